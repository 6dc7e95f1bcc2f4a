"""Key and config names of the original Wan checkpoints versus diffusers' ``WanTransformer3DModel``.

Wan-AI releases, CausVid and Self-Forcing store the transformer under the original Wan names
(``blocks.0.self_attn.q.weight``, ``head.modulation``, ...), sometimes behind a ``model.`` or
``model.diffusion_model.`` prefix; diffusers checkpoints use ``WanTransformer3DModel`` names
(``blocks.0.attn1.to_q.weight``, ``scale_shift_table``, ...).  The two layouts hold the same tensors with the
same shapes, so converting is a pure rename.  The stage loader renames one key at a time, before any tensor is
read, which is why this module works per key instead of on a whole state dict::

    layout = detect_layout(weight_map, source="model.safetensors.index.json")
    name = original_to_diffusers("model.diffusion_model.blocks.3.norm3.weight")  # "blocks.3.norm2.weight"
    key = diffusers_to_original("proj_out.bias")  # "head.head.bias"

The mapping is diffusers' own ``convert_wan_transformer_to_diffusers`` (``TRANSFORMER_KEYS_RENAME_DICT``)
restricted to the text-to-video keys plus the I2V cross-attention/image-embedding keys, written as exact
module-name tables so it can be inverted; ``tests/test_checkpoint.py`` pins it against that function.
VACE, Animate (face adapter, motion encoder) and other extensions are not supported and raise ``ValueError``.

``original_config_to_diffusers`` / ``diffusers_config_to_original`` convert the ``config.json`` of a Wan-AI
release (``dim``, ``num_heads``, ``in_dim``, ...) to and from ``WanTransformer3DModel`` keyword arguments.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from typing import Literal

from stagecast.model.dit_configs import WAN_ROPE_MAX_SEQ_LEN

logger = logging.getLogger(__name__)

Layout = Literal["diffusers", "original"]

# Leading prefixes that training and export code put in front of the transformer's own names, stripped in any
# order and repeatedly: ``module.`` (DistributedDataParallel), ``generator.model.`` (a whole CausVid / Self-Forcing
# distillation model's state dict), ``model.`` (their ``WanDiffusionWrapper.model``), ``model.diffusion_model.``
# (ComfyUI exports), ``diffusion_model.``.  Checked longest first: "model.diffusion_model." also starts with "model.".
ORIGINAL_PREFIXES = ("generator.model.", "model.diffusion_model.", "diffusion_model.", "module.", "model.")
# Wrapper modules that appear anywhere inside a name: ``_orig_mod.`` from ``torch.compile``, and FSDP's and activation
# checkpointing's wrappers (Self-Forcing strips the same three in ``trainer/distillation.py``'s ``rename_param``).
WRAPPER_SEGMENTS = ("_orig_mod.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")

# Module renames outside the blocks: original module -> diffusers module; the leaf (weight/bias) is kept.
_TOP_MODULES = {
    "patch_embedding": "patch_embedding",
    "text_embedding.0": "condition_embedder.text_embedder.linear_1",
    "text_embedding.2": "condition_embedder.text_embedder.linear_2",
    "time_embedding.0": "condition_embedder.time_embedder.linear_1",
    "time_embedding.2": "condition_embedder.time_embedder.linear_2",
    "time_projection.1": "condition_embedder.time_proj",
    "head.head": "proj_out",
    # I2V image embedding (never loaded by stages, but renamed so such checkpoints are recognised).
    "img_emb.proj.0": "condition_embedder.image_embedder.norm1",
    "img_emb.proj.1": "condition_embedder.image_embedder.ff.net.0.proj",
    "img_emb.proj.3": "condition_embedder.image_embedder.ff.net.2",
    "img_emb.proj.4": "condition_embedder.image_embedder.norm2",
}
# Bare parameters outside the blocks: the head's modulation is diffusers' top-level scale_shift_table.
_TOP_PARAMS = {"head.modulation": "scale_shift_table"}

# Module renames inside ``blocks.{i}.``.
_BLOCK_MODULES = {
    "self_attn.q": "attn1.to_q",
    "self_attn.k": "attn1.to_k",
    "self_attn.v": "attn1.to_v",
    "self_attn.o": "attn1.to_out.0",
    "self_attn.norm_q": "attn1.norm_q",
    "self_attn.norm_k": "attn1.norm_k",
    "cross_attn.q": "attn2.to_q",
    "cross_attn.k": "attn2.to_k",
    "cross_attn.v": "attn2.to_v",
    "cross_attn.o": "attn2.to_out.0",
    "cross_attn.norm_q": "attn2.norm_q",
    "cross_attn.norm_k": "attn2.norm_k",
    "cross_attn.k_img": "attn2.add_k_proj",
    "cross_attn.v_img": "attn2.add_v_proj",
    "cross_attn.norm_k_img": "attn2.norm_added_k",
    # Original Wan calls the (affine) cross-attention norm norm3 and the FFN norm norm2; diffusers swaps them.
    "norm3": "norm2",
    "norm2": "norm3",
    "ffn.0": "ffn.net.0.proj",
    "ffn.2": "ffn.net.2",
}
_BLOCK_PARAMS = {"modulation": "scale_shift_table"}

_BLOCK_RE = re.compile(r"blocks\.(\d+)\.(.+)")


class LayoutError(ValueError):
    """Keys that are neither (or a mix of) the diffusers and the original Wan layout; ``key`` is an example."""

    def __init__(self, message: str, key: str | None):
        super().__init__(message)
        self.key = key


def _invert(table: dict[str, str]) -> dict[str, str]:
    inverse = {v: k for k, v in table.items()}
    assert len(inverse) == len(table), "rename table is not one-to-one"
    return inverse


_TOP_MODULES_INV = _invert(_TOP_MODULES)
_TOP_PARAMS_INV = _invert(_TOP_PARAMS)
_BLOCK_MODULES_INV = _invert(_BLOCK_MODULES)
_BLOCK_PARAMS_INV = _invert(_BLOCK_PARAMS)


def _rename(name: str, modules: dict[str, str], params: dict[str, str]) -> str | None:
    if name in params:
        return params[name]
    module, _, leaf = name.rpartition(".")
    if module in modules and leaf in ("weight", "bias"):
        return f"{modules[module]}.{leaf}"
    return None


def _convert(key: str, top: tuple[dict, dict], block: tuple[dict, dict]) -> str | None:
    m = _BLOCK_RE.fullmatch(key)
    if m is not None:
        inner = _rename(m.group(2), *block)
        return None if inner is None else f"blocks.{int(m.group(1))}.{inner}"
    return _rename(key, *top)


def strip_original_prefix(key: str) -> str:
    """The transformer's own name inside ``key``: wrapper segments (``_orig_mod.``, FSDP's) removed wherever they
    are, then leading ``module.``, ``generator.model.``, ``model.``, ``model.diffusion_model.`` prefixes dropped
    (CausVid / Self-Forcing / StreamDiffusionV2 / ComfyUI exports, DDP and ``torch.compile`` wrappers)."""
    if "_" in key:
        for segment in WRAPPER_SEGMENTS:
            if segment in key:
                key = key.replace(segment, "")
    stripped = True
    while stripped:
        stripped = False
        for prefix in ORIGINAL_PREFIXES:
            if key.startswith(prefix):
                key = key[len(prefix) :]
                stripped = True
                break
    return key


def original_to_diffusers(key: str) -> str:
    """Rename one original-layout Wan key (optionally prefixed) to its ``WanTransformer3DModel`` name.

    Raises ``ValueError`` for a key that is not part of a text-to-video (or I2V) Wan transformer.
    """
    name = _convert(strip_original_prefix(key), (_TOP_MODULES, _TOP_PARAMS), (_BLOCK_MODULES, _BLOCK_PARAMS))
    if name is None:
        raise ValueError(f"not an original-layout Wan transformer key: {key!r}")
    return name


def diffusers_to_original(key: str, *, prefix: str = "") -> str:
    """Rename one ``WanTransformer3DModel`` key (optionally prefixed, see ``strip_original_prefix``) to the original
    Wan name, with an optional ``prefix`` in front."""
    name = _convert(
        strip_original_prefix(key), (_TOP_MODULES_INV, _TOP_PARAMS_INV), (_BLOCK_MODULES_INV, _BLOCK_PARAMS_INV)
    )
    if name is None:
        raise ValueError(f"not a diffusers WanTransformer3DModel key: {key!r}")
    return prefix + name


def _is_original(key: str) -> bool:
    try:
        original_to_diffusers(key)
    except ValueError:
        return False
    return True


def _is_diffusers(key: str) -> bool:
    try:
        diffusers_to_original(key)
    except ValueError:
        return False
    return True


def detect_layout(keys: Iterable[str], *, source: str | None = None) -> Layout:
    """Return ``"diffusers"`` or ``"original"`` for a checkpoint's keys (names only, no tensors).

    Keys valid in both layouts (``patch_embedding.*``, ``blocks.i.norm2.*``) do not decide.  ``source`` (the
    file the keys came from) is named in the ``LayoutError`` (a ``ValueError``) raised for an unknown or mixed layout.
    """
    where = f" in {source}" if source else ""
    keys = list(keys)
    if not keys:
        raise LayoutError(f"no tensor keys{where}: cannot detect the checkpoint layout", None)
    diffusers_only = original_only = unknown = None
    for key in keys:
        is_d, is_o = _is_diffusers(key), _is_original(key)
        if is_d and not is_o and diffusers_only is None:
            diffusers_only = key
        elif is_o and not is_d and original_only is None:
            original_only = key
        elif not is_d and not is_o and unknown is None:
            unknown = key
    if diffusers_only is not None and original_only is not None:
        raise LayoutError(
            f"mixed checkpoint key layout{where}: {diffusers_only!r} is a diffusers key but {original_only!r} "
            "is an original Wan key",
            original_only,
        )
    if diffusers_only is None and original_only is None:
        example = unknown if unknown is not None else keys[0]
        raise LayoutError(
            f"unknown checkpoint key layout{where}: key {example!r} is neither a diffusers WanTransformer3DModel "
            "key (e.g. 'blocks.0.attn1.to_q.weight') nor an original Wan key (e.g. 'blocks.0.self_attn.q.weight')",
            example,
        )
    return "diffusers" if diffusers_only is not None else "original"


# --- config.json -------------------------------------------------------------------------------------------

# WanTransformer3DModel kwargs that the original text-to-video WanModel config cannot express; they must hold
# these values for a Wan-AI style config to describe the model.
_T2V_FIXED = dict(image_dim=None, added_kv_proj_dim=None, rope_max_seq_len=WAN_ROPE_MAX_SEQ_LEN, pos_embed_seq_len=None)


def is_original_config(config: dict) -> bool:
    """A Wan-AI release ``config.json`` (``WanModel``: ``dim``, ``num_heads``) rather than a diffusers one."""
    return "dim" in config and "num_heads" in config and "num_attention_heads" not in config


def original_config_to_diffusers(config: dict) -> dict:
    """Convert a Wan-AI ``WanModel`` config (t2v / ti2v) to ``WanTransformer3DModel`` keyword arguments."""
    model_type = config.get("model_type", "t2v")
    if model_type not in ("t2v", "ti2v"):
        raise ValueError(f"original Wan config model_type {model_type!r} is not supported (only t2v, ti2v)")
    try:
        dim, heads, ffn_dim, num_layers = config["dim"], config["num_heads"], config["ffn_dim"], config["num_layers"]
    except KeyError as e:
        raise ValueError(f"original Wan config lacks {e.args[0]!r}") from None
    if dim % heads:
        raise ValueError(f"original Wan config: dim={dim} is not divisible by num_heads={heads}")
    if tuple(config.get("window_size", (-1, -1))) != (-1, -1):
        raise ValueError("original Wan config: windowed attention (window_size) is not supported by diffusers")
    return dict(
        patch_size=tuple(config.get("patch_size", (1, 2, 2))),
        num_attention_heads=heads,
        attention_head_dim=dim // heads,
        in_channels=config.get("in_dim", 16),
        out_channels=config.get("out_dim", 16),
        text_dim=config.get("text_dim", 4096),
        freq_dim=config.get("freq_dim", 256),
        ffn_dim=ffn_dim,
        num_layers=num_layers,
        cross_attn_norm=config.get("cross_attn_norm", True),
        # Original Wan's qk norm is one RMSNorm over all heads (WanRMSNorm(dim)).
        qk_norm="rms_norm_across_heads" if config.get("qk_norm", True) else None,
        eps=config.get("eps", 1e-6),
        **_T2V_FIXED,
    )


def diffusers_config_to_original(config: dict) -> dict:
    """Inverse of ``original_config_to_diffusers``; raises ``ValueError`` for configs it cannot express."""
    for key, value in _T2V_FIXED.items():
        if config.get(key, value) != value:
            raise ValueError(f"{key}={config[key]!r} cannot be written as an original Wan t2v config")
    qk_norm = config.get("qk_norm", "rms_norm_across_heads")
    if qk_norm not in ("rms_norm_across_heads", None):
        raise ValueError(f"qk_norm={qk_norm!r} cannot be written as an original Wan config")
    in_dim = config.get("in_channels", 16)
    return {
        "_class_name": "WanModel",
        "model_type": "ti2v" if in_dim == 48 else "t2v",
        "patch_size": list(config.get("patch_size", (1, 2, 2))),
        "dim": config["num_attention_heads"] * config["attention_head_dim"],
        "num_heads": config["num_attention_heads"],
        "in_dim": in_dim,
        "out_dim": config.get("out_channels") or in_dim,  # diffusers: out_channels=None means in_channels
        "text_dim": config.get("text_dim", 4096),
        "freq_dim": config.get("freq_dim", 256),
        "ffn_dim": config["ffn_dim"],
        "num_layers": config["num_layers"],
        "cross_attn_norm": config.get("cross_attn_norm", True),
        "qk_norm": qk_norm is not None,
        "eps": config.get("eps", 1e-6),
        "text_len": 512,
    }
