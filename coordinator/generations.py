"""Generations, rendezvous and stage health: the half of the coordinator's engine that forms the pipeline.

``Generations`` is one of the parts ``coordinator.engine.PipelineEngine`` holds: it forms a generation once every stage
is registered (each stage joins the process group through the rendezvous the coordinator serves), reads every stage's
results, health-checks the stages, and when one is lost ends the generation, resets the survivors and forms the
next one.  It shares the engine's one lock (``cond``) with the other parts and hands work to them only through the
callbacks it is given and these calls:

- ``on_formed`` (engine): every stage answered Form; the plan restarts, admission and the SLO model take the replies;
- ``on_chunk`` / ``on_done`` (engine): a stage's results of the current generation;
- ``end_all`` (stream table): every active stream ends with a failure when a generation does;
- ``heartbeat`` / ``on_registered`` / ``fail`` (coordinator.server, through the engine): a stage says where it stands;
- ``on_fatal`` (coordinator.server): a stage refused Form with RESOURCE_EXHAUSTED (its KV budget holds no stream at the
  serving defaults): nothing is re-formed, the pipeline never becomes READY and the coordinator's start-up fails.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from coordinator.errors import StreamFailure
from coordinator.metrics import CoordinatorTelemetry
from coordinator.registry import StageRecord, StageRegistry
from coordinator.scheduler import StreamBatchScheduler
from stagecast.internal.v1 import pipeline_pb2 as pb
from stagecast.internal.v1 import pipeline_pb2_grpc as pb_grpc

logger = logging.getLogger("coordinator.engine")


class StageLink:
    """Channel, stubs and an ordered submit queue for one stage of one generation."""

    def __init__(
        self, record: StageRecord, on_error: Callable[[int, str], None], connect: Callable[[str], grpc.Channel]
    ):
        self.record = record
        self.channel = connect(record.address)
        self.stub = pb_grpc.StageServiceStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self.outbox: queue.Queue = queue.Queue()
        self.on_error = on_error
        self.results_call = None
        self._sender = threading.Thread(target=self._send_loop, daemon=True, name=f"submit-{record.index}")
        self._sender.start()

    def _send_loop(self) -> None:
        while True:
            ev = self.outbox.get()
            if ev is None:
                return
            try:
                self.stub.Submit(ev, timeout=60)
            except ValueError:
                return  # close() closed the channel under a submit in flight: the link is gone, nothing to report
            except grpc.RpcError as exc:
                self.on_error(self.record.index, f"submit to stage {self.record.index} failed: {exc.details()}")
                return

    def close(self) -> None:
        self.outbox.put(None)
        if self.results_call is not None:
            self.results_call.cancel()
        self.channel.close()


class Generations:
    """Forming, failing and re-forming generations (see the module docstring).  Its state (the generation, whether it
    is ready or forming, its stage links and scheduler, the resets under way) is guarded by the engine's lock
    (``cond``); what it does for the rest of the coordinator it does through the callbacks it is given."""

    def __init__(
        self,
        cond: threading.Condition,
        registry: StageRegistry,
        telemetry: CoordinatorTelemetry,
        *,
        connect: Callable[[str], grpc.Channel],
        backend: str,
        max_batch: int,
        form_timeout: float,
        on_ready_change: Callable[[bool], None],
        on_formed: Callable[[dict[int, pb.FormReply]], None],
        on_chunk: Callable[[int, pb.ChunkResult], None],
        on_done: Callable[[int, int, pb.BatchDone, bool], None],
        end_all: Callable[[StreamFailure], None],
    ):
        self.cond = cond
        self.registry = registry
        self.telemetry = telemetry
        self.connect = connect
        self.backend = backend
        self.max_batch = max_batch
        self.form_timeout = form_timeout
        self.on_ready_change = on_ready_change
        # Under the lock, once every stage answered Form (index -> ``FormReply``), before the generation is ready.
        self.on_formed = on_formed
        self.on_chunk = on_chunk  # a stage's chunk result of the current generation (plan loop's side)
        self.on_done = on_done  # a stage's batch done (plan loop's side)
        self.end_all = end_all  # every active stream ends with a failure when a generation does
        # A Form refused for want of memory for one stream (RESOURCE_EXHAUSTED): the coordinator's start-up fails with
        # this message (``coordinator.server.Coordinator``); None: it is retried like any failed Form.
        self.on_fatal: Callable[[str], None] | None = None
        self._generation = 0
        self._ready = False
        self.forming = False
        self._stopped = False  # the engine is shutting down: nothing more forms
        self._links: list[StageLink] = []
        self._sched: StreamBatchScheduler | None = None
        self._stage_stats: dict[int, pb.StageStats] = {}
        self._last_error = ""
        self.resetting = 0
        self._monitor_stop = threading.Event()
        self._workers: set[threading.Thread] = set()  # forming and resetting threads, joined by close

    # What the rest of the coordinator reads: the generation's state, written here only.
    generation = property(lambda self: self._generation)  # the current generation's number (0: none yet)
    ready = property(lambda self: self._ready)  # a generation is formed and serving
    stopped = property(lambda self: self._stopped)  # the engine is shutting down
    links = property(lambda self: list(self._links))  # the formed generation's stage links
    sched = property(lambda self: self._sched)  # the formed generation's scheduler (None: none formed)
    last_error = property(lambda self: self._last_error)  # why the last generation ended or failed to form

    def stats(self) -> list[pb.StageStats]:
        """Each stage's counters in this generation (GetStatus), by index."""
        return [self._stage_stats[i] for i in sorted(self._stage_stats)]

    def set_max_batch(self, max_batch: int) -> None:
        """The Stream Batch the formed generation's scheduler forms from now on."""
        if self._sched is not None:
            self._sched.max_batch = max_batch

    def adopt(self, sched: StreamBatchScheduler | None) -> None:
        """Mark a generation formed around ``sched`` with no stage process, or none formed (None): for an engine
        driven by hand in process (``tests/engine_helpers.py``), where nothing is sent anywhere."""
        self._sched = sched
        self._ready = sched is not None

    def shut(self) -> tuple[list[StageLink], list[threading.Thread]]:
        """Under the lock, as the engine shuts down: nothing more forms; the links and workers to close and join."""
        self._stopped = True
        links, self._links = self._links, []
        return links, list(self._workers)

    def close(self, links: list[StageLink], workers: list[threading.Thread], timeout: float) -> None:
        """After ``shut``, outside the lock: stop the health monitor, close the links, join the workers."""
        self._monitor_stop.set()
        for link in links:
            link.close()
        # Forming and resetting talk to stages with deadlines; wait for them so that none is still running
        # (and starting threads) while the interpreter shuts down.
        for worker in workers:
            worker.join(timeout)

    def _spawn(self, target, *args, name: str) -> None:
        """Run a forming or resetting job in its own thread, unless the engine is shutting down.  A reset is
        counted in ``resetting`` from now on, so that no generation forms before it has run."""
        with self.cond:
            if self._stopped:
                if target == self._form:
                    self.forming = False
                return
            if target == self._reset_then_reform:
                self.resetting += 1
            thread = threading.Thread(target=self._tracked, args=(target, *args), daemon=True, name=name)
            self._workers.add(thread)
            thread.start()

    def _tracked(self, target, *args) -> None:
        try:
            target(*args)
        finally:
            with self.cond:
                self._workers.discard(threading.current_thread())

    def on_registered(self, record: StageRecord) -> None:
        with self.cond:
            in_current = any(link.record.index == record.index for link in self._links)
        if in_current:
            # A stage of the running generation came back as a new process: that generation is gone.
            self.fail(f"stage {record.index} restarted", lost=None)
        self._maybe_form()

    def _maybe_form(self) -> None:
        with self.cond:
            if self._ready or self.forming or self.resetting or self._stopped or not self.registry.complete:
                return
            self.forming = True
            self._generation += 1
            gen = self._generation
        self._spawn(self._form, gen, name=f"form-{gen}")

    def _form(self, gen: int) -> None:
        records = self.registry.records()
        links = [StageLink(r, lambda i, msg, g=gen: self._link_error(g, i, msg), self.connect) for r in records]
        world = len(records)

        replies: dict[int, pb.FormReply] = {}

        def form_one(link: StageLink) -> None:
            rec = link.record
            replies[rec.index] = link.stub.Form(
                pb.Rendezvous(
                    generation=gen,
                    rank=rec.index,
                    world_size=world,
                    backend=self.backend,
                    layer_start=rec.layers.start,
                    layer_stop=rec.layers.stop,
                    sp=self.registry.sp,
                    cfg_parallel=self.registry.cfg_parallel,
                ),
                timeout=self.form_timeout,
            )

        pool = ThreadPoolExecutor(max_workers=world)
        futures = [pool.submit(form_one, link) for link in links]
        done, silent = self._wait_forming(futures, links)
        pool.shutdown(wait=False)
        errors = [f.exception() for f in done if f.exception() is not None]
        short = [e for e in errors if isinstance(e, grpc.RpcError) and e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED]
        if silent is None and short and self.on_fatal is not None:
            # A stage that holds no stream at the serving defaults (stage_service.kv_budget.stream_fit_problem): no
            # re-forming helps, so the pipeline never becomes READY and the coordinator's start-up fails saying why.
            detail = short[0].details()
            logger.error("forming generation %d failed: %s", gen, detail)
            for link in links:
                link.close()
            with self.cond:
                self.forming = False
                self._last_error = f"start-up failed: {detail}"
            self.on_fatal(detail)
            return
        if silent is not None or errors or len(done) < len(futures):
            if silent is not None:
                detail = f"stage {silent.index} stopped answering health checks while forming"
                self.registry.mark_lost(silent.index, silent.address)
            elif errors and isinstance(errors[0], grpc.RpcError):
                detail = errors[0].details()
            else:
                detail = str(errors or f"no answer within the form timeout ({self.form_timeout:g}s)")
            logger.error("forming generation %d failed: %s", gen, detail)
            for link in links:
                link.close()
            with self.cond:
                self.forming = False
                self.resetting += 1  # counted before forming is cleared for anyone else to see
                self._last_error = f"forming generation {gen} failed: {detail}"
            # Stages still waiting in the rendezvous are released by Reset (leaving shuts their connections).
            self._reset_then_reform(records, f"forming generation {gen} failed", gen)
            return
        with self.cond:
            if self._generation != gen or self._stopped:
                for link in links:
                    link.close()
                return
            self._links = links
            # The schedule's depth is the pipeline's: a stage's sequence-parallel ranks run each batch together, and
            # CFG-parallel groups run it side by side.
            self._sched = StreamBatchScheduler(
                num_stages=self.registry.pipeline_stages,
                max_batch=self.max_batch,
                cfg_parallel=self.registry.cfg_parallel,
                equal_windows=any(r.cuda_graphs for r in replies.values()),
                rope_limit=self.registry.rope_limit(),
            )
            self._stage_stats = {}
            self.on_formed(
                replies
            )  # before ready: the plan restarts, the SLO model is seeded once the pipeline is formed
            self.forming = False
            self._ready = True
            self._monitor_stop = threading.Event()
            self.cond.notify_all()
        for link in links:
            threading.Thread(target=self._results_loop, args=(gen, link), daemon=True).start()
        threading.Thread(target=self._monitor, args=(gen, links, self._monitor_stop), daemon=True).start()
        logger.info("generation %d formed with %d stages", gen, world)
        self.on_ready_change(True)

    def _wait_forming(self, futures: list, links: list[StageLink]) -> tuple[set, StageRecord | None]:
        """Wait for every stage's Form, health-checking them meanwhile: a stage that hangs without dropping its
        connection (paused, wedged) is caught in about two seconds, not at the form timeout.  Returns the done
        futures and the record of a silent stage (None when all answered)."""
        deadline = time.monotonic() + self.form_timeout
        misses = {link.record.index: 0 for link in links}
        while True:
            left = deadline - time.monotonic()
            done, pending = wait(futures, timeout=min(0.5, max(left, 0.0)), return_when=FIRST_EXCEPTION)
            if not pending or any(f.exception() is not None for f in done) or left <= 0 or self._stopped:
                return done, None
            for link, future in zip(links, futures, strict=True):
                if future.done():
                    continue  # formed: it waits for the others
                try:
                    link.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=2.0)
                    misses[link.record.index] = 0
                except ValueError:  # grpc: "Cannot invoke RPC on closed channel": its links were closed (shutting
                    return  # down, or the generation ended), so there is nothing left to watch
                except grpc.RpcError:
                    misses[link.record.index] += 1
                    if misses[link.record.index] >= 2:
                        return done, link.record

    def _link_error(self, gen: int, index: int, message: str) -> None:
        with self.cond:
            if gen != self._generation:
                return
        self.fail(message, lost=None)

    def fail(self, reason: str, lost: int | None, lost_address: str | None = None, orderly: bool = False) -> None:
        """End the current generation: fail its streams, reset survivors, re-form when possible.  ``orderly``: a stage
        left on purpose (it was shut down), which is logged as a warning, not an error."""
        with self.cond:
            if not self._ready:
                if lost is not None:
                    self.registry.mark_lost(lost, lost_address)
                return
            log = logger.warning if orderly else logger.error
            log("generation %d %s: %s", self._generation, "ended" if orderly else "failed", reason)
            self._ready = False
            self._last_error = reason
            self._sched = None
            self.telemetry.generation_ended(reason, failed=True)
            msg = f"pipeline generation {self._generation} failed: {reason}; the stream cannot continue"
            self.end_all(StreamFailure(grpc.StatusCode.UNAVAILABLE, msg))
            links, self._links = self._links, []
            self._monitor_stop.set()
            if lost is not None:
                self.registry.mark_lost(lost, lost_address)
            self.cond.notify_all()
        self.on_ready_change(False)
        for link in links:
            link.close()
        gen = self._generation
        self._spawn(self._reset_then_reform, [link.record for link in links], reason, gen, name=f"reset-{gen}")

    def _reset_then_reform(self, records: list[StageRecord], reason: str, generation: int) -> None:
        """Runs in a ``_spawn``ed thread, which counted itself in ``resetting`` (no generation forms meanwhile)."""
        try:
            self._reset_stages(records, reason, generation)
        finally:
            with self.cond:
                self.resetting -= 1
        self._maybe_form()

    def _reset_stages(self, records: list[StageRecord], reason: str, generation: int) -> None:
        """Reset every stage at once: leaving shuts a stage's connections, which releases its peers."""

        def reset(rec: StageRecord) -> None:
            try:
                with self.connect(rec.address) as ch:
                    request = pb.ResetRequest(generation=generation, reason=reason)
                    pb_grpc.StageServiceStub(ch).Reset(request, timeout=15)
            except grpc.RpcError as exc:
                logger.warning("stage %d did not answer Reset (%s): marking it lost", rec.index, exc.code().name)
                self.registry.mark_lost(rec.index, rec.address)

        threads = [threading.Thread(target=reset, args=(rec,), daemon=True) for rec in records]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    def count_batch(self, index: int, done: pb.BatchDone) -> None:
        """A stage's finished batch, into its ``StageStats`` (GetStatus) for this generation."""
        st = self._stage_stats.setdefault(index, pb.StageStats(index=index))
        st.batches += 1
        st.forward_ms_total += done.forward_ms
        st.wait_ms_total += done.wait_ms
        st.micro_steps += done.micro_steps
        st.exchange_ms_total += done.exchange_ms
        st.eager_batches += done.eager

    def status(self, into: pb.ClusterStatus, kv_budgets: dict[int, int], kv_reserved: dict[int, int]) -> None:
        """Its part of GetStatus: the generation, whether it is ready, every stage and its counters."""
        into.generation = self._generation
        into.ready = self._ready
        into.stages.extend(self.stage_descriptions(kv_budgets, kv_reserved))
        into.stage_stats.extend(self.stats())

    def stage_descriptions(self, kv_budgets: dict[int, int], kv_reserved: dict[int, int]) -> list:
        """Under the lock: every registered stage, whether it is in the formed generation, its KV budget and use."""
        return [
            pb.StageDescription(
                index=r.index,
                address=r.address,
                layer_start=r.layers.start,
                layer_stop=r.layers.stop,
                device=r.device,
                formed=self._ready and not r.lost,
                kv_budget_bytes=kv_budgets.get(r.index, 0),
                kv_reserved_bytes=kv_reserved.get(r.index, 0),
            )
            for r in self.registry.records()
        ]

    def heartbeat(self, index: int, address: str, generation: int) -> tuple[bool, str]:
        """A stage says it is alive and holds ``generation`` (0: none).  Returns (rejoin, reason): whether it
        is outside the current generation, so that it must drop its state and register again."""
        rec = self.registry.get(index)
        if rec is None or rec.address != address:
            return True, f"stage {index} at {address} is not registered with this coordinator"
        if rec.lost:
            return True, f"stage {index} was marked lost"
        if generation == 0:
            return False, ""  # alive, waiting to join: the next generation forms once every stage is here
        with self.cond:
            if generation == self._generation and (self._ready or self.forming):
                return False, ""
            if self.resetting:
                return False, ""  # a Reset is on its way to it
            return True, f"generation {generation} is over (the coordinator is at {self._generation})"

    def _results_loop(self, gen: int, link: StageLink) -> None:
        # Group 0's last rank runs every batch (CFG-parallel group 1 skips batches without guidance).
        last = link.record.index == self.registry.layout.world_size - 1
        try:
            call = link.stub.Results(pb.ResultsRequest(generation=gen))
            link.results_call = call
            for ev in call:
                kind = ev.WhichOneof("event")
                if kind == "chunk":
                    self.on_chunk(gen, ev.chunk)
                elif kind == "done":
                    self.on_done(gen, link.record.index, ev.done, last)
                elif kind == "error":
                    self.fail(f"stage {ev.error.stage_index}: {ev.error.message}", lost=None)
                    return
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.CANCELLED:
                return
            with self.cond:
                current = gen == self._generation and self._ready
            if current:
                self.fail(
                    f"lost contact with stage {link.record.index} ({exc.code().name})",
                    lost=link.record.index,
                    lost_address=link.record.address,
                )
            return
        with self.cond:
            current = gen == self._generation and self._ready
        if current:
            # A stage ends its Results stream itself only when it leaves the generation: on SIGTERM (a normal
            # shutdown of `up` or a pod) or on a reset; its own log says which.
            self.fail(f"stage {link.record.index} left (it closed its results stream)", lost=None, orderly=True)

    def _monitor(self, gen: int, links: list[StageLink], stop: threading.Event) -> None:
        """Catch stages that hang without dropping their connections."""
        misses = {link.record.index: 0 for link in links}
        while not stop.wait(0.5):
            for link in links:
                try:
                    link.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=2.0)
                    misses[link.record.index] = 0
                except ValueError:  # grpc: "Cannot invoke RPC on closed channel": its links were closed (shutting
                    return  # down, or the generation ended), so there is nothing left to watch
                except grpc.RpcError:
                    misses[link.record.index] += 1
                    if misses[link.record.index] >= 2:
                        self.fail(
                            f"stage {link.record.index} stopped answering health checks",
                            lost=link.record.index,
                            lost_address=link.record.address,
                        )
                        return
