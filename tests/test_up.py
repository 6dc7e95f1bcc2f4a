"""``stagecast up`` starts coordinator, stages and gateway; SIGTERM stops all of them, leaving no orphans; it
restarts a service that dies, or exits naming it; its ports are its own."""

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import stagecast
from gateway.checkpoint import ModelInfo
from launcher.demo_checkpoint import write_demo_checkpoint, write_tiny_decoder, write_transformer
from launcher.process import Launcher
from stagecast.internal.v1 import pipeline_pb2 as pb
from stagecast.v1 import stream_pb2 as spb
from tests.pipeline_helpers import coordinator_stub, run_stream, tiny_spec, wait_for_generation, wait_until


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def descendants(pid):
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            kids = (task / "children").read_text().split() if (task / "children").exists() else []
            out += [int(k) for k in kids]
            todo += [int(k) for k in kids]
    return out


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.multiprocess
def test_up_serves_and_sigterm_stops_every_process():
    """Also: ``up --tiny-decoder FILE`` serves DECODER_TINY streams beside DECODER_FULL ones, with the same frames."""
    with tempfile.TemporaryDirectory() as tmp, Launcher() as launcher:
        write_demo_checkpoint(tmp)
        tiny = write_tiny_decoder(
            Path(tmp) / "taew_random.pth", latent_channels=ModelInfo.from_checkpoint(tmp).latent_channels
        )
        args = ["up", "--checkpoint", tmp, "--stages", "2", "--port", "0", "--gateway-port", "0", "--web-port", "0"]
        args += ["--credentials", launcher.credentials]  # the deployment CA this test holds an operator's cert of
        args += ["--tiny-decoder", str(tiny)]
        health_port = _free_port()
        args += ["--health-port", str(health_port)]  # plaintext grpc.health.v1: no certificate needed to probe
        up = launcher.spawn("up", [*args, "--vae-devices", "cpu,cpu"])  # the gateway's VAE cut in two parts
        with grpc.insecure_channel(f"127.0.0.1:{health_port}") as plain:
            reply = health_pb2_grpc.HealthStub(plain).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        channel, stub = coordinator_stub(up.info["coordinator"], launcher)
        assert stub.Status(pb.Empty()).ready
        chunks, reason = run_stream(stub, tiny_spec(num_chunks=2))
        assert reason == "completed" and len(chunks) == 2
        channel.close()
        with stagecast.Client(up.info["gateway"]) as client:
            size = dict(width=16, height=16)  # the smallest: the tiny decoder is slow on a busy CPU
            full = client.generate(prompt="a red fox", seconds=0.5, codec="raw", **size)  # no decoder: the full VAE
            frames = full.collect()
            small = client.generate(prompt="a red fox", seconds=0.5, codec="raw", decoder="tiny", **size)
            small_frames = small.collect()
        assert len(frames) == len(small_frames) == 8
        assert (full.info.config.decoder, small.info.config.decoder) == (spb.DECODER_FULL, spb.DECODER_TINY)
        assert (full.info.decoder, small.info.decoder) == ("full", "tiny")
        size = full.info.width * full.info.height * 3
        assert {len(f.data) for f in frames} == {len(f.data) for f in small_frames} == {size}
        assert [f.index for f in small_frames] == list(range(8)) and small.end.reason == "completed"
        with urllib.request.urlopen(up.info["web"], timeout=30) as page:  # the live page's URL, printed by up
            assert b"stagecast live" in page.read()
        children = descendants(up.pid)
        assert len(children) >= 5  # coordinator + 2 stages + gateway + web
        up.proc.send_signal(signal.SIGTERM)
        assert up.proc.wait(60) == 0
        assert not [pid for pid in children if alive(pid)]
        # A normal shutdown is no error: nothing in up's output (its services' logs included) says ERROR.
        wait_until(lambda: any("shutting down" in line for line in up.log), 30, what="up's last line")
        assert not [line for line in up.log if " ERROR " in line or "Traceback" in line], up.log[-40:]


@pytest.mark.multiprocess
def test_up_serves_a_checkpoint_whose_transformer_has_original_wan_keys_and_config(tmp_path):
    """Stages and gateway read the same config: a Wan-AI ``WanModel`` config.json (``dim``, ``num_heads``, no
    ``in_channels``) with original key names starts the whole system and streams."""
    root = write_demo_checkpoint(tmp_path / "ckpt")
    shutil.rmtree(root / "transformer")
    write_transformer(root / "transformer", seed=0, layout="original")
    config = (root / "transformer" / "config.json").read_text()
    assert '"dim"' in config and "in_channels" not in config
    with Launcher() as launcher:
        args = ["up", "--checkpoint", str(root), "--stages", "2", "--port", "0", "--gateway-port", "0"]
        args += ["--web-port", "0"]
        up = launcher.spawn("up", args)
        with stagecast.Client(up.info["gateway"]) as client:
            frames = client.generate(prompt="a red fox", seconds=0.5, codec="raw").collect()
        assert len(frames) == 8


def _service_pid(up_pid, command):
    """The pid of ``up``'s child running ``stagecast <command>``: a service runs as its own module
    (``python -m stage_service``, ``stagecast.service.SERVICE_MODULES``), any other command through the CLI."""
    from stagecast.service import SERVICE_MODULES

    word = (SERVICE_MODULES[command][0] if command in SERVICE_MODULES else command).encode()
    for pid in descendants(up_pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except FileNotFoundError:
            continue
        if word in argv[:4]:
            return pid
    return None


@pytest.mark.multiprocess
def test_up_restarts_a_killed_coordinator_and_a_new_stream_succeeds_within_10s():
    with tempfile.TemporaryDirectory() as tmp, Launcher() as launcher:
        write_demo_checkpoint(tmp)
        args = ["up", "--checkpoint", tmp, "--stages", "2", "--port", "0", "--gateway-port", "0", "--web-port", "0"]
        up = launcher.spawn("up", [*args, "--credentials", launcher.credentials])  # our operator cert is valid there
        old = _service_pid(up.pid, "coordinator")
        os.kill(old, signal.SIGKILL)
        line = wait_until(
            lambda: next((entry for entry in up.log if "coordinator restarted" in entry), None),
            timeout=120,
            what="the coordinator's restart",
        )
        restarted = time.monotonic()
        assert "was killed by SIGKILL" in "\n".join(up.log)
        new = _service_pid(up.pid, "coordinator")
        assert new is not None and new != old and f"pid {new}" in line
        # The stages rejoin the new coordinator by themselves; the gateway keeps its address.
        wait_for_generation(up.info["coordinator"], 1, launcher, timeout=60)
        formed = time.monotonic() - restarted
        with stagecast.Client(up.info["gateway"]) as client:
            while True:
                try:
                    frames = client.generate(prompt="a red fox", seconds=0.5, codec="raw").collect()
                    break
                except stagecast.StagecastError as exc:
                    assert "not ready" in str(exc), exc  # re-forming: refused clearly, then served
                    assert time.monotonic() - restarted < 10.0, exc
                    time.sleep(0.1)
        took = time.monotonic() - restarted
        assert len(frames) == 8
        assert took < 10.0, f"the first stream after the restart ended {took:.1f}s after it"
        print(f"after the coordinator restart: generation formed in {formed:.2f}s, a stream completed in {took:.2f}s")

        # `stagecast generate`: Ctrl-C stops gracefully, a second Ctrl-C ends it at once, without a traceback.
        cmd = [sys.executable, "-m", "launcher.cli", "generate", "--target", up.info["gateway"]]
        cmd += ["--prompt", "a red fox", "--codec", "raw", "--out", os.path.join(tmp, "clip.mp4")]
        # The stream above may still be listed by the gateway for a moment: counted below, it would have the Ctrl-C
        # sent while the CLI is still starting, before its handler (a KeyboardInterrupt, no "stopping" line).
        wait_until(lambda: _gateway_streams(up.info["gateway"]) == 0, 30, what="the previous stream leaving")
        gen = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        wait_until(lambda: gen.poll() is not None or _gateway_streams(up.info["gateway"]) > 0, 120)
        gen.send_signal(signal.SIGINT)
        assert any("stopping" in line for line in gen.stdout)  # the first Ctrl-C was handled (no EOF first)
        gen.send_signal(signal.SIGINT)
        out, err = gen.communicate(timeout=60)
        # Killed by SIGINT, as shells expect of an interrupted program (0: the graceful stop had already finished).
        assert gen.returncode in (-signal.SIGINT, 0), err
        assert "Traceback" not in err and "KeyboardInterrupt" not in err, err

        # SIGTERM under load: every process ends cleanly (no traceback, no stuck executor).
        with stagecast.Client(up.info["gateway"]) as client:
            busy = client.generate(prompt="a red fox", codec="raw")  # unbounded
            next(iter(busy))
            up.proc.send_signal(signal.SIGTERM)
            assert up.proc.wait(60) == 0
        log = "\n".join(up.log)
        assert "Traceback" not in log and "executor is stuck" not in log, log


def _gateway_streams(address):
    import grpc

    from stagecast.v1 import stream_pb2, stream_pb2_grpc

    with grpc.insecure_channel(address) as ch:
        status = stream_pb2_grpc.StreamServiceStub(ch).GetStatus(stream_pb2.StatusRequest(), timeout=10)
        # A stream counts once frames reach its client: by then the client has its Started and its Ctrl-C handler.
        return sum(1 for s in status.streams if s.frames_sent > 0)


@pytest.mark.multiprocess
def test_up_exits_non_zero_naming_a_service_it_cannot_keep_up():
    with tempfile.TemporaryDirectory() as tmp, Launcher() as launcher:
        write_demo_checkpoint(tmp)
        args = ["up", "--checkpoint", tmp, "--stages", "2", "--port", "0", "--gateway-port", "-1"]
        up = launcher.spawn("up", [*args, "--max-restarts", "0"])
        children = descendants(up.pid)
        os.kill(_service_pid(up.pid, "stage"), signal.SIGKILL)
        assert up.proc.wait(60) == 1
        log = "\n".join(up.log)
        assert "stage-0 was killed by SIGKILL" in log and "giving up" in log
        assert not [pid for pid in children if alive(pid)]


@pytest.mark.multiprocess
def test_a_second_up_on_a_taken_port_fails_at_once_with_address_already_in_use():
    from stagecast.grpc_util import make_server

    first, _, port = make_server(0, [])  # the port a first deployment's coordinator or gateway serves on
    first.start()
    with tempfile.TemporaryDirectory() as tmp:
        for flag in ("--port", "--gateway-port"):
            other = "--gateway-port" if flag == "--port" else "--port"
            args = ["up", "--checkpoint", tmp, "--stages", "2", flag, str(port), other, "0", "--web-port", "0"]
            start = time.monotonic()
            done = subprocess.run([sys.executable, "-m", "launcher.cli", *args], capture_output=True, text=True)
            assert done.returncode == 2
            assert f"127.0.0.1:{port}: address already in use" in done.stderr
            assert "Traceback" not in done.stderr
            # At once: before any service was started (their output is echoed as "[name] ...").
            assert "[coordinator]" not in done.stderr + done.stdout, done.stderr
            print(f"{flag} taken: exit 2 after {time.monotonic() - start:.1f}s (interpreter start included)")
    first.stop(None)


@pytest.mark.unit
def test_a_service_on_a_taken_port_says_address_already_in_use():
    from stagecast.grpc_util import AddressInUseError, make_server

    server, _, port = make_server(0, [])
    server.start()
    try:
        with pytest.raises(AddressInUseError, match="address already in use"):
            make_server(port, [])
        # A server started without the check still cannot share the port (no SO_REUSEPORT).
        import grpc

        from stagecast.grpc_util import SERVER_OPTIONS

        other = grpc.server(ThreadPoolExecutor(1), options=SERVER_OPTIONS)
        with pytest.raises(RuntimeError):
            other.add_insecure_port(f"127.0.0.1:{port}")
    finally:
        server.stop(None)


@pytest.mark.multiprocess
def test_up_replaces_a_stopped_stage_and_a_new_stream_succeeds():
    """SIGSTOP a stage: its health checks fail, ``up`` kills it after --stage-hang-s and starts it again, the
    pipeline re-forms and a new stream succeeds, without SIGCONT."""
    with tempfile.TemporaryDirectory() as tmp, Launcher() as launcher:
        write_demo_checkpoint(tmp)
        args = ["up", "--checkpoint", tmp, "--stages", "2", "--port", "0", "--gateway-port", "0", "--web-port", "-1"]
        args += ["--stage-hang-s", "3", "--credentials", launcher.credentials]  # our operator cert is valid there
        up = launcher.spawn("up", args)
        old = _service_pid(up.pid, "stage")
        os.kill(old, signal.SIGSTOP)
        stopped = time.monotonic()
        wait_until(
            lambda: any("restarted" in entry and "stage-" in entry for entry in up.log), timeout=120, what="a restart"
        )
        log = "\n".join(up.log)
        assert "failed its health checks for 3 s; killing it" in log and "was killed by SIGKILL" in log, log
        assert not alive(old)  # killed and reaped by up
        wait_for_generation(up.info["coordinator"], 2, launcher, timeout=120)  # the pipeline re-formed
        with stagecast.Client(up.info["gateway"]) as client:
            frames = client.generate(prompt="a red fox", seconds=0.5, codec="raw").collect()
        assert len(frames) == 8
        print(f"a new stream completed {time.monotonic() - stopped:.1f} s after the stage was stopped")
        up.proc.send_signal(signal.SIGTERM)
        assert up.proc.wait(60) == 0


@pytest.mark.unit
def test_the_supervisor_kills_a_child_whose_health_stays_failing_and_spares_a_healthy_one():
    import threading
    from concurrent import futures

    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    from launcher.process import Child, Supervisor

    class Proc:  # what the probe asks of a child's process
        def __init__(self):
            self.killed = threading.Event()

        def poll(self):
            return -9 if self.killed.is_set() else None

        def kill(self):
            self.killed.set()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    stop = threading.Event()
    try:
        sup = Supervisor(Launcher(mtls=False), stop, hang_s=1.0)
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        healthy = Child("stage-0", Proc(), info={"address": f"127.0.0.1:{port}"})
        probe = threading.Thread(target=sup._probe, args=(healthy, "stage"))
        probe.start()
        assert not healthy.proc.killed.wait(3.0)  # 3 s of passing checks: left alone
        servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)  # a hung executor
        assert healthy.proc.killed.wait(30.0)
        probe.join(10)
    finally:
        stop.set()
        server.stop(0)
    with pytest.raises(ValueError, match="--stage-hang-s"):
        Supervisor(Launcher(mtls=False), stop, hang_s=0.5)
