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
"""

from __future__ import annotations

import json
import logging
import os
import queue
import sys
import threading
import time

import grpc
import torch

from stage_service.calibration import DEFAULT_BUDGET_S, Calibration, calibrate, serving_shape
from stage_service.checkpoint import RANDOM_PREFIX, load_slice_state_dict, random_slice_state_dict
from stage_service.dit_slice import DiTSlice
from stage_service.executor import ExecutorEvent, StageExecutor
from stage_service.fp8 import convert_to_fp8
from stage_service.graphs import GraphedBlocks
from stage_service.kv_budget import check_kv_budget_gib, graph_buffer_cap, measure_kv_budget
from stage_service.metrics import StageTelemetry
from stage_service.options import StageOptions
from stage_service.parallel_state import LOCAL
from stage_service.rendezvous import GrpcStore
from stage_service.runner import SliceRunner, check_sequence_split, validate_batch
from stage_service.transport import PipeTransport, bind_data_plane
from stagecast import telemetry, wire
from stagecast.fp8 import check_fp8
from stagecast.grpc_util import (
    CHANNEL_OPTIONS,
    NOT_SERVING,
    RECONNECT_OPTIONS,
    SERVING,
    make_server,
    serve_health,
    set_serving,
)
from stagecast.internal.v1 import pipeline_pb2 as pb
from stagecast.internal.v1 import pipeline_pb2_grpc as pb_grpc
from stagecast.microstep import DEFAULT_MAX_BATCH, ChunkSpecs, PlanEvent, recache_steps
from stagecast.model.config import DiTConfig, check_image, check_spec, read_config
from stagecast.model.dit_configs import expands_timesteps, model_config
from stagecast.model.parallel import check_sp
from stagecast.names import DTYPES, STAGE_SERVICE
from stagecast.security import RoleGuard, connect
from stagecast.service import process_age, serve_lifecycle

logger = logging.getLogger(__name__)
SERVICE_NAME = STAGE_SERVICE
# Only the coordinator drives a stage (and an operator's tools, which RoleGuard always admits).
ROLE_RULES = {f"/{SERVICE_NAME}/": ["coordinator"]}
# One plan event running longer than this means a hung executor (a batch takes milliseconds to seconds; a peer that
# died releases the data plane when its generation fails, within seconds): the process then reports NOT_SERVING.
EXECUTOR_STALL_S = 20.0


class _Generation:
    """Everything that belongs to one formed generation; dropped as a whole on Reset."""

    def __init__(self, number: int, executor: StageExecutor, transport: PipeTransport | None):
        self.number = number
        self.executor = executor
        self.transport = transport
        self.events: queue.Queue = queue.Queue()
        self.next_seq = 1
        self.specs: dict[int, ChunkSpecs] = {}  # streams open as of the last accepted event


class StageServicer(pb_grpc.StageServiceServicer):
    def __init__(self, opts: StageOptions):
        self.opts = opts
        if opts.fp8:
            check_fp8(opts.device, opts.dtype)  # Fp8Unavailable (a ValueError naming --fp8), before any weights
        if opts.cuda_graphs and not opts.device.startswith("cuda"):
            logger.warning("--cuda-graphs needs a GPU; stage %d on %s runs eagerly", opts.index, opts.device)
        self.device = torch.device(opts.device)
        if opts.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {opts.dtype!r}")
        self.dtype = DTYPES[opts.dtype]
        if opts.checkpoint.startswith(RANDOM_PREFIX):
            # "random:wan2.1-1.3b": the real architecture with random weights (benchmarks; nothing to read).
            self.config = model_config(opts.checkpoint[len(RANDOM_PREFIX) :])
        else:
            self.config = read_config(opts.checkpoint)
        check_sp(opts.sp, self.config["num_attention_heads"])  # at start-up, before registering
        check_kv_budget_gib(opts.kv_budget_gib)
        self.layers: range | None = None
        self.world_size = 0
        self.slice: DiTSlice | None = None
        # the coordinator's Stream Batch (RegisterReply.max_batch): what the calibration times
        self.max_batch = DEFAULT_MAX_BATCH
        self.calibration: Calibration | None = None  # of the loaded slice; None: not calibrated
        self.kv_budget = 0  # bytes for streams' KV, measured after loading (FormReply.kv_budget_bytes; 0: no limit)
        # What the CUDA graphs' static buffers may hold (None: no cap, no graphs); kept out of the KV budget.
        self.graph_cap = graph_buffer_cap(self.device, opts.cuda_graphs)
        self.gen: _Generation | None = None
        self.lock = threading.RLock()
        self.address = ""
        self.health = None  # the server's grpc.health.v1 servicer, once serving
        self._progressing = True  # what "" health last said of the executor's progress
        self.telemetry = StageTelemetry(opts.index, state=lambda: self.gen)
        # Registration and the rendezvous store both go to the coordinator this stage was started with (a plan
        # cannot point a stage at another address), over mTLS.
        self.control = connect(opts.coordinator, opts.mtls, "coordinator", CHANNEL_OPTIONS)

    # ---- setup ----------------------------------------------------------------------------------------

    def register(self, address: str, timeout: float = 120.0) -> None:
        self.address = address
        self._register(pb_grpc.CoordinatorServiceStub(self.control), timeout, wait_for_ready=True)

    def _register(self, stub, timeout: float, wait_for_ready: bool = False) -> None:
        reply = stub.Register(
            pb.RegisterRequest(
                index=self.opts.index,
                address=self.address,
                model_config_json=json.dumps(self.config, sort_keys=True, default=list),
                expected_world_size=self.opts.expected_world_size,
                device=self.opts.device,
                sp=self.opts.sp,
            ),
            timeout=timeout,
            wait_for_ready=wait_for_ready,
        )
        self.world_size = reply.world_size
        if reply.max_batch > 0:
            self.max_batch = reply.max_batch
        self._load(range(reply.layer_start, reply.layer_stop))

    # ---- membership -----------------------------------------------------------------------------------

    def held_generation(self) -> int:
        gen = self.gen
        return gen.number if gen is not None else 0

    def membership(self, stop: threading.Event, interval: float = 0.5, max_backoff: float = 1.0) -> None:
        """Heartbeat until ``stop``; leave and register again whenever this stage is outside the current
        generation (see the module docstring).  Runs in its own thread."""
        channel = connect(self.opts.coordinator, self.opts.mtls, "coordinator", RECONNECT_OPTIONS)
        stub = pb_grpc.CoordinatorServiceStub(channel)
        registered, misses, delay = True, 0, interval
        try:
            while not stop.wait(delay):
                self._report_progress()
                held = self.held_generation()
                try:
                    if not registered:
                        self._register(stub, timeout=10.0)
                        registered, misses, delay = True, 0, interval
                        logger.info("stage %d registered again", self.opts.index)
                        continue
                    request = pb.HeartbeatRequest(index=self.opts.index, address=self.address, generation=held)
                    reply = stub.Heartbeat(request, timeout=2.0)
                except grpc.RpcError as exc:
                    misses += 1
                    delay = min(max_backoff, interval * 2**misses)
                    if misses == 1 or misses % 20 == 0:
                        logger.warning(
                            "stage %d: coordinator %s: %s: %s",
                            self.opts.index,
                            "registration failed" if not registered else "heartbeat failed",
                            exc.code().name,
                            exc.details(),
                        )
                    if registered and misses >= 3 and held:
                        # Whatever the coordinator knows when it is back, this generation cannot go on.
                        registered = not self.leave(held, f"lost the coordinator ({exc.code().name})")
                    continue
                misses, delay = 0, interval
                if reply.rejoin:
                    logger.warning("stage %d: %s; registering again", self.opts.index, reply.reason)
                    registered = not self.leave(held, reply.reason)
                    delay = 0.0
        finally:
            channel.close()

    def leave(self, held: int, reason: str) -> bool:
        """Drop generation ``held`` (0: none), unless another generation was formed meanwhile.  Returns
        whether this stage now holds no generation."""
        if not self.lock.acquire(timeout=5.0):
            self._reexec(f"leaving while busy forming a generation ({reason})")
        try:
            if self.held_generation() != held:
                return False
            clean = self._drop_generation(reason)
        finally:
            self.lock.release()
        if not clean:
            self._reexec(f"executor stuck after leaving ({reason})")
        return True

    def _report_progress(self) -> None:
        """The process's ``""`` health follows its executor: NOT_SERVING while one plan event has run for longer than
        ``EXECUTOR_STALL_S`` (a hung executor, whose gRPC threads still answer), so ``up`` and the chart's liveness
        probe replace the stage."""
        gen = self.gen
        stalled = gen.executor.stalled_s() if gen is not None else 0.0
        progressing = stalled < EXECUTOR_STALL_S
        if self.health is not None and progressing != self._progressing:
            self._progressing = progressing
            self.health.set("", SERVING if progressing else NOT_SERVING)
            if not progressing:
                logger.error(
                    "stage %d: one plan event has run for %.0f s: reporting not serving", self.opts.index, stalled
                )

    def _set_member(self, member: bool) -> None:
        if self.health is not None:
            self.health.set(SERVICE_NAME, SERVING if member else NOT_SERVING)

    def _load(self, layers: range) -> float:
        with self.lock:
            return self._load_locked(layers)

    def _load_locked(self, layers: range) -> float:
        if self.layers == layers and self.slice is not None:
            return 0.0
        start = time.perf_counter()
        n = self.config["num_layers"]
        first, last = layers.start == 0, layers.stop == n
        if self.opts.checkpoint.startswith(RANDOM_PREFIX):
            config = self.config
            sd = random_slice_state_dict(
                config, layers=layers, first=first, last=last, dtype=self.dtype, device=self.device
            )
        else:
            config, sd = load_slice_state_dict(
                self.opts.checkpoint,
                layers=layers,
                first=first,
                last=last,
                dtype=self.dtype,
                device=self.device,
                loras=self.opts.loras,
            )
        self.slice = DiTSlice.from_state_dict(config, sd, layers=layers, first=first, last=last, device=self.device)
        if self.opts.fp8:  # before Form builds CUDA graphs over the blocks
            convert_to_fp8(self.slice)
        self.layers = layers
        self.telemetry.set_layers(layers)
        took = time.perf_counter() - start
        logger.info("stage %d loaded layers %d:%d in %.2fs", self.opts.index, layers.start, layers.stop, took)
        self.telemetry.startup("load", took)
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            loaded = torch.cuda.memory_allocated(self.device)
        self.calibration = self._calibrate()
        peak = torch.cuda.max_memory_allocated(self.device) - loaded if cuda else 0
        if cuda:
            torch.cuda.empty_cache()
        self.kv_budget = measure_kv_budget(
            self.device, operator_gib=self.opts.kv_budget_gib, activation_peak=peak, graph_bytes=self.graph_cap or 0
        )
        gib = self.kv_budget / (1 << 30)
        limit = f"{gib:.3f} GiB" if self.kv_budget else "no limit (on a CPU: --kv-budget-gib sets one)"
        logger.info("stage %d gives streams' KV %s", self.opts.index, limit)
        return took

    def _calibrate(self) -> Calibration | None:
        """Time the freshly loaded slice for the coordinator's SLO model (never raises: a stage that cannot calibrate
        still serves, and the coordinator learns its times from measured batches)."""
        budget = self.opts.calibration_s
        if budget is None:
            # On a CPU the stages, the gateway and the text encoder share the cores, and a timing taken while they all
            # start says little about serving: calibrate there only when asked.
            budget = DEFAULT_BUDGET_S if self.device.type == "cuda" else 0.0
        if budget <= 0:
            return None
        if self.opts.sp > 1:
            logger.info("stage %d: no calibration under --sp (its forwards need the whole group)", self.opts.index)
            return None
        assert self.slice is not None
        try:
            shape = serving_shape(self.opts.checkpoint, self.config)
            cal = calibrate(
                self.slice,
                min(max(self.max_batch, 1), 64),
                shape,
                budget_s=budget,
                graphs=self.opts.cuda_graphs,
            )
        except Exception as exc:  # noqa: BLE001
            logger.warning("stage %d: calibration failed: %s; times come from batches", self.opts.index, exc)
            return None
        if cal.error:
            logger.warning("stage %d: calibration incomplete: %s", self.opts.index, cal.summary())
        else:
            logger.info("stage %d: calibration: %s", self.opts.index, cal.summary())
        self.telemetry.startup("calibration", cal.seconds)
        return cal

    # ---- RPCs -----------------------------------------------------------------------------------------

    def Form(self, request: pb.Rendezvous, context):
        with self.lock:
            self._drop_generation("re-forming")
            try:
                took = self._load(range(request.layer_start, request.layer_stop))
            except Exception as exc:  # noqa: BLE001
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"loading layers failed: {exc}")
            if max(request.sp, 1) != self.opts.sp:
                context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"the coordinator forms --sp {max(request.sp, 1)} but this stage runs --sp {self.opts.sp}",
                )
            transport = None
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
            if request.world_size > 1:
                transport = PipeTransport.join(
                    rank=request.rank,
                    world_size=request.world_size,
                    store=GrpcStore(self.control),
                    generation=request.generation,
                    backend=request.backend or ("nccl" if self.device.type == "cuda" else "gloo"),
                    device=self.device,
                    sp=self.opts.sp,
                    cfg_parallel=cfg_parallel,
                )
            assert self.slice is not None
            graphs = None
            if self.opts.cuda_graphs and self.device.type == "cuda":
                # A signature first seen while serving runs eagerly while its graph is captured off the serving path.
                # Its K/V stack is made for the coordinator's Stream Batch (rows), so growing batches keep one stack.
                graphs = GraphedBlocks(
                    self.slice, background=True, max_buffer_bytes=self.graph_cap, reserve_rows=self.max_batch
                )
            group_size = request.world_size // cfg_parallel  # ranks of one CFG group
            runner = SliceRunner(
                self.slice,
                graphs=graphs,
                sp=transport.sequence if transport else LOCAL,
                cfg_rank=request.rank // group_size,
                cfg_size=cfg_parallel,
            )
            gen_holder: list[_Generation] = []
            executor = StageExecutor(
                runner, transport, on_event=lambda ev: gen_holder[0].events.put(ev), telemetry=self.telemetry
            )
            gen = _Generation(request.generation, executor, transport)
            gen_holder.append(gen)
            self.gen = gen
            self.world_size = request.world_size
            executor.start()
            self._set_member(True)
            logger.info("stage %d formed generation %d", self.opts.index, request.generation)
            cal = self.calibration
            return pb.FormReply(
                rank=request.rank,
                load_seconds=took,
                calibration=cal.to_proto() if cal is not None else None,
                kv_budget_bytes=self.kv_budget,
                kv_element_bytes=torch.empty((), dtype=self.dtype).element_size(),
            )

    def _drop_generation(self, reason: str, timeout: float = 5.0) -> bool:
        """Leave the current generation.  Returns False when the executor is stuck in a data-plane wait
        that leaving could not release; the caller then restarts the process (``_reexec``)."""
        gen, self.gen = self.gen, None
        if gen is None:
            return True
        self._set_member(False)
        if gen.executor.failed is not None:  # its own line said why; the coordinator's reason would repeat it
            logger.info("stage %d leaving generation %d: its executor stopped (above)", self.opts.index, gen.number)
        else:
            logger.info("stage %d leaving generation %d: %s", self.opts.index, gen.number, reason)
        gen.events.put(None)  # ends a Results stream still attached to the old generation
        gen.executor.stop(timeout)  # aborting the transport releases a receive or send blocked on a peer
        if gen.executor.alive:
            logger.error("stage %d executor is stuck after %.0fs", self.opts.index, timeout)
            return False
        for sid in list(gen.executor.runner.streams):
            gen.executor.runner.close_stream(sid)
        released = True
        if gen.transport is not None:
            # Leaving shuts our connections, which releases peers blocked on us, and frees the group's
            # sockets, fds and threads.
            released = gen.transport.close()
        gen.executor.on_event = _ignore  # the executor's callback refers to ``gen``: no cycle outlives it
        return released

    def _reexec(self, why: str) -> None:
        """Replace this process with a fresh copy of itself (same PID, same arguments).  The only way to
        release a thread blocked inside a gloo receive; the new process registers again."""
        logger.error("stage %d restarting itself: %s", self.opts.index, why)
        telemetry.shutdown(timeout_s=2.0)
        for handler in logging.getLogger().handlers:
            handler.flush()
        os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])  # the same command line, as started

    def Reset(self, request: pb.ResetRequest, context):
        reason = request.reason or "reset by coordinator"
        if not self.lock.acquire(timeout=5.0):
            self._reexec(f"reset while busy forming a generation ({reason})")
        try:
            held = self.held_generation()
            if request.generation and held > request.generation:
                # A Reset that arrives late (this process was paused) must not end a newer generation.
                logger.info("stage %d ignores a reset of generation %d", self.opts.index, request.generation)
                return pb.Empty()
            clean = self._drop_generation(reason)
        finally:
            self.lock.release()
        if not clean:
            self._reexec(f"executor stuck after reset ({reason})")
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
                item = self._validate(gen, request)
            except KeyError as exc:
                context.abort(grpc.StatusCode.NOT_FOUND, str(exc.args[0]))
            except ValueError as exc:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            gen.next_seq += 1
            gen.executor.submit(item)
            return pb.SubmitReply(accepted_seq=request.seq)

    def _validate(self, gen: _Generation, msg: pb.PlanEvent) -> PlanEvent:
        assert self.slice is not None
        ev = wire.event_from_proto(msg)
        if ev.kind == "open":
            spec = ev.spec
            assert spec is not None
            if spec.stream_id in gen.specs:
                raise ValueError(f"stream {spec.stream_id} is already open")
            if ev.text is None:
                raise ValueError(f"stream {spec.stream_id}: open carries no text embeddings")
            check_spec(spec, DiTConfig.from_kwargs(self.config), tuple(ev.text.shape))
            image_shape = None if ev.latents is None else tuple(ev.latents.shape)
            check_image(spec, image_shape, per_token=expands_timesteps(self.config))
            check_sequence_split(spec, self.slice.tokens_per_frame(spec.latent_height, spec.latent_width), self.opts.sp)
            if spec.cfg != (ev.negative_text is not None) or (
                ev.negative_text is not None and ev.negative_text.shape != ev.text.shape
            ):
                shape = None if ev.negative_text is None else tuple(ev.negative_text.shape)
                raise ValueError(
                    f"stream {spec.stream_id}: guidance_scale={spec.guidance_scale} with negative_text of shape {shape}"
                )
            gen.specs[spec.stream_id] = ChunkSpecs(spec)
        elif ev.kind == "close":
            self._known(gen, ev.stream_id)
            del gen.specs[ev.stream_id]
        elif ev.kind == "prompt":
            spec = self._known(gen, ev.stream_id)
            if ev.text is None or tuple(ev.text.shape) != (1, spec.spec.text_len, self.config["text_dim"]):
                shape = None if ev.text is None else tuple(ev.text.shape)
                raise ValueError(f"stream {spec.spec.stream_id}: prompt update text has shape {shape}")
            if ev.recache:
                chunk_spec = spec.at(ev.from_chunk)
                rope = DiTConfig.from_kwargs(self.config).rope_max_seq_len
                need = {c for c, _ in recache_steps(chunk_spec, ev.from_chunk, rope)}
                given = dict(ev.window)
                bad = [c for c, x in given.items() if x is None or tuple(x.shape) != chunk_spec.latent_shape]
                if self.slice.first and (set(given) != need or bad):
                    raise ValueError(
                        f"stream {chunk_spec.stream_id}: a recache before chunk {ev.from_chunk} needs the clean "
                        f"latents of chunks {sorted(need)} ({chunk_spec.latent_shape}), got {sorted(given)}"
                    )
        elif ev.kind == "input":
            spec = self._known(gen, ev.stream_id).spec
            if not spec.input_latents:
                raise ValueError(f"stream {spec.stream_id} takes no input latents (it is not a video-to-video stream)")
            if ev.chunk < 0 or (spec.num_chunks is not None and ev.chunk >= spec.num_chunks):
                raise ValueError(f"stream {spec.stream_id}: input for chunk {ev.chunk} is out of range")
            if ev.latents is None or tuple(ev.latents.shape) != spec.latent_shape or ev.latents.dtype != torch.float32:
                got = None if ev.latents is None else (tuple(ev.latents.shape), ev.latents.dtype)
                raise ValueError(
                    f"stream {spec.stream_id}: input latents must be float32 {spec.latent_shape}, got {got}"
                )
        elif ev.kind == "steps":
            # Validated here (a bad ladder is INVALID_ARGUMENT, never an executor failure); the executor's runner
            # applies the same change in plan order.
            self._known(gen, ev.stream_id).change(ev.from_chunk, ev.timesteps)
        else:
            validate_batch(list(ev.steps), lambda st: self._known(gen, st.stream).at(st.chunk))
            for st in ev.steps:
                specs = gen.specs[st.stream]
                if st.level == specs.at(st.chunk).levels - 1:
                    specs.prune(st.chunk + 1)  # chunks of a stream finish in order: earlier specs are done
        return ev

    @staticmethod
    def _known(gen: _Generation, stream_id: int) -> ChunkSpecs:
        if stream_id not in gen.specs:
            raise KeyError(f"unknown stream {stream_id}: never opened on this stage, or already closed")
        return gen.specs[stream_id]

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
            yield self._event_to_proto(ev, gen.number)

    def _event_to_proto(self, ev: ExecutorEvent, generation: int) -> pb.StageEvent:
        if ev.kind == "chunk":
            assert ev.latents is not None
            return pb.StageEvent(
                chunk=pb.ChunkResult(
                    stream_id=ev.stream_id,
                    chunk=ev.chunk,
                    latents=wire.tensor_to_proto(ev.latents),
                    seq=ev.seq,
                    steps=ev.steps,
                )
            )
        if ev.kind == "done":
            return pb.StageEvent(
                done=pb.BatchDone(
                    seq=ev.seq,
                    forward_ms=ev.forward_ms,
                    wait_ms=ev.wait_ms,
                    micro_steps=ev.micro_steps,
                    exchange_ms=ev.exchange_ms,
                    batches=ev.batches,
                )
            )
        return pb.StageEvent(
            error=pb.StageError(generation=generation, seq=ev.seq, message=ev.message, stage_index=self.opts.index)
        )

    def Describe(self, request, context):
        with self.lock:
            gen = self.gen
            layers = self.layers or range(0, 0)
            kv = 0
            streams = 0
            if gen is not None:
                runner = gen.executor.runner
                streams = len(runner.streams)
                kv = runner.memory_bytes()["kv"]
            return pb.StageDescription(
                index=self.opts.index,
                address=self.address,
                model_config_json=json.dumps(self.config, sort_keys=True, default=list),
                layer_start=layers.start,
                layer_stop=layers.stop,
                generation=gen.number if gen else 0,
                open_streams=streams,
                device=self.opts.device,
                kv_bytes=kv,
                formed=gen is not None,
                kv_budget_bytes=self.kv_budget,
            )


def _ignore(_event) -> None:
    pass


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
    servicer.health = health
    server.start()
    probe = serve_health(health, opts.host, opts.health_port)
    bind_data_plane(opts.host if opts.host not in ("0.0.0.0", "::") else (opts.advertise_host or opts.host))
    address = f"{opts.advertise_host or opts.host}:{port}"
    logger.info("stage %d listening on %s", opts.index, address)
    stop = stop or threading.Event()
    member = threading.Thread(target=servicer.membership, args=(stop,), daemon=True, name="membership")

    def start() -> dict:
        servicer.register(address)
        set_serving(health, [], True)  # alive; StageService follows membership of a formed generation
        ready_s = process_age()
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
                clean = servicer._drop_generation("shutting down")
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
