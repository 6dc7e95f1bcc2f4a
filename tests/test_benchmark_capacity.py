"""The harness's capacity mode (``--capacity``) and the report's capacity table.

The system test runs the capacity smoke on the CPU with the coordinator's SLO model fixed at 160 ms per stage forward
of one micro-step (``--slo-stage-ms 160,160``: batches of 4 with 5% growth, 46 ms per stage per micro-step; both
stages on this one CPU host, so a micro-step costs their sum, 92 ms: coordinator/slo.py, "A CPU host").  A paced
stream at 16 FPS (4 chunks/s) at 1 step needs 36.8% of the host; admission holds 90%, so two streams are admitted and
the third is refused at once with RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import report
from benchmarks.report import BEGIN, END


@pytest.mark.multiprocess
def test_capacity_mode_opens_streams_until_admission_refuses_one_and_writes_the_row(tmp_path):
    out = tmp_path / "v2_cap_smoke.json"
    cmd = [sys.executable, "-m", "benchmarks.harness", "--smoke", "--capacity", "--decoder", "tiny"]
    cmd += ["--slo-stage-ms", "160,160", "--capacity-max", "4", "--burst", "3", "--burst-seconds", "2"]
    cmd += ["--no-pace-grid"]  # 2 streams admitted, the 3rd refused: the average-batch model's arithmetic
    cmd += ["--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    s = r["system"]
    assert r["peer"] is None and r["floor"] is None  # capacity smoke: no peers
    assert s["ttff_s"] == [] and s["interactive"] is None and s["load"] == []  # skipped parts
    assert s["main"]["frames"] == 32  # the one unpaced main stream (2 s) still runs, on the tiny decoder
    [row] = s["capacity"]
    assert row["decoder"] == "tiny" and row["admitted"] == 2 and len(row["per_stream"]) == 2
    refusal = row["refusal"]
    assert refusal["stream"] == 3 and refusal["code"] == "RESOURCE_EXHAUSTED"
    assert "over capacity" in refusal["details"] and 0 < refusal["ms"] < 1000  # at once
    assert row["failure"] is None
    # Held or not, it is said: capacity is the held count only when every admitted stream held.
    assert row["held"] == sum(p["held"] for p in row["per_stream"])
    assert row["capacity"] == (2 if row["held"] == 2 else None)
    assert ("capacity 2" in row["verdict"]) == (row["held"] == 2)
    for p in row["per_stream"]:
        assert p["frames"] > 2 and p["window_frames_due"] > 0 and 0 <= p["on_time"] <= 1
        assert p["held"] == (p["on_time"] >= 0.99) and p["error"] is None and p["ttff_s"] > 0
        # The first frame's time, split by the gateway's stamps: the pipeline's part is prompt + open + first chunk.
        parts = p["ttff_parts_ms"]
        assert parts["prompt"] > 0 and parts["open"] > 0 and parts["first_chunk"] > 0 and parts["vae"] > 0
        assert parts["pipeline"] == pytest.approx(parts["prompt"] + parts["open"] + parts["first_chunk"], abs=0.2)
        assert sum(parts[k] for k in ("pipeline", "vae", "encode", "rest")) == pytest.approx(p["ttff_s"] * 1e3, abs=0.5)
    slowest = max(row["per_stream"], key=lambda p: p["ttff_s"])
    assert row["ttff_slowest_parts_ms"] == slowest["ttff_parts_ms"]
    assert 0 < row["ttff_p50_s"] <= row["ttff_p95_s"] and row["window_s"] >= 3.0
    assert set(row["steps_chosen"]) == {"1"}  # fixed 1 step, from the coordinator's status samples
    assert row["mean_batch"] >= 1 and len(row["stages"]) == 2 and all(st["batches"] > 0 for st in row["stages"])
    assert row["memory"]["decoder_state_bytes_per_stream"] > 0  # the gateway's tiny decoder state
    assert row["frames_delivered"] > 0 and row["gateway_cpu_ms_per_frame"] > 0
    # The model's busy share of the two admitted streams (36.8% each on this host), beside NVML's (none on a CPU).
    assert row["priced_busy_pct"] == pytest.approx(73.6, abs=0.5) and row["gpu_busy"] is None
    assert row["slo_model"]["vae_source"] in ("none", "operator", "gateway")  # what admission priced the decode at
    # This row's decoder as priced when the first stream opened, and after the window: --slo-stage-ms fixes the
    # model (--slo-fixed), so the gateway's reports are not counted and the decode costs the operator's 0.
    tiny = row["slo_model"]["decoders"]["tiny"]
    assert (
        tiny
        == row["slo_model_end"]["decoders"]["tiny"]
        == {
            "chunk_ms": 0.0,
            "batch_ms": [],
            "formed_batch": 0.0,
            "source": "operator",
        }
    )

    # The burst: 3 streams opened at one instant on the idle system.  Admission holds 2 one at a time; opened together
    # on a loaded CPU it admitted 2 once and 1 once, so the row is held to what it says, not to a count.
    burst = s["burst"]
    admitted, refused = burst["admitted"], burst["refused"]
    assert burst["streams"] == 3 and 1 <= admitted <= 2 and admitted + refused == 3 and burst["failed"] == []
    assert len(burst["refusal_ms"]) == refused and 0 < burst["refusal_ms_max"] < 1000
    assert len(burst["per_stream"]) == admitted and burst["held"] == sum(p["held"] for p in burst["per_stream"])
    assert 0 < burst["ttff_p50_s"] <= burst["ttff_p95_s"] <= burst["ttff_max_s"]
    assert ("every one held" in burst["verdict"]) == (burst["held"] == admitted)

    # The report's capacity table renders the row.
    doc = tmp_path / "BENCHMARKS.md"
    doc.write_text(f"# B\n\n{BEGIN}\n{END}\n")
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.report", "--results", str(tmp_path), "--out", str(doc)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    text = doc.read_text()
    priced = "(tiny priced 0 ms/chunk alone, operator) | 2 | "
    assert f"| tiny, 1 step, 64×64, tiny {priced}" in text and f"RESOURCE_EXHAUSTED, {refusal['ms']:.0f} ms" in text
    assert "### Bursts" in text and f"| tiny, 1 step, 64×64, tiny | 3 | {admitted} / " in text  # the burst row


def _run(**capacity) -> dict:
    """A capacity-only harness result (no main stream) with one capacity row."""
    row = {
        "decoder": "tiny",
        "admitted": 7,
        "held": 7,
        "capacity": 7,
        "verdict": "capacity 7: every admitted stream held, stream 8 refused",
        "refusal": {"stream": 8, "code": "RESOURCE_EXHAUSTED", "details": "over capacity", "ms": 41.6},
        "ttff_p50_s": 0.612,
        "ttff_p95_s": 0.777,
        "on_time_min": 0.9951,
        "freezes": 0,
        "steps_chosen": {"1": 30, "2": 90},
        "mean_batch": 3.5,
        "stages": [{"index": 0, "mean_forward_ms": 37.25, "mean_batch": 3.5}],
        "memory": {"decoder_state_bytes_per_stream": 64 << 20, "kv_bytes_per_stream": 300 << 20},
        "gateway_cpu_ms_per_frame": 1.234,
        "ramp": [{"streams": 1, "stages": [{"mean_forward_ms": 21.04, "mean_batch": 1.0}]}],
        "ttff_slowest_parts_ms": {
            "pipeline": 600.0,
            "vae": 150.2,
            "encode": 9.0,
            "rest": 17.8,
            "prompt": 77.4,
            "open": 62.6,
            "first_chunk": 460.0,
        },
        **capacity,
    }
    return {
        "harness": 2,
        "commit": "abc1234",
        "dirty": False,
        "versions": {k: "v" for k in ("torch", "cuda", "nccl", "diffusers", "driver", "gpu")} | {"gpu_count": 1},
        "command": "python -m benchmarks.harness --capacity",
        "timesteps": [700.0],
        "args": {"model": "wan2.1-1.3b", "width": 832, "height": 480, "steps": 2, "load_min_steps": 1, "stages": 1},
        "system": {"main": None, "lead": None, "load": [], "capacity": [row]},
        "peer": None,
        "floor": None,
        "ratios": {"vs_peer": None, "vs_peer_compiled": None, "of_floor": None},
    }


@pytest.mark.unit
def test_the_capacity_table_renders_each_cell_from_the_json_and_names_what_is_missing(tmp_path):
    (tmp_path / "v2_cap_a.json").write_text(json.dumps(_run()))
    not_held = _run(
        held=5, capacity=None, verdict="admitted but not held: 5 of 7 admitted streams held", decoder="full"
    )
    not_held["commit"] = "def5678"
    (tmp_path / "v2_cap_b.json").write_text(json.dumps(not_held))
    doc, history = tmp_path / "B.md", tmp_path / "H.md"
    assert report.main(["--results", str(tmp_path), "--out", str(doc), "--history", str(history)]) == 0
    text = doc.read_text()
    lines = {line.split(" | ")[0]: line for line in text.splitlines() if line.startswith("| 1.3B, SLO 1–2 steps")}
    tiny = lines["| 1.3B, SLO 1–2 steps, 832×480, tiny"]
    assert tiny == (
        "| 1.3B, SLO 1–2 steps, 832×480, tiny | 1 | **7** | 7 / 7 | RESOURCE_EXHAUSTED, 42 ms | 612 / 777 | 99.5% | 0 "
        "| 2: 75%, 1: 25% | 3.50 | 37.2 | 64 / 300 | 1.23 | abc1234 |"
    )
    full = lines["| 1.3B, SLO 1–2 steps, 832×480, full"]
    assert "| – (admitted but not held: 5 of 7 admitted streams held) | 7 / 5 |" in full and "def5678" in full
    ramp = "- 1.3B, SLO 1–2 steps, 832×480, tiny (abc1234): 1 open: 21.0 ms at batch 1.00"
    assert ramp in history.read_text() and ramp not in text  # the ramp: in the history, not on the page
    # The slowest first frame taken apart: its parts add up to its TTFF (the 777 ms p95 here).
    assert (
        "- 1.3B, SLO 1–2 steps, 832×480, tiny (abc1234): 777 ms = prompt 77 + open 63 + first chunk 460 + decode 150 "
        "+ encode 9 + rest 18"
    ) in text
    # No main stream: no main-stream table rows for these runs; every expected configuration is named as missing.
    assert "### Steady state" in text and "| 1.3B @ 832×480" not in text
    missing = text.split("Missing (no `--capacity` JSON yet): ", 1)[1].split("\n", 1)[0]
    assert "capacity-14b" in missing and "capacity-5b" in missing and "capacity-1.3b`" in missing
    assert "SLO 1–2" not in missing  # the fixture's configurations are not in the expected list: nothing hides them


@pytest.mark.unit
def test_the_capacity_table_reads_a_load_row_that_met_a_refusal_as_a_look(tmp_path):
    r = copy.deepcopy(_run())
    r["system"]["capacity"] = []
    refused = "ResourceExhaustedError: RESOURCE_EXHAUSTED: over capacity"
    r["system"]["load"] = [
        {"streams": 4, "failed": 0, "refused": 0, "held": 3, "all_held": False, "per_stream": [], "steps": []},
        {
            "streams": 6,
            "failed": 1,
            "refused": 1,
            "held": 5,
            "all_held": True,
            "ttff_p50_s": 0.449,
            "ttff_p95_s": 0.613,
            "on_time_min": 1.0,
            "per_stream": [{"refused": False, "error": None}] * 5 + [{"refused": True, "error": refused}],
            "steps": [{"1": 240}] * 5,
            "steady_fps_min": 16.0,
            "steady_fps_mean": 16.0,
            "aggregate_fps": 80.0,
        },
    ]
    r["args"] |= {"load_min_steps": None, "steps": 1, "decoders": ["tiny"], "load": [4, 6]}
    table = report.capacity_table([{**r, "_file": "v2_x.json"}])
    [line] = [x for x in table.splitlines() if "(load rows:" in x]
    assert line.startswith("| 1.3B, 1 step, 832×480, tiny (load rows: 6 opened at once, `v2_x.json`) | 1 | **5** |")
    assert line.endswith("| 5 / 5 | RESOURCE_EXHAUSTED | 449 / 613 | 100.0% | 1: 100% (frames) | abc1234 |")
    # Not in the capacity mode's table: that one has no rows and says so.
    assert "| (no capacity rows yet: see Missing) |" in table
    assert table.index("(no capacity rows yet") < table.index("A look from load rows") < table.index(line)


def _rec(arrivals: list[float], error: str | None = None):
    from types import SimpleNamespace

    gen = SimpleNamespace(info=SimpleNamespace(pipeline_stream_id=7))
    return SimpleNamespace(
        arrivals=arrivals, gen=gen, ttff_s=arrivals[0], first=None, steps={1: len(arrivals)}, error=error
    )


@pytest.mark.unit
def test_a_capacity_stream_is_held_by_the_frames_due_in_the_window_and_a_frame_that_never_came_is_late():
    from benchmarks.harness import capacity_stream

    paced = [1.0 + i / 16 for i in range(16 * 10)]  # 10 s at 16 FPS from t = 1 s
    # Late in its first second (the ramp: frames 2..9, 300 ms late), on time inside the window [3 s, 9 s].
    ramp_late = [t + (0.3 if 2 <= i < 10 else 0.0) for i, t in enumerate(paced)]
    s = capacity_stream(_rec(ramp_late), 3.0, 9.0, 16.0)
    assert s["held"] and s["on_time"] == 1.0 and s["window_frames_due"] == 97  # due at 3.0, 3.0625, ..., 9.0
    assert s["late_frames"] == 0 and s["late_max_ms"] is None and s["late_first_s"] is None
    assert s["on_time_to_stop"] == (129 - 8) / 129 and s["steady_fps"] == pytest.approx(16.0)
    assert s["freezes"] == 1 and s["pipeline_stream_id"] == 7  # the ramp's 362 ms gap counts: from the first frame
    # Frames stop at 6 s: the ones due after it count late, so the stream is not held.
    cut = [t for t in paced if t <= 6.0]
    s = capacity_stream(_rec(cut), 3.0, 9.0, 16.0)
    assert not s["held"] and s["on_time"] == pytest.approx(49 / 97)
    # The 48 frames due after the cut never came: late, with no lateness to measure; the first was due 3.0625 s in.
    assert s["late_frames"] == 48 and s["late_max_ms"] is None and s["late_first_s"] == pytest.approx(3.0625)
    # A 400 ms freeze inside the window: one gap over 250 ms, and the frames after it late.
    frozen = [t + (0.4 if t >= 5.0 else 0.0) for t in paced]
    s = capacity_stream(_rec(frozen), 3.0, 9.0, 16.0)
    assert s["freezes"] == 1 and s["max_gap_ms"] == pytest.approx(462.5) and not s["held"]
    assert s["late_max_ms"] == pytest.approx(400.0) and s["late_first_s"] == pytest.approx(2.0)  # due at 5.0 s
    # The first late frames listed on the stream's clock: frame 64 (due 1 + 64/16 s), then every one after, 400 ms.
    listed = s["late_listed"]
    assert listed[0] == [64, 5.0, 400.0] and [i for i, _, _ in listed] == list(range(64, 76))
    assert all(ms == pytest.approx(400.0) for _, _, ms in listed)
    assert [x[2] for x in capacity_stream(_rec(cut), 3.0, 9.0, 16.0)["late_listed"]] == [None] * 12  # never came
    # A stream that ended with an error is not held whatever its punctuality.
    assert not capacity_stream(_rec(paced, error="UnavailableError: gone"), 3.0, 9.0, 16.0)["held"]


@pytest.mark.unit
def test_a_late_frame_is_put_down_to_the_first_part_that_ran_past_its_due_time():
    from benchmarks.harness import capacity_stream
    from benchmarks.harness.capacity import late_totals

    # 4 frames a chunk at 16 FPS from t = 1 s; chunk c's frames are due at 1 + (4c + k) / 16 s (k = 0..3).
    frames = 16 * 8
    arrivals = [1.0 + i / 16 for i in range(frames)]
    chunks = {}
    for c in range(frames // 4):
        due_ms = (1.0 + 4 * c / 16) * 1e3
        stamps = {"latents_ms": due_ms - 100, "decoded_ms": due_ms - 60, "encoded_ms": due_ms - 50}
        chunks[c] = {"chunk": c, **stamps}
    # Chunk 10's latents came 30 ms after its first frame was due; chunk 12 decoded 20 ms late; chunk 14 encoded 10 ms
    # late; chunk 16 was on time at the gateway, and its first frame arrived 45 ms late anyway.
    for c, stamps in ((10, (30, 35, 40)), (12, (-100, 20, 25)), (14, (-100, -60, 10))):
        due_ms = (1.0 + 4 * c / 16) * 1e3
        chunks[c] = {
            "chunk": c,
            **{k: due_ms + ms for k, ms in zip(("latents_ms", "decoded_ms", "encoded_ms"), stamps)},
        }
    late = {4 * c for c in (10, 12, 14, 16)}
    arrivals = [t + (0.045 if i in late else 0.0) for i, t in enumerate(arrivals)]
    rec = _rec(arrivals)
    rec.chunks, rec.frame_chunk = chunks, [i // 4 for i in range(frames)]
    s = capacity_stream(rec, 1.5, 8.9, 16.0)
    assert s["late_frames"] == 4
    causes = s["late_causes"]
    assert causes["late_frames_by_cause"] == {"pipeline": 1, "decode": 1, "encode": 1, "delivery": 1, "missing": 0}
    assert causes["decode_wait_ms"]["p50"] == 40.0 and causes["decode_wait_ms"]["max"] == 120.0  # chunk 12: -100..+20
    # A row sums its streams' causes; a frame that never came counts as missing.
    cut = _rec(arrivals[:100])
    cut.chunks, cut.frame_chunk = {c: v for c, v in chunks.items() if c < 25}, [i // 4 for i in range(100)]
    t = capacity_stream(cut, 1.5, 8.9, 16.0)
    never = 127 - 100  # frames 100..126 were due by 8.9 s and never came
    assert t["late_causes"]["late_frames_by_cause"]["missing"] == never and t["late_frames"] == never + 4
    total = late_totals([s, t])
    assert total["late_frames_by_cause"]["missing"] == never and total["late_frames_by_cause"]["decode"] == 2
    # Without the gateway's stamps (an SDK that gives none) there is nothing to say.
    assert capacity_stream(_rec(arrivals), 1.5, 9.0, 16.0)["late_causes"] is None
    assert late_totals([capacity_stream(_rec(arrivals), 1.5, 9.0, 16.0)]) is None


# BENCHMARKS.md as a results page: the committed page, history and index are what the report makes from the committed
# JSON, the page stays short, and it shows the newest row of each configuration.
ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


@pytest.mark.unit
def test_benchmarks_md_is_a_short_page_whose_capacity_header_names_held_per_gpu_and_admitted_over_held():
    text = (ROOT / "BENCHMARKS.md").read_text()
    assert len(text) <= 40_000, f"BENCHMARKS.md is {len(text):,} characters; the page holds at most 40,000"
    [header] = [line for line in text.splitlines() if line.startswith("| config | GPUs | **held per GPU** |")]
    assert "held per GPU" in header and "| admitted / held |" in header
    # What readers look for: the peers and the floor beside each throughput row, steady FPS, cold start, the
    # 8-stream load row, the DiT levers at batch 1/4/8/12, and the fleet table between the markers fleet_sim writes.
    assert "| peer eager | peer compiled | floor |" in text and "| time to READY (s) |" in text
    assert any(line.split(" | ")[1:2] == ["8"] for line in text.splitlines() if line.startswith("| 1.3B @ "))
    assert "| variant | batch 1 | batch 4 | batch 8 | batch 12 |" in text
    assert text.count("<!-- fleet_sim:table -->") == 1 and text.count("<!-- fleet_sim:table end -->") == 1


@pytest.mark.unit
def test_the_committed_page_history_and_index_are_what_the_report_makes_from_the_committed_json(tmp_path):
    args = ["--results", str(RESULTS), "--out", str(ROOT / "BENCHMARKS.md")]
    assert report.main([*args, "--check"]) == 0, "stale: run python -m benchmarks.report and commit what it writes"
    # A number changed by hand inside a generated block is caught, and --check writes nothing.
    page = (ROOT / "BENCHMARKS.md").read_text()
    head, block = page.split(BEGIN, 1)
    edited = head + BEGIN + re.sub(r"\*\*(\d+)\*\*", lambda m: f"**{int(m[1]) + 1}**", block, count=1)  # one held count
    assert edited != page
    stale = tmp_path / "BENCHMARKS.md"
    stale.write_text(edited)
    index = tmp_path / "INDEX.md"
    argv = ["--results", str(RESULTS), "--out", str(stale), "--index", str(index), "--history", str(tmp_path / "H.md")]
    assert report.main([*argv, "--check"]) == 1
    assert stale.read_text() == edited and not index.exists() and not (tmp_path / "H.md").exists()
    # Without --check it writes the page back to the committed one; the index names every result file.
    assert report.main(argv) == 0
    assert stale.read_text() == page and index.read_text() == (RESULTS / "INDEX.md").read_text()
    listed = {line.split("`")[1]: line for line in index.read_text().splitlines() if line.startswith("| `")}
    assert {p.name for p in RESULTS.iterdir() if p.name not in ("INDEX.md", "HISTORY.md")} <= set(listed)
    # A run's log carries its JSON's date and commit; a capacity run is named by its capacity rows' configurations.
    log = listed["v2_cap_13b_slo4_1gpu_grid_r7.json.startup.log"].split(" | ")
    assert log[1:4] == ["2026-12-02", "bdc38f6", "1.3B, SLO 1–4 steps, 832×480, tiny, pace grid"]


def _main_run(name: str, date: str, fps: float, peer: bool) -> dict:
    """A harness-v2 run with a main stream (1.3B 1 step on one GPU) and a load row of 8 streams."""
    r = copy.deepcopy(_run())
    r["args"] = {"model": "wan2.1-1.3b", "width": 832, "height": 480, "steps": 1, "stages": 1}
    main = {"on_time": 1.0, "max_gap_ms": 90.0, "p99_gap_ms": 80.0, "gaps_over_250ms": 0, "frames": 960}
    r["system"] = {
        "main": main,
        "lead": {"max": 3, "bound": 3},
        "steady_fps": fps,
        "whole_fps": fps,
        "time_to_ready_s": 100.0,
        "ttff_p50_s": 0.2,
        "ttff_p95_s": 0.25,
        "load": [{"streams": 8, "steady_fps_min": 6.0, "steady_fps_mean": 6.5, "on_time_min": 0.5} | _load_cells()],
        "capacity": [],
    }
    r["peer"], r["floor"] = ({"fps": 30.0}, {"fps": 150.0}) if peer else (None, None)
    r["peer_compiled"] = None
    r["ratios"] = {"vs_peer": fps / 30.0 if peer else None, "vs_peer_compiled": None, "of_floor": None}
    return {**r, "date": date, "commit": name, "_file": f"v2_{name}.json"}


def _load_cells() -> dict:
    return {"ttff_p50_s": 0.4, "ttff_p95_s": 0.5, "aggregate_fps": 52.0, "failed": 0}


@pytest.mark.unit
def test_the_page_shows_the_newest_run_of_each_configuration_and_the_history_every_run():
    old = _main_run("aaa0001", "2026-12-01", 40.0, peer=True)
    new = _main_run("bbb0002", "2026-12-02", 44.0, peer=False)  # no peers measured: it takes the older run's
    cap_r2 = {**copy.deepcopy(_run()), "date": "2026-12-02", "commit": "ccc0003", "_file": "v2_cap_x_r2.json"}
    cap_r10 = {**copy.deepcopy(_run(admitted=6, held=6, capacity=6)), "date": "2026-12-02", "commit": "ddd0004"}
    cap_r10["_file"] = "v2_cap_x_r10.json"  # _r10 is after _r2 on the same day, though it sorts before it by name
    runs = [new, cap_r10, old, cap_r2]
    page, history = report.page_tables(runs), report.tables(runs)
    rows = [line for line in page.splitlines() if line.startswith("| 1.3B @ 832×480, 1 step")]
    # One steady row, one cold-start row and one load row: the newest run's, with the older run's peer and floor.
    assert len(rows) == 3 and "| **40.0** |" not in page
    assert rows[0].startswith("| 1.3B @ 832×480, 1 step ² | 1 | **44.0** |") and "| 30.0 | – | 150 | 1.47× |" in rows[0]
    assert "`v2_bbb0002.json` takes the peers and floor of `v2_aaa0001.json`" in page
    assert "| 1.3B @ 832×480, 1 step | 8 | 6.0 / 6.5 |" in page and page.count("| 8 | 6.0 / 6.5 |") == 1
    cap = [line for line in page.splitlines() if line.startswith("| 1.3B, SLO 1–2 steps, 832×480, tiny")]
    assert len(cap) == 1 and "| **6** | 6 / 6 |" in cap[0] and cap[0].endswith("| ddd0004 |")
    # The page lists the files behind its rows; the history has every row and the runs table with the commands.
    assert "`v2_cap_x_r10.json`" in page and "v2_cap_x_r2.json" not in page
    assert "| **44.0** |" in history and "| **40.0** |" in history and history.count("| 8 | 6.0 / 6.5 |") == 2
    assert "| **7** | 7 / 7 |" in history and "### Runs" in history and "### Runs" not in page


@pytest.mark.unit
def test_a_capacity_configuration_names_the_levers_and_the_tiny_graphs_it_ran_with():
    args = {"model": "wan2.1-1.3b", "width": 832, "height": 480, "steps": 1, "pace_grid": True}
    plain = report.capacity_config(args, "tiny")
    graphed = report.capacity_config(args | {"tiny_cuda_graphs": True, "dit_levers": "fused@rows"}, "tiny")
    assert plain == "1.3B, 1 step, 832×480, tiny, pace grid"
    assert graphed == "1.3B, 1 step, 832×480, tiny, pace grid, levers fused@rows, tiny graphs"


@pytest.mark.unit
def test_a_run_on_another_card_names_it_and_never_stands_for_the_pages_card(tmp_path):
    h200 = {**copy.deepcopy(_run()), "date": "2026-12-02", "commit": "aaa0001", "gpu": "NVIDIA H200"}
    h100 = {**copy.deepcopy(_run(admitted=4, held=4, capacity=4)), "date": "2026-12-03", "commit": "bbb0002"}
    h100["gpu"] = "NVIDIA H100 80GB HBM3"  # newer, same configuration: on an H200 page it must not replace the row
    for i, r in enumerate((h200, h100)):
        (tmp_path / f"v2_cap_x_r{i + 1}.json").write_text(json.dumps(r))
    runs = report.load(tmp_path)
    page, history = report.page_tables(runs), report.tables(runs)
    rows = [line for line in page.splitlines() if line.startswith("| 1.3B, SLO 1–2 steps, 832×480, tiny")]
    assert [("on H100" in line, line.endswith("| aaa0001 |")) for line in rows] == [(False, True), (True, False)]
    assert "tiny, on H100 80GB HBM3 |" in history and "| **4** | 4 / 4 |" in history and "| **7** | 7 / 7 |" in page


@pytest.mark.unit
def test_gpu_busy_summarises_each_gpus_samples_and_says_none_without_nvml(monkeypatch):
    import builtins

    from benchmarks.harness.capacity import GpuBusy

    real_import = builtins.__import__

    def no_nvml(name, *args, **kwargs):
        if name == "pynvml":
            raise ImportError("no NVML here")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_nvml)
    with GpuBusy(period=0.01) as busy:
        pass
    assert busy.summary() is None and busy.samples == []  # nothing sampled, the row says None
    busy.samples = [[50, 10], [70, 30], [90, 20], [100, 40]]  # two GPUs, four samples
    s = busy.summary()
    assert s["samples"] == 4
    assert s["mean_pct"] == [77.5, 25.0]
    assert s["p90_pct"] == [100, 40] and s["p10_pct"] == [50, 10]
