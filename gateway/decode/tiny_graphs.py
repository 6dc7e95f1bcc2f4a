"""CUDA graphs for the tiny decoder: one latent frame's pass of a batch bucket as one graph replay.

A tiny decoder's pass is a few dozen convolutions and elementwise kernels; at the batches serving forms (1-4 streams
a call) their launches, not the GPU work, set its time (one H200: 4.6 ms a call at 1 stream, 2.8 ms as a graph;
``benchmarks/results/tiny_profile_1gpu_145e5ca.log``), and every launch is a point where the stages' forwards beside
it on the GPU wait.  Every call of a bucket at one latent size reads and writes tensors of fixed shapes, so::

    graphs = TinyFrameGraphs.capture(decoder.model.frame, rows=(1, 2, 4), latent_hw=(60, 104), ...)
    frames, memory = graphs.run(x, memory)   # None where no graph has this shape: the caller runs it eagerly

**A graph** holds a static input ``(rows, C, h, w)``, a static memory (each MemBlock's previous input), and static
outputs: the four raw frames and the new memory, which the captured pass copies into buffers of their own (the
pass's own outputs are intermediates that the next replay overwrites).  ``run`` copies the call's input and memory
in, replays, and returns copies of the outputs: a stream's state never aliases a graph's buffers, so a later replay
cannot change it.  One lock per graph set: a replay and the copies around it are one step.

**Exactness.** ``capture`` checks every graph against the pass it recorded (compiled or eager) on a probe input,
outputs and memory bit for bit; a capture that raises or differs leaves that bucket eager, with a warning.  On a CPU,
``stagecast.cuda_graphs.rerun_capture`` replays by re-running the pass on the static buffers, so tests hold
everything but the capture itself.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

import torch

from stagecast.cuda_graphs import Capture

logger = logging.getLogger(__name__)

Frame = Callable[[torch.Tensor, list[torch.Tensor]], tuple[list[torch.Tensor], list[torch.Tensor]]]


class TinyFrameGraph:
    """One bucket's pass at one latent size: static buffers in and out, and the replay over them."""

    def __init__(self, frame: Frame, x: torch.Tensor, memory: list[torch.Tensor], capture: Capture):
        self.frame = frame
        self.x = x.clone()
        self.memory = [m.clone() for m in memory]
        self.frames: list[torch.Tensor] | None = None  # the raw frames out
        self.new_memory: list[torch.Tensor] | None = None
        self.replay = capture(self._pass)

    @torch.no_grad()
    def _pass(self) -> None:
        frames, memory = self.frame(self.x, self.memory)
        if self.frames is None or self.new_memory is None:
            # The first run (a warm-up, outside any graph) allocates the outputs every replay writes into.
            self.frames = [f.clone() for f in frames]
            self.new_memory = [m.clone() for m in memory]
            return
        for static, new in zip([*self.frames, *self.new_memory], [*frames, *memory], strict=True):
            static.copy_(new)

    def run(self, x: torch.Tensor, memory: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        self.x.copy_(x)
        for static, value in zip(self.memory, memory, strict=True):
            static.copy_(value)
        self.replay()
        assert self.frames is not None and self.new_memory is not None
        return [f.clone() for f in self.frames], [m.clone() for m in self.new_memory]


class TinyFrameGraphs:
    """The captured buckets of one tiny decoder, by input shape; ``run`` replays the one that fits."""

    def __init__(self, graphs: dict[tuple, TinyFrameGraph]):
        self.graphs = graphs
        self.replays = 0
        self._lock = threading.Lock()

    @property
    def rows(self) -> list[int]:
        return sorted(key[0][0] for key in self.graphs)

    def run(self, x: torch.Tensor, memory: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
        """The pass of ``x`` and ``memory`` as a replay, or None where no graph has their shapes."""
        graph = self.graphs.get(_key(x, memory))
        if graph is None:
            return None
        with self._lock:
            self.replays += 1
            return graph.run(x, memory)

    @classmethod
    def capture(
        cls,
        frame: Frame,
        *,
        rows: Sequence[int],
        latent_channels: int,
        memory_shapes: Sequence[tuple[int, int, int]],
        latent_hw: tuple[int, int],
        device: torch.device,
        dtype: torch.dtype,
        capture: Capture,
    ) -> TinyFrameGraphs:
        """A graph per batch size in ``rows`` at ``latent_hw``, each checked bit for bit against ``frame`` itself on
        a probe; one that fails to capture or differs is left out (that bucket decodes eagerly)."""
        gen = torch.Generator(device="cpu").manual_seed(0)
        graphs: dict[tuple, TinyFrameGraph] = {}
        for n in rows:
            x = torch.randn(n, latent_channels, *latent_hw, generator=gen).to(device, dtype)
            memory = [torch.randn(n, *shape, generator=gen).to(device, dtype) for shape in memory_shapes]
            try:
                graph = TinyFrameGraph(frame, torch.zeros_like(x), [torch.zeros_like(m) for m in memory], capture)
                got = graph.run(x, memory)
                want = frame(x, memory)
            except Exception:  # noqa: BLE001 - a bucket that cannot be captured decodes eagerly
                logger.warning("tiny decoder: no CUDA graph for %d streams at %s latents", n, latent_hw, exc_info=True)
                continue
            if not all(torch.equal(a, b) for a, b in zip([*got[0], *got[1]], [*want[0], *want[1]], strict=True)):
                logger.warning("tiny decoder: the graph for %d streams differs from its pass; left eager", n)
                continue
            graphs[_key(x, memory)] = graph
        return cls(graphs)


def _key(x: torch.Tensor, memory: list[torch.Tensor]) -> tuple:
    return (tuple(x.shape), x.dtype, x.device, tuple(tuple(m.shape) for m in memory))
