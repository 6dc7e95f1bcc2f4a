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

The engine is three parts by job: ``coordinator.generations`` (forming, failing and re-forming generations, the
rendezvous, stage health and results), ``coordinator.admission`` (which streams may open) and this module (the
streams and the plan loop).
"""

from __future__ import annotations

import itertools
import logging
import math
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

import grpc
import torch

from coordinator.admission import AdmissionError, AdmissionState, Capacity, KvMemory, admit, kv_verdict
from coordinator.generations import Generations, StageLink, StreamFailure
from coordinator.metrics import CoordinatorTelemetry
from coordinator.registry import StageRegistry
from coordinator.scheduler import StreamBatchScheduler
from coordinator.slo import FULL, CostModel, Demand, SloController, decoder_kind
from stagecast import wire
from stagecast.api import DECODERS, DEFAULT_FPS
from stagecast.grpc_util import CHANNEL_OPTIONS
from stagecast.internal.v1 import pipeline_pb2 as pb
from stagecast.kv_memory import stream_kv_bytes
from stagecast.microstep import DEFAULT_MAX_BATCH, PlanEvent, StreamSpec, chunk_levels, context_frames, recache_steps
from stagecast.model.config import DiTConfig
from stagecast.model.dit_configs import WAN_ROPE_MAX_SEQ_LEN
from stagecast.sampling import MAX_STEPS

logger = logging.getLogger(__name__)

# Pacing (``OpenStreamRequest.chunk_rate``): a paced stream starts chunk c up to PLAYOUT_S before its real-time
# slot, so the viewer's playout buffer holds about that much video while the pipeline serves other streams.
PLAYOUT_S = 0.5
MAX_PLAYOUT_S = 10.0
MAX_CHUNK_RATE = 1000.0
# The plan loop ticks for a paced chunk once its slot is this close, and the credit lets the chunk start from then on:
# a tick that came early for a chunk the credit did not yet allow was never repeated (it is kicked once per chunk
# count), and the stream stalled until some other event woke the loop.
PACE_EARLY_S = 1e-3
# GetStatus capacity: streams at 16 FPS with one latent frame per chunk (4 video frames): 4 chunks per second.
CAPACITY_CHUNK_RATE = DEFAULT_FPS / 4
# A paced stream is falling behind (the SLO controller's correction) when a consumed chunk is more than this many chunk
# periods past its real-time schedule (the first chunk's consumption + c / chunk_rate) and its lateness grew by more
# than that in each of the last LATE_WINDOWS windows of LATE_WINDOW_S: a stream short of its rate by more than
# 0.5 / (4 chunks/s x 2 s) = 6% is caught within about 4 s, while a one-off stall that the stream then rides out is not.
LATE_TOLERANCE_CHUNKS = 0.5
LATE_WINDOW_S = 2.0
LATE_WINDOWS = 2
CAPACITY_STEPS = (1, 2, 3, 4)
RETRY_AFTER_S = 5.0  # the retry hint when no admitted stream has a known end


_END = object()

# A video-to-video stream's input chunks that may wait at the coordinator for the pipeline to start them; the
# consumer learns it is ahead from SubmitInput's RESOURCE_EXHAUSTED and either drops the chunk or waits.
MAX_PENDING_INPUTS = 2


@dataclass
class StreamSession:
    id: int
    spec: StreamSpec
    text: torch.Tensor
    negative_text: torch.Tensor | None = None  # a guided stream's negative prompt
    traceparent: str = ""
    events: queue.Queue = field(default_factory=queue.Queue)
    received: int = 0
    # Chunks the consumer has consumed: acknowledged by it (``acknowledges``), else yielded by its gRPC stream.
    delivered: int = 0
    acknowledges: bool = False
    consumer_depth: int = 0  # chunks the consumer holds between receiving and acknowledging (its VAE depth)
    chunk_rate: float = 0.0  # pacing: real-time chunks per second; 0: unpaced
    # pacing: how much sooner than c / chunk_rate chunk c >= 1 is due (the first chunk holds fewer video frames)
    pace_offset_s: float = 0.0
    ladders: dict[int, tuple[float, ...]] = field(default_factory=dict)  # steps -> ladder (SLO controller)
    latency_first: bool = False
    steps: int = 0  # what its next chunk runs
    paced_since: float | None = None  # clock time the stream's first chunk could start (its open was planned)
    started: int = 0  # chunks started by the scheduler
    max_lead: int = 0  # the largest started - delivered seen
    first_consumed_at: float | None = None  # clock time chunk 0 was consumed: the stream's real-time schedule
    late_mark: tuple[float, float] | None = None  # (clock time, lateness) at the start of the current window
    late_windows: int = 0  # consecutive windows in which the stream fell further behind
    late_chunks: int = 0  # times it was found falling behind (each one informs the SLO controller)
    expected: int | None = None  # known once the scheduler has finished the stream
    stopped: bool = False
    cancelled: bool = False
    ended: bool = False
    generation: int = 0
    inputs: dict[int, torch.Tensor] = field(default_factory=dict)  # video-to-video: input chunks not yet planned
    image: torch.Tensor | None = None  # image-to-video: the image latent the open event carries
    recache: torch.Tensor | None = None  # a recache prompt's text, waiting for the chunks in flight
    finished: dict[int, pb.Tensor] = field(default_factory=dict)  # the clean latents a recache would need
    inputs_received: int = 0
    kv: dict[int, int] = field(default_factory=dict)  # worst-case KV bytes reserved on each stage while it is open
    decoder: str = FULL  # the decoder the gateway runs it on ("full" | "tiny"): what its chunks' decode costs

    @property
    def best_effort(self) -> bool:
        """An unpaced stream (no chunk rate, no input clock): it yields to the paced ones in the scheduler and takes
        none of their capacity."""
        return self.chunk_rate <= 0 and not self.spec.input_latents

    def iter_events(self) -> Iterator[pb.StreamEvent | StreamFailure]:
        while True:
            ev = self.events.get()
            if ev is _END:
                return
            yield ev
            if isinstance(ev, StreamFailure):
                return


def _ladders(spec: StreamSpec, ladders: list[tuple[float, ...]] | None) -> dict[int, tuple[float, ...]]:
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


class PipelineEngine(Generations):
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
        clock: Callable[[], float] = time.monotonic,
        stage_ms: list[float] | None = None,
        slo_interval_s: float = 1.0,
        slo_learn: bool = True,
        vae_ms_per_chunk: float | dict[str, float] | None = None,
    ):
        self.registry = registry
        # Channels to stages (mTLS in a deployment: stagecast.security.connect); plaintext by default.
        self.connect = connect or (lambda address: grpc.insecure_channel(address, options=CHANNEL_OPTIONS))
        self.backend = backend
        self.max_batch = max_batch
        self.lookahead = lookahead or 2 * registry.pipeline_stages + 2
        self.max_streams = max_streams
        self.record_plan = record_plan
        self.on_ready_change = on_ready_change or (lambda ready: None)
        self.form_timeout = form_timeout
        # Chunks a stream may run ahead of its consumer: enough for the full wavefront plus a little slack.
        self.max_ahead = max_ahead
        if not 0 <= playout_s <= MAX_PLAYOUT_S:
            raise ValueError(f"playout_s must be in [0, {MAX_PLAYOUT_S}], got {playout_s}")
        self.playout_s = playout_s  # how far ahead of its real-time slot a paced stream may start a chunk
        self.clock = clock
        self._idle_ticks = 0
        # The SLO controller's model of stage time per batch: the operator's --stage-ms, else each stage's calibration
        # at READY (on_formed), refined by measured batches; each decoder kind's cost per chunk: the operator's (a
        # number: the full VAE's; or ms per kind), else the gateway's measurement (report_vae).  --slo-fixed
        # (slo_learn False) keeps the operator's numbers only.
        if not slo_learn:  # every decoder kind fixed: the operator's number, else 0
            given = vae_ms_per_chunk if isinstance(vae_ms_per_chunk, dict) else {FULL: vae_ms_per_chunk}
            vae_ms_per_chunk = {kind: given.get(kind) or 0.0 for kind in DECODERS}
        self.cost = CostModel(registry.world_size, max_batch, seed_ms=stage_ms, chunk_ms=vae_ms_per_chunk)
        self.calibrated: set[int] = set()  # stages whose model started from their own calibration
        self.controller = SloController(self.cost)
        self.slo_interval_s = slo_interval_s
        self.slo_learn = slo_learn  # False: keep the calibration (simulations, tests), ignore measured batches
        # Chunks started since the engine began, across streams and generations (it never falls), and its value when
        # the plan loop last woke for a paced chunk: the loop ticks for a paced chunk once per chunk started.
        self._chunks_started = 0
        self._kicked = -1
        self._decided_at: float | None = None  # clock time of the last controller decision (None: decide now)
        self._late_at: float | None = None  # clock time a paced stream was last seen late
        self._relaxed_at: float | None = None  # clock time the controller's correction last relaxed

        self.cond = threading.Condition()
        self.generation = 0
        self.ready = False
        self.forming = False
        self.links: list[StageLink] = []
        self.sched: StreamBatchScheduler | None = None
        self.sessions: dict[int, StreamSession] = {}
        self.pending_opens: deque[StreamSession] = deque()
        self.pending_stops: set[int] = set()
        self.pending_cancels: set[int] = set()
        self.pending_prompts: deque[tuple[int, torch.Tensor]] = deque()
        self.seq = 0
        self.batches_planned = 0
        self.batches_done = 0
        self.plan: list[pb.PlanEvent] = []
        self.stage_stats: dict[int, pb.StageStats] = {}
        # Each stage process's KV budget and K/V element size from its FormReply (index -> bytes; 0: no limit).
        self.kv_budgets: dict[int, int] = {}
        self.kv_elements: dict[int, int] = {}
        self.last_error = ""
        self.resetting = 0
        self._ids = itertools.count(1)
        self._stopped = False
        self._loop_thread = threading.Thread(target=self._loop, daemon=True, name="scheduler")
        self.telemetry = CoordinatorTelemetry()  # Prometheus registry and batch spans (coordinator.metrics)
        self.telemetry.bind(self)
        self._monitor_stop = threading.Event()
        self._workers: set[threading.Thread] = set()  # forming and resetting threads, joined by shutdown

    # ---- lifecycle ------------------------------------------------------------------------------------

    def start(self) -> None:
        self._loop_thread.start()

    def shutdown(self, timeout: float = 5.0) -> None:
        with self.cond:
            self._stopped = True
            self._end_all(StreamFailure(grpc.StatusCode.UNAVAILABLE, "coordinator is shutting down"))
            self.telemetry.generation_ended("coordinator is shutting down", failed=False)
            self.cond.notify_all()
            links, self.links = self.links, []
            workers = list(self._workers)
        self._monitor_stop.set()
        for link in links:
            link.close()
        # Forming and resetting talk to stages with deadlines; wait for them so that none is still running
        # (and starting threads) while the interpreter shuts down.
        for worker in workers:
            worker.join(timeout)
        if self._loop_thread.is_alive():
            self._loop_thread.join(timeout)

    def _spawn(self, target, *args, name: str) -> None:
        """Run a forming or resetting job in its own thread, unless the engine is shutting down.  A reset is
        counted in ``resetting`` from now on, so that no generation forms before it has run."""
        with self.cond:
            if self._stopped:
                if target == self._form:
                    self.forming = False
                return
            if target == self._reset_then_reform:
                self.resetting += 1
            thread = threading.Thread(target=self._tracked, args=(target, *args), daemon=True, name=name)
            self._workers.add(thread)
            thread.start()

    def _tracked(self, target, *args) -> None:
        try:
            target(*args)
        finally:
            with self.cond:
                self._workers.discard(threading.current_thread())

    # ---- streams --------------------------------------------------------------------------------------

    def model_config(self) -> dict | None:
        recs = self.registry.records()
        return recs[0].config if recs else None

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
        by_steps = _ladders(spec, ladders)
        cfg = self.model_config()
        with self.cond:
            newcomer = Demand(
                0,
                chunk_rate,
                tuple(by_steps),
                clean=spec.policy == "clean",
                latency_first=latency_first,
                rows=self._rows(spec),
                decoder=decoder,
            )
            state = AdmissionState(
                ready=self.ready,
                registered=len([r for r in self.registry.records() if not r.lost]),
                world_size=self.registry.world_size,
                active=len(self.sessions),
                max_streams=self.max_streams,
                model=cfg,
                last_error=self.last_error,
                capacity=self._capacity_verdict(newcomer),
                kv_memory=self._kv_verdict(spec, max(by_steps)),
            )
            try:
                admit(spec, text, state, consumer_depth=consumer_depth, image=image, negative_text=negative_text)
            except AdmissionError as exc:
                if exc.limit:
                    self.telemetry.refused(exc.limit)
                raise
            sid = spec.stream_id or next(self._ids)
            if sid in self.sessions:
                raise AdmissionError(grpc.StatusCode.ALREADY_EXISTS, f"stream {sid} is already active")
            spec = replace(spec, stream_id=sid)
            session = StreamSession(
                sid,
                spec,
                text,
                negative_text=negative_text,
                traceparent=traceparent,
                generation=self.generation,
                acknowledges=acknowledges,
                consumer_depth=consumer_depth,
                image=image,
                chunk_rate=chunk_rate,
                pace_offset_s=pace_offset_s,
                ladders=by_steps,
                latency_first=latency_first,
                steps=spec.steps,
                kv=self._stage_kv(spec, max(by_steps)),
                decoder=decoder,
            )
            self.sessions[sid] = session
            self._decided_at = None  # the set of streams changed: decide steps at the next tick
            self.pending_opens.append(session)
            self.telemetry.stream_opened()
            self._wake()
            return session

    def stop_stream(self, stream_id: int) -> None:
        with self.cond:
            session = self.sessions.get(stream_id)
            if session is None:
                raise AdmissionError(grpc.StatusCode.NOT_FOUND, f"unknown stream {stream_id}")
            session.stopped = True
            self.pending_stops.add(stream_id)
            self._wake()

    def cancel_stream(self, stream_id: int) -> None:
        """End a stream now (its consumer left): nothing more is planned for it, the batches already planned
        finish on the stages with their results dropped, and its close frees its state on every stage."""
        with self.cond:
            session = self.sessions.get(stream_id)
            if session is None:
                raise AdmissionError(grpc.StatusCode.NOT_FOUND, f"unknown stream {stream_id}")
            session.cancelled = True
            self._end(session, pb.StreamEvent(ended=pb.StreamEnded(reason="cancelled")))
            if any(pending is session for pending in self.pending_opens):
                # Never planned: nothing to close on the stages.
                self.pending_opens = deque(p for p in self.pending_opens if p is not session)
            else:
                self.pending_cancels.add(stream_id)
            self._wake()

    def update_prompt(self, stream_id: int, text: torch.Tensor, recache: bool = False) -> None:
        """A new prompt from the stream's next chunk not yet started.  ``recache``: the stream starts no new chunk
        until the ones in flight have finished and come back, then the plan rebuilds its KV window under the new
        prompt from their clean latents (``stagecast.microstep.recache_steps``) before the next chunk."""
        with self.cond:
            session = self.sessions.get(stream_id)
            if session is None:
                raise AdmissionError(grpc.StatusCode.NOT_FOUND, f"unknown stream {stream_id}")
            if tuple(text.shape) != tuple(session.text.shape):
                raise AdmissionError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"text has shape {tuple(text.shape)}, expected {tuple(session.text.shape)}",
                )
            if recache and session.spec.window is None:
                raise AdmissionError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "transition: recache rebuilds the KV window; this stream's window is unbounded (set window)",
                )
            if recache and session.spec.cfg:
                raise AdmissionError(
                    grpc.StatusCode.INVALID_ARGUMENT, "transition: a recache of a guided stream is not supported yet"
                )
            if recache and session.recache is not None:
                raise AdmissionError(
                    grpc.StatusCode.FAILED_PRECONDITION, "transition: a recache of this stream is already waiting"
                )
            self.pending_prompts.append((stream_id, text, recache))
            self._wake()

    def submit_input(self, stream_id: int, chunk: int, latents: torch.Tensor) -> None:
        """A video-to-video stream's input latents for its next chunk (chunks in order from 0).  At most
        ``MAX_PENDING_INPUTS`` wait for the pipeline: beyond that RESOURCE_EXHAUSTED, and the consumer drops the
        chunk or waits for one to start."""
        with self.cond:
            session = self.sessions.get(stream_id)
            if session is None:
                raise AdmissionError(grpc.StatusCode.NOT_FOUND, f"unknown stream {stream_id}")
            spec = session.spec
            if not spec.input_latents:
                raise AdmissionError(
                    grpc.StatusCode.FAILED_PRECONDITION, f"stream {stream_id} was not opened with input_latents"
                )
            if session.stopped or session.cancelled:
                raise AdmissionError(grpc.StatusCode.FAILED_PRECONDITION, f"stream {stream_id} is stopping")
            if chunk != session.inputs_received:
                raise AdmissionError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"chunk: input for chunk {chunk}, expected chunk {session.inputs_received} (inputs come in order)",
                )
            if spec.num_chunks is not None and chunk >= spec.num_chunks:
                raise AdmissionError(
                    grpc.StatusCode.OUT_OF_RANGE,
                    f"chunk: the stream has {spec.num_chunks} chunks, got input for {chunk}",
                )
            if tuple(latents.shape) != spec.latent_shape or latents.dtype != torch.float32:
                raise AdmissionError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"latents: must be float32 {spec.latent_shape}, got {latents.dtype} {tuple(latents.shape)}",
                )
            if not bool(torch.isfinite(latents).all()):
                raise AdmissionError(grpc.StatusCode.INVALID_ARGUMENT, "latents: must be finite")
            if session.inputs_received - session.started >= MAX_PENDING_INPUTS:
                raise AdmissionError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"input: {MAX_PENDING_INPUTS} chunks already wait for the pipeline to start them",
                )
            session.inputs[chunk] = latents
            session.inputs_received += 1
            self._wake()

    def _end(self, session: StreamSession, final) -> None:
        if session.ended:
            return
        session.ended = True
        session.inputs.clear()
        self.telemetry.stream_ended(final.ended.reason if isinstance(final, pb.StreamEvent) else final.code.name)
        session.events.put(final)
        session.events.put(_END)
        self.sessions.pop(session.id, None)

    def _end_all(self, failure: StreamFailure) -> None:
        for session in list(self.sessions.values()):
            self._end(session, failure)
        self.pending_opens.clear()
        self.pending_stops.clear()
        self.pending_cancels.clear()
        self.pending_prompts.clear()

    def _maybe_complete(self, session: StreamSession) -> None:
        if session.expected is not None and session.received >= session.expected:
            reason = "stopped" if session.stopped else "completed"
            self._end(session, pb.StreamEvent(ended=pb.StreamEnded(reason=reason)))

    def _on_chunk(self, gen: int, chunk: pb.ChunkResult) -> None:
        with self.cond:
            if gen != self.generation:
                return
            session = self.sessions.get(chunk.stream_id)
            if session is None:
                self.telemetry.chunk(routed=False)
                return
            session.received += 1
            self.telemetry.chunk(routed=True, steps=chunk.steps)
            if session.spec.window is not None:  # what a recache would rebuild the KV window from (bounded)
                session.finished[chunk.chunk] = chunk.latents
                keep = {f // session.spec.chunk_frames for f in context_frames(session.spec, chunk.chunk + 1, 1 << 30)}
                for c in [c for c in session.finished if c not in keep]:
                    del session.finished[c]
            session.events.put(pb.StreamEvent(chunk=chunk))
            self._maybe_complete(session)
            if session.recache is not None:
                self._wake()

    def on_formed(self, replies: dict[int, pb.FormReply]) -> None:
        """Seed the SLO model with each stage's calibration (full KV window; empty where only that was timed), unless
        the operator's --stage-ms or --slo-fixed takes precedence; take each stage's KV budget for admission."""
        self.kv_budgets = {index: max(0, reply.kv_budget_bytes) for index, reply in replies.items()}
        self.kv_elements = {index: max(0, reply.kv_element_bytes) for index, reply in replies.items()}
        for index, budget in sorted(self.kv_budgets.items()):
            if budget:
                logger.info("stage %d gives streams' KV %.3f GiB", index, budget / (1 << 30))
        for index, reply in sorted(replies.items()):
            if not reply.HasField("calibration"):
                logger.info("stage %d reported no calibration: its times are learnt from measured batches", index)
                continue
            cal = reply.calibration
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

    def report_vae(
        self,
        chunk_ms: float,
        what: str = "",
        *,
        decoder: str = FULL,
        batch_ms: tuple[float, ...] | list[float] = (),
        state_bytes: int = 0,
    ) -> bool:
        """The gateway measured decoder kind ``decoder``: ``chunk_ms`` per chunk alone on the busiest GPU, ``batch_ms``
        per stream at 1..n streams decoding together (empty: it does not batch).  Each report replaces that kind's
        numbers (ignored when the operator fixed them with --vae-ms-per-chunk or --slo-fixed); a change makes the
        controller decide again, and admission uses it from the next open.  ``ValueError`` names a field out of
        range."""
        with self.cond:
            changed = self.cost.report_vae(decoder, chunk_ms, batch_ms, state_bytes)
            if changed:
                kind = decoder_kind(decoder)
                batched = f", per stream {', '.join(f'{m:.2f}' for m in batch_ms)} at 1..{len(batch_ms)} in one call"
                logger.info(
                    "the SLO model counts the gateway's %s decoder at %.2f ms per chunk%s%s",
                    kind,
                    chunk_ms,
                    batched if batch_ms else "",
                    what,
                )
                self._decided_at = None  # decide steps again with the new cost
                self._wake()
            return changed

    def _on_done(self, gen: int, index: int, done: pb.BatchDone, last: bool) -> None:
        with self.cond:
            if gen != self.generation:
                return
            st = self.stage_stats.setdefault(index, pb.StageStats(index=index))
            st.batches += 1
            st.forward_ms_total += done.forward_ms
            st.wait_ms_total += done.wait_ms
            st.micro_steps += done.micro_steps
            st.exchange_ms_total += done.exchange_ms
            if done.batches > 0 and self.slo_learn:  # the SLO controller's model: mean ms per batch at the mean size
                size = max(1, round(done.micro_steps / done.batches))
                self.cost.observe(index, size, done.forward_ms / done.batches)
            if last:
                self.batches_done += 1
                self.telemetry.batch_done(done.seq)
                self._wake()

    # ---- scheduling loop ------------------------------------------------------------------------------

    def _has_work(self) -> bool:
        if not self.ready or self.sched is None:
            return False
        if self.pending_opens or self.pending_stops or self.pending_cancels or self.pending_prompts:
            return True
        # After P empty ticks in a row nothing waits on pipeline latency any more: only an outside event
        # (a batch done, a chunk delivered, an open or stop) can make work, and each one wakes the loop.
        return (
            self.sched.active
            and self.batches_planned - self.batches_done < self.lookahead
            and self._idle_ticks < self.registry.pipeline_stages
        )

    def _wake(self) -> None:
        self._idle_ticks = 0
        self.cond.notify_all()

    def delivered(self, session: StreamSession) -> None:
        """The consumer's gRPC stream took a chunk.  For a consumer that does not acknowledge, that is delivery: the
        stream may start another (delivery pacing)."""
        if session.acknowledges:
            return
        with self.cond:
            session.delivered += 1
            self._check_late(session)
            self._wake()

    def consumed(self, stream_id: int, chunks: int) -> None:
        """The consumer acknowledged the first ``chunks`` chunks as consumed (decoded and handed on)."""
        with self.cond:
            session = self.sessions.get(stream_id)
            if session is None:
                raise AdmissionError(grpc.StatusCode.NOT_FOUND, f"unknown stream {stream_id}")
            if not session.acknowledges:
                raise AdmissionError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"stream {stream_id} was opened without acknowledges; its chunks count as delivered when sent",
                )
            if not 0 <= chunks <= session.received:
                raise AdmissionError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"chunks={chunks} must be in [0, {session.received}] (the chunks the stream has received)",
                )
            if chunks > session.delivered:
                session.delivered = chunks
                self._check_late(session)
                self._wake()

    def _check_late(self, session: StreamSession) -> None:
        """Under the lock, when a stream's consumed count rose: a paced stream that keeps falling behind its real-time
        schedule tells the SLO controller that its model undercounts what the running set costs."""
        if session.chunk_rate <= 0 or session.delivered <= 0:
            return
        now = self.clock()
        newest = session.delivered - 1
        if session.first_consumed_at is None:
            session.first_consumed_at = now - newest / session.chunk_rate
            session.late_mark = (now, 0.0)
            return
        late_s = now - (session.first_consumed_at + newest / session.chunk_rate)
        mark_at, mark_late = session.late_mark or (now, late_s)
        if now - mark_at < LATE_WINDOW_S:
            return
        tolerance = LATE_TOLERANCE_CHUNKS / session.chunk_rate
        falling = late_s > tolerance and late_s - mark_late > tolerance
        session.late_windows = session.late_windows + 1 if falling else 0
        session.late_mark = (now, late_s)
        if session.late_windows < LATE_WINDOWS:
            return
        session.late_windows = 0  # the next finding needs fresh windows, with the corrected model deciding
        session.late_chunks += 1
        self._late_at = now
        if self.controller.observe_late(self._demands()):
            self._decided_at = None  # decide steps at the next tick, with the corrected model
            logger.info(
                "stream %d is late (chunk %d): the SLO model now counts %.2fx its costs",
                session.id,
                newest,
                self.controller.correction,
            )

    def lead_bound(self, session: StreamSession) -> int:
        """Chunks a stream may run ahead of its consumer: one wavefront (every level in every stage) plus what
        the consumer holds to keep its decoder busy (2 for a consumer that does not say)."""
        if self.max_ahead:
            return self.max_ahead
        depth = session.consumer_depth if session.acknowledges else 2
        levels = chunk_levels(max(session.ladders), session.spec.policy)
        return levels * self.registry.pipeline_stages + depth

    # ---- the SLO controller ----------------------------------------------------------------------------

    def _demand(self, session: StreamSession) -> Demand:
        return Demand(
            session.id,
            session.chunk_rate,
            tuple(session.ladders),
            steps=session.steps,
            clean=session.spec.policy == "clean",
            latency_first=session.latency_first,
            rows=self._rows(session.spec),
            decoder=session.decoder,
        )

    def _rows(self, spec: StreamSpec) -> int:
        """Batch rows a micro-step of the stream takes on a stage: a guided stream's two branches in one pipeline
        (under CFG-parallel each group runs one)."""
        return 2 if spec.cfg and self.registry.cfg_parallel == 1 else 1

    def _demands(self) -> list[Demand]:
        return [self._demand(s) for s in sorted(self.sessions.values(), key=lambda s: s.id) if not s.ended]

    def _retry_after(self) -> float:
        """When capacity or memory is likely back: the soonest end of a bounded paced stream (its remaining chunks
        at its pace), else ``RETRY_AFTER_S``."""
        ends = [
            (s.spec.num_chunks - s.delivered) / s.chunk_rate
            for s in self.sessions.values()
            if s.spec.num_chunks is not None and s.chunk_rate > 0
        ]
        return max(0.1, min(ends)) if ends else RETRY_AFTER_S

    def _stage_kv(self, spec: StreamSpec, max_steps: int) -> dict[int, int]:
        """The stream's worst-case KV bytes on each stage process with a KV budget (``stagecast.kv_memory``): its
        layers, its share of the heads under --sp, its CFG group's branches under --cfg-parallel."""
        cfg = self.model_config()
        if cfg is None or not any(self.kv_budgets.values()):
            return {}
        model = DiTConfig.from_kwargs(cfg)
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

    def kv_reserved(self) -> dict[int, int]:
        """Worst-case KV bytes of the open streams on each stage process (released as each stream ends)."""
        reserved: dict[int, int] = {}
        for session in self.sessions.values():
            for index, nbytes in session.kv.items():
                reserved[index] = reserved.get(index, 0) + nbytes
        return reserved

    def kv_status(self) -> list[tuple[int, int, int]]:
        """(stage index, KV budget, reserved bytes) of every stage with a budget, for metrics."""
        with self.cond:
            reserved = self.kv_reserved()
            return [(i, b, reserved.get(i, 0)) for i, b in sorted(self.kv_budgets.items()) if b > 0]

    def _kv_verdict(self, spec: StreamSpec, max_steps: int) -> KvMemory | None:
        """Whether the stream's worst-case KV fits every stage beside the admitted streams'; None when not checked."""
        if not any(self.kv_budgets.values()):
            return None
        rope = int((self.model_config() or {}).get("rope_max_seq_len") or WAN_ROPE_MAX_SEQ_LEN)
        try:
            return kv_verdict(
                spec,
                lambda s: self._stage_kv(s, max_steps),
                self.kv_reserved(),
                self.kv_budgets,
                rope_limit=rope,
                retry_after_s=self._retry_after(),
            )
        except (ValueError, TypeError, KeyError):
            return None  # a stream the model cannot run: check_spec refuses it with its reason

    def _capacity_verdict(self, newcomer: Demand) -> Capacity | None:
        """Whether the pipeline holds one more stream (every stream at its min_steps); None when not checked."""
        if newcomer.chunk_rate <= 0 or self.cost.micro_step_ms() is None:
            return None
        admitted = self._demands()
        if self.controller.admits(newcomer, admitted):
            return Capacity(True)
        need = self.controller.utilization(admitted + [newcomer], {d.stream_id: d.min_steps for d in admitted}) or 0.0
        # Capacity comes back when a bounded stream ends: the soonest one's remaining chunks at its pace.
        retry = self._retry_after()
        detail = (
            f"{len(admitted)} streams at their min_steps and this one at {newcomer.min_steps} steps on the "
            f"{newcomer.decoder} decoder would need {need:.0%} of the slowest stage (the limit is "
            f"{self.controller.target:.0%})"
        )
        return Capacity(False, detail, retry)

    def capacity(self, decoder: str = FULL) -> list[tuple[int, float]]:
        """(steps, streams): more streams at 16 FPS, one latent frame per chunk, on ``decoder``, the pipeline holds
        now."""
        with self.cond:
            admitted = self._demands()
            out = []
            for steps in CAPACITY_STEPS:
                n = self.controller.capacity_streams(admitted, CAPACITY_CHUNK_RATE, steps, decoder=decoder)
                if n is not None:
                    out.append((steps, n))
            return out

    def slo_correction(self) -> float:
        """What the SLO model's costs are multiplied by, learned from late streams (1: the model as measured)."""
        with self.cond:
            return self.controller.correction

    def utilization(self) -> float | None:
        with self.cond:
            return self.controller.utilization([d for d in self._demands() if d.chunk_rate > 0])

    def _control(self, sched: StreamBatchScheduler, events: list) -> None:
        """Let the SLO controller pick steps; a change applies from each stream's next chunk (a ``steps`` event)."""
        now = self.clock()
        if self._decided_at is not None and now - self._decided_at < self.slo_interval_s:
            return
        self._decided_at = now
        if self._relaxed_at is not None and (self._late_at is None or self._late_at < self._relaxed_at):
            self.controller.relax(now - self._relaxed_at)  # no stream was late since the last decision
        self._relaxed_at = now
        demands = [self._demand(self.sessions[sid]) for sid in sorted(sched.streams) if sid in self.sessions]
        if not any(len(d.allowed) > 1 for d in demands):
            return
        decision = self.controller.decide(demands)
        for d in demands:
            session, want = self.sessions[d.stream_id], decision[d.stream_id]
            if want == session.steps or sched.streams[d.stream_id].stopping:
                continue
            ladder = session.ladders[want]
            first = sched.set_steps(session.id, ladder)
            self.telemetry.steps_changed(session.steps, want)
            session.steps = want
            if first is not None:
                events.append(self._next_event("steps", stream_id=session.id, from_chunk=first, timesteps=ladder))

    def paced_credit(self, session: StreamSession, now: float) -> int | None:
        """Chunks a paced stream may have started by ``now``: chunk c starts no earlier than its real-time slot
        (``_pace_slot``) less the playout buffer.  None for an unpaced stream."""
        if session.chunk_rate <= 0 or session.paced_since is None:
            return None
        slots = (now + PACE_EARLY_S - session.paced_since + self.playout_s + session.pace_offset_s) * session.chunk_rate
        return max(0, math.floor(slots + 1e-9)) + 1  # 1e-9: a slot reached exactly is not lost to rounding

    @staticmethod
    def _pace_slot(session: StreamSession, chunk: int) -> float:
        """When a paced stream's chunk is due at its viewer, on the coordinator's clock: ``paced_since + c /
        chunk_rate``, less ``pace_offset_s`` for every chunk after the first, whose frames come sooner because the
        first chunk holds fewer (Wan's first latent frame decodes to one video frame, each later one to four)."""
        offset = session.pace_offset_s if chunk > 0 else 0.0
        return session.paced_since + chunk / session.chunk_rate - offset

    def _credit(self, session: StreamSession) -> int:
        credit = session.delivered + self.lead_bound(session)
        paced = self.paced_credit(session, self.clock())
        return credit if paced is None else min(credit, paced)

    def _pace_timeout(self) -> float | None:
        """Seconds until a paced stream may start its next chunk (0 when one may now), for streams whose consumer
        has room for it (a stream held by its consumer is woken by the consumer's acknowledgement)."""
        if self.sched is None:
            return None
        now = self.clock()
        soonest = None
        for sid, st in self.sched.streams.items():
            session = self.sessions.get(sid)
            if session is None or session.chunk_rate <= 0 or session.paced_since is None or st.stopping:
                continue
            started = self.sched.started_chunks.get(sid, 0)
            if started >= session.delivered + self.lead_bound(session):
                continue  # held by its consumer
            if st.spec.num_chunks is not None and started >= st.spec.num_chunks:
                continue
            due = self._pace_slot(session, started) - self.playout_s
            soonest = due if soonest is None else min(soonest, due)
        return None if soonest is None else max(0.0, soonest - now)

    def _loop(self) -> None:
        while True:
            with self.cond:
                while not self._stopped and not self._has_work():
                    timeout = self._pace_timeout()
                    started = self._chunks_started
                    if timeout is not None and timeout <= PACE_EARLY_S and self._idle_ticks and started != self._kicked:
                        # A paced stream's next chunk is due: tick again (once per chunk started, so a stream that
                        # cannot start for another reason is not ticked in a busy loop).  The count never falls: the
                        # sum of the open streams' started chunks did when one closed, and a later stream that reached
                        # the sum the loop last ticked for was never ticked for again (it stalled for good).
                        self._kicked = started
                        self._idle_ticks = 0
                        continue
                    if timeout is not None and timeout <= PACE_EARLY_S:
                        timeout = 0.005 if self._idle_ticks else None
                    self.cond.wait(timeout)
                if self._stopped:
                    return
                events = self._plan_tick()
                links = list(self.links)
            for ev in events:
                for link in links:
                    link.outbox.put(ev)

    def _next_event(self, kind: str, **kw) -> pb.PlanEvent:
        self.seq += 1
        event = PlanEvent(kind, seq=self.seq, **kw)
        if self.record_plan:
            # The recorded plan keeps the schedule, not the texts (GetPlan, selftest replay).
            stripped = replace(
                event,
                text=None,
                latents=None,
                negative_text=None,
                window=tuple((c, None) for c, _ in event.window),
            )
            self.plan.append(wire.event_to_proto(stripped, self.generation))
        return wire.event_to_proto(event, self.generation)

    def _plan_tick(self) -> list[pb.PlanEvent]:
        sched = self.sched
        assert sched is not None
        events = []
        while self.pending_opens:
            session = self.pending_opens.popleft()
            sched.add_stream(session.spec, best_effort=session.best_effort)
            session.paced_since = self.clock()
            events.append(
                self._next_event(
                    "open",
                    spec=session.spec,
                    text=session.text,
                    latents=session.image,
                    negative_text=session.negative_text,
                    traceparent=session.traceparent,
                )
            )
            session.events.put(
                pb.StreamEvent(started=pb.StreamStarted(stream_id=session.id, generation=self.generation))
            )
        before = set(sched.streams)  # a stream that leaves the scheduler from here on gets its close event
        for sid in sorted(self.pending_stops):
            if sid in sched.streams:
                sched.stop_stream(sid)
        self.pending_stops.clear()
        for sid in sorted(self.pending_cancels):
            sched.cancel_stream(sid)  # its close (below) follows the batches already planned
        self.pending_cancels.clear()
        while self.pending_prompts:
            sid, text, recache = self.pending_prompts.popleft()
            st = sched.streams.get(sid)
            session = self.sessions.get(sid)
            if st is None or session is None:
                continue
            if recache:  # planned below once the chunks in flight are back
                session.recache = text
                sched.hold(sid, True)
                continue
            # Effective from the next chunk not yet started: chunks in flight keep their prompt.
            events.append(self._next_event("prompt", stream_id=sid, from_chunk=st.next_chunk, text=text))
        for session in [s for s in self.sessions.values() if s.recache is not None]:
            self._plan_recache(sched, session, events)
        self._control(sched, events)
        for sid in sched.streams:
            session = self.sessions.get(sid)
            if session is not None:
                sched.set_credit(sid, self._credit(session))
                if session.spec.input_latents:
                    sched.set_inputs(sid, session.inputs_received)
        if sched.active and self.batches_planned - self.batches_done < self.lookahead:
            batch = sched.tick()
            self._idle_ticks = 0 if batch else self._idle_ticks + 1
            for sid in before:
                session = self.sessions.get(sid)
                if session is not None:
                    session.started = sched.started_chunks.get(sid, 0)
                    session.max_lead = max(session.max_lead, session.started - session.delivered)
            if batch:
                self.batches_planned += 1
                self._chunks_started += sum(1 for st in batch if st.level == 0)
                for st in batch:  # a video-to-video chunk's input goes to the stages right before it starts
                    session = self.sessions.get(st.stream)
                    if st.level == 0 and session is not None and session.spec.input_latents:
                        latents = session.inputs.pop(st.chunk)
                        events.append(self._next_event("input", stream_id=st.stream, chunk=st.chunk, latents=latents))
                events.append(self._next_event("batch", steps=tuple(batch)))
                steps = [
                    sched.streams[st.stream].specs.at(st.chunk).steps if st.stream in sched.streams else 0
                    for st in batch
                ]
                self.telemetry.batch_planned(events[-1], batch, self.sessions, steps)
            else:
                self.telemetry.empty_tick()
        for sid in sorted(before - set(sched.streams)):
            events.append(self._next_event("close", stream_id=sid))
            started = sched.started_chunks.pop(sid, 0)
            session = self.sessions.get(sid)
            if session is not None:
                session.expected = started
                self._maybe_complete(session)
        return events

    def _plan_recache(self, sched: StreamBatchScheduler, session: StreamSession, events: list) -> None:
        """Plan a waiting recache once the stream has nothing in flight and every chunk it started is back: the
        prompt event carries the window chunks' clean latents, and the stream may start chunks again."""
        sid = session.id
        st = sched.streams.get(sid)
        if st is None:
            session.recache = None
            return
        started = sched.started_chunks.get(sid, 0)
        if sched.inflight(sid) or session.received < started:
            return
        spec = st.specs.at(started)
        rope = int((self.model_config() or {}).get("rope_max_seq_len") or WAN_ROPE_MAX_SEQ_LEN)
        chunks = sorted({c for c, _ in recache_steps(spec, started, rope)})
        window = tuple((c, wire.tensor_from_proto(session.finished[c])) for c in chunks)
        events.append(
            self._next_event(
                "prompt", stream_id=sid, from_chunk=started, text=session.recache, recache=True, window=window
            )
        )
        session.recache = None
        sched.hold(sid, False)

    def status(self) -> pb.ClusterStatus:
        with self.cond:
            reserved = self.kv_reserved()
            stages = [
                pb.StageDescription(
                    index=r.index,
                    address=r.address,
                    layer_start=r.layers.start,
                    layer_stop=r.layers.stop,
                    device=r.device,
                    formed=self.ready and not r.lost,
                    kv_budget_bytes=self.kv_budgets.get(r.index, 0),
                    kv_reserved_bytes=reserved.get(r.index, 0),
                )
                for r in self.registry.records()
            ]
            return pb.ClusterStatus(
                generation=self.generation,
                ready=self.ready,
                world_size=self.registry.world_size,
                cfg_parallel=self.registry.cfg_parallel,
                stages=stages,
                active_streams=len(self.sessions),
                stage_stats=[self.stage_stats[i] for i in sorted(self.stage_stats)],
                streams=[
                    pb.StreamProgress(
                        stream_id=s.id,
                        started=s.started,
                        received=s.received,
                        consumed=s.delivered,
                        bound=self.lead_bound(s),
                        max_lead=s.max_lead,
                        steps=s.steps,
                        chunk_rate=s.chunk_rate,
                    )
                    for s in sorted(self.sessions.values(), key=lambda s: s.id)
                ],
                capacity=[pb.Capacity(steps=n, streams=c, decoder=FULL) for n, c in self.capacity()],
                vae_chunk_ms=self.cost.chunk_ms,
                vae_source=self.cost.vae_source,
                calibrated_stages=sorted(self.calibrated),
                decoders=[
                    pb.DecoderCostStatus(
                        decoder=kind,
                        chunk_ms=cost.chunk_ms,
                        batch_ms=list(cost.batch_ms),
                        state_bytes=cost.state_bytes,
                        source=cost.source,
                        capacity=[pb.Capacity(steps=n, streams=c, decoder=kind) for n, c in self.capacity(kind)],
                    )
                    for kind, cost in self.cost.decoders.items()
                ],
            )
