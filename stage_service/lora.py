"""LoRA weights merged into a stage's slice at load: ``stagecast stage --lora style.safetensors:0.8`` (repeatable).

Usage::

    spec = parse_lora("style.safetensors:0.8")                    # LoraSpec(path, scale=0.8)
    config, sd = load_slice_state_dict(folder, layers=range(4, 8), first=False, last=False, loras=[spec])

Each LoRA file is a safetensors file in one of the published key formats:

- **diffusers** (``save_lora_weights``): ``transformer.blocks.0.attn1.to_q.lora_A.weight`` / ``lora_B.weight``
  (older diffusers: ``lora.down.weight`` / ``lora.up.weight``);
- **PEFT** (``get_peft_model_state_dict``): ``base_model.model.blocks.0.attn1.to_q.lora_A.weight``, the module in
  diffusers or in original Wan naming (``self_attn.q``), with or without PEFT's adapter name (``lora_A.default``);
- **kohya / musubi-tuner**: ``lora_unet_blocks_0_self_attn_q.lora_down.weight`` / ``lora_up.weight`` / ``alpha``;
- **original Wan / ComfyUI**: ``diffusion_model.blocks.0.self_attn.q.lora_down.weight`` (or ``lora_A``), optional
  ``alpha``.

A module's update is ``delta = (B @ A) * scale`` added to its weight, in the order the LoRAs are given.  This is
exactly what diffusers' ``load_lora_weights`` + ``fuse_lora(lora_scale=scale)`` computes (PEFT's ``merge``): where
the file carries ``alpha`` the factor ``alpha / rank`` is folded into A and B with diffusers' own power-of-two split
(``_convert_non_diffusers_wan_lora_to_diffusers``), and ``tests/test_lora.py`` holds a merged stage against
diffusers bit for bit.  The merge is done in the LoRA's dtype (float32 for float32 files) and the result cast to the
stage dtype once.

A stage reads only the names of a LoRA file and then the tensors of its own modules (its blocks, the conditioning
embedders every stage runs, the head on the last stage).  Keys no format explains, a module the model does not have,
LoRA on a non-linear module, an A without its B, or shapes that do not fit the weight are errors naming the file
and the key.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from stagecast.model import wan_keys
from stagecast.model.config import CheckpointError

logger = logging.getLogger(__name__)

MAX_LORAS = 16
MAX_SCALE = 100.0


@dataclass(frozen=True)
class LoraSpec:
    path: str
    scale: float = 1.0


def parse_lora(text: str) -> LoraSpec:
    """``PATH`` or ``PATH:SCALE`` (a path may itself hold ``:``; only a final ``:number`` is a scale)."""
    path, scale = text, 1.0
    head, sep, tail = text.rpartition(":")
    if sep and head:
        try:
            scale = float(tail)
        except ValueError:
            pass
        else:
            path = head
    if not path:
        raise ValueError(f"--lora {text!r}: no file named")
    if not (abs(scale) <= MAX_SCALE and scale == scale):
        raise ValueError(f"--lora {text!r}: scale must be a number in [-{MAX_SCALE:g}, {MAX_SCALE:g}]")
    if not Path(path).is_file():
        raise FileNotFoundError(f"--lora {text!r}: no such file {path}")
    return LoraSpec(path, scale)


# --- key formats ----------------------------------------------------------------------------------------------

# Leading prefixes of the formats (after which the module name is diffusers' or original Wan's).
_PREFIXES = ("transformer.", "base_model.model.", "unet.")
# (suffix, part): part A is the down projection (rank x in), B the up projection (out x rank).
_SUFFIXES = (
    (".lora_A.weight", "A"),
    (".lora_B.weight", "B"),
    (".lora_down.weight", "A"),
    (".lora_up.weight", "B"),
    (".lora.down.weight", "A"),
    (".lora.up.weight", "B"),
    (".alpha", "alpha"),
)
_PEFT_ADAPTER = re.compile(r"\.lora_([AB])\.[A-Za-z0-9_-]+\.weight$")  # lora_A.default.weight
_KOHYA_PREFIX = "lora_unet_"


def _kohya_table(model_keys: Iterable[str]) -> dict[str, str]:
    """``blocks_0_self_attn_q`` (and the diffusers spelling ``blocks_0_attn1_to_q``) -> diffusers module name."""
    table: dict[str, str] = {}
    for key in model_keys:
        if not key.endswith(".weight"):
            continue
        module = key[: -len(".weight")]
        table[module.replace(".", "_")] = module
        try:
            original = wan_keys.diffusers_to_original(key)[: -len(".weight")]
        except ValueError:
            continue
        table[original.replace(".", "_")] = module
    return table


def _split(key: str, kohya: dict[str, str]) -> tuple[str, str] | None:
    """A LoRA file key -> (diffusers module name, part) or None when no format explains it."""
    part = None
    m = _PEFT_ADAPTER.search(key)
    if m is not None:
        body, part = key[: m.start()], m.group(1)
    else:
        for suffix, p in _SUFFIXES:
            if key.endswith(suffix):
                body, part = key[: -len(suffix)], p
                break
    if part is None:
        return None
    if body.startswith(_KOHYA_PREFIX):
        module = kohya.get(body[len(_KOHYA_PREFIX) :])
        return None if module is None else (module, part)
    for prefix in _PREFIXES:
        if body.startswith(prefix):
            body = body[len(prefix) :]
            break
    name = body + ".weight"
    try:
        wan_keys.diffusers_to_original(name)  # a diffusers module name (any training prefix stripped)
        return wan_keys.strip_original_prefix(name)[: -len(".weight")], part
    except ValueError:
        pass
    try:
        return wan_keys.original_to_diffusers(name)[: -len(".weight")], part
    except ValueError:
        return None


@dataclass
class _Module:
    keys: dict[str, str]  # part -> key in the file


def index_lora(path: str | Path, model_shapes: Mapping[str, tuple[int, ...]]) -> dict[str, _Module]:
    """Names only: diffusers module name -> the file's keys for it.  Every key must be explained."""
    path = Path(path)
    kohya = _kohya_table(model_shapes)
    modules: dict[str, _Module] = {}
    try:
        with safe_open(str(path), framework="pt") as f:
            keys = list(f.keys())
    except Exception as exc:  # noqa: BLE001 - safetensors' error types differ between versions
        raise CheckpointError(path, None, f"not a readable safetensors LoRA file: {exc}") from None
    if not keys:
        raise CheckpointError(path, None, "holds no tensors")
    unknown = []
    for key in keys:
        split = _split(key, kohya)
        if split is None:
            unknown.append(key)
            continue
        module, part = split
        if module + ".weight" not in model_shapes:
            raise CheckpointError(path, key, f"LoRA for {module!r}, which the model does not have")
        entry = modules.setdefault(module, _Module({}))
        if part in entry.keys:
            raise CheckpointError(path, key, f"duplicate LoRA {part} for {module!r} (also {entry.keys[part]!r})")
        entry.keys[part] = key
    if unknown:
        raise CheckpointError(
            path,
            unknown[0],
            f"not a LoRA key in a known format (diffusers, PEFT, kohya, original Wan); unknown keys: {unknown[:5]}",
        )
    for module, entry in modules.items():
        if "A" not in entry.keys or "B" not in entry.keys:
            have = next(iter(entry.keys.values()))
            raise CheckpointError(path, have, f"LoRA for {module!r} lacks its {'B' if 'A' in entry.keys else 'A'}")
        if len(model_shapes[module + ".weight"]) != 2:
            raise CheckpointError(path, entry.keys["A"], f"LoRA on {module!r}, which is not a linear layer")
    return modules


def _alpha_scales(alpha: float, rank: int) -> tuple[float, float]:
    """diffusers' ``get_alpha_scales`` (lora_conversion_utils): alpha / rank split into a down and an up factor."""
    scale_down = alpha / rank
    scale_up = 1.0
    while scale_down * 2 < scale_up:
        scale_down *= 2
        scale_up /= 2
    return scale_down, scale_up


def _peft_alpha(path: Path, metadata: Mapping[str, str] | None) -> float | None:
    """``lora_alpha / r`` from the adapter metadata diffusers writes beside the tensors, if any."""
    if not metadata or "lora_adapter_metadata" not in metadata:
        return None
    try:
        meta = json.loads(metadata["lora_adapter_metadata"])
        alpha, rank = meta.get("lora_alpha"), meta.get("r")
    except (ValueError, AttributeError):
        raise CheckpointError(path, "lora_adapter_metadata", "unreadable adapter metadata") from None
    if meta.get("alpha_pattern") or meta.get("rank_pattern") or meta.get("use_rslora") or meta.get("use_dora"):
        raise CheckpointError(path, "lora_adapter_metadata", "alpha/rank patterns, rsLoRA and DoRA are not supported")
    if alpha is None or rank is None:
        return None
    return alpha / rank


def merge_loras(
    state_dict: dict[str, torch.Tensor],
    loras: Iterable[LoraSpec],
    *,
    model_shapes: Mapping[str, tuple[int, ...]],
) -> None:
    """Merge every LoRA into ``state_dict`` (a slice, full-model diffusers names, blocks NOT renumbered) in place.

    ``model_shapes`` are the whole model's (every stage checks every key's module exists); only the tensors of the
    modules whose weight is in ``state_dict`` are read.
    """
    for spec in loras:
        path = Path(spec.path)
        modules = index_lora(path, model_shapes)
        mine = {m: e for m, e in modules.items() if m + ".weight" in state_dict}
        with safe_open(str(path), framework="pt") as f:
            base = _peft_alpha(path, f.metadata())
            for module, entry in mine.items():
                weight = state_dict[module + ".weight"]
                a = f.get_tensor(entry.keys["A"])
                b = f.get_tensor(entry.keys["B"])
                rank = a.shape[0]
                if a.dim() != 2 or b.dim() != 2 or b.shape[1] != rank or (b.shape[0], a.shape[1]) != weight.shape:
                    raise CheckpointError(
                        path,
                        entry.keys["A"],
                        f"LoRA shapes A {tuple(a.shape)}, B {tuple(b.shape)} do not fit {module}.weight "
                        f"{tuple(weight.shape)}",
                    )
                if not a.is_floating_point() or not b.is_floating_point():
                    raise CheckpointError(path, entry.keys["A"], f"LoRA tensors must be floating point, not {a.dtype}")
                scaling = 1.0
                if "alpha" in entry.keys:
                    scale_down, scale_up = _alpha_scales(float(f.get_tensor(entry.keys["alpha"]).item()), rank)
                    a, b = a * scale_down, b * scale_up
                elif base is not None:
                    scaling = base
                if a.dtype in (torch.float16, torch.bfloat16):
                    a, b = a.float(), b.float()  # as PEFT does on CPU: half-precision LoRAs merge in float32
                a, b = a.to(weight.device), b.to(weight.device)
                # PEFT's merge (what fuse_lora runs): weight += (B @ A) * (lora_alpha / r * lora_scale).
                delta = (b @ a) * (scaling * spec.scale)
                state_dict[module + ".weight"] = (weight.to(delta.dtype) + delta).to(weight.dtype)
        logger.info("merged LoRA %s (scale %g) into %d modules of this slice", path, spec.scale, len(mine))
