"""GPU check of grouped self-attention (``DiTSlice.grouped_attention``): one stage's blocks with a Stream Batch of
items that share a full KV window length, self-attention run per item (the loop it replaced) against grouped (one
batched SDPA per layer for the items of equal context length).

Usage (one GPU)::

    python -m benchmarks.attention_check --json benchmarks/results/attention_check.json   # 1.3B and 14B, B=1,2,4
    python -m benchmarks.attention_check --smoke --json /tmp/attention_smoke.json          # CPU, tiny model

For each model: the first stage of a ``--stages``-stage pipeline (layers ``[0, L / stages)``) with random bf16
weights of the real config (``random_slice_state_dict``, as ``--checkpoint random:<model>`` stages make them).
Inputs are the benchmark protocol's (DESIGN.md section 4): one latent frame per chunk at 480x832 (60x104 latents,
1560 tokens per item), a full KV window of 6 latent frames per item (9360 context tokens, random K/V of its own
for every item, so the batch reads as much memory as distinct streams do), text length 512, timestep 700, batch
sizes ``--batches``.

Per batch and mode (``per_item``, ``grouped``, ``in_place``: ``MODES``): per-forward milliseconds of
``DiTSlice.run_blocks`` eagerly and as a CUDA graph (``GraphedBlocks``, which copies every item's KV window into its
static buffers at each forward, as the stage does), CUDA events around each forward after ``--warmup`` forwards, median
(and p10/p90) of ``--iters``; the speedup of grouped over per-item; and the max |grouped - per_item| over the blocks'
output (0 on a CPU, where the tests hold it bit for bit; on a GPU it says whether the batched SDPA kernel rounds as the
batch-1 one does); and for ``in_place`` (the graphed forward reading the static K/V stack where window and new K/V lie
together, instead of concatenating them per layer) its speedup over ``grouped`` graphed and its max difference from it
(0 expected).
``attention_only`` times one layer's self-attention alone (the concatenation of window and new K/V, and SDPA), per
item against grouped, with its own max difference.

``kv_copies`` prices the copies of the KV window that reading it in place removes or would remove (issue 15, lever
3b): per forward, the stage copies every item's window out of its cache into the graph's static buffers (the ops of
``KVView.read_into``: one ``torch.cat`` of the window's frames per layer, for K and for V), and inside the graph each
layer concatenates the window and the chunk's new K/V before SDPA.  Both are timed alone (the second as a captured
CUDA graph, as the stage replays it), with their sum as a share of the grouped graphed forward.  ``in_place``
removes the second; the first remains (a KV ring the graph reads would need the cache to live in its buffers).

Writes JSON (``--json``) and prints one line per measurement.  ``--smoke`` runs the same path on a CPU with the tiny
test model in float32 (what ``tests/test_dit_slice_attention.py`` exercises).
"""

from __future__ import annotations

import argparse
import datetime
import sys

import torch

from benchmarks.fp8_check import (
    FixedWindow,
    add_protocol_args,
    parse_batches,
    protocol_inputs,
    protocol_record,
    time_forwards,
    versions,
    write_result,
)
from stage_service.checkpoint import random_slice_state_dict
from stage_service.dit_slice import AttentionContext, DiTSlice, attend_grouped, attend_per_item
from stage_service.graphs import GraphedBlocks
from stagecast.model.dit_configs import model_config

# per_item: one SDPA per item; grouped: one per group of equal context, window and new K/V concatenated per layer;
# in_place: grouped, reading the graph's static K/V stack where window and new K/V lie together (the stage's default).
MODES = ("per_item", "grouped", "in_place")


def make_inputs(cfg: dict, batch: int, args, device: torch.device, dtype: torch.dtype, layers: int) -> dict:
    """The protocol's inputs for one batch, from a fixed seed: every item has a KV window of its own."""
    inputs = protocol_inputs(cfg, batch, args, device, dtype, layers, seed=4321, windows=batch)
    inputs["windows"] = [FixedWindow(k, v) for k, v in inputs["windows"]]
    return inputs


def run_mode(sl: DiTSlice, inputs: dict, args, mode: str, timestep: float = 700.0) -> dict:
    """Eager and graphed forwards of ``sl``'s blocks with self-attention as ``mode`` (``MODES``) runs it."""
    device = sl.device
    hidden = inputs["hidden"]
    batch = hidden.shape[0]
    sl.grouped_attention = mode != "per_item"
    sl.kv_in_place = mode == "in_place"
    try:
        with torch.no_grad():
            cond = sl.condition(torch.full((batch,), timestep, device=device), tokens=inputs["tokens"])
            cross = sl.cross_kv(sl.embed_text(inputs["text"]))
            ctx = AttentionContext(
                rotary=sl.rotary(args.chunk_frames, args.height, args.width, [args.window] * batch),
                cross_kv=[cross] * batch,
                self_kv=list(inputs["windows"]),
            )
            eager_out = sl.run_blocks(hidden, cond, ctx)
            eager = time_forwards(lambda: sl.run_blocks(hidden, cond, ctx), device, args.warmup, args.iters)
            graphs = GraphedBlocks(sl)  # a graph per mode: capture records the kernels the mode launches
            try:
                graphed_out = graphs.run(hidden, cond, ctx)
                graphed = time_forwards(lambda: graphs.run(hidden, cond, ctx), device, args.warmup, args.iters)
                result = {
                    "eager": eager,
                    "graphed": graphed,
                    "graphs_captured": graphs.captures,
                    "graph_failure": graphs.failure,
                    "graphed_vs_eager_max_abs": max_abs(graphed_out, eager_out),
                }
            finally:
                graphs.close()
    finally:
        sl.grouped_attention = sl.kv_in_place = True
    return {"result": result, "eager_out": eager_out, "graphed_out": graphed_out}


def attention_only(cfg: dict, inputs: dict, args, device: torch.device, dtype: torch.dtype) -> dict:
    """One layer's self-attention alone (window + new K/V, SDPA), per item against grouped."""
    batch = inputs["hidden"].shape[0]
    heads, head_dim = cfg["num_attention_heads"], cfg["attention_head_dim"]
    gen = torch.Generator(device=device).manual_seed(99 + batch)
    q, k, v = (
        torch.randn(batch, inputs["tokens"], heads, head_dim, generator=gen, device=device, dtype=dtype)
        for _ in range(3)
    )
    cached = [(w.keys[0], w.values[0]) for w in inputs["windows"]]
    out = {}
    with torch.no_grad():
        per_item = attend_per_item(q, k, v, cached)
        grouped = attend_grouped(q, k, v, cached)
        out["per_item"] = time_forwards(lambda: attend_per_item(q, k, v, cached), device, args.warmup, args.iters)
        out["grouped"] = time_forwards(lambda: attend_grouped(q, k, v, cached), device, args.warmup, args.iters)
    out["speedup"] = out["per_item"]["median_ms"] / out["grouped"]["median_ms"]
    out["grouped_vs_per_item_max_abs"] = max_abs(grouped, per_item)
    return out


def kv_copies(cfg: dict, inputs: dict, args, device: torch.device, dtype: torch.dtype, layers: int) -> dict:
    """Milliseconds of the two window copies per forward of a batch (see the module docstring)."""
    batch, tokens = inputs["hidden"].shape[0], inputs["tokens"]
    heads, head_dim = cfg["num_attention_heads"], cfg["attention_head_dim"]
    frames = args.window
    per_frame = inputs["context"] // frames
    # The cache's layout: one tensor per frame and K / V, every layer in it, as StreamKVCache.commit stores them.
    cached = [
        [
            (
                w.keys[:, :, f * per_frame : (f + 1) * per_frame].clone(),
                w.values[:, :, f * per_frame : (f + 1) * per_frame].clone(),
            )
            for f in range(frames)
        ]
        for w in inputs["windows"]
    ]
    slots = [
        (
            torch.empty(layers, 1, inputs["context"], heads, head_dim, device=device, dtype=dtype),
            torch.empty(layers, 1, inputs["context"], heads, head_dim, device=device, dtype=dtype),
        )
        for _ in range(batch)
    ]

    def read_into() -> None:  # KVView.read_into, item by item
        for item, (k_in, v_in) in zip(cached, slots):
            torch.cat([k for k, _ in item], dim=2, out=k_in)
            torch.cat([v for _, v in item], dim=2, out=v_in)

    new_k = torch.randn(batch, tokens, heads, head_dim, device=device, dtype=dtype)
    new_v = torch.randn_like(new_k)
    k_all = torch.empty(batch, inputs["context"] + tokens, heads, head_dim, device=device, dtype=dtype)
    v_all = torch.empty_like(k_all)

    def attention_cat() -> None:  # attend_grouped's copy of window and new K/V, every layer
        for layer in range(layers):
            for b, (k_in, v_in) in enumerate(slots):
                torch.cat([k_in[layer], new_k[b : b + 1]], dim=1, out=k_all[b : b + 1])
                torch.cat([v_in[layer], new_v[b : b + 1]], dim=1, out=v_all[b : b + 1])

    with torch.no_grad():
        out = {"read_into": time_forwards(read_into, device, args.warmup, args.iters)}
        replay = attention_cat
        if device.type == "cuda":
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                attention_cat()  # warm-up before capture
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                attention_cat()
            replay = graph.replay
        out["attention_cat_graphed"] = time_forwards(replay, device, args.warmup, args.iters)
    window_bytes = 2 * layers * batch * inputs["context"] * heads * head_dim * dtype.itemsize
    out["window_bytes"] = window_bytes
    return out


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def check_model(name: str, args, device: torch.device, dtype: torch.dtype) -> dict:
    cfg = model_config(name, **({"num_layers": args.num_layers} if args.num_layers else {}))
    layers = range(0, max(1, cfg["num_layers"] // args.stages))
    sd = random_slice_state_dict(cfg, layers=layers, first=False, last=False, dtype=dtype, device=device, seed=0)
    sl = DiTSlice.from_state_dict(cfg, sd, layers=layers, first=False, last=False, device=device)
    del sd
    out: dict = {"model": name, "layers": [layers.start, layers.stop], "batches": {}}
    for batch in args.batches:
        inputs = make_inputs(cfg, batch, args, device, dtype, len(layers))
        row: dict = {"tokens": inputs["tokens"], "context_tokens": inputs["context"], "modes": {}}
        outs = {}
        for mode in MODES:
            got = run_mode(sl, inputs, args, mode)
            row["modes"][mode] = got["result"]
            outs[mode] = got
        base, new = row["modes"]["per_item"], row["modes"]["grouped"]
        row["speedup_eager"] = base["eager"]["median_ms"] / new["eager"]["median_ms"]
        row["speedup_graphed"] = base["graphed"]["median_ms"] / new["graphed"]["median_ms"]
        row["grouped_vs_per_item_max_abs_eager"] = max_abs(outs["grouped"]["eager_out"], outs["per_item"]["eager_out"])
        row["grouped_vs_per_item_max_abs_graphed"] = max_abs(
            outs["grouped"]["graphed_out"], outs["per_item"]["graphed_out"]
        )
        row["speedup_in_place_graphed"] = new["graphed"]["median_ms"] / row["modes"]["in_place"]["graphed"]["median_ms"]
        row["in_place_vs_grouped_max_abs_graphed"] = max_abs(
            outs["in_place"]["graphed_out"], outs["grouped"]["graphed_out"]
        )
        row["attention_only"] = attention_only(cfg, inputs, args, device, dtype)
        copies = kv_copies(cfg, inputs, args, device, dtype, len(layers))
        forward = new["graphed"]["median_ms"]
        copies["share_of_graphed_forward"] = (
            copies["read_into"]["median_ms"] + copies["attention_cat_graphed"]["median_ms"]
        ) / forward
        row["kv_copies"] = copies
        out["batches"][str(batch)] = row
        print(describe(name, len(layers), batch, row), flush=True)
        del inputs, outs
        if device.type == "cuda":
            torch.cuda.empty_cache()
    del sl
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def describe(name: str, layers: int, batch: int, row: dict) -> str:
    m = row["modes"]
    a = row["attention_only"]
    line = (
        f"{name} x{layers} layers batch {batch}: eager per_item {m['per_item']['eager']['median_ms']:.2f} ms, grouped "
        f"{m['grouped']['eager']['median_ms']:.2f} ms (x{row['speedup_eager']:.2f}); graphed per_item "
        f"{m['per_item']['graphed']['median_ms']:.2f} ms, grouped {m['grouped']['graphed']['median_ms']:.2f} ms "
        f"(x{row['speedup_graphed']:.2f}); grouped vs per_item max abs {row['grouped_vs_per_item_max_abs_eager']:.3e} "
        f"eager, {row['grouped_vs_per_item_max_abs_graphed']:.3e} graphed; one layer's attention "
        f"{a['per_item']['median_ms']:.3f} -> {a['grouped']['median_ms']:.3f} ms, max abs "
        f"{a['grouped_vs_per_item_max_abs']:.3e}; graphed in place {m['in_place']['graphed']['median_ms']:.2f} ms "
        f"(x{row['speedup_in_place_graphed']:.3f} over grouped), max abs "
        f"{row['in_place_vs_grouped_max_abs_graphed']:.3e}"
    )
    c = row.get("kv_copies")
    if c:
        line += (
            f"; window copies per forward: read_into {c['read_into']['median_ms']:.3f} ms + in-graph cat "
            f"{c['attention_cat_graphed']['median_ms']:.3f} ms = {100 * c['share_of_graphed_forward']:.1f}% of the "
            f"grouped graphed forward"
        )
    for mode in MODES:
        if m[mode].get("graph_failure"):
            line += f" ({mode} graph capture FAILED: {m[mode]['graph_failure']}; graphed ran eagerly)"
    return line


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_protocol_args(ap, models="wan2.1-1.3b,wan2.1-14b", batches="1,2,4", warmup=3, iters=20)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model, float32, small shapes, 2 iterations")
    args = ap.parse_args(argv)
    if args.smoke:
        args.models, args.height, args.width, args.window, args.text_len = "tiny-wan2.1", 4, 6, 3, 8
        args.warmup, args.iters = 1, 2
    args.batches = parse_batches(ap, args.batches, most=16)
    for flag in ("stages", "height", "width", "chunk_frames", "window", "text_len", "iters"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')}: must be at least 1, got {getattr(args, flag)}")
    if args.smoke:
        device, dtype = torch.device("cpu"), torch.float32
    elif torch.cuda.is_available():
        device, dtype = torch.device("cuda:0"), torch.bfloat16
        torch.cuda.set_device(device)
    else:
        print("attention_check: error: no GPU; --smoke runs the CPU path", file=sys.stderr)
        return 2
    command = "python -m benchmarks.attention_check " + " ".join(argv if argv is not None else sys.argv[1:])
    result = {
        "date": datetime.date.today().isoformat(),
        "command": command,
        "versions": versions(),
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "protocol": protocol_record(args, "latent frames of context per item, all items equal (one group)"),
        "models": [check_model(m, args, device, dtype) for m in args.models.split(",") if m],
    }
    write_result(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
