"""The stage process: gRPC control plane around one DiT slice and its data plane.

Run with ``stagecast stage --index I --coordinator HOST:PORT --checkpoint DIR``.  Lifecycle:

1. read the checkpoint's config, start the gRPC server (health NOT_SERVING), register with the
   coordinator, which answers with this stage's layer range;
2. load only that slice, time it (``stage_service.calibration``: forwards of batch sizes 1..the coordinator's
   max batch at the serving size, within ``--calibration-s``), then report the process SERVING (health service
   ""): alive, waiting to join.  ``Form`` hands the timings to the coordinator (``FormReply.calibration``), which
   seeds its SLO model with them, and the bytes this stage gives to streams' KV (``FormReply.kv_budget_bytes``,
   ``stage_service.kv_budget``: ``--kv-budget-gib``, else measured after the calibration), which it admits by;
3. ``Form`` joins the generation's process group; ``Submit`` enqueues validated plan events that the
   ``StageExecutor`` runs in order; ``Results`` streams finished chunks and batch completions back.  While a
   generation is formed, the health service ``stagecast.internal.v1.StageService`` is SERVING;
4. ``Reset`` abandons a generation after a failure elsewhere: streams dropped, group left, memory freed.

Self-healing: the stage sends the coordinator a heartbeat twice a second naming the generation it holds.
When the coordinator answers that the stage is outside its current generation (the stage was paused and
marked lost, the coordinator restarted, or the generation failed while the stage could not be reset), or
the coordinator stays unreachable, the stage drops its generation and registers again, with backoff.

Invalid plan events are rejected with a gRPC status naming the problem and never reach the executor.

Where each job lives: loading, calibrating and budgeting the slice in ``stage_service.slice_loader``; registration,
heartbeats and health in ``stage_service.membership``; a formed generation (data plane, executor, plan checks,
results) in ``stage_service.generation``; this module holds the RPCs and the lock they share.
"""

from __future__ import annotations

import json
import logging
import os
import threading

import grpc
import torch

from stage_service.dit_levers import parse_levers
from stage_service.executor import ExecutorEvent
from stage_service.generation import Generation
from stage_service.kv_budget import check_device_memory_gib, check_kv_budget_gib
from stage_service.membership import Membership, StageHealth, reexec
from stage_service.metrics import StageTelemetry
from stage_service.options import StageOptions
from stage_service.rendezvous import GrpcStore
from stage_service.slice_loader import SliceLoader
from stage_service.transport import bind_data_plane
from stagecast import telemetry
from stagecast.fp8 import check_fp8
from stagecast.grpc_util import CHANNEL_OPTIONS, make_server, serve_health, set_serving
from stagecast.internal.v1 import pipeline_pb2 as pb
from stagecast.internal.v1 import pipeline_pb2_grpc as pb_grpc
from stagecast.model.config import checkpoint_config
from stagecast.model.parallel import check_sp
from stagecast.names import DTYPES, STAGE_SERVICE
from stagecast.security import RoleGuard, connect
from stagecast.service import serve_lifecycle
from stagecast.startup import Startup

logger = logging.getLogger(__name__)
SERVICE_NAME = STAGE_SERVICE
# Only the coordinator drives a stage (and an operator's tools, which RoleGuard always admits).
ROLE_RULES = {f"/{SERVICE_NAME}/": ["coordinator"]}


class StageServicer(pb_grpc.StageServiceServicer):
    """The stage's RPCs (Form, Submit, Results, Reset, Describe) over the parts it holds, all under its one lock:

    - ``loader`` (``stage_service.slice_loader.SliceLoader``): the slice, its calibration and KV budget;
    - ``members`` (``stage_service.membership.Membership``): registration and the heartbeat loop;
    - ``health`` (``stage_service.membership.StageHealth``): what grpc.health.v1 says of the process and the stage;
    - ``gen`` (``stage_service.generation.Generation``): the formed generation, if any, with its executor.
    """

    def __init__(self, opts: StageOptions):
        self.opts = opts
        if opts.fp8:
            check_fp8(opts.device, opts.dtype)  # Fp8Unavailable (a ValueError naming --fp8), before any weights
        levers = parse_levers(opts.dit_levers)  # a ValueError naming --dit-levers, before any weights
        if opts.fp8 and "fp8" in levers:
            raise ValueError("--dit-levers fp8 and --fp8 both turn the block linears to float8: choose one")
        if opts.cuda_graphs and not opts.device.startswith("cuda"):
            logger.warning("--cuda-graphs needs a GPU; stage %d on %s runs eagerly", opts.index, opts.device)
        self.device = torch.device(opts.device)
        if opts.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {opts.dtype!r}")
        self.dtype = DTYPES[opts.dtype]
        # "random:wan2.1-1.3b" or "random:FOLDER": the real architecture with random weights (benchmarks).
        self.config = checkpoint_config(opts.checkpoint)
        check_sp(opts.sp, self.config["num_attention_heads"])  # at start-up, before registering
        check_kv_budget_gib(opts.kv_budget_gib)
        check_device_memory_gib(opts.device_memory_gib)
        self.world_size = 0
        self.gen: Generation | None = None
        self.lock = threading.RLock()
        self.telemetry = StageTelemetry(opts.index, state=lambda: self.gen)
        # Registration and the rendezvous store both go to the coordinator this stage was started with (a plan
        # cannot point a stage at another address), over mTLS.
        self.control = connect(opts.coordinator, opts.mtls, "coordinator", CHANNEL_OPTIONS)
        # Start-up steps, printed and reported to the coordinator (ClusterStatus.startup, the gateway's GetStatus).
        self.startup = Startup(f"stage {opts.index}", report=self._report_startup)
        self.loader = SliceLoader(
            opts, self.config, device=self.device, dtype=self.dtype, telemetry=self.telemetry, startup=self.startup
        )
        self.health = StageHealth(opts.index)
        self.members = Membership(
            opts,
            self.config,
            self.control,
            on_registered=self._on_registered,
            held_generation=self.held_generation,
            leave=self.leave,
            report_progress=lambda: self.health.report_progress(self.gen),
        )

    def _report_startup(self, startup: Startup) -> None:
        """Each start-up step to the coordinator; a report it cannot take is dropped (the next one carries it all)."""
        try:
            pb_grpc.CoordinatorServiceStub(self.control).ReportStartup(
                startup.to_proto(pb.StartupProgress, index=self.opts.index), timeout=2.0
            )
        except grpc.RpcError as exc:
            logger.debug("stage %d: start-up report not taken: %s", self.opts.index, exc.code().name)

    def _on_registered(self, reply: pb.RegisterReply) -> None:
        self.world_size = reply.world_size
        self.startup.step("registered", detail=f"layers {reply.layer_start}:{reply.layer_stop}")
        if reply.max_batch > 0:
            self.loader.max_batch = reply.max_batch
        self._load(range(reply.layer_start, reply.layer_stop))

    def _load(self, layers: range) -> float:
        with self.lock:
            return self.loader.load(layers)

    # ---- membership -----------------------------------------------------------------------------------

    def held_generation(self) -> int:
        gen = self.gen
        return gen.number if gen is not None else 0

    def leave(self, held: int, reason: str) -> bool:
        """Drop generation ``held`` (0: none), unless another generation was formed meanwhile.  Returns
        whether this stage now holds no generation."""
        if not self.lock.acquire(timeout=5.0):
            reexec(self.opts.index, f"leaving while busy forming a generation ({reason})")
        try:
            if self.held_generation() != held:
                return False
            clean = self.drop_generation(reason)
        finally:
            self.lock.release()
        if not clean:
            reexec(self.opts.index, f"executor stuck after leaving ({reason})")
        return True

    def drop_generation(self, reason: str, timeout: float = 5.0) -> bool:
        """Leave the current generation.  Returns False when the executor is stuck in a data-plane wait
        that leaving could not release; the caller then restarts the process (``reexec``)."""
        gen, self.gen = self.gen, None
        if gen is None:
            return True
        self.health.set_member(False)
        return gen.leave(reason, self.opts.index, timeout)

    # ---- RPCs -----------------------------------------------------------------------------------------

    def Form(self, request: pb.Rendezvous, context):
        with self.lock:
            self.drop_generation("re-forming")
            try:
                took = self._load(range(request.layer_start, request.layer_stop))
            except Exception as exc:  # noqa: BLE001
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"loading layers failed: {exc}")
            if max(request.sp, 1) != self.opts.sp:
                context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"the coordinator forms --sp {max(request.sp, 1)} but this stage runs --sp {self.opts.sp}",
                )
            cfg_parallel = request.cfg_parallel or 1
            if (
                cfg_parallel not in (1, 2)
                or request.world_size % cfg_parallel
                or (cfg_parallel > 1 and self.opts.sp > 1)
            ):
                context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"cfg_parallel={cfg_parallel} does not split {request.world_size} stages into CFG groups"
                    f" (with --sp {self.opts.sp})",
                )
            assert self.loader.slice is not None
            # A stage that holds no stream at the serving defaults refuses to form: the coordinator's start-up then
            # fails with this message (coordinator.generations) instead of becoming READY and refusing every stream.
            group = max(1, request.world_size // cfg_parallel)
            cfg_rank = request.rank // group
            short = self.loader.stream_fit_problem(sp=self.opts.sp, cfg_rank=cfg_rank, cfg_size=cfg_parallel)
            if short is not None:
                logger.error("%s", short)
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, short)
            self.gen = Generation.form(
                request,
                self.loader.slice,
                device=self.device,
                sp=self.opts.sp,
                graph_cap=self.loader.graph_cap,
                max_batch=self.loader.max_batch,
                store=GrpcStore(self.control),
                telemetry=self.telemetry,
                graphs=self.opts.cuda_graphs,
                shape=self.loader.serving_shape() if self.opts.cuda_graphs else None,
                on_graphs=lambda b, n: self.startup.step("graphs", b, n, detail=f"generation {request.generation}"),
            )
            self.world_size = request.world_size
            self.gen.executor.start()
            self.health.set_member(True)
            logger.info("stage %d formed generation %d", self.opts.index, request.generation)
            cal = self.loader.calibration
            return pb.FormReply(
                rank=request.rank,
                load_seconds=took,
                calibration=cal.to_proto() if cal is not None else None,
                kv_budget_bytes=self.loader.kv_budget,
                kv_element_bytes=torch.empty((), dtype=self.dtype).element_size(),
                cuda_graphs=self.gen.executor.runner.graphs is not None,
            )

    def Reset(self, request: pb.ResetRequest, context):
        reason = request.reason or "reset by coordinator"
        if not self.lock.acquire(timeout=5.0):
            reexec(self.opts.index, f"reset while busy forming a generation ({reason})")
        try:
            held = self.held_generation()
            if request.generation and held > request.generation:
                # A Reset that arrives late (this process was paused) must not end a newer generation.
                logger.info("stage %d ignores a reset of generation %d", self.opts.index, request.generation)
                return pb.Empty()
            clean = self.drop_generation(reason)
        finally:
            self.lock.release()
        if not clean:
            reexec(self.opts.index, f"executor stuck after reset ({reason})")
        return pb.Empty()

    def Submit(self, request: pb.PlanEvent, context):
        with self.lock:
            gen = self.gen
            if gen is None:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, "stage is not part of a formed generation")
            if request.generation != gen.number:
                context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"plan is for generation {request.generation} but this stage is in generation {gen.number}",
                )
            if gen.executor.failed:
                context.abort(grpc.StatusCode.UNAVAILABLE, gen.executor.failed)
            if request.seq != gen.next_seq:
                context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"plan event seq {request.seq} out of order: expected {gen.next_seq}",
                )
            try:
                item = gen.validate(request, self.config, self.opts.sp)
            except KeyError as exc:
                context.abort(grpc.StatusCode.NOT_FOUND, str(exc.args[0]))
            except ValueError as exc:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            gen.next_seq += 1
            gen.executor.submit(item)
            return pb.SubmitReply(accepted_seq=request.seq)

    def Results(self, request: pb.ResultsRequest, context):
        with self.lock:
            gen = self.gen
        if gen is None or gen.number != request.generation:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"not in generation {request.generation}")
        context.add_callback(lambda: gen.events.put(None))
        while context.is_active():
            ev: ExecutorEvent | None = gen.events.get()
            if ev is None:
                return
            yield gen.event_to_proto(ev, self.opts.index)

    def Describe(self, request, context):
        with self.lock:
            gen = self.gen
            layers = self.loader.layers or range(0, 0)
            kv = 0
            streams = 0
            if gen is not None:
                runner = gen.executor.runner
                streams = len(runner.streams)
                kv = runner.memory_bytes()["kv"]
            return pb.StageDescription(
                index=self.opts.index,
                address=self.members.address,
                model_config_json=json.dumps(self.config, sort_keys=True, default=list),
                layer_start=layers.start,
                layer_stop=layers.stop,
                generation=gen.number if gen else 0,
                open_streams=streams,
                device=self.opts.device,
                kv_bytes=kv,
                formed=gen is not None,
                kv_budget_bytes=self.loader.kv_budget,
            )


def serve(opts: StageOptions, ready: threading.Event | None = None, stop: threading.Event | None = None) -> None:
    telemetry.init("stage", {"stagecast.stage.index": opts.index})
    servicer = StageServicer(opts)
    metrics = telemetry.serve_metrics(
        opts.metrics_port, servicer.telemetry.registry, host=opts.metrics_host or opts.host, what=f"stage {opts.index}"
    )
    server, health, port = make_server(
        opts.port,
        [(pb_grpc.add_StageServiceServicer_to_server, servicer, SERVICE_NAME)],
        host=opts.host,
        credentials=opts.mtls.server_credentials() if opts.mtls else None,
        interceptors=[RoleGuard(ROLE_RULES)] if opts.mtls else [],
    )
    servicer.health.attach(health)
    server.start()
    probe = serve_health(health, opts.host, opts.health_port)
    bind_data_plane(opts.host if opts.host not in ("0.0.0.0", "::") else (opts.advertise_host or opts.host))
    address = f"{opts.advertise_host or opts.host}:{port}"
    logger.info("stage %d listening on %s", opts.index, address)
    stop = stop or threading.Event()
    member = threading.Thread(target=servicer.members.run, args=(stop,), daemon=True, name="membership")

    def start() -> dict:
        servicer.members.register(address)
        set_serving(health, [], True)  # alive; StageService follows membership of a formed generation
        ready_s = servicer.startup.ready().at_s
        servicer.telemetry.startup("ready", ready_s)
        logger.info("stage %d READY %.2fs after process start", opts.index, ready_s)
        member.start()
        if ready is not None:
            ready.set()
        return {"stage": opts.index, "address": address, "ready_s": f"{ready_s:.3f}"}

    def shutdown() -> None:
        if member.is_alive():
            member.join(5.0)
        clean = False
        if servicer.lock.acquire(timeout=5.0):
            try:
                clean = servicer.drop_generation("shutting down")
            finally:
                servicer.lock.release()
        server.stop(grace=2).wait()
        if probe is not None:
            probe.stop(0)
        metrics.close()
        if not clean:
            telemetry.shutdown()  # os._exit below skips the lifecycle's flush
            # A thread stuck in a data-plane wait would keep the interpreter alive: exit regardless.
            for handler in logging.getLogger().handlers:
                handler.flush()
            os._exit(0)

    serve_lifecycle("stage", start, shutdown, stop, attributes={"stagecast.stage.index": opts.index})
