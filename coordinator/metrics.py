"""Prometheus metrics and batch spans of the coordinator (``stagecast coordinator --metrics-port 9100``).

Usage (``coordinator.engine.PipelineEngine`` owns one as ``engine.telemetry`` and calls it under its lock)::

    tel = CoordinatorTelemetry()
    tel.bind(engine.stats)                         # gauges read one CoordinatorStats at scrape time
    tel.batch_planned(ev, batch, sessions)         # a batch event: counters, and its span (context in ev.traceparent)
    tel.batch_done(seq)                            # the last stage finished it: latency, span ends
    tel.generation_ended(reason)                   # batches in flight are abandoned

Metrics:

* ``stagecast_coordinator_active_streams``, ``stagecast_coordinator_pending_events`` (opens, stops and prompt
  updates not yet planned), ``stagecast_coordinator_batches_in_flight`` (planned, not finished by the last stage),
  ``stagecast_coordinator_lookahead_batches`` (its limit), ``stagecast_coordinator_stage_outbox_depth{stage}`` (plan
  events queued for a stage's Submit), ``stagecast_coordinator_ready``, ``stagecast_coordinator_generation``,
  ``stagecast_coordinator_stage_kv_budget_bytes{stage}`` (what a stage gives to streams' KV; stages without a limit are
  left out) and ``stagecast_coordinator_stage_kv_reserved_bytes{stage}`` (the admitted streams' worst-case KV on it)
  (gauges);
* ``stagecast_coordinator_batches_planned_total``, ``stagecast_coordinator_micro_steps_planned_total``,
  ``stagecast_coordinator_empty_ticks_total`` (ticks that planned nothing: a pipeline bubble at the source),
  ``stagecast_coordinator_chunks_routed_total``, ``stagecast_coordinator_chunks_dropped_total`` (finished chunks
  whose stream was gone), ``stagecast_coordinator_streams_opened_total``,
  ``stagecast_coordinator_streams_refused_total{limit}`` (streams, kv_memory, capacity),
  ``stagecast_coordinator_streams_ended_total{reason}``,
  ``stagecast_coordinator_generation_failures_total`` (counters);
* ``stagecast_coordinator_batch_size`` (micro-steps per batch) and ``stagecast_coordinator_batch_latency_seconds``
  (planned to finished by the last stage: lookahead queueing plus the pipeline's depth) (histograms).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from opentelemetry.trace import SpanKind, Status, StatusCode
from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector
from prometheus_client.core import GaugeMetricFamily

from stagecast import telemetry

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
SIZE_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 32)


@dataclass(frozen=True)
class CoordinatorStats:
    """What the coordinator's gauges read at a scrape (``PipelineEngine.stats``), taken at once under its lock."""

    active_streams: int
    pending_events: int  # opens, stops and prompt updates not yet planned
    batches_in_flight: int
    lookahead: int
    ready: bool
    generation: int
    outbox: list[tuple[int, int]] = field(default_factory=list)  # (stage index, plan events queued)
    kv: list[tuple[int, int, int]] = field(default_factory=list)  # (stage index, KV budget, reserved), budgeted ones
    capacity: list[tuple[int, float]] = field(default_factory=list)  # (steps, more streams at 16 FPS)
    utilization: float | None = None
    slo_correction: float = 1.0


class _StatsCollector:
    """Every gauge of the engine's state, from one ``CoordinatorStats`` per scrape."""

    def __init__(self, stats: Callable[[], CoordinatorStats]):
        self.stats = stats

    def collect(self):
        st = self.stats()
        for name, doc, value in (
            ("stagecast_coordinator_active_streams", "Streams admitted and not ended", st.active_streams),
            (
                "stagecast_coordinator_pending_events",
                "Stream opens, stops and prompt updates waiting for the next tick",
                st.pending_events,
            ),
            (
                "stagecast_coordinator_batches_in_flight",
                "Batches planned and not yet finished by the last stage",
                st.batches_in_flight,
            ),
            ("stagecast_coordinator_lookahead_batches", "Limit on batches in flight", st.lookahead),
            ("stagecast_coordinator_ready", "1 while a generation is formed", 1 if st.ready else 0),
            ("stagecast_coordinator_generation", "Current pipeline generation", st.generation),
        ):
            yield GaugeMetricFamily(name, doc, value=value)
        outbox = GaugeMetricFamily(
            "stagecast_coordinator_stage_outbox_depth",
            "Plan events queued for a stage and not yet submitted",
            labels=["stage"],
        )
        for index, depth in st.outbox:
            outbox.add_metric([str(index)], depth)
        yield outbox
        budget = GaugeMetricFamily(
            "stagecast_coordinator_stage_kv_budget_bytes",
            "Bytes a stage gives to streams' self-attention KV (stages without a limit are left out)",
            labels=["stage"],
        )
        reserved = GaugeMetricFamily(
            "stagecast_coordinator_stage_kv_reserved_bytes",
            "Worst-case KV bytes of the streams admitted on a stage",
            labels=["stage"],
        )
        for index, limit, held in st.kv:
            budget.add_metric([str(index)], limit)
            reserved.add_metric([str(index)], held)
        yield budget
        yield reserved
        capacity = GaugeMetricFamily(
            "stagecast_coordinator_capacity_streams",
            "More streams at 16 FPS (one latent frame per chunk) the pipeline holds beside the admitted ones",
            labels=["steps"],
        )
        for steps, streams in st.capacity:
            capacity.add_metric([str(steps)], streams)
        yield capacity
        if st.utilization is not None:
            yield GaugeMetricFamily(
                "stagecast_coordinator_slo_utilization",
                "Bottleneck stage busy share the paced streams need at their current steps (SLO model)",
                value=st.utilization,
            )
        yield GaugeMetricFamily(
            "stagecast_coordinator_slo_correction",
            "What the SLO model's costs are multiplied by, learned from paced streams that fell behind (1: none)",
            value=st.slo_correction,
        )


class CoordinatorTelemetry:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        ProcessCollector(registry=r)  # process_cpu_seconds_total, process_resident_memory_bytes, ...
        self._planned = Counter("stagecast_coordinator_batches_planned", "Batches planned", registry=r)
        self._steps = Counter("stagecast_coordinator_micro_steps_planned", "Micro-steps planned", registry=r)
        self._empty = Counter(
            "stagecast_coordinator_empty_ticks", "Scheduler ticks with active streams that planned nothing", registry=r
        )
        self._routed = Counter("stagecast_coordinator_chunks_routed", "Finished chunks handed to streams", registry=r)
        self._dropped = Counter(
            "stagecast_coordinator_chunks_dropped",
            "Finished chunks dropped because their stream or generation was gone",
            registry=r,
        )
        self._opened = Counter("stagecast_coordinator_streams_opened", "Streams admitted", registry=r)
        self._ended = Counter("stagecast_coordinator_streams_ended", "Streams ended, by reason", ["reason"], registry=r)
        self._failures = Counter(
            "stagecast_coordinator_generation_failures", "Pipeline generations that ended in a failure", registry=r
        )
        self._size = Histogram(
            "stagecast_coordinator_batch_size", "Micro-steps per planned batch", buckets=SIZE_BUCKETS, registry=r
        )
        self._latency = Histogram(
            "stagecast_coordinator_batch_latency_seconds",
            "From planning a batch to the last stage finishing it",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self._step_changes = Counter(
            "stagecast_coordinator_step_changes",
            "SLO controller step changes, by direction (down: capacity short; up: capacity back)",
            ["direction"],
            registry=r,
        )
        self._chunk_steps = Histogram(
            "stagecast_coordinator_chunk_steps",
            "Denoising steps of each chunk routed to its stream (the SLO controller's choice)",
            buckets=(1, 2, 3, 4, 6, 8, 12, 16, 25, 50),
            registry=r,
        )
        self._refused = Counter(
            "stagecast_coordinator_streams_refused", "Streams refused at admission, by limit", ["limit"], registry=r
        )
        self._inflight: dict[int, tuple[float, object]] = {}  # seq -> (planned at, span or None)

    def bind(self, stats: Callable[[], CoordinatorStats]) -> None:
        """The gauges read ``stats()`` (``PipelineEngine.stats``) at scrape time."""
        self.registry.register(_StatsCollector(stats))

    # ---- called by the engine, under its lock -----------------------------------------------------------------

    def empty_tick(self) -> None:
        self._empty.inc()

    def batch_planned(self, ev, batch, find, steps: list[int] | None = None) -> None:
        """``ev`` is the batch's plan event; sets ``ev.traceparent`` when the batch is traced.  ``find``: a stream's
        session by id (``StreamTable.find``), for the streams' trace contexts."""
        self._planned.inc()
        self._steps.inc(len(batch))
        self._size.observe(len(batch))
        span = None
        if telemetry.enabled():
            tps = [session.traceparent for session in (find(s.stream) for s in batch) if session is not None]
            links = telemetry.links_to(tps)
            if links:
                span = telemetry.tracer().start_span(
                    "coordinator.batch",
                    kind=SpanKind.PRODUCER,
                    links=links,
                    attributes={
                        "stagecast.generation": ev.generation,
                        "stagecast.batch.seq": ev.seq,
                        **telemetry.batch_attributes(batch),
                        # The denoising steps of each item's chunk (parallel to stagecast.levels).
                        **({"stagecast.steps": steps} if steps else {}),
                    },
                )
                ev.traceparent = telemetry.traceparent_of(span)
        self._inflight[ev.seq] = (time.perf_counter(), span)

    def batch_done(self, seq: int) -> None:
        entry = self._inflight.pop(seq, None)
        if entry is None:
            return
        planned, span = entry
        self._latency.observe(time.perf_counter() - planned)
        if span is not None:
            span.end()

    def generation_ended(self, reason: str, failed: bool) -> None:
        if failed:
            self._failures.inc()
        for _, span in self._inflight.values():
            if span is not None:
                span.set_status(Status(StatusCode.ERROR, reason))
                span.end()
        self._inflight.clear()

    def stream_opened(self) -> None:
        self._opened.inc()

    def stream_ended(self, reason: str) -> None:
        self._ended.labels(reason=reason).inc()

    def chunk(self, routed: bool, steps: int = 0) -> None:
        (self._routed if routed else self._dropped).inc()
        if routed and steps:
            self._chunk_steps.observe(steps)

    def steps_changed(self, old: int, new: int) -> None:
        self._step_changes.labels(direction="down" if new < old else "up").inc()

    def refused(self, limit: str) -> None:
        self._refused.labels(limit=limit).inc()
