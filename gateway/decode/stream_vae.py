"""Streaming Wan VAE decode: latent chunks in, video frames out, one causal-conv cache per stream.

The DiT finishes a stream's latents one chunk at a time. ``AutoencoderKLWan.decode`` cannot continue a video (it
clears its cache on entry and exit, so every chunk would restart at "frame 0"), so this module drives the decoder
itself, exactly as ``AutoencoderKLWan._decode`` does, with the cache kept per stream::

    vae = StreamVAE.from_folder("/models/Wan2.2-TI2V-5B-Diffusers/vae", dtype=torch.bfloat16, device="cuda")
    state = vae.new_state()                              # one per stream
    for latents in chunks:                               # the DiT's normalised latents, (1, z_dim, T, h, w)
        video = vae.decode_chunk(state, latents)         # (1, 3, n, H, W) in [-1, 1]
        frames = to_uint8_frames(video)                  # (n, H, W, 3) uint8, for the encoder
    vae.release(state)

The concatenated chunk outputs are bit-identical for every chunking of a stream, and equal bit for bit the one-shot
``vae.decode(z * std + mean).sample`` of the whole latent video wherever the backend's 1x1x1 ``post_quant_conv``
gives the same bits for T frames at once as for one at a time (true at most sizes; on CPU not at a 2x4 latent,
where the two differ by ~1e-6). The first chunk of a stream gives ``1 + 4 (T - 1)`` frames, later chunks ``4 T``
(``frames_for_chunk``). One ``StreamVAE`` serves any number of streams; it holds no per-stream data.

Moving a stream (another process or GPU): ``torch.save(state.state_dict(), f)`` and
``vae.load_state(torch.load(f))`` on a ``StreamVAE`` with the same weights; the dict holds only tensors, ints,
strings and None, so ``torch.load``'s default ``weights_only=True`` accepts it.

To run the decoder as pipeline stages, ``split_decoder(vae, 2)`` cuts it by blocks into ``StreamVAESlice`` s with
the same ``new_state``/``decode_chunk``/``release`` API; each owns the cache slots of its own blocks, the first
takes latents, the last returns video, and what passes between them is one tensor per chunk.

Tests and the CPU demo write a random tiny VAE with ``launcher.demo_checkpoint.write_tiny_vae(folder,
name="tiny-wan2.1")`` and load it with ``StreamVAE.from_folder(folder)``.

Not handled: tiled decode (``vae.enable_tiling()`` is ignored, and the one-shot reference is the untiled decode)
and model-offload hooks (they sit on ``vae.decode``, which this bypasses; keep the module on its device).
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from os import PathLike
from pathlib import Path

import torch
from diffusers import AutoencoderKLWan
from diffusers.models.autoencoders.autoencoder_kl_wan import CACHE_T, WanCausalConv3d, WanResample, patchify, unpatchify
from torch import nn

from stagecast.model import vae_configs
from stagecast.model.config import read_vae_config

logger = logging.getLogger(__name__)

_STATE_VERSION = 1
# A stream's latent frames from this one on may replay a captured graph: the cache slots change shape over frames 0
# (None -> "Rep" or 1 frame) and 1 (-> 2 frames), and are stable from frame 2 on.
GRAPHED_FROM = 2


def use_cudnn_autotune(devices) -> bool:
    """Let cuDNN pick each VAE convolution's algorithm by timing the candidates on its first use of a shape
    (``torch.backends.cudnn.benchmark``, process-wide) when any of ``devices`` is a GPU; returns whether it did.

    Opt-in (gateway ``--vae-cudnn-benchmark``).  Measured on an H200: the compiled Wan2.1 decoder at 480x832 went from
    60.4 to 53.8 ms per chunk (``benchmarks/vae_graphs_check.py --cudnn-benchmark both``; the Wan2.2 one at 704x1280
    was unchanged) and 1.3B at 1 step on one GPU from 40.3 to 44.4 steady FPS; but cuDNN searched again for every
    new stream's first, eager VAE frame, whose VAE share of TTFF went from 77 to 588 ms, the first gap of every
    stream to ~750 ms, and paced load rows fell from 98% to under 50% of frames on time (BENCHMARKS.md, issue 15's
    levers).  CPUs are unaffected, so CPU outputs (and the parity tests) do not change."""
    if not any(torch.device(d).type == "cuda" for d in devices):
        return False
    torch.backends.cudnn.benchmark = True
    return True


def frames_for_chunk(first: bool, latent_frames: int, temporal_factor: int = 4) -> int:
    """Video frames a chunk of ``latent_frames`` decodes to: frame 0 of a stream gives 1, every other gives 4."""
    if latent_frames < 1:
        raise ValueError(f"a chunk has at least one latent frame, got {latent_frames}")
    return 1 + temporal_factor * (latent_frames - 1) if first else temporal_factor * latent_frames


def to_uint8_frames(video: torch.Tensor) -> torch.Tensor:
    """Convert decoded video ``(1, 3, n, H, W)`` (or ``(3, n, H, W)``) in [-1, 1] to ``(n, H, W, 3)`` uint8.

    The result stays on the video's device.

    The same arithmetic as diffusers' ``VideoProcessor.postprocess_video(..., output_type="pil")`` and
    ``encode_video``: ``(x * 0.5 + 0.5).clamp(0, 1)`` in the video's dtype, then float32, ``* 255``, round half to
    even (``torch.round``, like ``np.round``), cast. Rounding rather than truncating (``export_to_video``'s
    ``astype(uint8)``) keeps the error within half a level; both are deterministic, this one is unbiased.
    """
    if video.dim() == 5:
        if video.shape[0] != 1:
            raise ValueError(f"expected one video (1, 3, n, H, W), got shape {tuple(video.shape)}")
        video = video[0]
    if video.dim() != 4 or video.shape[0] != 3:
        raise ValueError(f"expected video of shape (1, 3, n, H, W) or (3, n, H, W), got {tuple(video.shape)}")
    frames = (video.permute(1, 2, 3, 0) * 0.5 + 0.5).clamp(0, 1).float()
    return (frames * 255).round().to(torch.uint8)


@dataclass
class VAEStreamState:
    """One stream's decode state for one decoder (or decoder slice).

    ``feat_cache`` has one slot per ``WanCausalConv3d`` the decoder owns, in call order: ``None`` (not reached
    yet, or a 1x1x1 shortcut that never caches), ``"Rep"`` (an upsample3d after frame 0) or the last <= 2 input
    frames of that conv. Slots change shape over the first two latent frames and are stable after that.
    """

    feat_cache: list
    temporal_factor: int
    latent_frames: int = 0  # latent frames decoded so far; 0 means the next one is the stream's frame 0
    latent_hw: tuple[int, int] | None = None  # fixed by the first chunk: the cached frames only fit that size
    released: bool = False
    # The graph slot (``gateway.decode.vae_graphs``) this stream holds, if any: then ``feat_cache`` is the slot's static
    # buffers, which only this stream's replays read and update, until ``release`` gives the slot back.
    graph: object = None
    # Held across a decode and by ``release``: a state is never released (nor its slot reused) mid-decode.
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    @property
    def frames_decoded(self) -> int:
        """Video frames the stream has produced so far."""
        return frames_for_chunk(True, self.latent_frames, self.temporal_factor) if self.latent_frames else 0

    @property
    def approx_bytes(self) -> int:
        """Memory held by the cached tensors (what an admission bound should count per stream)."""
        return sum(t.numel() * t.element_size() for t in self.feat_cache if isinstance(t, torch.Tensor))

    def state_dict(self) -> dict:
        """Plain-data snapshot for ``torch.save``; restore it with ``load_state`` of a decoder with equal weights."""
        if self.released:
            raise ValueError("cannot snapshot a released VAE stream state")
        # A graph slot's buffers are overwritten by the next replay: the snapshot holds copies.
        cache = [t.clone() if self.graph is not None and isinstance(t, torch.Tensor) else t for t in self.feat_cache]
        return {
            "version": _STATE_VERSION,
            "feat_cache": cache,
            "temporal_factor": self.temporal_factor,
            "latent_frames": self.latent_frames,
            "latent_hw": None if self.latent_hw is None else list(self.latent_hw),
        }


class ChunkDecoder:
    """Shared per-stream, frame-by-frame driver; subclasses say what one latent frame runs through."""

    output_range = (-1.0, 1.0)  # the video a decoder that gives video returns (``to_uint8_frames`` maps it)

    def __init__(self, vae: AutoencoderKLWan, *, takes_latents: bool, gives_video: bool, in_factor: int, slots: int):
        if vae.use_tiling:
            logger.warning("vae tiling is on; streaming decode ignores it and decodes untiled")
        self.vae = vae
        self.device = next(vae.parameters()).device
        self.dtype = vae.dtype
        self.temporal_factor = vae_configs.temporal_factor(vae.config)
        self.takes_latents = takes_latents
        self.gives_video = gives_video
        # Frames per latent frame (after frame 0, which is always one) in the tensor this decoder receives.
        self.in_factor = in_factor
        self.num_slots = slots
        # Set by ``gateway.decode.vae_graphs.capture_graphs``: captured steady-state frames, one per stream slot.
        self.graphs = None
        if takes_latents:
            z_dim = vae.config.z_dim
            # Built exactly as WanPipeline does (cast to the VAE dtype, then reciprocal), so that
            # latents / inv_std + mean is bit-identical to the pipeline's de-normalisation.
            stats = dict(device=self.device, dtype=self.dtype)
            self._mean = torch.tensor(vae.config.latents_mean).view(1, z_dim, 1, 1, 1).to(**stats)
            self._inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, z_dim, 1, 1, 1).to(**stats)

    def new_state(self) -> VAEStreamState:
        return VAEStreamState(feat_cache=[None] * self.num_slots, temporal_factor=self.temporal_factor)

    def release(self, state: VAEStreamState) -> None:
        """Drop the cached tensors now rather than when the last reference goes, and give back the stream's graph
        slot; the state is unusable after.  Waits for a decode of this state in progress."""
        with state.lock:
            logger.debug(
                "releasing VAE stream state: %d latent frames, %d bytes", state.latent_frames, state.approx_bytes
            )
            if state.graph is not None:
                state.graph.pool.free(state.graph)
                state.graph = None
            state.feat_cache = []
            state.released = True

    def load_state(self, snapshot: dict) -> VAEStreamState:
        """Rebuild a state from ``VAEStreamState.state_dict()``, moving its tensors to this decoder's device."""
        if snapshot.get("version") != _STATE_VERSION:
            raise ValueError(f"unsupported VAE stream state version {snapshot.get('version')!r}")
        cache = snapshot["feat_cache"]
        if len(cache) != self.num_slots or snapshot["temporal_factor"] != self.temporal_factor:
            raise ValueError(
                f"VAE stream state has {len(cache)} cache slots and temporal factor {snapshot['temporal_factor']}; "
                f"this decoder has {self.num_slots} and {self.temporal_factor}"
            )
        for slot in cache:
            if isinstance(slot, torch.Tensor) and slot.dtype != self.dtype:
                raise ValueError(f"VAE stream state cache is {slot.dtype}; this decoder runs in {self.dtype}")
        hw = snapshot["latent_hw"]
        return VAEStreamState(
            feat_cache=[s.to(self.device) if isinstance(s, torch.Tensor) else s for s in cache],
            temporal_factor=self.temporal_factor,
            latent_frames=snapshot["latent_frames"],
            latent_hw=None if hw is None else tuple(hw),
        )

    @torch.no_grad()
    def decode_chunk(self, state: VAEStreamState, x: torch.Tensor) -> torch.Tensor:
        """Run one chunk through this decoder, advancing ``state``.

        ``x`` is the DiT's normalised latents ``(1, z_dim, T, h, w)`` for a decoder that takes latents, otherwise
        the previous slice's output for the same chunk. Returns video ``(1, 3, n, H, W)`` clamped to [-1, 1] for a
        decoder that gives video (n from ``frames_for_chunk``), otherwise the hidden tensor for the next slice.
        """
        with state.lock:
            if state.released:
                raise ValueError("this VAE stream state was released")
            if len(state.feat_cache) != self.num_slots:
                raise ValueError(f"state has {len(state.feat_cache)} cache slots; this decoder has {self.num_slots}")
            pieces = self._split_frames(state, self._prepare(state, x))
            outs = []
            for piece in pieces:
                slot = None
                if self.graphs is not None and state.latent_frames >= GRAPHED_FROM:
                    slot = self.graphs.attach(state, piece)
                if slot is not None:
                    out = slot.run(piece)  # the slot's static output: copied (by clone or cat) before its next replay
                    outs.append(out.clone() if len(pieces) > 1 else out)
                else:
                    outs.append(self._step(piece, state.feat_cache, first=state.latent_frames == 0))
                state.latent_frames += 1
            out = torch.cat(outs, dim=2)  # always a new tensor
        if self.gives_video:
            if self.vae.config.patch_size is not None:
                out = unpatchify(out, patch_size=self.vae.config.patch_size)
            out = out.clamp(-1.0, 1.0)
        return out

    def _step(self, piece: torch.Tensor, cache: list, first: bool) -> torch.Tensor:
        """One latent frame's piece through this decoder (what a graph slot captures, for ``first=False``)."""
        if self.takes_latents:
            # post_quant_conv (1x1x1) has no temporal state, but CPU/GPU conv kernels do not give bit-identical
            # results for every frame count (a 2x4 latent differs by ~5e-7 between T=1 and T=6 on CPU). Running
            # it one frame at a time makes the output independent of how the stream is chunked.
            piece = self.vae.post_quant_conv(piece)
        # Frame by frame, as _decode does: frame 0 must go alone (first_chunk=True) and a multi-frame call
        # is only approximately equal. feat_idx is mutated in place, so each call gets a fresh one.
        return self._run_frame(piece, cache, [0], first=first)

    def _prepare(self, state: VAEStreamState, x: torch.Tensor) -> torch.Tensor:
        if not self.takes_latents:
            return x.to(self.device)
        z_dim = self.vae.config.z_dim
        if x.dim() != 5 or x.shape[0] != 1 or x.shape[1] != z_dim or x.shape[2] < 1:
            raise ValueError(f"expected normalised latents of shape (1, {z_dim}, T, h, w), got {tuple(x.shape)}")
        hw = (x.shape[3], x.shape[4])
        if state.latent_hw is None:
            state.latent_hw = hw
        elif state.latent_hw != hw:
            raise ValueError(f"stream latents are {state.latent_hw[0]}x{state.latent_hw[1]}, got {hw[0]}x{hw[1]}")
        return x.to(self.device, self.dtype) / self._inv_std + self._mean

    def _split_frames(self, state: VAEStreamState, x: torch.Tensor) -> list[torch.Tensor]:
        """Cut a chunk back into per-latent-frame pieces: 1 frame for stream frame 0, ``in_factor`` for others."""
        first = 1 if state.latent_frames == 0 else 0
        rest = x.shape[2] - first
        if rest < 0 or rest % self.in_factor or (rest == 0 and not first):
            raise ValueError(
                f"got {x.shape[2]} frames; expected {'1 + ' if first else ''}a positive multiple of {self.in_factor}"
            )
        return list(x.split([1] * first + [self.in_factor] * (rest // self.in_factor), dim=2))

    def _run_frame(self, x: torch.Tensor, cache: list, idx: list[int], first: bool) -> torch.Tensor:
        raise NotImplementedError


class StreamVAE(ChunkDecoder):
    """The whole decoder of one ``AutoencoderKLWan``, decoding any number of streams chunk by chunk."""

    def __init__(self, vae: AutoencoderKLWan, *, compile: bool = False):
        slots = sum(isinstance(m, WanCausalConv3d) for m in vae.decoder.modules())
        super().__init__(vae, takes_latents=True, gives_video=True, in_factor=1, slots=slots)
        # torch.compile of the decoder: 85 -> 52 ms per latent frame at 480p on an H200.
        # Frame 0 stays eager: its cache slots hold the string "Rep" and it trims frames (first_chunk=True).
        self._compiled = torch.compile(vae.decoder, dynamic=False) if compile else None

    @classmethod
    def from_folder(
        cls,
        folder: str | PathLike,
        *,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        subfolder: str | None = None,
        compile: bool = False,
    ) -> StreamVAE:
        """Load a diffusers ``AutoencoderKLWan`` folder (``subfolder="vae"`` for a pipeline folder).

        The config is read first by the shared reader (``read_vae_config``): a config written by an older diffusers
        (no ``patch_size``, ``decoder_base_dim``, ...) gets diffusers' own defaults, as ``from_pretrained`` applies
        them, and a config that is no Wan VAE is refused naming the file and key."""
        read_vae_config(Path(folder) / subfolder if subfolder else folder)
        vae = AutoencoderKLWan.from_pretrained(folder, subfolder=subfolder, torch_dtype=dtype)
        vae = vae.to(device).eval().requires_grad_(False)
        logger.info("loaded VAE from %s (z_dim=%d, %s, %s)", folder, vae.config.z_dim, dtype, device)
        return cls(vae, compile=compile)

    def _run_frame(self, x: torch.Tensor, cache: list, idx: list[int], first: bool) -> torch.Tensor:
        if self._compiled is not None and not first:
            with _COMPILED_CALLS:
                return self._compiled(x, feat_cache=cache, feat_idx=idx, first_chunk=first)
        return self.vae.decoder(x, feat_cache=cache, feat_idx=idx, first_chunk=first)


# Dynamo is not thread-safe: one thread compiling while another calls a compiled function fails ("using FX to
# symbolically trace a dynamo-optimized function").  Compiled calls take this lock; they only launch kernels.
_COMPILED_CALLS = threading.Lock()


def _cached_conv(conv: WanCausalConv3d, x: torch.Tensor, cache: list, idx: list[int]) -> torch.Tensor:
    """WanDecoder3d's inline cache handling around conv_in and conv_out, op for op."""
    i = idx[0]
    cache_x = x[:, :, -CACHE_T:].clone()
    if cache_x.shape[2] < 2 and cache[i] is not None:
        cache_x = torch.cat([cache[i][:, :, -1:].to(cache_x.device), cache_x], dim=2)
    x = conv(x, cache[i])
    cache[i] = cache_x
    idx[0] += 1
    return x


@dataclass(frozen=True)
class _Unit:
    """One block of WanDecoder3d.forward, the granularity at which the decoder can be cut."""

    name: str
    run: Callable[[torch.Tensor, list, list[int], bool], torch.Tensor]  # (x, cache, feat_idx, first_chunk)
    modules: tuple[nn.Module, ...]
    temporal_up: bool  # doubles the frames of every latent frame after the first

    def slots(self) -> int:
        return sum(isinstance(m, WanCausalConv3d) for mod in self.modules for m in mod.modules())


def decoder_units(vae: AutoencoderKLWan) -> list[_Unit]:
    """conv_in, mid_block, each up block, head: the order of WanDecoder3d.forward."""
    dec = vae.decoder

    def up_block(block):
        return lambda x, cache, idx, first: block(x, feat_cache=cache, feat_idx=idx, first_chunk=first)

    units = [
        _Unit("conv_in", lambda x, cache, idx, _: _cached_conv(dec.conv_in, x, cache, idx), (dec.conv_in,), False),
        _Unit(
            "mid_block",
            lambda x, cache, idx, _: dec.mid_block(x, feat_cache=cache, feat_idx=idx),
            (dec.mid_block,),
            False,
        ),
    ]
    for i, block in enumerate(dec.up_blocks):
        temporal = any(isinstance(m, WanResample) and m.mode == "upsample3d" for m in block.modules())
        units.append(_Unit(f"up_blocks.{i}", up_block(block), (block,), temporal))

    def head(x, cache, idx, _):
        return _cached_conv(dec.conv_out, dec.nonlinearity(dec.norm_out(x)), cache, idx)

    units.append(_Unit("head", head, (dec.norm_out, dec.nonlinearity, dec.conv_out), False))
    return units


class StreamVAESlice(ChunkDecoder):
    """Decoder units ``[start, stop)`` of one ``AutoencoderKLWan`` (see ``decoder_units``), as a pipeline stage.

    The slice starting at unit 0 takes latents (de-normalisation and post_quant_conv included); the slice ending at
    the last unit returns video. Its state holds only its own units' cache slots.
    """

    def __init__(self, vae: AutoencoderKLWan, start: int, stop: int, *, compile: bool = False):
        units = decoder_units(vae)
        if not 0 <= start < stop <= len(units):
            raise ValueError(f"slice [{start}, {stop}) is not within the decoder's {len(units)} units")
        self.start, self.stop = start, stop
        self.units = units[start:stop]
        in_factor = 2 ** sum(u.temporal_up for u in units[:start])
        super().__init__(
            vae,
            takes_latents=start == 0,
            gives_video=stop == len(units),
            in_factor=in_factor,
            slots=sum(u.slots() for u in self.units),
        )
        # As StreamVAE: frames after a stream's first run through one compiled graph of this slice's units.
        self._compiled = None
        if compile:
            _reserve_compiled_variants()
            self._compiled = torch.compile(self._run_units, dynamic=False)

    def _run_units(self, x: torch.Tensor, cache: list, idx: list[int], first: bool) -> torch.Tensor:
        for unit in self.units:
            x = unit.run(x, cache, idx, first)
        return x

    def _run_frame(self, x: torch.Tensor, cache: list, idx: list[int], first: bool) -> torch.Tensor:
        if self._compiled is not None and not first:
            with _COMPILED_CALLS:
                return self._compiled(x, cache, idx, first)
        return self._run_units(x, cache, idx, first)


_compiled_slices = 0


def _reserve_compiled_variants() -> None:
    """Every compiled slice shares ``_run_units``'s code object, and dynamo keeps a limited number of compiled
    variants per code object (8 by default). Each slice needs up to three: the stream's frame 1, frame 2 and
    later frames, whose cache slots differ in frames and strides. Past the limit, dynamo silently runs the rest
    eagerly, so each compiled slice made in this process raises the limit by four."""
    global _compiled_slices
    _compiled_slices += 1
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    if getattr(config, name) < 4 * _compiled_slices:
        setattr(config, name, 4 * _compiled_slices)


@torch.no_grad()
def unit_macs(vae: AutoencoderKLWan, latent_hw: tuple[int, int] = (2, 2)) -> list[int]:
    """Multiply-accumulates per decoder unit for one steady-state latent frame at ``latent_hw``.

    Measured by running two latent frames through a scratch state with hooks on every conv; costs scale with
    h * w, so a tiny probe ranks the units as a full-size frame would.
    """
    units = decoder_units(vae)
    probe = StreamVAESlice(vae, 0, len(units))
    counts = [0] * len(units)
    current = [0]

    def count(conv, _inputs, out):
        counts[current[0]] += out.numel() * (conv.in_channels // conv.groups) * conv.weight[0, 0].numel()

    def enter(i):
        def hook(_module, _inputs):
            current[0] = i

        return hook

    handles = []
    for i, unit in enumerate(units):
        handles.append(unit.modules[0].register_forward_pre_hook(enter(i)))
        for mod in unit.modules:
            handles += [m.register_forward_hook(count) for m in mod.modules() if isinstance(m, nn.Conv2d | nn.Conv3d)]
    try:
        state = probe.new_state()
        z = torch.zeros(1, vae.config.z_dim, 1, *latent_hw)
        probe.decode_chunk(state, z)  # frame 0 takes the cheaper "Rep" path; count the next one only
        counts[:] = [0] * len(units)
        probe.decode_chunk(state, z)
    finally:
        for h in handles:
            h.remove()
    return counts


def split_decoder(
    vae: AutoencoderKLWan, num_slices: int, *, boundaries: list[int] | None = None, compile: bool = False
) -> list[StreamVAESlice]:
    """Cut the decoder into ``num_slices`` consecutive slices (``decoder_cut`` says where).

    The slices share ``vae``'s modules; to put them on different devices, build each with
    ``StreamVAESlice(vae_there, edges[i], edges[i + 1])`` from its own copy of the VAE moved there (a slice only
    runs its own units' weights).
    """
    edges = decoder_cut(vae, num_slices, boundaries)
    return [StreamVAESlice(vae, a, b, compile=compile) for a, b in itertools.pairwise(edges)]


def decoder_cut(
    vae: AutoencoderKLWan, num_slices: int, boundaries: list[int] | None = None, costs: list[int] | None = None
) -> list[int]:
    """``[0, *boundaries, units]``: where each of ``num_slices`` slices starts, and where the last one ends.

    ``boundaries`` are the unit indices where slices 1.. start; by default they minimise the largest slice's
    ``unit_macs`` (a pure function of the architecture, so every process that cuts the same model agrees; ``costs``:
    those counts where the caller already has them).
    """
    n = len(decoder_units(vae))
    if not 1 <= num_slices <= n:
        raise ValueError(f"the decoder has {n} units; cannot cut it into {num_slices} slices")
    if boundaries is None:
        costs = unit_macs(vae) if costs is None else costs

        def worst(cuts):
            edges = [0, *cuts, n]
            return max(sum(costs[a:b]) for a, b in itertools.pairwise(edges))

        boundaries = list(min(itertools.combinations(range(1, n), num_slices - 1), key=worst))
    if len(boundaries) != num_slices - 1 or list(boundaries) != sorted(set(boundaries)):
        raise ValueError(f"need {num_slices - 1} increasing boundaries, got {boundaries}")
    if boundaries and not 1 <= boundaries[0] <= boundaries[-1] < n:
        raise ValueError(f"boundaries {boundaries} must lie in [1, {n - 1}]: the decoder has {n} units")
    return [0, *boundaries, n]


@dataclass
class VAEEncodeState:
    """One stream's encode state: the encoder's causal-conv cache, the frames waiting to fill a group of
    ``temporal_factor``, and how many latent frames the stream has produced."""

    feat_cache: list
    pending: list[torch.Tensor]  # (1, 3, 1, H, W) frames in [-1, 1] not yet encoded (fewer than a group)
    latent_frames: int = 0
    frame_hw: tuple[int, int] | None = None  # fixed by the first frame
    released: bool = False

    @property
    def approx_bytes(self) -> int:
        cached = sum(t.numel() * t.element_size() for t in self.feat_cache if isinstance(t, torch.Tensor))
        return cached + sum(t.numel() * t.element_size() for t in self.pending)


class StreamVAEEncoder:
    """Streaming Wan VAE encode: video frames in, normalised latent frames out, one causal-conv cache per stream.

    ``AutoencoderKLWan._encode`` runs the encoder on frame 0 alone and then on each group of ``temporal_factor``
    (4) frames, carrying its own cache (``_enc_feat_map``) between calls; this drives the encoder the same way with
    the cache kept per stream, so a live input can be encoded as it arrives::

        enc = StreamVAEEncoder(vae)
        state = enc.new_state()
        z = enc.encode_frames(state, video)   # video (1, 3, n, H, W) in [-1, 1]; z (1, z_dim, k, h, w) or None
        enc.release(state)

    ``encode_frames`` returns the latent frames completed by the frames given so far (frame 0 completes latent frame
    0; every further 4 frames complete one more), normalised as ``WanVideoToVideoPipeline.prepare_latents`` does
    (``(mean - latents_mean) * (1 / latents_std)``, the distribution's mean, i.e. ``sample_mode="argmax"``). The
    concatenation over a stream equals the one-shot ``vae.encode(video).latent_dist.mode()`` so normalised, bit for
    bit where the backend's 1x1x1 ``quant_conv`` gives the same bits for k frames at once as one at a time (it runs
    per latent frame here, so the result never depends on how the input was split).
    """

    def __init__(self, vae: AutoencoderKLWan):
        if vae.use_tiling:
            logger.warning("vae tiling is on; streaming encode ignores it and encodes untiled")
        self.vae = vae
        self.device = next(vae.parameters()).device
        self.dtype = vae.dtype
        self.temporal_factor = vae_configs.temporal_factor(vae.config)
        self.spatial_factor = vae_configs.spatial_factor(vae.config)
        self.num_slots = sum(isinstance(m, WanCausalConv3d) for m in vae.encoder.modules())
        z_dim = vae.config.z_dim
        stats = dict(device=self.device, dtype=self.dtype)
        self._mean = torch.tensor(vae.config.latents_mean).view(1, z_dim, 1, 1, 1).to(**stats)
        self._inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, z_dim, 1, 1, 1).to(**stats)

    def new_state(self) -> VAEEncodeState:
        return VAEEncodeState(feat_cache=[None] * self.num_slots, pending=[])

    def release(self, state: VAEEncodeState) -> None:
        state.feat_cache = []
        state.pending = []
        state.released = True

    @torch.no_grad()
    def encode_frames(self, state: VAEEncodeState, video: torch.Tensor) -> torch.Tensor | None:
        """Add ``video`` (1, 3, n, H, W) in [-1, 1] to the stream; return the latent frames it completes
        ``(1, z_dim, k, H/s, W/s)``, or None when it completes none (frames wait for a whole group)."""
        if state.released:
            raise ValueError("this VAE encode state was released")
        if video.dim() != 5 or video.shape[0] != 1 or video.shape[1] != 3 or video.shape[2] < 1:
            raise ValueError(f"expected video of shape (1, 3, n, H, W), got {tuple(video.shape)}")
        hw = (video.shape[3], video.shape[4])
        if hw[0] % self.spatial_factor or hw[1] % self.spatial_factor:
            raise ValueError(f"frame size {hw[1]}x{hw[0]} is not a multiple of the VAE's {self.spatial_factor}")
        if state.frame_hw is None:
            state.frame_hw = hw
        elif state.frame_hw != hw:
            raise ValueError(f"stream frames are {state.frame_hw[1]}x{state.frame_hw[0]}, got {hw[1]}x{hw[0]}")
        state.pending.extend(video.to(self.device, self.dtype).split(1, dim=2))
        outs = []
        while state.pending:
            group = 1 if state.latent_frames == 0 else self.temporal_factor
            if len(state.pending) < group:
                break
            x = torch.cat(state.pending[:group], dim=2)
            del state.pending[:group]
            if self.vae.config.patch_size is not None:
                x = patchify(x, patch_size=self.vae.config.patch_size)
            # A fresh feat_idx per call: the encoder mutates it in place.
            h = self.vae.encoder(x, feat_cache=state.feat_cache, feat_idx=[0])
            mean = self.vae.quant_conv(h)[:, : self.vae.config.z_dim]
            outs.append((mean - self._mean) * self._inv_std)
            state.latent_frames += 1
        return torch.cat(outs, dim=2) if outs else None
