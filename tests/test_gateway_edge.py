"""The gateway's public edge under idle, huge, malformed and random requests: real processes on loopback (a
coordinator, one stage, one gateway with a short config deadline and small call budgets).

What holds here: calls that never send a config cannot take the gateway's threads (health, status and a real stream
keep working beside 100 of them, and they end at the config deadline); every call budget refuses the call over it at
once; a request over the largest legal message, bytes that are not a message, a prompt update over the prompt limit
and a stream over the cost budget each get a clear status; and a fuzz of random public requests gives no crash, no
hang and no INTERNAL or UNKNOWN, after which a normal stream completes.  ``test_fuzz_slice`` (100 requests) always
runs; ``test_fuzz_full`` (1,200) runs with ``-m fuzz``.  Two clients without stagecast's code stream with typed
enums: one built from gRPC reflection, and a Node.js one built from the .proto file (``tests/node``).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import struct
import subprocess
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

import stagecast
import stagecast.client
from launcher.demo_checkpoint import write_demo_checkpoint
from launcher.local_cluster import start_pipeline
from launcher.process import Child, Launcher
from stagecast.v1 import stream_pb2 as pb
from stagecast.v1 import stream_pb2_grpc as pb_grpc

pytestmark = pytest.mark.multiprocess

PROMPT = "a red fox running through snow"
W, H = 32, 32
# Long enough for the checks (a real stream among them) to run while the idle calls wait; they end after it.  The
# checks took 0.2 s on a quiet 2-core machine; the idle calls then wait out the rest, so more is wall time only.
CONFIG_TIMEOUT = 10.0
IDLE_CALLS = 100
MAX_PENDING = IDLE_CALLS + 4
MAX_WATCHERS = 4
MAX_STREAMS = 4
TIMEOUT = 120
GENERATE = "/stagecast.v1.StreamService/Generate"
GET_STATUS = "/stagecast.v1.StreamService/GetStatus"
WATCH_STATUS = "/stagecast.v1.StreamService/WatchStatus"
BAD_CODES = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}


class _CountingLog(list):
    """The child's log (the launcher keeps its last lines), counting tracebacks as lines arrive."""

    def __init__(self, lines):
        super().__init__(lines)
        self.tracebacks: list[str] = []

    def append(self, line: str) -> None:
        if "Traceback" in line:
            self.tracebacks.append(line)
        super().append(line)


@dataclass
class Edge:
    address: str
    health_address: str
    child: Child
    log: _CountingLog = field(repr=False)
    metrics_port: int = 0
    launcher: Launcher | None = field(default=None, repr=False)  # to start another gateway on the same pipeline
    coordinator: str = ""
    checkpoint: str = ""

    def metrics(self) -> str:
        return urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10).read().decode()

    def alive(self) -> bool:
        return self.child.proc.poll() is None


@pytest.fixture(scope="module")
def edge(tmp_path_factory):
    root = write_demo_checkpoint(tmp_path_factory.mktemp("ckpt"))
    with Launcher() as launcher:
        pipe = start_pipeline(launcher, checkpoint=str(root / "transformer"), stages=1, max_streams=8)
        args = ["gateway", "--coordinator", pipe.coordinator, "--checkpoint", str(root), "--port", "0"]
        args += ["--health-port", "0", "--config-timeout", str(CONFIG_TIMEOUT), "--max-pending", str(MAX_PENDING)]
        args += ["--max-watchers", str(MAX_WATCHERS), "--max-streams", str(MAX_STREAMS)]
        # The idle calls come over one connection: its own quota (tests/test_security.py pins it) is lifted to the
        # global bound, which is what these tests hold.
        args += ["--max-pending-per-client", str(MAX_PENDING)]
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            metrics_port = s.getsockname()[1]
        child = launcher.spawn("gateway", args + ["--metrics-port", str(metrics_port)])
        log = _CountingLog(child.log)
        child.log = log
        yield Edge(
            child.info["address"],
            child.info["health_address"],
            child,
            log,
            metrics_port,
            launcher,
            pipe.coordinator,
            str(root),
        )


def _channel(target: str) -> grpc.Channel:
    # Room for sending requests over the gateway's limit (the gateway, not this client, must refuse them).
    return grpc.insecure_channel(target, options=[("grpc.max_send_message_length", 64 << 20)])


def _health(target: str, timeout: float = 5.0) -> int:
    with grpc.insecure_channel(target) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=timeout).status


def _raw_generate(target: str, messages: list[bytes], timeout: float = TIMEOUT) -> grpc.RpcError | None:
    """A Generate call that sends exactly these bytes and half-closes; the error it ended with, or None."""
    with _channel(target) as ch:
        call = ch.stream_stream(GENERATE, request_serializer=None, response_deserializer=None)(
            iter(messages), timeout=timeout
        )
        try:
            for _ in call:
                pass
        except grpc.RpcError as exc:
            return exc
    return None


def _config(**kw) -> bytes:
    return pb.ClientMessage(config=stagecast.client.stream_config(PROMPT, **kw)).SerializeToString()


def _complete_a_stream(target: str) -> None:
    with stagecast.Client(target) as client:
        gen = client.generate(PROMPT, width=W, height=H, seconds=0.25, codec="raw", seed=1, timeout=TIMEOUT)
        frames = gen.collect()
        assert gen.end.reason == "completed" and len(frames) == 4


def _wait_status(target: str, predicate, timeout: float = TIMEOUT) -> pb.GatewayStatus:
    with stagecast.Client(target) as client:
        return client.wait_for_status(predicate, timeout=timeout)


def test_100_idle_calls_leave_health_status_and_a_real_stream_working_and_end_at_the_config_deadline(edge):
    release = threading.Event()

    def idle():  # a client that opens Generate and never sends its config
        release.wait()
        return
        yield

    errors: list = [None] * MAX_PENDING
    opened = time.monotonic()
    with grpc.insecure_channel(edge.address) as ch:
        generate = ch.stream_stream(GENERATE, request_serializer=None, response_deserializer=None)

        def hold(i: int) -> None:
            try:
                for _ in generate(idle(), timeout=TIMEOUT):
                    pass
            except grpc.RpcError as exc:
                errors[i] = exc

        threads = [threading.Thread(target=hold, args=(i,), daemon=True) for i in range(IDLE_CALLS)]
        for t in threads:
            t.start()
        try:
            _wait_status(edge.address, lambda s: s.waiting_calls == IDLE_CALLS)
            assert f"stagecast_gateway_waiting_calls {IDLE_CALLS:.1f}" in edge.metrics()
            # Health on the public port and on the gateway's own health port, status, and a real stream, all while
            # every idle call still holds its place.
            assert _health(edge.address) == health_pb2.HealthCheckResponse.SERVING
            assert _health(edge.health_address) == health_pb2.HealthCheckResponse.SERVING
            _complete_a_stream(edge.address)
            with stagecast.Client(edge.address) as client:
                assert client.status().waiting_calls == IDLE_CALLS
            assert time.monotonic() - opened < CONFIG_TIMEOUT, "the checks ran past the idle calls' deadline"

            # The pending budget: fill it, and the next call is refused at once instead of waiting.
            fillers = [threading.Thread(target=hold, args=(i,), daemon=True) for i in range(IDLE_CALLS, MAX_PENDING)]
            for t in fillers:
                t.start()
            threads += fillers
            _wait_status(edge.address, lambda s: s.waiting_calls == MAX_PENDING)
            start = time.monotonic()
            refused = _raw_generate(edge.address, [], timeout=10)
            assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-pending" in refused.details()
            assert time.monotonic() - start < 5

            # No config within the deadline: every idle call ends with DEADLINE_EXCEEDED naming the config.
            for t in threads:
                t.join(CONFIG_TIMEOUT + 30)
        finally:
            release.set()
    assert all(e is not None and e.code() == grpc.StatusCode.DEADLINE_EXCEEDED for e in errors), {
        e.code() if e else None for e in errors
    }
    assert all(e.details().startswith(f"config: none arrived within {CONFIG_TIMEOUT:g} s") for e in errors), errors[
        0
    ].details()
    assert _wait_status(edge.address, lambda s: s.waiting_calls == 0).waiting_calls == 0
    assert edge.alive() and not edge.log.tracebacks


def _open_streaming_call(ch: grpc.Channel, kind: str, hold: threading.Event):
    """One open call of a bounded streaming method, after its first response."""
    if kind == "status":
        call = pb_grpc.StreamServiceStub(ch).WatchStatus(pb.StatusRequest(), timeout=TIMEOUT)
    elif kind == "health":
        call = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(), timeout=TIMEOUT)
    else:

        def requests():
            yield reflection_pb2.ServerReflectionRequest(list_services="")
            hold.wait()

        call = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(requests(), timeout=TIMEOUT)
    next(call)
    return call


# ---- a full pending pool gives way fairly (issue 50) ----------------------------------------------------------------

IDLE_CLIENTS, IDLE_PER_CLIENT = 10, 14  # 140 idle calls: past the default --max-pending 128 (per client: 32)
DOOR = "127.0.0.1"  # every test client comes from here: as the fleet's door, it names each viewer in x-forwarded-for


def _viewer(address: str) -> tuple[tuple[str, str], ...]:
    return (("x-forwarded-for", f"198.51.100.7, {address}"),)  # the door appends the peer it saw: the last entry


def _stream_as(target: str, address: str, seconds: float = 0.25) -> pb.End:
    """A raw stream (config first, the call kept open until it ends) as the viewer at ``address``; its End."""
    done = threading.Event()

    def requests():
        yield _config(width=W, height=H, seconds=seconds, codec="raw", seed=3)
        done.wait(TIMEOUT)

    with grpc.insecure_channel(target) as ch:
        call = ch.stream_stream(GENERATE, request_serializer=None, response_deserializer=pb.ServerMessage.FromString)
        try:
            for msg in call(requests(), timeout=TIMEOUT, metadata=_viewer(address)):
                if msg.WhichOneof("msg") == "end":
                    return msg.end
        finally:
            done.set()
    raise AssertionError("the stream ended without an End")


@pytest.fixture
def door_gateway(edge):
    """A gateway on the same pipeline with the defaults' pending bounds, behind a trusted door (``--trusted-proxy``)."""
    args = ["gateway", "--coordinator", edge.coordinator, "--checkpoint", edge.checkpoint, "--port", "0"]
    args += ["--config-timeout", "100", "--trusted-proxy", DOOR, "--max-streams", str(MAX_STREAMS)]
    child = edge.launcher.spawn(f"gateway-door-{random.randrange(1 << 30)}", args)
    try:
        yield child.info["address"]
    finally:
        edge.launcher.stop(child)


def test_140_idle_calls_of_10_clients_leave_another_clients_streams_served(door_gateway):
    """10 clients over 10 connections keep 140 calls open that never send a config (the pool holds 128; a call
    refused or evicted is opened again): each of another client's 20 streams finds a place, evicting the oldest idle
    call of the client holding the most when the pool is full (RESOURCE_EXHAUSTED naming --max-pending), and
    completes."""
    release = threading.Event()
    ended: list[grpc.RpcError] = []

    def idle():
        release.wait()
        return
        yield

    def hold(i: int, ch) -> None:
        generate = ch.stream_stream(GENERATE, request_serializer=None, response_deserializer=None)
        while not release.is_set():
            try:
                for _ in generate(idle(), timeout=TIMEOUT, metadata=_viewer(f"10.0.0.{i % IDLE_CLIENTS}")):
                    pass
            except grpc.RpcError as exc:
                if release.is_set():
                    return
                ended.append(exc)
                if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    return
                release.wait(0.05)  # the attacker's pace between reopenings

    channels = [grpc.insecure_channel(door_gateway) for _ in range(IDLE_CLIENTS)]  # 10 connections
    threads = [
        threading.Thread(target=hold, args=(i, channels[i % IDLE_CLIENTS]), daemon=True)
        for i in range(IDLE_CLIENTS * IDLE_PER_CLIENT)
    ]
    try:
        for t in threads:
            t.start()
        _wait_status(door_gateway, lambda s: s.waiting_calls == 128)  # full; the other 12 keep being refused
        ends = [_stream_as(door_gateway, "203.0.113.9") for _ in range(20)]
        status = _wait_status(door_gateway, lambda s: True)
    finally:
        release.set()
        for t in threads:
            t.join(30)
        for ch in channels:
            ch.close()
    assert [e.reason for e in ends] == [pb.END_REASON_COMPLETED] * 20
    assert status.waiting_calls <= 128
    assert all(e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-pending" in e.details() for e in ended)
    evicted = [e for e in ended if "place went to another client" in e.details()]
    refused = [e for e in ended if "fair share" in e.details() and "too many calls waiting" in e.details()]
    print(f"{len(evicted)} idle calls evicted, {len(refused)} refused at their fair share, 20 of 20 streams served")
    assert evicted and refused and len(evicted) + len(refused) == len(ended)


@pytest.mark.parametrize("kind", ["status", "health", "reflection"])
def test_open_streaming_calls_over_their_budget_are_refused_and_status_and_health_still_served(edge, kind):
    hold = threading.Event()
    with grpc.insecure_channel(edge.address) as ch:
        calls = [_open_streaming_call(ch, kind, hold) for _ in range(MAX_WATCHERS)]
        try:
            with pytest.raises(grpc.RpcError) as err:
                _open_streaming_call(ch, kind, hold)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "at most 4" in err.value.details()
            with stagecast.Client(edge.address) as client:
                assert client.status().max_streams == MAX_STREAMS
            assert _health(edge.address) == health_pb2.HealthCheckResponse.SERVING
            assert _health(edge.health_address) == health_pb2.HealthCheckResponse.SERVING
        finally:
            hold.set()
            for call in calls:
                call.cancel()
        # The slots come back once the server has seen the calls end (bounded wait, not a sleep).
        deadline = time.monotonic() + 30
        while True:
            try:
                _open_streaming_call(ch, kind, threading.Event()).cancel()
                break
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() < deadline
                threading.Event().wait(0.05)


@pytest.mark.parametrize(
    "data",
    [b"\xff\xff\xff", b"\x0a\x05ab", b"\x0a\x03\x0a\x01\xc3", bytes(range(256))],
    ids=["bad-tag", "truncated", "bad-utf8", "noise"],
)
def test_undecodable_bytes_get_invalid_argument_and_no_traceback(edge, data):
    before = len(edge.log.tracebacks)
    err = _raw_generate(edge.address, [data])
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details().startswith("request: "), err.details()
    # After a config, too: the stream ends with INVALID_ARGUMENT.
    err = _raw_generate(edge.address, [_config(width=W, height=H), data])
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details().startswith("request: "), err.details()
    with _channel(edge.address) as ch:  # (a StatusRequest has no fields: only bytes broken on the wire fail it)
        with pytest.raises(grpc.RpcError) as info:
            ch.unary_unary(GET_STATUS, request_serializer=None, response_deserializer=None)(b"\x0a\x05ab", timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and info.value.details().startswith("request: ")
    assert len(edge.log.tracebacks) == before


def test_a_request_over_the_largest_legal_message_is_refused(edge):
    # The largest legal request is about 172 KiB; 1 MiB (and far more before) used to be parsed.
    for size in (1 << 20, 16 << 20):
        err = _raw_generate(edge.address, [b"\x0a" + b"\xff" * 5 + b"\x0f" + os.urandom(size)])
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (size, err.code(), err.details())
    # A 10 MB prompt update: refused by size before it costs anything.
    huge = pb.ClientMessage(prompt=pb.PromptUpdate(prompt="snow " * 2_000_000)).SerializeToString()
    err = _raw_generate(edge.address, [_config(width=W, height=H), huge])
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert edge.alive()


def test_a_prompt_update_over_the_prompt_limit_is_invalid_argument(edge):
    with stagecast.Client(edge.address) as client:
        gen = client.generate(PROMPT, width=W, height=H, codec="raw", timeout=TIMEOUT)  # until stopped
        gen.wait_started()
        start = time.monotonic()
        gen.update_prompt("x" * 20_001)  # fits a message, over the prompt limit the config has
        with pytest.raises(stagecast.InvalidArgumentError, match="prompt update: prompt: is 20001 characters"):
            gen.collect()
        assert time.monotonic() - start < 30


def test_a_stream_over_the_cost_budget_is_refused_naming_the_budget(edge):
    with stagecast.Client(edge.address) as client:
        # One legal 2048x2048 frame took a minute and gigabytes on CPU; 4096x4096 was accepted whatever the device.
        for size in (2048, 4096):
            with pytest.raises(stagecast.ResourceExhaustedError, match="cost budget: .*--max-frame-pixels"):
                client.generate(PROMPT, width=size, height=size, steps=1, timeout=TIMEOUT).wait_started()
        with pytest.raises(stagecast.ResourceExhaustedError, match="cost budget: .*pixel-passes/s.*--max-stream-cost"):
            client.generate(PROMPT, width=128, height=128, steps=8, timeout=TIMEOUT).wait_started()


def test_a_rate_the_encoder_cannot_take_is_refused_at_config_time(edge):
    with stagecast.Client(edge.address) as client:
        with pytest.raises(stagecast.InvalidArgumentError, match=r"target_fps: must be in \[1, 240\]"):
            client.generate(PROMPT, width=W, height=H, codec="h264", target_fps=1e-4, timeout=TIMEOUT).wait_started()


def test_started_echoes_every_field_and_enums_round_trip(edge):
    with stagecast.Client(edge.address) as client:
        gen = client.generate(PROMPT, width=W, height=H, seconds=0.25, codec="h264", policy="clean", timeout=TIMEOUT)
        info = gen.wait_started()
        frames = gen.collect()
    cfg = info.config
    assert (cfg.codec, cfg.policy, cfg.window, cfg.quality) == (pb.CODEC_H264, pb.KV_POLICY_CLEAN, 0, 55)
    assert (info.codec, info.policy, info.window) == ("h264", "clean", None)
    assert (cfg.decoder, info.decoder) == (pb.DECODER_FULL, "full")  # the deployment's default, written out
    assert gen.end.reason == "completed" and {f.codec for f in frames} == {"h264"}


# ---- fuzzing --------------------------------------------------------------------------------------------------

_INTS = [0, 1, -1, 2, 15, 16, 17, 32, 48, 64, 4096, 4112, 2**31 - 1, -(2**31)]
_FLOATS = [0.0, -0.0, 1.0, -1.0, 0.25, 1e-4, 16.0, 240.0, 240.5, 1e30, float("inf"), float("-inf"), float("nan")]
_LADDERS = [[700.0], [1000.0, 500.0], [500.0, 700.0], [700.0, 700.0], [1e30], [float("nan")], [0.0], [-1.0]]
_LADDERS += [[1000.0 - i for i in range(51)], [float("inf"), 500.0]]
_PROMPTS = ["", " ", PROMPT, "snow " * 40, "\u00e9\u4e2d\U0001f98a" * 50, "x" * 20_001, "\x00\x01\x7f"]


@dataclass
class Case:
    method: str
    messages: list[bytes]
    read: int = 3  # responses read before cancelling (a stream that started is cancelled, as a client may)
    note: str = ""


def _near_valid_config(rng: random.Random) -> pb.StreamConfig:
    """A config that starts a stream, with at most one field pushed to an edge: the streams the fuzz opens run."""
    cfg = stagecast.client.stream_config(
        PROMPT, width=W, height=H, seconds=rng.choice([0.25, None]), codec=rng.choice(["jpeg", "h264", "raw"])
    )
    name = rng.choice(["width", "steps", "target_fps", "window", "sink", "quality", "seed", "chunk_frames", None])
    if name == "target_fps":
        cfg.target_fps = rng.choice([1.0, 240.0, 239.99, 0.999])
    elif name == "seed":
        cfg.seed = rng.choice([-(2**63), 2**63 - 1])
    elif name is not None:
        setattr(cfg, name, rng.choice([0, 1, 2, 16, 64, 100, 1024, 1025]))
    return cfg


def _random_config(rng: random.Random) -> pb.StreamConfig:
    if rng.random() < 0.3:
        return _near_valid_config(rng)
    cfg = pb.StreamConfig(prompt=rng.choice(_PROMPTS))
    for name in ("width", "height", "chunk_frames", "steps", "window", "sink", "quality"):
        if rng.random() < 0.5:
            setattr(cfg, name, rng.choice(_INTS + [W, H, 1, 2, 4]))
    if rng.random() < 0.5:
        cfg.seed = rng.choice([0, -1, 2**63 - 1, -(2**63), rng.getrandbits(32)])
    for name in ("guidance_scale", "target_fps", "seconds"):
        if rng.random() < 0.4:
            setattr(cfg, name, rng.choice(_FLOATS))
    cfg.codec = rng.choice([0, 1, 2, 3, 4, -1, 2**31 - 1])
    cfg.policy = rng.choice([0, 1, 2, 3, -7])
    # The decoder follows the codec's draw (no draw of its own keeps the other cases as they were): UNSPECIFIED, FULL,
    # TINY on a gateway without one, and numbers it does not know.
    cfg.decoder = cfg.codec
    if rng.random() < 0.3:
        cfg.timesteps.extend(rng.choice(_LADDERS))
    if rng.random() < 0.2:
        cfg.shift = rng.choice(_FLOATS)
    return cfg


def _mutate(rng: random.Random, data: bytes) -> bytes:
    data = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(4)
        if op == 0 and data:
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        elif op == 1 and data:
            del data[rng.randrange(len(data)) :]
        elif op == 2:
            at = rng.randint(0, len(data))
            data[at:at] = os.urandom(rng.randint(1, 8))
        else:
            data += struct.pack("<B", rng.randrange(256)) * rng.randint(1, 16)
    return bytes(data)


def _later(rng: random.Random) -> bytes:
    kind = rng.randrange(5)
    if kind == 0:
        return pb.ClientMessage(prompt=pb.PromptUpdate(prompt=rng.choice(_PROMPTS))).SerializeToString()
    if kind == 1:
        return pb.ClientMessage(stop=pb.Stop()).SerializeToString()
    if kind == 2:
        return pb.ClientMessage(config=_random_config(rng)).SerializeToString()
    if kind == 3:
        return b""  # an empty ClientMessage
    return os.urandom(rng.randint(1, 64))


def fuzz_cases(n: int, seed: int) -> list[Case]:
    rng = random.Random(seed)
    cases = []
    for _ in range(n):
        r = rng.random()
        if r < 0.15:
            msgs = [os.urandom(rng.randint(0, 300)) for _ in range(rng.randint(1, 3))]
            cases.append(Case(GENERATE, msgs, note="noise"))
        elif r < 0.35:
            base = pb.ClientMessage(config=_random_config(rng)).SerializeToString()
            cases.append(Case(GENERATE, [_mutate(rng, base)], note="mutated config"))
        elif r < 0.75:
            first = pb.ClientMessage(config=_random_config(rng)).SerializeToString()
            cases.append(Case(GENERATE, [first] + [_later(rng) for _ in range(rng.randint(0, 3))], note="config"))
        elif r < 0.82:
            cases.append(Case(GENERATE, [_later(rng) for _ in range(rng.randint(0, 2))], note="no config first"))
        elif r < 0.90:
            data = rng.choice([b"", os.urandom(rng.randint(1, 40))])
            cases.append(Case(rng.choice([GET_STATUS, WATCH_STATUS]), [data], read=1, note="status"))
        elif r < 0.95:
            size = rng.choice([100 << 10, 1 << 20, 4 << 20])
            cases.append(Case(GENERATE, [b"\x0a" + os.urandom(size)], note="oversize"))
        else:
            cases.append(
                Case("/stagecast.v1.StreamService/" + rng.choice(["Nope", "generate", ""]), [b""], note="unknown")
            )
    return cases


def run_case(channel: grpc.Channel, case: Case, timeout: float = 60.0) -> grpc.StatusCode:
    """The status a case ended with (OK, or CANCELLED when this client cancelled a stream that was running);
    a client-side deadline is a hang."""
    if case.method in (GET_STATUS,):
        call = channel.unary_unary(case.method, request_serializer=None, response_deserializer=None)
        try:
            call(case.messages[0], timeout=timeout)
            return grpc.StatusCode.OK
        except grpc.RpcError as exc:
            return _code(exc)
    if case.method == WATCH_STATUS:
        it = channel.unary_stream(case.method, request_serializer=None, response_deserializer=None)(
            case.messages[0], timeout=timeout
        )
    else:
        it = channel.stream_stream(case.method, request_serializer=None, response_deserializer=None)(
            iter(case.messages), timeout=timeout
        )
    try:
        for i, _ in enumerate(it):
            if i + 1 >= case.read:
                it.cancel()
                return grpc.StatusCode.CANCELLED
        return grpc.StatusCode.OK
    except grpc.RpcError as exc:
        return _code(exc)


def _code(exc: grpc.RpcError) -> grpc.StatusCode | str:
    if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and not (exc.details() or "").startswith("config:"):
        return "HANG"  # the client's own deadline passed: the gateway never answered
    return exc.code()


def fuzz(edge: Edge, n: int, seed: int) -> None:
    cases = fuzz_cases(n, seed)
    before = len(edge.log.tracebacks)
    with _channel(edge.address) as ch, ThreadPoolExecutor(8) as pool:
        codes = list(pool.map(lambda c: run_case(ch, c), cases))
    bad = [(c.note, code, c.messages[:2]) for c, code in zip(cases, codes) if code in BAD_CODES or code == "HANG"]
    counts: dict = {}
    for code in codes:
        counts[str(code)] = counts.get(str(code), 0) + 1
    print(f"fuzz: {n} requests (seed {seed}): {counts}")
    assert not bad, f"{len(bad)} of {n} requests crashed, hung or got INTERNAL/UNKNOWN (seed {seed}): {bad[:5]}"
    assert edge.alive(), "the gateway process died"
    assert edge.log.tracebacks[before:] == [], "the gateway logged tracebacks"
    assert _health(edge.address) == health_pb2.HealthCheckResponse.SERVING
    # Every stream the fuzz started is gone, and a normal stream completes afterwards.
    _wait_status(edge.address, lambda s: s.active_streams == 0 and s.waiting_calls == 0)
    _complete_a_stream(edge.address)


def _seed(default: int) -> int:
    return int(os.environ.get("STAGECAST_FUZZ_SEED", default))


def test_fuzz_slice(edge):
    fuzz(edge, 100, _seed(17))


@pytest.mark.fuzz
def test_fuzz_full(edge):
    fuzz(edge, 1200, _seed(1717))


# ---- a client without stagecast's code ---------------------------------------------------------------------------


def test_a_client_built_only_from_server_reflection_streams_with_typed_enums(edge):
    """What a client in another language does (grpcurl, a Node client with a dynamic loader): it knows the API only
    from the service description, sets enums by name, and reads every field of Started.config back."""
    from google.protobuf import descriptor_pool, message_factory
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    with grpc.insecure_channel(edge.address) as ch:
        pool = descriptor_pool.DescriptorPool(ProtoReflectionDescriptorDatabase(ch))
        service = pool.FindServiceByName("stagecast.v1.StreamService")
        options = service.file.GetOptions()
        assert options.go_package.endswith(";stagecastv1") and options.java_package == "dev.stagecast.api.v1"
        client_msg = message_factory.GetMessageClass(pool.FindMessageTypeByName("stagecast.v1.ClientMessage"))
        server_msg = message_factory.GetMessageClass(pool.FindMessageTypeByName("stagecast.v1.ServerMessage"))
        codec = pool.FindEnumTypeByName("stagecast.v1.Codec")
        assert [v.name for v in codec.values] == ["CODEC_UNSPECIFIED", "CODEC_JPEG", "CODEC_H264", "CODEC_RAW"]

        request = client_msg()
        request.config.prompt = PROMPT
        request.config.width, request.config.height, request.config.seconds = W, H, 0.25
        request.config.codec = codec.values_by_name["CODEC_RAW"].number
        call = ch.stream_stream(
            "/stagecast.v1.StreamService/Generate",
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=server_msg.FromString,
        )(iter([request]), timeout=TIMEOUT)
        replies = list(call)

    def enum_name(message, field: str) -> str:
        value = getattr(message, field)
        return message.DESCRIPTOR.fields_by_name[field].enum_type.values_by_number[value].name

    started, frames, end = replies[0].started, [r.frame for r in replies[1:-1]], replies[-1].end
    config = started.config
    assert enum_name(config, "codec") == "CODEC_RAW" and enum_name(config, "policy") == "KV_POLICY_PER_LEVEL"
    assert enum_name(config, "decoder") == "DECODER_FULL"  # resolved and echoed, never UNSPECIFIED
    absent = [f.name for f in config.DESCRIPTOR.fields if f.has_presence and not config.HasField(f.name)]
    # A bounded clip: seconds present too; only the video-to-video fields, and the negative prompt of an unguided
    # stream, stay absent on a text stream.
    assert sorted(absent) == ["input_timeout", "negative_prompt", "strength"] and (config.window, config.quality) == (
        0,
        100,
    )
    assert len(frames) == 4 and all(enum_name(f, "codec") == "CODEC_RAW" for f in frames)
    assert all(len(f.data) == W * H * 3 for f in frames)
    assert enum_name(end, "reason") == "END_REASON_COMPLETED" and end.frames == 4


NODE_DIR = Path(__file__).resolve().parent / "node"


def install_node_client() -> None:
    """The client's two packages, pinned by ``tests/node/package-lock.json``: installed here when they are missing, so
    the README's plain ``pytest`` passes on a fresh clone as CI's run does; skipped, naming the command, where npm
    or its registry is not there."""
    if (NODE_DIR / "node_modules" / "@grpc" / "grpc-js").is_dir():
        return
    command = ["npm", "ci", "--prefix", str(NODE_DIR), "--no-audit", "--no-fund", "--loglevel=error"]
    if shutil.which("npm") is None:
        pytest.skip("no npm on this machine to run: npm ci --prefix tests/node")
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        pytest.skip("npm ci --prefix tests/node did not finish in 300 s (is the npm registry reachable?)")
    if done.returncode != 0:
        pytest.skip(f"npm ci --prefix tests/node failed: {done.stderr.strip()[-300:]}")


def test_a_node_client_built_from_the_proto_file_streams_with_enum_names(edge):
    """The Node.js path (``tests/node``; ``npm ci --prefix tests/node`` installs its two packages, as CI does)."""
    node = shutil.which("node")
    if node is None:
        pytest.skip("no node on this machine")
    install_node_client()
    proc = subprocess.run(
        [node, str(NODE_DIR / "foreign_client.mjs"), edge.address], capture_output=True, text=True, timeout=TIMEOUT
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["code"] == 0, out["details"]
    config = out["config"]
    assert (config["codec"], config["policy"], config["window"], config["quality"]) == (
        "CODEC_RAW",
        "KV_POLICY_PER_LEVEL",
        0,
        100,
    )
    assert config["width"] == W and config["target_fps"] == 16 and "seed" in config and "sink" in config
    assert out["frames"] == out["totalFrames"] == out["endFrames"] == 4
    assert out["frameCodecs"] == ["CODEC_RAW"] and out["frameBytes"] == [W * H * 3]
    assert out["endReason"] == "END_REASON_COMPLETED"
    assert out["badCode"] == grpc.StatusCode.INVALID_ARGUMENT.value[0] and out["badDetails"].startswith("codec:")
    assert out["statusMaxStreams"] == MAX_STREAMS
