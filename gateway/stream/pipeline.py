"""One gateway stream's calls to the coordinator: open the pipeline stream, read its chunks, stop, cancel,
acknowledge consumed chunks and update the prompt, each under a client span of the stream when traced.

Usage::

    call = PipelineCall(coordinator_stub, "coord:50050", trace)
    call.open(request)                      # the pipeline stream id; raises StreamFailed / grpc.RpcError
    for event in call.events(): ...         # chunk / ended events; marks the call ended when it returns
    call.stop(on_stopped)                   # StopStream once, without waiting; on_stopped(ok) when it answers
    call.cancel()                           # the coordinator plans nothing more and ends the stream
    call.acknowledge(chunks)                # the first ``chunks`` chunks are consumed (bounded lead)
    call.update_prompt(text)                # raises grpc.RpcError
    call.submit_input(chunk, latents)       # video-to-video: False when enough chunks already wait; else RpcError

Acknowledgements bound the stream's lead at the coordinator (``coordinator.pacing``), so the latest one is sent again
when it fails for a reason that may pass (``ACK_RETRIES``); they are cumulative, so a newer one supersedes it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import grpc

from gateway.stream.trace import StreamTrace
from stagecast import telemetry, wire
from stagecast.grpc_util import StatusError
from stagecast.internal.v1 import pipeline_pb2 as ipb

logger = logging.getLogger(__name__)

# How often the latest acknowledgement is sent again when it fails for a reason that may pass (the coordinator
# busy or briefly unreachable): the lead is bounded by what the coordinator has seen consumed, so a stream whose last
# acknowledgement is lost waits on it for good once nothing else is in flight.
ACK_RETRIES = 3
_RETRYABLE = (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)


class StreamFailed(StatusError):
    """Ends the client's call with ``code``."""


class PipelineCall:
    def __init__(self, coordinator, target: str, trace: StreamTrace):
        self.coordinator = coordinator
        self.target = target
        self.trace = trace
        self.pipeline_id = 0
        self._call = None
        self._open_span = None
        self._lock = threading.Lock()
        self._ended = False  # the coordinator ended the stream (or the call broke): nothing left to stop or cancel
        self._stop_sent = False
        self._cancelled = False
        self._ack_future = None  # the latest acknowledgement in flight (they are cumulative)

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def open(self, request: ipb.OpenStreamRequest) -> int:
        try:
            return self._open(request)
        except BaseException as exc:
            code = exc.code if isinstance(exc, StatusError) else exc.code() if isinstance(exc, grpc.RpcError) else None
            telemetry.end_rpc_span(self._open_span, code or grpc.StatusCode.UNKNOWN)
            self.trace.failed_to_open(f"opening the pipeline stream failed: {exc}")
            raise

    def _open(self, request: ipb.OpenStreamRequest) -> int:
        # The coordinator's stream span is this call's child; the context also rides in the request.
        self._open_span = self.trace.client_span("OpenStream", self.target)
        if self._open_span is not None:
            request.traceparent = telemetry.traceparent_of(self._open_span)
        self._call = self.coordinator.OpenStream(request, metadata=telemetry.metadata_for(self._open_span) or None)
        try:
            first = next(self._call)
        except StopIteration:
            raise StreamFailed(grpc.StatusCode.UNAVAILABLE, "pipeline: the coordinator closed the stream") from None
        if first.WhichOneof("event") != "started":
            self._call.cancel()
            raise StreamFailed(grpc.StatusCode.INTERNAL, f"pipeline: expected started, got {first}")
        self.pipeline_id = first.started.stream_id
        self.trace.set_pipeline_id(self.pipeline_id)
        if self._open_span is not None:
            self._open_span.set_attribute("stagecast.stream.id", self.pipeline_id)
        return self.pipeline_id

    def events(self):
        """The pipeline stream's events after ``started``; raises ``grpc.RpcError`` if the call breaks."""
        try:
            for event in self._call:
                if event.WhichOneof("event") == "ended":
                    with self._lock:
                        self._ended = True
                yield event
            telemetry.end_rpc_span(self._open_span, grpc.StatusCode.OK)
        except grpc.RpcError as exc:
            telemetry.end_rpc_span(self._open_span, exc.code(), exc.details() or "")
            raise
        finally:
            with self._lock:
                self._ended = True

    def stop(self, on_answer: Callable[[bool], None]) -> None:
        """StopStream (no new chunks) once, without waiting; ``on_answer(ok)`` runs when the coordinator answers
        (ok False: the stop failed and the call was cancelled instead)."""
        with self._lock:
            if self._stop_sent or self._ended or self._call is None:
                return
            self._stop_sent = True
        span = self.trace.client_span("StopStream", self.target)
        future = self.coordinator.StopStream.future(
            ipb.StopRequest(stream_id=self.pipeline_id), timeout=10, metadata=telemetry.metadata_for(span)
        )
        future.add_done_callback(lambda f: self._stopped(f, span, on_answer))  # no thread waits on it

    def _stopped(self, future, span, on_answer) -> None:
        exc = future.exception()
        if span is not None:
            code = exc.code() if isinstance(exc, grpc.RpcError) else grpc.StatusCode.OK
            telemetry.end_rpc_span(span, code, exc.details() if isinstance(exc, grpc.RpcError) else "")
        if isinstance(exc, grpc.RpcError) and exc.code() != grpc.StatusCode.NOT_FOUND:  # NOT_FOUND: it ended
            logger.warning("pipeline stream %d: StopStream failed (%s); cancelling", self.pipeline_id, exc.code().name)
            self.cancel()
            on_answer(False)
            return
        on_answer(True)

    def cancel(self) -> None:
        """Cancel the pipeline call: the coordinator plans nothing more for the stream and ends it."""
        with self._lock:
            if self._ended or self._call is None or self._cancelled:
                return
            self._cancelled = True
        logger.debug("pipeline stream %d: cancelling the call", self.pipeline_id)
        self._call.cancel()

    def acknowledge(self, chunks: int, attempt: int = 0) -> None:
        """The first ``chunks`` chunks are consumed; not waiting for the answer, the stream may start more.  The
        latest acknowledgement that fails for a passing reason (``_RETRYABLE``) is sent again, up to ``ACK_RETRIES``
        times, waiting for the channel to be ready; a newer one supersedes it (they are cumulative)."""
        req = ipb.ChunksConsumed(stream_id=self.pipeline_id, chunks=chunks)
        future = self.coordinator.Consumed.future(req, timeout=10, wait_for_ready=attempt > 0)
        with self._lock:
            self._ack_future = future
        future.add_done_callback(lambda f: self._acknowledged(f, chunks, attempt))

    def _acknowledged(self, future, chunks: int, attempt: int) -> None:
        exc = future.exception()
        if exc is None or exc.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.CANCELLED):
            return
        with self._lock:
            latest = future is self._ack_future and not (self._ended or self._cancelled)
        if latest and exc.code() in _RETRYABLE and attempt < ACK_RETRIES:
            logger.info(
                "pipeline stream %d: acknowledging %d chunks failed (%s); sending it again",
                self.pipeline_id,
                chunks,
                exc.code().name,
            )
            self.acknowledge(chunks, attempt + 1)
            return
        logger.warning("pipeline stream %d: acknowledging chunks failed (%s)", self.pipeline_id, exc.code().name)

    def submit_input(self, chunk: int, latents) -> bool:
        """A video-to-video chunk's noised input latents.  True: taken; False: the coordinator holds enough of this
        stream's chunks already (RESOURCE_EXHAUSTED); other answers raise ``grpc.RpcError``."""
        req = ipb.InputLatents(stream_id=self.pipeline_id, chunk=chunk, latents=wire.tensor_to_proto(latents))
        try:
            self.coordinator.SubmitInput(req, timeout=30)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                return False
            raise
        return True

    def update_prompt(self, text, recache: bool = False) -> None:
        """PromptUpdate for the stream's next chunk (``recache``: rebuilding the KV window under it first); raises
        ``grpc.RpcError`` as the coordinator answers."""
        req = ipb.PromptUpdate(stream_id=self.pipeline_id, text=wire.tensor_to_proto(text), recache=recache)
        span = self.trace.client_span("UpdatePrompt", self.target)
        if span is None:
            self.coordinator.UpdatePrompt(req, timeout=30)
            return
        try:
            self.coordinator.UpdatePrompt(req, timeout=30, metadata=telemetry.metadata_for(span))
        except grpc.RpcError as exc:
            telemetry.end_rpc_span(span, exc.code(), exc.details() or "")
            raise
        telemetry.end_rpc_span(span, grpc.StatusCode.OK)
