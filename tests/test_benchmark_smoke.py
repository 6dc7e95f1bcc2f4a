"""The benchmark harness runs end to end (CPU, tiny model) so it cannot rot between GPU runs, and its JSON makes the
BENCHMARKS.md tables."""

import json
import subprocess
import sys

import pytest

from benchmarks.report import BEGIN, END


def run_smoke(module: str, out, *extra: str, timeout: float) -> tuple[dict, str]:
    """Run ``python -m benchmarks.<module> --smoke --json out`` as people type it; once it exits 0, its JSON and what
    it printed."""
    proc = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{module}", "--smoke", "--json", str(out), *extra],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


@pytest.mark.multiprocess
def test_harness_smoke_mode_reports_what_a_viewer_sees_and_the_report_tabulates_it(tmp_path):
    out = tmp_path / "v2_smoke.json"
    md = tmp_path / "bench.md"
    # --decoder full,tiny: the main stream again on a tiny decoder (random weights), side by side in the same system.
    r, _ = run_smoke("harness", out, "--markdown", str(md), "--decoder", "full,tiny", timeout=900)
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
    by_decoder = s["main_by_decoder"]
    assert s["decoder"] == "full" and list(by_decoder) == ["full", "tiny"]
    assert by_decoder["full"]["steady_fps"] == s["steady_fps"]  # the first decoder's is the main stream itself
    assert by_decoder["tiny"]["frames"] == main["frames"] and by_decoder["tiny"]["steady_fps"] > 0
    assert by_decoder["tiny"]["error"] is None
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
    acked = s["interactive"]["acked_ms"]  # PromptUpdated came back before the first frame under the new prompt
    assert len(acked) == 2 and all(0 < a <= x for a, x in zip(acked, s["interactive"]["latencies_ms"], strict=True))
    assert [row["streams"] for row in s["load"]] == [1, 2]
    assert all(row["failed"] == 0 and row["aggregate_fps"] > 0 for row in s["load"])
    # Load rows run paced and SLO-adaptive: each says the streams held and refused and the steps its frames ran.
    for row in s["load"]:
        assert row["refused"] == 0 and 0 <= row["held"] <= row["streams"]
        assert len(row["steps"]) == row["streams"] and all(set(map(int, st)) <= {1, 2} for st in row["steps"])
    assert "capacity_streams" in s
    assert len(s["stages"]) == 2 and all(x["batches"] > 0 for x in s["stages"])
    assert r["peer"]["fps"] > 0 and r["peer_compiled"] is None  # the compiled peer runs on GPUs only
    assert r["floor"]["fps"] > 0 and r["floor"]["tflop_per_video_frame"] > 0
    assert r["ratios"]["vs_peer"] == s["steady_fps"] / r["peer"]["fps"]
    assert md.read_text().count("\n") == 1 and "tiny-wan2.1" in md.read_text()

    # The report puts its tables between its markers, and leaves the rest of the document alone.
    doc = tmp_path / "BENCHMARKS.md"
    doc.write_text(f"# Benchmarks\n\nprose\n\n{BEGIN}\nstale table\n{END}\n\nmore prose\n")
    # Run as the command people type (python -m benchmarks.report), not only as a function: the module must be
    # whole before its entry point runs.
    cmd = [sys.executable, "-m", "benchmarks.report", "--results", str(tmp_path), "--out", str(doc)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    text = doc.read_text()
    assert text.startswith("# Benchmarks\n\nprose\n\n") and text.endswith(f"{END}\n\nmore prose\n")
    assert "stale table" not in text and "| 2 | " in text
    assert "The main stream by decoder" in text and "| tiny | " in text  # --decoder full,tiny: both rows
    assert "| tiny @ 64×64, 2 steps, SLO load rows (steps 1–2, VAE " in text  # its load rows are SLO-adaptive


@pytest.mark.multiprocess
def test_v2v_bench_smoke_mode_measures_throughput_and_live_latency(tmp_path):
    out = tmp_path / "v2v_smoke.json"
    r, printed = run_smoke("v2v_bench", out, timeout=900)
    assert r["benchmark"] == "v2v" and r["timesteps"] == [700.0, 500.0]
    for name in ("throughput", "live"):
        row = r["system"][name]
        # 16 input frames (1 s at 16 FPS): 1 + 4 * 3 fill chunks, and the last 3 a chunk that a repeat of the last
        # frame completes: every frame the gateway did not drop comes back restyled, in pts order.  A live input
        # drops what the pipeline is behind on (on a loaded host, the first frames while the first encode runs), and
        # the stream's End counts them.
        assert row["error"] is None and row["end"] == "stopped", row
        assert row["input_frames"] == 16 and row["output_frames"] + row["input_dropped"] == 16, row
        lat = row["latency_ms"]
        assert 0 < lat["p50"] <= lat["p95"] <= lat["max"]
    assert r["system"]["throughput"]["input_dropped"] == 0  # backpressure drops nothing
    assert "| v2v throughput |" in printed and "| v2v live 16 FPS in |" in printed


@pytest.mark.unit
def test_guidance_rows_count_both_branches_and_the_cfg_table_compares_the_topologies():
    """The bytes a guided micro-step puts on the data plane: sequential CFG on PP=2 sends both rows' hidden states
    across the boundary and the latent back; CFG-parallel with PP=1 only swaps one prediction each way.  The report's
    guidance table names each topology and its GPUs."""
    import argparse

    from benchmarks.harness import cfg_label, comm_summary
    from benchmarks.report import tables

    def args(stages, cfg_parallel):
        return argparse.Namespace(
            model="wan2.1-1.3b",
            height=480,
            width=832,
            dtype="bfloat16",
            stages=stages,
            cfg_parallel=cfg_parallel,
            guidance=5.0,
            steps=1,
        )

    stages = [{"index": i, "mean_wait_ms": 1.0 + i, "mean_exchange_ms": 0.5 * i} for i in range(2)]
    seq, par = comm_summary(args(2, 1), stages), comm_summary(args(1, 2), stages)
    hidden = 1560 * 1536 * 2  # 1.3B at 480x832: 1560 tokens of 1536 bf16 values
    latent, flow = 16 * 60 * 104 * 4, 16 * 60 * 104 * 2
    assert seq["data_plane_bytes_per_micro_step"] == 2 * hidden + latent and seq["exchange_bytes_per_micro_step"] == 0
    assert par["data_plane_bytes_per_micro_step"] == par["exchange_bytes_per_micro_step"] == 2 * flow
    assert seq["exchange_ms_per_batch"] == 0.5 and par["exchange_ms_per_batch"] == 0.5  # the last stages' swaps
    assert cfg_label(vars(args(1, 2))) == ", guidance 5, CFG-parallel 2 x PP=1"

    def run(a, comm):
        system = {
            "steady_fps": 20.0,
            "whole_fps": 19.0,
            "ttff_p50_s": 0.5,
            "ttff_p95_s": 0.6,
            "time_to_ready_s": 9.0,
            "main": {"on_time": 1.0, "max_gap_ms": 90, "p99_gap_ms": 80, "gaps_over_250ms": 0, "frames": 960},
            "lead": {"max": 3, "bound": 4},
            "first_stream": {"steady_fps": 20.0, "on_time": 1.0, "max_gap_ms": 90, "gaps_over_250ms": 0, "ttff_s": 0.5},
            "ttff_parts_p50_ms": {},
            "interactive": {"p50_ms": 1, "p95_ms": 2},
            "comm": comm,
        }
        versions = {k: "x" for k in ("torch", "cuda", "nccl", "diffusers", "driver", "gpu_count", "gpu")}
        ratios = {"vs_peer": 1.0, "vs_peer_compiled": None, "of_floor": 0.1}
        return {"args": vars(a), "system": system, "ratios": ratios, "versions": versions, "timesteps": [700.0],
                "commit": "c", "dirty": False, "command": "cmd", "_file": "f.json"}  # fmt: skip

    text = tables([run(args(2, 1), seq), run(args(1, 2), par)])
    assert "### Classifier-free guidance: sequential CFG against CFG-parallel" in text
    assert "| 1.3B @ 832×480, 1 step, guidance 5, sequential CFG on PP=2 | 2 | **20.0** | 500 | 1.00 / 2.00 |" in text
    assert "| 1.3B @ 832×480, 1 step, guidance 5, CFG-parallel 2 × PP=1 | 2 | **20.0** |" in text


@pytest.mark.unit
def test_frame_stats_tells_late_frames_at_the_start_from_late_frames_later():
    from benchmarks.harness import frame_stats

    fps = 16.0
    on_time = [i / fps for i in range(64)]  # 4 s, every frame exactly on its due time
    assert frame_stats(on_time, fps)["on_time"] == 1.0
    start = [0.0] + [t + 0.1 for t in on_time[1:4]] + on_time[4:]  # frames 1-3 late by 100 ms
    later = on_time[:40] + [t + 0.2 for t in on_time[40:44]] + on_time[44:]  # frames 40-43 late by 200 ms
    s, lt = frame_stats(start, fps), frame_stats(later, fps)
    assert (s["late_first_s"], s["late_after_first_s"]) == (3, 0)
    assert (lt["late_first_s"], lt["late_after_first_s"]) == (0, 4)
    assert s["on_time"] == 61 / 64 and lt["on_time"] == 60 / 64
    assert lt["max_late_ms"] == pytest.approx(200.0)


@pytest.mark.multiprocess
def test_kv_admission_check_smoke_refuses_past_the_budget_and_serves_what_it_admits(tmp_path):
    out = tmp_path / "kv_smoke.json"
    r, _ = run_smoke("kv_admission_check", out, timeout=600)
    assert r["benchmark"] == "kv_admission" and all(r["checks"].values()), r["checks"]
    # A budget of 1.5 windowed streams: the stream without a window and the second windowed one are refused.
    assert not r["unbounded"]["admitted"] and "window: an unbounded KV window" in r["unbounded"]["refusal"]["details"]
    assert r["windowed"]["admitted"] == 1 and r["windowed"]["refusal"]["error"] == "ResourceExhaustedError"
    assert r["windowed"]["refusal"]["retry_after"] > 0
