"""A gateway stream's two sides of the client's call: ``Outbox`` (what goes out) and ``ClientRequests`` (what comes in).

Usage (``gateway.stream.run.StreamRun`` holds one of each; ``gateway.stream.run`` describes the buffering policy)::

    outbox = Outbox(limits, timers, ended=..., fail=..., release_call=...)
    outbox.send(msg)                      # from the decoder thread; False once the stream ended or the client is gone
    for msg in outbox.messages(started): yield msg   # the handler; raises StreamFailed
    outbox.arm(limits.slow_client_timeout)    # the slow-client watchdog, on the gateway's timer thread
    outbox.call_done()                    # gRPC's callback: no more watching

    requests = ClientRequests(run_id, cfg, input=..., pipeline=..., ...)
    requests.read(request_iterator)       # a thread of its own: prompt updates, stop, input frames
    requests.feed_input()                 # video-to-video: a thread of its own; then requests.input_end
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from gateway.edge.config import ConfigError, RequestTooLarge, check_prompt, check_transition
from gateway.stream.channel import CLOSED, BoundedChannel
from gateway.stream.pipeline import StreamFailed
from stagecast.v1 import stream_pb2 as pb

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StreamLimits:
    """A stream's bounds, the same for every stream of a gateway (``gateway.stream.run.StreamHost.limits``)."""

    buffer_chunks: int  # latent chunks queued between the pipeline and the VAE
    buffer_messages: int  # encoded messages queued between the encoder and the client
    slow_client_timeout: float  # how long a message may wait for the client to take it before the stream ends
    drain_timeout: float  # how long a stopped pipeline stream may take to finish its cooldown
    abandon_timeout: float  # how long a failed stream's client may take to read its error before cancelling
    buffer_bytes: int = 8 << 20  # bytes of encoded messages queued between the encoder and the client


class Outbox:
    """The stream's messages to its client: the bounded buffer (messages and bytes), the handler's generator over it,
    and the slow-client rule (a message the client takes too long to accept ends the stream)."""

    def __init__(
        self,
        limits: StreamLimits,
        timers,
        *,
        ended: Callable[[], bool],
        fail: Callable[[grpc.StatusCode, str, str], None],
        release_call: Callable[[], None],
    ):
        self.limits = limits
        self.timers = timers  # gateway.stream.timers.Timers
        self._ended = ended  # whether the stream has an outcome
        self._fail = fail  # ends the stream with a status (StreamRun.fail)
        self._release_call = release_call  # cancels the call after the abandon timeout
        self.out = BoundedChannel(limits.buffer_messages, max_bytes=limits.buffer_bytes)
        self.frames_sent = 0  # frames handed to gRPC
        self.end_sent = False  # the End message was handed to gRPC: the stream ended normally
        self._sending_since: float | None = None  # when the handler gave gRPC the message it is sending
        self._send_watch = None  # the watchdog's timer entry (``_watch_send``)
        self._lock = threading.Lock()
        self._rpc_done = False  # the call is over (gRPC's callback ran)

    def messages(self, started: pb.ServerMessage):
        """What the handler yields to the client, in order; raises ``StreamFailed`` to end the call with a status.

        gRPC's sync server sends what we yield and asks for the next message only once the send completed, so the
        time between a yield and the next ``next()`` is the time the client took to make room for that message
        (``_sending_since``, which the send watchdog reads)."""
        yield from self._sending(started)
        while True:
            item = self.out.get()
            if item is CLOSED:
                return  # the call ended underneath us (client cancel): nothing more to send
            if isinstance(item, StreamFailed):
                raise item
            if item.WhichOneof("msg") == "frame":
                self.frames_sent += 1
            yield from self._sending(item)
            if item.WhichOneof("msg") == "end":
                self.end_sent = True
                return

    def _sending(self, msg):
        self._sending_since = time.monotonic()
        yield msg
        self._sending_since = None

    def send(self, msg: pb.ServerMessage) -> bool:
        """Queue a message for the client; a client that leaves the queue full too long ends the stream."""
        timeout = self.limits.slow_client_timeout
        try:
            return self.out.put(msg, timeout=timeout, size=msg.ByteSize())
        except TimeoutError:
            self.too_slow(f"{len(self.out)} messages, {self.out.bytes} bytes waited {timeout:g} s for room")
            return False

    # ---- the slow-client rule ------------------------------------------------------------------------

    def arm(self, seconds: float) -> None:
        entry = self.timers.call_later(max(0.0, seconds), self._watch_send)
        with self._lock:
            if self._rpc_done:
                stale = entry  # the call is over: no more watching
            else:
                stale, self._send_watch = self._send_watch, entry
        self.timers.cancel(stale)

    def call_done(self) -> None:
        """The call is over: the watchdog stops."""
        with self._lock:
            self._rpc_done = True
            watch, self._send_watch = self._send_watch, None
        self.timers.cancel(watch)

    def _watch_send(self) -> None:
        """On the timer thread: a message gRPC has been sending for ``slow_client_timeout`` ends the stream."""
        limit = self.limits.slow_client_timeout
        since = self._sending_since
        now = time.monotonic()
        if since is not None and now - since >= limit:
            if not self._ended():
                self.too_slow(f"a message waited {now - since:.1f} s for the client to take it")
            else:  # the stream had ended (its End or error is queued behind the stuck message): release the call
                self._release_call()
            return
        if self._rpc_done:
            return
        self.arm(limit if since is None else since + limit - now)

    def too_slow(self, what: str) -> None:
        limit = self.limits.slow_client_timeout
        self._fail(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"client too slow: it fell more than {limit:g} s behind ({what}, --slow-client-timeout; the gateway "
            f"holds at most {self.out.capacity} messages or {self.limits.buffer_bytes / 2**20:g} MiB per stream "
            "besides what the client's flow-control window holds, --buffer-messages, --buffer-mib); "
            "the stream was ended",
            "client_too_slow",
        )


class ClientRequests:
    """The client's later messages, read on a thread of their own: prompt updates, stop, video-to-video input frames
    (anything else ends the stream with INVALID_ARGUMENT); and a video-to-video stream's input thread, which stops the
    pipeline stream once the input ends (``input_end`` says why)."""

    def __init__(
        self,
        stream_id: str,
        cfg,
        *,
        input,
        pipeline,
        trace,
        encode_prompt: Callable,
        send: Callable[[pb.ServerMessage], bool],
        stop_pipeline: Callable[[], None],
        fail: Callable[[grpc.StatusCode, str, str], None],
    ):
        self.id = stream_id
        self.cfg = cfg  # gateway.edge.config.EffectiveConfig
        self.input = input  # gateway.stream.video_input.InputPath, or None
        self.pipeline = pipeline  # gateway.stream.pipeline.PipelineCall
        self.trace = trace  # gateway.stream.trace.StreamTrace: a prompt's encoding is traced under the stream
        self.encode_prompt = encode_prompt
        self.send = send
        self.stop_pipeline = stop_pipeline
        self.fail = fail
        self.input_end: str | None = None  # why the input ended ("stopped", "input_stalled"), once it did
        self.closed = threading.Event()  # the client's side is over: it half-closed, the call ended, or we stopped

    def read(self, request_iterator) -> None:
        """Reads the client's later messages; ``request_iterator`` parses them (``ConfigError`` for bytes that are
        not a ClientMessage)."""
        try:
            for msg in request_iterator:
                kind = msg.WhichOneof("msg")
                if kind == "prompt":
                    if not self._update_prompt(msg.prompt.prompt, msg.prompt.transition):
                        return
                elif kind == "stop":
                    logger.info("stream %s: client asked to stop", self.id)
                    if self.input is not None:
                        self.input.end()  # the input thread stops the pipeline after the input already here
                    else:
                        self.stop_pipeline()
                elif kind == "frame":
                    if self.input is None:
                        self.fail(
                            grpc.StatusCode.INVALID_ARGUMENT,
                            "frame: this stream takes no input frames (set strength in its config for video-to-video)",
                            "invalid_argument",
                        )
                        return
                    if not self.input.offer(msg.frame):
                        return  # the stream ended
                elif kind == "config":
                    self.fail(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        "config: sent twice; a stream takes exactly one config, as its first message",
                        "invalid_argument",
                    )
                    return
                else:
                    self.fail(grpc.StatusCode.INVALID_ARGUMENT, "msg: empty ClientMessage", "invalid_argument")
                    return
            if self.input is not None:
                self.input.end()  # the client closed its side: its input is over
        except RequestTooLarge as exc:
            self.fail(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc), "invalid_argument")
        except ConfigError as exc:
            self.fail(grpc.StatusCode.INVALID_ARGUMENT, str(exc), "invalid_argument")
        except Exception as exc:  # the call ended while we were waiting for the next message
            logger.debug("stream %s: request stream ended: %s", self.id, exc)
        finally:
            self.closed.set()

    def feed_input(self) -> None:
        """Video-to-video: encode, noise and submit the input until it ends, then stop the pipeline stream (the chunks
        already submitted finish and are delivered)."""
        try:
            reason = self.input.run()
        except grpc.RpcError as exc:
            self.fail(exc.code(), f"pipeline: submitting input failed: {exc.details()}", "pipeline_error")
            return
        except Exception as exc:
            logger.exception("stream %s: input encoding failed", self.id)
            self.fail(grpc.StatusCode.INTERNAL, f"gateway: encoding the input failed: {exc}", "error")
            return
        if reason is None:
            return  # aborted: the stream ended otherwise
        logger.info("stream %s: input ended (%s) after %d frames", self.id, reason, self.input.received)
        self.input_end = reason
        self.stop_pipeline()

    def _update_prompt(self, prompt: str, transition: int = 0) -> bool:
        try:
            recache = check_transition(transition, self.cfg)
            # The config's limits, before tokenising.
            text = self.encode_prompt(check_prompt(prompt), parent_span=self.trace.span)
        except ConfigError as exc:
            self.fail(grpc.StatusCode.INVALID_ARGUMENT, f"prompt update: {exc}", "invalid_argument")
            return False
        try:
            self.pipeline.update_prompt(text, recache=recache)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                return True  # the pipeline stream already finished its last chunk: nothing left to change
            self.fail(exc.code(), f"pipeline: prompt update failed: {exc.details()}", "pipeline_error")
            return False
        logger.info("stream %s: prompt updated", self.id)
        return self.send(pb.ServerMessage(prompt_updated=pb.PromptUpdated(prompt=prompt)))
