"""The issue-24 predictions (``benchmarks.predict``): per-GPU DiT + VAE sums checked by hand on a tiny profile, the
derived 14B profile, and the committed table's numbers from the committed measurements."""

import json
from pathlib import Path

import pytest

from benchmarks import predict
from stagecast.model.balance import plan_balance
from stagecast.model.balance_profile import DIT_KEYS, BalanceProfile
from stagecast.model.dit_configs import model_config

pytestmark = pytest.mark.unit

BLOCKS = [1.0, 2.0, 3.0, 4.0]  # tiny-wan2.1 has 4 blocks
VAE = [1.0, 2.0, 3.0, 10.0, 20.0, 30.0, 5.0]  # its decoder's 7 units
STAGE, FIRST, LAST = 0.5, 0.25, 0.75


def tiny_profile() -> BalanceProfile:
    config = model_config("tiny-wan2.1")
    names = ["conv_in", "mid_block", "up_blocks.0", "up_blocks.1", "up_blocks.2", "up_blocks.3", "head"]
    return BalanceProfile(
        model="tiny-wan2.1",
        dit_config={k: config[k] for k in DIT_KEYS},
        blocks_ms=list(BLOCKS),
        vae_units=list(zip(names, VAE, strict=True)),
        stage_ms=STAGE,
        first_ms=FIRST,
        last_ms=LAST,
        device="cpu",
    )


def tiny_attention(graphed: float = 6.0, eager1: float = 8.0, eager4: float = 14.0) -> dict:
    def batch(graphed_ms, eager_ms):
        return {"modes": {"in_place": {"graphed": {"median_ms": graphed_ms}, "eager": {"median_ms": eager_ms}}}}

    return {
        "models": [
            {
                "model": "tiny-wan2.1",
                "layers": [0, 2],
                "batches": {"1": batch(graphed, eager1), "4": batch(4 * graphed, eager4)},
            }
        ]
    }


def test_the_vae_cut_by_macs_is_the_gateways_default():
    from diffusers import AutoencoderKLWan

    from gateway.decode.stream_vae import decoder_cut
    from stagecast.model.vae_configs import vae_config

    vae = AutoencoderKLWan(**vae_config("tiny-wan2.1"))
    for slices in (1, 2, 4):
        assert predict.mac_cut("tiny-wan2.1", slices) == decoder_cut(vae, slices)[1:-1]


def test_a_pipeline_predicts_the_busiest_gpus_stage_plus_vae_slices():
    profile = tiny_profile()
    cut = predict.mac_cut("tiny-wan2.1", 2)
    assert cut == [5]
    row = predict.pipeline(profile, 2, planner=False)
    # Even partition 2,2: stage 0 = fixed + first + blocks 0, 1 with VAE units 0..4; stage 1 = fixed + last + blocks
    # 2, 3 with VAE units 5, 6.
    gpu0 = STAGE + FIRST + 1.0 + 2.0 + sum(VAE[:5])
    gpu1 = STAGE + LAST + 3.0 + 4.0 + sum(VAE[5:])
    assert (row["partition"], row["vae_split"]) == ("2,2", [5])
    assert row["gpu_ms"] == {"0": pytest.approx(gpu0), "1": pytest.approx(gpu1)}
    assert row["bottleneck_ms"] == pytest.approx(max(gpu0, gpu1)) == pytest.approx(43.25)
    assert row["busiest"] == {"gpu": 1, "dit_ms": pytest.approx(8.25), "vae_ms": pytest.approx(35.0)}
    # The DiT alone would run faster than the GPUs allow, so the busiest GPU sets the rate.
    assert row["dit_only_chunks_per_second"] > 1e3 / row["bottleneck_ms"]
    assert row["fps"] == pytest.approx(4000 / 43.25)

    planned = predict.pipeline(profile, 2, planner=True)
    plan = plan_balance(profile.costs(), [0, 1], [0, 1])
    assert planned["bottleneck_ms"] == pytest.approx(plan.bottleneck_ms)
    assert planned["bottleneck_ms"] < row["bottleneck_ms"]
    one = predict.pipeline(profile, 1, planner=False)
    assert one["bottleneck_ms"] == pytest.approx(STAGE + FIRST + LAST + sum(BLOCKS) + sum(VAE))


def test_cfg_parallel_puts_each_groups_stage_on_its_gpus_beside_the_vae_slices():
    profile = tiny_profile()
    row = predict.cfg_parallel(profile, 2, exchange_ms=0.5)
    assert predict.mac_cut("tiny-wan2.1", 4) == [1, 4, 5]
    s0, s1 = STAGE + FIRST + 1.0 + 2.0, STAGE + LAST + 3.0 + 4.0 + 0.5  # the last stage swaps the predictions
    # GPU g runs group g // 2's stage g % 2 and VAE slice g of the cut 1,4,5.
    by_hand = [s0 + VAE[0], s1 + sum(VAE[1:4]), s0 + VAE[4], s1 + sum(VAE[5:])]
    assert [row["gpu_ms"][str(g)] for g in range(4)] == pytest.approx(by_hand, abs=1e-3)
    assert row["bottleneck_ms"] == pytest.approx(max(by_hand))
    assert row["fps"] == pytest.approx(4000 / max(by_hand))

    best = predict.cfg_parallel(profile, 2, exchange_ms=0.5, best=True)
    assert best["bottleneck_ms"] < row["bottleneck_ms"]
    again = predict.cfg_parallel(
        profile, 2, exchange_ms=0.5, counts=[int(c) for c in best["partition"].split(",")], vae_split=best["vae_split"]
    )
    assert again["bottleneck_ms"] == pytest.approx(best["bottleneck_ms"])


def test_sequence_parallel_ranks_run_the_simulators_sp_cost_beside_their_vae_slice():
    profile = tiny_profile()
    row = predict.sequence_parallel(profile, tiny_attention(), 2, 2)
    growth = (14.0 / 8.0 - 1) / 3
    assert row["growth"] == pytest.approx(growth)
    eager = [2 * 8.0 / 2 + STAGE + FIRST, 2 * 8.0 / 2 + STAGE + LAST]  # 2 of the 2 timed blocks' eager ms per stage
    assert row["eager_stage_ms"] == pytest.approx(eager)
    a2a = row["a2a_ms_per_forward"]
    rank = [eager[p] * ((1 - growth) + growth / 2) + a2a[p] for p in range(2)]  # coordinator.simulator's SP model
    by_hand = [rank[0] + VAE[0], rank[0] + sum(VAE[1:4]), rank[1] + VAE[4], rank[1] + sum(VAE[5:])]
    assert [row["gpu_ms"][str(g)] for g in range(4)] == pytest.approx(by_hand, rel=1e-3)
    assert row["bottleneck_ms"] == pytest.approx(max(by_hand), rel=1e-3)


def test_a_derived_profile_takes_the_graphed_blocks_and_the_base_fixed_work_and_vae(tmp_path):
    base = tiny_profile()
    derived = predict.derive_profile(base, tiny_attention(graphed=6.0), "tiny-wan2.1")
    assert derived.blocks_ms == [3.0] * 4  # 6 ms over the 2 timed blocks, for all 4
    assert (derived.stage_ms, derived.first_ms, derived.last_ms) == (STAGE, FIRST, LAST)
    assert derived.vae_units == base.vae_units and derived.device == "cpu (derived)"
    derived.save(tmp_path / "p.json")
    assert BalanceProfile.load(tmp_path / "p.json").blocks_ms == [3.0] * 4
    with pytest.raises(ValueError, match="wan2.2"):
        predict.derive_profile(base, tiny_attention(), "wan2.2-ti2v-5b")


def test_the_committed_14b_profile_is_the_derived_one(tmp_path):
    out = tmp_path / "p14.json"
    assert predict.main(["--write-profile", "wan2.1-14b", str(out)]) == 0
    committed = json.loads((predict.RESULTS / "balance_14b_1step_derived.json").read_text())
    assert json.loads(out.read_text()) == committed
    attention = json.loads((predict.RESULTS / predict.ATTENTION).read_text())
    ms, blocks = predict.attention_ms(attention, "wan2.1-14b")
    assert committed["dit"]["blocks_ms"] == [ms / blocks] * 40


def test_the_table_in_benchmarks_md_is_what_the_committed_measurements_give(tmp_path):
    out = tmp_path / "rows.json"
    assert predict.main(["--json", str(out)]) == 0
    rows = {(r["model"], r["gpus"], r["topology"]): r for r in json.loads(out.read_text())}
    text = (Path(__file__).resolve().parent.parent / "BENCHMARKS.md").read_text()
    for line in predict.table(list(rows.values()))[2:]:
        assert line in text
    assert rows["1.3B", 4, "PP=4, planner"]["fps"] == pytest.approx(135.5, abs=0.05)
    assert rows["14B", 4, "PP=4, planner"]["fps"] == pytest.approx(84.5, abs=0.05)
    assert rows["1.3B", 2, "PP=2, even + MAC cut"]["measured_fps"] == pytest.approx(70.9, abs=0.05)
