"""``--sp``: a stage as a group of sequence-parallel ranks (real processes, gRPC, gloo on loopback) reproduces the
reference executor's run of the same shard layout bit for bit; layouts that cannot run are refused at start-up."""

import json
import subprocess
import sys

import grpc
import pytest
import torch

from coordinator.registry import RegistrationError, StageRegistry
from launcher.demo_checkpoint import write_demo_checkpoint
from launcher.process import Launcher
from launcher.selftest import SelftestConfig, execute_selftest
from stagecast.model.dit_configs import model_config
from tests.cli_run import run_cli

CASES = [
    # stages, sp, policy, streams, window, sink
    (1, 2, "clean", 2, None, 0),
    (2, 2, "per_level", 2, 2, 1),
]


@pytest.mark.multiprocess
@pytest.mark.parity
@pytest.mark.parametrize("stages,sp,policy,streams,window,sink", CASES)
def test_sequence_parallel_run_equals_the_sharded_reference_bit_for_bit(stages, sp, policy, streams, window, sink):
    cfg = SelftestConfig(
        stages=stages, sp=sp, policy=policy, streams=streams, chunks=3, steps=2, window=window, sink=sink, batch=3
    )
    with Launcher() as launcher:
        result = execute_selftest(cfg, launcher)
    assert set(result.chunks) == set(result.reference) and len(result.chunks) == streams
    for sid, want in result.reference.items():
        got = result.chunks[sid]
        assert len(got) == len(want) > 0
        for g, w in zip(got, want):
            assert g.dtype == w.dtype and g.shape == w.shape
            assert (g == w).all(), f"stream {sid}: max diff {(g - w).abs().max()}"
    assert result.ok and result.max_diff == 0.0
    if policy == "per_level":
        assert any(ev.kind == "batch" and len(ev.steps) > 1 for ev in result.plan), "no Stream Batch was exercised"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_demo_checkpoint(tmp_path_factory.mktemp("ckpt") / "demo")


@pytest.mark.unit
def test_a_stage_whose_heads_do_not_split_over_sp_exits_2_at_start_up(checkpoint):
    heads = json.loads((checkpoint / "transformer" / "config.json").read_text())["num_attention_heads"]
    sp = heads + 1
    args = ["stage", "--index", "0", "--coordinator", "127.0.0.1:1", "--checkpoint", str(checkpoint), "--port", "0"]
    proc = run_cli(*args, "--sp", str(sp), "--insecure-internal")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"stagecast stage: error: --sp {sp}: the model has {heads} attention heads" in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = run_cli(*args, "--sp", "2", "--sp-rank", "2", "--insecure-internal")
    assert proc.returncode == 2 and "--sp-rank: must be in [0, 2), got 2" in proc.stderr


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--stages", "1", "--sp", "3"], "--sp 3: the model has 2 attention heads"),
        pytest.param(
            ["--stages", "2", "--sp", "2", "--device", "cuda"],
            "--stages 2 × --sp 2 = 4 ranks, but",
            marks=pytest.mark.skipif(torch.cuda.device_count() == 4, reason="4 GPUs fit this layout"),
        ),
        (["--stages", "1", "--sp", "0"], "--sp must be >= 1, got 0"),
    ],
)
@pytest.mark.unit
def test_up_refuses_a_layout_that_cannot_run_before_starting_anything(checkpoint, flags, message):
    proc = run_cli("up", "--checkpoint", str(checkpoint), "--port", "0", "--gateway-port", "-1", *flags)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"stagecast up: error: {message}" in proc.stderr and "Traceback" not in proc.stderr
    assert "stage-0" not in proc.stdout + proc.stderr  # nothing was started


@pytest.mark.unit
def test_selftest_refuses_a_layout_that_cannot_run_before_starting_anything():
    proc = run_cli("selftest", "--stages", "1", "--sp", "3")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "stagecast selftest: error: --sp 3: the model has 2 attention heads" in proc.stderr
    assert "Traceback" not in proc.stderr
    if torch.cuda.device_count() != 4:
        proc = run_cli("selftest", "--stages", "2", "--sp", "2", "--device", "cuda")
        assert proc.returncode == 2 and "--stages 2 × --sp 2 = 4 ranks, but" in proc.stderr


@pytest.mark.unit
def test_the_coordinator_registers_ranks_and_refuses_a_stage_of_another_sp():
    config = json.dumps(model_config("tiny-wan2.1"))
    reg = StageRegistry(world_size=2, sp=2)
    records = [
        reg.register(index=i, address=f"h:{i}", config_json=config, expected_world_size=2, device="cpu", sp=2)
        for i in range(4)
    ]
    assert [r.layers for r in records] == [range(0, 2), range(0, 2), range(2, 4), range(2, 4)]
    assert reg.complete and reg.ranks == 4
    with pytest.raises(RegistrationError, match="runs --sp 1 but this coordinator runs --sp 2") as err:
        StageRegistry(world_size=2, sp=2).register(
            index=0, address="h:0", config_json=config, expected_world_size=0, device="cpu", sp=1
        )
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(RegistrationError, match=r"--sp 4: the model has 2 attention heads"):
        StageRegistry(world_size=1, sp=4).register(
            index=0, address="h:0", config_json=config, expected_world_size=0, device="cpu", sp=4
        )
    with pytest.raises(RegistrationError, match=r"stage index 4 is out of range for 2 stages × --sp 2 \(0..3\)"):
        StageRegistry(world_size=2, sp=2).register(
            index=4, address="h:4", config_json=config, expected_world_size=0, device="cpu", sp=2
        )


@pytest.mark.multiprocess
def test_all_to_all_benchmark_runs_on_gloo_and_predicts_both_4_gpu_topologies(tmp_path):
    out = tmp_path / "sp.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.sp_bench", "--cpu", "--gpus", "2", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    (row,) = result["rows"]
    assert row["sp"] == 2 and row["per_layer_ms"] > 0
    assert row["per_forward_ms"] == pytest.approx(row["layers"] * row["per_layer_ms"] + row["gather_ms"])
    assert result["fit"]["latency_us"] >= 0 and result["fit"]["gbps"] > 0
    topologies = {(p["model"], p["topology"]) for p in result["predictions_4gpu"]}
    assert topologies == {(m, t) for m in ("wan2.1-1.3b", "wan2.1-14b") for t in ("PP=4", "PP=2×SP=2")}
    assert "all_to_all_single fit" in proc.stdout


@pytest.mark.multiprocess
def test_losing_one_rank_of_a_sequence_group_fails_the_stream_and_the_next_generation_serves(tmp_path):
    """PP=2 × SP=2: SIGKILL stage 1's sequence rank 0 mid-stream.  Its sequence peer (blocked in an all-to-all) and
    stage 0's ranks (blocked on the pipeline's links, their peers alive) are all released: the stream ends
    UNAVAILABLE promptly, and once the rank is back a new generation serves a stream to completion."""
    from launcher.demo_checkpoint import write_transformer
    from launcher.local_cluster import start_pipeline
    from stagecast.internal.v1 import pipeline_pb2 as pb
    from tests.pipeline_helpers import (
        coordinator_stub,
        open_request,
        run_stream,
        tiny_spec,
        wait_for_generation,
        wait_until,
    )

    write_transformer(tmp_path / "transformer", seed=0)
    with Launcher() as launcher:
        pipe = start_pipeline(launcher, checkpoint=str(tmp_path / "transformer"), stages=2, sp=2)
        assert sorted(pipe.stage_children) == [0, 1, 2, 3]
        channel, stub = coordinator_stub(pipe.coordinator, launcher)
        assert stub.Status(pb.Empty()).generation == 1
        events = stub.OpenStream(open_request(tiny_spec(num_chunks=100_000)), timeout=120)
        with pytest.raises(grpc.RpcError) as info:
            for ev in events:
                if ev.WhichOneof("event") == "chunk":
                    pipe.stage_children[2].proc.kill()
                    break
            for _ in events:
                pass
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "generation 1" in info.value.details()
        # No traceback at any survivor, and at most one line about the data plane (the executor's, naming the peer, or
        # the coordinator's reason as it leaves), whichever peer's loss reached it first.
        survivors = [pipe.stage_children[rank] for rank in (0, 1, 3)]
        for child in survivors:
            wait_until(lambda c=child: any("leaving generation 1" in line for line in c.log), 30, what="leaving")
        for child in survivors:
            log = list(child.log)
            assert not [line for line in log if "Traceback" in line], "\n".join(log[-30:])
            assert len([line for line in log if "data plane" in line]) <= 1, "\n".join(log[-30:])
        launcher.spawn("stage-1-sp0-restarted", pipe.stage_args[2])
        status = wait_for_generation(pipe.coordinator, 2, launcher)
        assert status.ready and status.generation >= 2
        chunks, reason = run_stream(stub, tiny_spec(num_chunks=3))
        assert reason == "completed" and len(chunks) == 3
        # Every rank reports the time its forwards spent in the sequence group's exchanges (part of the forward).
        stats = {st.index: st for st in stub.Status(pb.Empty(), timeout=10).stage_stats}
        assert sorted(stats) == [0, 1, 2, 3]
        for st in stats.values():
            assert st.batches > 0 and 0 < st.exchange_ms_total < st.forward_ms_total
        channel.close()
    assert all(child.proc.poll() is not None for child in [pipe.coordinator_child, *pipe.stage_children.values()])
