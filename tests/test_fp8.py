"""``--fp8`` is opt-in and GPU only: refused at start-up, naming the flag, wherever it cannot run (the stage, ``up``,
the harness, the GPU check), and it converts exactly the transformer blocks' linears.  None of this needs torchao;
the one test that converts a slice runs only where torchao is installed."""

import sys
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from benchmarks import fp8_check
from launcher.local_cluster import stage_args
from stage_service.checkpoint import random_slice_state_dict
from stage_service.dit_slice import DiTSlice
from stage_service.fp8 import eligible, fp8_linear_names
from stagecast.fp8 import Fp8Unavailable, check_fp8, fp8_refusal
from stagecast.model.dit_configs import model_config
from tests.cli_run import run_cli

pytestmark = pytest.mark.unit

NO_TORCHAO = "ModuleNotFoundError: No module named 'torchao'"
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where no CUDA GPU is visible")


# ---- the requirements, one by one ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "device,dtype,caps,torchao,needle",
    [
        ("cpu", "bfloat16", [], None, "--device is cpu"),
        ("cuda:0", "bfloat16", [], None, "no CUDA GPU is visible for cuda:0"),
        ("cuda:0", "bfloat16", [(8, 0)], None, "cuda:0 has 8.0"),  # A100: no float8 tensor cores
        ("cuda", "bfloat16", [(9, 0), (8, 6)], None, "cuda has 8.6"),  # every GPU the stages would use
        ("cuda:0", "float32", [(9, 0)], None, "needs --dtype bfloat16"),
        ("cuda:0", "float16", [(8, 9)], None, "got --dtype float16"),
        ("cuda:0", "bfloat16", [(9, 0)], NO_TORCHAO, "needs torchao"),
    ],
)
def test_each_requirement_is_refused_naming_the_flag(device, dtype, caps, torchao, needle):
    reason = fp8_refusal(device, dtype, caps, torchao)
    assert reason is not None and reason.startswith("--fp8: ") and needle in reason
    assert "\n" not in reason


@pytest.mark.parametrize("caps", [[(8, 9)], [(9, 0)], [(9, 0), (10, 0)]])
def test_a_capable_gpu_with_bfloat16_and_torchao_passes(caps):
    assert fp8_refusal("cuda:0", "bfloat16", caps, None) is None


def test_the_torchao_error_is_one_line_and_kept():
    reason = fp8_refusal("cuda:1", "bfloat16", [(9, 0)], NO_TORCHAO)
    assert NO_TORCHAO in reason and "stagecast[fp8]" in reason


def test_check_refuses_a_cpu_device_without_importing_torchao(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)  # an import would raise: the CPU refusal comes first
    with pytest.raises(Fp8Unavailable, match=r"^--fp8: .*--device is cpu"):
        check_fp8("cpu", "bfloat16")
    assert issubclass(Fp8Unavailable, ValueError)  # run_service prints ValueErrors as one line, exit 2


@cpu_only
@pytest.mark.parametrize("device", ["cuda", "cuda:0", "cuda:3"])
def test_check_refuses_cuda_where_no_gpu_is_visible(device):
    with pytest.raises(Fp8Unavailable, match=f"no CUDA GPU is visible for {device}"):
        check_fp8(device, "bfloat16")


# ---- the commands refuse it at start-up ---------------------------------------------------------------------


def one_error_line(proc, prefix: str) -> str:
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith(prefix)]
    assert len(lines) == 1, proc.stderr[-2000:]
    return lines[0]


@pytest.mark.parametrize(
    "flags,needle",
    [
        (["--device", "cpu", "--dtype", "bfloat16"], "--device is cpu"),
        (["--device", "cpu"], "--device is cpu"),  # the first reason wins: the device, before the dtype
        pytest.param(["--device", "cuda", "--dtype", "bfloat16"], "no CUDA GPU is visible", marks=cpu_only),
    ],
)
def test_the_stage_refuses_fp8_before_reading_any_weights(tmp_path, flags, needle):
    # The checkpoint does not exist: the fp8 refusal comes before the stage reads its config or weights.
    missing = tmp_path / "nowhere"
    args = ["stage", "--index", "0", "--coordinator", "127.0.0.1:1", "--checkpoint", str(missing), "--port", "0"]
    line = one_error_line(run_cli(*args, "--insecure-internal", "--fp8", *flags), "stagecast stage: error:")
    assert line.startswith("stagecast stage: error: --fp8: ") and needle in line
    assert "nowhere" not in line


def test_stagecast_up_refuses_fp8_before_starting_anything(tmp_path):
    missing = tmp_path / "nowhere"
    args = ["up", "--checkpoint", str(missing), "--device", "cpu", "--dtype", "bfloat16", "--fp8", "--port", "0"]
    proc = run_cli(*args, "--gateway-port", "-1")
    line = one_error_line(proc, "stagecast up: error:")
    assert line.startswith("stagecast up: error: --fp8: ") and "--device is cpu" in line
    assert "is up" not in proc.stdout


def test_a_stage_servicer_refuses_fp8_before_reading_its_config(tmp_path):
    from stage_service.server import StageOptions, StageServicer

    opts = StageOptions(index=0, coordinator="127.0.0.1:1", checkpoint=str(tmp_path / "nowhere"), fp8=True)
    with pytest.raises(Fp8Unavailable, match="--fp8: "):
        StageServicer(opts)


def test_the_harness_refuses_fp8_on_cpu(capsys):
    from benchmarks import harness

    with pytest.raises(SystemExit) as info:
        harness.main(["--smoke", "--fp8"])
    assert info.value.code == 2
    assert "--fp8: " in capsys.readouterr().err


def test_the_gpu_check_refuses_on_cpu(capsys):
    if torch.cuda.is_available():
        pytest.skip("checks the refusal where no CUDA GPU is visible")
    assert fp8_check.main(["--iters", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fp8_check: error: --fp8: ") and err.count("\n") == 1


def test_the_launcher_passes_fp8_to_every_stage_only_when_asked():
    on = stage_args(0, "c:1", "ckpt", "cuda", "bfloat16", "127.0.0.1", fp8=True)
    off = stage_args(0, "c:1", "ckpt", "cuda", "bfloat16", "127.0.0.1")
    assert on.count("--fp8") == 1 and "--fp8" not in off
    assert [a for a in on if a != "--fp8"] == off


# ---- which layers change -------------------------------------------------------------------------------------

BLOCK_LINEARS = (
    "attn1.to_q",
    "attn1.to_k",
    "attn1.to_v",
    "attn1.to_out.0",
    "attn2.to_q",
    "attn2.to_k",
    "attn2.to_v",
    "attn2.to_out.0",
    "ffn.net.0.proj",
    "ffn.net.2",
)


def tiny_slice(first=True, last=True, layers=range(0, 3), **overrides) -> DiTSlice:
    cfg = model_config("tiny-wan2.1", **overrides)
    sd = random_slice_state_dict(cfg, layers=layers, first=first, last=last, dtype=torch.bfloat16)
    return DiTSlice.from_state_dict(cfg, sd, layers=layers, first=first, last=last)


@pytest.mark.parametrize("first,last", [(True, True), (True, False), (False, True), (False, False)])
def test_only_the_block_linears_are_selected(first, last):
    sl = tiny_slice(first, last, layers=range(1, 3), attention_head_dim=16)  # D = 32: float8-aligned
    names = fp8_linear_names(sl)
    assert sorted(names) == sorted(f"blocks.{i}.{n}" for i in range(2) for n in BLOCK_LINEARS)
    modules = dict(sl.model.named_modules())
    assert all(isinstance(modules[n], nn.Linear) for n in names)
    # Embeddings (time, text), the head and every norm exist in the slice and stay out.
    outside = [n for n, m in modules.items() if isinstance(m, nn.Linear) and not n.startswith("blocks.")]
    assert any(n.startswith("condition_embedder.") for n in outside)
    assert (sl.model.proj_out is not None) == last
    assert not set(outside) & set(names)
    norms = [n for n, m in modules.items() if "norm" in n.rsplit(".", 1)[-1]]
    assert norms and not set(norms) & set(names)


def test_linears_float8_matmuls_cannot_take_stay_out():
    sl = tiny_slice(attention_head_dim=12)  # D = 24: not a multiple of 16
    assert fp8_linear_names(sl) == []
    assert eligible(nn.Linear(32, 48)) and not eligible(nn.Linear(24, 48)) and not eligible(nn.Linear(32, 40))
    assert not eligible(nn.LayerNorm(32)) and not eligible(nn.Conv3d(16, 32, 2))


def test_the_real_configs_convert_every_block_linear():
    """1.3B and 14B dimensions are float8-aligned: a stage converts all 10 linears of each of its blocks."""
    from diffusers import WanTransformer3DModel

    for name in ("wan2.1-1.3b", "wan2.1-14b"):
        cfg = model_config(name, num_layers=2)
        with torch.device("meta"):  # the real sizes, no memory
            model = WanTransformer3DModel.from_config(cfg)
        names = fp8_linear_names(DiTSlice(cfg, model, layers=range(2), first=True, last=True))
        assert len(names) == 2 * len(BLOCK_LINEARS), name


# ---- the GPU check's CPU-testable core -----------------------------------------------------------------------


def test_difference_reports_abs_relative_and_update_errors():
    inp = torch.zeros(1, 4, 2)
    ref = torch.ones(1, 4, 2) * 2.0
    out = ref.clone()
    out[0, 1, 0] += 0.5
    d = fp8_check.difference(ref, out, inp)
    assert d["max_abs"] == pytest.approx(0.5) and d["max_rel"] == pytest.approx(0.25)
    assert d["rel_l2"] == pytest.approx(0.5 / ref.norm().item())
    # Against the update (ref - inp) the same error is larger once the input carries most of the output.
    d2 = fp8_check.difference(ref + 10, out + 10, inp + 10)
    assert d2["max_abs"] == pytest.approx(0.5) and d2["update_max_rel"] == pytest.approx(0.25)
    assert d2["max_rel"] < d["max_rel"]
    assert fp8_check.difference(ref, ref, inp)["max_abs"] == 0.0


def test_the_gpu_check_runs_eager_and_graphed_on_the_same_inputs_on_cpu():
    """The script's measurement path (fixed KV window, text K/V, graphed and eager forwards), without float8."""
    args = SimpleNamespace(
        stages=2, num_layers=None, batches=[1, 2], height=4, width=6, chunk_frames=1, window=3, text_len=8, warmup=1,
        iters=2,
    )  # fmt: skip
    out = fp8_check.check_model("tiny-wan2.1", args, torch.device("cpu"), torch.float32, [])
    assert out["layers"] == [0, 2]
    for batch in ("1", "2"):
        row = out["batches"][batch]
        assert row["tokens"] == 6 and row["context_tokens"] == 18
        (entry,) = row["variants"].values()
        assert entry["graphs_captured"] == 1 and entry["graph_failure"] is None
        assert entry["graphed_vs_eager_max_abs"] == 0.0
        assert entry["eager"]["median_ms"] > 0 and entry["graphed"]["iters"] == 2


# ---- with torchao (skipped where it is not installed, as in CI) ------------------------------------------------


def test_conversion_changes_the_selected_linears_and_nothing_else(monkeypatch):
    pytest.importorskip("torchao.quantization")
    import torchao.float8.inference as inference

    from stage_service.fp8 import convert_to_fp8

    # torchao refuses a CPU; its CPU float8 matmul is enough to check which modules change.
    monkeypatch.setattr(inference, "_check_hardware_support", lambda granularities: None)
    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").startswith("torchao") and hasattr(module, "_check_hardware_support"):
            monkeypatch.setattr(module, "_check_hardware_support", lambda granularities: None)
    sl = tiny_slice(attention_head_dim=16)
    before = {n: type(p) for n, p in sl.model.named_parameters()}
    names = convert_to_fp8(sl)
    assert names == sorted(fp8_linear_names(tiny_slice(attention_head_dim=16)))
    changed = {n for n, p in sl.model.named_parameters() if type(p) is not before[n]}
    assert changed == {f"{n}.weight" for n in names}


def test_fp8_runs_are_labelled_in_the_benchmark_tables():
    from benchmarks.harness import fp8_label
    from benchmarks.report import config_name

    a = {"model": "wan2.1-1.3b", "width": 832, "height": 480, "steps": 1}
    assert "FP8" not in config_name({"args": a}) and fp8_label(a) == ""
    assert config_name({"args": {**a, "fp8": True}}).endswith(", FP8 blocks")
    assert fp8_label({**a, "fp8": True}) == ", FP8 blocks"
