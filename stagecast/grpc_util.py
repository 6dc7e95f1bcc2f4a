"""gRPC plumbing every stagecast service shares: servers with health + reflection, channel options.

Usage::

    server, health = make_server(port, [(add_FooServicer_to_server, servicer, "pkg.Foo")], host="0.0.0.0")
    server.start(); health.set("pkg.Foo", SERVING)
    channel = grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

# Text embeddings (512 x 4096) and latent chunks exceed gRPC's 4 MiB default.
MAX_MESSAGE_BYTES = 256 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def make_server(
    port: int,
    services: Sequence[tuple[Callable, object, str]],
    *,
    host: str = "127.0.0.1",
    max_workers: int = 32,
) -> tuple[grpc.Server, health.HealthServicer, int]:
    """Build a server with the given servicers, grpc.health.v1 and reflection.  Returns the bound port
    (useful with ``port=0``)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), options=CHANNEL_OPTIONS)
    health_servicer = health.HealthServicer()
    names = [reflection.SERVICE_NAME, health.SERVICE_NAME]
    for add, servicer, name in services:
        add(servicer, server)
        names.append(name)
        health_servicer.set(name, NOT_SERVING)
    health_servicer.set("", NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(names, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"could not bind gRPC server to {host}:{port}")
    return server, health_servicer, bound


def set_serving(health_servicer: health.HealthServicer, names: Sequence[str], serving: bool) -> None:
    status = SERVING if serving else NOT_SERVING
    for name in ["", *names]:
        health_servicer.set(name, status)


def wait_healthy(target: str, timeout: float, service: str = "") -> None:
    """Block until ``target`` reports SERVING (uses the health service's Watch stream, not polling)."""
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            for resp in stub.Watch(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout, wait_for_ready=True
            ):
                if resp.status == SERVING:
                    return
        except grpc.RpcError as exc:
            raise TimeoutError(f"{target} did not become healthy within {timeout}s: {exc.code().name}") from exc
        raise TimeoutError(f"{target} health stream ended before SERVING")
