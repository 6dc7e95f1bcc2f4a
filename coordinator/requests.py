"""``OpenRequest``: one stream's open as one validated value, from the servicer to the stream table.

Usage::

    request = OpenRequest.from_proto(msg, traceparent)       # coordinator.server: the wire's OpenStreamRequest
    request = OpenRequest(spec, text, chunk_rate=4.0)         # in process (tests, tools): the same checks
    session = engine.open(request)                            # admission.decide(request) -> table.open(request, ...)
    hold = engine.admitter.reserve(OpenRequest.for_hold(reserve_msg))  # admission before the prompt's encode
    session = engine.open(OpenRequest.from_proto(msg), hold)  # ... then the open claims the held place

Constructing one validates what needs no pipeline (a ValueError naming the field: INVALID_ARGUMENT): the decoder kind,
the pacing, the consumer's depth, the negative prompt and the step ladders, which it keeps by step count (``ladders``).
What needs the stages' model (``check_spec``) is admission's.  ``stagecast.wire`` is the only codec it uses.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import torch

from coordinator.slo import decoder_kind
from stagecast import wire
from stagecast.internal.v1 import pipeline_pb2 as pb
from stagecast.microstep import StreamSpec
from stagecast.sampling import MAX_STEPS

MAX_CONSUMER_DEPTH = 64  # chunks a consumer may declare it holds (OpenStreamRequest.consumer_depth)
MAX_CHUNK_RATE = 1000.0  # chunks per second a paced stream may ask for (OpenStreamRequest.chunk_rate)
MAX_TEXT_DIM = 1 << 16  # each size of a Reserve's text_shape (tokens, the encoder's width) is at most this


@dataclass(frozen=True, eq=False)
class OpenRequest:
    """A stream asking to open (``OpenStreamRequest``), validated; ``ladders`` is by step count once built."""

    spec: StreamSpec
    text: torch.Tensor
    negative_text: torch.Tensor | None = None  # a guided stream's negative prompt
    image: torch.Tensor | None = None  # image-to-video: the image latent the open event carries
    traceparent: str = ""
    acknowledges: bool = False
    consumer_depth: int = 0  # chunks the consumer holds between receiving and acknowledging (its VAE depth)
    chunk_rate: float = 0.0  # pacing: real-time chunks per second; 0: unpaced
    pace_offset_s: float = 0.0  # pacing: how much sooner than c / chunk_rate chunk c >= 1 is due
    # The ladder for each step count it may run (SLO controller); given as a list, kept as steps -> ladder.
    ladders: Mapping[int, tuple[float, ...]] | Sequence[Sequence[float]] | None = None
    latency_first: bool = False
    decoder: str = ""  # the decoder the gateway runs it on; "" is the full VAE

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "decoder", decoder_kind(self.decoder))  # ValueError naming decoder
        rate, offset = self.chunk_rate, self.pace_offset_s
        if not (rate == 0 or 0 < rate <= MAX_CHUNK_RATE):  # also catches NaN
            raise ValueError(f"chunk_rate must be 0 (unpaced) or in (0, {MAX_CHUNK_RATE}] chunks/s, got {rate}")
        if offset != 0 and not (rate > 0 and 0 < offset < 1 / rate):  # NaN too
            raise ValueError(
                f"pace_offset_s must be 0, or in (0, 1 / chunk_rate) for a paced stream; got {offset} "
                f"with chunk_rate {rate}"
            )
        if not isinstance(self.ladders, Mapping):
            set_(self, "ladders", ladders_by_steps(self.spec, self.ladders))
        if not 0 <= self.consumer_depth <= MAX_CONSUMER_DEPTH:
            raise ValueError(f"consumer_depth must be in [0, {MAX_CONSUMER_DEPTH}], got {self.consumer_depth}")
        check_negative_text(self.spec, self.text, self.negative_text)

    @property
    def by_steps(self) -> dict[int, tuple[float, ...]]:
        """The ladder for each step count it may run, ascending."""
        assert isinstance(self.ladders, Mapping)
        return dict(self.ladders)

    @property
    def max_steps(self) -> int:
        return max(self.by_steps)

    @property
    def best_effort(self) -> bool:
        """An unpaced stream (no chunk rate, no input clock): it yields to the paced ones in the scheduler and takes
        none of their capacity."""
        return self.chunk_rate <= 0 and not self.spec.input_latents

    @classmethod
    def from_proto(cls, msg: pb.OpenStreamRequest, traceparent: str = "") -> OpenRequest:
        """The wire's request (``traceparent``: the coordinator's span of the call, else the request's own)."""
        return cls(
            wire.spec_from_proto(msg.spec),
            wire.tensor_from_proto(msg.text),
            negative_text=wire.tensor_from_proto(msg.negative_text) if msg.HasField("negative_text") else None,
            image=wire.tensor_from_proto(msg.image) if msg.HasField("image") else None,
            traceparent=traceparent or msg.traceparent,
            acknowledges=msg.acknowledges,
            consumer_depth=msg.consumer_depth,
            chunk_rate=msg.chunk_rate,
            pace_offset_s=msg.pace_offset_s,
            ladders=[tuple(ladder.timesteps) for ladder in msg.ladders],
            latency_first=msg.latency_first,
            decoder=msg.decoder,
        )

    @classmethod
    def for_hold(cls, msg: pb.ReserveRequest) -> OpenRequest:
        """A Reserve's request (admission before the prompt is encoded): ``msg.open`` without its text, whose shape
        (``msg.text_shape``) admission checks; the text here is a zero-size-in-memory stand-in of that shape (and the
        negative prompt's, for a guided stream; an image-to-video stream's image latent of its spec's shape), never
        planned."""
        shape = tuple(int(n) for n in msg.text_shape)
        if len(shape) != 3 or not all(0 < n <= MAX_TEXT_DIM for n in shape):
            raise ValueError(f"text_shape: (1, tokens, dim) of positive sizes up to {MAX_TEXT_DIM}, got {list(shape)}")
        spec = wire.spec_from_proto(msg.open.spec)
        text = torch.zeros(1, 1, 1).expand(shape)
        image = None  # image-to-video: the image latent is encoded after admission; its stand-in has the spec's shape
        if spec.image_latents:
            image = torch.zeros(1, 1, 1, 1, 1).expand(1, spec.latent_channels, 1, spec.latent_height, spec.latent_width)
        open_ = msg.open
        return cls(
            spec,
            text,
            negative_text=text if spec.cfg else None,
            image=image,
            acknowledges=open_.acknowledges,
            consumer_depth=open_.consumer_depth,
            chunk_rate=open_.chunk_rate,
            pace_offset_s=open_.pace_offset_s,
            ladders=[tuple(ladder.timesteps) for ladder in open_.ladders],
            latency_first=open_.latency_first,
            decoder=open_.decoder,
        )


def ladders_by_steps(spec: StreamSpec, ladders: Sequence[Sequence[float]] | None) -> dict[int, tuple[float, ...]]:
    """The ladder for each step count a stream may run, validated; the spec's own when none are given."""
    if not ladders:
        return {spec.steps: spec.timesteps}
    if len(ladders) > MAX_STEPS:
        raise ValueError(f"ladders: at most {MAX_STEPS} (one per step count), got {len(ladders)}")
    out: dict[int, tuple[float, ...]] = {}
    for i, ladder in enumerate(ladders):
        try:
            checked = replace(spec, timesteps=tuple(ladder)).timesteps
        except ValueError as exc:
            raise ValueError(f"ladders[{i}]: {exc}") from None
        if len(checked) in out:
            raise ValueError(f"ladders[{i}]: a second ladder of {len(checked)} steps")
        out[len(checked)] = checked
    if out.get(spec.steps) != spec.timesteps:
        raise ValueError(f"ladders: none is the stream's own ladder {list(spec.timesteps)}")
    if spec.input_latents and any(ladder[0] != spec.timesteps[0] for ladder in out.values()):
        # Its input latents are noised to timesteps[0] (the stream's strength): every ladder must start there.
        raise ValueError(f"ladders: a video-to-video stream's ladders must all start at {spec.timesteps[0]:g}")
    return dict(sorted(out.items()))


def check_negative_text(spec: StreamSpec, text: torch.Tensor, negative_text: torch.Tensor | None) -> None:
    """A guided stream (``guidance_scale > 1``) carries a negative prompt of the text's shape; no other stream does."""
    if spec.cfg and negative_text is None:
        raise ValueError(
            f"negative_text: required with guidance_scale={spec.guidance_scale} (the unconditional branch)"
        )
    if not spec.cfg and negative_text is not None:
        raise ValueError("negative_text: only a guided stream (guidance_scale > 1) takes a negative prompt")
    if negative_text is not None and tuple(negative_text.shape) != tuple(text.shape):
        raise ValueError(f"negative_text: has shape {tuple(negative_text.shape)}, expected {tuple(text.shape)}")
