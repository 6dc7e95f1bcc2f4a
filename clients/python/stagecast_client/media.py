"""Encode generated RGB frames into the bytes the gateway streams to clients.

Usage::

    enc = make_encoder("h264", width=832, height=480, fps=16)
    for frame in frames:                 # (H, W, 3) uint8, numpy or torch
        chunk = enc.encode(frame)        # may be b"" until a fragment completes
        if chunk:
            send(chunk)
    send(enc.flush())                    # the tail; the encoder is finished afterwards

Codecs (``CODECS``):

* ``"jpeg"`` - one self-contained JPEG image per frame (Pillow).
* ``"h264"`` - one fragmented-MP4 byte stream (PyAV/FFmpeg).  The concatenation of every chunk is a
  playable MP4: the first chunk carries ``ftyp``+``moov``, each later one whole ``moof``+``mdat``
  fragments, so it can be fed to a browser's MediaSource or written to a file as it arrives.  The gateway makes
  one fragment per chunk (``make_encoder(..., chunked=True)`` and ``keyframe=True`` on each chunk's first frame).
* ``"raw"`` - the frame's RGB24 bytes, lossless, so end-to-end tests can compare frames bit for bit
  (``raw_to_frames`` turns them back into arrays).

Helpers ``write_mp4`` and ``read_mp4_frames`` are shared by the tests and the client SDK.
"""

from __future__ import annotations

import functools
import io
import logging
import operator
import os
from collections.abc import Iterable
from fractions import Fraction

import numpy as np

from stagecast_client.api import DEFAULT_FPS

logger = logging.getLogger(__name__)

CODECS = ("jpeg", "h264", "raw")

DEFAULT_JPEG_QUALITY = 90
DEFAULT_CRF = 23  # x264's own default

# H.264 encoders to try, best first.  libx264 is in PyAV's bundled FFmpeg; the others cover FFmpeg builds without
# GPL components and machines with hardware encoders.
H264_ENCODERS = (
    "libx264",
    "libopenh264",
    "h264_nvenc",
    "h264_qsv",
    "h264_amf",
    "h264_videotoolbox",
    "h264_mf",
    "h264_vaapi",
    "h264_v4l2m2m",
)

# frag_keyframe: cut a fragment at every keyframe; empty_moov: write the init segment up front instead of a moov at
# the end (which would need a seekable output); default_base_moof: the layout MediaSource expects.
MP4_MOVFLAGS = "frag_keyframe+empty_moov+default_base_moof"

__all__ = [
    "CODECS",
    "H264_ENCODERS",
    "FrameEncoder",
    "JpegEncoder",
    "Mp4Encoder",
    "RawEncoder",
    "as_rgb_frame",
    "find_h264_encoder",
    "make_encoder",
    "quality_to_crf",
    "raw_to_frames",
    "read_mp4_frames",
    "write_mp4",
]


def as_rgb_frame(frame, *, width: int | None = None, height: int | None = None) -> np.ndarray:
    """Return ``frame`` as a C-contiguous ``(H, W, 3)`` uint8 numpy array, or raise ``ValueError`` naming ``frame``.

    Accepts numpy arrays and torch tensors (on any device); torch is not imported here so the client SDK does not
    need it.
    """
    if hasattr(frame, "detach") and hasattr(frame, "cpu"):
        frame = frame.detach().cpu().numpy()
    if not isinstance(frame, np.ndarray):
        raise ValueError(f"frame must be a numpy array or torch tensor, got {type(frame).__name__}")
    if frame.ndim != 3 or frame.shape[2] != 3:
        raise ValueError(f"frame must have shape (H, W, 3), got {tuple(frame.shape)}")
    if frame.dtype != np.uint8:
        raise ValueError(f"frame must be uint8, got {frame.dtype}")
    h, w = frame.shape[:2]
    if (width is not None and w != width) or (height is not None and h != height):
        raise ValueError(f"frame is {w}x{h} but the encoder was opened for {width}x{height}")
    return np.ascontiguousarray(frame)


def _check_size(width: int, height: int) -> tuple[int, int]:
    try:
        width, height = operator.index(width), operator.index(height)  # ints and numpy integers, not floats
    except TypeError:
        raise ValueError(f"width and height must be positive integers, got {width!r}x{height!r}") from None
    if width < 1 or height < 1:
        raise ValueError(f"width and height must be positive integers, got {width}x{height}")
    return width, height


def _as_fps(fps: float | Fraction) -> Fraction:
    if not fps or fps <= 0:
        raise ValueError(f"fps must be > 0, got {fps!r}")
    # Containers store rates as rationals; 1001 covers NTSC-style rates such as 30000/1001.
    return Fraction(fps).limit_denominator(1001)


def quality_to_crf(quality: int) -> int:
    """Map the API's ``quality`` (1 worst .. 100 best) linearly onto x264's CRF (51 worst .. 0 best)."""
    _check_quality(quality)
    return round((100 - quality) * 51 / 100)


def _check_quality(quality: int) -> None:
    if not isinstance(quality, int) or not 1 <= quality <= 100:
        raise ValueError(f"quality must be an integer in 1..100, got {quality!r}")


class FrameEncoder:
    """Common interface: ``encode(frame) -> bytes`` per frame, ``flush() -> bytes`` once at the end.

    ``keyframe=True`` marks a frame that starts a unit the viewer should be able to start from (the gateway passes
    it on the first frame of every chunk); codecs whose every frame stands alone ignore it."""

    codec: str = ""
    content_type: str = "application/octet-stream"

    def encode(self, frame, keyframe: bool = False) -> bytes:
        raise NotImplementedError

    def flush(self) -> bytes:
        """Bytes still held back; stateless codecs hold none."""
        return b""

    def close(self) -> None:
        """Release resources without producing output (e.g. the client went away)."""


class JpegEncoder(FrameEncoder):
    """One baseline JPEG per frame.

    Pillow (libjpeg-turbo) rather than FFmpeg's mjpeg: its 1..100 quality is the knob clients know, while mjpeg
    needs qscale flags and a codec context per frame size.
    """

    codec = "jpeg"
    content_type = "image/jpeg"

    def __init__(
        self, width: int | None = None, height: int | None = None, *, quality: int = DEFAULT_JPEG_QUALITY
    ) -> None:
        _check_quality(quality)
        if width is not None or height is not None:
            width, height = _check_size(width, height)
        self.width, self.height, self.quality = width, height, quality

    def encode(self, frame, keyframe: bool = False) -> bytes:
        from PIL import Image

        arr = as_rgb_frame(frame, width=self.width, height=self.height)
        buf = io.BytesIO()
        Image.fromarray(arr, mode="RGB").save(buf, format="JPEG", quality=self.quality)
        return buf.getvalue()


class RawEncoder(FrameEncoder):
    """Lossless: each frame's RGB24 bytes, row-major, ``height * width * 3`` bytes per frame."""

    codec = "raw"
    content_type = "application/x-rgb24"

    def __init__(self, width: int, height: int) -> None:
        width, height = _check_size(width, height)
        self.width, self.height = width, height

    def encode(self, frame, keyframe: bool = False) -> bytes:
        return as_rgb_frame(frame, width=self.width, height=self.height).tobytes()


def raw_to_frames(data: bytes, width: int, height: int) -> np.ndarray:
    """Inverse of ``RawEncoder``: concatenated frame bytes -> ``(N, H, W, 3)`` uint8 array."""
    frame_bytes = width * height * 3
    if frame_bytes == 0 or len(data) % frame_bytes:
        raise ValueError(f"{len(data)} bytes is not a whole number of {width}x{height} RGB24 frames")
    return np.frombuffer(data, dtype=np.uint8).reshape(-1, height, width, 3)


class _ByteSink:
    """Write-only file object for the muxer that hands out what was written since the last ``take``.

    It deliberately has no ``seek``/``tell``: PyAV then marks the output unseekable, so the mp4 muxer never goes
    back to patch bytes that were already sent to a client.
    """

    def __init__(self) -> None:
        self._buf = bytearray()

    def write(self, data) -> int:
        self._buf += data
        return len(data)

    def take(self) -> bytes:
        out = bytes(self._buf)
        self._buf.clear()
        return out


@functools.cache
def _probe_encoder(name: str) -> bool:
    import av

    try:
        codec = av.codec.Codec(name, "w")
        ctx = av.CodecContext.create(codec)
        ctx.width, ctx.height = 64, 64
        formats = [f.name for f in (codec.video_formats or ())]
        ctx.pix_fmt = "yuv420p" if not formats or "yuv420p" in formats else formats[0]
        ctx.time_base = Fraction(1, 25)
        # Hardware encoders are compiled into FFmpeg builds that run on machines without the hardware; only
        # opening one proves it works here.
        ctx.open()
    except Exception as exc:  # any failure just means "not usable here"
        logger.debug("H.264 encoder %s unusable: %s", name, exc)
        return False
    return True


def find_h264_encoder(candidates: Iterable[str] = H264_ENCODERS) -> str:
    """First usable H.264 encoder in ``candidates``; ``RuntimeError`` if none (probe results are cached)."""
    candidates = tuple(candidates)
    for name in candidates:
        if _probe_encoder(name):
            return name
    raise RuntimeError(
        f"no usable H.264 encoder in this FFmpeg build (tried {', '.join(candidates)}); "
        f"install PyAV wheels that bundle libx264 or use the 'jpeg' codec"
    )


class Mp4Encoder(FrameEncoder):
    """Streaming H.264 in fragmented MP4, tuned for latency (x264 ``ultrafast`` + ``zerolatency``: no B-frames, no
    lookahead, one packet out per frame in).

    A fragment is emitted when the *next* keyframe arrives, so output lags by up to ``gop`` frames; ``gop`` defaults
    to one second of video.  ``fragment_every_frame=True`` cuts a fragment per frame instead (one frame of lag, ~100
    bytes of overhead per frame).  ``crf`` only applies to libx264; other encoders use their default rate control.
    Not thread-safe: use one encoder per stream.
    """

    codec = "h264"
    content_type = "video/mp4"

    def __init__(
        self,
        width: int,
        height: int,
        fps: float | Fraction = DEFAULT_FPS,
        *,
        crf: int = DEFAULT_CRF,
        gop: int | None = None,
        fragment_every_frame: bool = False,
        encoder_name: str | None = None,
    ) -> None:
        import av

        width, height = _check_size(width, height)
        if width % 2 or height % 2:
            # yuv420p halves the chroma planes, so H.264 encoders reject odd sizes (x264 fails at open time).
            raise ValueError(f"h264 needs an even width and height, got {width}x{height}")
        if not isinstance(crf, int) or not 0 <= crf <= 51:
            raise ValueError(f"crf must be an integer in 0..51, got {crf!r}")
        rate = _as_fps(fps)
        gop = max(1, round(rate)) if gop is None else gop
        if not isinstance(gop, int) or gop < 1:
            raise ValueError(f"gop must be a positive integer, got {gop!r}")

        self.width, self.height, self.fps, self.gop, self.crf = width, height, rate, gop, crf
        self.encoder_name = encoder_name or find_h264_encoder()
        movflags = MP4_MOVFLAGS + ("+frag_every_frame" if fragment_every_frame else "")

        self._sink = _ByteSink()
        self._container = av.open(self._sink, mode="w", format="mp4", options={"movflags": movflags})
        stream = self._container.add_stream(self.encoder_name, rate=rate)
        stream.width, stream.height = width, height
        formats = [f.name for f in (stream.codec_context.codec.video_formats or ())]
        stream.pix_fmt = "yuv420p" if not formats or "yuv420p" in formats else formats[0]
        stream.codec_context.gop_size = gop
        if self.encoder_name == "libx264":
            stream.options = {"preset": "ultrafast", "tune": "zerolatency", "crf": str(crf)}
        self._stream = stream
        self._frames = 0
        self._closed = False
        logger.debug(
            "mp4 encoder %s %dx%d @ %s fps, gop=%d, movflags=%s", self.encoder_name, width, height, rate, gop, movflags
        )

    @property
    def frames(self) -> int:
        return self._frames

    def encode(self, frame, keyframe: bool = False) -> bytes:
        """``keyframe=True`` forces an IDR frame here, which (with ``frag_keyframe``) starts a new fragment and
        writes out the previous one: the gateway forces one at every chunk's first frame, so each fragment holds
        one chunk and a chunk's frames are playable once the next chunk starts (not after a whole GOP)."""
        import av

        if self._closed:
            raise RuntimeError("encode() after flush()/close()")
        arr = as_rgb_frame(frame, width=self.width, height=self.height)
        vf = av.VideoFrame.from_ndarray(arr, format="rgb24")
        if keyframe:
            vf.pict_type = av.video.frame.PictureType.I
        vf.pts = self._frames  # in units of the stream's 1/fps time base
        self._frames += 1
        # PyAV converts rgb24 to the encoder's pixel format (BT.601, limited range) inside encode().
        for packet in self._stream.encode(vf):
            self._container.mux(packet)
        return self._sink.take()

    def flush(self) -> bytes:
        """Drain the encoder, write the last fragment and the trailer; returns the remaining bytes."""
        if self._closed:
            return b""
        for packet in self._stream.encode(None):
            self._container.mux(packet)
        self._closed = True
        self._container.close()
        return self._sink.take()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            try:
                self._container.close()
            except Exception as exc:  # closing an abandoned stream must not raise
                logger.debug("closing mp4 encoder: %s", exc)
            self._sink.take()


def make_encoder(
    codec: str,
    *,
    width: int,
    height: int,
    fps: float | Fraction = DEFAULT_FPS,
    quality: int | None = None,
    chunked: bool = False,
) -> FrameEncoder:
    """Encoder for one stream.  ``quality`` (1..100, ``None`` = codec default) is JPEG quality for "jpeg", maps to
    CRF via ``quality_to_crf`` for "h264", and is checked but unused for the lossless "raw".  ``fps`` is checked for
    every codec so a bad request fails the same way whatever the codec.  ``chunked``: the caller marks each chunk's
    first frame ``keyframe=True`` and h264 cuts fragments only there (one fragment per chunk; x264 adds no keyframes
    of its own within 10 s)."""
    if codec not in CODECS:
        raise ValueError(f"codec must be one of {', '.join(CODECS)}; got {codec!r}")
    rate = _as_fps(fps)
    if codec == "jpeg":
        return JpegEncoder(width, height, quality=DEFAULT_JPEG_QUALITY if quality is None else quality)
    if codec == "h264":
        crf = DEFAULT_CRF if quality is None else quality_to_crf(quality)
        return Mp4Encoder(width, height, rate, crf=crf, gop=max(1, round(10 * rate)) if chunked else None)
    if quality is not None:
        _check_quality(quality)
    return RawEncoder(width, height)


def write_mp4(
    path: str | os.PathLike, frames: Iterable, fps: float | Fraction = DEFAULT_FPS, *, crf: int = DEFAULT_CRF
) -> int:
    """Write frames to an (fragmented) MP4 file, sized from the first frame; returns the number of frames."""
    frames = iter(frames)
    try:
        first = as_rgb_frame(next(frames))
    except StopIteration:
        raise ValueError("write_mp4 needs at least one frame") from None
    height, width = first.shape[:2]
    enc = Mp4Encoder(width, height, fps, crf=crf)
    try:
        with open(path, "wb") as f:
            f.write(enc.encode(first))
            for frame in frames:
                f.write(enc.encode(frame))
            f.write(enc.flush())
    finally:
        enc.close()
    return enc.frames


def read_mp4_frames(source: str | os.PathLike | bytes | io.IOBase) -> list[np.ndarray]:
    """Decode every video frame of an MP4 (path, bytes, or file object) to ``(H, W, 3)`` uint8 RGB arrays."""
    import av

    if isinstance(source, (bytes, bytearray, memoryview)):
        source = io.BytesIO(bytes(source))
    elif isinstance(source, os.PathLike):
        source = os.fspath(source)
    with av.open(source, mode="r") as container:
        return [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]


def video_info(path: str | os.PathLike) -> tuple[int, int, float, int]:
    """``(width, height, fps, frames)`` of a video file's first video stream (frames 0 when the container does not
    say)."""
    import av

    with av.open(os.fspath(path), mode="r") as container:
        stream = container.streams.video[0]
        rate = stream.average_rate or stream.guessed_rate or DEFAULT_FPS
        return stream.codec_context.width, stream.codec_context.height, float(rate), int(stream.frames or 0)


def iter_video_frames(
    path: str | os.PathLike, *, width: int | None = None, height: int | None = None
) -> Iterable[tuple[np.ndarray, float]]:
    """Decode a video file frame by frame (constant memory): ``(rgb (H, W, 3) uint8, pts seconds)``, scaled to
    ``width`` x ``height`` when given.  Frames without a timestamp get ``index / fps``."""
    import av

    with av.open(os.fspath(path), mode="r") as container:
        stream = container.streams.video[0]
        fps = float(stream.average_rate or stream.guessed_rate or DEFAULT_FPS)
        for index, frame in enumerate(container.decode(stream)):
            pts = float(frame.time) if frame.time is not None else index / fps
            if width is not None and height is not None and (frame.width, frame.height) != (width, height):
                frame = frame.reformat(width=width, height=height)
            yield frame.to_ndarray(format="rgb24"), pts
