"""Admission before the prompt is encoded (issue 48 item 2): the coordinator's Reserve decides a stream from its
request without its text and holds its place (``HOLD_S``) until the open claims it, so a refusal never waits on the
gateway's encode.  Held places count as admitted streams (the count cap, the SLO model, free slots); an unclaimed
hold lapses or is released, and an open whose hold lapsed is decided again."""

from __future__ import annotations

import grpc
import pytest

from coordinator.errors import AdmissionError
from coordinator.holds import HOLD_S
from coordinator.requests import OpenRequest
from stagecast import wire
from stagecast.internal.v1 import pipeline_pb2 as pb
from tests.engine_helpers import TEXT, Clock, hand_driven_engine, small_spec

pytestmark = pytest.mark.unit


def reserve_msg(spec=None, text_shape=tuple(TEXT.shape)) -> pb.ReserveRequest:
    spec = spec or small_spec(timesteps=(1000.0, 500.0))
    return pb.ReserveRequest(open=pb.OpenStreamRequest(spec=wire.spec_to_proto(spec)), text_shape=list(text_shape))


def engine(max_streams: int = 2):
    clock = Clock()
    return hand_driven_engine(stages=1, clock=clock, max_streams=max_streams), clock


def test_held_places_count_as_admitted_streams_and_the_open_claims_its_own():
    eng, clock = engine(max_streams=2)
    first = eng.admitter.reserve(OpenRequest.for_hold(reserve_msg()))
    eng.admitter.reserve(OpenRequest.for_hold(reserve_msg()))
    with pytest.raises(AdmissionError) as info:  # two places held, none open yet: the count cap refuses now
        eng.admitter.reserve(OpenRequest.for_hold(reserve_msg()))
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    session = eng.open(OpenRequest(small_spec(timesteps=(1000.0, 500.0)), TEXT), first)  # claims its place
    assert session.id in eng.sessions and eng.streams.holds(clock.t) == 1  # the other hold still counts
    with pytest.raises(AdmissionError):  # one open + one held: still full
        eng.open(OpenRequest(small_spec(), TEXT))


def test_an_unclaimed_hold_lapses_or_is_released_and_its_place_comes_back():
    eng, clock = engine(max_streams=1)
    hold = eng.admitter.reserve(OpenRequest.for_hold(reserve_msg()))
    with pytest.raises(AdmissionError):
        eng.admitter.reserve(OpenRequest.for_hold(reserve_msg()))
    clock.t += HOLD_S  # the gateway never opened it
    again = eng.admitter.reserve(OpenRequest.for_hold(reserve_msg()))
    assert again != hold
    eng.admitter.release(again)  # a gateway that failed between the two gives it back at once
    eng.admitter.release("no such hold")  # unknown or lapsed: ignored
    eng.open(OpenRequest(small_spec(), TEXT))


def test_an_open_whose_hold_lapsed_is_decided_again():
    eng, clock = engine(max_streams=1)
    hold = eng.admitter.reserve(OpenRequest.for_hold(reserve_msg()))
    clock.t += HOLD_S
    eng.open(OpenRequest(small_spec(), TEXT))  # the lapsed hold is nobody's: this stream takes the place
    with pytest.raises(AdmissionError):
        eng.open(OpenRequest(small_spec(), TEXT), hold)  # decided now: full


def test_free_slots_count_the_held_places():
    eng, _ = engine(max_streams=3)
    before = eng.slots().free
    eng.admitter.reserve(OpenRequest.for_hold(reserve_msg()))
    assert eng.slots().free == before - 1


def test_a_reserve_request_names_a_bad_text_shape_and_admits_a_guided_stream_without_its_texts():
    with pytest.raises(ValueError, match="text_shape"):
        OpenRequest.for_hold(reserve_msg(text_shape=(1, 8)))
    with pytest.raises(ValueError, match="text_shape"):
        OpenRequest.for_hold(reserve_msg(text_shape=(1, 0, 8)))
    guided = OpenRequest.for_hold(reserve_msg(spec=small_spec(guidance_scale=5.0)))
    assert guided.negative_text is not None and tuple(guided.text.shape) == tuple(TEXT.shape)
    assert guided.text.untyped_storage().nbytes() <= 4  # a stand-in of the shape, not a tensor of that size


def test_an_image_to_video_stream_is_reserved_before_its_image_is_encoded():
    held = OpenRequest.for_hold(reserve_msg(spec=small_spec(image_latents=True)))
    assert held.image is not None and tuple(held.image.shape) == (1, 16, 1, 4, 6)
    assert OpenRequest.for_hold(reserve_msg()).image is None
