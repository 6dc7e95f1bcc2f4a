"""Video-to-video input in the gateway: a stream's input frames in, noised latent chunks out to the pipeline.

Usage (``gateway.stream.run.StreamRun`` does this for a stream whose config has ``strength``)::

    path = InputPath(cfg, encoder, submit=pipeline.submit_input, metrics=metrics, now_ms=run.ms)
    path.offer(frame_msg)            # request reader: decode and check (ConfigError naming the field), then queue
    path.end()                       # the client sent Stop or closed its side: the input is over
    reason = path.run()              # the input thread: "stopped", "input_stalled", or None once aborted
    path.frames_of(chunk)            # the decoder: [(pts, input_ms), ...] of the input frames chunk was made from
    path.progress()                  # the pipeline reader: a chunk came back (a BACKPRESSURE stream may submit more)
    path.abort()                     # the stream ended otherwise: wake and stop everything, free the VAE cache

**The path of a frame.** The request reader decodes it (JPEG or raw RGB; its size must be the stream's) and queues it.
The input thread VAE-encodes frames as they complete latent frames (``gateway.decode.stream_vae.StreamVAEEncoder``:
frame 0
alone, then groups of 4, with the encoder's causal-conv cache kept per stream), gathers ``chunk_frames`` latent frames
into a chunk, noises it to the stream's ``strength`` (flow matching: ``(1 - sigma) z + sigma noise``, the noise drawn
from the stream's seed and the chunk's index, as ``FlowMatchEulerDiscreteScheduler.scale_noise`` does) and submits it
to the coordinator, which starts the chunk's denoising from that level (``StreamSpec.input_latents``).  Output frame
``i`` of a chunk is decoded from the same latent frame as input frame ``i`` was encoded into, so it carries that
frame's pts.

**The clock is the input.**
- Input faster than the pipeline, ``LIVE``: at most ``QUEUE_CHUNKS`` chunks of frames wait to be encoded; beyond that
  the oldest queued frame is dropped.  A chunk the coordinator will not take yet (``MAX_PENDING_INPUTS`` of the
  stream's chunks already wait for it) is dropped whole.  Both count in
  ``stagecast_gateway_input_frames_dropped_total{reason="behind"}`` and the stream's ``input_frames_dropped``.
- ``BACKPRESSURE``: nothing is dropped.  A full queue blocks the request reader (so gRPC flow control holds the
  client back), and a chunk the coordinator will not take yet is offered again after the next chunk comes back.
- Input stalls: the stream waits for the next frame up to ``input_timeout`` seconds, then its input is over
  (``input_stalled``).  Over either way (that, or Stop / the client closing its side), the chunks already submitted
  are finished and delivered and the stream ends.
- The input's tail inside a chunk (it ended between chunk boundaries): its last frame is repeated until the chunk is
  complete, so every input frame gets its restyled frame; the decoder gives back only the frames of real input (the
  chunk's frames carry their pts), and ``padded`` counts the repeats.  Frames sent after the input ended are dropped
  (``reason="partial_chunk"``).
"""

from __future__ import annotations

import io
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable

import numpy as np
import torch

from gateway.decode.stream_vae import StreamVAEEncoder
from gateway.edge.config import ConfigError, EffectiveConfig
from stagecast.sampling import sigmas
from stagecast.v1 import stream_pb2 as pb

logger = logging.getLogger(__name__)

QUEUE_CHUNKS = 2  # chunks' worth of input frames that may wait for the encoder
BACKPRESSURE_RETRY_S = 0.5  # a BACKPRESSURE chunk the coordinator refused is offered again at least this often

_END = object()


def decode_frame(frame: pb.InputFrame, width: int, height: int) -> np.ndarray:
    """An input frame as ``(height, width, 3)`` uint8 RGB, or ``ConfigError`` naming the field at fault."""
    data = frame.data
    if frame.format == pb.INPUT_FORMAT_RAW:
        if len(data) != width * height * 3:
            raise ConfigError(
                "frame.data",
                f"a RAW frame of this {width}x{height} stream is {width * height * 3} bytes (RGB24), got {len(data)}",
            )
        return np.frombuffer(data, dtype=np.uint8).reshape(height, width, 3)
    if frame.format != pb.INPUT_FORMAT_JPEG:
        got = pb.InputFormat.Name(frame.format) if frame.format in pb.InputFormat.values() else frame.format
        raise ConfigError("frame.format", f"must be INPUT_FORMAT_JPEG or INPUT_FORMAT_RAW, got {got}")
    from PIL import Image

    try:
        image = Image.open(io.BytesIO(data), formats=["JPEG"])  # reads the header only
    except Exception as exc:  # UnidentifiedImageError, truncated headers, ...
        raise ConfigError("frame.data", f"{len(data)} bytes that are not a JPEG ({type(exc).__name__})") from None
    if image.size != (width, height):  # checked before the pixels are decoded: no decompression bombs
        raise ConfigError("frame.data", f"the JPEG is {image.size[0]}x{image.size[1]}; this stream is {width}x{height}")
    try:
        rgb = np.asarray(image.convert("RGB"))
    except Exception as exc:  # truncated or corrupt scan data
        raise ConfigError("frame.data", f"the JPEG does not decode ({type(exc).__name__}: {exc})") from None
    return rgb


def encode_image(encoder: StreamVAEEncoder, rgb: np.ndarray) -> torch.Tensor:
    """An image-to-video stream's first frame as its normalised latent (1, C, 1, h, w) float32: the VAE encode of one
    frame, as ``WanImageToVideoPipeline.prepare_latents`` computes its condition."""
    video = torch.from_numpy(np.ascontiguousarray(rgb)).permute(2, 0, 1)[None, :, None]
    video = video.to(encoder.device).float() / 255.0 * 2.0 - 1.0
    state = encoder.new_state()
    try:
        return encoder.encode_frames(state, video).float().cpu()
    finally:
        encoder.release(state)


def input_noise(seed: int, chunk: int, shape: tuple[int, ...]) -> torch.Tensor:
    """The noise a video-to-video chunk's input is mixed with: deterministic by (stream seed, chunk), on the CPU.

    The generator seed never equals one the stages draw level noise from (``chunk_noise`` uses ``... + level`` with
    level <= 50; this uses ``... + 1000``)."""
    g = torch.Generator(device="cpu").manual_seed((seed * 1_000_003 + chunk * 1009 + 1000) % (2**63))
    return torch.randn(shape, generator=g, dtype=torch.float32)


def noise_to(latents: torch.Tensor, sigma: float, noise: torch.Tensor) -> torch.Tensor:
    """``FlowMatchEulerDiscreteScheduler.scale_noise``: the clean latents ``latents`` at noise level ``sigma``."""
    return sigma * noise + (1.0 - sigma) * latents.float().cpu()


class InputPath:
    def __init__(
        self,
        cfg: EffectiveConfig,
        encoder: StreamVAEEncoder,
        *,
        submit: Callable[[int, torch.Tensor], bool],
        metrics,
        now_ms: Callable[[], float],
        temporal_factor: int = 4,
    ):
        if cfg.strength is None:
            raise ValueError("not a video-to-video stream")
        self.cfg = cfg
        self.encoder = encoder
        self.submit = submit  # (chunk, latents) -> True: accepted; False: the coordinator holds enough already
        self.metrics = metrics
        self.now_ms = now_ms
        self.live = cfg.input_pacing == "live"
        self.sigma = sigmas(cfg.pipeline_timesteps, cfg.shift)[0]
        self.capacity = QUEUE_CHUNKS * temporal_factor * cfg.chunk_frames + 1
        self.temporal_factor = temporal_factor
        self.received = 0
        self.dropped = 0  # frames dropped because the pipeline was behind (LIVE): the status's input_frames_dropped
        self.partial = 0  # frames that came after the input's end (dropped)
        self.padded = 0  # repeats of the last frame that completed the input's last chunk
        self.last_pts = -math.inf
        self._queue: deque = deque()  # (frame, pts, input_ms) or _END
        self._cond = threading.Condition()
        self._closed = False  # aborted: everything stops
        self._progress = 0  # chunks the pipeline gave back
        self._chunk_frames: dict[int, list[tuple[float, float]]] = {}  # accepted chunk -> its frames' (pts, ms)
        self.state = encoder.new_state()

    @property
    def state_bytes(self) -> int:
        """The encoder cache and the frames waiting for it (what the stream's status counts as VAE state)."""
        with self._cond:
            queued = sum(item[0].nbytes for item in self._queue if item is not _END)
        return self.state.approx_bytes + queued

    # ---- the request reader -------------------------------------------------------------------------------

    def offer(self, frame: pb.InputFrame) -> bool:
        """Check and queue one input frame; False once the path is closed.  Raises ``ConfigError`` naming the
        field.  LIVE: never blocks (drops the oldest queued frame when full); BACKPRESSURE: blocks while full."""
        pts = frame.pts
        if not math.isfinite(pts) or pts < 0:
            raise ConfigError("frame.pts", f"must be a finite number of seconds >= 0, got {pts}")
        if pts <= self.last_pts:
            raise ConfigError("frame.pts", f"must increase strictly: {pts:g} follows {self.last_pts:g}")
        rgb = decode_frame(frame, self.cfg.width, self.cfg.height)
        self.last_pts = pts
        item = (rgb, pts, self.now_ms())
        with self._cond:
            if self.live:
                if len(self._queue) >= self.capacity:
                    self._queue.popleft()
                    self._drop("behind", 1)
            else:
                self._cond.wait_for(lambda: self._closed or len(self._queue) < self.capacity)
            if self._closed:
                return False
            self._queue.append(item)
            self.received += 1
            self._cond.notify_all()
        self.metrics.input_frame()
        return True

    def end(self) -> None:
        """The input is over (Stop, or the client closed its side): the queued frames are still used."""
        with self._cond:
            if not self._queue or self._queue[-1] is not _END:
                self._queue.append(_END)
            self._cond.notify_all()

    # ---- the pipeline reader and the decoder ---------------------------------------------------------------

    def progress(self) -> None:
        with self._cond:
            self._progress += 1
            self._cond.notify_all()

    def frames_of(self, chunk: int) -> list[tuple[float, float]]:
        with self._cond:
            return self._chunk_frames.pop(chunk, [])

    def abort(self) -> None:
        with self._cond:
            self._closed = True
            self._queue.clear()
            self._cond.notify_all()

    # ---- the input thread ---------------------------------------------------------------------------------

    def run(self) -> str | None:
        """Encode, noise and submit chunks until the input is over ("stopped" or "input_stalled"), or the path is
        aborted (None).  Frees the encoder's cache on the way out."""
        try:
            return self._run()
        finally:
            self.encoder.release(self.state)

    def _run(self) -> str | None:
        cfg = self.cfg
        metas: deque[tuple[float, float] | None] = deque()  # frames given to the encoder, not yet in a latent frame
        latents: list[torch.Tensor] = []  # latent frames of the chunk being gathered
        chunk_metas: list[tuple[float, float]] = []  # the real frames of the chunk being gathered (pads have none)
        chunk = 0  # the next chunk index the pipeline expects (a dropped chunk's index is used by the next one)

        def feed(rgb: np.ndarray, meta: tuple[float, float] | None) -> bool:
            """Encode one frame (``meta`` None: a repeat that pads the tail) and submit the chunk it completes; False
            once aborted."""
            nonlocal latents, chunk_metas, chunk
            metas.append(meta)
            start = time.perf_counter()
            video = torch.from_numpy(rgb.copy()).permute(2, 0, 1)[None, :, None]  # (1, 3, 1, H, W) uint8
            video = video.to(self.encoder.device).float() / 255.0 * 2.0 - 1.0  # diffusers' VideoProcessor
            z = self.encoder.encode_frames(self.state, video)
            if z is None:
                return True
            for i in range(z.shape[2]):
                group = 1 if self.state.latent_frames - z.shape[2] + i == 0 else self.temporal_factor
                chunk_metas.extend(m for m in (metas.popleft() for _ in range(group)) if m is not None)
                latents.append(z[:, :, i : i + 1])
                if len(latents) < cfg.chunk_frames:
                    continue
                clean = torch.cat(latents, dim=2)
                x = noise_to(clean, self.sigma, input_noise(cfg.seed, chunk, tuple(clean.shape)))
                self.metrics.input_encoded(time.perf_counter() - start)
                accepted = self._submit(chunk, x, chunk_metas)
                if accepted is None:
                    return False
                if accepted:
                    chunk += 1
                latents, chunk_metas = [], []
            return True

        last = None
        while True:
            with self._cond:
                if not self._cond.wait_for(lambda: self._closed or self._queue, timeout=cfg.input_timeout):
                    reason = "input_stalled"
                    break
                if self._closed:
                    return None
                item = self._queue.popleft()
                self._cond.notify_all()
            if item is _END:
                reason = "stopped"
                break
            rgb, pts, ms = item
            last = rgb
            if not feed(rgb, (pts, ms)):
                return None
        # The input ended inside a chunk: repeat its last frame until the chunk is complete (at most a chunk's frames).
        while metas or latents:
            if not feed(last, None):
                return None
            self.padded += 1
        if self.padded:
            logger.debug("input: the last chunk was completed with %d repeats of the last frame", self.padded)
        self._drop("partial_chunk", self._pending_frames())
        return reason

    def _pending_frames(self) -> int:
        with self._cond:
            return sum(1 for item in self._queue if item is not _END)

    def _submit(self, chunk: int, x: torch.Tensor, metas: list[tuple[float, float]]) -> bool | None:
        """True: the pipeline took the chunk; False: dropped (LIVE, the pipeline is behind); None: aborted."""
        with self._cond:
            self._chunk_frames[chunk] = list(metas)
        while True:
            with self._cond:
                if self._closed:
                    return None
                seen = self._progress
            if self.submit(chunk, x):
                return True
            if self.live:
                with self._cond:
                    self._chunk_frames.pop(chunk, None)
                self._drop("behind", len(metas))
                return False
            with self._cond:  # BACKPRESSURE: offer it again once a chunk came back (or after a while)
                came_back = lambda seen=seen: self._closed or self._progress > seen  # noqa: E731
                self._cond.wait_for(came_back, timeout=BACKPRESSURE_RETRY_S)

    def _drop(self, reason: str, frames: int) -> None:
        if frames <= 0:
            return
        with self._cond:
            if reason == "partial_chunk":
                self.partial += frames  # after the input's end: not the pipeline being behind
            else:
                self.dropped += frames
        self.metrics.input_frames_dropped(reason, frames)
        logger.debug("input: dropped %d frames (%s)", frames, reason)
