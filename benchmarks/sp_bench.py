"""Ulysses all-to-all on the real shapes: time per layer and per forward, a latency + bandwidth fit, and the
simulator's 4-GPU predictions (PP=4 against PP=2×SP=2) from those measured numbers.

Usage::

    python -m benchmarks.sp_bench --gpus 2 --json benchmarks/results/sp_a2a_2gpu.json     # NCCL, one rank per GPU
    python -m benchmarks.sp_bench --cpu                                                    # gloo, tiny shapes (CI)

Each rank runs the stage's own exchange code (``stage_service.dit_slice.sequence_to_heads`` and
``heads_to_sequence`` over a ``DistSequenceGroup``) on one micro-step of each model at 480x832, one latent frame
(1560 tokens), bf16; GPU times are CUDA events around the collectives after a warm-up.  "Per forward" is what one
whole-model forward at SP=S spends exchanging: layers × (q/k/v in + output back), plus the gather before the head.
The size sweep of ``all_to_all_single`` is fitted to ``t = latency + bytes / bandwidth`` (least squares), which is
what ``stagecast simulate --a2a-gbps --a2a-latency-us`` takes.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from stagecast.model.dit_configs import model_config

TOKENS = 1560  # one latent frame at 480x832
# DESIGN.md section 4, one H200, one latent frame, text 512, a whole-model forward: (B=1 ms, B=4 ms).  The sequence-
# parallel stages run eagerly (no CUDA graphs yet), so the predictions price eager forwards.
EAGER_MS = {"wan2.1-1.3b": (56.8, 58.2), "wan2.1-14b": (94.0, 373.6)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _time(fn, device: torch.device, iters: int) -> float:
    """Mean ms of ``fn()`` over ``iters`` calls after three warm-ups (CUDA events on GPU, wall clock on CPU)."""
    for _ in range(3):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / iters
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) * 1e3 / iters


def _rank_main(rank: int, world: int, port: int, backend: str, models: list[str], tokens: int, iters: int, out: str):
    from stage_service.dit_slice import heads_to_sequence, sequence_to_heads
    from stage_service.parallel_state import DistSequenceGroup

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device(f"cuda:{rank}" if backend == "nccl" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        group = DistSequenceGroup(dist.new_group(list(range(world)), backend=backend), rank, world)
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        rows = []
        for name in models:
            cfg = model_config(name)
            heads, head_dim, layers = cfg["num_attention_heads"], cfg["attention_head_dim"], cfg["num_layers"]
            shard = tokens // world
            q, k, v = (torch.randn(1, shard, heads, head_dim, device=device, dtype=dtype) for _ in range(3))
            out_heads = torch.randn(1, tokens, heads // world, head_dim, device=device, dtype=dtype)
            hidden = torch.randn(1, shard, heads * head_dim, device=device, dtype=dtype)
            qkv_ms = _time(lambda q=q, k=k, v=v: sequence_to_heads(group, q, k, v), device, iters)
            out_ms = _time(lambda o=out_heads: heads_to_sequence(group, o), device, iters)
            gather_ms = _time(lambda h=hidden: group.all_gather(h), device, iters)
            rows.append(
                {
                    "model": name,
                    "tokens": tokens,
                    "sp": world,
                    "layers": layers,
                    "dim": heads * head_dim,
                    "qkv_all_to_all_ms": qkv_ms,
                    "out_all_to_all_ms": out_ms,
                    "gather_ms": gather_ms,
                    "per_layer_ms": qkv_ms + out_ms,
                    "per_forward_ms": layers * (qkv_ms + out_ms) + gather_ms,
                }
            )
        sweep = []
        for size in [2**i for i in range(12, 27, 2)] if device.type == "cuda" else [2**i for i in range(10, 18, 2)]:
            elems = size // torch.tensor([], dtype=dtype).element_size() // world * world
            send, recv = (torch.randn(elems, device=device, dtype=dtype) for _ in range(2))
            ms = _time(lambda s=send, r=recv: dist.all_to_all_single(r, s, group=group.group), device, iters)
            sweep.append({"bytes_per_rank": elems * send.element_size(), "ms": ms})
        if rank == 0:
            Path(out).write_text(json.dumps({"rows": rows, "sweep": sweep}))
    finally:
        dist.destroy_process_group()


def fit(sweep: list[dict]) -> tuple[float, float]:
    """Least-squares ``ms = latency_ms + bytes / (gbps * 1e6)``: returns (latency_ms, gbps), each clamped positive.
    Each rank sends (S-1)/S of ``bytes_per_rank``; the fit is per byte handed to the collective."""
    xs = [p["bytes_per_rank"] for p in sweep]
    ys = [p["ms"] for p in sweep]
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0
    latency = max(my - slope * mx, 0.0)
    gbps = 1.0 / (slope * 1e6) if slope > 0 else float("inf")
    return latency, gbps


def predictions(latency_ms: float, gbps: float, gpus: int = 4) -> list[dict]:
    """The simulator on ``gpus`` GPUs for each model: a pipeline of ``gpus`` stages against pipelines of
    ``gpus / 2`` stages of SP=2, one step, one stream, from the eager stage times and the measured exchange."""
    from coordinator.simulator import SimConfig, simulate

    out = []
    for name, (b1, b4) in EAGER_MS.items():
        cfg = model_config(name)
        growth = (b4 - b1) / 3 / b1
        for stages, sp in ((gpus, 1), (gpus // 2, 2)):
            sim = SimConfig(
                stages=stages,
                steps=1,
                streams=1,
                chunks=128,
                batch=4,
                stage_ms=[b1 / stages] * stages,
                growth=growth,
                sp=sp,
                a2a_gbps=gbps if gbps != float("inf") else 1e9,
                a2a_latency_ms=latency_ms,
                tokens=TOKENS,
                dim=cfg["num_attention_heads"] * cfg["attention_head_dim"],
                layers=cfg["num_layers"],
            )
            rep = simulate(sim)
            out.append(
                {
                    "model": name,
                    "topology": f"PP={stages}" if sp == 1 else f"PP={stages}×SP={sp}",
                    "gpus": stages * sp,
                    "chunks_per_s": rep.chunks_per_second,
                    "fps": rep.chunks_per_second * 4,  # 4 video frames per latent frame
                    "chunk_latency_ms": rep.chunk_latency_ms,
                    "a2a_ms_per_forward": max(rep.a2a_ms_per_forward),
                    "config": asdict(sim),
                }
            )
    return out


def run(gpus: int, cpu: bool, models: list[str], tokens: int, iters: int) -> dict:
    backend = "gloo" if cpu else "nccl"
    if not cpu and torch.cuda.device_count() < gpus:
        raise SystemExit(f"sp_bench: --gpus {gpus} but {torch.cuda.device_count()} GPU(s) are visible")
    import tempfile

    with tempfile.TemporaryDirectory(prefix="stagecast-sp-bench-") as tmp:
        out = os.path.join(tmp, "rank0.json")
        mp.spawn(_rank_main, args=(gpus, _free_port(), backend, models, tokens, iters, out), nprocs=gpus, join=True)
        measured = json.loads(Path(out).read_text())
    latency_ms, gbps = fit(measured["sweep"])
    return {
        "backend": backend,
        "gpus": gpus,
        "gpu": torch.cuda.get_device_name(0) if not cpu else "cpu",
        "torch": torch.__version__,
        **measured,
        "fit": {"latency_us": latency_ms * 1e3, "gbps": gbps},
        "predictions_4gpu": predictions(latency_ms, gbps),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int, default=2, help="ranks of the sequence group (one GPU each)")
    ap.add_argument("--cpu", action="store_true", help="gloo on the CPU with the tiny model (proves the script runs)")
    ap.add_argument("--models", default=None, help="comma-separated (default: wan2.1-1.3b,wan2.1-14b; --cpu: tiny)")
    ap.add_argument("--tokens", type=int, default=None, help=f"tokens per micro-step (default {TOKENS}; --cpu 64)")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--json", default=None, help="write the result here")
    args = ap.parse_args(argv)
    models = args.models.split(",") if args.models else (["tiny-wan2.1"] if args.cpu else list(EAGER_MS))
    tokens = args.tokens or (64 if args.cpu else TOKENS)
    if tokens % args.gpus:
        print(f"sp_bench: error: --tokens {tokens} does not split over {args.gpus} ranks", file=sys.stderr)
        return 2
    result = run(args.gpus, args.cpu, models, tokens, args.iters if not args.cpu else min(args.iters, 5))
    for row in result["rows"]:
        print(
            f"{row['model']} SP={row['sp']} {row['tokens']} tokens: all-to-all {row['per_layer_ms']:.3f} ms per layer "
            f"(q/k/v {row['qkv_all_to_all_ms']:.3f} + out {row['out_all_to_all_ms']:.3f}), "
            f"{row['per_forward_ms']:.2f} ms per whole-model forward ({row['layers']} layers + gather)"
        )
    fit_ = result["fit"]
    print(f"all_to_all_single fit: {fit_['latency_us']:.1f} µs + bytes / {fit_['gbps']:.1f} GB/s")
    for p in result["predictions_4gpu"]:
        print(
            f"simulated {p['model']} {p['topology']} on {p['gpus']} GPUs, 1 step: {p['fps']:.1f} FPS (DiT only), "
            f"chunk latency {p['chunk_latency_ms']:.1f} ms, "
            f"all-to-all {p['a2a_ms_per_forward']:.2f} ms per stage forward"
        )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
