"""Whether a stream may start on this gateway: the admission checks, in order, and the per-stream cost budget.

Usage::

    budget = CostBudget.derive(defaults, device="cuda:0")   # from the checkpoint's serving defaults and the device
    budget.check(cfg)                                       # raises Refused(RESOURCE_EXHAUSTED, "cost budget: ...")

    admission = Admission([count_cap, budget.check])        # the gateway's; later checks append (e.g. capacity)
    release = admission.admit(cfg)                          # raises Refused; release() gives back what was taken

    memory = DecoderMemory.derive("cuda:0", {"full": vae_bytes, "tiny": tiny_bytes}, (480, 832), budget_gib=0)
    memory.check(cfg)                                       # Refused(RESOURCE_EXHAUSTED, "decoder memory: ...")

A check is ``check(cfg) -> release | None``: it raises ``Refused`` to refuse the stream, or returns a callable that
gives back what it took (a slot) when a later check refuses or the stream ends before it started.  The gateway's
order is: count cap (``--max-streams``), cost budget, then whatever is appended (capacity admission).

The cost of a stream is what the pipeline does per second of video: pixels x frames per second x denoising passes
(steps, plus the clean pass of the ``clean`` policy), times the chunk's frames over the checkpoint's (at least 1):
a forward attends over every token of its chunk, so a frame of a larger chunk costs more (a 128x128 stream at 16
latent frames a chunk took 14 s for 1 s of video).  Generation is not slowed down to ``target_fps`` (it only
stamps presentation times), so the rate counted is at least the checkpoint's own.  A frame's pixels are also
bounded on their own: the VAE decodes and the encoder holds whole frames, so a huge frame at a tiny rate still costs
its memory at once.  Both bounds default to the checkpoint's serving size and rate times a headroom for the device
kind (``HEADROOM``); ``stagecast.json`` (``max_frame_pixels``, ``max_stream_cost``) or the gateway's flags set them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc

from gateway.checkpoint import ServingDefaults
from gateway.edge.config import EffectiveConfig
from stagecast.microstep import chunk_levels

# Multiples of the checkpoint's serving size (frame pixels) and of its serving cost (pixels x fps x steps) that a
# stream may ask for, by device kind.  A GPU serves its model at the serving size in real time with room to spare;
# on a CPU even the serving size is slow, so little more is allowed there.
HEADROOM = {"cpu": (4, 4), "cuda": (6, 16)}
DEFAULT_HEADROOM = HEADROOM["cpu"]


class Refused(Exception):
    """A stream may not start: the call ends with ``code`` and ``message``."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


Release = Callable[[], None]
Check = Callable[[EffectiveConfig], "Release | None"]


def passes(cfg: EffectiveConfig) -> int:
    """DiT passes per chunk: one per step, plus the clean pass under the ``clean`` policy.  An SLO-adaptive stream
    counts at its ``min_steps``, as capacity admission counts it: the controller raises steps only into spare
    capacity."""
    return chunk_levels(cfg.min_steps, cfg.policy)


@dataclass(frozen=True)
class CostBudget:
    max_frame_pixels: int
    max_stream_cost: float  # pixel-passes per second of video
    floor_fps: float  # the lowest rate a stream is counted at (the checkpoint's)
    floor_chunk_frames: int = 1  # the checkpoint's latent frames per chunk: larger chunks cost more per frame
    origin: str = ""  # where the numbers came from, for the refusal message

    @classmethod
    def derive(
        cls, defaults: ServingDefaults, device: str, *, max_frame_pixels: int = 0, max_stream_cost: float = 0
    ) -> CostBudget:
        """The budget for a checkpoint on a device; explicit values (flags, then ``stagecast.json``) win over the
        derived ones (0: derive)."""
        kind = device.split(":")[0]
        area_x, cost_x = HEADROOM.get(kind, DEFAULT_HEADROOM)
        area = defaults.width * defaults.height
        base = f"{defaults.width}x{defaults.height} at {defaults.fps:g} fps, {defaults.steps} steps"
        pixels = max_frame_pixels or defaults.max_frame_pixels or area * area_x
        cost = max_stream_cost or defaults.max_stream_cost or area * defaults.fps * defaults.steps * cost_x
        derived = not (max_frame_pixels or defaults.max_frame_pixels or max_stream_cost or defaults.max_stream_cost)
        origin = f"the checkpoint's {base}, x{area_x} pixels and x{cost_x} cost on {kind}" if derived else "set"
        return cls(
            max_frame_pixels=int(pixels),
            max_stream_cost=float(cost),
            floor_fps=defaults.fps,
            floor_chunk_frames=max(1, defaults.chunk_frames),
            origin=origin,
        )

    def chunk_factor(self, cfg: EffectiveConfig) -> float:
        """How much more a frame costs in the stream's chunks than in the checkpoint's (at least 1)."""
        return max(1.0, cfg.chunk_frames / self.floor_chunk_frames)

    def cost(self, cfg: EffectiveConfig) -> float:
        return cfg.width * cfg.height * max(cfg.fps, self.floor_fps) * passes(cfg) * self.chunk_factor(cfg)

    def check(self, cfg: EffectiveConfig) -> None:
        pixels = cfg.width * cfg.height
        if pixels > self.max_frame_pixels:
            raise Refused(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"cost budget: a {cfg.width}x{cfg.height} frame is {pixels} pixels; this gateway allows "
                f"{self.max_frame_pixels} per frame (--max-frame-pixels; {self.origin}); lower width or height",
            )
        cost = self.cost(cfg)
        if cost > self.max_stream_cost:
            fps = max(cfg.fps, self.floor_fps)
            factor = self.chunk_factor(cfg)
            chunk = (
                f" x {factor:g} for chunk_frames {cfg.chunk_frames} (the checkpoint's {self.floor_chunk_frames})"
                if factor > 1
                else ""
            )
            raise Refused(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"cost budget: {cfg.width}x{cfg.height} pixels x {fps:g} frames/s x {passes(cfg)} passes{chunk} = "
                f"{cost:.4g} pixel-passes/s is over this gateway's {self.max_stream_cost:.4g} per stream "
                f"(--max-stream-cost; {self.origin}); lower width, height, target_fps, steps or chunk_frames",
            )


GIB = 1024**3
# What is left on the decoder's device besides the decoder states: activations of a decode call, the allocator's
# slack, and a stage beside the gateway growing after it started.  At least this, or this fraction of the device.
MEMORY_RESERVE_BYTES = 8 * GIB
MEMORY_RESERVE_FRACTION = 0.1
MAX_BUDGET_GIB = 1 << 20  # a budget past a petabyte is not a budget
# The Wan VAE's per-stream caches when not measured (VAE on the CPU, or the measurement failed): ~1.8 GiB at 480x832
# in bfloat16 (scaled by the dtype and frame pixels).  And a tiny decoder's, as ``stagecast up``'s memory plan
# estimates it before anything runs (the gateway measures its own: ``BatchedDecoder.state_bytes_at``).
FULL_VAE_STATE_BYTES = int(1.8 * 1024**3)
FULL_VAE_STATE_ITEMSIZE = 2
TINY_STATE_BYTES = 64 << 20
STATE_PIXELS = 480 * 832  # the frame size of those figures
# With a planned share of the device (--device-memory-gib): what the gateway holds that torch.cuda.memory_allocated does
# not count (the CUDA context, cuDNN's and cuBLAS's workspaces), and the reserve for a decode call's activations and
# the allocator's slack.  No neighbour grows into a planned share, so the reserve is smaller than the derived one's.
CONTEXT_BYTES = 1 * GIB
PLANNED_RESERVE_BYTES = 2 * GIB


def planned_reserve(share: int) -> int:
    """The reserve kept out of a planned share's decoder budget: 2 GiB, or 10% of the share."""
    return max(PLANNED_RESERVE_BYTES, int(MEMORY_RESERVE_FRACTION * share))


def share_decoder_budget(share: int, held: int) -> int:
    """The decoder-state budget of a gateway given ``share`` bytes of its GPU that holds ``held`` bytes
    (``torch.cuda.memory_allocated`` once its models are loaded and warmed): the rest less ``CONTEXT_BYTES`` and
    ``planned_reserve``; at least 0."""
    return max(0, share - held - CONTEXT_BYTES - planned_reserve(share))


def share_for_decoder(room: int, held: int) -> int:
    """The smallest share whose ``share_decoder_budget`` is at least ``room`` (a plan's inverse)."""
    fixed = room + held + CONTEXT_BYTES
    share = max(fixed + PLANNED_RESERVE_BYTES, int(fixed / (1.0 - MEMORY_RESERVE_FRACTION)) + 1)
    while share_decoder_budget(share, held) < room:
        share += 1 << 20
    return share


@dataclass
class DecoderMemory:
    """Admission by the memory a stream's decoder state holds on the gateway's device (``--decoder-memory-gib``).

    ``per_pixel`` is each decoder kind's state bytes per frame pixel (its state at the serving size over that size's
    pixels: the caches scale with the frame); a stream holds ``per_pixel[cfg.decoder] x width x height`` from
    admission until it is forgotten.  ``budget`` None: unbounded (a CPU, where the host's memory is not the limit
    this guards)."""

    budget: int | None
    per_pixel: dict[str, float]
    device: str
    origin: str = ""
    held: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    @classmethod
    def derive(
        cls,
        device: str,
        state_bytes: dict[str, int],
        serving_hw: tuple[int, int],
        *,
        budget_gib: float = 0,
        free_bytes: Callable[[], tuple[int, int]] | None = None,
        share_gib: float = 0,
        held_bytes: Callable[[], int] | None = None,
    ) -> DecoderMemory:
        """``state_bytes``: each decoder kind's one-stream state at the serving size ``serving_hw`` (height, width).
        ``budget_gib`` > 0 is the budget; 0 derives it: on a GPU with ``share_gib`` > 0 (``--device-memory-gib``, the
        gateway's planned share of the device) that share less what the gateway holds now (``held_bytes()``, by
        default ``torch.cuda.memory_allocated``; ``share_decoder_budget``), else its free memory now (``free_bytes()
        -> (free, total)``, by default ``torch.cuda.mem_get_info``) less a reserve; on a CPU unbounded."""
        if not 0 <= budget_gib <= MAX_BUDGET_GIB:
            raise ValueError(f"--decoder-memory-gib must be in [0, {MAX_BUDGET_GIB}] (0: derived), got {budget_gib}")
        if not 0 <= share_gib <= MAX_BUDGET_GIB:
            raise ValueError(f"--device-memory-gib must be in [0, {MAX_BUDGET_GIB}] (0: derived), got {share_gib}")
        for kind, held in state_bytes.items():
            if held < 0:
                raise ValueError(f"decoder state bytes of {kind!r} must be >= 0, got {held}")
        pixels = serving_hw[0] * serving_hw[1]
        if pixels <= 0:
            raise ValueError(f"serving size must be positive, got {serving_hw[0]}x{serving_hw[1]}")
        per_pixel = {kind: held / pixels for kind, held in state_bytes.items()}
        if budget_gib > 0:
            return cls(int(budget_gib * GIB), per_pixel, device, "set")
        if not device.startswith("cuda"):
            return cls(None, per_pixel, device, "unbounded on a CPU")
        if share_gib > 0:
            if held_bytes is None:
                import torch

                held_bytes = lambda: torch.cuda.memory_allocated(torch.device(device))  # noqa: E731
            share, held = int(share_gib * GIB), held_bytes()
            origin = (
                f"its {share_gib:.1f} GiB share of {device} (--device-memory-gib) less the {held / GIB:.1f} GiB its "
                f"models hold, {CONTEXT_BYTES / GIB:.0f} GiB of CUDA context and a {planned_reserve(share) / GIB:.1f} "
                "GiB reserve"
            )
            return cls(share_decoder_budget(share, held), per_pixel, device, origin)
        if free_bytes is None:
            import torch

            free_bytes = lambda: torch.cuda.mem_get_info(torch.device(device))  # noqa: E731
        free, total = free_bytes()
        reserve = max(MEMORY_RESERVE_BYTES, int(MEMORY_RESERVE_FRACTION * total))
        budget = max(0, free - reserve)
        origin = f"{device}'s {free / GIB:.1f} GiB free at start-up less a {reserve / GIB:.1f} GiB reserve"
        return cls(budget, per_pixel, device, origin)

    def stream_fit_problem(self, decoder: str, serving_hw: tuple[int, int]) -> str | None:
        """Why this gateway may not start: its budget holds no stream of its default ``decoder`` at the serving size
        ``serving_hw`` (height, width); None when it holds one, is unbounded, or that decoder holds no state here."""
        need = int(self.per_pixel.get(decoder, 0.0) * serving_hw[0] * serving_hw[1])
        if self.budget is None or need == 0 or need <= self.budget:
            return None
        return (
            f"decoder memory: one {serving_hw[1]}x{serving_hw[0]} stream on the {decoder} decoder (the default) holds "
            f"{need / GIB:.2f} GiB of decoder state on {self.device}, and this gateway has {self.budget / GIB:.2f} GiB "
            f"for streams ({self.origin}): give it --decoder-memory-gib or a larger --device-memory-gib, put it on "
            "another GPU, or make the tiny decoder the default (--default-decoder tiny)"
        )

    def need(self, cfg: EffectiveConfig) -> int:
        return int(self.per_pixel.get(cfg.decoder, 0.0) * cfg.width * cfg.height)

    def check(self, cfg: EffectiveConfig) -> Release | None:
        need = self.need(cfg)
        if need == 0:
            return None
        with self.lock:
            if self.budget is not None and self.held + need > self.budget:
                raise Refused(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"decoder memory: a {cfg.width}x{cfg.height} stream on the {cfg.decoder} decoder holds "
                    f"{need / GIB:.2f} GiB of decoder state on {self.device}; this gateway's streams hold "
                    f"{self.held / GIB:.2f} of its {self.budget / GIB:.2f} GiB (--decoder-memory-gib; {self.origin}); "
                    "ask for the tiny decoder or a smaller frame, or retry later",
                )
            self.held += need
        return lambda: self._give_back(need)

    def _give_back(self, need: int) -> None:
        with self.lock:
            self.held -= need


class Admission:
    """The admission checks of a gateway, run in order by ``admit``; ``checks`` may be appended to."""

    def __init__(self, checks: Sequence[Check] = ()):
        self.checks: list[Check] = list(checks)

    def admit(self, cfg: EffectiveConfig) -> Release:
        """Run every check; on a refusal, give back what the earlier checks took and raise ``Refused``.  Returns a
        callable that gives back everything the checks took (for a stream that fails before it is registered)."""
        taken: list[Release] = []
        try:
            for check in self.checks:
                release = check(cfg)
                if release is not None:
                    taken.append(release)
        except BaseException:
            _release_all(taken)
            raise
        return lambda: _release_all(taken)


def _release_all(taken: list[Release]) -> None:
    for release in reversed(taken):
        release()
