"""A gateway stream's frames: each decoded chunk's frames encoded, stamped and queued for the client.

Usage (``gateway.stream.run.StreamRun``'s decoder thread, one chunk at a time)::

    frames = FrameEmitter(cfg, metrics=metrics, trace=trace, now_ms=run.ms, send=outbox.send, outcome=...)
    if not frames.emit(tag, decoded, encoder, run.input): ...   # False: the call ended or the stream failed
    frames.frames_emitted, frames.first_frame_ms, frames.fps()

A frame carries the stream's clock (``latents_ms``, ``decoded_ms``, ``encoded_ms``: milliseconds since the config
arrived) and its pts; a video-to-video frame takes its input frame's pts.  A frame encoded after its presentation
time, on a clock that starts with the first frame, counts as late.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

from stagecast import api
from stagecast.v1 import stream_pb2 as pb


@dataclass(frozen=True)
class ChunkTag:
    """What the decoder needs to know about a chunk besides its frames."""

    index: int
    arrived_ms: float
    arrived_ns: int = 0  # wall clock, for the VAE decode span
    span: object = None  # the chunk's span, when the stream is traced
    steps: int = 0  # the denoising steps the chunk ran (the SLO controller's choice)
    batch_seq: int = 0  # the pipeline batch that finished it (ChunkResult.seq; 0: not known)
    batch_chunks: int = 0  # the chunks that batch finished, this one included (ChunkResult.finished_with)


class FrameEmitter:
    """The stream's encoded frames: what each one carries, the frame counts, and the first and last frame's times."""

    def __init__(
        self,
        cfg,
        *,
        metrics,
        trace,
        now_ms: Callable[[], float],
        send: Callable[[pb.ServerMessage], bool],
        outcome: Callable[[], str | None],
        gate=None,
    ):
        self.cfg = cfg  # gateway.edge.config.EffectiveConfig
        self.metrics = metrics  # gateway.metrics.GatewayMetrics
        self.trace = trace  # gateway.stream.trace.StreamTrace
        self.now_ms = now_ms  # the stream's clock
        self.send = send  # queues a message for the client (Outbox.send)
        self.outcome = outcome  # why the stream ended, once it did
        self.gate = gate  # the encode gate (gateway.decode.decoder.encode_gate): a paced stream's encodes first
        self.frames_emitted = 0  # frames the decoder queued for the client
        self.first_frame_ms: float | None = None
        self.first_pts = 0.0
        self.last_frame_ms: float | None = None

    def emit(self, chunk: ChunkTag, frames, encoder, input) -> bool:
        """Encode and queue one chunk's frames (``input``: a video-to-video stream's
        ``gateway.stream.video_input.InputPath``,
        else None).  False once the call ended or the stream failed."""
        cfg, metrics = self.cfg, self.metrics
        decoded_ms = self.now_ms()
        if cfg.total_frames is not None:
            frames = frames[: max(0, cfg.total_frames - self.frames_emitted)]  # trim the last chunk's tail
        # Video-to-video: output frame i of a chunk is made from the chunk's input frame i and carries its pts.  The
        # input's last chunk may end in repeats of its last frame (``InputPath``): only real input's frames go out.
        inputs = input.frames_of(chunk.index) if input is not None else []
        if inputs and len(inputs) < len(frames):
            frames = frames[: len(inputs)]
        for position, frame in enumerate(frames):
            encode_start, encode_start_ns = time.perf_counter(), time.time_ns()
            with self.gate.hold(cfg.pace) if self.gate is not None else contextlib.nullcontext():
                data = encoder.encode(frame, keyframe=position == 0)  # h264: one fragment per chunk
            encode_s = time.perf_counter() - encode_start
            index = self.frames_emitted
            pts, input_ms = inputs[position] if position < len(inputs) else (index / cfg.fps, 0.0)
            self.trace.post_hoc(
                "frame.encode", chunk.index, chunk.span, encode_start_ns, time.time_ns(), {"stagecast.frame": index}
            )
            msg = pb.ServerMessage(
                frame=pb.Frame(
                    data=data,
                    codec=api.codec_value(cfg.codec),
                    index=index,
                    pts=pts,
                    chunk=chunk.index,
                    latents_ms=chunk.arrived_ms,
                    decoded_ms=decoded_ms,
                    encoded_ms=self.now_ms(),
                    width=cfg.width,
                    height=cfg.height,
                    input_ms=input_ms,
                    steps=chunk.steps or cfg.steps,
                )
            )
            if not self.send(msg):
                metrics.frames_dropped(self.outcome() or "unknown", len(frames) - position)
                return False  # the call ended or the stream failed
            if index == 0:
                self.first_frame_ms = msg.frame.encoded_ms
                self.first_pts = pts
                metrics.first_frame(msg.frame.encoded_ms / 1000.0)
            # Late: encoded after its presentation time on a clock that starts with the first frame.
            late = msg.frame.encoded_ms > self.first_frame_ms + 1000.0 * (pts - self.first_pts)
            metrics.frame_sent(late=late, encode_seconds=encode_s)
            self.last_frame_ms = msg.frame.encoded_ms
            self.frames_emitted += 1
        metrics.chunk_decoded((decoded_ms - chunk.arrived_ms) / 1000.0)
        return True

    def fps(self) -> float | None:
        """Frames per second from the first frame to the last; None for fewer than two frames apart in time."""
        first, last = self.first_frame_ms, self.last_frame_ms
        if first is not None and last is not None and last > first and self.frames_emitted >= 2:
            return (self.frames_emitted - 1) * 1000.0 / (last - first)
        return None
