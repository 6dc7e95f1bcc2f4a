"""Losing a stage mid-stream fails the affected streams promptly; a restarted stage rejoins a new generation;
a paused stage rejoins by itself once it runs again."""

import os
import re
import signal
import tempfile
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from launcher.demo_checkpoint import write_transformer
from launcher.local_cluster import stage_args, start_pipeline
from launcher.process import Launcher
from stage_service.server import SERVICE_NAME as STAGE_HEALTH
from stagecast.grpc_util import NOT_SERVING, SERVING
from stagecast.internal.v1 import pipeline_pb2 as pb
from tests.pipeline_helpers import (
    coordinator_stub,
    open_request,
    run_stream,
    tiny_spec,
    wait_for_generation,
    wait_until,
)

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def checkpoint():
    with tempfile.TemporaryDirectory() as tmp:
        write_transformer(Path(tmp) / "transformer", seed=0)
        yield str(Path(tmp) / "transformer")


def test_sigkill_of_a_stage_fails_streams_then_a_new_generation_serves(checkpoint):
    with Launcher() as launcher:
        pipe = start_pipeline(launcher, checkpoint=checkpoint, stages=3)
        channel, stub = coordinator_stub(pipe.coordinator, launcher)
        assert stub.Status(pb.Empty()).generation == 1
        # A long stream: it is still running when the stage dies.
        events = stub.OpenStream(open_request(tiny_spec(num_chunks=100_000)), timeout=60)
        seen_chunk = False
        with pytest.raises(grpc.RpcError) as info:
            for ev in events:
                if ev.WhichOneof("event") == "chunk" and not seen_chunk:
                    seen_chunk = True
                    killed_at = time.monotonic()
                    pipe.stage_children[1].proc.kill()  # SIGKILL
        failed_after = time.monotonic() - killed_at
        assert seen_chunk
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "stage" in info.value.details() and "generation 1" in info.value.details()
        assert failed_after < 10.0, f"the stream took {failed_after:.1f}s to fail"

        # While the stage is down, new streams are refused with a clear status, not hung.
        with pytest.raises(grpc.RpcError) as refused:
            run_stream(stub, tiny_spec(), timeout=30)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "not ready" in refused.value.details()
        # The surviving stage is alive, waiting to join: its process health says SERVING, its stage service not.
        survivor = pipe.stage_children[0].info["address"]
        wait_until(lambda: health(launcher, survivor, STAGE_HEALTH) == NOT_SERVING, timeout=30, what="stage 0 leaving")
        assert health(launcher, survivor, "") == SERVING
        # A dead data-plane peer is at most one line at each survivor, naming it, and no traceback.  A survivor whose
        # data plane met the dead peer says so; one reset first (the coordinator's reason may name another survivor
        # that left) need not name it, but the death is named at one survivor at least.
        survivors = [pipe.stage_children[0], pipe.stage_children[2]]
        for child in survivors:
            wait_until(lambda c=child: _left(c, 1), timeout=30, what="the survivors leaving generation 1")
        naming = []
        for child in survivors:
            log = list(child.log)
            assert not [line for line in log if "Traceback" in line], log[-30:]
            naming.append([line for line in log if re.search(r"\bstage 1\b", line)])
            assert len(naming[-1]) <= 1, naming[-1]
        assert any(naming), [list(child.log)[-30:] for child in survivors]

        launcher.spawn("stage-1-restarted", pipe.stage_args[1])
        status = wait_for_generation(pipe.coordinator, 2, launcher)
        assert status.ready and status.generation >= 2
        chunks, reason = run_stream(stub, tiny_spec(num_chunks=3))
        assert reason == "completed" and len(chunks) == 3
        channel.close()
    # Leaving the launcher stopped every process it started, including re-executed survivors.
    assert all(child.proc.poll() is not None for child in [pipe.coordinator_child, *pipe.stage_children.values()])


def _left(child, generation: int) -> bool:
    return any(f"leaving generation {generation}" in line for line in list(child.log))


def health(launcher, address, service):
    with launcher.channel(address, "stage") as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status


def _ready(stub):
    return stub.Status(pb.Empty(), timeout=10).ready


@pytest.mark.parametrize("pause", ["until-lost", pytest.param("20s", marks=pytest.mark.soak)])
def test_a_paused_stage_rejoins_by_itself_and_a_new_stream_succeeds_within_10s(checkpoint, pause):
    with Launcher() as launcher:
        pipe = start_pipeline(launcher, checkpoint=checkpoint, stages=2)
        channel, stub = coordinator_stub(pipe.coordinator, launcher)
        stage = pipe.stage_children[1]
        # A stream is running when the stage stops: the survivor is blocked on it in the data plane.
        events = stub.OpenStream(open_request(tiny_spec(num_chunks=100_000)), timeout=120)
        assert next(ev for ev in events if ev.WhichOneof("event") == "chunk")
        os.kill(stage.pid, signal.SIGSTOP)
        try:
            with pytest.raises(grpc.RpcError) as info:
                for _ in events:
                    pass
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "stopped answering health checks" in info.value.details()
            assert not _ready(stub)
            if pause == "20s":
                # Longer than the coordinator's Reset deadline (15 s): the stage is marked lost for good.
                time.sleep(20)
        finally:
            os.kill(stage.pid, signal.SIGCONT)
        resumed = time.monotonic()
        wait_for_generation(pipe.coordinator, 2, launcher, timeout=30)
        chunks, reason = run_stream(stub, tiny_spec(num_chunks=3), timeout=30)
        took = time.monotonic() - resumed
        assert reason == "completed" and len(chunks) == 3
        logs = "\n".join(f"[{child.name}] {line}" for child in launcher.children for line in child.log[-40:])
        assert took < 10.0, f"a new stream succeeded {took:.1f}s after SIGCONT; logs:\n{logs}"
        print(f"paused {pause}: a new stream completed {took:.2f}s after SIGCONT")
        assert stage.proc.poll() is None  # the same process (no restart by anyone)
        assert health(launcher, stage.info["address"], STAGE_HEALTH) == SERVING  # serving in the new generation
        channel.close()


def test_a_stage_paused_while_the_pipeline_forms_is_caught_in_seconds_and_rejoins_after_sigcont(checkpoint):
    with Launcher() as launcher:
        coord_args = ["coordinator", "--stages", "2", "--host", "127.0.0.1", "--port", "0", "--backend", "gloo"]
        address = launcher.spawn("coordinator", coord_args).info["address"]
        channel, stub = coordinator_stub(address, launcher)
        first = launcher.spawn("stage-0", stage_args(0, address, checkpoint, "cpu", "float32", "127.0.0.1"))
        os.kill(first.pid, signal.SIGSTOP)  # registered, then silent: its Form call will hang
        try:
            launcher.spawn("stage-1", stage_args(1, address, checkpoint, "cpu", "float32", "127.0.0.1"))
            formed_from = time.monotonic()  # stage 1 registered: the registry is complete, forming starts

            def forming_failed():
                try:
                    run_stream(stub, tiny_spec(), timeout=10)
                except grpc.RpcError as exc:
                    return exc.details() if "while forming" in exc.details() else None
                raise AssertionError("a stream was served with a paused stage")

            detail = wait_until(forming_failed, timeout=60, interval=0.2, what="forming to fail")
            caught = time.monotonic() - formed_from
        finally:
            os.kill(first.pid, signal.SIGCONT)
        assert "stage 0 stopped answering health checks while forming" in detail, detail
        wait_for_generation(address, 2, launcher, timeout=60)
        chunks, reason = run_stream(stub, tiny_spec(num_chunks=3), timeout=30)
        assert reason == "completed" and len(chunks) == 3
        assert first.proc.poll() is None  # the same process rejoined
        print(f"a stage paused while forming was caught {caught:.2f}s after forming began")
        channel.close()
