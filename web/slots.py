"""Who may hold the web edge's peer slots: authenticated browsers, a bounded number per tenant; sockets that have
not authenticated yet wait in a small pool of their own.

Usage (``web.server`` holds one of each)::

    slots = PeerSlots(max_peers=4, per_tenant=2)
    refusal = slots.take("rtc-1", "alice")      # None: taken; else the text of the refusal (HTTP 503)
    slots.free("rtc-1")                          # when the peer closes (freeing twice is harmless)

    pool = PreAuthPool(total=16, per_address=8)
    refusal = pool.enter("10.0.0.7")            # a WebSocket without a token in its headers, before its first message
    pool.leave("10.0.0.7")                       # authenticated (it then takes a peer slot) or closed

A peer slot is taken only once the browser's token is checked (the offer's ``Authorization`` header; a WebSocket's
``Sec-WebSocket-Protocol`` header or its first message), so sockets that never authenticate cannot lock valid tenants
out: they wait in the pre-auth pool, bounded per client address and in total, and are closed after
``PREAUTH_S``.  Without tokens every browser is the same (anonymous) tenant and only ``max_peers`` bounds them.
"""

from __future__ import annotations

from collections import Counter

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
    """WebSockets waiting to authenticate: at most ``total`` together and ``per_address`` from one client address."""

    def __init__(self, total: int, per_address: int):
        if not 1 <= total <= MAX_SLOTS:
            raise ValueError(f"--max-preauth must be in [1, {MAX_SLOTS}], got {total}")
        if not 1 <= per_address <= total:
            raise ValueError(f"--max-preauth-per-address must be in [1, --max-preauth {total}], got {per_address}")
        self.total = total
        self.per_address = per_address
        self._held: Counter[str] = Counter()

    def __len__(self) -> int:
        return sum(self._held.values())

    def enter(self, address: str | None) -> str | None:
        key = address or "?"
        if len(self) >= self.total:
            return f"too many sockets waiting to authenticate: {len(self)}, the limit is {self.total} (--max-preauth)"
        if self._held[key] >= self.per_address:
            return (
                f"too many sockets from {key} waiting to authenticate: the limit is {self.per_address} "
                "(--max-preauth-per-address)"
            )
        self._held[key] += 1
        return None

    def leave(self, address: str | None) -> None:
        key = address or "?"
        self._held[key] -= 1
        if self._held[key] <= 0:
            del self._held[key]
