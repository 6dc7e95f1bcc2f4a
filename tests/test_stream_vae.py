"""StreamVAE: chunked decode of a stream is bit-exact against the one-shot diffusers decode.

Tiny random ``AutoencoderKLWan`` models (Wan2.1-style and Wan2.2-style, same block structure as the real ones)
decode a 6-latent-frame video; every chunking must reproduce ``vae.decode`` after WanPipeline's de-normalisation
with zero difference, and so must a chain of decoder slices.
"""

from __future__ import annotations

import inspect
import io

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKLWan
from diffusers.video_processor import VideoProcessor

from gateway.decode.stream_vae import (
    StreamVAE,
    StreamVAESlice,
    decoder_units,
    frames_for_chunk,
    split_decoder,
    to_uint8_frames,
    unit_macs,
)
from stagecast.model.vae_configs import CONFIGS, spatial_factor, temporal_factor, vae_config

pytestmark = pytest.mark.parity

# Non-square, so an H/W mix-up shows. At 4x6 the CPU post_quant_conv gives the same bits for any frame count, so the
# one-shot decode is a bit-exact oracle; the 2x4 test below covers a size where it is not.
T, H, W = 6, 4, 6
CHUNKINGS = [[1, 2, 3], [3, 3], [2, 1, 1, 2], [6]]
SEEDS = {"tiny-wan2.1": 0, "tiny-wan2.2": 1}


def build_vae(name: str) -> AutoencoderKLWan:
    torch.manual_seed(SEEDS[name])
    return AutoencoderKLWan(**vae_config(name)).eval()


def pipeline_denormalise(vae: AutoencoderKLWan, latents: torch.Tensor) -> torch.Tensor:
    """WanPipeline.__call__'s de-normalisation before vae.decode, verbatim."""
    latents = latents.to(vae.device, dtype=vae.dtype)
    latents_mean = (
        torch.tensor(vae.config.latents_mean).view(1, vae.config.z_dim, 1, 1, 1).to(latents.device, latents.dtype)
    )
    latents_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, vae.config.z_dim, 1, 1, 1).to(
        latents.device, latents.dtype
    )
    return latents / latents_std + latents_mean


class Case:
    def __init__(self, name: str):
        self.name = name
        self.vae = build_vae(name)
        self.stream = StreamVAE(self.vae)
        gen = torch.Generator().manual_seed(100 + SEEDS[name])
        self.latents = torch.randn(1, self.vae.config.z_dim, T, H, W, generator=gen)
        self.other_latents = torch.randn(1, self.vae.config.z_dim, T, H, W, generator=gen)
        self.reference = self.one_shot(self.latents)

    @torch.no_grad()
    def one_shot(self, latents: torch.Tensor) -> torch.Tensor:
        return self.vae.decode(pipeline_denormalise(self.vae, latents)).sample


@pytest.fixture(scope="module", params=["tiny-wan2.1", "tiny-wan2.2"])
def case(request) -> Case:
    return Case(request.param)


def chunks(latents: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    return list(latents.split(sizes, dim=2))


def decode_stream(decoders, latents: torch.Tensor, sizes: list[int], states=None) -> torch.Tensor:
    """Run a stream through a decoder or a chain of slices, chunk by chunk (filling ``states`` if given)."""
    decoders = decoders if isinstance(decoders, list) else [decoders]
    if states is None:
        states = []
    states += [d.new_state() for d in decoders]
    outs = []
    for chunk in chunks(latents, sizes):
        x = chunk
        for d, s in zip(decoders, states):
            x = d.decode_chunk(s, x)
        outs.append(x)
    return torch.cat(outs, dim=2)


# -- configs -----------------------------------------------------------------------------------------------------


def test_wan21_config_is_the_diffusers_default():
    defaults = {k: p.default for k, p in inspect.signature(AutoencoderKLWan.__init__).parameters.items() if k != "self"}
    assert vae_config("wan2.1") == defaults


def test_wan22_config_has_48_channel_statistics_and_16x_spatial_factor():
    cfg = vae_config("wan2.2")
    assert cfg["z_dim"] == len(cfg["latents_mean"]) == len(cfg["latents_std"]) == 48
    assert (cfg["base_dim"], cfg["decoder_base_dim"], cfg["patch_size"]) == (160, 256, 2)
    assert all(s > 0 for s in cfg["latents_std"])


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_factors_derived_from_architecture_match_declared_scale_factors(name):
    cfg = vae_config(name)
    assert spatial_factor(cfg) == cfg["scale_factor_spatial"]
    assert temporal_factor(cfg) == cfg["scale_factor_temporal"]


def test_vae_config_returns_a_fresh_copy_and_rejects_unknown_names_and_keys():
    cfg = vae_config("tiny-wan2.1", num_res_blocks=1)
    cfg["latents_mean"][0] = 123.0
    assert vae_config("tiny-wan2.1")["latents_mean"][0] != 123.0
    assert cfg["num_res_blocks"] == 1
    with pytest.raises(KeyError, match="unknown VAE config"):
        vae_config("wan9")
    with pytest.raises(KeyError, match="clip_output"):
        vae_config("wan2.1", clip_output=True)


# -- chunked decode ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sizes", CHUNKINGS, ids=lambda s: "-".join(map(str, s)))
def test_chunked_decode_is_bit_exact_against_one_shot_decode(case, sizes):
    video = decode_stream(case.stream, case.latents, sizes)
    assert video.shape == case.reference.shape
    assert torch.equal(video, case.reference)


def test_chunking_never_changes_the_output_even_where_the_one_shot_conv_numerics_differ(case):
    """The one-shot decode runs post_quant_conv over all T frames at once, and conv kernels need not give the same
    bits for T=6 as for T=1 (on a 2x4 latent the CPU kernels differ by ~5e-7). StreamVAE runs it one frame at a
    time, so every chunking gives the same bits; against the one-shot decode it is then only close."""
    latents = case.latents[:, :, :, :2, :4]
    outs = [decode_stream(case.stream, latents, sizes) for sizes in CHUNKINGS]
    assert all(torch.equal(out, outs[0]) for out in outs[1:])
    torch.testing.assert_close(outs[0], case.one_shot(latents), rtol=0, atol=1e-5)


def test_frames_per_chunk_are_1_plus_4_times_t_minus_1_then_4_times_t(case):
    assert frames_for_chunk(True, 1) == 1 and frames_for_chunk(True, 3) == 9 and frames_for_chunk(False, 3) == 12
    sf = spatial_factor(case.vae.config)
    state = case.stream.new_state()
    for i, chunk in enumerate(chunks(case.latents, [2, 1, 3])):
        before = state.frames_decoded
        video = case.stream.decode_chunk(state, chunk)
        assert video.shape == (1, 3, frames_for_chunk(i == 0, chunk.shape[2]), H * sf, W * sf)
        assert state.frames_decoded == before + video.shape[2]
    assert state.frames_decoded == 1 + 4 * (T - 1) == case.reference.shape[2]
    assert state.latent_frames == T
    assert state.approx_bytes > 0


def test_interleaved_streams_do_not_interfere(case):
    a, b = case.stream.new_state(), case.stream.new_state()
    out_a, out_b = [], []
    for ca, cb in zip(chunks(case.latents, [2, 1, 3]), chunks(case.other_latents, [1, 3, 2])):
        out_a.append(case.stream.decode_chunk(a, ca))
        out_b.append(case.stream.decode_chunk(b, cb))
    assert torch.equal(torch.cat(out_a, 2), case.reference)
    assert torch.equal(torch.cat(out_b, 2), case.one_shot(case.other_latents))


def test_state_saved_with_torch_save_continues_exactly_in_a_fresh_instance(case):
    # Hand the stream to the other instance after every chunk, so the snapshot is taken in each cache phase:
    # after frame 0 (None and "Rep" slots, one-frame tensors), after frame 2, and in steady state.
    fresh = StreamVAE(build_vae(case.name))  # same seed, so same weights, but no shared objects
    decoders = [case.stream, fresh]
    state, outs = case.stream.new_state(), []
    for i, chunk in enumerate(chunks(case.latents, [1, 1, 2, 2])):
        decoder = decoders[i % 2]
        if i:
            buf = io.BytesIO()
            torch.save(state.state_dict(), buf)
            buf.seek(0)
            state = decoder.load_state(torch.load(buf))  # default weights_only=True: the snapshot is plain data
        outs.append(decoder.decode_chunk(state, chunk))
    assert state.latent_frames == T and state.latent_hw == (H, W)
    assert torch.equal(torch.cat(outs, 2), case.reference)


def test_bfloat16_decode_matches_the_pipeline_bit_for_bit():
    # In bf16, z * std + mean is not z / (1 / std) + mean; the stream must de-normalise the pipeline's way.
    vae = build_vae("tiny-wan2.1").to(torch.bfloat16)
    latents = torch.randn(1, 16, 3, H, W, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        reference = vae.decode(pipeline_denormalise(vae, latents)).sample
    assert reference.dtype == torch.bfloat16
    assert torch.equal(decode_stream(StreamVAE(vae), latents, [1, 2]), reference)


def test_wrong_latent_channel_count_raises_a_value_error_naming_the_expected_shape(case):
    z_dim = case.vae.config.z_dim
    bad = torch.zeros(1, z_dim + 1, 2, H, W)
    with pytest.raises(ValueError, match=rf"\(1, {z_dim}, T, h, w\).*\(1, {z_dim + 1}, 2, {H}, {W}\)"):
        case.stream.decode_chunk(case.stream.new_state(), bad)


def test_latent_size_change_mid_stream_is_rejected(case):
    state = case.stream.new_state()
    case.stream.decode_chunk(state, case.latents[:, :, :1])
    with pytest.raises(ValueError, match=f"{H}x{W}"):
        case.stream.decode_chunk(state, case.latents[:, :, 1:2, :, :2])


def test_released_state_holds_nothing_and_cannot_be_used(case):
    state = case.stream.new_state()
    case.stream.decode_chunk(state, case.latents[:, :, :2])
    case.stream.release(state)
    assert state.approx_bytes == 0
    with pytest.raises(ValueError, match="released"):
        case.stream.decode_chunk(state, case.latents[:, :, 2:3])


def test_from_folder_loads_what_save_pretrained_wrote(case, tmp_path):
    case.vae.save_pretrained(tmp_path)
    loaded = StreamVAE.from_folder(tmp_path, dtype=torch.float32, device="cpu")
    assert torch.equal(decode_stream(loaded, case.latents, [3, 3]), case.reference)


# -- uint8 conversion --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_uint8_frames_equal_the_diffusers_video_processor_output(dtype):
    gen = torch.Generator().manual_seed(7)
    video = torch.rand(1, 3, 5, 8, 10, generator=gen) * 2.4 - 1.2  # includes values outside [-1, 1]
    video[0, :, 0, 0, :3] = torch.tensor([-1.0, 0.0, 1.0])
    video = video.to(dtype)
    frames = to_uint8_frames(video)
    assert frames.shape == (5, 8, 10, 3) and frames.dtype == torch.uint8
    pil = VideoProcessor(vae_scale_factor=8).postprocess_video(video, output_type="pil")[0]
    expected = np.stack([np.asarray(img) for img in pil])
    assert np.array_equal(frames.numpy(), expected)
    assert frames[0, 0, 0].tolist() == [0, 0, 0]


# -- decoder slices ----------------------------------------------------------------------------------------------


def test_every_single_cut_of_the_decoder_is_bit_exact(case):
    full_states = []
    decode_stream(case.stream, case.latents, [T], full_states)
    for cut in range(1, len(decoder_units(case.vae))):
        slices, states = split_decoder(case.vae, 2, boundaries=[cut]), []
        assert torch.equal(decode_stream(slices, case.latents, [1, 2, 3], states), case.reference), cut
        # The slices own disjoint parts of the same cache: together they hold exactly what the full decoder does.
        assert sum(st.approx_bytes for st in states) == full_states[0].approx_bytes, cut


def test_three_way_balanced_split_is_bit_exact_and_covers_the_decoder(case):
    slices = split_decoder(case.vae, 3)
    assert len(slices) == 3 and slices[0].start == 0 and slices[-1].stop == len(decoder_units(case.vae))
    assert all(a.stop == b.start for a, b in zip(slices, slices[1:]))
    assert torch.equal(decode_stream(slices, case.latents, [2, 1, 1, 2]), case.reference)


def test_unit_costs_grow_with_resolution(case):
    costs = unit_macs(case.vae)
    names = [u.name for u in decoder_units(case.vae)]
    assert len(costs) == len(names) and all(c > 0 for c in costs)
    # The last up block runs at full resolution and dominates the first.
    assert costs[names.index("up_blocks.3")] > costs[names.index("up_blocks.0")]


def test_a_whole_decoder_slice_equals_stream_vae(case):
    whole = StreamVAESlice(case.vae, 0, len(decoder_units(case.vae)))
    assert whole.num_slots == case.stream.num_slots
    assert torch.equal(decode_stream(whole, case.latents, [3, 3]), case.reference)


def test_slice_rejects_a_frame_count_that_is_not_whole_latent_frames(case):
    head = StreamVAESlice(case.vae, len(decoder_units(case.vae)) - 1, len(decoder_units(case.vae)))
    state = head.new_state()
    with pytest.raises(ValueError, match="multiple of 4"):
        head.decode_chunk(state, torch.zeros(1, 8, 3, 2, 2))  # checked before any layer runs
