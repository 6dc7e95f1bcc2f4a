"""The per-frame CPU path benchmark and the batched decoder benchmark: their smoke modes run and say what they
measured."""

import json

import pytest

from benchmarks import batched_decoder_bench, frame_path_bench

pytestmark = pytest.mark.unit


def test_frame_path_bench_smoke_times_every_codec_at_each_stream_count(tmp_path):
    out = tmp_path / "frame_path.json"
    assert frame_path_bench.main(["--smoke", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["bench"] == "frame_path" and r["size"] == "64x64"
    assert {(row["codec"], row["streams"]) for row in r["rows"]} == {
        (c, n) for c in ("jpeg", "h264", "raw") for n in (1, 2)
    }
    for row in r["rows"]:
        assert row["frames"] == 8 * row["streams"] and row["fps"] > 0 and row["cpu_ms_per_frame"] >= 0
        assert row["fits"] == (row["fps"] >= 16.0 * row["streams"])


def test_frame_path_bench_refuses_bad_inputs_naming_the_flag():
    with pytest.raises(SystemExit):
        frame_path_bench.main(["--codecs", "gif"])
    with pytest.raises(SystemExit):
        frame_path_bench.main(["--width", "31"])


def test_batched_decoder_bench_smoke_measures_buckets_and_serves_paced_streams(tmp_path):
    out = tmp_path / "batched.json"
    assert batched_decoder_bench.main(["--smoke", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["bench"] == "batched_decoder" and r["batch_max_diff"] == 0  # a CPU decodes a stream batched as alone
    buckets = [row for row in r["rows"] if row["row"] == "bucket"]
    assert [b["streams"] for b in buckets] == [1, 2] and all(b["call_ms"] > 0 for b in buckets)
    served = [row for row in r["rows"] if row["row"] == "served"]
    assert [s["paced"] for s in served] == [1, 2]
    assert all(s["chunks"] > 0 and len(s["batch_ms"]) == 2 for s in served)
