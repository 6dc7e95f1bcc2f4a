"""While every stream is paced, the plan loop keeps one batch per stage in flight, not one more: a joining stream's
first chunk goes first among the micro-steps not yet planned, so each batch planned ahead of the stages' own was a
forward more of its time to first frame (on one H200 at capacity, about 70 ms of a 447 ms TTFF).  Paced streams start
their chunks up to their playout buffer early, so a stage waiting for the next plan costs them nothing they see; an
unpaced stream has no buffer: with only unpaced streams the stages never wait, but beside a paced one it never widens
the bound.  The plan loop is driven by hand under a fake
clock, as in ``tests/test_deadlines.py``."""

import pytest

from coordinator.requests import OpenRequest
from stagecast import wire
from tests.engine_helpers import TEXT, Clock, consume_first, hand_driven_engine, small_spec

pytestmark = pytest.mark.unit

RATE = 4.0  # chunks per second: 16 fps, 4 frames per chunk


def open_stream(eng, chunk_rate: float = RATE):
    spec = small_spec(timesteps=(1000.0,), window=3, sink=1)
    return eng.open(OpenRequest(spec, TEXT, acknowledges=True, consumer_depth=64, chunk_rate=chunk_rate))


def planned(eng) -> list[tuple[int, int]]:
    """One plan-loop tick, nothing completing: the (stream, chunk) rows of the batch it planned, if any."""
    events = [wire.event_from_proto(e) for e in eng.planner.tick()]
    return [(s.stream, s.chunk) for e in events if e.kind == "batch" for s in e.steps]


def running_set(eng, clock: Clock, n: int) -> list:
    """``n`` paced streams past their first chunk (consumed), then one chunk period later: each has one chunk ready."""
    streams = [open_stream(eng) for _ in range(n)]
    while planned(eng):
        eng.planner.batches_done = eng.planner.batches_planned
    for s in streams:
        consume_first(eng, s)
    clock.t += 1 / RATE
    return streams


def join_batch(**engine_kw) -> int:
    """Three paced streams' next chunks are ready (at most 2 per batch); a fourth stream joins right after the first
    batch was planned; then the batches in flight complete one at a time.  Returns the index, in plan order, of the
    batch that carries the joining stream's first chunk."""
    clock = Clock()
    eng = hand_driven_engine(stages=1, max_batch=2, playout_s=0.5, clock=clock, **engine_kw)
    eng.pacing.grid = True
    running = running_set(eng, clock, 3)
    batches = [planned(eng)]
    batches.append(planned(eng))  # with room for a batch more in flight, the rest of the running set goes now
    joining = open_stream(eng)
    for _ in range(4):
        planner = eng.planner
        planner.batches_done = min(planner.batches_done + 1, planner.batches_planned)  # the oldest one finished
        batches.append(planned(eng))
    batches = [b for b in batches if b]
    assert len(batches[0]) == 2 and joining.id not in {s for s, _ in batches[0]}  # planned before it joined
    assert sum((s.id, 3) in b for b in batches for s in running) == 3  # every running stream's chunk ran once
    return next(i for i, b in enumerate(batches) if (joining.id, 0) in b)


def test_a_joining_paced_stream_waits_behind_the_batch_in_flight_only():
    eng = hand_driven_engine(stages=1, clock=Clock())
    assert eng.lookahead == 2 and eng.planner.in_flight_limit() == 2  # no stream: the stages' one each plus one
    # The default lookahead: one batch per stage while every stream is paced, so the joining stream's first chunk is
    # planned right after the batch in flight (beside the third running stream's chunk, which was not yet planned).
    assert join_batch() == 1
    # A fixed lookahead of 2 (P + 1) had planned the third running stream's chunk before the stream joined: one
    # forward more before its first chunk.
    assert join_batch(lookahead=2) == 2


@pytest.mark.parametrize("stages", [1, 2, 3])
def test_the_bound_is_one_batch_per_stage_while_a_stream_is_paced_and_best_effort_ones_never_widen_it(stages):
    eng = hand_driven_engine(stages=stages, clock=Clock())
    paced = open_stream(eng)
    eng.planner.tick()
    assert eng.planner.in_flight_limit() == stages
    unpaced = open_stream(eng, chunk_rate=0.0)
    eng.planner.tick()
    assert eng.planner.in_flight_limit() == stages  # a best-effort stream beside a paced one: the paced bound holds
    eng.cancel_stream(paced.id)
    eng.planner.tick()
    assert eng.planner.in_flight_limit() == stages + 1 == eng.lookahead  # only unpaced: the stages never wait
    eng.cancel_stream(unpaced.id)
    eng.planner.tick()
    assert eng.planner.in_flight_limit() == eng.lookahead
    # An operator's lookahead is a fixed bound, paced streams or not.
    fixed = hand_driven_engine(stages=stages, clock=Clock(), lookahead=5)
    open_stream(fixed)
    fixed.planner.tick()
    assert fixed.planner.in_flight_limit() == 5


def test_the_coordinators_lookahead_flag_fixes_the_bound_and_is_checked():
    from types import SimpleNamespace

    from benchmarks.harness import coordinator_args
    from coordinator.options import MAX_LOOKAHEAD, CoordinatorOptions

    assert CoordinatorOptions(stages=1).lookahead is None  # the default: the paced bound
    for bad in (0, MAX_LOOKAHEAD + 1):
        with pytest.raises(ValueError, match=f"--lookahead must be in 1..{MAX_LOOKAHEAD} batches, got {bad}"):
            CoordinatorOptions(stages=1, lookahead=bad)
    # The harness hands it to the coordinator (gpu_suite.sh LOOKAHEAD=N: an A/B against the default bound).
    args = SimpleNamespace(stages=1, slo_vae_ms=None, slo_stage_ms=None, pace_grid=False, lookahead=2)
    argv = coordinator_args(args)
    assert argv[argv.index("--lookahead") + 1] == "2" and "--no-pace-grid" in argv  # the grid is on by default
    assert "--pace-grid" not in coordinator_args(SimpleNamespace(**{**vars(args), "pace_grid": True}))
    assert "--lookahead" not in coordinator_args(SimpleNamespace(**{**vars(args), "lookahead": None}))
