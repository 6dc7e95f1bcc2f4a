"""The tiny (TAEHV-design) streaming decoder: the published key layout, refusals, exact streaming and batching."""

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from gateway.decode import tiny_decoder as td
from gateway.decode.tiny_decoder import load_tiny_decoder, tiny_to_uint8_frames
from launcher.demo_checkpoint import write_tiny_decoder

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    return {
        16: write_tiny_decoder(folder / "taew2_1.pth", latent_channels=16, patch_size=1, seed=1),
        48: write_tiny_decoder(folder / "taew2_2.pth", latent_channels=48, patch_size=2, seed=2),
    }


@pytest.fixture(scope="module")
def dec16(files):
    return load_tiny_decoder(files[16])


def latents(channels=16, frames=2, hw=(1, 2), seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, channels, frames, *hw, generator=g) * scale


def decode_in_chunks(decoder, x, sizes):
    state = decoder.new_state()
    outs = [decoder.decode_chunk(state, part) for part in x.split(sizes, dim=2)]
    return torch.cat(outs, dim=2), state


# ---- the published layout -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("channels,patch", [(16, 1), (48, 2)])
def test_the_published_key_layout_loads_and_infers_channels_and_patch(files, channels, patch):
    sd = torch.load(files[channels], weights_only=True)
    # The layout the published taew2_1 / taew2_2 files use: decoder.N... beside encoder.N... (ignored).
    assert sd["decoder.1.weight"].shape == (256, channels, 3, 3)
    assert sd["decoder.3.conv.0.weight"].shape == (256, 512, 3, 3)
    assert sd["decoder.13.conv.weight"].shape == (256, 128, 1, 1)
    assert sd["decoder.14.weight"].shape == (64, 128, 3, 3)
    assert sd["decoder.22.weight"].shape == (3 * patch * patch, 64, 3, 3)
    assert sd["encoder.17.weight"].shape == (channels, 64, 3, 3)
    decoder = load_tiny_decoder(files[channels])
    assert (decoder.latent_channels, decoder.patch_size, decoder.spatial_factor) == (channels, patch, 8 * patch)
    assert decoder.takes_latents and decoder.gives_video and decoder.output_range == (0, 1)
    loaded = decoder.model.state_dict()
    assert set(loaded) == {k for k in sd if k.startswith("decoder.")}
    assert all(torch.equal(loaded[k], sd[k]) for k in loaded)
    video = decoder.decode_chunk(decoder.new_state(), latents(channels, frames=2))
    assert video.shape == (1, 3, 5, 8 * patch, 2 * 8 * patch)


def test_safetensors_loads_the_same_weights_and_casts_to_the_requested_dtype(files, tmp_path):
    sd = torch.load(files[16], weights_only=True)
    path = tmp_path / "taew2_1.safetensors"
    save_file({k: v.half() for k, v in sd.items()}, str(path))
    decoder = load_tiny_decoder(path, dtype=torch.float32)
    assert decoder.dtype == torch.float32
    loaded = decoder.model.state_dict()
    assert all(torch.equal(loaded[k], sd[k].half().float()) for k in loaded)


def test_a_wider_tgrow_keeps_the_last_timestep_channels(files, dec16, tmp_path):
    sd = torch.load(files[16], weights_only=True)
    narrow = sd["decoder.7.conv.weight"]  # TGrow(256, stride 1): (256, 256, 1, 1)
    sd["decoder.7.conv.weight"] = torch.cat([torch.randn_like(narrow), narrow])  # a stride-2 TGrow's weights
    torch.save(sd, tmp_path / "wide.pth")
    wide = load_tiny_decoder(tmp_path / "wide.pth")
    assert torch.equal(wide.model.state_dict()["decoder.7.conv.weight"], narrow)
    x = latents(frames=1)
    assert torch.equal(wide.decode_chunk(wide.new_state(), x), dec16.decode_chunk(dec16.new_state(), x))


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda sd: sd.pop("decoder.10.conv.2.bias"), "missing key 'decoder.10.conv.2.bias'"),
        (lambda sd: sd.update({"decoder.23.weight": torch.zeros(3)}), "unexpected key 'decoder.23.weight'"),
        (lambda sd: sd.update({"decoder.14.weight": torch.zeros(64, 64, 3, 3)}), "key 'decoder.14.weight' has shape"),
        # a TGrow narrower than the module, or wider by no whole number of sub-frames, is no TGrow of this design
        (lambda sd: sd.update({"decoder.13.conv.weight": torch.zeros(128, 128, 1, 1)}), "'decoder.13.conv.weight'"),
        (lambda sd: sd.update({"decoder.13.conv.weight": torch.zeros(300, 128, 1, 1)}), "'decoder.13.conv.weight'"),
        (lambda sd: sd.update({"decoder.22.weight": torch.zeros(6, 64, 3, 3)}), "'decoder.22.weight'"),
        (lambda sd: sd.pop("decoder.1.weight"), "missing key 'decoder.1.weight'"),
        (lambda sd: sd.update({"decoder.8.weight": torch.zeros(128, 256, 3, 3, dtype=torch.int8)}), "not floating"),
    ],
)
def test_a_mismatched_file_is_refused_naming_the_key(files, tmp_path, edit, message):
    sd = torch.load(files[16], weights_only=True)
    edit(sd)
    torch.save(sd, tmp_path / "bad.pth")
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        load_tiny_decoder(tmp_path / "bad.pth")


def test_files_that_are_no_state_dict_or_too_large_are_refused(files, tmp_path, monkeypatch):
    torch.save([torch.zeros(1)], tmp_path / "list.pth")
    with pytest.raises(ValueError, match="flat state dict"):
        load_tiny_decoder(tmp_path / "list.pth")
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="safetensors"):
        load_tiny_decoder(tmp_path / "junk.safetensors")
    with pytest.raises(ValueError, match="does not exist"):
        load_tiny_decoder(tmp_path / "absent.pth")
    monkeypatch.setattr(td, "MAX_FILE_BYTES", 1000)
    with pytest.raises(ValueError, match="the limit is 1000"):
        load_tiny_decoder(files[16])


# ---- streaming ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def whole16(dec16):
    x = latents(frames=4, seed=3)
    return x, decode_in_chunks(dec16, x, [4])[0]


@pytest.mark.parametrize("sizes", [[1, 3], [2, 2], [3, 1], [1, 1, 1, 1]])
def test_chunk_by_chunk_equals_one_call_bit_for_bit(dec16, whole16, sizes):
    x, whole = whole16
    chunked, _ = decode_in_chunks(dec16, x, sizes)
    assert whole.shape == (1, 3, 13, 8, 16)
    assert torch.equal(chunked, whole)


def test_chunk_by_chunk_equals_one_call_with_the_patch(files):
    decoder = load_tiny_decoder(files[48])
    x = latents(48, frames=3, hw=(1, 1), seed=4)
    whole, _ = decode_in_chunks(decoder, x, [3])
    assert torch.equal(decode_in_chunks(decoder, x, [1, 2])[0], whole)


def test_frame_counts_are_4t_minus_3_then_4t(dec16):
    state = dec16.new_state()
    counts = [dec16.decode_chunk(state, latents(frames=t, hw=(1, 1), seed=t)).shape[2] for t in (3, 1, 2)]
    assert counts == [9, 4, 8]
    assert state.frames_decoded == 21 and state.latent_frames == 6


@pytest.mark.parametrize("hw", [(1, 1), (2, 3), (3, 5)])
def test_a_batch_of_streams_equals_each_decoded_alone_bit_for_bit(dec16, hw):
    # Three streams at different points: two fresh, one already one chunk in (its memory is not zeros).
    xs = [latents(frames=2 if hw == (1, 1) else 1, hw=hw, seed=10 + i) for i in range(3)]
    head = latents(frames=1, hw=hw, seed=20)
    alone = []
    for i, x in enumerate(xs):
        state = dec16.new_state()
        if i == 1:
            dec16.decode_chunk(state, head)
        alone.append((dec16.decode_chunk(state, x), state))
    states = [dec16.new_state() for _ in xs]
    dec16.decode_chunk(states[1], head)
    batched = dec16.decode_batch(states, xs)
    for (want, want_state), got, got_state in zip(alone, batched, states, strict=True):
        assert torch.equal(got, want)
        assert all(torch.equal(a, b) for a, b in zip(got_state.memory, want_state.memory, strict=True))
    # and the batch's memories carry on exactly: the next chunk of each, batched again, still matches alone
    nxt = [latents(frames=1, hw=hw, seed=30 + i) for i in range(3)]
    again = dec16.decode_batch(states, nxt)
    for (_, want_state), x, got in zip(alone, nxt, again, strict=True):
        assert torch.equal(got, dec16.decode_chunk(want_state, x))


def test_output_is_within_0_1_even_for_large_latents(dec16):
    video = dec16.decode_chunk(dec16.new_state(), latents(frames=1, scale=20.0))
    assert video.min() >= 0 and video.max() <= 1
    assert 0 < video.mean() < 1  # not all clamped to one end


def test_release_frees_the_state_and_a_released_state_is_refused(dec16):
    state = dec16.new_state()
    dec16.decode_chunk(state, latents(frames=1, hw=(1, 1)))
    # nine MemBlock inputs: 256 ch at 1x1, 128 at 2x2, 64 at 4x4, three each, fp32
    assert state.approx_bytes == 4 * 3 * (256 * 1 + 128 * 4 + 64 * 16)
    dec16.release(state)
    assert state.memory is None and state.approx_bytes == 0 and state.released
    with pytest.raises(ValueError, match="released"):
        dec16.decode_chunk(state, latents(frames=1))


def test_bad_chunks_are_refused_naming_what_is_wrong(dec16):
    with pytest.raises(ValueError, match=r"\(1, 16, T, h, w\)"):
        dec16.decode_chunk(dec16.new_state(), torch.zeros(1, 48, 1, 2, 3))
    with pytest.raises(ValueError, match=r"\(1, 16, T, h, w\)"):
        dec16.decode_chunk(dec16.new_state(), torch.zeros(2, 16, 1, 2, 3))
    with pytest.raises(ValueError, match="latent sides"):
        dec16.decode_chunk(dec16.new_state(), torch.zeros(1, 16, 1, td.MAX_LATENT_SIDE + 1, 1))
    with pytest.raises(ValueError, match="floating point"):
        dec16.decode_chunk(dec16.new_state(), torch.zeros(1, 16, 1, 2, 3, dtype=torch.int64))
    state = dec16.new_state()
    dec16.decode_chunk(state, latents(frames=1, hw=(1, 1)))
    with pytest.raises(ValueError, match="stream latents are 1x1, got 1x2"):
        dec16.decode_chunk(state, latents(frames=1, hw=(1, 2)))
    a, b = dec16.new_state(), dec16.new_state()
    with pytest.raises(ValueError, match="one shape"):
        dec16.decode_batch([a, b], [latents(frames=1), latents(frames=2)])
    with pytest.raises(ValueError, match="twice"):
        dec16.decode_batch([a, a], [latents(frames=1), latents(frames=1)])
    with pytest.raises(ValueError, match="2 states and 1 chunks"):
        dec16.decode_batch([a, b], [latents(frames=1)])


# ---- the [0, 1] -> uint8 mapping ----------------------------------------------------------------------------------


def test_uint8_mapping_is_round_255x_half_to_even_and_clamped():
    halves = torch.tensor([0.5, 1.5, 2.5, 3.5, 254.5]) / 255
    assert torch.equal(halves * 255, torch.tensor([0.5, 1.5, 2.5, 3.5, 254.5]))  # exact halves in float32
    values = torch.cat([halves, torch.tensor([0.0, 1.0, -0.2, 1.7, 0.25])])
    video = values.view(1, 1, -1, 1, 1).expand(1, 3, -1, 1, 1).clone()
    video[0, 1] = 0.0  # channel order: R stays the value, G is 0, B the value
    frames = tiny_to_uint8_frames(video)
    assert frames.dtype == torch.uint8 and frames.shape == (10, 1, 1, 3)
    assert frames[:, 0, 0, 0].tolist() == [0, 2, 2, 4, 254, 0, 255, 0, 255, 64]
    assert frames[:, 0, 0, 1].tolist() == [0] * 10
    with pytest.raises(ValueError, match=r"\(1, 3, F, H, W\)"):
        tiny_to_uint8_frames(torch.zeros(3, 2, 1, 1))


# ---- an independent oracle: the whole video at once, parallel over time -------------------------------------------


def parallel_decode(sd, x, patch):
    """Every layer over all frames at once (TAEHV's parallel path), straight from the weights."""
    h = x[0].permute(1, 0, 2, 3)  # (T, C, h, w)

    def conv(h, key, pad=1):
        return F.conv2d(h, sd[f"{key}.weight"], sd.get(f"{key}.bias"), padding=pad)

    h = torch.tanh(h / 3) * 3
    h = F.relu(conv(h, "decoder.1"))
    for first, stride in ((3, 1), (9, 2), (15, 2)):
        for i in range(first, first + 3):
            past = torch.cat([torch.zeros_like(h[:1]), h[:-1]])  # the same block's input one frame earlier
            r = F.relu(conv(torch.cat([h, past], 1), f"decoder.{i}.conv.0"))
            r = F.relu(conv(r, f"decoder.{i}.conv.2"))
            h = F.relu(conv(r, f"decoder.{i}.conv.4") + h)
        h = F.interpolate(h, scale_factor=2, mode="nearest")
        grown = F.conv2d(h, sd[f"decoder.{first + 4}.conv.weight"])  # (T, s C, H, W): sub-frames in channel groups
        h = grown.reshape(h.shape[0] * stride, h.shape[1], *h.shape[2:])
        h = conv(h, f"decoder.{first + 5}")
    h = conv(F.relu(h), "decoder.22")
    if patch > 1:
        h = F.pixel_shuffle(h, patch)
    return h.clamp(0, 1)[3:].permute(1, 0, 2, 3).unsqueeze(0)


@pytest.mark.parametrize("channels,patch", [(16, 1), (48, 2)])
def test_streaming_agrees_with_a_parallel_whole_video_oracle(files, channels, patch):
    sd = torch.load(files[channels], weights_only=True)
    decoder = load_tiny_decoder(files[channels])
    x = latents(channels, frames=3, hw=(1, 2), seed=5)
    want = parallel_decode(sd, x, patch)
    got, _ = decode_in_chunks(decoder, x, [1, 2])
    assert got.shape == want.shape == (1, 3, 9, 8 * patch, 16 * patch)
    assert torch.allclose(got, want, atol=1e-5, rtol=0)
    assert (want > 0).float().mean() > 0.5  # the comparison is over real values, not clamped zeros


# ---- against upstream's own module --------------------------------------------------------------------------------

# Recorded from madebyollin/taehv's taehv.py (commit 1f14a56) with the weights ``write_tiny_decoder(path,
# latent_channels=C, patch_size=P, seed=7)`` writes: ``TAEHV(checkpoint_path=None, patch_size=P, latent_channels=C)``,
# ``load_state_dict`` of that file (its keys, encoder included, are upstream's exactly), then ``decode_video`` of
# ``torch.randn(1, C, 3, 1, 2, generator=torch.Generator().manual_seed(11))`` (as NTCHW, ``parallel=False``), CPU
# fp32. Ours gave the same bits there. Re-record them if ``write_tiny_decoder``'s initialisation changes.
UPSTREAM = {
    (16, 1): (
        [0.489683, 0.423603, 0.525695, 0.416232, 0.470413, 0.442261, 0.502001, 0.445676, 0.485276],
        [0.383181, 0.497131, 0.412369, 0.513104, 0.365031, 0.474321, 0.438699, 0.420125, 0.403362]
        + [0.441647, 0.558098, 0.517604, 0.592576, 0.525929, 0.584531, 0.482456, 0.585605, 0.537282]
        + [0.524004, 0.491429, 0.561528, 0.523929, 0.458409, 0.512015, 0.548109, 0.477717, 0.510123],
    ),
    (48, 2): (
        [0.522644, 0.480671, 0.515775, 0.487873, 0.524218, 0.494128, 0.523784, 0.472746, 0.522791],
        [0.515749, 0.428448, 0.507856, 0.414196, 0.528725, 0.395556, 0.492469, 0.464173, 0.519378]
        + [0.519185, 0.586319, 0.513889, 0.55318, 0.523043, 0.564625, 0.483746, 0.567762, 0.52253]
        + [0.485927, 0.515586, 0.506732, 0.531491, 0.511532, 0.415139, 0.464891, 0.544186, 0.434519],
    ),
}


@pytest.mark.parametrize("channels,patch", sorted(UPSTREAM))
def test_agrees_with_values_recorded_from_upstreams_module(tmp_path, channels, patch):
    decoder = load_tiny_decoder(
        write_tiny_decoder(tmp_path / "t.pth", latent_channels=channels, patch_size=patch, seed=7)
    )
    x = torch.randn(1, channels, 3, 1, 2, generator=torch.Generator().manual_seed(11))
    state = decoder.new_state()
    video = torch.cat([decoder.decode_chunk(state, x[:, :, :1]), decoder.decode_chunk(state, x[:, :, 1:])], dim=2)
    means, pixel = UPSTREAM[(channels, patch)]
    assert video.shape == (1, 3, 9, 8 * patch, 16 * patch)
    assert torch.allclose(video.mean(dim=(0, 1, 3, 4)), torch.tensor(means), atol=1e-5, rtol=0)
    assert torch.allclose(video[0, :, :, 0, 0].flatten(), torch.tensor(pixel), atol=1e-5, rtol=0)
