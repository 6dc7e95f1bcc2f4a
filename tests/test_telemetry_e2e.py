"""Traces and metrics of the real system: coordinator, 2 stages and a gateway as processes on loopback, one stream
through the SDK, spans exported over OTLP/gRPC to a receiver this test runs, every /metrics endpoint scraped.

The module's fixture runs everything once: it scrapes each endpoint before the stream, in the middle (after the first
frame, while the stream is open everywhere) and after it, then stops every process with SIGTERM (each flushes its
spans on the way out) and waits, on a condition, until the receiver holds spans from every service.  The tests then
only look at what was collected.
"""

from __future__ import annotations

import json
import socket
import sys
import threading
import urllib.request
from collections import defaultdict
from concurrent import futures
from dataclasses import dataclass, field

import grpc
import pytest
from google.protobuf.json_format import MessageToDict
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

import stagecast
from launcher.cli import main as cli_main
from launcher.demo_checkpoint import write_demo_checkpoint
from launcher.local_cluster import stage_args
from launcher.process import Launcher, LaunchError
from stagecast.grpc_util import wait_healthy
from stagecast.names import COORDINATOR_SERVICE
from tests.test_dashboard import DASHBOARD, dashboard_metric_names, family_names

pytestmark = pytest.mark.multiprocess

PROMPT = "a red fox running through snow"
W, H = 48, 32
TIMEOUT = 120
STAGES = 2
STEPS = 2  # two levels: the last stage sends latents back to stage 0, so every stage receives and sends


# ---- a tiny OTLP/gRPC receiver ----------------------------------------------------------------------------------


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self):
        self.cond = threading.Condition()
        self.requests: list[trace_service_pb2.ExportTraceServiceRequest] = []
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def Export(self, request, context):
        with self.cond:
            self.requests.append(request)
            self.cond.notify_all()
        return trace_service_pb2.ExportTraceServiceResponse()

    def wait_for(self, predicate, timeout: float) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: predicate(self.spans()), timeout)

    def spans(self) -> list[Span]:
        out = []
        for req in list(self.requests):
            for rs in req.resource_spans:
                resource = {a.key: _any(a.value) for a in rs.resource.attributes}
                for ss in rs.scope_spans:
                    out.extend(Span.of(resource, s) for s in ss.spans)
        return out

    def close(self) -> None:
        self.server.stop(None)


def _any(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_any(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


@dataclass
class Span:
    service: str
    resource: dict
    name: str
    kind: int
    trace_id: bytes
    span_id: bytes
    parent_id: bytes
    attrs: dict
    links: list[tuple[bytes, bytes]] = field(default_factory=list)
    start: int = 0
    end: int = 0
    status_code: int = 0

    @classmethod
    def of(cls, resource: dict, s) -> Span:
        return cls(
            service=resource.get("service.name", ""),
            resource=resource,
            name=s.name,
            kind=s.kind,
            trace_id=s.trace_id,
            span_id=s.span_id,
            parent_id=s.parent_span_id,
            attrs={a.key: _any(a.value) for a in s.attributes},
            links=[(link.trace_id, link.span_id) for link in s.links],
            start=s.start_time_unix_nano,
            end=s.end_time_unix_nano,
            status_code=s.status.code,
        )


# ---- the run ------------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> dict[tuple[str, frozenset], float]:
    """Every sample of the endpoint, keyed by (name, labels); the key ("", names) holds every series name the
    endpoint declares (with counter and histogram suffixes), sampled or not."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    families = list(text_string_to_metric_families(text))
    samples = {(s.name, frozenset(s.labels.items())): s.value for fam in families for s in fam.samples}
    samples[("", frozenset())] = family_names(families)
    return samples


@dataclass
class Run:
    ports: dict[str, int]  # "coordinator", "stage-0", "stage-1", "gateway" -> metrics port
    before: dict[str, dict]
    during: dict[str, dict]
    after: dict[str, dict]
    spans: list[Span]
    otlp_json: str
    pipeline_id: int
    model: str


def _have_every_service(spans: list[Span]) -> bool:
    services = {s.service for s in spans}
    stages = {s.resource.get("stagecast.stage.index") for s in spans if s.service == "stagecast-stage"}
    return {"stagecast-gateway", "stagecast-coordinator", "stagecast-stage"} <= services and stages >= {0, 1}


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Run:
    root = write_demo_checkpoint(tmp_path_factory.mktemp("ckpt"))
    receiver = Receiver()
    env = {
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"http://127.0.0.1:{receiver.port}",
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
        "OTEL_TRACES_SAMPLER": "parentbased_always_on",
        "OTEL_BSP_SCHEDULE_DELAY": "200",
        "OTEL_SEMCONV_STABILITY_OPT_IN": "rpc/dup",  # both the v1.37 and the stable RPC attributes
    }
    try:
        for attempt in range(3):
            # A metrics port is picked free here and bound by its process seconds later; another process may take
            # it in between (the kernel hands out the same range for port 0), so a start that lost a port to that
            # race is made again with fresh ports.
            ports = {name: _free_port() for name in ("coordinator", "stage-0", "stage-1", "gateway")}
            try:
                launcher, address, gw = _start(root, env, ports)
                break
            except LaunchError as exc:
                if "Address already in use" not in str(exc) or attempt == 2:
                    raise
        with launcher:
            before = {name: scrape(port) for name, port in ports.items()}
            with stagecast.Client(gw.info["address"]) as client:
                gen = client.generate(PROMPT, width=W, height=H, steps=STEPS, codec="jpeg", seed=3, timeout=TIMEOUT)
                frames = iter(gen)
                next(frames)  # the stream is open on every process until we stop it
                during = {name: scrape(port) for name, port in ports.items()}
                for _ in range(8):
                    next(frames)
                gen.stop()
                for _ in frames:
                    pass
                assert gen.end.reason == "stopped"
                pipeline_id = gen.info.pipeline_stream_id
                client.wait_for_status(lambda s: s.active_streams == 0 and s.vae_state_bytes == 0, timeout=TIMEOUT)
            after = {name: scrape(port) for name, port in ports.items()}
            launcher.stop_all()  # SIGTERM: every service flushes its spans before exiting
        assert receiver.wait_for(_have_every_service, timeout=30), {s.service for s in receiver.spans()}
        otlp_json = "\n".join(json.dumps(MessageToDict(r)) for r in receiver.requests)
        yield Run(ports, before, during, after, receiver.spans(), otlp_json, pipeline_id, root.resolve().name)
    finally:
        receiver.close()


def _start(root, env, ports):
    """Coordinator, stages and gateway with the given metrics ports; the launcher stops them all on a failure."""
    launcher = Launcher(env=env)
    try:
        coord = launcher.spawn(
            "coordinator",
            ["coordinator", "--stages", str(STAGES), "--port", "0", "--metrics-port", str(ports["coordinator"])],
        )
        address = coord.info["address"]
        for i in range(STAGES):
            args = stage_args(i, address, str(root / "transformer"), "cpu", "float32", "127.0.0.1")
            launcher.spawn(f"stage-{i}", args + ["--metrics-port", str(ports[f"stage-{i}"])])
        wait_healthy(
            address, TIMEOUT, service=COORDINATOR_SERVICE, channel=lambda: launcher.channel(address, "coordinator")
        )
        gw = launcher.spawn(
            "gateway",
            ["gateway", "--coordinator", address, "--checkpoint", str(root), "--port", "0"]
            + ["--metrics-port", str(ports["gateway"])],
        )
    except BaseException:
        launcher.__exit__(*sys.exc_info())  # stops what started and removes its credentials
        raise
    return launcher, address, gw


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, frozenset((k, str(v)) for k, v in labels.items())), 0.0)


# ---- traces -------------------------------------------------------------------------------------------------


def test_trace_holds_gateway_coordinator_stage_and_vae_spans_with_parentage_links_and_attributes(run):
    spans = run.spans
    by_id = {s.span_id: s for s in spans}
    named = defaultdict(list)
    for s in spans:
        named[(s.service, s.name)].append(s)

    def one(service: str, name: str) -> Span:
        found = named[(service, name)]
        assert len(found) == 1, (service, name, len(found))
        return found[0]

    # Gateway: the RPC, the stream under it, the coordinator call under the stream.
    rpc = one("stagecast-gateway", "stagecast.v1.StreamService/Generate")
    assert rpc.kind == 2  # SERVER
    assert rpc.attrs["rpc.system"] == "grpc" and rpc.attrs["rpc.system.name"] == "grpc"
    assert rpc.attrs["rpc.service"] == "stagecast.v1.StreamService"
    assert rpc.attrs["rpc.grpc.status_code"] == 0 and rpc.attrs["rpc.response.status_code"] == "OK"
    stream = one("stagecast-gateway", f"generate_content {run.model}")
    assert stream.parent_id == rpc.span_id and stream.trace_id == rpc.trace_id
    assert stream.attrs["gen_ai.operation.name"] == "generate_content"
    assert stream.attrs["gen_ai.request.model"] == run.model
    assert stream.attrs["gen_ai.request.seed"] == 3
    assert stream.attrs["stagecast.stream.id"] == run.pipeline_id
    assert (stream.attrs["stagecast.stream.width"], stream.attrs["stagecast.stream.height"]) == (W, H)
    assert stream.attrs["stagecast.stream.steps"] == STEPS
    assert stream.attrs["stagecast.stream.outcome"] == "stopped"
    encode = named[("stagecast-gateway", "text.encode")][0]  # the prompt, encoded before the stream opens
    assert encode.parent_id == rpc.span_id and isinstance(encode.attrs["stagecast.text.cached"], bool)
    open_client = one("stagecast-gateway", "stagecast.internal.v1.CoordinatorService/OpenStream")
    assert open_client.kind == 3 and open_client.parent_id == stream.span_id  # CLIENT

    # The client's stop crossed to the coordinator too.
    stop_client = one("stagecast-gateway", "stagecast.internal.v1.CoordinatorService/StopStream")
    assert stop_client.kind == 3 and stop_client.parent_id == stream.span_id
    stop_server = one("stagecast-coordinator", "stagecast.internal.v1.CoordinatorService/StopStream")
    assert (stop_server.kind, stop_server.parent_id) == (2, stop_client.span_id)
    assert stop_server.attrs["stagecast.stream.id"] == run.pipeline_id and stop_server.attrs["rpc.method"] in (
        "StopStream",
        "stagecast.internal.v1.CoordinatorService/StopStream",
    )

    # Chunks, each with its VAE decode and frame encodes.
    chunks = named[("stagecast-gateway", "chunk")]
    assert len(chunks) >= 3
    assert all(c.parent_id == stream.span_id and c.attrs["stagecast.stream.id"] == run.pipeline_id for c in chunks)
    assert sorted(c.attrs["stagecast.chunk"] for c in chunks)[:3] == [0, 1, 2]
    chunk_ids = {c.span_id: c for c in chunks}
    decodes = named[("stagecast-gateway", "vae.decode")]
    encodes = named[("stagecast-gateway", "frame.encode")]
    assert decodes and encodes
    for s in decodes + encodes:
        assert s.parent_id in chunk_ids
        assert s.attrs["stagecast.chunk"] == chunk_ids[s.parent_id].attrs["stagecast.chunk"]
    assert {s.parent_id for s in decodes} == set(chunk_ids)  # every chunk was decoded

    # Coordinator: its side of the stream is the gateway call's child, across the process boundary.
    open_server = one("stagecast-coordinator", "stagecast.internal.v1.CoordinatorService/OpenStream")
    assert open_server.kind == 2
    assert (open_server.trace_id, open_server.parent_id) == (open_client.trace_id, open_client.span_id)
    assert open_server.attrs["stagecast.stream.id"] == run.pipeline_id
    batches = named[("stagecast-coordinator", "coordinator.batch")]
    assert batches
    for b in batches:
        assert (open_server.trace_id, open_server.span_id) in b.links  # linked to the stream it serves
        assert set(b.attrs["stagecast.stream.ids"]) == {run.pipeline_id}
        assert len(b.attrs["stagecast.chunks"]) == len(b.attrs["stagecast.levels"]) == b.attrs["stagecast.batch.size"]
    batch_ids = {b.span_id: b for b in batches}

    # Stages: each stage's batch span is the planned batch's child, linked to the stream, split into phases.
    for index in range(STAGES):
        stage_batches = [
            s for s in named[("stagecast-stage", "stage.batch")] if s.attrs["stagecast.stage.index"] == index
        ]
        assert stage_batches, f"no batch spans from stage {index}"
        assert all(s.resource["stagecast.stage.index"] == index for s in stage_batches)
        for s in stage_batches:
            parent = batch_ids[s.parent_id]
            assert s.trace_id == parent.trace_id
            assert (s.attrs["stagecast.chunks"], s.attrs["stagecast.levels"]) == (
                parent.attrs["stagecast.chunks"],
                parent.attrs["stagecast.levels"],
            )
            assert (open_server.trace_id, open_server.span_id) in s.links
            assert s.attrs["stagecast.stage.layer_start"] < s.attrs["stagecast.stage.layer_stop"]
        assert {s.parent_id for s in stage_batches} == set(batch_ids)  # every stage ran every planned batch
        ids = {s.span_id for s in stage_batches}
        phases = defaultdict(int)
        for s in spans:
            if s.parent_id in ids:
                assert s.attrs["stagecast.stage.index"] == index
                phases[s.name] += 1
        assert phases["stage.compute"] == len(stage_batches)
        assert phases["stage.recv"] > 0 and phases["stage.send"] > 0
    stage_spans = named[("stagecast-stage", "stage.batch")]
    layer_ranges = sorted(
        {(s.attrs["stagecast.stage.layer_start"], s.attrs["stagecast.stage.layer_stop"]) for s in stage_spans}
    )
    assert len(layer_ranges) == STAGES and layer_ranges[0][0] == 0 and layer_ranges[0][1] == layer_ranges[1][0]
    assert all(s.end >= s.start > 0 for s in spans)
    assert all(s.status_code != 2 for s in spans), [s.name for s in spans if s.status_code == 2]  # no ERROR
    assert by_id  # ids are unique enough to index


def test_trace_summary_of_the_exported_traces(run, tmp_path, capsys):
    path = tmp_path / "traces.jsonl"
    path.write_text(run.otlp_json)
    assert cli_main(["trace-summary", str(path)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].split() == ["stage", "span", "count", "p50", "ms", "p95", "ms", "max", "ms"]
    rows = {tuple(line.split()[:3]) for line in lines[2:]}
    for stage in range(STAGES):
        assert ("stage", str(stage), "stage.compute") in rows
    assert any(line.startswith("gateway") and "vae.decode" in line for line in lines)
    assert any(line.startswith("coordinator") and "coordinator.batch" in line for line in lines)


# ---- metrics ------------------------------------------------------------------------------------------------


def test_every_metrics_endpoint_moves_as_a_stream_runs(run):
    b, d, a = run.before, run.during, run.after
    for i in range(STAGES):
        name, stage = f"stage-{i}", {"stage": i}
        for series in (
            "stagecast_stage_forward_seconds_count",
            "stagecast_stage_batches_total",
            "stagecast_stage_micro_steps_total",
            "stagecast_stage_compute_seconds_total",
            "stagecast_stage_recv_wait_seconds_total",
            "stagecast_stage_send_seconds_total",
            "stagecast_stage_idle_seconds_total",
        ):
            assert value(a[name], series, **stage) > value(b[name], series, **stage), (name, series)
        assert value(d[name], "stagecast_stage_open_streams", **stage) == 1
        assert value(d[name], "stagecast_stage_kv_cache_bytes", **stage) > 0
        assert value(b[name], "stagecast_stage_kv_cache_bytes", **stage) == 0
        assert 0 <= value(d[name], "stagecast_stage_bubble_ratio", **stage) <= 1
        assert value(d[name], "stagecast_stage_generation", **stage) == 1
        assert ("stagecast_stage_queue_depth", frozenset({("stage", str(i))})) in d[name]
        assert value(b[name], "stagecast_stage_startup_seconds", phase="ready", **stage) > 0  # time to READY
        assert value(b[name], "stagecast_stage_startup_seconds", phase="load", **stage) > 0

    c = "coordinator"
    for series in (
        "stagecast_coordinator_batches_planned_total",
        "stagecast_coordinator_micro_steps_planned_total",
        "stagecast_coordinator_chunks_routed_total",
        "stagecast_coordinator_streams_opened_total",
        "stagecast_coordinator_batch_latency_seconds_count",
        "stagecast_coordinator_batch_size_count",
    ):
        assert value(a[c], series) > value(b[c], series), series
    assert value(a[c], "stagecast_coordinator_streams_ended_total", reason="stopped") == 1
    assert value(d[c], "stagecast_coordinator_active_streams") == 1
    assert value(a[c], "stagecast_coordinator_ready") == 1
    assert value(d[c], "stagecast_coordinator_lookahead_batches") > 0
    assert ("stagecast_coordinator_stage_outbox_depth", frozenset({("stage", "1")})) in d[c]

    g = "gateway"
    for series in (
        "stagecast_gateway_frames_total",
        "stagecast_gateway_chunks_received_total",
        "stagecast_gateway_first_frame_seconds_count",
        "stagecast_gateway_chunk_decode_seconds_count",
        "stagecast_gateway_frame_encode_seconds_count",
        "stagecast_gateway_stream_fps_count",
    ):
        assert value(a[g], series) > value(b[g], series), series
    encoded = sum(value(a[g], "stagecast_gateway_prompt_encode_seconds_count", cached=c) for c in ("true", "false"))
    assert encoded >= 1
    assert value(a[g], "stagecast_gateway_streams_ended_total", reason="stopped") == 1
    assert value(d[g], "stagecast_gateway_active_streams") == 1
    assert value(d[g], "stagecast_gateway_vae_state_bytes") > 0
    assert value(a[g], "stagecast_gateway_active_streams") == 0
    assert value(a[g], "stagecast_gateway_frames_total") >= 9
    late, frames = value(a[g], "stagecast_gateway_late_frames_total"), value(a[g], "stagecast_gateway_frames_total")
    assert 0 <= late <= frames


def test_dashboard_queries_name_only_metrics_the_live_services_export(run):
    exported = set().union(*(samples[("", frozenset())] for samples in run.after.values()))
    used = dashboard_metric_names(json.loads(DASHBOARD.read_text()))
    assert used <= exported, f"not exported by any running service: {sorted(used - exported)}"
