"""Layer partitions: which contiguous blocks each pipeline stage owns.

Usage::

    counts = parse_partition("8,12,12,8", num_layers=40, num_stages=4)   # or None: an even split
    partition_ranges(counts)                                             # [range(0, 8), range(8, 20), ...]
"""

from __future__ import annotations

import itertools


def even_partition(num_layers: int, num_stages: int) -> list[int]:
    """Split ``num_layers`` into ``num_stages`` contiguous counts differing by at most one (earlier ones larger)."""
    if num_stages < 1:
        raise ValueError(f"stage count must be >= 1, got {num_stages}")
    if num_stages > num_layers:
        raise ValueError(f"cannot split {num_layers} layers into {num_stages} stages: each stage needs a layer")
    base, extra = divmod(num_layers, num_stages)
    return [base + (1 if i < extra else 0) for i in range(num_stages)]


def parse_partition(spec: str | list[int] | None, num_layers: int, num_stages: int | None = None) -> list[int]:
    """Parse ``"8,12,12,8"`` (or a list); None means an even split over ``num_stages``."""
    if spec is None or spec == "":
        if num_stages is None:
            raise ValueError("either a partition or a stage count is required")
        return even_partition(num_layers, num_stages)
    if spec == "auto":
        raise ValueError(
            "partition 'auto' is planned by stagecast up / selftest / the harness from --balance-profile; a "
            "coordinator takes the layers per stage that plan printed, e.g. 17,13"
        )
    if isinstance(spec, str):
        try:
            counts = [int(x) for x in spec.split(",")]
        except ValueError as exc:
            raise ValueError(f"partition {spec!r} must be comma-separated integers, e.g. '8,12,12,8'") from exc
    else:
        counts = [int(x) for x in spec]
    if any(c < 1 for c in counts):
        raise ValueError(f"partition {counts} has a stage with fewer than 1 layer")
    if sum(counts) != num_layers:
        raise ValueError(f"partition {counts} sums to {sum(counts)} layers but the model has {num_layers}")
    if num_stages is not None and len(counts) != num_stages:
        raise ValueError(f"partition {counts} has {len(counts)} stages but {num_stages} were requested")
    return counts


def partition_ranges(counts: list[int]) -> list[range]:
    """``[2, 3]`` -> ``[range(0, 2), range(2, 5)]``."""
    starts = [0, *itertools.accumulate(counts)]
    return [range(starts[i], starts[i + 1]) for i in range(len(counts))]
