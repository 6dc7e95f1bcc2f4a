"""The ``fused`` lever's kernels one by one at the serving shape: time, bytes moved, and how far under the memory
bandwidth each runs, compiled as the lever compiles them and in the forms that could replace them.

    python -m benchmarks.fused_kernels --json benchmarks/results/fused_kernels_1gpu.json     # one GPU, ~1 min
    python -m benchmarks.fused_kernels --smoke                                               # CPU: small, eager

Why: a kernel profile of a batch-4 forward (H200, ``benchmarks/results/dit_profile_1gpu_4aea243.log``) spent 20 of
its 67 ms outside the GEMMs and attention, in kernels that move little data: the q/k RMS norm with RoPE took 219 us
a layer for about 80 MB (0.35 TB/s where a copy runs near 4).  Each case here is one function of
``stage_service.dit_levers`` at batch ``--batches`` (1560 tokens, Wan2.1-1.3B's 1536 channels and 12 heads), in:

- ``dynamic``: ``torch.compile(fullgraph=True, dynamic=True)``, what the lever runs (one compile for every batch);
- ``static``: ``dynamic=False``, one compile per batch size (the lever's graphs are captured per batch anyway);
- ``rows``: ``dynamic=False`` with every dimension but the channels marked dynamic (``dit_levers.rows_dynamic``):
  one compile for every batch and token count with static reductions and strides;
- ``pairs`` (q/k norm + RoPE only): RoPE as ``x * cos + rotate(x) * sin`` with full tables, no strided writes
  (``rope_pairs``); on a CPU, uncompiled, it equals diffusers' form bit for bit (``tests/test_fused_kernels.py``).

Per case: the median time, the bytes its inputs and outputs hold (what it must move at least), that over the time,
and the largest difference from the eager function (the reference).  ``copy_tb_s`` is a device-to-device copy's
rate in the same run: the ceiling.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.fp8_check import parse_batches, time_forwards
from stage_service.dit_levers import add_mod_norm, compile_form, gate_residual, mod_norm, qk_norm_rope


def rope_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``dit_slice.apply_rotary_emb`` without its strided writes: each pair (x1, x2) becomes (x1 cos - x2 sin,
    x2 cos + x1 sin) as ``x * cos + (-x2, x1) * sin`` over the full tables.  Equal to it where each pair's two table
    entries are equal (diffusers' tables repeat each frequency twice): a - b is a + (-b), and a sum's order is free."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    rotated = torch.stack((-x2, x1), dim=-1).flatten(-2)
    return (x * cos + rotated * sin).type_as(x)


def qk_norm_rope_pairs(q, k, q_weight, k_weight, eps: float, heads: int, cos, sin):
    """``dit_levers.qk_norm_rope`` with ``rope_pairs``."""
    q = F.rms_norm(q, (q.shape[-1],), q_weight, eps).unflatten(2, (heads, -1))
    k = F.rms_norm(k, (k.shape[-1],), k_weight, eps).unflatten(2, (heads, -1))
    return rope_pairs(q, cos, sin), rope_pairs(k, cos, sin)


def _tensors(out) -> list[torch.Tensor]:
    return [t for t in (out if isinstance(out, tuple) else (out,)) if isinstance(t, torch.Tensor)]


def nbytes(args: tuple, out) -> int:
    """What a kernel must read and write at least: its tensor inputs (broadcast ones once) and outputs."""
    return sum(t.numel() * t.element_size() for t in [*_tensors(args), *_tensors(out)])


def inputs(name: str, batch: int, tokens: int, dim: int, heads: int, device, dtype) -> tuple:
    gen = torch.Generator(device=device).manual_seed(7 + batch)

    def randn(*shape, dt=dtype):
        return torch.randn(*shape, generator=gen, device=device, dtype=dt)

    mod = [randn(batch, 1, dim, dt=torch.float32) * 0.1 for _ in range(2)]
    if name == "qk_norm_rope":
        half = torch.rand(batch, tokens, 1, dim // heads // 2, generator=gen, device=device) * 6.28
        cos, sin = (f(half).repeat_interleave(2, dim=-1) for f in (torch.cos, torch.sin))  # diffusers' table form
        weights = [1 + randn(dim) * 0.1 for _ in range(2)]
        return (randn(batch, tokens, dim), randn(batch, tokens, dim), *weights, 1e-6, heads, cos, sin)
    if name == "mod_norm":
        return (randn(batch, tokens, dim), *mod, 1e-6)
    if name == "add_mod_norm":
        return (randn(batch, tokens, dim), randn(batch, tokens, dim), *mod, 1e-6)
    if name == "gate_residual":
        return (randn(batch, tokens, dim), randn(batch, tokens, dim, dt=torch.float32), mod[0])
    raise ValueError(name)


# (kernel, form, function): the function each form compiles; ``pairs`` only where it differs from the lever's.
CASES: tuple[tuple[str, str, Callable], ...] = (
    ("qk_norm_rope", "dynamic", qk_norm_rope),
    ("qk_norm_rope", "static", qk_norm_rope),
    ("qk_norm_rope", "pairs dynamic", qk_norm_rope_pairs),
    ("qk_norm_rope", "pairs static", qk_norm_rope_pairs),
    ("qk_norm_rope", "rows", qk_norm_rope),
    ("qk_norm_rope", "pairs rows", qk_norm_rope_pairs),
    ("mod_norm", "dynamic", mod_norm),
    ("mod_norm", "static", mod_norm),
    ("mod_norm", "rows", mod_norm),
    ("add_mod_norm", "dynamic", add_mod_norm),
    ("add_mod_norm", "static", add_mod_norm),
    ("add_mod_norm", "rows", add_mod_norm),
    ("gate_residual", "dynamic", gate_residual),
    ("gate_residual", "static", gate_residual),
    ("gate_residual", "rows", gate_residual),
)
# The eager function each kernel's forms are checked against.
REFERENCE = {f.__name__: f for f in (qk_norm_rope, mod_norm, add_mod_norm, gate_residual)}


def compiled(fn: Callable, form: str, compile: bool) -> Callable:
    """``fn`` as ``form`` compiles it (eager where ``compile`` is off: a CPU smoke run)."""
    if not compile:
        return fn
    return compile_form(fn, form.split()[-1])


def max_diff(out, ref) -> float:
    return max((a.float() - b.float()).abs().max().item() for a, b in zip(_tensors(out), _tensors(ref)))


def copy_rate(device, warmup: int, iters: int) -> float | None:
    """TB/s of a device-to-device copy of 1 GiB (read and written): the ceiling the kernels' rates are read against."""
    if device.type != "cuda":
        return None
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = time_forwards(lambda: dst.copy_(src), device, warmup, iters)["median_ms"]
    return 2 * src.numel() / (ms * 1e-3) / 1e12


def run(args) -> dict:
    device = torch.device("cuda:0" if torch.cuda.is_available() and not args.smoke else "cpu")
    compile = device.type == "cuda"
    result = {
        "date": datetime.date.today().isoformat(),
        "command": "python -m benchmarks.fused_kernels " + " ".join(args.argv),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "shape": {"tokens": args.tokens, "dim": args.dim, "heads": args.heads, "dtype": "bfloat16"},
        "copy_tb_s": copy_rate(device, args.warmup, args.iters),
        "cases": [],
    }
    dtype = torch.bfloat16
    for batch in args.batches:
        for name, form, fn in CASES:
            a = inputs(name, batch, args.tokens, args.dim, args.heads, device, dtype)
            ref = REFERENCE[name](*a)
            row = {"kernel": name, "form": form, "batch": batch}
            try:
                f = compiled(fn, form, compile)
                out = f(*a)
                row["max_diff_vs_eager"] = max_diff(out, ref)
                row["ms"] = time_forwards(lambda f=f, a=a: f(*a), device, args.warmup, args.iters)["median_ms"]
                row["mb"] = nbytes(a, out) / 1e6
                row["tb_s"] = row["mb"] / 1e6 / (row["ms"] * 1e-3)
            except Exception as exc:  # noqa: BLE001 - a form that cannot compile here is a result too
                row["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
            result["cases"].append(row)
            print(describe(row), flush=True)
            if args.json:
                Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return result


def describe(row: dict) -> str:
    head = f"{row['kernel']:14s} {row['form']:14s} batch {row['batch']:2d}: "
    if "error" in row:
        return head + f"FAILED {row['error']}"
    return head + (
        f"{row['ms'] * 1e3:8.1f} us, {row['mb']:6.1f} MB, {row['tb_s']:5.2f} TB/s, "
        f"max diff vs eager {row['max_diff_vs_eager']:.2e}"
    )


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.fused_kernels", description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,4", help="micro-steps per forward, comma-separated")
    ap.add_argument("--tokens", type=int, default=1560, help="tokens per chunk (480x832, 1 latent frame)")
    ap.add_argument("--dim", type=int, default=1536, help="channels (Wan2.1-1.3B)")
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--smoke", action="store_true", help="CPU, small shapes, eager: the code paths only")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    args.argv = list(argv if argv is not None else sys.argv[1:])
    args.batches = parse_batches(ap, args.batches)
    if args.dim % (2 * args.heads):
        ap.error(f"--dim: a multiple of twice --heads ({2 * args.heads}), got {args.dim}")
    if args.smoke:
        args.tokens, args.dim, args.heads, args.warmup, args.iters = 24, 64, 4, 1, 2
    return args


def main(argv: list[str] | None = None) -> int:
    run(parse(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
