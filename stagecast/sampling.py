"""Timestep ladders and the flow-matching shift: the sampler math every floor shares.

Usage::

    cfg = SamplerConfig.from_json(json.loads(path.read_text())["sampler"])   # SamplerError names the key
    cfg.ladder(4)                    # the checkpoint's ladder for 4 steps, e.g. (700.0, 500.0, 400.0, 200.0)
    cfg.supported_steps()            # the step counts it has a ladder for
    cfg.resolve(steps=None, timesteps=[700, 400], default_steps=4)   # a client's ladder, checked
    sigmas((700.0, 400.0), shift=5.0)    # [sigma_0, sigma_1, 0.0]: what the sampler steps between
    model_timestep(sigma)                # what the transformer is conditioned on (sigma * 1000)

A **ladder** is a strictly descending tuple of training timesteps in (0, 1000], one per denoising step, noisiest
first.  ``shift`` maps a timestep ``t`` to the flow-matching noise level
``sigma = shift*s / (1 + (shift-1)*s)`` with ``s = t/1000`` (diffusers' ``FlowMatchEulerDiscreteScheduler``, and
Self-Forcing's ``warp_denoising_step``); the model sees ``sigma * 1000``.  A checkpoint whose ladder is already
in model-timestep space (CausVid, StreamDiffusionV2: ``warp_denoising_step: false``) uses shift 1.

Every ladder and shift is rounded to float32 (``as_f32``), the precision the wire carries, so the gateway,
the coordinator, every stage and the single-process reference hold the very same numbers and derive the very
same sigmas from ``sigmas()``; parity stays bit for bit.

A checkpoint names its sampler in the ``sampler`` section of ``stagecast.json`` (docs/checkpoints.md)::

    "sampler": {
      "update": "x0",                        # "x0": predict x0, re-noise (CausVid / Self-Forcing / SDV2); "euler"
      "shift": 5.0,                          # default 1.0
      "ladder": [1000, 750, 500, 250],       # explicit: n steps use its first n entries
      "ladder": {"even_from": 1000},         # or a rule: n steps use T * (1 - i/n), i = 0..n-1 (the default)
      "ladders": {"3": [700, 600, 400]},     # per step count, ahead of the ladder; alone, the only counts
      "steps": [1, 2, 3, 4],                 # the step counts offered (default: every count a ladder exists for)
      "client_timesteps": true,              # may a stream send its own ladder (StreamConfig.timesteps)?
      "timestep_range": [1, 1000]            # where a stream's own timesteps may lie (inclusive)
    }

``SamplerConfig.ladder(n)`` is the one place a step count becomes a ladder: the gateway uses it for the steps a
stream asks for, and a controller that changes steps mid-stream uses it for the new count.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

MAX_STEPS = 50  # denoising steps per chunk, the most any ladder may hold
T_MAX = 1000.0  # training timesteps lie in (0, T_MAX]
UPDATES = ("x0", "euler")
SAMPLER_KEYS = ("update", "shift", "ladder", "ladders", "steps", "client_timesteps", "timestep_range")
MAX_SHIFT = 100.0


class SamplerError(ValueError):
    """A sampler setting or a ladder is invalid; the message starts with the field (or key path) at fault."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


def as_f32(x: float) -> float:
    """``x`` rounded to the nearest float32, as a Python float: what a ``float`` proto field carries."""
    return float(np.float32(x))


def _fmt(values: Sequence[float]) -> str:
    return "[" + ", ".join(f"{v:g}" for v in values) + "]"


def _fmt_counts(counts: Sequence[int]) -> str:
    counts = sorted(counts)
    if len(counts) > 2 and counts == list(range(counts[0], counts[-1] + 1)):
        return f"{counts[0]}..{counts[-1]}"
    return ", ".join(str(c) for c in counts)


def check_ladder(
    values: Sequence[float],
    *,
    field: str = "timesteps",
    lo: float = 0.0,
    hi: float = T_MAX,
    lo_inclusive: bool = False,
    steps: int | None = None,
) -> tuple[float, ...]:
    """Return ``values`` as a float32-rounded ladder, or raise ``SamplerError(field, ...)`` saying what is wrong:
    empty, too long, a non-number, outside the range, not strictly descending, or not ``steps`` entries."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise SamplerError(field, f"must be a list of timesteps, got {values!r}")
    if not values:
        raise SamplerError(field, "must hold at least one timestep")
    if len(values) > MAX_STEPS:
        raise SamplerError(field, f"has {len(values)} timesteps; at most {MAX_STEPS} steps are supported")
    if steps is not None and len(values) != steps:
        raise SamplerError(field, f"has {len(values)} timesteps but steps is {steps}: one timestep per step")
    out = []
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise SamplerError(field, f"entry {i} is {v!r}, not a finite number")
        inside = (lo <= v if lo_inclusive else lo < v) and v <= hi
        if not inside:
            bounds = f"{'[' if lo_inclusive else '('}{lo:g}, {hi:g}]"
            raise SamplerError(field, f"entry {i} is {v:g}, outside {bounds}")
        out.append(as_f32(v))
    for i in range(1, len(out)):
        if out[i] >= out[i - 1]:
            raise SamplerError(
                field,
                f"must be strictly descending (noisiest first), but entry {i} ({out[i]:g}) follows {out[i - 1]:g} "
                f"in {_fmt(out)}",
            )
    return tuple(out)


def even_ladder(steps: int, start: float = T_MAX) -> tuple[float, ...]:
    """``steps`` timesteps evenly spaced from ``start`` down: 4 from 1000 -> (1000, 750, 500, 250)."""
    if not 1 <= steps <= MAX_STEPS:
        raise SamplerError("steps", f"must be in [1, {MAX_STEPS}], got {steps}")
    return tuple(as_f32(start * (1 - i / steps)) for i in range(steps))


def check_shift(value: float, field: str = "shift") -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise SamplerError(field, f"must be a number, got {value!r}")
    if not 0 < value <= MAX_SHIFT:
        raise SamplerError(field, f"must be in (0, {MAX_SHIFT:g}], got {value:g}")
    return as_f32(value)


def sigmas(timesteps: Sequence[float], shift: float) -> list[float]:
    """The noise level of every step, then the terminal 0.0: ``shift*s / (1 + (shift-1)*s)``, ``s = t/1000``.

    The one function that turns a ladder into what the sampler steps between: the reference executor and every
    stage call it (through ``stage_service.sampler.FlowSampler``), so both derive identical numbers."""
    s = np.asarray(timesteps, dtype=np.float64) / T_MAX
    sig = shift * s / (1 + (shift - 1) * s)
    return [float(x) for x in sig] + [0.0]


def model_timestep(sigma: float) -> float:
    """What the transformer is conditioned on at noise level ``sigma`` (the clean pass: 0)."""
    return sigma * T_MAX


def _ladder_json(data: dict) -> dict:
    """The ``ladder`` and ``ladders`` keys of a ``sampler`` section as ``SamplerConfig`` keyword arguments."""
    kw: dict = {}
    ladder = data.get("ladder")
    if ladder is None:
        kw["even_from"] = None if "ladders" in data else T_MAX
    elif isinstance(ladder, dict):
        extra = sorted(set(ladder) - {"even_from"})
        if extra or "even_from" not in ladder:
            bad = extra[0] if extra else "even_from"
            raise SamplerError(
                f"sampler.ladder.{bad}",
                "unknown key" if extra else 'missing: the rule form is {"even_from": T}',
            )
        kw["even_from"] = ladder["even_from"]
    else:
        kw["ladder"], kw["even_from"] = ladder, None
    if "ladders" in data:
        raw = data["ladders"]
        if not isinstance(raw, dict):
            raise SamplerError("sampler.ladders", 'must map step counts to ladders, e.g. {"2": [700, 400]}')
        ladders = {}
        for key, lad in raw.items():
            try:
                n = int(key)
            except ValueError:
                raise SamplerError(f"sampler.ladders.{key}", 'a key must be a step count such as "4"') from None
            ladders[n] = lad
        kw["ladders"] = ladders
    return kw


@dataclass(frozen=True)
class SamplerConfig:
    """A checkpoint's sampler: the update rule, the shift, and a ladder for each step count it supports."""

    update: str = "x0"
    shift: float = 1.0
    ladder: tuple[float, ...] | None = None  # explicit; n steps use the first n entries
    even_from: float | None = T_MAX  # the rule "even from T": used when ``ladder`` is None
    ladders: Mapping[int, tuple[float, ...]] = field(default_factory=dict, hash=False)
    steps: tuple[int, ...] | None = None  # the step counts offered; None: every count a ladder exists for
    client_timesteps: bool = True
    timestep_range: tuple[float, float] = (1.0, T_MAX)

    def __post_init__(self):
        if self.update not in UPDATES:
            raise SamplerError("sampler.update", f"must be one of {', '.join(UPDATES)}, got {self.update!r}")
        object.__setattr__(self, "shift", check_shift(self.shift, "sampler.shift"))
        if self.ladder is not None and self.even_from is not None:
            raise SamplerError("sampler.ladder", "is either explicit timesteps or the rule even_from, not both")
        if self.ladder is not None:
            object.__setattr__(self, "ladder", check_ladder(self.ladder, field="sampler.ladder"))
        if self.even_from is not None:
            if not (isinstance(self.even_from, (int, float)) and 0 < self.even_from <= T_MAX):
                raise SamplerError("sampler.ladder.even_from", f"must be in (0, {T_MAX:g}], got {self.even_from!r}")
            object.__setattr__(self, "even_from", as_f32(self.even_from))
        object.__setattr__(self, "ladders", self._checked_ladders(self.ladders))
        if self.ladder is None and self.even_from is None and not self.ladders:
            raise SamplerError("sampler", "names no ladder: give ladder (explicit or even_from) or ladders")
        if self.steps is not None:
            object.__setattr__(self, "steps", self._checked_steps(self.steps))
        lo, hi = self.timestep_range
        if not (0 < lo <= hi <= T_MAX):
            raise SamplerError(
                "sampler.timestep_range", f"must be [lo, hi] with 0 < lo <= hi <= {T_MAX:g}, got {lo}, {hi}"
            )
        if not isinstance(self.client_timesteps, bool):
            raise SamplerError("sampler.client_timesteps", f"must be true or false, got {self.client_timesteps!r}")

    @staticmethod
    def _checked_ladders(raw: Mapping[int, tuple[float, ...]]) -> dict[int, tuple[float, ...]]:
        ladders = {}
        for n, lad in raw.items():
            key = f"sampler.ladders.{n}"
            if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_STEPS:
                raise SamplerError(key, f"a step count must be an integer in [1, {MAX_STEPS}]")
            ladders[n] = check_ladder(lad, field=key, steps=n)
        return dict(sorted(ladders.items()))

    def _checked_steps(self, steps: tuple[int, ...]) -> tuple[int, ...]:
        """The offered step counts, each one a count a ladder exists for, ascending and without repeats."""
        derivable = set(self._derivable())
        if not steps:
            raise SamplerError("sampler.steps", "must offer at least one step count")
        for n in steps:
            if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_STEPS:
                raise SamplerError("sampler.steps", f"{n!r} is not a step count in [1, {MAX_STEPS}]")
            if n not in derivable:
                raise SamplerError("sampler.steps", f"{n} has no ladder (ladders exist for {_fmt_counts(derivable)})")
        return tuple(sorted(set(steps)))

    def _derivable(self) -> list[int]:
        counts = set(self.ladders)
        if self.ladder is not None:
            counts.update(range(1, len(self.ladder) + 1))
        if self.even_from is not None:
            counts.update(range(1, MAX_STEPS + 1))
        return sorted(counts)

    def supported_steps(self) -> tuple[int, ...]:
        """The step counts this sampler offers, ascending."""
        return self.steps if self.steps is not None else tuple(self._derivable())

    def ladder_for(self, steps: int) -> tuple[float, ...]:
        """The ladder for ``steps`` denoising steps, or ``SamplerError("steps", ...)`` if there is none.

        ``ladders[steps]`` if the checkpoint names one, else the explicit ladder truncated to ``steps``, else
        ``even_from * (1 - i/steps)``."""
        supported = self.supported_steps()
        if steps not in supported:
            raise SamplerError("steps", f"this checkpoint's sampler offers {_fmt_counts(supported)} steps, not {steps}")
        if steps in self.ladders:
            return self.ladders[steps]
        if self.ladder is not None:
            return self.ladder[:steps]
        assert self.even_from is not None
        return even_ladder(steps, self.even_from)

    def resolve(self, *, steps: int | None, timesteps: Sequence[float] | None, default_steps: int) -> tuple[float, ...]:
        """The ladder of one stream: its own ``timesteps`` if it sent some (checked against what this checkpoint
        allows), else the checkpoint's ladder for ``steps`` (or ``default_steps``).  Errors name the field."""
        if timesteps:
            if not self.client_timesteps:
                raise SamplerError(
                    "timesteps",
                    "this checkpoint does not accept a stream's own ladder (stagecast.json sampler.client_timesteps "
                    "is false); leave timesteps out and choose steps",
                )
            lo, hi = self.timestep_range
            ladder = check_ladder(timesteps, field="timesteps", lo=lo, hi=hi, lo_inclusive=True, steps=steps)
            supported = self.supported_steps()
            if len(ladder) not in supported:
                raise SamplerError(
                    "timesteps",
                    f"has {len(ladder)} timesteps; this checkpoint's sampler offers {_fmt_counts(supported)} steps",
                )
            return ladder
        return self.ladder_for(default_steps if steps is None else steps)

    # ---- stagecast.json ------------------------------------------------------------------------------------

    @classmethod
    def from_json(cls, data: object) -> SamplerConfig:
        """Parse the ``sampler`` section of ``stagecast.json``; unknown keys and bad values raise ``SamplerError``
        naming the key path (``sampler.ladders.3``)."""
        if not isinstance(data, dict):
            raise SamplerError("sampler", f"must be an object, got {type(data).__name__}")
        unknown = sorted(set(data) - set(SAMPLER_KEYS))
        if unknown:
            raise SamplerError(f"sampler.{unknown[0]}", f"unknown key; known: {', '.join(SAMPLER_KEYS)}")
        kw: dict = {}
        if "update" in data:
            kw["update"] = data["update"]
        if "shift" in data:
            kw["shift"] = data["shift"]
        kw.update(_ladder_json(data))
        if "steps" in data:
            if not isinstance(data["steps"], list):
                raise SamplerError("sampler.steps", f"must be a list of step counts, got {data['steps']!r}")
            kw["steps"] = tuple(data["steps"])
        if "client_timesteps" in data:
            kw["client_timesteps"] = data["client_timesteps"]
        if "timestep_range" in data:
            rng = data["timestep_range"]
            if not (isinstance(rng, list) and len(rng) == 2 and all(isinstance(v, (int, float)) for v in rng)):
                raise SamplerError("sampler.timestep_range", f"must be [lo, hi], got {rng!r}")
            kw["timestep_range"] = (float(rng[0]), float(rng[1]))
        return cls(**kw)

    def to_json(self) -> dict:
        """The ``sampler`` section that ``from_json`` reads back to an equal config (for tools that write
        checkpoint folders)."""
        out: dict = {"update": self.update, "shift": self.shift}
        if self.ladder is not None:
            out["ladder"] = list(self.ladder)
        elif self.even_from is not None:
            out["ladder"] = {"even_from": self.even_from}
        if self.ladders:
            out["ladders"] = {str(n): list(lad) for n, lad in self.ladders.items()}
        if self.steps is not None:
            out["steps"] = list(self.steps)
        out["client_timesteps"] = self.client_timesteps
        out["timestep_range"] = list(self.timestep_range)
        return out
