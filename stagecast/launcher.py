"""Start and stop stagecast service processes on this machine (``stagecast up``, selftest, demo, tests).

Usage::

    with Launcher() as launcher:
        coord = launcher.spawn("coordinator", ["coordinator", "--stages", "2", "--port", "0"])
        coord.info["address"]                          # parsed from the child's STAGECAST_READY line
        launcher.spawn("stage-0", ["stage", "--index", "0", "--coordinator", coord.info["address"], ...])
    # leaving the block: SIGTERM to every child, SIGKILL after a grace period

Each child prints one ``STAGECAST_READY key=value ...`` line once it serves; ``spawn`` blocks on that
line (no polling); ``start`` + ``wait_ready`` start several children at once.  Children get
PR_SET_PDEATHSIG, so they die with the launcher even if it is killed with SIGKILL: no orphans.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

READY_PREFIX = "STAGECAST_READY"


def announce_ready(role: str | None = None, **info: object) -> None:
    """Print the line ``Launcher`` waits for: ``STAGECAST_READY [role] key=value ...`` (values without spaces)."""
    fields = [role] if role else []
    fields += [f"{key}={value}" for key, value in info.items()]
    print(" ".join([READY_PREFIX, *fields]), flush=True)


def _die_with_parent() -> None:
    # Linux only: deliver SIGTERM to the child when the launching thread's process exits.
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    info: dict[str, str] = field(default_factory=dict)
    log: list[str] = field(default_factory=list)
    ready: threading.Event | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid


class LaunchError(RuntimeError):
    pass


class Launcher:
    def __init__(self, env: dict[str, str] | None = None, echo: bool = False):
        self.children: list[Child] = []
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.echo = echo
        self._spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="launcher")

    def start(self, name: str, args: list[str]) -> Child:
        """Start a child without waiting for it; pair with ``wait_ready`` (lets several start at once)."""
        # PR_SET_PDEATHSIG fires when the *thread* that forked the child exits, so every child is forked from
        # the launcher's own long-lived thread, whichever thread calls start().
        proc = self._spawner.submit(
            subprocess.Popen,
            [sys.executable, "-m", "stagecast.cli", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=self.env,
            preexec_fn=_die_with_parent,
        ).result()
        child = Child(name, proc)
        self.children.append(child)
        ready = threading.Event()
        child.ready = ready

        def pump() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                line = line.rstrip("\n")
                child.log.append(line)
                del child.log[:-200]
                if line.startswith(READY_PREFIX) and not ready.is_set():
                    child.info = dict(kv.split("=", 1) for kv in line.split()[1:] if "=" in kv)
                    ready.set()
                elif self.echo:
                    print(f"[{name}] {line}", file=sys.stderr, flush=True)
            ready.set()  # EOF: the child exited

        threading.Thread(target=pump, daemon=True, name=f"log-{name}").start()
        return child

    def wait_ready(self, child: Child, timeout: float = 300.0) -> Child:
        """Block until the child printed its READY line (no polling); raise LaunchError if it exited or timed out."""
        assert child.ready is not None
        if not child.ready.wait(timeout) or not child.info:
            tail = "\n".join(child.log[-30:])
            self.stop(child)
            raise LaunchError(f"{child.name} did not become ready (exit code {child.proc.poll()}):\n{tail}")
        return child

    def spawn(self, name: str, args: list[str], timeout: float = 300.0) -> Child:
        return self.wait_ready(self.start(name, args), timeout)

    def stop(self, child: Child, grace: float = 10.0) -> int | None:
        if child.proc.poll() is None:
            child.proc.send_signal(signal.SIGTERM)
            try:
                child.proc.wait(grace)
            except subprocess.TimeoutExpired:
                logger.warning("%s ignored SIGTERM; killing it", child.name)
                child.proc.kill()
                child.proc.wait()
        return child.proc.returncode

    def stop_all(self, grace: float = 10.0) -> None:
        for child in reversed(self.children):
            if child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)
        for child in reversed(self.children):
            self.stop(child, grace)
        self.children.clear()
        # Only now may the forking thread exit: its exit is what PR_SET_PDEATHSIG watches.
        self._spawner.shutdown(wait=True)
        self._spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="launcher")

    def __enter__(self) -> Launcher:
        return self

    def __exit__(self, *exc) -> None:
        self.stop_all()
