"""The coordinator's pipeline engine: forms generations, schedules micro-steps, routes results, recovers.

Usage (the gRPC servicer in ``coordinator.server`` is a thin layer over this)::

    engine = PipelineEngine(registry, CoordinatorOptions(stages=2, max_batch=4), connect=channel_to)
    engine.start()
    engine.on_registered(record)            # forms a new generation once every stage is registered
    session = engine.open(OpenRequest(spec, text))   # raises AdmissionError with a gRPC code
    engine.slots()                          # Slots(free, total): more default streams it would admit now
    for ev in session.iter_events(): ...    # StreamStarted, ChunkResult..., then StreamEnded or a failure
    engine.stop_stream(session.id)          # cooldown: no new chunks, chunks in flight finish
    engine.cancel_stream(session.id)        # the consumer left: nothing more is planned, the stream ends now
    engine.heartbeat(index, address, gen)   # (rejoin, reason) for a stage's periodic heartbeat
    engine.shutdown()

Plans go to every stage through one ordered sender per stage; the number of batches planned but not yet
completed by the last stage is bounded (``lookahead``), so plans run ahead of execution without
queuing unboundedly.  Any stage failure ends the generation: every active stream ends with UNAVAILABLE,
surviving stages are reset, and a new generation forms once all stages are registered again.  A stage
that finds itself outside the current generation (it was paused and marked lost, the coordinator restarted,
its generation failed while it could not be reset) learns so from ``heartbeat`` and registers again.

The engine holds the coordinator's parts, one per job, each an object with its own state, told what it needs (the
lock, the other parts it reads, callbacks); they share the engine's one lock (``cond``):

- ``generations`` (``coordinator.generations.Generations``): forming, failing and re-forming generations, the
  rendezvous, stage health and results;
- ``streams`` (``coordinator.streams.StreamTable``): the open streams by id, their open, stop, cancel and end;
- ``pacing`` (``coordinator.pacing.Pacing``): pace slots, each stream's credit, the plan loop's pace timeout;
- ``admission`` (``coordinator.admission.Admission``): KV reservation per stage, capacity verdicts, retry-after;
- ``slo`` (``coordinator.slo_control.SloControl``): the SLO controller's demands, step decisions, lateness and the
  cost model's seeding (calibration at Form, the gateway's decoder reports, measured batches);
- ``planner`` (``coordinator.plan.PlanLoop``): the scheduling thread and its plan events.

This module is the public surface (``coordinator.server``, the simulator, tests) and the glue between the parts:
what one event does to several of them (an open, a consumed chunk, a stage's results, a formed generation).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import grpc
import torch

from coordinator.admission import Admission
from coordinator.errors import AdmissionError, StreamError, StreamFailure
from coordinator.generations import Generations
from coordinator.holds import Admitter
from coordinator.metrics import CoordinatorStats, CoordinatorTelemetry
from coordinator.options import CoordinatorOptions
from coordinator.pacing import PACE_EARLY_S, PLAYOUT_S, Pacing
from coordinator.plan import PlanLoop
from coordinator.registry import StageRecord, StageRegistry
from coordinator.requests import OpenRequest
from coordinator.slo import FULL, VaeReport
from coordinator.slo_control import SloControl
from coordinator.slots import Slots, StreamDefaults, free_slots
from coordinator.streams import StreamSession, StreamTable
from stagecast.grpc_util import CHANNEL_OPTIONS
from stagecast.internal.v1 import pipeline_pb2 as pb

__all__ = [
    "PACE_EARLY_S",
    "PLAYOUT_S",
    "AdmissionError",
    "OpenRequest",
    "PipelineEngine",
    "StreamError",
    "StreamFailure",
    "StreamSession",
]

logger = logging.getLogger(__name__)


class PipelineEngine:
    def __init__(
        self,
        registry: StageRegistry,
        opts: CoordinatorOptions,
        *,
        connect: Callable[[str], grpc.Channel] | None = None,
        on_ready_change: Callable[[bool], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        form_timeout: float = 600.0,
        max_ahead: int | None = None,
        slo_interval_s: float = 1.0,
        stream_defaults: StreamDefaults | None = None,
    ):
        """``opts``: the coordinator's options, whole (``coordinator.options``); the keywords are what is not a flag:
        how to reach a stage, who hears of readiness, the clock and the settings tests and tools change."""
        max_batch, lookahead = opts.max_batch, opts.lookahead
        self.registry = registry
        self.clock = clock
        self._stream_defaults = stream_defaults  # what a free slot is priced at (None: the public defaults)
        self.max_batch = max_batch
        self.pacing = Pacing(
            pipeline_stages=registry.pipeline_stages,
            max_ahead=max_ahead,
            playout_s=opts.playout_s,
            clock=clock,
            grid=opts.pace_grid,
        )
        self.cond = threading.Condition()
        self.telemetry = CoordinatorTelemetry()  # Prometheus registry and batch spans (coordinator.metrics)
        self.streams = StreamTable(self.telemetry, on_end=self._on_end)
        self.slo = SloControl(
            registry,
            self.telemetry,
            max_batch=max_batch,
            clock=clock,
            stage_ms=opts.stage_ms,
            slo_interval_s=slo_interval_s,
            slo_learn=opts.slo_learn,
            vae_ms_per_chunk=opts.vae_ms_per_chunk,
            pace_grid=opts.pace_grid,
            host_share=opts.host_share,
            gpu_sharing=opts.gpu_sharing,
        )
        self.admission = Admission(registry, self.slo.pricing, max_streams=opts.max_streams)
        self.generations = Generations(
            self.cond,
            registry,
            self.telemetry,
            # Channels to stages (mTLS in a deployment: stagecast.security.connect); plaintext by default.
            connect=connect or (lambda address: grpc.insecure_channel(address, options=CHANNEL_OPTIONS)),
            backend="" if opts.backend == "auto" else opts.backend,  # "": each stage picks nccl or gloo
            max_batch=max_batch,
            form_timeout=form_timeout,
            on_ready_change=on_ready_change or (lambda ready: None),
            on_formed=self._on_formed,
            on_chunk=self._on_chunk,
            on_done=self._on_done,
            end_all=self.streams.end_all,
        )
        # Admission beside the open streams and the places Reserve held (coordinator.holds).
        self.admitter = Admitter(self.cond, self.admission, self.streams, self.generations, self.telemetry, clock)
        self.planner = PlanLoop(
            self.cond,
            registry,
            self.generations,
            self.streams,
            self.pacing,
            self.slo,
            self.telemetry,
            # One batch per stage plus one waiting at the first: every stage stays fed, and a joining stream's first
            # chunk waits behind no more than that (each batch planned beyond it was a forward more of its TTFF: at
            # 2P + 2, on one H200 at capacity, about 80 ms each).
            lookahead=lookahead or registry.pipeline_stages + 1,
            paced_lookahead=lookahead is None,  # the default: one batch per stage while every stream is paced
            record_plan=opts.record_plan,
        )
        self.telemetry.bind(self.stats)

    # ---- what the server, the simulator, the metrics and the tests read: the parts' state ----------------

    generation = property(lambda self: self.generations.generation)
    ready = property(lambda self: self.generations.ready)
    sched = property(lambda self: self.generations.sched)
    sessions = property(lambda self: self.streams.by_id())  # the open streams' sessions by id (a copy)
    record_plan = property(lambda self: self.planner.record_plan)
    lookahead = property(lambda self: self.planner.lookahead)

    def recorded_plan(self) -> list[pb.PlanEvent]:
        """The plan recorded so far (``record_plan``), for GetPlan."""
        with self.cond:
            return self.planner.recorded()

    # ---- lifecycle ------------------------------------------------------------------------------------

    def start(self) -> None:
        self.planner.start()

    def shutdown(self, timeout: float = 5.0) -> None:
        with self.cond:
            links, workers = self.generations.shut()
            self.streams.end_all(StreamFailure(grpc.StatusCode.UNAVAILABLE, "coordinator is shutting down"))
            self.telemetry.generation_ended("coordinator is shutting down", failed=False)
            self.cond.notify_all()
        self.generations.close(links, workers, timeout)
        self.planner.join(timeout)

    def on_registered(self, record: StageRecord) -> None:
        self.generations.on_registered(record)

    def heartbeat(self, index: int, address: str, generation: int) -> tuple[bool, str]:
        return self.generations.heartbeat(index, address, generation)

    def fail(self, reason: str, lost: int | None, lost_address: str | None = None, orderly: bool = False) -> None:
        self.generations.fail(reason, lost, lost_address, orderly)

    def model_config(self) -> dict | None:
        return self.registry.model_config()

    # ---- streams --------------------------------------------------------------------------------------

    def open(self, request: OpenRequest, hold: str = "") -> StreamSession:
        """Admit ``request`` (``Admission.decide``: raises ``AdmissionError``; a ``hold`` from ``admitter.reserve``, not
        lapsed: admitted then), then open it in the stream table holding what admission priced (``StreamTable.open``);
        the plan loop plans its open at its next tick."""
        with self.cond:
            reservation = self.admitter.claim(request, hold)
            session = self.streams.open(request, reservation, generation=self.generations.generation)
            # The set of streams changed: decide steps at the next tick (raises wait).
            self.slo.joined(session.reservation.demand, request.by_steps, session.spec.steps)
            self.planner.wake()
            return session

    def slots(self, defaults: StreamDefaults | None = None) -> Slots:
        """How many more streams of the public defaults (``defaults``, else the engine's) this pipeline would admit
        now, by a dry run of the admission that refuses: hypothetical newcomers one by one through
        ``Admission.decide`` until the first refusal (``coordinator.slots``).  Nothing is reserved; 0 free while no
        generation is formed."""
        with self.cond:
            return self._slots(defaults or self.stream_defaults())

    def stream_defaults(self) -> StreamDefaults:
        """What a slot is priced at: the engine's ``stream_defaults``, else the public defaults at the stages' serving
        size (``StreamDefaults.serving``)."""
        return self._stream_defaults or StreamDefaults.serving(self.slo.serving(), self.registry.model_config())

    def _slots(self, defaults: StreamDefaults) -> Slots:
        admitted, ready = self.streams.admitted(self.clock()), self.generations.ready
        return free_slots(self.admission, admitted, defaults, self.registry.model_config(), ready=ready)

    def steps(self, stream_id: int) -> int:
        """The steps the stream's next chunk runs (the SLO controller's choice; 0: no such stream)."""
        with self.cond:
            return self.slo.steps(stream_id)

    def stop_stream(self, stream_id: int) -> None:
        with self.cond:
            self.streams.stop(stream_id)
            self.planner.wake()

    def cancel_stream(self, stream_id: int) -> None:
        """End a stream now (its consumer left): see ``StreamTable.cancel``."""
        with self.cond:
            self.streams.cancel(stream_id)
            self.planner.wake()

    def update_prompt(self, stream_id: int, text: torch.Tensor, recache: bool = False) -> None:
        """A new prompt from the stream's next chunk not yet started (``StreamTable.update_prompt``)."""
        with self.cond:
            self.streams.update_prompt(stream_id, text, recache)
            self.planner.wake()

    def submit_input(self, stream_id: int, chunk: int, latents: torch.Tensor) -> None:
        """A video-to-video stream's input latents for its next chunk (``StreamTable.submit_input``)."""
        with self.cond:
            self.streams.submit_input(stream_id, chunk, latents)
            self.planner.wake()

    def delivered(self, session: StreamSession) -> None:
        """The consumer's gRPC stream took a chunk.  For a consumer that does not acknowledge, that is delivery: the
        stream may start another (delivery pacing)."""
        if session.acknowledges:
            return
        with self.cond:
            if self.streams.delivered_one(session):
                self._consumed(session)

    def consumed(self, stream_id: int, chunks: int) -> None:
        """The consumer acknowledged the first ``chunks`` chunks as consumed (decoded and handed on)."""
        with self.cond:
            session = self.streams.consumed(stream_id, chunks)
            if session is not None:
                self._consumed(session)

    def _consumed(self, session: StreamSession) -> None:
        """Under the lock, its consumed count rose: the viewer's clock (pacing), its lateness (the SLO controller)."""
        viewer = self.pacing.consumed(session)
        if viewer is not None:
            self.slo.check_late(session, *viewer)
        self.planner.wake()

    def _on_end(self, stream_id: int) -> None:
        """Under the lock, a stream has gone (``StreamTable.end``): the parts that keep state of it forget it."""
        self.pacing.forget(stream_id)
        self.slo.forget(stream_id)

    # ---- a stage's results and a formed generation (Generations' callbacks) ---------------------------

    def _on_chunk(self, gen: int, chunk: pb.ChunkResult) -> None:
        with self.cond:
            if gen != self.generations.generation:
                return
            session = self.streams.on_chunk(chunk)
            if session is not None and session.recache is not None:
                self.planner.wake()

    def _on_done(self, gen: int, index: int, done: pb.BatchDone, last: bool) -> None:
        with self.cond:
            if gen != self.generations.generation:
                return
            self.generations.count_batch(index, done)
            self.slo.observe(index, done)
            if last:
                self.telemetry.batch_done(done.seq)
                self.planner.batch_done()

    def _on_formed(self, replies: dict[int, pb.FormReply]) -> None:
        """Under the lock, every stage answered Form: the plan restarts, admission takes each stage's KV budget, the
        SLO model is seeded with each stage's calibration (``SloControl.seed``) and the Stream Batch is picked from
        them (``SloControl.pick_batch``)."""
        self.planner.restart()
        self.admission.on_formed(replies)
        self.slo.seed(replies)
        self.generations.set_max_batch(self.slo.pick_batch(waits=self.planner.lookahead))  # within --max-batch

    # ---- the SLO controller ----------------------------------------------------------------------------

    def report_vae(self, report: VaeReport, what: str = "") -> bool:
        """The gateway measured one decoder kind (``SloControl.report_vae``); a change wakes the plan loop."""
        with self.cond:
            changed = self.slo.report_vae(report, what)
            if changed:
                self.planner.wake()
            return changed

    def capacity(self, decoder: str = FULL) -> list[tuple[int, float]]:
        """(steps, streams): more streams at 16 FPS, one latent frame per chunk, on ``decoder``, the pipeline holds
        now."""
        with self.cond:
            return self.slo.capacity(decoder)

    def slo_correction(self) -> float:
        """What the SLO model's costs are multiplied by, learned from late streams (1: the model as measured)."""
        with self.cond:
            return self.slo.correction()

    def utilization(self) -> float | None:
        with self.cond:
            return self.slo.utilization()

    def status(self) -> pb.ClusterStatus:
        """GetStatus: each part's piece of it, and the free slots (``slots``)."""
        with self.cond:
            admitted = self.streams.admitted()
            slots = self._slots(self.stream_defaults())
            status = pb.ClusterStatus(
                world_size=self.registry.world_size,
                cfg_parallel=self.registry.cfg_parallel,
                active_streams=admitted.count,
                streams=self.streams.progress(self.pacing.lead_bound, self.slo.steps),
                slots_free=slots.free,
                slots_total=slots.total,
            )
            self.generations.status(status, self.admission.budgets(), admitted.kv)
            self.slo.status(status)
            return status

    def stats(self) -> CoordinatorStats:
        """What the coordinator's metrics read at a scrape (``coordinator.metrics``), as one value."""
        with self.cond:
            admitted = self.streams.admitted()
            return CoordinatorStats(
                active_streams=admitted.count,
                pending_events=self.streams.pending_count(),
                batches_in_flight=self.planner.in_flight(),
                lookahead=self.planner.lookahead,
                ready=self.generations.ready,
                generation=self.generations.generation,
                outbox=[(link.record.index, link.outbox.qsize()) for link in self.generations.links],
                kv=self.admission.kv_status(admitted.kv),
                capacity=self.slo.capacity(),
                utilization=self.slo.utilization(),
                slo_correction=self.slo.correction(),
            )
