"""The selftest verdict: exact means bit for bit, and any mismatch or missing chunk fails it."""

import subprocess
import sys

import pytest
import torch

from launcher.selftest import judge


def chunks(*values):
    return [torch.full((1, 2, 1, 2, 2), v) for v in values]


@pytest.mark.unit
def test_bit_equal_streams_pass_and_any_difference_fails():
    ref = {1: chunks(0.5, 1.5), 2: chunks(2.0)}
    assert judge({1: chunks(0.5, 1.5), 2: chunks(2.0)}, ref, 0.0) == (True, 0.0)
    ok, worst = judge({1: chunks(0.5, 1.5 + 1e-7), 2: chunks(2.0)}, ref, 0.0)
    assert not ok and worst > 0
    assert judge({1: chunks(0.5, 1.5 + 1e-7), 2: chunks(2.0)}, ref, 1e-3)[0]
    assert not judge({1: chunks(0.5, float("nan")), 2: chunks(2.0)}, ref, 1e-3)[0]
    assert not judge({1: chunks(0.5, float("nan")), 2: chunks(2.0)}, ref, 0.0)[0]
    assert not judge({1: chunks(0.5), 2: chunks(2.0)}, ref, 0.0)[0]  # a chunk missing
    assert not judge({1: chunks(0.5, 1.5)}, ref, 0.0)[0]  # a stream missing


@pytest.mark.multiprocess
def test_selftest_command_passes_and_prints_the_difference():
    proc = subprocess.run(
        [sys.executable, "-m", "launcher.cli", "selftest", "--stages", "2", "--streams", "1", "--chunks", "2"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "max |distributed - reference| = 0.000e+00, exact=True" in proc.stdout
    assert "selftest PASS" in proc.stdout


@pytest.mark.unit
def test_a_run_on_a_formed_pipeline_replays_only_its_own_streams_events():
    """A later run's cut of the recorded plan: an earlier stream's late close is not this run's; a batch holding an
    earlier stream cannot be replayed alone and is an error (tests/selftest_pipelines.py)."""
    from dataclasses import replace

    from launcher.selftest import own_events
    from stagecast.microstep import MicroStep, PlanEvent
    from tests.pipeline_helpers import tiny_spec

    spec = replace(tiny_spec(), stream_id=5)
    opened = PlanEvent("open", seq=10, spec=spec)
    batch = PlanEvent("batch", seq=11, steps=(MicroStep(5, 0, 0),))
    late = PlanEvent("close", seq=12, stream_id=4)
    close = PlanEvent("close", seq=13, stream_id=5)
    assert own_events([opened, late, batch, close]) == [opened, batch, close]
    mixed = PlanEvent("batch", seq=14, steps=(MicroStep(4, 3, 1), MicroStep(5, 1, 0)))
    with pytest.raises(RuntimeError, match=r"streams \[4\] of an earlier run"):
        own_events([opened, mixed])


@pytest.mark.unit
def test_cases_of_one_formed_pipeline_run_next_to_each_other_within_their_module():
    from tests.selftest_pipelines import MARK, grouped

    class Item:
        def __init__(self, name, path, key=None):
            self.name, self.path, self.key = name, path, key

        def get_closest_marker(self, name):
            assert name == MARK
            return None if self.key is None else pytest.mark.selftest_pipeline(self.key).mark

    items = [Item("a1", "m", "A"), Item("x", "m"), Item("b1", "m", "B"), Item("a2", "m", "A"), Item("c", "n", "A")]
    assert [i.name for i in grouped(items)] == ["a1", "a2", "x", "b1", "c"]
