"""The stagecast client SDK: stream generated video from a gateway, synchronously or with asyncio.

Usage::

    import stagecast_client

    with stagecast_client.Client("localhost:50051") as client:
        gen = client.generate(prompt="a red fox running through snow", width=832, height=480, seconds=5, codec="jpeg")
        gen.info                                  # StreamInfo: the effective config (seed, total_frames, ...)
        for frame in gen:                         # Frame(index, pts, chunk, codec, data, width, height, timing)
            show(frame.to_array())
            if frame.index == 40:
                gen.update_prompt("a red fox sleeping in snow")   # from the next chunk not yet started
        gen.end                                   # EndInfo(reason="completed", frames=80)
        print(gen.ttff, gen.fps)

    client.generate(prompt="...", seconds=2).write_mp4("clip.mp4")  # consume the stream into an MP4

    # Video-to-video: restyle input frames (an iterator of (H, W, 3) uint8 arrays, or a video file's path).
    tr = client.transform("in.mp4", prompt="a watercolor painting", strength=700, steps=2)
    tr.write_mp4("out.mp4")                   # frame i is made from input frame i and carries its pts
    tr.frames_sent, tr.ttff, tr.fps

    async with stagecast_client.AsyncClient("localhost:50051") as client:
        gen = client.generate(prompt="...", seconds=2)
        async for frame in gen: ...
        await gen.write_mp4("clip.mp4")          # same methods; I/O ones are coroutines

Behind a fleet's door, ``client.generate(..., reconnect=True)`` reopens a stream that a drain or a lost pipeline
ended, for its remaining frames with the same prompt and seed (``gen.reconnects``: each gap; the picture starts over
on the new pipeline, which has no KV state), and ``retry_refused=True`` waits out a refusal's ``retry_after``.

``gen.stop()`` ends the stream gracefully (chunks in flight are still delivered), ``gen.cancel()`` at once.  A
failed call raises the ``stagecast_client.errors`` class for its status code (``InvalidArgumentError``,
``ResourceExhaustedError``, ``UnavailableError``, ...; all ``StagecastError``).  Leave ``seconds`` out to stream
until ``stop()``.

A gateway started with ``--tokens`` wants a bearer token, and one with ``--tls-cert`` speaks TLS::

    stagecast_client.Client("gw.example.com:443", token=os.environ["STAGECAST_TOKEN"], tls=True)   # system roots
    stagecast_client.Client("10.0.0.5:50051", token=token, root_certificates="ca.pem")             # TLS with this CA

A token is only ever sent over TLS, or in the clear to a loopback address (``UnauthenticatedError`` without a
valid token, ``PermissionDeniedError`` when the token may not do what was asked).
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, replace

import grpc

from stagecast_client import api
from stagecast_client.arrivals import Arrivals
from stagecast_client.errors import StagecastError, from_rpc_error
from stagecast_client.frames import EndInfo, Frame, Mp4Writer, StreamInfo
from stagecast_client.v1 import stream_pb2 as pb
from stagecast_client.v1 import stream_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

# Raw frames of large videos exceed gRPC's 4 MiB default.
DEFAULT_OPTIONS = [("grpc.max_receive_message_length", 256 * 1024 * 1024)]
_DONE = object()


# The request iterators hold only their queue, not the generation: gRPC's sending thread keeps the iterator alive,
# and a generation the caller dropped must still be collectable (its __del__ cancels the call).
def _drain(outbox: queue.Queue) -> Iterator[pb.ClientMessage]:
    while (msg := outbox.get()) is not _DONE:
        yield msg


async def _adrain(outbox: asyncio.Queue) -> AsyncIterator[pb.ClientMessage]:
    while (msg := await outbox.get()) is not _DONE:
        yield msg


def _check_input_format(input_format: str) -> None:
    if input_format not in ("jpeg", "raw"):
        raise ValueError(f"input_format: must be jpeg or raw, got {input_format!r}")


def _input_fps(config: pb.StreamConfig) -> float:
    """The rate that numbers input frames sent without a pts: the stream's target_fps, else the default (16)."""
    return config.target_fps if config.HasField("target_fps") else api.DEFAULT_FPS


def _input_frame(rgb, pts: float, fmt: str, quality: int) -> pb.InputFrame:
    """One input frame on the wire: JPEG (Pillow) or raw RGB24."""
    import numpy as np

    arr = np.ascontiguousarray(np.asarray(rgb, dtype=np.uint8))
    if arr.ndim != 3 or arr.shape[2] != 3:
        raise ValueError(f"frames: an input frame must be (H, W, 3) uint8 RGB, got shape {arr.shape}")
    if fmt == "raw":
        return pb.InputFrame(data=arr.tobytes(), format=pb.INPUT_FORMAT_RAW, pts=pts)
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="JPEG", quality=quality)
    return pb.InputFrame(data=buf.getvalue(), format=pb.INPUT_FORMAT_JPEG, pts=pts)


TRANSITIONS = {"cut": pb.TRANSITION_CUT, "recache": pb.TRANSITION_RECACHE}


def _prompt_update(prompt: str, transition: str | None) -> pb.PromptUpdate:
    if transition is not None and transition not in TRANSITIONS:
        raise ValueError(f"transition: must be one of {', '.join(TRANSITIONS)}, got {transition!r}")
    if transition is None:
        return pb.PromptUpdate(prompt=prompt)  # the server's default (a cut)
    return pb.PromptUpdate(prompt=prompt, transition=TRANSITIONS[transition])


def _image_bytes(image) -> bytes:
    if image is None:
        return b""
    if isinstance(image, (bytes, bytearray)):
        return bytes(image)
    if isinstance(image, (str, os.PathLike)):
        with open(image, "rb") as f:
            return f.read()
    import io

    import numpy as np
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(np.asarray(image, dtype=np.uint8))).save(buf, format="PNG")
    return buf.getvalue()


def stream_config(
    prompt: str,
    *,
    width: int | None = None,
    height: int | None = None,
    seconds: float | None = None,
    codec: str | int = "jpeg",
    chunk_frames: int | None = None,
    steps: int | None = None,
    seed: int | None = None,
    guidance_scale: float | None = None,
    target_fps: float | None = None,
    policy: str | int | None = None,
    window: int | None = None,
    sink: int | None = None,
    quality: int | None = None,
    timesteps: Sequence[float] | None = None,
    shift: float | None = None,
    strength: float | None = None,
    input_pacing: str | int | None = None,
    input_timeout: float | None = None,
    image=None,
    pace: bool | None = None,
    min_steps: int | None = None,
    max_steps: int | None = None,
    steps_preference: str | int | None = None,
    negative_prompt: str | None = None,
    decoder: str | int | None = None,
) -> pb.StreamConfig:
    """The first message of a stream.  ``None`` leaves a field out, so the gateway uses its default.

    ``codec`` is "jpeg", "h264" or "raw" and ``policy`` "per_level" or "clean" (the wire's ``Codec`` and ``KvPolicy``
    enums; an enum number is passed through as it is).  An unknown name raises ``ValueError`` naming the field.

    ``timesteps`` is the stream's own timestep ladder (e.g. ``[700, 500, 400, 200]``, strictly descending, one per
    step); left out, the checkpoint's ladder for ``steps`` is used.  ``shift`` is the checkpoint's: sending it only
    asserts it (another value is INVALID_ARGUMENT).  ``gen.info.timesteps`` / ``gen.info.shift`` say which ladder and
    shift the stream runs.

    ``strength`` makes a video-to-video stream (``Client.transform``): one of the ladder's timesteps, the level the
    input is noised to; ``input_pacing`` is "live" (drop input the pipeline cannot take yet) or "backpressure" (hold
    the sender back instead); ``input_timeout`` the seconds without input after which the stream ends.

    ``image`` is an image-to-video stream's first frame (Wan2.2-TI2V checkpoints): a path to a JPEG or PNG, its
    bytes, or an (H, W, 3) uint8 array (sent as PNG, lossless); it must be ``width`` x ``height``.

    ``pace`` (default True) generates the stream at ``target_fps``; ``pace=False`` runs it as fast as the pipeline
    allows (offline renders).

    ``min_steps`` / ``max_steps`` make the stream SLO-adaptive: the coordinator picks each chunk's steps in that range
    from measured capacity (``Frame.steps`` says what each chunk ran); ``steps_preference`` is "steps_first" (the
    default: as many steps as capacity allows) or "latency_first" (``min_steps`` always).

    ``guidance_scale`` above 1 runs classifier-free guidance against ``negative_prompt`` (left out: the checkpoint's
    default, else empty); a guidance-distilled checkpoint refuses it with INVALID_ARGUMENT naming the field.

    ``decoder`` is "full" (the model's VAE: exact) or "tiny" (a tiny streaming decoder: approximate, far cheaper per
    frame; only where the deployment has one, else INVALID_ARGUMENT naming ``decoder``), or a ``pb.Decoder`` value;
    left out, the deployment's default (the full VAE unless it says otherwise). ``gen.info.decoder`` says which ran."""
    msg = pb.StreamConfig(
        prompt=prompt,
        codec=api.codec_value(codec),
        policy=api.policy_value(policy),
        timesteps=list(timesteps or ()),
        input_pacing=api.input_pacing_value(input_pacing),
        image=_image_bytes(image),
        steps_preference=api.steps_preference_value(steps_preference),
        decoder=_decoder_value(decoder),
    )
    optional = dict(
        width=width,
        height=height,
        seconds=seconds,
        chunk_frames=chunk_frames,
        steps=steps,
        seed=seed,
        guidance_scale=guidance_scale,
        target_fps=target_fps,
        window=window,
        sink=sink,
        quality=quality,
        shift=shift,
        strength=strength,
        input_timeout=input_timeout,
        pace=pace,
        min_steps=min_steps,
        max_steps=max_steps,
        negative_prompt=negative_prompt,
    )
    for name, value in optional.items():
        if value is not None:
            setattr(msg, name, value)
    return msg


def _decoder_value(decoder: str | int | None) -> pb.Decoder:
    """``decoder=`` as its wire value: a name ("full" | "tiny"), a ``pb.Decoder`` number, or None (the default);
    anything else raises ``ValueError`` naming the field before a call is made."""
    if isinstance(decoder, bool) or not (decoder is None or isinstance(decoder, str | int)):
        raise ValueError(f"decoder: must be 'full', 'tiny' or a stagecast.v1 Decoder value, got {decoder!r}")
    if isinstance(decoder, int) and decoder not in pb.Decoder.values():
        names = ", ".join(pb.Decoder.keys())
        raise ValueError(f"decoder: {decoder} is not a stagecast.v1 Decoder value ({names})")
    return api.decoder_value(decoder)


# Reconnect (``reconnect=True``) and retry of refusals (``retry_refused=``), both opt-in on ``generate``.
RECONNECT_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)  # a drain's end, a lost pipeline, the door
MAX_RECONNECTS = 5  # reopens per stream (each after a backoff of RECONNECT_BACKOFF_S doubling, at most 2 s)
RECONNECT_BACKOFF_S = 0.2
RETRY_REFUSED_S = 30.0  # retry_refused=True: the most seconds waited in all on refusals' retry_after
MAX_REFUSED_WAIT_S = 10.0  # one refusal's retry_after is waited at most this long


@dataclass(frozen=True)
class Reconnect:
    """One reopen of a ``reconnect=True`` stream.  The new pipeline has no KV state: the picture starts over there
    (same prompt and seed, a fresh start), and its frames' indices go on after the last one received.

    ``at_index``: the first index after the gap; ``gap_s``: seconds from the last frame before to the first after;
    ``gap_frames``: the frames a viewer at the stream's fps missed in that time; ``error``: what ended the old call;
    ``pipeline``: the pipeline that took the stream over (``StreamInfo.pipeline``)."""

    at_index: int
    gap_s: float
    gap_frames: int
    error: str
    pipeline: str


class _Retry:
    """When a failed call is reopened, and with what config: ``plan(error, state)`` -> (delay seconds, config) or
    None (raise the error).  ``reconnect``: UNAVAILABLE or CANCELLED not asked for by the caller (a drain's end, a
    lost pipeline, the door's reset) reopens the stream for its remaining frames, the same prompt and the seed the
    first call ran, at most ``MAX_RECONNECTS`` times.  ``refused_s``: a refusal (RESOURCE_EXHAUSTED) with a
    ``retry_after`` is retried after it (each wait at most ``MAX_REFUSED_WAIT_S``) while the waits stay within
    ``refused_s`` seconds in all."""

    def __init__(self, config: pb.StreamConfig, *, reconnect: bool = False, retry_refused: bool | float = False):
        if isinstance(retry_refused, bool):
            refused_s = RETRY_REFUSED_S if retry_refused else 0.0
        else:
            refused_s = float(retry_refused)
            if not refused_s >= 0:
                raise ValueError(f"retry_refused: seconds must be >= 0, got {retry_refused}")
        self.config = config
        self.reconnect = reconnect
        self.refused_s = refused_s
        self.reconnects = 0
        self.waited_s = 0.0

    def plan(self, error: StagecastError, state: _StreamState) -> tuple[float, pb.StreamConfig] | None:
        if state._cancelled or state.end is not None:
            return None  # asked for, or over (HAProxy 2.6 may reset a call after its End message)
        if error.code == grpc.StatusCode.RESOURCE_EXHAUSTED and error.retry_after is not None:
            delay = min(max(0.0, error.retry_after), MAX_REFUSED_WAIT_S)
            if self.waited_s + delay > self.refused_s:
                return None
            self.waited_s += delay
            return delay, self.config
        if not self.reconnect or error.code not in RECONNECT_CODES or self.reconnects >= MAX_RECONNECTS:
            return None
        config = pb.StreamConfig()
        config.CopyFrom(self.config)
        info = state._info
        if info is not None:
            config.seed = info.config.seed  # the seed the stream ran, whether the caller chose it or the gateway
            fps = info.config.target_fps or api.DEFAULT_FPS
            if info.total_frames is not None:
                left = info.total_frames - state.frames_received
                if left <= 0:
                    return None  # every frame arrived: the stream is over
                config.seconds = (left - 0.5) / fps  # the gateway makes round_up(seconds * fps) frames: `left`
            self.config = config  # a later reopen keeps the seed
        delay = min(RECONNECT_BACKOFF_S * 2**self.reconnects, 2.0)
        self.reconnects += 1
        state._reopened(str(error))
        return delay, config


class _StreamState:
    """What sync and async generations share: turning server messages into SDK values and bookkeeping."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self._info: StreamInfo | None = None
        self.end: EndInfo | None = None
        self.prompt_updates: list[str] = []  # prompts the gateway accepted, in order
        self.frames_received = 0
        self.first_frame_s: float | None = None
        self.last_frame_s: float | None = None
        self.arrivals = Arrivals()
        self._cancelled = False
        self.reconnects: list[Reconnect] = []  # reconnect=True: each reopen, in order (see ``Reconnect``)
        self._next_index = 0  # the index the next frame takes (after a reopen: the new call's frames go on from it)
        self._index_base = 0
        self._gap: tuple[float | None, str] | None = None  # a reopen waiting for its first frame: (last frame's s, why)
        self._new_pipeline = ""  # the pipeline a reopened call's Started names

    def _reopened(self, error: str) -> None:
        """A new call replaces the failed one: its Started and frames follow (frame indices go on)."""
        self._gap = (self.last_frame_s, error)
        self._index_base = self._next_index

    def _handle(self, msg: pb.ServerMessage) -> Frame | None:
        kind = msg.WhichOneof("msg")
        if kind == "frame":
            now = time.monotonic() - self.t0
            if self.first_frame_s is None:
                self.first_frame_s = now
            self.last_frame_s = now
            self.frames_received += 1
            self.arrivals.add(now)
            frame = Frame.from_proto(msg.frame, now)
            if self._index_base:
                frame = replace(frame, index=frame.index + self._index_base)
            self._next_index = frame.index + 1
            if self._gap is not None:
                self._note_gap(now, frame.index)
            return frame
        if kind == "started":
            if self._gap is not None and self._info is not None:
                self._new_pipeline = msg.started.pipeline
                return None  # a reopened stream: its first Started stays ``info``
            self._info = StreamInfo.from_proto(msg.started)
        elif kind == "prompt_updated":
            self.prompt_updates.append(msg.prompt_updated.prompt)
        elif kind == "end":
            end = msg.end
            self.end = EndInfo(api.end_reason_name(end.reason), end.frames, end.trailer, end.input_frames_dropped)
        return None

    def _note_gap(self, now: float, index: int) -> None:
        assert self._gap is not None
        last, error = self._gap
        self._gap = None
        gap_s = now - (last if last is not None else 0.0)
        fps = (self._info.config.target_fps if self._info is not None else 0.0) or api.DEFAULT_FPS
        self.reconnects.append(Reconnect(index, gap_s, max(0, round(gap_s * fps) - 1), error, self._new_pipeline))

    @property
    def ttff(self) -> float | None:
        """Seconds from sending the config to receiving the first frame."""
        return self.first_frame_s

    @property
    def steady_fps(self) -> float | None:
        """The stream's frame rate as a viewer sees it: frames per second over the later half of its time, so a
        paced stream's start burst (its playout buffer) is not counted as rate (``stagecast.arrivals``)."""
        return self.arrivals.steady_fps

    @property
    def burst_frames(self) -> int:
        """Frames delivered beyond the steady rate since the first frame: a paced stream's start burst."""
        return self.arrivals.burst_frames

    @property
    def fps(self) -> float | None:
        """Frames per second received after the first frame, over the whole stream: the start burst included (a
        short paced clip reads far above its frame rate); ``steady_fps`` is the rate a viewer sees."""
        return self.arrivals.fps


class Generation(_StreamState):
    """One stream: an iterator of ``Frame``; see the module docstring.

    ``reconnect=True``: a stream ended by a drain or by the loss of its pipeline (UNAVAILABLE, or CANCELLED it did not
    ask for) is reopened through the same address (a fleet's door sends it to another pipeline) for its remaining
    frames, with the same prompt and seed; the frames' indices go on after the last one received, and each reopen is
    in ``reconnects`` (``Reconnect``: the gap in seconds and frames).  The new pipeline has no KV state, so the
    picture starts over.  ``retry_refused``: a refusal's ``retry_after`` is waited and the stream opened again
    (True: up to ``RETRY_REFUSED_S`` seconds of waits in all, a number: that many; each wait at most
    ``MAX_REFUSED_WAIT_S``)."""

    def __init__(
        self,
        stub: pb_grpc.StreamServiceStub,
        config: pb.StreamConfig,
        *,
        timeout: float | None = None,
        reconnect: bool = False,
        retry_refused: bool | float = False,
    ):
        super().__init__()
        self._stub = stub
        self._timeout = timeout
        self._retry = _Retry(config, reconnect=reconnect, retry_refused=retry_refused)
        self._open(config)

    def _open(self, config: pb.StreamConfig) -> None:
        self._outbox: queue.Queue = queue.Queue()
        self._outbox.put(pb.ClientMessage(config=config))
        self._call = self._stub.Generate(_drain(self._outbox), timeout=self._timeout)
        self._call_over = False  # the call ended (End, its status or an error) and our side is closed

    def _close_side(self) -> None:
        """The call is over: end the request iterator (gRPC's sending thread returns)."""
        self._call_over = True
        _put_done(self._outbox)

    def _read(self) -> pb.ServerMessage | None:
        """The next server message, None at the end of the call; raises the SDK error for a failed call (after the
        reopens ``reconnect`` / ``retry_refused`` allow)."""
        while True:
            try:
                msg = next(self._call)
                if msg.WhichOneof("msg") == "end":
                    self._close_side()  # nothing more to send: close our side before the call's status
                return msg
            except StopIteration:
                self._close_side()
                return None
            except grpc.RpcError as exc:
                self._close_side()
                if self._cancelled and exc.code() == grpc.StatusCode.CANCELLED:
                    return None
                error = from_rpc_error(exc)
                plan = self._retry.plan(error, self)
                if plan is None:
                    raise error from None
                logger.info("stream reopened in %.1f s after: %s", plan[0], error)
                time.sleep(plan[0])
                if self._cancelled:
                    return None
                self._open(plan[1])

    @property
    def info(self) -> StreamInfo:
        """The Started message (waits for it)."""
        return self.wait_started()

    def wait_started(self) -> StreamInfo:
        while self._info is None:
            msg = self._read()
            if msg is None:
                raise StagecastError("the stream ended before it started")
            if self._handle(msg) is not None:
                raise StagecastError("the gateway sent a frame before Started")
        return self._info

    def __iter__(self) -> Iterator[Frame]:
        return self

    def __next__(self) -> Frame:
        while True:
            msg = self._read()
            if msg is None:
                raise StopIteration
            frame = self._handle(msg)
            if frame is not None:
                return frame

    def update_prompt(self, prompt: str, transition: str | None = None) -> None:
        """Use ``prompt`` from the next chunk that has not started (asynchronous; see ``prompt_updates``).
        ``transition="recache"`` rebuilds the KV window under it first (the stream pauses for the chunks in flight);
        "cut" (the default) does not."""
        self._outbox.put(pb.ClientMessage(prompt=_prompt_update(prompt, transition)))

    def stop(self) -> None:
        """Graceful end: no new chunks; the frames of chunks in flight still arrive, then End(reason="stopped")."""
        self._outbox.put(pb.ClientMessage(stop=pb.Stop()))

    def cancel(self) -> None:
        """End the stream now; iteration stops.  The gateway frees the stream's pipeline and VAE state."""
        self._cancelled = True
        self._call.cancel()
        _put_done(self._outbox)

    def collect(self) -> list[Frame]:
        return list(self)

    def write_mp4(self, path: str | os.PathLike, *, on_frame: Callable[[Frame], None] | None = None) -> int:
        """Consume the rest of the stream into an MP4 at ``path``; returns the number of frames written."""
        with Mp4Writer(path, self.info.fps) as mp4:
            for frame in self:
                mp4.add(frame)
                if on_frame is not None:
                    on_frame(frame)
            if self.end is not None:
                mp4.add_trailer(self.end.trailer)
        return mp4.frames

    def __enter__(self) -> Generation:
        return self

    def __exit__(self, *exc) -> None:
        if self.end is None:
            self.cancel()

    def __del__(self) -> None:
        # A dropped, unfinished generation must not keep its stream (and the gateway's resources) alive.  One whose
        # call is over touches nothing: at the interpreter's exit (a generation in a reference cycle, such as a
        # refused one held by its exception's traceback, is finalized then), the request queue's lock may be held by
        # gRPC's sending thread, a daemon thread that the exit stopped for good, and taking it would hang the exit.
        if getattr(self, "_call_over", True) or self._cancelled or sys.is_finalizing():
            return
        self.cancel()


class Transform(Generation):
    """A video-to-video stream: a thread sends the input frames (bounded: at most ``window`` frames wait to be sent,
    so a file is read as fast as the gateway takes it), then Stop; iterate it like a ``Generation``.

    ``frames_sent`` counts input frames handed to gRPC; ``input_error`` holds what stopped the sender early (an
    unreadable file, a bad frame), and is raised when iteration ends."""

    def __init__(
        self,
        stub: pb_grpc.StreamServiceStub,
        config: pb.StreamConfig,
        frames,
        *,
        input_format: str = "jpeg",
        input_quality: int = 95,
        window: int = 8,
        timeout: float | None = None,
    ):
        _StreamState.__init__(self)
        self._retry = _Retry(config)  # a transform's input is consumed as it goes: no reopen
        _check_input_format(input_format)
        self.frames_sent = 0
        self.input_error: BaseException | None = None
        self._outbox = queue.Queue(maxsize=window)
        self._outbox.put(pb.ClientMessage(config=config))
        self._call = stub.Generate(_drain(self._outbox), timeout=timeout)
        self._call_over = False
        fps = _input_fps(config)
        self._sender = threading.Thread(
            target=self._send_frames, args=(frames, fps, input_format, input_quality), daemon=True, name="transform"
        )
        self._sender.start()

    def _send_frames(self, frames, fps: float, fmt: str, quality: int) -> None:
        try:
            for i, item in enumerate(frames):
                rgb, pts = item if isinstance(item, tuple) else (item, i / fps)
                msg = pb.ClientMessage(frame=_input_frame(rgb, pts, fmt, quality))
                if not self._put(msg):
                    return
                self.frames_sent += 1
            self._put(pb.ClientMessage(stop=pb.Stop()))  # the input is over: the frames already sent still come
        except Exception as exc:  # noqa: BLE001 - reported to the reader, which raises it
            self.input_error = exc
            self.cancel()

    def _put(self, msg) -> bool:
        """Blocks while ``window`` messages wait; False once the call is over."""
        while not self._cancelled and not self._call_over:
            try:
                self._outbox.put(msg, timeout=0.5)
                return True
            except queue.Full:
                continue
        return False

    def _read(self) -> pb.ServerMessage | None:
        msg = super()._read()
        if msg is None and self.input_error is not None:
            raise StagecastError(f"input: {self.input_error}") from self.input_error
        return msg

    def update_prompt(self, prompt: str, transition: str | None = None) -> None:
        self._put(pb.ClientMessage(prompt=_prompt_update(prompt, transition)))

    def stop(self) -> None:
        self._put(pb.ClientMessage(stop=pb.Stop()))


def _put_done(outbox: queue.Queue) -> None:
    """End a request iterator whose bounded queue may be full (its reader has stopped): make room, then _DONE."""
    while True:
        try:
            outbox.put_nowait(_DONE)
            return
        except queue.Full:
            try:
                outbox.get_nowait()
            except queue.Empty:
                pass


class AsyncGeneration(_StreamState):
    """The asyncio twin of ``Generation``: ``async for frame in gen``; I/O methods are coroutines."""

    def __init__(
        self,
        stub: pb_grpc.StreamServiceStub,
        config: pb.StreamConfig,
        *,
        timeout: float | None = None,
        reconnect: bool = False,
        retry_refused: bool | float = False,
    ):
        super().__init__()
        self._stub = stub
        self._timeout = timeout
        self._retry = _Retry(config, reconnect=reconnect, retry_refused=retry_refused)
        self._open(config)

    def _open(self, config: pb.StreamConfig) -> None:
        self._outbox: asyncio.Queue = asyncio.Queue()
        self._outbox.put_nowait(pb.ClientMessage(config=config))
        self._call = self._stub.Generate(_adrain(self._outbox), timeout=self._timeout)

    async def _read(self) -> pb.ServerMessage | None:
        while True:
            try:
                msg = await self._call.read()
            except asyncio.CancelledError:
                if self._cancelled:
                    return None
                raise
            except grpc.RpcError as exc:
                _aput_done(self._outbox)
                if self._cancelled and exc.code() == grpc.StatusCode.CANCELLED:
                    return None
                error = from_rpc_error(exc)
                plan = self._retry.plan(error, self)
                if plan is None:
                    raise error from None
                logger.info("stream reopened in %.1f s after: %s", plan[0], error)
                await asyncio.sleep(plan[0])
                if self._cancelled:
                    return None
                self._open(plan[1])
                continue
            if msg is grpc.aio.EOF or msg.WhichOneof("msg") == "end":
                _aput_done(self._outbox)  # End: nothing more to send, close our side before the call's status
            return None if msg is grpc.aio.EOF else msg

    @property
    def info(self) -> StreamInfo:
        """The Started message; ``await gen.wait_started()`` first."""
        if self._info is None:
            raise StagecastError("not started yet: await wait_started() first")
        return self._info

    async def wait_started(self) -> StreamInfo:
        while self._info is None:
            msg = await self._read()
            if msg is None:
                raise StagecastError("the stream ended before it started")
            if self._handle(msg) is not None:
                raise StagecastError("the gateway sent a frame before Started")
        return self._info

    def __aiter__(self) -> AsyncIterator[Frame]:
        return self

    async def __anext__(self) -> Frame:
        while True:
            msg = await self._read()
            if msg is None:
                raise StopAsyncIteration
            frame = self._handle(msg)
            if frame is not None:
                return frame

    def update_prompt(self, prompt: str, transition: str | None = None) -> None:
        self._outbox.put_nowait(pb.ClientMessage(prompt=_prompt_update(prompt, transition)))

    def stop(self) -> None:
        self._outbox.put_nowait(pb.ClientMessage(stop=pb.Stop()))

    def send_frame(self, rgb, pts: float, *, input_format: str = "raw", quality: int = 95) -> None:
        """Video-to-video (a config with ``strength``): queue one ``(H, W, 3)`` uint8 input frame with its pts
        (seconds, strictly increasing).  A live source checks ``frames_queued`` and drops rather than queue up."""
        _check_input_format(input_format)
        self._outbox.put_nowait(pb.ClientMessage(frame=_input_frame(rgb, pts, input_format, quality)))

    @property
    def frames_queued(self) -> int:
        """Messages queued here that gRPC has not taken yet."""
        return self._outbox.qsize()

    def cancel(self) -> None:
        self._cancelled = True
        self._call.cancel()
        _aput_done(self._outbox)

    async def collect(self) -> list[Frame]:
        return [frame async for frame in self]

    async def write_mp4(self, path: str | os.PathLike, *, on_frame: Callable[[Frame], None] | None = None) -> int:
        info = await self.wait_started()
        with Mp4Writer(path, info.fps) as mp4:
            async for frame in self:
                mp4.add(frame)
                if on_frame is not None:
                    on_frame(frame)
            if self.end is not None:
                mp4.add_trailer(self.end.trailer)
        return mp4.frames

    async def __aenter__(self) -> AsyncGeneration:
        return self

    async def __aexit__(self, *exc) -> None:
        if self.end is None:
            self.cancel()


def _aput_done(outbox: asyncio.Queue) -> None:
    """End an async request iterator whose queue may be bounded and full: make room, then _DONE."""
    while True:
        try:
            outbox.put_nowait(_DONE)
            return
        except asyncio.QueueFull:
            try:
                outbox.get_nowait()
            except asyncio.QueueEmpty:
                pass


class AsyncTransform(AsyncGeneration):
    """The asyncio twin of ``Transform``: a task sends the input frames (an iterable, or an async iterable, of
    arrays or ``(array, pts)`` pairs) with at most ``window`` waiting, then Stop; ``async for frame in tr``."""

    def __init__(
        self,
        stub: pb_grpc.StreamServiceStub,
        config: pb.StreamConfig,
        frames,
        *,
        input_format: str = "jpeg",
        input_quality: int = 95,
        window: int = 8,
        timeout: float | None = None,
    ):
        _StreamState.__init__(self)
        self._retry = _Retry(config)  # a transform's input is consumed as it goes: no reopen
        _check_input_format(input_format)
        self.frames_sent = 0
        self.input_error: BaseException | None = None
        self._outbox: asyncio.Queue = asyncio.Queue(maxsize=window)
        self._outbox.put_nowait(pb.ClientMessage(config=config))
        self._call = stub.Generate(_adrain(self._outbox), timeout=timeout)
        fps = _input_fps(config)
        self._sender = asyncio.get_running_loop().create_task(
            self._send_frames(frames, fps, input_format, input_quality)
        )

    async def _send_frames(self, frames, fps: float, fmt: str, quality: int) -> None:
        async def items():
            if hasattr(frames, "__aiter__"):
                async for item in frames:
                    yield item
            else:
                for item in frames:
                    yield item

        try:
            i = 0
            async for item in items():
                rgb, pts = item if isinstance(item, tuple) else (item, i / fps)
                await self._outbox.put(pb.ClientMessage(frame=_input_frame(rgb, pts, fmt, quality)))
                self.frames_sent += 1
                i += 1
            await self._outbox.put(pb.ClientMessage(stop=pb.Stop()))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - reported to the reader, which raises it
            self.input_error = exc
            self.cancel()

    async def _read(self) -> pb.ServerMessage | None:
        msg = await super()._read()
        if msg is None:
            self._sender.cancel()
            if self.input_error is not None:
                raise StagecastError(f"input: {self.input_error}") from self.input_error
        return msg

    def update_prompt(self, prompt: str, transition: str | None = None) -> None:
        """Like ``AsyncGeneration.update_prompt``; behind the frames already waiting to be sent."""
        _aput_later(self._outbox, pb.ClientMessage(prompt=_prompt_update(prompt, transition)))

    def stop(self) -> None:
        """No more input: the frames already queued are sent, then Stop."""
        self._sender.cancel()
        _aput_later(self._outbox, pb.ClientMessage(stop=pb.Stop()))

    def cancel(self) -> None:
        self._sender.cancel()
        super().cancel()


def _aput_later(outbox: asyncio.Queue, msg: pb.ClientMessage) -> None:
    """Queue ``msg`` now, or (frames still fill the bounded queue) as soon as there is room."""
    try:
        outbox.put_nowait(msg)
    except asyncio.QueueFull:
        asyncio.get_running_loop().create_task(outbox.put(msg))


def _read_roots(root_certificates: bytes | str | os.PathLike | None) -> bytes | None:
    if root_certificates is None or isinstance(root_certificates, bytes):
        return root_certificates
    with open(root_certificates, "rb") as f:
        return f.read()


def tls_name_options(tls_name: str | None, secure: bool) -> list[tuple[str, object]]:
    """The channel option that verifies the gateway's certificate against ``tls_name`` instead of the address
    dialled (``grpc.ssl_target_name_override``): for an address the certificate does not name."""
    if tls_name is None:
        return []
    if not secure:
        raise ValueError("tls_name: needs TLS (tls=True or root_certificates; CLI: --tls or --tls-ca)")
    if not tls_name.strip() or len(tls_name) > 253 or any(c.isspace() for c in tls_name):
        raise ValueError(f"tls_name: a DNS name or IP of at most 253 characters, no spaces; got {tls_name[:80]!r}")
    return [("grpc.ssl_target_name_override", tls_name)]


def channel_credentials(
    token: str | None = None, tls: bool | None = None, root_certificates: bytes | str | os.PathLike | None = None
) -> grpc.ChannelCredentials | None:
    """What a channel to a gateway needs: TLS (``tls`` or ``root_certificates``, a PEM path or bytes; system roots
    without them) and the token as ``authorization: Bearer``.  A token without TLS may only reach loopback (gRPC's
    local credentials refuse anything else, so a token is never sent in the clear over a network).  None: plaintext."""
    roots = _read_roots(root_certificates)
    secure = bool(tls) or roots is not None
    if token is not None and not token.strip():
        raise ValueError("token: empty")
    if not secure and token is None:
        return None
    base = grpc.ssl_channel_credentials(root_certificates=roots) if secure else grpc.local_channel_credentials()
    if token is None:
        return base
    return grpc.composite_channel_credentials(base, grpc.access_token_call_credentials(token.strip()))


class Client:
    """A connection to one gateway (``host:port``).  Thread-safe; one client can run many streams.

    ``token``: the bearer token of a gateway started with ``--tokens``; ``tls`` / ``root_certificates`` (PEM bytes
    or a file): TLS to a gateway started with ``--tls-cert``; ``tls_name``: the name its certificate is checked
    against when it does not name ``target`` (e.g. dialling a load balancer's IP)."""

    def __init__(
        self,
        target: str,
        *,
        token: str | None = None,
        tls: bool | None = None,
        root_certificates: bytes | str | os.PathLike | None = None,
        tls_name: str | None = None,
        options: Sequence[tuple[str, object]] = (),
    ):
        self.target = target
        creds = channel_credentials(token, tls, root_certificates)
        secure = bool(tls) or root_certificates is not None
        opts = [*DEFAULT_OPTIONS, *tls_name_options(tls_name, secure), *options]
        if creds:
            self._channel = grpc.secure_channel(target, creds, options=opts)
        else:
            self._channel = grpc.insecure_channel(target, options=opts)
        self._stub = pb_grpc.StreamServiceStub(self._channel)

    def generate(
        self,
        prompt: str,
        *,
        timeout: float | None = None,
        reconnect: bool = False,
        retry_refused: bool | float = False,
        **config,
    ) -> Generation:
        """Start a stream; keyword arguments are those of ``stream_config``.  Returns at once: errors surface when
        the stream is read (``info``, iteration).  ``reconnect`` and ``retry_refused`` (both opt-in): see
        ``Generation``; the picture of a reconnected stream starts over on its new pipeline."""
        cfg = stream_config(prompt, **config)
        return Generation(self._stub, cfg, timeout=timeout, reconnect=reconnect, retry_refused=retry_refused)

    def transform(
        self,
        frames,
        prompt: str,
        *,
        strength: float,
        input_format: str = "jpeg",
        input_quality: int = 95,
        timeout: float | None = None,
        **config,
    ) -> Transform:
        """Start a video-to-video stream.  ``frames`` is an iterable of ``(H, W, 3)`` uint8 RGB arrays (or ``(array,
        pts)`` pairs; without pts frame i is at ``i / target_fps``) or a video file's path (decoded with PyAV, scaled
        to ``width`` x ``height`` when given, else sent at its own size; its frame rate is the default
        ``target_fps``).  ``strength`` is the ladder timestep the input is noised to; ``config`` as for
        ``stream_config`` (``input_pacing`` defaults to "backpressure" for a file, the gateway's "live" otherwise).
        Frames travel as JPEG (``input_quality``) or raw RGB (``input_format="raw"``, lossless)."""
        if isinstance(frames, (str, os.PathLike)):
            from stagecast_client.media import iter_video_frames, video_info

            width, height, fps, _ = video_info(frames)
            config.setdefault("target_fps", fps)
            config.setdefault("input_pacing", "backpressure")
            if config.get("width") is None or config.get("height") is None:
                config["width"], config["height"] = width, height
            frames = iter_video_frames(frames, width=config["width"], height=config["height"])
        cfg = stream_config(prompt, strength=strength, **config)
        return Transform(
            self._stub, cfg, frames, input_format=input_format, input_quality=input_quality, timeout=timeout
        )

    def status(self, timeout: float = 10.0) -> pb.GatewayStatus:
        try:
            return self._stub.GetStatus(pb.StatusRequest(), timeout=timeout)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None

    def watch_status(self, timeout: float | None = None) -> Iterator[pb.GatewayStatus]:
        """The gateway's status now and after every change (stream started, ended, failed)."""
        call = self._stub.WatchStatus(pb.StatusRequest(), timeout=timeout)
        try:
            yield from call
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None
        finally:
            call.cancel()

    def wait_for_status(self, predicate: Callable[[pb.GatewayStatus], bool], timeout: float = 60.0) -> pb.GatewayStatus:
        """Block until the gateway's status satisfies ``predicate`` (event-driven, no polling)."""
        for status in self.watch_status(timeout=timeout):
            if predicate(status):
                return status
        raise StagecastError("status stream ended")

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient:
    """The asyncio twin of ``Client``; create it inside a running event loop."""

    def __init__(
        self,
        target: str,
        *,
        token: str | None = None,
        tls: bool | None = None,
        root_certificates: bytes | str | os.PathLike | None = None,
        tls_name: str | None = None,
        options: Sequence[tuple[str, object]] = (),
    ):
        self.target = target
        creds = channel_credentials(token, tls, root_certificates)
        secure = bool(tls) or root_certificates is not None
        opts = [*DEFAULT_OPTIONS, *tls_name_options(tls_name, secure), *options]
        if creds:
            self._channel = grpc.aio.secure_channel(target, creds, options=opts)
        else:
            self._channel = grpc.aio.insecure_channel(target, options=opts)
        self._stub = pb_grpc.StreamServiceStub(self._channel)

    def generate(
        self,
        prompt: str,
        *,
        timeout: float | None = None,
        reconnect: bool = False,
        retry_refused: bool | float = False,
        **config,
    ) -> AsyncGeneration:
        cfg = stream_config(prompt, **config)
        return AsyncGeneration(self._stub, cfg, timeout=timeout, reconnect=reconnect, retry_refused=retry_refused)

    def transform(
        self,
        frames,
        prompt: str,
        *,
        strength: float,
        input_format: str = "jpeg",
        input_quality: int = 95,
        timeout: float | None = None,
        **config,
    ) -> AsyncTransform:
        """``Client.transform`` for asyncio; ``frames`` may also be an async iterable."""
        if isinstance(frames, (str, os.PathLike)):
            from stagecast_client.media import iter_video_frames, video_info

            width, height, fps, _ = video_info(frames)
            config.setdefault("target_fps", fps)
            config.setdefault("input_pacing", "backpressure")
            if config.get("width") is None or config.get("height") is None:
                config["width"], config["height"] = width, height
            frames = iter_video_frames(frames, width=config["width"], height=config["height"])
        cfg = stream_config(prompt, strength=strength, **config)
        return AsyncTransform(
            self._stub, cfg, frames, input_format=input_format, input_quality=input_quality, timeout=timeout
        )

    async def status(self, timeout: float = 10.0) -> pb.GatewayStatus:
        try:
            return await self._stub.GetStatus(pb.StatusRequest(), timeout=timeout)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None

    async def watch_status(self, timeout: float | None = None) -> AsyncIterator[pb.GatewayStatus]:
        call = self._stub.WatchStatus(pb.StatusRequest(), timeout=timeout)
        try:
            async for status in call:
                yield status
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None
        finally:
            call.cancel()

    async def wait_for_status(
        self, predicate: Callable[[pb.GatewayStatus], bool], timeout: float = 60.0
    ) -> pb.GatewayStatus:
        async for status in self.watch_status(timeout=timeout):
            if predicate(status):
                return status
        raise StagecastError("status stream ended")

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
