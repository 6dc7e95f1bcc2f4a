"""CUDA graphs for the streaming VAE decoder: a stream's steady-state latent frames as one graph replay each.

A decoder part (``StreamVAE`` or a ``StreamVAESlice``) runs a latent frame as a few hundred kernels; at 480x832 the
launches and the Python around them, shared by every stream's part threads under one GIL, cost more than the GPU
work.  A graph replay is one launch.  What makes the decode capturable is that from a stream's latent frame 2 on
(``GRAPHED_FROM``) every cache slot holds a tensor of a fixed shape, so a frame reads only fixed-size tensors::

    capture_graphs(parts, latent_hw=(60, 104), slots=4, capture_for=lambda part: cuda_graph_capture(part.device))
    # then, unchanged: part.decode_chunk(state, x); part.release(state)

**Slots.** Each part gets a fixed pool of ``slots`` graph slots, captured once (before the gateway serves: a capture
on the serving path would stall every stream).  A slot is a static input buffer (one latent frame's piece), static
cache buffers (the steady-state shapes), a static output, and the graph that reads the input and the cache and
writes the output and the *next* cache into those same buffers.  A stream takes a free slot at its first frame past
``GRAPHED_FROM`` (its cache is copied in once; from then on ``state.feat_cache`` *is* the slot's buffers) and keeps
it until ``release``; a slot belongs to one stream at a time, so no two streams ever share a cache.  A stream that
finds no free slot, or whose frames are of another size than the one captured, decodes eagerly, and tries again at
its next frame.  ``release`` (the gateway calls it when a stream ends in any way: finished, failed, cancelled)
waits for a decode of the state in progress, then gives the slot back.  Frames 0 and 1 of every stream are eager.

**Memory.** The slots of one part share one graph memory pool (their intermediates); their replays are serialized
because every part thread launches on its device's default stream.  Each slot holds one stream's cache of that part
(Wan2.1 at 480x832: 1.9 GB bf16 for the whole decoder) whether a stream uses it or not.

**Exactness.** ``capture_graphs`` checks every slot against the eager step on a probe stream (its output and every
cache tensor, bit for bit) before handing it out; a capture that raises, or a slot that differs, leaves the part
eager with a warning.  On a CPU, ``stagecast.cuda_graphs.rerun_capture`` replays by re-running the step on the
static buffers, so tests check everything but the capture itself.

**torch.compile.** A part built with ``compile=True`` is captured through its compiled function (compiled without
cudagraphs, so the graph records Inductor's kernels): the two compose, and ``capture_graphs`` must run after the
warm-up that builds the compiled variants.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import torch

from gateway.decode.stream_vae import GRAPHED_FROM, ChunkDecoder, VAEStreamState
from stagecast.cuda_graphs import Capture, device_capture

logger = logging.getLogger(__name__)


MAX_SLOTS = 64  # slots per part; each holds a whole stream cache of that part


def default_capture(part: ChunkDecoder) -> Capture:
    """A CUDA graph capture on the part's GPU (one memory pool per part); on a CPU the stand-in that re-runs the
    frame on the static buffers (the same slot rule, no speed-up)."""
    return device_capture(part.device)


class GraphSlot:
    """Static buffers of one stream's steady-state frame through one part, and the captured replay over them."""

    def __init__(self, part: ChunkDecoder, piece: torch.Tensor, cache: list, capture: Capture):
        self.part = part
        self.x = piece.clone()
        self.cache = [t.clone() if isinstance(t, torch.Tensor) else t for t in cache]
        self.out: torch.Tensor | None = None
        self.pool: GraphSlots | None = None
        self.replay = capture(self._frame)

    @torch.no_grad()
    def _frame(self) -> None:
        work = list(self.cache)  # the decoder rebinds its slots to new tensors; the static buffers take their values
        y = self.part._step(self.x, work, first=False)
        for i, (static, new) in enumerate(zip(self.cache, work, strict=True)):
            if static is None and new is None:
                continue
            if not isinstance(static, torch.Tensor) or not isinstance(new, torch.Tensor) or new.shape != static.shape:
                raise RuntimeError(f"cache slot {i} is not a fixed-size tensor in the steady state")
            static.copy_(new)
        if self.out is None:
            self.out = y  # allocated by the first (warm-up) run, outside the graph: every replay writes into it
        else:
            self.out.copy_(y)

    def run(self, piece: torch.Tensor) -> torch.Tensor:
        """One frame: ``piece`` in, the static output back (valid until this slot's next replay)."""
        self.x.copy_(piece)
        self.replay()
        return self.out

    def load(self, cache: list) -> None:
        for static, value in zip(self.cache, cache, strict=True):
            if isinstance(static, torch.Tensor):
                static.copy_(value)


class GraphSlots:
    """A part's pool of graph slots; streams take one each (``attach``) and give it back on release (``free``)."""

    def __init__(self, part: ChunkDecoder, slots: list[GraphSlot]):
        self.part = part
        self.slots = slots
        for slot in slots:
            slot.pool = self  # a state gives its slot back here, even after the part was given another pool
        self._free = list(reversed(slots))
        self._lock = threading.Lock()
        first = slots[0]
        self._piece = (tuple(first.x.shape), first.x.dtype)
        self._cache = [None if t is None else (tuple(t.shape), t.dtype) for t in first.cache]

    @property
    def free_slots(self) -> int:
        with self._lock:
            return len(self._free)

    def fits(self, state: VAEStreamState, piece: torch.Tensor) -> bool:
        """Whether this stream's frame has the captured shapes (another frame size decodes eagerly)."""
        if (tuple(piece.shape), piece.dtype) != self._piece or len(state.feat_cache) != len(self._cache):
            return False
        for t, want in zip(state.feat_cache, self._cache, strict=True):
            got = (tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else t
            if got != want:
                return False
        return True

    def attach(self, state: VAEStreamState, piece: torch.Tensor) -> GraphSlot | None:
        """The stream's slot: the one it holds, else a free one (its cache copied in), else None (eager)."""
        if state.graph is not None:
            return state.graph
        if not self.fits(state, piece):
            return None
        with self._lock:
            if not self._free:
                return None
            slot = self._free.pop()
        slot.load(state.feat_cache)
        state.feat_cache = slot.cache
        state.graph = slot
        return slot

    def free(self, slot: GraphSlot) -> None:
        with self._lock:
            if slot in self._free or slot not in self.slots:
                raise ValueError("this graph slot is not held by a stream of this part")
            self._free.append(slot)


def _probe(parts: list[ChunkDecoder], latent_hw: tuple[int, int], frames: int, seed: int):
    """Run a scratch stream of ``frames`` one-frame chunks through the chain; per part and frame, the piece the part
    received and a copy of its cache before that frame."""
    first = parts[0]
    gen = torch.Generator().manual_seed(seed)
    states = [p.new_state() for p in parts]
    pieces: list[list[torch.Tensor]] = [[] for _ in parts]
    caches: list[list[list]] = [[] for _ in parts]
    with torch.no_grad():
        for f in range(frames):
            x = torch.randn(1, first.vae.config.z_dim, 1, *latent_hw, generator=gen)
            for i, (part, state) in enumerate(zip(parts, states, strict=True)):
                # Copies only where they are used (a cache is GBs at 480p): the captured frame and the checked one.
                keep = f >= GRAPHED_FROM
                caches[i].append([t.clone() if keep and isinstance(t, torch.Tensor) else t for t in state.feat_cache])
                pieces[i].append(part._prepare(state, x))
                x = part.decode_chunk(state, x)
    for part, state in zip(parts, states, strict=True):
        part.release(state)
    return pieces, caches


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
    return a is None and b is None


def build_slots(
    part: ChunkDecoder, piece: torch.Tensor, cache: list, check: tuple[torch.Tensor, list], slots: int, capture: Capture
) -> GraphSlots | None:
    """Capture ``slots`` graph slots of ``part`` on buffers shaped like ``piece`` and ``cache`` (a steady-state frame)
    and check each against the eager step on ``check`` (another frame's piece and cache), bit for bit; None (the
    part stays eager, with a warning) when a capture raises or a slot differs."""
    name = type(part).__name__ + (f"[{part.start}:{part.stop}]" if hasattr(part, "start") else "")
    check_piece, check_cache = check
    try:
        with torch.no_grad():
            work = [t.clone() if isinstance(t, torch.Tensor) else t for t in check_cache]
            want = part._step(check_piece, work, first=False)
            built = []
            for _ in range(slots):
                slot = GraphSlot(part, piece, cache, capture)
                slot.load(check_cache)
                got = slot.run(check_piece)
                if not _same(got, want) or not all(_same(a, b) for a, b in zip(slot.cache, work, strict=True)):
                    diff = (got.float() - want.float()).abs().max().item() if got.shape == want.shape else "shape"
                    logger.warning(
                        "VAE %s: a captured frame differs from the eager one (max %s); this part decodes eagerly",
                        name,
                        diff,
                    )
                    return None
                built.append(slot)
    except Exception as exc:  # noqa: BLE001 - any capture failure leaves the part eager
        logger.warning("VAE %s: the frame could not be captured as a graph (%s); this part decodes eagerly", name, exc)
        return None
    return GraphSlots(part, built)


def capture_graphs(
    parts: list[ChunkDecoder],
    *,
    latent_hw: tuple[int, int],
    slots: int,
    capture_for: Callable[[ChunkDecoder], Capture],
    targets: list[int] | None = None,
    seed: int = 0,
) -> list[bool]:
    """Give each target part of the chain ``parts`` (first takes latents, each feeds the next) ``slots`` graph slots
    for streams of latent frames ``latent_hw``; ``capture_for(part)`` gives the part's capture (one memory pool per
    part).  ``targets``: the indices to capture (default all; a VAE stage process chains a scratch prefix of the
    decoder before its own slice).  Returns, per target, whether it is graphed (else it stays eager, with a warning).
    """
    if not 1 <= slots <= MAX_SLOTS:
        raise ValueError(f"VAE graph slots must be in [1, {MAX_SLOTS}], got {slots}")
    if not parts or not parts[0].takes_latents:
        raise ValueError("capture_graphs needs the decoder chain from its first part (the one taking latents)")
    targets = list(range(len(parts))) if targets is None else targets
    for part in parts:
        part.graphs = None  # the probe and the checks run eagerly
    # Frames 0 and 1 settle the cache; frame GRAPHED_FROM is captured and the next one checks the capture.
    pieces, caches = _probe(parts, latent_hw, GRAPHED_FROM + 2, seed)
    done = []
    for i in targets:
        part = parts[i]
        f = GRAPHED_FROM
        part.graphs = build_slots(
            part, pieces[i][f], caches[i][f], (pieces[i][f + 1], caches[i][f + 1]), slots, capture_for(part)
        )
        done.append(part.graphs is not None)
        if part.graphs is not None:
            logger.info("VAE %s: %d graph slots captured for %dx%d latents", type(part).__name__, slots, *latent_hw)
    return done
