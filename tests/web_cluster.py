"""A demo-sized system with the web process in front of it, for the web tests: coordinator, 2 stages, a gateway
and ``stagecast web`` as real processes on loopback (the demo checkpoint, 64x64 frames at 16 fps)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from launcher.demo_checkpoint import write_demo_checkpoint
from launcher.local_cluster import start_pipeline
from launcher.process import Child, Launcher
from tests.pipeline_helpers import fixed_fast_stages

PEER_TIMEOUT = 2.0
MAX_PEERS = 2


@dataclass
class WebCluster:
    coordinator: str
    checkpoint: str
    gateway: str
    url: str
    web: Child
    launcher: Launcher


@contextlib.contextmanager
def web_cluster(root_dir, *, max_peers: int = MAX_PEERS, peer_timeout: float = PEER_TIMEOUT) -> Iterator[WebCluster]:
    root = write_demo_checkpoint(root_dir)
    with Launcher(env={"OMP_NUM_THREADS": "1"}) as launcher:
        pipe = start_pipeline(
            launcher, checkpoint=str(root / "transformer"), stages=2, coordinator_args=fixed_fast_stages(2)
        )
        gateway = launcher.spawn(
            "gateway", ["gateway", "--coordinator", pipe.coordinator, "--checkpoint", str(root), "--port", "0"]
        )
        args = ["web", "--gateway", gateway.info["address"], "--port", "0", "--ice-host", "127.0.0.1"]
        args += ["--max-peers", str(max_peers), "--peer-timeout", str(peer_timeout)]
        web = launcher.spawn("web", args)
        yield WebCluster(
            coordinator=pipe.coordinator,
            checkpoint=str(root),
            gateway=gateway.info["address"],
            url=web.info["url"],
            web=web,
            launcher=launcher,
        )
