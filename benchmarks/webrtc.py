"""What the browser edge costs: the same streams over gRPC (the SDK) and over WebRTC (``stagecast web``, an aiortc
peer standing in for the browser), on one system, alternating.

Usage::

    python -m benchmarks.webrtc --model wan2.1-1.3b --steps 1 --stages 2 --cuda-graphs --vae-compile \
        --json benchmarks/results/webrtc_13b_1step_2gpu.json          # GPUs: real configs, random weights
    python -m benchmarks.webrtc --smoke                               # CPU, tiny model, a few seconds

Per run and transport, with a prompt the server has not seen: TTFF (config sent to the first frame the client
holds: for WebRTC, decoded from RTP), steady FPS and the on-time share at ``--target-fps`` (``harness.frame_stats``:
frame i due at the first frame's arrival + i / fps), and for WebRTC the one-way delay from the web process handing a
frame to the RTP encoder (its ``sent_at``) to the peer holding it decoded (encode, packetise, loopback, jitter
buffer, decode; one machine, one clock), and the time to connect (offer to open data channel).  Everything runs on
loopback: the web process and the peer offer 127.0.0.1 only, and no ICE server is configured.

Video-to-video latency (an input frame's send time to its generated frame's arrival) needs input frames on the
public API; it is not measured here yet.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
import uuid
from pathlib import Path

from benchmarks.harness import frame_stats, percentile, start_system, write_assets
from launcher.local_cluster import web_args
from launcher.process import Launcher
from stagecast.client import AsyncClient
from web.rtc import VIDEO_CLOCK, use_ice_hosts
from web.viewer import RtcViewer


async def grpc_run(gateway: str, prompt: str, seconds: float, steps: int) -> dict:
    async with AsyncClient(gateway) as client:
        gen = client.generate(prompt, seconds=seconds, steps=steps, codec="raw")
        t0 = time.monotonic()
        arrivals = [time.monotonic() - t0 async for _ in gen]
    return {"ttff_s": arrivals[0], "arrivals_s": arrivals}


async def rtc_run(url: str, prompt: str, seconds: float, steps: int, fps: float) -> dict:
    t_connect = time.monotonic()
    async with RtcViewer(url) as viewer:
        connect_s = time.monotonic() - t_connect
        t0 = time.monotonic()
        viewer.send({"type": "config", "prompt": prompt, "seconds": seconds, "steps": steps})
        total = round(seconds * fps)
        arrivals: list[float] = []
        held_at: dict[int, float] = {}
        pts0 = None
        # aiortc's receiver hands a frame out when the next one's first packet arrives, so the stream's last frame
        # never comes out of this peer (a browser's jitter buffer uses the RTP marker bit): total - 1 frames.
        while len(arrivals) < total - 1:
            try:
                frame = await viewer.next_frame(timeout=max(30.0, 4 * seconds))
            except asyncio.TimeoutError:
                break  # frames lost on the way (RTP over loopback rarely loses any); the rest count as they are
            now = time.monotonic() - t0
            pts0 = frame.pts if pts0 is None else pts0
            index = round((frame.pts - pts0) * fps / VIDEO_CLOCK)
            arrivals.append(now)
            held_at[index] = time.time()
        await viewer.wait_for("end", timeout=60)
        sent = {m["index"]: m["sent_at"] for m in viewer.log if m["type"] == "frame"}
    delays = [(held_at[i] - sent[i]) * 1e3 for i in held_at if i in sent]
    return {
        "connect_s": connect_s,
        "ttff_s": arrivals[0],
        "arrivals_s": arrivals,
        "frames_expected": total,
        "delay_ms": {"p50": percentile(delays, 0.5), "p95": percentile(delays, 0.95), "max": max(delays)},
    }


def summarize(runs: list[dict], fps: float) -> dict:
    stats = [frame_stats(r["arrivals_s"], fps) for r in runs]
    ttffs = [r["ttff_s"] for r in runs]
    out = {
        "runs": len(runs),
        "ttff_p50_s": percentile(ttffs, 0.5),
        "ttff_max_s": max(ttffs),
        "steady_fps": statistics.median(s["steady_fps"] for s in stats if s["steady_fps"]),
        "on_time": statistics.median(s["on_time"] for s in stats if s["on_time"] is not None),
        "max_gap_ms": max(s["max_gap_ms"] for s in stats if s["max_gap_ms"] is not None),
        "frames": [s["frames"] for s in stats],
    }
    if "delay_ms" in runs[0]:
        out["delay_p50_ms"] = statistics.median(r["delay_ms"]["p50"] for r in runs)
        out["delay_p95_ms"] = max(r["delay_ms"]["p95"] for r in runs)
        out["connect_p50_s"] = statistics.median(r["connect_s"] for r in runs)
        out["frames_expected"] = runs[0]["frames_expected"]
    return out


async def measure(gateway: str, url: str, args) -> dict:
    grpc, rtc = [], []
    for run in range(args.runs):  # alternating, each with a prompt the text encoder has not seen
        grpc.append(await grpc_run(gateway, f"a red fox {uuid.uuid4().hex[:8]}", args.seconds, args.steps))
        rtc.append(await rtc_run(url, f"a red fox {uuid.uuid4().hex[:8]}", args.seconds, args.steps, args.target_fps))
        print(
            f"[webrtc] run {run + 1}/{args.runs}: ttff grpc {grpc[-1]['ttff_s']:.3f} s, "
            f"webrtc {rtc[-1]['ttff_s']:.3f} s, delay p50 {rtc[-1]['delay_ms']['p50']:.1f} ms",
            flush=True,
        )
    return {"grpc": summarize(grpc, args.target_fps), "webrtc": summarize(rtc, args.target_fps)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="wan2.1-1.3b")
    ap.add_argument("--width", type=int, default=832)
    ap.add_argument("--height", type=int, default=480)
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--partition", default=None)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--cuda-graphs", action="store_true")
    ap.add_argument("--vae-compile", action="store_true")
    ap.add_argument("--text-encoder", default=None, choices=["umt5-xxl", "tiny"])
    ap.add_argument("--seconds", type=float, default=20.0, help="video per stream")
    ap.add_argument("--runs", type=int, default=3, help="streams per transport")
    ap.add_argument("--target-fps", type=float, default=16.0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model, small frames: proves it runs")
    args = ap.parse_args(argv)
    import torch

    if args.smoke:
        args.model, args.width, args.height, args.stages, args.dtype = "tiny-wan2.1", 64, 64, 2, "float32"
        args.steps, args.seconds, args.runs = 2, 1.0, 1
    device_kind = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    if args.text_encoder is None:
        args.text_encoder = "umt5-xxl" if device_kind == "cuda" else "tiny"
    # What harness.start_system reads.
    args.load, args.gateway_gpu, args.vae_gpus, args.vae_split = [], None, None, None
    use_ice_hosts(["127.0.0.1"])
    env = {"OMP_NUM_THREADS": "1"} if device_kind == "cpu" else {}
    with tempfile.TemporaryDirectory(prefix="stagecast-webrtc-") as tmp, Launcher(env=env) as launcher:
        root = Path(tmp)
        write_assets(root, args)
        _pipe, gateway = start_system(launcher, root, args, device_kind)
        web = launcher.spawn("web", [*web_args(gateway, "127.0.0.1", 0), "--max-peers", "2"])
        result = asyncio.run(measure(gateway, web.info["url"], args))
    result = {"benchmark": "webrtc", "device": device_kind, "args": vars(args), **result}
    print(json.dumps({k: result[k] for k in ("grpc", "webrtc")}, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
