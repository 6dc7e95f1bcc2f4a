"""The coordinator's one admission function: its checks in order, each refusal naming its limit."""

import grpc
import pytest
import torch

from coordinator.admission import AdmissionError, AdmissionState, admit
from stagecast.microstep import StreamSpec
from stagecast.model.dit_configs import model_config

MODEL = model_config("tiny-wan2.1")
SPEC = StreamSpec(stream_id=0, latent_channels=16, chunk_frames=1, latent_height=4, latent_width=6, text_len=8)
TEXT = torch.zeros(1, 8, MODEL["text_dim"])


def state(**kw) -> AdmissionState:
    base = dict(ready=True, registered=2, world_size=2, active=0, max_streams=2, model=MODEL)
    return AdmissionState(**{**base, **kw})


def refusal(spec=SPEC, text=TEXT, **kw) -> AdmissionError:
    with pytest.raises(AdmissionError) as info:
        admit(spec, text, state(**kw))
    return info.value


def test_a_stream_that_fits_is_admitted():
    admit(SPEC, TEXT, state(active=1))


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
        admit(SPEC, TEXT, state(), consumer_depth=65)
