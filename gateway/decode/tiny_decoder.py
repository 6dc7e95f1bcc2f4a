"""A tiny streaming decoder for Wan latents: our implementation of the TAEHV decoder design (MIT, madebyollin/taehv).

It loads the published weights (``taew2_1.pth``: Wan2.1 and Wan2.2-A14B latents, 16 channels; ``taew2_2.pth``:
Wan2.2-TI2V-5B, 48 channels and a 2x2 pixel-shuffle patch; or their ``.safetensors``) by their own key names and
has the surface of ``gateway.decode.stream_vae.ChunkDecoder``, so ``LocalDecoder([decoder])`` drives it::

    decoder = load_tiny_decoder("/models/taew2_1.pth", device="cuda", dtype=torch.float16)
    state = decoder.new_state()                          # one per stream
    for latents in chunks:                               # the DiT's latents as they are, (1, C, T, h, w)
        video = decoder.decode_chunk(state, latents)     # (1, 3, F, 8h, 8w) in [0, 1]; F = 4T - 3, then 4T
        frames = tiny_to_uint8_frames(video)             # (F, H, W, 3) uint8, round(255 x)
    decoder.release(state)
    videos = decoder.decode_batch([s1, s2], [x1, x2])    # several streams' chunks (same shape) in one call

The design: ``Clamp`` (``tanh(x / 3) * 3``), a 3x3 conv to 256 channels, then three stages of three ``MemBlock`` s,
a nearest 2x ``Upsample``, a ``TGrow`` (1x1 conv C -> s C regrouped into s sub-frames: s = 1, 2, 2, so one latent
frame becomes 4 frames) and a 3x3 conv narrowing 256 -> 128 -> 64 -> 64, then ReLU and a 3x3 conv to RGB (x 4 with
the patch, pixel-shuffled). A ``MemBlock`` convolves ``cat[x, past]`` and adds ``x``, ``past`` being the block's
input one frame earlier (zeros at a stream's start). Those nine ``past`` tensors are all a stream carries between
chunks (``TinyStreamState``; ~64 MiB in fp16 at 480x832). A stream's first 3 output frames are dropped, so T latent
frames give 4T - 3 frames, as the Wan VAE does. TAEHV takes latents without the Wan VAE's mean/std and gives RGB in
[0, 1] (the Wan VAE gives [-1, 1]).

Exactness: every layer runs one frame at a time (a (B, C, H, W) tensor, B the streams of the call), whatever the
chunking, so decoding a stream chunk by chunk equals decoding all of it in one call bit for bit. On a CPU,
oneDNN picks other kernels for a batch of one than for several (measured: ~1e-6 apart), so there each stream's
convolution runs alone and ``decode_batch`` equals decoding each stream alone bit for bit; on a GPU the batch runs
as one convolution (that is the point of batching), and agrees with the lone decode to rounding.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from os import PathLike
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from gateway.decode.tiny_graphs import TinyFrameGraphs
from stagecast.cuda_graphs import Capture, device_capture

logger = logging.getLogger(__name__)

# The published files are ~10-30 MB; anything far larger is not a tiny decoder.
MAX_FILE_BYTES = 512 * 1024 * 1024
MAX_BATCH = 64  # streams in one decode_batch call
MAX_LATENT_FRAMES = 64  # latent frames in one chunk
MAX_LATENT_SIDE = 512  # latent pixels per side (4096 video pixels with the 8x decoder)
STAGE_CHANNELS = (256, 128, 64, 64)
TIME_STRIDES = (1, 2, 2)  # TGrow per stage: one latent frame -> 4 frames
FRAMES_TO_TRIM = 3  # a stream's first outputs dropped (TAEHV's frames_to_trim = t_upscale - 1)
TEMPORAL_FACTOR = 4


def _conv3(n_in: int, n_out: int, *, bias: bool = True) -> nn.Conv2d:
    return nn.Conv2d(n_in, n_out, 3, padding=1, bias=bias)


def _conv(conv: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """``conv(x)``; on a CPU one sample at a time, because oneDNN's kernel (and its bits) for a batch of one
    differs from the one for a batch of several, and a stream must decode to the same bits alone or batched."""
    if x.device.type == "cpu" and x.shape[0] > 1:
        return torch.cat([conv(x[i : i + 1]) for i in range(x.shape[0])])
    return conv(x)


class Clamp(nn.Module):
    """Soft clamp of the latents to (-3, 3)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x / 3) * 3


class MemBlock(nn.Module):
    """Residual block that also sees its own input one frame earlier (``past``)."""

    def __init__(self, channels: int):
        super().__init__()
        # Indices 0, 2, 4 are the published key names (conv.0.weight, ...); 1 and 3 are ReLUs.
        self.conv = nn.Sequential(
            _conv3(2 * channels, channels), nn.ReLU(), _conv3(channels, channels), nn.ReLU(), _conv3(channels, channels)
        )

    def forward(self, x: torch.Tensor, past: torch.Tensor) -> torch.Tensor:
        h = torch.cat([x, past], dim=1)
        for layer in self.conv:
            h = _conv(layer, h) if isinstance(layer, nn.Conv2d) else F.relu(h)
        return F.relu(h + x)


class TGrow(nn.Module):
    """Temporal upsampling: a 1x1 conv C -> stride * C whose channel groups are consecutive sub-frames."""

    def __init__(self, channels: int, stride: int):
        super().__init__()
        self.stride = stride
        self.conv = nn.Conv2d(channels, channels * stride, 1, bias=False)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        return list(_conv(self.conv, x).chunk(self.stride, dim=1))


class TinyDecoder(nn.Module):
    """The TAEHV decoder. ``decoder`` has the published layout, so its ``state_dict`` keys are the files' own:

    0 Clamp, 1 conv(C, 256), 2 ReLU, 3-5 MemBlock(256), 6 Upsample, 7 TGrow(256, 1), 8 conv(256, 128),
    9-11 MemBlock(128), 12 Upsample, 13 TGrow(128, 2), 14 conv(128, 64), 15-17 MemBlock(64), 18 Upsample,
    19 TGrow(64, 2), 20 conv(64, 64), 21 ReLU, 22 conv(64, 3 patch^2).
    """

    def __init__(self, *, latent_channels: int = 16, patch_size: int = 1):
        super().__init__()
        if latent_channels < 1 or latent_channels > 1024:
            raise ValueError(f"latent_channels must be in 1..1024, got {latent_channels}")
        if patch_size not in (1, 2):
            raise ValueError(f"patch_size must be 1 or 2, got {patch_size}")
        self.latent_channels = latent_channels
        self.patch_size = patch_size
        n = STAGE_CHANNELS
        layers: list[nn.Module] = [Clamp(), _conv3(latent_channels, n[0]), nn.ReLU()]
        for stage, stride in enumerate(TIME_STRIDES):
            c = n[stage]
            layers += [MemBlock(c), MemBlock(c), MemBlock(c), nn.Upsample(scale_factor=2), TGrow(c, stride)]
            layers.append(_conv3(c, n[stage + 1], bias=False))
        layers += [nn.ReLU(), _conv3(n[3], 3 * patch_size**2)]
        self.decoder = nn.Sequential(*layers)

    def state_bytes(self, latent_hw: tuple[int, int], element_size: int) -> int:
        """What one stream's state holds for latents of ``latent_hw`` at ``element_size`` bytes per value."""
        return sum(c * h * w for c, h, w in self.memory_shapes(latent_hw)) * element_size

    def memory_shapes(self, latent_hw: tuple[int, int]) -> list[tuple[int, int, int]]:
        """(C, H, W) of each MemBlock's input, in layer order, for latents of ``latent_hw``."""
        shapes, (h, w), scale = [], latent_hw, 1
        for layer in self.decoder:
            if isinstance(layer, MemBlock):
                shapes.append((layer.conv[2].in_channels, h * scale, w * scale))
            elif isinstance(layer, nn.Upsample):
                scale *= 2
        return shapes

    def frame(self, x: torch.Tensor, memory: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """One latent frame ``(B, C, h, w)`` through the decoder, each layer one (sub-)frame at a time.

        ``memory`` holds each MemBlock's previous input (zeros at a stream's start). Returns the 4 raw output frames
        ``(B, 3 patch^2, 8h, 8w)`` (before pixel shuffle and clamping) and the new memory. Pure: nothing is kept.
        """
        memory = list(memory)
        frames, m = [x], 0
        for layer in self.decoder:
            if isinstance(layer, MemBlock):
                outs = []
                for f in frames:
                    outs.append(layer(f, memory[m]))
                    memory[m] = f
                frames, m = outs, m + 1
            elif isinstance(layer, TGrow):
                frames = [g for f in frames for g in layer(f)]
            elif isinstance(layer, Clamp) and x.device.type == "cpu" and x.shape[0] > 1:
                # Elementwise kernels on a CPU run their vector tail in scalar code, and tanh's two differ in
                # the last bit: one stream at a time keeps a stream's bits independent of the batch.
                frames = [torch.cat([layer(f[i : i + 1]) for i in range(f.shape[0])]) for f in frames]
            elif isinstance(layer, nn.Conv2d):
                frames = [_conv(layer, f) for f in frames]
            else:
                frames = [layer(f) for f in frames]
        return frames, memory

    def postprocess(self, frame: torch.Tensor) -> torch.Tensor:
        """Raw output frame -> RGB in [0, 1]."""
        if self.patch_size > 1:
            frame = F.pixel_shuffle(frame, self.patch_size)
        return frame.clamp(0, 1)


@dataclass
class TinyStreamState:
    """One stream's decode state: each MemBlock's last input ``(1, C, H, W)``, None before the first chunk."""

    memory: list[torch.Tensor] | None = None
    latent_hw: tuple[int, int] | None = None  # fixed by the first chunk: the memory only fits that size
    frames_out: int = 0  # raw decoder frames so far, the trimmed ones included
    released: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    @property
    def frames_decoded(self) -> int:
        """Video frames the stream has given so far."""
        return max(0, self.frames_out - FRAMES_TO_TRIM)

    @property
    def latent_frames(self) -> int:
        return self.frames_out // TEMPORAL_FACTOR

    @property
    def approx_bytes(self) -> int:
        """Memory held by the stream's MemBlock memories (what an admission bound should count per stream)."""
        return sum(t.numel() * t.element_size() for t in self.memory or [])


class TinyStreamDecoder:
    """Decodes any number of streams chunk by chunk with one ``TinyDecoder``; holds no per-stream data.

    The surface of ``gateway.decode.stream_vae.ChunkDecoder`` (``LocalDecoder([it])`` works), plus ``decode_batch``.
    """

    takes_latents = True
    gives_video = True
    output_range = (0, 1)
    temporal_factor = TEMPORAL_FACTOR

    def __init__(self, model: TinyDecoder, *, compile: bool = False):
        self.model = model.eval().requires_grad_(False)
        param = next(model.parameters())
        self.device = param.device
        self.dtype = param.dtype
        self.latent_channels = model.latent_channels
        self.patch_size = model.patch_size
        self.spatial_factor = 8 * model.patch_size
        # torch.compile of one latent frame's pass: every call has the same shapes for a given batch and size.
        self._compiled = torch.compile(model.frame, dynamic=False) if compile else None
        self.graphs: TinyFrameGraphs | None = None  # the passes captured as CUDA graphs (``capture_graphs``)

    def new_state(self) -> TinyStreamState:
        return TinyStreamState()

    def release(self, state: TinyStreamState) -> None:
        """Drop the stream's memories now; the state is unusable after. Waits for a decode of it in progress."""
        with state.lock:
            state.memory = None
            state.released = True

    def decode_chunk(self, state: TinyStreamState, x: torch.Tensor) -> torch.Tensor:
        """One stream's chunk ``(1, C, T, h, w)`` -> video ``(1, 3, F, H, W)`` in [0, 1] (F = 4T - 3 for a stream's
        first chunk, 4T after), advancing ``state``."""
        return self.decode_batch([state], [x])[0]

    @torch.no_grad()
    def decode_batch(
        self, states: list[TinyStreamState], xs: list[torch.Tensor], *, pad_to: int | None = None
    ) -> list[torch.Tensor]:
        """Several streams' chunks, all of one shape, in one pass: each layer runs once per frame for all of them.
        Returns each stream's video, as ``decode_chunk`` of it alone would (bit for bit on a CPU).

        ``pad_to``: run the pass at this batch size, the rows past the streams' being zeros that no stream keeps (so
        a compiled pass sees a few batch sizes only, ``gateway.decode.batched_decoder``'s buckets)."""
        if pad_to is not None and not len(states) <= pad_to <= MAX_BATCH:
            raise ValueError(f"pad_to must be in {len(states)}..{MAX_BATCH} (the streams..MAX_BATCH), got {pad_to}")
        if len(states) != len(xs):
            raise ValueError(f"got {len(states)} states and {len(xs)} chunks")
        if not 1 <= len(states) <= MAX_BATCH:
            raise ValueError(f"a batch holds 1..{MAX_BATCH} streams, got {len(states)}")
        if len({id(s) for s in states}) != len(states):
            raise ValueError("a stream appears twice in one batch")
        for i, x in enumerate(xs):
            self._check(x, f"xs[{i}]")
        if len({tuple(x.shape) for x in xs}) != 1:
            raise ValueError(f"chunks in one batch must have one shape, got {sorted({tuple(x.shape) for x in xs})}")
        ordered = sorted(states, key=id)  # one lock order for every caller
        for s in ordered:
            s.lock.acquire()
        try:
            return self._decode_locked(states, xs, pad_to or len(states))
        finally:
            for s in ordered:
                s.lock.release()

    def _check(self, x: torch.Tensor, name: str) -> None:
        c = self.latent_channels
        if not isinstance(x, torch.Tensor) or x.dim() != 5 or x.shape[0] != 1 or x.shape[1] != c:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{name}: expected latents of shape (1, {c}, T, h, w), got {shape}")
        if not 1 <= x.shape[2] <= MAX_LATENT_FRAMES:
            raise ValueError(f"{name}: a chunk has 1..{MAX_LATENT_FRAMES} latent frames, got {x.shape[2]}")
        if not (1 <= x.shape[3] <= MAX_LATENT_SIDE and 1 <= x.shape[4] <= MAX_LATENT_SIDE):
            raise ValueError(f"{name}: latent sides must be 1..{MAX_LATENT_SIDE}, got {x.shape[3]}x{x.shape[4]}")
        if not x.is_floating_point():
            raise ValueError(f"{name}: latents must be floating point, got {x.dtype}")

    def _decode_locked(self, states: list[TinyStreamState], xs: list[torch.Tensor], rows: int) -> list[torch.Tensor]:
        hw = (xs[0].shape[3], xs[0].shape[4])
        for i, s in enumerate(states):
            if s.released:
                raise ValueError(f"states[{i}] was released")
            if s.latent_hw is not None and s.latent_hw != hw:
                raise ValueError(
                    f"states[{i}]: stream latents are {s.latent_hw[0]}x{s.latent_hw[1]}, got {hw[0]}x{hw[1]}"
                )
        x = torch.cat([x.to(self.device, self.dtype) for x in xs])
        memory = self._gather(states, hw)
        if rows > len(states):  # scratch rows: zeros in, dropped after
            pad = rows - len(states)
            x = torch.cat([x, x.new_zeros(pad, *x.shape[1:])])
            memory = [torch.cat([m, m.new_zeros(pad, *m.shape[1:])]) for m in memory]
        frames: list[torch.Tensor] = []
        for t in range(x.shape[2]):
            # contiguous: elementwise kernels' bits may depend on the layout, which depends on T
            raw, memory = self._frame(x[:, :, t].contiguous(), memory)
            frames += [self.model.postprocess(f) for f in raw]
        self._scatter(states, memory, hw, padded=rows > len(states))
        videos = []
        for b, s in enumerate(states):
            skip = max(0, FRAMES_TO_TRIM - s.frames_out)
            s.frames_out += len(frames)
            videos.append(torch.stack([f[b] for f in frames[skip:]], dim=1).unsqueeze(0))
        return videos

    def _frame(self, x: torch.Tensor, memory: list[torch.Tensor]):
        if self.graphs is not None:
            replayed = self.graphs.run(x, memory)
            if replayed is not None:
                return replayed
        return self._pass(x, memory)

    def _pass(self, x: torch.Tensor, memory: list[torch.Tensor]):
        """One latent frame's pass as it runs without graphs: compiled (``compile``), else eager."""
        if self._compiled is None:
            return self.model.frame(x, memory)
        with _COMPILED_CALLS:
            return self._compiled(x, memory)

    def capture_graphs(
        self, latent_hw: tuple[int, int], rows: Sequence[int], capture: Capture | None = None
    ) -> list[int]:
        """A CUDA graph of the pass for each batch size in ``rows`` at ``latent_hw`` (``gateway.decode.tiny_graphs``;
        after any compile warm-up, before serving); on a CPU the stand-in that re-runs the pass.  Returns the batch
        sizes graphed (each checked bit for bit against the pass); every other call runs as before."""
        if capture is None:
            capture = device_capture(self.device)
        self.graphs = TinyFrameGraphs.capture(
            self._pass,
            rows=rows,
            latent_channels=self.latent_channels,
            memory_shapes=self.model.memory_shapes(latent_hw),
            latent_hw=latent_hw,
            device=self.device,
            dtype=self.dtype,
            capture=capture,
        )
        return self.graphs.rows

    def _gather(self, states: list[TinyStreamState], hw: tuple[int, int]) -> list[torch.Tensor]:
        if len(states) == 1 and states[0].memory is not None:
            return list(states[0].memory)
        shapes = self.model.memory_shapes(hw)
        stats = dict(device=self.device, dtype=self.dtype)
        per_stream = [s.memory or [torch.zeros(1, *shape, **stats) for shape in shapes] for s in states]
        return [torch.cat(ms) for ms in zip(*per_stream, strict=True)]

    def _scatter(
        self, states: list[TinyStreamState], memory: list[torch.Tensor], hw: tuple[int, int], *, padded: bool = False
    ) -> None:
        for b, s in enumerate(states):
            # A copy per stream: a view would keep the whole batch's tensor alive until every stream moved on.
            s.memory = list(memory) if len(states) == 1 and not padded else [m[b : b + 1].clone() for m in memory]
            s.latent_hw = hw


# Dynamo is not thread-safe (one thread compiling while another calls the compiled function fails), and the gateway
# decodes each stream in its own thread: compiled calls take this lock; they only launch kernels.
_COMPILED_CALLS = threading.Lock()


def tiny_to_uint8_frames(video: torch.Tensor) -> torch.Tensor:
    """Decoded video ``(1, 3, F, H, W)`` in [0, 1] -> ``(F, H, W, 3)`` uint8 as ``round(255 x)`` (half to even, in
    float32, after clamping to [0, 1]); the result stays on the video's device."""
    if video.dim() != 5 or video.shape[0] != 1 or video.shape[1] != 3:
        raise ValueError(f"expected one video of shape (1, 3, F, H, W), got {tuple(video.shape)}")
    frames = video[0].permute(1, 2, 3, 0).float().clamp(0, 1)
    return (frames * 255).round().to(torch.uint8)


# ---- files in the published layout ------------------------------------------------------------------------------


def _read_file(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise ValueError(f"tiny decoder file {path} does not exist")
    size = path.stat().st_size
    if size > MAX_FILE_BYTES:
        raise ValueError(f"tiny decoder file {path} is {size} bytes; the limit is {MAX_FILE_BYTES}")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        try:
            sd = load_file(str(path), device="cpu")
        except Exception as exc:
            raise ValueError(f"tiny decoder file {path} is not a readable safetensors file: {exc}") from None
    else:
        try:
            sd = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:
            raise ValueError(f"tiny decoder file {path} is not a readable weights-only torch file: {exc}") from None
    if not isinstance(sd, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in sd.items()):
        raise ValueError(f"tiny decoder file {path} is not a flat state dict of named tensors")
    return sd


def _infer(sd: dict[str, torch.Tensor], path: Path) -> tuple[int, int]:
    """Latent channels and patch size from the first and last convs."""
    for key in ("decoder.1.weight", "decoder.22.weight"):
        if key not in sd:
            raise ValueError(f"tiny decoder file {path}: missing key {key!r}")
        if sd[key].dim() != 4:
            raise ValueError(f"tiny decoder file {path}: key {key!r} has shape {tuple(sd[key].shape)}, not a conv's")
    channels = sd["decoder.1.weight"].shape[1]
    out = sd["decoder.22.weight"].shape[0]
    patch = {3: 1, 12: 2}.get(out)
    if patch is None:
        raise ValueError(
            f"tiny decoder file {path}: key 'decoder.22.weight' gives {out} output channels; expected 3 or 12"
        )
    return channels, patch


def load_tiny_decoder(
    path: str | PathLike,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    compile: bool = False,
) -> TinyStreamDecoder:
    """Load ``taew2_1`` / ``taew2_2`` weights (``.pth`` or ``.safetensors``; ``encoder.*`` keys are ignored).

    The latent channels and patch size come from the weights. A ``TGrow`` conv wider than the module (a file trained
    with more temporal upsampling) keeps its last sub-frame's channels, as upstream's loader does. Any other missing,
    extra or misshapen key is refused with a ValueError naming the first one."""
    path = Path(path)
    sd = {k: v for k, v in _read_file(path).items() if not k.startswith("encoder.")}
    channels, patch = _infer(sd, path)
    model = TinyDecoder(latent_channels=channels, patch_size=patch)
    expected = model.state_dict()
    tgrows = {f"decoder.{i}.conv.weight" for i, m in enumerate(model.decoder) if isinstance(m, TGrow)}
    loaded = {}
    for key, want in expected.items():
        if key not in sd:
            raise ValueError(f"tiny decoder file {path}: missing key {key!r}")
        got = sd[key]
        if not got.is_floating_point():
            raise ValueError(f"tiny decoder file {path}: key {key!r} is {got.dtype}, not floating point")
        if got.shape != want.shape:
            wider = (
                key in tgrows
                and got.dim() == 4
                and got.shape[1:] == want.shape[1:]
                and got.shape[0] > want.shape[0]
                and got.shape[0] % want.shape[0] == 0
            )
            if not wider:
                raise ValueError(
                    f"tiny decoder file {path}: key {key!r} has shape {tuple(got.shape)}, expected {tuple(want.shape)}"
                )
            got = got[-want.shape[0] :]  # the last sub-frame's output channels
        loaded[key] = got
    extra = [k for k in sd if k not in expected]
    if extra:
        raise ValueError(f"tiny decoder file {path}: unexpected key {extra[0]!r}")
    model.load_state_dict(loaded)
    model = model.to(device=device, dtype=dtype)
    logger.info(
        "loaded tiny decoder from %s (%d latent channels, patch %d, %s, %s)", path, channels, patch, dtype, device
    )
    return TinyStreamDecoder(model, compile=compile)
