"""One client stream inside the gateway: pipeline chunks -> StreamVAE -> frame encoder -> the client's gRPC call.

Usage (the servicer in ``gateway.edge.handlers`` does this per ``Generate`` call)::

    run = StreamRun(gateway.stream_host, cfg, text, context, t0)   # StreamHost: what a stream needs
    run.open_pipeline()                  # coordinator OpenStream; raises grpc.RpcError as the coordinator says
    run.start(request_iterator)          # threads: pipeline reader, decoder, client-message reader
    for msg in run.messages(): yield msg # Started, Frames, PromptUpdated, End; raises StreamFailed

Threads and bounded buffers (per stream)::

    coordinator --(reader)--> decode session [buffer_chunks] --(decoder thread: encoder)--> out [buffer_messages]
                                                                                              --(handler)--> client

The decode session (``gateway.decode.decoder``) is the VAE in this process (latents queue, decoded by one worker thread
per VAE part, the parts possibly on several GPUs; the decoder thread takes finished frames and encodes them while
the next chunk decodes) or a chain of VAE stage processes (chunks in flight through the chain).

Slow clients: gRPC flow control stops the handler when the client does not read and ``out`` fills; a full ``out``
blocks the decoder thread, and a full decode session blocks the pipeline reader (backpressure, which is also all
that a VAE slower than the DiT causes; the coordinator paces each stream by delivery, so the pipeline then stops
starting chunks instead of queuing them).  ``out`` is bounded in messages and in bytes (``buffer_bytes``).  A
message that waits ``slow_client_timeout`` seconds for the client to take it (the one gRPC is sending: a send
completes once its bytes are written to the connection, which the client's HTTP/2 flow-control window allows only
as the client reads; or one waiting for room in ``out``) means the client fell that far behind: the stream ends
with RESOURCE_EXHAUSTED "client too slow", the buffered frames are dropped, the error is queued for the client, and
the pipeline stream is stopped and the VAE state freed.  A watchdog on the gateway's timer thread times the send in
progress, so the rule holds however slowly frames come.  A client that still does not read for
``abandon_timeout`` more seconds has its call cancelled.  Memory per stream is therefore bounded by the two buffers,
one message in gRPC and the connection's socket buffers, whatever the client does.  What the gateway cannot see is
the client's own window: a client that never reads holds up to its window of frames (gRPC's default client, with
BDP probing: about 4 MiB; without: 64 KiB) before its sends stop completing, so it is ended that many bytes plus
``slow_client_timeout`` after it stopped reading.

Cleanup: when the client asks to stop, the pipeline stream is stopped with StopStream (no new chunks; the chunks in
flight still reach the client).  Whenever the call ends otherwise (failed, cancelled or disconnected), the pipeline
call is cancelled: the coordinator plans nothing more for the stream, and its close frees the KV cache on every stage
once the batches already planned have run (``gateway.stream.pipeline.PipelineCall`` holds those calls, and
``gateway.stream.trace.StreamTrace`` the stream's spans).  The decode session releases the stream's VAE cache (in
every VAE stage, when they are remote).  The stream stays in the gateway's status (state "draining") until both
happened, so ``GatewayStatus`` shows what the gateway and the pipeline still hold.  Deadlines (a stopped stream's
drain, a failed stream's unread error) run on the gateway's one timer thread (``gateway.stream.timers``), not on a
thread
per stream.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import grpc
import torch

from gateway.edge.config import EffectiveConfig
from gateway.stream.client import ClientRequests, Outbox, StreamLimits
from gateway.stream.frames import ChunkTag, FrameEmitter
from gateway.stream.pipeline import PipelineCall, StreamFailed
from gateway.stream.timers import Deadlines
from gateway.stream.trace import StreamTrace
from gateway.stream.video_input import InputPath, encode_image
from stagecast import api, wire
from stagecast.internal.v1 import pipeline_pb2 as ipb
from stagecast.media import make_encoder
from stagecast.v1 import stream_pb2 as pb

if TYPE_CHECKING:
    from gateway.decode.decoder import DecodeGate
    from gateway.decode.stream_vae import StreamVAEEncoder
    from gateway.metrics import GatewayMetrics
    from gateway.stream.timers import Timers
    from stagecast.internal.v1.pipeline_pb2_grpc import CoordinatorServiceStub

logger = logging.getLogger(__name__)

# After End, how long the call's status waits for the client to close its side (the SDK does at once; a client that
# does not gets its status this much later, never its frames).
END_LINGER_S = 1.0
RESERVE_TIMEOUT_S = 10.0  # the coordinator's Reserve answers from its admission arithmetic: milliseconds

__all__ = ["StreamFailed", "StreamHost", "StreamLimits", "StreamRun", "open_request", "release_hold", "reserve"]


class DecodeSession(Protocol):
    """One stream's decode on a decoder (``gateway.decode.decoder``'s LocalSession / RemoteSession, the batched tiny
    decoder's BatchedSession): chunks in, frames out in order."""

    def submit(self, tag, latents: torch.Tensor) -> bool: ...
    def finish(self) -> None: ...
    def abort(self) -> None: ...
    def results(self) -> Iterator: ...
    def close(self) -> None: ...


class Decoder(Protocol):
    """A decoder streams open sessions on (``gateway.decode.decoder.LocalDecoder``, ``RemoteDecoder``, the batched
    one)."""

    def open(self, capacity: int, paced: bool = False) -> DecodeSession: ...
    def depth(self, capacity: int) -> int: ...


@dataclass(frozen=True)
class StreamHost:
    """What a stream needs from its gateway, and nothing more: the gateway builds one and hands it to every run."""

    coordinator: CoordinatorServiceStub
    coordinator_target: str
    # By StreamConfig.decoder: "full" (gateway.decode.decoder.LocalDecoder or RemoteDecoder: the VAE), and "tiny" (a
    # LocalDecoder of a tiny streaming decoder) where the deployment has one.
    decoders: Mapping[str, Decoder]
    metrics: GatewayMetrics
    timers: Timers
    limits: StreamLimits
    latent_channels: int
    text_len: int
    model_name: str
    encode_prompt: Callable[..., torch.Tensor]  # (prompt, parent_span=...) -> text embeddings
    input_encoder: Callable[[], StreamVAEEncoder]  # the VAE encoder video-to-video streams share
    temporal_factor: int
    touch: Callable[[], None]  # the stream's state changed (status watchers)
    forget: Callable[[StreamRun], None]  # the stream is gone from the pipeline and the VAE
    pipeline: str = ""  # this pipeline's name (--pipeline-name), in Started.pipeline
    encode_gate: DecodeGate | None = None  # gateway.decode.decoder.encode_gate: a paced stream's frame encodes go first
    # Whether the coordinator's channel is connected (again) within a bound (stagecast.grpc_util.reconnected): a
    # restarted coordinator is back before the channel's backoff ends.  None: no such wait (a test's stub).
    reconnected: Callable[[], bool] | None = None


def open_request(cfg: EffectiveConfig, host: StreamHost) -> ipb.OpenStreamRequest:
    """The stream's OpenStreamRequest without its text (nor negative text nor image): what the coordinator's Reserve
    admits before the prompt is encoded, and what the open then completes (``StreamRun.open_pipeline``)."""
    spec = cfg.stream_spec(latent_channels=host.latent_channels, text_len=host.text_len)
    # The stream's lead is held to one wavefront plus our VAE depth: we acknowledge each chunk once decoded.
    return ipb.OpenStreamRequest(
        spec=wire.spec_to_proto(spec),
        acknowledges=True,
        consumer_depth=host.decoders[cfg.decoder].depth(host.limits.buffer_chunks),
        chunk_rate=cfg.chunk_rate,
        pace_offset_s=cfg.pace_offset_s,
        ladders=[ipb.Ladder(timesteps=ladder) for ladder in cfg.ladders],
        latency_first=cfg.steps_preference == "latency_first",
        decoder=cfg.decoder,  # the SLO model prices the stream's chunks at this decoder's reported cost
    )


def reserve(cfg: EffectiveConfig, host: StreamHost, text_shape: tuple[int, ...]) -> str:
    """Admission before the prompt is encoded (the coordinator's Reserve): its hold, which the open claims; raises
    the refusal's ``grpc.RpcError`` (a full pipeline: RESOURCE_EXHAUSTED with its retry delay) at once.  A coordinator
    without Reserve (UNIMPLEMENTED): "" (the open decides, after the encode, as before)."""
    msg = ipb.ReserveRequest(open=open_request(cfg, host), text_shape=list(text_shape))

    def ask() -> str:
        try:
            return host.coordinator.Reserve(msg, timeout=RESERVE_TIMEOUT_S).hold
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                return ""
            raise

    try:
        return ask()
    except grpc.RpcError as exc:
        # Unreachable: the coordinator may be back while the channel waits out its reconnect backoff.  Asked again
        # once it is connected; still down after the bound, the client hears so now.
        if exc.code() != grpc.StatusCode.UNAVAILABLE or host.reconnected is None or not host.reconnected():
            raise
    return ask()


def release_hold(host: StreamHost, hold: str) -> None:
    """Give a Reserve's place back unopened (best effort: unreleased, it lapses after the coordinator's HOLD_S)."""
    try:
        host.coordinator.Release(ipb.ReserveReply(hold=hold), timeout=RESERVE_TIMEOUT_S)
    except grpc.RpcError as exc:
        logger.debug("releasing hold %s failed (it lapses by itself): %s", hold[:8], exc.code())


class StreamRun:
    """One client stream: its threads, its pipeline call, its decode session and how it ends.  The parts it holds:
    ``outbox`` (messages out, the slow-client rule), ``frames`` (encoded frames), ``requests`` (the client's later
    messages, a video-to-video stream's input), ``deadlines`` (its timer entries)."""

    def __init__(
        self,
        host: StreamHost,
        cfg: EffectiveConfig,
        text: torch.Tensor,
        context,
        t0: float,
        parent_span=None,
        negative_text: torch.Tensor | None = None,  # a guided stream's negative prompt embeddings
    ):
        self.host = host
        self.limits = host.limits
        self.cfg = cfg
        self.text = text
        self.negative_text = negative_text
        self.context = context
        self.t0 = t0
        self.prompt_ms = self.ms()  # the prompt is encoded: the handler encodes it before the run is made
        self.opened_ms = 0.0  # set once the coordinator admitted the stream (open_pipeline)
        self.id = uuid.uuid4().hex[:16]
        self.state = "starting"
        self.outcome: str | None = None  # why the stream ended: "completed", "stopped", "cancelled", ...
        self.chunks_received = 0
        self.last_steps = cfg.steps  # the steps of the last chunk received
        self.decoder = host.decoders[cfg.decoder]  # the one this stream asked for (resolve_config checked it exists)
        self.session = None  # the decode session (gateway.decode.decoder), opened by start()
        self.end_reason: str | None = None  # the pipeline's, once it ended the stream
        self.input: InputPath | None = None  # video-to-video: the input frames' path (gateway.stream.video_input)
        self.via_door = False  # a trusted proxy (the fleet's door) sent it on: what the agent's maxconn counts
        self._lock = threading.Lock()
        self.deadlines = Deadlines(host.timers)  # this stream's timer entries, cancelled when the stream is gone
        self._live_parts = 2  # pipeline reader + decoder; the gateway forgets the stream when both have finished
        self.trace = StreamTrace(cfg, host.model_name, self.id, parent_span)
        self.pipeline = PipelineCall(host.coordinator, host.coordinator_target, self.trace)
        # The call's outgoing side: the bounded buffer, the handler's messages, the slow-client watchdog.
        self.outbox = Outbox(
            self.limits,
            host.timers,
            ended=lambda: self.outcome is not None,
            fail=self.fail,
            release_call=self._release_call,
        )
        self.out = self.outbox.out
        # The decoder thread's frames: encoded, stamped and queued through the outbox.
        self.frames = FrameEmitter(
            cfg,
            metrics=host.metrics,
            trace=self.trace,
            now_ms=self.ms,
            send=self.outbox.send,
            outcome=lambda: self.outcome,
            gate=host.encode_gate,
        )

    frames_emitted = property(lambda self: self.frames.frames_emitted)  # frames the decoder queued for the client
    frames_sent = property(lambda self: self.outbox.frames_sent)  # frames handed to gRPC
    first_frame_ms = property(lambda self: self.frames.first_frame_ms)

    pipeline_id = property(lambda self: self.pipeline.pipeline_id)  # the coordinator's id of the stream
    span = property(lambda self: self.trace.span)

    def ms(self) -> float:
        return (time.monotonic() - self.t0) * 1000.0

    # ---- opening (the handler thread) ----------------------------------------------------------------

    def open_pipeline(self, hold: str = "") -> None:
        """Open the pipeline stream (``hold``: the coordinator's Reserve admitted it before the prompt was encoded)."""
        request = open_request(self.cfg, self.host)
        request.text.CopyFrom(wire.tensor_to_proto(self.text))
        request.hold = hold
        if self.cfg.image is not None:  # image-to-video: the first frame's latent, encoded as the pipeline does
            request.image.CopyFrom(wire.tensor_to_proto(encode_image(self.host.input_encoder(), self.cfg.image)))
        if self.negative_text is not None:
            request.negative_text.CopyFrom(wire.tensor_to_proto(self.negative_text))
        self.pipeline.open(request)
        self.opened_ms = self.ms()

    def start(self, request_iterator) -> None:
        self.state = "streaming"
        if self.cfg.v2v:
            self.input = InputPath(
                self.cfg,
                self.host.input_encoder(),
                submit=self.pipeline.submit_input,
                metrics=self.host.metrics,
                now_ms=self.ms,
                temporal_factor=self.host.temporal_factor,
            )
        with self._lock:
            # A decoder shared by streams (the batched tiny one) decodes paced streams' chunks first.
            self.session = self.decoder.open(self.limits.buffer_chunks, paced=self.cfg.pace)
            ended = self.outcome is not None  # the client left while we were opening
        if ended:
            self.session.abort()
            if self.input is not None:
                self.input.abort()
            self.pipeline.cancel()
        self.requests = ClientRequests(
            self.id,
            self.cfg,
            input=self.input,
            pipeline=self.pipeline,
            trace=self.trace,
            encode_prompt=functools.partial(self.host.encode_prompt, paced=self.cfg.pace),  # a paced update first
            send=self.outbox.send,
            stop_pipeline=self.stop_pipeline,
            fail=self.fail,
        )
        threads = [
            ("read_pipeline", self._read_pipeline, ()),
            ("decode", self._decode, ()),
            ("read_requests", self.requests.read, (request_iterator,)),
        ]
        if self.input is not None:
            threads.append(("feed_input", self.requests.feed_input, ()))
        for name, target, args in threads:
            threading.Thread(target=target, args=args, daemon=True, name=f"{name}-{self.id[:6]}").start()
        self.outbox.arm(self.limits.slow_client_timeout)

    def started_message(self) -> pb.ServerMessage:
        cfg = self.cfg
        return pb.ServerMessage(
            started=pb.Started(
                stream_id=self.id,
                config=cfg.to_proto(),
                total_frames=cfg.total_frames or 0,
                num_chunks=cfg.num_chunks or 0,
                latent_width=cfg.latent_width,
                latent_height=cfg.latent_height,
                pipeline_stream_id=self.pipeline_id,
                prompt_ms=self.prompt_ms,
                opened_ms=self.opened_ms,
                pipeline=self.host.pipeline,
            )
        )

    def messages(self):
        """What the handler yields to the client, in order (``Outbox.messages``); raises ``StreamFailed`` to end the
        call with a status.  After the End message the call's status waits, at most ``END_LINGER_S``, for the client
        to close its side (the SDK does on End): a proxy then sees both directions end, where HAProxy 2.6 resets a
        call whose response ends while its request is open (RST_STREAM CANCEL, which can overtake the End)."""
        yield from self.outbox.messages(self.started_message())
        if self.outbox.end_sent:
            self.requests.closed.wait(END_LINGER_S)

    # ---- ending --------------------------------------------------------------------------------------

    def fail(self, code: grpc.StatusCode, message: str, outcome: str) -> None:
        """End the stream with a status: drop what is buffered, tell the client, stop the pipeline stream."""
        with self._lock:
            if self.outcome is not None:
                return
            self.outcome = outcome
        self.state = "draining"
        logger.warning("stream %s: %s (%s)", self.id, message, code.name)
        self.host.metrics.frames_dropped(outcome, len(self.out))  # queued frames are discarded (approximately: a
        self.out.put_final(StreamFailed(code, message), drop=True)  # prompt-updated message counts as one)
        self._abort_decoding()
        self.pipeline.cancel()
        self.host.touch()
        # A client that never reads never takes the error either; cancel its call rather than hold it forever.
        self._release_call()

    def _release_call(self) -> None:
        self.deadlines.after(self.limits.abandon_timeout, self.context.cancel)

    def on_rpc_done(self) -> None:
        """gRPC callback: the call ended (normally, with an error, or the client cancelled/disconnected)."""
        self.state = "draining"
        self.outbox.call_done()
        with self._lock:
            if self.outcome is None:
                self.outcome = "cancelled"
                logger.info("stream %s: client went away after %d frames", self.id, self.frames_sent)
        self.host.metrics.frames_dropped(self.outcome, len(self.out))
        self.out.close(drop=True)
        self._abort_decoding()
        self.pipeline.cancel()  # nobody reads any more: plan nothing more, free the stream everywhere
        self.deadlines.clear()
        self.host.touch()

    def _abort_decoding(self) -> None:
        with self._lock:
            session = self.session
        if session is not None:
            session.abort()
        if self.input is not None:
            self.input.abort()

    def stop_pipeline(self) -> None:
        """StopStream (no new chunks) once; the reader keeps draining until the coordinator ends the stream,
        within the drain timeout (then the pipeline call is cancelled)."""
        self.pipeline.stop(lambda ok: ok and self.deadlines.after(self.limits.drain_timeout, self.pipeline.cancel))

    def _part_done(self) -> None:
        with self._lock:
            self._live_parts -= 1
            last = self._live_parts == 0
        if last:
            self.deadlines.clear()
            self._end_trace()
            self.host.forget(self)

    def _end_trace(self) -> None:
        fps = self.frames.fps()
        if fps is not None:
            self.host.metrics.stream_fps(fps)
        self.trace.end(
            self.outcome or "unknown",
            frames=self.frames_emitted,
            chunks=self.chunks_received,
            ttff_ms=self.first_frame_ms,
        )

    # ---- threads -------------------------------------------------------------------------------------

    def _read_pipeline(self) -> None:
        try:
            for ev in self.pipeline.events():
                kind = ev.WhichOneof("event")
                if kind == "chunk":
                    self.chunks_received += 1
                    self.last_steps = ev.chunk.steps or self.cfg.steps
                    self.host.metrics.chunk_received()
                    if self.input is not None:
                        self.input.progress()
                    span = self.trace.chunk_span(ev.chunk.chunk, self.last_steps)
                    tag = ChunkTag(
                        ev.chunk.chunk,
                        self.ms(),
                        time.time_ns(),
                        span,
                        self.last_steps,
                        batch_seq=ev.chunk.seq,
                        batch_chunks=ev.chunk.finished_with,
                    )
                    # Blocks while the decoder is behind (backpressure); False once aborted: we are only draining.
                    if not self.session.submit(tag, wire.tensor_from_proto(ev.chunk.latents)) and tag.span is not None:
                        tag.span.set_attribute("stagecast.chunk.dropped", True)
                        tag.span.end()
                elif kind == "ended":
                    self.end_reason = ev.ended.reason
        except grpc.RpcError as exc:
            if not self.pipeline.cancelled:
                self.fail(exc.code(), f"pipeline: {exc.details()}", "pipeline_error")
        finally:
            self.session.finish()  # the decoder's results end after the last chunk
            self._part_done()

    def _decode(self) -> None:
        cfg = self.cfg
        encoder = None
        try:
            encoder = make_encoder(
                cfg.codec, width=cfg.width, height=cfg.height, fps=cfg.fps, quality=cfg.quality, chunked=True
            )
            resumed_ns = time.time_ns()
            for tag, frames, when in self.session.results():
                if tag.span is not None:
                    if when is None:  # VAE stage processes: from when it both had arrived and the last one was out
                        when = (max(resumed_ns, tag.arrived_ns), time.time_ns())
                    self.trace.post_hoc("vae.decode", tag.index, tag.span, *when)
                emitted = self.frames.emit(tag, frames, encoder, self.input)
                if tag.span is not None:
                    tag.span.end()
                if not emitted:
                    return
                self.pipeline.acknowledge(tag.index + 1)
                resumed_ns = time.time_ns()
            if self.end_reason is not None:
                input_end = self.requests.input_end
                reason = input_end if input_end == "input_stalled" else self.end_reason
                self._finish(reason, encoder.flush() if cfg.codec == "h264" else b"")
            elif self.outcome is None:  # the reader ends with an end reason or a failure; this guards against bugs
                self.fail(grpc.StatusCode.INTERNAL, "pipeline stream ended without an end event", "error")
        except Exception as exc:
            logger.exception("stream %s: decode failed", self.id)
            self.fail(grpc.StatusCode.INTERNAL, f"gateway: decoding or encoding failed: {exc}", "error")
        finally:
            self.session.close()  # frees the stream's VAE cache (in the VAE stages too, before returning)
            if encoder is not None:
                encoder.close()
            self._part_done()

    def _finish(self, reason: str, trailer: bytes) -> None:
        with self._lock:
            if self.outcome is not None:
                return
            self.outcome = reason
        end = pb.End(reason=api.end_reason_value(reason), frames=self.frames_emitted, trailer=trailer)
        if self.input is not None:
            end.input_frames_dropped = self.input.dropped
        self.out.put_final(pb.ServerMessage(end=end))
