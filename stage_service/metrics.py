"""Prometheus metrics and trace spans of one stage process (``stagecast stage --metrics-port 9100``).

Usage (``stage_service.server`` owns one; the executor reports each batch to it)::

    tel = StageTelemetry(index=1, state=lambda: servicer.gen)
    tel.set_layers(range(4, 8))
    tel.idle(seconds)                                        # executor waited for the next plan event
    tel.batch(item, timing)                                  # a finished batch: histograms, counters, spans

Metrics (every series carries ``stage="<index>"``):

* ``stagecast_stage_forward_seconds`` (histogram): one batch's forward (GPU time from CUDA events on GPU).
* ``stagecast_stage_compute_seconds_total``, ``stagecast_stage_recv_wait_seconds_total``,
  ``stagecast_stage_send_seconds_total``, ``stagecast_stage_idle_seconds_total`` (counters): where the executor
  thread's wall time went; ``1 - rate(compute)`` is the stage's bubble fraction.
* ``stagecast_stage_bubble_ratio`` (gauge): the same over the last ``BUBBLE_WINDOW_S`` seconds of batches.
* ``stagecast_stage_batches_total``, ``stagecast_stage_micro_steps_total`` (counters).
* ``stagecast_stage_queue_depth`` (gauge): plan events accepted and not yet executed.
* ``stagecast_stage_startup_seconds{phase}`` (gauge): ``ready`` is the time from process start to READY (time to
  ready), ``load`` the time reading (in parallel threads) and merging this stage's slice, ``calibration`` the time
  timing it for the SLO controller (``stage_service.calibration``).
* ``stagecast_stage_open_streams``, ``stagecast_stage_kv_cache_bytes``, ``stagecast_stage_text_kv_bytes``,
  ``stagecast_stage_latent_bytes`` (gauges, read at scrape time), ``stagecast_stage_generation``.
* ``stagecast_stage_cuda_graphs``, ``stagecast_stage_graph_buffer_bytes`` (gauges, ``--cuda-graphs``): graphs
  captured and held, and their static input/output buffers; ``stagecast_stage_eager_batches`` (gauge): batches
  that ran eagerly past the graph limit or after a failed capture (0 when all batches replay graphs).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.trace import SpanKind
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

from stagecast import telemetry

FORWARD_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
BUBBLE_WINDOW_S = 10.0


@dataclass
class BatchTiming:
    """Wall-clock marks of one batch (``time.time_ns()``), and what the executor measured."""

    start_ns: int  # the batch was taken from the queue
    recv_ns: int  # receives done (== start_ns when nothing was received)
    compute_ns: int  # forward (and, on the last stage, the sampler step) done
    end_ns: int  # sends (and chunk reports) done
    received: bool
    sent: bool
    forward_ms: float  # what the done event reports (on CUDA: the batches whose GPU time was read just now)
    forward_samples: list[float]  # forward ms of each batch finished (CPU: this one; CUDA: as read from events)


class StageTelemetry:
    def __init__(self, index: int, state: Callable[[], object]):
        self.index = index
        self._state = state  # () -> the current stage_service.generation.Generation or None
        self.layers = range(0, 0)
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)  # process_cpu_seconds_total, process_resident_memory_bytes, ...
        labels = {"stage": str(index)}
        r = self.registry
        self._forward = Histogram(
            "stagecast_stage_forward_seconds",
            "Forward time of one batch on this stage (GPU time on CUDA)",
            ["stage"],
            buckets=FORWARD_BUCKETS,
            registry=r,
        ).labels(**labels)
        self._compute = Counter(
            "stagecast_stage_compute_seconds", "Executor time computing (forward + sampler)", ["stage"], registry=r
        ).labels(**labels)
        self._recv = Counter(
            "stagecast_stage_recv_wait_seconds",
            "Executor time spent waiting for the previous stage's hidden states or the last stage's latents",
            ["stage"],
            registry=r,
        ).labels(**labels)
        self._send = Counter(
            "stagecast_stage_send_seconds",
            "Executor time spent sending hidden states or latents and reporting chunks",
            ["stage"],
            registry=r,
        ).labels(**labels)
        self._idle = Counter(
            "stagecast_stage_idle_seconds", "Executor time spent waiting for the next plan event", ["stage"], registry=r
        ).labels(**labels)
        self._batches = Counter("stagecast_stage_batches", "Batches executed", ["stage"], registry=r).labels(**labels)
        self._steps = Counter("stagecast_stage_micro_steps", "Micro-steps executed", ["stage"], registry=r).labels(
            **labels
        )
        self._startup = Gauge(
            "stagecast_stage_startup_seconds",
            "Start-up phases of this stage: ready (process start to READY), load (reading and merging its slice), "
            "calibration (timing its slice for the SLO controller)",
            ["stage", "phase"],
            registry=r,
        )
        for name, doc, fn in (
            ("stagecast_stage_bubble_ratio", f"Share of the last {BUBBLE_WINDOW_S:g}s not computing", self._bubble),
            ("stagecast_stage_queue_depth", "Plan events accepted and not yet executed", self._queue_depth),
            ("stagecast_stage_open_streams", "Streams open on this stage", lambda: self._memory()[0]),
            ("stagecast_stage_kv_cache_bytes", "Self-attention KV cache of open streams", lambda: self._memory()[1]),
            ("stagecast_stage_text_kv_bytes", "Cross-attention K/V of the open streams", lambda: self._memory()[2]),
            ("stagecast_stage_latent_bytes", "Latents held between levels", lambda: self._memory()[3]),
            ("stagecast_stage_generation", "Pipeline generation this stage is in (0: none)", self._generation),
            ("stagecast_stage_cuda_graphs", "CUDA graphs captured and held", lambda: self._graphs()[0]),
            ("stagecast_stage_graph_buffer_bytes", "Static buffers of the CUDA graphs", lambda: self._graphs()[1]),
            ("stagecast_stage_eager_batches", "Batches run without a graph", lambda: self._graphs()[2]),
        ):
            g = Gauge(name, doc, ["stage"], registry=r)
            g.labels(**labels).set_function(fn)
        self._window: deque[tuple[float, float, float]] = deque()  # (start, end, compute seconds), monotonic
        self._window_lock = threading.Lock()
        self._last_memory = (0, 0, 0, 0)

    def set_layers(self, layers: range) -> None:
        self.layers = layers

    def startup(self, phase: str, seconds: float) -> None:
        """Record ``ready`` (process start to READY) or ``load`` (the last slice load) seconds."""
        self._startup.labels(stage=str(self.index), phase=phase).set(seconds)

    # ---- scrape-time values ------------------------------------------------------------------------------

    def _executor(self):
        gen = self._state()
        return None if gen is None else gen.executor

    def _queue_depth(self) -> float:
        ex = self._executor()
        return 0 if ex is None else ex.queue.qsize()

    def _generation(self) -> float:
        gen = self._state()
        return 0 if gen is None else gen.number

    def _memory(self) -> tuple[int, int, int, int]:
        ex = self._executor()
        if ex is None:
            return (0, 0, 0, 0)
        runner = ex.runner
        for _ in range(3):  # the executor may open or close a stream while we sum
            try:
                mem = runner.memory_bytes()
                self._last_memory = (len(runner.streams), mem["kv"], mem["text_kv"], mem["latents"])
                break
            except RuntimeError:
                continue
        return self._last_memory

    def _graphs(self) -> tuple[int, int, int]:
        ex = self._executor()
        graphs = None if ex is None else ex.runner.graphs
        if graphs is None:
            return (0, 0, 0)
        try:
            return (len(graphs.graphs), graphs.nbytes, graphs.eager_batches)
        except RuntimeError:  # the executor resized the slots while we summed
            return (len(graphs.graphs), 0, graphs.eager_batches)

    def _bubble(self) -> float:
        now = time.monotonic()
        with self._window_lock:
            while self._window and self._window[0][1] < now - BUBBLE_WINDOW_S:
                self._window.popleft()
            if not self._window:
                return 1.0
            busy = sum(c for _, _, c in self._window)
            span = max(now - self._window[0][0], 1e-9)
        return max(0.0, min(1.0, 1.0 - busy / span))

    # ---- reported by the executor ------------------------------------------------------------------------

    def idle(self, seconds: float) -> None:
        self._idle.inc(seconds)

    def batch(self, item, t: BatchTiming) -> None:
        recv_s = (t.recv_ns - t.start_ns) / 1e9
        compute_s = (t.compute_ns - t.recv_ns) / 1e9
        for ms in t.forward_samples:
            self._forward.observe(ms / 1e3)
        self._recv.inc(recv_s)
        self._compute.inc(compute_s)
        self._send.inc((t.end_ns - t.compute_ns) / 1e9)
        self._batches.inc()
        self._steps.inc(len(item.steps))
        end = time.monotonic()
        with self._window_lock:
            self._window.append((end - (t.end_ns - t.start_ns) / 1e9, end, compute_s))
            # Pruned here too, not only when the gauge is read: unscraped, the window would grow with every batch.
            while self._window[0][1] < end - BUBBLE_WINDOW_S:
                self._window.popleft()
        if item.traceparent and telemetry.enabled():
            self._spans(item, t)

    def recache(self, item, start_ns: int, end_ns: int, forwards: int) -> None:
        """A ``stage.recache`` span (under the stream's span): this stage's share of rebuilding a stream's KV window
        under a new prompt."""
        if not telemetry.enabled():
            return
        ex = self._executor()
        parent = telemetry.context_from_traceparent(
            item.traceparent or (ex.stream_traceparents.get(item.stream_id, "") if ex else "")
        )
        if parent is None:
            return
        attrs = {
            "stagecast.stage.index": self.index,
            "stagecast.stream.id": item.stream_id,
            "stagecast.recache.from_chunk": item.from_chunk,
            "stagecast.recache.forwards": forwards,
        }
        telemetry.tracer().start_span("stage.recache", context=parent, attributes=attrs, start_time=start_ns).end(
            end_ns
        )

    def _spans(self, item, t: BatchTiming) -> None:
        parent = telemetry.context_from_traceparent(item.traceparent)
        if parent is None:
            return
        ex = self._executor()
        links = telemetry.links_to(ex.stream_traceparents.get(s.stream, "") for s in item.steps) if ex else []
        gen = self._state()
        attrs = {
            "stagecast.stage.index": self.index,
            "stagecast.stage.layer_start": self.layers.start,
            "stagecast.stage.layer_stop": self.layers.stop,
            "stagecast.generation": gen.number if gen is not None else 0,
            "stagecast.batch.seq": item.seq,
            **telemetry.batch_attributes(item.steps),
        }
        tracer = telemetry.tracer()
        span = tracer.start_span(
            "stage.batch", context=parent, kind=SpanKind.CONSUMER, links=links, attributes=attrs, start_time=t.start_ns
        )
        ctx = trace.set_span_in_context(span)
        phase = {"stagecast.stage.index": self.index}
        if t.received:
            tracer.start_span("stage.recv", context=ctx, attributes=phase, start_time=t.start_ns).end(t.recv_ns)
        tracer.start_span("stage.compute", context=ctx, attributes=phase, start_time=t.recv_ns).end(t.compute_ns)
        if t.sent:
            tracer.start_span("stage.send", context=ctx, attributes=phase, start_time=t.compute_ns).end(t.end_ns)
        span.end(t.end_ns)
