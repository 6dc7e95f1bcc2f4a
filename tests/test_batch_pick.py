"""The Stream Batch from measurement (``CostModel.pick_batch``): ``--max-batch`` is the ceiling the stages calibrate,
and the batch the scheduler forms is the largest calibrated size of those that hold the most one-step streams, among
those whose forward keeps a joining stream's first frame within ``BATCH_TTFF_MS``."""

from __future__ import annotations

import pytest

from coordinator.slo import BATCH_TTFF_MS, TARGET_UTILIZATION, CostModel
from coordinator.slo_control import CAPACITY_CHUNK_RATE
from stagecast.internal.v1 import pipeline_pb2 as pb
from tests.engine_helpers import hand_driven_engine

pytestmark = pytest.mark.unit

RATE = CAPACITY_CHUNK_RATE  # 4 chunks/s: a chunk period of 250 ms, 225 ms of it at the 0.9 target
# One H200, 1.3B, full 6-frame window (a capacity run's calibration): batch 1 is launch-bound, 2..4 cost ~22 ms each.
H200_13B = {1: 44.56, 2: 45.13, 3: 65.10, 4: 88.95}


def model(calibration: dict[int, float], *, stages: int = 1, ceiling: int = 4, aligned: bool = True) -> CostModel:
    cost = CostModel(stages=stages, max_batch=ceiling, aligned=aligned)
    for p in range(stages):
        cost.calibrate(p, calibration)
    return cost


def test_on_the_grid_each_size_holds_what_its_whole_batches_and_remainder_cost():
    cost = model(H200_13B)
    # b=1: 5 x 44.56 = 222.8 <= 225; b=2: 4 x 45.13 = 180.5, a 9th adds a remainder of 44.56 (225.1 > 225);
    # b=3: 3 x 65.10 = 195.3, a 10th adds 44.56; b=4: 2 x 88.95 + 45.13 = 223.0 for 10, an 11th makes the rest 3.
    held = {b: cost.streams_held(b, RATE, TARGET_UTILIZATION) for b in range(1, 5)}
    assert held == {1: 5, 2: 8, 3: 9, 4: 10}
    assert cost.pick_batch(chunk_rate=RATE, waits=2, target=TARGET_UTILIZATION) == 4


def test_of_sizes_that_hold_as_many_streams_the_largest_within_the_first_frame_bound_is_picked():
    # One H200, 1.3B, a calibration that stopped at 3: every size from 2 holds 9 streams by it.  Fewer forwards a
    # period carry less of what each costs outside its kernels: 3, not 2 (2 held 6 streams where 4 had held 7).
    cost = model({1: 27.24, 2: 47.74, 3: 67.46})
    assert [cost.streams_held(b, RATE, TARGET_UTILIZATION) for b in range(1, 4)] == [8, 9, 9]
    assert cost.pick_batch(chunk_rate=RATE, waits=2, target=TARGET_UTILIZATION) == 3
    # Compute-bound from batch 1 (5B at 1280x704 on an H200: ~40 ms a micro-step at any batch): every size holds the
    # same streams, paced on the grid or apart; 4 and 3 cost a joining stream more than 300 ms (3 x 120 ms), so 2.
    flat = {b: 40.0 * b for b in range(1, 5)}
    for aligned in (True, False):
        cost = model(flat, aligned=aligned)
        assert {cost.streams_held(b, RATE, TARGET_UTILIZATION) for b in range(1, 5)} == {5}
        assert cost.pick_batch(chunk_rate=RATE, waits=2, target=TARGET_UTILIZATION) == 2
    # Paced apart, every micro-step at a full batch's per-micro-step cost: a size that buys streams wins over a
    # larger one that buys none.
    cost = model({1: 30.0, 2: 40.0, 3: 70.0, 4: 90.0}, aligned=False)
    assert [cost.streams_held(b, RATE, TARGET_UTILIZATION) for b in range(1, 5)] == [7, 11, 9, 10]
    assert cost.pick_batch(chunk_rate=RATE, waits=2, target=TARGET_UTILIZATION) == 2


def test_a_forward_that_costs_a_joining_stream_its_first_frame_is_out():
    # A joining stream waits up to ``waits`` forwards, then runs its own.  Batch 4 holds the most, but behind three
    # of them (a lookahead of 3) its first chunk would wait 4 x 88.95 > 300 ms: 3 is the largest size left.
    cost = model(H200_13B)
    assert 3 * H200_13B[4] <= BATCH_TTFF_MS < 4 * H200_13B[4] and 4 * H200_13B[3] <= BATCH_TTFF_MS
    assert cost.pick_batch(chunk_rate=RATE, waits=2, target=TARGET_UTILIZATION) == 4
    assert cost.pick_batch(chunk_rate=RATE, waits=3, target=TARGET_UTILIZATION) == 3
    # 14B on one H200: even a batch of one passes the bound; one it is (it holds what it holds).
    cost = model({1: 122.5, 2: 240.0})
    assert cost.pick_batch(chunk_rate=RATE, waits=2, target=TARGET_UTILIZATION) == 1


def test_only_sizes_every_stage_calibrated_within_the_ceiling_count():
    cost = CostModel(stages=2, max_batch=4, aligned=True)
    assert cost.pick_batch(chunk_rate=RATE, waits=3, target=TARGET_UTILIZATION) is None  # nothing measured
    cost.calibrate(0, {1: 20.0, 2: 22.0, 3: 24.0, 4: 26.0, 5: 28.0})  # 5: past the ceiling, dropped
    cost.calibrate(1, {1: 20.0, 2: 22.0})  # its calibration ran out of budget at 3
    assert 5 not in cost.fits[0].calibrated
    # Only 1..2 are known on both stages; the slowest stage prices each size.
    assert cost.pick_batch(chunk_rate=RATE, waits=3, target=TARGET_UTILIZATION) == 2
    # The operator's --stage-ms: no calibration is taken, so nothing is picked (the ceiling stays the batch).
    seeded = CostModel(stages=1, max_batch=4, seed_ms=[20.0])
    assert not seeded.calibrate(0, H200_13B)
    assert seeded.pick_batch(chunk_rate=RATE, waits=2, target=TARGET_UTILIZATION) is None


def _form_reply(full_ms: list[float]) -> pb.FormReply:
    return pb.FormReply(calibration=pb.StageCalibration(full_ms=full_ms, latent_height=60, latent_width=104, window=6))


def test_the_engine_runs_the_picked_batch_and_reports_it():
    eng = hand_driven_engine(stages=1, max_batch=4, pace_grid=True)
    eng.slo.seed({0: _form_reply([110.0, 220.0, 330.0, 440.0])})  # only a batch of one passes 300 ms behind 2
    assert eng.slo.pick_batch(waits=2) == 1
    assert eng.slo.cost.max_batch == 1 and eng.slo.cost.ceiling == 4
    assert eng.status().max_batch == 1
    # A later Form whose calibration batches well picks again, within the same ceiling.
    eng.slo.seed({0: _form_reply(list(H200_13B.values()))})
    assert eng.slo.pick_batch(waits=2) == 4 and eng.status().max_batch == 4
