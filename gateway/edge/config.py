"""Turn a client's ``stagecast.v1.StreamConfig`` into the effective config of one stream, or say which field is wrong.

Usage::

    cfg = resolve_config(msg, defaults=ServingDefaults(), model=ModelInfo.from_checkpoint(root))
    cfg = resolve_config(msg, defaults=..., model=..., decoders=Decoders(tiny=True))  # a deployment with a tiny one
    # raises ConfigError("width: must be a positive multiple of 16 ...") -> INVALID_ARGUMENT
    cfg.total_frames, cfg.num_chunks     # None, None for a stream that runs until stopped
    cfg.timesteps, cfg.shift, cfg.update      # the ladder the stream runs: the checkpoint's for cfg.steps, or its own
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
from dataclasses import dataclass, field

from gateway.checkpoint import MAX_NEGATIVE_PROMPT_CHARS, MAX_WINDOW, ModelInfo, ServingDefaults
from stagecast import api
from stagecast.media import CODECS, DEFAULT_CRF, DEFAULT_JPEG_QUALITY, quality_to_crf
from stagecast.microstep import MAX_GUIDANCE, POLICIES, StreamSpec
from stagecast.sampling import MAX_STEPS, SamplerError, as_f32
from stagecast.v1 import stream_pb2 as pb

# The hard limits of the public API (the ranges in proto/stagecast/v1/stream.proto say the same).  A gateway's cost
# budget (gateway.edge.admission) may refuse a stream inside them.
MAX_PROMPT_CHARS = MAX_NEGATIVE_PROMPT_CHARS  # tokenising is the real limit; this stops absurd payloads before it runs
MAX_SIDE = 4096
MAX_CHUNK_FRAMES = 16
MAX_SECONDS = 24 * 3600.0
MAX_FPS = 240.0
# Every encoder takes the rate as a fraction with a denominator <= 1001 (the MP4 time base), so 1e-4 fps rounds to 0
# and fails in the encoder; the API's range starts at 1 frame per second for every codec alike.
MIN_FPS = 1.0
MAX_INPUT_TIMEOUT = 3600.0  # seconds a video-to-video stream may wait for its next input frame
DEFAULT_INPUT_TIMEOUT = 10.0
# The largest legal request (stagecast.api says how it is sized; the web edge's bound is the same constant).  The
# public server refuses bigger messages before parsing them.
MAX_REQUEST_BYTES = api.MAX_REQUEST_BYTES

# Each codec's quality when the request leaves it out; Started.config writes it out.
DEFAULT_H264_QUALITY = 55  # quality_to_crf(55) == 23, x264's own default CRF
DEFAULT_QUALITY = {"jpeg": DEFAULT_JPEG_QUALITY, "h264": DEFAULT_H264_QUALITY, "raw": 100}
assert quality_to_crf(DEFAULT_H264_QUALITY) == DEFAULT_CRF


class ConfigError(ValueError):
    """A request field is invalid; the message starts with the field's name."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class Decoders:
    """The decoders a deployment holds, and the one a stream that names none (``DECODER_UNSPECIFIED``) gets.

    The full VAE is always there and is the default; a tiny decoder exists only where the gateway was given one
    (``--tiny-decoder PATH`` or ``tiny_decoder/`` in the checkpoint), and ``--default-decoder tiny`` makes it the
    default."""

    tiny: bool = False
    default: str = api.DEFAULT_DECODER

    def __post_init__(self) -> None:
        if self.default not in api.DECODERS:
            raise ValueError(f"--default-decoder: must be one of {', '.join(api.DECODERS)}, got {self.default!r}")
        if self.default == "tiny" and not self.tiny:
            raise ValueError(
                "--default-decoder tiny: this deployment has no tiny decoder (give --tiny-decoder PATH, or put "
                "tiny_decoder/ in the checkpoint)"
            )


class RequestTooLarge(ConfigError):
    """A message other than an input frame over ``MAX_REQUEST_BYTES`` (RESOURCE_EXHAUSTED)."""


@dataclass(frozen=True)
class EffectiveConfig:
    prompt: str
    width: int
    height: int
    chunk_frames: int
    steps: int
    seed: int
    guidance_scale: float  # 1.0: none
    codec: str
    fps: float
    seconds: float | None
    policy: str
    window: int | None  # None: unbounded
    sink: int
    quality: int  # the codec's default when the request left it out
    latent_width: int
    latent_height: int
    total_frames: int | None  # None: until stopped
    num_chunks: int | None
    timesteps: tuple[float, ...] = (1000.0, 750.0, 500.0, 250.0)  # the ladder, one timestep per step (float32)
    shift: float = 1.0  # the checkpoint's flow-matching shift
    update: str = "x0"  # the checkpoint's update rule: "x0" (re-noise) or "euler"
    # Video-to-video: the ladder timestep the input is noised to (None: a text stream), what the gateway does when
    # input comes faster than the pipeline serves it, and how long it waits for the next input frame.
    strength: float | None = None
    input_pacing: str = "live"
    input_timeout: float = DEFAULT_INPUT_TIMEOUT
    # Image-to-video: the first frame, (height, width, 3) uint8 RGB (None: no image).
    image: object = field(default=None, compare=False, repr=False)
    negative_prompt: str = ""  # the unconditional branch's prompt (guidance_scale > 1 only)
    decoder: str = api.DEFAULT_DECODER  # what turns its latents into frames: "full" (the VAE) or "tiny"

    @property
    def v2v(self) -> bool:
        return self.strength is not None

    @property
    def pipeline_timesteps(self) -> tuple[float, ...]:
        """The levels the pipeline runs: the ladder, or for video-to-video its entries from ``strength`` down."""
        if self.strength is None:
            return self.timesteps
        return self.timesteps[self.timesteps.index(self.strength) :]

    pace: bool = True  # generate at ``fps`` (plus the coordinator's playout buffer), not as fast as possible
    min_steps: int = 0  # SLO-adaptive bounds (0: ``steps``, a fixed step count)
    max_steps: int = 0
    steps_preference: str = "steps_first"
    ladders: tuple[tuple[float, ...], ...] = ()  # the sampler's ladder for each offered count in the bounds
    temporal_factor: int = 4  # video frames per latent frame after the first (the VAE's)

    def __post_init__(self) -> None:
        if not self.min_steps:
            object.__setattr__(self, "min_steps", self.steps)
        if not self.max_steps:
            object.__setattr__(self, "max_steps", self.steps)
        if not self.ladders:
            object.__setattr__(self, "ladders", (self.pipeline_timesteps,))

    @property
    def chunk_rate(self) -> float:
        """Pacing: chunks per second at ``fps`` in steady state (a chunk is ``temporal_factor * chunk_frames``
        frames); 0 for an unpaced stream or a video-to-video one (its input is its clock)."""
        if not self.pace or self.v2v:  # a video-to-video stream's clock is its input
            return 0.0
        return self.fps / (self.temporal_factor * self.chunk_frames)

    @property
    def pace_offset_s(self) -> float:
        """Pacing: how much sooner than ``c / chunk_rate`` chunk c >= 1 is due at the viewer. The first chunk decodes
        to ``temporal_factor - 1`` fewer video frames than the others (its first latent frame gives one frame), so
        every later chunk's frames are due that many frame periods sooner; 0 for an unpaced stream."""
        return (self.temporal_factor - 1) / self.fps if self.chunk_rate > 0 else 0.0

    def stream_spec(self, *, latent_channels: int, text_len: int) -> StreamSpec:
        return StreamSpec(
            stream_id=0,  # the coordinator assigns it
            latent_channels=latent_channels,
            chunk_frames=self.chunk_frames,
            latent_height=self.latent_height,
            latent_width=self.latent_width,
            timesteps=self.pipeline_timesteps,
            shift=self.shift,
            sampler=self.update,
            seed=self.seed,
            policy=self.policy,
            window=self.window,
            sink=self.sink,
            num_chunks=self.num_chunks,
            text_len=text_len,
            input_latents=self.v2v,
            image_latents=self.image is not None,
            guidance_scale=self.guidance_scale,
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
            codec=api.codec_value(self.codec),
            target_fps=self.fps,
            policy=api.policy_value(self.policy),
            window=self.window or 0,  # 0: unbounded, written out so that every field is present
            sink=self.sink,
            quality=self.quality,
            timesteps=self.timesteps,
            shift=self.shift,
            pace=self.pace,
            min_steps=self.min_steps,
            max_steps=self.max_steps,
            steps_preference=api.steps_preference_value(self.steps_preference),
            decoder=api.decoder_value(self.decoder),
        )
        if self.seconds is not None:
            msg.seconds = self.seconds
        if self.strength is not None:
            msg.strength = self.strength
            msg.input_pacing = api.input_pacing_value(self.input_pacing)
            msg.input_timeout = self.input_timeout
        if self.guidance_scale > 1.0:
            msg.negative_prompt = self.negative_prompt
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


def parse_client_message(data: bytes) -> pb.ClientMessage:
    """A request's bytes as a ClientMessage, or ``ConfigError("request", ...)`` (INVALID_ARGUMENT)."""
    return _parse(pb.ClientMessage, data)


def parse_status_request(data: bytes) -> pb.StatusRequest:
    return _parse(pb.StatusRequest, data)


def _parse(cls, data: bytes):
    try:
        return cls.FromString(data)
    except Exception as exc:  # DecodeError; anything else the parser raises is the same verdict
        name = cls.DESCRIPTOR.full_name
        raise ConfigError("request", f"{len(data)} bytes that are not a {name} ({exc})") from None


def decode_image(data: bytes, width: int, height: int):
    """A first-frame image (JPEG or PNG) as (height, width, 3) uint8 RGB, or ``ConfigError("image", ...)``."""
    import io

    import numpy as np
    from PIL import Image

    try:
        img = Image.open(io.BytesIO(data), formats=["JPEG", "PNG"])  # the header only
    except Exception as exc:
        raise ConfigError("image", f"{len(data)} bytes that are not a JPEG or PNG ({type(exc).__name__})") from None
    if img.size != (width, height):  # before the pixels are decoded
        raise ConfigError("image", f"is {img.size[0]}x{img.size[1]}; this stream is {width}x{height}")
    try:
        return np.asarray(img.convert("RGB"))
    except Exception as exc:
        raise ConfigError("image", f"does not decode ({type(exc).__name__}: {exc})") from None


def check_transition(value: int, cfg: EffectiveConfig) -> bool:
    """A prompt update's transition: True for RECACHE (which needs a bounded KV window), False for CUT; an unknown
    value or a recache on an unbounded window raises ``ConfigError("transition", ...)``."""
    if value in (pb.TRANSITION_UNSPECIFIED, pb.TRANSITION_CUT):
        return False
    if value != pb.TRANSITION_RECACHE:
        raise ConfigError("transition", f"must be TRANSITION_CUT or TRANSITION_RECACHE, got {value}")
    if cfg.window is None:
        raise ConfigError(
            "transition", "RECACHE rebuilds the KV window; this stream's window is unbounded (set window)"
        )
    return True


def check_prompt(prompt: str, field: str = "prompt") -> str:
    """The length and emptiness checks every prompt (a config's or an update's) passes before it is tokenised."""
    if len(prompt) > MAX_PROMPT_CHARS:
        raise ConfigError(field, f"is {len(prompt)} characters; the limit is {MAX_PROMPT_CHARS}")
    if not prompt.strip():
        raise ConfigError(field, "must not be empty")
    return prompt


def _enum(field: str, value: int, names: dict[str, int], default: str) -> str:
    """An enum field's name (UNSPECIFIED: ``default``); a number this gateway does not know names the field."""
    if value == 0:
        return default
    for name, number in names.items():
        if number == value:
            return name
    enum = pb.StreamConfig.DESCRIPTOR.fields_by_name[field].enum_type
    allowed = ", ".join(enum.values_by_number[n].name for n in names.values())
    raise ConfigError(field, f"must be one of {allowed} (UNSPECIFIED: {default}), got {value}")


def _sampler_ladder(sampler, steps: int) -> tuple[float, ...] | None:
    try:
        return sampler.ladder_for(steps)
    except SamplerError:
        return None


def _step_bounds(msg: pb.StreamConfig, sampler, steps: int, timesteps: tuple[float, ...]):
    """(min_steps, max_steps, ladders, timesteps) of an SLO-adaptive stream: the bounds checked against the stream's
    steps and the sampler's offered counts, and the sampler's ladder for every offered count between them."""
    has_min, has_max = msg.HasField("min_steps"), msg.HasField("max_steps")
    if not (has_min or has_max):
        return steps, steps, (), timesteps
    if msg.HasField("strength"):
        for name, present in (("min_steps", has_min), ("max_steps", has_max)):
            if present and getattr(msg, name) != steps:
                raise ConfigError(
                    name, "a video-to-video stream runs its ladder from its strength; leave min_steps and max_steps out"
                )
        return steps, steps, (), timesteps
    # A ladder that is the sampler's own for its count (as Started.config echoes it) is not a stream's own ladder.
    own = bool(msg.timesteps) and timesteps != _sampler_ladder(sampler, steps)
    for name, present in (("min_steps", has_min), ("max_steps", has_max)):
        if present:
            _int_in(name, getattr(msg, name), 1, MAX_STEPS)
            if own and getattr(msg, name) != steps:
                raise ConfigError(
                    name,
                    f"a stream with its own timesteps runs them ({steps} steps); leave min_steps and max_steps out",
                )
    lo = msg.min_steps if has_min else min(steps, msg.max_steps)
    hi = msg.max_steps if has_max else max(steps, msg.min_steps)
    if own:
        return steps, steps, (), timesteps
    if lo > hi:
        raise ConfigError("min_steps", f"must be <= max_steps ({hi}), got {lo}")
    if msg.HasField("steps") and not lo <= steps <= hi:
        raise ConfigError("steps", f"must lie in [min_steps, max_steps] = [{lo}, {hi}], got {steps}")
    offered = [n for n in sampler.supported_steps() if lo <= n <= hi]
    if not offered:
        raise ConfigError(
            "min_steps", f"the sampler offers none of {lo}..{hi} steps ({list(sampler.supported_steps())})"
        )
    if steps not in offered:  # steps left out: start at the most the bounds allow
        steps = offered[-1]
        timesteps = sampler.ladder_for(steps)
    return lo, hi, tuple(sampler.ladder_for(n) for n in offered), timesteps


def _resolve_steps(msg: pb.StreamConfig, defaults: ServingDefaults) -> tuple[list[float], int, int, list]:
    """``steps`` / ``timesteps`` / ``shift`` and the SLO bounds: the stream's ladder, its min and max steps and the
    ladders it may switch between."""
    steps = msg.steps if msg.HasField("steps") else None
    if steps is not None:
        _int_in("steps", steps, 1, MAX_STEPS)
    sampler = defaults.sampler
    try:
        timesteps = sampler.resolve(steps=steps, timesteps=list(msg.timesteps), default_steps=defaults.steps)
    except SamplerError as exc:
        raise ConfigError(exc.field, str(exc).removeprefix(f"{exc.field}: ")) from None
    if msg.HasField("shift") and as_f32(msg.shift) != sampler.shift:
        raise ConfigError(
            "shift",
            f"this checkpoint's sampler runs at shift {sampler.shift:g} (stagecast.json); leave shift out or send "
            f"{sampler.shift:g}, got {msg.shift:g}",
        )
    min_steps, max_steps, ladders, timesteps = _step_bounds(msg, sampler, len(timesteps), timesteps)
    return timesteps, min_steps, max_steps, ladders


def _resolve_guidance(msg: pb.StreamConfig, defaults: ServingDefaults) -> tuple[float, str]:
    """``guidance_scale`` and ``negative_prompt``."""
    guidance = as_f32(msg.guidance_scale) if msg.HasField("guidance_scale") else 1.0
    if not 1.0 <= guidance <= MAX_GUIDANCE:  # also NaN
        raise ConfigError("guidance_scale", f"must be in [1, {MAX_GUIDANCE:g}] (1: no guidance), got {guidance:.6g}")
    if guidance > 1.0 and defaults.guidance_distilled:
        raise ConfigError(
            "guidance_scale",
            f"this checkpoint is guidance-distilled (stagecast.json guidance_distilled: true) and runs only 1.0, got"
            f" {guidance:g}",
        )
    negative_prompt = defaults.negative_prompt
    if msg.HasField("negative_prompt"):
        if guidance == 1.0:
            raise ConfigError("negative_prompt", "is used only with guidance_scale > 1 (leave it out)")
        negative_prompt = msg.negative_prompt
        if len(negative_prompt) > MAX_PROMPT_CHARS:
            raise ConfigError(
                "negative_prompt", f"is {len(negative_prompt)} characters; the limit is {MAX_PROMPT_CHARS}"
            )
    return guidance, negative_prompt


def _resolve_timing(
    msg: pb.StreamConfig,
    defaults: ServingDefaults,
    model: ModelInfo,
    codec: str,
    width: int,
    height: int,
    chunk_frames: int,
) -> tuple[float, float | None, int | None, int | None]:
    """``target_fps`` and ``seconds``: the rate, the length (None: until stopped), and its frames and chunks."""
    fps = msg.target_fps if msg.HasField("target_fps") else defaults.fps
    if not (MIN_FPS <= fps <= MAX_FPS) or math.isnan(fps):
        raise ConfigError("target_fps", f"must be in [{MIN_FPS:g}, {MAX_FPS:g}], got {fps:.6g}")
    if codec == "h264" and (width % 2 or height % 2):  # yuv420p: whole chroma samples
        raise ConfigError("width" if width % 2 else "height", f"must be even with codec H264, got {width}x{height}")
    if not msg.HasField("seconds"):
        return fps, None, None, None
    seconds = msg.seconds
    if not (0 < seconds <= MAX_SECONDS) or math.isnan(seconds):
        raise ConfigError("seconds", f"must be in (0, {MAX_SECONDS:.0f}] (leave it out to stream until stopped)")
    total_frames, num_chunks = duration_plan(seconds, fps, chunk_frames, model.temporal_factor)
    return fps, seconds, total_frames, num_chunks


def _resolve_window(msg: pb.StreamConfig, defaults: ServingDefaults) -> tuple[int, int]:
    """``window`` and ``sink``.  Left out: the checkpoint's serving default (stagecast.json ``window``/``sink``; 0:
    unbounded).  The default sink comes only with the default window: a request's own window keeps sink 0 unless it
    sends one."""
    window = msg.window if msg.HasField("window") else defaults.window
    if not 0 <= window <= MAX_WINDOW:
        raise ConfigError(
            "window",
            f"must be in [0, {MAX_WINDOW}] latent frames (0: unbounded; absent: {defaults.window}), got {window}",
        )
    sink = msg.sink if msg.HasField("sink") else (0 if msg.HasField("window") else defaults.sink)
    if not 0 <= sink <= (window or MAX_WINDOW):
        raise ConfigError("sink", f"must be in [0, window] (window {window or 'unbounded'}), got {sink}")
    return window, sink


def _resolve_decoder(msg: pb.StreamConfig, decoders: Decoders) -> str:
    """``decoder``: one the deployment holds."""
    decoder = _enum("decoder", msg.decoder, api.DECODERS, decoders.default)
    if decoder == "tiny" and not decoders.tiny:
        raise ConfigError(
            "decoder",
            "DECODER_TINY: this deployment has no tiny decoder (its gateway runs without --tiny-decoder and the "
            "checkpoint has no tiny_decoder/); ask for DECODER_FULL or leave decoder out",
        )
    return decoder


def _resolve_video_input(
    msg: pb.StreamConfig, timesteps: list[float], seconds: float | None
) -> tuple[float | None, str, float]:
    """``strength``, ``input_pacing`` and ``input_timeout``: a video-to-video stream's (strength None: not one)."""
    if not msg.HasField("strength"):
        return None, api.DEFAULT_INPUT_PACING, DEFAULT_INPUT_TIMEOUT
    strength = as_f32(msg.strength)
    if strength not in timesteps:  # NaN is never in it
        ladder = ", ".join(f"{t:g}" for t in timesteps)
        raise ConfigError(
            "strength",
            f"must be one of the stream's ladder timesteps [{ladder}] (the level the input is noised to), "
            f"got {msg.strength:g}",
        )
    if seconds is not None:
        raise ConfigError("seconds", "a video-to-video stream (strength) runs as long as its input: leave seconds out")
    input_pacing = _enum("input_pacing", msg.input_pacing, api.INPUT_PACINGS, api.DEFAULT_INPUT_PACING)
    input_timeout = DEFAULT_INPUT_TIMEOUT
    if msg.HasField("input_timeout"):
        input_timeout = msg.input_timeout
        if not (0 < input_timeout <= MAX_INPUT_TIMEOUT) or math.isnan(input_timeout):
            bound = f"(0, {MAX_INPUT_TIMEOUT:g}]"
            raise ConfigError("input_timeout", f"must be in {bound} seconds, got {input_timeout:.6g}")
    return strength, input_pacing, input_timeout


def _resolve_image(
    msg: pb.StreamConfig, model: ModelInfo, width: int, height: int, strength: float | None
) -> object | None:  # (height, width, 3) uint8 (decode_image)
    """``image``: an image-to-video stream's first frame, decoded at the stream's size (None: not one)."""
    if not msg.image:
        return None
    image = decode_image(msg.image, width, height)
    if strength is not None:
        raise ConfigError("image", "a video-to-video stream (strength) takes its first frame from its input")
    if not model.per_token_timesteps:
        raise ConfigError(
            "image",
            "this checkpoint cannot condition on an image: its first frame would need timestep 0 beside noisy "
            "frames, and its transformer takes one timestep per item (Wan2.2-TI2V takes one per token)",
        )
    return image


def resolve_config(
    msg: pb.StreamConfig, *, defaults: ServingDefaults, model: ModelInfo, decoders: Decoders = Decoders()
) -> EffectiveConfig:
    """Validate ``msg`` field by field (the first bad field raises ``ConfigError``) and fill in defaults;
    ``decoders`` says which decoders the deployment holds (the full VAE only, unless told).  The steps below run in
    this order, so which field a request with several bad ones is told about does not change."""
    prompt = check_prompt(msg.prompt)
    sf, (p_h, p_w) = model.spatial_factor, model.patch_hw
    width = _size("width", msg.width if msg.HasField("width") else defaults.width, model.width_multiple, sf, p_w)
    height = _size("height", msg.height if msg.HasField("height") else defaults.height, model.height_multiple, sf, p_h)
    chunk_frames = msg.chunk_frames if msg.HasField("chunk_frames") else defaults.chunk_frames
    _int_in("chunk_frames", chunk_frames, 1, MAX_CHUNK_FRAMES)
    sampler = defaults.sampler
    timesteps, min_steps, max_steps, ladders = _resolve_steps(msg, defaults)
    steps = len(timesteps)
    steps_preference = _enum(
        "steps_preference", msg.steps_preference, api.STEPS_PREFERENCES, api.DEFAULT_STEPS_PREFERENCE
    )
    seed = msg.seed if msg.HasField("seed") else random.randrange(2**31)
    guidance, negative_prompt = _resolve_guidance(msg, defaults)
    codec = _enum("codec", msg.codec, api.CODECS, api.DEFAULT_CODEC)
    assert codec in CODECS
    fps, seconds, total_frames, num_chunks = _resolve_timing(msg, defaults, model, codec, width, height, chunk_frames)
    policy = _enum("policy", msg.policy, api.POLICIES, api.DEFAULT_POLICY)
    assert policy in POLICIES
    window, sink = _resolve_window(msg, defaults)
    quality = msg.quality if msg.HasField("quality") else DEFAULT_QUALITY[codec]
    _int_in("quality", quality, 1, 100)
    decoder = _resolve_decoder(msg, decoders)
    strength, input_pacing, input_timeout = _resolve_video_input(msg, timesteps, seconds)
    image = _resolve_image(msg, model, width, height, strength)
    if strength is None:
        for name in ("input_pacing", "input_timeout"):
            if msg.HasField(name) if name == "input_timeout" else msg.input_pacing:
                raise ConfigError(name, "applies to video-to-video streams only: set strength")

    return EffectiveConfig(
        prompt=prompt,
        width=width,
        height=height,
        chunk_frames=chunk_frames,
        steps=steps,
        seed=seed,
        guidance_scale=guidance,
        codec=codec,
        fps=fps,
        seconds=seconds,
        policy=policy,
        window=window or None,
        sink=sink,
        quality=quality,
        latent_width=width // sf,
        latent_height=height // sf,
        total_frames=total_frames,
        num_chunks=num_chunks,
        timesteps=timesteps,
        shift=sampler.shift,
        update=sampler.update,
        strength=strength,
        input_pacing=input_pacing,
        input_timeout=input_timeout,
        image=image,
        pace=msg.pace if msg.HasField("pace") else True,
        min_steps=min_steps,
        max_steps=max_steps,
        steps_preference=steps_preference,
        ladders=ladders,
        temporal_factor=model.temporal_factor,
        negative_prompt=negative_prompt,
        decoder=decoder,
    )
