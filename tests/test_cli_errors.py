"""A service that cannot start from its flags exits 2 with one line naming the problem, not a traceback."""

import pytest

from launcher.demo_checkpoint import write_demo_checkpoint
from tests.cli_run import run_cli

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_demo_checkpoint(tmp_path_factory.mktemp("ckpt") / "demo")


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--vae-devices", "gpu0"], "stagecast gateway: error: VAE device 'gpu0' is not a device name"),
        (["--vae-devices", "cpu,cpu", "--vae-split", "0"], "stagecast gateway: error: boundaries [0] must lie in"),
        (["--vae-graph-slots", "65"], "stagecast gateway: error: --vae-graph-slots must be in [0, 64], got 65"),
        (
            ["--vae-cuda-graphs", "--vae-stage", "127.0.0.1:1"],
            "stagecast gateway: error: --vae-cuda-graphs is for the in-process VAE",
        ),
    ],
)
def test_gateway_with_bad_vae_flags_exits_2_with_the_reason(checkpoint, flags, message):
    args = ["gateway", "--coordinator", "127.0.0.1:1", "--checkpoint", str(checkpoint), "--port", "0"]
    proc = run_cli(*args, "--insecure-internal", *flags)
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr


def test_stage_with_a_missing_checkpoint_exits_2_naming_it(tmp_path):
    missing = tmp_path / "nowhere"
    args = ["stage", "--index", "0", "--coordinator", "127.0.0.1:1", "--checkpoint", str(missing)]
    proc = run_cli(*args, "--insecure-internal")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "stagecast stage: error:" in proc.stderr and "nowhere" in proc.stderr and "Traceback" not in proc.stderr


def test_stage_with_a_calibration_budget_out_of_range_exits_2_naming_the_flag(checkpoint):
    args = ["stage", "--index", "0", "--coordinator", "127.0.0.1:1", "--checkpoint", str(checkpoint)]
    proc = run_cli(*args, "--insecure-internal", "--calibration-s", "-1")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "stagecast stage: error: --calibration-s: must be in [0, 600]" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("value", ["-1", "nan"])
def test_stage_with_a_kv_budget_out_of_range_exits_2_naming_the_flag(checkpoint, value):
    args = ["stage", "--index", "0", "--coordinator", "127.0.0.1:1", "--checkpoint", str(checkpoint)]
    proc = run_cli(*args, "--insecure-internal", "--kv-budget-gib", value)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "stagecast stage: error: --kv-budget-gib: must be in [0, " in proc.stderr
    assert "Traceback" not in proc.stderr


def test_coordinator_with_a_negative_vae_cost_exits_naming_the_flag():
    proc = run_cli("coordinator", "--stages", "1", "--port", "0", "--insecure-internal", "--vae-ms-per-chunk", "-3")
    assert proc.returncode != 0 and "--vae-ms-per-chunk: must be in [0, 100000)" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--dit-levers", "fused,warp"], "--dit-levers: unknown lever(s) warp"),
        (["--dit-levers", "fp8", "--fp8"], "--dit-levers fp8 and --fp8 both turn the block linears to float8"),
    ],
)
def test_up_with_bad_dit_levers_exits_2_naming_the_flag_before_anything_starts(checkpoint, flags, message):
    proc = run_cli("up", "--checkpoint", str(checkpoint), "--port", "0", "--gateway-port", "-1", *flags)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert "READY" not in proc.stdout  # nothing was started


def test_up_passes_dit_levers_to_every_stage(checkpoint, monkeypatch):
    import argparse

    import launcher.local_cluster as local_cluster
    from launcher import pipeline_start

    seen = {}
    monkeypatch.setattr(local_cluster, "start_pipeline", lambda launcher, **kw: seen.update(kw) or "pipe")
    args = argparse.Namespace(
        pace_grid=False,
        stage_ms=None,
        slo_learn=False,
        checkpoint=str(checkpoint),
        stages=1,
        device="cpu",
        dtype="float32",
        max_batch=4,
        host="127.0.0.1",
        cuda_graphs=False,
        fp8=False,
        loras=[],
        sp=1,
        cfg_parallel=1,
        dit_levers="fused",
    )
    plan = pipeline_start.Plan(placement=None, partition=None, vae_split=None)
    assert pipeline_start.start_stages(None, args, plan, port=0, metrics_port=0, health_port=-1) == "pipe"
    assert seen["stage_extra_args"] == ["--dit-levers", "fused"]
    args.dit_levers = ""
    pipeline_start.start_stages(None, args, plan, port=0, metrics_port=0, health_port=-1)
    assert seen["stage_extra_args"] == []  # the exact default path: no lever flag at all
