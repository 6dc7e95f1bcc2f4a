"""The coordinator process: stage registry, rendezvous store, and the gRPC face of the pipeline engine.

Run with ``stagecast coordinator --stages K [--partition 8,12,12,8] --mtls DIR``.  It serves the store the stages
rendezvous on (``coordinator.rendezvous``, one key prefix per generation) on its own mTLS gRPC port, answers
``Register``, and serves ``OpenStream``/``StopStream``/``UpdatePrompt`` to the gateway (and to an operator's
``stagecast selftest``).  Each method admits only the roles that need it (``ROLE_RULES``).  Its health
service reports the service ``stagecast.internal.v1.CoordinatorService`` SERVING only while a generation
is formed, so readiness probes and callers can wait on it.
"""

from __future__ import annotations

import logging
import math
import threading

import grpc

from coordinator import rendezvous
from coordinator.engine import PipelineEngine
from coordinator.errors import AdmissionError, StreamError, StreamFailure
from coordinator.holds import HOLD_S
from coordinator.options import CoordinatorOptions
from coordinator.registry import RegistrationError, StageRegistry
from coordinator.requests import OpenRequest
from coordinator.slo import VaeReport
from stagecast import telemetry, wire
from stagecast.grpc_util import CHANNEL_OPTIONS, make_server, serve_health, set_serving
from stagecast.internal.v1 import pipeline_pb2 as pb
from stagecast.internal.v1 import pipeline_pb2_grpc as pb_grpc
from stagecast.internal.v1 import rendezvous_pb2_grpc as rpb_grpc
from stagecast.names import COORDINATOR_SERVICE
from stagecast.security import MTLS, RoleGuard, connect
from stagecast.service import serve_lifecycle

logger = logging.getLogger(__name__)
SERVICE_NAME = COORDINATOR_SERVICE
MAX_STARTUP_STEPS = 32  # a stage's start-up names a handful (stagecast.startup)
_STREAMS = ["gateway"]  # streams are opened, steered and watched by the gateway (and an operator)
ROLE_RULES = {
    f"/{SERVICE_NAME}/Register": ["stage"],
    f"/{SERVICE_NAME}/Heartbeat": ["stage"],
    f"/{SERVICE_NAME}/ReportStartup": ["stage"],
    f"/{SERVICE_NAME}/Reserve": _STREAMS,
    f"/{SERVICE_NAME}/Release": _STREAMS,
    f"/{SERVICE_NAME}/OpenStream": _STREAMS,
    f"/{SERVICE_NAME}/StopStream": _STREAMS,
    f"/{SERVICE_NAME}/UpdatePrompt": _STREAMS,
    f"/{SERVICE_NAME}/Consumed": _STREAMS,
    f"/{SERVICE_NAME}/ReportVaeCost": _STREAMS,
    f"/{SERVICE_NAME}/SubmitInput": _STREAMS,
    f"/{SERVICE_NAME}/Status": _STREAMS,
    f"/{SERVICE_NAME}/GetPlan": [],
    f"/{rendezvous.SERVICE_NAME}/": ["stage"],
}


class CoordinatorServicer(pb_grpc.CoordinatorServiceServicer):
    def __init__(self, registry: StageRegistry, engine: PipelineEngine, mtls: MTLS | None = None):
        self.registry = registry
        self.engine = engine
        self.mtls = mtls
        self.address = ""  # server.address of the RPC spans, once bound
        # Each stage's start-up as it last reported it, by rank (ClusterStatus.startup); a restart's replaces it.
        self._startup: dict[int, pb.StartupProgress] = {}
        self._startup_lock = threading.Lock()

    def Register(self, request: pb.RegisterRequest, context):
        try:
            rec = self._register(request)
        except RegistrationError as exc:
            if exc.code != grpc.StatusCode.ALREADY_EXISTS or not self._holder_is_gone(request.index):
                context.abort(exc.code, str(exc))
            # The previous holder of this index is dead: its replacement takes over.
            self.engine.fail(f"stage {request.index} was replaced", lost=request.index)
            try:
                rec = self._register(request)
            except RegistrationError as again:
                context.abort(again.code, str(again))
        logger.info("stage %d registered from %s (layers %s)", rec.index, rec.address, rec.layers)
        self.engine.on_registered(rec)
        return pb.RegisterReply(
            max_batch=self.engine.max_batch,
            world_size=self.registry.world_size,
            layer_start=rec.layers.start,
            layer_stop=rec.layers.stop,
            generation=self.engine.generation,
        )

    def Heartbeat(self, request: pb.HeartbeatRequest, context):
        rejoin, reason = self.engine.heartbeat(request.index, request.address, request.generation)
        if rejoin:
            logger.info("stage %d (%s) must register again: %s", request.index, request.address, reason)
        return pb.HeartbeatReply(rejoin=rejoin, reason=reason, generation=self.engine.generation)

    def _register(self, request: pb.RegisterRequest):
        return self.registry.register(
            index=request.index,
            address=request.address,
            config_json=request.model_config_json,
            expected_world_size=request.expected_world_size,
            device=request.device,
            sp=request.sp,
        )

    def _holder_is_gone(self, index: int) -> bool:
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        rec = self.registry.get(index)
        if rec is None:
            return True
        try:
            with connect(rec.address, self.mtls, "stage") as ch:
                health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2.0)
            return False
        except grpc.RpcError:
            return True

    def Reserve(self, request: pb.ReserveRequest, context):
        with telemetry.server_span(f"{SERVICE_NAME}/Reserve", context, target=self.address, only_child=True):
            try:
                hold = self.engine.admitter.reserve(OpenRequest.for_hold(request))
            except ValueError as exc:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            except AdmissionError as exc:
                exc.abort(context)  # a capacity refusal carries its retry delay in the status details
            return pb.ReserveReply(hold=hold, hold_s=HOLD_S)

    def Release(self, request: pb.ReserveReply, context):
        self.engine.admitter.release(request.hold[:64])
        return pb.Empty()

    def OpenStream(self, request: pb.OpenStreamRequest, context):
        method = f"{SERVICE_NAME}/OpenStream"
        with telemetry.server_span(method, context, target=self.address, traceparent=request.traceparent) as span:
            yield from self._open_stream(request, context, span)

    def _open_stream(self, request: pb.OpenStreamRequest, context, span):
        try:
            # Plan events and batch spans refer to this call's span: the coordinator's side of the stream.
            session = self.engine.open(OpenRequest.from_proto(request, telemetry.traceparent_of(span)), request.hold)
            if span is not None:
                span.set_attribute("stagecast.stream.id", session.id)
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except AdmissionError as exc:
            exc.abort(context)  # a capacity refusal carries its retry delay in the status details

        def on_done():
            if not session.ended:
                # The caller went away: nothing more is planned for the stream, and its close frees its
                # state on every stage once the batches already planned have run.
                try:
                    self.engine.cancel_stream(session.id)
                except StreamError:
                    pass

        if not context.add_callback(on_done):
            on_done()  # the caller left before the callback could be added
        for ev in session.iter_events():
            if isinstance(ev, StreamFailure):
                context.abort(ev.code, ev.message)
            yield ev
            if ev.HasField("chunk"):
                # gRPC flow control holds this generator while the consumer is not reading, so for a consumer that
                # does not acknowledge, counting here paces the stream's scheduling by delivery.  (It paces loosely:
                # gRPC's buffers take several chunks; a consumer that acknowledges holds the lead exactly.)
                self.engine.delivered(session)

    def StopStream(self, request: pb.StopRequest, context):
        with telemetry.server_span(f"{SERVICE_NAME}/StopStream", context, target=self.address, only_child=True) as span:
            if span is not None:
                span.set_attribute("stagecast.stream.id", request.stream_id)
            try:
                self.engine.stop_stream(request.stream_id)
            except StreamError as exc:
                context.abort(exc.code, str(exc))
            return pb.Empty()

    def UpdatePrompt(self, request: pb.PromptUpdate, context):
        method = f"{SERVICE_NAME}/UpdatePrompt"
        with telemetry.server_span(method, context, target=self.address, only_child=True) as span:
            if span is not None:
                span.set_attribute("stagecast.stream.id", request.stream_id)
            try:
                self.engine.update_prompt(
                    request.stream_id, wire.tensor_from_proto(request.text), recache=request.recache
                )
            except ValueError as exc:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            except StreamError as exc:
                context.abort(exc.code, str(exc))
            return pb.Empty()

    def Consumed(self, request: pb.ChunksConsumed, context):
        try:
            self.engine.consumed(request.stream_id, request.chunks)
        except StreamError as exc:
            context.abort(exc.code, str(exc))
        return pb.Empty()

    def ReportVaeCost(self, request: pb.VaeCost, context):
        if not (math.isfinite(request.chunk_ms) and 0 < request.chunk_ms < 1e5):
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"chunk_ms: must be in (0, 100000) ms, got {request.chunk_ms}"
            )
        if not 0 <= request.parts <= 1024:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"parts: must be in [0, 1024], got {request.parts}")
        where = f" ({request.parts} part(s), the slowest on {request.device[:64]})" if request.parts else ""
        try:
            report = VaeReport(
                request.decoder,
                request.chunk_ms,
                tuple(request.batch_ms),
                request.state_bytes,
                request.formed_batch,
                on_cpu=request.device.startswith("cpu"),
            )
            self.engine.report_vae(report, where)
        except ValueError as exc:  # names the field: decoder, batch_ms[i], state_bytes, formed_batch
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return pb.Empty()

    def SubmitInput(self, request: pb.InputLatents, context):
        try:
            latents = wire.tensor_from_proto(request.latents)
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"latents: {exc}")
        try:
            self.engine.submit_input(request.stream_id, request.chunk, latents)
        except StreamError as exc:
            context.abort(exc.code, str(exc))
        return pb.Empty()

    def GetPlan(self, request, context):
        if not self.engine.record_plan:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "start the coordinator with --record-plan")
        return pb.PlanDump(events=self.engine.recorded_plan())

    def Status(self, request, context):
        status = self.engine.status()
        with self._startup_lock:
            status.startup.extend(self._startup[index] for index in sorted(self._startup))
        return status

    def ReportStartup(self, request: pb.StartupProgress, context):
        if not 0 <= request.index < self.registry.ranks:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"index: no stage rank {request.index}")
        if len(request.steps) > MAX_STARTUP_STEPS:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"steps: at most {MAX_STARTUP_STEPS}")
        with self._startup_lock:
            self._startup[request.index] = request
        return pb.Empty()


class Coordinator:
    """A running coordinator (store + engine + gRPC server)."""

    def __init__(self, opts: CoordinatorOptions):
        self.opts = opts
        self.store = rendezvous.RendezvousServicer()
        self.registry = StageRegistry(opts.stages, opts.partition, sp=opts.sp, cfg_parallel=opts.cfg_parallel)
        self.engine = PipelineEngine(
            self.registry,
            opts,
            connect=lambda address: connect(address, opts.mtls, "stage", CHANNEL_OPTIONS),
            on_ready_change=self._on_ready,
        )
        servicer = CoordinatorServicer(self.registry, self.engine, opts.mtls)
        self.server, self.health, self.port = make_server(
            opts.port,
            [
                (pb_grpc.add_CoordinatorServiceServicer_to_server, servicer, SERVICE_NAME),
                (rpb_grpc.add_RendezvousServiceServicer_to_server, self.store, rendezvous.SERVICE_NAME),
            ],
            host=opts.host,
            # Stages block in the store's Get/Wait while a group forms: room for them beside the streams.
            max_workers=64 + 2 * opts.stages * opts.sp * opts.cfg_parallel,
            credentials=opts.mtls.server_credentials() if opts.mtls else None,
            interceptors=[RoleGuard(ROLE_RULES)] if opts.mtls else [],
        )
        self.probe = None
        # Why start-up failed after READY was printed (a stage holds no stream: ``_fail_start``); "" while it has not.
        self.failure = ""
        self.stop_event = threading.Event()  # ``serve`` gives its own
        self.engine.generations.on_fatal = self._fail_start
        self.address = f"{opts.advertise_host or opts.host}:{self.port}"
        servicer.address = self.address
        self.metrics = telemetry.MetricsServer()

    def _fail_start(self, detail: str) -> None:
        """A stage cannot hold one stream (``Generations.on_fatal``): stop, and let ``serve`` fail naming it."""
        self.failure = detail
        self.stop_event.set()

    def _on_ready(self, ready: bool) -> None:
        self.health.set(SERVICE_NAME, 1 if ready else 2)  # SERVING / NOT_SERVING

    def start(self) -> None:
        self.engine.start()
        self.server.start()
        self.probe = serve_health(self.health, self.opts.host, self.opts.health_port)
        registry = self.engine.telemetry.registry
        host = self.opts.metrics_host or self.opts.host
        self.metrics = telemetry.serve_metrics(self.opts.metrics_port, registry, host=host, what="coordinator")
        set_serving(self.health, [rendezvous.SERVICE_NAME], True)  # alive; the pipeline service follows readiness
        logger.info("coordinator on %s (%s)", self.address, "mTLS" if self.opts.mtls else "plaintext")

    def stop(self) -> None:
        self.engine.shutdown()
        self.server.stop(grace=2).wait()
        if self.probe is not None:
            self.probe.stop(0)
        self.metrics.close()


def serve(opts: CoordinatorOptions, stop: threading.Event | None = None) -> None:
    telemetry.init("coordinator")  # before the Coordinator, as its construction may trace (init is idempotent)
    coord = Coordinator(opts)
    coord.stop_event = stop if stop is not None else threading.Event()

    def start() -> dict:
        coord.start()
        return {"address": coord.address}

    serve_lifecycle("coordinator", start, coord.stop, coord.stop_event, role="coordinator")
    if coord.failure:  # stagecast coordinator: error: ..., exit status 2 (stagecast.service.run_service)
        raise StartupFailure(coord.failure)


class StartupFailure(ValueError):
    """The pipeline cannot serve one stream as it stands: the coordinator stops without becoming READY."""


__all__ = ["CHANNEL_OPTIONS", "Coordinator", "CoordinatorOptions", "serve"]
