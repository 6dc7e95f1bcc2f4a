"""A fork server: one process that has imported the heavy libraries once and forks each service child from there.

A service process spends seconds importing torch and diffusers before it runs a line of its own (a stage about 4
CPU-seconds), and a launcher that restarts a dead stage, or a test suite that starts hundreds of services, pays it
every time.  ``Launcher(forkserver=True)`` (``$STAGECAST_FORKSERVER=1``) starts children from here instead::

    server = ForkServer(env)                                  # `python -m launcher.forkserver`, imports PRELOAD
    proc = server.spawn(["coordinator.__main__", "--port", "0"], env)   # the module `python -m` would run, args
    proc.stdout.readline(); proc.send_signal(signal.SIGTERM); proc.wait(10)  # a ``subprocess.Popen``'s surface
    server.close()

How it stays safe to fork: the server imports only third-party libraries (``PRELOAD``: nothing of ours, so a child
runs the code on disk now), never runs a tensor op, never makes a gRPC object or a thread, and forks from its one
thread.  A child resets the server's signal handlers, closes the server's descriptors, takes the environment,
working directory and output pipe it was sent, and runs its module as ``python -m`` would (``runpy``), then exits
through the interpreter's normal shutdown.  The server reaps each child and writes its wait status to a pipe only
the caller holds, so ``wait`` and ``poll`` read it without the caller being the parent; signals go to the pid.  A
child's parent is the server: ``die_with_parent`` (``stagecast.service``) ties it to the server, and the server
ends when its caller does (its stdin closes), so no child outlives the caller.

The test suite's launchers use it by default (``tests/conftest.py`` sets ``launcher.process.DEFAULT_FORKSERVER``);
``STAGECAST_TEST_FORKSERVER=0`` starts each test's children afresh, as ``stagecast up`` does by default.
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import runpy
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading

# Imported once by the server, shared by every child (each child imports our own modules itself).
PRELOAD = ("numpy", "torch", "diffusers.models.transformers.transformer_wan", "safetensors.torch")
MAX_REQUEST = 1 << 20
STATUS = struct.Struct("=i")  # os.waitpid's status, as the server writes it to a child's status pipe


class ForkServerError(RuntimeError):
    pass


class ForkedProcess:
    """A child of the fork server, as much of ``subprocess.Popen`` as a launcher uses: ``pid``, ``stdout`` (text,
    stdout and stderr together), ``poll``, ``wait``, ``send_signal``, ``terminate``, ``kill``, ``returncode``."""

    def __init__(self, pid: int, argv: list[str], stdout_fd: int, status_fd: int):
        self.pid = pid
        self.args = [sys.executable, "-m", *argv]  # the command it runs as, as Popen.args holds it
        self.stdout = os.fdopen(stdout_fd, "r", encoding="utf-8", errors="replace")
        self._status_fd = status_fd
        self._lock = threading.Lock()
        self.returncode: int | None = None

    def _read_status(self, timeout: float | None) -> int | None:
        with self._lock:
            if self.returncode is not None:
                return self.returncode
            ready, _, _ = select.select([self._status_fd], [], [], timeout)
            if not ready:
                return None
            data = os.read(self._status_fd, STATUS.size)
            os.close(self._status_fd)
            if len(data) != STATUS.size:  # the server died before reaping it: the child died with it
                self.returncode = -signal.SIGTERM
            else:
                self.returncode = os.waitstatus_to_exitcode(STATUS.unpack(data)[0])
            return self.returncode

    def poll(self) -> int | None:
        return self._read_status(0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._read_status(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """The caller's end: starts the server and asks it for children (thread-safe)."""

    def __init__(self, env: dict[str, str], timeout: float = 120.0):
        self._dir = tempfile.mkdtemp(prefix="stagecast-fork-")
        self.path = os.path.join(self._dir, "sock")
        self._lock = threading.Lock()
        here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "launcher.forkserver", self.path],
            stdin=subprocess.PIPE,  # the server ends when this closes: when its caller exits, however it exits
            stdout=subprocess.PIPE,
            env=env,
            cwd=here,  # `-m launcher.forkserver` finds this checkout's package; a child's sys.path[0] is its own cwd
        )
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else b""
        if line.strip() != b"READY":
            self.close()
            raise ForkServerError(f"the fork server did not start (exit code {self.proc.poll()})")

    def spawn(self, argv: list[str], env: dict[str, str], cwd: str | None = None) -> ForkedProcess:
        """A child running ``python -m argv[0] argv[1:]`` with ``env`` and ``cwd``."""
        out_r, out_w = os.pipe()
        status_r, status_w = os.pipe()
        request = json.dumps({"argv": argv, "env": env, "cwd": cwd or os.getcwd()}).encode()
        try:
            with self._lock, socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                conn.connect(self.path)
                socket.send_fds(conn, [struct.pack("=I", len(request)) + request], [out_w, status_w])
                reply = conn.recv(64)
        finally:
            os.close(out_w)
            os.close(status_w)
        if not reply.startswith(b"pid "):
            os.close(out_r)
            os.close(status_r)
            raise ForkServerError(f"the fork server refused to start {argv[:1]}: {reply!r}")
        return ForkedProcess(int(reply.split()[1]), argv, out_r, status_r)

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        try:
            os.unlink(self.path)
        except OSError:
            pass
        try:
            os.rmdir(self._dir)
        except OSError:
            pass


# ---- the server ----------------------------------------------------------------------------------------------


def _recv_request(conn: socket.socket) -> tuple[dict, list[int]]:
    data, fds, _flags, _addr = socket.recv_fds(conn, MAX_REQUEST + 4, 2)
    if len(data) < 4:
        raise ValueError("short request")
    (size,) = struct.unpack("=I", data[:4])
    while len(data) < 4 + size:
        more = conn.recv(4 + size - len(data))
        if not more:
            raise ValueError("truncated request")
        data += more
    if len(fds) != 2:
        raise ValueError(f"expected 2 descriptors, got {len(fds)}")
    return json.loads(data[4 : 4 + size]), list(fds)


def _reap(children: dict[int, int]) -> None:
    """Reap whatever child ended, and tell its caller its status on the child's status pipe."""
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        fd = children.pop(pid, None)
        if fd is not None:
            try:
                os.write(fd, STATUS.pack(status))
            except OSError:
                pass
            os.close(fd)


def _terminate(children: dict[int, int]) -> None:
    for pid in children:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass


def _become_child(out_w: int, server_fds: list[int]) -> None:
    """In a forked child: none of the server's descriptors, handlers or pipes; stdin from /dev/null, stdout and
    stderr to the caller's pipe."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for fd in server_fds:
        try:
            os.close(fd)
        except OSError:
            pass
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(out_w, 1)
    os.dup2(out_w, 2)
    os.close(out_w)


def serve(path: str) -> dict | None:
    """The server's loop; returns in a child (its request), or None when the caller has gone."""
    for name in PRELOAD:
        importlib.import_module(name)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children: dict[int, int] = {}  # pid -> its status pipe
    sys.stdout.write("READY\n")
    sys.stdout.flush()
    stdin = sys.stdin.fileno()
    while True:
        try:
            ready, _, _ = select.select([listener, wake_r, stdin], [], [])
        except InterruptedError:
            continue
        if wake_r in ready:
            os.read(wake_r, 4096)
        _reap(children)
        if stdin in ready and not os.read(stdin, 4096):
            _terminate(children)  # the caller has gone: so do its children
            return None
        if listener not in ready:
            continue
        conn, _ = listener.accept()
        with conn:
            try:
                request, (out_w, status_w) = _recv_request(conn)
            except (OSError, ValueError) as exc:
                conn.sendall(f"error {exc}".encode()[:64])
                continue
            pid = os.fork()
            if pid == 0:
                listener.close()
                _become_child(out_w, [wake_r, wake_w, status_w, *children.values()])
                return request
            os.close(out_w)
            children[pid] = status_w
            conn.sendall(f"pid {pid}".encode())


def run_child(request: dict) -> None:
    """Run the child's module as ``python -m`` would, with its environment and working directory.  It exits as
    ``python -m`` does (non-daemon threads joined, then the atexit handlers), less the teardown of every module the
    server imported, which would take a second for nothing."""
    os.chdir(request["cwd"])
    sys.path[0] = os.getcwd()  # as `python -m` starts: the working directory first
    os.environ.clear()
    os.environ.update(request["env"])
    argv = sys.argv = list(request["argv"])  # runpy makes argv[0] the module's path, as `python -m` does
    # What `python -m` would have been started with: a process that restarts itself (os.execv of sys.orig_argv, as
    # a stage does after a reset while busy) runs its own command again, from a fresh interpreter.
    sys.orig_argv = [sys.executable, "-m", *argv]
    status = [0]

    def leave() -> None:  # registered first, so it runs after every handler the child registers
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(status[0])

    atexit.register(leave)
    try:
        runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        # sys.exit("message"): the interpreter prints the message on its way out, and the status is 1.
        status[0] = (exc.code or 0) if exc.code is None or isinstance(exc.code, int) else 1
        raise
    except BaseException:
        status[0] = 1
        raise


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit("usage: python -m launcher.forkserver SOCKET")
    request = serve(sys.argv[1])
    if request is None:
        return
    # A child: its own process from here.  Our own package is imported afresh by whatever the child runs.
    for name in [m for m in sys.modules if m == "launcher" or m.startswith("launcher.")]:
        del sys.modules[name]
    run_child(request)


if __name__ == "__main__":
    main()
