"""Losing a stage mid-stream fails the affected streams promptly; a restarted stage rejoins a new generation."""

import tempfile
import time
from pathlib import Path

import grpc
import pytest

from launcher.demo_checkpoint import write_transformer
from launcher.local_cluster import start_pipeline
from launcher.process import Launcher
from stagecast.internal.v1 import pipeline_pb2 as pb
from tests.pipeline_helpers import coordinator_stub, open_request, run_stream, tiny_spec, wait_for_generation


@pytest.fixture(scope="module")
def checkpoint():
    with tempfile.TemporaryDirectory() as tmp:
        write_transformer(Path(tmp) / "transformer", seed=0)
        yield str(Path(tmp) / "transformer")


def test_sigkill_of_a_stage_fails_streams_then_a_new_generation_serves(checkpoint):
    with Launcher() as launcher:
        pipe = start_pipeline(launcher, checkpoint=checkpoint, stages=3)
        channel, stub = coordinator_stub(pipe.coordinator)
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

        launcher.spawn("stage-1-restarted", pipe.stage_args[1])
        status = wait_for_generation(pipe.coordinator, minimum=2)
        assert status.ready and status.generation >= 2
        chunks, reason = run_stream(stub, tiny_spec(num_chunks=3))
        assert reason == "completed" and len(chunks) == 3
        channel.close()
    # Leaving the launcher stopped every process it started, including re-executed survivors.
    assert all(child.proc.poll() is not None for child in [pipe.coordinator_child, *pipe.stage_children.values()])
