"""Admission before the prompt is encoded (issue 48 item 2): the coordinator's Reserve decides a stream from its
request without its text and holds its place (``HOLD_S``) until the open claims it, so a refusal never waits on the
gateway's encode.  Held places count as admitted streams (the count cap, the SLO model, free slots); an unclaimed
hold lapses or is released, and an open whose hold lapsed is decided again."""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest

from coordinator.errors import AdmissionError
from coordinator.holds import HOLD_S
from coordinator.requests import OpenRequest
from gateway.edge.config import Decoders
from gateway.stream.run import reserve
from stagecast import wire
from stagecast.grpc_util import EXCLUSIVE_PORT, RECONNECT_OPTIONS, reconnected
from stagecast.internal.v1 import pipeline_pb2 as pb
from stagecast.internal.v1 import pipeline_pb2_grpc as ipb_grpc
from tests.engine_helpers import TEXT, Clock, hand_driven_engine, small_spec
from tests.gateway_helpers import resolve, stub_stream_host

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


class ReserveServicer(ipb_grpc.CoordinatorServiceServicer):
    def __init__(self, name: str):
        self.name = name

    def Reserve(self, request, context):  # noqa: N802
        return pb.ReserveReply(hold=self.name)


def serve_reserve(name: str, port: int = 0) -> tuple[grpc.Server, int]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=[EXCLUSIVE_PORT])
    ipb_grpc.add_CoordinatorServiceServicer_to_server(ReserveServicer(name), server)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    return server, port


def gateway_host(channel):
    return stub_stream_host(
        ipb_grpc.CoordinatorServiceStub(channel), kinds=("full",), reconnected=lambda: reconnected(channel)
    )


def gateway_config():
    return resolve(decoders=Decoders(tiny=False, default="full"))


def test_the_gateways_reserve_reaches_a_restarted_coordinator_through_the_channels_backoff():
    # A coordinator that restarts is back on its port before the gateway's channel has waited out its reconnect
    # backoff: the gateway's Reserve waits for the channel (a bound past one backoff) and asks again, instead of
    # refusing the client "failed to connect to all addresses".  One still down is reported UNAVAILABLE.
    first, port = serve_reserve("before")
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=RECONNECT_OPTIONS)
    servers = [first]
    try:
        host, cfg = gateway_host(channel), gateway_config()
        assert reserve(cfg, host, (1, 32, 8)) == "before"
        first.stop(None).wait()
        with pytest.raises(grpc.RpcError) as down:
            reserve(cfg, host, (1, 32, 8))
        assert down.value.code() == grpc.StatusCode.UNAVAILABLE
        servers.append(serve_reserve("after", port)[0])  # the channel is in its backoff now
        assert reserve(cfg, host, (1, 32, 8)) == "after"
    finally:
        channel.close()
        for server in servers:
            server.stop(None).wait()


class FlakyCoordinator:
    """Reserve fails with ``codes`` in turn, then answers."""

    def __init__(self, *codes):
        self.codes = list(codes)
        self.calls = 0

    def Reserve(self, request, timeout=None):  # noqa: N802
        self.calls += 1
        if self.codes:
            code = self.codes.pop(0)
            raise type("Refused", (grpc.RpcError,), {"code": lambda self: code, "details": lambda self: "x"})()
        return pb.ReserveReply(hold="held")


@pytest.mark.parametrize(
    ("codes", "back", "hold", "calls"),
    [
        ((grpc.StatusCode.UNAVAILABLE,), True, "held", 2),  # reconnected: asked again, once
        ((grpc.StatusCode.UNAVAILABLE,), False, None, 1),  # still down after the bound: the client hears so
        ((grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAVAILABLE), True, None, 2),  # never more than once again
        ((grpc.StatusCode.RESOURCE_EXHAUSTED,), True, None, 1),  # a refusal is the answer: never asked again
        ((grpc.StatusCode.UNIMPLEMENTED,), True, "", 1),  # a coordinator without Reserve: the open decides
    ],
)
def test_the_gateways_reserve_asks_again_only_once_and_only_when_the_channel_came_back(codes, back, hold, calls):
    stub = FlakyCoordinator(*codes)
    host = stub_stream_host(stub, kinds=("full",), reconnected=lambda: back)
    if hold is None:
        with pytest.raises(grpc.RpcError):
            reserve(gateway_config(), host, (1, 32, 8))
    else:
        assert reserve(gateway_config(), host, (1, 32, 8)) == hold
    assert stub.calls == calls
