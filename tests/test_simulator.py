"""The scheduler simulator: balanced per_level pipelines stay busy; it explains the ones that cannot."""

import pytest

from coordinator.simulator import SimConfig, simulate
from launcher.cli import main


@pytest.mark.parametrize("stages,steps,batch", [(2, 2, 4), (2, 4, 4), (4, 4, 4), (8, 8, 8), (4, 4, 2)])
def test_balanced_per_level_stream_has_under_five_percent_bubbles(stages, steps, batch):
    rep = simulate(SimConfig(stages=stages, steps=steps, batch=batch, chunks=128))
    assert rep.bubble_fraction <= 0.05, rep
    assert all(u >= 0.95 for u in rep.utilization)
    assert rep.steady_window_ms > 0


def test_clean_policy_single_stream_cannot_fill_the_pipeline_and_says_why():
    rep = simulate(SimConfig(stages=4, steps=4, policy="clean", streams=1, chunks=32))
    assert rep.bubble_fraction > 0.5
    assert any("clean policy" in n and "at least 4 streams" in n for n in rep.notes)


def test_clean_policy_with_enough_streams_interleaves_them():
    rep = simulate(SimConfig(stages=2, steps=4, policy="clean", streams=2, chunks=64))
    assert rep.bubble_fraction <= 0.05
    assert not any("clean policy" in n for n in rep.notes)


def test_unbalanced_stages_are_reported_with_the_bottleneck():
    rep = simulate(SimConfig(stages=3, steps=4, chunks=64, stage_ms=[10.0, 15.0, 10.0]))
    assert rep.utilization[1] == pytest.approx(1.0, abs=0.01)
    assert rep.bubble_fraction == pytest.approx(1 - 35 / 45, abs=0.02)
    assert any("unbalanced stages: stage 1" in n for n in rep.notes)


def test_simulate_command_prints_the_report(capsys):
    assert main(["simulate", "--stages", "2", "--steps", "4", "--chunks", "64"]) == 0
    out = capsys.readouterr().out
    assert "steady-state bubble fraction: 0." in out and "utilization per stage" in out
