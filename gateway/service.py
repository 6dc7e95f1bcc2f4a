"""The gateway process: the public ``stagecast.v1.StreamService`` in front of a coordinator.

Run with ``stagecast gateway --coordinator HOST:PORT --checkpoint DIR [--port 50051] [--max-streams 8]``, or::

    gw = Gateway(GatewayOptions(coordinator="127.0.0.1:50050", checkpoint="/models/Wan2.1-T2V-1.3B-Diffusers"))
    gw.start(); ...; gw.stop()

The gateway encodes prompts (UMT5, cached per prompt), opens one coordinator stream per client stream, decodes the
finished latent chunks with a per-stream StreamVAE cache (in this process, or in a chain of ``stagecast vae-stage``
processes with ``--vae-stage``) and encodes frames (``gateway.stream`` holds the per-stream machinery and its
buffering policy).  Errors that end a call are gRPC status codes: INVALID_ARGUMENT names the bad
field (or says the request bytes are not a message), RESOURCE_EXHAUSTED means this gateway's ``--max-streams`` (or
the coordinator's own limit, passed through), its per-stream cost budget (``gateway.admission``), too many calls
waiting for their config or watching the status, or a client too slow to keep up; DEADLINE_EXCEEDED means no config
within ``--config-timeout``.  ``GetStatus``/``WatchStatus`` and the Prometheus metrics show the streams the
gateway holds and the VAE cache memory they use.

The edge is bounded: the handlers take raw bytes and parse them (grpc would answer INTERNAL to bytes it cannot
decode), requests over the largest legal message are refused before parsing, every call that can stay open holds a
slot from a bounded budget (streams, calls waiting for their config, status watchers, health watchers, reflection)
and the thread pool is larger than all budgets together, so health checks and new streams always find a thread.
With ``--health-port`` grpc.health.v1 is also served by a server of its own (what Kubernetes probes call).

Security: ``--tls-cert``/``--tls-key`` serve the public API over TLS; ``--tokens FILE`` requires a bearer token on
every call but health (``stagecast.security.TokenAuth``: UNAUTHENTICATED without a valid one).  Each token is a
tenant: ``GetStatus``/``WatchStatus`` show a tenant only its own streams (an admin or status token sees all), and a
stream's stop and prompt updates travel only on its own ``Generate`` call.  Inside the deployment the gateway
reaches the coordinator and VAE stages over mTLS (``--mtls``).
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import grpc
import torch
from opentelemetry import trace

from gateway.admission import Admission, CostBudget, DecoderMemory, Refused, passes
from gateway.batched_decoder import BatchedDecoder
from gateway.checkpoint import ModelInfo, ServingDefaults, tiny_decoder_file
from gateway.config import (
    MAX_REQUEST_BYTES,
    ConfigError,
    Decoders,
    RequestTooLarge,
    parse_client_message,
    parse_status_request,
    resolve_config,
)
from gateway.decoder import LocalDecoder, RemoteDecoder
from gateway.metrics import GatewayMetrics
from gateway.options import GatewayOptions
from gateway.pipeline_warmup import wait_budget, warm_pipeline
from gateway.quotas import Quotas, client_of
from gateway.revocation import RevocationWatch, credentials_of
from gateway.stream import StreamFailed, StreamHost, StreamLimits, StreamRun
from gateway.stream_vae import StreamVAE, StreamVAEEncoder, use_cudnn_autotune
from gateway.text_encoder import TextEncoder, text_dtype
from gateway.timers import Timers
from gateway.vae_cost import VaeCost, VaeReporter, measure_vae, tiny_cost
from gateway.vae_graphs import MAX_SLOTS as MAX_GRAPH_SLOTS
from stagecast import api, telemetry
from stagecast.cuda_graphs import cuda_graph_capture
from stagecast.grpc_util import (
    HEALTH_WATCH,
    MAX_MESSAGE_BYTES,
    RECONNECT_OPTIONS,
    REFLECTION_STREAMS,
    ConcurrencyLimits,
    abort_with_retry,
    make_health_server,
    make_server,
    retry_after_of,
    set_serving,
)
from stagecast.internal.v1 import pipeline_pb2 as ipb
from stagecast.internal.v1 import pipeline_pb2_grpc as ipb_grpc
from stagecast.names import DTYPES, STREAM_SERVICE
from stagecast.security import Principal, TokenAuth, connect, principal_of, server_tls
from stagecast.service import serve_lifecycle
from stagecast.v1 import stream_pb2 as pb

logger = logging.getLogger(__name__)

SERVICE_NAME = STREAM_SERVICE
WATCH_STATUS = f"/{SERVICE_NAME}/WatchStatus"


def public_options(max_frame_pixels: int) -> list[tuple[str, int]]:
    """The public server's options: requests are refused above the largest legal one before they are parsed (a
    config, or a video-to-video input frame: a raw RGB frame of the largest size the cost budget admits); responses
    (raw frames, H.264 fragments of a whole GOP) may be large."""
    return [
        ("grpc.max_receive_message_length", max_request_bytes(max_frame_pixels)),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ]


def max_request_bytes(max_frame_pixels: int) -> int:
    return MAX_REQUEST_BYTES + 3 * max_frame_pixels + 64


HEADROOM_THREADS = 16  # beyond every bounded kind of call: health checks, GetStatus, refusals in flight
# The Wan VAE's per-stream caches when not measured (VAE on the CPU, or the measurement failed): ~1.8 GiB at 480x832
# in bfloat16 (scaled by the dtype and frame pixels).
FULL_VAE_STATE_BYTES = int(1.8 * 1024**3)
FULL_VAE_STATE_ITEMSIZE = 2


class Gateway:
    def __init__(self, opts: GatewayOptions):
        self.opts = opts
        if not 0 <= opts.vae_graph_slots <= MAX_GRAPH_SLOTS:
            raise ValueError(f"--vae-graph-slots must be in [0, {MAX_GRAPH_SLOTS}], got {opts.vae_graph_slots}")
        if not opts.buffer_mib * 2**20 >= 1:
            raise ValueError(f"--buffer-mib must be above 0, got {opts.buffer_mib:g}")
        if opts.vae_cuda_graphs and opts.vae_stage:
            raise ValueError("--vae-cuda-graphs is for the in-process VAE; give the vae-stage processes --cuda-graphs")
        root = Path(opts.checkpoint)
        self.defaults = ServingDefaults.load(root)
        self.model = ModelInfo.from_checkpoint(root)
        self.model_name = root.resolve().name  # gen_ai.request.model on the stream spans
        self.text_len = opts.text_len or self.defaults.text_len
        self.timers = Timers("gateway-deadlines")  # every stream's deadlines, on one thread
        text_device = opts.text_device or opts.device
        self.encoder = TextEncoder(
            root,
            max_len=self.text_len,
            cache_size=opts.text_cache,
            device=text_device,
            dtype=text_dtype(opts.text_dtype, text_device),
            graph=cuda_graph_capture(torch.device(text_device))
            if opts.text_graph and torch.device(text_device).type == "cuda"
            else None,
        )
        if opts.vae_stage:
            self.decoder = RemoteDecoder(
                opts.vae_stage, drain_timeout=opts.drain_timeout, timers=self.timers, mtls=opts.mtls
            )
            autotuned = False
        else:
            autotuned = opts.vae_cudnn_benchmark and use_cudnn_autotune(opts.vae_devices or [opts.device])
            self.decoder = LocalDecoder.from_folder(
                root / "vae",
                dtype=DTYPES[opts.vae_dtype],
                devices=opts.vae_devices or [opts.device],
                boundaries=opts.vae_split,
                compile=opts.vae_compile,
            )
        tiny_path = tiny_decoder_file(root, opts.tiny_decoder)
        # Every tiny stream's ready chunk in one call (gateway.batched_decoder): one worker for all of them.
        self.tiny_decoder = (
            BatchedDecoder.tiny(
                tiny_path,
                device=opts.device,
                dtype=DTYPES[opts.vae_dtype],
                latent_channels=self.model.latent_channels,
                spatial_factor=self.model.spatial_factor,
                temporal_factor=self.model.temporal_factor,
                compile=opts.vae_compile and torch.device(opts.device).type == "cuda",
            )
            if tiny_path is not None
            else None
        )
        self.decoders = Decoders(tiny=self.tiny_decoder is not None, default=opts.default_decoder)
        self._encoder_lock = threading.Lock()
        self._input_encoder: StreamVAEEncoder | None = None
        self.warmup_s = 0.0
        if opts.warmup if opts.warmup is not None else opts.vae_compile or autotuned:
            self.warmup_s = self._warm_up()
        if opts.vae_cuda_graphs:
            # After the compile warm-up (a graph of a compiled part records the compiled kernels), before serving.
            start = time.perf_counter()
            sf = self.model.spatial_factor
            slots = opts.vae_graph_slots or min(opts.max_streams, MAX_GRAPH_SLOTS)
            graphed = self.decoder.capture_graphs((self.defaults.height // sf, self.defaults.width // sf), slots)
            self.warmup_s += time.perf_counter() - start
            logger.info("VAE graphs: parts graphed %s, captured in %.1f s", graphed, time.perf_counter() - start)
        # Measured after the capture: what streams will cost, graphed where they hold a slot.
        self.vae_cost = self._measure_vae()
        self.tiny_measured = self._warm_tiny()
        self.channel = connect(opts.coordinator, opts.mtls, "coordinator", RECONNECT_OPTIONS)  # it may restart
        self.coordinator = ipb_grpc.CoordinatorServiceStub(self.channel)
        # Each decoder's measured cost goes to the coordinator's SLO model (unless its operator fixed one); the tiny
        # decoder's again whenever its served batches move it.
        self.vae_reporter = (
            VaeReporter(self.coordinator, self.decoder_costs)
            if self.vae_cost is not None or self.tiny_measured
            else None
        )
        wait_s = wait_budget(opts.pipeline_warmup_s, opts.device)
        self.pipeline_warmup_chunks = self._warm_pipeline(wait_s) if wait_s > 0 else 0

        self.cond = threading.Condition()
        self.streams: dict[str, StreamRun] = {}
        self.admitted = 0  # streams past the count cap: being set up, or registered and not yet forgotten
        self.pending = 0  # Generate calls waiting for their config
        self._releases: dict[str, object] = {}  # per registered stream: gives back what admission took
        self.budget = CostBudget.derive(
            self.defaults,
            opts.device,  # the device kind decides the headroom (the VAE's devices are of the same kind)
            max_frame_pixels=opts.max_frame_pixels,
            max_stream_cost=opts.max_stream_cost,
        )
        self.decoder_memory = self._decoder_memory()
        # Admission, in order: count cap, cost budget, decoder memory (later checks, e.g. capacity, are appended).
        self.admission = Admission([self._count_cap, self.budget.check, self.decoder_memory.check])
        self.quotas = Quotas(opts.quotas, opts.max_streams)  # per client, within the global bounds (gateway.quotas)
        self.cost_budget = self._describe_budget()
        self.version = 0  # bumped on every change WatchStatus reports
        self.started = 0
        self.finished = 0
        self.ended_by_reason: collections.Counter[str] = collections.Counter()
        self.metrics = GatewayMetrics(
            active=lambda: len(self.streams),
            vae_bytes=self.vae_state_bytes,
            queued_chunks=lambda: sum(run.session.queued for run in self._runs() if run.session is not None),
            queued_messages=lambda: sum(len(run.out) for run in self._runs()),
            waiting_calls=lambda: self.pending,
        )
        # Everything a stream needs from this gateway, and nothing more (gateway.stream).
        self.stream_host = StreamHost(
            coordinator=self.coordinator,
            coordinator_target=opts.coordinator,
            decoders={"full": self.decoder, **({"tiny": self.tiny_decoder} if self.tiny_decoder else {})},
            metrics=self.metrics,
            timers=self.timers,
            limits=StreamLimits(
                buffer_chunks=opts.buffer_chunks,
                buffer_messages=opts.buffer_messages,
                buffer_bytes=int(opts.buffer_mib * 2**20),
                slow_client_timeout=opts.slow_client_timeout,
                drain_timeout=opts.drain_timeout,
                abandon_timeout=opts.abandon_timeout,
            ),
            latent_channels=self.model.latent_channels,
            text_len=self.text_len,
            model_name=self.model_name,
            encode_prompt=self.encode_prompt,
            input_encoder=self.input_encoder,
            temporal_factor=self.model.temporal_factor,
            touch=self.touch,
            forget=self.forget,
        )

        self.auth = TokenAuth(opts.tokens, generate_methods=[f"/{SERVICE_NAME}/Generate"]) if opts.tokens else None
        # A revoked token ends the streams it opened (gateway.revocation).
        self.revocation = RevocationWatch(self.auth, self._runs, self.timers) if self.auth else None
        servicer = StreamServicer(self)
        streaming = {WATCH_STATUS: opts.max_watchers, HEALTH_WATCH: opts.max_watchers}
        streaming.update(dict.fromkeys(REFLECTION_STREAMS, opts.max_watchers))
        self.limits = ConcurrencyLimits(streaming)
        # A handler thread per stream and per call waiting for its config, one per bounded streaming call, and
        # headroom: every call that can stay open is bounded below the pool's size.
        workers = opts.max_streams + opts.max_pending + self.limits.total() + HEADROOM_THREADS
        self.server, self.health, self.port = make_server(
            opts.port,
            [(_add_stream_service, servicer, SERVICE_NAME)],
            host=opts.host,
            max_workers=workers,
            options=public_options(self.budget.max_frame_pixels),
            # Tokens first: a call without a valid one is refused before it takes a slot of any budget.
            interceptors=[*([self.auth] if self.auth else []), self.limits],
            maximum_concurrent_rpcs=workers,
            credentials=server_tls(opts.tls_cert, opts.tls_key),
        )
        host = "127.0.0.1" if opts.host == "0.0.0.0" else opts.host
        self.address = f"{host}:{self.port}"
        self.health_server = self.health_address = None
        if opts.health_port is not None:
            self.health_server, health_port = make_health_server(self.health, opts.health_port, host=opts.host)
            self.health_address = f"{host}:{health_port}"

    def _describe_budget(self) -> pb.CostBudget:
        """The cost budget as GatewayStatus tells clients (the page offers only the sizes it admits)."""
        default = resolve_config(pb.StreamConfig(prompt="budget"), defaults=self.defaults, model=self.model)
        return pb.CostBudget(
            max_frame_pixels=self.budget.max_frame_pixels,
            max_stream_cost=self.budget.max_stream_cost,
            min_fps=self.budget.floor_fps,
            default_width=default.width,
            default_height=default.height,
            default_fps=default.fps,
            default_steps=default.steps,
            default_passes=passes(default),
        )

    def _warm_pipeline(self, wait_s: float) -> int:
        """One stream of the serving defaults through the pipeline before serving (``gateway.pipeline_warmup``): what
        a request that sets nothing gets, unpaced, its latents dropped.  Returns the chunks it ran (0: skipped)."""
        try:
            cfg = resolve_config(
                pb.StreamConfig(prompt="warm-up"), defaults=self.defaults, model=self.model, decoders=self.decoders
            )
            spec = cfg.stream_spec(latent_channels=self.model.latent_channels, text_len=self.text_len)
            decoder = self.tiny_decoder if cfg.decoder == "tiny" else self.decoder
            return warm_pipeline(
                self.coordinator,
                spec=spec,
                text=self.encoder.encode("warm-up"),
                consumer_depth=decoder.depth(self.opts.buffer_chunks),
                wait_s=wait_s,
                decoder=cfg.decoder,
            )
        except Exception:  # noqa: BLE001 - a warm-up is never a reason not to serve
            logger.warning("pipeline warm-up failed; serving without it", exc_info=True)
            return 0

    def _warm_up(self, chunks: int = 4, sessions: int = 3) -> float:
        """Before serving: encode a prompt and decode ``chunks`` chunks of the default size through ``sessions`` decode
        sessions one after the other (every VAE part, in its own thread, as streams would), so that kernels are
        loaded and every compiled variant is built now rather than while a stream waits.  One session is not enough:
        on an H200 the first stream after a one-session warm-up still recompiled once (a 26 s stall at its second
        chunk), as the second stream did without any warm-up; from the third stream on nothing compiles."""
        start = time.perf_counter()
        self.encoder.encode("warm-up")
        sf = self.model.spatial_factor
        shape = (1, self.model.latent_channels, 1, self.defaults.height // sf, self.defaults.width // sf)
        local = [self.decoder] if isinstance(self.decoder, LocalDecoder) else []
        local += [self.tiny_decoder] if self.tiny_decoder is not None else []
        for decoder in local:
            for _ in range(sessions):
                session = decoder.open(chunks)
                try:
                    for c in range(chunks):
                        session.submit(SimpleNamespace(index=c), torch.randn(shape))
                    session.finish()
                    for _ in session.results():
                        pass
                finally:
                    session.close()
        took = time.perf_counter() - start
        logger.info(
            "gateway warmed up in %.1f s (text encoder; %d x %d VAE chunks of the default size)", took, sessions, chunks
        )
        return took

    def _measure_vae(self) -> VaeCost | None:
        """Time a steady-state chunk decode of the default size on every in-process VAE part (after the warm-up, if
        any): the slowest part's ms is what each chunk costs the busiest GPU (``gateway.vae_cost``).  Only a VAE on GPUs
        is measured: the model counts its share of the stage GPUs."""
        if not isinstance(self.decoder, LocalDecoder):
            return None  # VAE stages (--vae-stage) run elsewhere: not measured here
        if not any(part.device.type == "cuda" for part in self.decoder.parts):
            # The model counts the VAE's share of the stage GPUs; a VAE on the CPU takes none of it.
            logger.info("VAE on the CPU: its cost is not counted in the SLO model's stage GPU time")
            return None
        sf = self.model.spatial_factor
        shape = (
            1,
            self.model.latent_channels,
            self.defaults.chunk_frames,
            self.defaults.height // sf,
            self.defaults.width // sf,
        )
        try:
            cost = measure_vae(self.decoder.parts, shape)
        except Exception:  # noqa: BLE001 - a measurement for the SLO model, never a reason not to serve
            logger.warning("measuring the VAE's cost per chunk failed", exc_info=True)
            return None
        if cost is not None:
            logger.info(
                "VAE: %.2f ms per chunk of %s latents on the busiest device (%s; parts: %s ms)",
                cost.chunk_ms,
                "x".join(map(str, shape[2:])),
                cost.device,
                ", ".join(f"{ms:.2f}" for ms in cost.part_ms),
            )
        return cost

    def _latent_shape(self) -> tuple[int, ...]:
        """One chunk of the serving defaults' latents."""
        sf = self.model.spatial_factor
        return (
            1,
            self.model.latent_channels,
            self.defaults.chunk_frames,
            self.defaults.height // sf,
            self.defaults.width // sf,
        )

    def _warm_tiny(self) -> bool:
        """A tiny decoder on a GPU: every batch bucket's pass built (compiled with ``--vae-compile``) and timed before
        serving, the start-up ``batch_ms`` the coordinator hears.  Returns whether it was measured."""
        if self.tiny_decoder is None or self.tiny_decoder.part.device.type != "cuda":
            return False
        start = time.perf_counter()
        try:
            self.tiny_decoder.warm(self._latent_shape())
        except Exception:  # noqa: BLE001 - a measurement for the SLO model, never a reason not to serve
            logger.warning("warming and measuring the tiny decoder's batches failed", exc_info=True)
            return False
        self.warmup_s += time.perf_counter() - start
        return True

    def decoder_costs(self) -> list[VaeCost | None]:
        """What the reporter sends: the full VAE's measured cost, and the tiny decoder's as it stands now."""
        costs: list[VaeCost | None] = [self.vae_cost]
        if self.tiny_measured:
            costs.append(tiny_cost(self.tiny_decoder, self._latent_shape()))
        return costs

    def _decoder_memory(self) -> DecoderMemory:
        """The admission bound on decoder state (``--decoder-memory-gib``): each local decoder's one-stream state at
        the serving size (the VAE's as measured, else estimated; VAE stages hold theirs elsewhere)."""
        shape = self._latent_shape()
        per_stream: dict[str, int] = {}
        if isinstance(self.decoder, LocalDecoder):
            measured = self.vae_cost.state_bytes if self.vae_cost is not None else 0
            per_stream["full"] = measured or int(
                FULL_VAE_STATE_BYTES
                * DTYPES[self.opts.vae_dtype].itemsize
                / FULL_VAE_STATE_ITEMSIZE
                * (self.defaults.height * self.defaults.width)
                / (480 * 832)
            )
        if self.tiny_decoder is not None:
            per_stream["tiny"] = self.tiny_decoder.state_bytes_at((shape[-2], shape[-1]))
        devices = self.opts.vae_devices or [self.opts.device]
        return DecoderMemory.derive(
            devices[0],
            per_stream,
            (self.defaults.height, self.defaults.width),
            budget_gib=self.opts.decoder_memory_gib,
        )

    def start(self) -> None:
        if self.vae_reporter is not None:
            self.vae_reporter.start()
        self.server.start()
        if self.revocation is not None:
            self.revocation.start()
        if self.health_server is not None:
            self.health_server.start()
        self.metrics.serve(self.opts.metrics_port, self.opts.metrics_host or self.opts.host)
        set_serving(self.health, [SERVICE_NAME], True)
        logger.info(
            "gateway on %s -> coordinator %s (text_len=%d, VAE %s, decoders %s (default %s), cost budget %d "
            "pixels/frame and %.4g pixel-passes/s per stream: %s)",
            self.address,
            self.opts.coordinator,
            self.text_len,
            self.opts.vae_stage or "in process",
            "full, tiny" if self.decoders.tiny else "full",
            self.decoders.default,
            self.budget.max_frame_pixels,
            self.budget.max_stream_cost,
            self.budget.origin,
        )

    def stop(self, grace: float = 5.0) -> None:
        set_serving(self.health, [SERVICE_NAME], False)
        if self.health_server is not None:
            self.health_server.stop(0)
        self.server.stop(grace).wait()
        if self.vae_reporter is not None:
            self.vae_reporter.stop()
        self.channel.close()
        self.decoder.close()
        if self.tiny_decoder is not None:
            self.tiny_decoder.close()
        if self.revocation is not None:
            self.revocation.stop()
        self.timers.close()
        self.metrics.close()

    # ---- used by the streams -------------------------------------------------------------------------

    def input_encoder(self) -> StreamVAEEncoder:
        """The VAE encoder video-to-video streams share (each holds its own cache): the in-process decoder's VAE, or,
        when decoding happens in VAE stages, the checkpoint's VAE loaded here on first use."""
        with self._encoder_lock:
            if self._input_encoder is None:
                if isinstance(self.decoder, LocalDecoder):
                    vae = self.decoder.parts[0].vae
                else:
                    vae = StreamVAE.from_folder(
                        Path(self.opts.checkpoint) / "vae", dtype=DTYPES[self.opts.vae_dtype], device=self.opts.device
                    ).vae
                self._input_encoder = StreamVAEEncoder(vae)
            return self._input_encoder

    def encode_prompt(self, prompt: str, parent_span=None, field: str = "prompt") -> torch.Tensor:
        """The prompt's embeddings, timed in ``stagecast_gateway_prompt_encode_seconds`` and a ``text.encode`` span
        (under ``parent_span`` when tracing).  ``field`` "negative_prompt": it may be empty, and errors name it."""
        start_ns = time.time_ns()
        t0 = time.perf_counter()
        try:
            embeds, cached = self.encoder.encode_cached(prompt, allow_empty=field == "negative_prompt")
        except ValueError as exc:
            raise ConfigError(field, str(exc).removeprefix("prompt ")) from None
        seconds = time.perf_counter() - t0
        self.metrics.prompt_encoded(seconds, cached=cached)
        if telemetry.enabled():
            ctx = trace.set_span_in_context(parent_span) if parent_span is not None else None
            attrs = {"stagecast.text.cached": cached, "stagecast.text.len": self.text_len}
            span = telemetry.tracer().start_span("text.encode", context=ctx, attributes=attrs, start_time=start_ns)
            span.end(start_ns + int(seconds * 1e9))
        return embeds

    # ---- admission ---------------------------------------------------------------------------------

    def admit(self, cfg, client: str):
        """The client's stream quotas, then the admission chain; returns what gives everything back.  A gateway that
        is full says so, not that the client is over its quota (the default quota is the gateway's whole bound)."""
        with self.cond:
            if self.admitted >= self.opts.max_streams:
                raise self._too_many_streams()
        quota = self.quotas.take_stream(not cfg.pace, client)
        try:
            release = self.admission.admit(cfg)
        except BaseException:
            quota()
            raise

        def release_all() -> None:
            release()
            quota()

        return release_all

    def _count_cap(self, cfg) -> object:
        """The first admission check: at most ``max_streams`` streams, from admission until they are forgotten."""
        with self.cond:
            if self.admitted >= self.opts.max_streams:
                raise self._too_many_streams()
            self.admitted += 1
        return self._uncount

    def _too_many_streams(self) -> Refused:
        return Refused(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"too many streams: this gateway serves at most {self.opts.max_streams} at once (--max-streams)",
        )

    def _uncount(self) -> None:
        with self.cond:
            self.admitted -= 1

    def enter_pending(self) -> bool:
        """A Generate call starts waiting for its config; False when ``max_pending`` calls already are."""
        with self.cond:
            if self.pending >= self.opts.max_pending:
                return False
            self.pending += 1
            self._changed()
            return True

    def leave_pending(self) -> None:
        with self.cond:
            self.pending -= 1
            self._changed()

    def register(self, run: StreamRun, release) -> None:
        """An admitted stream is open; ``release`` (from admission) runs when it is forgotten."""
        with self.cond:
            self._releases[run.id] = release
            self.streams[run.id] = run
            self.started += 1
            self._changed()

    def forget(self, run: StreamRun) -> None:
        """The stream's pipeline side and VAE state are gone: it no longer counts against the limits."""
        with self.cond:
            if self.streams.pop(run.id, None) is None:
                return
            release = self._releases.pop(run.id)
            reason = run.outcome or "unknown"
            self.finished += 1
            self.ended_by_reason[reason] += 1
            self._changed()
        release()
        self.metrics.stream_ended(reason)
        logger.info("stream %s finished: %s, %d frames", run.id, reason, run.frames_emitted)

    def touch(self) -> None:
        with self.cond:
            self._changed()

    def _changed(self) -> None:
        self.version += 1
        self.cond.notify_all()

    # ---- status ------------------------------------------------------------------------------------

    def _runs(self) -> list[StreamRun]:
        with self.cond:
            return list(self.streams.values())

    def vae_state_bytes(self) -> int:
        return sum(_vae_bytes(run) for run in self._runs())

    def capacity(self) -> list[pb.Capacity]:
        """The coordinator's remaining capacity (streams at 16 FPS per step count), asked at most once a second;
        empty when it does not know stage times yet or cannot be reached in time."""
        now = time.monotonic()
        with self.cond:
            cached = getattr(self, "_capacity", None)
            if cached is not None and now - cached[0] < 1.0:
                return list(cached[1])
        try:
            status = self.coordinator.Status(ipb.Empty(), timeout=1.0)
            out = [pb.Capacity(steps=c.steps, streams=c.streams) for c in status.capacity]
        except grpc.RpcError:
            out = []
        with self.cond:
            self._capacity = (now, out)
        return list(out)

    def status(self, who: Principal | None = None) -> pb.GatewayStatus:
        """The gateway's state as ``who`` may see it: a tenant sees only its own streams (and no totals or
        internal addresses); an admin or status token, or anyone on a gateway without tokens, sees everything."""
        everything = who is None or who.sees_all
        with self.cond:
            runs = [run for run in self.streams.values() if everything or getattr(run, "tenant", None) == who.tenant]
            msg = pb.GatewayStatus(
                active_streams=len(runs), max_streams=self.opts.max_streams, cost_budget=self.cost_budget
            )
            if everything:
                msg.streams_started = self.started
                msg.streams_finished = self.finished
                msg.ended_by_reason.update(self.ended_by_reason)
                msg.coordinator = self.opts.coordinator
                msg.waiting_calls = self.pending
        for run in runs:
            msg.streams.add(
                stream_id=run.id,
                pipeline_stream_id=run.pipeline_id,
                state=api.state_value(run.state),
                frames_sent=run.frames_sent,
                chunks_received=run.chunks_received,
                steps=run.last_steps,
                paced=run.cfg.pace,
                vae_state_bytes=_vae_bytes(run),
                queued_chunks=run.session.queued if run.session is not None else 0,
                queued_messages=len(run.out),
                input_frames_received=run.input.received if run.input is not None else 0,
                input_frames_dropped=run.input.dropped if run.input is not None else 0,
            )
        msg.vae_state_bytes = sum(s.vae_state_bytes for s in msg.streams)
        msg.paced_streams = sum(1 for s in msg.streams if s.paced)
        msg.unpaced_streams = len(msg.streams) - msg.paced_streams
        return msg


def _vae_bytes(run: StreamRun) -> int:
    """The stream's VAE caches: its decode session's, and a video-to-video stream's encoder cache and queued input."""
    session = run.session
    held = 0 if session is None else session.state_bytes
    if run.input is not None:
        held += run.input.state_bytes
    return held


_TIMED_OUT = object()
_NO_MESSAGE = object()


def _read_first(request_iterator, box: queue.SimpleQueue) -> None:
    """Reads the first request (bytes) into ``box`` in a thread of its own, so that the handler can stop waiting."""
    try:
        box.put(next(request_iterator))
    except StopIteration:
        box.put(_NO_MESSAGE)
    except Exception as exc:  # the call ended (cancelled, or aborted when its deadline passed)
        box.put(exc)


def _parsed(request_iterator):
    """The call's later requests as ClientMessages; raises ``ConfigError`` at bytes that are not one and
    ``RequestTooLarge`` at a message other than an input frame over ``MAX_REQUEST_BYTES`` (the server's own limit
    leaves room for a raw frame)."""
    for data in request_iterator:
        msg = parse_client_message(data)
        if len(data) > MAX_REQUEST_BYTES and msg.WhichOneof("msg") != "frame":
            raise RequestTooLarge(
                "request", f"{len(data)} bytes; a message other than an input frame is at most {MAX_REQUEST_BYTES}"
            )
        yield msg


def _add_stream_service(servicer: StreamServicer, server: grpc.Server) -> None:
    """Registers StreamService with handlers that take the request bytes (``request_deserializer=None``) and parse
    them: a sync grpc server answers INTERNAL (and logs a traceback) for bytes its deserializer cannot decode."""
    handlers = {
        "Generate": grpc.stream_stream_rpc_method_handler(
            servicer.Generate, response_serializer=pb.ServerMessage.SerializeToString
        ),
        "GetStatus": grpc.unary_unary_rpc_method_handler(
            servicer.GetStatus, response_serializer=pb.GatewayStatus.SerializeToString
        ),
        "WatchStatus": grpc.unary_stream_rpc_method_handler(
            servicer.WatchStatus, response_serializer=pb.GatewayStatus.SerializeToString
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))


class StreamServicer:
    """``stagecast.v1.StreamService``; every method takes the request's bytes (see ``_add_stream_service``)."""

    def __init__(self, gw: Gateway):
        self.gw = gw

    def Generate(self, request_iterator, context):
        with telemetry.server_span(f"{SERVICE_NAME}/Generate", context, target=self.gw.address) as span:
            yield from self._generate(request_iterator, context, span)

    def _first_message(self, request_iterator, context) -> pb.ClientMessage | None:
        """The call's first message, parsed; ends the call if none comes in time (None: the client already left)."""
        gw = self.gw
        try:  # the client's own quota first: a client over it takes no slot of the global bound
            give_back = gw.quotas.take("pending", client_of(gw.auth, context))
        except Refused as exc:
            self._abort(context, exc.code, exc.message)
        if not gw.enter_pending():
            give_back()
            self._abort(
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"too many calls waiting for their config: this gateway holds at most {gw.opts.max_pending} "
                "(--max-pending); send the config as the first message",
            )
        try:
            box: queue.SimpleQueue = queue.SimpleQueue()
            threading.Thread(target=_read_first, args=(request_iterator, box), daemon=True, name="config").start()
            try:
                first = box.get(timeout=gw.opts.config_timeout)
            except queue.Empty:
                first = _TIMED_OUT
        finally:
            gw.leave_pending()
            give_back()
        if first is _TIMED_OUT:
            self._abort(
                context,
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"config: none arrived within {gw.opts.config_timeout:g} s of the call's start (--config-timeout)",
            )
        if first is _NO_MESSAGE:
            self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, "config: the client sent no message; send a config")
        if isinstance(first, Exception):
            logger.debug("call ended before its config: %s", first)
            return None
        try:
            msg = parse_client_message(first)
        except ConfigError as exc:
            if len(first) > MAX_REQUEST_BYTES:
                self._abort(
                    context, grpc.StatusCode.RESOURCE_EXHAUSTED, f"request: {len(first)} bytes that are not a config"
                )
            self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        # A config is at most MAX_REQUEST_BYTES besides its first-frame image (bounded by the server's own limit).
        if len(first) - len(msg.config.image) > MAX_REQUEST_BYTES:
            self._abort(
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"request: {len(first)} bytes; a config is at most {MAX_REQUEST_BYTES} besides its image",
            )
        return msg

    def _generate(self, request_iterator, context, rpc_span):
        t0 = time.monotonic()
        gw = self.gw
        first = self._first_message(request_iterator, context)
        if first is None:
            return
        kind = first.WhichOneof("msg")
        if kind != "config":
            self._abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"config: the first message must be a config, got {kind or 'an empty message'}",
            )
        try:
            cfg = resolve_config(first.config, defaults=gw.defaults, model=gw.model, decoders=gw.decoders)
        except ConfigError as exc:
            self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        try:
            release = gw.admit(cfg, client_of(gw.auth, context))
        except Refused as exc:
            self._abort(context, exc.code, exc.message)
        run = self._open(cfg, context, t0, rpc_span, release)
        run.tenant = principal_of(gw.auth, context).tenant  # whose stream: status shows it to its tenant only
        run.credentials = credentials_of(context) if gw.auth else None  # checked again while it runs (revocation)
        gw.register(run, release)
        if not context.add_callback(run.on_rpc_done):
            run.on_rpc_done()  # the client left while we were opening
        run.start(_parsed(request_iterator))
        logger.info(
            "stream %s (pipeline %d): %dx%d, %s frames, codec %s, %s decoder",
            run.id,
            run.pipeline_id,
            cfg.width,
            cfg.height,
            cfg.total_frames or "unbounded",
            cfg.codec,
            cfg.decoder,
        )
        try:
            yield from run.messages()
        except StreamFailed as exc:
            self._abort(context, exc.code, exc.message)

    def _open(self, cfg, context, t0: float, rpc_span, release) -> StreamRun:
        """Encode the prompt and open the pipeline stream; on failure give back what admission took and end the call."""
        gw = self.gw
        retry_after = None  # a capacity refusal's retry delay, from the coordinator's status details
        try:
            text = gw.encode_prompt(cfg.prompt, parent_span=rpc_span)
            negative = None
            if cfg.guidance_scale > 1.0:
                negative = gw.encode_prompt(cfg.negative_prompt, parent_span=rpc_span, field="negative_prompt")
            run = StreamRun(gw.stream_host, cfg, text, context, t0, parent_span=rpc_span, negative_text=negative)
            run.open_pipeline()
            return run
        except ConfigError as exc:
            code, message = grpc.StatusCode.INVALID_ARGUMENT, str(exc)
        except grpc.RpcError as exc:
            code, message = exc.code(), f"pipeline (coordinator {gw.opts.coordinator}): {exc.details()}"
            retry_after = retry_after_of(exc)  # a capacity refusal's retry delay reaches the client
        except StreamFailed as exc:
            code, message = exc.code, exc.message
        release()
        self._abort(context, code, message, retry_after)

    def _abort(self, context, code: grpc.StatusCode, message: str, retry_after: float | None = None):
        self.gw.metrics.rejected(code.name)
        logger.info("call ended with %s: %s", code.name, message)
        abort_with_retry(context, code, message, retry_after or 0.0)

    def GetStatus(self, request: bytes, context):
        try:
            parse_status_request(request)
        except ConfigError as exc:
            self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        msg = self.gw.status(principal_of(self.gw.auth, context))
        msg.capacity.extend(self.gw.capacity())
        return msg

    def WatchStatus(self, request: bytes, context):
        gw = self.gw
        try:
            parse_status_request(request)
        except ConfigError as exc:
            self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        who = principal_of(gw.auth, context)
        try:
            give_back = gw.quotas.take("watchers", client_of(gw.auth, context))
        except Refused as exc:
            self._abort(context, exc.code, exc.message)
        try:
            yield from self._watch(who, context)
        finally:
            give_back()

    def _watch(self, who, context):
        gw = self.gw
        done = threading.Event()

        def on_done():
            done.set()
            gw.touch()

        context.add_callback(on_done)
        seen = [-1]  # a cell, so the predicate sees the current value
        while True:
            with gw.cond:
                gw.cond.wait_for(lambda: gw.version != seen[0] or done.is_set())
                if done.is_set():
                    return
                seen[0] = gw.version
            yield gw.status(who)


def serve(opts: GatewayOptions, stop: threading.Event | None = None) -> None:
    telemetry.init("gateway")  # before the Gateway: loading the models is traced too (init is idempotent)
    gw = Gateway(opts)

    def start() -> dict:
        gw.start()
        return {"address": gw.address, **({"health_address": gw.health_address} if gw.health_address else {})}

    serve_lifecycle("gateway", start, gw.stop, stop, role="gateway")
