"""The value types every layer shares: a stream's fixed parameters and the micro-step.

The scheduler makes ``MicroStep``s, the wire carries them (``stagecast.internal.v1.MicroStep``), and a stage
executes them.  A micro-step is ``(stream, chunk, level)``: level ``0 .. steps-1`` are denoising levels and
level ``steps`` is the clean pass of the ``clean`` KV policy.  Everything a stage derives from a micro-step
(timestep, RoPE offset, which KV row to read and write) is a pure function of it and its ``StreamSpec``, so
the reference executor and every stage agree without asking each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

from stagecast.sampling import MAX_STEPS, UPDATES, as_f32

POLICIES = ("clean", "per_level")


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

    def __post_init__(self):
        errors = []
        if self.policy not in POLICIES:
            errors.append(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.chunk_frames < 1:
            errors.append(f"chunk_frames must be >= 1, got {self.chunk_frames}")
        if not self.timesteps:
            errors.append("timesteps must hold at least one step")
        elif len(self.timesteps) > MAX_STEPS:
            errors.append(f"timesteps has {len(self.timesteps)} steps; at most {MAX_STEPS} are supported")
        elif any(not (0 < t <= 1000) for t in self.timesteps):  # also catches NaN
            errors.append(f"timesteps must lie in (0, 1000], got {list(self.timesteps)}")
        else:
            # float32, as the wire carries them: every process that holds this spec holds the same ladder.
            object.__setattr__(self, "timesteps", tuple(as_f32(t) for t in self.timesteps))
            if any(a <= b for a, b in zip(self.timesteps, self.timesteps[1:])):
                errors.append(f"timesteps must be strictly decreasing, got {list(self.timesteps)}")
        if not (0 < self.shift <= 1e6):  # also catches NaN
            errors.append(f"shift must be > 0, got {self.shift}")
        else:
            object.__setattr__(self, "shift", as_f32(self.shift))
        if self.window is not None and self.window < 1:
            errors.append(f"window must be >= 1 latent frame or None, got {self.window}")
        if self.sink < 0 or (self.window is not None and self.sink > self.window):
            errors.append(f"sink must be in [0, window], got sink={self.sink} window={self.window}")
        if self.reset_frames is not None and (
            self.reset_frames < self.chunk_frames or self.reset_frames % self.chunk_frames
        ):
            errors.append(f"reset_frames must be a positive multiple of chunk_frames, got {self.reset_frames}")
        if self.sampler not in UPDATES:
            errors.append(f"sampler must be 'x0' or 'euler', got {self.sampler!r}")
        if self.num_chunks is not None and self.num_chunks < 1:
            errors.append(f"num_chunks must be >= 1 or None, got {self.num_chunks}")
        if errors:
            raise ValueError("invalid stream spec: " + "; ".join(errors))

    @property
    def steps(self) -> int:
        return len(self.timesteps)

    @property
    def levels(self) -> int:
        """Micro-steps per chunk: the denoising steps, plus the clean pass under the ``clean`` policy."""
        return self.steps + (1 if self.policy == "clean" else 0)

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


def context_frames(spec: StreamSpec, chunk: int, rope_limit: int) -> list[int]:
    """Absolute latent frames that ``chunk`` attends to besides its own: the causal KV window.

    Frames of earlier epochs are never visible; within the epoch, the first ``sink`` frames plus the most
    recent ``window - sink`` frames (all of them when ``window`` is None).
    """
    f0 = chunk * spec.chunk_frames
    epoch = spec.epoch_frames(rope_limit)
    start = (f0 // epoch) * epoch
    earlier = list(range(start, f0))
    if spec.window is None or len(earlier) <= spec.window:
        return earlier
    sinks = earlier[: spec.sink]
    recent_count = spec.window - spec.sink
    recent = earlier[len(earlier) - recent_count :] if recent_count else []
    return sinks + [f for f in recent if f not in sinks]


def rope_offset(spec: StreamSpec, chunk: int, rope_limit: int) -> int:
    f0 = chunk * spec.chunk_frames
    return f0 % spec.epoch_frames(rope_limit)


PLAN_EVENT_KINDS = ("open", "batch", "close", "prompt", "input")


@dataclass(frozen=True)
class PlanEvent:
    """One entry of a plan, in execution order: open a stream, run a batch, change a prompt, hand a video-to-video
    stream the input latents of a chunk (``chunk``, ``latents``; planned before the batch that starts it), or close
    a stream.

    The coordinator makes them, the wire carries them (``stagecast.wire.event_to_proto`` / ``event_from_proto``),
    every stage executes them in ``seq`` order, and the reference executor replays them.  ``text`` (open, prompt)
    and ``latents`` (input) are None in a recorded plan, which keeps only what the schedule was.
    """

    kind: str
    seq: int = 0
    spec: StreamSpec | None = None
    text: torch.Tensor | None = None
    steps: tuple[MicroStep, ...] = ()
    stream_id: int | None = None
    from_chunk: int = 0  # "prompt": the first chunk the new prompt applies to
    traceparent: str = ""
    chunk: int = 0  # "input": the chunk whose level-0 latents these are
    # "input": (1, C, F, h, w); "open" of an image_latents stream: the image latent (1, C, 1, h, w); None in a
    # recorded plan.
    latents: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.kind not in PLAN_EVENT_KINDS:
            raise ValueError(f"plan event kind {self.kind!r} is not one of {PLAN_EVENT_KINDS}")
