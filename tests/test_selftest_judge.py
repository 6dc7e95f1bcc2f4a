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
