"""The streams a gateway holds, and what it admits: the part of ``gateway.service.Gateway`` that counts.

Usage::

    table = StreamTable(max_streams=8, max_pending=128, budget=budget, decoder_memory=memory, quotas=quotas,
                        metrics=metrics)
    entry = table.enter_pending(client, on_evict)   # a Generate call waiting for its config (raises PoolFull)
    table.leave_pending(entry)
    release = table.admit(cfg, client)      # raises gateway.edge.admission.Refused; release gives everything back
    table.register(run, release)            # the stream is open
    table.forget(run)                       # its pipeline side and VAE state are gone: release runs
    table.door_streams()                    # how many of them came through the fleet's door (the agent's maxconn)
    with table.cond: table.cond.wait_for(lambda: table.version != seen)   # WatchStatus follows ``version``

Admission runs the client's quotas (``gateway.edge.quotas``), then the chain: the count cap (``max_streams``, from
admission until the stream is forgotten), the unpaced cap (``max_unpaced``), the per-stream cost budget and the
decoder memory (``gateway.edge.admission``).  The calls waiting for their config are a ``stagecast.fair_pool.FairPool``
(``max_pending``, and the client's ``--max-pending-per-client``): a full pool makes room for a client below its fair
share by evicting the oldest waiting call of the client that holds the most.
"""

from __future__ import annotations

import collections
import logging
import threading

import grpc

from gateway.edge.admission import Admission, CostBudget, DecoderMemory, Refused
from gateway.edge.quotas import KINDS, MAX_QUOTA, Quotas
from gateway.metrics import GatewayMetrics
from stagecast.fair_pool import Entry, FairPool

logger = logging.getLogger(__name__)


class StreamTable:
    """The streams by id, the calls waiting for their config, admission, and the counters status reports."""

    def __init__(
        self,
        *,
        max_streams: int,
        max_pending: int,
        max_unpaced: int = 4,
        budget: CostBudget,
        decoder_memory: DecoderMemory,
        quotas: Quotas,
        metrics: GatewayMetrics,
    ):
        self.max_streams = max_streams
        self.max_pending = max_pending
        if not 1 <= max_unpaced <= MAX_QUOTA:
            raise ValueError(f"--max-unpaced must be in [1, {MAX_QUOTA}], got {max_unpaced}")
        self.max_unpaced = max_unpaced
        self.budget = budget
        self.decoder_memory = decoder_memory
        self.quotas = quotas  # per client, within the global bounds
        self.cond = threading.Condition()
        self.streams: dict = {}  # StreamRun by id
        self.admitted = 0  # streams past the count cap: being set up, or registered and not yet forgotten
        self.unpaced = 0  # of ``admitted``, streams with pace: false
        # Generate calls waiting for their config, each client within its quota, fair when full
        self.waiting = FairPool(
            max_pending,
            quotas.limits["pending"],
            flag="--max-pending",
            per_client_flag=KINDS["pending"][0],
            what=KINDS["pending"][1],
        )
        self._releases: dict[str, object] = {}  # per registered stream: gives back what admission took
        # Admission, in order: count cap, unpaced cap, cost budget, decoder memory (later checks, e.g. capacity, are
        # appended).
        self.admission = Admission([self._count_cap, self._unpaced_cap, budget.check, decoder_memory.check])
        self.version = 0  # bumped on every change WatchStatus reports
        self.started = 0
        self.finished = 0
        self.ended_by_reason: collections.Counter[str] = collections.Counter()
        self.metrics = metrics

    # ---- admission ---------------------------------------------------------------------------------

    def admit(self, cfg, client: str):
        """The client's stream quotas, then the admission chain; returns what gives everything back.  A gateway that
        is full says so, not that the client is over its quota (the default quota is the gateway's whole bound)."""
        with self.cond:
            if self.admitted >= self.max_streams:
                raise self._too_many_streams()
        quota = self.quotas.take_stream(not cfg.pace, client)
        try:
            release = self.admission.admit(cfg)
        except BaseException:
            quota()
            raise

        def release_all() -> None:
            release()
            quota()

        return release_all

    def _count_cap(self, cfg) -> object:
        """The first admission check: at most ``max_streams`` streams, from admission until they are forgotten."""
        with self.cond:
            if self.admitted >= self.max_streams:
                raise self._too_many_streams()
            self.admitted += 1
        return self._uncount

    def _too_many_streams(self) -> Refused:
        return Refused(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"too many streams: this gateway serves at most {self.max_streams} at once (--max-streams)",
        )

    def _uncount(self) -> None:
        with self.cond:
            self.admitted -= 1

    def _unpaced_cap(self, cfg) -> object | None:
        """At most ``max_unpaced`` best-effort streams at once, all clients together (each within its own quota)."""
        if cfg.pace:
            return None
        with self.cond:
            if self.unpaced >= self.max_unpaced:
                raise Refused(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"too many unpaced streams: this gateway runs at most {self.max_unpaced} pace: false streams at "
                    "once (--max-unpaced); send pace: true, or retry when one ends",
                )
            self.unpaced += 1

        def give_back() -> None:
            with self.cond:
                self.unpaced -= 1

        return give_back

    @property
    def pending(self) -> int:
        """Generate calls waiting for their config now."""
        return len(self.waiting)

    def enter_pending(self, client: str, on_evict) -> Entry:
        """A Generate call of ``client`` starts waiting for its config; raises ``stagecast.fair_pool.PoolFull`` (its
        quota, or a full pool with no one to evict).  ``on_evict`` tells the call that it gave its place away."""
        entry = self.waiting.enter(client, on_evict)
        self.touch()
        return entry

    def leave_pending(self, entry: Entry) -> None:
        self.waiting.leave(entry)
        self.touch()

    # ---- the streams held ----------------------------------------------------------------------------

    def register(self, run, release) -> None:
        """An admitted stream is open; ``release`` (from admission) runs when it is forgotten."""
        with self.cond:
            self._releases[run.id] = release
            self.streams[run.id] = run
            self.started += 1
            self._changed()

    def forget(self, run) -> None:
        """The stream's pipeline side and VAE state are gone: it no longer counts against the limits."""
        with self.cond:
            if self.streams.pop(run.id, None) is None:
                return
            release = self._releases.pop(run.id)
            reason = run.outcome or "unknown"
            self.finished += 1
            self.ended_by_reason[reason] += 1
            self._changed()
        release()
        self.metrics.stream_ended(reason)
        logger.info("stream %s finished: %s, %d frames", run.id, reason, run.frames_emitted)

    def touch(self) -> None:
        with self.cond:
            self._changed()

    def _changed(self) -> None:
        self.version += 1
        self.cond.notify_all()

    def runs(self) -> list:
        with self.cond:
            return list(self.streams.values())

    def door_streams(self) -> int:
        """The open streams a trusted proxy (the fleet's door) sent on: those its connection count holds."""
        with self.cond:
            return sum(1 for run in self.streams.values() if run.via_door)

    def vae_state_bytes(self) -> int:
        return sum(vae_bytes(run) for run in self.runs())


def vae_bytes(run) -> int:
    """The stream's VAE caches: its decode session's, and a video-to-video stream's encoder cache and queued input."""
    session = run.session
    held = 0 if session is None else session.state_bytes
    if run.input is not None:
        held += run.input.state_bytes
    return held
