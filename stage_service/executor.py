"""The stage's execution loop: plan events in, data-plane traffic and results out.

Usage::

    ex = StageExecutor(runner, transport, on_event=callback)   # transport None for a single stage
    ex = StageExecutor(runner, None, callback, prepare=fn)     # fn(stopping) runs first, on the executor's thread
    ex.start()
    ex.submit(PlanEvent("open", seq=seq, spec=..., text=...))       # validated by the caller, run in seq order
    ex.submit(PlanEvent("batch", seq=seq, steps=(...)))
    ex.stop()

Every stage executes the same events in the same order.  For a batch:

* stage 0 takes each item's input latent from its runner's store, first receiving from the last stage,
  in the order the last stage sends them, every latent it is owed up to the one it needs (a batch may need them in
  another order: one received earlier waits in the store);
* other stages receive the batch's hidden states from their predecessor;
* non-last stages send their output on; the last stage applies the sampler step, sends next-level
  latents back to stage 0 and reports finished chunks through ``on_event``.

The order in which the last stage sends latents is a pure function of the plan, so stage 0 tracks it
in ``_owed`` without any handshake.

A ``close`` frees the stream's KV, text K/V and latents; stage 0 first receives the next-level latents the last stage
still sends it for the stream (``_receive_owed_of``): on gloo, a send left unreceived past the group's timeout closes
the pair.  A ``prompt`` event with ``recache`` runs the window's (chunk, KV row) forwards through the pipeline in order
(``_recache``, ``SliceRunner.recache_step``), rewriting the window's K/V under the new prompt.

``prepare`` (the graph pre-capture, ``stage_service.precapture``) runs on the executor's thread before its first
event: events submitted meanwhile wait in the queue, and the RPC that formed the generation has already returned, so
the stage's lock is not held through it.  It is given ``stopping()``, true once ``stop`` was called, and should return
soon after.

CFG-parallel (``transport.cfg_parallel == 2``): the stage belongs to one of two groups, each a whole pipeline.
A batch's rows on this stage are its runner's (``SliceRunner.rows``: group 1 runs only the guided streams'
unconditional branch and skips a batch with none).  The two last stages swap their guided predictions before
the sampler step, so both step identically; only group 0's last stage reports finished chunks.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from stage_service.host_copy import HostTensor, to_host
from stage_service.metrics import BatchTiming, StageTelemetry
from stage_service.runner import SliceRunner
from stage_service.transport import PeerLost, PipeTransport, TransportAborted
from stagecast.microstep import MicroStep, PlanEvent, recache_steps

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BatchTime:
    """One batch's forward time (``BatchDone.timed``): its ms, rows, and whether it ran without its CUDA graph."""

    forward_ms: float
    micro_steps: int
    eager: bool = False


@dataclass
class ExecutorEvent:
    kind: str  # "chunk" | "done" | "error"
    seq: int
    stream_id: int = 0
    chunk: int = 0
    latents: HostTensor | None = None  # "chunk": the finished chunk's latents, on their way to the host
    message: str = ""
    forward_ms: float = 0.0
    wait_ms: float = 0.0
    micro_steps: int = 0
    # Parallel exchanges among the forwards reported: sequence-parallel collectives (``--sp``), or the CFG-parallel
    # swap of guided predictions with the other group's last stage (``--cfg-parallel 2``).
    exchange_ms: float = 0.0
    steps: int = 0  # "chunk": the denoising steps the chunk ran
    finished_with: int = 0  # "chunk": the chunks its batch finished, this one included
    batches: int = 0  # "done": batches whose times forward_ms sums
    eager: bool = False  # "done": this batch ran without a CUDA graph (with --cuda-graphs: a signature not captured)
    timed: list[BatchTime] = field(default_factory=list)  # "done": the batches forward_ms sums, one by one


_STOP = object()


class StageExecutor:
    def __init__(
        self,
        runner: SliceRunner,
        transport: PipeTransport | None,
        on_event: Callable[[ExecutorEvent], None],
        telemetry: StageTelemetry | None = None,
        prepare: Callable[[Callable[[], bool]], object] | None = None,
    ):
        self.runner = runner
        self.prepare = prepare  # run first on the executor's thread, given stopping() (module docstring)
        self.transport = transport
        self.on_event = on_event
        self.telemetry = telemetry  # metrics and spans (stage_service.metrics); None: not observed
        self.stream_traceparents: dict[int, str] = {}  # each open stream's span context, for batch span links
        self.queue: queue.Queue = queue.Queue()
        self.busy_since: float | None = None  # monotonic time the event being executed started (None: idle)
        self.failed: str | None = None
        self._stopping = False
        # Latents the last stage will send to stage 0, in its send order, with their shapes: a stream closed
        # while some are in flight (a cancel) still has them received, and dropped, to keep the pair in order.
        self._owed: deque[tuple[MicroStep, tuple[int, ...]]] = deque()
        # CUDA event pairs of batches whose GPU time has not been read yet (read when done, never synced).
        # (micro-steps, start, end, counted, eager): a batch that captured its CUDA graph in line is not counted
        self._timings: deque[tuple[int, torch.cuda.Event, torch.cuda.Event, bool, bool]] = deque()
        self._cuda = runner.slice.device.type == "cuda"
        self._thread = threading.Thread(target=self._loop, name="stage-executor", daemon=True)
        sl = runner.slice
        self.first, self.last = sl.first, sl.last

    def start(self) -> None:
        self._thread.start()

    def submit(self, item: PlanEvent) -> None:
        self.queue.put(item)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop after the current event; events still queued are dropped."""
        self._stopping = True
        if self.transport is not None:
            self.transport.abort()
        while True:
            try:
                self.queue.get_nowait()
            except queue.Empty:
                break
        self.queue.put(_STOP)
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def stalled_s(self) -> float:
        """Seconds the event being executed has run (0 when idle): an executor that makes no progress grows it."""
        since = self.busy_since
        return 0.0 if since is None else max(0.0, time.monotonic() - since)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # ---- loop -----------------------------------------------------------------------------------------

    def _loop(self) -> None:
        if self._cuda:
            # The current device is per thread: without this, streams and events here would be cuda:0's.
            torch.cuda.set_device(self.runner.slice.device)
        if self.prepare is not None:
            try:
                self.prepare(lambda: self._stopping)
            except Exception:  # noqa: BLE001 - a head start (the graph pre-capture), never a reason not to serve
                logger.warning("stage executor: preparing failed; serving without it", exc_info=True)
        while True:
            if self.telemetry is not None:
                waited = time.perf_counter()
                item = self.queue.get()
                self.telemetry.idle(time.perf_counter() - waited)
            else:
                item = self.queue.get()
            if item is _STOP:
                return
            self.busy_since = time.monotonic()
            try:
                self._run(item)
            except Exception as exc:  # noqa: BLE001 - reported to the coordinator, which ends the generation
                if self._stopping:
                    # Leaving the generation released a data-plane wait: the line that says why was logged already.
                    quiet = isinstance(exc, (PeerLost, TransportAborted))
                    log = logger.debug if quiet else logger.info
                    log("stage executor stopped during event %d (%s): %s", item.seq, item.kind, exc)
                    return
                self.failed = f"stage event {item.seq} ({item.kind}) failed: {type(exc).__name__}: {exc}"
                if isinstance(exc, (PeerLost, TransportAborted)):
                    # A peer left the generation (its message names it): expected while one ends, one line, no
                    # traceback.
                    logger.error("stage executor stopped: %s", self.failed)
                else:
                    logger.exception("stage executor failed")
                self.on_event(ExecutorEvent("error", item.seq, message=self.failed))
                return
            finally:
                self.busy_since = None

    def _run(self, item: PlanEvent) -> None:
        if item.kind == "open":
            assert item.spec is not None and item.text is not None
            self.runner.open_stream(item.spec, item.text, item.latents, negative_text=item.negative_text)
            if item.traceparent:
                self.stream_traceparents[item.spec.stream_id] = item.traceparent
        elif item.kind == "close":
            assert item.stream_id is not None
            self._receive_owed_of(item.stream_id)
            self.runner.close_stream(item.stream_id)
            self.stream_traceparents.pop(item.stream_id, None)
        elif item.kind == "prompt":
            assert item.stream_id is not None and item.text is not None
            self.runner.set_prompt(item.stream_id, item.from_chunk, item.text)
            if item.recache:
                self._recache(item)
        elif item.kind == "input":
            assert item.stream_id is not None and item.latents is not None
            self.runner.put_input(item.stream_id, item.chunk, item.latents)
        elif item.kind == "steps":
            assert item.stream_id is not None
            self.runner.set_steps(item.stream_id, item.from_chunk, item.timesteps)
        elif item.kind == "batch":
            self._run_batch(item)
        else:
            raise ValueError(f"unknown plan event kind {item.kind!r}")

    def _recache(self, item: PlanEvent) -> None:
        """Rebuild the stream's KV window under its new prompt: one forward per (window chunk, KV row), through
        every stage in order (``stagecast.microstep.recache_steps``); the first stage embeds the chunk's clean latent
        from the event, the last stage keeps only the K/V.  Every stage runs the same loop, so sends and receives pair
        up."""
        runner, tp = self.runner, self.transport
        sid, first = item.stream_id, item.from_chunk
        if not runner.recaches(sid):  # every stage of this group holds none of the stream's conditional KV
            return
        spec = runner.spec_at(sid, first)
        window = dict(item.window)
        distributed = tp is not None and tp.world_size > 1
        tokens = runner.slice.tokens_per_frame(spec.latent_height, spec.latent_width) * spec.chunk_frames
        start, start_ns = time.perf_counter(), time.time_ns()
        steps = recache_steps(spec, first, runner.rope_limit)
        for chunk, row in steps:
            hidden = None
            if not self.first:
                assert tp is not None
                hidden = tp.recv_hidden((1, tokens, runner.slice.inner_dim), runner.slice.dtype)
            out = runner.recache_step(sid, chunk, row, first, clean=window.get(chunk), inputs=hidden)
            if out is not None and distributed:
                tp.send_hidden(out)
        if self.telemetry is not None:
            self.telemetry.recache(item, start_ns, time.time_ns(), len(steps))
        logger.info(
            "stream %d: recached %d forwards before chunk %d in %.1f ms",
            sid,
            len(steps),
            first,
            (time.perf_counter() - start) * 1e3,
        )

    def _receive_owed_of(self, stream_id: int) -> None:
        """Stage 0 of a pipeline, at a stream's close: receive now the latents the last stage still sends it for the
        stream's next levels (a stream cancelled with chunks in flight), and those sent before them.  Left for a later
        batch to receive, they waited for one: on gloo a send is done only once received, and a send that waits out
        the group's timeout (an idle pipeline) closes the pair, failing the next stream on it."""
        tp = self.transport
        if not (self.first and tp is not None and tp.pipeline > 1):
            return
        owed = [step for step, _ in self._owed if step.stream == stream_id]
        if owed:
            self._receive_owed(owed)

    def _receive_owed(self, needed: list[MicroStep]) -> None:
        tp = self.transport
        assert tp is not None
        # A batch may take a chunk's next level after one whose latent came back later (the scheduler lets paced
        # streams' micro-steps go first): that latent was received, in order, with an earlier batch's and waits here.
        want = {st for st in needed if not self.runner.holds_latent(st)}
        while want:
            if not self._owed:
                raise RuntimeError(f"stage 0 needs latents for {sorted(map(str, want))} that no batch produces")
            step, shape = self._owed.popleft()
            latent = tp.recv_latent(shape)
            if step.stream in self.runner.streams:
                self.runner.put_latent(step, latent)
            want.discard(step)

    def _finish_last(self, item: PlanEvent, out, distributed: bool) -> int:
        """The last stage's end of a batch: the guidance exchange (CFG-parallel), the sampler, each next-level latent
        to the first stage, each finished chunk reported.  Returns when the compute ended (ns)."""
        runner, tp, steps = self.runner, self.transport, item.steps
        peer = None
        if runner.cfg_size == 2:
            own = runner.exchanged_rows(list(steps), out)
            if own is not None:
                assert tp is not None
                peer = tp.exchange_guidance(own)
        results = runner.finish(steps, out, peer)
        t_compute = time.time_ns()
        finished = sum(1 for res in results if res.finished is not None)
        for res in results:
            if res.next_latent is not None and distributed:
                tp.send_latent(res.next_latent)
            # One report per stage, not per rank, and only from CFG group 0.
            if res.finished is not None and runner.sp.rank == 0 and runner.cfg_rank == 0:
                self.on_event(
                    ExecutorEvent(
                        "chunk",
                        item.seq,
                        stream_id=res.step.stream,
                        chunk=res.step.chunk,
                        latents=to_host(res.finished),  # its copy starts now, behind the kernels that made it
                        steps=runner.spec_at(res.step.stream, res.step.chunk).steps,
                        finished_with=finished,
                    )
                )
        return t_compute

    def _measured(
        self, wall_ms: float, rows: int, sample_ms: float, counted: bool, eager: bool
    ) -> tuple[list[BatchTime], list[float]]:
        """What a batch reports of its time: each timed batch, and the samples for its span.  On a CPU, this batch's
        wall time (nothing when it captured a graph in line); on a GPU, every earlier batch whose CUDA events have
        completed (reading this one's would wait for the GPU)."""
        if not self._cuda:
            return ([BatchTime(wall_ms, rows, eager)], [sample_ms]) if counted else ([], [])
        timed: list[BatchTime] = []
        while self._timings and self._timings[0][2].query():
            n, a, b, was_counted, was_eager = self._timings.popleft()
            if was_counted:
                timed.append(BatchTime(a.elapsed_time(b), n, was_eager))
        return timed, [t.forward_ms for t in timed]

    def _run_batch(self, item: PlanEvent) -> None:
        steps = item.steps
        runner, tp = self.runner, self.transport
        runner.check_batch(steps)
        t_start = time.time_ns()
        wait_before = tp.wait_seconds if tp else 0.0
        exchange_before = tp.exchange_seconds if tp else 0.0
        # Latents travel between the last stage and the first only when they are different stages.
        distributed = tp is not None and tp.pipeline > 1
        sp = runner.sp.size
        mine = [st for st in steps if runner.computes(st)]
        rows = runner.rows(list(steps))
        if not rows:  # CFG-parallel group 1: no guided stream in this batch
            self.on_event(ExecutorEvent("done", item.seq))
            return
        if self.first and distributed:
            self._receive_owed([st for st in mine if st.level > 0])
        inputs = None
        if not self.first:
            assert tp is not None
            spec = runner.spec(steps[0].stream)
            tokens = runner.slice.tokens_per_frame(spec.latent_height, spec.latent_width) * spec.chunk_frames
            inputs = tp.recv_hidden((len(rows), tokens // sp, runner.slice.inner_dim), runner.slice.dtype)
        t_recv = time.time_ns()
        start = time.perf_counter()
        captures_before = runner.graphs.inline_captures if runner.graphs is not None else 0
        eager_before = runner.graphs.eager_batches if runner.graphs is not None else 0
        if self._cuda:
            ev_start = torch.cuda.Event(enable_timing=True)
            ev_start.record()
        out = runner.forward(steps, inputs)
        # A forward that captured its graph in line (a warm-up stream's) took the capture's time, seconds at worst:
        # it is not reported, or the SLO model would take it for what a batch of this size costs.
        counted = runner.graphs is None or runner.graphs.inline_captures == captures_before
        eager = runner.graphs is not None and runner.graphs.eager_batches > eager_before
        if self._cuda:
            ev_end = torch.cuda.Event(enable_timing=True)
            ev_end.record()
            self._timings.append((len(rows), ev_start, ev_end, counted, eager))
        if not self.last:
            t_compute = time.time_ns()
            assert tp is not None
            tp.send_hidden(out)
        else:
            t_compute = self._finish_last(item, out, distributed)
        if self.first and distributed:
            # The last stage will send, in this order, the next-level input of every item that has one.
            for st in mine:
                spec = runner.spec_at(st.stream, st.chunk)
                if st.level + 1 < spec.levels:
                    self._owed.append((MicroStep(st.stream, st.chunk, st.level + 1), spec.latent_shape))
        timed, forward_samples = self._measured(
            (time.perf_counter() - start) * 1e3, len(rows), (t_compute - t_recv) / 1e6, counted, eager
        )
        forward_ms = sum(t.forward_ms for t in timed)
        wait_ms = ((tp.wait_seconds if tp else 0.0) - wait_before) * 1e3
        if self.telemetry is not None:
            received = distributed and (not self.first or any(st.level > 0 for st in steps))
            sent = distributed and (
                not self.last or any(st.level + 1 < runner.spec_at(st.stream, st.chunk).levels for st in steps)
            )
            end = time.time_ns()
            timing = BatchTiming(t_start, t_recv, t_compute, end, received, sent, forward_ms, forward_samples)
        exchange_ms = runner.sp.take_ms() + ((tp.exchange_seconds if tp else 0.0) - exchange_before) * 1e3
        done = ExecutorEvent(
            "done",
            item.seq,
            forward_ms=forward_ms,
            wait_ms=wait_ms,
            micro_steps=sum(t.micro_steps for t in timed),
            exchange_ms=exchange_ms,
            batches=len(timed),
            eager=eager,
            timed=timed,
        )
        self.on_event(done)
        runner.prefetch_noise(steps)  # while the GPU runs this batch (no wait on it above)
        if self.telemetry is not None:
            self.telemetry.batch(item, timing)  # after the done report: spans are off the critical path
