"""The rate a viewer sees from a stream's frame arrivals (``stagecast.arrivals``): a paced stream's start burst does
not count as frame rate, and the burst is reported apart."""

from __future__ import annotations

import pytest

from stagecast.arrivals import MAX_SAMPLES, Arrivals

pytestmark = pytest.mark.unit


def _paced(seconds: float, fps: float = 16.0, buffer_s: float = 0.5, ttff: float = 0.2, chunk: int = 4) -> Arrivals:
    """Arrivals of a paced stream: the first ``buffer_s`` of frames at once, then one chunk of frames every
    ``chunk / fps`` seconds (frames of a chunk arrive together)."""
    a = Arrivals()
    n = round(seconds * fps)
    burst = round(buffer_s * fps)
    for i in range(n):
        if i < burst:
            a.add(ttff)
        else:
            chunk_no = (i - burst) // chunk + 1
            a.add(ttff + chunk_no * chunk / fps)
    return a


def test_a_short_paced_clip_reads_its_frame_rate_not_the_burst():
    a = _paced(1.0)
    assert a.fps is not None and a.fps > 25  # what the CLI used to print: the burst counted as rate
    assert a.steady_fps == pytest.approx(16.0, rel=0.35)
    assert 5 <= a.burst_frames <= 9


def test_a_long_paced_stream_reads_16_fps_and_the_same_burst():
    a = _paced(60.0)
    assert a.steady_fps == pytest.approx(16.0, rel=0.02)
    assert 5 <= a.burst_frames <= 9


def test_a_stream_at_one_rate_throughout_has_no_burst():
    a = Arrivals()
    for i in range(400):
        a.add(0.1 + i / 30.0)
    assert a.steady_fps == pytest.approx(30.0, rel=0.01)
    assert a.fps == pytest.approx(30.0, rel=0.01)
    assert a.burst_frames == 0


def test_too_few_frames_tell_no_rate():
    a = Arrivals()
    assert a.steady_fps is None and a.fps is None and a.burst_frames == 0
    a.add(0.3)
    assert a.steady_fps is None and a.burst_frames == 0


def test_memory_is_bounded_and_the_rate_holds_over_a_long_stream():
    a = Arrivals()
    n = MAX_SAMPLES * 5
    for i in range(n):
        a.add(i / 16.0)
    assert a.count == n
    assert len(a._time) <= MAX_SAMPLES
    assert a.steady_fps == pytest.approx(16.0, rel=0.01)
