"""What a launcher shows of its children's start-up (``stagecast up``, ``stagecast demo``).

Usage (``launcher.process.Launcher`` calls it from the thread that reads each child's output line by line)::

    view = StartupView()                          # on stderr; bars only when stderr is a terminal
    Launcher(startup=view)                        # each child's STAGECAST_STARTUP line goes to view.step
    view.step("stage-0", StartupStep("calibration", 2, 4, 3.1))   # "[stage-0] start-up: calibration 2/4 at 3.10 s"
    view.ready("stage-0", 4.2)                    # "[stage-0] READY in 4.20 s"

Children print plain lines (``stagecast.startup``: their output is a pipe); the bars are drawn here.  On a terminal a
counted step (calibration k of n, graphs k of n) is one tqdm bar per child that fills in place; anywhere else (a
pipe, a log file, CI) every step is one line.
"""

from __future__ import annotations

import sys
import threading
from typing import TextIO

from tqdm import tqdm

from stagecast.service import print_line
from stagecast.startup import StartupStep


class StartupView:
    def __init__(self, stream: TextIO | None = None, *, tty: bool | None = None):
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self._bars: dict[tuple[str, str], tqdm] = {}
        self._lock = threading.Lock()

    def step(self, child: str, step: StartupStep) -> None:
        if step.name == "ready":
            return  # its READY line says it (``ready``)
        with self._lock:
            if self.tty and step.total > 1:
                self._bar(child, step)
                return
            self._print(f"[{child}] start-up: {step.describe()}")

    def ready(self, child: str, seconds: float) -> None:
        with self._lock:
            for key in [k for k in self._bars if k[0] == child]:
                self._bars.pop(key).close()
            self._print(f"[{child}] READY in {seconds:.2f} s")

    def _bar(self, child: str, step: StartupStep) -> None:
        key = (child, step.name)
        bar = self._bars.get(key)
        if bar is None:
            bar = self._bars[key] = tqdm(total=step.total, desc=f"[{child}] {step.name}", file=self.stream, leave=True)
        bar.total = step.total
        bar.n = step.done
        bar.set_postfix_str(f"at {step.at_s:.1f} s", refresh=True)
        if step.done >= step.total:
            self._bars.pop(key).close()

    def _print(self, line: str) -> None:
        if self._bars:
            tqdm.write(line, file=self.stream)  # above the bars, which stay whole
        else:
            print_line(line, self.stream)
