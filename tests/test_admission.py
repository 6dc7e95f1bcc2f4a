"""The coordinator's one admission function: its checks in order, each refusal naming its limit."""

from dataclasses import replace

import grpc
import pytest
import torch

from coordinator.admission import AdmissionState, Capacity, admit, kv_verdict
from coordinator.errors import AdmissionError
from coordinator.requests import OpenRequest
from stagecast.kv_memory import format_bytes, stream_kv_bytes
from stagecast.microstep import StreamSpec
from stagecast.model.config import DiTConfig
from stagecast.model.dit_configs import model_config

pytestmark = pytest.mark.unit

MODEL = model_config("tiny-wan2.1")
SPEC = StreamSpec(stream_id=0, latent_channels=16, chunk_frames=1, latent_height=4, latent_width=6, text_len=8)
TEXT = torch.zeros(1, 8, MODEL["text_dim"])


def state(**kw) -> AdmissionState:
    base = dict(ready=True, registered=2, world_size=2, active=0, max_streams=2, model=MODEL)
    return AdmissionState(**{**base, **kw})


def refusal(spec=SPEC, text=TEXT, **kw) -> AdmissionError:
    with pytest.raises(AdmissionError) as info:
        admit(OpenRequest(spec, text), state(**kw))
    return info.value


def test_a_stream_that_fits_is_admitted():
    admit(OpenRequest(SPEC, TEXT), state(active=1))


def test_the_checks_run_in_order_and_name_their_limit():
    # Not formed beats the count cap, which beats a stream the model cannot run.
    bad = StreamSpec(stream_id=0, latent_channels=48, chunk_frames=1, latent_height=4, latent_width=6, text_len=8)
    err = refusal(bad, ready=False, registered=1, active=5, last_error="stage 1 lost")
    assert err.code == grpc.StatusCode.UNAVAILABLE and "1/2 stages registered; last error: stage 1 lost" in err.message
    err = refusal(bad, active=2)
    assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "stream limit" in err.message
    err = refusal(bad)
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT and "spec.latent_channels" in err.message


def test_a_consumer_depth_out_of_range_is_a_value_error():
    with pytest.raises(ValueError, match="consumer_depth"):
        OpenRequest(SPEC, TEXT, consumer_depth=65)


# ---- KV memory ---------------------------------------------------------------------------------------------------

DIT = DiTConfig.from_kwargs(MODEL)


def need_of(spec: StreamSpec) -> dict[int, int]:
    """Two stages of two layers each, float32, as the coordinator computes a stream's worst case."""
    return {i: stream_kv_bytes(spec, DIT, layers=2, element_bytes=4) for i in (0, 1)}


def verdict(spec, budget: int, reserved: int = 0, retry: float = 2.5):
    budgets = {0: budget, 1: budget}
    return kv_verdict(
        spec, need_of, {0: reserved, 1: reserved}, budgets, rope_limit=DIT.rope_max_seq_len, retry_after_s=retry
    )


def test_a_stage_without_a_kv_budget_checks_nothing():
    assert verdict(SPEC, budget=0) is None


def test_an_unbounded_window_that_can_never_fit_is_refused_naming_window_and_the_window_that_fits():
    six = replace(SPEC, window=6, sink=3)
    budget = need_of(six)[0]  # a 6-frame window fits exactly
    v = verdict(SPEC, budget)
    assert not v.fits and v.alone and v.retry_after_s == 0
    assert v.detail.startswith("window: an unbounded KV window grows to 1023 latent frames")
    assert "at most 6 latent frames fit" in v.detail and "or seconds" in v.detail
    assert format_bytes(need_of(SPEC)[0]) in v.detail and format_bytes(budget) in v.detail
    err = refusal(kv_memory=v, capacity=Capacity(False, "busy", 1.0))  # memory is checked before capacity
    assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED and err.message.startswith("window:")
    assert err.retry_after_s == 0 and err.limit == "kv_memory"
    # A bounded stream's unbounded window is not helped by seconds; a budget under one frame names the stage's flag.
    assert "or seconds" not in verdict(replace(SPEC, num_chunks=100), budget).detail
    assert "--kv-budget-gib" in verdict(SPEC, need_of(replace(SPEC, window=1))[0] - 1).detail


def test_a_stream_that_fits_alone_but_not_beside_the_admitted_ones_gets_a_retry_delay():
    six = replace(SPEC, window=6, sink=3)
    one = need_of(six)[0]
    assert verdict(six, 2 * one, reserved=one).fits
    v = verdict(six, 2 * one - 1, reserved=one)
    assert not v.fits and not v.alone and v.retry_after_s == 2.5 and "fits the stage alone" in v.detail
    err = refusal(kv_memory=v)
    assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED and err.retry_after_s == 2.5
    assert "retry after 2.5 s" in err.message
    # The count cap and the spec come first.
    assert refusal(kv_memory=v, active=2).limit == "streams"
