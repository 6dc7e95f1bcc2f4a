"""A stream's frame arrivals at the client, and the rate a viewer sees from them.

Usage (the SDK's generations hold one and feed it each frame's arrival)::

    arrivals = Arrivals()
    arrivals.add(seconds_since_config)      # once per frame, in order
    arrivals.steady_fps                     # the rate over the later half of the stream's time
    arrivals.burst_frames                   # frames delivered beyond that rate (the start's burst)

A paced stream's first frames come in a burst: the pipeline runs up to its playout buffer (0.5 s) ahead of the
stream's frame rate, so a 1 s clip at 16 FPS delivers half its frames at once, and the rate from the first frame to
the last (``fps``) reads 45 "FPS".  The steady rate is measured where the stream runs at its own pace, over the later
half of the time between the first and the last frame, as the benchmarks count steady FPS from the middle of a long
stream; the burst is reported apart.  Memory is bounded: past ``MAX_SAMPLES`` arrivals every other one is dropped,
which keeps the samples spread evenly over the whole stream.
"""

from __future__ import annotations

import bisect

MAX_SAMPLES = 4096
BURST_SLACK_FRAMES = 4  # one chunk of 4 frames arriving together is the pipeline's own rhythm, not a burst


class Arrivals:
    def __init__(self) -> None:
        self.count = 0
        self.first_s: float | None = None
        self.last_s: float | None = None
        self._index: list[int] = []  # frame indices of the kept samples (increasing)
        self._time: list[float] = []  # their arrival times
        self._stride = 1  # every stride-th frame is kept

    def add(self, t: float) -> None:
        if self.first_s is None:
            self.first_s = t
        self.last_s = t
        if self.count % self._stride == 0:
            self._index.append(self.count)
            self._time.append(t)
            if len(self._index) > MAX_SAMPLES:
                self._index, self._time, self._stride = self._index[::2], self._time[::2], self._stride * 2
        self.count += 1

    @property
    def fps(self) -> float | None:
        """Frames after the first over the time since it arrived (burst included)."""
        if self.count < 2 or self.first_s is None or self.last_s is None or self.last_s == self.first_s:
            return None
        return (self.count - 1) / (self.last_s - self.first_s)

    def _steady_start(self) -> tuple[int, float] | None:
        """Where the steady part starts: the arrival at the middle of the stream's time (a kept sample's) and the
        index of the first frame that arrived after it.  Frames of one chunk arrive together, so the count starts
        after a whole arrival, never inside one."""
        if self.first_s is None or self.last_s is None or self.last_s == self.first_s:
            return None
        at = bisect.bisect_left(self._time, (self.first_s + self.last_s) / 2)
        if at >= len(self._time):
            return None
        t = self._time[at]
        after = bisect.bisect_right(self._time, t)
        if after >= len(self._time):
            return None
        return self._index[after], t

    @property
    def steady_fps(self) -> float | None:
        """Frames per second over the later half of the stream's time (None with too few frames to tell)."""
        start = self._steady_start()
        if start is None or self.last_s is None:
            return None
        index, t = start
        if self.last_s == t:
            return None
        return (self.count - index) / (self.last_s - t)

    @property
    def burst_frames(self) -> int:
        """Frames delivered beyond the steady rate since the first frame: the burst a paced stream's playout buffer
        sends at its start (0 for a stream that ran at one rate throughout; within a chunk of frames is 0)."""
        rate = self.steady_fps
        if rate is None or self.first_s is None or self.last_s is None:
            return 0
        beyond = (self.count - 1) - rate * (self.last_s - self.first_s)
        return round(beyond) if beyond >= BURST_SLACK_FRAMES else 0
