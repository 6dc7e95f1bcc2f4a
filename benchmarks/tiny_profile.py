"""Where the batched tiny decoder's time goes on one GPU: its call at each batch size, taken apart.

Usage (one GPU, random weights in the published layout, 480x832 video: 60x104 latents)::

    python -m benchmarks.tiny_profile --rows 1,4,8 --dtypes bfloat16,float16 --json /tmp/tiny_profile.json

For each dtype, layout (``nchw``, ``channels_last``) and cuDNN setting (heuristics; ``--cudnn-benchmark``: timed
search) and each batch size, ms of (CUDA events, median of ``--calls`` after a compile warm-up):

- ``frame``: the compiled one-latent-frame pass alone, on fixed inputs (the GPU work);
- ``graph``: that pass and the postprocess captured as one CUDA graph and replayed (no launch cost);
- ``call``: ``TinyStreamDecoder.decode_batch`` (gather, pass, postprocess, per-stream stacking, scatter);
- ``host``: ``call`` plus the uint8 conversion and the one copy to the host (what ``BatchedDecoder`` times and reports);
- ``launch``: host seconds (as ms) for ``decode_batch`` to return, without waiting for the GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from gateway.decode.batched_decoder import allow_variants, to_host_uint8
from gateway.decode.tiny_decoder import load_tiny_decoder
from launcher.demo_checkpoint import write_tiny_decoder
from stagecast.names import DTYPES


def timed(fn, calls: int) -> float:
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    out = []
    for _ in range(calls):
        begin.record()
        fn()
        end.record()
        end.synchronize()
        out.append(begin.elapsed_time(end))
    return statistics.median(out)


def profile(path: Path, dtype: torch.dtype, rows: int, hw, calls: int, channels_last: bool) -> dict:
    dec = load_tiny_decoder(path, device="cuda", dtype=dtype, compile=True)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    if channels_last:
        dec.model.to(memory_format=fmt)
    gen = torch.Generator().manual_seed(0)
    states = [dec.new_state() for _ in range(rows)]
    xs = [torch.randn(1, dec.latent_channels, 1, *hw, generator=gen) for _ in range(rows)]
    for _ in range(3):  # compile, then the steady memories
        dec.decode_batch(states, xs)
    torch.cuda.synchronize()
    out = {"call": timed(lambda: dec.decode_batch(states, xs), calls)}
    out["host"] = timed(lambda: to_host_uint8(dec.decode_batch(states, xs)), calls)
    launches = []
    for _ in range(calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dec.decode_batch(states, xs)
        launches.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    out["launch"] = statistics.median(launches)
    x = torch.cat([x[:, :, 0] for x in xs]).to("cuda", dtype).contiguous(memory_format=fmt)
    memory = [
        torch.cat([s.memory[i] for s in states]).contiguous(memory_format=fmt) for i in range(len(states[0].memory))
    ]

    def frame():
        raw, _ = dec._compiled(x, memory)
        return [dec.model.postprocess(f) for f in raw]

    out["frame"] = timed(frame, calls)
    try:
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            frame()
            frame()
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph):
            frame()
        out["graph"] = timed(graph.replay, calls)
    except Exception as exc:  # noqa: BLE001 - a measurement: say why it is missing
        out["graph"] = None
        out["graph_error"] = f"{type(exc).__name__}: {exc}"[:300]
    for s in states:
        dec.release(s)
    return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in out.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,4,8")
    ap.add_argument("--dtypes", default="bfloat16,float16")
    ap.add_argument("--latent", default="60x104")
    ap.add_argument("--layouts", default="nchw,channels_last")
    ap.add_argument("--cudnn", choices=("heuristics", "search", "both"), default="both")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("tiny_profile: needs a GPU", file=sys.stderr)
        return 2
    hw = tuple(int(v) for v in args.latent.split("x"))
    rows = [int(v) for v in args.rows.split(",")]
    allow_variants(len(rows) * 4)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        path = write_tiny_decoder(Path(tmp) / "random.pth")
        for bench in {"heuristics": (False,), "search": (True,), "both": (False, True)}[args.cudnn]:
            torch.backends.cudnn.benchmark = bench
            for name in args.dtypes.split(","):
                for channels_last in [layout == "channels_last" for layout in args.layouts.split(",")]:
                    for r in rows:
                        t0 = time.perf_counter()
                        row = profile(path, DTYPES[name], r, hw, args.calls, channels_last)
                        row.update(
                            dtype=name,
                            rows=r,
                            layout="channels_last" if channels_last else "nchw",
                            cudnn_benchmark=bench,
                            setup_s=round(time.perf_counter() - t0, 1),
                        )
                        results.append(row)
                        print(json.dumps(row), flush=True)
    if args.json:
        Path(args.json).write_text(
            json.dumps({"bench": "tiny_profile", "device": torch.cuda.get_device_name(), "rows": results}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
