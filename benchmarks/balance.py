"""Measure a balance profile: ms per chunk of every transformer block and every VAE decoder unit, on one GPU.

Usage::

    python -m benchmarks.balance --model wan2.1-1.3b --steps 1 --cuda-graphs --vae-compile --out profile.json
    python -m benchmarks.balance --model tiny-wan2.1 --device cpu --out tiny.json      # CPU, tiny config (tests)
    stagecast up ... --partition auto --balance-profile profile.json      # the partition and VAE cut from it

Random weights in the real config, the benchmark protocol (DESIGN.md section 4): 480x832, one latent frame per chunk,
``per_level``, a KV window of 6 frames with 3 sinks, text length 512.  Times are CUDA events (wall clock on a CPU),
the median over ``--iters`` steady-state chunks.

The DiT is timed the way a stage runs it: a ``SliceRunner`` (with ``GraphedBlocks`` under ``--cuda-graphs``) over a
slice of random weights, driven by the steady-state wavefront (per chunk, one forward of ``steps`` micro-steps, one
per level, each reading its KV window).  A stage's time is its fixed work plus its blocks, so:

- block i: a middle slice holding block i alone, less the fixed work of a middle stage;
- the fixed work of every stage (``stage_ms``): the n one-block slices less one middle slice of all n blocks, over
  n - 1 (n stages hold it n times, one stage once);
- the first stage's extra (``first_ms``, patch embedding): the first slice of block 0 less the middle one;
- the last stage's extra (``last_ms``, head and sampler step): the last slice of the last block less the middle one.

The VAE is timed unit by unit (``gateway.decode.stream_vae.decoder_units``, the units ``--vae-split`` cuts at), each a
``StreamVAESlice`` of one unit (compiled one by one under ``--vae-compile``; the gateway compiles a slice's units
together), decoding one latent frame per chunk after the first three.

The last lines print what the planner makes of it on ``--gpus`` GPUs, beside the even partition with the VAE cut
balanced by multiply-accumulates (today's default).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import statistics
import sys
import time

import torch

from stagecast.microstep import DEFAULT_MAX_BATCH
from stagecast.model.balance import BalanceCosts, evaluate, plan_balance
from stagecast.model.balance_profile import DIT_KEYS, BalanceProfile
from stagecast.model.dit_configs import model_config
from stagecast.model.partition import even_partition

MAX_STEPS = DEFAULT_MAX_BATCH  # one forward of every level per chunk: the coordinator's default --max-batch


class _Clock:
    """Times one region: CUDA events on a GPU (what the GPU spent, gaps included), wall clock on a CPU."""

    def __init__(self, device: torch.device):
        self.device = device

    def __enter__(self):
        if self.device.type == "cuda":
            self.start = torch.cuda.Event(enable_timing=True)
            self.end = torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            self.end.record()
            self.end.synchronize()
            self.ms = self.start.elapsed_time(self.end)
        else:
            self.ms = (time.perf_counter() - self.t0) * 1e3


def stage_ms(
    config: dict,
    layers: range,
    *,
    first: bool,
    last: bool,
    args,
    device: torch.device,
    dtype: torch.dtype,
) -> float:
    """Median ms per chunk of one stage holding ``layers``, in the steady-state wavefront."""
    from stage_service.checkpoint import random_slice_state_dict
    from stage_service.dit_slice import DiTSlice
    from stage_service.graphs import GraphedBlocks
    from stage_service.runner import SliceRunner
    from stagecast.microstep import MicroStep, StreamSpec

    sd = random_slice_state_dict(config, layers=layers, first=first, last=last, dtype=dtype, device=device)
    sl = DiTSlice.from_state_dict(config, sd, layers=layers, first=first, last=last, device=device)
    del sd
    graphs = GraphedBlocks(sl) if args.cuda_graphs and device.type == "cuda" else None
    runner = SliceRunner(sl, graphs=graphs)
    lh, lw = args.height // args.spatial, args.width // args.spatial
    spec = StreamSpec(
        stream_id=1,
        latent_channels=config["in_channels"],
        chunk_frames=1,
        latent_height=lh,
        latent_width=lw,
        timesteps=tuple(1000.0 * (args.steps - i) / args.steps for i in range(args.steps)),
        policy="per_level",
        window=args.window,
        sink=args.sink,
        text_len=args.text_len,
    )
    gen = torch.Generator().manual_seed(0)
    runner.open_stream(spec, torch.randn(1, args.text_len, config["text_dim"], generator=gen))
    tokens = sl.tokens_per_frame(lh, lw)
    latent_shape = (1, config["in_channels"], 1, lh, lw)
    clock = _Clock(device)
    # The window fills over its first chunks (each a new attention shape, and a new graph): time after it is full.
    warm = args.window + args.steps + 3
    times = []
    for tick in range(warm + args.iters):
        steps = [MicroStep(1, tick - level, level) for level in range(args.steps) if tick - level >= 0]
        inputs = None
        if not first:  # the previous stage's hidden states
            inputs = torch.randn(len(steps), tokens, sl.inner_dim, generator=gen).to(device, dtype)
        elif not last:  # the last stage's next-level latents, received by stage 0
            for st in steps:
                if st.level > 0:
                    runner.put_latent(st, torch.randn(latent_shape, generator=gen).to(device))  # as received
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        with clock:
            out = runner.forward(steps, inputs)
            if last:
                runner.finish(steps, out)
        if tick >= warm:
            times.append(clock.ms)
    runner.close_stream(1)
    if graphs is not None:
        graphs.close()
    del runner, graphs, sl
    if device.type == "cuda":
        gc.collect()  # the graphs' memory pool goes with the last reference to them
        torch.cuda.empty_cache()
    return statistics.median(times)


def dit_costs(args, device: torch.device, dtype: torch.dtype) -> dict:
    config = model_config(args.model)
    n = config["num_layers"]
    if n == 1:
        whole = stage_ms(config, range(0, 1), first=True, last=True, args=args, device=device, dtype=dtype)
        return {"blocks_ms": [whole], "stage_ms": 0.0, "first_ms": 0.0, "last_ms": 0.0}

    def run(layers: range, first: bool = False, last: bool = False) -> float:
        ms = stage_ms(config, layers, first=first, last=last, args=args, device=device, dtype=dtype)
        print(f"  stage of layers {layers.start}:{layers.stop} first={first} last={last}: {ms:.3f} ms", flush=True)
        return ms

    middle = [run(range(i, i + 1)) for i in range(n)]
    # n one-block stages hold n times the fixed work, one stage of all n blocks holds it once: the difference over
    # n - 1 averages every block's noise (kept within [0, the cheapest one-block stage], so no block goes negative).
    whole = run(range(0, n))
    fixed = min(max(0.0, (sum(middle) - whole) / (n - 1)), min(middle))
    first = run(range(0, 1), first=True)
    last = run(range(n - 1, n), last=True)
    return {
        "blocks_ms": [max(0.0, m - fixed) for m in middle],
        "stage_ms": fixed,
        "first_ms": max(0.0, first - middle[0]),
        "last_ms": max(0.0, last - middle[-1]),
    }


def vae_costs(args, device: torch.device, dtype: torch.dtype) -> tuple[list[tuple[str, float]], list[int]]:
    """(unit name, median ms per chunk) per decoder unit, and the MAC-balanced cut over ``args.gpus`` slices."""
    from diffusers import AutoencoderKLWan

    from gateway.decode.stream_vae import StreamVAESlice, decoder_cut, decoder_units
    from stagecast.model.vae_configs import vae_config

    torch.manual_seed(0)
    vae = AutoencoderKLWan(**vae_config(args.vae)).to(device, dtype).eval().requires_grad_(False)
    units = decoder_units(vae)
    parts = [StreamVAESlice(vae, i, i + 1, compile=args.vae_compile) for i in range(len(units))]
    states = [p.new_state() for p in parts]
    latents = torch.randn(1, vae.config.z_dim, 1, args.height // args.spatial, args.width // args.spatial)
    clock = _Clock(device)
    warm = 3  # frame 0 takes the first-chunk path, frames 1 and 2 the compiled variants with short caches
    times: list[list[float]] = [[] for _ in units]
    for frame in range(warm + args.iters):
        x = latents
        for i, part in enumerate(parts):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            with clock:
                x = part.decode_chunk(states[i], x)
            if frame >= warm:
                times[i].append(clock.ms)
    for part, state in zip(parts, states, strict=True):
        part.release(state)
    cut = decoder_cut(vae, min(args.gpus, len(units)))[1:-1]
    return [(u.name, statistics.median(t)) for u, t in zip(units, times, strict=True)], cut


def measure(args) -> BalanceProfile:
    from benchmarks.harness import VAE_FOR_MODEL, git_commit
    from stagecast.model.vae_configs import spatial_factor, vae_config

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # CUDA events and graphs use the current device's stream
    config = model_config(args.model)
    args.vae = VAE_FOR_MODEL[args.model]
    args.spatial = spatial_factor(vae_config(args.vae))
    if args.height % args.spatial or args.width % args.spatial:
        raise SystemExit(f"balance: --width/--height must be multiples of the VAE's {args.spatial}")
    if args.text_len is None:
        args.text_len = 512 if config["text_dim"] >= 512 else 16
    with torch.no_grad():
        print(f"timing {config['num_layers']} blocks of {args.model} on {device} ...", flush=True)
        dit = dit_costs(args, device, dtype)
        print(f"timing the {args.vae} VAE decoder units on {device} ...", flush=True)
        vae, mac_cut = vae_costs(args, device, dtype)
    args.mac_cut = mac_cut
    return BalanceProfile(
        model=args.model,
        dit_config={k: config[k] for k in DIT_KEYS},
        blocks_ms=dit["blocks_ms"],
        vae_units=vae,
        stage_ms=dit["stage_ms"],
        first_ms=dit["first_ms"],
        last_ms=dit["last_ms"],
        width=args.width,
        height=args.height,
        steps=args.steps,
        batch=args.steps,
        policy="per_level",
        window=args.window,
        sink=args.sink,
        text_len=args.text_len,
        dtype=args.dtype,
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        cuda_graphs=bool(args.cuda_graphs and device.type == "cuda"),
        vae_compile=bool(args.vae_compile),
        measured={
            "iters": args.iters,
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "commit": git_commit(),
            "torch": torch.__version__,
            "command": "python -m benchmarks.balance " + " ".join(args.argv),
        },
    )


def report(profile: BalanceProfile, gpus: int, mac_cut: list[int]) -> list[str]:
    """The planner's answer on ``gpus`` GPUs (stage k and VAE slice k on GPU k) against the even partition with the
    multiply-accumulate cut."""
    costs: BalanceCosts = profile.costs()
    stages = min(gpus, len(profile.blocks_ms))
    devices = [f"cuda:{i}" for i in range(stages)]
    vae = devices[: min(stages, len(profile.vae_units))]
    even = evaluate(costs, even_partition(len(profile.blocks_ms), stages), mac_cut[: len(vae) - 1], devices, vae)
    plan = plan_balance(costs, devices, vae)
    lines = []
    for label, p in (("even + MAC cut", even), ("balanced", plan)):
        lines.append(
            f"{label}: {p.flags()}: ms per chunk per GPU {p.gpu_ms_text()}; bottleneck {p.bottleneck_ms:.2f} ms, at "
            f"most {4 * p.chunks_per_second:.1f} FPS"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="wan2.1-1.3b", help="a preset of stagecast.model.dit_configs")
    ap.add_argument("--width", type=int, default=None, help="video width (default 832; tiny models 48)")
    ap.add_argument("--height", type=int, default=None, help="video height (default 480; tiny models 32)")
    ap.add_argument("--steps", type=int, default=1, help=f"denoising steps per chunk, 1..{MAX_STEPS}")
    ap.add_argument("--window", type=int, default=6, help="KV window in latent frames (protocol: 6)")
    ap.add_argument("--sink", type=int, default=3, help="sink frames (protocol: 3)")
    ap.add_argument("--text-len", type=int, default=None, help="text tokens (default 512; tiny models 16)")
    ap.add_argument("--device", default=None, help="cuda:N or cpu (default: cuda:0 if there is one)")
    ap.add_argument("--dtype", default=None, help="default bfloat16 on a GPU, float32 on a CPU")
    ap.add_argument("--cuda-graphs", action="store_true", help="stages run their blocks as CUDA graphs (as served)")
    ap.add_argument("--vae-compile", action="store_true", help="torch.compile each VAE unit (as served, GPU)")
    ap.add_argument("--iters", type=int, default=None, help="steady-state chunks timed (default 30; CPU 10)")
    ap.add_argument("--gpus", type=int, default=2, help="GPUs of the plan printed at the end")
    ap.add_argument("--out", required=True, help="write the profile (JSON) here")
    args = ap.parse_args(argv)
    args.argv = list(argv if argv is not None else sys.argv[1:])
    tiny = args.model.startswith("tiny-")
    if args.device is None:
        args.device = "cuda:0" if torch.cuda.is_available() else "cpu"
    on_gpu = args.device.startswith("cuda")
    args.width = args.width or (48 if tiny else 832)
    args.height = args.height or (32 if tiny else 480)
    args.dtype = args.dtype or ("bfloat16" if on_gpu else "float32")
    args.iters = args.iters or (30 if on_gpu else 10)
    for name, value, lo, hi in (
        ("--steps", args.steps, 1, MAX_STEPS),
        ("--iters", args.iters, 1, 10_000),
        ("--gpus", args.gpus, 1, 8),
        ("--window", args.window, 1, 64),
        ("--sink", args.sink, 0, args.window),
    ):
        if not lo <= value <= hi:
            ap.error(f"{name}: must be in [{lo}, {hi}], got {value}")
    if args.dtype not in ("float32", "bfloat16", "float16"):
        ap.error(f"--dtype: float32, bfloat16 or float16, got {args.dtype!r}")
    from benchmarks.harness import VAE_FOR_MODEL

    if args.model not in VAE_FOR_MODEL:
        ap.error(f"--model: one of {', '.join(sorted(VAE_FOR_MODEL))}, got {args.model!r}")
    profile = measure(args)
    profile.save(args.out)
    print(f"wrote {args.out}: {len(profile.blocks_ms)} blocks, {len(profile.vae_units)} VAE units")
    print(
        f"DiT per chunk: blocks {sum(profile.blocks_ms):.2f} ms in all, every stage +{profile.stage_ms:.2f}, "
        f"first +{profile.first_ms:.2f}, last +{profile.last_ms:.2f}; VAE units "
        + ", ".join(f"{n} {t:.2f}" for n, t in profile.vae_units)
    )
    for line in report(profile, args.gpus, args.mac_cut):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
