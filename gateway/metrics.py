"""Prometheus metrics of the gateway (``stagecast gateway --metrics-port 9100``).

Usage::

    metrics = GatewayMetrics(active=lambda: n_streams, vae_bytes=lambda: held_bytes)
    metrics.serve(9100)                  # /metrics on 0.0.0.0:9100; port 0 leaves it off
    metrics.stream_ended("completed"); metrics.first_frame(0.42); metrics.chunk_decoded(0.05)

Each gateway owns its registry, so several gateways in one process (tests) do not collide.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

logger = logging.getLogger(__name__)

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class GatewayMetrics:
    def __init__(self, *, active: Callable[[], int], vae_bytes: Callable[[], int]):
        self.registry = CollectorRegistry()
        Gauge(
            "stagecast_gateway_active_streams",
            "Streams the gateway holds, including ones still draining",
            registry=self.registry,
        ).set_function(active)
        Gauge(
            "stagecast_gateway_vae_state_bytes",
            "Memory held by the per-stream VAE decode caches",
            registry=self.registry,
        ).set_function(vae_bytes)
        self._ended = Counter(
            "stagecast_gateway_streams_ended", "Streams that ended, by reason", ["reason"], registry=self.registry
        )
        self._rejected = Counter(
            "stagecast_gateway_streams_rejected",
            "Calls refused before streaming, by status",
            ["code"],
            registry=self.registry,
        )
        self._first_frame = Histogram(
            "stagecast_gateway_first_frame_seconds",
            "From the config arriving to the first frame being encoded (server-side TTFF)",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self._decode = Histogram(
            "stagecast_gateway_chunk_decode_seconds",
            "From a chunk's latents arriving to its VAE decode finishing",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )

    def serve(self, port: int) -> None:
        if port:
            start_http_server(port, registry=self.registry)
            logger.info("gateway metrics on :%d/metrics", port)

    def stream_ended(self, reason: str) -> None:
        self._ended.labels(reason=reason).inc()

    def rejected(self, code: str) -> None:
        self._rejected.labels(code=code).inc()

    def first_frame(self, seconds: float) -> None:
        self._first_frame.observe(seconds)

    def chunk_decoded(self, seconds: float) -> None:
        self._decode.observe(seconds)
