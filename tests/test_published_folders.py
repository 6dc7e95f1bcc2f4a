"""Folders as published: an older diffusers VAE config (Wan2.1-T2V-1.3B-Diffusers) and a converted Self-Forcing file
with ``--base``, served through the gateway exactly as the reference computes them from the same weights.

``Wan-AI/Wan2.1-T2V-1.3B-Diffusers/vae/config.json`` was written by diffusers 0.33.0.dev0 and holds only the keys
below: no ``patch_size``, ``decoder_base_dim``, ``is_residual``, ``in_channels``/``out_channels`` or
``scale_factor_*``, which ``AutoencoderKLWan`` gained later with defaults (``stagecast.model.config.read_vae_config``).
"""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import stagecast
from gateway.checkpoint import ModelInfo
from gateway.decode.stream_vae import StreamVAE
from launcher.demo_checkpoint import write_demo_checkpoint
from launcher.local_cluster import start_pipeline
from launcher.process import Launcher
from stagecast.model.config import read_vae_config
from stagecast.model.vae_configs import vae_config
from tests.test_gateway import PROMPT, Reference, _raw

OLD_DIFFUSERS_KEYS = (
    "attn_scales",
    "base_dim",
    "dim_mult",
    "dropout",
    "latents_mean",
    "latents_std",
    "num_res_blocks",
    "temperal_downsample",
    "z_dim",
)


def old_diffusers_vae(root) -> None:
    """Rewrite ``root/vae/config.json`` as diffusers 0.33.0.dev0 wrote the Wan2.1 VAE's."""
    path = root / "vae" / "config.json"
    config = json.loads(path.read_text())
    old = {"_class_name": "AutoencoderKLWan", "_diffusers_version": "0.33.0.dev0"}
    old.update({k: config[k] for k in OLD_DIFFUSERS_KEYS})
    path.write_text(json.dumps(old, indent=2))


@pytest.mark.unit
def test_old_diffusers_vae_config_reads_with_diffusers_defaults(tmp_path):
    root = write_demo_checkpoint(tmp_path / "ckpt")
    want = StreamVAE.from_folder(root / "vae")
    old_diffusers_vae(root)
    assert "patch_size" not in json.loads((root / "vae" / "config.json").read_text())
    assert read_vae_config(root / "vae") == vae_config("tiny-wan2.1")
    info = ModelInfo.from_checkpoint(root)
    assert (info.spatial_factor, info.temporal_factor, info.latent_channels) == (8, 4, 16)
    got = StreamVAE.from_folder(root / "vae")
    latents = torch.randn(1, 16, 2, 4, 6, generator=torch.Generator().manual_seed(0))
    a, b = want.new_state(), got.new_state()
    assert torch.equal(want.decode_chunk(a, latents), got.decode_chunk(b, latents))


def serve_and_compare(root, *, seed: int = 7) -> tuple[np.ndarray, object]:
    """Stream ``PROMPT`` through stages + gateway on ``root``; return the raw frames and the reference helper."""
    with Launcher() as launcher:
        pipe = start_pipeline(launcher, checkpoint=str(root / "transformer"), stages=2, record_plan=True)
        for child in pipe.stage_children.values():  # time-to-READY is on each stage's READY line
            assert 0 < float(child.info["ready_s"]) < 600
        gateway = launcher.spawn(
            "gateway", ["gateway", "--coordinator", pipe.coordinator, "--checkpoint", str(root), "--port", "0"]
        )
        with stagecast.Client(gateway.info["address"]) as client:
            gen = client.generate(PROMPT, width=48, height=32, seconds=0.5, codec="raw", seed=seed, timeout=120)
            frames = gen.collect()
        reference = Reference(SimpleNamespace(root=root, coordinator=pipe.coordinator, launcher=launcher))
        sid = gen.info.pipeline_stream_id
        events = reference.plan_of(sid)
        want = np.concatenate(reference.frames(reference.latents(events, sid, PROMPT)))[: len(frames)]
    return _raw(frames), want, events


@pytest.mark.multiprocess
def test_old_diffusers_vae_config_serves_exactly(tmp_path):
    root = write_demo_checkpoint(tmp_path / "ckpt")
    old_diffusers_vae(root)
    got, want, _ = serve_and_compare(root)
    assert got.shape == want.shape and got.shape[0] == 8
    assert got.tobytes() == want.tobytes()


@pytest.mark.multiprocess
def test_converted_self_forcing_with_base_serves_its_ladder_exactly(tmp_path):
    """``stagecast convert --base`` on a Self-Forcing file (old-diffusers VAE config in the base): the gateway streams
    with the source's ladder and shift, and every frame equals the reference over the same weights."""
    from launcher.convert import SOURCES, convert
    from tests.test_convert import self_forcing_file

    base = write_demo_checkpoint(tmp_path / "base")
    old_diffusers_vae(base)
    self_forcing_file(tmp_path / "sf.pt")
    root = tmp_path / "sf"
    convert(tmp_path / "sf.pt", root, source="self-forcing", base=base)
    # The tiny text encoder's length, as the demo's stagecast.json has it (a real UMT5 uses 512).
    serving = json.loads((root / "stagecast.json").read_text())
    serving["text_len"] = json.loads((base / "stagecast.json").read_text())["text_len"]
    (root / "stagecast.json").write_text(json.dumps(serving))
    got, want, events = serve_and_compare(root)
    spec = next(ev.spec for ev in events if ev.kind == "open")
    assert tuple(spec.timesteps) == SOURCES["self-forcing"].ladder[: len(spec.timesteps)]
    assert spec.shift == SOURCES["self-forcing"].shift
    assert got.shape == want.shape and got.tobytes() == want.tobytes()
    shutil.rmtree(root)
