"""``stagecast convert``: the published CausVid / Self-Forcing / StreamDiffusionV2 ``.pt`` layouts become stagecast
folders that serve exactly what the source weights compute.

The synthetic files copy each project's own save code (tiny shapes):

- CausVid, ``causvid/train_distillation.py`` ``save`` (tianweiy/CausVid @ ca21150): ``{"generator": ...,
  "critic": ...}``, both ``CausalWanDiffusionWrapper.state_dict()``, i.e. original Wan names behind ``model.``;
  ``minimal_inference/autoregressive_inference.py`` loads ``["generator"]``.
- Self-Forcing, ``trainer/distillation.py`` ``save`` (guandeh17/Self-Forcing @ 33593df): ``{"generator", "critic",
  "generator_ema"}``; the EMA is ``utils/distributed.py`` ``EMA_FSDP.state_dict()`` (float32 copies of
  ``named_parameters()`` under FSDP, whose names may carry ``_fsdp_wrapped_module.`` / ``_checkpoint_wrapped_module.``
  / ``_orig_mod.``: the same file's ``rename_param`` strips them); ``inference.py`` loads ``generator_ema`` with
  ``--use_ema``.
- StreamDiffusionV2, ``streamv2v/inference_common.py`` ``load_generator_state_dict`` (chenfengxu714/StreamDiffusionV2
  @ c5a0f20): ``model.pt`` holding ``generator`` / ``generator_ema`` / ``state_dict`` or a bare state dict, names
  with or without ``model.`` (it adds the prefix when missing).
"""

from __future__ import annotations

import gc
import json
import os
from pathlib import Path

import pytest
import torch
from diffusers import WanTransformer3DModel

from launcher.cli import main as cli_main
from launcher.convert import SOURCES, ConvertError, convert
from launcher.process import Launcher
from launcher.reference import ReferenceExecutor
from launcher.selftest import SelftestConfig, execute_selftest
from stage_service.checkpoint import load_slice_state_dict
from stage_service.dit_slice import DiTSlice
from stagecast.model.dit_configs import model_config
from stagecast.model.wan_keys import diffusers_to_original

MODEL = "tiny-wan2.1"


def tiny(seed: int) -> WanTransformer3DModel:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return WanTransformer3DModel(**model_config(MODEL)).eval()


def original(model: WanTransformer3DModel, prefix: str = "model.") -> dict[str, torch.Tensor]:
    """What ``WanDiffusionWrapper.state_dict()`` holds: original Wan names behind ``model.``."""
    return {diffusers_to_original(k, prefix=prefix): v.clone() for k, v in model.state_dict().items()}


def with_wrappers(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """FSDP / activation checkpointing / torch.compile wrapper segments inside names, as EMA_FSDP may record them."""
    out = {}
    for i, (k, v) in enumerate(sd.items()):
        if k.startswith("model.blocks."):
            _, _, n, rest = k.split(".", 3)
            wrapper = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")[i % 3]
            k = f"model.blocks.{n}.{wrapper}{rest}"
        elif i % 2:
            k = "model._orig_mod." + k[len("model.") :]
        out[k] = v.float()
    return out


GENERATOR, EMA, CRITIC = tiny(1), tiny(2), tiny(3)


def causvid_file(path: Path) -> WanTransformer3DModel:
    torch.save({"generator": original(GENERATOR), "critic": original(CRITIC)}, path)
    return GENERATOR


def self_forcing_file(path: Path) -> WanTransformer3DModel:
    torch.save(
        {"generator": original(GENERATOR), "critic": original(CRITIC), "generator_ema": with_wrappers(original(EMA))},
        path,
    )
    return EMA


def sdv2_file(path: Path) -> WanTransformer3DModel:
    torch.save({"generator": original(GENERATOR, prefix="")}, path)  # no model. prefix: the loader adds it
    return GENERATOR


def bare_ddp_file(path: Path) -> WanTransformer3DModel:
    # A bare state dict of a DDP-wrapped distillation model: module.generator.model.<original name>.
    torch.save(original(GENERATOR, prefix="module.generator.model."), path)
    return GENERATOR


LAYOUTS = {
    "causvid": ("causvid", causvid_file),
    "self-forcing": ("self-forcing", self_forcing_file),
    "streamdiffusionv2": ("streamdiffusionv2", sdv2_file),
    "bare-ddp": ("streamdiffusionv2", bare_ddp_file),
}


def full_slice(folder: Path) -> dict[str, torch.Tensor]:
    n = model_config(MODEL)["num_layers"]
    return load_slice_state_dict(folder, layers=range(n), first=True, last=True)[1]


@pytest.mark.parity
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_each_published_layout_converts_to_the_source_weights_in_layer_ordered_shards(tmp_path, layout):
    source, write = LAYOUTS[layout]
    model = write(tmp_path / "model.pt")
    report = convert(tmp_path / "model.pt", tmp_path / "out", source=source)
    assert report.preset == MODEL and report.preset_differences == []
    assert report.config == {k: v for k, v in model_config(MODEL).items()}
    got = full_slice(tmp_path / "out" / "transformer")
    want = model.state_dict()
    assert set(got) == set(want)
    for k in want:
        assert got[k].dtype == want[k].dtype == torch.float32 and torch.equal(got[k], want[k]), k
    # Shards in layer order: embedders, patch embedding, one per block, the head.
    index = json.loads((tmp_path / "out/transformer/diffusion_pytorch_model.safetensors.index.json").read_text())
    shard_of = index["weight_map"]
    files = sorted(set(shard_of.values()))
    assert len(files) == 3 + model_config(MODEL)["num_layers"]
    for i in range(4):
        assert {f for k, f in shard_of.items() if k.startswith(f"blocks.{i}.")} == {files[2 + i]}
    assert {shard_of["proj_out.weight"], shard_of["scale_shift_table"]} == {files[-1]}
    serving = json.loads((tmp_path / "out/stagecast.json").read_text())
    spec = SOURCES[source]
    assert serving["sampler"] == {"update": "x0", "shift": spec.shift, "ladder": list(spec.ladder)}
    assert serving["steps"] == len(spec.ladder) and serving["chunk_frames"] == spec.chunk_frames


@pytest.mark.parity
def test_the_sampler_written_is_the_one_the_sampler_reader_accepts(tmp_path):
    from stagecast.sampling import SamplerConfig  # the gateway's reader of the section

    for source, (_, write) in [(s, LAYOUTS[s]) for s in ("causvid", "self-forcing", "streamdiffusionv2")]:
        write(tmp_path / f"{source}.pt")
        convert(tmp_path / f"{source}.pt", tmp_path / source, source=source)
        section = json.loads((tmp_path / source / "stagecast.json").read_text())["sampler"]
        cfg = SamplerConfig.from_json(section)
        assert cfg.ladder_for(len(SOURCES[source].ladder)) == SOURCES[source].ladder
        assert cfg.shift == SOURCES[source].shift


@pytest.mark.parity
def test_ema_flag_chooses_the_entry(tmp_path):
    self_forcing_file(tmp_path / "sf.pt")
    convert(tmp_path / "sf.pt", tmp_path / "ema", source="self-forcing")
    convert(tmp_path / "sf.pt", tmp_path / "raw", source="self-forcing", ema=False)
    for name, model in (("ema", EMA), ("raw", GENERATOR)):
        got = full_slice(tmp_path / name / "transformer")
        assert all(torch.equal(got[k], v) for k, v in model.state_dict().items())
    causvid_file(tmp_path / "cv.pt")
    with pytest.raises(ConvertError, match="generator_ema"):
        convert(tmp_path / "cv.pt", tmp_path / "x", source="causvid", ema=True)


@pytest.mark.multiprocess
@pytest.mark.parity
@pytest.mark.parametrize("layout", ["causvid", "self-forcing", "streamdiffusionv2"])
def test_converted_file_serves_streams_exactly_as_the_source_weights(tmp_path, layout):
    """Two stages serve the converted folder; the reference replays the same plan over a model holding the source
    file's weights (built in this process, not read from the converted folder): every chunk bit for bit."""
    source, write = LAYOUTS[layout]
    model = write(tmp_path / "model.pt")
    convert(tmp_path / "model.pt", tmp_path / "out", source=source)
    cfg = SelftestConfig(stages=2, streams=2, chunks=2, steps=2, checkpoint=str(tmp_path / "out" / "transformer"))
    with Launcher() as launcher:
        result = execute_selftest(cfg, launcher)
    assert result.ok and result.max_diff == 0.0
    n = model_config(MODEL)["num_layers"]
    oracle = ReferenceExecutor(DiTSlice.from_model(model, layers=range(n), first=True, last=True))
    want = oracle.replay(result.plan, result.texts)
    assert set(want) == set(result.chunks)
    for sid, chunks in want.items():
        assert len(chunks) == len(result.chunks[sid]) > 0
        for g, w in zip(result.chunks[sid], chunks):
            assert torch.equal(g, w), f"stream {sid}"


# --- refusals ---------------------------------------------------------------------------------------------------

UNPICKLED = []


class NotATensor:
    """Unpickling this would run code: a weights_only load must refuse it, and never fall back."""

    def __reduce__(self):
        return (UNPICKLED.append, ("ran",))


def assert_nothing_left(tmp_path: Path, out: str = "out") -> None:
    assert not (tmp_path / out).exists()
    assert not [p for p in tmp_path.iterdir() if ".partial-" in p.name]


def mapped_paths() -> str:
    return Path("/proc/self/maps").read_text()


@pytest.mark.parity
def test_a_pickle_with_objects_is_refused_and_never_unpickled(tmp_path):
    torch.save({"generator": original(GENERATOR), "config": NotATensor()}, tmp_path / "model.pt")
    with pytest.raises(ConvertError) as err:
        convert(tmp_path / "model.pt", tmp_path / "out", source="causvid")
    msg = str(err.value)
    assert str(tmp_path / "model.pt") in msg and "weights_only=True" in msg and "never unpickles" in msg
    assert UNPICKLED == []
    assert_nothing_left(tmp_path)


@pytest.mark.parity
def test_a_truncated_file_names_the_file_and_leaves_nothing(tmp_path):
    causvid_file(tmp_path / "model.pt")
    data = (tmp_path / "model.pt").read_bytes()
    (tmp_path / "model.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(ConvertError, match=r"model\.pt: truncated: .* key 'generator: model\.[a-z_.0-9]+'"):
        convert(tmp_path / "model.pt", tmp_path / "out", source="causvid")
    assert_nothing_left(tmp_path)
    # The key named is the first whose bytes the file lacks: cut at 90 %, that is in the critic, saved last.
    (tmp_path / "model.pt").write_bytes(data[: len(data) * 9 // 10])
    with pytest.raises(ConvertError) as err:
        convert(tmp_path / "model.pt", tmp_path / "out", source="causvid")
    assert "critic: model." in str(err.value)  # the critic is saved after the generator


@pytest.mark.parity
def test_unknown_layout_names_the_first_unknown_keys(tmp_path):
    sd = original(GENERATOR)
    sd["model.lora_magic.weight"] = torch.zeros(2)
    sd["model.blocks.0.adapter.up.weight"] = torch.zeros(2)
    torch.save({"generator": sd}, tmp_path / "model.pt")
    with pytest.raises(ConvertError) as err:
        convert(tmp_path / "model.pt", tmp_path / "out", source="causvid")
    assert "model.lora_magic.weight" in str(err.value) and "model.blocks.0.adapter.up.weight" in str(err.value)
    torch.save({"generator": {"encoder.layer.0.weight": torch.zeros(2)}}, tmp_path / "other.pt")
    with pytest.raises(ConvertError, match=r"first unknown keys: \['encoder.layer.0.weight'\]"):
        convert(tmp_path / "other.pt", tmp_path / "out", source="causvid")
    assert_nothing_left(tmp_path)


@pytest.mark.parity
def test_a_wrong_shape_names_the_key_and_nothing_stays_mapped(tmp_path):
    sd = original(GENERATOR)
    sd["model.blocks.2.ffn.2.weight"] = torch.zeros(3, 3)
    torch.save({"generator": sd}, tmp_path / "model.pt")
    del sd
    gc.collect()
    before = {id(o) for o in gc.get_objects() if issubclass(type(o), torch.Tensor)}
    with pytest.raises(ConvertError, match=r"model\.pt.*'model\.blocks\.2\.ffn\.2\.weight' has shape \(3, 3\)") as err:
        convert(tmp_path / "model.pt", tmp_path / "out", source="causvid")
    # The caller still holds the error (as a log handler or the CLI would): its traceback must hold no tensors.
    assert err.value is not None
    gc.collect()
    after = {id(o) for o in gc.get_objects() if issubclass(type(o), torch.Tensor)}
    assert after <= before  # no tensor of the failed conversion is still alive
    assert str(tmp_path / "model.pt") not in mapped_paths()  # and the file is no longer memory-mapped
    assert_nothing_left(tmp_path)


@pytest.mark.parity
def test_refuses_an_existing_output_folder(tmp_path):
    causvid_file(tmp_path / "model.pt")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "x").write_text("mine")
    with pytest.raises(ConvertError, match="not empty"):
        convert(tmp_path / "model.pt", tmp_path / "out", source="causvid")
    assert (tmp_path / "out" / "x").read_text() == "mine"


@pytest.mark.parity
def test_cli_converts_with_a_base_and_reports(tmp_path, capsys):
    from launcher.demo_checkpoint import write_demo_checkpoint

    base = write_demo_checkpoint(tmp_path / "base")
    self_forcing_file(tmp_path / "sf.pt")
    rc = cli_main(
        ["convert", str(tmp_path / "sf.pt"), "--source", "self-forcing", "--base", str(base)]
        + [
            "--out",
            str(tmp_path / "out"),
        ]
    )
    assert rc == 0
    printed = capsys.readouterr().out
    assert "generator_ema" in printed and MODEL in printed
    for part in ("vae", "text_encoder", "tokenizer"):
        assert sorted(os.listdir(tmp_path / "out" / part)) == sorted(os.listdir(base / part))
    rc = cli_main(["convert", str(tmp_path / "nope.pt"), "--source", "causvid", "--out", str(tmp_path / "o2")])
    assert rc == 2 and "nope.pt: no such file" in capsys.readouterr().out


@pytest.mark.parity
def test_config_checked_against_presets_and_overrides(tmp_path):
    """A model with fewer layers than any preset: heads come from the preset of its width, the difference is
    reported; --ladder / --shift replace the source's sampler and are checked by the sampler reader."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        small = WanTransformer3DModel(**model_config(MODEL, num_layers=2)).eval()
    torch.save({"generator": original(small)}, tmp_path / "small.pt")
    report = convert(tmp_path / "small.pt", tmp_path / "out", source="causvid", ladder=[900.0, 450.0], shift=3.0)
    assert report.preset == MODEL and report.preset_differences == ["num_layers=2 (preset 4)"]
    assert report.config == model_config(MODEL, num_layers=2)
    assert report.sampler == {"update": "x0", "shift": 3.0, "ladder": [900.0, 450.0]}
    with pytest.raises(ConvertError, match="sampler.ladder"):
        convert(tmp_path / "small.pt", tmp_path / "bad", source="causvid", ladder=[450.0, 900.0])
    with pytest.raises(ConvertError, match="--num-heads 5"):
        convert(tmp_path / "small.pt", tmp_path / "bad", source="causvid", num_heads=5)
    assert_nothing_left(tmp_path, "bad")
