"""The batched tiny decoder (``gateway.decode.batched_decoder``) on its own: each bucket's call, and N paced streams
(plus an
unpaced flood) served through it as the gateway serves them.

Usage (one GPU; random weights in the published layout unless ``--tiny-weights``; 1.3B's 480x832, 60x104 latents)::

    python -m benchmarks.batched_decoder_bench --compile --streams 1,4,6,8,10,16 --unpaced 8 \\
        --json benchmarks/results/batched_decoder.json
    python -m benchmarks.batched_decoder_bench --smoke --json /tmp/batched_smoke.json     # CPU, 4x4 latents

Rows:

- ``bucket``: ``BatchedDecoder.warm`` at each bucket (``--buckets``): the call's median ms (CUDA events after the
  compile, if any) and the per-stream ms, the ``VaeCost.batch_ms`` the gateway reports at start-up;
- ``served``: N paced streams, each submitting one chunk (``--latent-frames``, 4 frames per latent frame) every
  chunk period at ``--fps``, for ``--seconds``, and ``--unpaced`` streams submitting as fast as their sessions take
  them; per paced chunk the latency from submit to its frames on the host: p50/p99, the share done within one chunk
  period (``on_time``), the calls' mean batch size and the served ``batch_ms`` (recent medians).

``exact``: a probe stream decoded beside ``max(buckets) - 1`` others against alone (max |uint8 difference|: 0 on a
CPU by construction, rounding on a GPU).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from gateway.decode.batched_decoder import DEFAULT_BUCKETS, BatchedDecoder, allow_variants
from gateway.decode.tiny_decoder import load_tiny_decoder, tiny_to_uint8_frames
from launcher.demo_checkpoint import write_tiny_decoder
from stagecast.api import DEFAULT_FPS
from stagecast.names import DTYPES


def parse_ints(text: str) -> tuple[int, ...]:
    try:
        out = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not out or min(out) < 0:
        raise argparse.ArgumentTypeError(f"expected integers >= 0, got {text!r}")
    return out


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, 4x4 latents, 1 s: a quick check")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="float16", choices=sorted(DTYPES))
    ap.add_argument("--compile", action="store_true", help="torch.compile each bucket's pass (as --vae-compile)")
    ap.add_argument("--tiny-weights", default=None, help="a taew2_1.pth (default: random weights, 16 channels)")
    ap.add_argument("--latent", default="60x104", help="latent HxW (480x832 video: 60x104)")
    ap.add_argument("--latent-frames", type=int, default=1)
    ap.add_argument(
        "--buckets", type=parse_ints, default=DEFAULT_BUCKETS, help="batch sizes timed (padded to, with --compile)"
    )
    ap.add_argument("--streams", type=parse_ints, default=(1, 4, 6, 8, 10, 16), help="paced streams per served row")
    ap.add_argument("--unpaced", type=int, default=0, help="unpaced streams beside the paced ones")
    ap.add_argument("--fps", type=float, default=DEFAULT_FPS)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.smoke:
        args.device, args.dtype, args.latent, args.seconds = "cpu", "float32", "4x4", 1.0
        args.buckets, args.streams, args.fps = (1, 2), (1, 2), 4.0
    try:
        h, w = (int(v) for v in args.latent.split("x"))
    except ValueError:
        ap.error(f"--latent: expected HxW, got {args.latent!r}")
    if not (1 <= h <= 512 and 1 <= w <= 512):
        ap.error(f"--latent: sides must be 1..512, got {args.latent}")
    if not 1 <= args.latent_frames <= 16:
        ap.error(f"--latent-frames must be in 1..16, got {args.latent_frames}")
    if not 0 < args.fps <= 240 or not 0 < args.seconds <= 600 or not 0 <= args.unpaced <= 64:
        ap.error("--fps must be in (0, 240], --seconds in (0, 600], --unpaced in 0..64")
    if max(args.streams) + args.unpaced > 64:
        ap.error("--streams plus --unpaced: at most 64 streams")
    args.hw = (h, w)
    return args


def serve(decoder: BatchedDecoder, args, paced: int, unpaced: int) -> dict:
    """``paced`` streams at the chunk rate and ``unpaced`` as fast as they go, for ``args.seconds``."""
    shape = (1, 16, args.latent_frames, *args.hw)
    period = 4 * args.latent_frames / args.fps
    latencies: list[float] = []
    on_time = [0, 0]
    lock = threading.Lock()
    stop = threading.Event()
    calls_before, sizes_before = decoder.calls, len(decoder.batch_sizes)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(shape, generator=gen).to(decoder.part.device)

    def producer(session, is_paced):
        submitted = {}
        t0 = time.perf_counter()

        def consume():
            for tag, _frames, _when in session.results():
                lat = time.perf_counter() - submitted.pop(tag.index)
                if is_paced:
                    with lock:
                        latencies.append(lat)
                        on_time[0] += lat <= period
                        on_time[1] += 1

        reader = threading.Thread(target=consume, daemon=True)
        reader.start()
        c = 0
        while not stop.is_set():
            if is_paced:
                due = t0 + c * period
                if (wait := due - time.perf_counter()) > 0 and stop.wait(wait):  # pacing, as the coordinator does
                    break
            submitted[c] = time.perf_counter()
            if not session.submit(SimpleNamespace(index=c), x):
                break
            c += 1
        session.finish()
        reader.join()

    sessions = [decoder.open(4, paced=True) for _ in range(paced)] + [decoder.open(4) for _ in range(unpaced)]
    threads = [threading.Thread(target=producer, args=(s, i < paced), daemon=True) for i, s in enumerate(sessions)]
    for t in threads:
        t.start()
    stop.wait(args.seconds)
    stop.set()
    for t in threads:
        t.join()
    for s in sessions:
        s.close()
    sizes = (
        decoder.batch_sizes[sizes_before - len(decoder.batch_sizes) :]
        if len(decoder.batch_sizes) > sizes_before
        else []
    )
    lat = sorted(latencies)
    return {
        "row": "served",
        "paced": paced,
        "unpaced": unpaced,
        "chunks": len(lat),
        "p50_ms": round(1e3 * statistics.median(lat), 2) if lat else None,
        "p99_ms": round(1e3 * lat[min(len(lat) - 1, int(0.99 * len(lat)))], 2) if lat else None,
        "on_time": round(on_time[0] / on_time[1], 4) if on_time[1] else None,
        "calls": decoder.calls - calls_before,
        "mean_batch": round(float(np.mean(sizes)), 2) if sizes else None,
        "batch_ms": [round(v, 3) for v in decoder.batch_ms(max(args.buckets))],
    }


def exactness(decoder: BatchedDecoder, args) -> int:
    """Max |uint8 difference| of a probe stream beside others against alone, over 3 chunks."""
    part = decoder.part
    n = max(args.buckets)
    gen = torch.Generator().manual_seed(2)
    chunks = [[torch.randn(1, 16, 1, *args.hw, generator=gen) for _ in range(n)] for _ in range(3)]
    states = [part.new_state() for _ in range(n)]
    alone = part.new_state()
    worst = 0
    try:
        for xs in chunks:
            together = part.decode_batch(states, xs, pad_to=decoder.bucket(n))[0]
            lone = part.decode_chunk(alone, xs[0])
            a = tiny_to_uint8_frames(together).cpu().numpy().astype(int)
            b = tiny_to_uint8_frames(lone).cpu().numpy().astype(int)
            worst = max(worst, int(np.abs(a - b).max()))
    finally:
        for s in [*states, alone]:
            part.release(s)
    return worst


def main(argv=None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.tiny_weights or write_tiny_decoder(Path(tmp) / "random.pth", latent_channels=16)
        part = load_tiny_decoder(path, device=args.device, dtype=DTYPES[args.dtype], compile=args.compile)
    if args.compile:
        allow_variants(len(args.buckets))
    # Padded to the buckets when compiled (as the gateway does); eager calls run at any batch size.
    decoder = BatchedDecoder(part, buckets=args.buckets if args.compile or args.smoke else None)
    rows = []
    try:
        t0 = time.perf_counter()
        measured = decoder.warm((1, 16, args.latent_frames, *args.hw))
        warm_s = time.perf_counter() - t0
        for rows_n, ms in measured.items():
            rows.append(
                {"row": "bucket", "streams": rows_n, "call_ms": round(ms, 3), "per_stream_ms": round(ms / rows_n, 3)}
            )
        exact = exactness(decoder, args)
        for n in args.streams:
            rows.append(serve(decoder, args, n, args.unpaced))
            print(json.dumps(rows[-1]), flush=True)
    finally:
        decoder.close()
    out = {
        "bench": "batched_decoder",
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "dtype": args.dtype,
        "compile": args.compile,
        "latent_hw": list(args.hw),
        "latent_frames": args.latent_frames,
        "fps": args.fps,
        "warm_s": round(warm_s, 1),
        "batch_max_diff": exact,
        "state_mib": round(decoder.state_bytes_at(args.hw) / 2**20, 2),
        "rows": rows,
    }
    text = json.dumps(out, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
