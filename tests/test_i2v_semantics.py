"""Image-to-video (Wan2.2-TI2V first frame): latent frame 0 is the clean image latent at timestep 0 in every forward.

Pinned two ways: one chunk holding the whole clip equals diffusers' ``WanImageToVideoPipeline(expand_timesteps=True)``
run with the same noise, ladder and image, bit for bit (that pipeline is bidirectional over the clip, so a single
chunk is the comparable case); and a stream of several chunks equals, level by level, one masked full-sequence
forward over [image, every later chunk's level-i input] with per-token timesteps 0 on the image frame.  A model that
takes one timestep per item cannot condition on an image and is refused naming the field.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanImageToVideoPipeline
from PIL import Image

from gateway.decode.stream_vae import StreamVAEEncoder
from launcher.reference import ReferenceExecutor, StreamRequest
from stage_service.dit_slice import DiTSlice
from stage_service.sampler import FlowSampler, chunk_noise
from stagecast.microstep import StreamSpec
from stagecast.model.vae_configs import vae_config
from stagecast.sampling import as_f32
from tests.oracle import chunkwise_patch_embedding, frame_mask, set_self_mask

pytestmark = pytest.mark.parity

H = W = 64  # the tiny Wan2.2 VAE is 16x spatially: 4x4 latents, 2x2 patches -> 4 tokens per frame
TPF = 4


def image_and_latent(vae):
    rgb = np.random.default_rng(5).integers(0, 256, (H, W, 3), dtype=np.uint8)
    enc = StreamVAEEncoder(vae)
    x = torch.from_numpy(rgb).permute(2, 0, 1)[None, :, None].float() / 255.0 * 2.0 - 1.0
    return Image.fromarray(rgb), enc.encode_frames(enc.new_state(), x)


def spec_for(**kw):
    base = dict(stream_id=1, latent_channels=48, chunk_frames=1, latent_height=4, latent_width=4, seed=3)
    base.update(kw)
    return StreamSpec(**base, image_latents=True)


def test_a_one_chunk_clip_equals_diffusers_wan_image_to_video_pipeline(tiny_model):
    model = tiny_model("tiny-wan2.2-ti2v")
    torch.manual_seed(1)
    vae = AutoencoderKLWan(**vae_config("tiny-wan2.2")).eval()
    scheduler = FlowMatchEulerDiscreteScheduler(shift=1.0)
    pipe = WanImageToVideoPipeline(
        tokenizer=None, text_encoder=None, vae=vae, scheduler=scheduler, transformer=model, expand_timesteps=True
    )
    scheduler.set_timesteps(3)
    ladder = tuple(as_f32(float(t)) for t in scheduler.timesteps)
    spec = spec_for(chunk_frames=3, num_chunks=1, timesteps=ladder, sampler="euler", text_len=16)
    text = torch.randn(1, 16, model.config.text_dim, generator=torch.Generator().manual_seed(2))
    image, latent = image_and_latent(vae)
    noise = chunk_noise(spec, 0, 0)
    with torch.no_grad():
        want = pipe(
            image=image,
            prompt_embeds=text,
            guidance_scale=1.0,
            height=H,
            width=W,
            num_frames=9,
            num_inference_steps=3,
            latents=noise.clone(),
            output_type="latent",
        ).frames
    full = DiTSlice.from_model(model, layers=range(model.config.num_layers), first=True, last=True)
    got = ReferenceExecutor(full).generate([StreamRequest(spec, text, image=latent)]).chunks[1][0]
    assert got.shape == want.shape == (1, 48, 3, 4, 4)
    assert torch.equal(got[:, :, :1], want[:, :, :1]) and torch.equal(got[:, :, :1], latent)  # the image frame
    # Bit for bit: the pipeline's per-token timesteps and Euler steps from its float32 sigmas give the same numbers
    # as the stream's ladder math on this ladder.
    assert torch.equal(got, want), (got - want).abs().max().item()
    # The image steers the clip: with another image the later frames change.
    other = ReferenceExecutor(full).generate([StreamRequest(spec, text, image=latent.flip(-1))]).chunks[1][0]
    assert not torch.allclose(other[:, :, 1:], got[:, :, 1:], atol=1e-3)


@pytest.mark.parametrize("policy", ["per_level", "clean"])
def test_a_stream_with_an_image_frame_equals_the_masked_full_sequence_oracle(tiny_model, policy):
    model = tiny_model("tiny-wan2.2-ti2v")
    n = 3
    spec = spec_for(num_chunks=n, timesteps=(1000.0, 500.0), policy=policy, text_len=16)
    text = torch.randn(1, 16, model.config.text_dim, generator=torch.Generator().manual_seed(8))
    latent = torch.randn(1, 48, 1, 4, 4, generator=torch.Generator().manual_seed(4))
    calls, inputs = {}, {}
    full = DiTSlice.from_model(model, layers=range(model.config.num_layers), first=True, last=True)

    def trace(steps, flow, results):
        for i, st in enumerate(steps):
            calls[st] = flow[i : i + 1].clone()

    ref = ReferenceExecutor(full, trace=trace)
    take = ref.runner.take_latent
    ref.runner.take_latent = lambda step: inputs.setdefault(step, take(step).clone())
    out = ref.generate([StreamRequest(spec, text, image=latent)], num_stages=2).chunks[1]
    assert torch.equal(out[0], latent) and all(not torch.equal(c, latent) for c in out[1:])
    chunkwise_patch_embedding(model, 1)
    sampler = FlowSampler(spec)
    for level in range(spec.steps):
        # per_level: every chunk's level-i input; clean: earlier chunks at their clean latents at t=0 (the image frame
        # is its own clean latent), built per chunk below.
        level_inputs = [inputs[s] for s in sorted(inputs, key=lambda s: s.chunk) if s.level == level]
        context = torch.cat(level_inputs, dim=2)
        for c in range(n):
            st = next(s for s in calls if s.chunk == c and s.level == level)
            if policy == "per_level":
                t = torch.full((1, n * TPF), sampler.model_timestep(level))
                t[:, :TPF] = 0.0  # the image frame
                set_self_mask(model, frame_mask(spec, n, TPF))
                want = model(context, t, text, return_dict=False)[0][:, :, c : c + 1]
            else:
                clean = [out[k] for k in range(c)]
                seq = torch.cat([*clean, inputs[st]], dim=2)
                t = torch.zeros((1, (c + 1) * TPF))
                t[:, c * TPF :] = sampler.model_timestep(level)
                t[:, :TPF] = 0.0
                set_self_mask(model, frame_mask(spec, c + 1, TPF))
                want = model(seq, t, text, return_dict=False)[0][:, :, c : c + 1]
            assert (calls[st] - want).abs().max() < 5e-6, (policy, level, c)


def test_a_model_with_one_timestep_per_item_cannot_take_an_image(tiny_model):
    model = tiny_model("tiny-wan2.1")
    full = DiTSlice.from_model(model, layers=range(model.config.num_layers), first=True, last=True)
    spec = spec_for(latent_channels=16, num_chunks=1, text_len=16)
    text = torch.zeros(1, 16, model.config.text_dim)
    with pytest.raises(ValueError, match="^image: this model cannot condition on an image"):
        ReferenceExecutor(full).runner.open_stream(spec, text, torch.zeros(1, 16, 1, 4, 4))
