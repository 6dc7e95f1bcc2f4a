"""Pacing: when a paced stream may start its next chunk, and how far any stream may run ahead of its consumer.

``Pacing`` is one of the parts ``coordinator.engine.PipelineEngine`` holds; the plan loop (``coordinator.plan``) asks
it, under the engine's lock, for each stream's credit (the chunks it may have started by now) and for how long the
loop may sleep before a paced stream's next chunk is due (``pace_timeout``).  It keeps no state of its own beyond its
settings: what it reads is each stream's session (``coordinator.streams``) and the scheduler's started chunks.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from coordinator.scheduler import StreamBatchScheduler
from coordinator.streams import StreamSession
from stagecast.microstep import chunk_levels

# Pacing (``OpenStreamRequest.chunk_rate``): a paced stream starts chunk c up to PLAYOUT_S before its real-time
# slot, so the viewer's playout buffer holds about that much video while the pipeline serves other streams.
PLAYOUT_S = 0.5
MAX_PLAYOUT_S = 10.0
MAX_CHUNK_RATE = 1000.0
# The plan loop ticks for a paced chunk once its slot is this close, and the credit lets the chunk start from then on:
# a tick that came early for a chunk the credit did not yet allow was never repeated (it is kicked once per chunk
# count), and the stream stalled until some other event woke the loop.
PACE_EARLY_S = 1e-3


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

    def start(self, session: StreamSession) -> float:
        """When a paced stream's real-time schedule starts (``StreamSession.paced_since``): now, or with ``grid`` now
        moved back to the last whole chunk period of the clock, so that paced streams of one chunk rate (and offset)
        have their slots at the same instants, their chunks become ready in the same tick and the scheduler batches
        them (paced apart, each stream's chunks run as batches of one: more forwards, and no batch for a batching
        decoder).  A stream's slots come at most one chunk period sooner: within its consumer's lead bound, never
        later."""
        now = self.clock()
        if not self.grid or session.chunk_rate <= 0:
            return now
        return math.floor(now * session.chunk_rate) / session.chunk_rate

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
        if session.chunk_rate <= 0 or session.paced_since is None:
            return None
        slots = (now + PACE_EARLY_S - session.paced_since + self.playout_s + session.pace_offset_s) * session.chunk_rate
        return max(0, math.floor(slots + 1e-9)) + 1  # 1e-9: a slot reached exactly is not lost to rounding

    @staticmethod
    def pace_slot(session: StreamSession, chunk: int) -> float:
        """When a paced stream's chunk is due at its viewer, on the coordinator's clock: ``paced_since + c /
        chunk_rate``, less ``pace_offset_s`` for every chunk after the first, whose frames come sooner because the
        first chunk holds fewer (Wan's first latent frame decodes to one video frame, each later one to four)."""
        offset = session.pace_offset_s if chunk > 0 else 0.0
        return session.paced_since + chunk / session.chunk_rate - offset

    @staticmethod
    def deadline(session: StreamSession, chunk: int) -> float | None:
        """When a paced stream's chunk is due at its viewer (None for an unpaced stream), the scheduler's order among
        ready micro-steps (``StreamBatchScheduler.set_due``): once chunk 0 is consumed, on the viewer's own clock
        (``first_consumed_at``, the first frame's time: chunk c is due ``c / chunk_rate`` after it, less
        ``pace_offset_s`` past the first chunk); before, at its slot (``pace_slot``), which is no later.  A joining
        stream's second chunk is due one frame after its first, while a running stream's next chunks start up to the
        playout buffer before they are due: that chunk goes first, or its viewer's picture freezes after one frame."""
        if session.chunk_rate <= 0 or session.paced_since is None:
            return None
        if session.first_consumed_at is None:
            return Pacing.pace_slot(session, chunk)
        offset = session.pace_offset_s if chunk > 0 else 0.0
        return session.first_consumed_at + chunk / session.chunk_rate - offset

    def credit(self, session: StreamSession) -> int:
        credit = session.delivered + self.lead_bound(session)
        paced = self.paced_credit(session, self.clock())
        return credit if paced is None else min(credit, paced)

    def pace_timeout(self, sched: StreamBatchScheduler | None, sessions: dict[int, StreamSession]) -> float | None:
        """Seconds until a paced stream may start its next chunk (0 when one may now), for streams whose consumer
        has room for it (a stream held by its consumer is woken by the consumer's acknowledgement)."""
        if sched is None:
            return None
        now = self.clock()
        soonest = None
        for sid, st in sched.streams.items():
            session = sessions.get(sid)
            if session is None or session.chunk_rate <= 0 or session.paced_since is None or st.stopping:
                continue
            started = sched.started_chunks.get(sid, 0)
            if started >= session.delivered + self.lead_bound(session):
                continue  # held by its consumer
            if st.spec.num_chunks is not None and started >= st.spec.num_chunks:
                continue
            due = self.pace_slot(session, started) - self.playout_s
            soonest = due if soonest is None else min(soonest, due)
        return None if soonest is None else max(0.0, soonest - now)
