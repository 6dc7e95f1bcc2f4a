"""The SDK's opt-in reconnect and retry of refusals (``reconnect=True``, ``retry_refused=``), sync and async, against
a small in-process gRPC server that plays the gateway's part: a call cut by UNAVAILABLE (a drain's end) or CANCELLED
(the door's reset) is reopened with the same prompt and seed for the remaining frames, the frame indices go on, and
the gap is reported; a refusal's retry_after is waited, within its bound.  The fleet test holds the same behaviour
through a real door (tests/test_fleet_reconnect.py)."""

import asyncio
import time
from concurrent import futures

import grpc
import pytest

import stagecast
from stagecast.client import MAX_RECONNECTS, Reconnect
from stagecast.errors import CancelledError, ResourceExhaustedError, UnavailableError
from stagecast.grpc_util import abort_with_retry
from stagecast.v1 import stream_pb2 as pb
from stagecast.v1 import stream_pb2_grpc as pb_grpc

pytestmark = pytest.mark.unit

FPS = 16.0
DRAINED = "pipeline a drained: it stopped after --drain-s 2 s; reconnect (through the fleet's door ...)"


class Scripted(pb_grpc.StreamServiceServicer):
    """Each call takes the next step of ``script``: ("cut", frames, code, message, retry_after) sends Started and
    that many frames then aborts; ("whole", pipeline) sends every frame the config asks for and End.  ``configs``:
    what each call was opened with."""

    def __init__(self, script):
        self.script = list(script)
        self.configs: list[pb.StreamConfig] = []

    def Generate(self, request_iterator, context):
        config = next(request_iterator).config
        self.configs.append(config)
        step = self.script.pop(0) if self.script else ("whole", "z")
        seed = config.seed if config.HasField("seed") else 1234  # the gateway picks one when the client did not
        total = int(-(-config.seconds * FPS // 1))
        effective = pb.StreamConfig()
        effective.CopyFrom(config)
        effective.seed, effective.target_fps = seed, FPS
        name = step[1] if step[0] == "whole" else "a"
        yield pb.ServerMessage(started=pb.Started(stream_id="s", config=effective, total_frames=total, pipeline=name))
        frames = step[1] if step[0] == "cut" else total
        for i in range(frames):
            yield pb.ServerMessage(frame=pb.Frame(index=i, pts=i / FPS, codec=pb.CODEC_JPEG))
        if step[0] == "cut":
            abort_with_retry(context, step[2], step[3], step[4] if len(step) > 4 else 0.0)
        yield pb.ServerMessage(end=pb.End(reason=pb.END_REASON_COMPLETED, frames=frames))


@pytest.fixture
def serve():
    servers = []

    def start(script) -> tuple[Scripted, str]:
        servicer = Scripted(script)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        pb_grpc.add_StreamServiceServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        return servicer, f"127.0.0.1:{port}"

    yield start
    for server in servers:
        server.stop(0)


def test_a_drained_stream_is_reopened_for_its_remaining_frames_with_its_seed(serve):
    servicer, address = serve([("cut", 6, grpc.StatusCode.UNAVAILABLE, DRAINED), ("whole", "b")])
    with stagecast.Client(address) as client:
        gen = client.generate("a fox", seconds=1.0, reconnect=True)
        frames = gen.collect()
    assert [f.index for f in frames] == list(range(16))  # indices go on after the gap: none repeated, none skipped
    assert gen.end is not None and gen.end.reason == "completed"
    first, second = servicer.configs
    assert second.prompt == first.prompt == "a fox"
    assert second.seed == 1234  # the seed the first call ran (the gateway chose it), not a new random one
    assert round(second.seconds * FPS + 0.5) == 10  # the 10 frames left
    assert gen.info.pipeline == "a"  # info stays the stream's first Started
    [reconnect] = gen.reconnects
    assert isinstance(reconnect, Reconnect)
    assert reconnect.at_index == 6 and reconnect.pipeline == "b" and "drained" in reconnect.error
    assert reconnect.gap_s > 0 and reconnect.gap_frames == max(0, round(reconnect.gap_s * FPS) - 1)


def test_a_reset_by_the_door_reopens_too_and_a_chosen_seed_is_kept(serve):
    servicer, address = serve([("cut", 3, grpc.StatusCode.CANCELLED, "reset"), ("whole", "b")])
    with stagecast.Client(address) as client:
        frames = client.generate("x", seconds=0.5, seed=42, reconnect=True).collect()
    assert [f.index for f in frames] == list(range(8)) and servicer.configs[1].seed == 42


def test_without_reconnect_the_drain_is_raised(serve):
    _, address = serve([("cut", 2, grpc.StatusCode.UNAVAILABLE, DRAINED)])
    with stagecast.Client(address) as client:
        gen = client.generate("x", seconds=1.0)
        with pytest.raises(UnavailableError, match="drained"):
            gen.collect()
        assert gen.reconnects == []


def test_reconnects_are_bounded(serve):
    cut = ("cut", 1, grpc.StatusCode.UNAVAILABLE, DRAINED)
    servicer, address = serve([cut] * (MAX_RECONNECTS + 1))
    with stagecast.Client(address) as client:
        gen = client.generate("x", seconds=2.0, reconnect=True)
        with pytest.raises(UnavailableError):
            gen.collect()
    assert len(servicer.configs) == MAX_RECONNECTS + 1 and len(gen.reconnects) == MAX_RECONNECTS


def test_other_errors_are_not_reconnected(serve):
    servicer, address = serve([("cut", 2, grpc.StatusCode.INVALID_ARGUMENT, "width: bad")])
    with stagecast.Client(address) as client:
        with pytest.raises(stagecast.errors.InvalidArgumentError):
            client.generate("x", seconds=1.0, reconnect=True).collect()
    assert len(servicer.configs) == 1


def test_retry_refused_waits_the_refusals_retry_after(serve):
    refused = ("cut", 0, grpc.StatusCode.RESOURCE_EXHAUSTED, "full: retry", 0.3)
    servicer, address = serve([refused, ("whole", "b")])
    with stagecast.Client(address) as client:
        t0 = time.monotonic()
        frames = client.generate("x", seconds=0.25, retry_refused=True).collect()
        assert time.monotonic() - t0 >= 0.3
    assert len(frames) == 4 and len(servicer.configs) == 2


def test_retry_refused_is_off_by_default_and_bounded_by_its_seconds(serve):
    refused = ("cut", 0, grpc.StatusCode.RESOURCE_EXHAUSTED, "full: retry", 5.0)
    servicer, address = serve([refused, refused])
    with stagecast.Client(address) as client:
        with pytest.raises(ResourceExhaustedError) as exc:
            client.generate("x", seconds=0.25).collect()
        assert exc.value.retry_after == pytest.approx(5.0)
        t0 = time.monotonic()
        with pytest.raises(ResourceExhaustedError):  # 5 s is past the 1 s allowed: raised at once, no wait
            client.generate("x", seconds=0.25, retry_refused=1.0).collect()
        assert time.monotonic() - t0 < 2.0
    with pytest.raises(ValueError, match="retry_refused"):
        stagecast.Client(address).generate("x", retry_refused=-1.0)


def test_a_cancel_by_the_caller_is_not_reconnected(serve):
    servicer, address = serve([("whole", "a")])
    with stagecast.Client(address) as client:
        gen = client.generate("x", seconds=30.0, reconnect=True)
        next(iter(gen))
        gen.cancel()
        assert list(gen) == [] and gen.reconnects == []
    assert len(servicer.configs) == 1


def test_the_async_client_reconnects_the_same_way(serve):
    servicer, address = serve([("cut", 5, grpc.StatusCode.UNAVAILABLE, DRAINED), ("whole", "b")])

    async def run():
        async with stagecast.AsyncClient(address) as client:
            gen = client.generate("a fox", seconds=1.0, reconnect=True)
            return gen, await gen.collect()

    gen, frames = asyncio.run(run())
    assert [f.index for f in frames] == list(range(16))
    assert [(r.at_index, r.pipeline) for r in gen.reconnects] == [(5, "b")]
    assert servicer.configs[1].seed == 1234


def test_the_async_client_raises_without_reconnect(serve):
    _, address = serve([("cut", 1, grpc.StatusCode.CANCELLED, "reset")])

    async def run():
        async with stagecast.AsyncClient(address) as client:
            await client.generate("x", seconds=1.0).collect()

    with pytest.raises(CancelledError):
        asyncio.run(run())
