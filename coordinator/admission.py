"""Which streams the coordinator opens: one function, its checks in a stated order, each refusal naming its limit.

Usage (``PipelineEngine.open`` calls it under the engine's lock)::

    admit(spec, text, AdmissionState(ready=..., registered=2, world_size=2, active=3, max_streams=16, model=cfg))

The order: the pipeline is formed (UNAVAILABLE), the stream-count cap (RESOURCE_EXHAUSTED), the stream against the
model (INVALID_ARGUMENT, ``stagecast.model.config.check_spec``), then KV memory (RESOURCE_EXHAUSTED), then capacity
(RESOURCE_EXHAUSTED with a retry delay): the SLO controller's verdict on whether the admitted streams at their
min_steps and this one at its min_steps are held at their frame rates by the measured stage times
(``coordinator.slo``).  The gateway checks its own count cap and the per-stream cost budget before it opens a
coordinator stream.

KV memory (``kv_verdict``): every stage process tells the coordinator at Form how many bytes it gives to streams' KV
(``FormReply.kv_budget_bytes``, ``stage_service.kv_budget``; 0: no limit), and a stream is admitted only while, on
every stage, the worst-case KV of the admitted streams plus its own (``stagecast.kv_memory.stream_kv_bytes``) fits.
A stream that could not fit even alone is refused naming ``window`` (with the largest window that fits), and one
that fits alone but not beside the admitted streams with a retry delay.  A stream's bytes are reserved while it is
open and given back when it ends, however it ends.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import grpc
import torch

from stagecast.grpc_util import StatusError
from stagecast.kv_memory import format_bytes, max_context_frames
from stagecast.microstep import StreamSpec
from stagecast.model.config import DiTConfig, check_image, check_spec
from stagecast.model.dit_configs import expands_timesteps

MAX_CONSUMER_DEPTH = 64  # chunks a consumer may declare it holds (OpenStreamRequest.consumer_depth)


class AdmissionError(StatusError):
    """A stream the coordinator will not open, with the status its caller gets; ``limit`` names the check that
    refused it (the coordinator's refusal metric)."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_after_s: float = 0.0, limit: str = ""):
        super().__init__(code, message, retry_after_s)
        self.limit = limit


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
    kv_memory: KvMemory | None = None  # None: not checked (no stage has a KV budget)


@dataclass(frozen=True)
class Capacity:
    """The SLO controller's verdict on one more stream."""

    fits: bool
    detail: str = ""  # what the refusal says: the utilization it would need
    retry_after_s: float = 0.0  # when capacity is likely back (the soonest end of a bounded stream)


@dataclass(frozen=True)
class KvMemory:
    """The verdict on a stream's worst-case KV on every stage (``kv_verdict``)."""

    fits: bool
    alone: bool = False  # it would not fit even on an empty pipeline: no retry helps, its window must change
    detail: str = ""  # what the refusal says
    retry_after_s: float = 0.0  # beside the admitted streams: when memory is likely back


def kv_verdict(
    spec: StreamSpec,
    need_of: Callable[[StreamSpec], dict[int, int]],
    reserved: dict[int, int],
    budgets: dict[int, int],
    *,
    rope_limit: int,
    retry_after_s: float,
) -> KvMemory | None:
    """Whether ``spec`` fits every stage's KV budget (stage index -> bytes, 0: no limit) beside the ``reserved`` bytes
    of the admitted streams.  ``need_of(spec)``: its worst-case KV bytes per stage index.  None when no stage has a
    budget."""
    limited = {i: b for i, b in budgets.items() if b > 0}
    if not limited:
        return None
    need = need_of(spec)
    short = [i for i in sorted(limited) if need.get(i, 0) > limited[i]]
    if short:
        i = max(short, key=lambda i: need[i] / limited[i])
        frames = max_context_frames(spec, rope_limit)
        if spec.window is None:
            what = f"an unbounded KV window grows to {frames} latent frames"
        else:
            what = f"a KV window of {spec.window} latent frames"

        def fits(window: int) -> bool:
            smaller = need_of(replace(spec, window=window, sink=min(spec.sink, window)))
            return all(smaller.get(j, 0) <= b for j, b in limited.items())

        if fits(1):
            lo, hi = 1, max(frames, 1)  # the largest window that fits: fits(lo), and nothing above hi helps
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
            fix = f"set window (at most {lo} latent frames fit)"
            if spec.window is None and spec.num_chunks is None:
                fix += " or seconds"
        else:
            fix = (
                "even a window of 1 latent frame does not fit: lower the steps or the resolution, or give the stage a"
                " larger --kv-budget-gib"
            )
        detail = (
            f"window: {what}, {format_bytes(need[i])} of KV on stage {i}, which has {format_bytes(limited[i])} for "
            f"streams; {fix}"
        )
        return KvMemory(False, alone=True, detail=detail)
    for i in sorted(limited):
        if reserved.get(i, 0) + need.get(i, 0) > limited[i]:
            detail = (
                f"KV memory: this stream's worst case, {format_bytes(need[i])} on stage {i}, fits the stage alone but "
                f"not beside the admitted streams' {format_bytes(reserved.get(i, 0))} (the stage has "
                f"{format_bytes(limited[i])} for streams)"
            )
            return KvMemory(False, detail=detail, retry_after_s=retry_after_s)
    return KvMemory(True)


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
            limit="streams",
        )
    if state.model is not None:
        try:
            check_spec(spec, DiTConfig.from_kwargs(state.model), tuple(text.shape))
            shape = None if image is None else tuple(image.shape)
            check_image(spec, shape, per_token=expands_timesteps(state.model))
        except ValueError as exc:
            raise AdmissionError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
    memory = state.kv_memory
    if memory is not None and not memory.fits:
        if memory.alone:
            raise AdmissionError(grpc.StatusCode.RESOURCE_EXHAUSTED, memory.detail, limit="kv_memory")
        raise AdmissionError(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"{memory.detail}; retry after {memory.retry_after_s:.1f} s",
            retry_after_s=memory.retry_after_s,
            limit="kv_memory",
        )
    if state.capacity is not None and not state.capacity.fits:
        raise AdmissionError(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"over capacity: {state.capacity.detail} (the measured capacity; retry after "
            f"{state.capacity.retry_after_s:.1f} s)",
            retry_after_s=state.capacity.retry_after_s,
            limit="capacity",
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
