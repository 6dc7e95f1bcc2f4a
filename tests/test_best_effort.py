"""Unpaced streams are best effort: they yield to paced streams in the scheduler's batches, take none of their
capacity, and one client holds only a few of them; alone, an unpaced stream still runs flat out."""

from __future__ import annotations

import grpc
import pytest
import torch

from coordinator.errors import AdmissionError
from coordinator.requests import OpenRequest
from coordinator.scheduler import StreamBatchScheduler
from gateway.edge.admission import Refused
from gateway.edge.quotas import QuotaOptions, Quotas
from stagecast.microstep import MicroStep, StreamSpec
from stagecast.model.dit_configs import model_config
from tests.engine_helpers import hand_driven_engine

P = 2  # pipeline stages
TEXT = torch.zeros(1, 8, model_config("tiny-wan2.1")["text_dim"])


def spec(sid: int, *, steps: int = 4, height: int = 4, **kw) -> StreamSpec:
    ladder = tuple(1000.0 - 250.0 * i for i in range(steps))
    return StreamSpec(
        stream_id=sid,
        latent_channels=16,
        chunk_frames=1,
        latent_height=height,
        latent_width=6,
        text_len=8,
        timesteps=ladder,
        **kw,
    )


def run(sched: StreamBatchScheduler, ticks: int) -> list[list[MicroStep]]:
    return [sched.tick() for _ in range(ticks)]


def of(batches: list[list[MicroStep]], sid: int) -> list[list[MicroStep]]:
    return [[step for step in batch if step.stream == sid] for batch in batches]


def paced_alone(paced: StreamSpec, ticks: int, max_batch: int) -> list[list[MicroStep]]:
    sched = StreamBatchScheduler(num_stages=P, max_batch=max_batch)
    sched.add_stream(paced)
    return run(sched, ticks)


@pytest.mark.unit
@pytest.mark.parametrize("max_batch", [1, 2, 4])
@pytest.mark.parametrize("other_height", [4, 8])  # best-effort streams of the paced one's latent shape, and another
def test_a_paced_stream_is_planned_tick_for_tick_as_alone_beside_eight_unpaced_streams(max_batch, other_height):
    ticks = 60
    sched = StreamBatchScheduler(num_stages=P, max_batch=max_batch)
    for sid in range(1, 9):  # they arrived first: without the classes they would win every tie
        sched.add_stream(spec(sid, height=other_height), best_effort=True)
    run(sched, 5)
    paced = spec(100, num_chunks=6)
    sched.add_stream(paced)
    batches = run(sched, ticks)
    alone = paced_alone(paced, ticks, max_batch)
    assert of(batches, 100) == alone
    assert sum(len(b) for b in alone) == 6 * 4  # the paced stream ran to its end
    # In every batch the paced stream's micro-steps come first, and the best-effort streams still progressed.
    for batch in batches:
        kinds = [step.stream == 100 for step in batch]
        assert kinds == sorted(kinds, reverse=True), batch
    assert any(step.stream != 100 for batch in batches for step in batch)


@pytest.mark.unit
def test_best_effort_rows_fill_a_batch_only_up_to_what_the_paced_streams_demand():
    sched = StreamBatchScheduler(num_stages=P, max_batch=8)
    for sid in range(1, 9):
        sched.add_stream(spec(sid), best_effort=True)
    flat_out = run(sched, 20)
    assert max(len(b) for b in flat_out) == 8  # alone they fill the largest batch
    paced = spec(100, steps=1)  # one level per chunk: a demand of at most 2 rows, one per stage
    sched.add_stream(paced)
    sched.set_credit(100, 3)  # its clock lets it start 3 chunks for now (the engine's pacing credit)
    beside = run(sched, 40)
    assert max(len(b) for b in beside[P:]) == 1  # ceil(its demand / stages) = 1 row per batch
    assert [step.chunk for batch in of(beside, 100) for step in batch] == [0, 1, 2]
    assert all(b and b[0].stream != 100 for b in beside[3:])  # the ticks the paced stream leaves go to best effort


@pytest.mark.unit
def test_a_lone_unpaced_stream_is_scheduled_exactly_as_before():
    for max_batch in (1, 4):
        a = StreamBatchScheduler(num_stages=P, max_batch=max_batch)
        b = StreamBatchScheduler(num_stages=P, max_batch=max_batch)
        a.add_stream(spec(1, num_chunks=5))
        b.add_stream(spec(1, num_chunks=5), best_effort=True)
        assert run(a, 50) == run(b, 50)


@pytest.mark.unit
def test_unpaced_streams_take_no_paced_capacity_at_the_coordinator():
    # 174 ms x 1.15 / 4 = 50 ms per micro-step: a paced stream at 3 steps and 4 chunks/s needs 60% of a stage.
    eng = hand_driven_engine(P, lookahead=10**6, stage_ms=[174.0] * P, slo_learn=False, clock=lambda: 0.0)
    s3 = spec(0, steps=3)
    unpaced = [eng.open(OpenRequest(s3, TEXT, acknowledges=True, consumer_depth=8)) for _ in range(8)]
    assert all(s.best_effort for s in unpaced)
    paced = eng.open(OpenRequest(s3, TEXT, acknowledges=True, consumer_depth=8, chunk_rate=4.0))
    assert not paced.best_effort
    eng.planner.tick()
    assert {sid for sid, st in eng.sched.streams.items() if st.best_effort} == {s.id for s in unpaced}
    with pytest.raises(AdmissionError) as info:  # a second paced one does not fit beside the first (120%)
        eng.open(OpenRequest(s3, TEXT, acknowledges=True, consumer_depth=8, chunk_rate=4.0))
    assert info.value.limit == "capacity"
    # A video-to-video stream has its input as its clock: it is not best effort, though it has no chunk rate.
    v2v = eng.open(OpenRequest(spec(0, steps=3, input_latents=True), TEXT, acknowledges=True, consumer_depth=8))
    assert not v2v.best_effort


@pytest.mark.unit
def test_one_client_holds_at_most_its_quota_of_unpaced_streams():
    quotas = Quotas(QuotaOptions(unpaced=2), max_streams=8)
    held = [quotas.take_stream(True, "connection a") for _ in range(2)]
    with pytest.raises(Refused) as info:
        quotas.take_stream(True, "connection a")
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "--max-unpaced-per-client 2" in info.value.message and "connection a" in info.value.message
    assert quotas.held("streams", "connection a") == 2  # the refused one gave its stream slot back
    quotas.take_stream(False, "connection a")  # a paced stream of the same client still starts
    quotas.take_stream(True, "connection b")  # and another client's unpaced one
    held[0]()
    held[0]()  # giving back twice gives back once
    quotas.take_stream(True, "connection a")
    with pytest.raises(Refused):
        quotas.take_stream(True, "connection a")


@pytest.mark.unit
@pytest.mark.parametrize("kw", [{"unpaced": 0}, {"pending": -1}, {"watchers": 10**6}, {"streams": -1}])
def test_a_quota_out_of_range_is_refused_naming_its_flag(kw):
    with pytest.raises(ValueError, match="--max-.*-per-client"):
        QuotaOptions(**kw)
