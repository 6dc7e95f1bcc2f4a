"""One formed generation on a stage: its data plane, its executor, its plan checks and its results.

Usage (``stage_service.server.StageServicer`` holds at most one, under its lock)::

    gen = Generation.form(request, slice_, device=device, sp=1, graph_cap=cap, max_batch=4, store=store,
                          telemetry=telemetry, graphs=False)   # joins the process group
    gen.executor.start()
    gen.executor.submit(gen.validate(plan_event, config, sp=1))   # ValueError / KeyError: the event is refused
    gen.event_to_proto(executor_event, stage_index)    # what Results streams to the coordinator
    clean = gen.leave(reason, stage_index)             # False: the executor is stuck in a data-plane wait

A plan event is validated against the streams open as of the last accepted event (``specs``) before it reaches the
executor, so an invalid one is a gRPC status naming the problem and never an executor failure.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable

import torch

from stage_service.calibration import ServingShape
from stage_service.dit_slice import DiTSlice
from stage_service.executor import ExecutorEvent, StageExecutor
from stage_service.graphs import GraphedBlocks
from stage_service.metrics import StageTelemetry
from stage_service.parallel_state import LOCAL
from stage_service.precapture import precapture
from stage_service.runner import SliceRunner, check_sequence_split, validate_batch
from stage_service.transport import PipeTransport
from stagecast import wire
from stagecast.internal.v1 import pipeline_pb2 as pb
from stagecast.microstep import ChunkSpecs, PlanEvent, recache_steps
from stagecast.model.config import DiTConfig, check_image, check_spec
from stagecast.model.dit_configs import expands_timesteps

logger = logging.getLogger(__name__)


class Generation:
    """Everything that belongs to one formed generation; dropped as a whole on Reset."""

    def __init__(self, number: int, executor: StageExecutor, transport: PipeTransport | None, slice_: DiTSlice):
        self.number = number
        self.executor = executor
        self.transport = transport
        self.slice = slice_
        self.events: queue.Queue = queue.Queue()
        self.next_seq = 1
        self.specs: dict[int, ChunkSpecs] = {}  # streams open as of the last accepted event

    @classmethod
    def form(
        cls,
        request: pb.Rendezvous,
        slice_: DiTSlice,
        *,
        device: torch.device,
        sp: int,
        graph_cap: int | None,
        max_batch: int,
        store,
        telemetry: StageTelemetry,
        graphs: bool,
        shape: ServingShape | None = None,
        on_graphs: Callable[[int, int], None] | None = None,
    ) -> Generation:
        """Join the generation's process group (more than one stage) and build the runner (CUDA graphs when asked, on
        a GPU, with the graphs of batches of 1..``max_batch`` streams at the serving ``shape`` captured by the
        executor before its first event: ``stage_service.precapture``, ``on_graphs(b, max_batch)`` as each batch size
        is captured) and its executor, which the caller starts.  ``request`` was checked by the servicer."""
        cfg_parallel = request.cfg_parallel or 1
        transport = None
        if request.world_size > 1:
            transport = PipeTransport.join(
                rank=request.rank,
                world_size=request.world_size,
                store=store,
                generation=request.generation,
                backend=request.backend or ("nccl" if device.type == "cuda" else "gloo"),
                device=device,
                sp=sp,
                cfg_parallel=cfg_parallel,
            )
        blocks = None
        if graphs and device.type == "cuda":
            # A signature first seen while serving runs eagerly while its graph is captured off the serving path.
            # Its K/V stack is made for the coordinator's Stream Batch (rows), so growing batches keep one stack.
            blocks = GraphedBlocks(slice_, background=True, max_buffer_bytes=graph_cap, reserve_rows=max_batch)
        group_size = request.world_size // cfg_parallel  # ranks of one CFG group
        runner = SliceRunner(
            slice_,
            graphs=blocks,
            sp=transport.sequence if transport else LOCAL,
            cfg_rank=request.rank // group_size,
            cfg_size=cfg_parallel,
        )
        prepare = None
        if blocks is not None and shape is not None:
            # On the executor's thread before its first event, so Form (under the stage's lock) does not wait for it.
            def prepare(stopping) -> None:
                start = time.perf_counter()
                precapture(runner, max_batch, shape, stop=stopping, on_batch=on_graphs)
                telemetry.startup("graph_precapture", time.perf_counter() - start)

        gen_holder: list[Generation] = []
        executor = StageExecutor(
            runner,
            transport,
            on_event=lambda ev: gen_holder[0].events.put(ev),
            telemetry=telemetry,
            prepare=prepare,
        )
        gen = cls(request.generation, executor, transport, slice_)
        gen_holder.append(gen)
        return gen

    def leave(self, reason: str, index: int, timeout: float = 5.0) -> bool:
        """Stop the executor, close the streams and the data plane.  Returns False when the executor is stuck in a
        data-plane wait that leaving could not release."""
        if self.executor.failed is not None:  # its own line said why; the coordinator's reason would repeat it
            logger.info("stage %d leaving generation %d: its executor stopped (above)", index, self.number)
        else:
            logger.info("stage %d leaving generation %d: %s", index, self.number, reason)
        self.events.put(None)  # ends a Results stream still attached to the old generation
        self.executor.stop(timeout)  # aborting the transport releases a receive or send blocked on a peer
        if self.executor.alive:
            logger.error("stage %d executor is stuck after %.0fs", index, timeout)
            return False
        for sid in list(self.executor.runner.streams):
            self.executor.runner.close_stream(sid)
        released = True
        if self.transport is not None:
            # Leaving shuts our connections, which releases peers blocked on us, and frees the group's
            # sockets, fds and threads.
            released = self.transport.close()
        self.executor.on_event = _ignore  # the executor's callback refers to this generation: no cycle outlives it
        return released

    def validate(self, msg: pb.PlanEvent, config: dict, sp: int) -> PlanEvent:
        """The plan event, checked against the model (``config``) and the streams open; ValueError (bad) or KeyError
        (unknown stream) refuses it.  One validator per event kind."""
        ev = wire.event_from_proto(msg)
        if ev.kind == "open":
            self._validate_open(ev, config, sp)
        elif ev.kind == "close":
            self._known(ev.stream_id)
            del self.specs[ev.stream_id]
        elif ev.kind == "prompt":
            self._validate_prompt(ev, config)
        elif ev.kind == "input":
            self._validate_input(ev)
        elif ev.kind == "steps":
            # Validated here (a bad ladder is INVALID_ARGUMENT, never an executor failure); the executor's runner
            # applies the same change in plan order.
            self._known(ev.stream_id).change(ev.from_chunk, ev.timesteps)
        else:
            self._validate_batch(ev)
        return ev

    def _validate_open(self, ev: PlanEvent, config: dict, sp: int) -> None:
        spec = ev.spec
        assert spec is not None
        if spec.stream_id in self.specs:
            raise ValueError(f"stream {spec.stream_id} is already open")
        if ev.text is None:
            raise ValueError(f"stream {spec.stream_id}: open carries no text embeddings")
        check_spec(spec, DiTConfig.from_kwargs(config), tuple(ev.text.shape))
        image_shape = None if ev.latents is None else tuple(ev.latents.shape)
        check_image(spec, image_shape, per_token=expands_timesteps(config))
        check_sequence_split(spec, self.slice.tokens_per_frame(spec.latent_height, spec.latent_width), sp)
        if spec.cfg != (ev.negative_text is not None) or (
            ev.negative_text is not None and ev.negative_text.shape != ev.text.shape
        ):
            shape = None if ev.negative_text is None else tuple(ev.negative_text.shape)
            raise ValueError(
                f"stream {spec.stream_id}: guidance_scale={spec.guidance_scale} with negative_text of shape {shape}"
            )
        self.specs[spec.stream_id] = ChunkSpecs(spec)

    def _validate_prompt(self, ev: PlanEvent, config: dict) -> None:
        spec = self._known(ev.stream_id)
        if ev.text is None or tuple(ev.text.shape) != (1, spec.spec.text_len, config["text_dim"]):
            shape = None if ev.text is None else tuple(ev.text.shape)
            raise ValueError(f"stream {spec.spec.stream_id}: prompt update text has shape {shape}")
        if not ev.recache:
            return
        chunk_spec = spec.at(ev.from_chunk)
        rope = DiTConfig.from_kwargs(config).rope_max_seq_len
        need = {c for c, _ in recache_steps(chunk_spec, ev.from_chunk, rope)}
        given = dict(ev.window)
        bad = [c for c, x in given.items() if x is None or tuple(x.shape) != chunk_spec.latent_shape]
        if self.slice.first and (set(given) != need or bad):
            raise ValueError(
                f"stream {chunk_spec.stream_id}: a recache before chunk {ev.from_chunk} needs the clean "
                f"latents of chunks {sorted(need)} ({chunk_spec.latent_shape}), got {sorted(given)}"
            )

    def _validate_input(self, ev: PlanEvent) -> None:
        spec = self._known(ev.stream_id).spec
        if not spec.input_latents:
            raise ValueError(f"stream {spec.stream_id} takes no input latents (it is not a video-to-video stream)")
        if ev.chunk < 0 or (spec.num_chunks is not None and ev.chunk >= spec.num_chunks):
            raise ValueError(f"stream {spec.stream_id}: input for chunk {ev.chunk} is out of range")
        if ev.latents is None or tuple(ev.latents.shape) != spec.latent_shape or ev.latents.dtype != torch.float32:
            got = None if ev.latents is None else (tuple(ev.latents.shape), ev.latents.dtype)
            raise ValueError(f"stream {spec.stream_id}: input latents must be float32 {spec.latent_shape}, got {got}")

    def _validate_batch(self, ev: PlanEvent) -> None:
        validate_batch(list(ev.steps), lambda st: self._known(st.stream).at(st.chunk))
        for st in ev.steps:
            specs = self.specs[st.stream]
            if st.level == specs.at(st.chunk).levels - 1:
                specs.prune(st.chunk + 1)  # chunks of a stream finish in order: earlier specs are done

    def _known(self, stream_id: int) -> ChunkSpecs:
        if stream_id not in self.specs:
            raise KeyError(f"unknown stream {stream_id}: never opened on this stage, or already closed")
        return self.specs[stream_id]

    def event_to_proto(self, ev: ExecutorEvent, index: int) -> pb.StageEvent:
        """An executor event as ``Results`` streams it (``index``: this stage's, named in an error)."""
        if ev.kind == "chunk":
            assert ev.latents is not None
            return pb.StageEvent(
                chunk=pb.ChunkResult(
                    stream_id=ev.stream_id,
                    chunk=ev.chunk,
                    latents=wire.tensor_to_proto(ev.latents.wait()),
                    seq=ev.seq,
                    steps=ev.steps,
                    finished_with=ev.finished_with,
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
                    eager=ev.eager,
                    timed=[
                        pb.BatchTime(forward_ms=t.forward_ms, micro_steps=t.micro_steps, eager=t.eager)
                        for t in ev.timed
                    ],
                )
            )
        return pb.StageEvent(
            error=pb.StageError(generation=self.number, seq=ev.seq, message=ev.message, stage_index=index)
        )


def _ignore(_event) -> None:
    pass
