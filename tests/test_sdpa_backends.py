"""The SDPA backends probe (``benchmarks/sdpa_backends.py``) in its CPU smoke mode: every case it can run there is
timed and recorded with its shape, and the JSON says what ran it."""

from __future__ import annotations

import json

import pytest

from benchmarks import sdpa_backends

pytestmark = pytest.mark.unit


def test_smoke_times_each_case_it_can_run_and_records_the_shapes(tmp_path, monkeypatch):
    monkeypatch.setattr(sdpa_backends, "git_commit", lambda: "abc1234")  # (git runs a process: not in this tier)
    out = tmp_path / "sdpa.json"
    assert sdpa_backends.main(["--smoke", "--batches", "1,2", "--iters", "2", "--warmup", "1", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["commit"] == "abc1234" and r["date"]
    assert r["device"] == "cpu" and r["command"].startswith("python -m benchmarks.sdpa_backends --smoke")
    cases = r["cases"]
    # On a CPU only the math kernel is forced (the fused ones are CUDA's): self and cross, two layouts, two batches.
    assert {c["backend"] for c in cases} == {"math"} and len(cases) == 2 * 2 * 2
    for c in cases:
        assert c["eager_ms"] > 0 and "error" not in c and c["tflops"] >= 0
        assert c["keys"] == (c["queries"] + 48 if c["attention"] == "self" else 8)
        assert c["ms_per_stream_chunk_30_layers"] == pytest.approx(c["eager_ms"] * 30 / c["batch"], abs=1e-3)
