"""Request validation, duration arithmetic and the per-stream bounded channel of the gateway (no processes)."""

import threading

import pytest

from gateway.checkpoint import ModelInfo, ServingDefaults
from gateway.edge.config import ConfigError, Decoders, duration_plan, frames_after_chunks, resolve_config
from gateway.stream.channel import CLOSED, BoundedChannel
from stagecast.client import stream_config
from stagecast.v1 import stream_pb2 as pb

pytestmark = pytest.mark.unit

WAN21 = ModelInfo(latent_channels=16, patch_hw=(2, 2), spatial_factor=8, temporal_factor=4)
DEFAULTS = ServingDefaults(text_len=32, width=64, height=48)


def resolve(prompt="a cat", **kw):
    return resolve_config(stream_config(prompt, **kw), defaults=DEFAULTS, model=WAN21)


@pytest.mark.parametrize(
    "seconds,fps,chunk_frames,frames,chunks",
    [
        (1, 16, 1, 16, 5),  # 5 chunks give 17 frames; the 17th is dropped
        (5.0625, 16, 1, 81, 21),  # 81 frames = 21 latent frames exactly, Wan's usual clip
        (0.01, 16, 1, 1, 1),  # never less than one frame
        (1, 16, 3, 16, 2),  # 5 latent frames need two 3-frame chunks
        (0.3, 10, 1, 3, 2),  # 0.3 * 10 is 3.0000000000000004 in floating point: still 3 frames
    ],
)
def test_duration_is_the_fewest_chunks_covering_ceil_seconds_times_fps(seconds, fps, chunk_frames, frames, chunks):
    assert duration_plan(seconds, fps, chunk_frames, 4) == (frames, chunks)
    assert frames_after_chunks(chunks, chunk_frames, 4) >= frames > frames_after_chunks(chunks - 1, chunk_frames, 4)


def test_absent_fields_take_the_defaults_and_the_effective_config_fills_every_field():
    cfg = resolve(seed=5)
    assert (cfg.width, cfg.height, cfg.latent_width, cfg.latent_height) == (64, 48, 8, 6)
    assert (cfg.codec, cfg.fps, cfg.policy, cfg.steps, cfg.guidance_scale) == ("jpeg", 16.0, "per_level", 4, 1.0)
    assert cfg.seconds is None and cfg.total_frames is None and cfg.num_chunks is None  # until stopped
    assert (cfg.timesteps, cfg.shift, cfg.update) == ((1000.0, 750.0, 500.0, 250.0), 1.0, "x0")
    echo = cfg.to_proto()
    # Every field is written out, the unbounded window as 0 and the codec's default quality; only seconds stays
    # absent for a stream that runs until stopped, the video-to-video fields for a text stream, and negative_prompt
    # for a stream without guidance.
    optional = [f.name for f in echo.DESCRIPTOR.fields if f.has_presence]
    assert [name for name in optional if not echo.HasField(name)] == [
        "seconds",
        "strength",
        "input_timeout",
        "negative_prompt",
    ]
    assert (echo.window, echo.quality, echo.codec, echo.policy) == (0, 90, pb.CODEC_JPEG, pb.KV_POLICY_PER_LEVEL)
    assert list(echo.timesteps) == [1000.0, 750.0, 500.0, 250.0] and echo.shift == 1.0
    spec = cfg.stream_spec(latent_channels=16, text_len=32)
    assert (spec.latent_height, spec.latent_width, spec.num_chunks, spec.seed, spec.text_len) == (6, 8, None, 5, 32)
    assert (spec.timesteps, spec.shift, spec.sampler) == ((1000.0, 750.0, 500.0, 250.0), 1.0, "x0")


def test_a_random_seed_is_chosen_when_none_is_given():
    assert len({resolve().seed for _ in range(8)}) > 1


@pytest.mark.parametrize(
    "field,kwargs",
    [
        ("prompt", dict(prompt="")),
        ("prompt", dict(prompt="x" * 20_001)),
        ("width", dict(width=50)),
        ("width", dict(width=0)),
        ("height", dict(height=-16)),
        ("height", dict(height=8)),
        ("seconds", dict(seconds=0)),
        ("seconds", dict(seconds=-1)),
        ("steps", dict(steps=0)),
        ("steps", dict(steps=51)),
        ("chunk_frames", dict(chunk_frames=0)),
        ("codec", dict(codec=99)),  # an enum number this gateway does not know
        ("guidance_scale", dict(guidance_scale=0.5)),
        ("guidance_scale", dict(guidance_scale=31.0)),
        ("guidance_scale", dict(guidance_scale=float("nan"))),
        ("negative_prompt", dict(guidance_scale=5.0, negative_prompt="x" * 20_001)),
        ("negative_prompt", dict(negative_prompt="blurry")),  # without guidance it would do nothing
        ("target_fps", dict(target_fps=0)),
        ("policy", dict(policy=7)),
        ("window", dict(window=-1)),
        ("window", dict(window=1025)),
        ("sink", dict(sink=-1)),
        ("sink", dict(window=2, sink=3)),
        ("quality", dict(quality=101)),
        ("quality", dict(quality=0)),
        ("target_fps", dict(target_fps=float("nan"))),
        ("target_fps", dict(target_fps=241)),
        ("target_fps", dict(codec="h264", target_fps=1e-4)),  # accepted once, then failed INTERNAL in the muxer
        ("target_fps", dict(target_fps=0.5)),
        ("seconds", dict(seconds=float("inf"))),
        ("steps", dict(steps=2**31 - 1)),
        ("chunk_frames", dict(chunk_frames=17)),
        ("width", dict(width=4112)),
    ],
)
def test_each_invalid_field_is_named_in_the_error(field, kwargs):
    with pytest.raises(ConfigError) as err:
        resolve(**kwargs)
    assert err.value.field == field and str(err.value).startswith(f"{field}: ")


@pytest.mark.unit
def test_a_tiny_decoder_where_the_deployment_has_none_is_refused_naming_decoder():
    with pytest.raises(ConfigError) as err:
        resolve(decoder="tiny")
    assert err.value.field == "decoder" and "no tiny decoder" in str(err.value)
    with pytest.raises(ConfigError) as err:  # a number this gateway does not know
        resolve_config(pb.StreamConfig(prompt="a cat", decoder=7), defaults=DEFAULTS, model=WAN21)
    assert err.value.field == "decoder"


@pytest.mark.unit
@pytest.mark.parametrize(
    "decoders,asked,resolved",
    [
        (Decoders(), None, pb.DECODER_FULL),  # no tiny decoder: the full VAE, echoed as FULL, never UNSPECIFIED
        (Decoders(), "full", pb.DECODER_FULL),
        (Decoders(tiny=True), None, pb.DECODER_FULL),  # the full VAE stays the default beside a tiny one
        (Decoders(tiny=True), "tiny", pb.DECODER_TINY),
        (Decoders(tiny=True), pb.DECODER_FULL, pb.DECODER_FULL),
        (Decoders(tiny=True, default="tiny"), None, pb.DECODER_TINY),  # --default-decoder tiny
        (Decoders(tiny=True, default="tiny"), "full", pb.DECODER_FULL),
    ],
)
def test_the_resolved_decoder_is_echoed_in_the_effective_config(decoders, asked, resolved):
    cfg = resolve_config(stream_config("a cat", decoder=asked), defaults=DEFAULTS, model=WAN21, decoders=decoders)
    assert cfg.decoder == {pb.DECODER_FULL: "full", pb.DECODER_TINY: "tiny"}[resolved]
    assert cfg.to_proto().decoder == resolved


@pytest.mark.unit
def test_a_tiny_default_without_a_tiny_decoder_stops_the_gateway_naming_the_flag():
    with pytest.raises(ValueError, match="--default-decoder tiny"):
        Decoders(default="tiny")
    with pytest.raises(ValueError, match="--default-decoder"):
        Decoders(tiny=True, default="medium")


@pytest.mark.unit
@pytest.mark.parametrize("bad", ["medium", 5, 1.5, True])
def test_the_sdk_refuses_an_unknown_decoder_naming_the_field(bad):
    with pytest.raises(ValueError, match="^decoder: "):
        stream_config("a cat", decoder=bad)


def test_width_error_says_why_16():
    with pytest.raises(ConfigError, match=r"multiple of 16 \(VAE spatial factor 8 x patch 2\)"):
        resolve(width=40)


def test_channel_blocks_when_full_and_times_out():
    ch = BoundedChannel(2)
    assert ch.put(1) and ch.put(2)
    with pytest.raises(TimeoutError):
        ch.put(3, timeout=0.01)
    assert ch.get() == 1 and ch.put(3, timeout=0.01)
    assert [ch.get(), ch.get()] == [2, 3]


def test_put_final_goes_past_the_bound_and_closing_wakes_a_blocked_producer():
    ch = BoundedChannel(1)
    ch.put("frame")
    result = []
    producer = threading.Thread(target=lambda: result.append(ch.put("blocked")))
    producer.start()
    assert ch.put_final("error", drop=True)  # the consumer's last word replaces what was queued
    producer.join(5)
    assert result == [False]
    assert ch.get() == "error" and ch.get() is CLOSED
    assert not ch.put_final("late")


def test_serving_defaults_reject_unknown_keys(tmp_path):
    (tmp_path / "stagecast.json").write_text('{"text_len": 32, "widht": 64}')
    with pytest.raises(ValueError, match="widht"):
        ServingDefaults.load(tmp_path)
    assert ServingDefaults.load(tmp_path / "missing") == ServingDefaults()


def test_a_checkpoints_serving_window_applies_where_the_request_leaves_window_out(tmp_path):
    (tmp_path / "stagecast.json").write_text('{"text_len": 32, "width": 64, "height": 48, "window": 6, "sink": 3}')
    served = ServingDefaults.load(tmp_path)

    def resolved(**kw):
        cfg = resolve_config(stream_config("a cat", **kw), defaults=served, model=WAN21)
        return cfg.window, cfg.sink, cfg.stream_spec(latent_channels=16, text_len=32).window

    assert resolved() == (6, 3, 6)  # the checkpoint's window and its sinks
    assert resolved(window=12) == (12, 0, 12)  # the request's own window, without the default's sinks
    assert resolved(window=12, sink=2) == (12, 2, 12)
    assert resolved(window=0) == (None, 0, None)  # asked for unbounded explicitly
    with pytest.raises(ConfigError, match="window") as err:
        resolve_config(stream_config("a cat", window=2000), defaults=served, model=WAN21)
    assert err.value.field == "window" and "absent: 6" in str(err.value)
    # Without a stagecast.json window, a stream that leaves it out stays unbounded, as before.
    assert resolve(seed=1).window is None


@pytest.mark.parametrize(
    "body,name",
    [
        ('{"window": -1}', "window"),
        ('{"window": 2000}', "window"),
        ('{"window": 4, "sink": 5}', "sink"),
        ('{"window": 6.5}', "window"),
        ('{"window": true}', "window"),
    ],
)
def test_a_bad_serving_window_stops_the_gateway_naming_the_key(tmp_path, body, name):
    (tmp_path / "stagecast.json").write_text(body)
    with pytest.raises(ValueError, match=f"{name}: must be an integer"):
        ServingDefaults.load(tmp_path)


def test_step_bounds_make_a_stream_slo_adaptive_with_the_samplers_ladders():
    cfg = resolve(min_steps=2, max_steps=4)
    assert (cfg.min_steps, cfg.steps, cfg.max_steps) == (2, 4, 4)  # starts at the most the bounds allow
    assert [len(ladder) for ladder in cfg.ladders] == [2, 3, 4] and cfg.ladders[-1] == cfg.timesteps
    assert cfg.steps_preference == "steps_first"
    echo = cfg.to_proto()
    assert (echo.min_steps, echo.max_steps, echo.steps_preference) == (2, 4, pb.STEPS_PREFERENCE_STEPS_FIRST)
    assert resolve_config(echo, defaults=DEFAULTS, model=WAN21) == cfg  # the echo resolves to the same stream
    fixed = resolve(steps=3)
    assert (fixed.min_steps, fixed.max_steps, fixed.ladders) == (3, 3, (fixed.timesteps,))
    low = resolve(steps=2, min_steps=1, max_steps=3, steps_preference="latency_first")
    assert (low.steps, low.steps_preference) == (2, "latency_first") and len(low.ladders) == 3
    assert resolve(max_steps=2).steps == 2 and resolve(min_steps=1).max_steps == 4


@pytest.mark.parametrize(
    "field,kwargs",
    [
        ("min_steps", dict(min_steps=0)),
        ("max_steps", dict(max_steps=51)),
        ("min_steps", dict(min_steps=4, max_steps=2)),
        ("steps", dict(steps=4, max_steps=3)),
        ("min_steps", dict(timesteps=[700.0, 500.0], min_steps=1)),
        ("steps_preference", dict(steps_preference=7)),
    ],
)
def test_bad_step_bounds_name_their_field(field, kwargs):
    with pytest.raises(ConfigError) as info:
        resolve(**kwargs)
    assert info.value.field == field


# ---- classifier-free guidance ---------------------------------------------------------------------------------


def test_guidance_takes_the_requests_negative_prompt_or_the_checkpoints_default():
    cfg = resolve(guidance_scale=5.0, negative_prompt="")
    assert (cfg.guidance_scale, cfg.negative_prompt) == (5.0, "")
    assert cfg.stream_spec(latent_channels=16, text_len=32).guidance_scale == 5.0
    assert cfg.to_proto().negative_prompt == "" and cfg.to_proto().HasField("negative_prompt")
    msg = stream_config("a cat", guidance_scale=4.5)
    own = resolve_config(msg, defaults=ServingDefaults(text_len=32, negative_prompt="blurry, static"), model=WAN21)
    assert (own.guidance_scale, own.negative_prompt) == (4.5, "blurry, static")
    plain = resolve()
    assert plain.guidance_scale == 1.0 and not plain.to_proto().HasField("negative_prompt")
    assert plain.stream_spec(latent_channels=16, text_len=32).cfg is False


def test_a_guidance_distilled_checkpoint_refuses_guidance_naming_the_field(tmp_path):
    (tmp_path / "stagecast.json").write_text('{"guidance_distilled": true, "negative_prompt": "low quality"}')
    defaults = ServingDefaults.load(tmp_path)
    assert defaults.guidance_distilled and defaults.negative_prompt == "low quality"
    with pytest.raises(ConfigError, match="guidance_scale: this checkpoint is guidance-distilled"):
        resolve_config(stream_config("a cat", guidance_scale=5.0), defaults=defaults, model=WAN21)
    assert resolve_config(stream_config("a cat", guidance_scale=1.0), defaults=defaults, model=WAN21).seed >= 0
    (tmp_path / "stagecast.json").write_text('{"negative_prompt": ' + '"' + "x" * 20_001 + '"}')
    with pytest.raises(ValueError, match="negative_prompt: must be a string of at most 20000 characters"):
        ServingDefaults.load(tmp_path)
    (tmp_path / "stagecast.json").write_text('{"guidance_distilled": "yes"}')
    with pytest.raises(ValueError, match="guidance_distilled: must be true or false"):
        ServingDefaults.load(tmp_path)


@pytest.mark.unit
def test_a_strength_off_the_ladder_quotes_the_ladder_as_numbers():
    with pytest.raises(ConfigError) as info:
        resolve(strength=600.0)
    message = str(info.value)
    assert "must be one of the stream's ladder timesteps [1000, 750, 500, 250]" in message, message
    assert "'1000'" not in message and "got 600" in message


def test_channel_bounded_in_bytes_takes_one_item_past_the_bound_only_when_empty():
    ch = BoundedChannel(10, max_bytes=100)
    assert ch.put("a", size=60) and ch.bytes == 60
    with pytest.raises(TimeoutError):
        ch.put("b", size=50, timeout=0.01)  # 110 bytes would pass the bound
    assert ch.put("c", size=40, timeout=0.01) and ch.bytes == 100
    assert ch.get() == "a" and ch.get() == "c" and ch.bytes == 0
    assert ch.put("huge", size=1000, timeout=0.01)  # alone, a message larger than the bound still goes
    with pytest.raises(TimeoutError):
        ch.put("d", size=1, timeout=0.01)
    assert ch.put_final("end", drop=True) and ch.bytes == 0
