"""Who may hold the web edge's peer slots: authenticated browsers, a bounded number per tenant; sockets that have
not authenticated yet wait in a small pool of their own.

Usage (``web.server`` holds one of each)::

    slots = PeerSlots(max_peers=4, per_tenant=2)
    refusal = slots.take("rtc-1", "alice")      # None: taken; else the text of the refusal (HTTP 503)
    slots.free("rtc-1")                          # when the peer closes (freeing twice is harmless)

    pool = PreAuthPool(total=16, per_address=8)
    entry = pool.enter("10.0.0.7", on_evict)    # a WebSocket without a token in its headers, before its first message
    if isinstance(entry, str): ...               # refused: the text (HTTP 503)
    pool.leave(entry)                            # authenticated (it then takes a peer slot), closed, or evicted

A peer slot is taken only once the browser's token is checked (the offer's ``Authorization`` header; a WebSocket's
``Sec-WebSocket-Protocol`` header or its first message), so sockets that never authenticate cannot lock valid tenants
out: they wait in the pre-auth pool, bounded per client address and in total, and are closed after
``PREAUTH_S``; a full pool gives way fairly (a newcomer below its fair share evicts the oldest socket of the address
holding the most).  The page itself never waits there: it sends its token in ``Sec-WebSocket-Protocol``.  The address
is ``stagecast.client_identity``'s (behind ``--trusted-proxy``, the one it forwarded for).  Without tokens every
browser is the same (anonymous) tenant and only ``max_peers`` bounds them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from stagecast.fair_pool import Entry, FairPool, PoolFull

PREAUTH_S = 1.0  # a WebSocket without a token in its headers must authenticate (its first message) within this
MAX_SLOTS = 10_000


class PeerSlots:
    """The peers connected now: at most ``max_peers`` together and ``per_tenant`` of any one tenant."""

    def __init__(self, max_peers: int, per_tenant: int):
        if not 1 <= max_peers <= MAX_SLOTS:
            raise ValueError(f"--max-peers must be in [1, {MAX_SLOTS}], got {max_peers}")
        if not 1 <= per_tenant <= MAX_SLOTS:
            raise ValueError(f"--max-peers-per-tenant must be in [1, {MAX_SLOTS}], got {per_tenant}")
        self.max_peers = max_peers
        self.per_tenant = per_tenant
        self._tenant: dict[str, str | None] = {}  # peer id -> its tenant (None: no tokens, no per-tenant bound)
        self._held: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self._tenant)

    def take(self, peer_id: str, tenant: str | None) -> str | None:
        if len(self._tenant) >= self.max_peers:
            return f"too many peers: {len(self._tenant)} connected, the limit is {self.max_peers}"
        if tenant is not None and self._held[tenant] >= self.per_tenant:
            return (
                f"too many peers of tenant {tenant!r}: {self._held[tenant]} connected, the limit is {self.per_tenant} "
                "(--max-peers-per-tenant)"
            )
        self._tenant[peer_id] = tenant
        if tenant is not None:
            self._held[tenant] += 1
        return None

    def free(self, peer_id: str) -> None:
        if peer_id not in self._tenant:
            return
        tenant = self._tenant.pop(peer_id)
        if tenant is not None:
            self._held[tenant] -= 1
            if self._held[tenant] <= 0:
                del self._held[tenant]


class PreAuthPool:
    """WebSockets waiting to authenticate: at most ``total`` together and ``per_address`` from one client address;
    when all ``total`` are taken, a newcomer from an address below its fair share evicts the oldest socket of the
    address holding the most (``stagecast.fair_pool``)."""

    def __init__(self, total: int, per_address: int):
        if not 1 <= total <= MAX_SLOTS:
            raise ValueError(f"--max-preauth must be in [1, {MAX_SLOTS}], got {total}")
        if not 1 <= per_address <= total:
            raise ValueError(f"--max-preauth-per-address must be in [1, --max-preauth {total}], got {per_address}")
        self.total = total
        self.per_address = per_address
        self._pool = FairPool(
            total,
            per_address,
            flag="--max-preauth",
            per_client_flag="--max-preauth-per-address",
            what="sockets waiting to authenticate",
        )

    def __len__(self) -> int:
        return len(self._pool)

    @property
    def evictions(self) -> int:
        return self._pool.evictions

    def enter(self, address: str | None, on_evict: Callable[[], None] | None = None) -> Entry | str:
        """The socket's place (an ``Entry``), or the refusal's text (HTTP 503).  ``on_evict`` runs when a newcomer
        takes the place: it must close the socket."""
        try:
            return self._pool.enter(f"address {address or 'unknown'}", on_evict)
        except PoolFull as exc:
            return str(exc)

    def leave(self, entry: Entry) -> None:
        self._pool.leave(entry)
