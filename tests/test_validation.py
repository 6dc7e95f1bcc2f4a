"""Invalid registrations, plans and stream requests get clear gRPC errors and never break a stage."""

import json
import tempfile
from pathlib import Path

import grpc
import pytest
import torch

from launcher.demo_checkpoint import write_transformer
from launcher.local_cluster import start_pipeline
from launcher.process import Launcher
from stagecast import wire
from stagecast.internal.v1 import pipeline_pb2 as pb
from stagecast.internal.v1 import pipeline_pb2_grpc as pb_grpc
from stagecast.model.config import read_config
from tests.pipeline_helpers import coordinator_stub, open_request, run_stream, tiny_spec

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def pipeline():
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "transformer"
        write_transformer(ckpt, seed=0)
        with Launcher() as launcher:
            pipe = start_pipeline(launcher, checkpoint=str(ckpt), stages=2)
            channel, stub = coordinator_stub(pipe.coordinator, launcher)
            pipe.launcher = launcher  # the operator's credentials, for channels to the stages
            yield pipe, stub, read_config(ckpt)
            channel.close()


def register(stub, index, config, address="127.0.0.1:1", expected=0):
    return stub.Register(
        pb.RegisterRequest(
            index=index, address=address, model_config_json=json.dumps(config), expected_world_size=expected
        ),
        timeout=10,
    )


def expect(code, fn, *needles):
    with pytest.raises(grpc.RpcError) as info:
        fn()
    assert info.value.code() == code, info.value.details()
    for needle in needles:
        assert needle in info.value.details()


def test_bad_registrations_are_refused_with_the_reason(pipeline):
    pipe, stub, config = pipeline
    expect(grpc.StatusCode.INVALID_ARGUMENT, lambda: register(stub, 5, config), "index 5 is out of range")
    expect(grpc.StatusCode.ALREADY_EXISTS, lambda: register(stub, 0, config), "index 0 is already registered")
    expect(
        grpc.StatusCode.FAILED_PRECONDITION, lambda: register(stub, 1, config, expected=3), "expects 3 stages", "runs 2"
    )
    other = dict(config, num_layers=6)
    expect(grpc.StatusCode.FAILED_PRECONDITION, lambda: register(stub, 1, other), "different model", "num_layers")
    # The live generation is untouched.
    assert stub.Status(pb.Empty()).ready
    chunks, reason = run_stream(stub, tiny_spec(num_chunks=2))
    assert reason == "completed" and len(chunks) == 2


def test_invalid_plans_are_rejected_and_the_stage_keeps_working(pipeline):
    pipe, stub, config = pipeline
    status = stub.Status(pb.Empty())
    gen = status.generation
    stage0 = next(s for s in status.stages if s.index == 0)
    with pipe.launcher.channel(stage0.address, "stage") as ch:
        stage = pb_grpc.StageServiceStub(ch)
        step = pb.MicroStep(stream=999, chunk=0, level=0)
        # Learn the stage's next expected seq from the out-of-order rejection, which names it.
        with pytest.raises(grpc.RpcError) as info:
            stage.Submit(pb.PlanEvent(generation=gen, seq=10**9, batch=pb.MicroBatch(steps=[step])), timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "out of order" in info.value.details()
        seq = int(info.value.details().rsplit("expected ", 1)[1])

        def submit(**kw):
            return stage.Submit(pb.PlanEvent(generation=kw.pop("generation", gen), seq=seq, **kw), timeout=10)

        expect(
            grpc.StatusCode.FAILED_PRECONDITION,
            lambda: submit(generation=gen + 7, batch=pb.MicroBatch(steps=[step])),
            f"generation {gen + 7}",
        )
        expect(grpc.StatusCode.NOT_FOUND, lambda: submit(batch=pb.MicroBatch(steps=[step])), "unknown stream 999")
        expect(grpc.StatusCode.INVALID_ARGUMENT, lambda: submit(batch=pb.MicroBatch()), "at least one micro-step")
        bad_text = wire.tensor_to_proto(torch.zeros(1, 3, 5))
        spec = wire.spec_to_proto(tiny_spec())
        spec.stream_id = 12345
        expect(
            grpc.StatusCode.INVALID_ARGUMENT,
            lambda: submit(open=pb.OpenStream(spec=spec, text=bad_text)),
            "text embeddings have shape",
        )
        spec.policy = "bogus"
        good_text = wire.tensor_to_proto(torch.zeros(1, 16, config["text_dim"]))
        expect(
            grpc.StatusCode.INVALID_ARGUMENT, lambda: submit(open=pb.OpenStream(spec=spec, text=good_text)), "policy"
        )
    chunks, reason = run_stream(stub, tiny_spec(num_chunks=2))
    assert reason == "completed" and len(chunks) == 2


def test_invalid_stream_requests_get_invalid_argument(pipeline):
    pipe, stub, config = pipeline
    req = open_request(tiny_spec())
    req.spec.latent_channels = 48
    expect(grpc.StatusCode.INVALID_ARGUMENT, lambda: list(stub.OpenStream(req, timeout=10)), "latent_channels")
    req = open_request(tiny_spec())
    req.spec.latent_height = 7
    expect(grpc.StatusCode.INVALID_ARGUMENT, lambda: list(stub.OpenStream(req, timeout=10)), "divisible")
    req = open_request(tiny_spec())
    del req.spec.timesteps[:]
    expect(grpc.StatusCode.INVALID_ARGUMENT, lambda: list(stub.OpenStream(req, timeout=10)), "timesteps")
    expect(grpc.StatusCode.NOT_FOUND, lambda: stub.StopStream(pb.StopRequest(stream_id=424242)), "unknown stream")
