"""Admission prices a start: streams whose viewers have no frame yet ask for one chunk more in their first second
(Wan's chunk 0 decodes to one frame, and chunk 1 comes due one frame after it), and a burst of them asks for it at
once (``coordinator.slo.SloController.startup_utilization``).  The model is driven by hand: 25 ms a micro-step, a
one-step stream at 4 chunks per second costs 10% of the stage."""

from __future__ import annotations

import grpc
import pytest

from coordinator.errors import AdmissionError
from coordinator.slo import STARTUP_UTILIZATION, STARTUP_WINDOW_S, TARGET_UTILIZATION, CostModel, Demand, SloController
from tests.engine_helpers import consume_first, hand_driven_engine, stream_opener

pytestmark = pytest.mark.unit

RATE = 4.0  # 16 FPS, 4 frames a chunk


def controller() -> SloController:
    return SloController(CostModel(stages=1, max_batch=1, seed_ms=[25.0]))  # 4 x 25 ms = 10% a stream


def admitted_until_refused(ctl: SloController, starting: bool) -> int:
    """Streams offered one after another; ``starting``: none of them has a frame yet (a burst), else each is running
    by the time the next asks (a ramp)."""
    admitted: list[Demand] = []
    for n in range(1, 40):
        newcomer = Demand(n, RATE, (1,), starting=True)
        if not ctl.admits(newcomer, admitted):
            return len(admitted)
        newcomer.starting = starting
        admitted.append(newcomer)
    raise AssertionError("never refused")


def test_a_burst_is_held_to_what_its_start_fits_and_a_ramp_to_the_steady_target():
    ctl = controller()
    # A ramp: 9 streams at 10% fit the 90% target (the 9th's own start adds 10% / 4 = 2.5%: 92.5%, within 100%).
    assert admitted_until_refused(ctl, starting=False) == 9
    # A burst: n streams starting at once cost n x 10% x (1 + 1 / (4 chunks/s x 1 s)): 8 x 12.5% = 100% fits, 9 do not.
    assert admitted_until_refused(ctl, starting=True) == 8
    assert STARTUP_UTILIZATION / (1 + 1 / (RATE * STARTUP_WINDOW_S)) == pytest.approx(0.8)
    burst = [Demand(i, RATE, (1,), starting=True) for i in range(8)]
    assert ctl.startup_utilization(burst) == pytest.approx(1.0)
    assert ctl.utilization(burst) == pytest.approx(0.8)  # within the steady target: the start is what refuses


def test_streams_that_have_started_cost_their_steady_rate_only():
    ctl = controller()
    running = [Demand(i, RATE, (1,)) for i in range(6)]
    assert ctl.startup_utilization(running) == pytest.approx(ctl.utilization(running)) == pytest.approx(0.6)
    joiners = [Demand(10 + i, RATE, (1,), starting=True) for i in range(2)]
    assert ctl.startup_utilization(running + joiners) == pytest.approx(0.8 + 0.2 / 4)


def test_the_engine_refuses_a_stream_past_a_bursts_start_and_admits_it_once_the_others_have_frames():
    # 87 ms a forward of 4 with 5% growth: 25 ms a micro-step, 10% a stream (the steady target holds 8).
    eng = hand_driven_engine(stages=1, max_batch=1, lookahead=10**6, stage_ms=[87.0], slo_learn=False, pace_grid=False)
    open_stream = stream_opener(eng, chunk_rate=RATE, ladders=((1000.0,),))
    burst = []
    with pytest.raises(AdmissionError) as info:
        for _ in range(20):
            burst.append(open_stream())
    per_stream = eng.admission.pricing.utilization([Demand(0, RATE, (1,))])
    assert len(burst) < TARGET_UTILIZATION / per_stream  # fewer than the steady target holds
    err = info.value
    assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "starting at once" in err.message
    assert err.retry_after_s == 1.0  # the others' first frames are near: not the steady retry
    for s in burst:
        eng.planner.tick()
        consume_first(eng, s)
    open_stream()  # the same stream once the others have their first frames: priced at the steady rate
