"""The coordinator's pipeline engine: forms generations, schedules micro-steps, routes results, recovers.

Usage (the gRPC servicer in ``coordinator.server`` is a thin layer over this)::

    engine = PipelineEngine(registry, connect=lambda address: channel_to(address), max_batch=4)
    engine.start()
    engine.on_registered(record)            # forms a new generation once every stage is registered
    session = engine.open(spec, text)       # raises AdmissionError with a gRPC code
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
from collections.abc import Callable, Sequence
from dataclasses import replace

import grpc
import torch

from coordinator.admission import Admission, Reservation, admit
from coordinator.errors import AdmissionError, StreamError, StreamFailure
from coordinator.generations import Generations
from coordinator.metrics import CoordinatorTelemetry
from coordinator.pacing import MAX_CHUNK_RATE, PACE_EARLY_S, PLAYOUT_S, Pacing
from coordinator.plan import PlanLoop
from coordinator.registry import StageRecord, StageRegistry
from coordinator.slo import FULL, VaeReport, decoder_kind
from coordinator.slo_control import SloControl
from coordinator.slots import Slots, StreamDefaults, spatial_factor
from coordinator.streams import StreamSession, StreamTable, ladders_by_steps
from stagecast.grpc_util import CHANNEL_OPTIONS
from stagecast.internal.v1 import pipeline_pb2 as pb
from stagecast.microstep import DEFAULT_MAX_BATCH, StreamSpec

__all__ = [
    "PACE_EARLY_S",
    "PLAYOUT_S",
    "AdmissionError",
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
        *,
        connect: Callable[[str], grpc.Channel] | None = None,
        backend: str = "gloo",
        max_batch: int = DEFAULT_MAX_BATCH,
        lookahead: int | None = None,
        max_streams: int = 16,
        record_plan: bool = False,
        on_ready_change: Callable[[bool], None] | None = None,
        form_timeout: float = 600.0,
        max_ahead: int | None = None,
        playout_s: float = PLAYOUT_S,
        pace_grid: bool = False,
        clock: Callable[[], float] = time.monotonic,
        stage_ms: list[float] | None = None,
        slo_interval_s: float = 1.0,
        slo_learn: bool = True,
        vae_ms_per_chunk: float | dict[str, float] | None = None,
        stream_defaults: StreamDefaults | None = None,
    ):
        self.registry = registry
        self._stream_defaults = stream_defaults  # what a free slot is priced at (None: the public defaults)
        self.max_batch = max_batch
        self.pacing = Pacing(
            pipeline_stages=registry.pipeline_stages,
            max_ahead=max_ahead,
            playout_s=playout_s,
            clock=clock,
            grid=pace_grid,
        )
        self.cond = threading.Condition()
        self.telemetry = CoordinatorTelemetry()  # Prometheus registry and batch spans (coordinator.metrics)
        self.streams = StreamTable(self.telemetry)
        self.slo = SloControl(
            registry,
            self.streams,
            self.telemetry,
            max_batch=max_batch,
            clock=clock,
            stage_ms=stage_ms,
            slo_interval_s=slo_interval_s,
            slo_learn=slo_learn,
            vae_ms_per_chunk=vae_ms_per_chunk,
            pace_grid=pace_grid,
        )
        self.admission = Admission(registry, self.streams, self.slo, max_streams=max_streams)
        self.generations = Generations(
            self.cond,
            registry,
            self.telemetry,
            # Channels to stages (mTLS in a deployment: stagecast.security.connect); plaintext by default.
            connect=connect or (lambda address: grpc.insecure_channel(address, options=CHANNEL_OPTIONS)),
            backend=backend,
            max_batch=max_batch,
            form_timeout=form_timeout,
            on_ready_change=on_ready_change or (lambda ready: None),
            on_formed=self._on_formed,
            on_chunk=self._on_chunk,
            on_done=self._on_done,
            end_all=self.streams.end_all,
        )
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
            record_plan=record_plan,
        )
        self.telemetry.bind(self)

    # ---- what the server, the simulator, the metrics and the tests read: the parts' state ----------------

    generation = property(lambda self: self.generations.generation)
    ready = property(lambda self: self.generations.ready)
    sched = property(lambda self: self.generations.sched)
    links = property(lambda self: self.generations.links)
    sessions = property(lambda self: self.streams.sessions)
    plan = property(lambda self: self.planner.plan)
    record_plan = property(lambda self: self.planner.record_plan)
    lookahead = property(lambda self: self.planner.lookahead)

    # ---- lifecycle ------------------------------------------------------------------------------------

    def start(self) -> None:
        self.planner.thread.start()

    def shutdown(self, timeout: float = 5.0) -> None:
        with self.cond:
            links, workers = self.generations.shut()
            self.streams.end_all(StreamFailure(grpc.StatusCode.UNAVAILABLE, "coordinator is shutting down"))
            self.telemetry.generation_ended("coordinator is shutting down", failed=False)
            self.cond.notify_all()
        self.generations.close(links, workers, timeout)
        if self.planner.thread.is_alive():
            self.planner.thread.join(timeout)

    def on_registered(self, record: StageRecord) -> None:
        self.generations.on_registered(record)

    def heartbeat(self, index: int, address: str, generation: int) -> tuple[bool, str]:
        return self.generations.heartbeat(index, address, generation)

    def fail(self, reason: str, lost: int | None, lost_address: str | None = None, orderly: bool = False) -> None:
        self.generations.fail(reason, lost, lost_address, orderly)

    def model_config(self) -> dict | None:
        return self.registry.model_config()

    # ---- streams --------------------------------------------------------------------------------------

    def open(
        self,
        spec: StreamSpec,
        text: torch.Tensor,
        traceparent: str = "",
        *,
        acknowledges: bool = False,
        consumer_depth: int = 0,
        image: torch.Tensor | None = None,
        chunk_rate: float = 0.0,
        pace_offset_s: float = 0.0,
        ladders: list[tuple[float, ...]] | None = None,
        latency_first: bool = False,
        negative_text: torch.Tensor | None = None,
        decoder: str = "",
    ) -> StreamSession:
        decoder = decoder_kind(decoder)  # ValueError naming decoder: INVALID_ARGUMENT
        if not (chunk_rate == 0 or 0 < chunk_rate <= MAX_CHUNK_RATE):  # also catches NaN
            raise ValueError(f"chunk_rate must be 0 (unpaced) or in (0, {MAX_CHUNK_RATE}] chunks/s, got {chunk_rate}")
        if pace_offset_s != 0 and not (chunk_rate > 0 and 0 < pace_offset_s < 1 / chunk_rate):  # NaN too
            raise ValueError(
                f"pace_offset_s must be 0, or in (0, 1 / chunk_rate) for a paced stream; got {pace_offset_s} "
                f"with chunk_rate {chunk_rate}"
            )
        by_steps = ladders_by_steps(spec, ladders)
        with self.cond:
            try:
                reservation = self._admit(
                    spec,
                    text,
                    chunk_rate=chunk_rate,
                    by_steps=by_steps,
                    latency_first=latency_first,
                    decoder=decoder,
                    consumer_depth=consumer_depth,
                    image=image,
                    negative_text=negative_text,
                )
            except AdmissionError as exc:
                if exc.limit:
                    self.telemetry.refused(exc.limit)
                raise
            gens = self.generations
            session = self.streams.open(
                spec,
                text,
                negative_text=negative_text,
                traceparent=traceparent,
                generation=gens.generation,
                acknowledges=acknowledges,
                consumer_depth=consumer_depth,
                image=image,
                chunk_rate=chunk_rate,
                pace_offset_s=pace_offset_s,
                ladders=by_steps,
                latency_first=latency_first,
                kv=reservation.kv,
                decoder=decoder,
            )
            self.slo.joined()  # the set of streams changed: decide steps at the next tick (raises wait)
            self.planner.wake()
            return session

    def _admit(
        self,
        spec: StreamSpec,
        text: torch.Tensor,
        *,
        chunk_rate: float,
        by_steps: dict[int, tuple[float, ...]],
        latency_first: bool,
        decoder: str,
        consumer_depth: int = 0,
        image: torch.Tensor | None = None,
        negative_text: torch.Tensor | None = None,
        extra: Sequence[Reservation] = (),
    ) -> Reservation:
        """Under the lock: what the stream would hold if admitted beside the open streams and ``extra``; raises
        ``AdmissionError`` (or ``ValueError``) when it may not open.  Reserves nothing."""
        newcomer = self.slo.newcomer(spec, chunk_rate, by_steps, latency_first=latency_first, decoder=decoder)
        gens = self.generations
        state = self.admission.state(
            spec,
            newcomer,
            max(by_steps),
            ready=gens.ready,
            last_error=gens.last_error,
            model=self.model_config(),
            extra=extra,
        )
        admit(spec, text, state, consumer_depth=consumer_depth, image=image, negative_text=negative_text)
        return Reservation(self.admission.stage_kv(spec, max(by_steps)), newcomer)

    def slots(self, defaults: StreamDefaults | None = None) -> Slots:
        """How many more streams of the public defaults (``defaults``, else the engine's) this pipeline would admit
        now, by a dry run of the admission that refuses: hypothetical newcomers one by one until the first refusal
        (``coordinator.slots``).  Nothing is reserved; 0 free while no generation is formed."""
        with self.cond:
            return self._slots(defaults or self.stream_defaults())

    def stream_defaults(self) -> StreamDefaults:
        """The defaults a slot is priced at: the engine's ``stream_defaults``, else the public defaults at the serving
        size the stages' calibration timed."""
        if self._stream_defaults is not None:
            return self._stream_defaults
        cfg = self.model_config() or {}
        return StreamDefaults().with_shape(self.slo.serving_shape, spatial_factor(cfg))

    def _slots(self, defaults: StreamDefaults) -> Slots:
        active = len(self.streams.sessions)
        if not self.generations.ready:
            return Slots(0, active)
        cfg = self.model_config()
        try:
            spec = defaults.spec(cfg)
        except ValueError as exc:
            logger.warning("free slots: the default stream is not valid (%s)", exc)
            return Slots(0, active)
        text_dim = int((cfg or {}).get("text_dim") or 1)
        text = torch.empty(1, spec.text_len, text_dim, device="meta")  # its shape is all admission reads
        by_steps = {spec.steps: spec.timesteps}
        extra: list[Reservation] = []
        while len(extra) <= self.admission.max_streams:  # the stream cap ends it at the latest
            try:
                reservation = self._admit(
                    spec,
                    text,
                    chunk_rate=defaults.chunk_rate,
                    by_steps=by_steps,
                    latency_first=False,
                    decoder=decoder_kind(defaults.decoder),
                    extra=extra,
                )
            except (AdmissionError, ValueError):
                break
            extra.append(replace(reservation, demand=replace(reservation.demand, stream_id=-1 - len(extra))))
        return Slots(len(extra), active + len(extra))

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
            session.delivered += 1
            self.slo.check_late(session)
            self.planner.wake()

    def consumed(self, stream_id: int, chunks: int) -> None:
        """The consumer acknowledged the first ``chunks`` chunks as consumed (decoded and handed on)."""
        with self.cond:
            session = self.streams.consumed(stream_id, chunks)
            if session is not None:
                self.slo.check_late(session)
                self.planner.wake()

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
                self.planner.batches_done += 1
                self.telemetry.batch_done(done.seq)
                self.planner.wake()

    def _on_formed(self, replies: dict[int, pb.FormReply]) -> None:
        """Under the lock, every stage answered Form: the plan restarts, admission takes each stage's KV budget, the
        SLO model is seeded with each stage's calibration (``SloControl.seed``) and the Stream Batch is picked from
        them (``SloControl.pick_batch``)."""
        self.planner.restart()
        self.admission.on_formed(replies)
        self.slo.seed(replies)
        self.generations.sched.max_batch = self.slo.pick_batch(waits=self.planner.lookahead)  # within --max-batch

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
            return self.slo.controller.correction

    def utilization(self) -> float | None:
        with self.cond:
            return self.slo.utilization()

    def kv_status(self) -> list[tuple[int, int, int]]:
        """(stage index, KV budget, reserved bytes) of every stage with a budget, for metrics."""
        with self.cond:
            return self.admission.kv_status()

    def status(self) -> pb.ClusterStatus:
        with self.cond:
            reserved = self.admission.kv_reserved()
            slots = self._slots(self.stream_defaults())
            return pb.ClusterStatus(
                generation=self.generations.generation,
                ready=self.generations.ready,
                world_size=self.registry.world_size,
                cfg_parallel=self.registry.cfg_parallel,
                stages=self.generations.stage_descriptions(self.admission.kv_budgets, reserved),
                active_streams=len(self.streams.sessions),
                stage_stats=[self.generations.stage_stats[i] for i in sorted(self.generations.stage_stats)],
                streams=self.streams.progress(self.pacing.lead_bound),
                capacity=[pb.Capacity(steps=n, streams=c, decoder=FULL) for n, c in self.slo.capacity()],
                vae_chunk_ms=self.slo.cost.chunk_ms,
                vae_source=self.slo.cost.vae_source,
                calibrated_stages=sorted(self.slo.calibrated),
                decoders=self.slo.decoder_status(),
                max_batch=self.slo.cost.max_batch,
                slots_free=slots.free,
                slots_total=slots.total,
            )
