"""The SLO controller, driven by simulated stage times: load rises, steps fall; load falls, steps rise; admission
refuses exactly at capacity."""

import pytest

from coordinator.requests import OpenRequest
from coordinator.slo import CostModel, Demand, SloController

pytestmark = pytest.mark.unit

RATE = 4.0  # 16 fps, 4 frames per chunk


def controller(stage_ms=10.0, batch=4, growth=1.0) -> SloController:
    # growth 1: a batch of b costs b x stage_ms, so one micro-step costs exactly stage_ms of the bottleneck.
    return SloController(CostModel(stages=2, max_batch=batch, seed_ms=[stage_ms, stage_ms * 0.5], growth=growth))


def demand(i, **kw) -> Demand:
    return Demand(i, chunk_rate=kw.pop("rate", RATE), allowed=kw.pop("allowed", (1, 2, 3, 4)), **kw)


def test_load_rises_steps_fall_evenly_and_load_falls_steps_rise():
    # 10 ms per micro-step at the bottleneck: 90 micro-steps/s at 90% -> 22.5 stream-steps at 4 chunks/s.
    ctl = controller(stage_ms=10.0)
    streams: list[Demand] = []
    history = []
    for i in range(1, 9):
        streams.append(demand(i))
        steps = ctl.decide(streams)
        for d in streams:
            d.steps = steps[d.stream_id]
        history.append([d.steps for d in streams])
        assert ctl.utilization(streams) <= 0.9 + 1e-9 or all(d.steps == 1 for d in streams)
    assert history[:5] == [[4], [4, 4], [4, 4, 4], [4, 4, 4, 4], [4, 4, 4, 4, 4]]  # 20 stream-steps fit
    # The sixth passes the target (24 stream-steps, 96%): steps fall, newest first, to the raise threshold (80%: 20),
    # not just under the target (22), so the set has room for what a lowering does not undo at once.
    assert history[5] == [4, 4, 3, 3, 3, 3]
    assert sum(history[5]) == 20 and max(history[5]) - min(history[5]) <= 1  # lowered evenly, newest first
    assert sum(history[7]) == 20 and max(history[7]) - min(history[7]) <= 1
    # Load falls: steps come back, but only under the raise threshold (80%: 20 stream-steps).
    while len(streams) > 2:
        streams.pop()
        steps = ctl.decide(streams)
        for d in streams:
            d.steps = steps[d.stream_id]
    assert [d.steps for d in streams] == [4, 4]


def test_steps_stay_within_each_streams_bounds_and_latency_first_holds_min_steps():
    ctl = controller(stage_ms=30.0)  # 30 micro-steps/s at 100%: 27 at 90%
    streams = [demand(1, allowed=(2, 3, 4)), demand(2, allowed=(1, 2)), demand(3, allowed=(1, 4), latency_first=True)]
    steps = ctl.decide(streams)
    assert steps[3] == 1  # latency first
    assert 2 <= steps[1] <= 4 and 1 <= steps[2] <= 2
    assert steps[1] in (2, 3, 4)
    # Far over capacity: everyone at min_steps, nobody below.
    crowd = [demand(i, allowed=(2, 4)) for i in range(1, 10)]
    assert set(ctl.decide(crowd).values()) == {2}


def test_no_measurement_keeps_what_runs_and_admits():
    ctl = SloController(CostModel(stages=2, max_batch=4))
    d = demand(1, steps=3)
    assert ctl.decide([d]) == {1: 3}
    assert ctl.admits(demand(2), [d]) and ctl.capacity_streams([d], RATE, 1) is None


def test_admission_refuses_exactly_at_capacity():
    # 10 ms per micro-step -> 90 micro-steps/s at 90%; a stream at min 2 steps needs 8/s: 11 fit (88), not 12 (96).
    ctl = controller(stage_ms=10.0)
    admitted: list[Demand] = []
    for i in range(1, 20):
        newcomer = demand(i, allowed=(2, 3, 4))
        if not ctl.admits(newcomer, admitted):
            break
        admitted.append(newcomer)
    assert len(admitted) == 11
    assert ctl.capacity_streams(admitted, RATE, 2) == pytest.approx(0.25)
    assert ctl.capacity_streams([], RATE, 1) == pytest.approx(22.5)
    # An unpaced stream is best-effort: never refused for capacity.
    assert ctl.admits(demand(99, rate=0.0), admitted)


def test_the_cost_model_learns_from_measured_batches():
    cost = CostModel(stages=2, max_batch=4)
    assert cost.micro_step_ms() is None
    for _ in range(50):
        cost.observe(0, 1, 10.0)
        cost.observe(0, 4, 16.0)
        cost.observe(1, 1, 12.0)
        cost.observe(1, 4, 24.0)
    assert cost.micro_step_ms(4) == pytest.approx(6.0)  # stage 1 is the bottleneck: 24 ms / 4
    assert cost.stage_ms(2)[0] == pytest.approx(12.0)  # the line through (1, 10) and (4, 16)
    cost.observe(0, 0, 5.0)  # a report without a batch (GPU timings not read yet) is ignored
    cost.observe(5, 1, 5.0)
    assert cost.micro_step_ms(4) == pytest.approx(6.0)


def test_a_micro_step_is_priced_at_the_batches_the_stages_form_not_at_the_largest():
    # One stage calibrated alone: a batch of 4 is the cheapest per micro-step (86 / 4 = 21.5 ms).
    calibration = {1: 26.0, 2: 45.0, 3: 65.0, 4: 86.0}
    cost = CostModel(stages=1, max_batch=4, chunk_ms=64.0)
    cost.calibrate(0, calibration)
    assert cost.typical_batch == 4
    assert cost.micro_step_ms() == pytest.approx(calibration[4] / 4)
    # Paced streams form batches of 2, measured at 80 ms while the VAE shares the GPU.
    for _ in range(60):
        cost.observe(0, 2, 80.0)
    assert cost.typical_batch == pytest.approx(2.0)
    per_step = cost.micro_step_ms()
    assert per_step == pytest.approx(80.0 / 2, rel=1e-3)
    # Two paced streams that may run 1 or 2 steps: priced at the batches they form, only (1, 1) is held
    # (util = 8 micro-steps/s x 40 ms + 8 chunks/s x 64 ms = 83%); priced at the largest batch, (2, 2) would be.
    streams = [demand(1, allowed=(1, 2)), demand(2, allowed=(1, 2))]
    assert SloController(cost).decide(streams) == {1: 1, 2: 1}
    alone = CostModel(stages=1, max_batch=4, chunk_ms=64.0)
    alone.calibrate(0, calibration)
    assert SloController(alone).decide(streams) == {1: 2, 2: 2}
    # A fractional average lies between the two whole batch sizes around it.
    for _ in range(200):
        cost.observe(0, 3, 96.0)
        cost.observe(0, 2, 80.0)
    b = cost.typical_batch
    assert 2.0 < b < 3.0
    assert cost.micro_step_ms() == pytest.approx((80.0 + (96.0 - 80.0) * (b - 2)) / b, rel=1e-3)


# ---- the controller inside the coordinator's engine (no stages: the plan loop driven by hand) ----------------

LADDERS = [(1000.0,), (1000.0, 500.0), (1000.0, 667.0, 333.0)]


def _engine(stage_ms: float, clock=lambda: 0.0):
    from tests.engine_helpers import hand_driven_engine, stream_opener

    # Off the pace grid: these tests' arithmetic prices the average batch measured (tests/test_slo_grid.py: the grid's).
    eng = hand_driven_engine(
        lookahead=10**6, stage_ms=[stage_ms, stage_ms], slo_learn=False, clock=clock, pace_grid=False
    )
    return eng, stream_opener(eng, chunk_rate=4.0, ladders=LADDERS, running=True)  # priced at their steady rate


def test_the_engine_plans_step_changes_and_refuses_past_capacity_with_a_retry_delay():
    import grpc

    from coordinator.errors import AdmissionError

    # 174 ms x 1.15 / 4 = 50 ms per micro-step: one stream at 3 steps needs 60% of the slowest stage, two need 120%.
    eng, open_stream = _engine(174.0)
    a = open_stream()
    events = eng.planner.tick()
    assert not [e for e in events if e.WhichOneof("event") == "steps"] and eng.steps(a.id) == 3
    b = open_stream()
    events = eng.planner.tick()
    changes = [(e.steps.stream_id, len(e.steps.timesteps)) for e in events if e.WhichOneof("event") == "steps"]
    # Past the target, steps fall to the raise threshold (80%): 2 and 2 steps is 2 x 4 chunks/s x 2 x 50.03 ms =
    # 80.04%, just over it, so the newest gives one more (60%).
    assert sorted(changes) == [(a.id, 2), (b.id, 1)]
    status = eng.status()
    assert [(s.stream_id, s.steps) for s in status.streams] == [(a.id, 2), (b.id, 1)]
    # Beside two streams at min 1 step (40%), 50 ms x 4 chunks/s = 20% more per stream at 1 step: 2.5 streams.
    assert [(c.steps, round(c.streams, 2)) for c in status.capacity] == [(1, 2.5), (2, 1.25), (3, 0.83), (4, 0.62)]
    assert status.utilization == pytest.approx(eng.utilization())  # the model's busy share of the open set
    assert status.utilization == pytest.approx(0.6, abs=0.01)  # 2 x 4 x 2 x 50 ms + 4 x 50 ms a second
    open_stream()
    open_stream()
    with pytest.raises(AdmissionError) as info:
        open_stream()  # 5 x 20% > 90%
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "over capacity" in info.value.message
    assert info.value.retry_after_s == 5.0  # no admitted stream has a known end
    # A latency-first stream holds its min_steps.
    eng2, open2 = _engine(174.0)
    c = open2(latency_first=True)
    eng2.planner.tick()
    assert eng2.steps(c.id) == 1


def test_a_refusal_beside_hour_long_streams_hints_at_most_a_minute():
    from coordinator.errors import AdmissionError
    from stagecast.grpc_util import MAX_RETRY_AFTER_S

    eng, open_stream = _engine(174.0)
    hour = 3600 * 4  # chunks: an hour at 4 chunks per second
    for _ in range(4):
        open_stream(num_chunks=hour)
        eng.planner.tick()
    with pytest.raises(AdmissionError) as info:
        open_stream(num_chunks=hour)
    assert info.value.retry_after_s == MAX_RETRY_AFTER_S == 60.0  # the soonest end is an hour away: a minute
    assert "retry after 60.0 s" in info.value.message


def test_the_vae_cost_per_chunk_counts_whatever_the_steps():
    # 10 ms per micro-step and 25 ms of VAE per chunk on each GPU: a stream at 1 step needs 4 x 35 ms = 14%.
    ctl = SloController(CostModel(stages=2, max_batch=4, seed_ms=[10.0, 5.0], growth=1.0, chunk_ms=25.0))
    assert ctl.capacity_streams([], RATE, 1) == pytest.approx(0.9 / 0.14)
    crowd = [demand(i, allowed=(1, 4)) for i in range(1, 8)]  # 7 x 14% = 98% even at 1 step
    assert set(ctl.decide(crowd).values()) == {1} and ctl.utilization(crowd, {d.stream_id: 1 for d in crowd}) > 0.9
    admitted = crowd[:6]  # 6 x 14% = 84%
    assert ctl.admits(demand(9, allowed=(1,)), admitted[:5]) and not ctl.admits(demand(9, allowed=(1,)), admitted)
    with pytest.raises(ValueError, match="chunk_ms"):
        CostModel(stages=2, max_batch=4, chunk_ms=-1.0)


def test_a_late_stream_scales_the_model_so_steps_fall_and_admission_refuses_what_would_not_be_held():
    # 10 ms per micro-step: two streams at 4 steps need 32%, so the model holds them and would admit three more.
    ctl = controller(stage_ms=10.0)
    running = [demand(1, steps=4), demand(2, steps=4)]
    assert ctl.utilization(running) == pytest.approx(0.32) and ctl.correction == 1.0
    five = [demand(i, steps=4) for i in range(1, 6)]  # at their min 1 step 20%, with a newcomer at 4 steps 36%
    assert ctl.admits(demand(6, allowed=(4,)), five)
    # Yet a stream fell behind: the set that ran is really past the target, whatever the model said.
    assert ctl.observe_late(running)
    assert ctl.utilization(running) == pytest.approx(0.9 * 1.05) and ctl.correction == pytest.approx(0.945 / 0.32)
    assert not ctl.admits(demand(6, allowed=(4,)), five)  # 36% x 2.95 is past the target
    steps = ctl.decide(running)
    # Both give a step, newest first, down to the raise threshold: 4 and 3 would still be 82.7%.
    assert sorted(steps.values()) == [3, 3] and ctl.utilization(running, steps) <= 0.8
    # Capacity counts the correction too: beside the two at min 1 step, fewer streams fit than the raw model says.
    raw = SloController(ctl.cost).capacity_streams(running, RATE, 1)
    k = ctl.correction
    assert ctl.capacity_streams(running, RATE, 1) == pytest.approx((0.9 - 0.08 * k) / (0.04 * k))
    assert ctl.capacity_streams(running, RATE, 1) < raw
    # A second late report of a set already judged over the target changes nothing (steps are already falling).
    k = ctl.correction
    assert not ctl.observe_late(running) and ctl.correction == k
    # With no stream late, the correction relaxes: one half-life halves its excess factor, and it never goes below 1.
    ctl.relax(300.0)
    assert ctl.correction == pytest.approx(max(1.0, k / 2))
    ctl.relax(1e6)
    assert ctl.correction == 1.0
    assert not SloController(ctl.cost).observe_late([demand(1, rate=0.0)])  # unpaced streams carry no schedule


def test_the_engine_learns_from_a_paced_stream_that_falls_behind():
    now = [0.0]
    # 40 x 1.15 / 4 = 11.5 ms per micro-step: 2 streams at 3 steps need 28%
    eng, open_stream = _engine(40.0, clock=lambda: now[0])
    a, b = open_stream(), open_stream()
    eng.planner.tick()
    assert (eng.steps(a.id), eng.steps(b.id)) == (3, 3) and eng.slo_correction() == 1.0
    capacity = dict(eng.capacity())[1]
    a.received = b.received = 400
    # On schedule: chunk c consumed at 0.5 + c / 4 s (the first chunk's consumption sets the schedule), for 8 s.
    for c in range(32):
        now[0] = 0.5 + c / 4
        eng.consumed(a.id, c + 1)
        eng.consumed(b.id, c + 1)
    assert eng.slo_correction() == 1.0 and eng.slo.late_findings(a.id) == eng.slo.late_findings(b.id) == 0
    # Stream a stalls once for 1 s and then keeps its rate: it stays 1 s late, but it is not falling behind.
    for c in range(32, 64):
        now[0] = 0.5 + c / 4 + 1.0
        eng.consumed(a.id, c + 1)
    assert eng.slo_correction() == 1.0 and eng.slo.late_findings(a.id) == 0
    # Stream b falls behind: it gets 3 chunks a second against its 4, from chunk 32 on.  Caught within two 2 s windows.
    c, t = 32, 0.5 + 31 / 4
    while eng.slo.late_findings(b.id) == 0:
        c, t = c + 1, t + 1 / 3
        now[0] = t
        eng.consumed(b.id, c)
        assert t < 0.5 + 31 / 4 + 2 * 2.0 + 2.0, "not caught within two windows"
    assert eng.slo_correction() > 1.0
    assert dict(eng.capacity())[1] < capacity
    events = eng.planner.tick()  # the controller decides again at once, with the corrected model
    # The set that ran (2 x 3 steps) is now judged 94.5%: the newest stream gives a step, 2 x 4 x (3 + 2) x 11.5 ms
    # x 3.42 = 79%, and nothing rises back over the 80% raise threshold.
    changes = [(e.steps.stream_id, len(e.steps.timesteps)) for e in events if e.WhichOneof("event") == "steps"]
    assert changes == [(b.id, 2)] and (eng.steps(a.id), eng.steps(b.id)) == (3, 2)
    assert eng.slo.controller.utilization(eng.slo.demands()) <= eng.slo.controller.target


def test_steps_do_not_rise_for_a_while_after_a_stream_joins_unless_it_is_alone():
    # 40 x 1.15 / 4 = 11.5 ms per micro-step: each step of a stream at 4 chunks/s is 4.6%; everything fits at 3 steps.
    from coordinator.slo_control import RAISE_HOLD_S
    from tests.engine_helpers import TEXT, small_spec

    now = [0.0]
    eng, open_stream = _engine(40.0, clock=lambda: now[0])

    def open_at_one_step():  # as the gateway opens a stream whose default steps lie below its max_steps
        spec = small_spec(timesteps=LADDERS[0])
        return eng.open(OpenRequest(spec, TEXT, acknowledges=True, consumer_depth=8, chunk_rate=4.0, ladders=LADDERS))

    a = open_at_one_step()
    eng.planner.tick()
    assert eng.steps(a.id) == 3  # alone: it rises at once, right after its join
    b = open_at_one_step()
    eng.planner.tick()
    assert (eng.steps(a.id), eng.steps(b.id)) == (3, 1)  # b joined running a: within RAISE_HOLD_S nothing rises
    now[0] = 1.5
    eng.planner.tick()
    assert eng.steps(b.id) == 1
    now[0] = RAISE_HOLD_S + 0.1  # settled: the next decision raises what fits
    eng.planner.tick()
    assert (eng.steps(a.id), eng.steps(b.id)) == (3, 3)
    # Lowering is never held: a join that does not fit lowers at once (at 174 ms, 50 ms per micro-step).
    eng2, open2 = _engine(174.0, clock=lambda: 0.0)
    c, d = open2(), None
    eng2.planner.tick()
    d = open2()
    eng2.planner.tick()
    assert (eng2.steps(c.id), eng2.steps(d.id)) == (2, 1)  # to the raise threshold (2 and 2: 80.04%)
