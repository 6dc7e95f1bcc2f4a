"""Services start as themselves: ``python -m coordinator`` (and stage_service, gateway, web, gateway.decode.vae_stage)
is
the same command as ``stagecast <role>``, and a service process the launcher starts never imports the launcher."""

from __future__ import annotations

import os
import subprocess
import sys
from unittest.mock import ANY

import pytest

from launcher.process import module_args
from stagecast.service import READY_PREFIX, SERVICE_MODULES
from stagecast.startup import STARTUP_PREFIX, StartupStep, parse_line

pytestmark = pytest.mark.multiprocess


def launcher_modules(importtime_log: str) -> list[str]:
    """The modules of the ``launcher`` package in a ``-X importtime`` log (its last column is the module name)."""
    names = [line.rsplit("|", 1)[-1].strip() for line in importtime_log.splitlines() if line.startswith("import time:")]
    return [name for name in names if name == "launcher" or name.startswith("launcher.")]


def test_the_check_sees_a_launcher_import():
    log = "import time:       339 |        339 |   launcher.process\nimport time: 1 | 1 | accelerate.launchers\n"
    assert launcher_modules(log) == ["launcher.process"]


@pytest.mark.parametrize("role", sorted(SERVICE_MODULES))
def test_python_m_service_help_is_the_stagecast_role_and_imports_no_launcher(role):
    module = SERVICE_MODULES[role][0]
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", module, "--help"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith(f"usage: stagecast {role} "), proc.stdout[:200]
    assert launcher_modules(proc.stderr) == []


def test_a_launcher_starts_services_as_themselves_and_other_commands_through_its_cli():
    assert module_args(["coordinator", "--stages", "1"]) == ["coordinator", "--stages", "1"]
    assert module_args(["vae-stage", "--index", "0"]) == ["gateway.decode.vae_stage", "--index", "0"]
    assert module_args(["selftest", "--stages", "1"]) == ["launcher.cli", "selftest", "--stages", "1"]


def test_no_running_service_process_imports_the_launcher(shared_system):
    """The shared system's children run with an import watch (tests/shared_system.py): every one of them armed it,
    each runs as its own module, and none has tried to import the launcher (the check repeats after every test that
    uses the system, in ``assert_idle``)."""
    armed, imports = shared_system.launcher_imports()
    for name, child in shared_system.children.items():
        assert child.proc.args[1] == "-m" and not child.proc.args[2].startswith("launcher"), (name, child.proc.args)
        assert child.pid in armed, f"{name}: its import watch never ran"
    assert imports == []


def unbuffered_lines(script: str, count: int) -> list[str]:
    """The lines ``script`` (given ``count``) writes, stdout and stderr on one pipe, run unbuffered as a launcher runs
    its services."""
    proc = subprocess.run(
        [sys.executable, "-c", script, str(count)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-2000:]
    return proc.stdout.splitlines()


CHATTY_CHILD = r"""
import logging, sys, threading
from stagecast.service import announce_ready
from stagecast.startup import Startup
logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")  # stderr: the launcher's pipe too
stop = threading.Event()
def chatter():
    while not stop.is_set():
        logging.info("another thread logs")
threading.Thread(target=chatter, daemon=True).start()
startup = Startup("gateway")
for i in range(int(sys.argv[1])):
    announce_ready("gateway", address=f"127.0.0.1:{i}")
    startup.step("weights", i, 1000)
stop.set()
"""


def test_ready_and_startup_lines_stay_whole_while_another_thread_logs_to_the_same_pipe():
    """A launcher runs services unbuffered with stderr on stdout's pipe; a READY line split by a log line once gave a
    test the address ``127.0.0.1:381652026-12-05`` (``print`` writes the text and its newline separately)."""
    count = 500
    lines = unbuffered_lines(CHATTY_CHILD, count)
    ready = [line for line in lines if line.startswith(READY_PREFIX)]
    steps = [line for line in lines if line.startswith(STARTUP_PREFIX)]
    assert ready == [f"{READY_PREFIX} gateway address=127.0.0.1:{i}" for i in range(count)]
    assert [parse_line(line) for line in steps] == [StartupStep("weights", i, 1000, ANY, "") for i in range(count)]


CHATTY_LAUNCHER = r"""
import sys, threading
from launcher.startup_view import StartupView
from stagecast.service import print_line
stop = threading.Event()
view = StartupView(tty=False)
def echo():  # what a launcher's pump threads write: children's lines and their READY times, on stderr
    while not stop.is_set():
        print_line("[stage-0] a child's log line", sys.stderr)
        view.ready("gateway", 1.5)
threading.Thread(target=echo, daemon=True).start()
for i in range(int(sys.argv[1])):
    print_line(f"stagecast is up in {i}.0 s: 2 stages")
stop.set()
"""


def test_a_launchers_summary_stays_whole_while_its_children_are_echoed_to_the_same_pipe():
    """``stagecast up`` echoes its children (stderr) while it prints its summary (stdout), both on a test's one pipe:
    with ``print`` a summary line once read ``stagecast is up in 3.1 s: 2 stages[gateway] ...`` in CI."""
    count = 3000
    lines = unbuffered_lines(CHATTY_LAUNCHER, count)
    assert [line for line in lines if line.startswith("stagecast")] == [
        f"stagecast is up in {i}.0 s: 2 stages" for i in range(count)
    ]
    assert set(lines) - {f"stagecast is up in {i}.0 s: 2 stages" for i in range(count)} <= {
        "[stage-0] a child's log line",
        "[gateway] READY in 1.50 s",
    }
