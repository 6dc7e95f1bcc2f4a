"""Tracing (OpenTelemetry) and the Prometheus endpoint every stagecast service shares.

Usage (each service's ``serve()`` does this)::

    from stagecast import telemetry

    telemetry.init("stage", {"stagecast.stage.index": 1})  # reads only OTEL_* variables; no-op when off
    metrics = telemetry.serve_metrics(9100, registry)        # /metrics; port 0 leaves it off
    ...
    metrics.close(); telemetry.shutdown()                    # flushes queued spans (serve()'s stop path)

    span = telemetry.tracer().start_span("stage.batch", context=telemetry.context_from_traceparent(tp))
    ev.traceparent = telemetry.traceparent_of(span)          # "" when the span is not sampled

Configuration is the standard OpenTelemetry environment and nothing else:

* ``OTEL_SDK_DISABLED=true`` or ``OTEL_TRACES_EXPORTER=none``: tracing off.  Tracing is also off unless an exporter is
  asked for, by ``OTEL_TRACES_EXPORTER`` (``otlp`` or ``console``) or an OTLP endpoint
  (``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_ENDPOINT``), so a laptop run never tries to reach a
  collector on localhost:4317.  When off, no SDK object exists: ``enabled()`` is False, ``tracer()`` is the API's
  no-op tracer, and the services skip span bookkeeping on their hot paths.
* ``OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL``: ``grpc`` (default; ``opentelemetry-exporter-otlp-proto-grpc``) or
  ``http/protobuf`` when ``opentelemetry-exporter-otlp-proto-http`` is installed.  Endpoint, headers, timeout,
  insecure and compression are read by the exporter itself; ``OTEL_BSP_*`` by the ``BatchSpanProcessor``.
* ``OTEL_TRACES_SAMPLER`` / ``OTEL_TRACES_SAMPLER_ARG`` (default ``parentbased_always_on``).  Wrapped so that a root
  span with links (the coordinator's batch span, which serves several streams) is sampled exactly when one of the
  streams it links to is, so a sampled stream's trace always has its batches and stage spans.
* ``OTEL_SERVICE_NAME`` / ``OTEL_RESOURCE_ATTRIBUTES``; without a service name the service is ``stagecast-<component>``
  (what the Helm chart sets).  ``stagecast.component`` (and ``stagecast.stage.index`` on stages) are added.
* ``OTEL_PROPAGATORS`` (default ``tracecontext,baggage``) for gRPC metadata.  Plan events and ``OpenStreamRequest``
  carry a W3C ``traceparent`` string field as well.

Semantic conventions, chosen deliberately:

* RPC spans (``rpc.server``/``rpc.client``, named ``<package.Service>/<Method>``) emit by default the RPC attributes
  of semantic conventions v1.37.0 and earlier: ``rpc.system="grpc"``, ``rpc.service``, ``rpc.method`` (the bare
  method), ``rpc.grpc.status_code`` (int), ``server.address``/``server.port``.  Those are what
  ``opentelemetry-instrumentation-grpc`` and today's backends (service graphs, RPC views) read, so our spans line
  up with every other gRPC span in a trace.  The RPC conventions were reworked and declared stable in v1.45.0
  (``rpc.system.name``, fully qualified ``rpc.method``, string ``rpc.response.status_code``, ``error.type``); as
  the conventions' migration guide prescribes, ``OTEL_SEMCONV_STABILITY_OPT_IN=rpc`` switches to those and
  ``rpc/dup`` emits both (``rpc.method``, a key both versions use, then holds the stable, fully qualified value).
* The gateway's stream span follows the GenAI conventions (development status): name
  ``generate_content <model>``, ``gen_ai.operation.name="generate_content"``, ``gen_ai.provider.name="stagecast"``,
  ``gen_ai.request.model``, ``gen_ai.request.seed``, ``gen_ai.output.type="video"`` (a custom value), plus the
  stream config under ``stagecast.stream.*``.
* Everything else is ``stagecast.*``: ``stagecast.stream.id`` (the pipeline's int stream id, the same in every
  process), ``stagecast.chunk``, ``stagecast.level``, ``stagecast.stage.index``, ``stagecast.stage.layer_start`` /
  ``layer_stop``, and on batch spans the parallel int arrays ``stagecast.stream.ids``, ``stagecast.chunks``,
  ``stagecast.levels`` (one entry per micro-step).

Span tree: gateway ``stagecast.v1.StreamService/Generate`` (server) -> ``generate_content <model>`` (the stream)
-> ``stagecast.internal.v1.CoordinatorService/OpenStream`` (client) -> coordinator ``.../OpenStream`` (server, the
coordinator's stream span); ``StopStream`` / ``UpdatePrompt`` calls likewise (client span under the stream, server
span under it); the stream span also parents ``chunk`` -> ``vae.decode``, ``frame.encode`` (one per frame).  Batches
are planned ahead and shared by streams, so each ``coordinator.batch`` is a root span (plan to last-stage done)
LINKED to the coordinator stream spans it serves; its context travels in ``PlanEvent.traceparent`` and every
stage's ``stage.batch`` is its child (links to the same streams), split into ``stage.recv`` (waiting for the
previous stage or the latents), ``stage.compute`` and ``stage.send`` (host time: on CUDA, compute is launch time;
``stagecast_stage_forward_seconds`` has the GPU time from CUDA events).  The control-plane calls around it
(``Submit``, ``Results``, ``Form``, health checks) get no spans of their own: they are off the critical path, and a
span per plan event per stage would double the volume for nothing the batch spans do not already show.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager

import grpc
from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.trace import Link, NonRecordingSpan, Span, SpanContext, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

logger = logging.getLogger(__name__)

_W3C = TraceContextTextMapPropagator()
_NOOP_TRACER = trace.NoOpTracer()
_lock = threading.Lock()
_provider = None  # the SDK TracerProvider while tracing is on
_tracer: trace.Tracer = _NOOP_TRACER
_component = ""

# ---- setup ---------------------------------------------------------------------------------------------


def _env(name: str) -> str:
    return os.environ.get(name, "").strip()


def _exporter_wanted() -> str | None:
    """Which exporter the OTEL_* environment asks for: "otlp", "console" or None (tracing off)."""
    if _env("OTEL_SDK_DISABLED").lower() == "true":
        return None
    names = [n.strip().lower() for n in _env("OTEL_TRACES_EXPORTER").split(",") if n.strip()]
    if "none" in names:
        return None
    if "otlp" in names:
        return "otlp"
    if "console" in names:
        return "console"
    if names:
        logger.warning("OTEL_TRACES_EXPORTER=%s: only otlp, console and none are supported; tracing is off", names)
        return None
    if _env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or _env("OTEL_EXPORTER_OTLP_ENDPOINT"):
        return "otlp"
    return None


def _make_exporter(kind: str):
    if kind == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    protocol = (_env("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or _env("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc").lower()
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter()
    if protocol == "http/protobuf":
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HTTPExporter
        except ImportError:
            logger.error("OTLP protocol http/protobuf needs opentelemetry-exporter-otlp-proto-http; tracing is off")
            return None
        return HTTPExporter()
    logger.error("OTLP protocol %r is not supported (grpc, http/protobuf); tracing is off", protocol)
    return None


class LinkAwareSampler:
    """The configured sampler, except for root spans with links: those follow their links (any sampled -> sampled).

    The coordinator's batch span is a root (it serves several streams) linked to the streams' spans; sampling it
    by its own trace id would leave sampled streams without their batches and vice versa."""

    def __init__(self, base):
        self.base = base

    def should_sample(self, parent_context, trace_id, name, kind=None, attributes=None, links=None, trace_state=None):
        from opentelemetry.sdk.trace.sampling import Decision, SamplingResult

        parent = trace.get_current_span(parent_context).get_span_context()
        if not parent.is_valid and links:
            sampled = any(link.context.trace_flags.sampled for link in links)
            decision = Decision.RECORD_AND_SAMPLE if sampled else Decision.DROP
            return SamplingResult(decision, attributes if sampled else None, trace_state)
        return self.base.should_sample(parent_context, trace_id, name, kind, attributes, links, trace_state)

    def get_description(self) -> str:
        return f"LinkAware{{{self.base.get_description()}}}"


def init(component: str, attributes: Mapping[str, object] | None = None) -> bool:
    """Set up tracing for this process from the OTEL_* environment.  Returns whether tracing is on.

    Idempotent: a second call while tracing is on keeps the first setup."""
    global _provider, _tracer, _component
    with _lock:
        if _provider is not None:
            return True
        kind = _exporter_wanted()
        if kind is None:
            return False
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        exporter = _make_exporter(kind)
        if exporter is None:
            return False
        resource = Resource.create({"stagecast.component": component, **(attributes or {})})
        if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
            resource = resource.merge(Resource({SERVICE_NAME: f"stagecast-{component}"}))
        # TracerProvider() reads OTEL_TRACES_SAMPLER(_ARG); wrap what it chose.
        base = TracerProvider(resource=resource, shutdown_on_exit=False).sampler
        provider = TracerProvider(resource=resource, sampler=LinkAwareSampler(base), shutdown_on_exit=False)
        provider.add_span_processor(BatchSpanProcessor(exporter))
        _provider = provider
        _component = component
        _tracer = provider.get_tracer("stagecast")
        logger.info(
            "tracing on: service %s, exporter %s, sampler %s",
            resource.attributes.get(SERVICE_NAME),
            kind,
            provider.sampler.get_description(),
        )
        return True


def enabled() -> bool:
    return _provider is not None


def tracer() -> trace.Tracer:
    return _tracer


def force_flush(timeout_s: float = 5.0) -> None:
    provider = _provider
    if provider is not None:
        provider.force_flush(int(timeout_s * 1000))


def shutdown(timeout_s: float = 5.0) -> None:
    """Export every span still queued and stop tracing (called on the services' stop path: SIGTERM, exit)."""
    global _provider, _tracer
    with _lock:
        provider, _provider, _tracer = _provider, None, _NOOP_TRACER
    if provider is not None:
        provider.force_flush(int(timeout_s * 1000))
        provider.shutdown()


# ---- propagation ---------------------------------------------------------------------------------------


def traceparent_of(span: Span | None) -> str:
    """The W3C traceparent of ``span``; "" when there is nothing worth propagating (no span, or not sampled)."""
    if span is None:
        return ""
    sc = span.get_span_context()
    if not sc.is_valid or not sc.trace_flags.sampled:
        return ""
    carrier: dict[str, str] = {}
    _W3C.inject(carrier, context=trace.set_span_in_context(span))
    return carrier.get("traceparent", "")


def span_context_from_traceparent(traceparent: str) -> SpanContext | None:
    if not traceparent:
        return None
    sc = trace.get_current_span(_W3C.extract({"traceparent": traceparent})).get_span_context()
    return sc if sc.is_valid else None


def context_from_traceparent(traceparent: str) -> Context | None:
    sc = span_context_from_traceparent(traceparent)
    return None if sc is None else trace.set_span_in_context(NonRecordingSpan(sc))


def links_to(traceparents: Iterable[str]) -> list[Link]:
    links, seen = [], set()
    for tp in traceparents:
        sc = span_context_from_traceparent(tp)
        if sc is not None and (sc.trace_id, sc.span_id) not in seen:
            seen.add((sc.trace_id, sc.span_id))
            links.append(Link(sc))
    return links


def metadata_for(span: Span | None) -> list[tuple[str, str]]:
    """gRPC metadata carrying ``span``'s context (OTEL_PROPAGATORS; W3C tracecontext by default)."""
    if span is None or not span.get_span_context().is_valid:
        return []
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(span))
    return list(carrier.items())


def context_from_metadata(grpc_context, fallback_traceparent: str = "") -> Context | None:
    """The caller's span context from a servicer's ``context`` metadata, else from a ``traceparent`` field."""
    carrier = {k.lower(): v for k, v in (grpc_context.invocation_metadata() or ()) if isinstance(v, str)}
    if "traceparent" in carrier:
        ctx = propagate.extract(carrier)
        if trace.get_current_span(ctx).get_span_context().is_valid:
            return ctx
    return context_from_traceparent(fallback_traceparent)


# ---- RPC semantic conventions ------------------------------------------------------------------------------


def _semconv_mode() -> tuple[bool, bool]:
    """(emit the v1.37 attributes, emit the stable v1.45 attributes) from OTEL_SEMCONV_STABILITY_OPT_IN."""
    values = {v.strip().lower() for v in _env("OTEL_SEMCONV_STABILITY_OPT_IN").split(",")}
    if "rpc/dup" in values:
        return True, True
    if "rpc" in values:
        return False, True
    return True, False


def rpc_attributes(full_method: str, target: str | None = None) -> dict[str, object]:
    """Attributes of a gRPC span for ``full_method`` ("pkg.Service/Method") served at ``target`` ("host:port")."""
    service, _, method = full_method.rpartition("/")
    old, new = _semconv_mode()
    attrs: dict[str, object] = {}
    if old:
        attrs.update({"rpc.system": "grpc", "rpc.service": service, "rpc.method": method})
    if new:
        attrs.update({"rpc.system.name": "grpc", "rpc.method": full_method})
    if target:
        host, _, port = target.rpartition(":")
        if host and port.isdigit():
            attrs.update({"server.address": host.strip("[]"), "server.port": int(port)})
        else:
            attrs["server.address"] = target
    return attrs


def start_rpc_span(full_method: str, kind: SpanKind, *, context: Context | None = None, target: str | None = None):
    """A gRPC client or server span named ``full_method``; end it with ``end_rpc_span``."""
    return _tracer.start_span(full_method, context=context, kind=kind, attributes=rpc_attributes(full_method, target))


# gRPC status codes a server span counts as errors (semantic conventions: the client's side counts every non-OK).
_SERVER_ERRORS = {"UNKNOWN", "DEADLINE_EXCEEDED", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS"}


def end_rpc_span(span: Span | None, code, message: str = "") -> None:
    """Record the call's gRPC status (a ``grpc.StatusCode``) on ``span`` and end it."""
    if span is None:
        return
    old, new = _semconv_mode()
    name = code.name
    if old:
        span.set_attribute("rpc.grpc.status_code", int(code.value[0]))
    if new:
        span.set_attribute("rpc.response.status_code", name)
    is_server = getattr(span, "kind", None) == SpanKind.SERVER
    if name != "OK" and (not is_server or name in _SERVER_ERRORS):
        if new:
            span.set_attribute("error.type", name)
        span.set_status(Status(StatusCode.ERROR, message or name))
    span.end()


@contextmanager
def server_span(
    full_method: str, grpc_context, *, target: str | None = None, traceparent: str = "", only_child: bool = False
) -> Iterator[Span | None]:
    """A gRPC server span around a handler (unary, or a streaming generator's whole life); None when tracing is off.

    The caller's context comes from the call's metadata, else from ``traceparent`` (a request field).  With
    ``only_child`` a call that carries no context gets no span.  The status is what the handler aborted with;
    a streaming handler closed early (the client went away) records CANCELLED."""
    if _provider is None:
        yield None
        return
    parent = context_from_metadata(grpc_context, traceparent)
    if parent is None and only_child:
        yield None
        return
    span = start_rpc_span(full_method, SpanKind.SERVER, context=parent, target=target)
    code = None
    try:
        yield span
    except GeneratorExit:
        code = grpc.StatusCode.CANCELLED
        raise
    except BaseException:
        code = _context_code(grpc_context) or grpc.StatusCode.UNKNOWN
        raise
    finally:
        end_rpc_span(span, code or _context_code(grpc_context) or grpc.StatusCode.OK)


def _context_code(grpc_context):
    try:
        return grpc_context.code()
    except Exception:  # noqa: BLE001 - not every context implements code()
        return None


# ---- Prometheus ----------------------------------------------------------------------------------------


class MetricsServer:
    """A running /metrics endpoint (or nothing, for port 0)."""

    def __init__(self, httpd=None, thread=None):
        self.httpd = httpd
        self.thread = thread

    @property
    def port(self) -> int:
        return self.httpd.server_port if self.httpd is not None else 0

    def close(self) -> None:
        if self.httpd is not None:
            self.httpd.shutdown()
            self.httpd.server_close()
            self.httpd = None


def serve_metrics(port: int, registry, host: str = "127.0.0.1", what: str = "metrics") -> MetricsServer:
    """Serve ``registry`` on http://host:port/metrics; port 0 leaves it off."""
    if not port:
        return MetricsServer()
    from prometheus_client import start_http_server

    httpd, thread = start_http_server(port, addr=host, registry=registry)
    logger.info("%s on %s:%d/metrics", what, host, port)
    return MetricsServer(httpd, thread)


def batch_attributes(steps: Sequence) -> dict[str, object]:
    """``stagecast.stream.ids`` / ``chunks`` / ``levels`` of a batch of ``MicroStep``s (parallel arrays)."""
    return {
        "stagecast.batch.size": len(steps),
        "stagecast.stream.ids": [int(s.stream) for s in steps],
        "stagecast.chunks": [int(s.chunk) for s in steps],
        "stagecast.levels": [int(s.level) for s in steps],
    }
