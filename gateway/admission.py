"""Whether a stream may start on this gateway: the admission checks, in order, and the per-stream cost budget.

Usage::

    budget = CostBudget.derive(defaults, device="cuda:0")   # from the checkpoint's serving defaults and the device
    budget.check(cfg)                                       # raises Refused(RESOURCE_EXHAUSTED, "cost budget: ...")

    admission = Admission([count_cap, budget.check])        # the gateway's; later checks append (e.g. capacity)
    release = admission.admit(cfg)                          # raises Refused; release() gives back what was taken

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

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc

from gateway.checkpoint import ServingDefaults
from gateway.config import EffectiveConfig
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
