"""Parity sweeps through formed pipelines: cases whose configs start the same processes (``launcher.selftest``'s
``pipeline_key``: checkpoint, stages, partition, sp, CFG groups, max batch, coordinator flags) run one after another
through one pipeline instead of each forming its own (a pipeline is several interpreters importing torch, most of a
case's time).  Each case still opens its own streams and compares every chunk with the reference replaying its own
part of the recorded plan, bit for bit.

A module takes the ``selftest_pipelines`` fixture (tests/conftest.py: one per module, one pipeline alive at a time)
and marks each case with the pipeline it runs on (``on_pipeline``, ``shares_pipeline``); the conftest runs a module's
cases of one pipeline next to each other, in the order the first of them appears.  A mark that does not match the
config a case runs only costs a formation: the pipeline is chosen by the config, never by the mark.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from launcher.process import Launcher
from launcher.selftest import (
    SelftestConfig,
    SelftestPipeline,
    SelftestResult,
    form_pipeline,
    pipeline_key,
    run_on,
)

MARK = "selftest_pipeline"


def shares_pipeline(cfg: SelftestConfig):
    """The mark of a test whose case runs ``cfg``."""
    return getattr(pytest.mark, MARK)(pipeline_key(cfg))


def on_pipeline(cfg: SelftestConfig, *values, id: str | None = None):
    """A ``parametrize`` case (``values``, named as pytest names them) that runs ``cfg``."""
    return pytest.param(*values, marks=shares_pipeline(cfg), id=id)


class SelftestPipelines:
    """Runs selftest configs, each through the held pipeline when its key is the config's, otherwise through a
    newly formed one (the held one stopped first: one pipeline alive at a time).  A run that raises or does not
    match the reference takes its pipeline down with it, so the next case starts from a fresh one."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.held: SelftestPipeline | None = None
        self.formed = 0
        self.runs = 0

    def run(self, cfg: SelftestConfig) -> SelftestResult:
        if self.held is not None and self.held.key != pipeline_key(cfg):
            self.close()
        if self.held is None:
            launcher = Launcher().__enter__()
            try:
                self.held = form_pipeline(cfg, launcher, tempfile.mkdtemp(dir=self.folder))
            except BaseException:
                launcher.__exit__(None, None, None)
                raise
            self.formed += 1
        self.runs += 1
        try:
            result = run_on(self.held, cfg)
        except BaseException:
            self.close()
            raise
        if not result.ok:
            self.close()
        return result

    def close(self) -> None:
        if self.held is not None:
            held, self.held = self.held, None
            held.launcher.__exit__(None, None, None)


def grouped(items: list) -> list:
    """``items`` with each module's cases of one pipeline (the ``selftest_pipeline`` mark) next to each other, at
    the place of the first of them; everything else keeps its order."""
    first: dict = {}
    keys = []
    for i, item in enumerate(items):
        mark = item.get_closest_marker(MARK)
        key = (item.path, mark.args[0]) if mark is not None else i
        first.setdefault(key, i)
        keys.append(first[key])
    order = sorted(range(len(items)), key=lambda i: (keys[i], i))
    return [items[i] for i in order]
