"""Which streams the coordinator opens: one function, its checks in a stated order, each refusal naming its limit.

Usage (``PipelineEngine.open`` calls it under the engine's lock)::

    admit(spec, text, AdmissionState(ready=..., registered=2, world_size=2, active=3, max_streams=16, model=cfg))

The order: the pipeline is formed (UNAVAILABLE), the stream-count cap (RESOURCE_EXHAUSTED), the stream against the
model (INVALID_ARGUMENT, ``stagecast.model.config.check_spec``), then capacity (RESOURCE_EXHAUSTED with a retry
delay): the SLO controller's verdict on whether the admitted streams at their min_steps and this one at its
min_steps are held at their frame rates by the measured stage times (``coordinator.slo``).  The gateway checks its
own count cap and the per-stream cost budget before it opens a coordinator stream.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc
import torch

from stagecast.grpc_util import StatusError
from stagecast.microstep import StreamSpec
from stagecast.model.config import DiTConfig, check_image, check_spec
from stagecast.model.dit_configs import expands_timesteps

MAX_CONSUMER_DEPTH = 64  # chunks a consumer may declare it holds (OpenStreamRequest.consumer_depth)


class AdmissionError(StatusError):
    """A stream the coordinator will not open, with the status its caller gets."""


@dataclass(frozen=True)
class AdmissionState:
    ready: bool  # a generation is formed
    registered: int  # stages registered and not lost
    world_size: int
    active: int  # streams open now
    max_streams: int
    model: dict | None  # the stages' model config (None before any stage registered)
    last_error: str = ""
    capacity: Capacity | None = None  # None: not checked (an unpaced stream, or no stage times known yet)


@dataclass(frozen=True)
class Capacity:
    """The SLO controller's verdict on one more stream."""

    fits: bool
    detail: str = ""  # what the refusal says: the utilization it would need
    retry_after_s: float = 0.0  # when capacity is likely back (the soonest end of a bounded stream)


def admit(
    spec: StreamSpec,
    text: torch.Tensor,
    state: AdmissionState,
    *,
    consumer_depth: int = 0,
    image: torch.Tensor | None = None,
    negative_text: torch.Tensor | None = None,
) -> None:
    """Raise ``AdmissionError`` (or ``ValueError`` for a malformed request) unless the stream may open now."""
    if not 0 <= consumer_depth <= MAX_CONSUMER_DEPTH:
        raise ValueError(f"consumer_depth must be in [0, {MAX_CONSUMER_DEPTH}], got {consumer_depth}")
    check_negative_text(spec, text, negative_text)
    if not state.ready:
        detail = f"; last error: {state.last_error}" if state.last_error else ""
        raise AdmissionError(
            grpc.StatusCode.UNAVAILABLE,
            f"pipeline is not ready ({state.registered}/{state.world_size} stages registered{detail})",
        )
    if state.active >= state.max_streams:
        raise AdmissionError(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"too many streams: {state.active} of {state.max_streams} are active (the coordinator's stream limit)",
        )
    if state.model is not None:
        try:
            check_spec(spec, DiTConfig.from_kwargs(state.model), tuple(text.shape))
            shape = None if image is None else tuple(image.shape)
            check_image(spec, shape, per_token=expands_timesteps(state.model))
        except ValueError as exc:
            raise AdmissionError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
    if state.capacity is not None and not state.capacity.fits:
        raise AdmissionError(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"over capacity: {state.capacity.detail} (the measured capacity; retry after "
            f"{state.capacity.retry_after_s:.1f} s)",
            retry_after_s=state.capacity.retry_after_s,
        )


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
