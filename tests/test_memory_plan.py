"""One memory budget on a shared GPU (issue 48, Build item 4): the budgets a process derives from its share
(``--device-memory-gib``), the plan ``stagecast up`` makes of a shared device (``launcher.memory_plan``), and the
refusals that keep a system that holds no stream from coming up READY.  Numbers are injected: no GPU is touched.

The case that started it: 14B on one H200 (``up --device cuda --stages 1``: stage 0 and the gateway share the GPU).
Each process sized its budget from the device's free memory while the other was still loading: the gateway's
decoder budget came out 0.00 GiB and stage 0's KV budget 1 byte, so every stream was refused.
"""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from gateway.edge.admission import CONTEXT_BYTES as GATEWAY_CONTEXT
from gateway.edge.admission import GIB, DecoderMemory, planned_reserve, share_decoder_budget, share_for_decoder
from launcher import memory_plan
from launcher.demo_checkpoint import UMT5_XXL, write_demo_checkpoint, write_random_text_encoder, write_tiny_vae
from launcher.local_cluster import Placement
from launcher.memory_plan import GatewayPart, Layout, StagePart, layout_parts, plan_device, plan_devices, share_of
from launcher.pipeline_start import Plan, gateway_argv
from stage_service.checkpoint import slice_parameter_bytes
from stage_service.kv_budget import (
    CONTEXT_BYTES,
    GRAPH_FRACTION,
    RESERVE_FRACTION,
    KvBudget,
    kv_budget,
    measure_kv_budget_detail,
    planned_kv_budget,
    share_for_kv,
    share_kv_budget,
    stream_fit_problem,
)
from stagecast.kv_memory import describe_spec, serving_spec, stream_kv_bytes
from stagecast.model.config import DiTConfig
from stagecast.model.dit_configs import model_config

pytestmark = pytest.mark.unit

H200 = 143771 << 20  # what nvidia-smi reports of an H200: 140.4 GiB
CUDA = torch.device("cuda:0")  # a name only: nothing below runs on it


@pytest.fixture(scope="module")
def wan14b():
    """14B's numbers at the benchmark protocol's serving defaults (832x480, 1 step, a 6-frame window)."""
    config = model_config("wan2.1-14b")
    weights = slice_parameter_bytes(config, layers=range(40), first=True, last=True, dtype=torch.bfloat16)
    spec = serving_spec(None, config)
    one_step = type(spec)(**{**spec.__dict__, "timesteps": (1000.0,)})
    kv = stream_kv_bytes(one_step, DiTConfig.from_kwargs(config), layers=40, element_bytes=2)
    text = memory_plan.umt5_parameters({**UMT5_XXL, "feed_forward_proj": "gated-gelu"}) * 2
    return weights, kv, text


def test_the_14b_numbers_are_what_the_h200_run_reported(wan14b):
    weights, kv, text = wan14b
    assert round(kv / GIB, 2) == 8.33  # "the 6-frame window (8.33 GiB) is refused"
    assert 26 < weights / GIB < 27.5 and 10.5 < text / GIB < 10.7  # 14B in bf16; UMT5-XXL's 5.7B in bf16


def test_budgets_from_the_devices_free_memory_depend_on_the_neighbour_and_shares_do_not(wan14b):
    weights, kv, _ = wan14b
    # Today: 125-129 GiB of the GPU in use at idle, read while the other process was still filling it.
    free = H200 - 128 * GIB
    assert kv_budget(0.0, free=free, total=H200, activation_peak=GIB, graph_bytes=int(GRAPH_FRACTION * H200)) == 1
    gateway = DecoderMemory.derive("cuda:0", {"full": 2 * GIB}, (480, 832), free_bytes=lambda: (free, H200))
    assert gateway.budget == 0
    # With a share, a stage counts what it holds itself: the same whatever the neighbour holds at that moment.
    share = 110 * GIB
    graphs = int(GRAPH_FRACTION * share)
    budget = measure_kv_budget_detail(
        CUDA, operator_gib=0, activation_peak=GIB, graph_bytes=graphs, share_gib=110, allocated=weights
    )
    assert budget.bytes == share - weights - CONTEXT_BYTES - GIB - graphs - int(RESERVE_FRACTION * share)
    assert budget.bytes // kv >= 2 and "--device-memory-gib" in budget.origin
    assert budget.bytes == share_kv_budget(share, held=weights, activation_peak=GIB, graph_bytes=graphs)
    # The operator's --kv-budget-gib wins over the share.
    assert measure_kv_budget_detail(CUDA, operator_gib=3, share_gib=110, allocated=weights).bytes == 3 * GIB


def test_share_for_kv_is_the_smallest_share_that_leaves_the_kv(wan14b):
    weights, kv, _ = wan14b
    for graphs in (False, True):
        for streams in (1, 2, 5):
            share = share_for_kv(streams * kv, weights=weights, activation_peak=GIB, cuda_graphs=graphs)
            assert planned_kv_budget(share, weights=weights, activation_peak=GIB, cuda_graphs=graphs) >= streams * kv
            smaller = share - (2 << 20)
            assert planned_kv_budget(smaller, weights=weights, activation_peak=GIB, cuda_graphs=graphs) < streams * kv
    held = 11 * GIB
    for room in (GIB, 7 * GIB, 40 * GIB):
        share = share_for_decoder(room, held)
        assert share_decoder_budget(share, held) >= room > share_decoder_budget(share - (2 << 20), held)


def test_the_gateways_share_counts_its_own_memory(wan14b):
    held = 11 * GIB
    planned = DecoderMemory.derive("cuda:0", {"full": 2 * GIB}, (480, 832), share_gib=16, held_bytes=lambda: held)
    assert planned.budget == 16 * GIB - held - GATEWAY_CONTEXT - planned_reserve(16 * GIB) == 2 * GIB
    assert planned.stream_fit_problem("full", (480, 832)) is None
    assert "its 16.0 GiB share of cuda:0 (--device-memory-gib)" in planned.origin
    assert DecoderMemory.derive("cuda:0", {"full": GIB}, (48, 64), budget_gib=3, share_gib=16).budget == 3 * GIB
    assert DecoderMemory.derive("cpu", {"full": GIB}, (48, 64), share_gib=16).budget is None  # a CPU: unbounded
    with pytest.raises(ValueError, match="--device-memory-gib must be in"):
        DecoderMemory.derive("cpu", {"full": GIB}, (48, 64), share_gib=-1)
    short = DecoderMemory.derive("cuda:0", {"full": 2 * GIB}, (480, 832), free_bytes=lambda: (9 * GIB, H200))
    problem = short.stream_fit_problem("full", (480, 832))
    assert problem.startswith("decoder memory: one 832x480 stream on the full decoder (the default) holds 2.00 GiB")
    assert "--device-memory-gib" in problem and "--default-decoder tiny" in problem


def test_the_14b_h200_plan_leaves_room_for_two_streams(wan14b):
    weights, kv, text = wan14b
    state = memory_plan.decoder_state_bytes("full", 832, 480, 2)
    layout = Layout(
        "", ["cuda:0"], [weights], [kv], cuda_graphs=True, gateway_device="cuda:0", vae_devices=["cuda:0"],
        text_bytes=text, cache_bytes=GIB, vae_bytes=memory_plan.VAE_PARAMS * 2, stream_state=state,
    )  # fmt: skip
    (plan,) = plan_devices({"cuda:0": H200}, layout_parts(layout), "832x480")
    assert plan.problem is None and plan.shared and plan.streams >= 2  # >= 1 is the floor, 2 the goal
    stage, gateway = plan.shares
    assert stage.bytes + gateway.bytes <= H200
    assert stage.room >= 2 * kv and gateway.room >= plan.streams * state
    # What each process derives from its share, with what it holds injected, is what the plan forecast.
    shares = share_of([plan])
    derived = measure_kv_budget_detail(
        CUDA,
        operator_gib=0,
        activation_peak=memory_plan.ACTIVATION_BYTES,
        graph_bytes=int(GRAPH_FRACTION * shares[("", "stage", 0)] * GIB),
        share_gib=shares[("", "stage", 0)],
        allocated=weights,
    )
    assert derived.bytes // kv >= 2
    held = text + GIB + memory_plan.VAE_PARAMS * 2
    gw = DecoderMemory.derive(
        "cuda:0", {"full": state}, (480, 832), share_gib=shares[("", "gateway", "cuda:0")], held_bytes=lambda: held
    )
    assert gw.budget >= plan.streams * state
    line = plan.line()
    assert line.startswith("cuda:0 (140.4 GiB) shared, planned for")
    assert "stage 0" in line and "the gateway" in line and "text encoder 10.6" in line and "graph buffers" in line


def test_a_device_that_holds_no_stream_names_the_parts_and_what_to_move(wan14b):
    weights, kv, text = wan14b
    layout = Layout(
        "", ["cuda:0"], [weights], [kv], cuda_graphs=True, gateway_device="cuda:0", vae_devices=["cuda:0"],
        text_bytes=text, vae_bytes=memory_plan.VAE_PARAMS * 2, stream_state=2 * GIB,
    )  # fmt: skip
    (plan,) = plan_devices({"cuda:0": 60 * GIB}, layout_parts(layout), "832x480, 1 step, a 6-frame window")
    problem = plan.problem
    assert problem is not None and plan.shares == () and share_of([plan]) == {}
    assert problem.startswith("cuda:0 (60.0 GiB): stage 0's 26.7 GiB of weights, its graph buffers")
    assert "the gateway's text encoder 10.6 GiB" in problem
    assert "GiB for stage 0's KV; one stream at 832x480, 1 step, a 6-frame window needs 8.33 GiB" in problem
    assert "put the gateway on another GPU (--gateway-device) or use more stages (--stages)" in problem
    # Without graphs' buffers the same device holds one.
    layout.cuda_graphs = False
    (plan,) = plan_devices({"cuda:0": 60 * GIB}, layout_parts(layout))
    assert plan.problem is None and plan.streams >= 1


def test_a_device_with_one_process_keeps_todays_behaviour(wan14b):
    weights, kv, _ = wan14b
    layout = Layout("", ["cuda:0"], [weights], [kv], cuda_graphs=True)
    (plan,) = plan_devices({"cuda:0": H200}, layout_parts(layout))
    assert not plan.shared and plan.problem is None and share_of([plan]) == {}


def test_the_operators_numbers_win_and_a_too_small_one_is_named(wan14b):
    weights, kv, text = wan14b
    stage = StagePart(("", "stage", 0), "stage 0", "cuda:0", weights, kv, True, kv_room=int(0.5 * GIB))
    gateway = GatewayPart(("", "gateway", "cuda:0"), "the gateway", "cuda:0", (("text encoder", text),), GIB, "full")
    problem = plan_device("cuda:0", H200, [stage, gateway], "832x480").problem
    assert problem == (
        "cuda:0: --kv-budget-gib gives stage 0 0.5 GiB, and one stream at 832x480 needs 8.33 GiB there: raise "
        "--kv-budget-gib or leave it out (0: planned)"
    )
    fixed = StagePart(("", "stage", 0), "stage 0", "cuda:0", weights, kv, True, kv_room=20 * GIB)
    plan = plan_device("cuda:0", H200, [fixed, gateway], "832x480")
    assert plan.problem is None and plan.shares[0].room == 20 * GIB and plan.streams == 2


def test_pipelines_sharing_a_device_are_planned_together(wan14b):
    weights, kv, text = wan14b
    layouts = [
        Layout(
            name,
            ["cuda:0"],
            [weights],
            [kv],
            cuda_graphs=False,
            gateway_device="cuda:0",
            vae_devices=["cuda:0"],
            text_bytes=text,
            vae_bytes=memory_plan.VAE_PARAMS * 2,
            stream_state=64 << 20,
            decoder="tiny",
        )  # fmt: skip
        for name in ("p0", "p1")
    ]
    parts = [p for layout in layouts for p in layout_parts(layout)]
    (plan,) = plan_devices({"cuda:0": H200}, parts)
    assert plan.problem is None and len(plan.shares) == 4 and plan.streams >= 1
    assert sum(s.bytes for s in plan.shares) <= H200
    shares = share_of([plan])
    assert set(shares) == {(p, part, key) for p in ("p0", "p1") for part, key in (("stage", 0), ("gateway", "cuda:0"))}
    assert shares[("p0", "stage", 0)] == shares[("p1", "stage", 0)]
    assert "p0's stage 0" in plan.line() and "p1's gateway" in plan.line()


def test_a_stage_that_holds_no_serving_stream_says_so_at_form(wan14b):
    _, kv, _ = wan14b
    origin = "cuda:0's 12.0 GiB free after loading less ... (a GPU shared with the gateway or another pipeline: ...)"
    problem = stream_fit_problem(KvBudget(1, origin), kv, stage=0, stream="832x480, ...")
    assert problem.startswith("stage 0 holds no stream: one stream at the serving defaults (832x480, ...) needs 8.33")
    assert "it gives streams 1 B" in problem and "--device-memory-gib" in problem and "more stages" in problem
    assert stream_fit_problem(KvBudget(kv, origin), kv, stage=0, stream="") is None
    assert stream_fit_problem(KvBudget(0, "no limit on a CPU"), kv, stage=0, stream="") is None  # a CPU: no limit


def test_the_serving_stream_is_the_checkpoints_defaults(tmp_path):
    config = model_config("wan2.1-1.3b")
    spec = serving_spec(None, config)
    assert (spec.latent_width, spec.latent_height, spec.steps, spec.window, spec.sink) == (104, 60, 4, 6, 3)
    assert describe_spec(spec, 8) == "832x480, 1 latent frame a chunk, 4 steps, a 6-frame window"
    (tmp_path / "stagecast.json").write_text(json.dumps({"width": 64, "height": 48, "steps": 2, "window": 9}))
    spec = serving_spec(tmp_path, config)
    assert (spec.latent_width, spec.latent_height, spec.steps, spec.window, spec.sink) == (8, 6, 2, 9, 0)
    (tmp_path / "stagecast.json").write_text("{")
    with pytest.raises(ValueError, match="stagecast.json: not valid JSON"):
        serving_spec(tmp_path, config)


def test_weights_are_read_from_the_checkpoints_headers_in_the_serving_dtype(tmp_path):
    from safetensors import safe_open

    root = write_demo_checkpoint(tmp_path / "demo")
    for folder in ("text_encoder", "vae"):
        want = 0
        for path in sorted((root / folder).glob("*.safetensors")):
            with safe_open(str(path), "pt") as f:
                for key in f.keys():
                    t = f.get_tensor(key)
                    want += t.numel() * (2 if t.is_floating_point() else t.element_size())
        assert memory_plan.safetensors_bytes(root / folder, 2) == want > 0
    assert memory_plan.safetensors_bytes(tmp_path / "nowhere", 2) is None
    # A config-only text encoder (its weights drawn where it loads): its parameters, as transformers builds it.
    from transformers import UMT5Config, UMT5EncoderModel

    dims = dict(d_model=64, d_kv=16, d_ff=96, num_layers=3, num_heads=4, vocab_size=500)
    with torch.device("meta"):
        model = UMT5EncoderModel(UMT5Config(**dims, feed_forward_proj="gated-gelu"))
    assert memory_plan.umt5_parameters({**dims, "feed_forward_proj": "gated-gelu"}) == sum(
        p.numel() for p in model.parameters()
    )


@pytest.fixture(scope="module")
def checkpoint_14b(tmp_path_factory):
    """14B's real transformer config and text encoder config (random weights, drawn where they load), a small VAE,
    and the benchmark protocol's serving defaults: what the GPU runs serve."""
    root = tmp_path_factory.mktemp("ckpt14b")
    (root / "transformer").mkdir()
    (root / "transformer" / "config.json").write_text(json.dumps(model_config("wan2.1-14b"), default=list))
    write_random_text_encoder(root)
    write_tiny_vae(root / "vae", name="tiny-wan2.1")
    (root / "stagecast.json").write_text(json.dumps({"text_len": 512, "width": 832, "height": 480, "steps": 1}))
    return root


def up_args(root, **over) -> argparse.Namespace:
    args = dict(
        checkpoint=str(root), stages=1, device="cuda", dtype="bfloat16", cuda_graphs=True, sp=1, cfg_parallel=1,
        gateway_port=50051, tiny_decoder=None, default_decoder="full", vae_cuda_graphs=False, kv_budget_gib=0.0,
        decoder_memory_gib=0.0, pipelines=1, vae_compile=False, vae_devices=None, tokens=None, tls_cert=None,
        tls_key=None, host="127.0.0.1",
    )  # fmt: skip
    return argparse.Namespace(**{**args, **over})


def test_up_plans_a_shared_gpu_before_starting_and_passes_each_process_its_share(checkpoint_14b, capsys):
    from launcher.up import plan_memory

    args = up_args(checkpoint_14b)
    placement = Placement.plan("cuda", 1, gpus=1)
    plan = plan_memory(args, Plan(placement, None, None), totals={"cuda:0": H200})
    out = capsys.readouterr().out
    assert out.startswith("stagecast up: memory: cuda:0 (140.4 GiB) shared, planned for")
    assert out.count("\n") == 1 and "text encoder 10.6" in out
    stage_gib = plan.stage_args()[0]
    assert stage_gib[0] == "--device-memory-gib" and 100 < float(stage_gib[1]) < 125
    gateway = gateway_argv(args, plan, "127.0.0.1:1", metrics_port=0)
    assert float(gateway[gateway.index("--device-memory-gib") + 1]) == plan.gateway_share()
    assert 12 < plan.gateway_share() < 30
    # A GPU too small for one stream: ValueError naming the parts (up prints it and exits 2 before starting).
    with pytest.raises(ValueError, match=r"cuda:0 \(40.0 GiB\): stage 0's 26.7 GiB of weights.*--gateway-device"):
        plan_memory(args, Plan(placement, None, None), totals={"cuda:0": 40 * GIB})
    # One stage per GPU and the gateway on a GPU of its own: nothing shared, nothing planned.
    alone = Placement(["cuda:0"], "cuda:1", ["cuda:1"])
    assert plan_memory(args, Plan(alone, None, None), totals={"cuda:0": H200, "cuda:1": H200}).shares == {}
    assert capsys.readouterr().out == ""


def test_up_plans_pipelines_that_share_gpus_together(checkpoint_14b, capsys, monkeypatch):
    from launcher.fleet import pipeline_gpus
    from launcher.up import plan_memory

    args = up_args(checkpoint_14b, pipelines=2, default_decoder="full")
    assert pipeline_gpus(args, 0, gpus=1) == pipeline_gpus(args, 1, gpus=1) == [0]
    assert pipeline_gpus(argparse.Namespace(stages=2, sp=1, cfg_parallel=1), 1, gpus=3) == [2, 0]
    placement = Placement.plan("cuda", 1, gpus=1)
    monkeypatch.setattr("launcher.fleet.pipeline_gpus", lambda args, index, gpus=None: pipeline_gpus(args, index, 1))
    # Two 14B pipelines with graphs' buffers do not fit one H200: the plan says so, naming both pipelines' parts.
    with pytest.raises(ValueError, match=r"p0's stage 0's 26.7 GiB of weights.*p1's gateway.*fewer pipelines"):
        plan_memory(args, Plan(placement, None, None), totals={"cuda:0": H200})
    args.cuda_graphs = False
    plan = plan_memory(args, Plan(placement, None, None), totals={"cuda:0": H200})
    assert "p0's stage 0" in capsys.readouterr().out
    assert set(plan.stage_args("p0")) == set(plan.stage_args("p1")) == {0}
    assert plan.gateway_share("p0") == plan.gateway_share("p1") > 0
    total = 2 * float(plan.stage_args("p0")[0][1]) + plan.gateway_share("p0") + plan.gateway_share("p1")
    assert total <= H200 / GIB


def test_up_refuses_an_operators_kv_budget_that_holds_no_stream_on_any_device(checkpoint_14b):
    from launcher.up import plan_memory

    args = up_args(checkpoint_14b, device="cpu", kv_budget_gib=1.0)
    placement = Placement.plan("cpu", 1)
    wanted = r"--kv-budget-gib gives stage 0 1 GiB of KV, and one stream at 832x480.* needs 8.33 GiB on it"
    with pytest.raises(ValueError, match=wanted):
        plan_memory(args, Plan(placement, None, None))
    ok = up_args(checkpoint_14b, device="cpu", kv_budget_gib=9.0)
    assert plan_memory(ok, Plan(placement, None, None)).shares == {}


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return write_demo_checkpoint(tmp_path_factory.mktemp("demo") / "demo")


def test_up_with_a_kv_budget_that_holds_no_stream_exits_2_before_anything_starts(demo):
    from tests.cli_run import run_cli

    proc = run_cli("up", "--checkpoint", str(demo), "--port", "0", "--gateway-port", "-1", "--kv-budget-gib", "1e-6")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "stagecast up: error: --kv-budget-gib gives stage 0 1.05 KiB of KV, and one stream at 64x64" in proc.stderr
    assert "Traceback" not in proc.stderr and "READY" not in proc.stdout  # nothing was started


def test_a_gateway_whose_decoder_memory_holds_no_default_stream_exits_2_naming_it(demo):
    from tests.cli_run import run_cli

    args = ["gateway", "--coordinator", "127.0.0.1:1", "--checkpoint", str(demo), "--port", "0"]
    proc = run_cli(*args, "--insecure-internal", "--decoder-memory-gib", "1e-6")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "stagecast gateway: error: decoder memory: one 64x64 stream on the full decoder (the default) holds" in (
        proc.stderr
    )
    assert "this gateway has 0.00 GiB for streams (set)" in proc.stderr and "Traceback" not in proc.stderr


def test_the_benchmark_harness_plans_a_shared_gpu_as_up_does(checkpoint_14b, capsys):
    from benchmarks.harness.system import memory_shares

    args = argparse.Namespace(
        stages=1, sp=1, cfg_parallel=1, dtype="bfloat16", cuda_graphs=True, gpus=None, stage_extra_args=None
    )
    plan = memory_shares(checkpoint_14b, args, "cuda", None, "cuda:0", ["cuda:0"], None, totals={"cuda:0": H200})
    assert capsys.readouterr().out.startswith("harness: memory: cuda:0 (140.4 GiB) shared")
    assert 100 < float(plan.stage_args()[0][1]) < 125 and 12 < plan.gateway_share() < 30
    assert memory_shares(checkpoint_14b, args, "cpu", None, "cpu", None, None).shares == {}


def test_a_stage_with_a_negative_share_exits_2_naming_the_flag(demo):
    from tests.cli_run import run_cli

    args = ["stage", "--index", "0", "--coordinator", "127.0.0.1:1", "--checkpoint", str(demo / "transformer")]
    proc = run_cli(*args, "--insecure-internal", "--device-memory-gib", "-1")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "stagecast stage: error: --device-memory-gib: must be in [0, " in proc.stderr


def test_tiny_decoder_graphs_are_planned_in_the_gateways_share_and_passed_on(checkpoint_14b, tmp_path, capsys):
    from launcher.demo_checkpoint import write_tiny_decoder
    from launcher.up import plan_memory

    tiny = write_tiny_decoder(tmp_path / "taew.pth", latent_channels=16, seed=1)
    placement = Placement.plan("cuda", 1, gpus=1)
    plain = plan_memory(up_args(checkpoint_14b, tiny_decoder=str(tiny)), Plan(placement, None, None), {"cuda:0": H200})
    assert "tiny decoder graphs" not in capsys.readouterr().out
    args = up_args(checkpoint_14b, tiny_decoder=str(tiny), tiny_cuda_graphs=True)
    graphed = plan_memory(args, Plan(placement, None, None), totals={"cuda:0": H200})
    # Buckets 1, 2, 3 and 4 graphed: 10 rows, each with a stream's memory in and out and four 480x832 frames out.
    want = 10 * (2 * memory_plan.decoder_state_bytes("tiny", 832, 480, 2) + 4 * 3 * 832 * 480 * 2) / GIB
    assert f"tiny decoder graphs {want:.1f}" in capsys.readouterr().out
    assert graphed.gateway_share() - plain.gateway_share() == pytest.approx(want, abs=0.15)
    assert "--tiny-cuda-graphs" in gateway_argv(args, graphed, "127.0.0.1:1", metrics_port=0)
