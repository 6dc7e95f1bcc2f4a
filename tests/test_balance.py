"""The balance planner picks the stage partition and the VAE cut with the smallest busiest-GPU time (checked
against brute force), the profile format refuses bad files naming the field, and the CPU profile script measures
a tiny model."""

import itertools
import json
import math
import random

import pytest

from stagecast.model.balance import BalanceCosts, BalanceError, evaluate, plan_balance
from stagecast.model.balance_profile import BalanceProfile, BalanceProfileError
from stagecast.model.partition import even_partition


def _ns(ms: float) -> int:
    return round(ms * 1_000_000)


def brute_force(costs: BalanceCosts, stage_gpus, vae_gpus, counts=None):
    """Every contiguous partition and every VAE cut, ranked by (largest GPU time, sum of squared GPU times, counts,
    split), in whole nanoseconds: the planner's documented order, computed the slow way."""
    n, stages, units = len(costs.blocks_ms), len(stage_gpus), len(costs.vae_units_ms)
    best = None
    partitions = (
        [list(counts)]
        if counts is not None
        else [
            [b - a for a, b in itertools.pairwise([0, *cuts, n])]
            for cuts in itertools.combinations(range(1, n), stages - 1)
        ]
    )
    splits = list(itertools.combinations(range(1, units), len(vae_gpus) - 1)) if vae_gpus else [()]
    for part in partitions:
        for split in splits:
            load = {}
            start = 0
            for k, c in enumerate(part):
                t = _ns(costs.stage_ms) + sum(_ns(x) for x in costs.blocks_ms[start : start + c])
                t += _ns(costs.first_ms) if k == 0 else 0
                t += _ns(costs.last_ms) if k == stages - 1 else 0
                load[stage_gpus[k]] = load.get(stage_gpus[k], 0) + t
                start += c
            for j, (a, b) in enumerate(itertools.pairwise([0, *split, units]) if vae_gpus else []):
                load[vae_gpus[j]] = load.get(vae_gpus[j], 0) + sum(_ns(x) for x in costs.vae_units_ms[a:b])
            key = (max(load.values()), sum(t * t for t in load.values()), part, list(split))
            if best is None or key < best:
                best = key
    return best


def random_case(rng: random.Random):
    n = rng.randint(1, 9)
    stages = rng.randint(1, min(n, 4))
    units = rng.randint(0, 7)
    gpus = list(range(stages + rng.randint(0, 1)))  # sometimes a GPU with VAE slices only
    stage_gpus = rng.sample(gpus, stages)
    slices = rng.randint(0, min(units, 4)) if units else 0
    vae_gpus = [rng.choice(gpus) for _ in range(slices)]  # several slices may share a GPU
    grain = rng.choice([1.0, 0.5, 0.001])  # coarse grains make ties, which the order must break
    costs = BalanceCosts(
        blocks_ms=[round(rng.uniform(0, 5) / grain) * grain for _ in range(n)],
        vae_units_ms=[round(rng.uniform(0, 12) / grain) * grain for _ in range(units)],
        stage_ms=rng.choice([0.0, 0.3]),
        first_ms=rng.uniform(0, 1),
        last_ms=rng.uniform(0, 2),
    )
    return costs, stage_gpus, vae_gpus


@pytest.mark.unit
def test_the_plan_is_the_brute_force_optimum_with_its_tie_break_on_random_small_cases():
    rng = random.Random(15)
    for _ in range(250):
        costs, stage_gpus, vae_gpus = random_case(rng)
        plan = plan_balance(costs, stage_gpus, vae_gpus)
        bottleneck, _, counts, split = brute_force(costs, stage_gpus, vae_gpus)
        assert (plan.counts, plan.vae_split) == (counts, split), (costs, stage_gpus, vae_gpus)
        assert _ns(plan.bottleneck_ms) == bottleneck
        # What the plan reports is what its own partition and cut cost.
        again = evaluate(costs, plan.counts, plan.vae_split, stage_gpus, vae_gpus)
        assert again.gpu_ms == plan.gpu_ms and again.bottleneck_ms == plan.bottleneck_ms


@pytest.mark.unit
def test_with_a_given_partition_only_the_vae_cut_is_chosen_and_it_is_the_best_for_it():
    rng = random.Random(16)
    for _ in range(100):
        costs, stage_gpus, vae_gpus = random_case(rng)
        counts = even_partition(len(costs.blocks_ms), len(stage_gpus))
        plan = plan_balance(costs, stage_gpus, vae_gpus, counts=counts)
        bottleneck, _, _, split = brute_force(costs, stage_gpus, vae_gpus, counts=counts)
        assert plan.counts == counts and plan.vae_split == split and _ns(plan.bottleneck_ms) == bottleneck


@pytest.mark.unit
def test_the_plan_is_deterministic_and_never_worse_than_the_even_split():
    rng = random.Random(17)
    for _ in range(50):
        costs, stage_gpus, vae_gpus = random_case(rng)
        plans = {repr(plan_balance(costs, stage_gpus, vae_gpus)) for _ in range(3)}
        assert len(plans) == 1
        even = plan_balance(costs, stage_gpus, vae_gpus, counts=even_partition(len(costs.blocks_ms), len(stage_gpus)))
        assert plan_balance(costs, stage_gpus, vae_gpus).bottleneck_ms <= even.bottleneck_ms


@pytest.mark.unit
def test_the_largest_sizes_plan_in_seconds():
    """40 blocks over 8 GPUs with 24 decoder units in 8 slices, and the degenerate case where every cut ties."""
    import time

    rng = random.Random(18)
    gpus = [f"cuda:{i}" for i in range(8)]
    for units in ([rng.uniform(0, 10) for _ in range(24)], [0.0] * 24):
        costs = BalanceCosts(blocks_ms=[rng.uniform(0.4, 0.6) for _ in range(40)], vae_units_ms=units, stage_ms=0.3)
        start = time.perf_counter()
        plan = plan_balance(costs, gpus, gpus)
        assert time.perf_counter() - start < 20
        assert sum(plan.counts) == 40 and len(plan.vae_split) == 7


@pytest.mark.parametrize(
    "make,field",
    [
        (lambda: BalanceCosts(blocks_ms=[1.0, -0.5]), "blocks_ms[1]"),
        (lambda: BalanceCosts(blocks_ms=[1.0, math.nan]), "blocks_ms[1]"),
        (lambda: BalanceCosts(blocks_ms=[1.0], vae_units_ms=[1.0, math.inf]), "vae_units_ms[1]"),
        (lambda: BalanceCosts(blocks_ms=[1.0], last_ms=-1), "last_ms"),
        (lambda: BalanceCosts(blocks_ms=[1.0], stage_ms="3"), "stage_ms"),
        (lambda: BalanceCosts(blocks_ms=[]), "blocks_ms"),
        (lambda: BalanceCosts(blocks_ms=[1e9]), "blocks_ms[0]"),
        (lambda: plan_balance(BalanceCosts(blocks_ms=[1.0, 1.0]), ["a", "b", "c"]), "stage_gpus"),
        (lambda: plan_balance(BalanceCosts(blocks_ms=[1.0, 1.0]), ["a", "a"]), "stage_gpus"),
        (lambda: plan_balance(BalanceCosts(blocks_ms=[1.0], vae_units_ms=[1.0]), ["a"], ["a", "b"]), "vae_gpus"),
        (lambda: plan_balance(BalanceCosts(blocks_ms=[1.0, 1.0]), ["a", "b"], counts=[2, 1]), "counts"),
        (
            lambda: evaluate(BalanceCosts(blocks_ms=[1.0], vae_units_ms=[1, 1]), [1], [2], ["a"], ["a", "b"]),
            "vae_split",
        ),
    ],
)
@pytest.mark.unit
def test_bad_planner_input_is_refused_naming_the_field(make, field):
    with pytest.raises(BalanceError) as err:
        make()
    assert str(err.value).startswith(f"{field}:")


# ---- the profile format ----------------------------------------------------------------------------------


def profile_json(**over) -> dict:
    data = BalanceProfile(
        model="tiny-wan2.1",
        dit_config={
            "num_layers": 4,
            "num_attention_heads": 2,
            "attention_head_dim": 12,
            "ffn_dim": 48,
            "in_channels": 16,
        },
        blocks_ms=[5.0, 1.0, 1.0, 1.0],
        vae_units=[
            (n, 1.0)
            for n in ("conv_in", "mid_block", "up_blocks.0", "up_blocks.1", "up_blocks.2", "up_blocks.3", "head")
        ],
        stage_ms=0.1,
        width=48,
        height=32,
        text_len=16,
        dtype="float32",
        device="cpu",
    ).to_json()
    data.update(over)
    return data


@pytest.mark.unit
def test_a_profile_round_trips_through_its_json(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(profile_json()))
    profile = BalanceProfile.load(path)
    assert profile.to_json() == profile_json()
    assert profile.costs().blocks_ms == (5.0, 1.0, 1.0, 1.0) and len(profile.costs().vae_units_ms) == 7


@pytest.mark.parametrize(
    "edit,field",
    [
        (lambda d: d.update(format="something"), "format"),
        (lambda d: d.update(version=2), "version"),
        (lambda d: d.pop("model"), "model"),
        (lambda d: d["dit"]["blocks_ms"].__setitem__(2, -1.0), "dit.blocks_ms[2]"),
        (lambda d: d["dit"]["blocks_ms"].__setitem__(2, "fast"), "dit.blocks_ms[2]"),
        (lambda d: d["dit"]["blocks_ms"].pop(), "dit.blocks_ms"),
        (lambda d: d["dit_config"].update(num_layers=0), "dit_config.num_layers"),
        (lambda d: d["vae"]["units"][1].update(ms=None), "vae.units[1].ms"),
        (lambda d: d["vae"]["units"].__setitem__(0, "conv_in"), "vae.units[0]"),
        (lambda d: d.update(steps=0), "steps"),
        (lambda d: d.update(dtype="int8"), "dtype"),
        (lambda d: d.update(cuda_graphs="yes"), "cuda_graphs"),
        (lambda d: d["dit"].pop("last_ms"), "dit.last_ms"),
    ],
)
@pytest.mark.unit
def test_a_bad_profile_is_refused_naming_the_field(tmp_path, edit, field):
    data = profile_json()
    edit(data)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    with pytest.raises(BalanceProfileError) as err:
        BalanceProfile.load(path)
    assert f"{path}: {field}:" in str(err.value)


@pytest.mark.unit
def test_a_profile_that_is_not_json_missing_or_too_large_is_refused(tmp_path):
    for content, why in ((b"{not json", "not JSON"), (b"[]", "(top level)"), (b" " * (2 << 20), "over the limit")):
        path = tmp_path / "p.json"
        path.write_bytes(content)
        with pytest.raises(BalanceProfileError, match=why.replace("(", r"\(").replace(")", r"\)")):
            BalanceProfile.load(path)
    with pytest.raises(BalanceProfileError, match="cannot read"):
        BalanceProfile.load(tmp_path / "absent.json")


@pytest.mark.unit
def test_a_profile_of_another_model_or_decoder_is_refused_naming_the_field():
    from stagecast.model.dit_configs import model_config

    profile = BalanceProfile.from_json(profile_json())
    profile.check_model(name="tiny-wan2.1", config=model_config("tiny-wan2.1"))
    with pytest.raises(BalanceProfileError, match=r"model: measured on 'tiny-wan2.1'"):
        profile.check_model(name="wan2.1-1.3b")
    with pytest.raises(BalanceProfileError, match=r"dit_config.num_layers: the profile's block count is 4"):
        profile.check_model(config=model_config("tiny-wan2.1", num_layers=6))
    with pytest.raises(BalanceProfileError, match=r"dit_config.ffn_dim"):
        profile.check_model(config=model_config("tiny-wan2.1", ffn_dim=64))
    with pytest.raises(BalanceProfileError, match=r"vae.units"):
        profile.check_vae_units(["conv_in", "head"])
    with pytest.raises(BalanceProfileError, match=r"steps: measured at 1, this run uses 2"):
        profile.check_run(steps=2)


# ---- the profile script, on a CPU ------------------------------------------------------------------------


@pytest.mark.multiprocess
def test_the_profile_script_measures_every_block_and_vae_unit_of_the_tiny_model(tmp_path, capsys):
    from diffusers import AutoencoderKLWan

    from benchmarks.balance import main
    from gateway.decode.stream_vae import decoder_units
    from stagecast.model.vae_configs import vae_config

    out = tmp_path / "tiny.json"
    assert main(["--model", "tiny-wan2.1", "--device", "cpu", "--out", str(out)]) == 0
    profile = BalanceProfile.load(out)
    units = [u.name for u in decoder_units(AutoencoderKLWan(**vae_config("tiny-wan2.1")))]
    assert profile.model == "tiny-wan2.1" and profile.device == "cpu" and profile.dtype == "float32"
    assert (profile.width, profile.height, profile.window, profile.sink, profile.steps) == (48, 32, 6, 3, 1)
    # Block times are differences of stage times, so on a loaded CPU the cheapest may read 0; their sum may not.
    assert len(profile.blocks_ms) == 4 and all(t >= 0 for t in profile.blocks_ms) and sum(profile.blocks_ms) > 0
    assert [n for n, _ in profile.vae_units] == units and all(t > 0 for _, t in profile.vae_units)
    printed = capsys.readouterr().out
    plan = plan_balance(profile.costs(), ["cuda:0", "cuda:1"], ["cuda:0", "cuda:1"])
    assert f"balanced: --partition {plan.partition} --vae-split {plan.vae_split[0]}" in printed
    with pytest.raises(SystemExit):
        main(["--model", "tiny-wan2.1", "--steps", "5", "--out", str(out)])


@pytest.mark.unit
def test_a_coordinator_given_partition_auto_says_where_auto_is_planned():
    from stagecast.model.partition import parse_partition

    with pytest.raises(ValueError, match="--balance-profile"):
        parse_partition("auto", 30, 2)
