"""Specification of the stage checkpoint loader (stage_service.checkpoint) and Wan key mapping (wan_keys).

Tiny random Wan transformers are written to tmp_path with ``write_checkpoint`` and read back slice by slice; a
slice must hold exactly its tensors, bit-identical to the full model's, read from only the files that hold them.
"""

from __future__ import annotations

import gc
import json
import threading
from pathlib import Path

import pytest
import safetensors
import torch
from diffusers import WanTransformer3DModel
from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers
from safetensors.torch import save_file

from launcher.demo_checkpoint import write_checkpoint
from stage_service import checkpoint
from stage_service.checkpoint import (
    CheckpointError,
    load_slice_state_dict,
    read_config,
    slice_parameter_bytes,
)
from stagecast.model.dit_configs import CONFIGS, model_config
from stagecast.model.wan_keys import (
    detect_layout,
    diffusers_config_to_original,
    diffusers_to_original,
    original_config_to_diffusers,
    original_to_diffusers,
)

pytestmark = pytest.mark.unit

TINY = ["tiny-wan2.1", "tiny-wan2.2-ti2v"]
SINGLE = "diffusion_pytorch_model.safetensors"
INDEX = "diffusion_pytorch_model.safetensors.index.json"
SMALL_SHARDS = 4096  # bytes: the tiny models then span ~50 shards, most holding one or two tensors

_MODELS: dict[str, tuple[dict, dict[str, torch.Tensor]]] = {}


def full_model(name: str, **overrides) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config, state_dict) of a seeded random tiny model, built once per config."""
    cache_key = name + repr(sorted(overrides.items()))
    if cache_key not in _MODELS:
        cfg = model_config(name, **overrides)
        torch.manual_seed(0)
        _MODELS[cache_key] = cfg, WanTransformer3DModel(**cfg).state_dict()
    return _MODELS[cache_key]


def expected_slice(full: dict[str, torch.Tensor], layers: range, first: bool, last: bool) -> dict[str, torch.Tensor]:
    """The slice contract, written out independently of the loader (keys renumbered from layers.start)."""
    out = {}
    for key, tensor in full.items():
        head, _, rest = key.partition(".")
        if head == "blocks":
            index, _, rest = rest.partition(".")
            if int(index) in layers:
                out[f"blocks.{int(index) - layers.start}.{rest}"] = tensor
        elif head == "condition_embedder" and not rest.startswith("image_embedder."):
            out[key] = tensor
        elif head == "patch_embedding" and first:
            out[key] = tensor
        elif (head == "proj_out" or key == "scale_shift_table") and last:
            out[key] = tensor
    return out


def full_names(expected: dict[str, torch.Tensor], layers: range) -> set[str]:
    """Undo the renumbering: the full-model diffusers names of a slice."""
    names = set()
    for key in expected:
        parts = key.split(".")
        if parts[0] == "blocks":
            parts[1] = str(int(parts[1]) + layers.start)
        names.add(".".join(parts))
    return names


def assert_same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for key in want:
        assert got[key].dtype == want[key].dtype, key
        assert torch.equal(got[key], want[key]), key


class RecordingSafeOpen:
    """Stands in for safetensors.safe_open: records which files are opened and which keys are read."""

    def __init__(self):
        self.opened: list[str] = []
        self.requested: list[tuple[str, str]] = []
        self.bytes_read = 0
        self.lock = threading.Lock()  # shards are read by several threads at once

    def __call__(self, path, *args, **kwargs):
        with self.lock:
            self.opened.append(Path(path).name)
        return _RecordingHandle(self, Path(path).name, safetensors.safe_open(path, *args, **kwargs))


class _RecordingHandle:
    def __init__(self, recorder: RecordingSafeOpen, name: str, handle):
        self._recorder, self._name, self._handle = recorder, name, handle

    def __enter__(self):
        self._handle.__enter__()
        return self

    def __exit__(self, *exc):
        return self._handle.__exit__(*exc)

    def keys(self):
        return self._handle.keys()

    def metadata(self):
        return self._handle.metadata()

    def get_slice(self, key):  # header only: the shape, no tensor bytes
        return self._handle.get_slice(key)

    def get_tensor(self, key):
        tensor = self._handle.get_tensor(key)
        with self._recorder.lock:
            self._recorder.requested.append((self._name, key))
            self._recorder.bytes_read += tensor.nbytes
        return tensor


# --- key mapping ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "original, diffusers",
    [
        ("blocks.0.self_attn.q.weight", "blocks.0.attn1.to_q.weight"),
        ("blocks.0.self_attn.o.bias", "blocks.0.attn1.to_out.0.bias"),
        ("blocks.7.cross_attn.norm_k.weight", "blocks.7.attn2.norm_k.weight"),
        ("blocks.0.modulation", "blocks.0.scale_shift_table"),
        ("blocks.0.norm3.weight", "blocks.0.norm2.weight"),  # original norm3 is the affine cross-attn norm
        ("blocks.12.ffn.0.bias", "blocks.12.ffn.net.0.proj.bias"),
        ("blocks.12.ffn.2.weight", "blocks.12.ffn.net.2.weight"),
        ("time_embedding.0.weight", "condition_embedder.time_embedder.linear_1.weight"),
        ("time_projection.1.bias", "condition_embedder.time_proj.bias"),
        ("text_embedding.2.weight", "condition_embedder.text_embedder.linear_2.weight"),
        ("head.head.weight", "proj_out.weight"),
        ("head.modulation", "scale_shift_table"),
        ("patch_embedding.weight", "patch_embedding.weight"),
        ("blocks.0.cross_attn.k_img.weight", "blocks.0.attn2.add_k_proj.weight"),
        ("img_emb.proj.1.weight", "condition_embedder.image_embedder.ff.net.0.proj.weight"),
    ],
)
def test_key_renames_both_ways(original, diffusers):
    assert original_to_diffusers(original) == diffusers
    assert original_to_diffusers("model.diffusion_model." + original) == diffusers
    assert original_to_diffusers("model." + original) == diffusers
    assert diffusers_to_original(diffusers) == original
    assert diffusers_to_original(diffusers, prefix="model.diffusion_model.") == "model.diffusion_model." + original


@pytest.mark.parametrize("key", ["vace_blocks.0.before_proj.weight", "blocks.0.attn1.to_q.weight", "foo.bar"])
def test_unsupported_original_keys_raise(key):
    with pytest.raises(ValueError, match="original-layout"):
        original_to_diffusers(key)


@pytest.mark.parametrize("name", TINY + ["tiny-i2v"])
@pytest.mark.parametrize("prefix", ["", "model.diffusion_model."])
def test_per_key_mapping_agrees_with_diffusers_converter(name, prefix):
    """original_to_diffusers(k) renames every key exactly as convert_wan_transformer_to_diffusers does."""
    if name == "tiny-i2v":  # I2V adds image embedder and added k/v keys; built on meta, names only
        cfg = model_config("tiny-wan2.1", image_dim=16, added_kv_proj_dim=24)
    else:
        cfg = model_config(name)
    model_keys = list(checkpoint.model_shapes(cfg))
    originals = [diffusers_to_original(k, prefix=prefix) for k in model_keys]
    # Tag each tensor with its position so the converter's output can be matched back key by key.
    converted = convert_wan_transformer_to_diffusers({k: torch.tensor(i) for i, k in enumerate(originals)})
    by_tag = {int(v): k for k, v in converted.items()}
    for i, original in enumerate(originals):
        assert original_to_diffusers(original) == by_tag[i] == model_keys[i]


def test_detect_layout():
    assert detect_layout(["patch_embedding.weight", "blocks.0.attn1.to_q.weight"]) == "diffusers"
    assert detect_layout(["patch_embedding.weight", "model.blocks.0.self_attn.q.weight"]) == "original"
    with pytest.raises(ValueError, match=r"unknown checkpoint key layout in some/file\.safetensors.*'foo\.bar'"):
        detect_layout(["foo.bar"], source="some/file.safetensors")
    with pytest.raises(ValueError, match="mixed"):
        detect_layout(["blocks.0.attn1.to_q.weight", "blocks.0.self_attn.q.weight"], source="x")
    # Keys valid in both layouts cannot decide.
    with pytest.raises(ValueError, match="unknown"):
        detect_layout(["patch_embedding.weight", "blocks.0.norm2.weight"], source="x")


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_original_config_round_trip(name):
    cfg = model_config(name)
    assert original_config_to_diffusers(diffusers_config_to_original(cfg)) == cfg


# --- slicing ------------------------------------------------------------------------------------------------

PARTITIONS = [
    [(0, 4)],
    [(0, 1), (1, 4)],
    [(0, 3), (3, 4)],
    [(0, 2), (2, 4)],
    [(0, 1), (1, 2), (2, 4)],
    [(0, 1), (1, 2), (2, 3), (3, 4)],
]


@pytest.mark.parametrize("name", TINY)
@pytest.mark.parametrize("partition", PARTITIONS, ids=lambda p: "|".join(f"{s}:{e}" for s, e in p))
def test_every_partition_loads_exactly_its_slice(tmp_path, name, partition):
    cfg, full = full_model(name)
    write_checkpoint(tmp_path, full, cfg)
    seen_blocks = set()
    for start, stop in partition:
        layers, first, last = range(start, stop), start == 0, stop == cfg["num_layers"]
        config, sd = load_slice_state_dict(tmp_path, layers=layers, first=first, last=last)
        assert config == cfg
        assert_same_tensors(sd, expected_slice(full, layers, first, last))
        assert ("patch_embedding.weight" in sd) == first
        assert ("proj_out.weight" in sd) == ("scale_shift_table" in sd) == last
        assert "condition_embedder.time_embedder.linear_1.weight" in sd  # every stage recomputes conditioning
        seen_blocks |= {k for k in full_names(sd, layers) if k.startswith("blocks.")}
    assert seen_blocks == {k for k in full if k.startswith("blocks.")}


def test_block_1_does_not_match_block_10(tmp_path):
    cfg, full = full_model("tiny-wan2.1", num_layers=12)
    write_checkpoint(tmp_path, full, cfg)
    recorder = RecordingSafeOpen()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(checkpoint, "safe_open", recorder)
        _, sd = load_slice_state_dict(tmp_path, layers=range(1, 2), first=False, last=False)
    assert_same_tensors(sd, expected_slice(full, range(1, 2), False, False))
    assert not [k for _, k in recorder.requested if k.startswith(("blocks.10.", "blocks.11."))]


@pytest.mark.parametrize("layout", ["diffusers", "original"])
def test_sharded_middle_slice_reads_only_its_shards_and_keys(tmp_path, layout):
    cfg, full = full_model("tiny-wan2.1")
    write_checkpoint(tmp_path, full, cfg, layout=layout, max_shard_bytes=SMALL_SHARDS)
    weight_map = json.loads((tmp_path / INDEX).read_text())["weight_map"]
    all_shards = set(weight_map.values())
    assert len(all_shards) > 20

    layers = range(1, 3)
    want = expected_slice(full, layers, first=False, last=False)
    want_stored = {k if layout == "diffusers" else diffusers_to_original(k) for k in full_names(want, layers)}
    recorder = RecordingSafeOpen()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(checkpoint, "safe_open", recorder)
        _, sd = load_slice_state_dict(tmp_path, layers=layers, first=False, last=False)

    assert_same_tensors(sd, want)
    requested_keys = [k for _, k in recorder.requested]
    assert sorted(requested_keys) == sorted(want_stored)  # each needed key read once, nothing else
    assert all(weight_map[k] == shard for shard, k in recorder.requested)
    assert sorted(recorder.opened) == sorted({weight_map[k] for k in want_stored})  # each needed shard opened once
    assert set(recorder.opened) < all_shards
    full_bytes = sum(t.nbytes for t in full.values())
    assert recorder.bytes_read == sum(t.nbytes for t in sd.values()) < full_bytes


LAYOUTS = [("original", ""), ("original", "model.diffusion_model."), ("original", "model.")]


@pytest.mark.parametrize("name", TINY)
@pytest.mark.parametrize("max_shard_bytes", [None, SMALL_SHARDS], ids=["single", "sharded"])
@pytest.mark.parametrize("layout, prefix", LAYOUTS, ids=["original", "prefixed", "model-prefixed"])
def test_original_layout_loads_same_slices_as_diffusers(tmp_path, name, max_shard_bytes, layout, prefix):
    cfg, full = full_model(name)
    write_checkpoint(tmp_path / "diffusers", full, cfg, max_shard_bytes=max_shard_bytes)
    write_checkpoint(
        tmp_path / "original", full, cfg, layout=layout, key_prefix=prefix, max_shard_bytes=max_shard_bytes
    )
    assert (tmp_path / "original" / (INDEX if max_shard_bytes else SINGLE)).is_file()
    for start, stop in [(0, 1), (1, 3), (3, 4)]:
        kwargs = dict(layers=range(start, stop), first=start == 0, last=stop == 4)
        cfg_d, sd_d = load_slice_state_dict(tmp_path / "diffusers", **kwargs)
        cfg_o, sd_o = load_slice_state_dict(tmp_path / "original", **kwargs)
        assert cfg_d == cfg_o == cfg
        assert_same_tensors(sd_o, sd_d)


def test_original_release_file_names_are_accepted(tmp_path):
    cfg, full = full_model("tiny-wan2.1")
    want = expected_slice(full, range(2, 4), first=False, last=True)
    single = write_checkpoint(tmp_path / "single", full, cfg, layout="original")
    (single / SINGLE).rename(single / "wan2.1_t2v_tiny_bf16.safetensors")
    sharded = write_checkpoint(tmp_path / "sharded", full, cfg, layout="original", max_shard_bytes=SMALL_SHARDS)
    (sharded / INDEX).rename(sharded / "model.safetensors.index.json")
    for folder in (single, sharded):
        assert "dim" in json.loads((folder / "config.json").read_text())  # a Wan-AI WanModel config
        config, sd = load_slice_state_dict(folder, layers=range(2, 4), first=False, last=True)
        assert config == cfg
        assert_same_tensors(sd, want)


def test_slice_parameter_bytes_matches_loaded_bytes(tmp_path):
    cfg, full = full_model("tiny-wan2.2-ti2v")
    write_checkpoint(tmp_path, full, cfg)
    for dtype in (torch.float32, torch.bfloat16):
        _, sd = load_slice_state_dict(tmp_path, layers=range(1, 3), first=True, last=False, dtype=dtype)
        assert slice_parameter_bytes(cfg, layers=range(1, 3), first=True, last=False, dtype=dtype) == sum(
            t.nbytes for t in sd.values()
        )


def test_read_config_returns_model_kwargs(tmp_path):
    cfg, full = full_model("tiny-wan2.1")
    write_checkpoint(tmp_path, full, cfg)
    assert read_config(tmp_path) == cfg
    WanTransformer3DModel(**read_config(tmp_path))  # no metadata keys left that __init__ would reject


# --- dtype ----------------------------------------------------------------------------------------------------


def _kept_in_fp32(key: str) -> bool:
    parts = key.split(".")
    return parts[-1] == "scale_shift_table" or "norm2" in parts or "time_embedder" in parts


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_load_keeps_fp32_modules_in_fp32(tmp_path, dtype):
    cfg, full = full_model("tiny-wan2.1")
    write_checkpoint(tmp_path, full, cfg)
    _, sd = load_slice_state_dict(tmp_path, layers=range(0, 4), first=True, last=True, dtype=dtype)
    want = expected_slice(full, range(0, 4), True, True)
    kept = {k for k in sd if _kept_in_fp32(k)}
    assert {"scale_shift_table", "blocks.3.scale_shift_table", "blocks.0.norm2.weight"} <= kept
    assert "condition_embedder.time_embedder.linear_2.bias" in kept
    for key, tensor in sd.items():
        if key in kept:
            assert tensor.dtype == torch.float32 and torch.equal(tensor, want[key]), key
        else:
            assert tensor.dtype == dtype and torch.equal(tensor, want[key].to(dtype)), key


def test_bf16_slice_matches_from_pretrained(tmp_path):
    pytest.importorskip("accelerate")  # from_pretrained(torch_dtype=bf16) needs it for _keep_in_fp32_modules
    cfg, full = full_model("tiny-wan2.2-ti2v")
    write_checkpoint(tmp_path, full, cfg, max_shard_bytes=SMALL_SHARDS)
    reference = WanTransformer3DModel.from_pretrained(tmp_path, torch_dtype=torch.bfloat16).state_dict()
    layers = range(1, 3)
    _, sd = load_slice_state_dict(tmp_path, layers=layers, first=False, last=True, dtype=torch.bfloat16)
    assert_same_tensors(sd, expected_slice(reference, layers, first=False, last=True))


# --- corrupt checkpoints ----------------------------------------------------------------------------------------


def assert_names(err: pytest.ExceptionInfo, file: str, key: str | None) -> None:
    """The error is a CheckpointError (a ValueError) whose message names the file and the key."""
    assert isinstance(err.value, CheckpointError) and isinstance(err.value, ValueError)
    assert Path(err.value.file).name == file
    assert str(Path(err.value.file)) in str(err.value)
    assert err.value.key == key
    if key is not None:
        assert repr(key) in str(err.value)


def test_missing_config_json(tmp_path):
    cfg, full = full_model("tiny-wan2.1")
    write_checkpoint(tmp_path, full, cfg)
    (tmp_path / "config.json").unlink()
    with pytest.raises(CheckpointError, match="missing config.json") as err:
        load_slice_state_dict(tmp_path, layers=range(0, 1), first=True, last=False)
    assert_names(err, "config.json", None)


@pytest.mark.parametrize("layout", ["diffusers", "original"])
@pytest.mark.parametrize("max_shard_bytes", [None, SMALL_SHARDS], ids=["single", "sharded"])
def test_missing_key(tmp_path, layout, max_shard_bytes):
    cfg, full = full_model("tiny-wan2.1")
    gone = "blocks.2.attn1.to_q.weight"
    write_checkpoint(
        tmp_path, {k: v for k, v in full.items() if k != gone}, cfg, layout=layout, max_shard_bytes=max_shard_bytes
    )
    with pytest.raises(CheckpointError, match="missing tensor") as err:
        load_slice_state_dict(tmp_path, layers=range(2, 4), first=False, last=True)
    stored = gone if layout == "diffusers" else "blocks.2.self_attn.q.weight"
    assert_names(err, INDEX if max_shard_bytes else SINGLE, stored)


def test_wrong_shape(tmp_path):
    cfg, full = full_model("tiny-wan2.1")
    bad = "blocks.1.ffn.net.0.proj.weight"
    write_checkpoint(tmp_path, {**full, bad: torch.zeros(47, 24)}, cfg)
    with pytest.raises(CheckpointError, match=r"shape \(47, 24\) but .* expects \(48, 24\)") as err:
        load_slice_state_dict(tmp_path, layers=range(1, 2), first=False, last=False)
    assert_names(err, SINGLE, bad)


def test_checkpoint_with_more_blocks_than_config(tmp_path):
    cfg, full = full_model("tiny-wan2.1")
    write_checkpoint(tmp_path, full, dict(cfg, num_layers=3))
    with pytest.raises(CheckpointError, match="has block 3 but .* num_layers=3") as err:
        load_slice_state_dict(tmp_path, layers=range(0, 1), first=True, last=False)
    assert err.value.key.startswith("blocks.3.")
    assert_names(err, SINGLE, err.value.key)


def test_checkpoint_with_fewer_blocks_than_config(tmp_path):
    cfg, full = full_model("tiny-wan2.1")
    write_checkpoint(tmp_path, full, dict(cfg, num_layers=5))
    with pytest.raises(CheckpointError, match="missing tensor") as err:
        load_slice_state_dict(tmp_path, layers=range(0, 1), first=True, last=False)
    assert err.value.key.startswith("blocks.4.")
    assert_names(err, SINGLE, err.value.key)


def test_config_with_other_dims_than_tensors(tmp_path):
    cfg, full = full_model("tiny-wan2.1")
    write_checkpoint(tmp_path, full, dict(cfg, ffn_dim=64))
    with pytest.raises(CheckpointError, match=r"shape \(48, 24\) but .* expects \(64, 24\)") as err:
        load_slice_state_dict(tmp_path, layers=range(0, 1), first=True, last=False)
    assert_names(err, SINGLE, "blocks.0.ffn.net.0.proj.weight")


def test_unknown_layout(tmp_path):
    cfg, _ = full_model("tiny-wan2.1")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    save_file({"foo.bar": torch.zeros(2)}, str(tmp_path / SINGLE))
    with pytest.raises(CheckpointError, match="unknown checkpoint key layout") as err:
        load_slice_state_dict(tmp_path, layers=range(0, 1), first=True, last=False)
    assert_names(err, SINGLE, "foo.bar")


def test_missing_shard_file(tmp_path):
    cfg, full = full_model("tiny-wan2.1")
    write_checkpoint(tmp_path, full, cfg, max_shard_bytes=SMALL_SHARDS)
    weight_map = json.loads((tmp_path / INDEX).read_text())["weight_map"]
    lost = weight_map["blocks.3.ffn.net.2.weight"]
    (tmp_path / lost).unlink()
    # Fails even for a slice that does not need the lost shard: the checkpoint is incomplete.
    with pytest.raises(CheckpointError, match=f"missing shard file '{lost}'") as err:
        load_slice_state_dict(tmp_path, layers=range(0, 1), first=True, last=False)
    assert weight_map[err.value.key] == lost
    assert_names(err, INDEX, err.value.key)


def test_index_points_to_shard_without_the_key(tmp_path):
    cfg, full = full_model("tiny-wan2.1")
    write_checkpoint(tmp_path, full, cfg, max_shard_bytes=SMALL_SHARDS)
    index = json.loads((tmp_path / INDEX).read_text())
    key = "blocks.1.attn1.to_q.weight"
    wrong = index["weight_map"]["patch_embedding.weight"]
    index["weight_map"][key] = wrong
    (tmp_path / INDEX).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="the file lacks it") as err:
        load_slice_state_dict(tmp_path, layers=range(1, 2), first=False, last=False)
    assert_names(err, wrong, key)


@pytest.mark.parametrize("layers", [range(3, 5), range(-1, 2), range(0, 4, 2)])
def test_layers_out_of_range(tmp_path, layers):
    cfg, full = full_model("tiny-wan2.1")
    write_checkpoint(tmp_path, full, cfg)
    with pytest.raises(CheckpointError, match="out of range for num_layers=4") as err:
        load_slice_state_dict(tmp_path, layers=layers, first=False, last=True)
    assert_names(err, "config.json", "num_layers")


def test_several_safetensors_without_index(tmp_path):
    cfg, full = full_model("tiny-wan2.1")
    write_checkpoint(tmp_path, full, cfg)
    save_file({"x": torch.zeros(1)}, str(tmp_path / "extra.safetensors"))
    (tmp_path / SINGLE).rename(tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="several safetensors files") as err:
        load_slice_state_dict(tmp_path, layers=range(0, 1), first=True, last=False)
    assert_names(err, tmp_path.name, None)


def test_write_refuses_a_folder_with_weights(tmp_path):
    cfg, full = full_model("tiny-wan2.1")
    write_checkpoint(tmp_path, full, cfg)
    with pytest.raises(FileExistsError):
        write_checkpoint(tmp_path, full, cfg, max_shard_bytes=SMALL_SHARDS)


# --- training-wrapper prefixes, truncated files, nothing half-loaded ----------------------------------------------


@pytest.mark.parametrize(
    "layout, prefix",
    [
        ("original", "generator.model."),
        ("original", "module.model._orig_mod."),
        ("diffusers", "_orig_mod."),
        ("diffusers", "module."),
    ],
)
def test_training_wrapper_prefixes_load(tmp_path, layout, prefix):
    """``_orig_mod.`` (torch.compile), ``module.`` (DDP), ``generator.model.`` (a distillation model's state dict)."""
    cfg, full = full_model("tiny-wan2.1")
    if layout == "original":
        sd = {diffusers_to_original(k, prefix=prefix): v for k, v in full.items()}
    else:
        sd = {prefix + k: v for k, v in full.items()}
    (tmp_path / "config.json").write_text(json.dumps(dict(cfg), default=list))
    save_file({k: v.contiguous() for k, v in sd.items()}, str(tmp_path / SINGLE))
    for layers in (range(0, 2), range(2, 4)):
        first, last = layers.start == 0, layers.stop == 4
        _, got = load_slice_state_dict(tmp_path, layers=layers, first=first, last=last)
        assert_same_tensors(got, expected_slice(full, layers, first, last))


def _tensor_ids() -> set[int]:
    gc.collect()
    return {id(o) for o in gc.get_objects() if issubclass(type(o), torch.Tensor)}


@pytest.mark.parametrize("sharded", [True, False], ids=["sharded", "single"])
def test_truncated_file_names_file_and_key_and_nothing_half_loaded_stays(tmp_path, sharded):
    cfg, full = full_model("tiny-wan2.1")
    write_checkpoint(tmp_path, full, cfg, max_shard_bytes=SMALL_SHARDS if sharded else None)
    if sharded:
        weight_map = json.loads((tmp_path / INDEX).read_text())["weight_map"]
        victim = tmp_path / weight_map["blocks.3.ffn.net.2.weight"]  # read late, after other shards' tensors
    else:
        victim = tmp_path / SINGLE
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) - 200])
    before = _tensor_ids()
    with pytest.raises(CheckpointError) as err:
        load_slice_state_dict(tmp_path, layers=range(4), first=True, last=True)
    # The caller holds the error (a log record would): it must not keep any tensor read before the failure alive.
    assert err.value.file == str(victim) and err.value.key is not None and "truncated" in str(err.value)
    assert err.value.key in str(err.value)
    assert _tensor_ids() <= before
    assert str(victim) not in Path("/proc/self/maps").read_text()  # no file left memory-mapped
