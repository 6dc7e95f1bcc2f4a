"""``stagecast.kv_memory.stream_kv_bytes`` against what real ``StreamKVCache`` s hold while a tiny model runs streams.

The reference executor runs the same ``SliceRunner`` s (and so the same KV caches) a stage does, under the real
scheduler's wavefront.  Every commit is watched: a row's peak is the bytes it held before the commit plus the chunk
being written (its new frames exist beside the old ones until the eviction).  The bound says every row at its peak
at once, so the sum over rows of their peaks must equal it exactly.
"""

from __future__ import annotations

import pytest
import torch

from launcher.reference import ReferenceExecutor, StreamRequest
from stage_service.checkpoint import random_slice_state_dict
from stage_service.dit_slice import DiTSlice
from stage_service.kv_budget import (
    RESERVE_FRACTION,
    check_kv_budget_gib,
    graph_buffer_cap,
    kv_budget,
    measure_kv_budget,
)
from stage_service.kv_cache import StreamKVCache
from stagecast.kv_memory import kv_rows, max_context_frames, stream_kv_bytes
from stagecast.microstep import StreamSpec, context_frames
from stagecast.model.config import DiTConfig
from stagecast.model.dit_configs import model_config

pytestmark = pytest.mark.unit

CFG = model_config("tiny-wan2.1")
MODEL = DiTConfig.from_kwargs(CFG)
TEXT_LEN = 8


def full_slice(dtype: torch.dtype) -> DiTSlice:
    layers = range(CFG["num_layers"])
    torch.manual_seed(0)
    sd = random_slice_state_dict(CFG, layers=layers, first=True, last=True, dtype=dtype)
    return DiTSlice.from_state_dict(CFG, sd, layers=layers, first=True, last=True)


@pytest.fixture
def peaks(monkeypatch):
    """(id of cache, row) -> the most bytes the row held, its new chunk included, over every commit."""
    seen: dict[tuple[int, int], int] = {}
    caches: list[StreamKVCache] = []  # kept alive, so that ids stay unique
    commit = StreamKVCache.commit

    def watched(self, view):
        if view.writes:
            row = self.rows.get(view.row_id)
            held = sum(frame.nbytes for frame in row.frames.values()) if row is not None else 0
            key = (id(self), view.row_id)
            seen[key] = max(seen.get(key, 0), held + view.pending_bytes)
            caches.append(self)
        return commit(self, view)

    monkeypatch.setattr(StreamKVCache, "commit", watched)
    return seen


def spec(**kw) -> StreamSpec:
    base = dict(stream_id=1, latent_channels=16, chunk_frames=1, latent_height=4, latent_width=6, text_len=TEXT_LEN)
    return StreamSpec(**{**base, **kw})


def run(s: StreamSpec, dtype=torch.float32, *, sp=1, cfg_parallel=1, stop_tick=None, step_changes=None) -> None:
    text = torch.randn(1, TEXT_LEN, CFG["text_dim"], generator=torch.Generator().manual_seed(1))
    ref = ReferenceExecutor(full_slice(dtype), sp=sp, cfg_parallel=cfg_parallel)
    try:
        request = StreamRequest(
            s, text, stop_tick=stop_tick, step_changes=step_changes or {}, negative_text=-text if s.cfg else None
        )
        ref.generate([request], num_stages=2, max_batch=4)
    finally:
        ref.close()


CASES = {
    # a window of 3 with a sink, filled and rolled over: 3 rows
    "per_level window": dict(spec=spec(timesteps=(1000.0, 600.0, 300.0), window=3, sink=1, num_chunks=7)),
    # no window over a bounded stream: every row ends holding the whole stream (the bound is reached at rest)
    "clean unbounded bounded stream": dict(spec=spec(policy="clean", timesteps=(1000.0, 500.0), num_chunks=5)),
    # chunks of 2 frames, a window of 3 that holds part of a chunk
    "two-frame chunks": dict(spec=spec(chunk_frames=2, timesteps=(1000.0, 500.0), window=3, num_chunks=4)),
    # an unbounded stream with epochs of 3 frames: the context restarts at each reset
    "epochs": dict(spec=spec(timesteps=(1000.0, 500.0), reset_frames=3), stop_tick=30),
    # the SLO controller's step change 2 -> 3 steps: the new segment has 3 rows
    "step change": dict(
        spec=spec(timesteps=(1000.0, 500.0), window=2, num_chunks=9),
        step_changes={6: (1000.0, 700.0, 400.0)},
        max_steps=3,
    ),
    "bfloat16": dict(spec=spec(timesteps=(1000.0, 500.0), window=2, num_chunks=5), dtype=torch.bfloat16),
    # sequential CFG: both branches' rows in one runner
    "guided": dict(spec=spec(timesteps=(1000.0, 500.0), window=2, num_chunks=5, guidance_scale=5.0)),
    # CFG-parallel: each group's runner keeps its own branch
    "guided, CFG-parallel": dict(
        spec=spec(timesteps=(1000.0, 500.0), window=2, num_chunks=5, guidance_scale=5.0), cfg_parallel=2
    ),
    # sequence parallel: each rank keeps the whole sequence for its heads
    "sequence parallel": dict(spec=spec(timesteps=(1000.0, 500.0), window=2, num_chunks=5), sp=2),
}


@pytest.mark.parametrize("name", list(CASES))
def test_the_bound_is_every_row_of_a_real_cache_at_its_peak(peaks, name):
    case = CASES[name]
    s, dtype = case["spec"], case.get("dtype", torch.float32)
    sp, cfg_parallel = case.get("sp", 1), case.get("cfg_parallel", 1)
    changes = case.get("step_changes")
    run(s, dtype, sp=sp, cfg_parallel=cfg_parallel, stop_tick=case.get("stop_tick"), step_changes=changes)
    held = sum(peaks.values())
    element = torch.empty((), dtype=dtype).element_size()
    kw = dict(layers=MODEL.num_layers, element_bytes=element, max_steps=case.get("max_steps"), sp=sp)
    # Every process of the stage (sequence ranks, CFG groups) at its bound, summed, is what the caches held.
    groups = range(cfg_parallel)
    bound = sp * sum(stream_kv_bytes(s, MODEL, cfg_rank=g, cfg_size=cfg_parallel, **kw) for g in groups)
    assert held == bound > 0
    # CFG-parallel: group 0 holds the conditional branch, group 1 the unconditional one (and nothing of an unguided
    # stream); sequential CFG holds both.
    if s.cfg:
        one = stream_kv_bytes(s, MODEL, cfg_rank=0, cfg_size=2, **kw)
        assert stream_kv_bytes(s, MODEL, cfg_rank=1, cfg_size=2, **kw) == one
        assert stream_kv_bytes(s, MODEL, **kw) == 2 * one
    else:
        assert stream_kv_bytes(s, MODEL, cfg_rank=1, cfg_size=2, **kw) == 0


def test_the_most_context_comes_from_the_microstep_helpers():
    rope = MODEL.rope_max_seq_len
    # No window and no end: the RoPE epoch's last chunk sees every earlier frame of it.
    unbounded = spec()
    assert max_context_frames(unbounded, rope) == rope - 1
    assert max_context_frames(spec(num_chunks=10), rope) == 9
    assert max_context_frames(spec(window=6, sink=3), rope) == 6
    assert max_context_frames(spec(window=6, num_chunks=4), rope) == 3
    assert max_context_frames(spec(chunk_frames=3, reset_frames=9), rope) == 6
    for s in (unbounded, spec(window=6, sink=3), spec(chunk_frames=3, window=4, num_chunks=5)):
        epoch_chunks = s.epoch_frames(rope) // s.chunk_frames
        chunks = min(s.num_chunks or epoch_chunks, 3 * epoch_chunks)
        assert max_context_frames(s, rope) == max(len(context_frames(s, c, rope)) for c in range(chunks))
    assert kv_rows(spec(timesteps=(1000.0, 500.0)), max_steps=4) == 4
    assert kv_rows(spec(policy="clean", timesteps=(1000.0, 500.0)), max_steps=4) == 1


def test_a_stage_budget_is_the_operators_else_free_memory_less_the_reserve_and_none_on_a_cpu():
    gib = 1 << 30
    assert kv_budget(0.5, free=0, total=0, activation_peak=0) == gib // 2
    # 100 GiB free of 140: the reserve is the calibration's activation peak plus a tenth of the GPU.
    free, total, peak = 100 * gib, 140 * gib, 3 * gib
    assert kv_budget(0.0, free=free, total=total, activation_peak=peak) == free - peak - int(RESERVE_FRACTION * total)
    # With --cuda-graphs the graphs' buffer cap is kept out too.
    graphs = 30 * gib
    with_graphs = kv_budget(0.0, free=free, total=total, activation_peak=peak, graph_bytes=graphs)
    assert with_graphs == kv_budget(0.0, free=free, total=total, activation_peak=peak) - graphs
    # Nothing left is one byte (a stage that admits no stream), never 0, which would mean no limit.
    assert kv_budget(0.0, free=gib, total=total, activation_peak=peak) == 1
    cpu = torch.device("cpu")
    assert measure_kv_budget(cpu, operator_gib=0.0) == 0
    assert measure_kv_budget(cpu, operator_gib=2.0) == 2 * gib
    assert graph_buffer_cap(cpu, cuda_graphs=True) is None
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="--kv-budget-gib"):
            check_kv_budget_gib(bad)


def test_a_step_change_that_overlaps_the_old_ladder_holds_no_more_than_the_bound(monkeypatch):
    """A per_level step change's new KV segment starts while the old ladder's chunks finish: the stage's cache holds
    both segments' rows for a while, each old row only until the old segment's last chunk has committed it, so the
    cache never holds more rows, nor more bytes, than the bound of the stream's longest ladder."""
    most, rows, overlapped, commit = [0], [0], [0], StreamKVCache.commit

    def watched(self, view):
        if view.writes:
            most[0] = max(most[0], self.nbytes + view.pending_bytes)
            overlapped[0] += any(r for _, r in self.older.values())
        commit(self, view)
        rows[0] = max(rows[0], len(self.rows) + sum(len(r) for _, r in self.older.values()))

    monkeypatch.setattr(StreamKVCache, "commit", watched)
    s = spec(timesteps=(1000.0, 700.0, 400.0), window=2, num_chunks=10)
    # Another ladder of as many steps (each new row is written while the old ladder runs), then fewer, then more.
    run(s, step_changes={3: (1000.0, 600.0, 200.0), 5: (1000.0, 500.0), 7: (1000.0, 700.0, 400.0)})
    assert overlapped[0] > 0, "no step change overlapped the old ladder's chunks"
    bound = stream_kv_bytes(s, MODEL, layers=MODEL.num_layers, element_bytes=4, max_steps=3)
    assert 0 < most[0] <= bound
    assert rows[0] == 3  # never more rows than the longest ladder's: an old row goes before the new one is written
