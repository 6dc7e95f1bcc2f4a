"""Load only one pipeline stage's slice of a Wan transformer checkpoint.

A stage owning blocks ``[s:e)`` calls::

    config, sd = load_slice_state_dict(folder, layers=range(s, e), first=s == 0, last=e == n, dtype=torch.bfloat16)

and gets the diffusers ``config.json`` and a state dict in ``WanTransformer3DModel`` naming with the blocks
renumbered from 0 (``blocks.{i - s}``), ready for ``load_state_dict(sd, strict=False, assign=True)`` on a model
built on meta whose ``blocks`` were cut to ``[s:e)``.

The slice is ``blocks.{s..e-1}.*``, ``condition_embedder.*`` without the image embedder (every stage recomputes
the conditioning), ``patch_embedding.*`` if ``first`` and ``proj_out.*`` plus the top-level ``scale_shift_table``
if ``last``.  Only the safetensors files holding those keys are opened and only those keys are read, so a stage
never holds the full model.

A checkpoint folder holds ``config.json`` (diffusers, or a Wan-AI ``WanModel`` config) and either one
safetensors file (``diffusion_pytorch_model.safetensors``, or any single ``*.safetensors``) or shards listed in
``diffusion_pytorch_model.safetensors.index.json`` / ``model.safetensors.index.json``.  Keys may use the
diffusers or the original Wan / CausVid / Self-Forcing layout (see ``wan_keys``); original keys are renamed
on the fly.  The key names are checked against the config before any tensor is read; every problem raises a
``CheckpointError`` naming the file and the key.

Tests and the CPU demo write checkpoints in these layouts with ``launcher.demo_checkpoint.write_checkpoint``; a
``random:<model>`` stage draws its slice on its device instead (``random_slice_state_dict``).
"""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from diffusers import WanTransformer3DModel
from safetensors import safe_open

from stagecast.model import wan_keys
from stagecast.model.config import CONFIG_NAME, CheckpointError, read_config

if TYPE_CHECKING:
    from stage_service.lora import LoraSpec

logger = logging.getLogger(__name__)

WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
WEIGHTS_INDEX_NAME = "diffusion_pytorch_model.safetensors.index.json"
# Index names tried in order; the second is the transformers-style name some original-layout exports use.
INDEX_NAMES = (WEIGHTS_INDEX_NAME, "model.safetensors.index.json")
# Parameters of the I2V image embedder: no stage ever loads them (conditioning images are encoded elsewhere).
IMAGE_EMBEDDER_PREFIX = "condition_embedder.image_embedder."


@functools.lru_cache(maxsize=8)
def _model_shapes_cached(config_json: str) -> dict[str, tuple[int, ...]]:
    # Built on meta: real configs (14B) would otherwise allocate the whole model just to learn its shapes.
    with torch.device("meta"):
        model = WanTransformer3DModel.from_config(json.loads(config_json))
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def model_shapes(config: Mapping) -> dict[str, tuple[int, ...]]:
    """Shapes of every ``WanTransformer3DModel`` state-dict entry for ``config`` (no memory allocated)."""
    return dict(_model_shapes_cached(json.dumps(dict(config), sort_keys=True)))


def _slice_member(key: str, layers: range, first: bool, last: bool) -> bool | None:
    """Whether a full-model diffusers key belongs to the slice; None for a key no rule knows."""
    parts = key.split(".")
    if parts[0] == "blocks":
        # Parse the index: a string prefix "blocks.1" would also match blocks.10.
        return int(parts[1]) in layers
    if parts[0] == "condition_embedder":
        return not key.startswith(IMAGE_EMBEDDER_PREFIX)
    if parts[0] == "patch_embedding":
        return first
    if parts[0] == "proj_out" or key == "scale_shift_table":
        return last
    return None


def _check_layers(layers: range, num_layers: int, source: str | Path) -> None:
    if not isinstance(layers, range):
        raise TypeError(f"layers must be a range, got {type(layers).__name__}")
    if layers.step != 1 or not 0 <= layers.start <= layers.stop <= num_layers:
        raise CheckpointError(
            source,
            "num_layers",
            f"layers {layers} out of range for num_layers={num_layers} (need 0 <= start <= stop <= num_layers, step 1)",
        )


def slice_shapes(
    config: Mapping, *, layers: range, first: bool, last: bool, source: str | Path = CONFIG_NAME
) -> dict[str, tuple[int, ...]]:
    """Full-model diffusers names (blocks NOT renumbered) and shapes of the tensors a stage slice needs."""
    _check_layers(layers, config["num_layers"], source)
    out = {}
    for key, shape in model_shapes(config).items():
        member = _slice_member(key, layers, first, last)
        if member is None:
            # A config feature the slicer does not know how to assign to a stage (never silently drop weights).
            raise CheckpointError(source, key, "parameter that no pipeline stage is assigned to")
        if member:
            out[key] = shape
    return out


def load_dtype(key: str, stored: torch.dtype, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype a tensor stored as ``stored`` under diffusers name ``key`` is loaded as when a stage asks for ``dtype``
    (None: as stored); ``stagecast convert`` writes with the same rule."""
    if dtype is None or not stored.is_floating_point:
        return stored
    # Same rule as diffusers' from_pretrained(torch_dtype=...): these modules stay fp32 for accuracy.
    parts = key.split(".")
    if any(m in parts for m in WanTransformer3DModel._keep_in_fp32_modules):
        return torch.float32
    return dtype


def slice_parameter_bytes(
    config: Mapping, *, layers: range, first: bool, last: bool, dtype: torch.dtype = torch.float32
) -> int:
    """Bytes a stage slice occupies once loaded with ``dtype`` (fp32 modules counted as fp32)."""
    total = 0
    for key, shape in slice_shapes(config, layers=layers, first=first, last=last).items():
        itemsize = load_dtype(key, torch.float32, dtype).itemsize
        total += itemsize * torch.Size(shape).numel()
    return total


# --- locating tensors ---------------------------------------------------------------------------------------


@dataclass
class _Checkpoint:
    source: Path  # the index json, or the single safetensors file (named in errors about the whole checkpoint)
    files: dict[str, Path]  # stored key -> safetensors file
    layout: wan_keys.Layout


def _locate(folder: Path) -> _Checkpoint:
    for name in INDEX_NAMES:
        index_path = folder / name
        if index_path.is_file():
            return _from_index(index_path)
    single = folder / WEIGHTS_NAME
    if not single.is_file():
        # Wan-AI / ComfyUI exports name the single file freely; accept it when it is unambiguous.
        candidates = sorted(folder.glob("*.safetensors"))
        if not candidates:
            raise CheckpointError(folder, None, f"no {WEIGHTS_NAME}, index json or *.safetensors file")
        if len(candidates) > 1:
            names = ", ".join(p.name for p in candidates)
            raise CheckpointError(folder, None, f"several safetensors files ({names}) but no index json")
        single = candidates[0]
    with _open(single, None) as f:
        keys = list(f.keys())
    return _Checkpoint(single, dict.fromkeys(keys, single), _detect(keys, single))


def _open(path: Path, device: str | torch.device | None):
    """``safe_open`` with a ``CheckpointError`` naming the file, and the first tensor a truncated file cuts off."""
    try:
        return safe_open(str(path), framework="pt", device=str(device or "cpu"))
    except Exception as exc:  # safetensors' own error types differ between versions
        key, why = truncated_key(path)
        raise CheckpointError(path, key, f"not a readable safetensors file: {why or exc}") from None


def truncated_key(path: str | Path) -> tuple[str | None, str | None]:
    """For a safetensors file shorter than its header says: the first tensor whose bytes are missing, and why.

    ``(None, None)`` when the header cannot be parsed or the file is long enough (another problem)."""
    try:
        size = Path(path).stat().st_size
        with open(path, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            if n <= 0 or 8 + n > size or n > 100 * 2**20:
                return None, f"header of {n} bytes but the file holds {size} bytes: truncated or not safetensors"
            header = json.loads(fh.read(n))
        ends = sorted((info["data_offsets"][1], key) for key, info in header.items() if key != "__metadata__")
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return None, None
    for end, key in ends:
        if 8 + n + end > size:
            return key, f"truncated: the file ends at byte {size} but tensor {key!r} needs bytes up to {8 + n + end}"
    return None, None


def _from_index(index_path: Path) -> _Checkpoint:
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(index_path, "weight_map", f"unreadable index: {e!r}") from e
    if not isinstance(weight_map, dict):
        raise CheckpointError(index_path, "weight_map", "weight_map is not a JSON object")
    files: dict[str, Path] = {}
    exists: dict[str, bool] = {}
    for key, name in weight_map.items():
        if name not in exists:
            exists[name] = (index_path.parent / name).is_file()
        if not exists[name]:
            # Checked for every shard, not just the slice's: a partial download must fail on every stage alike.
            raise CheckpointError(index_path, key, f"index references missing shard file {name!r}")
        files[key] = index_path.parent / name
    return _Checkpoint(index_path, files, _detect(files, index_path))


def _detect(keys, source: Path) -> wan_keys.Layout:
    try:
        return wan_keys.detect_layout(keys, source=str(source))
    except wan_keys.LayoutError as e:
        raise CheckpointError(source, e.key, str(e)) from e


def _diffusers_names(ckpt: _Checkpoint) -> dict[str, str]:
    """Diffusers name -> stored key, for every tensor of the checkpoint (names only)."""
    names: dict[str, str] = {}
    for stored, path in ckpt.files.items():
        if ckpt.layout == "diffusers":
            name = wan_keys.strip_original_prefix(stored)
        else:
            try:
                name = wan_keys.original_to_diffusers(stored)
            except ValueError as e:
                raise CheckpointError(path, stored, str(e)) from e
        if name in names:
            raise CheckpointError(path, stored, f"duplicate of {names[name]!r} (both are {name!r})")
        names[name] = stored
    return names


def _check_names(ckpt: _Checkpoint, names: dict[str, str], config: Mapping, config_path: Path) -> None:
    """The checkpoint's key names must be exactly the config's model (image embedder aside)."""
    shapes = model_shapes(config)
    num_layers = config["num_layers"]
    for name, stored in names.items():
        if name in shapes or name.startswith(IMAGE_EMBEDDER_PREFIX):
            continue
        parts = name.split(".")
        if parts[0] == "blocks" and len(parts) > 1 and parts[1].isdigit() and int(parts[1]) >= num_layers:
            why = f"checkpoint has block {parts[1]} but {config_path} says num_layers={num_layers}"
        else:
            why = f"tensor {name!r} is not in WanTransformer3DModel built from {config_path}"
        raise CheckpointError(ckpt.files[stored], stored, f"config disagrees with checkpoint: {why}")
    for name in shapes:
        if name not in names and not name.startswith(IMAGE_EMBEDDER_PREFIX):
            stored = name if ckpt.layout == "diffusers" else wan_keys.diffusers_to_original(name)
            raise CheckpointError(ckpt.source, stored, f"missing tensor (the model from {config_path} needs {name!r})")


# --- loading ------------------------------------------------------------------------------------------------


def load_slice_state_dict(folder: str | Path, **kwargs) -> tuple[dict, dict[str, torch.Tensor]]:
    """Read one stage's tensors (keyword arguments: see ``_load_slice_state_dict``).

    A ``CheckpointError`` is raised with its traceback cut, so the frames of the failed load (and any tensor they
    held) are gone once the caller has the error: nothing half-loaded stays behind."""
    try:
        return _load_slice_state_dict(folder, **kwargs)
    except CheckpointError as exc:
        error = exc
    error.__traceback__ = error.__context__ = error.__cause__ = None
    raise error


def _load_slice_state_dict(
    folder: str | Path,
    *,
    layers: range,
    first: bool,
    last: bool,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    loras: Sequence[LoraSpec] = (),
) -> tuple[dict, dict[str, torch.Tensor]]:
    """Read one stage's tensors: ``(config, state_dict)`` in diffusers naming, blocks renumbered from 0.

    ``dtype`` None keeps the stored dtypes; otherwise tensors are cast to it except diffusers'
    ``_keep_in_fp32_modules``, which become fp32 (bit-exact with ``from_pretrained(torch_dtype=dtype)``).
    Files are read in parallel threads.  ``loras`` (``stage_service.lora``) are merged into the slice's weights,
    reading only the LoRA tensors of the slice's modules.  On any error nothing read so far is kept.
    """
    folder = Path(folder)
    config_path = folder / CONFIG_NAME
    config = read_config(folder)
    wanted = slice_shapes(config, layers=layers, first=first, last=last, source=config_path)
    ckpt = _locate(folder)
    names = _diffusers_names(ckpt)
    _check_names(ckpt, names, config, config_path)

    by_file: dict[Path, list[str]] = {}
    for name in wanted:
        by_file.setdefault(ckpt.files[names[name]], []).append(name)

    start = time.perf_counter()
    loaded: dict[str, torch.Tensor] = {}
    try:
        # With LoRAs the stored precision is kept until they are merged, then each tensor is cast once.
        _read_files(by_file, names, wanted, ckpt, config_path, None if loras else dtype, device, loaded)
        if loras:
            from stage_service.lora import merge_loras

            merge_loras(loaded, loras, model_shapes=model_shapes(config))
            for name, tensor in loaded.items():
                loaded[name] = tensor.to(load_dtype(name, tensor.dtype, dtype))
        state_dict = {_renumber(name, layers.start): loaded[name] for name in wanted}
    except BaseException:
        # Nothing half-loaded stays behind: the traceback keeps this frame alive, so drop the tensors explicitly.
        loaded.clear()
        raise
    logger.info(
        "loaded %d tensors (%.1f MiB) for layers [%d:%d) first=%s last=%s from %d of %d files in %s in %.2fs%s",
        len(state_dict),
        sum(t.nbytes for t in state_dict.values()) / 2**20,
        layers.start,
        layers.stop,
        first,
        last,
        len(by_file),
        len(set(ckpt.files.values())),
        folder,
        time.perf_counter() - start,
        f" with {len(loras)} LoRA(s) merged" if loras else "",
    )
    return config, state_dict


# Shards are read by this many threads at once (safetensors releases the GIL while copying).
READ_THREADS = 8


def _read_files(
    by_file: dict[Path, list[str]],
    names: dict[str, str],
    wanted: dict[str, tuple[int, ...]],
    ckpt: _Checkpoint,
    config_path: Path,
    dtype: torch.dtype | None,
    device: str | torch.device,
    out: dict[str, torch.Tensor],
) -> None:
    """Read every file's tensors into ``out``, one thread per file (at most ``READ_THREADS``); the first error wins."""

    def read(path: Path, file_names: list[str]) -> dict[str, torch.Tensor]:
        got: dict[str, torch.Tensor] = {}
        key = names[file_names[0]]
        try:
            with _open(path, device) as f:
                present = set(f.keys())
                # Every name and shape is checked from the header before any tensor of this file is read.
                for name in file_names:
                    key = names[name]
                    if key not in present:
                        raise CheckpointError(path, key, f"{ckpt.source.name} maps this key here but the file lacks it")
                    shape = tuple(f.get_slice(key).get_shape())
                    if shape != wanted[name]:
                        raise CheckpointError(
                            path, key, f"shape {shape} but the model from {config_path} expects {wanted[name]}"
                        )
                for name in file_names:
                    key = names[name]
                    tensor = f.get_tensor(key)
                    # copy=True always: CPU tensors from safe_open are unaligned mmap views (5e-7 output differences).
                    got[name] = tensor.to(dtype=load_dtype(name, tensor.dtype, dtype), copy=True)
                    del tensor
        except CheckpointError:
            got.clear()
            raise
        except Exception as exc:  # a truncated or corrupt file: safetensors' own error, with the file and key named
            got.clear()
            raise CheckpointError(path, key, f"cannot read the tensor (truncated or corrupt file?): {exc}") from None
        return got

    if len(by_file) <= 1:
        for path, file_names in by_file.items():
            out.update(read(path, file_names))
        return
    with ThreadPoolExecutor(max_workers=min(READ_THREADS, len(by_file)), thread_name_prefix="shard-read") as pool:
        futures = [pool.submit(read, path, file_names) for path, file_names in by_file.items()]
        error: BaseException | None = None
        for future in futures:
            try:
                part = future.result()
            except BaseException as exc:  # noqa: BLE001 - re-raised below, after every reader has finished
                error = error or exc
                continue
            if error is None:
                out.update(part)
            part = None
        futures.clear()
    if error is not None:
        raise error


def _renumber(name: str, start: int) -> str:
    parts = name.split(".")
    if parts[0] != "blocks":
        return name
    parts[1] = str(int(parts[1]) - start)
    return ".".join(parts)


# --- random weights (benchmarks: ``--checkpoint random:<model>`` or ``random:<folder>``) -------------------------


def random_slice_state_dict(
    config: Mapping,
    *,
    layers: range,
    first: bool,
    last: bool,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """Random weights for a slice, in the same naming and dtypes ``load_slice_state_dict`` returns.

    Benchmarks run the real architectures with random weights (throughput does not depend on the values),
    so each stage makes its own slice on its device instead of reading tens of GB from disk.  Values are
    scaled like an initialised model (std 0.02; norms at 1) so activations stay finite in bf16.
    """
    device = torch.device(device)
    # Generate on the target device: a 14B slice is tens of GB, far too slow to draw on the CPU.
    gen = torch.Generator(device=device).manual_seed(seed * 7919 + layers.start)
    out = {}
    for key, shape in slice_shapes(config, layers=layers, first=first, last=last).items():
        target = load_dtype(key, torch.float32, dtype)
        if ".norm" in key and key.endswith(".weight"):
            t = torch.ones(shape, dtype=target, device=device)
        else:
            t = torch.randn(shape, generator=gen, device=device, dtype=target) * 0.02
        out[_renumber(key, layers.start)] = t
    return out
