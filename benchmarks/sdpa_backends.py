"""Which scaled-dot-product-attention kernel runs the DiT's attention fastest, and which ones run it at all.

Usage (one GPU; a smoke run works on a CPU with tiny shapes)::

    python -m benchmarks.sdpa_backends --json benchmarks/results/sdpa_backends_<commit>.json
    python -m benchmarks.sdpa_backends --smoke --json /tmp/sdpa_smoke.json

The shapes are the benchmark protocol's (DESIGN.md section 4) for Wan2.1-1.3B: a chunk's 1560 query tokens, self-
attention over a full 6-frame window (9360 cached + 1560 new keys) and cross-attention over 512 text tokens, 12 heads
of 128, bf16, at batch 1 and 4.  Each of torch's SDPA backends (flash, memory-efficient, cuDNN; math at batch 1 only:
it materialises the scores) is forced alone (and cuDNN first by priority with flash after it, to see which runs) with
``torch.nn.attention.sdpa_kernel`` and timed with CUDA events (median of ``--iters`` after ``--warmup``), eagerly and
replayed from a captured CUDA graph (how the stage runs its blocks), in two layouts: ``permuted`` (the (B, L, H, D)
tensors the DiT holds, permuted to (B, H, L, D) as ``stage_service.dit_slice._sdpa`` passes them) and ``contiguous``
((B, H, L, D) in memory).  A backend that refuses a case is recorded with torch's reason.  Per case: ms, TFLOP/s, the
max |difference| from the flash kernel's output, and the ms the 30 layers' attention would cost per stream-chunk.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from benchmarks.fp8_check import time_forwards
from benchmarks.harness.rows import git_commit

# name -> (the backends enabled, whether their order is a priority: ``sdpa_kernel(..., set_priority=True)``)
BACKENDS = {
    "flash": ([SDPBackend.FLASH_ATTENTION], False),
    "efficient": ([SDPBackend.EFFICIENT_ATTENTION], False),
    "cudnn": ([SDPBackend.CUDNN_ATTENTION], False),
    "math": ([SDPBackend.MATH], False),
    # cuDNN first by priority, flash enabled after it: which one torch runs (max_diff_vs_flash 0: flash)
    "cudnn>flash (priority)": ([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION], True),
}
LAYERS = 30


def make_inputs(batch: int, queries: int, keys: int, heads: int, dim: int, layout: str, device, dtype):
    """q, k, v as SDPA takes them, (B, H, L, D): views of (B, L, H, D) tensors (``permuted``) or contiguous."""
    g = torch.Generator(device="cpu").manual_seed(0)

    def one(length: int) -> torch.Tensor:
        t = torch.randn(batch, length, heads, dim, generator=g).to(device=device, dtype=dtype)
        t = t.permute(0, 2, 1, 3)
        return t.contiguous() if layout == "contiguous" else t

    return one(queries), one(keys), one(keys)


def graphed(fn, device):
    """``fn`` captured once into a CUDA graph; returns (replay, its static output)."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        fn()  # warm-up outside the capture (workspace allocations)
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph.replay, out


def run_case(name, backends, priority, q, k, v, reference, args, device) -> dict:
    record: dict = {"backend": name}
    call = lambda: F.scaled_dot_product_attention(q, k, v)  # noqa: E731
    try:
        with sdpa_kernel(backends, set_priority=priority), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = call()
            record["eager_ms"] = round(time_forwards(call, device, args.warmup, args.iters)["median_ms"], 4)
            if device.type == "cuda":
                replay, static = graphed(call, device)
                record["graphed_ms"] = round(time_forwards(replay, device, args.warmup, args.iters)["median_ms"], 4)
                record["graphed_max_diff_vs_eager"] = float((static - out).abs().max())
    except RuntimeError as exc:
        record["error"] = str(exc).splitlines()[0][:400]
        record["warnings"] = [str(w.message)[:400] for w in caught][:6]
        return record
    record["max_diff_vs_flash"] = None if reference is None else float((out.float() - reference.float()).abs().max())
    return record


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,4", help="comma-separated batch sizes")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, any device (what the test runs)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.smoke:
        heads, dim, queries, window, text = 2, 16, 24, 48, 8
    else:
        heads, dim, queries, window, text = 12, 128, 1560, 9360, 512
    kinds = {"self": queries + window, "cross": text}
    cases = []
    for batch in (int(b) for b in args.batches.split(",")):
        for kind, keys in kinds.items():
            for layout in ("permuted", "contiguous"):
                q, k, v = make_inputs(batch, queries, keys, heads, dim, layout, device, dtype)
                flops = 4 * batch * heads * queries * keys * dim
                reference = None
                if device.type == "cuda":
                    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                        reference = F.scaled_dot_product_attention(q, k, v)
                for name, (backends, priority) in BACKENDS.items():
                    if name == "math" and batch > 1 and not args.smoke:
                        continue
                    if device.type != "cuda" and name != "math":
                        continue
                    rec = run_case(name, backends, priority, q, k, v, reference, args, device)
                    rec.update(batch=batch, attention=kind, layout=layout, queries=queries, keys=keys)
                    ms = rec.get("graphed_ms", rec.get("eager_ms"))
                    if ms:
                        rec["tflops"] = round(flops / ms / 1e9, 1)
                        rec["ms_per_stream_chunk_30_layers"] = round(ms * LAYERS / batch, 3)
                    cases.append(rec)
                    print(json.dumps(rec), flush=True)
    result = {
        "date": datetime.date.today().isoformat(),
        "commit": git_commit(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "cudnn": torch.backends.cudnn.version(),
        "command": "python -m benchmarks.sdpa_backends " + " ".join(sys.argv[1:] if argv is None else argv),
        "cases": cases,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
