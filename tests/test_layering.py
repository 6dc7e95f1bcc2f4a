"""The three floors: the ground (``stagecast/``) imports no service, services never import each other or the
launcher, and only the top floor (``launcher/``) may import everything.  Every import counts, lazy ones too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
SERVICES = ("stage_service", "coordinator", "gateway", "web")
TOP = ("launcher",)


def imported_packages(path: Path) -> set[str]:
    """Top-level package names a module imports, anywhere in its body."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def modules(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def violations(package: str, forbidden: tuple[str, ...]) -> list[str]:
    found = []
    for path in modules(package):
        bad = imported_packages(path) & set(forbidden)
        found += [f"{path.relative_to(ROOT)} imports {name}" for name in sorted(bad)]
    return found


def test_every_floor_has_modules():
    for package in ("stagecast", *SERVICES, *TOP):
        assert modules(package), package


def test_the_ground_floor_imports_no_service_and_not_the_launcher():
    assert violations("stagecast", SERVICES + TOP) == []


@pytest.mark.parametrize("service", SERVICES)
def test_a_service_imports_no_other_service_and_not_the_launcher(service):
    others = tuple(s for s in SERVICES if s != service)
    assert violations(service, others + TOP) == []


def test_the_check_sees_lazy_imports(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from gateway.service import Gateway\n    import coordinator.engine\n")
    assert imported_packages(module) >= {"gateway", "coordinator"}
