import multiprocessing.process
import os
import re
import subprocess

import pytest
import torch

# Exactness tests compare bit for bit; keep CPU kernels deterministic and the suite light on 2 cores.
THREADS = int(os.environ.get("STAGECAST_TEST_THREADS", "2"))
torch.use_deterministic_algorithms(True)
torch.set_num_threads(THREADS)
# The services the tests start inherit this: each child computes on at most THREADS threads, so a system of five
# processes does not ask for five times the machine's cores.
for _name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_name, str(THREADS))

# The services the tests start through a Launcher are forked from one fork server per test process
# (launcher.forkserver): torch and diffusers imported once, not once per child (about 4 CPU-seconds each).
# STAGECAST_TEST_FORKSERVER=0 starts each child afresh, as `stagecast up` does by default.  Commands the tests start
# with subprocess (`stagecast up`, `demo`) keep the default of their own launchers.
import launcher.process  # noqa: E402

launcher.process.DEFAULT_FORKSERVER = os.environ.get("STAGECAST_TEST_FORKSERVER", "1") == "1"


@pytest.fixture
def tiny_model():
    from diffusers import WanTransformer3DModel

    from stagecast.model.dit_configs import model_config

    def make(name="tiny-wan2.1", seed=0, **overrides):
        torch.manual_seed(seed)
        return WanTransformer3DModel(**model_config(name, **overrides)).eval().requires_grad_(False)

    return make


@pytest.fixture(scope="session")
def system_session(tmp_path_factory):
    """The session's one running system (tests/shared_system.py), formed when a test first asks for it."""
    from tests.shared_system import shared_system

    with shared_system(tmp_path_factory.mktemp("shared")) as system:
        yield system


@pytest.fixture(scope="module")
def selftest_pipelines(tmp_path_factory):
    """The module's parity cases run through formed pipelines, one alive at a time (tests/selftest_pipelines.py)."""
    from tests.selftest_pipelines import SelftestPipelines

    pipelines = SelftestPipelines(tmp_path_factory.mktemp("selftest"))
    try:
        yield pipelines
    finally:
        pipelines.close()


@pytest.fixture
def shared_system(system_session):
    """The shared running system for one test, which must end its own streams: checked after it."""
    yield system_session
    system_session.assert_idle()


# ---- tiers.  Every test carries its own tier marker (on the test, its class, or the module's ``pytestmark``):
#   unit          in process and quick: the fast set, ``pytest -m unit``; it never starts a process
#   parity        exactness sweeps against the reference executor and the oracles
#   multiprocess  starts real services on loopback (it may carry ``parity`` as well)
# A test without a tier, or with ``unit`` beside another tier, is a collection error; a ``unit`` test (its fixtures
# included) that starts a process fails, naming the tier it belongs to.
TIERS = ("unit", "parity", "multiprocess")


def tier_problem(item) -> str | None:
    tiers = {mark.name for mark in item.iter_markers() if mark.name in TIERS}
    if not tiers:
        return f"{item.nodeid}: no tier marker; mark it one of {', '.join(TIERS)}"
    if "unit" in tiers and len(tiers) > 1:
        return f"{item.nodeid}: marked unit and {' and '.join(sorted(tiers - {'unit'}))}; a test has one tier"
    return None


# Long runs that only an explicit ``-m fuzz`` / ``-m soak`` selects, whatever else ``-m`` names (``-m unit`` on the
# command line replaces the ``-m`` of pyproject's addopts).
OPT_IN = ("fuzz", "soak")


def pytest_collection_modifyitems(config, items):
    problems = [problem for item in items if (problem := tier_problem(item))]
    if problems:
        raise pytest.UsageError("tests without a proper tier:\n  " + "\n  ".join(problems))
    asked = config.getoption("markexpr") or ""
    skipped = [name for name in OPT_IN if not re.search(rf"(?<!not )\b{name}\b", asked)]
    dropped = [item for item in items if any(item.get_closest_marker(name) for name in skipped)]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [item for item in items if item not in dropped]
    # A module's cases that run on one formed selftest pipeline run next to each other (tests/selftest_pipelines.py).
    from tests.selftest_pipelines import grouped

    items[:] = grouped(items)


class _ProcessGuard:
    """Refuses process starts while a ``unit`` test (or its fixtures' set-up) runs, and remembers the attempt."""

    def __init__(self):
        self.item = None
        self.started: dict[str, str] = {}

    # Library internals that run a helper program in passing (ctypes.util.find_library runs ``ldconfig -p``).
    ALLOWED = ("ldconfig",)

    def allowed(self, args) -> bool:
        argv = args[1] if len(args) > 1 and isinstance(args[1], list | tuple) else None
        return bool(argv) and os.path.basename(str(argv[0])) in self.ALLOWED

    def wrap(self, owner, name: str, what: str) -> None:
        original = getattr(owner, name)
        guard = self

        def guarded(*args, **kwargs):
            if guard.item is not None and not guard.allowed(args):
                message = f"a test marked unit started {what}; mark it multiprocess"
                guard.started.setdefault(guard.item.nodeid, message)
                raise RuntimeError(message)
            return original(*args, **kwargs)

        setattr(owner, name, guarded)


_guard = _ProcessGuard()
_guard.wrap(subprocess.Popen, "_execute_child", "a subprocess")
_guard.wrap(multiprocessing.process.BaseProcess, "start", "a multiprocessing process")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _guard.item = item if item.get_closest_marker("unit") else None
    try:
        yield
    finally:
        _guard.item = None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    message = _guard.started.get(item.nodeid)
    if message and report.when == "call" or message and report.when == "setup" and report.failed:
        report.outcome = "failed"
        report.longrepr = f"{item.nodeid}: {message}"
