"""One running system for the whole test session: the tests that need a system and nothing special about it share
it instead of each module forming its own pipeline (a pipeline is five interpreters importing torch, and most of
a system test's time).

It is the demo checkpoint behind a coordinator that records its plan (its SLO model fixed at 1 ms stages, so no test
here is refused as over capacity by a loaded CPU), two float32 stages and a gateway with its
default flags, on loopback with the launcher's mTLS.  A module that needs another gateway or a web process in front
spawns just that on it (``SharedSystem.launcher``) and stops it when done.  Every test that uses it ends its own
streams; the ``shared_system`` fixture (tests/conftest.py) checks after each test that no stream is left anywhere,
so a leak is reported at the test that caused it.  New system tests use it unless they need other pipeline flags.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import stagecast
from launcher.demo_checkpoint import write_demo_checkpoint
from launcher.local_cluster import start_pipeline
from launcher.process import Child, Launcher
from stagecast.internal.v1 import pipeline_pb2 as ipb
from stagecast.internal.v1 import pipeline_pb2_grpc as ipb_grpc
from tests.pipeline_helpers import fixed_fast_stages

STAGES = 2
IDLE_TIMEOUT = 60.0


@dataclass
class SharedSystem:
    root: Path  # the demo checkpoint (transformer/, vae/, text encoder)
    coordinator: str
    gateway: str
    launcher: Launcher  # holds the operator's certificate for the internal services
    children: dict[str, Child] = field(default_factory=dict)

    def assert_idle(self, timeout: float = IDLE_TIMEOUT) -> None:
        """No stream left: the gateway holds none (nor any VAE state), then the coordinator has none."""
        with stagecast.Client(self.gateway) as client:
            client.wait_for_status(lambda s: s.active_streams == 0 and s.vae_state_bytes == 0, timeout=timeout)
        with self.launcher.channel(self.coordinator, "coordinator") as ch:
            status = ipb_grpc.CoordinatorServiceStub(ch).Status(ipb.Empty(), timeout=10)
        assert status.active_streams == 0, f"{status.active_streams} streams left on the shared system's coordinator"

    @contextlib.contextmanager
    def spawned(self, name: str, args: list[str]) -> Iterator[Child]:
        """One more service (a gateway with other flags, a web process) on this system, stopped on leaving."""
        child = self.launcher.spawn(name, args)
        try:
            yield child
        finally:
            self.launcher.stop(child)


@contextlib.contextmanager
def shared_system(folder: Path) -> Iterator[SharedSystem]:
    root = write_demo_checkpoint(folder / "ckpt")
    with Launcher() as launcher:
        pipe = start_pipeline(
            launcher,
            checkpoint=str(root / "transformer"),
            stages=STAGES,
            record_plan=True,
            coordinator_args=fixed_fast_stages(STAGES),
        )
        gateway = launcher.spawn(
            "gateway", ["gateway", "--coordinator", pipe.coordinator, "--checkpoint", str(root), "--port", "0"]
        )
        children = {"coordinator": pipe.coordinator_child, "gateway": gateway}
        children.update({f"stage-{i}": child for i, child in pipe.stage_children.items()})
        yield SharedSystem(root, pipe.coordinator, gateway.info["address"], launcher, children)
