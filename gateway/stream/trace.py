"""A gateway stream's spans (``stagecast.telemetry``): the stream, its coordinator calls, its chunks, decode and
encode.  Every method is a no-op when tracing is off, so the stream's code has no ``if span`` of its own.

Usage::

    trace = StreamTrace(cfg, model_name, stream_id, parent_span)
    trace.set_pipeline_id(7)
    span = trace.client_span("OpenStream", target)     # None when off
    chunk_span = trace.chunk_span(3)
    trace.post_hoc("vae.decode", 3, chunk_span, start_ns, end_ns)
    trace.end(outcome, frames=..., chunks=..., ttff_ms=...)
"""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from stagecast import telemetry
from stagecast.names import COORDINATOR_SERVICE

FINE_OUTCOMES = {"completed", "stopped", "cancelled"}


class StreamTrace:
    def __init__(self, cfg, model_name: str, stream_id: str, parent_span=None):
        self.pipeline_id = 0
        self.span = self._start(cfg, model_name, stream_id, parent_span) if telemetry.enabled() else None

    @staticmethod
    def _start(cfg, model: str, stream_id: str, parent):
        attrs = {
            "gen_ai.operation.name": "generate_content",
            "gen_ai.provider.name": "stagecast",
            "gen_ai.request.model": model,
            "gen_ai.request.seed": cfg.seed,
            "gen_ai.output.type": "video",
            "stagecast.gateway.stream_id": stream_id,
            "stagecast.stream.width": cfg.width,
            "stagecast.stream.height": cfg.height,
            "stagecast.stream.fps": cfg.fps,
            "stagecast.stream.steps": cfg.steps,
            "stagecast.stream.timesteps": list(cfg.timesteps),
            "stagecast.stream.shift": cfg.shift,
            "stagecast.stream.chunk_frames": cfg.chunk_frames,
            "stagecast.stream.codec": cfg.codec,
            "stagecast.stream.policy": cfg.policy,
            "stagecast.stream.decoder": cfg.decoder,
            "stagecast.stream.total_frames": cfg.total_frames or 0,
            "stagecast.stream.num_chunks": cfg.num_chunks or 0,
            "stagecast.stream.window": cfg.window or 0,
            "stagecast.stream.sink": cfg.sink,
        }
        ctx = trace.set_span_in_context(parent) if parent is not None else None
        return telemetry.tracer().start_span(f"generate_content {model}", context=ctx, attributes=attrs)

    @property
    def enabled(self) -> bool:
        return self.span is not None

    def set_pipeline_id(self, pipeline_id: int) -> None:
        self.pipeline_id = pipeline_id
        if self.span is not None:
            self.span.set_attribute("stagecast.stream.id", pipeline_id)

    def client_span(self, method: str, target: str):
        """A client span of the stream for a coordinator call (None when off)."""
        if self.span is None:
            return None
        span = telemetry.start_rpc_span(
            f"{COORDINATOR_SERVICE}/{method}",
            SpanKind.CLIENT,
            context=trace.set_span_in_context(self.span),
            target=target,
        )
        if self.pipeline_id:
            span.set_attribute("stagecast.stream.id", self.pipeline_id)
        return span

    def chunk_span(self, chunk: int, steps: int = 0):
        if self.span is None:
            return None
        attrs = {"stagecast.stream.id": self.pipeline_id, "stagecast.chunk": chunk}
        if steps:
            attrs["stagecast.chunk.steps"] = steps
        return telemetry.tracer().start_span("chunk", context=trace.set_span_in_context(self.span), attributes=attrs)

    def post_hoc(self, name: str, chunk: int, chunk_span, start_ns: int, end_ns: int, extra=None) -> None:
        """A span under a chunk's span whose times were measured already (decode workers, the encoder)."""
        if chunk_span is None:
            return
        attrs = {"stagecast.stream.id": self.pipeline_id, "stagecast.chunk": chunk, **(extra or {})}
        ctx = trace.set_span_in_context(chunk_span)
        telemetry.tracer().start_span(name, context=ctx, attributes=attrs, start_time=start_ns).end(end_ns)

    def failed_to_open(self, message: str) -> None:
        if self.span is not None:
            self.span.set_status(Status(StatusCode.ERROR, message))
            self.span.end()

    def end(self, outcome: str, *, frames: int, chunks: int, ttff_ms: float | None) -> None:
        """The stream is gone from the pipeline and the VAE: its span ends with the outcome."""
        span = self.span
        if span is None:
            return
        span.set_attribute("stagecast.stream.outcome", outcome)
        span.set_attribute("stagecast.stream.frames", frames)
        span.set_attribute("stagecast.stream.chunks", chunks)
        if ttff_ms is not None:
            span.set_attribute("stagecast.stream.ttff_ms", ttff_ms)
        if outcome not in FINE_OUTCOMES:
            span.set_status(Status(StatusCode.ERROR, outcome))
        span.end()
