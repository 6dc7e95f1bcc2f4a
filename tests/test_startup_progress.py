"""Start-up progress across processes: ``stagecast up`` on CPU prints each service's start-up steps with their times
before READY, the stages report theirs through the coordinator, and the gateway's GetStatus carries them all; while
the gateway loads, its port already answers: health NOT_SERVING, GetStatus/WatchStatus the steps so far, Generate
refused UNAVAILABLE."""

from __future__ import annotations

import re
import tempfile

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from coordinator.options import CoordinatorOptions
from gateway.edge.status import STARTING, STARTING_RETRY_S
from gateway.options import GatewayOptions
from launcher.demo_checkpoint import write_demo_checkpoint
from launcher.local_cluster import stage_args
from launcher.process import Launcher
from stagecast.flags import to_argv
from stagecast.grpc_util import retry_after_of
from stagecast.v1 import stream_pb2 as spb
from stagecast.v1 import stream_pb2_grpc as spb_grpc
from tests.test_up import _free_port

pytestmark = pytest.mark.multiprocess

STEP_LINE = re.compile(r"^\[(?P<child>[\w-]+)\] start-up: (?P<name>\w+)(?: (\d+)/(\d+))? at (?P<at>\d+\.\d\d) s")


def _steps(progress: spb.StartupProgress) -> list[str]:
    return [s.name for s in progress.steps]


def test_up_prints_each_services_start_up_steps_before_ready_and_get_status_carries_them():
    with tempfile.TemporaryDirectory() as tmp, Launcher() as launcher:
        write_demo_checkpoint(tmp)
        args = ["up", "--checkpoint", tmp, "--stages", "2", "--port", "0", "--gateway-port", "0", "--web-port", "-1"]
        up = launcher.spawn("up", args)
        log = list(up.log)
        is_up = next(i for i, line in enumerate(log) if re.match(r"stagecast is up in \d+\.\d s: 2 stages$", line))
        steps = [m for m in map(STEP_LINE.match, log[:is_up]) if m]
        seen = {(m["child"], m["name"]) for m in steps}
        assert {("stage-0", "registered"), ("stage-0", "weights"), ("stage-1", "weights")} <= seen
        assert {("gateway", "text_encoder"), ("gateway", "decoders")} <= seen
        assert all(float(m["at"]) > 0 for m in steps)  # each with its time
        # Each service's READY line with its time, before up's own summary; no raw step lines or bars echoed.
        for child in ("coordinator", "stage-0", "stage-1", "gateway"):
            assert any(re.match(rf"^\[{child}\] READY in \d+\.\d\d s$", line) for line in log[:is_up]), child
        assert not any("STAGECAST_STARTUP" in line or "Loading weights" in line for line in log)

        with grpc.insecure_channel(up.info["gateway"]) as ch:
            status = spb_grpc.StreamServiceStub(ch).GetStatus(spb.StatusRequest(), timeout=10)
        assert not status.starting
        by_process = {p.process: p for p in status.startup}
        assert list(by_process) == ["gateway", "stage 0", "stage 1"]  # the gateway's own first, then by rank
        assert all(p.ready and p.ready_s > 0 for p in status.startup)
        assert _steps(by_process["gateway"])[:2] == ["text_encoder", "decoders"]
        assert _steps(by_process["gateway"])[-1] == "ready"
        for stage in ("stage 0", "stage 1"):
            assert _steps(by_process[stage]) == ["registered", "weights", "ready"]
            at = [s.at_s for s in by_process[stage].steps]
            assert at == sorted(at) and by_process[stage].ready_s == at[-1]
        assert by_process["stage 1"].steps[1].detail.startswith("layers 2:4")


def test_a_loading_gateway_answers_health_not_serving_and_its_start_up_until_it_serves():
    with tempfile.TemporaryDirectory() as tmp, Launcher() as launcher:
        root = write_demo_checkpoint(tmp)
        coordinator = launcher.spawn(
            "coordinator", ["coordinator", *to_argv(CoordinatorOptions(stages=1, port=0, backend="gloo"))]
        )
        address = coordinator.info["address"]
        port = _free_port()
        # Its warm-up waits for the pipeline, which has no stage yet: the gateway stays loading until one comes.
        options = GatewayOptions(coordinator=address, checkpoint=str(root), port=port, pipeline_warmup_s=120.0)
        gateway = launcher.start("gateway", ["gateway", *to_argv(options)])
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = spb_grpc.StreamServiceStub(ch)
            watch = stub.WatchStatus(spb.StatusRequest(), timeout=300, wait_for_ready=True)
            for status in watch:  # each message after a step: no polling
                if status.starting and "decoders" in _steps(status.startup[0]):
                    break
            assert status.max_streams > 0 and status.startup[0].process == "gateway"
            assert not status.startup[0].ready and len(status.startup) == 1  # no stage has reported
            health = health_pb2_grpc.HealthStub(ch)
            for service in ("", "stagecast.v1.StreamService"):
                reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
                assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.RpcError) as refused:
                config = spb.ClientMessage(config=spb.StreamConfig(prompt="a fox"))
                next(iter(stub.Generate(iter([config]), timeout=10)))
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and refused.value.details() == STARTING
            assert retry_after_of(refused.value) == STARTING_RETRY_S  # when to come back (google.rpc.RetryInfo)

            # A stage joins: it reports its steps through the coordinator, the pipeline forms, the gateway finishes.
            launcher.start("stage-0", stage_args(0, address, str(root / "transformer"), "cpu", "float32", "127.0.0.1"))
            for status in watch:
                if not status.starting:
                    break
            launcher.wait_ready(gateway, timeout=300)
            status = stub.GetStatus(spb.StatusRequest(), timeout=10)
            assert not status.starting
            gateway_steps = _steps(status.startup[0])
            assert gateway_steps[:2] == ["text_encoder", "decoders"] and gateway_steps[-1] == "ready"
            assert "pipeline" in gateway_steps and "pipeline_warm_up" in gateway_steps
            assert status.startup[1].process == "stage 0" and _steps(status.startup[1]) == [
                "registered",
                "weights",
                "ready",
            ]
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            watch.cancel()
