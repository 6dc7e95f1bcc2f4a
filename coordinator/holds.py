"""Admission at the engine: a stream decided beside the open streams and the places held for streams not open yet.

Usage (``coordinator.engine.PipelineEngine`` holds one as ``admitter``; every call takes the engine's lock)::

    hold = engine.admitter.reserve(request)      # Reserve: admitted before the gateway encodes the prompt; its place
    engine.admitter.release(hold)                # ... held HOLD_S, or given back (Release)
    reservation = admitter.claim(request, hold)  # the open: the held place, or (none, lapsed) admission decides now

A held place counts as an admitted stream (``StreamTable.admitted(now)``): the count cap, the SLO model and the free
slots all see it, so what Reserve admitted the open can take.  A refusal is counted by its limit (telemetry).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from coordinator.admission import Admission, Reservation
from coordinator.errors import AdmissionError
from coordinator.generations import Generations
from coordinator.metrics import CoordinatorTelemetry
from coordinator.requests import OpenRequest
from coordinator.streams import StreamTable

# How long a place admitted by ``reserve`` (before the gateway encodes the prompt) is held for its open: an encode
# takes milliseconds to a second; a gateway that fails in between gives the place back (``release``) or it lapses.
HOLD_S = 10.0


class Admitter:
    """Decides streams for the engine (``Admission.decide``) beside the open ones and the held places."""

    def __init__(
        self,
        cond: threading.Condition,
        admission: Admission,
        streams: StreamTable,
        generations: Generations,
        telemetry: CoordinatorTelemetry,
        clock: Callable[[], float],
    ):
        self.cond = cond
        self.admission = admission
        self.streams = streams
        self.generations = generations
        self.telemetry = telemetry
        self.clock = clock

    def reserve(self, request: OpenRequest) -> str:
        """Admission alone (``Reserve``): decide ``request`` (raises ``AdmissionError``) and hold its place for
        ``HOLD_S``; returns the hold the open claims."""
        with self.cond:
            return self.streams.hold(self.decide(request), self.clock(), HOLD_S)

    def release(self, hold: str) -> None:
        """A held place given back unopened (``Release``): unknown or lapsed holds are ignored."""
        with self.cond:
            self.streams.take_hold(hold, self.clock())

    def claim(self, request: OpenRequest, hold: str = "") -> Reservation:
        """Under the lock, for an open: the place ``hold`` held (not lapsed), else admission's decision now."""
        held = self.streams.take_hold(hold, self.clock()) if hold else None
        return held if held is not None else self.decide(request)

    def decide(self, request: OpenRequest) -> Reservation:
        """Under the lock: ``Admission.decide`` beside the open streams and the held places; a refusal is counted."""
        gens = self.generations
        try:
            return self.admission.decide(
                request, self.streams.admitted(self.clock()), ready=gens.ready, last_error=gens.last_error
            )
        except AdmissionError as exc:
            if exc.limit:
                self.telemetry.refused(exc.limit)
            raise
