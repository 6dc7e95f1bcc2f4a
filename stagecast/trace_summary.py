"""``stagecast trace-summary FILE``: a per-stage latency table of the spans in an OTLP JSON trace file.

Usage::

    stagecast trace-summary traces.json            # group by stage (stage spans) or service (the others)
    stagecast trace-summary traces.json --by service

    rows = summarize(load(path)); print(format_table(rows))

The file is the OTLP/JSON encoding of ``ExportTraceServiceRequest`` (``resourceSpans`` -> ``scopeSpans`` -> ``spans``),
as an OpenTelemetry Collector's file exporter writes it: one request per file, or one per line.  The proto field
names (``resource_spans``, ``start_time_unix_nano``, ...) are accepted too.  A span belongs to stage N when it or
its resource has ``stagecast.stage.index`` = N; other spans are grouped by ``stagecast.component`` (else
``service.name``).  Percentiles are nearest-rank over each (group, span name)'s durations, in milliseconds.
"""

from __future__ import annotations

import json
import math
import sys
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from stagecast.flags import HelpFormatter


@dataclass(frozen=True)
class Row:
    group: str
    name: str
    count: int
    p50_ms: float
    p95_ms: float
    max_ms: float


def load(path: str) -> list[dict]:
    """The ExportTraceServiceRequest documents in ``path`` ("-" for stdin)."""
    text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    text = text.strip()
    if not text:
        return []
    try:
        doc = json.loads(text)
        return doc if isinstance(doc, list) else [doc]
    except json.JSONDecodeError:
        return [json.loads(line) for line in text.splitlines() if line.strip()]


def _get(d: dict, camel: str, snake: str, default=None):
    return d.get(camel, d.get(snake, default))


def _value(v: dict):
    for key in ("stringValue", "string_value", "boolValue", "bool_value", "doubleValue", "double_value"):
        if key in v:
            return v[key]
    for key in ("intValue", "int_value"):
        if key in v:
            return int(v[key])
    arr = _get(v, "arrayValue", "array_value")
    if arr is not None:
        return [_value(x) for x in arr.get("values", [])]
    return None


def _attrs(items: Iterable[dict] | None) -> dict:
    return {a["key"]: _value(a.get("value", {})) for a in items or ()}


def iter_spans(docs: Iterable[dict]) -> Iterator[tuple[dict, dict, dict]]:
    """(resource attributes, span attributes, span) for every span."""
    for doc in docs:
        for rs in _get(doc, "resourceSpans", "resource_spans", []):
            resource = _attrs((rs.get("resource") or {}).get("attributes"))
            for ss in _get(rs, "scopeSpans", "scope_spans", []):
                for span in ss.get("spans", []):
                    yield resource, _attrs(span.get("attributes")), span


def _group(resource: dict, attrs: dict, by: str) -> str:
    if by == "stage":
        index = attrs.get("stagecast.stage.index", resource.get("stagecast.stage.index"))
        if index is not None:
            return f"stage {int(index)}"
    return str(resource.get("stagecast.component") or resource.get("service.name") or "unknown")


def _percentile(sorted_values: list[float], q: float) -> float:
    rank = max(1, math.ceil(q * len(sorted_values)))
    return sorted_values[rank - 1]


def _group_order(group: str) -> tuple:
    known = {"gateway": 0, "coordinator": 1}
    if group.startswith("stage "):
        return (2, int(group.split()[1]), group)
    return (known.get(group, 3), 0, group)


def summarize(docs: Iterable[dict], by: str = "stage") -> list[Row]:
    durations: dict[tuple[str, str], list[float]] = defaultdict(list)
    for resource, attrs, span in iter_spans(docs):
        start = int(_get(span, "startTimeUnixNano", "start_time_unix_nano", 0))
        end = int(_get(span, "endTimeUnixNano", "end_time_unix_nano", 0))
        if end < start:
            continue
        durations[(_group(resource, attrs, by), span.get("name", "?"))].append((end - start) / 1e6)
    rows = []
    for (group, name), values in durations.items():
        values.sort()
        rows.append(Row(group, name, len(values), _percentile(values, 0.5), _percentile(values, 0.95), values[-1]))
    rows.sort(key=lambda r: (_group_order(r.group), r.name))
    return rows


def format_table(rows: list[Row], by: str = "stage") -> str:
    header = (by, "span", "count", "p50 ms", "p95 ms", "max ms")
    body = [(r.group, r.name, str(r.count), f"{r.p50_ms:.3f}", f"{r.p95_ms:.3f}", f"{r.max_ms:.3f}") for r in rows]
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]

    def fmt(row) -> str:
        left = [row[i].ljust(widths[i]) for i in range(2)]
        right = [row[i].rjust(widths[i]) for i in range(2, len(row))]
        return "  ".join(left + right).rstrip()

    return "\n".join([fmt(header), "  ".join("-" * w for w in widths), *map(fmt, body)])


def main(args) -> int:
    try:
        docs = load(args.file)
    except (OSError, json.JSONDecodeError) as exc:
        print(f"stagecast trace-summary: cannot read {args.file}: {exc}", file=sys.stderr)
        return 1
    rows = summarize(docs, by=args.by)
    if not rows:
        print(f"stagecast trace-summary: no spans in {args.file}", file=sys.stderr)
        return 1
    print(format_table(rows, by=args.by))
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser(
        "trace-summary",
        help="per-stage span latency table (count, p50, p95, max) of an OTLP JSON file",
        formatter_class=HelpFormatter,
    )
    p.add_argument("file", help="OTLP/JSON traces (ExportTraceServiceRequest; one per line also accepted); - for stdin")
    p.add_argument("--by", choices=["stage", "service"], default="stage", help="group rows by stage or by service")
    p.set_defaults(run=main)
