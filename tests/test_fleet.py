"""A fleet on loopback: ``stagecast up --pipelines 2 --stages 1 --state-file F`` on the demo checkpoint, behind a
real HAProxy that terminates the public TLS.  One ``up`` serves the module, in order: the door routes by free slots
(A full, so every stream lands on B until B is full, then a pipeline refuses with its retry delay); a lost (SIGKILL)
or hung (SIGSTOP) gateway is marked down within 3 s, routed around and taken back; SIGTERM to a pipeline drains it
and ``up`` does not restart it.  Also: HAProxy accepts the rendered config."""

import json
import os
import re
import signal
import tempfile
import threading
import time
from pathlib import Path

import pytest

import stagecast
from launcher import door
from launcher.demo_checkpoint import write_demo_checkpoint
from launcher.process import Launcher
from stagecast.errors import InvalidArgumentError, ResourceExhaustedError, UnavailableError
from stagecast.security import issue, make_ca
from tests.pipeline_helpers import wait_until

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.skipif(
        not any(os.access(p, os.X_OK) for p in ("/usr/sbin/haproxy", "/usr/bin/haproxy")),
        reason="HAProxy is not installed (apt-get install haproxy; .ci/run installs it)",
    ),
]

DOOR_RESET = (
    "HAProxy 2.6.12 (Debian 12's) resets a call whose response ends while the client's request is still open with "
    "RST_STREAM(CANCEL), and the reset can overtake the End message (haproxy/haproxy#1219, fixed upstream by "
    "e87397bc7 in 2025): so the SDK closes its side at End and the gateway ends the call after that"
)
STEPS = 4  # the coordinator prices a free slot at the public defaults' 4 steps: every stream here is one slot
STAGE_MS = "60"  # with --slo-fixed, the SLO model's stage time: 3 such streams per pipeline, whatever this CPU does


class Fleet:
    def __init__(self, up, state_file: Path, ca: bytes):
        self.up = up
        self.state_file = state_file
        self.ca = ca  # the public API's CA: the door terminates TLS with the gateway's certificate
        socket_line = next(line for line in up.log if "master CLI" in line)
        self.door_socket = socket_line.rsplit(" ", 1)[1]

    @property
    def state(self) -> dict:
        return json.loads(self.state_file.read_text())

    def door_client(self) -> stagecast.Client:
        return stagecast.Client(self.state["door"], root_certificates=self.ca)

    def pipeline(self, name: str) -> dict:
        return next(p for p in self.state["pipelines"] if p["name"] == name)

    def door_servers(self, backend: str = "grpc") -> dict:
        view = door.Door.__new__(door.Door)  # the running door's master CLI, not a new HAProxy
        view.socket = Path(self.door_socket)
        return view.servers(backend)

    def weight(self, name: str) -> str:
        return self.door_servers()[name]["weight"]

    def _whole(self, name: str) -> bool:
        """The pipeline's gateway, as the state file names it now (a restart moves it), holds nothing."""
        try:
            with stagecast.Client(self.pipeline(name)["gateway"]) as client:
                return _whole(client.status(timeout=2.0))
        except UnavailableError:  # restarting: not idle yet
            return False

    def wait_door(self, name: str, predicate, what: str, timeout: float = 30.0) -> None:
        wait_until(lambda: predicate(self.door_servers().get(name, {})), timeout, interval=0.1, what=what)

    def wait_idle(self) -> None:
        """Both pipelines hold nothing and the door weighs them whole again."""
        for name in ("p0", "p1"):
            wait_until(lambda name=name: self._whole(name), 120, interval=0.2, what=f"{name} idle")
        for name in ("p0", "p1"):
            self.wait_door(name, lambda s: s.get("status") == "UP" and s.get("weight") == "100", f"{name} weighed")


def _open(client, prompt: str):
    """A stream that is read on a thread of its own (a client that keeps up), once it started; cancel() ends it."""
    stream = client.generate(prompt=prompt, steps=STEPS)
    stream.wait_started()
    threading.Thread(target=lambda: [None for _ in stream], daemon=True).start()
    return stream


def _door_collect(stream) -> list:
    """A stream's frames through the door, which must end it with its End message and status (DOOR_RESET)."""
    frames = stream.collect()
    assert stream.end is not None and stream.end.reason == "completed"
    return frames


def _whole(status) -> bool:
    return status.active_streams == 0 and status.slots_total > 0 and status.slots_free == status.slots_total


@pytest.fixture(scope="module")
def fleet():
    with tempfile.TemporaryDirectory() as tmp, Launcher() as launcher:
        write_demo_checkpoint(tmp)
        ca, ca_key = make_ca("the fleet test's public CA", days=1)
        cert, key = issue(ca, ca_key, "gateway", hosts=["127.0.0.1"])  # the gateway's certificate, at the door
        (Path(tmp) / "public.crt").write_bytes(cert)
        (Path(tmp) / "public.key").write_bytes(key)
        state = Path(tmp) / "state.json"
        args = ["up", "--checkpoint", tmp, "--pipelines", "2", "--stages", "1", "--port", "0", "--gateway-port", "0"]
        args += ["--web-port", "-1", "--state-file", str(state), "--stage-ms", STAGE_MS, "--slo-fixed"]
        args += ["--drain-s", "20", "--tls-cert", f"{tmp}/public.crt", "--tls-key", f"{tmp}/public.key"]
        up = launcher.spawn("up", args, timeout=600)
        yield Fleet(up, state, ca)


def test_state_file_names_the_door_and_every_pipelines_processes(fleet):
    state = fleet.state
    assert state["door"] == fleet.up.info["door"] == fleet.up.info["gateway"]
    assert [p["name"] for p in state["pipelines"]] == ["p0", "p1"]
    for p in state["pipelines"]:
        assert re.fullmatch(r"127\.0\.0\.1:\d+", p["gateway"]) and re.fullmatch(r"127\.0\.0\.1:\d+", p["coordinator"])
        pids = p["pids"]
        assert len(pids["stages"]) == 1 and all(_alive(pid) for pid in [pids["gateway"], pids["coordinator"]])
        with stagecast.Client(p["gateway"]) as client:
            assert client.status().pipeline == p["name"]
    with fleet.door_client() as client:
        assert client.status().pipeline in ("p0", "p1")  # GetStatus through the door reaches one pipeline
    with stagecast.Client(state["door"]) as plaintext, pytest.raises(UnavailableError):
        plaintext.status(timeout=5.0)  # the public API is TLS: the door terminates it, the gateways behind are plain


def test_door_fills_the_pipeline_with_room_then_a_pipeline_refuses_with_its_retry_delay(fleet):
    fleet.wait_idle()
    a, b = fleet.pipeline("p0"), fleet.pipeline("p1")
    opened = []
    with stagecast.Client(a["gateway"]) as on_a, stagecast.Client(b["gateway"]) as on_b:
        with fleet.door_client() as through_door:
            try:
                free_a = on_a.status().slots_free
                for i in range(free_a):  # A's slots taken by streams opened on its own address
                    opened.append(_open(on_a, f"on a {i}"))
                    assert opened[-1].info.pipeline == "p0"
                wait_until(lambda: on_a.status().slots_free == 0, 30, what="A full")
                fleet.wait_door("p0", lambda s: s.get("weight") == "0", "the door weighing A 0")
                free_b = on_b.status().slots_free
                assert free_b > 0
                for i in range(free_b):  # round-robin would send every other one to A, which would refuse it
                    opened.append(_open(through_door, f"door {i}"))
                    assert opened[-1].info.pipeline == "p1", f"stream {i} through the door"
                with pytest.raises(ResourceExhaustedError) as refused:
                    through_door.generate(prompt="one too many", steps=STEPS).wait_started()
                assert refused.value.retry_after and refused.value.retry_after > 0
                assert "over capacity" in refused.value.details  # the pipeline's own refusal, not HAProxy's 503
            finally:
                for stream in opened:
                    stream.cancel()


def test_a_lost_gateway_is_marked_down_routed_around_and_taken_back(fleet):
    fleet.wait_idle()
    lost = fleet.pipeline("p0")["pids"]["gateway"]
    os.kill(lost, signal.SIGKILL)
    killed = time.monotonic()
    fleet.wait_door("p0", lambda s: s.get("status") == "DOWN", "the door marking the lost p0 down", 3.0)
    with fleet.door_client() as client:
        for i in range(3):  # new streams go to the other pipeline, whole
            stream = client.generate(prompt=f"after {i}", seconds=0.5, steps=STEPS)
            assert stream.info.pipeline == "p1" and len(_door_collect(stream)) == 8
        assert time.monotonic() - killed < 15.0
    # up restarted it (the state file says so), and the door took it back once its agent said up
    wait_until(lambda: fleet.pipeline("p0")["pids"]["gateway"] != lost, 120, interval=0.2, what="p0 restarted")
    assert _alive(fleet.pipeline("p0")["pids"]["gateway"])
    fleet.wait_door("p0", lambda s: s.get("status") == "UP" and s.get("weight") == "100", "p0 back at the door", 60)


def test_a_hung_gateway_is_marked_down_and_taken_back_when_it_answers_again(fleet):
    """SIGSTOP: the kernel still accepts TCP connections for it; the door's h2 check, unanswered, marks it down."""
    fleet.wait_idle()
    hung = fleet.pipeline("p1")["pids"]["gateway"]
    os.kill(hung, signal.SIGSTOP)
    try:
        fleet.wait_door("p1", lambda s: s.get("status") == "DOWN", "the door marking the hung p1 down", 3.0)
        with fleet.door_client() as client:
            stream = client.generate(prompt="while p1 hangs", seconds=0.5, steps=STEPS, timeout=30)
            assert stream.info.pipeline == "p0" and len(_door_collect(stream)) == 8
    finally:
        os.kill(hung, signal.SIGCONT)
    fleet.wait_door("p1", lambda s: s.get("status") == "UP", "p1 back at the door", 10)
    assert fleet.pipeline("p1")["pids"]["gateway"] == hung  # it answered again: not restarted


def test_a_stream_through_the_door_ends_with_its_status(fleet):
    """The SDK closes its side at End and the gateway ends the call after that (gateway.stream.run.END_LINGER_S), so
    HAProxy 2.6, which resets a call whose response ends while its request is open (DOOR_RESET), ends none here."""
    fleet.wait_idle()
    with fleet.door_client() as client:
        for i in range(6):
            stream = client.generate(prompt=f"status {i}", seconds=0.5, steps=STEPS)
            assert len(stream.collect()) == 8 and stream.end.reason == "completed"


def test_a_bad_request_through_the_door_gets_invalid_argument_naming_the_field(fleet):
    """A refusal of the request itself crosses the door with its status (the SDK's call, its side still open)."""
    with fleet.door_client() as client:
        for _ in range(3):
            with pytest.raises(InvalidArgumentError, match="width"):
                client.generate(prompt="too narrow", width=50, steps=STEPS).wait_started()


def test_sigterm_drains_a_pipeline_and_up_does_not_restart_it(fleet):
    fleet.wait_idle()
    b = fleet.pipeline("p1")
    with stagecast.Client(b["gateway"]) as on_b, fleet.door_client() as through_door:
        running = on_b.generate(prompt="runs through the drain", seconds=2, steps=STEPS)
        assert running.info.pipeline == "p1"
        os.kill(b["pids"]["gateway"], signal.SIGTERM)
        wait_until(lambda: on_b.status().draining, 10, interval=0.05, what="p1 draining")
        with pytest.raises(UnavailableError, match="pipeline p1 is draining"):
            on_b.generate(prompt="too late", steps=STEPS).wait_started()  # it admits nothing new
        fleet.wait_door("p1", lambda s: s.get("status") in ("DRAIN", "DOWN", "MAINT"), "the door draining p1", 10)
        frames = running.collect()
        assert running.end.reason == "completed" and len(frames) == 32  # its running stream completed
        wait_until(lambda: not _alive(b["pids"]["gateway"]), 30, interval=0.1, what="p1's gateway exited")
        wait_until(lambda: any("pipeline p1 stopped" in line for line in fleet.up.log), 30, what="up: p1 stopped")
        for pid in [b["pids"]["coordinator"], *b["pids"]["stages"]]:
            wait_until(lambda pid=pid: not _alive(pid), 30, interval=0.1, what=f"p1's process {pid} stopped")
        assert not any("p1/gateway restarted" in line for line in fleet.up.log)
        assert fleet.pipeline("p1")["pids"]["gateway"] == b["pids"]["gateway"]  # not started again
        stream = through_door.generate(prompt="the rest of the fleet", seconds=0.5, steps=STEPS)
        assert stream.info.pipeline == "p0" and len(_door_collect(stream)) == 8


def test_haproxy_accepts_the_rendered_door():
    servers = [door.Server("p0", "127.0.0.1:7001", 7101), door.Server("p1", "127.0.0.1:7002", 7102)]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "haproxy.cfg"
        path.write_text(door.render(bind="127.0.0.1:7000", servers=servers, web="127.0.0.1:7003"))
        door.check_config(door.find_haproxy(), path)
        path.write_text(door.render(bind="127.0.0.1:7000", servers=servers).replace("roundrobin", "round-robin"))
        with pytest.raises(door.DoorError, match=r"haproxy\.cfg:\d+\] : balance"):  # HAProxy names the line
            door.check_config(door.find_haproxy(), path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/status")
    return not (status.exists() and "State:\tZ" in status.read_text())
