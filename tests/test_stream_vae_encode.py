"""StreamVAEEncoder: a stream encoded frame group by frame group equals the one-shot diffusers encode, bit for bit.

The oracle is what ``WanVideoToVideoPipeline.prepare_latents`` computes: ``vae.encode(video).latent_dist.mode()``
(``sample_mode="argmax"``), then ``(z - latents_mean) * (1 / latents_std)``.  Tiny random Wan2.1- and Wan2.2-style
VAEs (the 2.2 one patchifies), 13 frames, and the input split every way a live source may deliver it.
"""

from __future__ import annotations

import pytest
import torch
from diffusers import AutoencoderKLWan

from gateway.decode.stream_vae import StreamVAEEncoder
from stagecast.model.vae_configs import spatial_factor, vae_config

pytestmark = pytest.mark.parity

FRAMES = 13  # 1 + 4 * 3: four latent frames
SPLITS = [[13], [1, 4, 4, 4], [3, 5, 2, 3], [1] * 13, [2, 11]]
SEEDS = {"tiny-wan2.1": 0, "tiny-wan2.2": 1}


def build_vae(name: str) -> AutoencoderKLWan:
    torch.manual_seed(SEEDS[name])
    return AutoencoderKLWan(**vae_config(name)).eval()


def oracle(vae: AutoencoderKLWan, video: torch.Tensor) -> torch.Tensor:
    """WanVideoToVideoPipeline.prepare_latents, verbatim, for one video."""
    with torch.no_grad():
        z = vae.encode(video).latent_dist.mode()
    mean = torch.tensor(vae.config.latents_mean).view(1, vae.config.z_dim, 1, 1, 1).to(z.device, z.dtype)
    inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, vae.config.z_dim, 1, 1, 1).to(z.device, z.dtype)
    return (z - mean) * inv_std


@pytest.fixture(scope="module", params=sorted(SEEDS))
def case(request):
    vae = build_vae(request.param)
    s = spatial_factor(vae.config)
    gen = torch.Generator().manual_seed(7)
    video = torch.rand(1, 3, FRAMES, 4 * s, 6 * s, generator=gen) * 2 - 1  # non-square: an H/W mix-up shows
    return vae, video, oracle(vae, video)


@pytest.mark.parametrize("split", SPLITS, ids=lambda s: "-".join(map(str, s)))
def test_streaming_encode_equals_one_shot(case, split):
    vae, video, expected = case
    enc = StreamVAEEncoder(vae)
    state = enc.new_state()
    outs, start = [], 0
    for n in split:
        z = enc.encode_frames(state, video[:, :, start : start + n])
        start += n
        produced = 1 + (start - 1) // 4  # latent frames completed by the first `start` frames
        assert state.latent_frames == produced
        if z is not None:
            outs.append(z)
    got = torch.cat(outs, dim=2)
    assert got.shape == expected.shape == (1, vae.config.z_dim, 4, 4, 6)
    assert torch.equal(got, expected), (got - expected).abs().max().item()
    enc.release(state)
    assert state.approx_bytes == 0


def test_frames_wait_for_a_whole_group(case):
    vae, video, expected = case
    enc = StreamVAEEncoder(vae)
    state = enc.new_state()
    assert enc.encode_frames(state, video[:, :, :1]).shape[2] == 1
    for i in range(1, 4):
        assert enc.encode_frames(state, video[:, :, i : i + 1]) is None
    z = enc.encode_frames(state, video[:, :, 4:5])
    assert torch.equal(z, expected[:, :, 1:2])
    assert state.approx_bytes > 0


def test_bad_frames_are_refused(case):
    vae, video, _ = case
    enc = StreamVAEEncoder(vae)
    state = enc.new_state()
    with pytest.raises(ValueError, match=r"\(1, 3, n, H, W\)"):
        enc.encode_frames(state, video[0])
    with pytest.raises(ValueError, match="not a multiple"):
        enc.encode_frames(state, video[:, :, :1, :-1])
    enc.encode_frames(state, video[:, :, :1])
    s = spatial_factor(vae.config)
    with pytest.raises(ValueError, match="stream frames are"):
        enc.encode_frames(state, video[:, :, 1:2, : 2 * s])
    enc.release(state)
    with pytest.raises(ValueError, match="released"):
        enc.encode_frames(state, video[:, :, 1:2])
