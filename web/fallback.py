"""The WebSocket fallback, for networks where WebRTC cannot connect: JSON control, fragmented MP4 for MSE.

Usage (inside the aiohttp handler of ``GET /api/ws``)::

    ws = web.WebSocketResponse(heartbeat=2.0, max_msg_size=MAX_MESSAGE_BYTES)
    await serve_socket(ws, make_session, authorize)

The browser's first message is a ``config`` (``web.control``) carrying ``"token"`` (unless the socket sent its token in
``Sec-WebSocket-Protocol``), since a browser cannot set a WebSocket's Authorization header.  ``authorize(token)``
decides at that first message: None, or the (code, text) the socket is refused with.

The gateway streams H.264 as one fragmented-MP4 byte stream (``ftyp``+``moov`` first, then a
``moof``+``mdat`` per chunk); its bytes go out as binary messages as they are, after one ``{"type": "init", "mime":
"video/mp4; codecs=\"avc1.PPCCLL\""}`` for ``MediaSource.addSourceBuffer``.  Control and stats are text messages,
the same as on the data channel.  A socket that goes quiet is closed by aiohttp's heartbeat within seconds.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from aiohttp import WSMsgType, web

from stagecast.frames import Frame, StreamInfo
from web.control import BadMessage, dumps, parse_message
from web.session import FrameSink, Session

logger = logging.getLogger(__name__)

FIRST_MESSAGE_S = 10.0  # the config must arrive within this (the gateway's --config-timeout)


def mse_mime(init: bytes) -> str:
    """The MSE type of an fMP4 init segment: ``avc1.`` + profile, compatibility and level from its ``avcC`` box."""
    at = init.find(b"avcC")
    if at < 0 or len(init) < at + 8:
        return 'video/mp4; codecs="avc1.42E01E"'
    profile, compat, level = init[at + 5], init[at + 6], init[at + 7]
    return f'video/mp4; codecs="avc1.{profile:02X}{compat:02X}{level:02X}"'


class Outbox:
    """Everything for one socket, in order: text (control, stats) and binary (fMP4), written by one task."""

    def __init__(self, ws: web.WebSocketResponse):
        self.ws = ws
        self.queue: asyncio.Queue = asyncio.Queue()
        self.task = asyncio.get_running_loop().create_task(self._write())

    def send(self, msg: dict) -> None:
        if not self.ws.closed:
            self.queue.put_nowait(dumps(msg))

    async def send_bytes(self, data: bytes) -> None:
        """Queue ``data`` and wait until everything queued is written (the back-pressure of a slow socket)."""
        self.queue.put_nowait(data)
        await self.queue.join()

    async def _write(self) -> None:
        while True:
            item = await self.queue.get()
            try:
                if not self.ws.closed:
                    if isinstance(item, bytes):
                        await self.ws.send_bytes(item)
                    else:
                        await self.ws.send_str(item)
            except (ConnectionError, RuntimeError):
                pass  # the socket is closing; the session ends with it
            finally:
                self.queue.task_done()

    async def close(self) -> None:
        self.task.cancel()
        try:
            await self.task
        except asyncio.CancelledError:
            pass


class SocketSink(FrameSink):
    def __init__(self, outbox: Outbox):
        self.outbox = outbox
        self._first: float | None = None
        self._n = 0
        self._init_sent = False

    def restart(self, info: StreamInfo) -> None:
        self._first = None
        self._n = 0
        self._init_sent = False  # a new stream is a new fMP4 byte stream, starting with its own init segment

    async def deliver(self, frame: Frame, info: StreamInfo, sent: Callable[[Frame, float], None]) -> None:
        now = time.monotonic()
        if self._first is None:
            self._first = now
        late = max(0.0, now - (self._first + self._n / info.fps))
        self._n += 1
        if frame.data:
            if not self._init_sent:
                self.outbox.send({"type": "init", "mime": mse_mime(frame.data)})
                self._init_sent = True
            await self.outbox.send_bytes(frame.data)
        sent(frame, late)

    async def trailer(self, data: bytes) -> None:
        await self.outbox.send_bytes(data)


async def serve_socket(
    ws: web.WebSocketResponse,
    make_session: Callable[[FrameSink, Callable[[dict], None], Callable[[str], None]], Session],
    authorize: Callable[[str | None], tuple[str, str] | None],
) -> str:
    """Serve one socket until it closes; returns why it ended.  ``authorize(token)`` returns None, or the error code
    and text the socket is refused with (it is closed then)."""
    closing: list[str] = []
    outbox = Outbox(ws)
    loop = asyncio.get_running_loop()

    def fatal(why: str) -> None:
        closing.append(why)
        loop.create_task(ws.close(message=why[:120].encode()))

    async def refuse_first(code: str, text: str, why: str) -> str:
        outbox.send({"type": "error", "code": code, "message": text})
        await outbox.queue.join()
        await ws.close(message=why.encode())
        return why

    session = make_session(SocketSink(outbox), outbox.send, fatal)
    first = True
    try:
        async for msg in ws:
            if msg.type == WSMsgType.ERROR:
                return f"socket error: {ws.exception()}"
            if msg.type not in (WSMsgType.TEXT, WSMsgType.BINARY):
                continue
            if not session.admit():
                continue
            try:
                control = parse_message(msg.data)
            except BadMessage as exc:
                if first:
                    return await refuse_first("INVALID_ARGUMENT", str(exc), "the first message must be a config")
                session.refuse(exc)
                continue
            if first:
                if control.kind != "config":
                    return await refuse_first(
                        "INVALID_ARGUMENT", "type: the first message must be a config", "first message not a config"
                    )
                problem = authorize(control.token)
                if problem is not None:
                    return await refuse_first(problem[0], problem[1], problem[0].lower())
                first = False
            if control.kind != "ping":
                await session.handle(control)
        return closing[0] if closing else "closed by the browser"
    finally:
        await session.close()
        await outbox.close()
