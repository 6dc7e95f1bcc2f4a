"""Helpers for tests that drive a running pipeline over gRPC."""

import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from stagecast import wire
from stagecast.grpc_util import CHANNEL_OPTIONS
from stagecast.internal.v1 import pipeline_pb2 as pb
from stagecast.internal.v1 import pipeline_pb2_grpc as pb_grpc
from stagecast.microstep import StreamSpec
from stagecast.names import COORDINATOR_SERVICE


def coordinator_stub(address, launcher):
    """An operator's channel and stub to the coordinator of a pipeline ``launcher`` started (mTLS)."""
    channel = launcher.channel(address, "coordinator", CHANNEL_OPTIONS)
    return channel, pb_grpc.CoordinatorServiceStub(channel)


def tiny_spec(num_chunks=3, policy="per_level", seed=0) -> StreamSpec:
    return StreamSpec(
        stream_id=0,
        latent_channels=16,
        chunk_frames=1,
        latent_height=8,
        latent_width=8,
        timesteps=(1000.0, 500.0),
        seed=seed,
        policy=policy,
        num_chunks=num_chunks,
        text_len=16,
    )


def open_request(spec, text_dim=32, seed=0):
    text = torch.randn(1, spec.text_len, text_dim, generator=torch.Generator().manual_seed(seed))
    return pb.OpenStreamRequest(spec=wire.spec_to_proto(spec), text=wire.tensor_to_proto(text))


def wait_for_generation(address, minimum, launcher, timeout=120.0):
    """Block until the coordinator serves a formed generation >= ``minimum`` (health Watch, no polling)."""
    with launcher.channel(address, "coordinator") as ch:
        health = health_pb2_grpc.HealthStub(ch)
        stub = pb_grpc.CoordinatorServiceStub(ch)
        watch = health.Watch(health_pb2.HealthCheckRequest(service=COORDINATOR_SERVICE), timeout=timeout)
        for resp in watch:
            if resp.status == health_pb2.HealthCheckResponse.SERVING:
                status = stub.Status(pb.Empty(), timeout=10)
                if status.ready and status.generation >= minimum:
                    watch.cancel()
                    return status
    raise TimeoutError(f"no generation >= {minimum} within {timeout}s")


def run_stream(stub, spec, timeout=120.0):
    chunks = []
    for ev in stub.OpenStream(open_request(spec), timeout=timeout):
        if ev.WhichOneof("event") == "chunk":
            chunks.append(wire.tensor_from_proto(ev.chunk.latents))
        elif ev.WhichOneof("event") == "ended":
            return chunks, ev.ended.reason
    raise AssertionError("stream ended without an end event")


def wait_until(predicate, timeout, interval=0.05, what="condition"):
    """Poll an observable state until ``predicate()`` is truthy; returns its value (TimeoutError otherwise)."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not hold within {timeout}s")
        time.sleep(interval)


def fixed_fast_stages(stages: int) -> list[str]:
    """Coordinator flags for a test system whose subject is not capacity: the SLO model keeps 1 ms stages
    (``--stage-ms``, ``--slo-fixed``) instead of measuring this loaded CPU, so paced streams are never refused as
    over capacity while the test is about something else (tests/test_capacity.py tests that refusal)."""
    return ["--stage-ms", ",".join(["1"] * stages), "--slo-fixed"]
