"""The web process in front of the session's shared system, for the web tests: ``stagecast web`` as a real process
on loopback before the shared coordinator, 2 stages and gateway (the demo checkpoint, 64x64 frames at 16 fps)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from launcher.process import Child, Launcher

PEER_TIMEOUT = 2.0
MAX_PEERS = 2


@dataclass
class WebCluster:
    gateway: str
    url: str
    web: Child
    launcher: Launcher


@contextlib.contextmanager
def web_cluster(system, *, max_peers: int = MAX_PEERS, peer_timeout: float = PEER_TIMEOUT) -> Iterator[WebCluster]:
    """``stagecast web`` in front of the shared system's gateway (tests/shared_system.py), stopped on leaving."""
    args = ["web", "--gateway", system.gateway, "--port", "0", "--ice-host", "127.0.0.1"]
    args += ["--max-peers", str(max_peers), "--peer-timeout", str(peer_timeout)]
    with system.spawned("web", args) as web:
        yield WebCluster(gateway=system.gateway, url=web.info["url"], web=web, launcher=system.launcher)
