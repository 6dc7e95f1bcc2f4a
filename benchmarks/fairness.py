"""Paced streams under hostile unpaced load: a paced stream's FPS alone, then beside unpaced streams of another client.

Usage::

    python -m benchmarks.fairness --stages 1 --cuda-graphs --vae-compile \
        --json benchmarks/results/fairness_1gpu.json        # GPU: Wan2.1-1.3B 480x832, random weights
    python -m benchmarks.fairness --smoke                   # CPU, tiny model: the path only, the numbers mean nothing

What it does, through the public API:

1. one paced stream of ``--seconds`` alone: its steady FPS (the middle of its frames, ``harness.frame_stats``);
2. ``--unpaced`` unbounded unpaced streams from one client (the gateway is started with room for all of them per
   client: the worst case for the scheduler's priority, not for the per-client quota), read as fast as they come;
3. while they run, the same paced stream from another client: its steady FPS and on-time share beside them;
4. the unpaced streams are cancelled.  Checks: the paced stream was admitted beside them, completed, and its steady
   FPS is at least ``--min-ratio`` (0.9) of what it got alone.  Exits 1 if a check fails (not with ``--smoke``).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
from pathlib import Path

import stagecast
from benchmarks.harness import (
    StreamRecord,
    smoke_system,
    start_system,
    system_device,
    system_flags,
    write_assets,
)
from launcher.process import Launcher
from stagecast.api import DEFAULT_FPS


def measure(gateway: str, args) -> dict:
    with stagecast.Client(gateway) as viewer:
        alone = StreamRecord(viewer, args, args.seconds, "a fox alone", pace=True).run()
    out: dict = {"alone": alone.json()}
    with stagecast.Client(gateway) as greedy, stagecast.Client(gateway) as viewer:
        hogs = [StreamRecord(greedy, args, None, f"a hog {i}", pace=False) for i in range(args.unpaced)]
        for hog in hogs:  # every unpaced stream is admitted (or refused) before the paced one asks
            try:
                hog.gen.wait_started()
            except stagecast.StagecastError:
                pass  # run() records the refusal
        readers = [threading.Thread(target=hog.run, daemon=True) for hog in hogs]
        for reader in readers:
            reader.start()
        beside = StreamRecord(viewer, args, args.seconds, "a fox beside hogs", pace=True).run()
        for hog in hogs:
            hog.gen.cancel()
        for reader in readers:
            reader.join(60)
    out["beside"] = beside.json()
    out["unpaced"] = [{"frames": len(h.arrivals), "error": h.error, "refused": h.refused} for h in hogs]
    a, b = alone.stats().get("steady_fps"), beside.stats().get("steady_fps")
    out["fps_ratio"] = b / a if a and b else None
    out["checks"] = {
        "the paced stream was admitted beside the unpaced ones": not beside.refused,
        "it completed": beside.error is None and len(beside.arrivals) == len(alone.arrivals),
        f"its steady FPS is at least {args.min_ratio:.0%} of alone": (out["fps_ratio"] or 0.0) >= args.min_ratio,
    }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    system_flags(ap, steps=2, stages=1)
    ap.add_argument("--seconds", type=float, default=10.0, help="video of the paced stream")
    ap.add_argument("--unpaced", type=int, default=8, help="unpaced streams of the hostile client")
    ap.add_argument("--target-fps", type=float, default=DEFAULT_FPS)
    ap.add_argument("--codec", default="jpeg", choices=["jpeg", "h264", "raw"])
    ap.add_argument("--min-ratio", type=float, default=0.9)
    ap.add_argument("--json", default=None)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model, 1 s, 2 unpaced streams")
    args = ap.parse_args(argv)
    if args.smoke:
        smoke_system(args)
        args.seconds, args.unpaced, args.steps = 1.0, 2, 2
    args.load_min_steps, args.guidance, args.negative_prompt = 0, 1.0, ""
    device_kind = system_device(args)
    args.load = [args.unpaced + 1]  # the gateway's and the coordinator's caps (and the per-client quota) fit them all
    with tempfile.TemporaryDirectory(prefix="stagecast-fair-") as tmp, Launcher() as launcher:
        root = Path(tmp)
        write_assets(root, args)
        _, gateway = start_system(launcher, root, args, device_kind)
        result = measure(gateway, args)
    result = {"benchmark": "fairness", "device": device_kind, "args": vars(args), **result}
    summary = {k: result[k] for k in ("fps_ratio", "checks")}
    print(json.dumps(summary, indent=2, default=str))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=str) + "\n")
    return 0 if args.smoke or all(result["checks"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
