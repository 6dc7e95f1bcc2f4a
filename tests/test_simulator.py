"""The scheduler simulator: balanced per_level pipelines stay busy; it explains the ones that cannot."""

import pytest

from coordinator.simulator import SimConfig, simulate
from launcher.cli import main

pytestmark = pytest.mark.unit


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


def test_sequence_parallel_prices_the_all_to_alls_and_shrinks_only_the_token_share():
    base = dict(steps=1, chunks=64, batch=1, growth=0.5, tokens=1000, dim=100, layers=10, dtype_bytes=2)
    pp = simulate(SimConfig(stages=2, stage_ms=[10.0, 10.0], **base))
    hybrid = simulate(SimConfig(stages=2, sp=2, stage_ms=[10.0, 10.0], a2a_gbps=1.0, a2a_latency_ms=0.01, **base))
    # Per layer, each rank sends half of its q/k/v and output shards: 4 * 1000 * 100 * 2 / 2 / 2 bytes at 1 GB/s,
    # plus two collectives' latency; 5 layers per stage; the last stage also gathers the other half of the hidden.
    per_layer = 2 * 0.01 + 4 * (1000 * 100 * 2 / 2) * (1 / 2) / 1e6
    gather = 0.01 + (1000 * 100 * 2 / 2) / 1e6
    assert hybrid.a2a_ms_per_forward == pytest.approx([5 * per_layer, 5 * per_layer + gather])
    assert pp.a2a_ms_per_forward == [0.0, 0.0]
    # Compute: the fixed half stays, the token half halves: 10 * (0.5 + 0.25) ms, plus the exchanges.
    slowest = 7.5 + 5 * per_layer + gather
    assert hybrid.forward_ms == pytest.approx([7.5 + 5 * per_layer, slowest])
    assert pp.forward_ms == pytest.approx([10.0, 10.0])
    assert hybrid.chunks_per_second == pytest.approx(1e3 / slowest, rel=0.02)
    assert pp.chunks_per_second == pytest.approx(1e3 / 10.0, rel=0.02)
    assert any("sequence parallel" in n for n in hybrid.notes)


def test_simulate_refuses_a_topology_that_does_not_fill_the_gpus(capsys):
    assert main(["simulate", "--stages", "2", "--sp", "2", "--gpus", "2"]) == 2
    assert "--stages 2 × --sp 2 = 4 ranks, but 2 GPU(s) were given" in capsys.readouterr().err
    assert main(["simulate", "--stages", "2", "--sp", "2", "--gpus", "4", "--steps", "1", "--chunks", "32"]) == 0
    assert "all-to-all per forward" in capsys.readouterr().out


def test_controller_simulation_lowers_steps_as_streams_arrive_and_refuses_at_capacity():
    from coordinator.simulator import simulate_controller

    cfg = SimConfig(stages=2, steps=4, streams=40, chunks=24, batch=4, stage_ms=[20.0, 20.0])
    rows, capacity = simulate_controller(cfg, min_steps=2, fps=16.0)
    admitted = [r for r in rows if r.admitted]
    assert not rows[-1].admitted  # the first stream past capacity is refused
    # 20 ms x 1.15 / 4 = 5.75 ms per micro-step; 90% of the slowest stage holds 156.5 micro-steps/s: 19 streams at
    # 2 steps (4 chunks/s x 2), not 20.
    assert len(admitted) == 19 == int(capacity[2])
    # Load rises: no stream's steps ever rise (a newcomer starts at its max), and a set that passed the target was
    # lowered to the raise threshold, or as far as its min_steps go.
    for i in range(len(admitted[-1].steps)):
        mine = [r.steps[i] for r in admitted if len(r.steps) > i]
        assert all(a >= b for a, b in zip(mine, mine[1:])), (i, mine)
    lowered = [b for a, b in zip(admitted, admitted[1:]) if sum(b.steps[:-1]) < sum(a.steps)]
    assert lowered and all(r.utilization <= 0.8 + 1e-9 or set(r.steps) == {2} for r in lowered)
    assert admitted[0].steps == [4] and min(admitted[-1].steps) == 2 and max(admitted[-1].steps) <= 3
    assert all(r.utilization <= 0.9 + 1e-9 for r in admitted)
    # The real scheduler at each admitted load produces at least the chunks the streams need.
    assert all(r.simulated_chunks_per_second >= r.needed_chunks_per_second for r in admitted)


def test_controller_simulation_prices_each_decoder(capsys):
    from coordinator.simulator import simulate_controller

    # One stage at 20 ms: a stream at 1 step takes 4 x 20 ms x 1.15 / 4 = 23 ms/s of DiT.  The full VAE at 30 ms a chunk
    # adds 120 ms/s (6 streams fit in 90%); the tiny decoder at 6 ms adds 24 ms/s (19 fit), and batched down to 3 ms
    # per stream at 4 streams and more, 12 ms/s (25 fit).
    cfg = SimConfig(stages=1, steps=1, streams=40, chunks=8, batch=4, stage_ms=[20.0])
    counts = {}
    for name, kw in {
        "full": {"decoder": "full"},
        "tiny": {"decoder": "tiny", "tiny_ms": 6.0},
        "batched": {"decoder": "tiny", "tiny_ms": 6.0, "tiny_batch_ms": (6.0, 4.5, 3.5, 3.0)},
    }.items():
        rows, capacity = simulate_controller(cfg, min_steps=1, fps=16.0, vae_ms=30.0, **kw)
        counts[name] = (sum(r.admitted for r in rows), int(capacity[1]))
    assert counts == {"full": (6, 6), "tiny": (19, 19), "batched": (25, 25)}
    assert main(["simulate", "--controller", "--stages", "1", "--stage-ms", "20", "--steps", "1", "--streams", "30",
                 "--decoder", "tiny", "--tiny-batch-ms", "6,4.5,3.5,3"]) == 0  # fmt: skip
    assert "25.7 at 1 step" in capsys.readouterr().out
    assert main(["simulate", "--controller", "--tiny-batch-ms", "6,x"]) == 2
    assert "--tiny-batch-ms" in capsys.readouterr().out
