"""On stages that run CUDA graphs the scheduler batches only micro-steps whose KV windows hold equal frames: a graph
is per batch signature, which holds each item's window length, so a stream whose window still fills would otherwise
make a new signature beside every other stream's chunk, each run eagerly at about twice a graph's time."""

from __future__ import annotations

import pytest

from coordinator.scheduler import StreamBatchScheduler
from stagecast.microstep import MicroStep, StreamSpec, context_frames
from tests.engine_helpers import small_spec

P = 1  # pipeline stages (one: every ready micro-step fits the batch)
ROPE = 1024


def spec(sid: int) -> StreamSpec:
    return small_spec(stream_id=sid, timesteps=(1000.0,), window=3, sink=1, num_chunks=12)


def plan(equal_windows: bool, late: int = 6) -> tuple[list[list[MicroStep]], dict[int, StreamSpec]]:
    """Streams 1 and 2 from tick 0 and stream 3 from tick ``late`` (its window fills beside their full ones)."""
    sched = StreamBatchScheduler(num_stages=P, max_batch=4, equal_windows=equal_windows, rope_limit=ROPE)
    specs = {s.stream_id: s for s in (spec(1), spec(2), spec(3))}
    sched.add_stream(specs[1])
    sched.add_stream(specs[2])
    batches = []
    for tick in range(200):
        if tick == late:
            sched.add_stream(specs[3])
        batches.append(sched.tick())
        if tick > late and not sched.active:
            break
    return batches, specs


def windows(batch: list[MicroStep], specs: dict[int, StreamSpec]) -> set[int]:
    return {len(context_frames(specs[s.stream], s.chunk, ROPE)) for s in batch}


@pytest.mark.unit
def test_a_filling_window_is_batched_apart_only_where_the_stages_run_graphs():
    mixed, specs = plan(equal_windows=False)
    assert any(len(windows(b, specs)) > 1 for b in mixed)  # without the rule, a filling window rides a full batch
    apart, _ = plan(equal_windows=True)
    assert all(len(windows(b, specs)) <= 1 for b in apart)
    # Every stream still ran each chunk exactly once, and full windows still batch together.
    for sid, s in specs.items():
        assert sorted(st.chunk for b in apart for st in b if st.stream == sid) == list(range(s.num_chunks))
    assert max(len(b) for b in apart) > 1


@pytest.mark.unit
def test_windows_are_told_apart_by_their_frames_not_by_their_streams():
    # Two streams started together fill their windows in step: they batch together from their first chunk.
    sched = StreamBatchScheduler(num_stages=P, max_batch=4, equal_windows=True, rope_limit=ROPE)
    sched.add_stream(spec(1))
    sched.add_stream(spec(2))
    first = sched.tick()
    assert {s.stream for s in first} == {1, 2} and {s.chunk for s in first} == {0}


@pytest.mark.unit
@pytest.mark.parametrize("equal_windows", [False, True])
def test_a_joining_streams_first_chunk_goes_ahead_of_the_running_streams_later_chunks(equal_windows):
    # Its viewer waits for the first frame, while running streams' chunks start ahead of their slots.
    ladder = (1000.0, 750.0)
    sched = StreamBatchScheduler(num_stages=2, max_batch=1, equal_windows=equal_windows, rope_limit=ROPE)
    for sid in (1, 2):
        sched.add_stream(small_spec(stream_id=sid, timesteps=ladder, window=3, sink=1, num_chunks=12))
    for _ in range(9):
        sched.tick()
    sched.add_stream(small_spec(stream_id=3, timesteps=ladder, window=3, sink=1, num_chunks=12))
    first = sched.tick()
    assert [(s.stream, s.chunk, s.level) for s in first] == [(3, 0, 0)]
    # Its next level goes ahead too once its latent is back (two stages: two ticks later).
    sched.tick()
    assert [(s.stream, s.chunk, s.level) for s in sched.tick()] == [(3, 0, 1)]
    # From its second chunk on, it takes its turn by age among the others.
    later = [s for _ in range(40) for s in sched.tick()]
    assert {s.stream for s in later} == {1, 2, 3}
