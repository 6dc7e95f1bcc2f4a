"""Stage start-up time on a real-size checkpoint on disk: how long until every stage is READY.

Usage (a GPU machine; about 30 GB free on the disk for the 14B checkpoint)::

    python -m benchmarks.startup --out /data/wan14b-random --stages 2            # writes it once, then measures
    python -m benchmarks.startup --out /data/wan14b-random --stages 2 --drop-caches   # cold read (needs root)

The checkpoint is the named config (default ``wan2.1-14b``: 28 GB in bfloat16) with random weights, written once the
way ``stagecast convert`` writes one: safetensors shards in layer order (embedders, patch embedding, one shard per
block, head), so each stage opens only the shards of its own layers.  Then a coordinator and ``--stages`` stages
start as real processes (``launcher.local_cluster.start_pipeline``), each stage reading its slice in parallel
threads onto ``cuda:(i % GPUs)``, and the script prints one JSON row: per stage the time from process start to
READY (the ``ready_s`` of its READY line, also ``stagecast_stage_startup_seconds{phase="ready"}``) and the slice
load time from its log, the wall time until the whole pipeline was formed, and whether the page cache was dropped
first (``cold``) or not (``warm``: the numbers then measure memory-speed reads, not the disk).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import time
from pathlib import Path

import torch

from launcher.convert import WEIGHTS_INDEX_NAME
from launcher.demo_checkpoint import write_random_checkpoint
from launcher.local_cluster import start_pipeline
from launcher.process import Launcher

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_LOADED = re.compile(r"stage (\d+) loaded layers (\d+):(\d+) in ([0-9.]+)s")


def drop_page_cache() -> bool:
    """``sync; echo 3 > /proc/sys/vm/drop_caches``: True when it worked (root), else the read is warm."""
    subprocess.run(["sync"], check=False)
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        return False
    return True


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder of the random checkpoint (written when missing)")
    p.add_argument("--model", default="wan2.1-14b", help="named config (stagecast.model.dit_configs)")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES), help="stored and loaded dtype")
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--device", default="cuda", help="cuda (stage i on cuda:(i % GPUs)) or cpu")
    p.add_argument("--drop-caches", action="store_true", help="drop the page cache first (cold read; needs root)")
    args = p.parse_args()

    folder = Path(args.out)
    if not (folder / WEIGHTS_INDEX_NAME).is_file():
        t0 = time.perf_counter()
        size = write_random_checkpoint(folder, args.model, DTYPES[args.dtype])
        print(f"wrote {size / 1e9:.1f} GB to {folder} in {time.perf_counter() - t0:.0f}s", flush=True)
    size = json.loads((folder / WEIGHTS_INDEX_NAME).read_text())["metadata"]["total_size"]
    cold = drop_page_cache() if args.drop_caches else False
    if args.drop_caches and not cold:
        print("could not drop the page cache (not root): the read below is warm", flush=True)

    t0 = time.perf_counter()
    with Launcher() as launcher:
        pipe = start_pipeline(
            launcher, checkpoint=str(folder), stages=args.stages, device=args.device, dtype=args.dtype
        )
        formed = time.perf_counter() - t0
        stages = []
        for index, child in sorted(pipe.stage_children.items()):
            loads = [m for line in child.log if (m := _LOADED.search(line))]
            load = loads[-1] if loads else None
            stages.append(
                {
                    "stage": index,
                    "ready_s": float(child.info.get("ready_s", "nan")),
                    "load_s": float(load.group(4)) if load else None,
                    "layers": f"{load.group(2)}:{load.group(3)}" if load else None,
                }
            )
    row = {
        "benchmark": "stage_startup",
        "model": args.model,
        "dtype": args.dtype,
        "checkpoint_gb": round(size / 1e9, 2),
        "stages": args.stages,
        "device": args.device,
        "page_cache": "cold" if cold else "warm",
        "pipeline_formed_s": round(formed, 2),
        "per_stage": stages,
        "host": os.uname().nodename,
        "gpus": torch.cuda.device_count(),
    }
    print(json.dumps(row, indent=2), flush=True)


if __name__ == "__main__":
    main()
