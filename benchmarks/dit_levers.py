"""GPU micro-benchmark of the DiT levers: ms per stream-chunk of the 30 graphed blocks at batch 1, 4, 8 and 12.

Usage (one GPU; nothing to install: the levers use the image's torch)::

    python -m benchmarks.dit_levers --json benchmarks/results/dit_levers_<commit>.json
    python -m benchmarks.dit_levers --num-layers 2 --batches 1,2 --iters 3     # a smoke run (CPU too, uncompiled)

The model is Wan2.1-1.3B's real config with random bf16 weights (``random_slice_state_dict``), one slice of all its
layers (what ``STAGES=1`` serves), built afresh per variant from the same seed.  Inputs are the benchmark protocol's
(DESIGN.md section 4): one latent frame per chunk at 480x832 (1560 tokens), a KV window of 6 latent frames (3 sinks +
3 recent: 9360 context tokens per item, fixed random K/V, the same for every variant), text length 512, timestep 700.

Variants (``stage_service.dit_levers``; ``cudnn`` sets the SDPA backends of its own slice only): ``bf16`` (today's
default: the blocks as a CUDA graph, ``GraphedBlocks``), ``fp8``, ``fused``, ``fp8+fused``, ``cudnn``,
``fused+cudnn``, ``all``, and the fused lever compiled in its other forms, ``fused@dynamic`` and ``fused@static``
(``dit_levers.FUSED_FORMS``; ``fused`` is the stage's default form, ``rows``).  Per variant and batch:

- ``ms``: median (p10, p90) of ``--iters`` graphed forwards of the blocks (CUDA events, after ``--warmup``), which
  include copying the batch's KV windows into the graph's static buffers, as a stage does; ``ms_per_chunk`` is that
  over the batch;
- ``vs_bf16``: the latents after one step (``x - sigma * v``, sigma of timestep 700 at shift 5) through the whole
  model (patch embedding, the graphed blocks, head) against the bf16 variant's, in float32: ``max_rel`` =
  max |d| / max |ref|, ``mean_rel`` = mean |d| / mean |ref|;
- ``graphed_vs_eager_max_abs``: the graph against an eager forward of the same variant (a capture that went wrong).

``cudnn_probe`` records whether cuDNN's SDPA alone takes the protocol's attention shape.  Prints one line per
measurement and a markdown table last.
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys

import torch

from benchmarks.fp8_check import FixedWindow, parse_batches, protocol_inputs, time_forwards, versions, write_result
from stage_service.checkpoint import random_slice_state_dict
from stage_service.dit_levers import DEFAULT_FUSED_FORM, Levers, apply_levers, cudnn_refusal
from stage_service.dit_slice import SDPA_CALLS, AttentionContext, DiTSlice
from stage_service.graphs import GraphedBlocks
from stagecast.model.dit_configs import model_config
from stagecast.sampling import sigmas

VARIANTS = (
    ("bf16", ()),
    ("fp8", ("fp8",)),
    ("fused", ("fused",)),
    ("fp8+fused", ("fp8", "fused")),
    ("cudnn", ("cudnn",)),
    ("fused+cudnn", ("fused", "cudnn")),
    ("all", ("fp8", "fused", "cudnn")),
    # the fused lever compiled in its other forms (``dit_levers.FUSED_FORMS``): which one the stage should run
    ("fused@dynamic", ("fused",)),
    ("fused@static", ("fused",)),
)
TIMESTEP, SHIFT = 700.0, 5.0


def random_slice(
    cfg: dict, device: torch.device, levers: Levers, dtype: torch.dtype = torch.bfloat16
) -> tuple[DiTSlice, dict]:
    """One slice of all of ``cfg``'s layers with random weights (what ``STAGES=1`` serves), ``levers`` on."""
    layers = range(0, cfg["num_layers"])
    sd = random_slice_state_dict(cfg, layers=layers, first=True, last=True, dtype=dtype, device=device)
    sl = DiTSlice.from_state_dict(cfg, sd, layers=layers, first=True, last=True, device=device)
    return sl, apply_levers(sl, levers)


def build(cfg: dict, device: torch.device, levers: tuple[str, ...], label: str = "") -> tuple[DiTSlice, dict]:
    """The slice with ``levers`` on; a label ``NAME@FORM`` compiles the fused lever as ``FORM``."""
    return random_slice(cfg, device, Levers(levers, label.partition("@")[2] or DEFAULT_FUSED_FORM))


def inputs_for(cfg: dict, batch: int, args, device: torch.device) -> dict:
    """The protocol's inputs (``benchmarks.fp8_check.protocol_inputs``) plus noisy latents for the whole model."""
    inputs = protocol_inputs(cfg, batch, args, device, torch.bfloat16, cfg["num_layers"], seed=1234, windows=1)
    inputs["keys"], inputs["values"] = inputs.pop("windows")[0]
    gen = torch.Generator(device=device).manual_seed(99 + batch)
    shape = (batch, cfg["in_channels"], args.chunk_frames, args.height, args.width)
    inputs["latents"] = torch.randn(*shape, generator=gen, device=device, dtype=torch.float32)
    return inputs


def one_step(sl: DiTSlice, run, inputs: dict, args) -> torch.Tensor:
    """The latents after one step through the whole slice, the blocks by ``run``: float32."""
    latents = inputs["latents"]
    batch = latents.shape[0]
    sigma = sigmas([TIMESTEP], SHIFT)[0]
    cond = sl.condition(torch.full((batch,), sigma * 1000.0, device=latents.device), tokens=inputs["tokens"])
    hidden = run(sl.embed(latents), cond)
    velocity = sl.head(hidden, cond, latents.shape).float()
    return latents - sigma * velocity


def relative(out: torch.Tensor, ref: torch.Tensor) -> dict:
    d = (out - ref).abs()
    return {
        "max_rel": d.max().item() / max(ref.abs().max().item(), 1e-30),
        "mean_rel": d.mean().item() / max(ref.abs().mean().item(), 1e-30),
    }


def measure(sl: DiTSlice, inputs: dict, args) -> dict:
    """Graphed and eager forwards of the blocks on ``inputs``, and the latents after one step (graphed)."""
    device, batch = sl.device, inputs["hidden"].shape[0]
    cond = sl.condition(torch.full((batch,), TIMESTEP, device=device), tokens=inputs["tokens"])
    cross = sl.cross_kv(sl.embed_text(inputs["text"]))
    window = FixedWindow(inputs["keys"], inputs["values"])

    def ctx():
        rotary = sl.rotary(args.chunk_frames, args.height, args.width, [args.window] * batch)
        return AttentionContext(rotary=rotary, cross_kv=[cross] * batch, self_kv=[window] * batch)

    context = ctx()
    hidden = inputs["hidden"]
    eager_out = sl.run_blocks(hidden, cond, context)
    graphs = GraphedBlocks(sl)
    graphed_out = graphs.run(hidden, cond, context)
    timing = time_forwards(lambda: graphs.run(hidden, cond, context), device, args.warmup, args.iters)
    # Eager too: a kernel that a graph capture would not take (or took otherwise) shows as eager and graphed apart.
    eager = time_forwards(lambda: sl.run_blocks(hidden, cond, context), device, 1, max(args.iters // 3, 2))
    kernels = None
    if args.profile:
        table, kernels = kernel_profile(lambda: sl.run_blocks(hidden, cond, context), device)
        print(table, flush=True)
    step = one_step(sl, lambda h, c: graphs.run(h, c, ctx()), inputs, args)
    result = {
        "ms": timing,
        "eager_ms": eager["median_ms"],
        "ms_per_chunk": timing["median_ms"] / batch,
        "graphs_captured": graphs.captures,
        "graph_failure": graphs.failure,
        "graphed_vs_eager_max_abs": (graphed_out.float() - eager_out.float()).abs().max().item(),
    }
    if kernels is not None:
        result["kernels"] = kernels
    graphs.close()
    return {"result": result, "step": step}


# Which part of a forward a kernel is (``kernel_class``), by its name: the first class whose markers it holds.  The
# names are cuDNN's, cuBLAS's and Inductor's as a profile on an H200 shows them
# (``benchmarks/results/dit_profile_1gpu_4aea243.log``).
KERNEL_CLASSES = (
    ("fused", ("triton_",)),  # the fused lever's compiled kernels (norms, RoPE, gates), whatever else their names say
    ("attention", ("sdpa", "flash", "fmha", "attention")),
    ("gemm", ("nvjet", "gemm", "cutlass", "xmma", "scaled_mm", "addmm", "aten::mm", "bmm")),
    ("copy", ("copy", "cat")),  # the K/V window into the graph's buffers
)
KERNEL_ROWS = 12


def kernel_class(name: str) -> str:
    """``attention``, ``gemm``, ``copy``, ``fused`` or ``elementwise`` (everything else: eager norms, adds, casts)."""
    low = name.lower()
    return next((cls for cls, marks in KERNEL_CLASSES if any(m in low for m in marks)), "elementwise")


def kernel_summary(events: list[tuple[str, float, int]], rows: int = KERNEL_ROWS) -> dict:
    """(name, self ms, calls) per kernel of one forward: ms per class (``kernel_class``), their total, and the
    costliest ``rows`` kernels with their class: where a forward's time goes, kept in the JSON beside its speed."""
    by_class: dict[str, float] = {}
    for name, ms, _ in events:
        cls = kernel_class(name)
        by_class[cls] = by_class.get(cls, 0.0) + ms
    top = sorted(events, key=lambda e: -e[1])[:rows]
    return {
        "total_ms": round(sum(ms for _, ms, _ in events), 3),
        "by_class_ms": {k: round(v, 3) for k, v in sorted(by_class.items(), key=lambda kv: -kv[1])},
        "top": [{"name": n, "class": kernel_class(n), "ms": round(ms, 3), "calls": c} for n, ms, c in top],
    }


def kernel_profile(forward, device: torch.device, rows: int = KERNEL_ROWS) -> tuple[str, dict]:
    """One forward under torch's profiler: its costliest kernels as a table (device time on a GPU, else CPU time),
    and ``kernel_summary`` of every kernel."""
    from torch.profiler import ProfilerActivity, profile

    gpu = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA] if gpu else [ProfilerActivity.CPU]) as prof:
        forward()
        if gpu:
            torch.cuda.synchronize(device)
    key = "self_device_time_total" if gpu else "self_cpu_time_total"
    averages = prof.key_averages()
    events = [(e.key, getattr(e, key) / 1e3, e.count) for e in averages if getattr(e, key) > 0]
    return averages.table(sort_by=key, row_limit=rows, max_name_column_width=70), kernel_summary(events, rows)


def cudnn_probe(cfg: dict, args, device: torch.device) -> dict:
    """Whether cuDNN's SDPA alone takes the protocol's self-attention shape (4 items, 1560 queries, window + chunk)."""
    if device.type != "cuda":
        return {"ok": False, "error": "no GPU"}
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def _sdpa(q, k, v):  # the blocks' layout: (B, L, H, Dh) permuted to (B, H, L, Dh), as DiTSlice does
        return torch.nn.functional.scaled_dot_product_attention(*(t.permute(0, 2, 1, 3) for t in (q, k, v)))

    heads, dim = cfg["num_attention_heads"], cfg["attention_head_dim"]
    tokens = args.chunk_frames * (args.height // 2) * (args.width // 2)
    q = torch.randn(4, tokens, heads, dim, device=device, dtype=torch.bfloat16)
    k = torch.randn(4, tokens * (args.window + 1), heads, dim, device=device, dtype=torch.bfloat16)
    try:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            got = _sdpa(q, k, k)
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            ref = _sdpa(q, k, k)
        return {"ok": True, "max_abs_vs_flash": (got.float() - ref.float()).abs().max().item()}
    except RuntimeError as exc:
        return {"ok": False, "error": str(exc).splitlines()[0]}


def run_variant(cfg: dict, args, device: torch.device, levers: tuple, row: dict, refs: dict, label: str) -> None:
    sl, row["applied"] = build(cfg, device, levers, label)
    if "cudnn" in levers and device.type == "cuda":  # None: cuDNN takes the blocks' attention; else torch's reasons
        row["cudnn_refusal"] = cudnn_refusal(sl, args.chunk_frames, args.height, args.width, args.text_len)
        print(f"{label}: cuDNN refusal: {row['cudnn_refusal']}", flush=True)
    with torch.no_grad():
        for batch in args.batches:
            inputs = inputs_for(cfg, batch, args, device)
            SDPA_CALLS.take()
            got = measure(sl, inputs, args)
            entry = got["result"]
            entry["sdpa_calls"] = SDPA_CALLS.take()  # under a backend scope (cudnn): which backend ran each call
            for what, calls in entry["sdpa_calls"].items():
                print(f"{label} batch {batch}: {calls} attention call(s): {what}", flush=True)
            if not levers:
                refs[batch] = got["step"]
            elif batch in refs:
                entry["vs_bf16"] = relative(got["step"], refs[batch])
            row["batches"][str(batch)] = entry
            print(describe(label, batch, entry), flush=True)
            del inputs, got


def run_variants(cfg: dict, args, device: torch.device, result: dict) -> None:
    """Each variant into ``result["variants"]``, the JSON rewritten after each (a run cut short keeps what it has); a
    variant that fails records its error and the next one runs."""
    out = result["variants"] = {}
    refs: dict[int, torch.Tensor] = {}
    for label, levers in args.variants:
        row = out[label] = {"levers": list(levers), "batches": {}}
        try:
            run_variant(cfg, args, device, levers, row, refs, label)
        except Exception as exc:  # noqa: BLE001 - a lever that cannot run here is a result too
            row["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:500]
            print(f"{label}: FAILED {row['error']}", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        write_result(args.json, result)


def describe(label: str, batch: int, e: dict) -> str:
    line = f"{label:12s} batch {batch:2d}: {e['ms']['median_ms']:8.2f} ms, {e['ms_per_chunk']:6.2f} ms/chunk"
    if "eager_ms" in e:
        line += f" (eager {e['eager_ms']:.2f} ms)"
    if e.get("graph_failure"):
        line += f" (graph capture FAILED: {e['graph_failure']})"
    if "vs_bf16" in e:
        line += f"; vs bf16 max rel {e['vs_bf16']['max_rel']:.2e}, mean rel {e['vs_bf16']['mean_rel']:.2e}"
    return line


def markdown(result: dict) -> str:
    """The BENCHMARKS.md table: ms per stream-chunk per variant and batch, and the error at the largest batch."""
    batches = result["batches"]
    head = "| variant | " + " | ".join(f"batch {b}" for b in batches) + " | vs bf16 (max / mean rel) |"
    lines = [head, "|" + "---|" * (len(batches) + 2)]
    base = result["variants"].get("bf16", {}).get("batches", {})
    for label, row in result["variants"].items():
        if len(row["batches"]) < len(batches):
            lines.append(f"| `{label}` | " + " | ".join(["-"] * len(batches)) + f" | {row.get('error', 'cut short')} |")
            continue
        cells = []
        for b in batches:
            e = row["batches"][str(b)]
            ms = e["ms_per_chunk"]
            ratio = base.get(str(b), {}).get("ms_per_chunk", ms) / ms
            cells.append(f"{ms:.2f}" + ("" if label == "bf16" else f" (x{ratio:.2f})"))
        err = row["batches"][str(batches[-1])].get("vs_bf16")
        cells.append(f"{err['max_rel']:.1e} / {err['mean_rel']:.1e}" if err else "exact (reference)")
        lines.append(f"| `{label}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def commit() -> str:
    """The commit measured: ``$STAGECAST_COMMIT`` (a device machine's copy has no .git), else git's."""
    if os.environ.get("STAGECAST_COMMIT"):
        return os.environ["STAGECAST_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "unknown"


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="wan2.1-1.3b")
    ap.add_argument("--num-layers", type=int, default=None, help="override the model's layer count (smoke runs)")
    ap.add_argument("--batches", default="1,4,8,12", help="micro-steps per forward, comma-separated")
    ap.add_argument("--variants", default=",".join(v for v, _ in VARIANTS), help="which of them, in the fixed order")
    ap.add_argument("--height", type=int, default=60, help="latent height (480 / 8)")
    ap.add_argument("--width", type=int, default=104, help="latent width (832 / 8)")
    ap.add_argument("--chunk-frames", type=int, default=1, help="latent frames per chunk (protocol: 1)")
    ap.add_argument("--window", type=int, default=6, help="KV window in latent frames (protocol: 6, 3 of them sinks)")
    ap.add_argument("--text-len", type=int, default=512)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--profile",
        action="store_true",
        help="print each eager forward's 12 costliest kernels, and keep its ms per kernel class in the JSON (kernels)",
    )
    args = ap.parse_args(argv)
    args.batches = parse_batches(ap, args.batches)
    wanted = [v for v in args.variants.split(",") if v]
    known = dict(VARIANTS)
    bad = [v for v in wanted if v not in known]
    if bad or not wanted:
        ap.error(f"--variants: each one of {', '.join(known)}, got {args.variants!r}")
    args.variants = [(v, levers) for v, levers in VARIANTS if v in wanted]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    cfg = model_config(args.model, **({"num_layers": args.num_layers} if args.num_layers else {}))
    result = {
        "date": datetime.date.today().isoformat(),
        "commit": commit(),
        "command": "python -m benchmarks.dit_levers " + " ".join(argv if argv is not None else sys.argv[1:]),
        "versions": versions(),
        "model": args.model,
        "layers": cfg["num_layers"],
        "batches": args.batches,
        "protocol": {
            "latent": [args.chunk_frames, args.height, args.width],
            "window": args.window,
            "text_len": args.text_len,
            "timestep": TIMESTEP,
            "warmup": args.warmup,
            "iters": args.iters,
        },
        "cudnn_probe": cudnn_probe(cfg, args, device),
    }
    print(f"cudnn probe: {result['cudnn_probe']}", flush=True)
    run_variants(cfg, args, device, result)
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
