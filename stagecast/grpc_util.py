"""gRPC plumbing every stagecast service shares: servers with health + reflection, channel options.

Usage::

    server, health, port = make_server(port, [(add_FooServicer_to_server, servicer, "pkg.Foo")], host="10.0.0.1",
                                       credentials=mtls.server_credentials(), interceptors=[RoleGuard(rules)])
    server.start(); health.set("pkg.Foo", SERVING)
    channel = stagecast.security.connect(target, mtls, peer="coordinator", options=CHANNEL_OPTIONS)

    # A public server: bounded calls per streaming method, and health also on a server of its own.
    limits = ConcurrencyLimits({HEALTH_WATCH: 16, "/pkg.Foo/Watch": 8})
    server, health, port = make_server(port, services, interceptors=[limits], max_workers=limits.total() + 32)
    probe_server, probe_port = make_health_server(health, probe_port)
    probe = serve_health(health, "10.0.0.1", 8081)   # the same, started; port 0: None

``credentials`` None serves plaintext (tests and ``--insecure-internal``); ``stagecast.security`` makes the
credentials (mTLS, public TLS) and interceptors (``RoleGuard``, ``TokenAuth``).
"""

from __future__ import annotations

import collections
import errno
import socket
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

# A failed call's status details (google.rpc.Status) as a client reads them (status_of, retry_after_of) are the SDK's
# (stagecast_client.errors, which needs neither grpc_health nor grpc_reflection); abort_with_retry writes them.
from stagecast_client.errors import STATUS_DETAILS_KEY, retry_after_of, status_of  # noqa: F401

# Text embeddings (512 x 4096) and latent chunks exceed gRPC's 4 MiB default.
MAX_MESSAGE_BYTES = 256 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
# For a channel to a service that may restart (the coordinator): gRPC's reconnect backoff grows to 120 s, so a
# channel that saw the service down for a while would notice its return only seconds (or minutes) later.
RECONNECT_OPTIONS = [
    *CHANNEL_OPTIONS,
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
# How long a caller waits for such a channel to come back when a call found it down: past one backoff at its cap,
# so a service that is up again is reached; a service still down is reported after this, not after a call's deadline.
RECONNECT_WAIT_S = 1.5
# A server owns its port: with gRPC's default SO_REUSEPORT, a second server on a taken port starts
# "successfully" and the kernel splits the clients between two unrelated processes.
EXCLUSIVE_PORT = ("grpc.so_reuseport", 0)
SERVER_OPTIONS = [*CHANNEL_OPTIONS, EXCLUSIVE_PORT]
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
HEALTH_WATCH = "/grpc.health.v1.Health/Watch"
REFLECTION_STREAMS = (
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
    "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
)


REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"


def _add_reflection_v1(names: Sequence[str], server: grpc.Server) -> None:
    """grpc.reflection.v1 beside v1alpha (grpcio-reflection serves v1alpha only; grpcurl and Postman ask v1 first).
    The two protocols are the same messages under another package name, so v1alpha's servicer answers both."""
    from grpc_reflection.v1alpha import reflection_pb2

    servicer = reflection.ReflectionServicer(names)
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(REFLECTION_V1, {"ServerReflectionInfo": handler}),)
    )


class ConcurrencyLimits(grpc.ServerInterceptor):
    """A server interceptor that bounds the open calls of each listed streaming method: a call over its method's
    limit ends at once with RESOURCE_EXHAUSTED instead of holding one of the server's threads.

    In grpc's thread-per-call server, every open streaming call holds a thread; with every such method bounded and
    the thread pool larger than the sum of the bounds, short calls (health checks, status) always find a thread.
    """

    def __init__(self, limits: Mapping[str, int]):
        self.limits = dict(limits)
        self._open: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()

    def total(self) -> int:
        return sum(self.limits.values())

    def open_calls(self, method: str) -> int:
        with self._lock:
            return self._open[method]

    def _acquire(self, method: str) -> bool:
        with self._lock:
            if self._open[method] >= self.limits[method]:
                return False
            self._open[method] += 1
            return True

    def _release(self, method: str) -> None:
        with self._lock:
            self._open[method] -= 1

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method not in self.limits or not handler.response_streaming:
            return handler
        inner = handler.stream_stream if handler.request_streaming else handler.unary_stream
        limit = self.limits[method]

        def limited(request, context):
            if not self._acquire(method):
                context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"{method}: this server serves at most {limit} such calls at once",
                )
            try:
                yield from inner(request, context)
            finally:
                self._release(method)

        make = (
            grpc.stream_stream_rpc_method_handler if handler.request_streaming else grpc.unary_stream_rpc_method_handler
        )
        return make(
            limited, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
        )


def make_server(
    port: int,
    services: Sequence[tuple[Callable, object, str]],
    *,
    host: str = "127.0.0.1",
    max_workers: int = 32,
    options: Sequence[tuple[str, object]] = CHANNEL_OPTIONS,
    interceptors: Sequence[grpc.ServerInterceptor] = (),
    maximum_concurrent_rpcs: int | None = None,
    credentials: grpc.ServerCredentials | None = None,
) -> tuple[grpc.Server, health.HealthServicer, int]:
    """Build a server with the given servicers, grpc.health.v1 and reflection, on ``host`` only (TLS with
    ``credentials``).  Returns the bound port (useful with ``port=0``).  ``add(servicer, server)`` registers a
    servicer (a generated ``add_*_to_server`` or a function adding generic handlers).  A taken port raises
    ``AddressInUseError`` ("address already in use")."""
    check_port_free(host, port)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers),
        interceptors=list(interceptors),
        options=[*options, EXCLUSIVE_PORT],
        maximum_concurrent_rpcs=maximum_concurrent_rpcs,
    )
    health_servicer = health.HealthServicer()
    names = [reflection.SERVICE_NAME, health.SERVICE_NAME]
    for add, servicer, name in services:
        add(servicer, server)
        names.append(name)
        health_servicer.set(name, NOT_SERVING)
    health_servicer.set("", NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names.append(REFLECTION_V1)
    reflection.enable_server_reflection(names, server)
    _add_reflection_v1(names, server)
    address = _join(host, port)
    try:
        bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    except RuntimeError as exc:  # "Failed to bind to address": taken between the check and now, or not ours
        check_port_free(host, port)
        raise OSError(f"could not bind gRPC server to {address}") from exc
    if bound == 0:
        raise OSError(f"could not bind gRPC server to {address}")
    return server, health_servicer, bound


def make_health_server(
    health_servicer: health.HealthServicer, port: int, *, host: str = "127.0.0.1", max_watchers: int = 4
) -> tuple[grpc.Server, int]:
    """grpc.health.v1 alone on its own port and threads, sharing ``health_servicer``'s statuses: what liveness and
    readiness probes should call, since nothing the main server's clients do can take its threads.  Plaintext:
    probes cannot present a certificate, and it tells nothing but SERVING / NOT_SERVING.  Not started."""
    check_port_free(host, port)
    limits = ConcurrencyLimits({HEALTH_WATCH: max_watchers})
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_watchers + 4),
        interceptors=[limits],
        options=[("grpc.max_receive_message_length", 4096), EXCLUSIVE_PORT],
        maximum_concurrent_rpcs=max_watchers + 4,
    )
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    bound = server.add_insecure_port(_join(host, port))
    if bound == 0:
        raise OSError(f"could not bind the health server to {host}:{port}")
    return server, bound


class AddressInUseError(OSError):
    def __init__(self, host: str, port: int):
        super().__init__(errno.EADDRINUSE, f"{host}:{port}: address already in use")


def reconnected(channel: grpc.Channel, timeout_s: float = RECONNECT_WAIT_S) -> bool:
    """Whether ``channel`` is (again) connected within ``timeout_s``: for a call that failed UNAVAILABLE on a
    RECONNECT_OPTIONS channel, which may be waiting out a backoff while the service is already back."""
    ready = grpc.channel_ready_future(channel)
    try:
        ready.result(timeout=timeout_s)
        return True
    except grpc.FutureTimeoutError:
        return False
    finally:
        ready.cancel()


def check_port_free(host: str, port: int) -> None:
    """Raise ``AddressInUseError`` if something listens on ``host:port`` (port 0 is always free)."""
    if not port:
        return
    try:
        infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror:
        return  # the server's own bind reports an unusable host
    for family, type_, proto, _, addr in infos:
        with socket.socket(family, type_, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC does: TIME_WAIT is no owner
            try:
                sock.bind(addr)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise AddressInUseError(host, port) from None


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def serve_health(health_servicer: health.HealthServicer, host: str, port: int) -> grpc.Server | None:
    """``make_health_server`` on ``host``, started (for the services' ``--health-port``); port 0 leaves it off."""
    if not port:
        return None
    server, _ = make_health_server(health_servicer, port, host=host)
    server.start()
    return server


def set_serving(health_servicer: health.HealthServicer, names: Sequence[str], serving: bool) -> None:
    status = SERVING if serving else NOT_SERVING
    for name in ["", *names]:
        health_servicer.set(name, status)


def wait_healthy(
    target: str, timeout: float, service: str = "", channel: Callable[[], grpc.Channel] | None = None
) -> None:
    """Block until ``target`` reports SERVING (uses the health service's Watch stream, not polling).  ``channel``
    makes the channel (e.g. ``lambda: connect(target, mtls, "coordinator")``); default plaintext."""
    with channel() if channel else grpc.insecure_channel(target) as channel:
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


class StatusError(Exception):
    """An error that ends an RPC with a gRPC status code: services raise it, the handler aborts with it.

    ``raise StatusError(grpc.StatusCode.RESOURCE_EXHAUSTED, "stream limit 8 reached")``; in a handler,
    ``except StatusError as e: e.abort(context)``.
    """

    def __init__(self, code: grpc.StatusCode, message: str, retry_after_s: float = 0.0):
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s  # > 0: a google.rpc.RetryInfo delay travels in the status details

    def abort(self, context: grpc.ServicerContext):
        abort_with_retry(context, self.code, self.message, self.retry_after_s)


# A retry hint is the expected wait for the next free slot, and no hint says more than a minute: past that a client
# is better told to come back soon and be refused again (with a fresh hint) than to wait for a long stream's end.
MAX_RETRY_AFTER_S = 60.0


def abort_with_retry(
    context: grpc.ServicerContext,
    code: grpc.StatusCode,
    message: str,
    retry_after_s: float = 0.0,
    metadata: tuple[tuple[str, str], ...] = (),
):
    """Abort the call with ``code``; the status details (google.rpc.Status, gRPC's richer error model) repeat the code
    and message, and with ``retry_after_s`` > 0 carry a google.rpc.RetryInfo saying when to try again.  ``metadata``:
    more trailers.  The details outlive a proxy that resets the stream after the answer (HAProxy does, to a client
    still sending: its status reads CANCELLED): ``status_of`` reads them back."""
    from google.protobuf import any_pb2, duration_pb2
    from google.rpc import error_details_pb2, status_pb2

    status = status_pb2.Status(code=code.value[0], message=message)
    if retry_after_s > 0:
        delay = min(float(retry_after_s), MAX_RETRY_AFTER_S)
        info = error_details_pb2.RetryInfo(
            retry_delay=duration_pb2.Duration(seconds=int(delay), nanos=int((delay % 1) * 1e9))
        )
        detail = any_pb2.Any()
        detail.Pack(info)
        status.details.append(detail)
    context.set_trailing_metadata((*metadata, (STATUS_DETAILS_KEY, status.SerializeToString())))
    context.abort(code, message)
