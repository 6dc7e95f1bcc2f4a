"""GPU check of ``--fp8``: one stage's transformer blocks in bf16 and in float8 (torchao), on the same inputs.

Usage (one GPU of compute capability 8.9+, torchao installed, e.g. from a carried wheel)::

    python -m benchmarks.fp8_check --json benchmarks/results/fp8_check.json              # 1.3B, batches 1 and 4
    python -m benchmarks.fp8_check --models wan2.1-1.3b,wan2.1-14b --json ...             # and one 14B stage

For each model: the first stage of a ``--stages``-stage pipeline (layers ``[0, L / stages)``) with random bf16
weights of the real config (``random_slice_state_dict``, as ``--checkpoint random:<model>`` stages make them), built
once per variant: ``bf16``, then ``fp8_row`` (the stage's ``--fp8``: rowwise scales) and ``fp8_tensor`` (tensorwise,
for comparison), each from the same seed.  Inputs are the benchmark protocol's (DESIGN.md section 4): one latent
frame per chunk at 480x832 (60x104 latents, 1560 tokens per item), a KV window of 6 latent frames (3 sinks + 3
recent: 9360 context tokens per item, fixed random K/V shared by every variant), text length 512 (the text K/V are
computed by each variant's own cross-attention projections, as a stage does at stream open), timestep 700, batch
sizes ``--batches``.

Per variant and batch: per-forward milliseconds of ``DiTSlice.run_blocks`` eagerly and as a CUDA graph
(``GraphedBlocks``, which copies the KV window into its static buffers at every forward, as the stage does), CUDA
events around each forward after ``--warmup`` forwards, median (and p10/p90) of ``--iters``; the graphed output
against the eager one; and for the fp8 variants the difference from bf16 (float32 arithmetic):

- ``max_abs``: max |fp8 - bf16| over the output hidden states;
- ``max_rel``: ``max_abs`` / max |bf16|;
- ``rel_l2``: ||fp8 - bf16|| / ||bf16||;
- ``update_rel_l2`` / ``update_max_rel``: the same for what the blocks add to their input (output - input), which
  the residual stream would otherwise hide.

Writes JSON (``--json``) and prints one line per measurement.  Refuses to start, naming ``--fp8``, where float8
cannot run (``stagecast.fp8.check_fp8``): on a CPU it exits 2 with that line.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from stage_service.checkpoint import random_slice_state_dict
from stage_service.dit_slice import AttentionContext, DiTSlice
from stage_service.graphs import GraphedBlocks
from stagecast.model.dit_configs import model_config

GRANULARITIES = ("row", "tensor")


class FixedWindow:
    """A KV window that reads fixed tensors ``(layers, 1, tokens, heads, head_dim)`` and drops what a forward
    writes, so every variant and every repetition attends to the same context.  It offers what ``run_blocks`` and
    ``GraphedBlocks`` ask of a stage's ``KVView``."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, writes: bool = True):
        self.keys, self.values = keys, values
        self.writes = writes  # a level-0 micro-step writes its chunk's K/V (copied into the graph's static outputs)

    @property
    def context_tokens(self) -> int:
        return self.keys.shape[2]

    @property
    def max_context_tokens(self) -> int:
        return self.context_tokens

    def read(self, layer: int):
        if self.context_tokens == 0:
            return None
        return self.keys[layer], self.values[layer]

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        pass

    def write_all(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        pass

    def read_into(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        keys.copy_(self.keys)
        values.copy_(self.values)


def difference(ref: torch.Tensor, out: torch.Tensor, inp: torch.Tensor) -> dict:
    """How far ``out`` is from ``ref`` (both the blocks' output for input ``inp``), in float32."""
    ref, out, inp = ref.float(), out.float(), inp.float()
    err = out - ref
    update_ref = ref - inp
    update_err = (out - inp) - update_ref  # == err, measured against the size of the update instead
    max_abs = err.abs().max().item()
    return {
        "max_abs": max_abs,
        "max_rel": max_abs / max(ref.abs().max().item(), 1e-30),
        "rel_l2": (err.norm() / ref.norm().clamp_min(1e-30)).item(),
        "update_max_rel": update_err.abs().max().item() / max(update_ref.abs().max().item(), 1e-30),
        "update_rel_l2": (update_err.norm() / update_ref.norm().clamp_min(1e-30)).item(),
    }


def time_forwards(fn: Callable[[], torch.Tensor], device: torch.device, warmup: int, iters: int) -> dict:
    """Per-forward milliseconds of ``fn``: CUDA events on a GPU (perf_counter on a CPU), after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    times.sort()
    return {
        "median_ms": statistics.median(times),
        "p10_ms": times[len(times) // 10],
        "p90_ms": times[min(len(times) - 1, (len(times) * 9) // 10)],
        "iters": iters,
    }


def add_protocol_args(ap: argparse.ArgumentParser, *, models: str, batches: str, warmup: int, iters: int) -> None:
    """The flags every one-stage block benchmark shares (this one and ``benchmarks.attention_check``)."""
    ap.add_argument("--models", default=models, help="comma-separated model configs, e.g. wan2.1-1.3b,wan2.1-14b")
    ap.add_argument("--stages", type=int, default=2, help="the checked slice is the first of this many stages")
    ap.add_argument("--num-layers", type=int, default=None, help="override the model's layer count (smoke runs)")
    ap.add_argument("--batches", default=batches, help="micro-steps per forward, comma-separated")
    ap.add_argument("--height", type=int, default=60, help="latent height (480 / 8)")
    ap.add_argument("--width", type=int, default=104, help="latent width (832 / 8)")
    ap.add_argument("--chunk-frames", type=int, default=1, help="latent frames per chunk (protocol: 1)")
    ap.add_argument("--window", type=int, default=6, help="KV window in latent frames (protocol: 6, 3 of them sinks)")
    ap.add_argument("--text-len", type=int, default=512)
    ap.add_argument("--warmup", type=int, default=warmup)
    ap.add_argument("--iters", type=int, default=iters)
    ap.add_argument("--json", default=None)


def parse_batches(ap: argparse.ArgumentParser, text: str, most: int | None = None) -> list[int]:
    """``--batches``: comma-separated integers from 1 (to ``most``); anything else is the parser's error."""
    try:
        batches = [int(b) for b in text.split(",") if b]
    except ValueError:
        ap.error(f"--batches: comma-separated positive integers, got {text!r}")
    if not batches or any(b < 1 or (most is not None and b > most) for b in batches):
        allowed = f"integers from 1 to {most}" if most else "positive integers"
        ap.error(f"--batches: {allowed}, got {batches}")
    return batches


def protocol_inputs(
    cfg: dict, batch: int, args, device: torch.device, dtype: torch.dtype, layers: int, *, seed: int, windows: int
) -> dict:
    """The protocol's inputs for one batch, from a fixed seed: hidden states, text, and ``windows`` KV windows of
    ``args.window`` latent frames for ``layers`` layers (``keys``/``values``: lists of ``windows`` tensors)."""
    gen = torch.Generator(device=device).manual_seed(seed + batch)
    heads, head_dim = cfg["num_attention_heads"], cfg["attention_head_dim"]
    _, p_h, p_w = cfg["patch_size"]
    tokens = args.chunk_frames * (args.height // p_h) * (args.width // p_w)
    context = args.window * (args.height // p_h) * (args.width // p_w)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=dtype)

    hidden, text = randn(batch, tokens, heads * head_dim), randn(1, args.text_len, cfg["text_dim"])
    # K after norm_k and RoPE is about unit scale.
    kv = [
        (randn(layers, 1, context, heads, head_dim), randn(layers, 1, context, heads, head_dim)) for _ in range(windows)
    ]
    return {"hidden": hidden, "text": text, "windows": kv, "tokens": tokens, "context": context}


def protocol_record(args, note: str) -> dict:
    """What the results' ``protocol`` records (``note``: what the window's context is)."""
    return {
        "latent": [args.chunk_frames, args.height, args.width],
        "window": args.window,
        "window_note": note,
        "text_len": args.text_len,
        "timestep": 700.0,
        "warmup": args.warmup,
        "iters": args.iters,
    }


def write_result(path: str | None, result: dict) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(result, indent=1))
        print(f"wrote {path}")


def make_inputs(cfg: dict, batch: int, args, device: torch.device, dtype: torch.dtype, layers: int) -> dict:
    """The protocol's inputs for one batch, from a fixed seed (identical for every variant): one KV window shared by
    the batch's items (reads only)."""
    inputs = protocol_inputs(cfg, batch, args, device, dtype, layers, seed=1234, windows=1)
    inputs["keys"], inputs["values"] = inputs.pop("windows")[0]
    return inputs


def run_variant(sl: DiTSlice, inputs: dict, args, timestep: float = 700.0) -> dict:
    """Eager and graphed forwards of ``sl``'s blocks on ``inputs``: timings and outputs."""
    device = sl.device
    hidden = inputs["hidden"]
    batch = hidden.shape[0]
    with torch.no_grad():
        cond = sl.condition(torch.full((batch,), timestep, device=device), tokens=inputs["tokens"])
        cross = sl.cross_kv(sl.embed_text(inputs["text"]))
        window = FixedWindow(inputs["keys"], inputs["values"])
        ctx = AttentionContext(
            rotary=sl.rotary(args.chunk_frames, args.height, args.width, [args.window] * batch),
            cross_kv=[cross] * batch,
            self_kv=[window] * batch,
        )
        eager_out = sl.run_blocks(hidden, cond, ctx)
        eager = time_forwards(lambda: sl.run_blocks(hidden, cond, ctx), device, args.warmup, args.iters)
        graphs = GraphedBlocks(sl)
        graphed_out = graphs.run(hidden, cond, ctx)
        graphed = time_forwards(lambda: graphs.run(hidden, cond, ctx), device, args.warmup, args.iters)
        result = {
            "eager": eager,
            "graphed": graphed,
            "graphs_captured": graphs.captures,
            "graph_failure": graphs.failure,
            "graphed_vs_eager_max_abs": (graphed_out.float() - eager_out.float()).abs().max().item(),
        }
        graphs.close()
    return {"result": result, "output": eager_out}


def build(cfg: dict, layers: range, device: torch.device, dtype: torch.dtype, granularity: str | None) -> DiTSlice:
    """The stage's slice from the same random weights every time; ``granularity`` None keeps it bf16."""
    sd = random_slice_state_dict(cfg, layers=layers, first=False, last=False, dtype=dtype, device=device, seed=0)
    sl = DiTSlice.from_state_dict(cfg, sd, layers=layers, first=False, last=False, device=device)
    if granularity is not None:
        from stage_service.fp8 import convert_to_fp8

        convert_to_fp8(sl, granularity)
    return sl


def check_model(name: str, args, device: torch.device, dtype: torch.dtype, granularities) -> dict:
    cfg = model_config(name, **({"num_layers": args.num_layers} if args.num_layers else {}))
    layers = range(0, max(1, cfg["num_layers"] // args.stages))
    variants: list[tuple[str, str | None]] = [("bf16" if dtype == torch.bfloat16 else str(dtype), None)]
    variants += [(f"fp8_{g}", g) for g in granularities]
    out: dict = {"model": name, "layers": [layers.start, layers.stop], "batches": {}}
    reference: dict[int, torch.Tensor] = {}
    for label, granularity in variants:
        sl = build(cfg, layers, device, dtype, granularity)
        for batch in args.batches:
            inputs = make_inputs(cfg, batch, args, device, dtype, len(layers))
            got = run_variant(sl, inputs, args)
            row = out["batches"].setdefault(
                str(batch), {"tokens": inputs["tokens"], "context_tokens": inputs["context"], "variants": {}}
            )
            entry = got["result"]
            if granularity is None:
                reference[batch] = got["output"]
            else:
                entry["vs_bf16"] = difference(reference[batch], got["output"], inputs["hidden"])
                base = row["variants"][variants[0][0]]
                entry["speedup_eager"] = base["eager"]["median_ms"] / entry["eager"]["median_ms"]
                entry["speedup_graphed"] = base["graphed"]["median_ms"] / entry["graphed"]["median_ms"]
            row["variants"][label] = entry
            print(describe(name, len(layers), batch, label, entry), flush=True)
            del inputs, got
        del sl
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def describe(name: str, layers: int, batch: int, label: str, e: dict) -> str:
    line = (
        f"{name} x{layers} layers batch {batch} {label}: eager {e['eager']['median_ms']:.2f} ms, "
        f"graphed {e['graphed']['median_ms']:.2f} ms"
    )
    if e.get("graph_failure"):
        line += f" (graph capture FAILED: {e['graph_failure']}; graphed ran eagerly)"
    if "vs_bf16" in e:
        d = e["vs_bf16"]
        line += (
            f"; x{e['speedup_eager']:.2f} eager, x{e['speedup_graphed']:.2f} graphed; vs bf16 max abs "
            f"{d['max_abs']:.3e}, max rel {d['max_rel']:.3e}, rel L2 {d['rel_l2']:.3e}, update rel L2 "
            f"{d['update_rel_l2']:.3e}"
        )
    return line


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda}
    try:
        out["torchao"] = version("torchao")
    except PackageNotFoundError:
        out["torchao"] = None
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(0)
        out["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_protocol_args(ap, models="wan2.1-1.3b", batches="1,4", warmup=5, iters=30)
    ap.add_argument("--granularities", default="row,tensor", help="float8 scales to try: row (the stage's), tensor")
    args = ap.parse_args(argv)
    args.batches = parse_batches(ap, args.batches)
    granularities = [g for g in args.granularities.split(",") if g]
    bad = [g for g in granularities if g not in GRANULARITIES]
    if bad or not granularities:
        ap.error(f"--granularities: each must be one of {', '.join(GRANULARITIES)}, got {args.granularities!r}")
    from stagecast.fp8 import Fp8Unavailable, check_fp8

    try:
        check_fp8("cuda:0" if torch.cuda.is_available() else "cpu", "bfloat16")
    except Fp8Unavailable as exc:
        print(f"fp8_check: error: {exc}", file=sys.stderr)
        return 2
    device, dtype = torch.device("cuda:0"), torch.bfloat16
    torch.cuda.set_device(device)
    command = "python -m benchmarks.fp8_check " + " ".join(argv if argv is not None else sys.argv[1:])
    result = {
        "date": datetime.date.today().isoformat(),
        "command": command,
        "versions": versions(),
        "protocol": protocol_record(args, "latent frames of context (the protocol's 3 sinks + 3 recent)"),
        "models": [check_model(m, args, device, dtype, granularities) for m in args.models.split(",") if m],
    }
    write_result(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
