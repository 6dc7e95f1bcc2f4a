"""A bounded, closable FIFO between two threads of one stream (pipeline reader -> decoder -> client sender).

Usage::

    ch = BoundedChannel(capacity=4)
    ch.put(item)                    # blocks while full; False once the channel is closed (the consumer is gone)
    ch.put(item, timeout=5.0)       # raises TimeoutError if still full after 5 s (the consumer is too slow)
    ch = BoundedChannel(capacity=32, max_bytes=8 << 20)   # also bounded in bytes: put(item, size=n) waits while
    ch.put(msg, size=len(data))     # the queued sizes plus n would pass max_bytes (one item always fits when empty)
    ch.bytes                        # the sizes queued
    ch.put_final(end)               # append past the bound and close: the last word, e.g. an error or End
    item = ch.get()                 # blocks; returns CLOSED once closed and drained
    ch.close(drop=True)             # no more puts; drop=True also discards what is queued

``queue.Queue`` has neither close nor "append past the bound", which is what ending a stream needs: the final
message must get in even when the queue is full, and a blocked producer must wake up when the consumer leaves.
"""

from __future__ import annotations

import threading
from collections import deque

CLOSED = object()


class BoundedChannel:
    def __init__(self, capacity: int, max_bytes: int | None = None):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        if max_bytes is not None and max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self.capacity = capacity
        self.max_bytes = max_bytes
        self._items: deque = deque()  # (item, size)
        self._bytes = 0
        self._closed = False
        self._cond = threading.Condition()

    def _room(self, size: int) -> bool:
        if len(self._items) >= self.capacity:
            return False
        return self.max_bytes is None or not self._items or self._bytes + size <= self.max_bytes

    @property
    def bytes(self) -> int:
        with self._cond:
            return self._bytes

    def __len__(self) -> int:
        with self._cond:
            return len(self._items)

    @property
    def closed(self) -> bool:
        with self._cond:
            return self._closed

    def put(self, item, timeout: float | None = None, size: int = 0) -> bool:
        with self._cond:
            if not self._cond.wait_for(lambda: self._closed or self._room(size), timeout):
                held = f"{len(self._items)} items, {self._bytes} bytes"
                raise TimeoutError(f"channel stayed full ({held}) for {timeout} s")
            if self._closed:
                return False
            self._items.append((item, size))
            self._bytes += size
            self._cond.notify_all()
            return True

    def put_final(self, item, *, drop: bool = False) -> bool:
        """Append ``item`` regardless of the bound and close; ``drop`` discards queued items first.  False if the
        channel was already closed (someone else had the last word)."""
        with self._cond:
            if self._closed:
                return False
            if drop:
                self._items.clear()
                self._bytes = 0
            self._items.append((item, 0))
            self._closed = True
            self._cond.notify_all()
            return True

    def get(self):
        with self._cond:
            self._cond.wait_for(lambda: self._items or self._closed)
            if self._items:
                item, size = self._items.popleft()
                self._bytes -= size
                self._cond.notify_all()
                return item
            return CLOSED

    def close(self, *, drop: bool = False) -> None:
        with self._cond:
            self._closed = True
            if drop:
                self._items.clear()
                self._bytes = 0
            self._cond.notify_all()
