"""What every service process shares at start-up: the READY line, the stop signal and flag helpers.

A service's ``cli.py`` builds its parser with these helpers and runs through ``run_service``::

    def main(args) -> int:
        return run_service("stage", lambda stop: serve(options_from(args), stop=stop))

``run_service`` sets SIGTERM/SIGINT to a stop event (services run as PID 1 in containers), and turns a
``ValueError`` or ``OSError`` raised while starting (a missing file, "address already in use") into one line on
stderr and exit status 2.  It installs ``stagecast.diagnostics`` (SIGUSR2 reports what the process holds), and
once ``serve`` has returned (spans flushed, peers released) the process exits at once: tearing down torch's and
gRPC's globals takes seconds on a busy machine and can hang in their destructors.
When a launcher started the process (``STAGECAST_PARENT_PID`` set), the process also dies with it.

The first SIGTERM always ends a service within ``STOP_DEADLINE_S`` (launchers wait 10 s before SIGKILL): a stop
before the READY line exits at once (nothing is served yet; start-up can block for minutes loading weights,
capturing graphs or waiting for a coordinator), and a shutdown that takes longer than the deadline (a drain waiting
on a GPU, an NCCL teardown) is cut short with one line naming where the main thread was.  Python runs signal
handlers only on the main thread between bytecodes, so none of this relies on one: the signal module's C handler
writes the signal to a wakeup pipe (``signal.set_wakeup_fd``) that a thread reads, and once stopping, a SIGALRM
with its default action ends the process even if no Python thread can run.
"""

from __future__ import annotations

import argparse
import contextlib
import contextvars
import ctypes
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from stagecast.flags import flag

READY_PREFIX = "STAGECAST_READY"
PARENT_PID_ENV = "STAGECAST_PARENT_PID"

logger = logging.getLogger(__name__)
_LOADED = time.monotonic()
STOP_DEADLINE_S = 8.0  # the most a service takes to exit after the first SIGTERM (launchers wait 10 s)
_STOP_SIGNALS = {0, signal.SIGTERM, signal.SIGINT}  # 0: written by the Python-level handler
_READY = threading.Event()  # the READY line is out: a stop from now on shuts down in order


def announce_ready(role: str | None = None, **info: object) -> None:
    """Print the line a launcher waits for: ``STAGECAST_READY [role] key=value ...`` (values without spaces)."""
    fields = [role] if role else []
    fields += [f"{key}={value}" for key, value in info.items()]
    _READY.set()  # first: a launcher may stop us the moment it reads the line, and that stop shuts down in order
    print_line(" ".join([READY_PREFIX, *fields]))


def print_line(line: str, file: TextIO | None = None) -> None:
    """Write ``line`` and its newline to ``file`` (stdout) in one write, then flush.

    ``print`` writes the text and its end separately; with ``PYTHONUNBUFFERED`` (launchers set it) each is its own
    write to the pipe, and a log line from another thread on stderr (the same pipe) can land between them: a READY
    line once read ``address=127.0.0.1:38165`` with the next line's date glued to the port.  One write of a line
    shorter than ``PIPE_BUF`` is never split.  A launcher's own lines (``stagecast up``'s summary, its children's
    echoed lines) go through here too: a summary line once read ``... 2 stages[gateway] ...`` in CI."""
    out = sys.stdout if file is None else file
    out.write(line + "\n")
    out.flush()


def process_age() -> float:
    """Seconds since this process started (from ``/proc/self/stat``; since this module loaded elsewhere)."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        start_ticks = int(fields[19])  # field 22 of proc(5): starttime, in clock ticks after boot
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.monotonic() - _LOADED


def die_with_parent() -> None:
    """If a launcher started this process, get SIGTERM when it exits (Linux ``PR_SET_PDEATHSIG``).

    The child sets this itself, after ``exec``, rather than in a ``preexec_fn``: a ``preexec_fn`` makes
    ``subprocess`` fork instead of spawn, and gRPC's fork handlers then abort a child of a process that has
    used gRPC (grpc/grpc#43055).  A parent that died before the call is caught by comparing the parent pid.
    """
    expected = os.environ.get(PARENT_PID_ENV)
    if not expected:
        return
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        return
    if str(os.getppid()) != expected:
        os.kill(os.getpid(), signal.SIGTERM)


from stagecast_client.cli import INTERRUPTED  # noqa: E402 - a command's status after Ctrl-C (128 + SIGINT)


def die_of_sigint() -> None:
    """End this process as killed by SIGINT, after flushing output (the Unix convention for an interrupted
    program, so a calling shell sees the interrupt); exit status 130 where the signal cannot be raised."""
    sys.stdout.flush()
    sys.stderr.flush()
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGINT)
    os._exit(INTERRUPTED)


def stop_event() -> threading.Event:
    """An event set by SIGTERM/SIGINT, so services shut down cleanly.

    Nothing here waits for the main thread.  Python's C-level handler writes each signal's number to a wakeup pipe
    at once, and a thread reading the pipe sets the event: a main thread blocked in a C call (a gRPC wait, a CUDA
    synchronize, an NCCL collective, a ``join``) does not delay the stop.  The Python handler writes a byte to the
    same pipe too (in case something else, e.g. an asyncio loop, takes the wakeup fd).  Neither sets the event
    itself: Python runs a handler in the main thread between two bytecodes, possibly inside ``Event.set`` or
    ``Event.wait`` with the event's lock held; a handler that set the event itself would then wait for that lock
    forever.  That happened: a second SIGTERM (a launcher sends one, then another while it waits, and the parent's
    death sends a third) arrived inside the first handler's ``Event.set``, and the gateway never exited."""
    stop = threading.Event()
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)

    def watch() -> None:
        while True:
            data = os.read(read_fd, 64)  # signal numbers; other handled signals (SIGUSR2) come through here too
            if not data:
                return
            if any(number in _STOP_SIGNALS for number in data):
                if not stop.is_set():
                    # Armed here, before the event wakes anyone: once set, the main thread may enter a shutdown
                    # that holds the GIL (a C call) before the deadline thread runs again; the alarm still fires.
                    signal.alarm(int(STOP_DEADLINE_S) + 1)
                stop.set()

    threading.Thread(target=watch, name="stop-signal", daemon=True).start()

    def handler(signum, frame):
        try:
            os.write(write_fd, b"\0")
        except BlockingIOError:
            pass  # the pipe is full of earlier signals: the stop is already on its way

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGALRM, signal.SIG_DFL)  # the last resort of ``_exit_when_stopped``
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    return stop


def _exit_when_stopped(name: str, stop: threading.Event, deadline: float = STOP_DEADLINE_S) -> None:
    """The stop's deadline (a thread of ``run_service``): exit at once when stopped before READY; else give the
    shutdown ``deadline`` seconds, then exit naming where the main thread was.  A SIGALRM one second later (armed by
    ``stop_event``'s reader as it sets the event) ends the process should no Python thread get to run (a C call
    holding the GIL)."""
    stop.wait()
    if not _READY.is_set():
        _exit_now(name, "stopped while starting: exiting now", 0)
    if threading.Event().wait(deadline):  # never set: this is the shutdown's time
        return
    frame, where = sys._current_frames().get(threading.main_thread().ident), []
    while frame is not None and len(where) < 3:  # innermost first: "wait (threading.py:327) < drain (...) < ..."
        where.append(f"{frame.f_code.co_name} ({Path(frame.f_code.co_filename).name}:{frame.f_lineno})")
        frame = frame.f_back
    stack = " < ".join(where) or "unknown"
    _exit_now(name, f"still shutting down {deadline:g} s after SIGTERM (main thread in {stack}): exiting now", 0)


def _exit_now(name: str, message: str, code: int) -> None:
    logger.warning("%s %s", name, message)
    for handler in logging.getLogger().handlers:
        try:
            handler.flush()
        except Exception:  # noqa: BLE001 - exiting regardless
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def csv_list(kind):
    """argparse type: a comma-separated list, e.g. ``cuda:0,cuda:1`` or ``4``."""

    def parse(text: str) -> list:
        try:
            return [kind(part.strip()) for part in text.split(",") if part.strip()]
        except ValueError:
            msg = f"expected a comma-separated list of {kind.__name__}, got {text!r}"
            raise argparse.ArgumentTypeError(msg) from None

    return parse


def add_security_flags(parser) -> None:
    """The deployment-credential flags every internal service shares: ``--mtls DIR`` / ``--insecure-internal``
    (``stagecast.security.mtls_from_flags`` turns them into the options' ``mtls``)."""
    from stagecast.security import add_mtls_flags

    add_mtls_flags(parser)


def metrics_host_flag() -> Any:
    """The ``--metrics-host`` field of a service's options (one declaration, every service's)."""
    return flag(help="address /metrics binds (default: --host)")


def health_port_flag() -> Any:
    """The ``--health-port`` field of an internal service's options: plaintext health for probes (0: off)."""
    return flag(
        0, help="plaintext port serving only grpc.health.v1, for probes that cannot present a certificate (0: off)"
    )


_IN_PROCESS = contextvars.ContextVar("stagecast_service_in_process", default=False)


@contextlib.contextmanager
def in_process():
    """Inside it, ``run_service`` returns its exit status instead of ending the process, and leaves signal handlers
    and diagnostics alone: a caller (a test of start-up refusals) runs a command's whole start-up path in its own
    process.  A service that did start would serve until killed, so use it only where start-up must fail."""
    token = _IN_PROCESS.set(True)
    try:
        yield
    finally:
        _IN_PROCESS.reset(token)


def run_service(name: str, serve: Callable[[threading.Event], None]) -> int:
    """Run ``serve(stop)`` until SIGTERM/SIGINT; a start-up error in the flags is one line and exit status 2.
    Does not return (the process exits with that status), except ``in_process()``."""
    from stagecast import diagnostics

    here = _IN_PROCESS.get()
    if not here:
        diagnostics.install()
    code = 0
    stop = threading.Event()
    if not here:
        stop = stop_event()
        threading.Thread(target=_exit_when_stopped, args=(name, stop), daemon=True, name="stop-deadline").start()
    try:
        serve(stop)
    except (ValueError, OSError) as exc:
        logger.debug("%s failed to start", name, exc_info=True)
        print(f"stagecast {name}: error: {exc}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:  # Ctrl-C before the stop event was set up
        code = INTERRUPTED
    if here:
        return code
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# Each service's own entry point: its role -> (the module ``python -m`` runs, the module and function that add its
# parser).  ``stagecast <role>`` stays the user-facing spelling (``launcher.cli``); a launcher starts each service as
# itself (``python -m coordinator``), so no service process imports the launcher.
SERVICE_MODULES: dict[str, tuple[str, str, str]] = {
    "coordinator": ("coordinator", "coordinator.cli", "add_parser"),
    "stage": ("stage_service", "stage_service.cli", "add_parser"),
    "gateway": ("gateway", "gateway.cli", "add_parser"),
    "vae-stage": ("gateway.decode.vae_stage", "gateway.cli", "add_vae_stage_parser"),
    "web": ("web", "web.cli", "add_parser"),
}


def run_command(command: str, module: str, function: str, argv: list[str]) -> int:
    """Parse ``argv`` with the parser ``module.function(sub)`` adds for ``command`` and run it: what
    ``stagecast <command> ...`` and ``python -m <service> ...`` both do.  Returns the command's exit status
    (``INTERRUPTED`` after a second Ctrl-C)."""
    import importlib

    from stagecast.log import setup_logging

    parser = argparse.ArgumentParser(prog="stagecast", formatter_class=argparse.RawTextHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    getattr(importlib.import_module(module), function)(sub)
    args = parser.parse_args([command, *argv])
    setup_logging()
    try:
        return args.run(args)
    except KeyboardInterrupt:
        # A second Ctrl-C (the first one stops gracefully where a command supports it) ends without a traceback.
        print(f"\nstagecast {command}: interrupted", file=sys.stderr)
        return INTERRUPTED


def service_main(role: str) -> None:
    """``python -m <service>``: the service ``role`` (a ``SERVICE_MODULES`` key) with this process's arguments; ends
    the process with its status (killed by SIGINT after a second Ctrl-C, as shells expect)."""
    die_with_parent()
    _, module, function = SERVICE_MODULES[role]
    code = run_command(role, module, function, sys.argv[1:])
    if code == INTERRUPTED:
        die_of_sigint()
    sys.exit(code)


def resolve_transformer(path: str) -> str:
    """A checkpoint root holding ``transformer/``, or the transformer folder itself (or ``random:...``)."""
    from stagecast.model.config import RANDOM_PREFIX

    if path.startswith(RANDOM_PREFIX):
        return path
    sub = os.path.join(path, "transformer")
    return sub if os.path.isdir(sub) else path


def serve_lifecycle(
    component: str,
    start: Callable[[], dict],
    shutdown: Callable[[], None],
    stop: threading.Event | None = None,
    *,
    role: str | None = None,
    attributes: dict | None = None,
) -> None:
    """The one lifecycle of every service: tracing on, ``start()`` (its READY fields), the READY line, serve until
    ``stop``, then ``shutdown()`` and flush the queued spans, also when starting failed half-way.

    ``stop`` None serves until the process is killed (tests pass their own event)."""
    from stagecast import telemetry

    telemetry.init(component, attributes)
    try:
        announce_ready(role, **start())
        (stop or threading.Event()).wait()
    finally:
        try:
            shutdown()
        finally:
            telemetry.shutdown()  # flush queued spans before the process ends
