"""Balance per GPU: the DiT's stage partition and the VAE's cut, chosen together from measured times.

Every stage GPU carries its DiT stage, and the gateway's VAE slices run on the stage GPUs too, so the steady-state
rate is set by the busiest GPU: its stage's blocks (plus the stage's fixed work, and the patch embedding on the first
stage, the head and sampler step on the last) plus the VAE slices it holds, per chunk.  ``plan_balance`` picks the
layers per stage and the decoder units per VAE slice that minimise that largest per-GPU time::

    costs = BalanceCosts(blocks_ms=[0.5] * 30, stage_ms=0.3, first_ms=0.2, last_ms=0.6,
                         vae_units_ms=[1, 4, 9, 14, 12, 9, 3])
    plan = plan_balance(costs, stage_gpus=["cuda:0", "cuda:1"], vae_gpus=["cuda:0", "cuda:1"])
    plan.counts           # layers per stage, for --partition (e.g. [17, 13])
    plan.vae_split        # decoder units where VAE slices 1.. start, for the gateway's --vae-split (e.g. [4])
    plan.gpu_ms           # {"cuda:0": ..., "cuda:1": ...}: predicted ms per chunk on each GPU
    evaluate(costs, [15, 15], [4], stage_gpus, vae_gpus).bottleneck_ms   # any given partition and cut, for comparison

The answer is exact: the VAE cuts are enumerated (depth first, pruned by a lower bound) and, for each, the partition
is a dynamic programme over the blocks.  Times are compared in whole nanoseconds, so ties are exact, and they are
broken deterministically: the smallest largest per-GPU time, then the smallest sum of squared per-GPU times (the most
even spread of what is left), then the lexicographically smallest (layers per stage, VAE split).

Each DiT stage must have a GPU of its own (a GPU may also hold any number of VAE slices, and a GPU may hold VAE slices
only).  This module is pure arithmetic: it imports no model code and no service.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

MAX_BLOCKS = 256
MAX_VAE_UNITS = 64
MAX_GPUS = 64
MAX_MS = 1e5  # one cost of 100 s per chunk is surely a unit mistake
_NS = 1_000_000  # ms -> integer nanoseconds


class BalanceError(ValueError):
    """Bad planner input; the message names the field."""


@dataclass(frozen=True)
class BalanceCosts:
    """Measured milliseconds per chunk (steady state).

    ``blocks_ms[i]``: transformer block i.  ``stage_ms``: what every stage spends besides its blocks (conditioning,
    RoPE tables, KV bookkeeping).  ``first_ms`` / ``last_ms``: what only the first stage (patch embedding) / the last
    stage (head, sampler step) adds.  ``vae_units_ms[u]``: decoder unit u, in the order the gateway cuts at.
    """

    blocks_ms: tuple[float, ...]
    vae_units_ms: tuple[float, ...] = ()
    stage_ms: float = 0.0
    first_ms: float = 0.0
    last_ms: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "blocks_ms", tuple(self.blocks_ms))
        object.__setattr__(self, "vae_units_ms", tuple(self.vae_units_ms))
        if not self.blocks_ms:
            raise BalanceError("blocks_ms: at least one transformer block is needed")
        if len(self.blocks_ms) > MAX_BLOCKS:
            raise BalanceError(f"blocks_ms: at most {MAX_BLOCKS} blocks, got {len(self.blocks_ms)}")
        if len(self.vae_units_ms) > MAX_VAE_UNITS:
            raise BalanceError(f"vae_units_ms: at most {MAX_VAE_UNITS} units, got {len(self.vae_units_ms)}")
        for i, v in enumerate(self.blocks_ms):
            _check_ms(f"blocks_ms[{i}]", v)
        for i, v in enumerate(self.vae_units_ms):
            _check_ms(f"vae_units_ms[{i}]", v)
        for name in ("stage_ms", "first_ms", "last_ms"):
            _check_ms(name, getattr(self, name))


def _check_ms(field: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BalanceError(f"{field}: a number of milliseconds, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise BalanceError(f"{field}: must be finite and >= 0 ms, got {value!r}")
    if value > MAX_MS:
        raise BalanceError(f"{field}: {value} ms per chunk is over the limit of {MAX_MS:g} ms")


def _ns(ms: float) -> int:
    return round(ms * _NS)


@dataclass(frozen=True)
class BalancePlan:
    counts: list[int]  # layers per stage
    vae_split: list[int]  # decoder units where VAE slices 1.. start (empty with one slice or none)
    stage_ms: list[float]  # per stage: its blocks and fixed work
    vae_slice_ms: list[float]  # per VAE slice
    gpu_ms: dict[Hashable, float]  # per GPU: its stage and its VAE slices, ms per chunk
    bottleneck_ms: float  # the largest of gpu_ms: the steady-state time per chunk

    @property
    def partition(self) -> str:
        """``--partition`` text: ``"17,13"``."""
        return ",".join(map(str, self.counts))

    def flags(self) -> str:
        """The plan as command-line flags: ``"--partition 17,13 --vae-split 9"`` (``-`` for no VAE cut)."""
        return f"--partition {self.partition} --vae-split {','.join(map(str, self.vae_split)) or '-'}"

    def gpu_ms_text(self) -> str:
        """Per GPU, its ms per chunk: ``"cuda:0 20.31, cuda:1 21.02"``."""
        return ", ".join(f"{g} {ms:.2f}" for g, ms in self.gpu_ms.items())

    @property
    def chunks_per_second(self) -> float:
        return 1e3 / self.bottleneck_ms if self.bottleneck_ms > 0 else math.inf


def _check_layout(costs: BalanceCosts, stage_gpus: Sequence[Hashable], vae_gpus: Sequence[Hashable]) -> None:
    stages = len(stage_gpus)
    if stages < 1:
        raise BalanceError("stage_gpus: at least one stage is needed")
    if stages > len(costs.blocks_ms):
        raise BalanceError(
            f"stage_gpus: {stages} stages need at least {stages} transformer blocks, blocks_ms has "
            f"{len(costs.blocks_ms)}"
        )
    if len(set(stage_gpus)) != stages:
        raise BalanceError(f"stage_gpus: each stage needs a GPU of its own, got {list(stage_gpus)}")
    if len(set(stage_gpus) | set(vae_gpus)) > MAX_GPUS:
        raise BalanceError(f"stage_gpus, vae_gpus: at most {MAX_GPUS} GPUs")
    if vae_gpus and len(vae_gpus) > len(costs.vae_units_ms):
        raise BalanceError(
            f"vae_gpus: {len(vae_gpus)} VAE slices need at least {len(vae_gpus)} decoder units, vae_units_ms has "
            f"{len(costs.vae_units_ms)}"
        )


def _fixed_ns(costs: BalanceCosts, stages: int) -> list[int]:
    out = [_ns(costs.stage_ms)] * stages
    out[0] += _ns(costs.first_ms)
    out[-1] += _ns(costs.last_ms)
    return out


def evaluate(
    costs: BalanceCosts,
    counts: Sequence[int],
    vae_split: Sequence[int],
    stage_gpus: Sequence[Hashable],
    vae_gpus: Sequence[Hashable],
) -> BalancePlan:
    """The per-GPU times of a given partition and VAE cut (an even split, a MAC-balanced cut, ...)."""
    _check_layout(costs, stage_gpus, vae_gpus)
    counts, vae_split = list(counts), list(vae_split)
    if len(counts) != len(stage_gpus) or any(c < 1 for c in counts) or sum(counts) != len(costs.blocks_ms):
        raise BalanceError(
            f"counts: {counts} is not {len(stage_gpus)} stages of >= 1 layer summing to {len(costs.blocks_ms)}"
        )
    units = len(costs.vae_units_ms)
    if vae_gpus:
        edges = [0, *vae_split, units]
        if len(vae_split) != len(vae_gpus) - 1 or any(a >= b for a, b in itertools.pairwise(edges)):
            raise BalanceError(f"vae_split: {vae_split} does not cut {units} units into {len(vae_gpus)} slices")
    elif vae_split:
        raise BalanceError(f"vae_split: {vae_split} given without VAE slices")
    return _plan(costs, counts, vae_split, stage_gpus, vae_gpus)


def _plan(costs, counts, vae_split, stage_gpus, vae_gpus) -> BalancePlan:
    fixed = _fixed_ns(costs, len(counts))
    blocks = [_ns(v) for v in costs.blocks_ms]
    units = [_ns(v) for v in costs.vae_units_ms]
    stage_ns, start = [], 0
    for k, c in enumerate(counts):
        stage_ns.append(fixed[k] + sum(blocks[start : start + c]))
        start += c
    slice_ns = []
    if vae_gpus:
        edges = [0, *vae_split, len(units)]
        slice_ns = [sum(units[a:b]) for a, b in itertools.pairwise(edges)]
    gpu_ns: dict[Hashable, int] = {}
    for gpu, t in [*zip(stage_gpus, stage_ns), *zip(vae_gpus, slice_ns)]:
        gpu_ns[gpu] = gpu_ns.get(gpu, 0) + t
    return BalancePlan(
        counts=list(counts),
        vae_split=list(vae_split),
        stage_ms=[t / _NS for t in stage_ns],
        vae_slice_ms=[t / _NS for t in slice_ns],
        gpu_ms={g: t / _NS for g, t in gpu_ns.items()},
        bottleneck_ms=max(gpu_ns.values()) / _NS,
    )


def plan_balance(
    costs: BalanceCosts,
    stage_gpus: Sequence[Hashable],
    vae_gpus: Sequence[Hashable] = (),
    *,
    counts: Sequence[int] | None = None,
) -> BalancePlan:
    """The partition (``len(stage_gpus)`` stages, stage k on ``stage_gpus[k]``) and the VAE cut
    (``len(vae_gpus)`` slices, slice j on ``vae_gpus[j]``; none: the VAE is not placed) with the smallest
    largest per-GPU time per chunk; ties broken as the module docstring says.  With ``counts`` the partition is
    given and only the VAE cut is chosen."""
    _check_layout(costs, stage_gpus, vae_gpus)
    stages, n = len(stage_gpus), len(costs.blocks_ms)
    fixed = _fixed_ns(costs, stages)
    prefix = [0, *itertools.accumulate(_ns(v) for v in costs.blocks_ms)]
    given: list[int] = []
    if counts is not None:
        counts = list(counts)
        evaluate(costs, counts, [], stage_gpus, ())  # BalanceError names a bad partition
        edges = [0, *itertools.accumulate(counts)]
        given = [fixed[k] + prefix[edges[k + 1]] - prefix[edges[k]] for k in range(stages)]
    units = [_ns(v) for v in costs.vae_units_ms]
    slices = len(vae_gpus)
    stage_of_gpu = {g: k for k, g in enumerate(stage_gpus)}
    min_block = min(prefix[i + 1] - prefix[i] for i in range(n))

    best: tuple | None = None  # (bottleneck, sum of squares, counts, split)
    minimax: dict[tuple, int] = {}  # per VAE load on the stage GPUs (cuts often share one, e.g. when they tie)
    squares_memo: dict[tuple, tuple[int, list[int]]] = {}

    def consider(split: list[int], vae_load: dict[Hashable, int]) -> None:
        nonlocal best
        offsets = tuple(vae_load.get(g, 0) for g in stage_gpus)
        vae_only = [t for g, t in vae_load.items() if g not in stage_of_gpu]
        floor = max(vae_only, default=0)
        if counts is not None:
            loads = [a + b for a, b in zip(given, offsets, strict=True)]
            bottleneck, squares, chosen = max(floor, *loads), sum(t * t for t in loads), counts
        else:
            if offsets not in minimax:
                minimax[offsets] = _minimax(prefix, fixed, offsets)
            bottleneck = max(floor, minimax[offsets])
            if best is not None and bottleneck > best[0]:
                return
            if (offsets, bottleneck) not in squares_memo:
                squares_memo[offsets, bottleneck] = _min_squares(prefix, fixed, offsets, bottleneck)
            squares, chosen = squares_memo[offsets, bottleneck]
        key = (bottleneck, squares + sum(t * t for t in vae_only), chosen, split)
        if best is None or key < best:
            best = key

    if slices == 0:
        consider([], {})
    else:
        unit_prefix = [0, *itertools.accumulate(units)]
        total_units = len(units)

        def lower_bound(load: dict[Hashable, int]) -> int:
            # What a GPU carries already, plus at least its stage's fixed work and one block.
            return max(t + (fixed[stage_of_gpu[g]] + min_block if g in stage_of_gpu else 0) for g, t in load.items())

        def dfs(j: int, start: int, split: list[int], load: dict[Hashable, int]) -> None:
            # Slice j starts at unit ``start``; slices j+1.. need a unit each.
            if j == slices - 1:
                stops = [total_units]
            else:
                stops = range(start + 1, total_units - (slices - 1 - j) + 1)
            for stop in stops:
                gpu = vae_gpus[j]
                here = dict(load)
                here[gpu] = here.get(gpu, 0) + unit_prefix[stop] - unit_prefix[start]
                if best is not None and lower_bound(here) > best[0]:
                    continue
                if j == slices - 1:
                    consider(split, here)
                else:
                    dfs(j + 1, stop, [*split, stop], here)

        dfs(0, 0, [], {})
    assert best is not None
    return _plan(costs, best[2], best[3], stage_gpus, vae_gpus)


def _minimax(prefix: list[int], fixed: list[int], offsets: Sequence[int]) -> int:
    """The smallest possible largest stage load (fixed + blocks + the VAE on its GPU) over contiguous partitions."""
    n, stages = len(prefix) - 1, len(fixed)
    inf = math.inf
    # g[i]: best largest load of stages k.. covering blocks [i, n); built from the last stage backwards.
    g = [inf] * (n + 1)
    last = stages - 1
    for i in range(last, n):
        g[i] = fixed[last] + offsets[last] + prefix[n] - prefix[i]
    for k in range(stages - 2, -1, -1):
        nxt, g = g, [inf] * (n + 1)
        base = fixed[k] + offsets[k]
        for i in range(k, n - (stages - 1 - k)):
            best = inf
            for j in range(i + 1, n - (stages - 2 - k)):
                load = base + prefix[j] - prefix[i]
                if load >= best:
                    break  # loads only grow with j
                v = load if load > nxt[j] else nxt[j]
                if v < best:
                    best = v
            g[i] = best
    return int(g[0])


def _min_squares(prefix: list[int], fixed: list[int], offsets: Sequence[int], limit: int) -> tuple[int, list[int]]:
    """Among partitions whose every stage load is <= ``limit``: the smallest sum of squared loads, and the
    lexicographically smallest layer counts achieving it."""
    n, stages = len(prefix) - 1, len(fixed)
    inf = math.inf
    # h[k][i]: smallest sum of squares for stages k.. covering blocks [i, n), each load <= limit.
    h = [[inf] * (n + 1) for _ in range(stages + 1)]
    h[stages][n] = 0
    for k in range(stages - 1, -1, -1):
        base = fixed[k] + offsets[k]
        for i in range(k, n - (stages - 1 - k)):
            best = inf
            for j in range(i + 1, n - (stages - 2 - k) if k < stages - 1 else n + 1):
                load = base + prefix[j] - prefix[i]
                if load > limit:
                    break
                rest = h[k + 1][j]
                if rest == inf:
                    continue
                v = load * load + rest
                if v < best:
                    best = v
            h[k][i] = best
    counts, i = [], 0
    for k in range(stages):
        base = fixed[k] + offsets[k]
        stop = n - (stages - 2 - k) if k < stages - 1 else n + 1
        for j in range(i + 1, stop):
            load = base + prefix[j] - prefix[i]
            if load <= limit and h[k + 1][j] != inf and load * load + h[k + 1][j] == h[k][i]:
                counts.append(j - i)
                i = j
                break
    return int(h[0][0]), counts
