"""The tiny random checkpoint behind ``stagecast demo``, tests and the CPU Helm values.

Usage::

    root = write_demo_checkpoint("~/.cache/stagecast/demo")   # idempotent: reuses a complete folder
    # root/transformer  tiny Wan2.1-style DiT (diffusers layout, sharded so stages read only their shards)
    # root/text_encoder root/tokenizer   tiny UMT5 + offline tokenizer (d_model == the DiT's text_dim)
    # root/vae          tiny Wan2.1-style VAE
    # root/stagecast.json  the gateway's serving defaults for it (text length 32, 64x64 frames)

The weights are random: the demo proves the system end to end (real processes, real gRPC, real data
plane, real codecs), not image quality.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import torch

from stagecast.api import DEFAULT_FPS
from stagecast.flags import HelpFormatter

logger = logging.getLogger(__name__)

DEMO_MODEL = "tiny-wan2.1"
DEMO_VAE = "tiny-wan2.1"
_MARKER = "stagecast-demo.json"
PARTS = ("transformer", "text_encoder", "tokenizer", "vae")
SERVING_DEFAULTS = "stagecast.json"  # read by gateway.checkpoint.ServingDefaults
DEMO_SERVING = {"text_len": 32, "width": 64, "height": 64, "fps": DEFAULT_FPS, "steps": 2}


def write_transformer(
    folder: Path,
    *,
    seed: int,
    name: str = DEMO_MODEL,
    max_shard_bytes: int = 64 * 1024,
    layout: str = "diffusers",
    **overrides,
) -> None:
    """Write a random transformer of a named config (``stagecast.model.dit_configs``).

    ``layout="original"`` writes the Wan-AI key names and ``WanModel`` config (as CausVid / Self-Forcing ship).
    """
    from diffusers import WanTransformer3DModel

    from stage_service.checkpoint import write_checkpoint
    from stagecast.model.dit_configs import model_config

    cfg = model_config(name, **overrides)
    gen_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = WanTransformer3DModel(**cfg)
    finally:
        torch.random.set_rng_state(gen_state)
    write_checkpoint(folder, model.state_dict(), dict(model.config), layout=layout, max_shard_bytes=max_shard_bytes)


def write_demo_checkpoint(out: str | Path, *, seed: int = 0, tiny_decoder: bool = False) -> Path:
    """Write (or complete) the demo checkpoint in ``out`` and return its path.

    ``tiny_decoder``: also a tiny streaming decoder with random weights in ``tiny_decoder/`` (``gateway.tiny_decoder``),
    so that a gateway on this checkpoint serves DECODER_TINY streams beside the VAE's (opt-in: it is ~45 MB and
    takes the gateway a second to load).

    Each part is written only if it is missing, so a folder from an older stagecast (e.g. without ``vae/``) is
    completed rather than rewritten; the marker file is written last, so an interrupted write is redone.
    """
    root = Path(out).expanduser()
    marker = root / _MARKER
    if marker.exists() and all((root / part).is_dir() for part in PARTS):
        if tiny_decoder:
            _write_tiny_decoder(root, seed)
        return root
    root.mkdir(parents=True, exist_ok=True)
    from stagecast.model.dit_configs import model_config

    text_dim = model_config(DEMO_MODEL)["text_dim"]
    if not (root / "transformer" / "config.json").exists():
        write_transformer(root / "transformer", seed=seed)
    if not (root / "text_encoder" / "config.json").exists() or not (root / "tokenizer").is_dir():
        from gateway.text_encoder import write_tiny_text_encoder

        write_tiny_text_encoder(root, d_model=text_dim, seed=seed)
    if not (root / "vae" / "config.json").exists():
        from gateway.stream_vae import write_tiny_vae

        write_tiny_vae(root / "vae", name=DEMO_VAE, seed=seed)
    # Serving defaults the gateway reads (gateway.checkpoint): a short text length keeps the tiny model cheap, and a
    # small frame size keeps the CPU VAE fast. A real Wan checkpoint has no such file and gets 512 tokens, 832x480.
    (root / SERVING_DEFAULTS).write_text(json.dumps(DEMO_SERVING, indent=2) + "\n")
    if tiny_decoder:
        _write_tiny_decoder(root, seed)
    marker.write_text(json.dumps({"model": DEMO_MODEL, "vae": DEMO_VAE, "seed": seed}))
    logger.info("wrote demo checkpoint to %s", root)
    return root


def _write_tiny_decoder(root: Path, seed: int) -> None:
    folder = root / "tiny_decoder"
    if folder.is_dir() and any(folder.iterdir()):
        return
    from gateway.checkpoint import ModelInfo
    from gateway.tiny_decoder import write_tiny_decoder

    folder.mkdir(exist_ok=True)
    channels = ModelInfo.from_checkpoint(root).latent_channels
    write_tiny_decoder(folder / "random.pth", latent_channels=channels, seed=seed)


def add_parser(sub) -> None:
    p = sub.add_parser(
        "demo-checkpoint",
        help="write the tiny random demo checkpoint",
        formatter_class=HelpFormatter,
    )
    p.add_argument("--out", required=True, help="folder to write (transformer/, vae/, text_encoder/, tokenizer/)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    p.add_argument(
        "--tiny-decoder", action="store_true", help="also a tiny decoder (tiny_decoder/), for DECODER_TINY streams"
    )
    p.set_defaults(run=main)


def main(args: argparse.Namespace) -> int:
    path = write_demo_checkpoint(args.out, seed=args.seed, tiny_decoder=args.tiny_decoder)
    print(f"wrote demo checkpoint to {path}")
    return 0
