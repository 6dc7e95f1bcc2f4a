"""``stagecast up --cuda-mps``: a CUDA MPS control daemon of this run's own, so that the processes sharing a GPU (a
stage and the gateway's decoders, or a fleet's pipelines) run their kernels side by side instead of time-slicing it.

Usage::

    with CudaMps() as mps:      # nvidia-cuda-mps-control -d, its pipe and log folders private to this run
        ...                     # children started now inherit CUDA_MPS_PIPE_DIRECTORY / CUDA_MPS_LOG_DIRECTORY
                                # on the way out: "quit" to the daemon, the folders removed, the environment restored

Without MPS, two processes on one GPU take turns on it: while the stage's graphed forward runs, the gateway's decoder
call waits for its slice, and the other way round (on one H100 at 8 streams the tiny decoder's calls served at 7 times
their cost alone, BENCHMARKS.md).  The daemon is the NVIDIA driver's own (``nvidia-cuda-mps-control``); its folders
live in a private temporary folder, so a second ``up`` on the host starts a daemon of its own rather than joining this
one.  A server process that fails (e.g. a GPU in exclusive mode another daemon holds) shows in its log folder, which
is kept and named when the daemon cannot start.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile

CONTROL = "nvidia-cuda-mps-control"
PIPE_ENV, LOG_ENV = "CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"
CONTROL_TIMEOUT_S = 30.0  # each call of the control program: starting the daemon, telling it to quit


class MpsError(RuntimeError):
    """The daemon could not start; the message names ``--cuda-mps`` and what to do."""


class CudaMps:
    """One MPS control daemon for the life of a ``with`` block, its folders in ``self.folder``."""

    def __init__(self, control: str = CONTROL):
        self.control = control
        self.folder: str | None = None
        self._saved: dict[str, str | None] = {}

    @property
    def env(self) -> dict[str, str]:
        """What a client process needs to reach this daemon."""
        assert self.folder is not None, "the daemon is not running"
        return {PIPE_ENV: os.path.join(self.folder, "pipe"), LOG_ENV: os.path.join(self.folder, "log")}

    def __enter__(self) -> CudaMps:
        binary = shutil.which(self.control)
        if binary is None:
            raise MpsError(
                f"--cuda-mps: {self.control} is not on PATH (it comes with the NVIDIA driver's utilities); "
                "start without --cuda-mps, or install them"
            )
        self.folder = tempfile.mkdtemp(prefix="stagecast-mps-")  # 0700: this run's daemon only
        env = self.env
        for path in env.values():
            os.mkdir(path, 0o700)
        try:
            done = subprocess.run(
                [binary, "-d"], env={**os.environ, **env}, capture_output=True, text=True, timeout=CONTROL_TIMEOUT_S
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise MpsError(f"--cuda-mps: {self.control} -d failed: {exc} (its log: {env[LOG_ENV]})") from exc
        if done.returncode != 0:
            said = (done.stderr or done.stdout).strip()
            raise MpsError(
                f"--cuda-mps: {self.control} -d exited with {done.returncode}{': ' + said if said else ''} "
                f"(its log: {env[LOG_ENV]})"
            )
        self._saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)  # every launcher made from here on passes it to its children
        return self

    def __exit__(self, *exc) -> None:
        if self.folder is None:
            return
        env = self.env
        for key, value in self._saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        binary = shutil.which(self.control)
        try:
            if binary is not None:  # "quit": the daemon stops its server once its clients are gone
                subprocess.run(
                    [binary],
                    input="quit\n",
                    env={**os.environ, **env},
                    capture_output=True,
                    text=True,
                    timeout=CONTROL_TIMEOUT_S,
                )
        except (OSError, subprocess.TimeoutExpired):
            pass  # the folder goes anyway: a daemon left behind cannot be reached through it
        finally:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None
