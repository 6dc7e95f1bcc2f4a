"""Opt-in levers on a stage's transformer blocks, for speed at the cost of exactness (``--dit-levers``).

Usage::

    levers = parse_levers("fp8,fused,cudnn")     # Levers: the names in LEVERS order and fused's form (ValueError)
    apply_levers(dit_slice, levers)              # after loading and LoRA merges, before CUDA graphs capture the blocks
    warm_levers(dit_slice, 1, 60, 104, 512)      # fused: compile at the serving shape before calibrating

None of them is on by default: the default path stays bit for bit the single-process reference's.  Each changes the
numbers a little, so each is a named option whose error against bf16 ``benchmarks/dit_levers.py`` reports (the
latents after one step) beside its time at batch 1, 4, 8 and 12:

- ``fp8``: every transformer-block linear whose dimensions are multiples of 16 runs as ``torch._scaled_mm`` on
  float8 e4m3 operands with **rowwise** scales (one per activation row, one per weight output channel), bf16 out.
  Weights are quantised once here; activations at every forward (an amax per row, a divide, a cast).  No torchao:
  the GPU image's torch has what it needs.
- ``fused``: the work between the GEMMs (the modulation and layer norms, the gated residuals, the q/k RMS norms with
  RoPE, the FFN's GELU, and with ``fp8`` the activations' quantisation) runs as a few ``torch.compile`` d kernels per
  block instead of dozens of eager ones; the compiled kernels sit inside the blocks' CUDA graphs like any other.
  On a CPU the same functions run uncompiled, and there they equal diffusers' ops bit for bit
  (``tests/test_dit_levers.py``): on a GPU the compiled kernels keep intermediates in float32, hence the error.
- ``cudnn``: the slice's scaled-dot-product attention runs cuDNN's kernel (``DiTSlice.attention_backends``): on a
  GPU each SDPA call runs cuDNN's op itself, and a call it refuses runs on torch's choice among flash,
  memory-efficient and math (``dit_slice.SDPA_CALLS`` counts which ran; the stage logs them after its calibration).
  On an H200 with torch 2.11 this changes nothing: a kernel profile shows torch's own choice for the blocks' calls
  is already cuDNN's kernel (``benchmarks/results/dit_profile_1gpu_4aea243.log``).  The lever matters where torch
  would pick another kernel.  At start-up the stage checks that cuDNN takes the blocks' own calls
  (``cudnn_refusal``) and logs torch's reasons where it does not.

This module is pure computation, like ``stage_service.dit_slice``: it swaps modules and forwards on a built slice.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from stage_service.dit_slice import AttentionContext, DiTSlice, apply_rotary_emb

LEVERS = ("fp8", "fused", "cudnn")
# ``cudnn``: the slice's SDPA backends: cuDNN alone, else torch's choice among the rest (``dit_slice._sdpa_on``).
CUDNN_FIRST = ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH")
FP8_MAX = 448.0  # the largest finite float8 e4m3fn
ALIGN = 16  # torch._scaled_mm needs both matrix dimensions divisible by 16
MIN_SCALE = 1e-12  # an all-zero row still gets a finite scale

# How ``Kernels`` compiles the fused functions (``Levers.fused_form``; ``benchmarks/dit_levers.py`` times
# each as variant ``fused@FORM``):
# - ``dynamic``: ``dynamic=True``: one compile for every batch and token count, every dimension symbolic (the
#   channels too: looped reductions and runtime index math);
# - ``rows``: ``dynamic=False`` with every dimension but the last marked dynamic at each call (``rows_dynamic``): one
#   compile for every batch above 1 and every token count, with the channels static;
# - ``static``: ``dynamic=False``: one compile per shape (the blocks' graphs are captured per batch size anyway).
# One H200 (619ccb5, ``dit_levers_1gpu_619ccb5.json``): rows 16.75-16.99 ms per stream-chunk at batch 4-12, static
# the same, dynamic 18.01-18.25, at the same error against bf16.  Served beside --tiny-cuda-graphs, fused@rows held
# 8, 9 and 8 streams in three ramps (r24-r28), where dynamic without the tiny graphs held 8 (r23).
FUSED_FORMS = ("dynamic", "rows", "static")
DEFAULT_FUSED_FORM = "rows"
# The forms a stage may run (``--dit-levers fused@FORM``): ``static`` compiles once per batch size, which serving meets
# inside its graphs' captures and calibration; the benchmark times it.
SERVING_FORMS = ("dynamic", "rows")


@dataclass(frozen=True)
class Levers:
    """``--dit-levers`` parsed: the lever names in ``LEVERS`` order, and how ``fused`` compiles (``fused@FORM``; a
    bare ``fused`` is ``DEFAULT_FUSED_FORM``).  ``"fused" in levers`` asks for a lever by name."""

    names: tuple[str, ...] = ()
    fused_form: str = DEFAULT_FUSED_FORM

    def __contains__(self, name: object) -> bool:
        return name in self.names

    def __iter__(self):
        return iter(self.names)

    def __bool__(self) -> bool:
        return bool(self.names)

    def __str__(self) -> str:
        form = f"@{self.fused_form}" if self.fused_form != DEFAULT_FUSED_FORM else ""
        return ",".join(n + form if n == "fused" else n for n in self.names)


def parse_levers(text: str | Sequence[str] | Levers) -> Levers:
    """``--dit-levers``: comma-separated names from ``LEVERS`` (empty: none), ``fused`` optionally as ``fused@FORM``
    with FORM one of ``SERVING_FORMS``; a ValueError naming ``--dit-levers`` for anything else."""
    if isinstance(text, Levers):
        return text
    entries = [n.strip() for n in (text.split(",") if isinstance(text, str) else text) if n.strip()]
    names, form = set(), DEFAULT_FUSED_FORM
    bad = []
    for entry in entries:
        name, at, given = entry.partition("@")
        if name not in LEVERS:
            bad.append(entry)
            continue
        if at:
            if name != "fused" or given not in SERVING_FORMS:
                raise ValueError(
                    f"--dit-levers: {entry!r}: only fused takes a compile form, one of "
                    f"{', '.join('fused@' + f for f in SERVING_FORMS)}"
                )
            form = given
        names.add(name)
    if bad:
        raise ValueError(f"--dit-levers: unknown lever(s) {', '.join(bad)}; choose from {', '.join(LEVERS)}")
    return Levers(tuple(n for n in LEVERS if n in names), form)


# ---- float8 rowwise linears -------------------------------------------------------------------------------------


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, K) -> (float8 e4m3 (M, K), float32 scales (M, 1)) with ``x ~= q * scale`` row by row."""
    scale = (x.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp_min(MIN_SCALE)
    q = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


class Fp8Linear(nn.Module):
    """An ``nn.Linear`` whose weight is float8 e4m3 with one scale per output channel; activations are quantised per
    row at each call and multiplied by ``torch._scaled_mm`` (fast accumulation), bf16 out.  ``quantize`` may be
    swapped for a compiled copy (the ``fused`` lever); ``forward_quantized`` takes an input quantised already."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        if linear.in_features % ALIGN or linear.out_features % ALIGN:
            raise ValueError(f"Fp8Linear: {linear.in_features}x{linear.out_features} is not a multiple of {ALIGN}")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        q, scale = quantize_rows(linear.weight.detach())
        self.register_buffer("weight_t", q.t(), persistent=False)  # (K, N) column-major, what _scaled_mm takes
        self.register_buffer("weight_scale", scale.reshape(1, -1).contiguous(), persistent=False)  # (1, N)
        bias = linear.bias.detach().to(torch.bfloat16) if linear.bias is not None else None
        self.register_buffer("bias", bias, persistent=False)
        self.quantize: Callable = quantize_rows

    def forward_quantized(self, q: torch.Tensor, scale: torch.Tensor, lead: Sequence[int]) -> torch.Tensor:
        out = torch._scaled_mm(
            q,
            self.weight_t,
            scale_a=scale,
            scale_b=self.weight_scale,
            bias=self.bias,
            out_dtype=torch.bfloat16,
            use_fast_accum=True,
        )
        return out.reshape(*lead, self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, scale = self.quantize(x.reshape(-1, self.in_features))
        return self.forward_quantized(q, scale, x.shape[:-1])

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, float8 e4m3 rowwise"


def to_fp8(dit_slice: DiTSlice) -> list[str]:
    """Every eligible ``nn.Linear`` of the slice's blocks becomes an ``Fp8Linear`` in place; returns their names."""
    names = []
    for block_name, block in dit_slice.model.blocks.named_children():
        for name, module in list(block.named_modules()):
            if isinstance(module, nn.Linear) and not module.in_features % ALIGN and not module.out_features % ALIGN:
                parent_name, _, child = name.rpartition(".")
                parent = block.get_submodule(parent_name) if parent_name else block
                setattr(parent, child, Fp8Linear(module))
                names.append(f"blocks.{block_name}.{name}")
    return names


# ---- the work between the GEMMs, as functions torch.compile fuses ----------------------------------------------
# Each mirrors diffusers' WanTransformerBlock / WanAttnProcessor op for op, so uncompiled (a CPU) it gives the same
# bits, and compiled (a GPU) one kernel where eager launches several.


def mod_norm(h: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """``norm1`` / ``norm3`` (FP32LayerNorm without affine) with the block's modulation."""
    return (F.layer_norm(h.float(), (h.shape[-1],), eps=eps) * (1 + scale) + shift).type_as(h)


def gate_residual(h: torch.Tensor, out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    return (h.float() + out * gate).type_as(h)


def affine_norm(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """``norm2`` (FP32LayerNorm with affine, ``cross_attn_norm``)."""
    return F.layer_norm(h.float(), (h.shape[-1],), weight.float(), bias.float(), eps).type_as(h)


def add_mod_norm(h, out, shift, scale, eps: float):
    """The cross-attention residual and ``norm3`` with its modulation: (new residual, FFN input)."""
    h = h + out
    return h, mod_norm(h, shift, scale, eps)


def qk_norm_rope(q, k, q_weight, k_weight, eps: float, heads: int, cos, sin):
    """``norm_q`` / ``norm_k`` (RMSNorm across heads), the head split and RoPE, for q and k at once."""
    q = F.rms_norm(q, (q.shape[-1],), q_weight, eps).unflatten(2, (heads, -1))
    k = F.rms_norm(k, (k.shape[-1],), k_weight, eps).unflatten(2, (heads, -1))
    return apply_rotary_emb(q, cos, sin), apply_rotary_emb(k, cos, sin)


def rms_heads(q: torch.Tensor, weight: torch.Tensor, eps: float, heads: int) -> torch.Tensor:
    """The cross-attention's ``norm_q`` and head split."""
    return F.rms_norm(q, (q.shape[-1],), weight, eps).unflatten(2, (heads, -1))


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def quantized(fn: Callable) -> Callable:
    """``fn`` followed by the rowwise quantisation of its (last) output, flattened to rows: one compiled kernel."""

    @functools.wraps(fn)
    def wrapper(*args):
        out = fn(*args)
        x = out[-1] if isinstance(out, tuple) else out
        q, scale = quantize_rows(x.reshape(-1, x.shape[-1]))
        return (*out[:-1], q, scale) if isinstance(out, tuple) else (q, scale)

    return wrapper


def rows_dynamic(fn: Callable) -> Callable:
    """``fn`` with every tensor argument's dimensions but the last marked dynamic (where larger than 1): one compile
    for every batch and token count, as ``dynamic=True`` gives, with the channels (the reductions' length, the
    index math's strides) left static, as ``dynamic=False`` gives.  Dimensions of size 1 stay static (torch
    specializes them), so batch 1 compiles apart."""

    @functools.wraps(fn)
    def call(*args):
        for t in args:
            if isinstance(t, torch.Tensor):
                for d in range(t.ndim - 1):
                    if t.shape[d] > 1:
                        torch._dynamo.mark_dynamic(t, d)
        return fn(*args)

    return call


def check_fused_form(form: str) -> str:
    """``form`` if it is one of ``FUSED_FORMS``; else ValueError naming them."""
    if form not in FUSED_FORMS:
        raise ValueError(f"fused form: one of {', '.join(FUSED_FORMS)}, got {form!r}")
    return form


def compile_form(fn: Callable, form: str, backend="inductor") -> Callable:
    """``fn`` compiled as ``form`` (one of ``FUSED_FORMS``) with ``fullgraph=True`` (``backend``: torch.compile's)."""
    if check_fused_form(form) == "rows":
        return rows_dynamic(torch.compile(fn, fullgraph=True, dynamic=False, backend=backend))
    return torch.compile(fn, fullgraph=True, dynamic=form == "dynamic", backend=backend)


class Kernels:
    """The fused lever's functions, compiled on a GPU (``torch.compile`` as ``form``, one of ``FUSED_FORMS``).  One
    instance per process and setting (``kernels``): slices that share it share the compiled code."""

    def __init__(self, compile: bool, form: str = DEFAULT_FUSED_FORM):
        check_fused_form(form)  # also where nothing compiles (a CPU)
        if compile:  # a function is compiled once static and once dynamic per wrapper; ``quantized`` shares a frame
            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
            torch._dynamo.config.accumulated_cache_size_limit = max(
                torch._dynamo.config.accumulated_cache_size_limit, 512
            )

        def wrap(fn):
            return compile_form(fn, form) if compile else fn

        self.mod_norm, self.gate_residual, self.affine_norm = wrap(mod_norm), wrap(gate_residual), wrap(affine_norm)
        self.add_mod_norm, self.qk_norm_rope, self.gelu = wrap(add_mod_norm), wrap(qk_norm_rope), wrap(gelu_tanh)
        self.quantize, self.rms_heads = wrap(quantize_rows), wrap(rms_heads)
        self.quantize_3d = wrap(lambda h: quantize_rows(h.reshape(-1, h.shape[-1])))
        self.mod_norm_q, self.affine_norm_q = wrap(quantized(mod_norm)), wrap(quantized(affine_norm))
        self.add_mod_norm_q, self.gelu_q = wrap(quantized(add_mod_norm)), wrap(quantized(gelu_tanh))


@functools.cache
def kernels(compile: bool, form: str = DEFAULT_FUSED_FORM) -> Kernels:
    return Kernels(compile, form)


class FusedBlock:
    """``WanTransformerBlock.forward`` with the non-GEMM work through ``Kernels``: what a block's ``forward`` becomes
    under the ``fused`` lever.  The attention itself (KV window reads and writes, grouped SDPA) is the slice's."""

    def __init__(self, dit_slice: DiTSlice, block: nn.Module, layer: int, kernels: Kernels):
        self.slice, self.block, self.layer, self.k = dit_slice, block, layer, kernels
        self.eps = block.norm1.eps
        self.fp8 = isinstance(block.attn1.to_q, Fp8Linear)

    def _normed(self, plain: Callable, with_quant: Callable, *args):
        """``plain(*args)`` or, with fp8 linears, its output quantised in the same kernel (as (q, scale, shape))."""
        if not self.fp8:
            return plain(*args)
        q, scale = with_quant(*args)
        return q, scale, args[0].shape[:-1]

    @staticmethod
    def _linear(linear: nn.Module, x):
        return linear.forward_quantized(*x) if isinstance(x, tuple) else linear(x)

    def __call__(self, hidden, encoder_hidden_states, temb, rotary_emb):
        b = self.block
        if temb.ndim == 4:  # per-token modulation (Wan2.2 TI2V): diffusers' own forward
            return type(b).forward(b, hidden, encoder_hidden_states, temb, rotary_emb)
        shift, scale, gate, c_shift, c_scale, c_gate = (b.scale_shift_table + temb.float()).chunk(6, dim=1)
        x = self._normed(self.k.mod_norm, self.k.mod_norm_q, hidden, shift, scale, self.eps)
        hidden = self.k.gate_residual(hidden, self._self_attention(x, hidden.dtype), gate)
        if isinstance(b.norm2, nn.LayerNorm):
            args = (hidden, b.norm2.weight, b.norm2.bias, b.norm2.eps)
            x = self._normed(self.k.affine_norm, self.k.affine_norm_q, *args)
        else:
            x = self._normed(lambda h: h, self.k.quantize_3d, hidden) if self.fp8 else hidden
        cross = self._cross_attention(x, hidden.dtype)
        if self.fp8:
            hidden, q, qs = self.k.add_mod_norm_q(hidden, cross, c_shift, c_scale, self.eps)
            x = (q, qs, hidden.shape[:-1])
        else:
            hidden, x = self.k.add_mod_norm(hidden, cross, c_shift, c_scale, self.eps)
        ff = self._ffn(x, hidden.shape[:-1])
        return self.k.gate_residual(hidden, ff.float(), c_gate)

    def _self_attention(self, x, dtype):
        attn = self.block.attn1
        q, k, v = (self._linear(lin, x) for lin in (attn.to_q, attn.to_k, attn.to_v))
        ctx = self.slice.current_context()
        if ctx.sp.size > 1:
            raise RuntimeError("--dit-levers fused: not with sequence parallelism (--sp) yet")
        q, k = self.k.qk_norm_rope(
            q, k, attn.norm_q.weight, attn.norm_k.weight, attn.norm_q.eps, attn.heads, *ctx.rotary
        )
        out = self.slice.self_attend(self.layer, q, k, v.unflatten(2, (attn.heads, -1)), ctx)
        return self._out(attn, out.flatten(2, 3).to(dtype))

    def _cross_attention(self, x, dtype):
        attn = self.block.attn2
        q = self._linear(attn.to_q, x)
        q = self.k.rms_heads(q, attn.norm_q.weight, attn.norm_q.eps, attn.heads)
        out = self.slice.cross_attend(self.layer, q, self.slice.current_context())
        return self._out(attn, out.flatten(2, 3).to(dtype))

    @staticmethod
    def _out(attn, out):
        return attn.to_out[1](attn.to_out[0](out))

    def _ffn(self, x, lead):
        net = self.block.ffn.net
        up, down = net[0].proj, net[2]
        if self.fp8:
            q, scale = self.k.gelu_q(self._linear(up, x))
            return down.forward_quantized(q, scale, lead)
        if isinstance(up, nn.Linear) and up.bias is not None and x.is_cuda:
            # cuBLASLt's GELU epilogue (tanh approximation): the activation never makes its own pass over memory.
            hidden = torch._addmm_activation(up.bias, x.reshape(-1, x.shape[-1]), up.weight.t(), use_gelu=True)
            return down(hidden.reshape(*lead, -1))
        return down(self.k.gelu(up(x)))


@torch.no_grad()
def warm_levers(dit_slice: DiTSlice, frames: int, height: int, width: int, text_len: int) -> None:
    """Forwards of the blocks at batch 1 and 2 of the serving shape (latent ``frames x height x width``), so that the
    ``fused`` lever's kernels are compiled before the stage calibrates and captures its graphs: compiled while
    calibrating, they took its whole budget at batch 1 (one H200, 2026-12-03)."""
    for batch in (1, 2):
        _serving_forward(dit_slice, batch, frames, height, width, text_len)


def _serving_forward(dit_slice: DiTSlice, batch: int, frames: int, height: int, width: int, text_len: int) -> None:
    """One forward of the blocks at the serving shape: zero latents and text, no KV window."""
    tokens = frames * dit_slice.tokens_per_frame(height, width)
    text = torch.zeros(1, text_len, dit_slice.config["text_dim"], device=dit_slice.device, dtype=dit_slice.dtype)
    cross = dit_slice.cross_kv(dit_slice.embed_text(text))
    hidden = torch.zeros(batch, tokens, dit_slice.inner_dim, device=dit_slice.device, dtype=dit_slice.dtype)
    cond = dit_slice.condition(torch.full((batch,), 500.0, device=dit_slice.device), tokens=tokens)
    rotary = dit_slice.rotary(frames, height, width, [0] * batch)
    dit_slice.run_blocks(hidden, cond, AttentionContext(rotary=rotary, cross_kv=[cross] * batch))


@torch.no_grad()
def cudnn_refusal(dit_slice: DiTSlice, frames: int, height: int, width: int, text_len: int) -> str | None:
    """Whether cuDNN's SDPA takes the blocks' own attention calls: one forward at the serving shape (batch 1, no
    window) with cuDNN as the only backend.  None when it ran; else why not, in torch's words (the reasons it warns
    of for each backend it rules out, else its error).  ``cudnn`` falls back to the next backend where cuDNN
    refuses, so without this the lever would change nothing and say nothing."""
    saved = dit_slice.attention_backends
    dit_slice.attention_backends = ("CUDNN_ATTENTION",)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                _serving_forward(dit_slice, 1, frames, height, width, text_len)
            except RuntimeError as exc:
                reasons = list(dict.fromkeys(str(w.message).strip() for w in caught))[:10]
                return "; ".join(reasons) or str(exc).splitlines()[0]
        return None
    finally:
        dit_slice.attention_backends = saved


def apply_levers(
    dit_slice: DiTSlice,
    levers: Sequence[str] | Levers,
    *,
    compile: bool | None = None,
) -> dict:
    """Turn ``levers`` (``parse_levers``' input or result; a ``Levers`` built directly may name any of
    ``FUSED_FORMS``, as the benchmark does) on for ``dit_slice`` in place; returns what changed.  ``compile``: whether
    ``fused`` compiles its kernels (default: on a GPU)."""
    levers = parse_levers(levers)
    done: dict = {"levers": list(levers)}
    if "fp8" in levers:
        done["fp8_linears"] = len(to_fp8(dit_slice))
    if "fused" in levers:
        shared = kernels(dit_slice.device.type == "cuda" if compile is None else compile, levers.fused_form)
        for layer, block in enumerate(dit_slice.model.blocks):
            block.forward = FusedBlock(dit_slice, block, layer, shared)
        for module in dit_slice.model.blocks.modules():
            if isinstance(module, Fp8Linear):
                module.quantize = shared.quantize
        done["fused_blocks"] = len(dit_slice.model.blocks)
        done["fused_form"] = levers.fused_form
    if "cudnn" in levers:
        dit_slice.attention_backends = CUDNN_FIRST
        done["sdpa"] = ", ".join(CUDNN_FIRST)
    return done


__all__ = [
    "LEVERS",
    "Levers",
    "Fp8Linear",
    "FusedBlock",
    "Kernels",
    "CUDNN_FIRST",
    "FUSED_FORMS",
    "SERVING_FORMS",
    "apply_levers",
    "cudnn_refusal",
    "parse_levers",
    "quantize_rows",
    "to_fp8",
    "warm_levers",
]
