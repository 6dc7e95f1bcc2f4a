"""The fleet's door on this machine: HAProxy in front of ``stagecast up --pipelines N``'s gateways.

Usage::

    haproxy = find_haproxy()                       # its path; DoorError naming `apt-get install haproxy` if missing
    text = render(bind="127.0.0.1:50051", servers=[Server("p0", "127.0.0.1:50061", 50071)], web="127.0.0.1:8080")
    check_config(haproxy, path)                    # haproxy -c -f PATH; DoorError with its message
    door = Door(haproxy, folder, text)             # writes haproxy.cfg into folder (private), starts it
    door.wait_listening("127.0.0.1", 50051, 10)    # its bind accepts connections
    door.servers("grpc")                           # {name: (status, weight, maxconn)} from its master CLI
    door.stop()

The config comes from one template, ``helm/stagecast/files/haproxy.cfg.tmpl``, that the Helm chart renders too
(``template_path`` finds it: package data beside this module, a link to the chart's file).  HAProxy runs in the
foreground in master-worker mode (``-W -db``) with its master CLI on a socket in ``folder``, through which ``up`` and
tests read the servers' states; it dies with ``up`` (``setpriv --pdeathsig``, where util-linux has it).
"""

from __future__ import annotations

import csv
import os
import shutil
import socket
import string
import subprocess
from dataclasses import dataclass
from pathlib import Path

TEMPLATE = "haproxy.cfg.tmpl"
INSTALL_HINT = "apt-get install haproxy"


class DoorError(RuntimeError):
    pass


@dataclass(frozen=True)
class Server:
    """One pipeline's gateway behind the door: its name, its public address, its agent port."""

    name: str
    address: str
    agent_port: int

    def line(self) -> str:
        return f"    server {self.name} {self.address} agent-port {self.agent_port}"


def template_path() -> Path:
    """The door's config template: beside this module (package data), else the chart's file in a source tree."""
    here = Path(__file__).resolve().parent
    for candidate in (here / TEMPLATE, here.parent / "helm" / "stagecast" / "files" / TEMPLATE):
        if candidate.is_file():
            return candidate
    raise DoorError(f"the HAProxy config template {TEMPLATE} is missing beside {here} (a broken install)")


def render(*, bind: str, servers: list[Server], web: str | None = None, tls_pem: str | None = None) -> str:
    """The door's config: ``bind`` HOST:PORT (TLS with ``tls_pem``, a certificate chain and key in one file)."""
    if not servers:
        raise ValueError("the door needs at least one pipeline")
    bind_args = bind + (f" ssl crt {tls_pem} alpn h2,http/1.1" if tls_pem else "")
    return string.Template(template_path().read_text()).substitute(
        bind=bind_args,
        servers="\n".join(server.line() for server in servers),
        web=f"    server web {web}" if web else "",
    )


def find_haproxy() -> str:
    path = shutil.which("haproxy") or next((p for p in ("/usr/sbin/haproxy",) if os.access(p, os.X_OK)), None)
    if path is None:
        raise DoorError(f"--pipelines needs HAProxy, the fleet's door, and it is not installed: {INSTALL_HINT}")
    return path


def check_config(haproxy: str, path: str | os.PathLike) -> None:
    """``haproxy -c -f PATH``: raise ``DoorError`` with HAProxy's own words when the config is not valid."""
    run = subprocess.run([haproxy, "-c", "-f", str(path)], capture_output=True, text=True, timeout=30)
    if run.returncode != 0:
        raise DoorError(f"HAProxy refused the door's config {path}:\n{run.stdout}{run.stderr}")


class Door:
    """A running HAProxy with the given config (written to ``folder/haproxy.cfg``)."""

    def __init__(self, haproxy: str, folder: str | os.PathLike, config: str):
        self.folder = Path(folder)
        self.config = self.folder / "haproxy.cfg"
        self.config.write_text(config)
        check_config(haproxy, self.config)
        self.socket = self.folder / "master.sock"
        argv = [haproxy, "-W", "-db", "-S", str(self.socket), "-f", str(self.config)]
        setpriv = shutil.which("setpriv")
        if setpriv is not None:  # SIGTERM to HAProxy when up dies, even by SIGKILL
            argv = [setpriv, "--pdeathsig", "TERM", *argv]
        self.log = self.folder / "haproxy.log"  # its alerts and server state changes (a pipe could fill and block it)
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_listening(self, host: str, port: int, timeout: float) -> None:
        """Until the door accepts connections on ``host:port``; DoorError if HAProxy exits or ``timeout`` passes."""
        import time

        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise DoorError(f"HAProxy exited with code {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            try:
                with socket.create_connection((host, port), timeout=0.5):
                    return
            except OSError:
                if time.monotonic() > deadline:
                    raise DoorError(f"HAProxy did not listen on {host}:{port} within {timeout:g} s") from None
            try:  # HAProxy prints no ready line: poll the port, waking at once should it exit
                self.proc.wait(0.05)
            except subprocess.TimeoutExpired:
                pass

    def command(self, line: str) -> str:
        """One command to the worker through the master CLI (e.g. ``show stat``)."""
        with socket.socket(socket.AF_UNIX) as sock:
            sock.settimeout(5.0)
            sock.connect(str(self.socket))
            sock.sendall(f"@1 {line}\n".encode())
            sock.shutdown(socket.SHUT_WR)  # one command: the master CLI answers and closes once our side is done
            out = b""
            while chunk := sock.recv(65536):
                out += chunk
        return out.decode()

    def servers(self, backend: str = "grpc") -> dict[str, dict[str, str]]:
        """The backend's servers as ``show stat`` reports them: name -> {status, weight, slim (maxconn), scur...}."""
        text = self.command("show stat").lstrip("# ")
        rows = csv.DictReader(line for line in text.splitlines() if line and not line.startswith(">"))
        return {
            row["svname"]: row for row in rows if row.get("pxname") == backend and row["svname"] not in ("BACKEND",)
        }

    def stop(self, grace: float = 5.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
