"""Typed values the client SDK yields, and writing them to an MP4 file.

Usage::

    frame.index, frame.pts, frame.chunk, frame.codec, frame.data     # one generated frame
    frame.to_array()                      # (H, W, 3) uint8 for "jpeg" and "raw" (h264 bytes are not per-frame)
    with Mp4Writer("clip.mp4", fps=16) as mp4:
        for frame in frames: mp4.add(frame)
        mp4.add_trailer(end.trailer)      # h264 only: the last fMP4 fragment
    save_mp4(frames, "clip.mp4", fps=16, trailer=end.trailer)  # the same in one call

For "jpeg" and "raw" the frames are decoded and re-encoded to H.264; for "h264" the gateway already streams a
fragmented MP4, so its bytes are written as they are.
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from stagecast_client import api
from stagecast_client.v1 import stream_pb2 as pb

if TYPE_CHECKING:
    from stagecast_client.media import Mp4Encoder


@dataclass(frozen=True)
class FrameTiming:
    """Gateway timestamps are milliseconds since the gateway received the config; ``received_s`` is seconds since
    this client sent it (so ``received_s`` of frame 0 is the time to first frame)."""

    latents_ms: float
    decoded_ms: float
    encoded_ms: float
    received_s: float


@dataclass(frozen=True)
class Frame:
    index: int
    pts: float  # presentation time, seconds
    chunk: int
    codec: str
    data: bytes
    width: int
    height: int
    timing: FrameTiming
    steps: int = 0  # the denoising steps this frame's chunk ran

    @classmethod
    def from_proto(cls, msg: pb.Frame, received_s: float) -> Frame:
        return cls(
            index=msg.index,
            pts=msg.pts,
            chunk=msg.chunk,
            codec=api.codec_name(msg.codec),
            data=msg.data,
            width=msg.width,
            height=msg.height,
            timing=FrameTiming(msg.latents_ms, msg.decoded_ms, msg.encoded_ms, received_s),
            steps=msg.steps,
        )

    def to_array(self) -> np.ndarray:
        """The frame as ``(H, W, 3)`` uint8 RGB."""
        if self.codec == "raw":
            return np.frombuffer(self.data, dtype=np.uint8).reshape(self.height, self.width, 3)
        if self.codec == "jpeg":
            from PIL import Image

            return np.asarray(Image.open(io.BytesIO(self.data)).convert("RGB"))
        raise ValueError(f"{self.codec} frames are fragments of one MP4 stream; decode the whole stream instead")


@dataclass(frozen=True)
class StreamInfo:
    """The gateway's Started message: the effective config, every field filled in."""

    stream_id: str
    pipeline_stream_id: int
    config: pb.StreamConfig
    total_frames: int | None  # None: until stopped
    num_chunks: int | None
    latent_width: int
    latent_height: int
    # The gateway's clock (ms since it got the config, as ``FrameTiming``): the prompt encoded, the stream admitted.
    prompt_ms: float = 0.0
    opened_ms: float = 0.0
    pipeline: str = ""  # the pipeline serving it (its gateway's --pipeline-name): behind a fleet's door, which one

    @classmethod
    def from_proto(cls, msg: pb.Started) -> StreamInfo:
        return cls(
            stream_id=msg.stream_id,
            pipeline_stream_id=msg.pipeline_stream_id,
            config=msg.config,
            total_frames=msg.total_frames or None,
            num_chunks=msg.num_chunks or None,
            latent_width=msg.latent_width,
            latent_height=msg.latent_height,
            prompt_ms=msg.prompt_ms,
            opened_ms=msg.opened_ms,
            pipeline=msg.pipeline,
        )

    @property
    def width(self) -> int:
        return self.config.width

    @property
    def height(self) -> int:
        return self.config.height

    @property
    def fps(self) -> float:
        return self.config.target_fps

    @property
    def codec(self) -> str:
        """ "jpeg", "h264" or "raw"."""
        return api.codec_name(self.config.codec)

    @property
    def policy(self) -> str:
        """ "per_level" or "clean"."""
        return api.policy_name(self.config.policy)

    @property
    def window(self) -> int | None:
        """KV window in latent frames; None: unbounded."""
        return self.config.window or None

    @property
    def quality(self) -> int:
        return self.config.quality

    @property
    def timesteps(self) -> tuple[float, ...]:
        """The timestep ladder the stream runs, one per denoising step."""
        return tuple(self.config.timesteps)

    @property
    def shift(self) -> float:
        return self.config.shift

    @property
    def decoder(self) -> str:
        """ "full" (the model's VAE) or "tiny": what turned the stream's latents into frames."""
        return api.decoder_name(self.config.decoder)

    @property
    def seed(self) -> int:
        return self.config.seed

    @property
    def min_steps(self) -> int:
        """The fewest steps the SLO controller may run a chunk at (``steps`` for a fixed step count)."""
        return self.config.min_steps

    @property
    def max_steps(self) -> int:
        return self.config.max_steps

    @property
    def pace(self) -> bool:
        """True: generated at ``fps``; False: as fast as the pipeline allows."""
        return self.config.pace


@dataclass(frozen=True)
class EndInfo:
    reason: str  # "completed" | "stopped" (the wire's EndReason)
    frames: int
    trailer: bytes = b""
    input_dropped: int = 0  # video-to-video (LIVE): input frames the gateway dropped, the pipeline being behind


class Mp4Writer:
    """Write frames of any codec to an MP4 file as they arrive (constant memory)."""

    def __init__(self, path: str | os.PathLike, fps: float):
        self.path = path
        self.fps = fps
        self.frames = 0
        self._file = open(path, "wb")  # noqa: SIM115 - closed in close()
        self._encoder: Mp4Encoder | None = None

    def add(self, frame: Frame) -> None:
        if frame.codec == "h264":
            self._file.write(frame.data)
        else:
            from stagecast_client.media import Mp4Encoder

            if self._encoder is None:
                self._encoder = Mp4Encoder(frame.width, frame.height, self.fps)
            self._file.write(self._encoder.encode(frame.to_array()))
        self.frames += 1

    def add_trailer(self, trailer: bytes) -> None:
        self._file.write(trailer)

    def close(self) -> None:
        if self._encoder is not None:
            self._file.write(self._encoder.flush())
            self._encoder.close()
            self._encoder = None
        self._file.close()

    def __enter__(self) -> Mp4Writer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def save_mp4(frames: Iterable[Frame], path: str | os.PathLike, *, fps: float, trailer: bytes = b"") -> int:
    """Write ``frames`` (and an h264 stream's ``End.trailer``) to ``path``; returns the number of frames."""
    with Mp4Writer(path, fps) as mp4:
        for frame in frames:
            mp4.add(frame)
        mp4.add_trailer(trailer)
    return mp4.frames
