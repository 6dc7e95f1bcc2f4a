"""The fork server (launcher/forkserver.py): a child forked from it runs its module as `python -m` would, with the
environment, working directory, exit status and signals of a child started afresh, and none outlives its caller."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from launcher.forkserver import ForkServer
from launcher.process import Launcher, shared_forkserver

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def server():
    fs = ForkServer(dict(os.environ))
    yield fs
    fs.close()


@pytest.fixture
def module(tmp_path, monkeypatch):
    """A module ``probe`` in a folder on the child's PYTHONPATH... as the fork server sees it: on its cwd."""

    def write(body: str) -> dict[str, str]:
        (tmp_path / "probe.py").write_text(textwrap.dedent(body))
        return {**os.environ, "PROBE": "from-the-caller"}

    return write


def run(server, argv, env, cwd=None, timeout=30):
    proc = server.spawn(argv, env, cwd)
    out = proc.stdout.read()
    return proc.wait(timeout), out, proc


def test_a_child_runs_its_module_with_its_own_environment_directory_and_argv(server, module, tmp_path):
    env = module(
        """
        import os, sys
        print(os.environ["PROBE"], os.getcwd(), sys.argv[1:], sys.orig_argv[1:3], os.getppid() != 1)
        print("to stderr", file=sys.stderr)
        """
    )
    code, out, proc = run(server, ["probe", "a", "b"], env, cwd=str(tmp_path))
    assert code == 0 and proc.returncode == 0
    assert out.splitlines() == [f"from-the-caller {tmp_path} ['a', 'b'] ['-m', 'probe'] True", "to stderr"]


@pytest.mark.parametrize(
    ("body", "code", "text"),
    [
        ("import sys; sys.exit(3)", 3, ""),
        ("import sys; sys.exit('bad flag')", 1, "bad flag"),
        ("raise RuntimeError('boom')", 1, "RuntimeError: boom"),
        ("import atexit; atexit.register(print, 'atexit ran')", 0, "atexit ran"),
        (
            "import threading, time; threading.Thread(target=lambda: (time.sleep(0.2), print('joined'))).start()",
            0,
            "joined",
        ),
    ],
)
def test_a_child_exits_as_python_m_would(server, module, tmp_path, body, code, text):
    env = module(body)
    got, out, _ = run(server, ["probe"], env, cwd=str(tmp_path))
    assert got == code and text in out
    afresh = subprocess.run([sys.executable, "-m", "probe"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert afresh.returncode == code and text in afresh.stdout + afresh.stderr
    assert out.count(text) == (afresh.stdout + afresh.stderr).count(text)  # said as often: once


def test_signals_reach_the_child_and_its_status_reads_like_popens(server, module, tmp_path):
    env = module("import sys, time; print('up', flush=True); time.sleep(60)")
    proc = server.spawn(["probe"], env, str(tmp_path))
    assert proc.stdout.readline() == "up\n"
    assert proc.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(0.05)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == -signal.SIGTERM and proc.poll() == -signal.SIGTERM
    proc.kill()  # after the end: nothing to signal, no error


def test_the_children_end_with_their_caller(module, tmp_path):
    env = module("import time; print('up', flush=True); time.sleep(120)")
    fs = ForkServer(dict(os.environ))
    proc = fs.spawn(["probe"], env, str(tmp_path))
    assert proc.stdout.readline() == "up\n"
    fs.proc.stdin.close()  # what the caller's exit does, however it exits
    assert proc.wait(30) == -signal.SIGTERM
    assert fs.proc.wait(30) == 0
    fs.close()


def test_a_launcher_on_the_fork_server_starts_services_that_serve(tmp_path):
    with Launcher(forkserver=True) as launcher:
        coord = launcher.spawn("coordinator", ["coordinator", "--stages", "1", "--port", "0"])
        assert coord.info["address"] and coord.proc.poll() is None
        assert coord.proc.args[:5] == [sys.executable, "-m", "coordinator", "--stages", "1"]  # as Popen.args reads
        server = shared_forkserver(launcher.env)
        assert f"PPid:\t{server.proc.pid}\n" in open(f"/proc/{coord.pid}/status").read()  # forked, not started
        assert launcher.stop(coord) == 0  # SIGTERM: a clean stop
