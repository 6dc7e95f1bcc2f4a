"""The gateway's limits without processes: request parsing, prompt limits, codec-facing ranges, the per-stream cost
budget and the order of admission checks (tests/test_gateway_edge.py drives the same limits through a gateway)."""

import math
import random

import grpc
import numpy as np
import pytest

from gateway.checkpoint import ModelInfo, ServingDefaults
from gateway.edge.admission import Admission, CostBudget, Refused
from gateway.edge.config import (
    DEFAULT_QUALITY,
    MAX_CHUNK_FRAMES,
    MAX_FPS,
    MAX_PROMPT_CHARS,
    MAX_REQUEST_BYTES,
    MAX_SECONDS,
    MAX_SIDE,
    MAX_STEPS,
    MAX_WINDOW,
    MIN_FPS,
    ConfigError,
    check_prompt,
    parse_client_message,
    resolve_config,
)
from stagecast import api
from stagecast.client import stream_config
from stagecast.frames import StreamInfo
from stagecast.media import DEFAULT_CRF, make_encoder, quality_to_crf
from stagecast.microstep import MAX_GUIDANCE
from stagecast.v1 import stream_pb2 as pb

pytestmark = pytest.mark.unit

WAN21 = ModelInfo(latent_channels=16, patch_hw=(2, 2), spatial_factor=8, temporal_factor=4)
DEFAULTS = ServingDefaults(text_len=32, width=64, height=48, fps=16.0, steps=2)


def resolve(prompt="a cat", **kw):
    return resolve_config(stream_config(prompt, **kw), defaults=DEFAULTS, model=WAN21)


# ---- parsing --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "data", [b"\xff", b"\x0a\x05ab", b"\x12\x02\x0a\xff", b"\x0a\x03\x0a\x01\xc3", bytes(range(64))]
)
def test_bytes_that_are_not_a_client_message_are_a_request_error(data):
    with pytest.raises(ConfigError) as err:
        parse_client_message(data)
    assert err.value.field == "request" and "stagecast.v1.ClientMessage" in str(err.value)


def test_the_largest_legal_request_fits_the_public_message_limit():
    widest = "\U0001f98a" * MAX_PROMPT_CHARS  # 4 UTF-8 bytes per character
    cfg = stream_config(
        check_prompt(widest),
        width=MAX_SIDE,
        height=MAX_SIDE,
        seconds=MAX_SECONDS,
        codec="h264",
        chunk_frames=MAX_CHUNK_FRAMES,
        steps=MAX_STEPS,
        seed=-(2**63),
        guidance_scale=MAX_GUIDANCE,
        target_fps=MAX_FPS,
        policy="clean",
        window=MAX_WINDOW,
        sink=MAX_WINDOW,
        quality=100,
        timesteps=[1000.0 - 19.5 * i for i in range(MAX_STEPS)],
        shift=1.0,
        negative_prompt=widest,
    )
    size = pb.ClientMessage(config=cfg).ByteSize()
    assert 2 * 4 * MAX_PROMPT_CHARS < size <= MAX_REQUEST_BYTES < 2 * size  # sized to it, not far above it
    assert pb.ClientMessage(prompt=pb.PromptUpdate(prompt=widest)).ByteSize() <= MAX_REQUEST_BYTES


# ---- prompts --------------------------------------------------------------------------------------------------


def test_prompt_updates_share_the_configs_prompt_limit():
    assert check_prompt("x" * MAX_PROMPT_CHARS) == "x" * MAX_PROMPT_CHARS
    with pytest.raises(ConfigError, match=f"prompt: is {MAX_PROMPT_CHARS + 1} characters; the limit is"):
        check_prompt("x" * (MAX_PROMPT_CHARS + 1))
    with pytest.raises(ConfigError, match="prompt: is 10000000 characters"):
        check_prompt("y" * 10_000_000)  # refused on its length, before anything tokenises it
    with pytest.raises(ConfigError, match="prompt: must not be empty"):
        check_prompt(" \n")


# ---- enums and the echoed config ------------------------------------------------------------------------------


def test_sdk_names_map_to_the_wire_enums_and_back():
    for name, value in api.CODECS.items():
        assert stream_config("a", codec=name).codec == value and api.codec_name(value) == name
    assert stream_config("a").codec == pb.CODEC_JPEG and stream_config("a").policy == pb.KV_POLICY_UNSPECIFIED
    assert stream_config("a", policy="clean").policy == pb.KV_POLICY_CLEAN
    assert (
        api.end_reason_name(pb.END_REASON_STOPPED) == "stopped"
        and api.state_name(pb.STREAM_STATE_DRAINING) == "draining"
    )
    with pytest.raises(ValueError, match="codec: must be one of jpeg, h264, raw, got 'gif'"):
        stream_config("a", codec="gif")
    with pytest.raises(ValueError, match="policy"):
        stream_config("a", policy="greedy")


def test_every_enum_has_an_unspecified_zero_and_the_server_never_echoes_it():
    for enum in pb.DESCRIPTOR.enum_types_by_name.values():
        assert enum.values_by_number[0].name.endswith("_UNSPECIFIED"), enum.name
    cfg = resolve(codec=0, policy=0).to_proto()
    assert cfg.codec == pb.CODEC_JPEG and cfg.policy == pb.KV_POLICY_PER_LEVEL


@pytest.mark.parametrize("codec", list(api.CODECS))
def test_started_config_writes_the_codecs_default_quality_and_an_unbounded_window(codec):
    cfg = resolve(codec=codec)
    echo = cfg.to_proto()
    assert echo.HasField("quality") and echo.quality == DEFAULT_QUALITY[codec]
    assert echo.HasField("window") and echo.window == 0 and cfg.window is None
    info = StreamInfo.from_proto(pb.Started(config=echo))
    assert (info.codec, info.window, info.quality) == (codec, None, DEFAULT_QUALITY[codec])
    # The echo is itself a valid config that resolves to the same stream.
    assert resolve_config(echo, defaults=DEFAULTS, model=WAN21) == cfg
    assert quality_to_crf(DEFAULT_QUALITY["h264"]) == DEFAULT_CRF


def test_window_zero_is_unbounded_and_sink_is_bounded_by_the_window():
    assert resolve(window=0).window is None and resolve(window=MAX_WINDOW, sink=MAX_WINDOW).sink == MAX_WINDOW
    with pytest.raises(ConfigError, match=r"sink: must be in \[0, window\] \(window 2\)"):
        resolve(window=2, sink=3)


# ---- numbers that reach a codec -------------------------------------------------------------------------------


def _random_legal_config(rng: random.Random, codec: str) -> dict:
    low = MIN_FPS
    fps = rng.choice([low, MAX_FPS, math.nextafter(MAX_FPS, 0), rng.uniform(low, MAX_FPS), 29.97, 1 / 3 + low])
    return dict(codec=codec, target_fps=fps, quality=rng.choice([1, 100, rng.randint(1, 100), None]))


@pytest.mark.parametrize("codec", list(api.CODECS))
def test_every_config_that_passes_validation_opens_its_encoder_and_encodes_a_frame(codec):
    rng = random.Random(codec)
    for _ in range(12):
        kw = _random_legal_config(rng, codec)
        kw = {k: v for k, v in kw.items() if v is not None}
        cfg = resolve(width=32, height=16, **kw)
        enc = make_encoder(cfg.codec, width=cfg.width, height=cfg.height, fps=cfg.fps, quality=cfg.quality)
        try:
            enc.encode(np.zeros((16, 32, 3), dtype=np.uint8))
            enc.flush()
        finally:
            enc.close()


@pytest.mark.parametrize("codec", list(api.CODECS))
def test_a_rate_the_encoders_cannot_represent_is_refused_for_every_codec(codec):
    # 1e-4 fps was accepted for h264 and then failed INTERNAL in the muxer (the rate rounds to 0/1).
    with pytest.raises(ConfigError, match=r"target_fps: must be in \[1, 240\], got 0.0001"):
        resolve(codec=codec, target_fps=1e-4)


# ---- the cost budget and admission ----------------------------------------------------------------------------


def test_the_budget_is_derived_from_the_checkpoint_and_the_device():
    cpu, gpu = CostBudget.derive(DEFAULTS, "cpu"), CostBudget.derive(DEFAULTS, "cuda:1")
    area, cost = 64 * 48, 64 * 48 * 16.0 * 2
    assert (cpu.max_frame_pixels, cpu.max_stream_cost) == (4 * area, 4 * cost)
    assert (gpu.max_frame_pixels, gpu.max_stream_cost) == (6 * area, 16 * cost)
    real = CostBudget.derive(ServingDefaults(), "cuda")  # Wan2.1 at 832x480, 16 fps, 4 steps
    assert real.max_frame_pixels >= 1920 * 1080 > 832 * 480 and 4096 * 4096 > real.max_frame_pixels
    pinned = ServingDefaults(width=64, height=48, max_frame_pixels=100_000, max_stream_cost=5e6)
    assert CostBudget.derive(pinned, "cpu").max_frame_pixels == 100_000  # stagecast.json wins over the derivation
    assert CostBudget.derive(pinned, "cpu", max_stream_cost=1e6).max_stream_cost == 1e6  # and a flag over both


def test_over_the_budget_is_resource_exhausted_naming_the_budget():
    budget = CostBudget.derive(DEFAULTS, "cpu")
    budget.check(resolve(width=128, height=96))  # 4x the pixels: at the limit
    for kw, what in [
        (dict(width=2048, height=2048), "frame is 4194304 pixels"),
        (dict(width=4096, height=4096, steps=1), "frame is"),
        (dict(width=128, height=96, steps=3), "pixel-passes/s is over"),
        (dict(width=128, height=96, policy="clean"), "x 3 passes"),  # the clean pass costs a pass
    ]:
        with pytest.raises(Refused) as err:
            budget.check(resolve(**kw))
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert err.value.message.startswith("cost budget: ") and what in err.value.message, err.value.message


@pytest.mark.unit
def test_larger_chunks_than_the_checkpoints_count_in_the_cost_budget():
    budget = CostBudget.derive(DEFAULTS, "cpu")  # the checkpoint's chunk: 1 latent frame
    budget.check(resolve(width=64, height=48, chunk_frames=4))  # 4x the cost at the serving size: at the limit
    budget.check(resolve(width=96, height=96))  # within the frame and cost budget at the checkpoint's chunk
    with pytest.raises(Refused) as err:  # not at 16 latent frames a chunk (128x128 so took 14 s per second on a CPU)
        budget.check(resolve(width=96, height=96, chunk_frames=16))
    assert "x 16 for chunk_frames 16 (the checkpoint's 1)" in err.value.message
    assert "chunk_frames" in err.value.message.rsplit(";", 1)[1]  # the advice names it
    with pytest.raises(Refused, match="x 2 for chunk_frames 8 .the checkpoint's 4."):
        CostBudget.derive(ServingDefaults(**{**vars(DEFAULTS), "chunk_frames": 4}), "cpu").check(
            resolve(width=128, height=96, chunk_frames=8)
        )


def test_a_lower_target_fps_does_not_buy_more_pixels():
    budget = CostBudget.derive(DEFAULTS, "cpu")
    # 128x96 at 2 steps is the whole budget at 16 fps; at 1 fps it is counted at the checkpoint's 16 fps still.
    with pytest.raises(Refused, match="x 16 frames/s x 3 passes"):
        budget.check(resolve(width=128, height=96, steps=3, target_fps=1))


def test_admission_runs_the_count_cap_before_the_budget_and_gives_back_on_refusal():
    budget = CostBudget.derive(DEFAULTS, "cpu")
    taken, log = [0], []

    def count_cap(cfg, limit=1):
        log.append("count")
        if taken[0] >= limit:
            raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many streams")
        taken[0] += 1
        return lambda: taken.__setitem__(0, taken[0] - 1)

    def budget_check(cfg):
        log.append("cost")
        return budget.check(cfg)

    def capacity(cfg):  # what a later check (capacity admission) looks like: appended after the budget
        log.append("capacity")
        raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, "no capacity")

    admission = Admission([count_cap, budget_check])
    release = admission.admit(resolve())
    assert taken == [1] and log == ["count", "cost"]
    with pytest.raises(Refused, match="too many streams"):
        admission.admit(resolve(width=4096, height=4096))  # the count cap answers first
    release()
    with pytest.raises(Refused, match="cost budget"):
        admission.admit(resolve(width=4096, height=4096))
    assert taken == [0]  # the slot the count cap took was given back
    admission.checks.append(capacity)
    log.clear()
    with pytest.raises(Refused, match="no capacity"):
        admission.admit(resolve())
    assert log == ["count", "cost", "capacity"] and taken == [0]
