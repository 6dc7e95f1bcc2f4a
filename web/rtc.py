"""WebRTC out of the web process (aiortc): one video track of generated frames and a data channel for control.

Usage::

    use_ice_hosts(["127.0.0.1"])                 # once per process: the addresses offered as host candidates
    peer = RtcPeer(session_factory, ice_servers=[], on_closed=forget)
    answer_sdp = await peer.answer(offer_sdp)     # raises BadOffer naming what is wrong
    await peer.close()

The browser's offer must receive video and open a data channel (any label); control messages travel on it
(``web.control``).  An offer that also sends video (the webcam) feeds a video-to-video stream (a config with
``strength``): each camera frame is scaled to the stream's size and sent as a raw input frame with the camera's
timing as pts; while gRPC has not taken the previous few, a frame is dropped (a live source).

Frames go from the SDK's raw RGB straight into an ``av.VideoFrame`` and the RTP encoder (VP8 or H.264, whichever
the browser prefers), with no JPEG in between, paced at the stream's ``target_fps``: frame i leaves at (first
frame's send time + i / fps), or as soon as it exists if it is late (its stats say by how much).  At most
``QUEUED_FRAMES`` wait for their send time; beyond that the SDK reader waits, so the gateway's pacing by consumption
reaches the DiT.

A peer that vanishes without a goodbye is noticed by silence: the page pings on the data channel every second, and
a peer quiet for ``peer_timeout`` seconds (or not connected within ``connect_timeout``) is closed, which cancels its
stream, so the gateway frees it.  ICE's own consent checks would take 30 s.
"""

from __future__ import annotations

import asyncio
import fractions
import logging
import time
from collections.abc import Callable, Sequence

import aioice.ice
import av
from aiortc import MediaStreamTrack, RTCConfiguration, RTCIceServer, RTCPeerConnection, RTCSessionDescription
from aiortc.mediastreams import MediaStreamError

from stagecast.frames import Frame, StreamInfo
from web.control import BadMessage, parse_message
from web.session import FrameSink, Session

logger = logging.getLogger(__name__)

MAX_SDP_BYTES = 64 * 1024  # a browser's offer with a video and a data m-line is a few KiB
VIDEO_CLOCK = 90000
QUEUED_FRAMES = 8  # frames waiting for their send time; the SDK reader waits beyond this (back-pressure)


class BadOffer(ValueError):
    """An offer that cannot be answered; the text names the field."""


def use_ice_hosts(hosts: Sequence[str]) -> None:
    """Offer ICE host candidates on exactly these addresses (and bind the media sockets there).

    aioice gathers every interface's address except 127.0.0.1, and has no option for it.  A web process bound to
    one address (``--host``, a pod's IP, loopback in tests) must offer that address: the gatherer's address lookup
    is replaced for this process.  Empty: aioice's own choice."""
    hosts = list(hosts)
    if not hosts:
        return

    def addresses(use_ipv4: bool, use_ipv6: bool) -> list[str]:
        return [h for h in hosts if (":" in h and use_ipv6) or (":" not in h and use_ipv4)]

    aioice.ice.get_host_addresses = addresses


class PacedTrack(MediaStreamTrack):
    """The outgoing video: frames handed over by ``deliver`` leave at the stream's frame rate."""

    kind = "video"

    def __init__(self) -> None:
        super().__init__()
        self._queue: asyncio.Queue = asyncio.Queue(maxsize=QUEUED_FRAMES)
        self._epoch = 0
        self._pts = 0
        self._clock: tuple[float, int, float] | None = None  # (first send time, frame number then, fps)
        self._sent = 0

    def restart(self) -> None:
        self._epoch += 1
        self._clock = None
        while not self._queue.empty():
            self._queue.get_nowait()
            self._queue.task_done()

    async def put(self, item) -> None:
        await self._queue.put((self._epoch, *item))

    async def recv(self) -> av.VideoFrame:
        while True:
            if self.readyState != "live":
                raise MediaStreamError
            epoch, frame, fps, sent = await self._queue.get()
            if epoch == self._epoch:
                break
            self._queue.task_done()
        now = time.monotonic()
        if self._clock is None:
            self._clock = (now, self._sent, fps)
        first, n0, fps = self._clock
        due = first + (self._sent - n0) / fps
        if now < due:
            await asyncio.sleep(due - now)
        late = max(0.0, now - due)
        video = av.VideoFrame.from_ndarray(frame.to_array(), format="rgb24")
        video.pts = self._pts
        video.time_base = fractions.Fraction(1, VIDEO_CLOCK)
        self._pts += max(1, round(VIDEO_CLOCK / fps))
        self._sent += 1
        sent(frame, late)
        self._queue.task_done()
        return video

    async def drain(self) -> None:
        """Wait until every frame handed over has been sent."""
        await self._queue.join()


class TrackSink(FrameSink):
    def __init__(self, track: PacedTrack):
        self.track = track

    def restart(self, info: StreamInfo) -> None:
        self.track.restart()

    async def deliver(self, frame: Frame, info: StreamInfo, sent: Callable[[Frame, float], None]) -> None:
        await self.track.put((frame, info.fps, sent))

    async def drain(self) -> None:
        await self.track.drain()


def check_offer(sdp: object) -> str:
    if not isinstance(sdp, str):
        raise BadOffer("sdp: must be a string")
    if len(sdp.encode("utf-8", errors="replace")) > MAX_SDP_BYTES:
        raise BadOffer(f"sdp: over {MAX_SDP_BYTES} bytes")
    if not sdp.startswith("v=0") or "\nm=" not in sdp:
        raise BadOffer("sdp: not a session description (it must start with v=0 and have m= lines)")
    return sdp


class RtcPeer:
    def __init__(
        self,
        make_session: Callable[[FrameSink, Callable[[dict], None], Callable[[str], None]], Session],
        *,
        ice_servers: Sequence[RTCIceServer] = (),
        peer_timeout: float = 5.0,
        connect_timeout: float = 15.0,
        on_closed: Callable[[RtcPeer], None] | None = None,
    ):
        # iceServers=[] and never None: aiortc's default is a public STUN server.
        self.pc = RTCPeerConnection(RTCConfiguration(iceServers=list(ice_servers)))
        self.track = PacedTrack()
        self.channel = None
        self.session = make_session(TrackSink(self.track), self._send, self._fatal)
        self._camera: asyncio.Task | None = None
        self.peer_timeout = peer_timeout
        self.on_closed = on_closed
        self.closed = asyncio.Event()
        self.reason = ""
        loop = asyncio.get_running_loop()
        self._deadline = loop.call_later(connect_timeout, self._expire, "not connected in time")

        @self.pc.on("datachannel")
        def on_datachannel(channel) -> None:
            if self.channel is not None:
                channel.close()  # one control channel per peer
                return
            self.channel = channel
            self._alive()

            @channel.on("message")
            def on_message(data) -> None:
                self._alive()
                if not self.session.admit():
                    return
                try:
                    msg = parse_message(data)
                except BadMessage as exc:
                    self.session.refuse(exc)
                    return
                if msg.kind != "ping":
                    loop.create_task(self.session.handle(msg))

        @self.pc.on("track")
        def on_track(track) -> None:
            # The browser's camera, for video-to-video: one video track in (a second one is ignored).
            if track.kind == "video" and self._camera is None:
                self._camera = loop.create_task(self._read_camera(track))

        @self.pc.on("connectionstatechange")
        async def on_state() -> None:
            if self.pc.connectionState in ("failed", "closed"):
                await self.close(f"connection {self.pc.connectionState}")

    async def _read_camera(self, track) -> None:
        while True:
            try:
                frame = await track.recv()
            except MediaStreamError:
                return
            try:
                self.session.input_frame(frame)
            except Exception as exc:  # noqa: BLE001 - a frame that cannot be converted is dropped, not fatal
                logger.warning("camera frame dropped: %s", exc)

    def _alive(self) -> None:
        self._deadline.cancel()
        loop = asyncio.get_running_loop()
        self._deadline = loop.call_later(self.peer_timeout, self._expire, f"silent for {self.peer_timeout:g} s")

    def _expire(self, why: str) -> None:
        asyncio.get_running_loop().create_task(self.close(why))

    def _fatal(self, why: str) -> None:
        self._expire(why)

    def _send(self, msg: dict) -> None:
        from web.control import dumps

        if self.channel is not None and self.channel.readyState == "open":
            self.channel.send(dumps(msg))

    async def answer(self, sdp: object) -> str:
        offer = RTCSessionDescription(sdp=check_offer(sdp), type="offer")
        try:
            await self.pc.setRemoteDescription(offer)
        except Exception as exc:  # noqa: BLE001 - aiortc raises many kinds for a bad SDP; all mean the same
            raise BadOffer(f"sdp: cannot be used: {exc}"[:300]) from None
        kinds = [t.kind for t in self.pc.getTransceivers()]
        if "video" not in kinds:
            raise BadOffer("sdp: the offer must receive video (a video m-line, recvonly or sendrecv)")
        if self.pc.sctp is None:
            raise BadOffer("sdp: the offer must open a data channel (an application m-line) for control")
        self.pc.addTrack(self.track)
        try:
            await self.pc.setLocalDescription(await self.pc.createAnswer())
        except Exception as exc:  # noqa: BLE001 - e.g. no codec in common
            raise BadOffer(f"sdp: cannot be answered: {exc}"[:300]) from None
        return self.pc.localDescription.sdp

    async def close(self, reason: str = "closed") -> None:
        if self.closed.is_set():
            return
        self.closed.set()
        self.reason = reason
        self._deadline.cancel()
        if self._camera is not None:
            self._camera.cancel()
        logger.info("peer closed: %s", reason)
        try:
            await self.session.close()
        finally:
            self.track.stop()
            await self.pc.close()
            if self.on_closed is not None:
                self.on_closed(self)
