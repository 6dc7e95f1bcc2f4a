"""The three floors: the ground (``stagecast/``) imports no service, services never import each other or the
launcher, and only the top floor (``launcher/``) may import everything.  Every import counts, lazy ones too.

Two rules ride along.  Services and the ground floor only load weights: every writer of a tiny or random checkpoint
lives in ``launcher/demo_checkpoint.py``.  And no package takes another's private (underscore) names; a test may take
those of the module it is named for (``test_dit_slice_attention.py`` of ``stage_service.dit_slice``)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
SERVICES = ("stage_service", "coordinator", "gateway", "web")
TOP = ("launcher",)
OURS = ("stagecast", *SERVICES, *TOP, "benchmarks", "tests")
WRITERS_HOME = "launcher/demo_checkpoint.py"
# Calls that write weights: safetensors' and transformers' / diffusers' savers (``torch.save`` is matched apart).
WEIGHT_SAVERS = {"save_file", "save_model", "save_torch_state_dict", "save_pretrained"}
# Private names a test still takes from a module it is not named for, each with the reason it is left.
KNOWN_PRIVATE = {
    # The gateway's flags are becoming one options dataclass with a public constructor; until then its test builds
    # the options through these helpers of gateway/cli.py.
    ("test_vae_graphs.py", "gateway.cli._gateway_options"),
    ("test_vae_graphs.py", "gateway.cli._vae_options"),
}


def imported_packages(path: Path) -> set[str]:
    """Top-level package names a module imports, anywhere in its body."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def weight_writes(path: Path) -> list[str]:
    """``line: call`` for every call in a module that writes model weights to a file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        torch_save = name == "save" and isinstance(func, ast.Attribute) and ast.unparse(func.value) == "torch"
        if name in WEIGHT_SAVERS or torch_save:
            found.append(f"{node.lineno}: {ast.unparse(func)}")
    return found


def private_imports(path: Path) -> list[str]:
    """``line: module.name`` for every private name a module takes from a module of ours: ``from m import _x``, or
    ``m._x`` on a name it imported (lazy imports too)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found, origin = [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and node.module.split(".")[0] in OURS:
            for alias in node.names:
                if _private(alias.name):
                    found.append(f"{node.lineno}: {node.module}.{alias.name}")
                origin[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in OURS:
                    name = alias.asname or alias.name.split(".")[0]  # ``import a.b`` binds a; ``as c`` binds a.b
                    origin[name] = alias.name if alias.asname else name
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            chain, base = [], node.value
            while isinstance(base, ast.Attribute):
                chain.insert(0, base.attr)
                base = base.value
            if isinstance(base, ast.Name) and base.id in origin:
                found.append(f"{node.lineno}: {'.'.join([origin[base.id], *chain, node.attr])}")
    return found


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def taken_from(found: str) -> str:
    """The module (or class) a ``line: module.name`` entry takes its private name from."""
    return found.split(": ", 1)[1].rsplit(".", 1)[0]


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


@pytest.mark.parametrize("package", ("stagecast", *SERVICES))
def test_services_and_the_ground_floor_write_no_weights(package):
    """Writers of tiny and random checkpoints live in one module on the top floor, not in the services that load."""
    found = [f"{path.relative_to(ROOT)}:{w}" for path in modules(package) for w in weight_writes(path)]
    assert found == [], f"a checkpoint writer belongs in {WRITERS_HOME}"


def test_every_random_checkpoint_writer_lives_in_one_module():
    """Outside the tests, only the writers' home and ``stagecast convert`` (real weights, converted) save weights."""
    writers = {
        str(path.relative_to(ROOT))
        for package in ("stagecast", *SERVICES, *TOP, "benchmarks")
        for path in modules(package)
        if weight_writes(path)
    }
    assert writers == {WRITERS_HOME, "launcher/convert.py"}


@pytest.mark.parametrize("package", ("stagecast", *SERVICES, *TOP, "benchmarks"))
def test_no_package_takes_another_packages_private_names(package):
    found = [
        f"{path.relative_to(ROOT)}:{hit}"
        for path in modules(package)
        for hit in private_imports(path)
        if taken_from(hit).split(".")[0] != package
    ]
    assert found == [], "make the name public where it is a real API, or move it"


def test_a_test_takes_private_names_only_from_the_module_it_is_named_for():
    found = []
    for path in modules("tests"):
        for hit in private_imports(path):
            module = taken_from(hit)
            if module.split(".")[0] == "tests" or module.rsplit(".", 1)[-1] in path.stem:
                continue
            if (path.name, hit.split(": ", 1)[1]) not in KNOWN_PRIVATE:
                found.append(f"{path.relative_to(ROOT)}:{hit}")
    assert found == []


def test_the_checks_see_writers_and_private_names(tmp_path):
    module = tmp_path / "m.py"
    module.write_text(
        "import torch\n"
        "import stagecast.client\n"
        "from gateway.decode.stream_vae import _helper\n"
        "def write_tiny(folder, model):\n"
        "    from safetensors.torch import save_file\n"
        "    save_file(model.state_dict(), folder)\n"
        "    torch.save(model.state_dict(), folder)\n"
        "    model.save_pretrained(folder)\n"
        "    return stagecast.client._prompt_update\n"
    )
    assert [w.split(": ")[1] for w in weight_writes(module)] == ["save_file", "torch.save", "model.save_pretrained"]
    assert sorted(h.split(": ")[1] for h in private_imports(module)) == [
        "gateway.decode.stream_vae._helper",
        "stagecast.client._prompt_update",
    ]
