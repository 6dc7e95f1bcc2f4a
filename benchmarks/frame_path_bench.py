"""The gateway's per-frame CPU path at many streams: does encoding N streams' frames keep up with N x 16 FPS?

Usage (CPU only; run it on the serving host, whose cores the gateway shares with the stage processes)::

    python -m benchmarks.frame_path_bench --streams 1,4,10,16 --codecs jpeg,h264,raw --json /tmp/frame_path.json
    python -m benchmarks.frame_path_bench --smoke                 # 64x64, 2 streams, a few frames

What one frame costs in a stream's decode thread (``gateway.stream.frames.FrameEmitter.emit``), each stream in its own
thread as in the gateway: ``stagecast.media.make_encoder(codec, chunked=True)`` (JPEG: Pillow; H.264: PyAV/x264
ultrafast zerolatency in fragmented MP4, a keyframe at each chunk's first frame; raw: the RGB bytes), then the
``stagecast.v1.ServerMessage`` holding it, serialized (what gRPC does to it in its own thread).  Frames are
``--width`` x ``--height`` uint8 RGB, smooth moving gradients with a little noise (closer to decoded video than
noise, which no encoder compresses), 4 per chunk as the decoder hands them over.

Per codec and stream count: ``fps`` (frames of all streams per wall second), ``cpu_ms_per_frame`` (this process's
CPU time over the frames: the cost in cores), ``scaling`` (fps over the one-stream fps: N when nothing serializes;
near 1 when the GIL or one thread does), and ``fits`` (whether ``fps`` >= N x ``--fps``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

import numpy as np

from stagecast.api import DEFAULT_FPS
from stagecast.media import make_encoder
from stagecast.v1 import stream_pb2 as pb

CODECS = ("jpeg", "h264", "raw")


def synthetic_frames(count: int, width: int, height: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    out = []
    for t in range(count):
        r = 127 + 100 * np.sin((x + 7 * t) / 37.0)
        g = 127 + 100 * np.cos((y - 5 * t) / 29.0)
        b = 127 + 100 * np.sin((x + y + 3 * t) / 53.0)
        img = np.stack([r, g, b], axis=-1) + rng.normal(0, 4, (height, width, 3))
        out.append(np.clip(img, 0, 255).astype(np.uint8))
    return out


def run_streams(codec: str, streams: int, frames_per_stream: int, pool: list[np.ndarray], args) -> dict:
    barrier = threading.Barrier(streams + 1)
    errors: list[BaseException] = []

    def stream(i: int) -> None:
        encoder = make_encoder(codec, width=args.width, height=args.height, fps=args.fps, quality=None, chunked=True)
        try:
            barrier.wait()
            for n in range(frames_per_stream):
                frame = pool[(n + i) % len(pool)]
                data = encoder.encode(frame, keyframe=n % 4 == 0)
                msg = pb.ServerMessage(frame=pb.Frame(data=data, index=n, width=args.width, height=args.height))
                msg.SerializeToString()
            if codec == "h264":
                encoder.flush()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            encoder.close()

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(streams)]
    for t in threads:
        t.start()
    barrier.wait()
    wall0, cpu0 = time.perf_counter(), time.process_time()
    for t in threads:
        t.join()
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    if errors:
        raise errors[0]
    total = streams * frames_per_stream
    return {
        "codec": codec,
        "streams": streams,
        "frames": total,
        "fps": round(total / wall, 1),
        "cpu_ms_per_frame": round(1e3 * cpu / total, 3),
        "wall_ms_per_frame": round(1e3 * wall / total, 3),
    }


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--streams", default="1,4,10,16")
    ap.add_argument("--codecs", default=",".join(CODECS))
    ap.add_argument("--width", type=int, default=832)
    ap.add_argument("--height", type=int, default=480)
    ap.add_argument("--fps", type=float, default=DEFAULT_FPS)
    ap.add_argument("--frames", type=int, default=64, help="frames per stream")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.smoke:
        args.streams, args.width, args.height, args.frames = "1,2", 64, 64, 8
    try:
        args.streams = [int(v) for v in args.streams.split(",")]
    except ValueError:
        ap.error(f"--streams: expected comma-separated integers, got {args.streams!r}")
    args.codecs = args.codecs.split(",")
    if not all(1 <= n <= 64 for n in args.streams):
        ap.error("--streams: each in 1..64")
    if any(c not in CODECS for c in args.codecs):
        ap.error(f"--codecs: each one of {', '.join(CODECS)}")
    if not (16 <= args.width <= 4096 and 16 <= args.height <= 4096) or args.width % 2 or args.height % 2:
        ap.error("--width/--height: even, 16..4096")
    if not 1 <= args.frames <= 10_000 or not 0 < args.fps <= 240:
        ap.error("--frames in 1..10000, --fps in (0, 240]")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    pool = synthetic_frames(8, args.width, args.height)
    rows = []
    for codec in args.codecs:
        base = None
        for n in args.streams:
            row = run_streams(codec, n, args.frames, pool, args)
            base = base or (row["fps"] if n == 1 else None)
            row["scaling"] = round(row["fps"] / base, 2) if base else None
            row["needed_fps"] = n * args.fps
            row["fits"] = row["fps"] >= n * args.fps
            rows.append(row)
            print(json.dumps(row), flush=True)
    out = {
        "bench": "frame_path",
        "cpus": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "size": f"{args.width}x{args.height}",
        "rows": rows,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
