"""Free slots: how many more default-config streams this pipeline would admit now (``PipelineEngine.slots``).

Usage::

    slots = engine.slots()          # Slots(free=3, total=7): 4 streams open, 3 more default streams fit
    engine.status().slots_free      # the same numbers in GetStatus (ClusterStatus.slots_free / slots_total)

A slot is one more stream of the public defaults (what a client that sets nothing gets from the gateway:
``gateway.edge.config.resolve_config`` over the checkpoint's serving defaults), priced by the very admission that
refuses
streams (stream cap, KV memory, SLO capacity with its decoder's cost): hypothetical newcomers are added one by one
until the first refusal, and nothing is reserved.  The newcomers start together (none has a frame yet), so their start
is priced as a burst's (``coordinator.slo``, "Admission"): the count is what that many streams arriving at once would
get, and a door that sends them at once is not refused past it.  A pipeline that is not formed has no free slot.

``StreamDefaults`` holds what the gateway fills in for such a request; its defaults are the gateway's without a
``stagecast.json`` (``gateway.checkpoint.ServingDefaults``) and the public API's (``stagecast.api``).  Where the
engine is given none, the serving size comes from the stages' calibration, which read it from the same
``stagecast.json`` (``stage_service.calibration.serving_shape``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from coordinator.admission import Admission, Admitted
from coordinator.errors import AdmissionError
from coordinator.requests import OpenRequest
from stagecast.api import (
    DEFAULT_CHUNK_FRAMES,
    DEFAULT_DECODER,
    DEFAULT_FPS,
    DEFAULT_HEIGHT,
    DEFAULT_POLICY,
    DEFAULT_STEPS,
    DEFAULT_TEXT_LEN,
    DEFAULT_WIDTH,
)
from stagecast.internal.v1 import pipeline_pb2 as pb
from stagecast.microstep import StreamSpec
from stagecast.sampling import SamplerConfig

logger = logging.getLogger("coordinator.engine")

TEMPORAL_FACTOR = 4  # video frames per latent frame after the first (the Wan VAEs'; the gateway's ModelInfo)


@dataclass(frozen=True)
class Slots:
    """``free``: more default streams admitted now; ``total``: ``free`` plus the streams open now."""

    free: int
    total: int


@dataclass(frozen=True)
class StreamDefaults:
    """What the gateway fills in for a request that sets nothing (frame size in pixels, window in latent frames, 0:
    unbounded)."""

    width: int = DEFAULT_WIDTH
    height: int = DEFAULT_HEIGHT
    chunk_frames: int = DEFAULT_CHUNK_FRAMES
    text_len: int = DEFAULT_TEXT_LEN
    steps: int = DEFAULT_STEPS
    fps: float = DEFAULT_FPS
    window: int = 0
    sink: int = 0
    policy: str = DEFAULT_POLICY
    decoder: str = DEFAULT_DECODER
    sampler: SamplerConfig = field(default_factory=SamplerConfig)

    @property
    def chunk_rate(self) -> float:
        """Chunks per second at ``fps`` (a paced stream, as ``EffectiveConfig.chunk_rate``)."""
        return self.fps / (TEMPORAL_FACTOR * self.chunk_frames)

    @classmethod
    def serving(cls, calibration: pb.StageCalibration | None, model: dict | None) -> StreamDefaults:
        """The public defaults at the serving size a stage's calibration timed (None: 832x480)."""
        return cls().with_shape(calibration, spatial_factor(model or {}))

    def with_shape(self, calibration: pb.StageCalibration | None, spatial_factor: int) -> StreamDefaults:
        """These defaults with the serving size a stage's calibration timed (None: unchanged)."""
        if calibration is None or calibration.latent_height <= 0 or calibration.latent_width <= 0:
            return self
        return StreamDefaults(
            width=calibration.latent_width * spatial_factor,
            height=calibration.latent_height * spatial_factor,
            chunk_frames=calibration.chunk_frames or self.chunk_frames,
            text_len=calibration.text_len or self.text_len,
            steps=self.steps,
            fps=self.fps,
            window=self.window,
            sink=self.sink,
            policy=self.policy,
            decoder=self.decoder,
            sampler=self.sampler,
        )

    def request(self, model: dict | None) -> OpenRequest:
        """The ``OpenRequest`` of such a stream, as ``gateway.stream.run.StreamRun.open_pipeline`` sends it (its text's
        shape is all admission reads of it)."""
        spec = self.spec(model)
        text_dim = int((model or {}).get("text_dim") or 1)
        text = torch.empty(1, spec.text_len, text_dim, device="meta")
        return OpenRequest(spec, text, acknowledges=True, chunk_rate=self.chunk_rate, decoder=self.decoder)

    def spec(self, model: dict | None) -> StreamSpec:
        """The ``StreamSpec`` the gateway sends for such a request (``EffectiveConfig.stream_spec``), for the stages'
        model config (None: a 16-channel Wan2.1 model)."""
        model = model or {}
        channels = int(model.get("in_channels") or 16)
        factor = spatial_factor(model)
        return StreamSpec(
            stream_id=0,
            latent_channels=channels,
            chunk_frames=self.chunk_frames,
            latent_height=self.height // factor,
            latent_width=self.width // factor,
            timesteps=self.sampler.ladder_for(self.steps),
            shift=self.sampler.shift,
            sampler=self.sampler.update,
            policy=self.policy,
            window=self.window or None,
            sink=self.sink,
            text_len=self.text_len,
        )


def spatial_factor(model: dict) -> int:
    """Pixels per latent pixel: the Wan2.2 VAE (48 latent channels) is 16x, Wan2.1's 8x."""
    return 16 if model.get("in_channels") == 48 else 8


def free_slots(
    admission: Admission, admitted: Admitted, defaults: StreamDefaults, model: dict | None, *, ready: bool
) -> Slots:
    """The dry run: streams of ``defaults`` added one by one beside ``admitted`` through ``Admission.decide`` until the
    first refusal (the stream cap ends it at the latest); nothing is reserved.  0 free while not ``ready``."""
    if not ready:
        return Slots(0, admitted.count)
    try:
        request = defaults.request(model)
    except ValueError as exc:
        logger.warning("free slots: the default stream is not valid (%s)", exc)
        return Slots(0, admitted.count)
    free = 0
    while free <= admission.max_streams:
        try:
            reservation = admission.decide(request, admitted, ready=True)
        except AdmissionError:
            break
        admitted = admitted.plus(reservation)
        free += 1
    return Slots(free, admitted.count)
