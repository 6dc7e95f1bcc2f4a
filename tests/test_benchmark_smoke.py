"""The benchmark harness runs end to end (CPU, tiny model) so it cannot rot between GPU runs, and its JSON makes the
BENCHMARKS.md tables."""

import json
import subprocess
import sys

from benchmarks.report import BEGIN, END
from benchmarks.report import main as report


def test_harness_smoke_mode_reports_what_a_viewer_sees_and_the_report_tabulates_it(tmp_path):
    out = tmp_path / "v2_smoke.json"
    md = tmp_path / "bench.md"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.harness", "--smoke", "--json", str(out), "--markdown", str(md)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    s = r["system"]
    assert r["harness"] == 2 and r["commit"] and r["dirty"] in (True, False)
    assert {"torch", "cuda", "nccl", "diffusers", "driver", "gpu_count"} <= set(r["versions"])

    # Cold start, then the first stream after READY on its own.
    assert s["time_to_ready_s"] > 0 and s["first_stream"]["frames"] > 2
    # The main stream: one arrival per frame, in order; steady FPS over its middle; punctuality at the target.
    main = s["main"]
    arrivals = main["arrivals_s"]
    assert len(arrivals) == main["frames"] == 32  # 2 s at 16 fps
    assert arrivals == sorted(arrivals) and arrivals[0] == round(main["ttff_s"], 5)
    assert s["steady_fps"] > 0 and s["whole_fps"] > 0 and 0 <= main["on_time"] <= 1
    assert main["max_gap_ms"] >= main["p99_gap_ms"] > 0 and main["gaps_over_250ms"] >= 0
    chunks = main["gateway_chunks"]
    assert [c["chunk"] for c in chunks] == list(range(len(chunks)))
    assert all(c["latents_ms"] <= c["decoded_ms"] <= c["encoded_ms"] for c in chunks)
    # The lead, sampled from the coordinator, never passed its bound (2 levels x 2 stages + the VAE's depth).
    assert s["lead"]["samples"] and 0 < s["lead"]["max"] <= s["lead"]["bound"]

    assert 0 < s["ttff_p50_s"] <= s["ttff_p95_s"]
    parts = s["ttff_parts_p50_ms"]
    assert set(parts) == {"pipeline", "vae", "encode", "rest"}
    assert parts["pipeline"] > 0 and parts["vae"] > 0 and parts["encode"] >= 0 and parts["rest"] > 0
    # Each PromptUpdate was matched to the first chunk generated under it.
    assert len(s["interactive"]["latencies_ms"]) == 2 and all(x > 0 for x in s["interactive"]["latencies_ms"])
    assert [row["streams"] for row in s["load"]] == [1, 2]
    assert all(row["failed"] == 0 and row["aggregate_fps"] > 0 for row in s["load"])
    assert len(s["stages"]) == 2 and all(x["batches"] > 0 for x in s["stages"])
    assert r["peer"]["fps"] > 0 and r["peer_compiled"] is None  # the compiled peer runs on GPUs only
    assert r["floor"]["fps"] > 0 and r["floor"]["tflop_per_video_frame"] > 0
    assert r["ratios"]["vs_peer"] == s["steady_fps"] / r["peer"]["fps"]
    assert md.read_text().count("\n") == 1 and "tiny-wan2.1" in md.read_text()

    # The report puts its tables between its markers, and leaves the rest of the document alone.
    doc = tmp_path / "BENCHMARKS.md"
    doc.write_text(f"# Benchmarks\n\nprose\n\n{BEGIN}\nstale table\n{END}\n\nmore prose\n")
    assert report(["--results", str(tmp_path), "--out", str(doc)]) == 0
    text = doc.read_text()
    assert text.startswith("# Benchmarks\n\nprose\n\n") and text.endswith(f"{END}\n\nmore prose\n")
    assert "stale table" not in text and "| tiny @ 64×64, 2 steps | 2 | **" in text and "| 2 | " in text


def test_v2v_bench_smoke_mode_measures_throughput_and_live_latency(tmp_path):
    out = tmp_path / "v2v_smoke.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.v2v_bench", "--smoke", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["benchmark"] == "v2v" and r["timesteps"] == [700.0, 500.0]
    for name in ("throughput", "live"):
        row = r["system"][name]
        # 16 input frames (1 s at 16 FPS): 1 + 4 * 3 of them fill chunks and come back restyled, in pts order.
        assert row["error"] is None and row["end"] == "stopped", row
        assert row["input_frames"] == 16 and row["output_frames"] == 13
        lat = row["latency_ms"]
        assert 0 < lat["p50"] <= lat["p95"] <= lat["max"]
    assert r["system"]["throughput"]["input_dropped"] == 0  # backpressure drops nothing
    assert "| v2v throughput |" in proc.stdout and "| v2v live 16 FPS in |" in proc.stdout
