"""`stagecast generate` of an unbounded stream: a Ctrl-C that comes while the stream opens (the gateway already counts
it) stops it gracefully as soon as it is open, instead of interrupting the open (which once left the command hung)."""

from __future__ import annotations

import os
import signal
from types import SimpleNamespace

import pytest

from stagecast import generate

pytestmark = pytest.mark.unit


class FakeStream:
    def __init__(self, total_frames):
        self.stopped = 0
        self.info = SimpleNamespace(
            total_frames=total_frames,
            width=8,
            height=8,
            codec="raw",
            seed=1,
            timesteps=[1000.0],
            shift=1.0,
            decoder="full",
            pipeline="p0",
        )
        self.end, self.ttff, self.fps = SimpleNamespace(reason="stopped"), 0.1, 16.0
        self.steady_fps, self.burst_frames = 16.0, 0

    def stop(self):
        self.stopped += 1

    def write_mp4(self, out, on_frame):
        return 0


class FakeClient:
    def __init__(self, stream, **_):
        self.stream = stream

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def generate(self, prompt, timeout=None, **config):
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C while the stream opens
        return self.stream


@pytest.fixture
def python_sigint():
    """SIGINT as an interactive `python` has it (KeyboardInterrupt): a process started in the background, as CI may
    start the suite, inherits it ignored."""
    original = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, original)


@pytest.mark.parametrize("seconds", [None, 1.0])
def test_a_ctrl_c_while_the_stream_opens(monkeypatch, tmp_path, seconds, python_sigint):
    stream = FakeStream(total_frames=None if seconds is None else 16)
    monkeypatch.setattr(generate, "Client", lambda target, **kw: FakeClient(stream))
    before = signal.getsignal(signal.SIGINT)
    if seconds is None:  # unbounded: stopped gracefully once open, and the handler is restored after
        report = generate.generate_clip("x", tmp_path / "a.mp4", prompt="p", progress=False)
        assert stream.stopped == 1 and report.end_reason == "stopped"
    else:  # bounded: Ctrl-C interrupts, as by default
        with pytest.raises(KeyboardInterrupt):
            generate.generate_clip("x", tmp_path / "a.mp4", prompt="p", progress=False, seconds=seconds)
        assert stream.stopped == 0
    assert signal.getsignal(signal.SIGINT) is before
