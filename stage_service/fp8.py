"""``--fp8``: a stage's transformer-block linears as torchao float8 linears (dynamic activation, float8 weight).

Usage::

    names = fp8_linear_names(dit_slice)          # which linears would change (pure; no torchao needed)
    convert_to_fp8(dit_slice)                    # after loading, before CUDA graphs capture the blocks

What changes: every ``nn.Linear`` inside ``model.blocks`` (self-attention q/k/v/out, cross-attention q/k/v/out, the
FFN's two projections) whose in and out features are multiples of 16 (what float8 matmuls take).  What stays bf16:
the norms (``norm1/2/3``, ``norm_q/norm_k``), the modulation tables, the patch and text/time embeddings, the head,
and the attention math itself (RoPE, softmax(QK^T)V run on the bf16 outputs of the projections).

Scales are **rowwise** (torchao ``PerRow``): one scale per token of the activation and per output channel of the
weight.  torchao 0.17 supports two granularities for float8 dynamic-activation inference on compute capability 8.9+,
rowwise and tensorwise (``PerTensor``: one scale per tensor).  Rowwise is the choice because one outlier token or
channel then costs precision only in its own row, not in the whole tensor, for the price of a scale vector; the
matmul is ``torch._scaled_mm``'s rowwise path.  ``benchmarks/fp8_check.py`` measures tensorwise beside it, so the
choice can be revisited on numbers.  Activations are quantised by GPU ops at every forward, so ``GraphedBlocks``
captures the converted blocks as it does bf16 ones (``fp8_check`` reports a failed capture if one happens).  The
stage-level refusals are in ``stagecast/fp8.py``.
"""

from __future__ import annotations

import logging

from torch import nn

from stage_service.dit_slice import DiTSlice

logger = logging.getLogger(__name__)

ALIGN = 16  # float8 matmuls (torch._scaled_mm) need both matrix dimensions divisible by 16


def eligible(module: nn.Module) -> bool:
    """A linear float8 matmuls can take: both dimensions multiples of ``ALIGN``."""
    return isinstance(module, nn.Linear) and module.in_features % ALIGN == 0 and module.out_features % ALIGN == 0


def fp8_linear_names(dit_slice: DiTSlice) -> list[str]:
    """Qualified names (relative to ``dit_slice.model``) of the linears ``convert_to_fp8`` turns into float8:
    the eligible ``nn.Linear`` s of the transformer blocks, nothing outside them."""
    return [f"blocks.{name}" for name, module in dit_slice.model.blocks.named_modules() if name and eligible(module)]


def float8_config(granularity: str = "row"):
    """torchao's float8 dynamic-activation, float8-weight config with ``row`` (the stage's) or ``tensor`` scales."""
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, PerTensor

    if granularity not in ("row", "tensor"):
        raise ValueError(f"float8 granularity must be 'row' or 'tensor', got {granularity!r}")
    # set_inductor_config=False: the stage does not compile its blocks, and torchao must not change global settings.
    return Float8DynamicActivationFloat8WeightConfig(
        granularity=PerRow() if granularity == "row" else PerTensor(), set_inductor_config=False
    )


def convert_to_fp8(dit_slice: DiTSlice, granularity: str = "row") -> list[str]:
    """Turn the slice's block linears into float8 in place (``fp8_linear_names``); returns their names.
    Needs torchao and a GPU of compute capability 8.9+ (``stagecast.fp8.check_fp8`` refuses the rest earlier)."""
    from torchao.quantization import quantize_

    names = set(fp8_linear_names(dit_slice))
    kept = sorted(
        f"blocks.{name}"
        for name, module in dit_slice.model.blocks.named_modules()
        if isinstance(module, nn.Linear) and f"blocks.{name}" not in names
    )
    if kept:
        logger.warning("--fp8: %d block linears stay bf16 (dimensions not multiples of %d): %s", len(kept), ALIGN, kept)
    quantize_(dit_slice.model, float8_config(granularity), filter_fn=lambda module, fqn: fqn in names)
    logger.info("--fp8: %d block linears now float8 (%s-wise scales)", len(names), granularity)
    return sorted(names)


__all__ = ["ALIGN", "convert_to_fp8", "eligible", "float8_config", "fp8_linear_names"]
