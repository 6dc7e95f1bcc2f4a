"""The checkpoint writers (``launcher.demo_checkpoint``, their one home): the same arguments write the same bytes, the
caller's torch RNG state is left as it was, another seed gives other weights, and the service that owns the format
loads what each writes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gateway.decode.stream_vae import StreamVAE
from gateway.decode.tiny_decoder import load_tiny_decoder
from gateway.text_encoder import TextEncoder
from launcher.demo_checkpoint import (
    write_random_checkpoint,
    write_tiny_decoder,
    write_tiny_text_encoder,
    write_tiny_vae,
    write_transformer,
)
from stage_service.checkpoint import load_slice_state_dict, model_shapes
from stagecast.model.config import read_config

pytestmark = pytest.mark.unit


def load_transformer(folder: Path) -> None:
    config = read_config(folder)
    _, sd = load_slice_state_dict(folder, layers=range(config["num_layers"]), first=True, last=True)
    assert len(sd) == len(model_shapes(config))


def load_text_encoder(folder: Path) -> None:
    assert TextEncoder(folder, max_len=8).encode("a red fox").shape == (1, 8, 32)


def load_vae(folder: Path) -> None:
    StreamVAE.from_folder(folder)


def load_decoder(folder: Path) -> None:
    load_tiny_decoder(folder / "t.pth")


# part -> (write(folder, seed), load(folder)); each writes a folder of its own.
WRITERS = {
    "transformer": (lambda out, seed: write_transformer(out, seed=seed, layout="original"), load_transformer),
    "random checkpoint": (
        lambda out, seed: write_random_checkpoint(out, "tiny-wan2.1", torch.float32, seed=seed),
        load_transformer,
    ),
    "text encoder": (lambda out, seed: write_tiny_text_encoder(out, d_model=32, seed=seed), load_text_encoder),
    "vae": (lambda out, seed: write_tiny_vae(out, seed=seed), load_vae),
    "tiny decoder": (
        lambda out, seed: write_tiny_decoder(out / "t.pth", latent_channels=16, seed=seed),
        load_decoder,
    ),
}


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("part", sorted(WRITERS))
def test_a_writer_repeats_its_bytes_leaves_the_callers_rng_and_writes_what_the_owning_service_loads(tmp_path, part):
    write, load = WRITERS[part]
    torch.manual_seed(123)
    state = torch.random.get_rng_state()
    written = {}
    for name, seed in (("a", 7), ("b", 7), ("c", 8)):
        (tmp_path / name).mkdir()
        write(tmp_path / name, seed)
        assert torch.equal(torch.random.get_rng_state(), state)
        written[name] = folder_bytes(tmp_path / name)
    assert written["a"] and written["a"] == written["b"]
    assert written["a"] != written["c"]
    load(tmp_path / "a")
