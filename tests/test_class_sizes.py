"""One job per class: the classes that hold a service together stay small, their jobs in parts they compose.

A class's size is the span of its lines in the source (``ast``: first to last line, docstring and comments included);
a file's is its line count.  A class that grows past its bound is holding a second job: give that job a part of its
own, as the coordinator's engine, the gateway, a gateway stream and the stage servicer do."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]

CLASS_BOUNDS = [
    ("coordinator/engine.py", "PipelineEngine", 300),
    ("gateway/service.py", "Gateway", 300),
    ("gateway/stream/run.py", "StreamRun", 300),
    ("stage_service/server.py", "StageServicer", 300),
]
FILE_BOUNDS = [("coordinator/engine.py", 400)]


def class_lines(path: Path, name: str) -> int:
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node.end_lineno - node.lineno + 1
    raise AssertionError(f"{path.relative_to(ROOT)} defines no class {name}")


@pytest.mark.parametrize(("path", "name", "bound"), CLASS_BOUNDS, ids=[c for _, c, _ in CLASS_BOUNDS])
def test_a_service_class_holding_its_parts_stays_within_its_line_bound(path, name, bound):
    lines = class_lines(ROOT / path, name)
    assert lines <= bound, f"{path}: {name} spans {lines} lines, past {bound}: give a job of it a class of its own"


@pytest.mark.parametrize(("path", "bound"), FILE_BOUNDS, ids=[p for p, _ in FILE_BOUNDS])
def test_a_service_module_holding_its_parts_stays_within_its_line_bound(path, bound):
    lines = len((ROOT / path).read_text().splitlines())
    assert lines <= bound, f"{path} has {lines} lines, past {bound}"


def test_the_measure_counts_a_class_from_its_first_line_to_its_last(tmp_path):
    module = tmp_path / "m.py"
    module.write_text('x = 1\n\n\nclass A:\n    """doc."""\n\n    def f(self):\n        return 1\n\n\ny = 2\n')
    assert class_lines(module, "A") == 5
