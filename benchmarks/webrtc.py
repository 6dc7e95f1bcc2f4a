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

**Video-to-video latency**: a moving pattern at ``--target-fps`` goes in as the input of a stream with
``--strength`` (``--v2v-steps`` steps), and each output frame, which carries its input's pts, is matched to the input
frame's send time: over gRPC, the SDK sends raw input frames (dropping while gRPC has not taken 4, as the web
process does) and the latency runs to the output frame's arrival; over WebRTC, the aiortc peer sends the pattern as
its camera track and the latency runs to the output frame decoded from RTP (the web process's per-frame stats name
each output frame's input pts).  p50 and p95 per transport, and how many output frames were matched.
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

from benchmarks.harness import (
    frame_stats,
    percentile,
    smoke_system,
    start_system,
    system_device,
    system_flags,
    write_assets,
)
from launcher.local_cluster import web_args
from launcher.process import Launcher
from stagecast.api import DEFAULT_FPS
from stagecast.client import AsyncClient
from web.rtc import VIDEO_CLOCK, use_ice_hosts
from web.viewer import PatternCamera, RtcViewer, pattern


def kv_window(args) -> dict:
    """The benchmark protocol's KV window (BENCHMARKS.md: 6 latent frames, 3 of them sinks) as config fields."""
    return {"window": args.window, "sink": args.sink}


async def grpc_run(gateway: str, prompt: str, seconds: float, steps: int, kv: dict) -> dict:
    async with AsyncClient(gateway) as client:
        gen = client.generate(prompt, seconds=seconds, steps=steps, codec="raw", **kv)
        t0 = time.monotonic()
        arrivals = [time.monotonic() - t0 async for _ in gen]
    return {"ttff_s": arrivals[0], "arrivals_s": arrivals}


async def rtc_run(url: str, prompt: str, seconds: float, steps: int, fps: float, kv: dict) -> dict:
    t_connect = time.monotonic()
    async with RtcViewer(url) as viewer:
        connect_s = time.monotonic() - t_connect
        t0 = time.monotonic()
        viewer.send({"type": "config", "prompt": prompt, "seconds": seconds, "steps": steps, **kv})
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


async def grpc_v2v(gateway: str, prompt: str, args) -> dict:
    fps, sent, latencies = args.target_fps, {}, []
    async with AsyncClient(gateway) as client:
        gen = client.generate(
            prompt,
            strength=args.strength,
            steps=args.v2v_steps,
            width=args.width,
            height=args.height,
            codec="raw",
            **kv_window(args),
        )
        await gen.wait_started()

        async def feed() -> None:
            t0 = time.monotonic()
            for i in range(round(args.seconds * fps)):
                await asyncio.sleep(max(0.0, t0 + i / fps - time.monotonic()))
                if gen.frames_queued < 4:  # a live source drops rather than queue up
                    sent[round(i / fps, 6)] = time.time()
                    gen.send_frame(pattern(args.width, args.height, i), round(i / fps, 6))
            gen.stop()

        feeder = asyncio.get_running_loop().create_task(feed())
        async for frame in gen:
            t = sent.get(round(frame.pts, 6))
            if t is not None:
                latencies.append((time.time() - t) * 1e3)
        await feeder
    return {"sent": len(sent), "matched": len(latencies), "latencies_ms": latencies}


async def rtc_v2v(url: str, prompt: str, args) -> dict:
    fps = args.target_fps
    camera = PatternCamera(args.width, args.height, fps)
    held: dict[int, float] = {}
    async with RtcViewer(url, camera=camera) as viewer:
        viewer.send(
            {"type": "config", "prompt": prompt, "strength": args.strength, "steps": args.v2v_steps, **kv_window(args)}
        )
        await viewer.wait_for("started")
        t_end = time.monotonic() + args.seconds
        pts0 = None
        while time.monotonic() < t_end:
            try:
                frame = await viewer.next_frame(timeout=max(1.0, t_end - time.monotonic()))
            except asyncio.TimeoutError:
                break
            pts0 = frame.pts if pts0 is None else pts0
            held[round((frame.pts - pts0) * fps / VIDEO_CLOCK)] = time.time()
        viewer.send({"type": "stop"})
        t_stop = time.monotonic()
        # The output of input already sent still comes after Stop: keep taking it until the stream's end.
        while not any(m["type"] == "end" for m in viewer.log) and time.monotonic() - t_stop < 120:
            try:
                frame = await viewer.next_frame(timeout=1.0)
            except asyncio.TimeoutError:
                continue
            pts0 = frame.pts if pts0 is None else pts0
            held[round((frame.pts - pts0) * fps / VIDEO_CLOCK)] = time.time()
        input_pts = {m["index"]: m["pts"] for m in viewer.log if m["type"] == "frame"}
    latencies = [
        (held[i] - camera.sent_at[round(input_pts[i], 6)]) * 1e3
        for i in held
        if i in input_pts and round(input_pts[i], 6) in camera.sent_at
    ]
    return {"sent": len(camera.sent_at), "matched": len(latencies), "latencies_ms": latencies}


def v2v_summary(runs: list[dict]) -> dict:
    lat = [x for r in runs for x in r["latencies_ms"]]
    return {
        "runs": len(runs),
        "input_frames": sum(r["sent"] for r in runs),
        "matched": len(lat),
        "p50_ms": percentile(lat, 0.5) if lat else None,
        "p95_ms": percentile(lat, 0.95) if lat else None,
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
        grpc.append(
            await grpc_run(gateway, f"a red fox {uuid.uuid4().hex[:8]}", args.seconds, args.steps, kv_window(args))
        )
        rtc.append(
            await rtc_run(
                url, f"a red fox {uuid.uuid4().hex[:8]}", args.seconds, args.steps, args.target_fps, kv_window(args)
            )
        )
        print(
            f"[webrtc] run {run + 1}/{args.runs}: ttff grpc {grpc[-1]['ttff_s']:.3f} s, "
            f"webrtc {rtc[-1]['ttff_s']:.3f} s, delay p50 {rtc[-1]['delay_ms']['p50']:.1f} ms",
            flush=True,
        )
    out = {"grpc": summarize(grpc, args.target_fps), "webrtc": summarize(rtc, args.target_fps)}
    if args.strength:
        g2, r2 = [], []
        for run in range(args.runs):
            g2.append(await grpc_v2v(gateway, f"a watercolor {uuid.uuid4().hex[:8]}", args))
            r2.append(await rtc_v2v(url, f"a watercolor {uuid.uuid4().hex[:8]}", args))
            matched = f"grpc {g2[-1]['matched']}, webrtc {r2[-1]['matched']}"
            print(f"[webrtc] v2v run {run + 1}/{args.runs}: output frames matched to inputs: {matched}", flush=True)
        out["v2v"] = {
            "strength": args.strength,
            "steps": args.v2v_steps,
            "grpc": v2v_summary(g2),
            "webrtc": v2v_summary(r2),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    system_flags(ap, steps=1, stages=2)
    ap.add_argument("--seconds", type=float, default=20.0, help="video per stream")
    ap.add_argument("--runs", type=int, default=3, help="streams per transport")
    ap.add_argument("--target-fps", type=float, default=DEFAULT_FPS)
    ap.add_argument("--strength", type=float, default=500.0, help="video-to-video: input noised to (0: skip v2v)")
    ap.add_argument("--v2v-steps", type=int, default=2, help="video-to-video steps (the ladder must hold strength)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model, small frames: proves it runs")
    args = ap.parse_args(argv)

    if args.smoke:
        smoke_system(args)
        args.steps, args.seconds, args.runs, args.window, args.sink = 2, 1.0, 1, 2, 1
    device_kind = system_device(args)
    use_ice_hosts(["127.0.0.1"])
    env = {"OMP_NUM_THREADS": "1"} if device_kind == "cpu" else {}
    with tempfile.TemporaryDirectory(prefix="stagecast-webrtc-") as tmp, Launcher(env=env) as launcher:
        root = Path(tmp)
        write_assets(root, args)
        _pipe, gateway = start_system(launcher, root, args, device_kind)
        web = launcher.spawn("web", web_args(gateway, "127.0.0.1", 0, max_peers=2))
        result = asyncio.run(measure(gateway, web.info["url"], args))
    result = {"benchmark": "webrtc", "device": device_kind, "args": vars(args), **result}
    print(json.dumps({k: result[k] for k in ("grpc", "webrtc", "v2v") if k in result}, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
