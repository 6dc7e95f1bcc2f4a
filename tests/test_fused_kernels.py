"""The fused-kernel probe (``benchmarks.fused_kernels``): its RoPE without strided writes equals the slice's RoPE bit
for bit on the slice's own tables, and its CPU smoke run checks every form against the eager functions."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.fused_kernels import CASES, main, rope_pairs
from stage_service.dit_slice import DiTSlice, apply_rotary_emb

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_pairs_equals_the_slices_rope_on_its_own_tables(tiny_model, dtype):
    model = tiny_model("tiny-wan2.1")
    sl = DiTSlice.from_model(model, layers=range(model.config.num_layers), first=True, last=True)
    cos, sin = sl.rotary(1, 4, 6, [0, 3, 7])  # three items at different frame offsets: a table each
    heads, dim = sl.config["num_attention_heads"], sl.config["attention_head_dim"]
    x = torch.randn(3, cos.shape[1], heads, dim, generator=torch.Generator().manual_seed(3)).to(dtype)
    assert torch.equal(rope_pairs(x, cos, sin), apply_rotary_emb(x, cos, sin))
    # Not a vacuous equality: the rotation moves the values.
    assert not torch.equal(rope_pairs(x, cos, sin), x)


def test_rope_pairs_needs_tables_whose_pairs_repeat():
    """The form holds only where each pair's two table entries are equal (diffusers' tables): elsewhere it differs."""
    x = torch.randn(1, 5, 2, 8, generator=torch.Generator().manual_seed(4))
    cos, sin = torch.rand(1, 5, 1, 8) * 0.5 + 0.5, torch.rand(1, 5, 1, 8) * 0.5 + 0.5
    assert not torch.equal(rope_pairs(x, cos, sin), apply_rotary_emb(x, cos, sin))


def test_the_smoke_run_times_every_form_of_every_kernel_and_each_equals_its_eager_function(tmp_path):
    out = tmp_path / "fused.json"
    assert main(["--smoke", "--batches", "1,2", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["device"] == "cpu" and result["copy_tb_s"] is None
    assert [(r["kernel"], r["form"], r["batch"]) for r in result["cases"]] == [
        (name, form, b) for b in (1, 2) for name, form, _ in CASES
    ]
    for row in result["cases"]:
        assert "error" not in row, row
        assert row["max_diff_vs_eager"] == 0.0 and row["ms"] > 0 and row["mb"] > 0, row
