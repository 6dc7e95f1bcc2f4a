"""GPU check of ``stage_service.graphs``: graphed slice forwards against eager ones, in one process.

Usage (a machine with a GPU)::

    python -m benchmarks.graphs_check                     # parity (tiny + 1.3B with 4 layers) and 1.3B timing

Parity: the reference executor runs the same streams eagerly and with ``GraphedBlocks`` (real CUDA graph capture)
and prints the largest difference per stream (expected 0.0).  Timing: one full 1.3B slice at 480x832 with the
protocol's KV window (6 frames, 3 sinks), steady-state forward of one micro-step, eager against graphed.
"""

from __future__ import annotations

import argparse
import time

import torch
from diffusers import WanTransformer3DModel

from launcher.reference import ReferenceExecutor, StreamRequest
from stage_service.dit_slice import DiTSlice
from stage_service.graphs import GraphedBlocks
from stagecast.microstep import MicroStep, StreamSpec
from stagecast.model.dit_configs import model_config


def build(name: str, layers: int | None, dtype: torch.dtype) -> DiTSlice:
    cfg = model_config(name) if layers is None else model_config(name, num_layers=layers)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = WanTransformer3DModel(**cfg).to(dtype).eval().requires_grad_(False)
    return DiTSlice.from_model(model, layers=range(cfg["num_layers"]), first=True, last=True)


def parity(name: str, layers: int | None, dtype: torch.dtype, h: int, w: int, policy: str) -> float:
    full = build(name, layers, dtype)
    text_dim = full.config["text_dim"]
    gen = torch.Generator().manual_seed(1)
    reqs = [
        StreamRequest(
            StreamSpec(
                stream_id=i + 1,
                latent_channels=full.config["in_channels"],
                chunk_frames=1,
                latent_height=h,
                latent_width=w,
                timesteps=(1000.0, 500.0),
                num_chunks=5,
                text_len=32,
                seed=i,
                window=3,
                sink=1,
                policy=policy,
            ),
            torch.randn(1, 32, text_dim, generator=gen),
            arrival_tick=2 * i,
        )
        for i in range(2)
    ]
    eager = ReferenceExecutor(full).generate(reqs, num_stages=2, max_batch=3)
    graphed_ref = ReferenceExecutor(full)
    graphed_ref.runner.graphs = graphs = GraphedBlocks(full)
    graphed = graphed_ref.generate(reqs, num_stages=2, max_batch=3)
    worst = 0.0
    for sid, chunks in eager.chunks.items():
        for a, b in zip(chunks, graphed.chunks[sid], strict=True):
            worst = max(worst, (a.float() - b.float()).abs().max().item())
    print(f"parity {name} layers={layers} {dtype} {policy}: max diff {worst:.3e} ({graphs.captures} graphs)")
    return worst


def timing(layers: int | None, dtype: torch.dtype, iters: int = 20) -> None:
    full = build("wan2.1-1.3b", layers, dtype)
    spec = StreamSpec(
        stream_id=1,
        latent_channels=16,
        chunk_frames=1,
        latent_height=60,
        latent_width=104,
        timesteps=(700.0,),
        num_chunks=None,
        text_len=512,
        window=6,
        sink=3,
    )
    text = torch.randn(1, 512, full.config["text_dim"])
    for mode in ("eager", "graphed"):
        ref = ReferenceExecutor(full)
        if mode == "graphed":
            ref.runner.graphs = GraphedBlocks(full)
        ref.runner.open_stream(spec, text)
        times = []
        for chunk in range(8 + iters):  # the first 7 chunks fill the window
            torch.cuda.synchronize()
            t = time.perf_counter()
            ref.run_batch([MicroStep(1, chunk, 0)])
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        ref.runner.close_stream(1)
        steady = sorted(times[8:])
        median_ms = steady[len(steady) // 2] * 1e3
        print(f"timing 1.3B x{layers or 30} layers 480x832 window 6, {mode}: median {median_ms:.1f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--skip-timing", action="store_true")
    args = ap.parse_args()
    parity("tiny-wan2.1", None, torch.bfloat16, 8, 8, "per_level")
    parity("tiny-wan2.1", None, torch.float32, 8, 8, "clean")
    parity("wan2.1-1.3b", 4, torch.bfloat16, 60, 104, "per_level")
    if not args.skip_timing:
        timing(None, torch.bfloat16)


if __name__ == "__main__":
    main()
