"""``stagecast convert``: a CausVid / Self-Forcing / StreamDiffusionV2 ``.pt`` file to a stagecast checkpoint folder.

Usage::

    stagecast convert self_forcing_dmd.pt --source self-forcing --base Wan2.1-T2V-1.3B-Diffusers --out sf
    stagecast up --checkpoint sf --stages 2 --device cuda --dtype bfloat16

    convert("model.pt", "out", source="causvid", base="Wan2.1-T2V-1.3B-Diffusers")   # -> ConvertReport

What those projects publish (read from their own save/load code):

- **CausVid** (``causvid/train_distillation.py`` ``save``): ``{"generator": ..., "critic": ...}``, the generator being
  ``CausalWanDiffusionWrapper.state_dict()``: original Wan names behind ``model.``
  (``model.blocks.0.self_attn.q.weight``).  ``minimal_inference/autoregressive_inference.py`` loads
  ``["generator"]``.  Sampler (``configs/wan_causal_dmd.yaml``): ``denoising_step_list [1000, 757, 522, 0]``,
  ``warp_denoising_step: false``.
- **Self-Forcing** (``trainer/distillation.py`` ``save``): ``{"generator", "critic", "generator_ema"}``; the EMA is
  ``EMA_FSDP.state_dict()`` (float32, ``model.``-prefixed names, FSDP / checkpoint / ``_orig_mod.`` wrappers possible:
  its ``rename_param`` strips them).  ``inference.py`` loads ``generator_ema`` with ``--use_ema``.  Sampler
  (``configs/self_forcing_dmd.yaml``): ``denoising_step_list [1000, 750, 500, 250]``, ``warp_denoising_step: true``,
  ``timestep_shift: 5.0``, ``num_frame_per_block: 3``.
- **StreamDiffusionV2** (``streamv2v/inference_common.py`` ``load_generator_state_dict``): ``model.pt`` holding
  ``generator`` / ``generator_ema`` / ``state_dict`` or a bare state dict, names with or without ``model.``.  Sampler
  (``configs/wan_causal_dmd_v2v.yaml``): ``denoising_step_list [700, 500, 400, 200, 0]``, no warp,
  ``num_frame_per_block: 1``.

A warped ladder (Self-Forcing) is written as its raw timesteps with the shift (``stagecast.sampling`` applies the same
``shift*s / (1 + (shift-1)*s)`` warp); an unwarped one (CausVid, StreamDiffusionV2) is already in model-timestep
space and gets shift 1.  ``--ladder`` / ``--shift`` override the source's values.

The file is read with ``torch.load(weights_only=True, mmap=True)``: a pickle holding anything but tensors and plain
containers is refused with the reason, never unpickled unsafely.  The transformer is written as safetensors shards
ordered by layer (the conditioning embedders, the patch embedding, one shard per block, the head), so a stage opens
only the shards of its own layers; the config is inferred from the tensor shapes and checked against the named
presets (``stagecast.model.dit_configs``).  Everything is written to a temporary folder beside ``--out`` and renamed
into place at the end, so a failed conversion leaves nothing behind.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import math
import os
import pickle
import shutil
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

from stagecast.flags import HelpFormatter
from stagecast.model import wan_keys
from stagecast.model.config import CONFIG_NAME, CheckpointError, read_vae_config
from stagecast.model.dit_configs import CONFIGS, WAN_ROPE_MAX_SEQ_LEN
from stagecast.names import DTYPES as NAMED_DTYPES

logger = logging.getLogger(__name__)

WEIGHTS_INDEX_NAME = "diffusion_pytorch_model.safetensors.index.json"
SERVING_FILE = "stagecast.json"
BASE_PARTS = ("vae", "text_encoder", "tokenizer")


@dataclass(frozen=True)
class Source:
    """How a project's published checkpoints are sampled (the entries they nest weights under: ``NESTING``)."""

    ladder: tuple[float, ...]  # raw denoising_step_list without the terminal 0
    shift: float  # 1.0 when the ladder is not warped
    chunk_frames: int  # num_frame_per_block
    cite: str


SOURCES: dict[str, Source] = {
    "causvid": Source(
        ladder=(1000.0, 757.0, 522.0),
        shift=1.0,
        chunk_frames=3,
        cite="tianweiy/CausVid configs/wan_causal_dmd.yaml, causvid/train_distillation.py",
    ),
    "self-forcing": Source(
        ladder=(1000.0, 750.0, 500.0, 250.0),
        shift=5.0,
        chunk_frames=3,
        cite="guandeh17/Self-Forcing configs/self_forcing_dmd.yaml, trainer/distillation.py",
    ),
    "streamdiffusionv2": Source(
        ladder=(700.0, 500.0, 400.0, 200.0),
        shift=1.0,
        chunk_frames=1,
        cite="chenfengxu714/StreamDiffusionV2 configs/wan_causal_dmd_v2v.yaml, streamv2v/inference_common.py",
    ),
}
# Every entry name a published file may nest its state dict under (others, e.g. "critic", are ignored).
NESTING = ("generator_ema", "generator", "state_dict", "model")


class ConvertError(ValueError):
    """A source file that cannot be converted; names the file (and the key where there is one)."""


@dataclass
class ConvertReport:
    out: Path
    entry: str | None  # the nested entry converted (None: a bare state dict)
    layout: str
    config: dict
    preset: str | None  # the named preset whose shapes the file matches
    preset_differences: list[str] = field(default_factory=list)
    shards: int = 0
    sampler: dict = field(default_factory=dict)


# --- reading ----------------------------------------------------------------------------------------------------


def load_source(path: str | Path) -> object:
    """``torch.load(weights_only=True, mmap=True)`` with the reasons it can fail said in the project's words."""
    path = Path(path)
    if not path.is_file():
        raise ConvertError(f"{path}: no such file")
    if not zipfile.is_zipfile(path):
        key = truncated_pt_key(path)
        if key is not None:
            raise ConvertError(f"{path}: truncated: the file ends before (or inside) the bytes of key {key!r}")
        raise ConvertError(
            f"{path}: not a torch.save zip archive (truncated, or written with the legacy serialization that "
            "cannot be memory-mapped); re-save it with torch.save(state_dict, path)"
        )
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()
        why = next(
            (line for line in first if "Unsupported global" in line or "GLOBAL" in line), first[0] if first else ""
        )
        raise ConvertError(
            f"{path}: holds Python objects other than tensors and plain containers ({why.strip()}); stagecast reads "
            "checkpoints only with torch.load(weights_only=True) and never unpickles arbitrary objects. Load it in "
            "the project that wrote it and save just the state dict: torch.save({k: v for k, v in sd.items()}, path)"
        ) from None
    except (RuntimeError, OSError, EOFError, ValueError) as exc:
        raise ConvertError(f"{path}: unreadable (truncated or corrupt?): {exc}") from None


def truncated_pt_key(path: str | Path) -> str | None:
    """For a ``torch.save`` archive cut short: the first state-dict key whose tensor bytes are missing, or None.

    The zip's directory is at its end, so a truncated file has none; the entries still lie in order behind their
    local headers: ``<name>/data.pkl`` (the pickle, naming each tensor's storage record) and then
    ``<name>/data/<storage>`` records.  The pickle's op stream is read (``pickletools.genops``, nothing is
    executed) to pair every key with its storage, and the first key whose record is absent or is the last one
    (the one the file ends in) is the answer."""
    import mmap
    import pickletools

    try:
        with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as data:
            headers: list[tuple[str, int]] = []  # (entry name, data start)
            pos = data.find(b"PK\x03\x04")
            while pos != -1 and pos + 30 <= len(data):
                name_len, extra_len = (
                    int.from_bytes(data[pos + 26 : pos + 28], "little"),
                    int.from_bytes(data[pos + 28 : pos + 30], "little"),
                )
                name = data[pos + 30 : pos + 30 + name_len].decode("utf-8", "replace")
                headers.append((name, pos + 30 + name_len + extra_len))
                pos = data.find(b"PK\x03\x04", pos + 30 + name_len)
            pkl = next((start for name, start in headers if name.endswith("/data.pkl")), None)
            if pkl is None:
                return None
            storage_of = _storage_keys(pickletools.genops(io.BytesIO(data[pkl:])))
    except (OSError, ValueError, EOFError, UnicodeDecodeError):
        return None
    records = {name.rsplit("/", 1)[1]: i for i, (name, _) in enumerate(headers) if "/data/" in name}
    last = len(headers) - 1
    for key, storage in storage_of:
        if storage not in records or records[storage] == last:
            return key
    return None


def _storage_keys(ops) -> list[tuple[str, str]]:
    """``(state-dict key, storage record)`` pairs, in pickle order, from a state dict's pickle ops (a key inside a
    nested entry reads ``"generator_ema: model.blocks.0..."``).

    A tensor is pickled as its key string, then ``_rebuild_tensor_v2`` whose persistent id is the tuple
    ``("storage", <storage class>, "<record>", "<location>", numel)``; strings reused through the memo are
    followed with it."""
    memo: dict[int, object] = {}
    last: object = None
    key: str | None = None
    pending_storage = False
    section = ""
    pairs: list[tuple[str, str]] = []
    next_memo = 0
    for op, arg, _ in ops:
        value: object = None
        if op.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE", "BINUNICODE8"):
            value = arg
        elif op.name in ("BINGET", "LONG_BINGET", "GET"):
            value = memo.get(arg)
        elif op.name in ("BINPUT", "LONG_BINPUT", "PUT"):
            memo[arg] = last
            continue
        elif op.name == "MEMOIZE":
            memo[next_memo] = last
            next_memo += 1
            continue
        elif op.name == "STOP":
            break
        elif op.name == "EMPTY_DICT" and isinstance(last, str):
            section = last  # a nested state dict's entry name ("generator", "generator_ema", ...)
        last = value
        if not isinstance(value, str):
            continue
        if value == "storage":
            pending_storage = True
        elif pending_storage and value.isdigit():
            if key is not None:
                pairs.append((f"{section}: {key}" if section else key, value))
            pending_storage = False
        elif not pending_storage and value not in ("cpu",) and not value.startswith("cuda"):
            key = value
    return pairs


def select_state_dict(obj: object, path: Path, *, ema: bool | None) -> tuple[str | None, Mapping[str, torch.Tensor]]:
    """The transformer's state dict inside a loaded file: ``generator_ema`` when present (``ema`` None), else
    ``generator`` ...; ``ema`` True demands the EMA, False refuses it."""
    if not isinstance(obj, Mapping):
        raise ConvertError(f"{path}: holds a {type(obj).__name__}, not a state dict")
    nested = [name for name in NESTING if isinstance(obj.get(name), Mapping)]
    if not nested:
        if ema:
            raise ConvertError(f"{path}: --ema asks for generator_ema but the file is a bare state dict")
        entry, sd = None, obj
    else:
        if ema is True:
            if "generator_ema" not in nested:
                raise ConvertError(f"{path}: --ema asks for generator_ema but the file holds only {nested}")
            entry = "generator_ema"
        elif ema is False:
            rest = [n for n in nested if n != "generator_ema"]
            if not rest:
                raise ConvertError(f"{path}: --no-ema but the file holds only generator_ema")
            entry = rest[0]
        else:
            entry = nested[0]
        sd = obj[entry]
    for key, value in sd.items():
        if not isinstance(key, str):
            raise ConvertError(f"{path}: key {key!r} in {entry or 'the state dict'} is not a string")
        if not isinstance(value, torch.Tensor):
            where = f"{entry}." if entry else ""
            raise ConvertError(f"{path}: key {where}{key!r} holds a {type(value).__name__}, not a tensor")
    return entry, sd


def to_diffusers_names(sd: Mapping[str, torch.Tensor], path: Path, entry: str | None) -> tuple[str, dict[str, str]]:
    """``(layout, diffusers name -> source key)``; a key no layout explains is an error naming the first ones."""
    where = f"{path} [{entry}]" if entry else str(path)
    keys = list(sd)
    try:
        layout = wan_keys.detect_layout(keys, source=where)
    except wan_keys.LayoutError as exc:
        unknown = [k for k in keys if not _known(k)][:5]
        raise ConvertError(f"{exc}; first unknown keys: {unknown}") from None
    names: dict[str, str] = {}
    unknown = []
    for key in keys:
        try:
            name = (
                wan_keys.original_to_diffusers(key)
                if layout == "original"
                else _checked_diffusers(wan_keys.strip_original_prefix(key))
            )
        except ValueError:
            unknown.append(key)
            continue
        if name in names:
            raise ConvertError(f"{where}: keys {names[name]!r} and {key!r} are the same tensor {name!r}")
        names[name] = key
    if unknown:
        raise ConvertError(
            f"{where}: {len(unknown)} keys match no known Wan transformer layout ({layout} detected); "
            f"first unknown keys: {unknown[:5]}"
        )
    return layout, names


def _checked_diffusers(name: str) -> str:
    wan_keys.diffusers_to_original(name)  # raises ValueError for a name outside the diffusers layout
    return name


def _known(key: str) -> bool:
    for fn in (wan_keys.original_to_diffusers, wan_keys.diffusers_to_original):
        try:
            fn(key)
            return True
        except ValueError:
            pass
    return False


# --- the config -------------------------------------------------------------------------------------------------


def infer_config(shapes: Mapping[str, tuple[int, ...]], where: str, *, num_heads: int | None = None):
    """``(config, preset, differences)``: ``WanTransformer3DModel`` kwargs from tensor shapes.

    Heads cannot be seen in the shapes (q/k norms span all heads); they come from ``num_heads`` or from the named
    preset with the same width.  ``preset`` is the preset matching every inferred value (or the one of that width),
    ``differences`` lists the values that differ from it."""

    def need(name: str) -> tuple[int, ...]:
        if name not in shapes:
            raise ConvertError(f"{where}: key {name!r} is missing; cannot infer the model config without it")
        return shapes[name]

    for name in shapes:
        if name.startswith("condition_embedder.image_embedder.") or ".attn2.add_" in name or ".norm_added" in name:
            raise ConvertError(
                f"{where}: key {name!r} belongs to an image-to-video model, which stagecast does not serve"
            )
    dim, in_channels, *patch = need("patch_embedding.weight")
    text_dim = need("condition_embedder.text_embedder.linear_1.weight")[1]
    freq_dim = need("condition_embedder.time_embedder.linear_1.weight")[1]
    blocks = sorted({int(n.split(".")[1]) for n in shapes if n.startswith("blocks.")})
    if not blocks or blocks != list(range(len(blocks))):
        raise ConvertError(f"{where}: blocks {blocks[:3]}...{blocks[-3:]} are not numbered 0..n-1")
    ffn_dim = need("blocks.0.ffn.net.0.proj.weight")[0]
    out_channels = need("proj_out.weight")[0] // math.prod(patch)
    config = dict(
        patch_size=tuple(patch),
        in_channels=in_channels,
        out_channels=out_channels,
        text_dim=text_dim,
        freq_dim=freq_dim,
        ffn_dim=ffn_dim,
        num_layers=len(blocks),
        cross_attn_norm="blocks.0.norm2.weight" in shapes,
        qk_norm="rms_norm_across_heads" if "blocks.0.attn1.norm_q.weight" in shapes else None,
        eps=1e-6,
        image_dim=None,
        added_kv_proj_dim=None,
        rope_max_seq_len=WAN_ROPE_MAX_SEQ_LEN,
        pos_embed_seq_len=None,
    )
    same_width = {n: c for n, c in CONFIGS.items() if c["num_attention_heads"] * c["attention_head_dim"] == dim}
    # The preset of this width that differs in the fewest values (exactly one, or no preset is named).
    ranked = sorted((sum(c.get(k) != v for k, v in config.items()), n) for n, c in same_width.items())
    preset = ranked[0][1] if ranked and (len(ranked) == 1 or ranked[0][0] < ranked[1][0]) else None
    if num_heads is None:
        heads = {c["num_attention_heads"] for c in same_width.values()}
        if len(heads) == 1:
            num_heads = heads.pop()  # every preset of this width agrees
        elif preset is None:
            raise ConvertError(
                f"{where}: width {dim} matches no named preset ({', '.join(sorted(CONFIGS))}); give --num-heads"
            )
        else:
            num_heads = CONFIGS[preset]["num_attention_heads"]
    if num_heads < 1 or dim % num_heads:
        raise ConvertError(f"{where}: width {dim} is not divisible by --num-heads {num_heads}")
    config = dict(config, num_attention_heads=num_heads, attention_head_dim=dim // num_heads)
    differences = []
    if preset is not None:
        ref = CONFIGS[preset]
        differences = [f"{k}={config[k]!r} (preset {ref[k]!r})" for k in sorted(config) if ref.get(k) != config[k]]
    return config, preset, differences


def check_shapes(config: dict, shapes: Mapping[str, tuple[int, ...]], names: Mapping[str, str], where: str) -> None:
    """Every tensor the model from ``config`` has, with its shape; nothing else."""
    from stage_service.checkpoint import model_shapes

    want = model_shapes(config)
    for name, shape in shapes.items():
        if name not in want:
            raise ConvertError(f"{where}: key {names[name]!r} ({name}) is not in the inferred model")
        if tuple(shape) != want[name]:
            raise ConvertError(
                f"{where}: key {names[name]!r} has shape {tuple(shape)}, the inferred model expects {want[name]}"
            )
    missing = [n for n in want if n not in shapes]
    if missing:
        raise ConvertError(f"{where}: the file lacks {len(missing)} tensors of the model, first {missing[:5]}")


# --- writing ----------------------------------------------------------------------------------------------------


def shard_groups(names: list[str], num_layers: int) -> list[tuple[str, list[str]]]:
    """Shards in layer order: the conditioning embedders (every stage), the patch embedding (stage 0), one shard per
    block, the head (the last stage)."""
    groups: dict[str, list[str]] = {"embedders": [], "patch": []}
    groups.update({f"block{i}": [] for i in range(num_layers)})
    groups["head"] = []
    for name in names:
        if name.startswith("blocks."):
            groups[f"block{int(name.split('.')[1])}"].append(name)
        elif name.startswith("patch_embedding."):
            groups["patch"].append(name)
        elif name.startswith("proj_out.") or name == "scale_shift_table":
            groups["head"].append(name)
        else:
            groups["embedders"].append(name)
    return [(g, sorted(ns)) for g, ns in groups.items() if ns]


def write_transformer(
    folder: Path, sd: Mapping[str, torch.Tensor], names: Mapping[str, str], config: dict, dtype: torch.dtype | None
) -> int:
    """Write the shards one at a time (only one shard's tensors in memory), the index and the config."""
    from diffusers import WanTransformer3DModel
    from diffusers import __version__ as diffusers_version

    from stage_service.checkpoint import load_dtype

    folder.mkdir(parents=True)
    groups = shard_groups(list(names), config["num_layers"])
    weight_map: dict[str, str] = {}
    total = 0
    for i, (_, group) in enumerate(groups, start=1):
        file = f"diffusion_pytorch_model-{i:05d}-of-{len(groups):05d}.safetensors"
        tensors = {}
        for name in group:
            t = sd[names[name]]
            tensors[name] = t.to(dtype=load_dtype(name, t.dtype, dtype)).contiguous().clone()
        save_file(tensors, str(folder / file), metadata={"format": "pt"})
        total += sum(t.nbytes for t in tensors.values())
        weight_map.update(dict.fromkeys(group, file))
        del tensors
    assert set(weight_map) == set(names)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / WEIGHTS_INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    config_json = {"_class_name": WanTransformer3DModel.__name__, "_diffusers_version": diffusers_version, **config}
    (folder / CONFIG_NAME).write_text(json.dumps(config_json, indent=2, default=list) + "\n")
    return len(groups)


def _link_or_copy(src: str, dst: str) -> str:
    try:
        os.link(src, dst)  # the base's weights can be tens of GB: share them when on the same file system
    except OSError:
        shutil.copy2(src, dst)
    return dst


def copy_base(base: Path, out: Path, config: dict) -> None:
    """``vae/``, ``text_encoder/`` and ``tokenizer/`` of a diffusers folder, checked against the transformer."""
    for part in BASE_PARTS:
        if not (base / part).is_dir():
            raise ConvertError(f"{base}: --base needs a diffusers folder with {', '.join(BASE_PARTS)}; no {part}/")
    try:
        vae = read_vae_config(base / "vae")
    except CheckpointError as exc:
        raise ConvertError(str(exc)) from None
    if vae["z_dim"] != config["in_channels"]:
        raise ConvertError(
            f"{base / 'vae' / CONFIG_NAME}: key 'z_dim' is {vae['z_dim']} but the transformer takes "
            f"{config['in_channels']} latent channels"
        )
    te_config = base / "text_encoder" / CONFIG_NAME
    try:
        d_model = json.loads(te_config.read_text())["d_model"]
    except (OSError, ValueError, KeyError) as exc:
        raise ConvertError(f"{te_config}: key 'd_model' unreadable: {exc!r}") from None
    if d_model != config["text_dim"]:
        raise ConvertError(
            f"{te_config}: key 'd_model' is {d_model} but the transformer takes text_dim {config['text_dim']}"
        )
    for part in BASE_PARTS:
        shutil.copytree(base / part, out / part, copy_function=_link_or_copy)


def sampler_section(source: Source, ladder: list[float] | None, shift: float | None) -> dict:
    """The ``sampler`` section of ``stagecast.json`` (``stagecast.sampling.SamplerConfig.from_json``'s format)."""
    return {
        "update": "x0",
        "shift": float(shift if shift is not None else source.shift),
        "ladder": [float(t) for t in (ladder or source.ladder)],
    }


def convert(src: str | Path, out: str | Path, **kwargs) -> ConvertReport:
    """Convert ``src`` into the new folder ``out`` (keyword arguments: see ``_convert``).

    A refused file raises ``ConvertError`` naming the file (and the key) with its traceback cut: the frames of the
    failed conversion, and the memory-mapped source tensors they held, are gone once it is raised."""
    try:
        return _convert(src, out, **kwargs)
    except (ConvertError, CheckpointError) as exc:
        error = exc
    raise strip_traceback(error)


def strip_traceback(error: BaseException) -> BaseException:
    """``error`` without its traceback and chained exceptions, whose frames would keep half-loaded tensors alive."""
    error.__traceback__ = None
    error.__context__ = None
    error.__cause__ = None
    return error


def _convert(
    src: str | Path,
    out: str | Path,
    *,
    source: str,
    base: str | Path | None = None,
    ema: bool | None = None,
    dtype: torch.dtype | None = None,
    num_heads: int | None = None,
    ladder: list[float] | None = None,
    shift: float | None = None,
) -> ConvertReport:
    src, out = Path(src), Path(out)
    if source not in SOURCES:
        raise ConvertError(f"--source {source!r}: one of {', '.join(SOURCES)}")
    spec = SOURCES[source]
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConvertError(f"{out}: already exists and is not empty; choose a new --out")
    obj = load_source(src)
    entry, sd = select_state_dict(obj, src, ema=ema)
    where = f"{src} [{entry}]" if entry else str(src)
    layout, names = to_diffusers_names(sd, src, entry)
    shapes = {name: tuple(sd[key].shape) for name, key in names.items()}
    config, preset, differences = infer_config(shapes, where, num_heads=num_heads)
    check_shapes(config, shapes, names, where)
    if preset is None:
        logger.warning("%s: no named preset has these shapes (config %s)", where, config)
    elif differences:
        logger.warning("%s: differs from preset %s in %s", where, preset, ", ".join(differences))
    else:
        logger.info("%s: matches preset %s", where, preset)
    sampler = sampler_section(spec, ladder, shift)
    _check_sampler(sampler, where)

    tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        tmp.mkdir(parents=True)
        shards = write_transformer(tmp / "transformer", sd, names, config, dtype)
        # Every source this converts is a guidance-distilled few-step model: guidance above 1 is refused.
        serving = {
            "steps": len(sampler["ladder"]),
            "chunk_frames": spec.chunk_frames,
            "sampler": sampler,
            "guidance_distilled": True,
        }
        (tmp / SERVING_FILE).write_text(json.dumps(serving, indent=2) + "\n")
        if base is not None:
            copy_base(Path(base), tmp, config)
        if out.exists():
            out.rmdir()  # empty, checked above
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ConvertReport(
        out=out,
        entry=entry,
        layout=layout,
        config=config,
        preset=preset,
        preset_differences=differences,
        shards=shards,
        sampler=sampler,
    )


def _check_sampler(sampler: dict, where: str) -> None:
    """The section must read back through the gateway's own reader (``--ladder`` / ``--shift`` are checked here)."""
    from stagecast.sampling import SamplerConfig, SamplerError

    try:
        SamplerConfig.from_json(sampler)
    except SamplerError as exc:
        raise ConvertError(f"{where}: {exc}") from None


# --- the command ------------------------------------------------------------------------------------------------

DTYPES = {"keep": None, **NAMED_DTYPES}  # "keep": as stored; the rest are the shared dtype table


def add_parser(sub) -> None:
    p = sub.add_parser(
        "convert",
        help="turn a CausVid / Self-Forcing / StreamDiffusionV2 .pt into a stagecast checkpoint folder",
        formatter_class=HelpFormatter,
    )
    p.add_argument("src", help="the published .pt file (e.g. self_forcing_dmd.pt, CausVid's model.pt)")
    p.add_argument("--out", required=True, help="new folder to write (transformer/, stagecast.json, base parts)")
    p.add_argument("--source", required=True, choices=sorted(SOURCES), help="the project that wrote the file")
    p.add_argument("--base", default=None, help="diffusers folder supplying vae/, text_encoder/, tokenizer/")
    p.add_argument(
        "--ema",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="convert generator_ema (--ema) or generator (--no-ema); default: generator_ema when present",
    )
    p.add_argument("--dtype", default="keep", choices=sorted(DTYPES), help="weights as written (keep: as stored)")
    p.add_argument("--num-heads", type=int, default=None, help="attention heads, when no named preset has this width")
    p.add_argument(
        "--ladder", default=None, help="override the source's timestep ladder, e.g. 1000,750,500,250 (no trailing 0)"
    )
    p.add_argument("--shift", type=float, default=None, help="override the source's timestep shift")
    p.set_defaults(run=main)


def main(args: argparse.Namespace) -> int:
    ladder = None
    if args.ladder:
        try:
            ladder = [float(x) for x in args.ladder.split(",")]
        except ValueError:
            print(f"stagecast convert: error: --ladder {args.ladder!r} must be comma-separated numbers", flush=True)
            return 2
    try:
        report = convert(
            args.src,
            args.out,
            source=args.source,
            base=args.base,
            ema=args.ema,
            dtype=DTYPES[args.dtype],
            num_heads=args.num_heads,
            ladder=ladder,
            shift=args.shift,
        )
    except (ConvertError, CheckpointError) as exc:
        print(f"stagecast convert: error: {exc}", flush=True)
        return 2
    preset = report.preset or "no named preset"
    if report.preset_differences:
        preset += f" (differs: {', '.join(report.preset_differences)})"
    print(
        f"wrote {report.out}: {report.config['num_layers']} layers in {report.shards} shards from "
        f"{report.entry or 'the state dict'} ({report.layout} keys), {preset}, sampler {report.sampler}",
        flush=True,
    )
    if not all((report.out / part).is_dir() for part in BASE_PARTS):
        print("no --base: add vae/, text_encoder/ and tokenizer/ from a diffusers folder before `stagecast up`")
    return 0
