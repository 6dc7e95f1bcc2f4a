"""The gateway process: the public ``stagecast.v1.StreamService`` in front of a coordinator.

Run with ``stagecast gateway --coordinator HOST:PORT --checkpoint DIR [--port 50051] [--max-streams 8]``, or::

    gw = Gateway(GatewayOptions(coordinator="127.0.0.1:50050", checkpoint="/models/Wan2.1-T2V-1.3B-Diffusers"))
    gw.start(); ...; gw.stop()

The gateway encodes prompts (UMT5, cached per prompt), opens one coordinator stream per client stream, decodes the
finished latent chunks with a per-stream StreamVAE cache (in this process, or in a chain of ``stagecast vae-stage``
processes with ``--vae-stage``) and encodes frames (``gateway.stream.run`` holds the per-stream machinery and its
buffering policy).  Errors that end a call are gRPC status codes: INVALID_ARGUMENT names the bad
field (or says the request bytes are not a message), RESOURCE_EXHAUSTED means this gateway's ``--max-streams`` (or
the coordinator's own limit, passed through), its per-stream cost budget (``gateway.edge.admission``), too many calls
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

import logging
import threading
import time
from pathlib import Path

import torch
from opentelemetry import trace

from gateway.checkpoint import ModelInfo, ServingDefaults
from gateway.decode.decoder import encode_gate
from gateway.decode.vae_cost import VaeReporter
from gateway.decode.vae_graphs import MAX_SLOTS as MAX_GRAPH_SLOTS
from gateway.edge.admission import CostBudget
from gateway.edge.agent import Fleet, sigterm_drains
from gateway.edge.client_identity import ClientIdentity
from gateway.edge.config import MAX_REQUEST_BYTES, ConfigError
from gateway.edge.handlers import StreamParts, StreamServicer, add_stream_service
from gateway.edge.quotas import Quotas
from gateway.edge.revocation import RevocationWatch
from gateway.edge.status import StartingFront, StatusReport, describe_budget
from gateway.edge.stream_table import StreamTable
from gateway.metrics import GatewayMetrics
from gateway.models import GatewayModels
from gateway.options import GatewayOptions
from gateway.stream.run import StreamHost, StreamLimits
from gateway.stream.timers import Timers
from gateway.stream.warmup import wait_budget, wait_ready
from stagecast import telemetry
from stagecast.grpc_util import (
    HEALTH_WATCH,
    MAX_MESSAGE_BYTES,
    RECONNECT_OPTIONS,
    REFLECTION_STREAMS,
    ConcurrencyLimits,
    make_health_server,
    make_server,
    reconnected,
    set_serving,
)
from stagecast.internal.v1 import pipeline_pb2_grpc as ipb_grpc
from stagecast.names import STREAM_SERVICE
from stagecast.security import TokenAuth, connect, server_tls
from stagecast.service import serve_lifecycle
from stagecast.startup import Startup

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


class Gateway:
    """The gateway process: its options, its parts, its servers, and what a stream needs from it.

    The parts, each an object with its own state:

    - ``models`` (``gateway.models.GatewayModels``): the text encoder, the decoders and the input encoder, built,
      warmed and measured at start-up;
    - ``table`` (``gateway.edge.stream_table.StreamTable``): the streams held and the calls waiting, admission,
    counters;
    - ``report`` (``gateway.edge.status.StatusReport``): what GetStatus and WatchStatus say, the coordinator's capacity;
    - the handlers (``gateway.edge.handlers.StreamServicer``), and ``stream_host``: what each
    ``gateway.stream.run.StreamRun``
      is given.
    """

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
        self.channel = connect(opts.coordinator, opts.mtls, "coordinator", RECONNECT_OPTIONS)  # it may restart
        self.coordinator = ipb_grpc.CoordinatorServiceStub(self.channel)
        wait_s = wait_budget(opts.pipeline_warmup_s, opts.device)
        budget = CostBudget.derive(
            self.defaults,
            opts.device,  # the device kind decides the headroom (the VAE's devices are of the same kind)
            max_frame_pixels=opts.max_frame_pixels,
            max_stream_cost=opts.max_stream_cost,
        )
        # The port serves from here on: health NOT_SERVING, and GetStatus/WatchStatus the start-up steps, while the
        # models load (minutes on a GPU); Generate is refused UNAVAILABLE until start().
        self.startup = Startup("gateway")
        self._build_servers(budget)
        self.server.start()
        if self.health_server is not None:
            self.health_server.start()
        try:
            self._load(wait_s, budget)
        except BaseException:
            self._stop_servers(0)
            raise

    def _load(self, wait_s: float, budget: CostBudget) -> None:
        """The models (text encoder, decoders: warmed, graphed, measured), the pipeline warm-up, and the parts that
        hold streams."""
        opts, root = self.opts, Path(self.opts.checkpoint)
        self.models = GatewayModels(
            opts,
            root,
            defaults=self.defaults,
            model=self.model,
            text_len=self.text_len,
            timers=self.timers,
            before_measure=(lambda: self._wait_pipeline(wait_s)) if wait_s > 0 else None,
            startup=self.startup,
        )
        # Each decoder's measured cost goes to the coordinator's SLO model (unless its operator fixed one); the tiny
        # decoder's again whenever its served batches move it.
        self.vae_reporter = (
            VaeReporter(self.coordinator, self.models.decoder_costs)
            if self.models.vae_cost is not None or self.models.tiny_measured
            else None
        )
        self.pipeline_warmup_chunks = (
            self.models.warm_pipeline(self.coordinator, wait_s, opts.buffer_chunks) if wait_s > 0 else 0
        )
        if wait_s > 0:
            self.startup.step("pipeline_warm_up", detail=f"{self.pipeline_warmup_chunks} chunks")
        self.metrics = GatewayMetrics(
            active=lambda: len(self.table.streams),
            vae_bytes=lambda: self.table.vae_state_bytes(),
            queued_chunks=lambda: sum(run.session.queued for run in self.table.runs() if run.session is not None),
            queued_messages=lambda: sum(len(run.out) for run in self.table.runs()),
            waiting_calls=lambda: self.table.pending,
            slots_free=lambda: self.fleet.slots.free,
            slots=lambda: self.fleet.slots.total,
            tiny_formed_batch=self._tiny_formed_batch,
        )
        self.encode_gate = encode_gate()  # prompts and frames: a paced stream's encodes first (gateway.decode.decoder)
        self.table = StreamTable(
            max_streams=opts.max_streams,
            max_pending=opts.max_pending,
            max_unpaced=opts.max_unpaced,
            budget=budget,
            decoder_memory=self.models.decoder_memory(),
            quotas=Quotas(opts.quotas, opts.max_streams),  # per client, within the global bounds (gateway.edge.quotas)
            metrics=self.metrics,
        )
        # The pipeline's name, its free slots for a door (--agent-port), and drain (gateway.edge.agent).
        self.fleet = Fleet(opts.fleet, self.coordinator, host=opts.host, streams=self.table.door_streams)
        self.table.admission.checks.insert(0, self.fleet.refuse_while_draining)
        self.report = StatusReport(
            self.table,
            self.coordinator,
            max_streams=opts.max_streams,
            coordinator_target=opts.coordinator,
            cost_budget=describe_budget(budget, self.defaults, self.model),
            fleet=self.fleet,
            startup=self.startup,
        )
        # Everything a stream needs from this gateway, and nothing more (gateway.stream.run).
        self.stream_host = StreamHost(
            coordinator=self.coordinator,
            coordinator_target=opts.coordinator,
            reconnected=lambda: reconnected(self.channel),
            decoders=self.models.by_kind(),
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
            input_encoder=self.models.input_encoder,
            temporal_factor=self.model.temporal_factor,
            touch=self.table.touch,
            forget=self.table.forget,
            pipeline=self.fleet.name,
            encode_gate=self.encode_gate,
        )
        # A revoked token ends the streams it opened (gateway.edge.revocation).
        self.revocation = RevocationWatch(self.auth, self.table.runs, self.timers) if self.auth else None

    def _tiny_formed_batch(self) -> float:
        models = getattr(self, "models", None)  # scraped before the models load: none yet
        tiny = None if models is None else models.tiny_decoder
        return 0.0 if tiny is None else tiny.formed_batch()

    def _wait_pipeline(self, wait_s: float) -> None:
        """Before the decoders' costs are measured: wait (within the warm-up budget) until the coordinator reports its
        pipeline ready, so the stages' calibration at READY and these measurements do not share the GPU."""
        start = time.monotonic()
        if wait_ready(self.coordinator, start + wait_s, clock=time.monotonic, stop=threading.Event()) is None:
            logger.warning("the pipeline was not ready within %.0f s: measuring the decoders beside it", wait_s)
            self.startup.step("pipeline", 0, 1, detail=f"not ready within {wait_s:.0f} s")
        else:
            logger.info("waited %.1f s for the pipeline before measuring the decoders", time.monotonic() - start)
            self.startup.step("pipeline", detail=f"ready after {time.monotonic() - start:.1f} s")

    def _build_servers(self, budget: CostBudget) -> None:
        """The public server (tokens, then the concurrency limits), and health on a port of its own if asked."""
        opts = self.opts
        self.auth = TokenAuth(opts.tokens, generate_methods=[f"/{SERVICE_NAME}/Generate"]) if opts.tokens else None
        self.identity = ClientIdentity(self.auth, opts.trusted_proxy)  # whose quotas a call counts against
        self.front = StartingFront(self)  # the servicer's calls once start() opens it
        streaming = {WATCH_STATUS: opts.max_watchers, HEALTH_WATCH: opts.max_watchers}
        streaming.update(dict.fromkeys(REFLECTION_STREAMS, opts.max_watchers))
        self.limits = ConcurrencyLimits(streaming)
        # A handler thread per stream and per call waiting for its config, one per bounded streaming call, and
        # headroom: every call that can stay open is bounded below the pool's size.
        workers = opts.max_streams + opts.max_pending + self.limits.total() + HEADROOM_THREADS
        self.server, self.health, self.port = make_server(
            opts.port,
            [(add_stream_service, self.front, SERVICE_NAME)],
            host=opts.host,
            max_workers=workers,
            options=public_options(budget.max_frame_pixels),
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

    def start(self) -> None:
        """Serve: the servers already answer (since the constructor); now Generate is open and health SERVING."""
        self.fleet.start()
        if self.vae_reporter is not None:
            self.vae_reporter.start()
        if self.revocation is not None:
            self.revocation.start()
        self.metrics.serve(self.opts.metrics_port, self.opts.metrics_host or self.opts.host)
        self.front.open(StreamServicer(self.stream_parts()))
        set_serving(self.health, [SERVICE_NAME], True)
        budget = self.table.budget
        logger.info(
            "gateway on %s -> coordinator %s (text_len=%d, VAE %s, decoders %s (default %s), cost budget %d "
            "pixels/frame and %.4g pixel-passes/s per stream: %s)",
            self.address,
            self.opts.coordinator,
            self.text_len,
            self.opts.vae_stage or "in process",
            "full, tiny" if self.models.decoders.tiny else "full",
            self.models.decoders.default,
            budget.max_frame_pixels,
            budget.max_stream_cost,
            budget.origin,
        )

    def _stop_servers(self, grace: float) -> None:
        set_serving(self.health, [SERVICE_NAME], False)
        if self.health_server is not None:
            self.health_server.stop(0)
        self.server.stop(grace).wait()

    def stop(self, grace: float = 5.0) -> None:
        self._stop_servers(grace)
        if self.vae_reporter is not None:
            self.vae_reporter.stop()
        self.fleet.stop()
        self.channel.close()
        self.models.close()
        if self.revocation is not None:
            self.revocation.stop()
        self.timers.close()
        self.metrics.close()

    def drain_then_stop(self, drain) -> None:
        """Wait for SIGTERM's drain request, drain (``gateway.edge.agent.Fleet.drain``), then stop as SIGTERM does."""
        drain.requested.wait()
        ended = self.fleet.drain(self.table)
        logger.info("drained (%d streams ended by the --drain-s bound); stopping", ended)
        drain.finish()

    def stream_parts(self) -> StreamParts:
        """What the public StreamService serves with (``gateway.edge.handlers.StreamServicer``), once the models are
        up."""
        return StreamParts(
            table=self.table,
            identity=self.identity,
            report=self.report,
            stream_host=self.stream_host,
            metrics=self.metrics,
            auth=self.auth,
            defaults=self.defaults,
            model=self.model,
            decoders=self.models.decoders,
            encode_prompt=self.encode_prompt,
            address=self.address,
            pipeline_name=self.fleet.name,
            coordinator=self.opts.coordinator,
            config_timeout=self.opts.config_timeout,
            max_pending=self.opts.max_pending,
            text_shape=(1, self.models.encoder.max_len, self.models.encoder.d_model),
        )

    def encode_prompt(self, prompt: str, parent_span=None, field: str = "prompt", paced: bool = True) -> torch.Tensor:
        """The prompt's embeddings, timed in ``stagecast_gateway_prompt_encode_seconds`` and a ``text.encode`` span
        (under ``parent_span`` when tracing).  ``field`` "negative_prompt": it may be empty, and errors name it.
        Encodes pass the encode gate: a paced stream's prompt goes before an unpaced stream's waiting one."""
        start_ns = time.time_ns()
        t0 = time.perf_counter()
        try:
            with self.encode_gate.yielding(paced):  # paced prompts still batch together (gateway.text_encoder)
                embeds, cached = self.models.encoder.encode_cached(prompt, allow_empty=field == "negative_prompt")
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


def serve(opts: GatewayOptions, stop: threading.Event | None = None, drain=None) -> None:
    """``drain``: a ``gateway.edge.agent.DrainSignal`` (SIGTERM drains); None: one is installed with --agent-port when
    called on the main thread with a ``stop`` (``stagecast gateway``)."""
    telemetry.init("gateway")  # before the Gateway: loading the models is traced too (init is idempotent)
    if drain is None and opts.fleet.agent_port is not None and stop is not None:
        if threading.current_thread() is threading.main_thread():  # behind a door, SIGTERM drains (gateway.edge.agent)
            drain = sigterm_drains(stop)
    gw = Gateway(opts)

    def start() -> dict:
        gw.startup.ready()
        gw.start()
        if drain is not None:
            threading.Thread(target=gw.drain_then_stop, args=(drain,), daemon=True, name="drain").start()
        info = {"address": gw.address, **({"health_address": gw.health_address} if gw.health_address else {})}
        return {**info, **({"agent_address": gw.fleet.agent_address} if gw.fleet.agent_address else {})}

    serve_lifecycle("gateway", start, gw.stop, stop, role="gateway")
