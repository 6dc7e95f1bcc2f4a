"""The plan loop: the coordinator's one scheduling thread, which turns the streams' changes into plan events.

``PlanLoop`` is one of the parts ``coordinator.engine.PipelineEngine`` holds.  Its thread waits on the engine's
condition (``cond``) until there is work (``has_work``) or a paced stream's next chunk is due (``Pacing.pace_timeout``),
then under the lock ticks (``tick``): it applies the stream table's changes (``StreamTable.take_changes``: opens,
stops, cancels and prompt changes) to the scheduler, lets the SLO glue pick steps and gives each stream its credit,
plans a batch, and closes the streams that left the scheduler; outside the lock it hands the tick's events to every
stage's ordered sender.  What it planned for a stream it reports to the stream table (``progressed``,
``planned_all``, ...) and to pacing (``start``): it assigns no stream's fields itself.

The number of batches planned but not yet completed by the last stage is bounded
(``lookahead``), so plans run ahead of execution without queuing unboundedly; with ``paced_lookahead``, while any
stream is paced the bound is one batch per stage (``in_flight_limit``).  Anything that makes work calls ``wake`` under
the lock.

Besides ``open``, ``batch`` and ``close``, two events ride the same ordered stream, so the reference replays them:

- ``input`` (video-to-video, ``StreamSpec.input_latents``): a chunk's input latents, planned right before the batch
  that starts the chunk; the first stage embeds them and the last stage's sampler step starts from them;
- ``prompt`` with ``recache`` (a prompt update with transition recache): the stream's new chunks wait until the ones
  in flight are back (``plan_recache``), then the event carries the clean latents of the chunks its window still sees,
  and every stage rewrites that window's K/V under the new prompt (``stage_service.executor``,
  ``stagecast.microstep.recache_steps``).

A stream that leaves the scheduler gets a ``close`` once its started chunks are planned (``close_left``): every stage
frees its KV, text K/V and latents.  A stop is graceful (no new chunks; those in flight finish and are delivered); a
cancel (a lost client, a stream the gateway ended) drops the stream from the scheduler at once, and its close follows
the batches already planned, which still run on every stage.
"""

from __future__ import annotations

import threading
from dataclasses import replace

from coordinator.generations import Generations
from coordinator.metrics import CoordinatorTelemetry
from coordinator.pacing import PACE_EARLY_S, Pacing
from coordinator.registry import StageRegistry
from coordinator.scheduler import StreamBatchScheduler
from coordinator.slo_control import SloControl
from coordinator.streams import StreamChanges, StreamSession, StreamTable
from stagecast import wire
from stagecast.internal.v1 import pipeline_pb2 as pb
from stagecast.microstep import PlanEvent, recache_steps


class PlanLoop:
    """The scheduling thread and its counters: plan sequence, batches planned and done, the idle ticks."""

    def __init__(
        self,
        cond: threading.Condition,
        registry: StageRegistry,
        gens: Generations,
        streams: StreamTable,
        pacing: Pacing,
        slo: SloControl,
        telemetry: CoordinatorTelemetry,
        *,
        lookahead: int,
        paced_lookahead: bool = False,
        record_plan: bool = False,
    ):
        self.cond = cond
        self.registry = registry
        self.gens = gens  # the generation's scheduler, links and number; whether it is ready or shutting down
        self.streams = streams
        self.pacing = pacing
        self.slo = slo
        self.telemetry = telemetry
        self._lookahead = lookahead  # fixed at construction: read-only (``lookahead``)
        self.paced_lookahead = paced_lookahead
        self._record_plan = record_plan
        self.seq = 0
        self.batches_planned = 0
        self.batches_done = 0
        self.plan: list[pb.PlanEvent] = []
        self._idle_ticks = 0
        # Chunks started since the engine began, across streams and generations (it never falls), and its value when
        # the plan loop last woke for a paced chunk: the loop ticks for a paced chunk once per chunk started.
        self._chunks_started = 0
        self._kicked = -1
        self.thread = threading.Thread(target=self.run, daemon=True, name="scheduler")

    def start(self) -> None:
        self.thread.start()

    def join(self, timeout: float) -> None:
        if self.thread.is_alive():
            self.thread.join(timeout)

    def batch_done(self) -> None:
        """Under the lock: the last stage finished a batch of this generation."""
        self.batches_done += 1
        self.wake()

    @property
    def lookahead(self) -> int:
        """The bound on batches in flight the coordinator was started with (``--lookahead``, or its default)."""
        return self._lookahead

    @property
    def record_plan(self) -> bool:
        """Whether the plan is recorded for GetPlan."""
        return self._record_plan

    def in_flight(self) -> int:
        """Batches planned and not yet finished by the last stage."""
        return self.batches_planned - self.batches_done

    def recorded(self) -> list[pb.PlanEvent]:
        """The plan recorded so far (``record_plan``; texts left out), for GetPlan."""
        return list(self.plan)

    def restart(self) -> None:
        """Under the lock, as a new generation forms: its plan starts from sequence 0 with nothing in flight."""
        self.seq = 0
        self.batches_planned = self.batches_done = 0

    def in_flight_limit(self) -> int:
        """Batches that may be planned and not yet finished by the last stage: ``lookahead``; with ``paced_lookahead``,
        while any stream is paced, one batch per stage.  Paced streams start their chunks up to their playout
        buffer before they are due, so the stage waiting for the next batch's plan (about a millisecond) costs them
        nothing they see, while a batch queued beyond the stages' one each is a forward more that a joining stream's
        first chunk waits behind (it goes first only among the micro-steps not yet planned).  Best-effort (unpaced)
        streams never widen the bound while a paced one runs (they take what paced streams leave, a plan's wait
        included); with only unpaced streams, which have no buffer, the stages never wait for a plan."""
        sched = self.gens.sched
        if not self.paced_lookahead or sched is None:
            return self._lookahead
        for sid in sched.streams:
            session = self.streams.find(sid)
            if session is not None and session.chunk_rate > 0:
                return min(self._lookahead, self.registry.pipeline_stages)
        return self._lookahead

    def has_work(self) -> bool:
        if not self.gens.ready or self.gens.sched is None:
            return False
        if self.streams.has_pending():
            return True
        # After P empty ticks in a row nothing waits on pipeline latency any more: only an outside event
        # (a batch done, a chunk delivered, an open or stop) can make work, and each one wakes the loop.
        return (
            self.gens.sched.active
            and self.batches_planned - self.batches_done < self.in_flight_limit()
            and self._idle_ticks < self.registry.pipeline_stages
        )

    def wake(self) -> None:
        self._idle_ticks = 0
        self.cond.notify_all()

    def run(self) -> None:
        while True:
            with self.cond:
                while not self.gens.stopped and not self.has_work():
                    timeout = self.pacing.pace_timeout(self.gens.sched, self.streams.find)
                    started = self._chunks_started
                    if timeout is not None and timeout <= PACE_EARLY_S and self._idle_ticks and started != self._kicked:
                        # A paced stream's next chunk is due: tick again (once per chunk started, so a stream that
                        # cannot start for another reason is not ticked in a busy loop).  The count never falls: the
                        # sum of the open streams' started chunks did when one closed, and a later stream that reached
                        # the sum the loop last ticked for was never ticked for again (it stalled for good).
                        self._kicked = started
                        self._idle_ticks = 0
                        continue
                    if timeout is not None and timeout <= PACE_EARLY_S:
                        timeout = 0.005 if self._idle_ticks else None
                    self.cond.wait(timeout)
                if self.gens.stopped:
                    return
                events = self.tick()
                links = list(self.gens.links)
            for ev in events:
                for link in links:
                    link.outbox.put(ev)

    def next_event(self, kind: str, **kw) -> pb.PlanEvent:
        self.seq += 1
        event = PlanEvent(kind, seq=self.seq, **kw)
        if self._record_plan:
            # The recorded plan keeps the schedule, not the texts (GetPlan, selftest replay).
            stripped = replace(
                event,
                text=None,
                latents=None,
                negative_text=None,
                window=tuple((c, None) for c, _ in event.window),
            )
            self.plan.append(wire.event_to_proto(stripped, self.gens.generation))
        return wire.event_to_proto(event, self.gens.generation)

    def tick(self) -> list[pb.PlanEvent]:
        sched = self.gens.sched
        assert sched is not None
        events: list[pb.PlanEvent] = []
        before = self.apply(sched, self.streams.take_changes(), events)
        self.plan_batch(sched, before, events)
        self.close_left(sched, before, events)
        return events

    def apply(self, sched: StreamBatchScheduler, changes: StreamChanges, events: list) -> set[int]:
        """The stream table's changes into the scheduler (opens, stops, cancels, prompts), a waiting recache, the SLO
        controller's steps and each stream's credit; the streams scheduled before any left (whose close is planned
        once they leave the scheduler)."""
        for session in changes.opens:
            self.open(sched, session, events)
        before = set(sched.streams)  # a stream that leaves the scheduler from here on gets its close event
        for sid in changes.stops:
            if sid in sched.streams:
                sched.stop_stream(sid)
        for sid in changes.cancels:
            sched.cancel_stream(sid)  # its close (below) follows the batches already planned
        for sid, text, recache in changes.prompts:
            self.prompt(sched, sid, text, recache, events)
        for session in self.streams.recaching():
            self.plan_recache(sched, session, events)
        self.slo.control(sched, events, self.next_event)
        for sid in sched.streams:
            session = self.streams.find(sid)
            if session is not None:
                sched.set_credit(sid, self.pacing.credit(session))
                if session.spec.input_latents:
                    sched.set_inputs(sid, session.inputs_received)
        return before

    def open(self, sched: StreamBatchScheduler, session: StreamSession, events: list) -> None:
        sched.add_stream(session.spec, best_effort=session.best_effort)
        self.pacing.start(session)
        if session.chunk_rate > 0:
            sid = session.spec.stream_id
            sched.set_due(sid, lambda chunk, sid=sid: self.pacing.deadline(sid, chunk))
        events.append(
            self.next_event(
                "open",
                spec=session.spec,
                text=session.text,
                latents=session.image,
                negative_text=session.negative_text,
                traceparent=session.traceparent,
            )
        )
        session.events.put(
            pb.StreamEvent(started=pb.StreamStarted(stream_id=session.id, generation=self.gens.generation))
        )

    def prompt(self, sched: StreamBatchScheduler, sid: int, text, recache: bool, events: list) -> None:
        st = sched.streams.get(sid)
        session = self.streams.find(sid)
        if st is None or session is None:
            return
        if recache:  # planned once the chunks in flight are back
            self.streams.hold_recache(session, text)
            sched.hold(sid, True)
            return
        # Effective from the next chunk not yet started: chunks in flight keep their prompt.
        events.append(self.next_event("prompt", stream_id=sid, from_chunk=st.next_chunk, text=text))

    def plan_batch(self, sched: StreamBatchScheduler, before: set[int], events: list) -> None:
        """One batch, if the pipeline has room for it: its inputs' events, then the batch event."""
        if not sched.active or self.batches_planned - self.batches_done >= self.in_flight_limit():
            return
        batch = sched.tick()
        self._idle_ticks = 0 if batch else self._idle_ticks + 1
        for sid in before:
            session = self.streams.find(sid)
            if session is not None:
                self.streams.progressed(session, sched.started_chunks.get(sid, 0))
        if not batch:
            self.telemetry.empty_tick()
            return
        self.batches_planned += 1
        self._chunks_started += sum(1 for st in batch if st.level == 0)
        for st in batch:  # a video-to-video chunk's input goes to the stages right before it starts
            session = self.streams.find(st.stream)
            if st.level == 0 and session is not None and session.spec.input_latents:
                latents = self.streams.take_input(session, st.chunk)
                events.append(self.next_event("input", stream_id=st.stream, chunk=st.chunk, latents=latents))
        events.append(self.next_event("batch", steps=tuple(batch)))
        steps = [sched.streams[st.stream].specs.at(st.chunk).steps if st.stream in sched.streams else 0 for st in batch]
        self.telemetry.batch_planned(events[-1], batch, self.streams.find, steps)

    def close_left(self, sched: StreamBatchScheduler, before: set[int], events: list) -> None:
        """A close event for each stream that left the scheduler; it ends once its started chunks are all back."""
        for sid in sorted(before - set(sched.streams)):
            events.append(self.next_event("close", stream_id=sid))
            started = sched.started_chunks.pop(sid, 0)
            session = self.streams.find(sid)
            if session is not None:
                self.streams.planned_all(session, started)

    def plan_recache(self, sched: StreamBatchScheduler, session: StreamSession, events: list) -> None:
        """Plan a waiting recache once the stream has nothing in flight and every chunk it started is back: the
        prompt event carries the window chunks' clean latents, and the stream may start chunks again."""
        sid = session.id
        st = sched.streams.get(sid)
        if st is None:
            self.streams.recache_planned(session)
            return
        started = sched.started_chunks.get(sid, 0)
        if sched.inflight(sid) or session.received < started:
            return
        spec = st.specs.at(started)
        rope = self.registry.rope_limit()
        chunks = sorted({c for c, _ in recache_steps(spec, started, rope)})
        window = tuple((c, wire.tensor_from_proto(session.finished[c])) for c in chunks)
        events.append(
            self.next_event(
                "prompt", stream_id=sid, from_chunk=started, text=session.recache, recache=True, window=window
            )
        )
        self.streams.recache_planned(session)
        sched.hold(sid, False)
