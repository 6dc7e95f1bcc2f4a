"""One running system for the whole test session: the tests that need a system and nothing special about it share
it instead of each module forming its own pipeline (a pipeline is five interpreters importing torch, and most of
a system test's time).

It is the demo checkpoint behind a coordinator that records its plan (its SLO model fixed at 1 ms stages, so no test
here is refused as over capacity by a loaded CPU) and admits ``MAX_STREAMS`` streams, two float32 stages and a
gateway with its default flags, on loopback with the launcher's mTLS.  A module that needs another gateway or a web
process (or VAE stages) in front spawns just that on it (``SharedSystem.spawned``) and stops it when done.  Every test
that uses it ends its own streams; the ``shared_system`` fixture (tests/conftest.py) checks after each test that no
stream is left anywhere, so a leak is reported at the test that caused it.  New system tests use it unless they need
other pipeline flags.
"""

from __future__ import annotations

import contextlib
import os
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
MAX_STREAMS = 4  # the coordinator's admission limit: small, so a test reaches it with a few streams
IDLE_TIMEOUT = 60.0

# Put on every child's PYTHONPATH as ``sitecustomize``: it records each process that armed it, and every import of
# the launcher package a child attempts, in IMPORTS_LOG, so the session checks at run time that no service process
# imports the launcher (services start as themselves: ``python -m coordinator``).
_WATCH = """import os, sys
_LOG = {log!r}
with open(_LOG, "a") as f:
    f.write(f"armed {{os.getpid()}}\\n")
class _LauncherImports:
    def find_spec(self, name, path=None, target=None):
        if name == "launcher" or name.startswith("launcher."):
            with open(_LOG, "a") as f:
                f.write(f"import {{os.getpid()}} {{name}}\\n")
        return None
sys.meta_path.insert(0, _LauncherImports())
"""


@dataclass
class SharedSystem:
    root: Path  # the demo checkpoint (transformer/, vae/, text encoder)
    coordinator: str
    gateway: str
    launcher: Launcher  # holds the operator's certificate for the internal services
    children: dict[str, Child] = field(default_factory=dict)
    imports_log: Path | None = None  # what the children's import watch recorded (``_WATCH``)

    def launcher_imports(self) -> tuple[set[int], list[str]]:
        """The pids whose import watch was armed, and every ``pid name`` of a launcher import a child attempted."""
        lines = self.imports_log.read_text().splitlines() if self.imports_log and self.imports_log.exists() else []
        armed = {int(line.split()[1]) for line in lines if line.startswith("armed ")}
        return armed, [line.split(" ", 1)[1] for line in lines if line.startswith("import ")]

    def assert_idle(self, timeout: float = IDLE_TIMEOUT) -> None:
        """No stream left: the gateway holds none (nor any VAE state), then the coordinator has none."""
        with stagecast.Client(self.gateway) as client:
            client.wait_for_status(lambda s: s.active_streams == 0 and s.vae_state_bytes == 0, timeout=timeout)
        with self.launcher.channel(self.coordinator, "coordinator") as ch:
            status = ipb_grpc.CoordinatorServiceStub(ch).Status(ipb.Empty(), timeout=10)
        assert status.active_streams == 0, f"{status.active_streams} streams left on the shared system's coordinator"
        _, imports = self.launcher_imports()
        assert imports == [], f"service processes imported the launcher: {imports}"

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
    watch = folder / "import-watch"
    watch.mkdir()
    imports_log = folder / "imports.log"
    (watch / "sitecustomize.py").write_text(_WATCH.format(log=str(imports_log)))
    path = os.pathsep.join(p for p in (str(watch), os.environ.get("PYTHONPATH", "")) if p)
    # Started afresh, not from a fork server: its children are what tests/test_service_entry.py checks a service
    # process is (`python -m <module>`, the import watch armed in each).
    with Launcher(env={"PYTHONPATH": path}, forkserver=False) as launcher:
        pipe = start_pipeline(
            launcher,
            checkpoint=str(root / "transformer"),
            stages=STAGES,
            record_plan=True,
            max_streams=MAX_STREAMS,
            coordinator_args=fixed_fast_stages(STAGES),
        )
        gateway = launcher.spawn(
            "gateway", ["gateway", "--coordinator", pipe.coordinator, "--checkpoint", str(root), "--port", "0"]
        )
        children = {"coordinator": pipe.coordinator_child, "gateway": gateway}
        children.update({f"stage-{i}": child for i, child in pipe.stage_children.items()})
        yield SharedSystem(root, pipe.coordinator, gateway.info["address"], launcher, children, imports_log)
