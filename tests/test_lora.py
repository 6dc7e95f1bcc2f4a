"""LoRA merged at load (``stagecast stage --lora PATH[:SCALE]``): each stage's merged slice equals diffusers'
``load_lora_weights`` + ``fuse_lora`` on the full model bit for bit, in the diffusers, PEFT, kohya (musubi-tuner) and
original-Wan key formats, and each stage reads only its own modules' LoRA tensors.

The key formats are the ones diffusers' own loader reads (``diffusers/loaders/lora_conversion_utils.py``:
``_convert_musubi_wan_lora_to_diffusers`` for ``lora_unet_blocks_0_self_attn_q.lora_down.weight`` + ``alpha``,
``_convert_non_diffusers_wan_lora_to_diffusers`` for ``diffusion_model.blocks.0.self_attn.q.lora_A.weight``), what
diffusers' ``save_lora_weights`` writes (``transformer.blocks.0.attn1.to_q.lora_A.weight``), and what PEFT's
``get_peft_model_state_dict`` writes for a PEFT-wrapped original ``WanModel`` / ``CausalWanModel`` (the LongLive
LoRA training setup): ``base_model.model.blocks.0.self_attn.q.lora_A.weight``.
"""

from __future__ import annotations

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel
from safetensors.torch import save_file

from launcher.demo_checkpoint import write_checkpoint
from launcher.process import Launcher
from launcher.reference import ReferenceExecutor
from launcher.selftest import SelftestConfig, execute_selftest
from stage_service import lora as lora_mod
from stage_service.checkpoint import CheckpointError, load_slice_state_dict
from stage_service.dit_slice import DiTSlice
from stage_service.lora import LoraSpec, parse_lora
from stagecast.model.dit_configs import model_config
from stagecast.model.wan_keys import diffusers_to_original
from tests.test_checkpoint import RecordingSafeOpen

MODEL = "tiny-wan2.1"
LAYERS = model_config(MODEL)["num_layers"]
# Every module diffusers' musubi converter expects in each block (it pops them unconditionally).
BLOCK_MODULES = [
    "attn1.to_q",
    "attn1.to_k",
    "attn1.to_v",
    "attn1.to_out.0",
    "attn2.to_q",
    "attn2.to_k",
    "attn2.to_v",
    "attn2.to_out.0",
    "ffn.net.0.proj",
    "ffn.net.2",
]
KOHYA = {"attn1": "self_attn", "attn2": "cross_attn", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "o"}


def base_model() -> WanTransformer3DModel:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return WanTransformer3DModel(**model_config(MODEL)).eval()


def random_lora(seed: int, rank: int = 3, extra: tuple[str, ...] = ()) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """diffusers module -> (A, B): every block module, plus ``extra`` modules outside the blocks."""
    shapes = {k: v.shape for k, v in base_model().state_dict().items()}
    g = torch.Generator().manual_seed(seed)
    out = {}
    for module in [f"blocks.{i}.{m}" for i in range(LAYERS) for m in BLOCK_MODULES] + list(extra):
        n_out, n_in = shapes[module + ".weight"]
        out[module] = (torch.randn(rank, n_in, generator=g) * 0.1, torch.randn(n_out, rank, generator=g) * 0.1)
    return out


def diffusers_keys(lora) -> dict[str, torch.Tensor]:
    sd = {}
    for module, (a, b) in lora.items():
        sd[f"transformer.{module}.lora_A.weight"] = a
        sd[f"transformer.{module}.lora_B.weight"] = b
    return sd


def peft_keys(lora) -> dict[str, torch.Tensor]:
    sd = {}
    for module, (a, b) in lora.items():
        name = diffusers_to_original(module + ".weight")[: -len(".weight")]
        sd[f"base_model.model.{name}.lora_A.weight"] = a
        sd[f"base_model.model.{name}.lora_B.weight"] = b
    return sd


def kohya_keys(lora, alpha: float = 2.0) -> dict[str, torch.Tensor]:
    sd = {}
    for module, (a, b) in lora.items():
        name = diffusers_to_original(module + ".weight")[: -len(".weight")].replace(".", "_")
        sd[f"lora_unet_{name}.lora_down.weight"] = a
        sd[f"lora_unet_{name}.lora_up.weight"] = b
        sd[f"lora_unet_{name}.alpha"] = torch.tensor(alpha)
    return sd


def original_keys(lora, alpha: float = 6.0) -> dict[str, torch.Tensor]:
    sd = {}
    for i, (module, (a, b)) in enumerate(lora.items()):
        name = diffusers_to_original(module + ".weight")[: -len(".weight")]
        sd[f"diffusion_model.{name}.lora_down.weight"] = a
        sd[f"diffusion_model.{name}.lora_up.weight"] = b
        if module.startswith("blocks.") and ".attn1." in module and i % 2:
            sd[f"diffusion_model.{name}.alpha"] = torch.tensor(alpha)
    return sd


FORMATS = {
    "diffusers": (diffusers_keys, ("condition_embedder.time_embedder.linear_1", "proj_out")),
    "peft": (peft_keys, ("condition_embedder.text_embedder.linear_2", "proj_out")),
    "kohya": (kohya_keys, ()),
    "original": (original_keys, ()),
}


def oracle(files: list[str], scale: float, weights: list[float] | None = None) -> WanTransformer3DModel:
    """diffusers itself: load_lora_weights for each file, then fuse_lora(lora_scale=scale) on the full model (several
    files: set_adapters with their ``weights``, then fuse_lora, diffusers' way to fuse several LoRAs)."""
    model = base_model()
    pipe = WanPipeline(
        tokenizer=None, text_encoder=None, transformer=model, vae=None, scheduler=FlowMatchEulerDiscreteScheduler()
    )
    names = [f"lora{i}" for i in range(len(files))]
    for name, file in zip(names, files):
        pipe.load_lora_weights(file, adapter_name=name)
    if weights is not None:
        pipe.set_adapters(names, adapter_weights=weights)
    pipe.fuse_lora(lora_scale=scale, adapter_names=names)
    pipe.unload_lora_weights()  # after fusing: the plain model with the fused weights
    return model


def folder_and_file(tmp_path, fmt: str, seed: int = 1) -> tuple[str, str]:
    keys, extra = FORMATS[fmt]
    file = tmp_path / f"{fmt}-{seed}.safetensors"
    save_file(keys(random_lora(seed, extra=extra)), str(file))
    folder = tmp_path / "transformer"
    if not folder.exists():
        model = base_model()
        write_checkpoint(folder, model.state_dict(), dict(model.config), max_shard_bytes=4096)
    return str(folder), str(file)


def peft_as_diffusers(tmp_path, seed: int) -> str:
    """diffusers has no loader for bare PEFT names; the oracle reads the same tensors under diffusers' names."""
    file = tmp_path / f"peft-as-diffusers-{seed}.safetensors"
    save_file(diffusers_keys(random_lora(seed, extra=FORMATS["peft"][1])), str(file))
    return str(file)


def renumbered(full: dict[str, torch.Tensor], layers: range, first: bool, last: bool) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in full.items():
        parts = k.split(".")
        if parts[0] == "blocks":
            if int(parts[1]) not in layers:
                continue
            parts[1] = str(int(parts[1]) - layers.start)
        elif (
            parts[0] == "patch_embedding"
            and not first
            or (parts[0] == "proj_out" or k == "scale_shift_table")
            and not last
        ):
            continue
        out[".".join(parts)] = v
    return out


@pytest.mark.parity
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("scale", [1.0, 0.7])
def test_merged_slices_equal_diffusers_load_lora_weights_and_fuse_lora(tmp_path, fmt, scale):
    folder, file = folder_and_file(tmp_path, fmt)
    want = oracle([peft_as_diffusers(tmp_path, 1) if fmt == "peft" else file], scale).state_dict()
    base = base_model().state_dict()
    assert any(not torch.equal(want[k], base[k]) for k in want), "the LoRA changed nothing"
    for layers in (range(0, 1), range(1, 3), range(3, 4), range(0, 4)):
        first, last = layers.start == 0, layers.stop == LAYERS
        _, got = load_slice_state_dict(folder, layers=layers, first=first, last=last, loras=[LoraSpec(file, scale)])
        expected = renumbered(want, layers, first, last)
        assert set(got) == set(expected)
        for k in expected:
            assert torch.equal(got[k], expected[k]), (fmt, layers, k)


@pytest.mark.parity
def test_two_loras_merge_in_order_like_diffusers(tmp_path):
    folder, first_file = folder_and_file(tmp_path, "diffusers", seed=1)
    _, second_file = folder_and_file(tmp_path, "kohya", seed=2)
    want = oracle([first_file, second_file], 1.0, weights=[0.5, 1.0]).state_dict()
    specs = [LoraSpec(first_file, 0.5), LoraSpec(second_file, 1.0)]
    _, got = load_slice_state_dict(folder, layers=range(LAYERS), first=True, last=True, loras=specs)
    assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parity
def test_each_stage_reads_only_its_own_lora_tensors(tmp_path):
    folder, file = folder_and_file(tmp_path, "diffusers")
    recorder = RecordingSafeOpen()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(lora_mod, "safe_open", recorder)
        load_slice_state_dict(folder, layers=range(1, 3), first=False, last=False, loras=[LoraSpec(file)])
    read = {key for _, key in recorder.requested}
    assert read and all(
        k.startswith(("transformer.blocks.1.", "transformer.blocks.2.", "transformer.condition_")) for k in read
    )
    assert any(k.startswith("transformer.condition_embedder.") for k in read)  # every stage runs the embedders
    assert not any("proj_out" in k for k in read)


@pytest.mark.multiprocess
@pytest.mark.parity
def test_lora_files_of_every_format_serve_a_stream_exactly_as_the_diffusers_fused_model(tmp_path):
    """One file per key format, all four on the stages at once (``--lora`` repeated, each with its scale); the
    reference is diffusers' fusion of the same files into the full model."""
    weights = {"diffusers": 0.5, "peft": 1.0, "kohya": 0.5, "original": 1.0}
    files, oracle_files = [], []
    for seed, fmt in enumerate(weights, start=1):
        folder, file = folder_and_file(tmp_path, fmt, seed=seed)
        files.append(f"{file}:{weights[fmt]}")
        oracle_files.append(peft_as_diffusers(tmp_path, seed) if fmt == "peft" else file)
    cfg = SelftestConfig(stages=2, partition="1,3", streams=2, chunks=2, steps=2, checkpoint=folder, loras=tuple(files))
    with Launcher() as launcher:
        result = execute_selftest(cfg, launcher)
    assert result.ok and result.max_diff == 0.0
    fused = oracle(oracle_files, 1.0, weights=list(weights.values()))
    want = ReferenceExecutor(DiTSlice.from_model(fused, layers=range(LAYERS), first=True, last=True)).replay(
        result.plan, result.texts
    )
    for sid, chunks in want.items():
        assert len(chunks) == len(result.chunks[sid]) > 0
        assert all(torch.equal(g, w) for g, w in zip(result.chunks[sid], chunks))
    plain = ReferenceExecutor(DiTSlice.from_model(base_model(), layers=range(LAYERS), first=True, last=True))
    unmerged = plain.replay(result.plan, result.texts)
    assert not all(torch.equal(a, b) for sid in want for a, b in zip(want[sid], unmerged[sid])), "LoRA had no effect"


# --- refusals ---------------------------------------------------------------------------------------------------


def bad_lora(tmp_path, sd) -> str:
    file = tmp_path / "bad.safetensors"
    save_file(sd, str(file))
    return str(file)


@pytest.mark.parametrize(
    "sd, key, why",
    [
        ({"transformer.blocks.0.attn1.to_q.magic.weight": torch.zeros(2, 2)}, "magic", "known format"),
        ({"transformer.blocks.9.attn1.to_q.lora_A.weight": torch.zeros(2, 24)}, "blocks.9", "does not have"),
        ({"transformer.blocks.0.attn1.to_q.lora_A.weight": torch.zeros(2, 24)}, "to_q.lora_A", "lacks its B"),
        (
            {
                "transformer.blocks.0.attn1.to_q.lora_A.weight": torch.zeros(2, 7),
                "transformer.blocks.0.attn1.to_q.lora_B.weight": torch.zeros(24, 2),
            },
            "to_q.lora_A",
            "do not fit",
        ),
        (
            {
                "transformer.patch_embedding.lora_A.weight": torch.zeros(2, 2),
                "transformer.patch_embedding.lora_B.weight": torch.zeros(2, 2),
            },
            "patch_embedding",
            "not a linear layer",
        ),
    ],
    ids=["unknown-key", "no-such-block", "a-without-b", "wrong-shape", "conv"],
)
@pytest.mark.parity
def test_bad_lora_names_the_file_and_key(tmp_path, sd, key, why):
    folder, _ = folder_and_file(tmp_path, "diffusers")
    file = bad_lora(tmp_path, sd)
    with pytest.raises(CheckpointError) as err:
        load_slice_state_dict(folder, layers=range(LAYERS), first=True, last=True, loras=[LoraSpec(file)])
    assert err.value.file == file and key in (err.value.key or "") and why in str(err.value)


@pytest.mark.parity
def test_parse_lora(tmp_path):
    file = tmp_path / "a:b.safetensors"
    file.write_bytes(b"")
    assert parse_lora(f"{file}:0.5") == LoraSpec(str(file), 0.5)
    assert parse_lora(str(file)) == LoraSpec(str(file), 1.0)
    with pytest.raises(FileNotFoundError, match="no such file"):
        parse_lora(str(tmp_path / "missing.safetensors:2"))
    with pytest.raises(ValueError, match="scale"):
        parse_lora(f"{file}:1e9")
