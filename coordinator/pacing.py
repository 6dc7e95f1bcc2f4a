"""Pacing: when a paced stream may start its next chunk, and how far any stream may run ahead of its consumer.

``Pacing`` is one of the parts ``coordinator.engine.PipelineEngine`` holds; the plan loop (``coordinator.plan``) asks
it, under the engine's lock, for each stream's credit (the chunks it may have started by now) and for how long the
loop may sleep before a paced stream's next chunk is due (``pace_timeout``).  It keeps each paced stream's real-time
schedule by stream id (``start`` when its open is planned, ``consumed`` when its consumer took chunk 0, ``forget``
when it ends); the rest it reads from the stream's session (``coordinator.streams``, its request) and the scheduler.

Two rules give a stream its credit:

- by consumption, every stream: the gateway acknowledges a chunk once it has decoded it and handed its frames on
  (``ChunksConsumed``), and a stream starts a chunk only while ``started - consumed`` is below one wavefront (levels x
  stages) plus the decoder depth its consumer declared at open (``consumer_depth``; 2 for one that does not
  acknowledge), so gRPC's buffers cannot hide a slow consumer (``lead_bound``);
- by the clock, a paced stream (``chunk_rate`` > 0; ``pace: false`` turns it off): chunk c starts no earlier than
  ``c / chunk_rate - pace_offset_s - playout`` after its open was planned (``paced_credit``; ``--playout-s``, 0.5 s:
  the viewer's playout buffer; ``pace_offset_s``: later chunks decode to four frames per latent frame, the first to
  one), so a stream is generated at its frame rate and the capacity left serves other streams.  With ``--pace-grid``
  paced streams' slots lie on one grid of chunk periods, so their chunks batch.  Start times depend on the clock, so
  parity runs replay the recorded plan.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from coordinator.requests import MAX_CHUNK_RATE
from coordinator.scheduler import StreamBatchScheduler
from coordinator.streams import StreamSession
from stagecast.microstep import chunk_levels

# Pacing (``OpenStreamRequest.chunk_rate``): a paced stream starts chunk c up to PLAYOUT_S before its real-time
# slot, so the viewer's playout buffer holds about that much video while the pipeline serves other streams.
PLAYOUT_S = 0.5
MAX_PLAYOUT_S = 10.0
__all__ = ["MAX_CHUNK_RATE", "PACE_EARLY_S", "PLAYOUT_S", "Pacing"]
# The plan loop ticks for a paced chunk once its slot is this close, and the credit lets the chunk start from then on:
# a tick that came early for a chunk the credit did not yet allow was never repeated (it is kicked once per chunk
# count), and the stream stalled until some other event woke the loop.
PACE_EARLY_S = 1e-3
# Among ready micro-steps, a joining stream's first chunk is due this long after its open (``Pacing.deadline``): its
# viewer waits for the first frame, but the second chunk of a stream that joined just before it is due one frame
# after that stream's first and would otherwise wait behind every joiner's first chunk.  On one H200 a burst of 7
# 1.3B streams ran all 7 first chunks (two forwards) before any second one, and 3 of them started 2-4 frames late,
# missing "held" (99% on time) by those frames alone (2026-12-04).  The grace counts from the open itself, not from
# its slot on the pace grid (``Pacing.deadline`` says why).
FIRST_CHUNK_GRACE_S = 0.1


@dataclass
class _Schedule:
    """A paced stream's real-time schedule."""

    chunk_rate: float
    pace_offset_s: float
    since: float  # clock time its first chunk could start (its open was planned; on the pace grid, that period's start)
    opened: float  # clock time its open was planned (``since`` before the pace grid moves it back)
    first_consumed_at: float | None = None  # clock time chunk 0 was consumed: the viewer's clock


class Pacing:
    """Each stream's credit: its consumer's lead bound, and for a paced stream its real-time slots."""

    def __init__(
        self,
        *,
        pipeline_stages: int,
        max_ahead: int | None = None,
        playout_s: float = PLAYOUT_S,
        clock: Callable[[], float] = time.monotonic,
        grid: bool = False,
    ):
        if not 0 <= playout_s <= MAX_PLAYOUT_S:
            raise ValueError(f"playout_s must be in [0, {MAX_PLAYOUT_S}], got {playout_s}")
        self.pipeline_stages = pipeline_stages
        # Chunks a stream may run ahead of its consumer: enough for the full wavefront plus a little slack.
        self.max_ahead = max_ahead
        self.playout_s = playout_s  # how far ahead of its real-time slot a paced stream may start a chunk
        self.clock = clock
        self.grid = grid  # paced streams' slots on one grid of whole chunk periods (``start``)
        self._schedules: dict[int, _Schedule] = {}  # paced streams whose open was planned, by id

    def start(self, session: StreamSession) -> None:
        """The stream's open is planned: a paced stream's real-time schedule starts (``since``): now, or with ``grid``
        now moved back to the last whole chunk period of the clock, so that paced streams of one chunk rate (and offset)
        have their slots at the same instants, their chunks become ready in the same tick and the scheduler batches
        them (paced apart, each stream's chunks run as batches of one: more forwards, and no batch for a batching
        decoder).  A stream's slots come at most one chunk period sooner: within its consumer's lead bound, never
        later."""
        if session.chunk_rate <= 0:
            return
        now = self.clock()
        since = math.floor(now * session.chunk_rate) / session.chunk_rate if self.grid else now
        self._schedules[session.id] = _Schedule(session.chunk_rate, session.pace_offset_s, since, now)

    def since(self, stream_id: int) -> float | None:
        """When the paced stream's schedule started (None: unpaced, or its open is not planned yet)."""
        schedule = self._schedules.get(stream_id)
        return None if schedule is None else schedule.since

    def consumed(self, session: StreamSession) -> tuple[float, bool] | None:
        """The stream's consumed count rose: (when its chunk 0 was consumed on the viewer's clock, whether that is
        news), for a paced stream with a chunk consumed; else None.  The first time, the viewer's clock is taken as
        now less the chunks consumed since chunk 0 at the stream's rate."""
        schedule = self._schedules.get(session.id)
        if schedule is None or session.delivered <= 0:
            return None
        if schedule.first_consumed_at is not None:
            return schedule.first_consumed_at, False
        schedule.first_consumed_at = self.clock() - (session.delivered - 1) / schedule.chunk_rate
        return schedule.first_consumed_at, True

    def forget(self, stream_id: int) -> None:
        self._schedules.pop(stream_id, None)

    def lead_bound(self, session: StreamSession) -> int:
        """Chunks a stream may run ahead of its consumer: one wavefront (every level in every stage) plus what
        the consumer holds to keep its decoder busy (2 for a consumer that does not say)."""
        if self.max_ahead:
            return self.max_ahead
        depth = session.consumer_depth if session.acknowledges else 2
        levels = chunk_levels(max(session.ladders), session.spec.policy)
        return levels * self.pipeline_stages + depth

    def paced_credit(self, session: StreamSession, now: float) -> int | None:
        """Chunks a paced stream may have started by ``now``: chunk c starts no earlier than its real-time slot
        (``pace_slot``) less the playout buffer.  None for an unpaced stream."""
        schedule = self._schedules.get(session.id)
        if schedule is None:
            return None
        slots = (now + PACE_EARLY_S - schedule.since + self.playout_s + schedule.pace_offset_s) * schedule.chunk_rate
        return max(0, math.floor(slots + 1e-9)) + 1  # 1e-9: a slot reached exactly is not lost to rounding

    @staticmethod
    def _slot(schedule: _Schedule, chunk: int) -> float:
        offset = schedule.pace_offset_s if chunk > 0 else 0.0
        return schedule.since + chunk / schedule.chunk_rate - offset

    def pace_slot(self, stream_id: int, chunk: int) -> float | None:
        """When a paced stream's chunk is due at its viewer, on the coordinator's clock: ``since + c / chunk_rate``,
        less ``pace_offset_s`` for every chunk after the first, whose frames come sooner because the first chunk holds
        fewer (Wan's first latent frame decodes to one video frame, each later one to four).  None: not paced."""
        schedule = self._schedules.get(stream_id)
        return None if schedule is None else self._slot(schedule, chunk)

    def deadline(self, stream_id: int, chunk: int) -> float | None:
        """When a paced stream's chunk is due at its viewer (None for an unpaced stream), the scheduler's order among
        ready micro-steps (``StreamBatchScheduler.set_due``): once chunk 0 is consumed, on the viewer's own clock
        (``first_consumed_at``, the first frame's time: chunk c is due ``c / chunk_rate`` after it, less
        ``pace_offset_s`` past the first chunk).  Before that:

        - chunk 0 is due ``FIRST_CHUNK_GRACE_S`` after the open (its viewer waits for the first frame, but a stream
          that joined just before it needs its next chunk sooner);
        - a later chunk as if the first frame came now, the soonest it can: its viewer's clock has not started, so
          its deadlines lie no earlier.  A joining stream's second chunk is then due one frame from now, while a
          running stream's next chunks start up to the playout buffer before they are due: the joiner's goes first,
          or its picture freezes after one frame; but a running chunk due within that frame goes before it.

        Neither counts from the stream's slot on the pace grid (``pace_slot``), which lies up to a chunk period
        before the open: from there, a burst's first and second chunks were all due before the burst began, every
        one of them went before any running stream's next chunk, and on one H200 the first stream admitted (its
        first frame out 82 ms after its call) saw its third chunk wait behind four forwards of the joiners' first
        two, 5 frames late (r27, 2026-12-07)."""
        schedule = self._schedules.get(stream_id)
        if schedule is None:
            return None
        offset = schedule.pace_offset_s if chunk > 0 else 0.0
        if schedule.first_consumed_at is None:
            if chunk == 0:
                return schedule.opened + FIRST_CHUNK_GRACE_S
            return self.clock() + chunk / schedule.chunk_rate - offset
        return schedule.first_consumed_at + chunk / schedule.chunk_rate - offset

    def credit(self, session: StreamSession) -> int:
        credit = session.delivered + self.lead_bound(session)
        paced = self.paced_credit(session, self.clock())
        return credit if paced is None else min(credit, paced)

    def pace_timeout(
        self, sched: StreamBatchScheduler | None, find: Callable[[int], StreamSession | None]
    ) -> float | None:
        """Seconds until a paced stream may start its next chunk (0 when one may now), for streams whose consumer
        has room for it (a stream held by its consumer is woken by the consumer's acknowledgement)."""
        if sched is None:
            return None
        now = self.clock()
        soonest = None
        for sid, st in sched.streams.items():
            session, schedule = find(sid), self._schedules.get(sid)
            if session is None or schedule is None or st.stopping:
                continue
            started = sched.started_chunks.get(sid, 0)
            if started >= session.delivered + self.lead_bound(session):
                continue  # held by its consumer
            if st.spec.num_chunks is not None and started >= st.spec.num_chunks:
                continue
            due = self._slot(schedule, started) - self.playout_s
            soonest = due if soonest is None else min(soonest, due)
        return None if soonest is None else max(0.0, soonest - now)
