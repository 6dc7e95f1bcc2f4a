"""Deadlines of the gateway's streams on one thread (not a ``threading.Timer`` thread per stream).

Usage::

    timers = Timers()
    entry = timers.call_later(30.0, call.cancel)   # runs on the timers' thread, once
    timers.cancel(entry)                           # drops the callback (and what it refers to) at once
    timers.close()

    deadlines = Deadlines(timers)                  # one stream's entries
    deadlines.after(60.0, call.cancel); deadlines.clear()

Callbacks must be quick (they cancel calls, queue messages); one that raises is logged.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)


class TimerEntry:
    __slots__ = ("when", "fn")

    def __init__(self, when: float, fn: Callable[[], object]):
        self.when = when
        self.fn: Callable[[], object] | None = fn


class Timers:
    def __init__(self, name: str = "timers"):
        self._heap: list[tuple[float, int, TimerEntry]] = []
        self._ids = itertools.count()
        self._cond = threading.Condition()
        self._closed = False
        self._husks = 0  # cancelled entries still in the heap
        self._thread = threading.Thread(target=self._run, daemon=True, name=name)
        self._thread.start()

    def call_later(self, seconds: float, fn: Callable[[], object]) -> TimerEntry:
        entry = TimerEntry(time.monotonic() + seconds, fn)
        with self._cond:
            heapq.heappush(self._heap, (entry.when, next(self._ids), entry))
            if self._heap[0][2] is entry:
                self._cond.notify()
        return entry

    def cancel(self, entry: TimerEntry | None) -> None:
        if entry is None:
            return
        with self._cond:
            if entry.fn is None:
                return  # ran or cancelled already
            entry.fn = None  # what the callback held is released now
            self._husks += 1
            if self._husks > 16 and self._husks > len(self._heap) // 2:
                # Mostly husks: rebuild, so that cancelled deadlines do not pile up until their time.
                self._heap = [item for item in self._heap if item[2].fn is not None]
                heapq.heapify(self._heap)
                self._husks = 0

    def __len__(self) -> int:
        with self._cond:
            return sum(1 for _, _, entry in self._heap if entry.fn is not None)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._heap.clear()
            self._cond.notify()
        self._thread.join(5.0)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed:
                    if not self._heap:
                        self._cond.wait()
                        continue
                    delay = self._heap[0][0] - time.monotonic()
                    if delay <= 0:
                        break
                    self._cond.wait(delay)
                if self._closed:
                    return
                _, _, entry = heapq.heappop(self._heap)
                fn, entry.fn = entry.fn, None
                if fn is None:
                    self._husks = max(0, self._husks - 1)
            if fn is None:
                continue
            try:
                fn()
            except Exception:  # noqa: BLE001 - a deadline's action failing must not stop the others
                logger.exception("timer callback failed")


class Deadlines:
    """One stream's entries on the gateway's ``Timers``, cancelled together when the stream is gone."""

    def __init__(self, timers: Timers):
        self.timers = timers
        self._lock = threading.Lock()
        self._entries: list[TimerEntry] = []

    def after(self, seconds: float, fn: Callable[[], object]) -> None:
        # Deadlines that fire after the fact are harmless: cancelling a finished call is a no-op.
        entry = self.timers.call_later(seconds, fn)
        with self._lock:
            self._entries.append(entry)

    def clear(self) -> None:
        with self._lock:
            entries, self._entries = self._entries, []
        for entry in entries:
            self.timers.cancel(entry)
