"""A bounded pool of waiting entries shared by many clients, where a full pool makes room for a newcomer fairly.

Usage (the gateway's calls waiting for their config, the web edge's sockets waiting to authenticate)::

    pool = FairPool(total=128, per_client=32, flag="--max-pending", per_client_flag="--max-pending-per-client")
    entry = pool.enter("address 10.0.0.7", on_evict=lambda: wake_and_refuse(call))   # or raises PoolFull
    ...
    pool.leave(entry)        # done waiting (any way; leaving an evicted entry, or leaving twice, is harmless)

The rule of a full pool: a newcomer from a client holding fewer than its fair share (``total`` over the clients in
the pool, the newcomer counted) evicts the oldest entry of the client that holds the most, provided that client
would still hold at least as many as the newcomer; else the newcomer is refused.  So one client, or many idle
connections of a few, can fill the pool only until someone else arrives, and they then give way one entry at a
time, oldest first.  ``on_evict`` runs outside the pool's lock, once, in the newcomer's thread: it must only signal
the evicted waiter (set an event, queue a message), never block.  A client is whatever key the caller passes
(``stagecast.client_identity.client_key``).  Thread-safe.
"""

from __future__ import annotations

import itertools
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

MAX_ENTRIES = 100_000


class PoolFull(Exception):
    """The pool refuses a newcomer; ``str()`` says why, naming the flag."""


@dataclass(eq=False)
class Entry:
    client: str
    seq: int
    on_evict: Callable[[], None] | None = field(repr=False, default=None)
    evicted: bool = False
    held: bool = True


class FairPool:
    def __init__(self, total: int, per_client: int, *, flag: str, per_client_flag: str, what: str = "entries"):
        if not 1 <= total <= MAX_ENTRIES:
            raise ValueError(f"{flag} must be in [1, {MAX_ENTRIES}], got {total}")
        if not 1 <= per_client <= MAX_ENTRIES:
            raise ValueError(f"{per_client_flag} must be in [1, {MAX_ENTRIES}], got {per_client}")
        self.total, self.per_client = total, per_client
        self.flag, self.per_client_flag, self.what = flag, per_client_flag, what
        self._lock = threading.Lock()
        self._entries: dict[str, list[Entry]] = {}  # client -> its entries, oldest first
        self._count = 0
        self._seq = itertools.count()
        self.evictions = 0

    def __len__(self) -> int:
        with self._lock:
            return self._count

    def held(self) -> Counter[str]:
        with self._lock:
            return Counter({client: len(entries) for client, entries in self._entries.items()})

    def enter(self, client: str, on_evict: Callable[[], None] | None = None) -> Entry:
        """A place for ``client``'s waiter; raises ``PoolFull`` when its quota is spent or the pool is full and
        fairness gives it no one to evict."""
        victim = None
        with self._lock:
            mine = self._entries.get(client, [])
            if len(mine) >= self.per_client:
                raise PoolFull(
                    f"quota: {client} already holds {len(mine)} {self.what}, its quota ({self.per_client_flag} "
                    f"{self.per_client})"
                )
            if self._count >= self.total:
                victim = self._victim(client, len(mine))
                if victim is None:
                    share = self.total / (len(self._entries) + (0 if client in self._entries else 1))
                    why = (
                        f"{client} already holds its fair share of them"
                        if len(mine) >= share
                        else "no client holds more than its fair share"
                    )
                    raise PoolFull(f"too many {self.what}: at most {self.total} at once ({self.flag}), and {why}")
                self._remove(victim)
                victim.evicted = True
                self.evictions += 1
            entry = Entry(client, next(self._seq), on_evict)
            self._entries.setdefault(client, []).append(entry)
            self._count += 1
        if victim is not None and victim.on_evict is not None:
            victim.on_evict()
        return entry

    def _victim(self, client: str, mine: int) -> Entry | None:
        clients = len(self._entries) + (0 if client in self._entries else 1)
        if mine >= self.total / clients:
            return None  # the newcomer already holds its fair share
        # The client holding the most (ties: the one whose oldest entry is oldest) gives up its oldest entry, if it
        # would still hold at least what the newcomer will.
        top, entries = max(self._entries.items(), key=lambda kv: (len(kv[1]), -kv[1][0].seq))
        if top == client or len(entries) - 1 < mine + 1:
            return None
        return entries[0]

    def _remove(self, entry: Entry) -> None:
        entries = self._entries[entry.client]
        entries.remove(entry)
        if not entries:
            del self._entries[entry.client]
        self._count -= 1
        entry.held = False

    def leave(self, entry: Entry) -> None:
        with self._lock:
            if entry.held:
                self._remove(entry)
