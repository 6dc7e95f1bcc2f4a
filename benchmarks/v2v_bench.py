"""Video-to-video benchmark: the two BENCHMARKS.md v2v rows (throughput from a file, live input at 16 FPS).

Usage (2 GPUs, real configs, random bf16 weights, the real-size UMT5-XXL; one command runs both rows)::

    python -m benchmarks.v2v_bench --model wan2.1-1.3b --width 832 --height 480 --steps 2 --stages 2 \
        --cuda-graphs --vae-compile --json benchmarks/results/v2v_13b_2step_2gpu.json
    python -m benchmarks.v2v_bench --smoke          # CPU, tiny model: proves the script runs (a test runs this)

The system is the one ``benchmarks.harness`` starts (coordinator, stages, a gateway whose VAE is cut over the
stages' GPUs; the benchmark protocol of BENCHMARKS.md: one latent frame per chunk, KV window 6 with 3 sinks,
``per_level``, StreamDiffusionV2's ladder [700, 500] for 2 steps).  The input is a synthetic moving picture at the
stream's size, sent as JPEG frames; ``strength`` is the ladder's first timestep, so every step of the ladder runs
("2 steps from strength").

* **throughput**: ``--seconds`` of input (60 by default) fed as fast as the server accepts it
  (``input_pacing="backpressure"``: nothing is dropped, gRPC flow control holds the client back).  Steady FPS is
  counted at the client over the middle 40% of output frames, while input is still flowing.  Row: steady FPS >= 60.
* **live**: the same input released at ``--live-fps`` (16) in real time, ``input_pacing="live"`` (input the pipeline
  cannot take yet is dropped and counted).  Per-frame latency: from an input frame's release (just before the SDK
  encodes and sends it) to the arrival of the output frame carrying its pts; p50 / p95 / max, the share of input
  frames that came back, and the dropped count the gateway reports.  Row: p95 <= 300 ms.

Both streams run after a short warm-up stream (CUDA graphs, compiled VAE variants, the prompt's text embedding are
built there, and reported separately as cold figures).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.harness import (
    LADDER,
    frame_stats,
    git_commit,
    gpu_name,
    log,
    percentile,
    smoke_system,
    start_system,
    system_device,
    system_flags,
    tree_dirty,
    versions,
    write_assets,
)
from stagecast.api import DEFAULT_FPS

PROMPT = "harbour"  # short enough for the tiny text encoder's 16 tokens


def moving_picture(width: int, height: int, n: int, seed: int = 0):
    """A synthetic input: one random picture panned a few pixels per frame (cheap to make, not constant)."""
    base = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    for i in range(n):
        yield np.roll(base, 4 * i, axis=1)


def stream_kwargs(args) -> dict:
    ladder = list(LADDER[: args.steps])
    return dict(
        strength=ladder[0],
        timesteps=ladder,
        width=args.width,
        height=args.height,
        codec=args.codec,
        chunk_frames=1,
        window=args.window,
        sink=args.sink,
        policy="per_level",
        target_fps=args.live_fps,
        input_format="jpeg",
    )


class V2VRecord:
    """One video-to-video stream: input release times by pts, output arrivals by pts (client clock)."""

    def __init__(self, client, args, frames: int, prompt: str, *, live_fps: float | None):
        self.args = args
        self.frames = frames
        self.live_fps = live_fps
        self.released: dict[float, float] = {}
        self.arrivals: list[float] = []
        self.latencies_ms: list[float] = []
        self.error: str | None = None
        pacing = "live" if live_fps else "backpressure"
        self.tr = client.transform(self._source(), prompt, input_pacing=pacing, timeout=3600, **stream_kwargs(args))

    def _source(self):
        fps = self.args.live_fps
        start = None
        for i, rgb in enumerate(moving_picture(self.args.width, self.args.height, self.frames)):
            pts = i / fps
            if self.live_fps:
                if start is None:
                    start = time.monotonic()
                delay = start + i / self.live_fps - time.monotonic()  # a live source: frame i exists at i / fps
                if delay > 0:
                    time.sleep(delay)
            self.released[pts] = time.monotonic()  # absolute: the stream's t0 is set while this already runs
            yield rgb, pts

    def run(self) -> V2VRecord:
        try:
            for frame in self.tr:
                now = frame.timing.received_s  # seconds since the stream's t0
                self.arrivals.append(now)
                sent = self.released.get(frame.pts)
                if sent is not None:
                    self.latencies_ms.append((self.tr.t0 + now - sent) * 1e3)
        except Exception as exc:  # noqa: BLE001 - recorded in the result
            self.error = f"{type(exc).__name__}: {exc}"
        return self

    def json(self) -> dict:
        stats = frame_stats(self.arrivals, self.args.live_fps) if self.arrivals else {}
        lat = self.latencies_ms
        return {
            "pipeline_stream_id": self.tr.info.pipeline_stream_id if self.arrivals else None,
            "ttff_s": self.tr.ttff,
            "input_frames": self.tr.frames_sent,
            "output_frames": len(self.arrivals),
            "input_dropped": self.tr.end.input_dropped if self.tr.end else None,  # the gateway's count (LIVE)
            "end": self.tr.end.reason if self.tr.end else None,
            "latency_ms": {
                "p50": percentile(lat, 0.5) if lat else None,
                "p95": percentile(lat, 0.95) if lat else None,
                "max": max(lat) if lat else None,
            },
            **stats,
            "error": self.error,
        }


def run(args, root: Path, device_kind: str) -> dict:
    import stagecast
    from launcher.process import Launcher

    out: dict = {}
    with Launcher() as launcher:
        t = time.perf_counter()
        _pipe, gateway = start_system(launcher, root, args, device_kind)
        out["time_to_ready_s"] = time.perf_counter() - t
        log("ready")
        with stagecast.Client(gateway) as client:
            warm = V2VRecord(client, args, args.warmup_frames, PROMPT, live_fps=None).run()
            out["warmup"] = warm.json()
            log("warm-up stream")
            for name, live in (("throughput", None), ("live", args.live_fps)):
                frames = int(args.seconds * args.live_fps)
                out[name] = V2VRecord(client, args, frames, PROMPT, live_fps=live).run().json()
                log(name)
    return out


def markdown_rows(result: dict) -> list[str]:
    a = result["args"]
    topo = f"{a['stages']}× {result['gpu']}"
    thr, live = result["system"]["throughput"], result["system"]["live"]

    def f(x, spec=".1f"):
        return "–" if x is None else format(x, spec)

    return [
        f"| v2v throughput | {a['model']} {a['width']}×{a['height']} | {a['steps']} from strength | {topo} | "
        f"steady {f(thr.get('steady_fps'))} FPS | latency p95 {f(thr['latency_ms']['p95'], '.0f')} ms | "
        f"dropped {thr['input_dropped']} | {result['commit']} |",
        f"| v2v live {a['live_fps']:g} FPS in | {a['model']} {a['width']}×{a['height']} | {a['steps']} from strength | "
        f"{topo} | {f(live.get('whole_fps'))} FPS out | latency p50 {f(live['latency_ms']['p50'], '.0f')} / "
        f"p95 {f(live['latency_ms']['p95'], '.0f')} ms | dropped {live['input_dropped']} | {result['commit']} |",
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    system_flags(ap, steps=2, stages=2, steps_help="ladder steps, all run from strength (its first timestep)")
    ap.add_argument("--seconds", type=float, default=60.0, help="input video per measured stream")
    ap.add_argument("--warmup-frames", type=int, default=81)
    ap.add_argument("--live-fps", type=float, default=DEFAULT_FPS, help="the live input's rate (and the pts clock)")
    ap.add_argument("--codec", default="jpeg")
    ap.add_argument("--gateway-gpu", type=int, default=None)
    ap.add_argument("--vae-gpus", default=None)
    ap.add_argument("--vae-split", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model, small frames: proves the script runs")
    args = ap.parse_args(argv)
    if args.smoke:
        smoke_system(args)
        args.seconds, args.warmup_frames, args.window, args.sink, args.codec = 1.0, 5, 2, 1, "raw"
    device_kind = system_device(args)
    command = "python -m benchmarks.v2v_bench " + " ".join(argv if argv is not None else sys.argv[1:])
    with tempfile.TemporaryDirectory(prefix="stagecast-v2v-") as tmp:
        root = Path(tmp)
        write_assets(root, args)
        system = run(args, root, device_kind)
    result = {
        "benchmark": "v2v",
        "gpu": gpu_name(),
        "commit": git_commit(),
        "dirty": tree_dirty(),
        "versions": versions(),
        "command": command,
        "args": vars(args),
        "timesteps": list(LADDER[: args.steps]),
        "system": system,
    }
    print(json.dumps(result, indent=1))
    for row in markdown_rows(result):
        print(row)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
