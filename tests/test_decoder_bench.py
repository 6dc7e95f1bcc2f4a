"""The decoder table's benchmark: its smoke mode runs every row on CPU and the report renders the table."""

import json

import pytest

from benchmarks import decoder_bench, report


@pytest.mark.unit
def test_decoder_bench_smoke_times_every_row_and_the_report_renders_the_decoder_table(tmp_path, monkeypatch):
    monkeypatch.setenv("STAGECAST_COMMIT", "test0000")  # the commit from the environment, not a git process
    out = tmp_path / "decoder_smoke.json"
    assert decoder_bench.main(["--smoke", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["bench"] == "decoder" and r["size"] == "8x8" and r["latent_hw"] == [1, 1]
    got = {(row["decoder"], row["variant"], row["streams"]) for row in r["rows"]}
    want = {
        (d, v, n) for d, v in [("tiny", "eager"), ("wan-vae", "per-stream"), ("wan-vae", "batched")] for n in (1, 2)
    }
    assert got == want
    for row in r["rows"]:
        assert row["chunk_ms"] > 0 and row["per_stream_ms"] * row["streams"] == pytest.approx(row["chunk_ms"], rel=1e-3)
        assert row["state_mib"] > 0
    # the tiny decoder's state at a 1x1 latent: 3 MemBlocks each of 256 ch at 1x1, 128 at 2x2 and 64 at 4x4, fp32
    tiny = next(row for row in r["rows"] if row["decoder"] == "tiny")
    assert tiny["state_mib"] == round(4 * 3 * (256 + 128 * 4 + 64 * 16) / 2**20, 2)
    # on a CPU a stream decodes to the same bits beside another as alone
    assert all(
        row["batch_max_diff"] == 0 and row["max_diff_vs_eager"] == 0 for row in r["rows"] if row["decoder"] == "tiny"
    )
    # the report puts the table between its own markers and leaves the rest (the harness tables too) alone
    doc = tmp_path / "BENCHMARKS.md"
    doc.write_text(
        f"# B\n\n{report.BEGIN}\nharness\n{report.END}\n\n{report.DEC_BEGIN}\nstale\n{report.DEC_END}\nend\n"
    )
    assert report.main(["--results", str(tmp_path), "--out", str(doc)]) == 0
    text = doc.read_text()
    assert text.startswith(f"# B\n\n{report.BEGIN}\nharness\n{report.END}\n") and text.endswith(
        f"{report.DEC_END}\nend\n"
    )
    assert "stale" not in text
    assert "| tiny | eager | float32 | 2 |" in text and "| wan-vae | batched | float32 | 1 |" in text
