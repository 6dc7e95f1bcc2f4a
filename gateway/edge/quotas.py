"""Per-client quotas at the gateway: no client or tenant can hold every slot of a shared budget.

Usage::

    quotas = Quotas(QuotaOptions(pending=32), max_streams=8)   # its flags: a nested part of GatewayOptions
    who = gateway_identity.of(context)         # "tenant 'alice'" with --tokens, else "address 10.0.0.7"
    release = quotas.take("pending", who)      # raises Refused(RESOURCE_EXHAUSTED, "quota: ...") naming the flag
    ...
    release()                                  # exactly once, when the call stops holding the slot

A client is its tenant when the gateway asks for tokens (every connection of a tenant counts together), else its
peer's address, or behind a trusted proxy the address it forwarded for (``gateway.edge.client_identity``: one rule with
the web edge).  Each kind of slot has its quota per client, below the gateway's global bound for that kind
(``--max-streams``, ``--max-unpaced``, ``--max-pending``, ``--max-watchers``), which still bounds all clients
together:

* ``streams``: streams a client holds (default: ``--max-streams``, so one client can still fill the pipeline to its
  capacity, as the capacity benchmark does);
* ``unpaced``: of those, streams with ``pace: false`` (best effort: they yield to paced streams in the coordinator's
  scheduler and take none of their capacity, and this bounds how many one client holds);
* ``pending``: Generate calls that have not sent their config yet (counted by the gateway's ``FairPool``, which
  also evicts fairly when the global bound is full: ``gateway.edge.stream_table``);
* ``watchers``: WatchStatus calls.

The defaults sit above what one client needs to reach the pipeline's capacity (a client opening ``--max-streams``
streams at once has each call wait for its config only while it sends it).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from stagecast.flags import flag

MAX_QUOTA = 100_000

# kind -> (the flag that sets it, what one slot is, for the refusal)
KINDS = {
    "streams": ("--max-streams-per-client", "streams"),
    "unpaced": ("--max-unpaced-per-client", "unpaced (pace: false) streams"),
    "pending": ("--max-pending-per-client", "calls waiting for their config"),
    "watchers": ("--max-watchers-per-client", "WatchStatus calls"),
}


@dataclass(frozen=True)
class QuotaOptions:
    """The gateway's per-client quota flags (a nested part of ``GatewayOptions``)."""

    streams: int = flag(
        0,
        name=KINDS["streams"][0],
        help="streams one client (its tenant with --tokens, else its address) holds at once (0: --max-streams)",
    )
    unpaced: int = flag(
        2,
        name=KINDS["unpaced"][0],
        help="unpaced (pace: false) streams one client holds at once: best effort, they yield to paced streams",
    )
    pending: int = flag(
        32,
        name=KINDS["pending"][0],
        help="Generate calls of one client waiting for their config at once (within --max-pending)",
    )
    watchers: int = flag(
        4, name=KINDS["watchers"][0], help="WatchStatus calls of one client at once (within --max-watchers)"
    )

    def __post_init__(self) -> None:
        for kind, (flag_name, _) in KINDS.items():
            value = getattr(self, kind)
            least = 0 if kind == "streams" else 1
            if not least <= value <= MAX_QUOTA:
                raise ValueError(f"{flag_name} must be in [{least}, {MAX_QUOTA}], got {value}")


class Quotas:
    """Slots each client holds, per kind; ``take`` refuses past the client's quota."""

    def __init__(self, opts: QuotaOptions, max_streams: int):
        self.limits = {
            "streams": opts.streams or max_streams,
            "unpaced": opts.unpaced,
            "pending": opts.pending,
            "watchers": opts.watchers,
        }
        self._lock = threading.Lock()
        self._held: dict[str, Counter[str]] = {kind: Counter() for kind in KINDS}

    def take(self, kind: str, client: str) -> Callable[[], None]:
        """One slot of ``kind`` for ``client``; returns what gives it back (call it once)."""
        import grpc

        from gateway.edge.admission import Refused

        flag, what = KINDS[kind]
        limit = self.limits[kind]
        with self._lock:
            held = self._held[kind]
            if held[client] >= limit:
                raise Refused(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"quota: {client} already holds {held[client]} {what}, its quota ({flag} {limit})",
                )
            held[client] += 1
        released = [False]

        def release() -> None:
            with self._lock:
                if released[0]:
                    return
                released[0] = True
                held[client] -= 1
                if held[client] <= 0:
                    del held[client]

        return release

    def held(self, kind: str, client: str) -> int:
        with self._lock:
            return self._held[kind][client]

    def take_stream(self, unpaced: bool, client: str) -> Callable[[], None]:
        """A stream's slots: one of the client's streams and, for an unpaced one, one of its unpaced streams."""
        stream = self.take("streams", client)
        if not unpaced:
            return stream
        try:
            best_effort = self.take("unpaced", client)
        except BaseException:
            stream()
            raise

        def release() -> None:
            best_effort()
            stream()

        return release
