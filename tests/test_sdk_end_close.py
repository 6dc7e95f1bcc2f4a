"""The SDK closes its request side when it reads End, sync and async, so a proxy sees both directions end before the
call's status (HAProxy 2.6 resets a call whose response ends while its request is open: tests/test_fleet.py).
A small in-process server plays the gateway: it sends Started and End, then waits for the client's half-close (its
request iterator ending) before it returns, and records whether that came.

A generation's finalizer: a dropped, unfinished one cancels its call; one whose call is over takes no lock (at the
interpreter's exit a daemon thread that held one is stopped for good, and the exit would wait for it forever)."""

import asyncio
import gc
import threading
from concurrent import futures

import grpc
import pytest

import stagecast
from stagecast.v1 import stream_pb2 as pb
from stagecast.v1 import stream_pb2_grpc as pb_grpc

pytestmark = pytest.mark.unit

WAIT_S = 10.0  # a bound only: the half-close comes in milliseconds


class WaitsForHalfClose(pb_grpc.StreamServiceServicer):
    def __init__(self):
        self.half_closed = threading.Event()
        self.closed_before_status: bool | None = None  # whether the half-close came while the call was still open
        self.later: list[str] = []  # what the client sent after its config

    def Generate(self, request_iterator, context):
        config = next(request_iterator).config

        def read_rest():
            for msg in request_iterator:
                self.later.append(msg.WhichOneof("msg"))
            self.half_closed.set()  # the iterator ended: the client closed its side (not a cancel: see below)

        threading.Thread(target=read_rest, daemon=True).start()
        effective = pb.StreamConfig()
        effective.CopyFrom(config)
        effective.seed, effective.target_fps = 1, 16.0
        yield pb.ServerMessage(started=pb.Started(stream_id="s", config=effective, total_frames=1))
        yield pb.ServerMessage(frame=pb.Frame(index=0, pts=0.0, codec=pb.CODEC_JPEG))
        yield pb.ServerMessage(end=pb.End(reason=pb.END_REASON_COMPLETED, frames=1))
        # The call's status only after the client's side is over, as the gateway does (at most a bound).
        self.closed_before_status = self.half_closed.wait(WAIT_S)


class Refuses(pb_grpc.StreamServiceServicer):
    def Generate(self, request_iterator, context):
        next(request_iterator)
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, "width: must be a positive multiple of 16, got 50")


class HoldsOpen(pb_grpc.StreamServiceServicer):
    """Starts the stream and sends nothing more until the client cancels."""

    def __init__(self):
        self.cancelled = threading.Event()

    def Generate(self, request_iterator, context):
        config = next(request_iterator).config
        context.add_callback(self.cancelled.set)
        yield pb.ServerMessage(started=pb.Started(stream_id="s", config=config))
        self.cancelled.wait(WAIT_S)


def serving(servicer):
    srv = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_StreamServiceServicer_to_server(servicer, srv)
    port = srv.add_insecure_port("127.0.0.1:0")
    srv.start()
    return srv, f"127.0.0.1:{port}"


@pytest.fixture
def server():
    servicer = WaitsForHalfClose()
    srv, address = serving(servicer)
    yield servicer, address
    srv.stop(0)


def test_the_sync_sdk_closes_its_side_at_end_and_the_call_ends_ok(server):
    servicer, address = server
    with stagecast.Client(address) as client:
        gen = client.generate("a fox", seconds=0.1)
        frames = gen.collect()
        gen.update_prompt("too late")  # after End: goes nowhere, raises nothing
    assert servicer.closed_before_status, "the SDK kept its request side open after End"
    assert len(frames) == 1 and gen.end is not None and gen.end.reason == "completed"
    assert servicer.later == []  # nothing after the config: closing is not a message


def test_the_async_sdk_closes_its_side_at_end_and_the_call_ends_ok(server):
    servicer, address = server

    async def run():
        async with stagecast.AsyncClient(address) as client:
            gen = client.generate("a fox", seconds=0.1)
            frames = await gen.collect()
            return frames, gen.end

    frames, end = asyncio.run(run())
    assert servicer.closed_before_status, "the async SDK kept its request side open after End"
    assert len(frames) == 1 and end is not None and end.reason == "completed"
    assert servicer.later == []


def test_a_refused_generations_finalizer_takes_no_lock():
    srv, address = serving(Refuses())
    try:
        with stagecast.Client(address) as client:
            gen = client.generate("a fox", seconds=0.1)
            with pytest.raises(stagecast.InvalidArgumentError):
                gen.collect()
            gen._outbox.mutex.acquire()  # as gRPC's sending thread may hold it when the interpreter's exit stops it
            try:
                finalizer = threading.Thread(target=gen.__del__, daemon=True)
                finalizer.start()
                finalizer.join(WAIT_S)
                assert not finalizer.is_alive(), "a refused generation's finalizer waited for the request queue's lock"
            finally:
                gen._outbox.mutex.release()
    finally:
        srv.stop(0)


def test_a_dropped_unfinished_generation_cancels_its_call():
    servicer = HoldsOpen()
    srv, address = serving(servicer)
    try:
        with stagecast.Client(address) as client:
            gen = client.generate("a fox")
            gen.wait_started()
            del gen
            gc.collect()
            assert servicer.cancelled.wait(WAIT_S), "the gateway kept a stream its caller dropped"
    finally:
        srv.stop(0)
