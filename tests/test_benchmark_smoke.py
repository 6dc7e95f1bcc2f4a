"""The benchmark harness runs end to end (CPU, tiny model) so it cannot rot between GPU runs."""

import json
import subprocess
import sys


def test_harness_smoke_mode_reports_system_peer_and_floor(tmp_path):
    out = tmp_path / "smoke.json"
    md = tmp_path / "bench.md"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.harness", "--smoke", "--json", str(out), "--markdown", str(md)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["system"]["fps"] > 0 and r["system"]["frames"] > 0
    assert 0 < r["system"]["ttff_p50_s"] <= r["system"]["ttff_p95_s"]
    parts = r["system"]["ttff_parts_p50_ms"]
    assert set(parts) == {"pipeline", "vae", "encode", "rest"}
    assert parts["pipeline"] > 0 and parts["vae"] > 0 and parts["encode"] >= 0 and parts["rest"] > 0
    # Each part is a median over the TTFF streams; a stream's parts add up to its TTFF.
    assert sum(parts.values()) <= 2 * r["system"]["ttff_p95_s"] * 1e3
    assert len(r["system"]["stages"]) == 2 and all(s["batches"] > 0 for s in r["system"]["stages"])
    assert r["peer"]["fps"] > 0
    assert r["floor"]["fps"] > 0 and r["floor"]["tflop_per_video_frame"] > 0
    assert r["ratios"]["vs_peer"] == r["system"]["fps"] / r["peer"]["fps"]
    assert md.read_text().count("\n") == 1 and "tiny-wan2.1" in md.read_text()
