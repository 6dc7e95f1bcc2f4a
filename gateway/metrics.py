"""Prometheus metrics of the gateway (``stagecast gateway --metrics-port 9100``).

Usage::

    metrics = GatewayMetrics(active=lambda: n_streams, vae_bytes=lambda: held_bytes)
    metrics.serve(9100, host)            # /metrics on host:9100; port 0 leaves it off
    metrics.stream_ended("completed"); metrics.first_frame(0.42); metrics.chunk_decoded(0.05)
    metrics.frame_sent(late=False, encode_seconds=0.002); metrics.stream_fps(15.8)
    metrics.frames_dropped("cancelled", 3)
    metrics.close()

Each gateway owns its registry, so several gateways in one process (tests) do not collide.  Series:

* ``stagecast_gateway_active_streams``, ``stagecast_gateway_vae_state_bytes`` (VAE decode caches),
  ``stagecast_gateway_queued_chunks`` (latent chunks waiting for the VAE), ``stagecast_gateway_queued_messages``
  (encoded messages waiting for clients), ``stagecast_gateway_waiting_calls`` (Generate calls that have not sent their
  config yet: a flood of idle calls shows here), ``stagecast_gateway_tiny_formed_batch`` (streams per tiny decoder call
  over its recent calls: what the coordinator prices a tiny stream's decode at), ``stagecast_gateway_slots_free`` and
  ``stagecast_gateway_slots`` (the pipeline's free and total slots for a default stream, its coordinator's own
  arithmetic: ``gateway.edge.agent``) (gauges);
* ``stagecast_gateway_streams_ended_total{reason}``, ``stagecast_gateway_streams_rejected_total{code}``,
  ``stagecast_gateway_chunks_received_total``, ``stagecast_gateway_frames_total`` (frames queued for clients),
  ``stagecast_gateway_late_frames_total`` (encoded after their presentation time: the first frame's encode time plus
  the frame's pts), ``stagecast_gateway_frames_dropped_total{reason}`` (encoded, never handed to the client because
  the stream ended first) (counters);
* ``stagecast_gateway_prompt_encode_seconds{cached}`` (a prompt's text encoding, cached="true" for a cache hit),
  ``stagecast_gateway_first_frame_seconds`` (server-side TTFF), ``stagecast_gateway_chunk_decode_seconds``,
  ``stagecast_gateway_frame_encode_seconds``, ``stagecast_gateway_stream_fps`` (each finished stream's frames per
  second, first to last frame) (histograms).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, start_http_server

logger = logging.getLogger(__name__)

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_ENCODE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)
_FPS_BUCKETS = (1, 2, 4, 8, 12, 16, 20, 24, 30, 48, 60, 120)


class GatewayMetrics:
    def __init__(
        self,
        *,
        active: Callable[[], int],
        vae_bytes: Callable[[], int],
        queued_chunks: Callable[[], int] = lambda: 0,
        queued_messages: Callable[[], int] = lambda: 0,
        waiting_calls: Callable[[], int] = lambda: 0,
        slots_free: Callable[[], int] = lambda: 0,
        slots: Callable[[], int] = lambda: 0,
        tiny_formed_batch: Callable[[], float] = lambda: 0.0,
    ):
        self._server = None
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)  # process_cpu_seconds_total, process_resident_memory_bytes, ...
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
        Gauge(
            "stagecast_gateway_waiting_calls",
            "Generate calls that have not sent their config yet (at most --max-pending)",
            registry=self.registry,
        ).set_function(waiting_calls)
        # The fleet's numbers (gateway.edge.agent): what the --agent-port tells a door, for Envoy, Gateway API, llm-d
        # or KEDA
        Gauge(
            "stagecast_gateway_slots_free",
            "More streams of the default config this pipeline admits now (its coordinator's dry-run admission; 0 while "
            "not ready)",
            registry=self.registry,
        ).set_function(slots_free)
        Gauge(
            "stagecast_gateway_slots",
            "Streams of the default config this pipeline holds in all: its free slots plus the streams open now",
            registry=self.registry,
        ).set_function(slots)
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
        Gauge(
            "stagecast_gateway_queued_chunks",
            "Latent chunks received and waiting for (or in) the VAE, all streams",
            registry=self.registry,
        ).set_function(queued_chunks)
        Gauge(
            "stagecast_gateway_tiny_formed_batch",
            "Streams per tiny decoder call, over its recent calls (what the coordinator prices a tiny stream at)",
            registry=self.registry,
        ).set_function(tiny_formed_batch)
        Gauge(
            "stagecast_gateway_queued_messages",
            "Encoded messages waiting for their clients to read, all streams",
            registry=self.registry,
        ).set_function(queued_messages)
        self._chunks = Counter(
            "stagecast_gateway_chunks_received", "Latent chunks received from the pipeline", registry=self.registry
        )
        self._frames = Counter("stagecast_gateway_frames", "Frames queued for clients", registry=self.registry)
        self._late = Counter(
            "stagecast_gateway_late_frames",
            "Frames encoded after their presentation time (first frame's encode time + pts)",
            registry=self.registry,
        )
        self._dropped = Counter(
            "stagecast_gateway_frames_dropped",
            "Frames encoded but never handed to the client because the stream ended first, by stream outcome",
            ["reason"],
            registry=self.registry,
        )
        self._input = Counter(
            "stagecast_gateway_input_frames",
            "Video-to-video input frames accepted from clients",
            registry=self.registry,
        )
        self._input_dropped = Counter(
            "stagecast_gateway_input_frames_dropped",
            "Video-to-video input frames never restyled: 'behind' (a LIVE stream's input came faster than the "
            "pipeline served it), 'partial_chunk' (sent after the input ended)",
            ["reason"],
            registry=self.registry,
        )
        self._input_encode = Histogram(
            "stagecast_gateway_input_encode_seconds",
            "VAE-encoding one input chunk (video-to-video)",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self._encode = Histogram(
            "stagecast_gateway_frame_encode_seconds",
            "Encoding one frame (JPEG, H.264 or raw)",
            buckets=_ENCODE_BUCKETS,
            registry=self.registry,
        )
        self._prompt = Histogram(
            "stagecast_gateway_prompt_encode_seconds",
            "Encoding a prompt with the text encoder (cached: served from the embedding cache)",
            ["cached"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self._fps = Histogram(
            "stagecast_gateway_stream_fps",
            "Frames per second of each finished stream, first to last frame (streams with at least two frames)",
            buckets=_FPS_BUCKETS,
            registry=self.registry,
        )

    def serve(self, port: int, host: str = "127.0.0.1") -> None:
        if port:
            self._server, _ = start_http_server(port, addr=host, registry=self.registry)
            logger.info("gateway metrics on %s:%d/metrics", host, port)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def stream_ended(self, reason: str) -> None:
        self._ended.labels(reason=reason).inc()

    def rejected(self, code: str) -> None:
        self._rejected.labels(code=code).inc()

    def prompt_encoded(self, seconds: float, *, cached: bool) -> None:
        self._prompt.labels(cached="true" if cached else "false").observe(seconds)

    def first_frame(self, seconds: float) -> None:
        self._first_frame.observe(seconds)

    def chunk_decoded(self, seconds: float) -> None:
        self._decode.observe(seconds)

    def chunk_received(self) -> None:
        self._chunks.inc()

    def frame_sent(self, *, late: bool, encode_seconds: float) -> None:
        self._frames.inc()
        self._encode.observe(encode_seconds)
        if late:
            self._late.inc()

    def frames_dropped(self, reason: str, frames: int) -> None:
        if frames > 0:
            self._dropped.labels(reason=reason).inc(frames)

    def input_frame(self) -> None:
        self._input.inc()

    def input_frames_dropped(self, reason: str, frames: int) -> None:
        if frames > 0:
            self._input_dropped.labels(reason=reason).inc(frames)

    def input_encoded(self, seconds: float) -> None:
        self._input_encode.observe(seconds)

    def stream_fps(self, fps: float) -> None:
        self._fps.observe(fps)
