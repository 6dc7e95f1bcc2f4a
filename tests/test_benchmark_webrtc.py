"""The WebRTC benchmark runs end to end on CPU (tiny model), so it cannot rot between GPU runs: the same streams over
gRPC and over WebRTC, with TTFF, pacing and the web-to-peer delay."""

import pytest

from tests.test_benchmark_smoke import run_smoke

pytestmark = pytest.mark.multiprocess


def test_webrtc_benchmark_smoke_reports_both_transports(tmp_path):
    out = tmp_path / "webrtc.json"
    r, _ = run_smoke("webrtc", out, timeout=600)
    grpc, rtc = r["grpc"], r["webrtc"]
    assert grpc["frames"] == [16]  # 1 s at 16 fps over gRPC
    assert rtc["frames_expected"] == 16 and rtc["frames"][0] >= 15  # the peer holds all but the last (see module)
    assert 0 < grpc["ttff_p50_s"] and 0 < rtc["ttff_p50_s"] and 0 < rtc["connect_p50_s"]
    assert 0 < rtc["delay_p50_ms"] <= rtc["delay_p95_ms"]
    assert 0 <= rtc["on_time"] <= 1 and rtc["steady_fps"] > 0
    # Video-to-video: output frames matched to the input frames they were made from, on both transports.
    v2v = r["v2v"]
    for transport in ("grpc", "webrtc"):
        row = v2v[transport]
        assert 0 < row["matched"] <= row["input_frames"], (transport, row)
        assert 0 < row["p50_ms"] <= row["p95_ms"], (transport, row)
