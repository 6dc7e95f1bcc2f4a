"""Every service exits on the first SIGTERM within its grace period (``stagecast.service``): at once while it is
still starting, and by ``STOP_DEADLINE_S`` when its shutdown hangs, even with the GIL held (SIGALRM's default
action).  Launchers wait 10 s before SIGKILL ("ignored SIGTERM; killing it")."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from launcher.demo_checkpoint import write_transformer
from launcher.local_cluster import stage_args
from launcher.process import Launcher
from stagecast.service import READY_PREFIX, STOP_DEADLINE_S
from tests.pipeline_helpers import wait_until

pytestmark = pytest.mark.multiprocess

LAUNCHER_GRACE_S = 10.0


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens there once closed


def test_a_stage_stopped_while_starting_exits_at_once():
    # Its coordinator never answers: the stage's main thread waits in gRPC's Register (up to 120 s) and would see
    # the stop only afterwards.
    with tempfile.TemporaryDirectory() as tmp, Launcher() as launcher:
        write_transformer(Path(tmp) / "transformer", seed=0)
        args = stage_args(
            0, f"127.0.0.1:{_closed_port()}", str(Path(tmp) / "transformer"), "cpu", "float32", "127.0.0.1"
        )
        stage = launcher.start("stage-0", args)
        wait_until(lambda: any("listening on" in line for line in stage.log), 120, what="the stage registering")
        sent = time.monotonic()
        stage.proc.send_signal(signal.SIGTERM)
        assert stage.proc.wait(LAUNCHER_GRACE_S) == 0
        assert time.monotonic() - sent < STOP_DEADLINE_S  # at once, not by the deadline
        wait_until(lambda: any("stopped while starting" in line for line in stage.log), 10, what="its last line")


HANGING_SERVICE = """
import ctypes, sys, threading
from stagecast.service import run_service, serve_lifecycle

def shutdown():
    if sys.argv[1] == "gil":
        ctypes.PyDLL(None).sleep(600)  # a C call that keeps the GIL: no Python thread runs
    threading.Event().wait()  # a drain that never ends

run_service("hang", lambda stop: serve_lifecycle("hang", lambda: {"pid": 1}, shutdown, stop))
"""


@pytest.mark.parametrize("blocked", ["python", "gil"])
def test_a_service_whose_shutdown_hangs_still_exits_within_the_grace_period(blocked):
    code = textwrap.dedent(HANGING_SERVICE)
    proc = subprocess.Popen(
        [sys.executable, "-c", code, blocked], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith(READY_PREFIX), line
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        status = proc.wait(LAUNCHER_GRACE_S)
        took = time.monotonic() - sent
        err = proc.stderr.read()
        assert STOP_DEADLINE_S - 0.5 < took < LAUNCHER_GRACE_S, (took, status, err)
        if blocked == "python":  # the deadline's thread exits, naming where the main thread waited
            assert status == 0 and "still shutting down" in err and "< shutdown (<string>" in err, err
        else:  # no Python thread can run: SIGALRM's default action ends the process a second later
            assert status == -signal.SIGALRM, (status, err)
    finally:
        proc.kill()
        proc.wait(30)
        proc.stdout.close()
        proc.stderr.close()
