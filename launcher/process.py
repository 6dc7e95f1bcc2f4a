"""Start and stop stagecast service processes on this machine (``stagecast up``, selftest, demo, tests).

Usage::

    with Launcher() as launcher:
        coord = launcher.spawn("coordinator", ["coordinator", "--stages", "2", "--port", "0"])
        coord.info["address"]                          # parsed from the child's STAGECAST_READY line
        launcher.spawn("stage-0", ["stage", "--index", "0", "--coordinator", coord.info["address"], ...])
    # leaving the block: SIGTERM to every child, SIGKILL after a grace period

Each child prints one ``STAGECAST_READY key=value ...`` line once it serves; ``spawn`` blocks on that
line (no polling); ``start`` + ``wait_ready`` start several children at once.  Before it, a child prints its start-up
steps (``STAGECAST_STARTUP ...``, ``stagecast.startup``), kept in ``child.startup`` and shown by
``Launcher(startup=StartupView())`` (``launcher.startup_view``) with its READY time.  Children get
PR_SET_PDEATHSIG (set by the child itself, ``stagecast.service.die_with_parent``), so they die with the
launcher even if it is killed with SIGKILL: no orphans.

``Supervisor`` keeps children up (``stagecast up``)::

    sup = Supervisor(launcher, stop)                 # stop: a threading.Event (SIGTERM / Ctrl-C)
    sup.watch(coord, args)                           # restart with ``args`` when it dies, with backoff
    sup.watch(stage, args, health="stage")           # also when its health fails for ``hang_s`` (stopped, hung)
    failure = sup.wait()                             # None once ``stop`` is set; else why it gave up

Local clusters are authenticated with no set-up: the launcher makes a throwaway deployment CA and one certificate
per role in a private temporary folder (``stagecast.security.write_deployment``), hands each service child its
role's folder (``$STAGECAST_MTLS``), keeps an ``operator`` certificate for its own clients
(``launcher.channel(address, "coordinator")``), and deletes the folder when it exits.  ``Launcher(mtls=False)``
runs the services with ``--insecure-internal`` instead.  A launcher killed with SIGKILL cannot delete it, so the
folder names its owner (``owner.json``: pid, the pid's start time and pid namespace) and ``remove_stale_credentials()``
(``stagecast up`` calls it at start) deletes the folders whose owner is gone::

    removed = remove_stale_credentials()     # [paths] of this user's throwaway folders whose launcher died
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from launcher.forkserver import ForkedProcess, ForkServer
from launcher.startup_view import StartupView
from stagecast.diagnostics import STACK_CACHE_OFF
from stagecast.grpc_util import CHANNEL_OPTIONS
from stagecast.security import MTLS, MTLS_ENV, connect, write_deployment
from stagecast.service import PARENT_PID_ENV, READY_PREFIX, SERVICE_MODULES, print_line
from stagecast.startup import STARTUP_PREFIX, StartupStep, parse_line

# The certificate each service command runs with.
SERVICE_ROLES = {"coordinator": "coordinator", "stage": "stage", "gateway": "gateway", "vae-stage": "vae-stage"}

logger = logging.getLogger(__name__)

CREDENTIALS_PREFIX = "stagecast-mtls-"  # the throwaway folders, in the temporary directory
OWNER_FILE = "owner.json"


def _process_identity(pid: int) -> tuple[str, str] | None:
    """(start time in clock ticks since boot, pid namespace) of a live process of ours; None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        namespace = os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": state is field 3, starttime field 22
    return fields[19], namespace


def _write_owner(folder: str) -> None:
    identity = _process_identity(os.getpid())
    start, namespace = identity if identity is not None else ("", "")
    Path(folder, OWNER_FILE).write_text(json.dumps({"pid": os.getpid(), "start": start, "pidns": namespace}))


def _owner_gone(folder: Path) -> bool:
    """True only when the folder's owner is known and dead: a folder without an owner file (another program's, or
    one being made), or whose owner lives in another pid namespace (we cannot see it), is kept."""
    try:
        owner = json.loads((folder / OWNER_FILE).read_text())
        pid, start, namespace = int(owner["pid"]), str(owner["start"]), str(owner["pidns"])
    except (OSError, ValueError, KeyError, TypeError):
        return False
    mine = _process_identity(os.getpid())
    if mine is None or namespace != mine[1]:
        return False
    now = _process_identity(pid)
    return now is None or now[0] != start  # dead, or the pid was reused by a later process


def remove_stale_credentials(tmp: str | os.PathLike | None = None) -> list[Path]:
    """Delete this user's throwaway credential folders whose launcher is dead (SIGKILLed: it could not clean up)."""
    removed = []
    for folder in sorted(Path(tmp or tempfile.gettempdir()).glob(f"{CREDENTIALS_PREFIX}*")):
        try:
            if folder.is_symlink() or not folder.is_dir() or folder.stat().st_uid != os.getuid():
                continue
        except OSError:
            continue
        if _owner_gone(folder):
            shutil.rmtree(folder, ignore_errors=True)
            if not folder.exists():
                removed.append(folder)
    return removed


def module_args(args: list[str]) -> list[str]:
    """A child's ``python -m`` arguments: a service starts as itself (``coordinator --stages 2``: its package's
    ``__main__``, ``stagecast.service.SERVICE_MODULES``), so no service process imports the launcher; any other
    command runs through ``launcher.cli``."""
    if args and args[0] in SERVICE_MODULES:
        return [SERVICE_MODULES[args[0]][0], *args[1:]]
    return ["launcher.cli", *args]


@dataclass
class Child:
    name: str
    proc: subprocess.Popen | ForkedProcess
    info: dict[str, str] = field(default_factory=dict)
    log: list[str] = field(default_factory=list)
    ready: threading.Event | None = None
    startup: list[StartupStep] = field(default_factory=list)  # its STAGECAST_STARTUP lines, as printed
    started: float = field(default_factory=time.monotonic)  # when the launcher started it

    def ready_s(self) -> float:
        """Seconds from its start to READY: as it said (its "ready" step), else as the launcher saw it."""
        said = next((s.at_s for s in reversed(self.startup) if s.name == "ready"), None)
        return said if said is not None else time.monotonic() - self.started

    @property
    def pid(self) -> int:
        return self.proc.pid


class LaunchError(RuntimeError):
    pass


FORKSERVER_ENV = "STAGECAST_FORKSERVER"  # "1": a Launcher forks its service children from a fork server
# Launcher(forkserver=None) reads this: the environment's choice, or an embedding program's (the test suite's).
DEFAULT_FORKSERVER = os.environ.get(FORKSERVER_ENV) == "1"
_forkservers: dict[tuple, ForkServer] = {}
_forkserver_lock = threading.Lock()


def _startup_env(env: dict[str, str]) -> tuple:
    """What of an environment acts when an interpreter starts or imports (its path, site hooks, thread pools,
    allocator): children whose environments differ here need fork servers of their own."""
    keys = [k for k in env if k.startswith(("PYTHON", "LD_", "MALLOC_")) or k.endswith("_NUM_THREADS")]
    return tuple(sorted((k, env[k]) for k in [*keys, "GLIBC_TUNABLES"] if k in env))


def shared_forkserver(env: dict[str, str]) -> ForkServer:
    """This process's fork server (``launcher.forkserver``) for children of ``env``'s start-up environment, started on
    first use, ended at exit."""
    key = _startup_env(env)
    with _forkserver_lock:
        server = _forkservers.get(key)
        if server is None or server.proc.poll() is not None:
            server = _forkservers[key] = ForkServer(env)
            atexit.register(server.close)
        return server


class Launcher:
    def __init__(
        self,
        env: dict[str, str] | None = None,
        echo: bool = False,
        mtls: bool = True,
        credentials: str | None = None,
        forkserver: bool | None = None,
        prefix: str = "",
        startup: StartupView | None = None,
    ):
        """``credentials``: an existing deployment folder (``ca.crt`` and one folder per role, as
        ``write_deployment`` makes) to use instead of a throwaway one; it is left in place.  ``forkserver``: fork the
        children from this process's fork server (``launcher.forkserver``: the heavy imports done once) instead of
        starting each interpreter afresh; default ``DEFAULT_FORKSERVER`` (``$STAGECAST_FORKSERVER`` == "1").  A child
        started with a ``prefix`` (a command that execs it) always starts afresh.  ``startup``: where the children's
        start-up steps and READY times are shown (with ``echo``, their other lines are echoed beside them)."""
        self.forkserver = DEFAULT_FORKSERVER if forkserver is None else forkserver
        self.prefix = prefix  # before every child's name ("p0/" in a fleet: "p0/gateway")
        self.children: list[Child] = []
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.env.pop(FORKSERVER_ENV, None)  # how this launcher starts its children is its own: not passed down
        # Stacks of exited threads are unmapped rather than cached (stagecast.diagnostics says why).
        self.env.setdefault("GLIBC_TUNABLES", STACK_CACHE_OFF)
        # A child's output is a pipe read line by line: no progress bars in it (tqdm's, the Hub's "Loading weights");
        # its start-up steps are lines (stagecast.startup), and a view here draws bars where there is a terminal.
        self.env.setdefault("TQDM_DISABLE", "1")
        self.env.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        self.echo = echo
        self.startup_view = startup
        self.secure = mtls
        self._credentials: str | None = credentials
        self._owns_credentials = credentials is None
        self._operator: MTLS | None = None
        self._spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="launcher")

    # ---- credentials ----------------------------------------------------------------------------------------

    @property
    def credentials(self) -> str | None:
        """The folder of this launcher's throwaway deployment CA and role certificates (made on first use)."""
        if self.secure and self._credentials is None:
            folder = tempfile.mkdtemp(prefix=CREDENTIALS_PREFIX)  # 0700
            _write_owner(folder)  # first: a folder whose owner dies while it is written is still found stale
            write_deployment(folder)
            self._credentials = folder
            self._owns_credentials = True
        return self._credentials

    def mtls(self, role: str = "operator") -> MTLS | None:
        """Credentials of ``role`` (None when the services run without mTLS)."""
        if not self.secure:
            return None
        if role == "operator":
            if self._operator is None:
                self._operator = MTLS.load(os.path.join(self.credentials, "operator"))
            return self._operator
        return MTLS.load(os.path.join(self.credentials, role))

    def channel(self, target: str, peer: str, options=CHANNEL_OPTIONS) -> grpc.Channel:
        """An operator's channel to the internal service ``peer`` (``coordinator``, ``stage``, ``vae-stage``)."""
        return connect(target, self.mtls(), peer, options)

    def _service_env(self, args: list[str]) -> dict[str, str]:
        role = SERVICE_ROLES.get(args[0]) if args else None
        if role is None or "--mtls" in args or "--insecure-internal" in args:
            return {}
        if not self.secure:
            args.append("--insecure-internal")
            return {}
        return {MTLS_ENV: os.path.join(self.credentials, role)}

    def start(self, name: str, args: list[str], prefix: Sequence[str] = ()) -> Child:
        """Start a child without waiting for it; pair with ``wait_ready`` (lets several start at once).  ``prefix``
        runs it through a command that ``exec``s it, e.g. ``["ip", "netns", "exec", "ns1"]``."""
        args = list(args)
        extra = self._service_env(args)
        if self.forkserver and not prefix:
            server = shared_forkserver(self.env)
            # The child's parent is the fork server, which ends when this process does.
            env = {**self.env, **extra, PARENT_PID_ENV: str(server.proc.pid)}
            return self._track(name, server.spawn(module_args(args), env))
        # PR_SET_PDEATHSIG fires when the *thread* that forked the child exits, so every child is forked from
        # the launcher's own long-lived thread, whichever thread calls start().
        proc = self._spawner.submit(
            subprocess.Popen,
            [*prefix, sys.executable, "-m", *module_args(args)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            # No preexec_fn: it would make subprocess fork rather than spawn, and gRPC's fork handlers abort
            # such a child (grpc/grpc#43055).  The child sets PR_SET_PDEATHSIG itself (die_with_parent).
            env={**self.env, **extra, PARENT_PID_ENV: str(os.getpid())},
        ).result()
        return self._track(name, proc)

    def _track(self, name: str, proc: subprocess.Popen | ForkedProcess) -> Child:
        """Keep ``proc`` as a child, its output read line by line until its READY line (``wait_ready``)."""
        if not name.startswith(self.prefix):
            name = self.prefix + name
        child = Child(name, proc)
        self.children.append(child)
        ready = threading.Event()
        child.ready = ready

        def pump() -> None:
            assert proc.stdout is not None
            view = self.startup_view
            for line in proc.stdout:
                line = line.rstrip("\n")
                child.log.append(line)
                del child.log[:-200]
                step = parse_line(line) if line.startswith(STARTUP_PREFIX) else None
                if step is not None:
                    child.startup.append(step)
                    del child.startup[:-200]
                if line.startswith(READY_PREFIX) and not ready.is_set():
                    child.info = dict(kv.split("=", 1) for kv in line.split()[1:] if "=" in kv)
                    if view is not None:
                        view.ready(name, child.ready_s())
                    ready.set()
                elif step is not None and view is not None:
                    view.step(name, step)
                elif self.echo:
                    print_line(f"[{name}] {line}", sys.stderr)
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

    def spawn(self, name: str, args: list[str], timeout: float = 300.0, prefix: Sequence[str] = ()) -> Child:
        return self.wait_ready(self.start(name, args, prefix), timeout)

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
        if self._credentials is not None and self._owns_credentials:
            shutil.rmtree(self._credentials, ignore_errors=True)
            self._credentials = None
            self._operator = None


def describe_exit(code: int | None) -> str:
    if code is None:
        return "is running"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


HANG_S = 15.0  # a watched service whose health checks fail this long is killed and restarted
PROBE_S = 1.0


class Supervisor:
    """Restart watched children that die, with exponential backoff; give up when one dies more than
    ``max_restarts`` times within ``window`` seconds, or cannot be started again, naming it."""

    def __init__(
        self,
        launcher: Launcher,
        stop: threading.Event,
        *,
        max_restarts: int = 5,
        window: float = 600.0,
        backoff: tuple[float, float] = (0.5, 10.0),
        ready_timeout: float = 300.0,
        hang_s: float = HANG_S,
        command: str = "stagecast up",
    ):
        """``command``: the program whose name starts each line it prints (``stagecast demo --serve`` too)."""
        self.command = command
        self.launcher = launcher
        self.stop = stop
        self.max_restarts = max_restarts
        self.window = window
        self.backoff = backoff
        self.ready_timeout = ready_timeout
        if not 1.0 <= hang_s <= 3600.0:
            raise ValueError(f"--stage-hang-s must be in [1, 3600], got {hang_s}")
        self.hang_s = hang_s
        self.failure: str | None = None
        self.restarts: dict[str, int] = {}
        # A fleet's hooks (launcher.fleet): a restarted child (the state file), a child that stopped rather than died
        self.on_restart: Callable[[Child], None] | None = None
        self.on_stop: Callable[[Child], None] | None = None
        self.clean_exit_stops = False  # exit code 0 is a stop (a drained gateway, a SIGTERMed service): no restart
        self.retired: set[str] = set()
        self.launcher_of: dict[str, Launcher] = {}
        self._threads: list[threading.Thread] = []

    def watch(self, child: Child, args: list[str], health: str | None = None, launcher: Launcher | None = None) -> None:
        """Restart ``child`` with ``args`` when it dies; with ``health`` (the role its certificate holds), also kill it,
        and so restart it, once its grpc.health.v1 ``""`` has failed for ``hang_s`` (a stopped or hung process).
        ``launcher``: the one that started it (default: the supervisor's), which starts it again."""
        thread = threading.Thread(
            target=self._watch,
            args=(child, args, health, launcher or self.launcher),
            daemon=True,
            name=f"watch-{child.name}",
        )
        self._threads.append(thread)
        thread.start()

    def wait(self) -> str | None:
        """Block until ``stop`` is set (SIGTERM, or the supervisor gave up); returns why it gave up, or None."""
        self.stop.wait()
        return self.failure

    def _give_up(self, message: str) -> None:
        if self.failure is None:
            self.failure = message
        self.stop.set()

    def retire(self, child: Child) -> None:
        """Stop watching ``child`` (by name) and stop it: it is not started again."""
        self.retired.add(child.name)
        self.launcher_of.get(child.name, self.launcher).stop(child)

    def _stopped(self, child: Child, code: int | None) -> bool:
        """True when ``child``'s exit is a stop, not a crash: it was retired, or ``clean_exit_stops`` and it exited 0
        (a service exits 0 only when stopped: SIGTERM, or a drain's end); then ``on_stop(child)`` runs once."""
        if child.name in self.retired:
            return True
        if not (self.clean_exit_stops and code == 0):
            return False
        self.retired.add(child.name)
        print_line(f"{self.command}: {child.name} stopped (exit code 0): not restarting it", sys.stderr)
        if self.on_stop is not None:
            self.on_stop(child)
        return True

    def _watch(self, child: Child, args: list[str], health: str | None, launcher: Launcher) -> None:
        name = child.name
        self.launcher_of[name] = launcher
        deaths: deque[float] = deque()
        while True:
            if health is not None:
                threading.Thread(target=self._probe, args=(child, health), daemon=True, name=f"probe-{name}").start()
            code = child.proc.wait()  # also reaps it: no zombie
            if self.stop.is_set() or self._stopped(child, code):
                return
            now = time.monotonic()
            deaths.append(now)
            while deaths and deaths[0] < now - self.window:
                deaths.popleft()
            what = f"{name} {describe_exit(code)}"
            if len(deaths) > self.max_restarts:
                tail = "\n".join(child.log[-10:])
                self._give_up(f"{what}; it died {len(deaths)} times in {self.window:.0f} s, giving up\n{tail}")
                return
            delay = min(self.backoff[1], self.backoff[0] * 2 ** (len(deaths) - 1))
            logger.warning("%s; restarting it in %.1f s", what, delay)
            print_line(f"{self.command}: {what}; restarting it in {delay:.1f} s", sys.stderr)
            if self.stop.wait(delay):
                return
            try:
                child = launcher.wait_ready(launcher.start(name, args), self.ready_timeout)
            except LaunchError as exc:
                self._give_up(f"{what} and could not be restarted: {exc}")
                return
            self.restarts[name] = self.restarts.get(name, 0) + 1
            print_line(f"{self.command}: {name} restarted (pid {child.pid})", sys.stderr)
            if self.on_restart is not None:
                self.on_restart(child)

    def _probe(self, child: Child, role: str) -> None:
        """Check the child's health every ``PROBE_S`` until it exits; kill it once the checks have failed for
        ``hang_s`` in a row (a SIGSTOPped process answers nothing; a hung stage reports NOT_SERVING)."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        address = child.info.get("address")
        if not address:
            return
        failing_since: float | None = None
        with self.launcher.channel(address, role) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while child.proc.poll() is None and not self.stop.wait(PROBE_S):
                try:
                    reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=PROBE_S)
                    ok = reply.status == health_pb2.HealthCheckResponse.SERVING
                except grpc.RpcError:
                    ok = False
                now = time.monotonic()
                if ok:
                    failing_since = None
                    continue
                failing_since = now if failing_since is None else failing_since
                if now - failing_since >= self.hang_s and child.proc.poll() is None:
                    what = f"{child.name} failed its health checks for {self.hang_s:g} s; killing it"
                    logger.warning("%s", what)
                    print_line(f"{self.command}: {what}", sys.stderr)
                    child.proc.kill()  # works on a stopped process too; the watch then restarts it
                    return
