"""Which streams the coordinator opens: one function, its checks in a stated order, each refusal naming its limit.

Usage (``PipelineEngine.open`` and ``PipelineEngine.slots`` call it under the engine's lock)::

    admission = Admission(registry, pricing=slo_controller, max_streams=16)
    reservation = admission.decide(request, table.admitted(), ready=True)   # raises AdmissionError; reserves nothing
    table.open(request, reservation)                                         # the stream holds it while it is open
    admission.decide(request, table.admitted().plus(reservation), ...)       # a dry run: one more beside it

``Admission`` prices a stream through a ``Pricing`` (the SLO controller: ``price``, a ``Fit`` with the shares that
decided, and ``micro_step_ms``) and its KV on each stage once; ``decide`` answers a ``Reservation`` (the KV it holds
per stage and its demand on the controller) or raises.  The open streams come in as an ``Admitted`` value: admission
keeps no view of the stream table.  ``admit`` is the order of the checks over an ``AdmissionState``:

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

import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Protocol

import grpc

from coordinator.errors import AdmissionError
from coordinator.registry import StageRegistry
from coordinator.requests import OpenRequest
from coordinator.slo import STARTUP_UTILIZATION, Demand, Fit
from stagecast.internal.v1 import pipeline_pb2 as pb
from stagecast.kv_memory import format_bytes, max_context_frames, stream_kv_bytes
from stagecast.microstep import StreamSpec
from stagecast.model.config import DiTConfig, check_image, check_spec
from stagecast.model.dit_configs import expands_timesteps

logger = logging.getLogger("coordinator.engine")

RETRY_AFTER_S = 5.0  # the retry hint when no admitted stream has a known end
# The retry hint for a stream refused while others start (``SloController.startup_utilization``): their first frames
# come within a second of their opens, and then the steady price alone decides.
STARTUP_RETRY_S = 1.0


class Pricing(Protocol):
    """What admission asks the SLO model (``coordinator.slo.SloController``)."""

    target: float  # the bottleneck stage's busy share a held set may need at most

    def price(self, newcomer: Demand, admitted: list[Demand]) -> Fit: ...

    def micro_step_ms(self) -> float | None: ...

    @property
    def bottleneck(self) -> str: ...  # what the busy share is of: "the slowest stage", or "the host" (one CPU host)


@dataclass(frozen=True)
class Reservation:
    """What an admitted stream holds while it is open: its worst-case KV bytes per stage index (stages with a budget)
    and its demand on the SLO controller (``stream_id`` 0 until the stream table gives it one)."""

    kv: dict[int, int]
    demand: Demand


@dataclass(frozen=True)
class Admitted:
    """The open streams as admission counts them (``StreamTable.admitted``): how many, their KV reserved per stage,
    their demands, and when a refused stream may retry (``retry_after_s``)."""

    count: int = 0
    kv: dict[int, int] = field(default_factory=dict)
    demands: tuple[Demand, ...] = ()
    retry_after_s: float = RETRY_AFTER_S

    def plus(self, reservation: Reservation) -> Admitted:
        """These and one more (a dry run's hypothetical stream, given an id of its own)."""
        kv = dict(self.kv)
        for index, nbytes in reservation.kv.items():
            kv[index] = kv.get(index, 0) + nbytes
        demand = replace(reservation.demand, stream_id=-1 - self.count)
        return Admitted(self.count + 1, kv, (*self.demands, demand), self.retry_after_s)


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


def admit(request: OpenRequest, state: AdmissionState) -> None:
    """Raise ``AdmissionError`` unless the stream may open now (``OpenRequest`` checked the rest when it was built)."""
    spec = request.spec
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
            check_spec(spec, DiTConfig.from_kwargs(state.model), tuple(request.text.shape))
            shape = None if request.image is None else tuple(request.image.shape)
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


def newcomer(request: OpenRequest, cfg_parallel: int) -> Demand:
    """A stream asking to open, as the SLO controller prices it (its id not yet given)."""
    spec = request.spec
    return Demand(
        0,
        request.chunk_rate,
        tuple(request.by_steps),
        clean=spec.policy == "clean",
        latency_first=request.latency_first,
        rows=rows(spec, cfg_parallel),
        decoder=request.decoder,
        starting=True,
    )


def rows(spec: StreamSpec, cfg_parallel: int) -> int:
    """Batch rows a micro-step of the stream takes on a stage: a guided stream's two branches in one pipeline (under
    CFG-parallel each group runs one)."""
    return 2 if spec.cfg and cfg_parallel == 1 else 1


class Admission:
    """The coordinator's admission: each stage's KV budget, a stream's KV need on each, and the verdicts of its checks
    over the open streams (``Admitted``) and the SLO model (``pricing``).  Every method runs under the engine's lock."""

    def __init__(self, registry: StageRegistry, pricing: Pricing, *, max_streams: int = 16):
        self.registry = registry
        self.pricing = pricing
        self.max_streams = max_streams
        # Each stage process's KV budget and K/V element size from its FormReply (index -> bytes; 0: no limit).
        self.kv_budgets: dict[int, int] = {}
        self.kv_elements: dict[int, int] = {}

    def on_formed(self, replies: dict[int, pb.FormReply]) -> None:
        """Take each stage's KV budget for admission (every stage answered Form)."""
        self.kv_budgets = {index: max(0, reply.kv_budget_bytes) for index, reply in replies.items()}
        self.kv_elements = {index: max(0, reply.kv_element_bytes) for index, reply in replies.items()}
        for index, budget in sorted(self.kv_budgets.items()):
            if budget:
                logger.info("stage %d gives streams' KV %.3f GiB", index, budget / (1 << 30))

    def decide(self, request: OpenRequest, admitted: Admitted, *, ready: bool, last_error: str = "") -> Reservation:
        """What ``request`` would hold beside ``admitted`` (``ready``: a generation is formed; ``last_error``: why the
        last one ended); raises ``AdmissionError`` when it may not open.  Its KV is priced once, here."""
        spec = request.spec
        demand = newcomer(request, self.registry.cfg_parallel)
        kv = self.stage_kv(spec, request.max_steps)
        state = AdmissionState(
            ready=ready,
            registered=len([r for r in self.registry.records() if not r.lost]),
            world_size=self.registry.world_size,
            active=admitted.count,
            max_streams=self.max_streams,
            model=self.registry.model_config(),
            last_error=last_error,
            capacity=self.capacity_verdict(demand, admitted),
            kv_memory=self.kv_verdict(spec, request.max_steps, kv, admitted),
        )
        admit(request, state)
        return Reservation(kv, demand)

    def stage_kv(self, spec: StreamSpec, max_steps: int) -> dict[int, int]:
        """The stream's worst-case KV bytes on each stage process with a KV budget (``stagecast.kv_memory``): its
        layers, its share of the heads under --sp, its CFG group's branches under --cfg-parallel."""
        cfg = self.registry.model_config()
        if cfg is None or not any(self.kv_budgets.values()):
            return {}
        try:
            return self._stage_kv(spec, DiTConfig.from_kwargs(cfg), max_steps)
        except (ValueError, TypeError, KeyError):
            return {}  # a stream the model cannot run: check_spec refuses it with its reason

    def _stage_kv(self, spec: StreamSpec, model: DiTConfig, max_steps: int) -> dict[int, int]:
        ranks_per_group = self.registry.layout.world_size  # stage processes of one CFG group
        return {
            r.index: stream_kv_bytes(
                spec,
                model,
                layers=len(r.layers),
                element_bytes=self.kv_elements.get(r.index) or 4,  # unknown: the widest dtype a stage runs
                max_steps=max_steps,
                sp=self.registry.sp,
                cfg_rank=r.index // ranks_per_group,
                cfg_size=self.registry.cfg_parallel,
            )
            for r in self.registry.records()
            if self.kv_budgets.get(r.index, 0) > 0
        }

    def budgets(self) -> dict[int, int]:
        """Each stage's KV budget for streams (index -> bytes; 0: no limit), as its FormReply gave it."""
        return dict(self.kv_budgets)

    def kv_status(self, reserved: dict[int, int]) -> list[tuple[int, int, int]]:
        """(stage index, KV budget, reserved bytes) of every stage with a budget, for metrics."""
        return [(i, b, reserved.get(i, 0)) for i, b in sorted(self.kv_budgets.items()) if b > 0]

    def kv_verdict(self, spec: StreamSpec, max_steps: int, need: dict[int, int], admitted: Admitted) -> KvMemory | None:
        """Whether the stream's worst-case KV (``need``) fits every stage beside the admitted streams'; None when not
        checked."""
        if not any(self.kv_budgets.values()):
            return None
        rope = self.registry.rope_limit()

        def need_of(s: StreamSpec) -> dict[int, int]:
            return need if s is spec else self.stage_kv(s, max_steps)  # another window: kv_verdict's search

        try:
            return kv_verdict(
                spec,
                need_of,
                admitted.kv,
                self.kv_budgets,
                rope_limit=rope,
                retry_after_s=admitted.retry_after_s,
            )
        except (ValueError, TypeError, KeyError):
            return None  # a stream the model cannot run: check_spec refuses it with its reason

    def capacity_verdict(self, newcomer: Demand, admitted: Admitted) -> Capacity | None:
        """Whether the pipeline holds one more stream (every stream at its min_steps); None when not checked."""
        if newcomer.chunk_rate <= 0 or self.pricing.micro_step_ms() is None:
            return None
        demands = list(admitted.demands)
        fit = self.pricing.price(newcomer, demands)
        if fit.fits:
            return Capacity(True)
        streams = (
            f"{len(demands)} streams at their min_steps and this one at {newcomer.min_steps} steps on the "
            f"{newcomer.decoder} decoder"
        )
        if fit.start is not None:  # the steady set fits: their start does not
            detail = (
                f"{streams} fit, but {fit.starting} of them starting at once would need {fit.start:.0%} of "
                f"{self.pricing.bottleneck} (the limit while streams start is {STARTUP_UTILIZATION:.0%})"
            )
            return Capacity(False, detail, STARTUP_RETRY_S)
        limit = f"the limit is {self.pricing.target:.0%}"
        detail = f"{streams} would need {fit.steady or 0.0:.0%} of {self.pricing.bottleneck} ({limit})"
        # Capacity comes back when a bounded stream ends: the soonest one's remaining chunks at its pace.
        return Capacity(False, detail, admitted.retry_after_s)
