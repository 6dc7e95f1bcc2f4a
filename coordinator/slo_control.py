"""The SLO glue: the coordinator's streams as the SLO controller's demands, its step decisions, and its cost model's
seeding and learning.

``SloControl`` is one of the parts ``coordinator.engine.PipelineEngine`` holds; every method runs under the engine's
lock.  It owns the cost model (``coordinator.slo.CostModel``) and the controller (``SloController``): the plan loop
asks it to decide steps (``control``) at most every ``slo_interval_s``; the consumed counts tell it when a paced stream
falls behind (``check_late``); each stage's calibration at Form seeds the model (``seed``), the measured batches refine
it (``observe``) and the gateway's decoder measurements price each stream's decode (``report_vae``).  Admission
(``coordinator.admission``) prices through the controller (``pricing``: its ``Pricing``).  It keeps its own view of
each open stream by id (``joined`` at open, ``forget`` at its end): its demand, the steps it runs and its lateness.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace

from coordinator.metrics import CoordinatorTelemetry
from coordinator.registry import StageRegistry
from coordinator.scheduler import StreamBatchScheduler
from coordinator.slo import (
    FULL,
    GPU_SHARING,
    RAISE_UTILIZATION,
    TARGET_UTILIZATION,
    CostModel,
    Demand,
    SloController,
    VaeReport,
    decoder_kind,
)
from coordinator.streams import StreamSession
from stagecast.api import DECODERS, DEFAULT_FPS
from stagecast.internal.v1 import pipeline_pb2 as pb

logger = logging.getLogger("coordinator.engine")

# GetStatus capacity: streams at 16 FPS with one latent frame per chunk (4 video frames): 4 chunks per second.
CAPACITY_CHUNK_RATE = DEFAULT_FPS / 4
CAPACITY_STEPS = (1, 2, 3, 4)
# A paced stream is falling behind (the SLO controller's correction) when a consumed chunk is more than this many chunk
# periods past its real-time schedule (the first chunk's consumption + c / chunk_rate) and its lateness grew by more
# than that in each of the last LATE_WINDOWS windows of LATE_WINDOW_S: a stream short of its rate by more than
# 0.5 / (4 chunks/s x 2 s) = 6% is caught within about 4 s, while a one-off stall that the stream then rides out is not.
LATE_TOLERANCE_CHUNKS = 0.5
LATE_WINDOW_S = 2.0
LATE_WINDOWS = 2
# After a stream joins, no stream's steps rise for this long (lowering is never held, nor is a lone paced stream):
# in a ramp of streams opened one after another each join lowers steps, and a rise between two joins only starts
# chunks at more steps that the next join takes back, while the chunks already started run at the higher count.  On
# one H200, 7 SLO-adaptive 1.3B streams opened in 2.4 s ran their first seconds at 2-4 steps and 4 of them missed
# more than 1% of their frames (gaps up to 0.59 s).  With the hold, single runs held 1-3 of 7: not shown to suffice.
RAISE_HOLD_S = 5.0


@dataclass
class _Watched:
    """An open stream as the SLO controller sees it: its demand (``demand.steps``: what its next chunk runs), its
    ladders by step count, and its lateness against its real-time schedule."""

    demand: Demand
    ladders: dict[int, tuple[float, ...]]
    late_mark: tuple[float, float] | None = None  # (clock time, lateness) at the start of the current window
    late_windows: int = 0  # consecutive windows in which the stream fell further behind
    late_chunks: int = 0  # times it was found falling behind (each one informs the SLO controller)


class SloControl:
    """The SLO controller's view of the open streams (by id), with its cost model and decision clock."""

    def __init__(
        self,
        registry: StageRegistry,
        telemetry: CoordinatorTelemetry,
        *,
        max_batch: int,
        clock: Callable[[], float],
        stage_ms: list[float] | None = None,
        slo_interval_s: float = 1.0,
        slo_learn: bool = True,
        vae_ms_per_chunk: float | dict[str, float] | None = None,
        pace_grid: bool = False,
        host_share: float = 1.0,
        gpu_sharing: float = GPU_SHARING,
    ):
        if not 0 < host_share <= 1:  # also NaN
            raise ValueError(f"--host-share must be in (0, 1], got {host_share}")
        self.registry = registry
        self.telemetry = telemetry
        self._streams: dict[int, _Watched] = {}
        self.clock = clock
        # The SLO controller's model of stage time per batch: the operator's --stage-ms, else each stage's calibration
        # at READY (seed), refined by measured batches; each decoder kind's cost per chunk: the operator's (a
        # number: the full VAE's; or ms per kind), else the gateway's measurement (report_vae).  --slo-fixed
        # (slo_learn False) keeps the operator's numbers only.
        if not slo_learn:  # every decoder kind fixed: the operator's number, else 0
            given = vae_ms_per_chunk if isinstance(vae_ms_per_chunk, dict) else {FULL: vae_ms_per_chunk}
            vae_ms_per_chunk = {kind: given.get(kind) or 0.0 for kind in DECODERS}
        # Under --pace-grid the batches a set of paced streams forms are predicted from the set (CostModel.aligned_ms).
        self.cost = CostModel(
            registry.world_size,
            max_batch,
            seed_ms=stage_ms,
            chunk_ms=vae_ms_per_chunk,
            aligned=pace_grid,
            gpu_sharing=gpu_sharing,  # --gpu-sharing: forwards beside a decoder on their GPU
        )
        self.calibrated: set[int] = set()  # stages whose model started from their own calibration
        # The serving size the stages' calibration timed (stagecast.json's, as the gateway reads it); None: not reported
        self.serving_shape: pb.StageCalibration | None = None
        # Pipelines sharing one host (--host-share) each size their streams for their share of it.
        self.controller = SloController(
            self.cost,
            target_utilization=TARGET_UTILIZATION * host_share,
            raise_utilization=RAISE_UTILIZATION * host_share,
        )
        self.slo_interval_s = slo_interval_s
        self.slo_learn = slo_learn  # False: keep the calibration (simulations, tests), ignore measured batches
        self._decided_at: float | None = None  # clock time of the last controller decision (None: decide now)
        self._late_at: float | None = None  # clock time a paced stream was last seen late
        self._relaxed_at: float | None = None  # clock time the controller's correction last relaxed
        self._joined_at: float | None = None  # clock time a stream was last admitted (raises wait RAISE_HOLD_S)

    def decide_now(self) -> None:
        """The set of streams or their costs changed: decide steps at the next tick."""
        self._decided_at = None

    def joined(self, demand: Demand, ladders: dict[int, tuple[float, ...]], steps: int) -> None:
        """A stream was admitted (``demand`` with its id, starting at ``steps``): decide steps at the next tick, and
        raise none for ``RAISE_HOLD_S``."""
        self._streams[demand.stream_id] = _Watched(replace(demand, steps=steps), dict(ladders))
        self.decide_now()
        self._joined_at = self.clock()

    def forget(self, stream_id: int) -> None:
        """The stream has ended."""
        self._streams.pop(stream_id, None)

    def steps(self, stream_id: int) -> int:
        """What the stream's next chunk runs (0: not watched)."""
        watched = self._streams.get(stream_id)
        return 0 if watched is None else watched.demand.steps

    def late_findings(self, stream_id: int) -> int:
        """Times the stream was found falling behind its real-time schedule (each one informed the controller)."""
        watched = self._streams.get(stream_id)
        return 0 if watched is None else watched.late_chunks

    def correction(self) -> float:
        """What the SLO model's costs are multiplied by, learned from late streams (1: the model as measured)."""
        return self.controller.correction

    def serving(self) -> pb.StageCalibration | None:
        """The serving size the stages' calibration timed at the last Form (None: none reported)."""
        return self.serving_shape

    def status(self, into: pb.ClusterStatus) -> None:
        """Its part of GetStatus: the capacity on the full VAE, each decoder's cost, the calibrated stages, the Stream
        Batch, and the model's busy share of the streams open now."""
        into.capacity.extend(pb.Capacity(steps=n, streams=c, decoder=FULL) for n, c in self.capacity())
        into.vae_chunk_ms = self.cost.chunk_ms
        into.vae_source = self.cost.vae_source
        into.calibrated_stages.extend(sorted(self.calibrated))
        into.decoders.extend(self.decoder_status())
        into.max_batch = self.cost.max_batch
        into.utilization = self.utilization() or 0.0

    @property
    def pricing(self) -> SloController:
        """What admission prices streams with (``coordinator.admission.Pricing``)."""
        return self.controller

    def demands(self) -> list[Demand]:
        return [self._streams[sid].demand for sid in sorted(self._streams)]

    def capacity(self, decoder: str = FULL) -> list[tuple[int, float]]:
        """(steps, streams): more streams at 16 FPS, one latent frame per chunk, on ``decoder``, the pipeline holds
        now."""
        admitted = self.demands()
        out = []
        for steps in CAPACITY_STEPS:
            n = self.controller.capacity_streams(admitted, CAPACITY_CHUNK_RATE, steps, decoder=decoder)
            if n is not None:
                out.append((steps, n))
        return out

    def decoder_status(self) -> list[pb.DecoderCostStatus]:
        """Each decoder kind's cost as the SLO model counts it, and the capacity on it, for GetStatus."""
        return [
            pb.DecoderCostStatus(
                decoder=kind,
                chunk_ms=cost.chunk_ms,
                batch_ms=list(cost.batch_ms),
                state_bytes=cost.state_bytes,
                source=cost.source,
                formed_batch=cost.formed_batch,
                capacity=[pb.Capacity(steps=n, streams=c, decoder=kind) for n, c in self.capacity(kind)],
            )
            for kind, cost in self.cost.decoders.items()
        ]

    def utilization(self) -> float | None:
        return self.controller.utilization([d for d in self.demands() if d.chunk_rate > 0])

    def control(self, sched: StreamBatchScheduler, events: list, next_event: Callable[..., pb.PlanEvent]) -> None:
        """Let the SLO controller pick steps; a change applies from each stream's next chunk (a ``steps`` event)."""
        now = self.clock()
        if self._decided_at is not None and now - self._decided_at < self.slo_interval_s:
            return
        self._decided_at = now
        if self._relaxed_at is not None and (self._late_at is None or self._late_at < self._relaxed_at):
            self.controller.relax(now - self._relaxed_at)  # no stream was late since the last decision
        self._relaxed_at = now
        watched = self._streams
        demands = [watched[sid].demand for sid in sorted(sched.streams) if sid in watched]
        if not any(len(d.allowed) > 1 for d in demands):
            return
        # A lone paced stream rises at once (no join of a ramp can take a step back from another stream).
        alone = sum(1 for d in demands if d.chunk_rate > 0) <= 1
        settled = alone or self._joined_at is None or now - self._joined_at >= RAISE_HOLD_S
        decision = self.controller.decide(demands, raise_steps=settled)
        for d in demands:
            sid, want = d.stream_id, decision[d.stream_id]
            if want == d.steps or sched.streams[sid].stopping:
                continue
            ladder = watched[sid].ladders[want]
            first = sched.set_steps(sid, ladder)
            self.telemetry.steps_changed(d.steps, want)
            d.steps = want
            if first is not None:
                events.append(next_event("steps", stream_id=sid, from_chunk=first, timesteps=ladder))

    def check_late(self, session: StreamSession, first_consumed_at: float, first: bool) -> None:
        """Under the lock, when a paced stream's consumed count rose (``first_consumed_at``: its chunk 0's consumption
        on the viewer's clock, ``first``: just now, ``coordinator.pacing.Pacing.consumed``): a stream that keeps
        falling behind its real-time schedule tells the SLO controller that its model undercounts what the running
        set costs."""
        watched = self._streams.get(session.id)
        if watched is None or session.chunk_rate <= 0 or session.delivered <= 0:
            return
        now = self.clock()
        newest = session.delivered - 1
        if first:
            watched.late_mark = (now, 0.0)
            return
        late_s = now - (first_consumed_at + newest / session.chunk_rate)
        mark_at, mark_late = watched.late_mark or (now, late_s)
        if now - mark_at < LATE_WINDOW_S:
            return
        tolerance = LATE_TOLERANCE_CHUNKS / session.chunk_rate
        falling = late_s > tolerance and late_s - mark_late > tolerance
        watched.late_windows = watched.late_windows + 1 if falling else 0
        watched.late_mark = (now, late_s)
        if watched.late_windows < LATE_WINDOWS:
            return
        watched.late_windows = 0  # the next finding needs fresh windows, with the corrected model deciding
        watched.late_chunks += 1
        self._late_at = now
        if self.controller.observe_late(self.demands()):
            self._decided_at = None  # decide steps at the next tick, with the corrected model
            logger.info(
                "stream %d is late (chunk %d): the SLO model now counts %.2fx its costs",
                session.id,
                newest,
                self.controller.correction,
            )

    def seed(self, replies: dict[int, pb.FormReply]) -> None:
        """Seed the SLO model with each stage's calibration (full KV window; empty where only that was timed), unless
        the operator's --stage-ms or --slo-fixed takes precedence."""
        self.serving_shape = None
        shared = self.registry.one_cpu_host()
        if shared != self.cost.shared_host:
            logger.info(
                "the SLO model prices %s",
                "one CPU host: the stages' sum per micro-step, and a decoder on the CPU"
                if shared
                else "the slowest stage per micro-step",
            )
        self.cost.shared_host = shared
        for index, reply in sorted(replies.items()):
            if not reply.HasField("calibration"):
                logger.info("stage %d reported no calibration: its times are learnt from measured batches", index)
                continue
            cal = reply.calibration
            if self.serving_shape is None:
                self.serving_shape = cal
            per = list(cal.full_ms) or list(cal.empty_ms)
            if cal.error:
                logger.warning("stage %d calibration incomplete: %s", index, cal.error)
            if not 0 <= index < self.cost.stages:
                continue
            if not self.slo_learn or self.cost.fits[index].seed_ms is not None:
                logger.info("stage %d calibration not used: the operator's --stage-ms takes precedence", index)
                continue
            if self.cost.calibrate(index, {b + 1: ms for b, ms in enumerate(per)}):
                self.calibrated.add(index)
                logger.info(
                    "stage %d calibration seeds the SLO model: %s ms per forward of 1..%d micro-steps (%dx%d latents,"
                    " %d-frame window%s, %.2fs)",
                    index,
                    ", ".join(f"{ms:.2f}" for ms in per),
                    len(per),
                    cal.latent_height,
                    cal.latent_width,
                    cal.window,
                    ", CUDA graphs" if cal.graphs else "",
                    cal.seconds,
                )

    def pick_batch(self, waits: int) -> int:
        """The Stream Batch the scheduler forms from now on (``CostModel.pick_batch``, from the stages' calibrations
        seeded at this Form; ``waits``: the forwards planned ahead of a joining stream's first chunk), else the
        operator's --max-batch."""
        cost = self.cost
        picked = cost.pick_batch(chunk_rate=CAPACITY_CHUNK_RATE, waits=waits, target=self.controller.target)
        cost.max_batch = picked or cost.ceiling
        if picked is None:
            logger.info("Stream Batch: --max-batch %d (no calibration from every stage to pick from)", cost.ceiling)
        else:
            logger.info(
                "Stream Batch: %d of at most %d micro-steps, picked from the stages' calibrations (%d one-step streams"
                " at 16 FPS by them)",
                picked,
                cost.ceiling,
                cost.streams_held(picked, CAPACITY_CHUNK_RATE, self.controller.target),
            )
        return cost.max_batch

    def report_vae(self, report: VaeReport, what: str = "") -> bool:
        """The gateway measured one decoder kind (``VaeReport``; ``what``: where, for the log).  Each report replaces
        that kind's numbers (ignored when the operator fixed them with --vae-ms-per-chunk or --slo-fixed); a change
        makes the controller decide again, and admission uses it from the next open.  ``ValueError`` names a field
        out of range."""
        changed = self.cost.report_vae(report)
        if changed:
            batch_ms = report.batch_ms
            batched = f", per stream {', '.join(f'{m:.2f}' for m in batch_ms)} at 1..{len(batch_ms)} in one call"
            batched += (
                f" (its calls hold {report.formed_batch:.2f} streams)" if report.formed_batch else " (no call yet)"
            )
            logger.info(
                "the SLO model counts the gateway's %s decoder at %.2f ms per chunk%s%s",
                decoder_kind(report.decoder),
                report.chunk_ms,
                batched if batch_ms else "",
                what,
            )
            self._decided_at = None  # decide steps again with the new cost
        return changed

    def observe(self, index: int, done: pb.BatchDone) -> None:
        """A stage's measured batches (unless --slo-fixed): each at its own size, except those run without their CUDA
        graph (a signature seen before its graph was captured: a transient at about twice a graph's time, which
        priced every size the stage has not served yet up through ``_StageFit.sharing``).  A stage that reports only
        the sums: their mean ms at the mean size."""
        if not self.slo_learn:
            return
        if done.timed:
            for t in done.timed:
                if not t.eager and t.micro_steps > 0:
                    self.cost.observe(index, t.micro_steps, t.forward_ms)
        elif done.batches > 0:
            size = max(1, round(done.micro_steps / done.batches))
            self.cost.observe(index, size, done.forward_ms / done.batches)
