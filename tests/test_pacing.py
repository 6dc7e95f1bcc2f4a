"""Pacing: a stream with a chunk rate starts chunk c no earlier than its real-time slot less the playout buffer.

The engine's plan loop is driven by hand here (no stages): ``PlanLoop.tick`` under a fake clock, so the test sees
exactly which chunks the scheduler was allowed to start at which time.
"""

import pytest
import torch

from coordinator.engine import PipelineEngine
from coordinator.requests import OpenRequest
from stagecast.model.dit_configs import model_config
from tests.engine_helpers import Clock, hand_driven_engine, small_spec
from tests.pipeline_helpers import wait_until

pytestmark = pytest.mark.unit

MODEL = model_config("tiny-wan2.1")


def engine(clock: Clock, playout_s: float = 0.5) -> PipelineEngine:
    return hand_driven_engine(max_batch=8, playout_s=playout_s, clock=clock, lookahead=10**6)


def open_stream(eng: PipelineEngine, rate: float, depth: int = 64, offset: float = 0.0):
    text = torch.zeros(1, 8, MODEL["text_dim"])
    # acknowledges with a large consumer depth: the delivery credit does not bind, the pace does.
    return eng.open(
        OpenRequest(small_spec(), text, acknowledges=True, consumer_depth=depth, chunk_rate=rate, pace_offset_s=offset)
    )


def run_ticks(eng: PipelineEngine, n: int) -> None:
    for _ in range(n):
        eng.planner.tick()
        eng.planner.batches_done = eng.planner.batches_planned  # every batch completes at once


def test_a_paced_stream_starts_chunks_at_its_rate_plus_the_playout_buffer():
    clock = Clock()
    eng = engine(clock, playout_s=0.5)
    s = open_stream(eng, rate=4.0)  # 16 fps, 4 frames per chunk
    run_ticks(eng, 50)
    # At the open: chunks whose slot is within 0.5 s: 0, 0.25, 0.5 -> 3 chunks.
    assert eng.sched.started_chunks[s.id] == 3
    assert eng.pacing.pace_timeout(eng.sched, eng.sessions.get) == pytest.approx(0.25, abs=1e-3)
    clock.t += 0.25
    run_ticks(eng, 50)
    assert eng.sched.started_chunks[s.id] == 4
    clock.t += 10.0  # 10 s later: 40 more slots
    run_ticks(eng, 400)
    assert eng.sched.started_chunks[s.id] == 44


def test_an_unpaced_stream_runs_as_far_as_its_lead_allows():
    clock = Clock()
    eng = engine(clock)
    s = open_stream(eng, rate=0.0, depth=0)
    run_ticks(eng, 50)
    assert eng.sched.started_chunks[s.id] == eng.pacing.lead_bound(s)  # the delivery bound, not the clock
    assert eng.pacing.pace_timeout(eng.sched, eng.sessions.get) is None


def test_pacing_leaves_the_pipeline_to_other_streams():
    # Two paced streams and one unpaced: the paced ones hold their rate, the unpaced one takes the rest.
    clock = Clock()
    eng = engine(clock, playout_s=0.0)
    a, b = open_stream(eng, 2.0), open_stream(eng, 2.0)
    run_ticks(eng, 20)
    assert eng.sched.started_chunks[a.id] == eng.sched.started_chunks[b.id] == 1
    clock.t += 1.0
    run_ticks(eng, 20)
    assert eng.sched.started_chunks[a.id] == eng.sched.started_chunks[b.id] == 3


@pytest.mark.parametrize("rate", [-1.0, float("nan"), 1001.0])
def test_a_chunk_rate_out_of_range_is_refused_naming_it(rate):
    eng = engine(Clock())
    with pytest.raises(ValueError, match="chunk_rate"):
        open_stream(eng, rate)


def test_the_plan_loop_wakes_for_each_paced_chunk_without_spinning():
    # The real plan-loop thread: it sleeps until the next paced chunk is due, and a chunk held by pace alone is
    # started as soon as its slot comes (the loop was idle: no batch or acknowledgement woke it).
    clock = Clock()
    eng = engine(clock, playout_s=0.0)
    eng.start()
    try:
        s = open_stream(eng, rate=4.0)
        wait_until(lambda: eng.sched.started_chunks.get(s.id) == 1, 10, what="the first chunk")
        ticks = eng.sched.now
        clock.t += 1.0  # four more slots
        wait_until(lambda: eng.sched.started_chunks.get(s.id) == 5, 10, what="four paced chunks")
        assert eng.pacing.pace_timeout(eng.sched, eng.sessions.get) == pytest.approx(0.25)
        # Idle until the next slot: the loop does not tick in a busy loop meanwhile.
        with eng.cond:
            now = eng.sched.now
        assert now - ticks < 200
    finally:
        eng.shutdown()


@pytest.mark.parametrize("rate", [0.7, 3.0, 4.0, 16.0, 29.97])
def test_when_the_loop_ticks_for_a_paced_chunk_the_credit_lets_it_start(rate):
    # The loop ticks once per chunk count when a slot is PACE_EARLY_S away; a credit that did not yet allow the chunk
    # at that tick left the stream stalled for good when no other event came (its last chunks consumed early).
    from coordinator.engine import PACE_EARLY_S

    clock = Clock()
    eng = engine(clock, playout_s=0.5)
    s = open_stream(eng, rate=rate)
    eng.planner.tick()  # the open is planned: the stream's real-time schedule starts
    for started in range(1, 200):
        due = eng.pacing.since(s.id) + started / rate - 0.5
        clock.t = due - PACE_EARLY_S  # the earliest moment the loop ticks for chunk `started`
        assert eng.pacing.paced_credit(s, clock()) >= started + 1, (rate, started)


def test_chunks_after_the_first_are_paced_sooner_by_the_offset():
    # 16 fps, 4 frames per chunk, but the first chunk has one frame: chunk c >= 1 holds frames 4c-3..4c, due at
    # (4c - 3) / 16 s, 3/16 s before the even spacing c / 4 says. Paced by frames, it starts 3/16 s sooner.
    clock = Clock()
    eng = engine(clock, playout_s=0.0)
    s = open_stream(eng, rate=4.0, offset=3 / 16)
    run_ticks(eng, 20)
    assert eng.sched.started_chunks[s.id] == 1  # chunk 1 is due 1/16 s after chunk 0
    assert eng.pacing.pace_timeout(eng.sched, eng.sessions.get) == pytest.approx(1 / 16, abs=1e-3)
    for c in range(1, 40):
        due = eng.pacing.since(s.id) + (4 * c - 3) / 16  # chunk c's first frame
        clock.t = due - 0.01
        run_ticks(eng, 5)
        assert eng.sched.started_chunks[s.id] == c, c  # not before its first frame's slot
        clock.t = due
        run_ticks(eng, 5)
        assert eng.sched.started_chunks[s.id] == c + 1, c


@pytest.mark.parametrize("rate, offset", [(4.0, 0.25), (4.0, -0.01), (4.0, float("nan")), (0.0, 0.1)])
def test_a_pace_offset_out_of_range_is_refused_naming_it(rate, offset):
    eng = engine(Clock())
    with pytest.raises(ValueError, match="pace_offset_s"):
        open_stream(eng, rate, offset=offset)


def test_the_gateway_paces_by_the_frames_each_chunk_holds():
    from gateway.edge.config import EffectiveConfig

    base = dict(
        prompt="p", width=64, height=64, chunk_frames=1, steps=1, seed=0, guidance_scale=1.0, codec="jpeg", fps=16.0,
        seconds=None, policy="per_level", window=None, sink=0, quality=80, latent_width=8, latent_height=8,
        total_frames=None, num_chunks=None,
    )  # fmt: skip
    paced = EffectiveConfig(**base)
    assert paced.chunk_rate == pytest.approx(4.0)
    assert paced.pace_offset_s == pytest.approx(3 / 16)  # the first chunk is 1 frame, the others 4
    two = EffectiveConfig(**{**base, "chunk_frames": 2})  # 5 frames, then 8
    assert two.chunk_rate == pytest.approx(2.0) and two.pace_offset_s == pytest.approx(3 / 16)
    assert EffectiveConfig(**{**base, "pace": False}).pace_offset_s == 0.0
    assert EffectiveConfig(**{**base, "strength": 1000.0}).pace_offset_s == 0.0  # video-to-video: its input paces it


def test_a_paced_chunk_is_started_when_an_earlier_stream_was_kicked_at_the_same_chunk_count():
    # The loop ticks for a paced chunk once per chunk count.  That count was the sum of the chunks the open streams
    # had started, which falls when a stream closes: a later stream reaching the count the loop last ticked for was
    # never ticked for, and stalled for good once nothing else woke the loop (seen in CI as a stream that stopped
    # delivering frames until its client's deadline).
    clock = Clock()
    eng = engine(clock, playout_s=0.0)
    stages = eng.registry.pipeline_stages
    eng.start()

    def idle_after(chunks: int, sid: int) -> bool:
        # The loop started `chunks` chunks of the stream and then ran out of work: only the clock can move it on.
        with eng.cond:
            return eng.sched.started_chunks.get(sid) == chunks and eng.planner._idle_ticks >= stages

    def advance(seconds: float) -> None:
        with eng.cond:
            clock.t += seconds
            eng.cond.notify_all()  # end the loop's real-time wait; not _wake(), which would tick regardless

    try:
        first = open_stream(eng, rate=4.0)
        wait_until(lambda: idle_after(1, first.id), 10, what="the first stream's first chunk")
        advance(0.25)  # the loop ticks for the first stream's chunk 1 with one chunk started in all
        wait_until(lambda: idle_after(2, first.id), 10, what="the first stream's second chunk")
        eng.cancel_stream(first.id)
        wait_until(lambda: first.id not in eng.sched.started_chunks, 10, what="the first stream's close")

        second = open_stream(eng, rate=4.0)
        wait_until(lambda: idle_after(1, second.id), 10, what="the second stream's first chunk")
        advance(0.25)  # again one chunk started in all: this chunk count was ticked for before
        wait_until(lambda: idle_after(2, second.id), 10, what="the second stream's second chunk")
    finally:
        eng.shutdown()


def paced_pair(grid: bool) -> list[tuple[int, int]]:
    """Two 16 fps streams opened 0.1 s apart; their started chunks every 10 ms for 4 s."""
    clock = Clock()
    eng = engine(clock, playout_s=0.5)
    eng.pacing.grid = grid
    clock.t = 100.03
    a = open_stream(eng, rate=4.0)
    run_ticks(eng, 10)
    clock.t += 0.1
    b = open_stream(eng, rate=4.0)
    started = []
    for _ in range(400):
        run_ticks(eng, 10)
        started.append((eng.sched.started_chunks[a.id], eng.sched.started_chunks[b.id]))
        clock.t += 0.01
    return started


def changes(counts: list[int]) -> list[int]:
    return [i for i in range(1, len(counts)) if counts[i] != counts[i - 1]]


def test_on_the_pace_grid_streams_opened_apart_start_their_chunks_together_and_never_later():
    apart, grid = paced_pair(grid=False), paced_pair(grid=True)
    a_apart, b_apart = changes([a for a, _ in apart]), changes([b for _, b in apart])
    a_grid, b_grid = changes([a for a, _ in grid]), changes([b for _, b in grid])
    assert len(a_grid) >= 14 and a_grid == b_grid  # one instant for both, every chunk period
    assert not set(a_apart) & set(b_apart)  # paced apart: never the same instant
    for (a0, b0), (a1, b1) in zip(apart, grid, strict=True):
        assert a0 <= a1 <= a0 + 1 and b0 <= b1 <= b0 + 1  # at most one chunk sooner, never later


def test_the_pace_grid_leaves_unpaced_streams_alone():
    clock = Clock()
    eng = engine(clock)
    eng.pacing.grid = True
    clock.t = 100.03
    s = open_stream(eng, rate=0.0, depth=0)
    run_ticks(eng, 5)
    assert eng.pacing.since(s.id) is None  # no real-time schedule: nothing to move onto the grid
