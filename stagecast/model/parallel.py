"""The pipeline × sequence layout of a deployment, and the checks that refuse one that cannot run.

Global rank ``stage * sp + sp_rank``: each pipeline stage is a group of ``sp`` ranks (Ulysses sequence
parallelism), and the pipeline's point-to-point links join rank ``(k, r)`` to ``(k + 1, r)``.

Usage::

    layout = ParallelLayout(pipeline=2, sp=2)        # 4 ranks
    layout.stage_of(3), layout.sp_rank_of(3)         # 1, 1
    check_sp(2, heads=12)                            # LayoutError unless heads split evenly
    check_gpus(stages=2, sp=2, gpus=4)               # LayoutError unless stages × sp == GPUs
"""

from __future__ import annotations

from dataclasses import dataclass


class LayoutError(ValueError):
    """A pipeline × sequence layout that cannot run (the message names the flag)."""


@dataclass(frozen=True)
class ParallelLayout:
    pipeline: int  # P: pipeline stages
    sp: int = 1  # S: sequence-parallel ranks per stage

    def __post_init__(self):
        if self.pipeline < 1:
            raise LayoutError(f"--stages must be >= 1, got {self.pipeline}")
        if self.sp < 1:
            raise LayoutError(f"--sp must be >= 1, got {self.sp}")

    @property
    def world_size(self) -> int:
        return self.pipeline * self.sp

    def rank(self, stage: int, sp_rank: int) -> int:
        return stage * self.sp + sp_rank

    def stage_of(self, rank: int) -> int:
        return rank // self.sp

    def sp_rank_of(self, rank: int) -> int:
        return rank % self.sp

    def sequence_ranks(self, stage: int) -> list[int]:
        return [self.rank(stage, r) for r in range(self.sp)]


def check_sp(sp: int, heads: int) -> None:
    """Ulysses splits attention by heads: ``heads`` must be a multiple of ``sp``."""
    if sp < 1:
        raise LayoutError(f"--sp must be >= 1, got {sp}")
    if heads % sp:
        raise LayoutError(
            f"--sp {sp}: the model has {heads} attention heads, which do not split evenly over {sp} ranks "
            f"(Ulysses gives each rank heads/sp heads)"
        )


def check_gpus(stages: int, sp: int, gpus: int) -> None:
    """A sequence-parallel deployment puts one rank on each GPU: stages × sp must equal the GPUs given."""
    if stages * sp != gpus:
        raise LayoutError(
            f"--stages {stages} × --sp {sp} = {stages * sp} ranks, but {gpus} GPU(s) were given: "
            "with --sp each rank needs a GPU of its own"
        )
