"""The tiny random checkpoint behind ``stagecast demo``, tests and the CPU Helm values.

Usage::

    root = write_demo_checkpoint("~/.cache/stagecast/demo")   # idempotent: reuses a complete folder
    # root/transformer  tiny Wan2.1-style DiT (diffusers layout, sharded so stages read only their shards)
    # root/text_encoder root/tokenizer   tiny UMT5 + offline tokenizer (d_model == the DiT's text_dim)
    # root/vae          tiny Wan2.1-style VAE

The weights are random: the demo proves the system end to end (real processes, real gRPC, real data
plane, real codecs), not image quality.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

DEMO_MODEL = "tiny-wan2.1"
DEMO_VAE = "tiny-wan2.1"
_MARKER = "stagecast-demo.json"


def write_transformer(folder: Path, *, seed: int, name: str = DEMO_MODEL, max_shard_bytes: int = 64 * 1024) -> None:
    from diffusers import WanTransformer3DModel

    from stage_service.checkpoint import write_checkpoint
    from stage_service.configs import model_config

    cfg = model_config(name)
    gen_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = WanTransformer3DModel(**cfg)
    finally:
        torch.random.set_rng_state(gen_state)
    write_checkpoint(folder, model.state_dict(), dict(model.config), max_shard_bytes=max_shard_bytes)


def write_demo_checkpoint(out: str | Path, *, seed: int = 0) -> Path:
    root = Path(out).expanduser()
    marker = root / _MARKER
    if marker.exists():
        return root
    root.mkdir(parents=True, exist_ok=True)
    from stage_service.configs import model_config

    text_dim = model_config(DEMO_MODEL)["text_dim"]
    write_transformer(root / "transformer", seed=seed)
    from gateway.text_encoder import write_tiny_text_encoder

    write_tiny_text_encoder(root, d_model=text_dim, seed=seed)
    try:
        from gateway.stream_vae import write_tiny_vae
    except ImportError:
        write_tiny_vae = None
    if write_tiny_vae is not None:
        write_tiny_vae(root / "vae", name=DEMO_VAE, seed=seed)
    marker.write_text(json.dumps({"model": DEMO_MODEL, "vae": DEMO_VAE, "seed": seed}))
    logger.info("wrote demo checkpoint to %s", root)
    return root
