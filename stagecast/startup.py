"""A service's start-up steps, printed as they happen and kept for ``GetStatus``.

Usage (a service holds one from its first line; ``launcher.startup_view`` shows what its children print)::

    startup = Startup("stage 0", report=lambda progress: ...)   # report: e.g. to the coordinator (ReportStartup)
    startup.step("weights", detail="layers 0:15")              # STAGECAST_STARTUP weights 1/1 0.41s layers 0:15
    startup.step("calibration", 2, 4)                          # a counted step: its latest count is kept
    startup.ready()                                            # STAGECAST_STARTUP ready 1/1 2.03s
    startup.to_proto(pb.StartupProgress)                       # the internal or the public message (same fields)

Each step is one line on stdout, ``STAGECAST_STARTUP NAME DONE/TOTAL SECONDSs [DETAIL]`` (seconds since the process
started), readable as it is in ``kubectl logs`` and parsed line by line by a launcher (``parse_line``); no progress
bar is drawn here, since a service's output is a pipe.  ``report`` is called with the progress after every step, and
must not raise (a lost report never holds start-up up).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from stagecast.service import print_line, process_age

logger = logging.getLogger(__name__)

STARTUP_PREFIX = "STAGECAST_STARTUP"


@dataclass
class StartupStep:
    name: str
    done: int = 1
    total: int = 1  # 0: not counted
    at_s: float = 0.0  # seconds after the process started
    detail: str = ""

    def line(self) -> str:
        """The line a service prints for this step (``parse_line`` reads it back)."""
        fields = [STARTUP_PREFIX, self.name, f"{self.done}/{self.total}", f"{self.at_s:.2f}s", self.detail]
        return " ".join(f for f in fields if f)

    def describe(self) -> str:
        """For people: ``calibration 2/4 at 3.10 s (detail)``; a step of one is not counted."""
        count = f" {self.done}/{self.total}" if self.total != 1 else ""
        return f"{self.name}{count} at {self.at_s:.2f} s" + (f" ({self.detail})" if self.detail else "")


def parse_line(line: str) -> StartupStep | None:
    """The step a ``STAGECAST_STARTUP`` line names, or None for any other line (or a malformed one)."""
    parts = line.split(maxsplit=4)
    if len(parts) < 4 or parts[0] != STARTUP_PREFIX:
        return None
    try:
        done, total = (int(n) for n in parts[2].split("/", 1))
        at_s = float(parts[3].removesuffix("s"))
    except ValueError:
        return None
    return StartupStep(parts[1], done, total, at_s, parts[4] if len(parts) > 4 else "")


class Startup:
    """One process's start-up steps (module docstring); thread-safe."""

    def __init__(
        self,
        process: str,
        *,
        report: Callable[[Startup], None] | None = None,
        clock: Callable[[], float] = process_age,
        echo: bool = True,
    ):
        self.process = process
        self.report = report
        self.clock = clock
        self.echo = echo  # print each step's line (off in tests that run a service in their own process)
        self.steps: list[StartupStep] = []
        self.ready_s = 0.0
        self.version = 0  # bumped at every step (a status watcher waits on it)
        self.changed = threading.Condition()

    def step(self, name: str, done: int = 1, total: int = 1, detail: str = "") -> StartupStep:
        """Record (or, for a step seen before, update) ``name`` at ``done`` of ``total``; print and report it."""
        at = self.clock()
        with self.changed:
            step = next((s for s in self.steps if s.name == name), None)
            if step is None:
                step = StartupStep(name)
                self.steps.append(step)
            step.done, step.total, step.at_s, step.detail = done, total, at, detail
            if name == "ready":
                self.ready_s = at
            self.version += 1
            self.changed.notify_all()
            line = step.line()
        if self.echo:
            print_line(line)
        if self.report is not None:
            self.report(self)
        return step

    def ready(self, detail: str = "") -> StartupStep:
        return self.step("ready", detail=detail)

    @property
    def is_ready(self) -> bool:
        return self.ready_s > 0

    def wait_change(self, version: int, timeout: float) -> int:
        """Block until a step after ``version`` (or ``timeout``); returns the version now."""
        with self.changed:
            self.changed.wait_for(lambda: self.version != version, timeout)
            return self.version

    def to_proto(self, cls, **fields):
        """This progress as ``cls`` (``stagecast.v1`` or ``stagecast.internal.v1`` ``StartupProgress``: the same
        fields), with extra ``fields`` (the internal one's ``index``)."""
        with self.changed:
            msg = cls(process=self.process, ready=self.is_ready, ready_s=self.ready_s, **fields)
            for s in self.steps:
                msg.steps.add(name=s.name, done=s.done, total=s.total, at_s=s.at_s, detail=s.detail)
        return msg
