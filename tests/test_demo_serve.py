"""``stagecast demo --serve`` keeps its services up as ``stagecast up`` does: a gateway that dies is started again on
its port, so the live page goes on working; Ctrl-C stops everything (issue 51, finding b)."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading

import grpc
import pytest

from stagecast.v1 import stream_pb2 as spb
from stagecast.v1 import stream_pb2_grpc as spb_grpc
from tests.test_demo import _processes_mentioning

pytestmark = pytest.mark.multiprocess


def _lines(proc: subprocess.Popen) -> queue.Queue:
    lines: queue.Queue = queue.Queue()

    def pump() -> None:
        for line in proc.stdout:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return lines


def _until(lines: queue.Queue, pattern: str, log: list[str], timeout: float = 240.0) -> re.Match:
    while True:
        try:
            line = lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no line matching {pattern!r} within {timeout} s:\n" + "\n".join(log)) from None
        if line is None:
            raise AssertionError(f"the demo ended before {pattern!r}:\n" + "\n".join(log))
        log.append(line)
        match = re.search(pattern, line)
        if match:
            return match


def test_demo_serve_restarts_a_gateway_that_died_on_its_port(tmp_path):
    cache = str(tmp_path / "cache")
    env = {**os.environ, "STAGECAST_CACHE": cache, "STAGECAST_FORKSERVER": "0"}  # each service its own command line
    args = ["demo", "--seconds", "0.5", "--stages", "1", "--serve", "--no-progress", "--out", str(tmp_path / "d.mp4")]
    proc = subprocess.Popen(
        [sys.executable, "-m", "launcher.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    log: list[str] = []
    try:
        lines = _lines(proc)
        gateway = _until(lines, r"up in [\d.]+ s: gateway (\S+),", log)[1]
        _until(lines, r"serving the live page at http://127\.0\.0\.1:\d+/ until Ctrl-C", log)
        pids = [int(c.split("\0")[0]) for c in _gateway_pids(cache)]
        assert len(pids) == 1, pids
        os.kill(pids[0], signal.SIGKILL)
        _until(lines, r"stagecast demo: gateway restarted \(pid \d+\)", log)
        with grpc.insecure_channel(gateway) as ch:  # the same address answers again
            status = spb_grpc.StreamServiceStub(ch).GetStatus(spb.StatusRequest(), timeout=30, wait_for_ready=True)
        assert not status.starting and status.max_streams > 0
        proc.send_signal(signal.SIGINT)
        _until(lines, r"demo finished in [\d.]+ s; every process stopped", log)
        assert proc.wait(timeout=60) == 0, "\n".join(log)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert _processes_mentioning(cache) == []


def _gateway_pids(cache: str) -> list[str]:
    """``pid\\0cmdline`` of the gateway processes serving the demo's checkpoint."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if cache in cmdline and " -m gateway " in cmdline:
            found.append(f"{pid}\0{cmdline}")
    return found
