"""Sequence-parallel groups: the ranks of one pipeline stage that share its layers (Ulysses).

Modelled on vLLM's ``parallel_state``: the world is laid out as ``pipeline × sequence``, global rank
``stage * sp + sp_rank``; each stage's ``sp`` ranks form their own process group (``SequenceGroup``), beside the
pipeline's point-to-point links, which join rank ``(k, r)`` to ``(k + 1, r)``.  Every rank creates every group in
the same order, as ``torch.distributed.new_group`` requires.

Usage::

    layout = ParallelLayout(pipeline=2, sp=2)        # stagecast.model.parallel: 4 ranks
    group = init_sequence_groups(layout, rank=3)     # after init_process_group: this rank's SequenceGroup
    group.all_to_all([t0, t1])                       # send t_j to sp rank j; returns what each rank sent us
    group.all_gather(t)                              # [t from rank 0, t from rank 1]

    groups = ThreadSequenceGroup.create(2)           # the same layout inside one process (the reference):
                                                     # one handle per thread, exchanging through memory

Both kinds move data only (no arithmetic), so a run over processes and a run over threads of one process give
the same bits for the same shard layout.  ``LOCAL`` is the group of one: no sharding, no communication.

How a stage of S ranks computes: stage 0's ranks each embed the whole chunk and keep their sequence shard (L / S
tokens of every item), and every block runs on the shard.  Self-attention is Ulysses (``stage_service.dit_slice``):
one all-to-all turns q, k, v (after ``norm_q`` / ``norm_k``) from sequence shards into the whole sequence for H / S
heads, RoPE and attention with the KV window run there, and a second all-to-all brings the output back to shards, so
a rank's KV cache holds its own heads.  Cross-attention, modulation and the FFN need no exchange.  The last stage
gathers the shards before its head; every rank steps the sampler, and only rank 0 of the last stage reports chunks.
Each rank reports its exchanges' time (``BatchDone.exchange_ms``), summed per rank in ``StageStats.exchange_ms_total``.
Against the unsharded model a sharded forward differs by rounding only (its GEMMs' shapes differ): the stated bound is
2e-6 in fp32 (``tests/test_sequence_parallel.py``).  CUDA graphs with ``--sp`` > 1 are refused at start-up.
"""

from __future__ import annotations

import re
import threading
import time
from collections import deque

import torch
import torch.distributed as dist

from stagecast.model.parallel import ParallelLayout


class PeerLost(RuntimeError):
    """A data-plane operation failed because a peer (or this stage, leaving) closed the generation's connections.
    Its message names the peer and gloo's / NCCL's reason in one line (``short_reason``)."""


def short_reason(exc: BaseException) -> str:
    """The first sentence of a communication error, without gloo's source location: ``[.../pair.cc:553] Connection
    closed by peer [127.0.0.1]:56455. This is typically caused by ...`` becomes ``Connection closed by peer
    [127.0.0.1]:56455``."""
    text = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    text = re.sub(r"^\[[^\]]*\]\s*", "", text)
    return text.split(". ")[0][:200]


class SequenceGroup:
    """One rank's handle on its stage's sequence-parallel group."""

    rank: int = 0
    size: int = 1

    def all_to_all(self, chunks: list[torch.Tensor]) -> list[torch.Tensor]:
        """Send ``chunks[j]`` to rank j; return the chunks every rank sent here, by source rank."""
        raise NotImplementedError

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        raise NotImplementedError

    def abort(self) -> None:
        pass

    def take_ms(self) -> float:
        """Milliseconds spent in this group's collectives since the last call (on GPU: those finished so far)."""
        return 0.0


class _Local(SequenceGroup):
    def all_to_all(self, chunks):
        return list(chunks)

    def all_gather(self, tensor):
        return [tensor]


LOCAL: SequenceGroup = _Local()


class DistSequenceGroup(SequenceGroup):
    """A torch.distributed subgroup (gloo on CPU, NCCL on GPU); every chunk has the same shape and dtype."""

    def __init__(self, group: dist.ProcessGroup, rank: int, size: int, ranks: list[int] | None = None):
        self.group = group
        self.rank = rank
        self.size = size
        self.ranks = ranks  # the world ranks (registry stage indices) in the group, for messages
        self._ms = 0.0  # host-timed collectives (gloo: they block)
        self._events: deque = deque()  # CUDA event pairs around NCCL collectives, read once finished

    def _timed(self, tensor: torch.Tensor, run) -> None:
        if tensor.is_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            self._run(run)
            end.record()
            self._events.append((start, end))
            return
        t0 = time.perf_counter()
        self._run(run)
        self._ms += (time.perf_counter() - t0) * 1e3

    def _run(self, run) -> None:
        try:
            run()
        except RuntimeError as exc:
            group = f"stages {', '.join(map(str, self.ranks))}" if self.ranks else "this stage's ranks"
            raise PeerLost(f"data plane: lost a peer of the sequence group of {group}: {short_reason(exc)}") from None

    def take_ms(self) -> float:
        ms, self._ms = self._ms, 0.0
        while self._events and self._events[0][1].query():
            start, end = self._events.popleft()
            ms += start.elapsed_time(end)
        return ms

    def all_to_all(self, chunks):
        if len(chunks) != self.size:
            raise ValueError(f"all_to_all needs {self.size} chunks, got {len(chunks)}")
        send = torch.stack([c.contiguous() for c in chunks])
        recv = torch.empty_like(send)
        self._timed(send, lambda: dist.all_to_all_single(recv, send, group=self.group))
        return list(recv.unbind(0))

    def all_gather(self, tensor):
        out = [torch.empty_like(tensor) for _ in range(self.size)]
        self._timed(tensor, lambda: dist.all_gather(out, tensor.contiguous(), group=self.group))
        return out


def init_sequence_groups(layout: ParallelLayout, rank: int, backend: str | None = None) -> SequenceGroup:
    """Create every stage's sequence group (all ranks, same order) and return this rank's; LOCAL when sp is 1."""
    if layout.sp == 1:
        return LOCAL
    mine = None
    for stage in range(layout.pipeline):
        ranks = layout.sequence_ranks(stage)
        group = dist.new_group(ranks, backend=backend)
        if rank in ranks:
            mine = DistSequenceGroup(group, layout.sp_rank_of(rank), layout.sp, ranks=list(ranks))
    assert mine is not None
    return mine


class SequenceGroupAborted(RuntimeError):
    pass


class _Exchange:
    """Shared state of the threads that emulate one sequence group."""

    def __init__(self, size: int):
        self.size = size
        self.barrier = threading.Barrier(size)
        self.slots: list[list[torch.Tensor] | None] = [None] * size


class ThreadSequenceGroup(SequenceGroup):
    """One thread's handle on a sequence group whose ranks are threads of this process (the reference)."""

    def __init__(self, exchange: _Exchange, rank: int):
        self._x = exchange
        self.rank = rank
        self.size = exchange.size

    @classmethod
    def create(cls, size: int) -> list[ThreadSequenceGroup]:
        exchange = _Exchange(size)
        return [cls(exchange, r) for r in range(size)]

    def _swap(self, payload: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        x = self._x
        try:
            x.slots[self.rank] = payload
            x.barrier.wait()
            everyone = list(x.slots)
            x.barrier.wait()  # nobody overwrites a slot before every rank has read it
        except threading.BrokenBarrierError:
            raise SequenceGroupAborted("another rank of the sequence group failed") from None
        return everyone  # type: ignore[return-value]

    def all_to_all(self, chunks):
        if len(chunks) != self.size:
            raise ValueError(f"all_to_all needs {self.size} chunks, got {len(chunks)}")
        everyone = self._swap(list(chunks))
        return [everyone[src][self.rank].clone() for src in range(self.size)]

    def all_gather(self, tensor):
        everyone = self._swap([tensor])
        return [everyone[src][0].clone() for src in range(self.size)]

    def abort(self) -> None:
        self._x.barrier.abort()


__all__ = [
    "LOCAL",
    "DistSequenceGroup",
    "SequenceGroup",
    "ThreadSequenceGroup",
    "init_sequence_groups",
]
