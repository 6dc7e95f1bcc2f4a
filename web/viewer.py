"""A Python stand-in for the browser page: an aiortc peer that speaks the page's protocol (tests, benchmarks).

Usage::

    async with RtcViewer("http://127.0.0.1:8080/", token=None) as viewer:   # offer/answer, channel open
        viewer.send({"type": "config", "prompt": "a red fox", "seconds": 2})
        msg = await viewer.wait_for("started")
        frame = await viewer.next_frame()          # av.VideoFrame as decoded from the RTP stream
        viewer.send({"type": "prompt", "prompt": "a blue bird"})
        await viewer.wait_for("prompt_updated")

    camera = PatternCamera(64, 64, fps=16)                     # a moving test pattern, as the browser's webcam
    async with RtcViewer(url, camera=camera) as viewer:         # sends it: video-to-video
        viewer.send({"type": "config", "prompt": "a watercolor", "strength": 500, "steps": 2})

It offers host candidates only where ``web.rtc.use_ice_hosts`` says (a test calls ``use_ice_hosts(["127.0.0.1"])``)
and no ICE servers, so nothing leaves the machine.  It pings every second, as the page does.
"""

from __future__ import annotations

import asyncio
import fractions
import json
import time
import urllib.parse

import aiohttp
import av
import numpy as np
from aiortc import MediaStreamTrack, RTCConfiguration, RTCPeerConnection, RTCSessionDescription

from stagecast.api import DEFAULT_FPS

VIDEO_CLOCK = 90000


def pattern(width: int, height: int, n: int) -> np.ndarray:
    """Frame ``n`` of a moving colour pattern, ``(height, width, 3)`` uint8."""
    y, x = np.mgrid[0:height, 0:width]
    rgb = np.stack([(x * 4 + n * 8) % 256, (y * 4) % 256, ((x + y) * 2 + n * 16) % 256], axis=-1)
    return rgb.astype(np.uint8)


class PatternCamera(MediaStreamTrack):
    """A synthetic webcam: a moving colour pattern at ``fps``.  ``sent_at[pts_seconds]`` is when each frame left
    (``time.time()``), where pts counts from the first frame (as the web process turns camera timing into pts)."""

    kind = "video"

    def __init__(self, width: int, height: int, fps: float = DEFAULT_FPS):
        super().__init__()
        self.width, self.height, self.fps = width, height, fps
        self.sent_at: dict[float, float] = {}
        self._n = 0
        self._t0: float | None = None

    async def recv(self) -> av.VideoFrame:
        now = time.monotonic()
        if self._t0 is None:
            self._t0 = now
        due = self._t0 + self._n / self.fps
        if due > now:
            await asyncio.sleep(due - now)
        frame = av.VideoFrame.from_ndarray(pattern(self.width, self.height, self._n), format="rgb24")
        step = round(VIDEO_CLOCK / self.fps)
        frame.pts = self._n * step
        frame.time_base = fractions.Fraction(1, VIDEO_CLOCK)
        self.sent_at[round(self._n * step / VIDEO_CLOCK, 6)] = time.time()
        self._n += 1
        return frame


class OfferRefused(RuntimeError):
    def __init__(self, status: int, error: str):
        super().__init__(f"{status}: {error}")
        self.status = status
        self.error = error


async def post_offer(url: str, body: object, token: str | None = None, raw: bytes | None = None) -> dict:
    """POST ``body`` (or ``raw`` bytes) to ``/api/offer``; returns the answer or raises ``OfferRefused``."""
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    data = raw if raw is not None else json.dumps(body).encode()
    async with aiohttp.ClientSession() as http:
        async with http.post(urllib.parse.urljoin(url, "api/offer"), data=data, headers=headers) as resp:
            reply = await resp.json(content_type=None)
            if resp.status != 200:
                raise OfferRefused(resp.status, reply.get("error", ""))
            return reply


class RtcViewer:
    def __init__(self, url: str, token: str | None = None, ping: bool = True, camera: MediaStreamTrack | None = None):
        self.url = url
        self.camera = camera
        self.token = token
        self.ping = ping
        self.pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        self.messages: asyncio.Queue = asyncio.Queue()
        self.frames: asyncio.Queue = asyncio.Queue()
        self.log: list[dict] = []
        self.channel = None
        self.peer = ""
        self._tasks: list[asyncio.Task] = []

    async def __aenter__(self) -> RtcViewer:
        await self.connect()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def connect(self) -> None:
        if self.camera is not None:
            self.pc.addTrack(self.camera)  # sendrecv: the camera out, the generated video back
        else:
            self.pc.addTransceiver("video", direction="recvonly")
        self.channel = self.pc.createDataChannel("control")
        opened = asyncio.get_running_loop().create_future()

        @self.channel.on("open")
        def on_open() -> None:
            if not opened.done():
                opened.set_result(True)

        @self.channel.on("message")
        def on_message(data) -> None:
            msg = json.loads(data)
            self.log.append(msg)
            self.messages.put_nowait(msg)

        @self.pc.on("track")
        def on_track(track) -> None:
            self._tasks.append(asyncio.get_running_loop().create_task(self._read(track)))

        await self.pc.setLocalDescription(await self.pc.createOffer())
        answer = await post_offer(self.url, {"sdp": self.pc.localDescription.sdp, "type": "offer"}, self.token)
        self.peer = answer["peer"]
        await self.pc.setRemoteDescription(RTCSessionDescription(sdp=answer["sdp"], type="answer"))
        await opened
        if self.ping:
            self._tasks.append(asyncio.get_running_loop().create_task(self._pinger()))

    async def _read(self, track) -> None:
        while True:
            try:
                frame = await track.recv()
            except Exception:  # noqa: BLE001 - the track ended
                return
            self.frames.put_nowait(frame)

    async def _pinger(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            self.send({"type": "ping"})

    def send(self, msg: dict | str | bytes) -> None:
        if self.channel is not None and self.channel.readyState == "open":
            self.channel.send(msg if isinstance(msg, (str, bytes)) else json.dumps(msg))

    async def wait_for(self, kind: str, timeout: float = 120.0) -> dict:
        async def find() -> dict:
            while True:
                msg = await self.messages.get()
                if msg["type"] == kind:
                    return msg
                if msg["type"] == "error" and kind != "error":
                    raise RuntimeError(f"waiting for {kind}: {msg}")

        return await asyncio.wait_for(find(), timeout)

    async def next_frame(self, timeout: float = 120.0):
        return await asyncio.wait_for(self.frames.get(), timeout)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await self.pc.close()
