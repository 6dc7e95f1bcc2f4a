"""The gateway's video-to-video input path without a pipeline: config checks, frame decoding, chunking, noising,
and the input clock (LIVE drops counted, BACKPRESSURE waits, a stall ends the input)."""

from __future__ import annotations

import io
import threading

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKLWan
from PIL import Image

from gateway.checkpoint import ModelInfo, ServingDefaults
from gateway.decode.stream_vae import StreamVAEEncoder
from gateway.edge.config import ConfigError, resolve_config
from gateway.stream.video_input import InputPath, decode_frame, input_noise, noise_to
from stagecast.client import stream_config
from stagecast.model.vae_configs import vae_config
from stagecast.sampling import SamplerConfig, sigmas
from stagecast.v1 import stream_pb2 as pb

pytestmark = pytest.mark.unit

W, H = 48, 32
MODEL = ModelInfo(latent_channels=16, patch_hw=(2, 2), spatial_factor=8, temporal_factor=4)
SAMPLER = SamplerConfig(ladder=(700.0, 500.0), even_from=None)
DEFAULTS = ServingDefaults(text_len=16, width=W, height=H, steps=2, sampler=SAMPLER)


def cfg(**kw):
    kw.setdefault("width", W)
    kw.setdefault("height", H)
    kw.setdefault("seed", 3)
    return resolve_config(stream_config("a cat", **kw), defaults=DEFAULTS, model=MODEL)


class Metrics:
    def __init__(self):
        self.dropped: dict[str, int] = {}
        self.received = 0

    def input_frame(self):
        self.received += 1

    def input_frames_dropped(self, reason, n):
        self.dropped[reason] = self.dropped.get(reason, 0) + n

    def input_encoded(self, seconds):
        pass


@pytest.fixture(scope="module")
def encoder():
    torch.manual_seed(0)
    return StreamVAEEncoder(AutoencoderKLWan(**vae_config("tiny-wan2.1")).eval())


def rgb_frames(n, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (H, W, 3), dtype=np.uint8) for _ in range(n)]


def raw(rgb, pts):
    return pb.InputFrame(data=rgb.tobytes(), format=pb.INPUT_FORMAT_RAW, pts=pts)


def jpeg_bytes(rgb):
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="JPEG")
    return buf.getvalue()


# ---- config ---------------------------------------------------------------------------------------------------


def test_strength_picks_the_levels_the_pipeline_runs_and_is_echoed():
    c = cfg(strength=500, input_pacing="backpressure", input_timeout=3)
    assert c.v2v and c.timesteps == (700.0, 500.0) and c.pipeline_timesteps == (500.0,)
    spec = c.stream_spec(latent_channels=16, text_len=16)
    assert spec.input_latents and spec.timesteps == (500.0,) and spec.num_chunks is None
    echo = c.to_proto()
    assert (echo.strength, echo.input_pacing, echo.input_timeout) == (500.0, pb.INPUT_PACING_BACKPRESSURE, 3.0)
    text = cfg()
    assert not text.v2v and not text.to_proto().HasField("strength")
    assert text.stream_spec(latent_channels=16, text_len=16).input_latents is False


@pytest.mark.parametrize(
    "kw,field",
    [
        (dict(strength=600), "strength"),
        (dict(strength=float("nan")), "strength"),
        (dict(strength=700, seconds=2), "seconds"),
        (dict(strength=700, input_timeout=0), "input_timeout"),
        (dict(strength=700, input_timeout=1e9), "input_timeout"),
        (dict(input_timeout=2), "input_timeout"),
        (dict(input_pacing="live"), "input_pacing"),
        (dict(strength=700, input_pacing=7), "input_pacing"),
    ],
)
def test_bad_video_to_video_configs_name_their_field(kw, field):
    with pytest.raises(ConfigError) as err:
        cfg(**kw)
    assert err.value.field == field, str(err.value)


# ---- frames ---------------------------------------------------------------------------------------------------


def test_raw_and_jpeg_frames_decode_and_bad_ones_name_the_field():
    (rgb,) = rgb_frames(1)
    assert np.array_equal(decode_frame(raw(rgb, 0), W, H), rgb)
    jpg = decode_frame(pb.InputFrame(data=jpeg_bytes(rgb), format=pb.INPUT_FORMAT_JPEG), W, H)
    assert jpg.shape == (H, W, 3) and jpg.dtype == np.uint8
    whole = jpeg_bytes(rgb)
    bad = [
        (pb.InputFrame(data=rgb.tobytes()[:-3], format=pb.INPUT_FORMAT_RAW), "frame.data", "bytes"),
        (pb.InputFrame(data=b"\xff\xd8garbage", format=pb.INPUT_FORMAT_JPEG), "frame.data", "not a JPEG"),
        (pb.InputFrame(data=jpeg_bytes(rgb[:16]), format=pb.INPUT_FORMAT_JPEG), "frame.data", "48x16"),
        (pb.InputFrame(data=whole[: len(whole) * 2 // 3], format=pb.INPUT_FORMAT_JPEG), "frame.data", "decode"),
        (pb.InputFrame(data=rgb.tobytes()), "frame.format", "INPUT_FORMAT_UNSPECIFIED"),
        (pb.InputFrame(data=rgb.tobytes(), format=9), "frame.format", "got 9"),
    ]
    for frame, field, words in bad:
        with pytest.raises(ConfigError, match=words) as err:
            decode_frame(frame, W, H)
        assert err.value.field == field


# ---- the path -------------------------------------------------------------------------------------------------


class Pipeline:
    """Stands in for the coordinator: records what is submitted, refuses when told to."""

    def __init__(self, refuse=()):
        self.refuse = list(refuse)  # answers to give first (False: RESOURCE_EXHAUSTED)
        self.chunks: list[tuple[int, torch.Tensor]] = []

    def submit(self, chunk, latents):
        if self.refuse:
            if not self.refuse.pop(0):
                return False
        self.chunks.append((chunk, latents))
        return True


def run_path(path, frames, pts, *, progress=0):
    """Offer the frames while the input thread runs (a BACKPRESSURE offer blocks while the queue is full)."""
    result = {}
    worker = threading.Thread(target=lambda: result.setdefault("reason", path.run()))
    worker.start()
    for rgb, p in zip(frames, pts):
        assert path.offer(raw(rgb, p))
    path.end()
    for _ in range(progress):
        path.progress()
    worker.join(timeout=60)
    assert not worker.is_alive()
    return result["reason"]


def test_chunks_are_the_streaming_encode_noised_to_strength_with_the_input_pts(encoder):
    c = cfg(strength=700, input_pacing="backpressure")
    pipe, metrics = Pipeline(), Metrics()
    path = InputPath(c, encoder, submit=pipe.submit, metrics=metrics, now_ms=lambda: 1.0)
    frames = rgb_frames(11)
    pts = [0.5 + 0.1 * i for i in range(11)]
    assert run_path(path, frames, pts) == "stopped"
    # 11 frames: latent frame 0 (frame 0), 1 (frames 1-4), 2 (frames 5-8); frames 9 and 10 end inside latent frame
    # 3, which two repeats of frame 10 complete: every input frame is in a chunk, and chunk 3 names only 9 and 10.
    assert [c for c, _ in pipe.chunks] == [0, 1, 2, 3]
    assert metrics.dropped == {} and path.partial == 0 and path.padded == 2 and path.received == 11
    assert path.dropped == 0  # backpressure: the status's input_frames_dropped counts only frames the pipeline missed
    assert path.frames_of(0) == [(0.5, 1.0)]
    assert [p for p, _ in path.frames_of(1)] == pts[1:5] and [p for p, _ in path.frames_of(2)] == pts[5:9]
    assert [p for p, _ in path.frames_of(3)] == pts[9:11]
    # The oracle: one-shot-equivalent encode of the 11 frames and the 2 repeats (tests/test_stream_vae_encode.py pins
    # it to vae.encode), then flow-matching noise at the strength's sigma, drawn per chunk.
    padded = [*frames, frames[10], frames[10]]
    video = torch.from_numpy(np.stack(padded)).permute(3, 0, 1, 2)[None].float() / 255.0 * 2.0 - 1.0
    state = encoder.new_state()
    z = encoder.encode_frames(state, video)
    sigma = sigmas((700.0, 500.0), 1.0)[0]
    for chunk, got in pipe.chunks:
        clean = z[:, :, chunk : chunk + 1]
        want = noise_to(clean, sigma, input_noise(3, chunk, tuple(clean.shape)))
        assert torch.equal(got, want)
    assert not torch.equal(input_noise(3, 0, (4,)), input_noise(3, 1, (4,)))
    assert path.state.released


def test_live_drops_a_chunk_the_pipeline_cannot_take_and_counts_its_frames(encoder):
    c = cfg(strength=700)  # LIVE is the default
    pipe, metrics = Pipeline(refuse=[True, False]), Metrics()  # chunk 0 taken, the next refused once
    path = InputPath(c, encoder, submit=pipe.submit, metrics=metrics, now_ms=lambda: 0.0)
    pts = [0.1 * i for i in range(9)]
    for rgb, p in zip(rgb_frames(9), pts):  # 9 frames: the queue holds them all, none is dropped there
        assert path.offer(raw(rgb, p))
    path.end()
    assert path.run() == "stopped"
    # Frames 1-4 were dropped with their chunk; frames 5-8 became the pipeline's chunk 1.
    assert [c for c, _ in pipe.chunks] == [0, 1]
    assert metrics.dropped == {"behind": 4} and path.dropped == 4
    assert [p for p, _ in path.frames_of(1)] == pts[5:9]


def test_live_drops_the_oldest_queued_frames_when_the_encoder_is_behind(encoder):
    c = cfg(strength=700)
    pipe, metrics = Pipeline(), Metrics()
    path = InputPath(c, encoder, submit=pipe.submit, metrics=metrics, now_ms=lambda: 0.0)
    n = path.capacity + 3  # nobody encodes while these arrive
    for i, rgb in enumerate(rgb_frames(n)):
        assert path.offer(raw(rgb, i))
    assert path.dropped == 3 and metrics.dropped == {"behind": 3}
    path.end()
    assert path.run() == "stopped"
    assert path.frames_of(0) == [(3.0, 0.0)]  # the oldest three went: frame 3 became the stream's first


def test_backpressure_offers_a_refused_chunk_again_after_progress_and_drops_nothing(encoder):
    c = cfg(strength=700, input_pacing="backpressure")
    pipe, metrics = Pipeline(refuse=[True, False, False]), Metrics()
    path = InputPath(c, encoder, submit=pipe.submit, metrics=metrics, now_ms=lambda: 0.0)
    # Refused twice; progress (a chunk came back) and the retry timeout both lead to offering it again.
    assert run_path(path, rgb_frames(5), range(5), progress=1) == "stopped"
    assert [c for c, _ in pipe.chunks] == [0, 1] and metrics.dropped == {} and path.dropped == 0


def test_a_stalled_input_ends_after_input_timeout_and_an_aborted_one_at_once(encoder):
    c = cfg(strength=700, input_timeout=0.2)
    pipe = Pipeline()
    path = InputPath(c, encoder, submit=pipe.submit, metrics=Metrics(), now_ms=lambda: 0.0)
    assert path.offer(raw(rgb_frames(1)[0], 0.0))
    assert path.run() == "input_stalled" and [c for c, _ in pipe.chunks] == [0]
    with pytest.raises(ConfigError) as err:  # pts must increase
        path.offer(raw(rgb_frames(1)[0], 0.0))
    assert err.value.field == "frame.pts"
    with pytest.raises(ConfigError, match="finite"):
        path.offer(raw(rgb_frames(1)[0], float("inf")))
    aborted = InputPath(cfg(strength=700), encoder, submit=pipe.submit, metrics=Metrics(), now_ms=lambda: 0.0)
    aborted.abort()
    assert aborted.run() is None
    assert not aborted.offer(raw(rgb_frames(1)[0], 0.0))
