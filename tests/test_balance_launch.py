"""``--partition auto --balance-profile``: up hands the planner's one answer to the coordinator (layers per stage) and
the gateway (VAE cut); a profile of another model is refused before anything starts; simulate prices stages by it."""

import json
import tempfile

import pytest

import stagecast
from launcher.balance import lanes, resolve_balance
from launcher.demo_checkpoint import write_demo_checkpoint
from launcher.process import Launcher
from stagecast.model.balance import plan_balance
from stagecast.model.balance_profile import BalanceProfile
from tests.cli_run import run_cli
from tests.test_balance import profile_json


def write_profile(folder, **over) -> str:
    path = f"{folder}/profile.json"
    with open(path, "w") as f:
        json.dump(profile_json(**over), f)
    return path


@pytest.mark.unit
def test_the_launcher_plans_stages_and_vae_slices_over_the_stage_devices(tmp_path):
    root = write_demo_checkpoint(tmp_path / "ckpt")
    profile = write_profile(tmp_path)
    costs = BalanceProfile.load(profile).costs()
    gpus = ["cuda:0", "cuda:1"]
    choice = resolve_balance(
        profile, transformer=str(root / "transformer"), stage_devices=gpus, vae_folder=root / "vae", vae_devices=gpus
    )
    want = plan_balance(costs, gpus, gpus)
    assert (choice.partition, choice.vae_split) == (want.partition, want.vae_split)
    # Stages sharing one device (a CPU run) get a lane each; one VAE part sits with the last stage (the gateway).
    assert lanes(["cpu", "cpu"], ["cpu"]) == (["lane 0", "lane 1"], ["lane 1"])
    assert lanes(["cpu"] * 3, ["cpu", "cpu"]) == (["lane 0", "lane 1", "lane 2"], ["lane 0", "lane 1"])
    # Without a VAE folder (no gateway) only the DiT is planned.
    alone = resolve_balance(profile, transformer="random:tiny-wan2.1", stage_devices=gpus)
    assert alone.partition == plan_balance(costs, gpus).partition and alone.vae_split is None


@pytest.mark.unit
def test_up_refuses_auto_without_a_profile_and_a_profile_of_another_model_before_starting_anything(tmp_path):
    root = write_demo_checkpoint(tmp_path / "ckpt")
    base = ["up", "--checkpoint", str(root), "--port", "0", "--gateway-port", "0"]
    three = profile_json()
    three["dit_config"]["num_layers"], three["dit"]["blocks_ms"] = 3, [1.0, 1.0, 1.0]
    units = profile_json()
    units["vae"]["units"] = units["vae"]["units"][:-1]
    (tmp_path / "three.json").write_text(json.dumps(three))
    (tmp_path / "units.json").write_text(json.dumps(units))
    cases = [
        (["--partition", "auto"], "--partition auto needs --balance-profile"),
        (["--balance-profile", write_profile(tmp_path)], "--balance-profile is read with --partition auto"),
        (
            ["--partition", "auto", "--balance-profile", str(tmp_path / "three.json")],
            "dit_config.num_layers: the profile's block count is 3, the deployment's model has 4",
        ),
        (["--partition", "auto", "--balance-profile", str(tmp_path / "units.json")], "vae.units:"),
    ]
    for flags, message in cases:
        done = run_cli(*base, *flags, "--web-port", "-1")
        assert done.returncode == 2, done.stderr
        assert message in done.stderr and "Traceback" not in done.stderr
        assert "[coordinator]" not in done.stdout + done.stderr  # nothing was started


@pytest.mark.multiprocess
def test_up_with_an_auto_partition_gives_the_stages_and_the_gateway_one_plan_and_serves():
    with tempfile.TemporaryDirectory() as tmp, Launcher() as launcher:
        write_demo_checkpoint(tmp)
        profile = write_profile(tmp)  # block 0 is slow: the planner gives it a stage of its own
        plan = plan_balance(BalanceProfile.load(profile).costs(), ["lane 0", "lane 1"], ["lane 0", "lane 1"])
        args = ["up", "--checkpoint", tmp, "--stages", "2", "--port", "0", "--gateway-port", "0", "--web-port", "-1"]
        args += ["--partition", "auto", "--balance-profile", profile, "--vae-devices", "cpu,cpu"]
        up = launcher.spawn("up", [*args, "--credentials", launcher.credentials])
        with stagecast.Client(up.info["gateway"]) as client:
            frames = client.generate(prompt="a red fox", seconds=0.5, codec="raw").collect()
        assert len(frames) == 8
        log = "\n".join(up.log)
        assert f"--partition {plan.partition} --vae-split {plan.vae_split[0]}" in log
        first = plan.counts[0]
        assert f"stage 0 loaded layers 0:{first}" in log and f"stage 1 loaded layers {first}:4" in log
        assert f"VAE decoder split over cpu, cpu at units [{plan.vae_split[0]}]" in log


@pytest.mark.unit
def test_simulate_takes_stage_times_and_the_vae_from_a_profile(tmp_path, capsys):
    from launcher.cli import main

    profile = write_profile(tmp_path)
    costs = BalanceProfile.load(profile).costs()
    assert main(["simulate", "--balance-profile", profile, "--stages", "2", "--chunks", "32", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    plan = plan_balance(costs, ["cuda:0", "cuda:1"], ["cuda:0", "cuda:1"])
    balance = report["balance"]
    assert (balance["partition"], balance["vae_split"]) == (plan.partition, plan.vae_split)
    assert report["config"]["stage_ms"] == plan.stage_ms and report["config"]["steps"] == 1
    assert balance["predicted_chunks_per_second"] <= 1e3 / plan.bottleneck_ms + 1e-9
    assert main(["simulate", "--balance-profile", profile, "--partition", "2,2", "--chunks", "32"]) == 0
    assert "chosen: --partition 2,2" in capsys.readouterr().out
    assert main(["simulate", "--balance-profile", profile, "--steps", "4"]) == 2
    assert "--steps 4" in capsys.readouterr().err


@pytest.mark.unit
def test_the_harness_plans_from_a_profile_that_fits_its_run_and_refuses_one_that_does_not(tmp_path):
    import argparse

    import pytest

    from benchmarks.harness import balance, vae_devices_of, write_assets
    from stagecast.model.balance_profile import BalanceProfileError

    args = argparse.Namespace(
        model="tiny-wan2.1", width=48, height=32, steps=1, stages=2, sp=1, cfg_parallel=1, partition="auto",
        balance_profile=write_profile(tmp_path), vae_split=None, vae_gpus=None, text_encoder="tiny",
    )  # fmt: skip
    write_assets(tmp_path / "root", args)
    partition, vae_split = balance(tmp_path / "root", args, "cpu", vae_devices_of(args, "cpu"))
    plan = plan_balance(BalanceProfile.load(args.balance_profile).costs(), ["lane 0", "lane 1"], ["lane 0", "lane 1"])
    assert (partition, vae_split) == (plan.partition, ",".join(map(str, plan.vae_split)))
    assert args.balance["partition"] == plan.partition and args.balance["predicted_bottleneck_ms"] == plan.bottleneck_ms
    args.steps = 2
    with pytest.raises(BalanceProfileError, match="steps: measured at 1, this run uses 2"):
        balance(tmp_path / "root", args, "cpu", ["cpu", "cpu"])
    args.steps, args.vae_split = 1, "4"
    with pytest.raises(ValueError, match="--vae-split"):
        balance(tmp_path / "root", args, "cpu", ["cpu", "cpu"])
