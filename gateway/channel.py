"""A bounded, closable FIFO between two threads of one stream (pipeline reader -> decoder -> client sender).

Usage::

    ch = BoundedChannel(capacity=4)
    ch.put(item)                    # blocks while full; False once the channel is closed (the consumer is gone)
    ch.put(item, timeout=5.0)       # raises TimeoutError if still full after 5 s (the consumer is too slow)
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
    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._items: deque = deque()
        self._closed = False
        self._cond = threading.Condition()

    def __len__(self) -> int:
        with self._cond:
            return len(self._items)

    @property
    def closed(self) -> bool:
        with self._cond:
            return self._closed

    def put(self, item, timeout: float | None = None) -> bool:
        with self._cond:
            if not self._cond.wait_for(lambda: self._closed or len(self._items) < self.capacity, timeout):
                raise TimeoutError(f"channel stayed full ({self.capacity} items) for {timeout} s")
            if self._closed:
                return False
            self._items.append(item)
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
            self._items.append(item)
            self._closed = True
            self._cond.notify_all()
            return True

    def get(self):
        with self._cond:
            self._cond.wait_for(lambda: self._items or self._closed)
            if self._items:
                item = self._items.popleft()
                self._cond.notify_all()
                return item
            return CLOSED

    def close(self, *, drop: bool = False) -> None:
        with self._cond:
            self._closed = True
            if drop:
                self._items.clear()
            self._cond.notify_all()
