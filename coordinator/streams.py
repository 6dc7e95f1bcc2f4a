"""The coordinator's stream table: the open streams by id, and their open, stop, cancel and end bookkeeping.

``StreamTable`` is one of the parts ``coordinator.engine.PipelineEngine`` holds; every method runs under the engine's
lock (``cond``), which the engine takes, and the engine wakes the plan loop after a change that makes work.  The
``pending_*`` queues are what the plan loop (``coordinator.plan``) takes at its next tick: opens, stops, cancels and
prompt changes.  A stream's session is the one record of it that every part reads: the pacing (``coordinator.pacing``),
admission's KV reservation (``coordinator.admission``) and the SLO glue (``coordinator.slo_control``).
"""

from __future__ import annotations

import itertools
import queue
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

import grpc
import torch

from coordinator.errors import AdmissionError, StreamError, StreamFailure
from coordinator.metrics import CoordinatorTelemetry
from coordinator.slo import FULL
from stagecast.internal.v1 import pipeline_pb2 as pb
from stagecast.microstep import StreamSpec, context_frames
from stagecast.sampling import MAX_STEPS

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


def ladders_by_steps(spec: StreamSpec, ladders: list[tuple[float, ...]] | None) -> dict[int, tuple[float, ...]]:
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


class StreamTable:
    """The open streams (``sessions``) and the changes the plan loop has yet to plan; guarded by the engine's lock."""

    def __init__(self, telemetry: CoordinatorTelemetry):
        self.telemetry = telemetry
        self.sessions: dict[int, StreamSession] = {}
        self.pending_opens: deque[StreamSession] = deque()
        self.pending_stops: set[int] = set()
        self.pending_cancels: set[int] = set()
        self.pending_prompts: deque[tuple[int, torch.Tensor, bool]] = deque()
        self._ids = itertools.count(1)

    def has_pending(self) -> bool:
        """Opens, stops, cancels or prompt changes the plan loop has yet to take."""
        return bool(self.pending_opens or self.pending_stops or self.pending_cancels or self.pending_prompts)

    def get(self, stream_id: int) -> StreamSession:
        session = self.sessions.get(stream_id)
        if session is None:
            raise StreamError(grpc.StatusCode.NOT_FOUND, f"unknown stream {stream_id}")
        return session

    def open(self, spec: StreamSpec, text: torch.Tensor, **fields) -> StreamSession:
        """An admitted stream: its id (the spec's, else the next free one), its session, and its open for the plan."""
        sid = spec.stream_id or next(self._ids)
        if sid in self.sessions:
            raise AdmissionError(grpc.StatusCode.ALREADY_EXISTS, f"stream {sid} is already active")
        spec = replace(spec, stream_id=sid)
        session = StreamSession(sid, spec, text, steps=spec.steps, **fields)
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
        self.sessions.pop(session.id, None)

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

    def progress(self, lead_bound: Callable[[StreamSession], int]) -> list[pb.StreamProgress]:
        """Each open stream's progress for GetStatus, with its lead bound (``Pacing.lead_bound``)."""
        return [
            pb.StreamProgress(
                stream_id=s.id,
                started=s.started,
                received=s.received,
                consumed=s.delivered,
                bound=lead_bound(s),
                max_lead=s.max_lead,
                steps=s.steps,
                chunk_rate=s.chunk_rate,
            )
            for s in sorted(self.sessions.values(), key=lambda s: s.id)
        ]
