"""One browser peer's stream: control messages in, a generation through the public SDK, frames and stats out.

Usage::

    session = Session(open_client, sink, send)     # send(dict): a JSON message to the browser
    await session.handle(parse_message(text))      # config / prompt / stop / ping
    await session.close()                          # cancels the stream: the gateway frees it at once

A ``config`` starts a stream (and replaces a running one); the SDK's generation is read in a task that hands every
frame to the ``sink`` (the WebRTC track, or the WebSocket), which paces it and calls ``frame_sent`` once the frame is
on its way, so the per-frame stats say when the viewer got it.  The gateway validates every field; its errors
travel back as ``{"type": "error", "code": "INVALID_ARGUMENT", "message": "width: ..."}``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from google.protobuf.json_format import MessageToDict

from stagecast.client import AsyncClient, AsyncGeneration
from stagecast.errors import StagecastError
from stagecast.frames import Frame, StreamInfo
from web.control import BadMessage, ControlMessage

logger = logging.getLogger(__name__)

MAX_BAD_MESSAGES = 50  # a peer that keeps sending junk is closed after this many
MAX_MESSAGES_PER_S = 30  # control messages a peer may send per second (the page sends about one)
MAX_QUEUED_INPUT = 4  # webcam frames waiting for gRPC; a live source drops beyond this rather than fall behind


class FrameSink:
    """Where a session's frames go.  ``deliver`` may wait (that is the back-pressure that paces the gateway)."""

    def restart(self, info: StreamInfo) -> None:
        """A new stream begins: forget the previous one's frames and clock."""

    async def deliver(self, frame: Frame, info: StreamInfo, sent: Callable[[Frame, float], None]) -> None:
        raise NotImplementedError

    async def drain(self) -> None:
        """Wait until every delivered frame is on its way (so ``end`` follows the last frame)."""

    async def trailer(self, data: bytes) -> None:
        """The encoder's last bytes, from the gateway's End (h264: the last fMP4 fragment)."""


class Session:
    def __init__(
        self,
        open_client: Callable[[], AsyncClient],
        sink: FrameSink,
        send: Callable[[dict], None],
        *,
        codec: str,
        on_fatal: Callable[[str], None] | None = None,
    ):
        self._open_client = open_client
        self._client: AsyncClient | None = None
        self.sink = sink
        self.send = send
        self.codec = codec
        self.on_fatal = on_fatal
        self.gen: AsyncGeneration | None = None
        self._task: asyncio.Task | None = None
        self.bad_messages = 0
        self.info: StreamInfo | None = None  # the running stream's, once started
        self.stopping = False
        self._window = (0.0, 0)  # (start of the current second, messages in it)
        self.input_sent = 0
        self.input_dropped = 0
        # The camera's clock from its first frame on this peer: every stream's input pts are on it.
        self._input_t0: float | None = None
        self._input_last: float | None = None
        self.streams = 0
        self.closed = False
        # Messages are handled one at a time, in order: two configs in a row must not both start a stream.
        self._lock = asyncio.Lock()

    def refuse(self, exc: BadMessage) -> None:
        """Junk from the browser: say what was wrong and keep serving; close a peer that only sends junk."""
        self.bad_messages += 1
        self.send({"type": "error", "code": "INVALID_ARGUMENT", "message": str(exc)})
        if self.bad_messages >= MAX_BAD_MESSAGES and self.on_fatal is not None:
            self.on_fatal(f"{self.bad_messages} malformed control messages")

    def admit(self) -> bool:
        """Whether one more control message fits this second's budget; one that does not is refused as junk."""
        now = time.monotonic()
        start, count = self._window
        if now - start >= 1.0:
            start, count = now, 0
        self._window = (start, count + 1)
        if count < MAX_MESSAGES_PER_S:
            return True
        self.refuse(BadMessage(f"message: more than {MAX_MESSAGES_PER_S} control messages a second"))
        return False

    async def handle(self, msg: ControlMessage) -> None:
        async with self._lock:
            await self._handle(msg)

    async def _handle(self, msg: ControlMessage) -> None:
        if self.closed:
            return
        if msg.kind == "config":
            await self._start(msg.config)
        elif msg.kind == "prompt":
            if self.gen is None or self.gen.end is not None:
                self.send({"type": "error", "code": "FAILED_PRECONDITION", "message": "prompt: no stream is running"})
            else:
                self.gen.update_prompt(msg.prompt)
        elif msg.kind == "stop":
            if self.gen is not None:
                self.stopping = True  # for video-to-video, Stop says the input is over: no camera frame follows it
                self.gen.stop()

    async def _start(self, config: dict) -> None:
        await self._cancel()
        if self.closed:  # closed while the previous stream was being cancelled
            return
        if self._client is None:
            self._client = self._open_client()
        self.streams += 1
        self.stopping = False
        self.gen = self._client.generate(codec=self.codec, **config)
        self._task = asyncio.get_running_loop().create_task(self._run(self.gen))

    async def _run(self, gen: AsyncGeneration) -> None:
        try:
            info = await gen.wait_started()
            self.info = info
            self.sink.restart(info)
            self.send(
                {
                    "type": "started",
                    "stream_id": info.stream_id,
                    "total_frames": info.total_frames or 0,
                    "config": MessageToDict(info.config, preserving_proto_field_name=True),
                }
            )
            seen = 0
            async for frame in gen:
                seen = self._prompt_updates(gen, seen)
                await self.sink.deliver(frame, info, self.frame_sent)
            self._prompt_updates(gen, seen)
            await self.sink.drain()
            end = gen.end
            if end is not None and end.trailer:
                await self.sink.trailer(end.trailer)
            self.send({"type": "end", "reason": end.reason if end else "cancelled", "frames": end.frames if end else 0})
        except StagecastError as exc:
            self.send({"type": "error", "code": exc.code.name, "message": exc.details})
        except (ValueError, TypeError) as exc:  # the SDK's own checks (e.g. an unknown policy name)
            self.send({"type": "error", "code": "INVALID_ARGUMENT", "message": str(exc)})

    def input_frame(self, frame) -> None:
        """A frame of the browser's camera (an ``av.VideoFrame``) for the running video-to-video stream, scaled to
        its size, with the camera's own timing as pts.  Dropped (and counted) while no such stream has started, and
        while gRPC has not taken the previous ones: the camera is live, so the newest frames matter."""
        t = float(frame.pts * frame.time_base) if frame.pts is not None and frame.time_base else time.monotonic()
        if self._input_t0 is None:
            self._input_t0 = t
        pts = round(t - self._input_t0, 6)
        gen, info = self.gen, self.info
        if gen is None or info is None or gen.end is not None or self.stopping or not info.config.HasField("strength"):
            self.input_dropped += 1
            return
        if gen.frames_queued >= MAX_QUEUED_INPUT or (self._input_last is not None and pts <= self._input_last):
            self.input_dropped += 1  # gRPC is behind (a live source drops), or pts did not increase
            return
        self._input_last = pts
        gen.send_frame(frame.to_ndarray(format="rgb24", width=info.width, height=info.height), pts)
        self.input_sent += 1

    def _prompt_updates(self, gen: AsyncGeneration, seen: int) -> int:
        for prompt in gen.prompt_updates[seen:]:
            self.send({"type": "prompt_updated", "prompt": prompt})
        return len(gen.prompt_updates)

    def frame_sent(self, frame: Frame, late_s: float) -> None:
        """Per-frame stats, once the frame is on its way to the viewer (times in seconds since the config)."""
        gen = self.gen
        t0 = gen.t0 if gen is not None else time.monotonic()
        self.send(
            {
                "type": "frame",
                "index": frame.index,
                "chunk": frame.chunk,
                "pts": frame.pts,
                "received_s": round(frame.timing.received_s, 4),
                "sent_s": round(time.monotonic() - t0, 4),
                "sent_at": round(time.time(), 4),  # wall clock, for one-way delays on one machine
                "late_ms": round(late_s * 1000.0, 1),
                "latents_ms": frame.timing.latents_ms,
                "decoded_ms": frame.timing.decoded_ms,
                "encoded_ms": frame.timing.encoded_ms,
            }
        )

    async def _cancel(self) -> None:
        gen, task = self.gen, self._task
        self.gen = self._task = None
        self.info = None
        if gen is not None and gen.end is None:
            gen.cancel()
        if task is not None:
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - the stream is gone either way
                pass

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True  # a message still waiting for the lock finds the session closed
        await self._cancel()
        if self._client is not None:
            await self._client.close()
            self._client = None
