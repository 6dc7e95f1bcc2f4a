"""The opt-in DiT levers (``stage_service.dit_levers``): names checked at the flag, the fused block forward equal to
diffusers' op for op where it runs uncompiled, and the float8 rowwise linears within float8's precision."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from stage_service.dit_levers import LEVERS, Fp8Linear, apply_levers, parse_levers, quantize_rows
from stage_service.dit_slice import AttentionContext, DiTSlice

pytestmark = pytest.mark.unit

# Dimensions that float8 matmuls take (multiples of 16), otherwise the tiny Wan2.1 test model.
FP8_DIMS = dict(attention_head_dim=16, num_attention_heads=2, ffn_dim=64, text_dim=32)


class Window:
    """A fixed KV window of ``tokens`` tokens per layer that drops what the forward writes."""

    def __init__(self, layers: int, tokens: int, heads: int, dim: int, seed: int, dtype):
        gen = torch.Generator().manual_seed(seed)
        self.k = torch.randn(layers, 1, tokens, heads, dim, generator=gen).to(dtype)
        self.v = torch.randn(layers, 1, tokens, heads, dim, generator=gen).to(dtype)
        self.writes = True

    @property
    def context_tokens(self) -> int:
        return self.k.shape[2]

    def read(self, layer):
        return self.k[layer], self.v[layer]

    def write(self, layer, key, value):
        pass


def forward(sl: DiTSlice, latents, text, windows) -> torch.Tensor:
    b, _, f, h, w = latents.shape
    hs = sl.embed(latents)
    cond = sl.condition(torch.full((b,), 700.0), tokens=hs.shape[1])
    cross = [sl.cross_kv(sl.embed_text(text))] * b
    ctx = AttentionContext(rotary=sl.rotary(f, h, w, [2] * b), cross_kv=cross, self_kv=windows)
    return sl.head(sl.run_blocks(hs, cond, ctx), cond, latents.shape)


def slice_of(tiny_model, dtype, **overrides) -> DiTSlice:
    model = tiny_model("tiny-wan2.1", **overrides).to(dtype)
    return DiTSlice.from_model(model, layers=range(model.config.num_layers), first=True, last=True)


def inputs(sl: DiTSlice, dtype, batch: int = 3):
    g = torch.Generator().manual_seed(5)
    latents = torch.randn(batch, 16, 1, 4, 6, generator=g)
    text = torch.randn(1, 7, sl.config["text_dim"], generator=g)
    heads, dim = sl.config["num_attention_heads"], sl.config["attention_head_dim"]
    # Items 0 and 2 share a window length (one grouped SDPA), item 1 has none.
    windows = [Window(sl.num_layers, 12, heads, dim, 1, dtype), None, Window(sl.num_layers, 12, heads, dim, 2, dtype)]
    return latents, text, windows[:batch]


def test_lever_names_are_checked_and_ordered():
    assert parse_levers("cudnn, fp8").names == ("fp8", "cudnn")
    assert not parse_levers("") and parse_levers("").names == ()
    assert parse_levers(list(LEVERS)).names == LEVERS
    with pytest.raises(ValueError, match="--dit-levers: unknown lever.*fp4"):
        parse_levers("fused,fp4")


def test_the_fused_lever_names_its_compile_form_and_a_bad_one_is_refused_by_flag():
    from stage_service.dit_levers import DEFAULT_FUSED_FORM

    dynamic = parse_levers("cudnn,fused@dynamic")
    assert dynamic.names == ("fused", "cudnn") and dynamic.fused_form == "dynamic" and "fused" in dynamic
    assert str(dynamic) == "fused@dynamic,cudnn" and parse_levers(str(dynamic)) == dynamic
    assert parse_levers("fused").fused_form == DEFAULT_FUSED_FORM == parse_levers("fused@rows").fused_form == "rows"
    assert str(parse_levers("fused@rows")) == "fused"
    for bad in ("fused@static", "fused@sideways", "fp8@rows"):  # static compiles per batch size: benchmark only
        with pytest.raises(ValueError, match=f"--dit-levers: '{bad}': only fused takes a compile form"):
            parse_levers(bad)


def test_apply_levers_compiles_fused_in_the_form_the_flag_names(tiny_model):
    from stage_service.dit_levers import kernels

    for flag, form in [("fused@rows", "rows"), ("fused", "rows"), ("fused@dynamic", "dynamic")]:
        sl = slice_of(tiny_model, torch.float32)
        assert apply_levers(sl, parse_levers(flag), compile=False)["fused_form"] == form
        assert all(block.forward.k is kernels(False, form) for block in sl.model.blocks)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_blocks_uncompiled_equal_the_default_forward_bit_for_bit(tiny_model, dtype):
    plain, fused = slice_of(tiny_model, dtype), slice_of(tiny_model, dtype)
    applied = apply_levers(fused, ["fused"], compile=False)
    assert applied["fused_blocks"] == plain.num_layers
    latents, text, windows = inputs(plain, dtype)
    expected = forward(plain, latents, text, windows)
    got = forward(fused, latents, text, windows)
    assert torch.equal(got, expected), (got - expected).abs().max()


def test_no_levers_change_nothing(tiny_model):
    plain, same = slice_of(tiny_model, torch.bfloat16), slice_of(tiny_model, torch.bfloat16)
    assert apply_levers(same, []) == {"levers": []}
    latents, text, windows = inputs(plain, torch.bfloat16)
    assert torch.equal(forward(same, latents, text, windows), forward(plain, latents, text, windows))


def test_rowwise_quantisation_keeps_each_row_within_float8_precision():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 96, generator=g) * torch.logspace(-3, 3, 64)[:, None]  # rows six decades apart
    q, scale = quantize_rows(x.to(torch.bfloat16))
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (64, 1)
    back = q.float() * scale
    row_max = x.abs().amax(dim=1, keepdim=True)
    # e4m3 keeps 3 mantissa bits: a relative error of at most 2^-4 near a row's max, and never more than that of
    # the row's max in absolute terms (the small values of a row share its scale).
    assert ((back - x).abs() <= row_max * 2**-4 + 1e-6).all()
    assert (back.abs().amax(dim=1, keepdim=True) - row_max).abs().max() <= (row_max * 2**-4).max()


def test_fp8_linear_is_close_to_the_bf16_linear_and_replaces_only_block_linears(tiny_model):
    linear = nn.Linear(64, 32).to(torch.bfloat16)
    x = torch.randn(5, 7, 64).to(torch.bfloat16)
    got, ref = Fp8Linear(linear)(x).float(), linear(x).float()
    assert got.shape == ref.shape
    assert (got - ref).norm() / ref.norm() < 0.06  # float8 operands: a few percent

    sl = slice_of(tiny_model, torch.bfloat16, **FP8_DIMS)
    applied = apply_levers(sl, ["fp8"])
    per_block = 4 + 4 + 2  # self-attention q/k/v/out, cross-attention q/k/v/out, the FFN's two projections
    assert applied["fp8_linears"] == per_block * sl.num_layers
    assert not isinstance(sl.model.condition_embedder.text_embedder.linear_1, Fp8Linear)
    assert not isinstance(sl.model.proj_out, Fp8Linear)
    with pytest.raises(ValueError, match="multiple of 16"):
        Fp8Linear(nn.Linear(24, 32))


def test_fp8_with_fused_blocks_stays_near_bf16(tiny_model):
    plain, levered = slice_of(tiny_model, torch.bfloat16, **FP8_DIMS), slice_of(tiny_model, torch.bfloat16, **FP8_DIMS)
    apply_levers(levered, ["fp8", "fused"], compile=False)
    latents, text, windows = inputs(plain, torch.bfloat16)
    ref = forward(plain, latents, text, windows).float()
    got = forward(levered, latents, text, windows).float()
    assert torch.isfinite(got).all()
    assert (got - ref).norm() / ref.norm() < 0.1


def test_warm_levers_runs_the_blocks_at_the_serving_shape_and_changes_no_weight(tiny_model):
    from stage_service.dit_levers import warm_levers

    sl = slice_of(tiny_model, torch.float32)
    apply_levers(sl, ["fused"], compile=False)
    before = {k: v.clone() for k, v in sl.model.state_dict().items()}
    warm_levers(sl, 1, 4, 6, 7)
    assert all(torch.equal(v, before[k]) for k, v in sl.model.state_dict().items())


def test_cudnn_lever_scopes_the_slices_own_attention_and_falls_back_where_cudnn_refuses(tiny_model):
    """``cudnn`` sets the slice's SDPA backends around each of its calls (cuDNN first): on a CPU, where cuDNN refuses
    every call, the next backend runs it, and the process's own SDPA flags are left as they were."""
    from torch.nn.attention import SDPBackend

    from stage_service.dit_levers import CUDNN_FIRST
    from stage_service.dit_slice import SDPA_CALLS

    plain, cudnn = slice_of(tiny_model, torch.float32), slice_of(tiny_model, torch.float32)
    flags = (torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled())
    assert apply_levers(cudnn, ["cudnn"])["sdpa"] == ", ".join(CUDNN_FIRST)
    assert cudnn.attention_backends == CUDNN_FIRST and plain.attention_backends is None
    assert (torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled()) == flags
    latents, text, windows = inputs(plain, torch.float32)
    SDPA_CALLS.take()
    expected = forward(plain, latents, text, windows)
    assert SDPA_CALLS.take() == {}  # no lever, no backend scope
    got = forward(cudnn, latents, text, windows)
    torch.testing.assert_close(got, expected)  # CPU kernels after cuDNN's refusal: the same attention
    # Every call of the slice was refused by cuDNN, counted by backend, shapes and torch's reason (what a stage logs).
    calls = SDPA_CALLS.take()
    assert SDPA_CALLS.refusals(calls) == calls
    assert sum(calls.values()) >= 2 * len(cudnn.model.blocks)  # self- and cross-attention in every block, at least
    assert all(what.startswith("CUDNN_ATTENTION refused q(") and "torch.float32: " in what for what in calls)
    assert SDPA_CALLS.take() == {}  # taken: counting starts again
    # A first backend that takes the calls is counted as having run them.
    cudnn.attention_backends = (SDPBackend.MATH.name, SDPBackend.FLASH_ATTENTION.name)
    torch.testing.assert_close(forward(cudnn, latents, text, windows), expected)
    calls = SDPA_CALLS.take()
    assert calls and SDPA_CALLS.refusals(calls) == {} and all(w.startswith("MATH ran q(") for w in calls)
    # The scope is in effect: cuDNN alone cannot run on a CPU, and says so.
    cudnn.attention_backends = (SDPBackend.CUDNN_ATTENTION.name,)
    with pytest.raises(RuntimeError, match="No viable backend"):
        forward(cudnn, latents, text, windows)


def test_cudnn_refusal_says_why_cudnn_does_not_take_the_blocks_attention(tiny_model):
    """On a CPU cuDNN never runs: the probe says why, in torch's words, and leaves the slice's backends as they were."""
    from stage_service.dit_levers import CUDNN_FIRST, cudnn_refusal

    sl = slice_of(tiny_model, torch.float32)
    apply_levers(sl, ["cudnn"])
    why = cudnn_refusal(sl, 1, 4, 6, 7)
    assert why and isinstance(why, str)
    assert sl.attention_backends == CUDNN_FIRST


def test_the_results_page_shows_the_newest_of_the_fullest_lever_runs_and_a_later_probe():
    from benchmarks.report import shown_lever_runs

    def run(name, date, variants, batches):
        return {"_file": name, "date": date, "variants": variants, "batches": batches}

    old_full = run("a.json", "2026-12-01", ["bf16", "fused"], [1, 4, 8, 12])
    same_later = run("b.json", "2026-12-02", ["bf16", "cudnn"], [1, 4, 8, 12])
    same_day_probe = run("c.json", "2026-12-02", ["bf16"], [4])
    newest = run("d.json", "2026-12-03", ["bf16"], [1, 4])
    # a full run of a later day supersedes an older one of as many cells; a probe of that same day is not shown
    assert shown_lever_runs([newest, same_later, old_full, same_day_probe]) == [same_later, newest]
    assert shown_lever_runs([old_full, same_day_probe, same_later]) == [same_later]
    assert shown_lever_runs([same_later]) == [same_later] and shown_lever_runs([]) == []


@pytest.mark.parametrize(
    "form, compiles",
    [
        # one compile serves batches 2-4 at both token counts (batch 1 specializes apart); static compiles per shape
        ("rows", 2),
        ("static", 7),
    ],
)
def test_each_fused_form_compiles_as_documented_and_equals_the_eager_function(form, compiles):
    from torch._dynamo.testing import CompileCounter

    from stage_service.dit_levers import compile_form, mod_norm

    torch._dynamo.reset()
    counter = CompileCounter()
    fn = compile_form(mod_norm, form, backend=counter)
    gen = torch.Generator().manual_seed(5)
    for batch, tokens in [(1, 10), (2, 10), (3, 10), (4, 10), (2, 12), (3, 12), (4, 12)]:
        h = torch.randn(batch, tokens, 16, generator=gen).to(torch.bfloat16)
        shift, scale = (torch.randn(batch, 1, 16, generator=gen) for _ in range(2))
        assert torch.equal(fn(h, shift, scale, 1e-6), mod_norm(h, shift, scale, 1e-6))
    assert counter.frame_count == compiles


def test_an_unknown_fused_form_is_refused_by_name():
    from stage_service.dit_levers import Kernels

    with pytest.raises(ValueError, match="fused form: one of dynamic, rows, static"):
        Kernels(compile=False, form="sideways")


def test_a_profiled_forward_is_summed_by_kernel_class_from_the_kernels_names():
    from benchmarks.dit_levers import kernel_class, kernel_profile, kernel_summary

    # Names as a profile of one H200 forward shows them (benchmarks/results/dit_profile_1gpu_4aea243.log).
    named = {
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x128_4x1x1_kernel0_0": "attention",
        "nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopB_gelubias_TNN": "gemm",
        "void at::native::(anonymous namespace)::CatArrayBatchedCopy_vectorized<...>": "copy",
        "triton_poi_fused__fused_rms_norm_add_copy_mul_slice_sub_unbind_view_0": "fused",
        "triton_red_fused__to_copy_add_mul_native_layer_norm_0": "fused",
        "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16, float>": "elementwise",
        "aten::addmm": "gemm",
    }
    assert {n: kernel_class(n) for n in named} == named
    events = [(n, ms, 30) for n, ms in zip(named, (24.3, 7.8, 4.3, 6.6, 4.2, 2.7, 1.0))]
    summary = kernel_summary(events, rows=3)
    assert summary["by_class_ms"] == {"attention": 24.3, "fused": 10.8, "gemm": 8.8, "copy": 4.3, "elementwise": 2.7}
    assert list(summary["by_class_ms"]) == ["attention", "fused", "gemm", "copy", "elementwise"]  # costliest first
    assert summary["total_ms"] == pytest.approx(50.9)
    assert [(t["class"], t["ms"]) for t in summary["top"]] == [("attention", 24.3), ("gemm", 7.8), ("fused", 6.6)]
    # On a CPU the profile is of CPU time, and a matrix multiply still counts as a GEMM.
    a, b = torch.randn(64, 64), torch.randn(64, 64)
    table, got = kernel_profile(lambda: torch.relu(a @ b), torch.device("cpu"))
    assert "Self CPU" in table and got["by_class_ms"].get("gemm", 0) > 0 and got["total_ms"] > 0
