"""``stagecast ARGS`` run in the test's own process, for the checks that a command refuses bad flags at start-up:
the same parser, validation and one-line error as the console script, without the seconds a new interpreter spends
importing torch."""

from __future__ import annotations

import contextlib
import io
import subprocess

from launcher.cli import main
from stagecast.service import in_process


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """What ``stagecast ARGS`` exits with and writes, as ``subprocess.run(..., capture_output=True, text=True)``
    would report it.  Only for commands that must fail at start-up: one that starts would serve until killed."""
    out, err = io.StringIO(), io.StringIO()
    with in_process(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exc:  # argparse's errors, and commands that call sys.exit
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            if isinstance(exc.code, str):
                print(exc.code, file=err)
    return subprocess.CompletedProcess(["stagecast", *args], code, out.getvalue(), err.getvalue())
