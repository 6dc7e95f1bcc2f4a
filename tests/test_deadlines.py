"""Earliest deadline first: among ready micro-steps, the chunk a viewer needs soonest goes first.

A joining paced stream's viewer sees its first frame (chunk 0), and needs chunk 1's frames one frame period later,
while the running streams' next chunks start up to their playout buffer (0.5 s) before they are due.  Ordered by
stream arrival, a joining stream's chunk 1 waited behind every running stream's next chunk, and on one H200 the last
stream of a capacity ramp froze after its first frame (4 of 320 frames late: not held).  The engine's plan loop is
driven by hand here, under a fake clock, as in ``tests/test_pacing.py``.
"""

import pytest

import coordinator.pacing
from coordinator.pacing import FIRST_CHUNK_GRACE_S
from coordinator.requests import OpenRequest
from coordinator.scheduler import StreamBatchScheduler
from stagecast import wire
from tests.engine_helpers import TEXT, Clock, consume_first, hand_driven_engine, small_spec

pytestmark = pytest.mark.unit

ONE_STEP = (1000.0,)
RATE = 4.0  # 16 fps, 4 frames per chunk
OFFSET = 3 / 16  # Wan's first chunk decodes to one frame: later chunks are due three frames sooner


def engine(clock: Clock):
    eng = hand_driven_engine(stages=1, max_batch=2, playout_s=0.5, clock=clock, lookahead=10**6)
    eng.pacing.grid = True
    return eng


def open_paced(eng):
    spec = small_spec(timesteps=ONE_STEP, window=3, sink=1)
    return eng.open(
        OpenRequest(spec, TEXT, acknowledges=True, consumer_depth=64, chunk_rate=RATE, pace_offset_s=OFFSET)
    )


def tick(eng) -> list[tuple[int, int]]:
    """One plan-loop tick, every batch completing at once: the (stream, chunk) of the batch it planned, if any."""
    events = [wire.event_from_proto(e) for e in eng.planner.tick()]
    eng.planner.batches_done = eng.planner.batches_planned
    return [(s.stream, s.chunk) for e in events if e.kind == "batch" for s in e.steps]


def run_running_set(eng, clock: Clock, n: int) -> list:
    """``n`` paced streams opened together, each with its credited chunks started and its chunk 0 consumed."""
    streams = [open_paced(eng) for _ in range(n)]
    while tick(eng):
        pass
    for s in streams:
        consume_first(eng, s)
    return streams


def ordered_by_arrival(eng) -> None:
    """The scheduler's order before deadlines: no stream has one."""
    for st in eng.sched.streams.values():
        st.due = None


@pytest.mark.parametrize("deadlines", [True, False])
def test_a_joining_streams_second_chunk_goes_in_the_batch_right_after_its_first(deadlines):
    clock = Clock()
    eng = engine(clock)
    running = run_running_set(eng, clock, 3)
    clock.t += 1 / RATE  # one more chunk of every running stream is credited: three ready beside the newcomer
    joining = open_paced(eng)
    first = tick(eng)  # plans its open (its deadlines are set there) and the first batch
    assert (joining.id, 0) in first  # its first chunk goes first either way
    if not deadlines:
        ordered_by_arrival(eng)
    second = tick(eng)
    if deadlines:
        # Due one frame after its first frame: ahead of the running streams' chunks, due up to 0.5 s later.
        assert (joining.id, 1) in second
    else:
        # By arrival, the newest stream's chunk 1 waited behind the running streams' chunks.
        assert (joining.id, 1) not in second and {sid for sid, _ in second} <= {s.id for s in running}


def test_a_running_stream_that_fell_behind_goes_before_one_on_time():
    clock = Clock()
    eng = engine(clock)
    a, b, c = [open_paced(eng) for _ in range(3)]
    while tick(eng):
        pass
    # c's viewer saw its first frame a whole chunk period before a's and b's: its chunks are due sooner.
    clock.t -= 1 / RATE
    consume_first(eng, c)
    clock.t += 1 / RATE
    for s in (a, b):
        consume_first(eng, s)
    clock.t += 1 / RATE
    assert [sid for sid, _ in tick(eng)][0] == c.id


def test_a_deadline_counts_from_the_open_until_the_first_chunk_is_consumed_then_from_the_viewers_clock():
    clock = Clock()
    eng = engine(clock)
    clock.t = 100.1  # the pace grid moves its schedule back to 100.0
    s = open_paced(eng)
    tick(eng)
    pacing = eng.pacing
    assert pacing.since(s.id) == pytest.approx(100.0)
    # Chunk 0 is due a grace after the open, not after its slot on the grid (its viewer waits for the first frame,
    # but a joiner before it needs its second chunk sooner); a later chunk as if the first frame came now.
    assert pacing.deadline(s.id, 0) == pytest.approx(100.1 + FIRST_CHUNK_GRACE_S)
    assert pacing.deadline(s.id, 0) > pacing.pace_slot(s.id, 0) + FIRST_CHUNK_GRACE_S
    assert pacing.deadline(s.id, 1) == pytest.approx(100.1 + 1 / RATE - OFFSET)
    clock.t = 100.2  # the first frame has not come yet: no deadline of the viewer's lies before now
    assert pacing.deadline(s.id, 0) == pytest.approx(100.1 + FIRST_CHUNK_GRACE_S)
    assert pacing.deadline(s.id, 2) == pytest.approx(100.2 + 2 / RATE - OFFSET)
    clock.t = 100.31  # its first frame reached the viewer
    consume_first(eng, s)
    assert pacing.deadline(s.id, 0) == pytest.approx(100.31)
    assert pacing.deadline(s.id, 1) == pytest.approx(100.31 + 1 / RATE - OFFSET)  # one frame after the first
    assert pacing.deadline(s.id, 5) == pytest.approx(100.31 + 5 / RATE - OFFSET)


def test_an_unpaced_stream_has_no_deadline():
    clock = Clock()
    eng = engine(clock)
    unpaced = eng.open(
        OpenRequest(small_spec(timesteps=ONE_STEP), TEXT, acknowledges=True, consumer_depth=64, chunk_rate=0.0)
    )
    tick(eng)
    assert eng.pacing.deadline(unpaced.id, 0) is None


def test_deadlines_order_ready_steps_and_equal_ones_keep_the_arrival_order():
    # Scheduler alone: three one-step streams on one stage, batches of one.
    sched = StreamBatchScheduler(num_stages=1, max_batch=1)
    for sid in (1, 2, 3):
        sched.add_stream(small_spec(stream_id=sid, timesteps=ONE_STEP, num_chunks=4))
    dues = {1: 5.0, 2: 3.0, 3: 4.0}
    for sid, base in dues.items():
        sched.set_due(sid, lambda c, base=base: base + 10 * c)
    order = [s.stream for _ in range(6) for s in sched.tick()]
    assert order == [2, 3, 1, 2, 3, 1]  # earliest deadline first, chunk by chunk
    sched = StreamBatchScheduler(num_stages=1, max_batch=1)
    for sid in (1, 2, 3):
        sched.add_stream(small_spec(stream_id=sid, timesteps=ONE_STEP, num_chunks=4))
        sched.set_due(sid, lambda c: 7.0)  # one pace grid: equal deadlines
    assert [s.stream for _ in range(3) for s in sched.tick()] == [1, 2, 3]
    # A stream without deadlines goes after every stream with one.
    sched = StreamBatchScheduler(num_stages=1, max_batch=1)
    for sid in (1, 2):
        sched.add_stream(small_spec(stream_id=sid, timesteps=ONE_STEP, num_chunks=4))
    sched.set_due(2, lambda c: 1e9)
    assert [s.stream for s in sched.tick()] == [2]


@pytest.mark.parametrize("grace", [FIRST_CHUNK_GRACE_S, 0.0])
def test_in_a_burst_the_first_joiners_second_chunks_go_before_the_last_joiners_first_chunks(grace, monkeypatch):
    # One H200, a burst of 7 (2026-12-04): all 7 first chunks ran (two forwards) before any second chunk, due one
    # frame after each stream's first frame, and 3 of the 7 streams started 2-4 frames late.
    monkeypatch.setattr(coordinator.pacing, "FIRST_CHUNK_GRACE_S", grace)
    clock = Clock()
    eng = engine(clock)
    burst = [open_paced(eng) for _ in range(4)]  # batches of 2
    first = tick(eng)
    assert sorted(first) == [(burst[0].id, 0), (burst[1].id, 0)]
    second = tick(eng)
    if grace:
        assert sorted(second) == [(burst[0].id, 1), (burst[1].id, 1)]
        assert sorted(tick(eng)) == [(burst[2].id, 0), (burst[3].id, 0)]  # one forward later
    else:  # each joiner's first chunk due at once: every first chunk went first
        assert sorted(second) == [(burst[2].id, 0), (burst[3].id, 0)]


def open_and_first_frame(eng, clock: Clock, opened: float, first_frame: float):
    """A paced stream opened at ``opened`` whose chunk 0 ran alone and reached its viewer at ``first_frame``."""
    clock.t = opened
    s = open_paced(eng)
    assert tick(eng) == [(s.id, 0)]
    clock.t = first_frame
    consume_first(eng, s)
    return s


def test_joiners_first_chunks_on_the_pace_grid_do_not_go_before_a_running_chunk_due_sooner():
    # One H200, a burst of 12 (r27, 2026-12-07): the first stream admitted had its first frame out 82 ms after its
    # call, and the others opened 50-80 ms after it.  Their first chunks, due a grace after their slot on the pace
    # grid (up to a chunk period before the open), went before its next chunk, which came 5 frames late.
    clock = Clock()
    eng = engine(clock)
    running = open_and_first_frame(eng, clock, 100.1, 100.1875)  # the grid puts every slot at 100.0
    assert eng.pacing.deadline(running.id, 1) == pytest.approx(100.25)
    clock.t = 100.2
    joiners = [open_paced(eng) for _ in range(2)]  # due 100.3 by their open, 100.1 by their slot
    first = tick(eng)
    assert (running.id, 1) in first  # due at 100.25: before either joiner's first chunk
    assert (joiners[0].id, 0) in first  # and the earlier joiner fills the batch
    second = tick(eng)
    assert (joiners[1].id, 0) in second


def test_a_running_chunk_due_within_a_frame_goes_before_a_joiners_later_chunks():
    clock = Clock()
    eng = engine(clock)
    running = open_and_first_frame(eng, clock, 100.0, 100.02)  # chunk 2 due at 100.3325
    clock.t = 100.03
    a, b = open_paced(eng), open_paced(eng)
    assert sorted(tick(eng)) == sorted([(running.id, 1), (a.id, 0)])  # due 100.0825 and 100.13
    assert sorted(tick(eng)) == sorted([(a.id, 1), (b.id, 0)])  # a's second chunk: one frame from now
    # Neither joiner's first frame has reached its viewer at 100.29: b's second chunk is due one frame from now and
    # a's third a chunk period later, so the running stream's chunk, due at 100.3325, goes in; by their slots on the
    # grid (100.0625 and 100.3125) both joiners' chunks went first and it waited a forward more.
    clock.t = 100.29
    assert eng.pacing.deadline(running.id, 2) == pytest.approx(100.3325)
    assert sorted(tick(eng)) == sorted([(running.id, 2), (b.id, 1)])
