"""How the gateway holds two decoders (in process): which weights file a deployment's tiny decoder is, the uint8
mapping each decoder's video gets, and a tiny decoder serving a stream through the same ``LocalDecoder`` session
as the VAE."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from gateway.checkpoint import tiny_decoder_file
from gateway.decode.decoder import LocalDecoder, uint8_frames
from gateway.decode.tiny_decoder import load_tiny_decoder, tiny_to_uint8_frames
from launcher.demo_checkpoint import write_tiny_decoder

FULL = SimpleNamespace(output_range=(-1.0, 1.0))  # the Wan VAE's parts (gateway.decode.stream_vae.ChunkDecoder)
TINY = SimpleNamespace(output_range=(0, 1))  # a tiny decoder's (gateway.decode.tiny_decoder.TinyStreamDecoder)


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory):
    """Random weights in the published layout for 16-channel latents (Wan2.1's), written once."""
    return write_tiny_decoder(tmp_path_factory.mktemp("tiny") / "taew.pth", latent_channels=16)


@pytest.mark.unit
@pytest.mark.parametrize(
    "value,full,tiny",
    [
        (-1.0, 0, 0),  # the VAE's black; below a tiny decoder's range, clamped
        (0.0, 128, 0),  # the VAE's mid grey (127.5, half to even); a tiny decoder's black
        (0.5, 191, 128),  # 191.25; 127.5 -> 128
        (1.0, 255, 255),
    ],
)
def test_each_decoder_maps_its_own_range_to_uint8(value, full, tiny):
    video = torch.full((1, 3, 2, 4, 4), value)
    assert uint8_frames(FULL, video).unique().tolist() == [full]
    assert uint8_frames(TINY, video).unique().tolist() == [tiny]
    assert uint8_frames(FULL, video).shape == (2, 4, 4, 3)


@pytest.mark.unit
def test_a_part_with_another_range_is_refused():
    with pytest.raises(ValueError, match=r"\[0, 255\]"):
        uint8_frames(SimpleNamespace(output_range=(0, 255)), torch.zeros(1, 3, 1, 2, 2))


@pytest.mark.unit
def test_the_tiny_decoder_is_the_flags_file_else_the_one_file_in_the_checkpoints_tiny_decoder(tmp_path):
    assert tiny_decoder_file(tmp_path) is None  # neither: the full VAE only
    folder = tmp_path / "tiny_decoder"
    folder.mkdir()
    with pytest.raises(ValueError, match="exactly one .pth or .safetensors weights file, found none"):
        tiny_decoder_file(tmp_path)
    (folder / "taew2_1.pth").write_bytes(b"")
    (folder / "README.md").write_text("not weights")
    assert tiny_decoder_file(tmp_path) == folder / "taew2_1.pth"
    (folder / "taew2_2.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="found taew2_1.pth, taew2_2.safetensors"):
        tiny_decoder_file(tmp_path)
    flag = tmp_path / "elsewhere.pth"
    flag.write_bytes(b"")
    assert tiny_decoder_file(tmp_path, flag) == flag  # the flag wins over the folder
    with pytest.raises(ValueError, match="^--tiny-decoder .*: no such file"):
        tiny_decoder_file(tmp_path, tmp_path / "missing.pth")
    with pytest.raises(ValueError, match="^--tiny-decoder .*: must be a .pth or .safetensors"):
        tiny_decoder_file(tmp_path, folder / "README.md")


@pytest.mark.unit
def test_a_tiny_decoder_for_other_latents_is_refused_naming_the_flag(tiny_file):
    path = tiny_file
    with pytest.raises(ValueError, match="^--tiny-decoder .*decodes 16-channel latents; this checkpoint's DiT .* 48"):
        LocalDecoder.tiny(
            path, device="cpu", dtype=torch.float32, latent_channels=48, spatial_factor=8, temporal_factor=4
        )


@pytest.mark.unit
def test_a_tiny_decoder_serves_a_stream_through_a_local_session_with_its_own_mapping_and_depth(tiny_file):
    path = tiny_file
    decoder = LocalDecoder.tiny(
        path, device="cpu", dtype=torch.float32, latent_channels=16, spatial_factor=8, temporal_factor=4
    )
    assert decoder.depth(4) == 2  # one part: the consumer depth the gateway declares for a tiny stream
    gen = torch.Generator().manual_seed(0)
    chunks = [torch.randn(1, 16, 1, 1, 2, generator=gen) for _ in range(2)]
    session = decoder.open(capacity=4)
    try:
        for c, x in enumerate(chunks):
            assert session.submit(SimpleNamespace(index=c), x)
        session.finish()
        got = [frames for _tag, frames, _when in session.results()]
        assert session.state_bytes > 0  # the stream's MemBlock memories, counted as the VAE's cache is
    finally:
        session.close()
    assert session.state_bytes == 0
    reference = load_tiny_decoder(path)
    state = reference.new_state()
    want = [tiny_to_uint8_frames(reference.decode_chunk(state, x)).numpy() for x in chunks]
    assert [g.shape for g in got] == [(1, 8, 16, 3), (4, 8, 16, 3)]  # as the VAE: 1 frame, then 4
    assert all((g == w).all() for g, w in zip(got, want, strict=True))


@pytest.mark.unit
def test_the_demo_checkpoint_can_carry_a_tiny_decoder_its_gateway_accepts(tmp_path):
    from gateway.checkpoint import ModelInfo
    from launcher.demo_checkpoint import write_demo_checkpoint

    root = write_demo_checkpoint(tmp_path / "plain")
    assert tiny_decoder_file(root) is None  # opt-in: the suite's demo checkpoints stay as they were
    root = write_demo_checkpoint(root, tiny_decoder=True)  # completes an existing checkpoint
    model = ModelInfo.from_checkpoint(root)
    decoder = LocalDecoder.tiny(
        tiny_decoder_file(root),
        device="cpu",
        dtype=torch.float32,
        latent_channels=model.latent_channels,
        spatial_factor=model.spatial_factor,
        temporal_factor=model.temporal_factor,
    )
    assert decoder.parts[0].latent_channels == model.latent_channels
