"""The Grafana dashboard the Helm chart ships (helm/stagecast/dashboards/stagecast.json): valid JSON, Grafana's panel
structure, and PromQL that names only metrics the services export (their registries, built in-process here;
``tests/test_telemetry_e2e.py`` checks the same against live scrapes)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

DASHBOARD = Path(__file__).resolve().parent.parent / "helm" / "stagecast" / "dashboards" / "stagecast.json"
PANEL_TYPES = {"row", "timeseries", "stat", "bargauge", "heatmap", "gauge", "table"}
# Words of PromQL that look like metric names but are not.
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset", "and", "or", "unless"}


def promql_metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects (strings, label matchers, ranges, grouping labels and function
    names are not metric names)."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    e = re.sub(r"\{[^}]*\}", "", e)
    e = re.sub(r"\[[^\]]*\]", "", e)
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", e)
    e = re.sub(r"(?<![A-Za-z0-9_:])\d+(\.\d+)?([eE][-+]?\d+)?", "0", e)
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", e):
        if m.group(0) in KEYWORDS or e[m.end() :].lstrip().startswith("("):
            continue  # a keyword, or a function / aggregation
        names.add(m.group(0))
    return names


def dashboard_queries(dash: dict) -> list[str]:
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            m = re.fullmatch(r"\s*label_values\((.*),\s*[A-Za-z_][A-Za-z0-9_]*\s*\)\s*", query)
            exprs.append(m.group(1) if m else query)
    return exprs


def dashboard_metric_names(dash: dict) -> set[str]:
    return set().union(*(promql_metric_names(e) for e in dashboard_queries(dash)))


def family_names(families) -> set[str]:
    """Every series name a set of metric families can expose (a counter ``x``: ``x_total``, ``x_created``; ...)."""
    suffixes = {
        "counter": ("_total", "_created"),
        "histogram": ("_bucket", "_count", "_sum", "_created"),
        "summary": ("", "_count", "_sum", "_created"),
    }
    names = set()
    for fam in families:
        names.update(fam.name + s for s in suffixes.get(fam.type, ("",)))
        names.update(s.name for s in fam.samples)
    return names


def exported_metric_names() -> set[str]:
    from coordinator.metrics import CoordinatorStats, CoordinatorTelemetry
    from gateway.metrics import GatewayMetrics
    from stage_service.metrics import StageTelemetry

    stats = CoordinatorStats(
        active_streams=0,
        pending_events=0,
        batches_in_flight=0,
        lookahead=6,
        ready=False,
        generation=0,
        kv=[(0, 1 << 30, 0)],  # (stage, KV budget, reserved) of stages with a budget
        capacity=[(1, 3)],  # the SLO model's gauges are exported once it has stage times
        utilization=0.5,
    )
    coordinator = CoordinatorTelemetry()
    coordinator.bind(lambda: stats)
    registries = [
        coordinator.registry,
        StageTelemetry(0, state=lambda: None).registry,
        GatewayMetrics(active=lambda: 0, vae_bytes=lambda: 0).registry,
    ]
    return set().union(*(family_names(r.collect()) for r in registries))


@pytest.fixture(scope="module")
def dash() -> dict:
    return json.loads(DASHBOARD.read_text())


def test_promql_metric_name_extraction():
    expr = (
        'histogram_quantile(0.95, sum by (stage, le) (rate(stagecast_stage_forward_seconds_bucket{stage=~"$stage",'
        ' namespace="a:b"}[$__rate_interval]))) / clamp_min(sum(rate(x_total[5m])) by (pod), 1e-9) and on(pod) up'
    )
    assert promql_metric_names(expr) == {"stagecast_stage_forward_seconds_bucket", "x_total", "up"}


def test_dashboard_is_a_grafana_dashboard(dash):
    assert dash["title"] and dash["uid"] and isinstance(dash["schemaVersion"], int) and dash["schemaVersion"] >= 30
    variables = {v["name"] for v in dash["templating"]["list"]}
    assert {"datasource", "namespace", "stage"} <= variables
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    occupied = set()
    for p in dash["panels"]:
        assert p["type"] in PANEL_TYPES, p["type"]
        g = p["gridPos"]
        assert all(isinstance(g[k], int) for k in "hwxy") and g["x"] + g["w"] <= 24 and g["h"] > 0
        cells = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & occupied, f"panel {p['title']!r} overlaps another"
        occupied |= cells
        if p["type"] == "row":
            continue
        assert p["title"] and p["datasource"]["uid"] == "${datasource}"
        assert p["targets"], f"panel {p['title']!r} has no queries"
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs))
        for t in p["targets"]:
            assert t["expr"].strip()
            assert t["expr"].count("(") == t["expr"].count(")"), t["expr"]
            for var in re.findall(r"\$(\w+)", t["expr"]):
                assert var in variables or var.startswith("__"), f"undefined variable ${var}"


def test_dashboard_queries_name_only_exported_metrics(dash):
    exported = exported_metric_names()
    used = dashboard_metric_names(dash)
    assert used, "no metric names found in the dashboard"
    assert used <= exported, f"not exported by any service: {sorted(used - exported)}"


def test_dashboard_covers_per_stage_latency_and_pipeline_health(dash):
    used = dashboard_metric_names(dash)
    for name in (
        "stagecast_stage_forward_seconds_bucket",
        "stagecast_stage_compute_seconds_total",
        "stagecast_stage_recv_wait_seconds_total",
        "stagecast_stage_bubble_ratio",
        "stagecast_stage_queue_depth",
        "stagecast_stage_kv_cache_bytes",
        "stagecast_coordinator_batches_in_flight",
        "stagecast_coordinator_batch_latency_seconds_bucket",
        "stagecast_gateway_first_frame_seconds_bucket",
        "stagecast_gateway_stream_fps_bucket",
        "stagecast_gateway_late_frames_total",
        "stagecast_gateway_frames_dropped_total",
        "stagecast_gateway_vae_state_bytes",
    ):
        assert name in used, name
    per_stage = [t["expr"] for p in dash["panels"] for t in p.get("targets", []) if "by (stage" in t["expr"]]
    assert any("stagecast_stage_forward_seconds_bucket" in e for e in per_stage)
