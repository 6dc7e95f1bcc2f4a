"""stagecast.telemetry in-process (configuration from OTEL_* only, propagation, the RPC semantic conventions, the
link-aware sampler) and ``stagecast trace-summary`` on a small hand-written OTLP JSON file."""

from __future__ import annotations

import json

import grpc
import pytest
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, Decision
from opentelemetry.trace import Link, SpanContext, TraceFlags

from launcher.cli import main as cli_main
from stagecast import telemetry
from stagecast.trace_summary import load, summarize

pytestmark = pytest.mark.unit

OTEL_VARS = (
    "OTEL_SDK_DISABLED",
    "OTEL_TRACES_EXPORTER",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_PROTOCOL",
    "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
    "OTEL_SERVICE_NAME",
    "OTEL_RESOURCE_ATTRIBUTES",
    "OTEL_TRACES_SAMPLER",
    "OTEL_TRACES_SAMPLER_ARG",
    "OTEL_SEMCONV_STABILITY_OPT_IN",
)


@pytest.fixture
def env(monkeypatch):
    for name in OTEL_VARS:
        monkeypatch.delenv(name, raising=False)
    telemetry.shutdown()
    yield monkeypatch
    telemetry.shutdown()


# ---- configuration ---------------------------------------------------------------------------------------


def test_tracing_is_off_unless_an_exporter_is_configured(env):
    assert telemetry.init("gateway") is False and not telemetry.enabled()
    assert not telemetry.tracer().start_span("x").get_span_context().is_valid  # the API's no-op tracer


@pytest.mark.parametrize(
    "settings",
    [
        {"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317"},
        {"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317"},
        {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"},
    ],
)
def test_disabled_or_unsupported_settings_leave_tracing_off(env, settings):
    for k, v in settings.items():
        env.setenv(k, v)
    assert telemetry.init("coordinator") is False and not telemetry.enabled()


def test_otlp_endpoint_turns_tracing_on_with_a_default_service_name_and_sampler(env):
    env.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://127.0.0.1:1")  # nothing listens: spans are dropped
    env.setenv("OTEL_TRACES_SAMPLER", "always_off")
    assert telemetry.init("stage", {"stagecast.stage.index": 2}) is True and telemetry.enabled()
    span = telemetry.tracer().start_span("stage.batch")
    assert span.get_span_context().is_valid  # an SDK span...
    assert not span.get_span_context().trace_flags.sampled  # ...that OTEL_TRACES_SAMPLER=always_off dropped
    provider = telemetry._provider
    assert provider.resource.attributes["service.name"] == "stagecast-stage"
    assert provider.resource.attributes["stagecast.stage.index"] == 2
    assert provider.sampler.get_description().startswith("LinkAware")


def test_otel_service_name_wins_over_the_default(env):
    env.setenv("OTEL_TRACES_EXPORTER", "console")
    env.setenv("OTEL_SERVICE_NAME", "my-gateway")
    env.setenv("OTEL_RESOURCE_ATTRIBUTES", "k8s.pod.name=gw-0")
    assert telemetry.init("gateway")
    attrs = telemetry._provider.resource.attributes
    assert (attrs["service.name"], attrs["k8s.pod.name"], attrs["stagecast.component"]) == (
        "my-gateway",
        "gw-0",
        "gateway",
    )


# ---- propagation and sampling ------------------------------------------------------------------------------


def _context(sampled: bool) -> SpanContext:
    flags = TraceFlags(TraceFlags.SAMPLED if sampled else TraceFlags.DEFAULT)
    return SpanContext(0x1234, 0x99, is_remote=True, trace_flags=flags)


def test_traceparent_round_trip_and_links(env):
    env.setenv("OTEL_TRACES_EXPORTER", "console")
    telemetry.init("coordinator")
    span = telemetry.tracer().start_span("coordinator.batch")
    tp = telemetry.traceparent_of(span)
    assert tp.startswith("00-") and int(tp[-2:], 16) & 1  # W3C, sampled
    sc = telemetry.span_context_from_traceparent(tp)
    assert (sc.trace_id, sc.span_id) == (span.get_span_context().trace_id, span.get_span_context().span_id)
    child = telemetry.tracer().start_span("stage.batch", context=telemetry.context_from_traceparent(tp))
    assert child.parent.span_id == span.get_span_context().span_id
    assert [link.context.span_id for link in telemetry.links_to([tp, tp, "", "garbage"])] == [sc.span_id]
    assert telemetry.traceparent_of(None) == "" and telemetry.context_from_traceparent("") is None
    metadata = dict(telemetry.metadata_for(span))
    assert metadata["traceparent"] == tp

    class Ctx:
        def invocation_metadata(self):
            return tuple(metadata.items())

    assert telemetry.context_from_metadata(Ctx()) is not None


def test_link_aware_sampler_follows_the_links_of_root_spans():
    sampler = telemetry.LinkAwareSampler(ALWAYS_OFF)
    sampled = sampler.should_sample(None, 1, "coordinator.batch", links=[Link(_context(False)), Link(_context(True))])
    assert sampled.decision == Decision.RECORD_AND_SAMPLE
    dropped = sampler.should_sample(None, 1, "coordinator.batch", links=[Link(_context(False))])
    assert dropped.decision == Decision.DROP
    assert sampler.should_sample(None, 1, "no links").decision == Decision.DROP  # the configured sampler decides


# ---- RPC semantic conventions ------------------------------------------------------------------------------


def test_rpc_attributes_default_to_the_v1_37_conventions(env):
    attrs = telemetry.rpc_attributes("stagecast.v1.StreamService/Generate", "10.0.0.5:50051")
    assert attrs == {
        "rpc.system": "grpc",
        "rpc.service": "stagecast.v1.StreamService",
        "rpc.method": "Generate",
        "server.address": "10.0.0.5",
        "server.port": 50051,
    }


def test_rpc_attributes_opt_in_to_the_stable_conventions(env):
    env.setenv("OTEL_SEMCONV_STABILITY_OPT_IN", "http,rpc")
    attrs = telemetry.rpc_attributes("stagecast.v1.StreamService/Generate", "gw:50051")
    assert attrs["rpc.system.name"] == "grpc" and attrs["rpc.method"] == "stagecast.v1.StreamService/Generate"
    assert "rpc.system" not in attrs and "rpc.service" not in attrs
    env.setenv("OTEL_SEMCONV_STABILITY_OPT_IN", "rpc/dup")
    attrs = telemetry.rpc_attributes("stagecast.v1.StreamService/Generate")
    assert attrs["rpc.system"] == attrs["rpc.system.name"] == "grpc" and "server.address" not in attrs


def test_rpc_status_codes_and_errors(env):
    env.setenv("OTEL_TRACES_EXPORTER", "console")
    env.setenv("OTEL_SEMCONV_STABILITY_OPT_IN", "rpc/dup")
    telemetry.init("gateway")
    from opentelemetry.trace import SpanKind, StatusCode

    method = "stagecast.internal.v1.CoordinatorService/OpenStream"
    client = telemetry.start_rpc_span(method, SpanKind.CLIENT)
    telemetry.end_rpc_span(client, grpc.StatusCode.NOT_FOUND, "unknown stream")
    assert (
        client.attributes["rpc.grpc.status_code"] == 5 and client.attributes["rpc.response.status_code"] == "NOT_FOUND"
    )
    assert client.status.status_code == StatusCode.ERROR and client.attributes["error.type"] == "NOT_FOUND"
    server = telemetry.start_rpc_span(method, SpanKind.SERVER)
    telemetry.end_rpc_span(server, grpc.StatusCode.NOT_FOUND)  # a client error is not the server's
    assert server.status.status_code == StatusCode.UNSET and "error.type" not in server.attributes
    server = telemetry.start_rpc_span(method, SpanKind.SERVER)
    telemetry.end_rpc_span(server, grpc.StatusCode.UNAVAILABLE)
    assert server.status.status_code == StatusCode.ERROR


# ---- trace-summary -------------------------------------------------------------------------------------------


def _span(name: str, start_ms: float, dur_ms: float, **attrs) -> dict:
    values = [{"key": k, "value": {"intValue": str(v)}} for k, v in attrs.items()]
    return {
        "traceId": "5b8efff798038103d269b633813fc60c",
        "spanId": "eee19b7ec3c1b174",
        "name": name,
        "kind": 1,
        "startTimeUnixNano": str(int(start_ms * 1e6)),
        "endTimeUnixNano": str(int((start_ms + dur_ms) * 1e6)),
        "attributes": values,
    }


def _resource(**attrs) -> dict:
    return {"attributes": [{"key": k, "value": {"stringValue": v}} for k, v in attrs.items()]}


def _request() -> dict:
    stage_spans = [
        _span("stage.compute", 10 * i, d, **{"stagecast.stage.index": 0}) for i, d in enumerate(range(1, 21))
    ]
    stage_spans += [_span("stage.compute", 0, 7, **{"stagecast.stage.index": 1})]
    return {
        "resourceSpans": [
            {
                "resource": _resource(**{"service.name": "stagecast-stage"}),
                "scopeSpans": [{"scope": {"name": "stagecast"}, "spans": stage_spans}],
            },
            {
                "resource": _resource(**{"service.name": "stagecast-gateway", "stagecast.component": "gateway"}),
                "scopeSpans": [{"spans": [_span("vae.decode", 0, 3), _span("vae.decode", 5, 5)]}],
            },
        ]
    }


def test_trace_summary_groups_by_stage_with_nearest_rank_percentiles(tmp_path, capsys):
    path = tmp_path / "traces.json"
    path.write_text(json.dumps(_request()))
    rows = {(r.group, r.name): r for r in summarize(load(str(path)))}
    stage0 = rows[("stage 0", "stage.compute")]
    assert (stage0.count, stage0.p50_ms, stage0.p95_ms, stage0.max_ms) == (20, 10.0, 19.0, 20.0)
    assert rows[("stage 1", "stage.compute")].count == 1
    decode = rows[("gateway", "vae.decode")]
    assert (decode.count, decode.p50_ms, decode.max_ms) == (2, 3.0, 5.0)

    assert cli_main(["trace-summary", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["stage", "span", "count", "p50", "ms", "p95", "ms", "max", "ms"]
    assert [line.split() for line in lines[2:]] == [
        ["gateway", "vae.decode", "2", "3.000", "5.000", "5.000"],
        ["stage", "0", "stage.compute", "20", "10.000", "19.000", "20.000"],
        ["stage", "1", "stage.compute", "1", "7.000", "7.000", "7.000"],
    ]


def test_trace_summary_reads_one_request_per_line_and_groups_by_service(tmp_path, capsys):
    path = tmp_path / "traces.jsonl"
    path.write_text(json.dumps(_request()) + "\n" + json.dumps(_request()) + "\n")
    assert cli_main(["trace-summary", str(path), "--by", "service"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    assert ["gateway", "vae.decode", "4", "3.000", "5.000", "5.000"] in rows
    assert ["stagecast-stage", "stage.compute", "42", "10.000", "19.000", "20.000"] in rows


def test_trace_summary_fails_clearly_on_an_empty_or_missing_file(tmp_path, capsys):
    empty = tmp_path / "empty.json"
    empty.write_text("")
    assert cli_main(["trace-summary", str(empty)]) == 1
    assert cli_main(["trace-summary", str(tmp_path / "missing.json")]) == 1
    assert "cannot read" in capsys.readouterr().err
