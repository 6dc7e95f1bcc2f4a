"""The value types every layer shares: a stream's fixed parameters and the micro-step.

The scheduler makes ``MicroStep``s, the wire carries them (``stagecast.internal.v1.MicroStep``), and a stage
executes them.  A micro-step is ``(stream, chunk, level)``: level ``0 .. steps-1`` are denoising levels and
level ``steps`` is the clean pass of the ``clean`` KV policy.  Everything a stage derives from a micro-step
(timestep, RoPE offset, which KV row to read and write) is a pure function of it and its ``StreamSpec``, so
the reference executor and every stage agree without asking each other.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

from stagecast.sampling import MAX_STEPS, UPDATES, as_f32

POLICIES = ("clean", "per_level")
MAX_GUIDANCE = 30.0  # classifier-free guidance scales a stream may ask for: [1, MAX_GUIDANCE]
CFG_BRANCHES = 2  # classifier-free guidance runs a conditional (0) and an unconditional (1) branch
# The Stream Batch: micro-steps a stage runs in one forward, unless the operator says otherwise (the coordinator's
# ``--max-batch``; ``stagecast up``, ``local_cluster``, the self-test and the benchmarks default to it too).  No Helm
# value mirrors it: the chart passes no ``--max-batch`` (tests/test_one_home.py checks it stays so or agrees).
DEFAULT_MAX_BATCH = 4


def chunk_levels(steps: int, policy: str) -> int:
    """Micro-steps (DiT passes) per chunk of a stream running ``steps`` denoising steps under KV ``policy``: one per
    step, plus the clean pass under ``clean``.  The one place this is written; the scheduler, the SLO controller,
    the coordinator's lead bound and the gateway's cost budget all count with it."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    return steps + (1 if policy == "clean" else 0)


@dataclass(frozen=True)
class MicroStep:
    stream: int
    chunk: int
    level: int

    def __str__(self) -> str:
        return f"s{self.stream}c{self.chunk}l{self.level}"


@dataclass(frozen=True)
class StreamSpec:
    """What a stream is, as far as the DiT is concerned.  Immutable for the stream's lifetime.

    ``window`` is the number of cached latent frames a chunk attends to (sinks included); None keeps every
    frame of the current epoch.  ``sink`` is how many of the epoch's first frames are never evicted.
    ``reset_frames`` bounds absolute positions for unbounded streams: every ``reset_frames`` latent frames
    the cache starts empty and RoPE positions restart at 0 (an "epoch").  None means the model's RoPE table
    length rounded down to whole chunks.
    """

    stream_id: int
    latent_channels: int
    chunk_frames: int
    latent_height: int
    latent_width: int
    timesteps: tuple[float, ...] = (1000.0, 750.0, 500.0, 250.0)  # the ladder (``stagecast.sampling``), float32
    shift: float = 1.0  # flow-matching shift of the ladder, float32
    seed: int = 0
    policy: str = "per_level"
    window: int | None = None
    sink: int = 0
    reset_frames: int | None = None
    sampler: str = "x0"  # "x0": predict x0, re-noise with fresh noise (CausVid / Self-Forcing); "euler"
    num_chunks: int | None = None  # None: unbounded, ends when stopped
    text_len: int = 512
    # Video-to-video: level 0 of chunk c starts from latents the consumer sends for it (already noised to
    # ``timesteps[0]``: the stream's strength), not from noise; chunk c starts only once they are here.
    input_latents: bool = False
    # Image-to-video (per-token-timestep models): latent frame 0 of the stream is a clean image latent, given at open,
    # at timestep 0 in every forward (WanImageToVideoPipeline with expand_timesteps).
    image_latents: bool = False
    # The first chunk of this spec's KV segment (``ChunkSpecs``): under ``per_level`` a step change starts a new
    # segment, where the cache starts empty and RoPE positions restart (a window reset).  0 in an open event.
    segment_start: int = 0
    # Classifier-free guidance, float32: 1.0 is none.  Above 1 every level runs a conditional branch (the
    # prompt) and an unconditional one (the negative prompt), combined as u + g * (c - u) before the sampler step.
    guidance_scale: float = 1.0
    # A warm-up stream (the gateway's, before it serves): its batches capture their CUDA graphs in line.
    warmup: bool = False

    def __post_init__(self):
        errors = []
        if self.policy not in POLICIES:
            errors.append(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.chunk_frames < 1:
            errors.append(f"chunk_frames must be >= 1, got {self.chunk_frames}")
        errors += self._ladder_errors() + self._window_errors()
        if self.sampler not in UPDATES:
            errors.append(f"sampler must be 'x0' or 'euler', got {self.sampler!r}")
        if not (1.0 <= self.guidance_scale <= MAX_GUIDANCE):  # also catches NaN
            errors.append(f"guidance_scale must be in [1, {MAX_GUIDANCE:g}], got {self.guidance_scale}")
        else:
            object.__setattr__(self, "guidance_scale", as_f32(self.guidance_scale))
        if self.num_chunks is not None and self.num_chunks < 1:
            errors.append(f"num_chunks must be >= 1 or None, got {self.num_chunks}")
        if self.segment_start < 0:
            errors.append(f"segment_start must be >= 0, got {self.segment_start}")
        if errors:
            raise ValueError("invalid stream spec: " + "; ".join(errors))

    def _ladder_errors(self) -> list[str]:
        """The ladder and its shift, checked and held as float32 (as the wire carries them: every process that holds
        this spec holds the same ladder)."""
        errors = []
        if not self.timesteps:
            errors.append("timesteps must hold at least one step")
        elif len(self.timesteps) > MAX_STEPS:
            errors.append(f"timesteps has {len(self.timesteps)} steps; at most {MAX_STEPS} are supported")
        elif any(not (0 < t <= 1000) for t in self.timesteps):  # also catches NaN
            errors.append(f"timesteps must lie in (0, 1000], got {list(self.timesteps)}")
        else:
            object.__setattr__(self, "timesteps", tuple(as_f32(t) for t in self.timesteps))
            if any(a <= b for a, b in zip(self.timesteps, self.timesteps[1:])):
                errors.append(f"timesteps must be strictly decreasing, got {list(self.timesteps)}")
        if not (0 < self.shift <= 1e6):  # also catches NaN
            errors.append(f"shift must be > 0, got {self.shift}")
        else:
            object.__setattr__(self, "shift", as_f32(self.shift))
        return errors

    def _window_errors(self) -> list[str]:
        errors = []
        if self.window is not None and self.window < 1:
            errors.append(f"window must be >= 1 latent frame or None, got {self.window}")
        if self.sink < 0 or (self.window is not None and self.sink > self.window):
            errors.append(f"sink must be in [0, window], got sink={self.sink} window={self.window}")
        if self.reset_frames is not None and (
            self.reset_frames < self.chunk_frames or self.reset_frames % self.chunk_frames
        ):
            errors.append(f"reset_frames must be a positive multiple of chunk_frames, got {self.reset_frames}")
        return errors

    @property
    def steps(self) -> int:
        return len(self.timesteps)

    @property
    def cfg(self) -> bool:
        """Whether the stream runs classifier-free guidance (two branches per micro-step)."""
        return self.guidance_scale != 1.0

    @property
    def levels(self) -> int:
        """Micro-steps per chunk: the denoising steps, plus the clean pass under the ``clean`` policy."""
        return chunk_levels(self.steps, self.policy)

    @property
    def latent_shape(self) -> tuple[int, int, int, int, int]:
        return (1, self.latent_channels, self.chunk_frames, self.latent_height, self.latent_width)

    def is_clean_pass(self, level: int) -> bool:
        return self.policy == "clean" and level == self.steps

    def kv_row(self, level: int) -> int:
        """Which KV row a level reads: its own under ``per_level``, the single clean row under ``clean``."""
        return level if self.policy == "per_level" else 0

    def writes_kv(self, level: int) -> bool:
        return self.policy == "per_level" or self.is_clean_pass(level)

    def epoch_frames(self, rope_limit: int) -> int:
        if self.reset_frames is not None:
            return self.reset_frames
        return (rope_limit // self.chunk_frames) * self.chunk_frames


def stream_branches(spec: StreamSpec, cfg_rank: int, cfg_size: int) -> tuple[int, ...]:
    """The CFG branches (0: conditional, 1: unconditional) a runner of CFG group ``cfg_rank`` (of ``cfg_size``)
    computes, and keeps KV rows for, for a stream: both under sequential CFG, its own under CFG-parallel (group 1
    runs nothing of an unguided stream)."""
    if not spec.cfg:
        return (0,) if cfg_rank == 0 else ()
    return (0, 1) if cfg_size == 1 else (cfg_rank,)


def context_frames(spec: StreamSpec, chunk: int, rope_limit: int) -> list[int]:
    """Absolute latent frames that ``chunk`` attends to besides its own: the causal KV window.

    Frames of earlier epochs are never visible; within the epoch, the first ``sink`` frames plus the most
    recent ``window - sink`` frames (all of them when ``window`` is None).
    """
    f0 = chunk * spec.chunk_frames
    epoch = spec.epoch_frames(rope_limit)
    seg = spec.segment_start * spec.chunk_frames
    start = seg + ((f0 - seg) // epoch) * epoch
    earlier = list(range(start, f0))
    if spec.window is None or len(earlier) <= spec.window:
        return earlier
    sinks = earlier[: spec.sink]
    recent_count = spec.window - spec.sink
    recent = earlier[len(earlier) - recent_count :] if recent_count else []
    return sinks + [f for f in recent if f not in sinks]


def recache_steps(spec: StreamSpec, from_chunk: int, rope_limit: int) -> list[tuple[int, int]]:
    """A recache before ``from_chunk``: the (chunk, KV row) forwards that rebuild the window under the new prompt.

    The window is what ``from_chunk`` would attend to (``context_frames``: the sinks and the most recent frames).
    Its chunks run in ascending order, each attending to the window frames before it (already rebuilt) and writing
    its frames that lie in the window, in every KV row of the policy: under ``clean`` the one clean row, from the
    chunk's clean latent at t=0 (a fresh stream's clean pass); under ``per_level`` row i, from the clean latent
    re-noised to level i with the chunk's level-i noise (``(1 - sigma_i) x + sigma_i * chunk_noise(c, i)``) at the
    level's timestep.
    """
    chunks = sorted({f // spec.chunk_frames for f in context_frames(spec, from_chunk, rope_limit)})
    rows = range(spec.steps) if spec.policy == "per_level" else [0]
    return [(c, r) for c in chunks for r in rows]


def rope_offset(spec: StreamSpec, chunk: int, rope_limit: int) -> int:
    f0 = chunk * spec.chunk_frames
    return (f0 - spec.segment_start * spec.chunk_frames) % spec.epoch_frames(rope_limit)


class ChunkSpecs:
    """A stream's spec for each chunk: the open spec, then each step change (a ``steps`` plan event) from its
    first chunk on.  The scheduler, every stage and the reference executor hold one per stream and derive a
    micro-step's timestep, level count and KV context from ``at(chunk)``.

    What a step change means:
      * ``clean``: the KV holds clean (t=0) context whatever ladder wrote it, so chunk c simply runs its own ladder
        and attends to the clean K/V of earlier chunks as before.
      * ``per_level``: KV row i holds level-i K/V, and level i is a different timestep on another ladder.  So a
        change is a window reset: its first chunk starts a new KV segment (``StreamSpec.segment_start``) with an
        empty cache and RoPE positions from 0, exactly as an epoch reset.  The new segment reads nothing of the
        old one, so the scheduler starts it while the old segment's chunks finish (the stage's cache keeps the old
        segment's rows until its last chunk has committed each); chunks still finish in order.  The oracle is the
        per_level full-sequence forward over each segment on its own.

    Usage::

        specs = ChunkSpecs(spec)
        specs.change(from_chunk=8, timesteps=(1000.0, 500.0))   # chunks >= 8 run 2 steps
        specs.at(9).steps                                        # 2
        specs.prune(before=8)                                    # chunks < 8 are done: forget their specs
    """

    def __init__(self, spec: StreamSpec):
        self.spec = spec
        self.changes: list[tuple[int, StreamSpec]] = [(0, spec)]

    def at(self, chunk: int) -> StreamSpec:
        current = self.changes[0][1]
        for first, spec in self.changes:
            if first > chunk:
                break
            current = spec
        return current

    def change(self, from_chunk: int, timesteps) -> bool:
        """Run ``timesteps`` from chunk ``from_chunk`` on; False (nothing changes) when that is the ladder already.
        Raises ValueError for an invalid ladder or a chunk before the last change."""
        last = self.changes[-1][0]
        if from_chunk < last:
            raise ValueError(f"steps change from chunk {from_chunk}: chunks from {last} on were already changed")
        timesteps = tuple(float(t) for t in timesteps)
        current = self.at(from_chunk)
        derived = replace(
            self.spec,
            timesteps=timesteps,
            segment_start=from_chunk if self.spec.policy == "per_level" else 0,
        )
        if derived.timesteps == current.timesteps:
            return False
        if from_chunk == last:
            self.changes[-1] = (from_chunk, derived)
        else:
            self.changes.append((from_chunk, derived))
        return True

    def prune(self, before: int) -> None:
        """Chunks below ``before`` are done: drop the specs only they used (the list stays bounded)."""
        while len(self.changes) > 1 and self.changes[1][0] <= before:
            self.changes.pop(0)

    def starts_segment(self, chunk: int) -> bool:
        """Whether ``chunk`` is the first of a new per_level KV segment (after a step change)."""
        return chunk > 0 and self.at(chunk).segment_start == chunk


PLAN_EVENT_KINDS = ("open", "batch", "close", "prompt", "input", "steps")


@dataclass(frozen=True)
class PlanEvent:
    """One entry of a plan, in execution order: open a stream, run a batch, change a prompt, hand a video-to-video
    stream the input latents of a chunk (``chunk``, ``latents``; planned before the batch that starts it), or close
    a stream.

    A prompt update changes the conditional branch only; a guided stream's negative prompt is fixed at open.

    The coordinator makes them, the wire carries them (``stagecast.wire.event_to_proto`` / ``event_from_proto``),
    every stage executes them in ``seq`` order, and the reference executor replays them.  ``text`` (open, prompt)
    and ``latents`` (input) are None in a recorded plan, which keeps only what the schedule was.
    """

    kind: str
    seq: int = 0
    spec: StreamSpec | None = None
    text: torch.Tensor | None = None
    negative_text: torch.Tensor | None = None  # "open" of a guided stream: the unconditional branch's text
    steps: tuple[MicroStep, ...] = ()
    stream_id: int | None = None
    from_chunk: int = 0  # "prompt", "steps": the first chunk the change applies to
    timesteps: tuple[float, ...] = ()  # "steps": the ladder chunks >= from_chunk run
    traceparent: str = ""
    chunk: int = 0  # "input": the chunk whose level-0 latents these are
    # "prompt" with transition recache: the KV window is recomputed under the new prompt before ``from_chunk``, from
    # the clean latents of the window's chunks: ``window`` holds (chunk, latents or None in a recorded plan).
    recache: bool = False
    window: tuple = ()
    # "input": (1, C, F, h, w); "open" of an image_latents stream: the image latent (1, C, 1, h, w); None in a
    # recorded plan.
    latents: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.kind not in PLAN_EVENT_KINDS:
            raise ValueError(f"plan event kind {self.kind!r} is not one of {PLAN_EVENT_KINDS}")
