"""Turn a client's ``stagecast.v1.StreamConfig`` into the effective config of one stream, or say which field is wrong.

Usage::

    cfg = resolve_config(msg, defaults=ServingDefaults(), model=ModelInfo.from_checkpoint(root))
    # raises ConfigError("width: must be a positive multiple of 16 ...") -> INVALID_ARGUMENT
    cfg.total_frames, cfg.num_chunks     # None, None for a stream that runs until stopped
    spec = cfg.stream_spec(latent_channels=16, text_len=512)
    started.config.CopyFrom(cfg.to_proto())   # every field filled in: what the client gets back

Duration: the Wan VAE turns latent frame 0 into 1 video frame and every later latent frame into
``temporal_factor`` (4), so ``c`` chunks of ``F`` latent frames give ``1 + 4 (cF - 1)`` frames.  A request for
``seconds`` at ``target_fps`` wants ``N = ceil(seconds * target_fps)`` frames; the gateway generates the fewest
chunks that cover ``N`` and sends exactly the first ``N`` frames (the tail of the last chunk is dropped).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from gateway.checkpoint import ModelInfo, ServingDefaults
from stagecast.media import CODECS
from stagecast.microstep import POLICIES, StreamSpec
from stagecast.v1 import stream_pb2 as pb

MAX_PROMPT_CHARS = 20_000  # tokenising is the real limit; this only stops absurd payloads before it runs
MAX_SIDE = 4096
MAX_STEPS = 50
MAX_CHUNK_FRAMES = 16
MAX_SECONDS = 24 * 3600.0
MAX_FPS = 240.0


class ConfigError(ValueError):
    """A request field is invalid; the message starts with the field's name."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class EffectiveConfig:
    prompt: str
    width: int
    height: int
    chunk_frames: int
    steps: int
    seed: int
    guidance_scale: float
    codec: str
    fps: float
    seconds: float | None
    policy: str
    window: int | None
    sink: int
    quality: int | None
    latent_width: int
    latent_height: int
    total_frames: int | None  # None: until stopped
    num_chunks: int | None

    def timesteps(self) -> tuple[float, ...]:
        """An evenly spaced ladder from 1000: 1 step -> (1000,), 4 steps -> (1000, 750, 500, 250)."""
        return tuple(1000.0 * (1 - i / self.steps) for i in range(self.steps))

    def stream_spec(self, *, latent_channels: int, text_len: int) -> StreamSpec:
        return StreamSpec(
            stream_id=0,  # the coordinator assigns it
            latent_channels=latent_channels,
            chunk_frames=self.chunk_frames,
            height=self.latent_height,
            width=self.latent_width,
            timesteps=self.timesteps(),
            seed=self.seed,
            policy=self.policy,
            window=self.window,
            sink=self.sink,
            num_chunks=self.num_chunks,
            text_len=text_len,
        )

    def to_proto(self) -> pb.StreamConfig:
        msg = pb.StreamConfig(
            prompt=self.prompt,
            width=self.width,
            height=self.height,
            chunk_frames=self.chunk_frames,
            steps=self.steps,
            seed=self.seed,
            guidance_scale=self.guidance_scale,
            codec=self.codec,
            target_fps=self.fps,
            policy=self.policy,
            sink=self.sink,
        )
        if self.seconds is not None:
            msg.seconds = self.seconds
        if self.window is not None:
            msg.window = self.window
        if self.quality is not None:
            msg.quality = self.quality
        return msg


def frames_after_chunks(chunks: int, chunk_frames: int, temporal_factor: int) -> int:
    """Video frames the first ``chunks`` chunks of a stream decode to."""
    return 1 + temporal_factor * (chunks * chunk_frames - 1) if chunks else 0


def duration_plan(seconds: float, fps: float, chunk_frames: int, temporal_factor: int) -> tuple[int, int]:
    """``(frames, chunks)``: the exact frame count for ``seconds`` and the fewest chunks that cover it."""
    # round() first so that e.g. 0.3 s * 10 fps (= 3.0000000000000004) asks for 3 frames, not 4.
    frames = max(1, math.ceil(round(seconds * fps, 6)))
    latent_frames = 1 + math.ceil((frames - 1) / temporal_factor)
    return frames, math.ceil(latent_frames / chunk_frames)


def _int_in(field: str, value: int, lo: int, hi: int) -> int:
    if not lo <= value <= hi:
        raise ConfigError(field, f"must be in [{lo}, {hi}], got {value}")
    return value


def _size(field: str, value: int, multiple: int, factor: int, patch: int) -> int:
    if value <= 0 or value % multiple or value > MAX_SIDE:
        raise ConfigError(
            field,
            f"must be a positive multiple of {multiple} (VAE spatial factor {factor} x patch {patch}) "
            f"up to {MAX_SIDE}, got {value}",
        )
    return value


def resolve_config(msg: pb.StreamConfig, *, defaults: ServingDefaults, model: ModelInfo) -> EffectiveConfig:
    """Validate ``msg`` field by field (the first bad field raises ``ConfigError``) and fill in defaults."""
    prompt = msg.prompt
    if not prompt.strip():
        raise ConfigError("prompt", "must not be empty")
    if len(prompt) > MAX_PROMPT_CHARS:
        raise ConfigError("prompt", f"is {len(prompt)} characters; the limit is {MAX_PROMPT_CHARS}")

    sf, (p_h, p_w) = model.spatial_factor, model.patch_hw
    width = _size("width", msg.width if msg.HasField("width") else defaults.width, model.width_multiple, sf, p_w)
    height = _size("height", msg.height if msg.HasField("height") else defaults.height, model.height_multiple, sf, p_h)

    chunk_frames = msg.chunk_frames if msg.HasField("chunk_frames") else defaults.chunk_frames
    _int_in("chunk_frames", chunk_frames, 1, MAX_CHUNK_FRAMES)
    steps = msg.steps if msg.HasField("steps") else defaults.steps
    _int_in("steps", steps, 1, MAX_STEPS)
    seed = msg.seed if msg.HasField("seed") else random.randrange(2**31)

    guidance = msg.guidance_scale if msg.HasField("guidance_scale") else 1.0
    if guidance != 1.0:
        raise ConfigError(
            "guidance_scale",
            f"only 1.0 is supported (the served causal few-step models are guidance-distilled), got {guidance}",
        )

    codec = msg.codec or "jpeg"
    if codec not in CODECS:
        raise ConfigError("codec", f"must be one of {', '.join(CODECS)}, got {codec!r}")

    fps = msg.target_fps if msg.HasField("target_fps") else defaults.fps
    if not (0 < fps <= MAX_FPS) or math.isnan(fps):
        raise ConfigError("target_fps", f"must be in (0, {MAX_FPS}], got {fps}")

    seconds: float | None = None
    total_frames = num_chunks = None
    if msg.HasField("seconds"):
        seconds = msg.seconds
        if not (0 < seconds <= MAX_SECONDS) or math.isnan(seconds):
            raise ConfigError("seconds", f"must be in (0, {MAX_SECONDS:.0f}] (leave it out to stream until stopped)")
        total_frames, num_chunks = duration_plan(seconds, fps, chunk_frames, model.temporal_factor)

    policy = msg.policy or "per_level"
    if policy not in POLICIES:
        raise ConfigError("policy", f"must be one of {', '.join(POLICIES)}, got {policy!r}")
    window = msg.window if msg.HasField("window") else None
    if window is not None and window < 1:
        raise ConfigError("window", f"must be >= 1 latent frame (leave it out for an unbounded window), got {window}")
    sink = msg.sink if msg.HasField("sink") else 0
    if sink < 0 or (window is not None and sink > window):
        raise ConfigError("sink", f"must be in [0, window], got sink={sink} window={window}")
    quality = msg.quality if msg.HasField("quality") else None
    if quality is not None:
        _int_in("quality", quality, 1, 100)

    return EffectiveConfig(
        prompt=prompt,
        width=width,
        height=height,
        chunk_frames=chunk_frames,
        steps=steps,
        seed=seed,
        guidance_scale=1.0,
        codec=codec,
        fps=fps,
        seconds=seconds,
        policy=policy,
        window=window,
        sink=sink,
        quality=quality,
        latent_width=width // sf,
        latent_height=height // sf,
        total_frames=total_frames,
        num_chunks=num_chunks,
    )
