"""``stagecast up --cuda-mps``: a CUDA MPS control daemon of the run's own, reached by the children it starts, told to
quit and its folders removed on the way out; a daemon that cannot start is a clear error naming the flag.

The daemon here is a stand-in script with ``nvidia-cuda-mps-control``'s interface (``-d`` starts it, ``quit`` on
stdin stops it), which records what it was asked and in which folders: CI has no NVIDIA driver."""

import os
import stat
import subprocess
import sys

import pytest

from launcher.mps import LOG_ENV, PIPE_ENV, CudaMps, MpsError
from launcher.process import Launcher

pytestmark = pytest.mark.multiprocess


def _control(tmp_path, exit_code: int = 0, say: str = "") -> tuple[str, object]:
    record = tmp_path / "record.txt"
    script = tmp_path / "nvidia-cuda-mps-control"
    script.write_text(
        "#!/bin/sh\n"
        f'if [ "$1" = "-d" ]; then echo "start $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY" >> {record}; '
        f"{'echo ' + repr(say) + ' >&2; ' if say else ''}exit {exit_code}; fi\n"
        f'read cmd; echo "$cmd $CUDA_MPS_PIPE_DIRECTORY" >> {record}\n'
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return str(script), record


def test_the_daemon_runs_in_private_folders_its_children_reach_and_quits_on_the_way_out(tmp_path, monkeypatch):
    monkeypatch.delenv(PIPE_ENV, raising=False)
    monkeypatch.setenv(LOG_ENV, "/somewhere/else")  # an operator's own value comes back afterwards
    control, record = _control(tmp_path)
    with CudaMps(control=control) as mps:
        pipe, log = mps.env[PIPE_ENV], mps.env[LOG_ENV]
        folder = mps.folder
        assert os.path.isdir(pipe) and os.path.isdir(log)
        assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700  # no other user's client joins this run's daemon
        assert record.read_text().split() == ["start", pipe, log]
        # A launcher made now hands the daemon's folders to every child it starts.
        with Launcher(mtls=False) as launcher:
            assert launcher.env[PIPE_ENV] == pipe and launcher.env[LOG_ENV] == log
        child = subprocess.run(
            [sys.executable, "-c", f"import os; print(os.environ['{PIPE_ENV}'])"],
            capture_output=True,
            text=True,
            check=True,
        )
        assert child.stdout.strip() == pipe
    assert record.read_text().splitlines()[-1].split() == ["quit", pipe]
    assert not os.path.exists(folder)
    assert PIPE_ENV not in os.environ and os.environ[LOG_ENV] == "/somewhere/else"


def test_a_daemon_that_cannot_start_or_a_missing_one_is_an_error_naming_the_flag(tmp_path, monkeypatch):
    monkeypatch.delenv(PIPE_ENV, raising=False)
    control, _ = _control(tmp_path, exit_code=1, say="An instance of this daemon is already running")
    with pytest.raises(MpsError) as failed:
        with CudaMps(control=control):
            pass
    said = str(failed.value)
    assert said.startswith("--cuda-mps: ") and "exited with 1" in said and "already running" in said
    assert PIPE_ENV not in os.environ  # the environment was left alone
    with pytest.raises(MpsError, match="--cuda-mps: .*not on PATH"):
        with CudaMps(control=str(tmp_path / "no-such-control")):
            pass


def test_up_refuses_cuda_mps_off_a_gpu_before_anything_starts():
    done = subprocess.run(
        [sys.executable, "-m", "launcher.cli", "up", "--checkpoint", "/nonexistent", "--device", "cpu", "--cuda-mps"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "--cuda-mps: only with --device cuda" in done.stderr
