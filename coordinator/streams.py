"""The coordinator's stream table: the open streams by id, and their open, stop, cancel and end bookkeeping.

Usage (``coordinator.engine.PipelineEngine`` holds one; every method runs under the engine's lock, ``cond``)::

    table = StreamTable(telemetry, on_end=lambda stream_id: ...)
    session = table.open(request, reservation, generation=g)   # an admitted OpenRequest: its id, session, open planned
    table.admitted()                                           # the open streams as admission counts them
    changes = table.take_changes()                             # the plan loop's tick: opens, stops, cancels, prompts

A ``StreamSession`` is a stream's record here, and only this module assigns its fields: the plan loop reports what it
planned through the table's methods (``progressed``, ``planned_all``, ``take_input``, ``hold_recache``, ...).  Pacing
(``coordinator.pacing``) and the SLO controller's view (``coordinator.slo_control``) keep their own state of a stream,
keyed by its id; ``on_end`` tells them when a stream has gone, however it ended.
"""

from __future__ import annotations

import itertools
import queue
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

import grpc
import torch

from coordinator.admission import RETRY_AFTER_S, Admitted, Reservation
from coordinator.errors import AdmissionError, StreamError, StreamFailure
from coordinator.metrics import CoordinatorTelemetry
from coordinator.requests import OpenRequest
from stagecast.grpc_util import MAX_RETRY_AFTER_S
from stagecast.internal.v1 import pipeline_pb2 as pb
from stagecast.microstep import StreamSpec, context_frames

_END = object()

# A video-to-video stream's input chunks that may wait at the coordinator for the pipeline to start them; the
# consumer learns it is ahead from SubmitInput's RESOURCE_EXHAUSTED and either drops the chunk or waits.
MAX_PENDING_INPUTS = 2


@dataclass(eq=False)
class StreamSession:
    """An open stream: its request (``OpenRequest``), its spec with its id, its events and its progress."""

    id: int
    spec: StreamSpec  # the request's, with the stream's id
    request: OpenRequest
    reservation: Reservation  # what admission priced it at: its KV per stage, its demand on the SLO controller
    generation: int = 0
    events: queue.Queue = field(default_factory=queue.Queue)
    received: int = 0
    # Chunks the consumer has consumed: acknowledged by it (``acknowledges``), else yielded by its gRPC stream.
    delivered: int = 0
    started: int = 0  # chunks started by the scheduler
    max_lead: int = 0  # the largest started - delivered seen
    expected: int | None = None  # known once the scheduler has finished the stream
    stopped: bool = False
    cancelled: bool = False
    ended: bool = False
    inputs: dict[int, torch.Tensor] = field(default_factory=dict)  # video-to-video: input chunks not yet planned
    recache: torch.Tensor | None = None  # a recache prompt's text, waiting for the chunks in flight
    finished: dict[int, pb.Tensor] = field(default_factory=dict)  # the clean latents a recache would need
    inputs_received: int = 0

    # What the request said, read as the session's own.
    text = property(lambda self: self.request.text)
    negative_text = property(lambda self: self.request.negative_text)
    image = property(lambda self: self.request.image)
    traceparent = property(lambda self: self.request.traceparent)
    acknowledges = property(lambda self: self.request.acknowledges)
    consumer_depth = property(lambda self: self.request.consumer_depth)
    chunk_rate = property(lambda self: self.request.chunk_rate)
    pace_offset_s = property(lambda self: self.request.pace_offset_s)
    ladders = property(lambda self: self.request.by_steps)  # steps -> ladder (SLO controller)
    latency_first = property(lambda self: self.request.latency_first)
    decoder = property(lambda self: self.request.decoder)
    best_effort = property(lambda self: self.request.best_effort)
    kv = property(lambda self: self.reservation.kv)  # worst-case KV bytes reserved on each stage while it is open

    def iter_events(self) -> Iterator[pb.StreamEvent | StreamFailure]:
        while True:
            ev = self.events.get()
            if ev is _END:
                return
            yield ev
            if isinstance(ev, StreamFailure):
                return


@dataclass
class StreamChanges:
    """What the plan loop takes at its next tick (``StreamTable.take_changes``): opens in order, stops and cancels by
    id (ascending), prompt changes in order (stream id, text, recache)."""

    opens: list[StreamSession] = field(default_factory=list)
    stops: list[int] = field(default_factory=list)
    cancels: list[int] = field(default_factory=list)
    prompts: list[tuple[int, torch.Tensor, bool]] = field(default_factory=list)


class StreamTable:
    """The open streams (``sessions``) and the changes the plan loop has yet to plan; guarded by the engine's lock."""

    def __init__(self, telemetry: CoordinatorTelemetry, on_end: Callable[[int], None] = lambda stream_id: None):
        self.telemetry = telemetry
        self.on_end = on_end  # a stream has gone: the parts that keep state of it forget it
        self.sessions: dict[int, StreamSession] = {}
        self.pending_opens: deque[StreamSession] = deque()
        self.pending_stops: set[int] = set()
        self.pending_cancels: set[int] = set()
        self.pending_prompts: deque[tuple[int, torch.Tensor, bool]] = deque()
        self._ids = itertools.count(1)
        # Admitted streams not opened yet (Reserve, before the gateway encodes the prompt): hold id -> (what
        # admission priced, when the hold lapses).  They count as admitted until claimed (``take_hold``) or lapsed.
        self._holds: dict[str, tuple[Reservation, float]] = {}

    def has_pending(self) -> bool:
        """Opens, stops, cancels or prompt changes the plan loop has yet to take."""
        return bool(self.pending_opens or self.pending_stops or self.pending_cancels or self.pending_prompts)

    def pending_count(self) -> int:
        """Opens, stops and prompt changes not yet planned (the pending-events gauge)."""
        return len(self.pending_opens) + len(self.pending_stops) + len(self.pending_prompts)

    def take_changes(self) -> StreamChanges:
        """The opens, stops, cancels and prompt changes since the last call, for the plan loop; the table forgets
        them."""
        changes = StreamChanges(
            opens=list(self.pending_opens),
            stops=sorted(self.pending_stops),
            cancels=sorted(self.pending_cancels),
            prompts=list(self.pending_prompts),
        )
        self.pending_opens.clear()
        self.pending_stops.clear()
        self.pending_cancels.clear()
        self.pending_prompts.clear()
        return changes

    def __len__(self) -> int:
        return len(self.sessions)

    def find(self, stream_id: int) -> StreamSession | None:
        """The open stream's session (None: no such stream, or it ended)."""
        return self.sessions.get(stream_id)

    def by_id(self) -> dict[int, StreamSession]:
        """The open streams' sessions by id (a copy)."""
        return dict(self.sessions)

    def recaching(self) -> list[StreamSession]:
        """The streams whose recache waits for their chunks in flight."""
        return [s for s in self.sessions.values() if s.recache is not None]

    def admitted(self, now: float | None = None) -> Admitted:
        """The open streams as admission counts them: how many, their KV reserved on each stage, their demands (by
        id), and when capacity or memory is likely back (``retry_after``); with ``now``, the holds not lapsed too."""
        kv: dict[int, int] = {}
        for session in self.sessions.values():
            for index, nbytes in session.kv.items():
                kv[index] = kv.get(index, 0) + nbytes
        # A stream whose viewer has no frame yet is still starting: admission prices its start.
        demands = tuple(
            replace(s.reservation.demand, starting=s.delivered == 0)
            for s in sorted(self.sessions.values(), key=lambda s: s.id)
        )
        admitted = Admitted(len(self.sessions), kv, demands, self.retry_after())
        if now is not None:
            self._lapse(now)
            for reservation, _ in self._holds.values():
                admitted = admitted.plus(reservation)  # a held place is priced as an open stream's
        return admitted

    def hold(self, reservation: Reservation, now: float, hold_s: float) -> str:
        """Hold an admitted stream's place until ``now + hold_s`` (Reserve); returns the hold's id."""
        self._lapse(now)
        hold = uuid.uuid4().hex
        self._holds[hold] = (reservation, now + hold_s)
        return hold

    def take_hold(self, hold: str, now: float) -> Reservation | None:
        """The held place, claimed (the stream opens on it); None when it lapsed or was never given."""
        self._lapse(now)
        held = self._holds.pop(hold, None)
        return None if held is None else held[0]

    def holds(self, now: float) -> int:
        """Places held and not yet claimed."""
        self._lapse(now)
        return len(self._holds)

    def _lapse(self, now: float) -> None:
        for hold in [h for h, (_, until) in self._holds.items() if until <= now]:
            del self._holds[hold]

    def retry_after(self) -> float:
        """When capacity or memory is likely back: the soonest end of a bounded paced stream (its remaining chunks
        at its pace), else ``RETRY_AFTER_S``; never more than ``MAX_RETRY_AFTER_S`` (60 s, the ceiling of the hint
        on the wire too): past a minute a viewer is better told to look again than to wait out an hour's stream."""
        ends = [
            (s.spec.num_chunks - s.delivered) / s.chunk_rate
            for s in self.sessions.values()
            if s.spec.num_chunks is not None and s.chunk_rate > 0
        ]
        return min(max(0.1, min(ends)), MAX_RETRY_AFTER_S) if ends else RETRY_AFTER_S

    def get(self, stream_id: int) -> StreamSession:
        session = self.sessions.get(stream_id)
        if session is None:
            raise StreamError(grpc.StatusCode.NOT_FOUND, f"unknown stream {stream_id}")
        return session

    def open(self, request: OpenRequest, reservation: Reservation, *, generation: int) -> StreamSession:
        """An admitted stream: its id (the spec's, else the next free one), its session holding ``reservation``, and
        its open for the plan."""
        sid = request.spec.stream_id or next(self._ids)
        if sid in self.sessions:
            raise AdmissionError(grpc.StatusCode.ALREADY_EXISTS, f"stream {sid} is already active")
        spec = replace(request.spec, stream_id=sid)
        held = replace(reservation, demand=replace(reservation.demand, stream_id=sid))
        session = StreamSession(sid, spec, request, held, generation)
        self.sessions[sid] = session
        self.pending_opens.append(session)
        self.telemetry.stream_opened()
        return session

    def stop(self, stream_id: int) -> None:
        session = self.get(stream_id)
        session.stopped = True
        self.pending_stops.add(stream_id)

    def cancel(self, stream_id: int) -> None:
        """End a stream now (its consumer left): nothing more is planned for it, the batches already planned
        finish on the stages with their results dropped, and its close frees its state on every stage."""
        session = self.get(stream_id)
        session.cancelled = True
        self.end(session, pb.StreamEvent(ended=pb.StreamEnded(reason="cancelled")))
        if any(pending is session for pending in self.pending_opens):
            # Never planned: nothing to close on the stages.
            self.pending_opens = deque(p for p in self.pending_opens if p is not session)
        else:
            self.pending_cancels.add(stream_id)

    def update_prompt(self, stream_id: int, text: torch.Tensor, recache: bool = False) -> None:
        """A new prompt from the stream's next chunk not yet started.  ``recache``: the stream starts no new chunk
        until the ones in flight have finished and come back, then the plan rebuilds its KV window under the new
        prompt from their clean latents (``stagecast.microstep.recache_steps``) before the next chunk."""
        session = self.get(stream_id)
        if tuple(text.shape) != tuple(session.text.shape):
            raise StreamError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"text has shape {tuple(text.shape)}, expected {tuple(session.text.shape)}",
            )
        if recache and session.spec.window is None:
            raise StreamError(
                grpc.StatusCode.INVALID_ARGUMENT,
                "transition: recache rebuilds the KV window; this stream's window is unbounded (set window)",
            )
        if recache and session.spec.cfg:
            raise StreamError(
                grpc.StatusCode.INVALID_ARGUMENT, "transition: a recache of a guided stream is not supported yet"
            )
        if recache and session.recache is not None:
            raise StreamError(
                grpc.StatusCode.FAILED_PRECONDITION, "transition: a recache of this stream is already waiting"
            )
        self.pending_prompts.append((stream_id, text, recache))

    def submit_input(self, stream_id: int, chunk: int, latents: torch.Tensor) -> None:
        """A video-to-video stream's input latents for its next chunk (chunks in order from 0).  At most
        ``MAX_PENDING_INPUTS`` wait for the pipeline: beyond that RESOURCE_EXHAUSTED, and the consumer drops the
        chunk or waits for one to start."""
        session = self.get(stream_id)
        spec = session.spec
        if not spec.input_latents:
            raise StreamError(
                grpc.StatusCode.FAILED_PRECONDITION, f"stream {stream_id} was not opened with input_latents"
            )
        if session.stopped or session.cancelled:
            raise StreamError(grpc.StatusCode.FAILED_PRECONDITION, f"stream {stream_id} is stopping")
        if chunk != session.inputs_received:
            raise StreamError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"chunk: input for chunk {chunk}, expected chunk {session.inputs_received} (inputs come in order)",
            )
        if spec.num_chunks is not None and chunk >= spec.num_chunks:
            raise StreamError(
                grpc.StatusCode.OUT_OF_RANGE,
                f"chunk: the stream has {spec.num_chunks} chunks, got input for {chunk}",
            )
        if tuple(latents.shape) != spec.latent_shape or latents.dtype != torch.float32:
            raise StreamError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"latents: must be float32 {spec.latent_shape}, got {latents.dtype} {tuple(latents.shape)}",
            )
        if not bool(torch.isfinite(latents).all()):
            raise StreamError(grpc.StatusCode.INVALID_ARGUMENT, "latents: must be finite")
        if session.inputs_received - session.started >= MAX_PENDING_INPUTS:
            raise StreamError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"input: {MAX_PENDING_INPUTS} chunks already wait for the pipeline to start them",
            )
        session.inputs[chunk] = latents
        session.inputs_received += 1

    def end(self, session: StreamSession, final) -> None:
        if session.ended:
            return
        session.ended = True
        session.inputs.clear()
        self.telemetry.stream_ended(final.ended.reason if isinstance(final, pb.StreamEvent) else final.code.name)
        session.events.put(final)
        session.events.put(_END)
        if self.sessions.pop(session.id, None) is not None:
            self.on_end(session.id)

    def end_all(self, failure: StreamFailure) -> None:
        for session in list(self.sessions.values()):
            self.end(session, failure)
        self.pending_opens.clear()
        self.pending_stops.clear()
        self.pending_cancels.clear()
        self.pending_prompts.clear()

    def maybe_complete(self, session: StreamSession) -> None:
        if session.expected is not None and session.received >= session.expected:
            reason = "stopped" if session.stopped else "completed"
            self.end(session, pb.StreamEvent(ended=pb.StreamEnded(reason=reason)))

    def on_chunk(self, chunk: pb.ChunkResult) -> StreamSession | None:
        """Route a stage's result of the current generation to its stream (None: the stream is gone)."""
        session = self.sessions.get(chunk.stream_id)
        if session is None:
            self.telemetry.chunk(routed=False)
            return None
        session.received += 1
        self.telemetry.chunk(routed=True, steps=chunk.steps)
        if session.spec.window is not None:  # what a recache would rebuild the KV window from (bounded)
            session.finished[chunk.chunk] = chunk.latents
            keep = {f // session.spec.chunk_frames for f in context_frames(session.spec, chunk.chunk + 1, 1 << 30)}
            for c in [c for c in session.finished if c not in keep]:
                del session.finished[c]
        session.events.put(pb.StreamEvent(chunk=chunk))
        self.maybe_complete(session)
        return session

    def consumed(self, stream_id: int, chunks: int) -> StreamSession | None:
        """The consumer acknowledged the first ``chunks`` chunks as consumed; the session when its count rose."""
        session = self.get(stream_id)
        if not session.acknowledges:
            raise StreamError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"stream {stream_id} was opened without acknowledges; its chunks count as delivered when sent",
            )
        if not 0 <= chunks <= session.received:
            raise StreamError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"chunks={chunks} must be in [0, {session.received}] (the chunks the stream has received)",
            )
        if chunks <= session.delivered:
            return None
        session.delivered = chunks
        return session

    # ---- what the plan loop and the engine report (the only writers of a session's fields) ----------------

    def hold_recache(self, session: StreamSession, text: torch.Tensor) -> None:
        """A recache prompt waits for the stream's chunks in flight (``coordinator.plan``)."""
        session.recache = text

    def recache_planned(self, session: StreamSession) -> None:
        """The waiting recache was planned (or its stream left the scheduler)."""
        session.recache = None

    def progressed(self, session: StreamSession, started: int) -> None:
        """The scheduler has started ``started`` chunks of the stream."""
        session.started = started
        session.max_lead = max(session.max_lead, started - session.delivered)

    def take_input(self, session: StreamSession, chunk: int) -> torch.Tensor:
        """A video-to-video chunk's input latents, planned right before the chunk starts."""
        return session.inputs.pop(chunk)

    def planned_all(self, session: StreamSession, started: int) -> None:
        """The scheduler is done with the stream after ``started`` chunks: it ends once they are all back."""
        session.expected = started
        self.maybe_complete(session)

    def delivered_one(self, session: StreamSession) -> bool:
        """A consumer that does not acknowledge took one more chunk (delivery pacing); False for one that does."""
        if session.acknowledges:
            return False
        session.delivered += 1
        return True

    def progress(
        self, lead_bound: Callable[[StreamSession], int], steps: Callable[[int], int]
    ) -> list[pb.StreamProgress]:
        """Each open stream's progress for GetStatus, with its lead bound (``Pacing.lead_bound``) and the steps its
        next chunk runs (``SloControl.steps``)."""
        return [
            pb.StreamProgress(
                stream_id=s.id,
                started=s.started,
                received=s.received,
                consumed=s.delivered,
                bound=lead_bound(s),
                max_lead=s.max_lead,
                steps=steps(s.id),
                chunk_rate=s.chunk_rate,
            )
            for s in sorted(self.sessions.values(), key=lambda s: s.id)
        ]
