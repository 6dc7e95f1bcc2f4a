"""``stagecast generate``: stream one clip from a gateway into an MP4, with a progress bar, TTFF and FPS.

Usage::

    stagecast generate --target localhost:50051 --prompt "a red fox in snow" --seconds 4 --out clip.mp4
    report = generate_clip("localhost:50051", "clip.mp4", prompt="a red fox in snow", seconds=4)
    report.frames, report.ttff, report.fps

Without ``--seconds`` the stream runs until Ctrl-C, which stops it gracefully (the frames of chunks in flight are
still written).  TTFF is measured at the client, from sending the config to receiving the first frame; FPS counts
the frames received after the first one over the time since it arrived.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from dataclasses import dataclass

from tqdm import tqdm

from stagecast.client import Client

logger = logging.getLogger(__name__)


@dataclass
class GenerateReport:
    out: str
    frames: int
    width: int
    height: int
    codec: str
    seed: int
    end_reason: str
    ttff: float | None
    fps: float | None

    def summary(self) -> str:
        ttff = f"{self.ttff:.3f} s" if self.ttff is not None else "n/a"
        fps = f"{self.fps:.1f}" if self.fps is not None else "n/a"
        return (
            f"wrote {self.out}: {self.frames} frames {self.width}x{self.height} ({self.codec}, seed {self.seed}, "
            f"{self.end_reason}); TTFF {ttff}; FPS {fps}"
        )


def generate_clip(
    target: str, out: str | os.PathLike, *, prompt: str, progress: bool = True, timeout: float | None = None, **config
) -> GenerateReport:
    """Stream a clip from the gateway at ``target`` into ``out``; ``config`` as for ``Client.generate``."""
    with Client(target) as client:
        gen = client.generate(prompt, timeout=timeout, **config)
        info = gen.info
        bar = tqdm(total=info.total_frames, unit="frame", disable=not progress, desc="generating")
        restore = _stop_on_interrupt(gen.stop) if info.total_frames is None else None
        try:
            frames = gen.write_mp4(out, on_frame=lambda _frame: bar.update(1))
        finally:
            bar.close()
            if restore is not None:
                restore()
        return GenerateReport(
            out=os.fspath(out),
            frames=frames,
            width=info.width,
            height=info.height,
            codec=info.codec,
            seed=info.seed,
            end_reason=gen.end.reason if gen.end else "unknown",
            ttff=gen.ttff,
            fps=gen.fps,
        )


def _stop_on_interrupt(stop):
    """Make Ctrl-C end an unbounded stream gracefully (once); returns a function restoring the old handler."""
    if threading.current_thread() is not threading.main_thread():
        return None
    previous = signal.getsignal(signal.SIGINT)

    def handler(signum, frame):
        print("\nstopping: the frames of chunks in flight are still written (Ctrl-C again to abort)", flush=True)
        signal.signal(signal.SIGINT, previous)
        stop()

    signal.signal(signal.SIGINT, handler)
    return lambda: signal.signal(signal.SIGINT, previous)
