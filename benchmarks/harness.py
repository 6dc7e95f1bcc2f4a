"""Benchmark harness: the real system against the single-GPU peer and the compute floor, in one run.

Usage (on a machine with GPUs; one command per configuration)::

    python -m benchmarks.harness --model wan2.1-1.3b --width 832 --height 480 --steps 1 --stages 2 \
        --seconds 10 --json results/1.3b-1step-2gpu.json --markdown BENCHMARKS.md
    python -m benchmarks.harness --smoke          # CPU, tiny model, a few seconds (CI runs this)

What one run does:

1. writes a checkpoint folder holding the real VAE / DiT *configs* with random weights (stages build their
   own random slices on their GPUs: ``--checkpoint random:<model>``), and a small random UMT5 with the
   real text width (4096);
2. measures the **compute floor**: FLOPs per video frame (DiT forward per latent frame at every step,
   counted with ``torch.utils.flop_counter``, plus the VAE decode of one latent frame) divided by a bf16
   matmul peak measured here, times the GPU count;
3. measures the **peer**: diffusers on one GPU, sequential and eager, ``WanTransformer3DModel`` for every
   step of a chunk, then ``AutoencoderKLWan`` chunk decode;
4. starts coordinator, N stages and the gateway as processes (gRPC + NCCL) and streams through the public
   API with the SDK: FPS counted at the client after warmup, TTFF p50/p95 over fresh prompts, per-stage
   forward time and utilization from the coordinator's stats, peak GPU memory from nvidia-smi;
5. prints ratios against the peer and the floor, writes JSON, and appends a row to ``--markdown``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import torch

from stagecast.model.dit_configs import model_config

VAE_FOR_MODEL = {
    "wan2.1-1.3b": "wan2.1",
    "wan2.1-14b": "wan2.1",
    "wan2.2-ti2v-5b": "wan2.2",
    "tiny-wan2.1": "tiny-wan2.1",
}
# StreamDiffusionV2's configs: timesteps truncated to the step count (DESIGN.md section 4).
LADDER = (700.0, 500.0, 400.0, 200.0)


def git_commit() -> str:
    if os.environ.get("STAGECAST_COMMIT"):  # the device machine gets a copy of the tree without .git
        return os.environ["STAGECAST_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def gpu_name() -> str:
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---- assets ---------------------------------------------------------------------------------------------


def write_assets(root: Path, args) -> None:
    from diffusers import AutoencoderKLWan

    from gateway.text_encoder import write_tiny_text_encoder
    from stagecast.model.vae_configs import vae_config

    cfg = model_config(args.model)
    (root / "transformer").mkdir(parents=True)
    (root / "transformer" / "config.json").write_text(json.dumps(cfg, default=list))
    torch.manual_seed(0)
    AutoencoderKLWan(**vae_config(VAE_FOR_MODEL[args.model])).save_pretrained(root / "vae")
    # The real encoder is UMT5-XXL (5.7B, ~50 ms per new prompt on an H200, DESIGN.md section 4); a random one of
    # that size cannot be written here in reasonable time, so a 2-layer encoder of the same width stands in.
    heads = 8 if cfg["text_dim"] >= 512 else 4
    write_tiny_text_encoder(
        root, d_model=cfg["text_dim"], num_layers=2, num_heads=heads, d_kv=cfg["text_dim"] // heads, d_ff=256
    )
    text_len = 512 if cfg["text_dim"] >= 512 else 16
    defaults = {"text_len": text_len, "width": args.width, "height": args.height, "steps": args.steps}
    (root / "stagecast.json").write_text(json.dumps(defaults))


# ---- floor ----------------------------------------------------------------------------------------------


def matmul_peak_tflops(device: torch.device, n: int) -> float:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    sync(device)
    reps = 10
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync(device)
    return 2 * n**3 * reps / (time.perf_counter() - t) / 1e12


def build_peer(args, device, dtype):
    from diffusers import AutoencoderKLWan, WanTransformer3DModel

    from stagecast.model.vae_configs import vae_config

    torch.manual_seed(0)
    with torch.device(device):
        dit = WanTransformer3DModel(**model_config(args.model)).to(dtype).eval().requires_grad_(False)
        vae = AutoencoderKLWan(**vae_config(VAE_FOR_MODEL[args.model])).to(dtype).eval().requires_grad_(False)
    return dit, vae


def latent_geometry(args, vae) -> tuple[int, int, int]:
    from stagecast.model.vae_configs import spatial_factor

    f = spatial_factor(dict(vae.config))
    return vae.config.z_dim, args.height // f, args.width // f


def flops_per_frame(args, dit, vae, device, dtype, text_len) -> dict:
    from torch.utils.flop_counter import FlopCounterMode

    from gateway.stream_vae import StreamVAE

    c, h, w = latent_geometry(args, vae)
    x = torch.randn(1, c, 1, h, w, device=device, dtype=dtype)
    text = torch.randn(1, text_len, dit.config.text_dim, device=device, dtype=dtype)
    with torch.no_grad(), FlopCounterMode(display=False) as fc:
        dit(x, torch.tensor([500.0], device=device), text)
    dit_flops = fc.get_total_flops()
    # KV window attention (not in a single-chunk forward): q.k and p.v over the cached frames, every layer.
    tokens = h // 2 * (w // 2)
    d = dit.config.num_attention_heads * dit.config.attention_head_dim
    window_flops = 4 * tokens * (args.window * tokens) * d * dit.config.num_layers
    sv = StreamVAE(vae)
    state = sv.new_state()
    with torch.no_grad():
        sv.decode_chunk(state, torch.randn(1, c, 1, h, w, device=device, dtype=dtype))  # frame 0: 1 video frame
        with FlopCounterMode(display=False) as fc:
            sv.decode_chunk(state, torch.randn(1, c, 1, h, w, device=device, dtype=dtype))
    vae_flops = fc.get_total_flops()
    sv.release(state)
    per_latent = args.steps * (dit_flops + window_flops) + vae_flops
    return {
        "dit_tflop_per_forward": dit_flops / 1e12,
        "window_tflop_per_forward": window_flops / 1e12,
        "vae_tflop_per_latent_frame": vae_flops / 1e12,
        "tflop_per_video_frame": per_latent / 4 / 1e12,
    }


def run_peer(args, dit, vae, device, dtype, text_len, chunks: int) -> dict:
    """diffusers, one GPU, sequential, eager: every step of a chunk through the whole DiT, then VAE decode."""
    from gateway.stream_vae import StreamVAE

    c, h, w = latent_geometry(args, vae)
    text = torch.randn(1, text_len, dit.config.text_dim, device=device, dtype=dtype)
    sv = StreamVAE(vae)
    state = sv.new_state()
    timesteps = LADDER[: args.steps]
    frames = 0
    with torch.no_grad():
        for i in range(chunks + 2):
            if i == 2:  # two warm-up chunks (frame 0 decodes alone, then the cache settles)
                sync(device)
                start, frames = time.perf_counter(), 0
            x = torch.randn(1, c, 1, h, w, device=device, dtype=dtype)
            for t in timesteps:
                v = dit(x, torch.tensor([t], device=device), text, return_dict=False)[0]
                x = x - (t / 1000.0) * v
            video = sv.decode_chunk(state, x)
            frames += video.shape[2]
        sync(device)
    elapsed = time.perf_counter() - start
    sv.release(state)
    return {"fps": frames / elapsed, "frames": frames, "seconds": elapsed}


# ---- the system -----------------------------------------------------------------------------------------


def start_system(launcher, root: Path, args, device_kind: str):
    from launcher.local_cluster import start_pipeline

    stage_device = "cuda" if device_kind == "cuda" else "cpu"
    pipe = start_pipeline(
        launcher,
        checkpoint=f"random:{args.model}",
        stages=args.stages,
        partition=args.partition,
        device=stage_device,
        dtype=args.dtype,
        max_batch=args.batch,
        cuda_graphs=args.cuda_graphs and device_kind == "cuda",
    )
    gw_device = f"cuda:{args.gateway_gpu if args.gateway_gpu is not None else args.stages - 1}"
    gw_args = ["gateway", "--port", "0", "--coordinator", pipe.coordinator, "--checkpoint", str(root)]
    gw_args += ["--device", gw_device if device_kind == "cuda" else "cpu", "--vae-dtype", args.dtype]
    if args.vae_compile and device_kind == "cuda":
        gw_args.append("--vae-compile")
    if device_kind == "cuda":
        vae_gpus = args.vae_gpus if args.vae_gpus is not None else ",".join(str(i) for i in range(args.stages))
        gw_args += ["--vae-devices", ",".join(f"cuda:{g}" for g in vae_gpus.split(","))]
    else:  # CPU smoke: the same pipelined path, two slices on the CPU
        gw_args += ["--vae-devices", "cpu,cpu"]
    if args.vae_split:
        gw_args += ["--vae-split", args.vae_split]
    gateway = launcher.spawn("gateway", gw_args, timeout=600)
    return pipe, gateway.info["address"]


def stream_once(client, args, seconds: float, prompt: str) -> dict:
    gen = client.generate(
        prompt=prompt,
        width=args.width,
        height=args.height,
        seconds=seconds,
        steps=args.steps,
        codec=args.codec,
        chunk_frames=1,
        window=args.window,
        sink=args.sink,
        policy="per_level",
    )
    t0 = time.perf_counter()
    stamps, first = [], None
    for frame in gen:
        stamps.append(time.perf_counter() - t0)
        first = first or frame
    ended = time.perf_counter() - t0  # the call's end: the End message after the last frame
    if not stamps:
        raise RuntimeError("the stream produced no frames")
    skip = max(1, len(stamps) // 5)  # steady state: drop the first fifth (warmup of the wavefront)
    steady = stamps[skip:]
    fps = (len(steady) - 1) / (steady[-1] - steady[0]) if len(steady) > 2 else float("nan")
    ttff = first.timing.received_s  # the SDK's clock starts before the call sends the config
    return {
        "ttff_s": ttff,
        "ttff_parts_ms": ttff_parts(first.timing, ttff),
        "fps": fps,
        "frames": len(stamps),
        "first_to_last_frame_s": stamps[-1] - stamps[0],
        "last_frame_to_end_s": ended - stamps[-1],
    }


def ttff_parts(timing, ttff_s: float) -> dict:
    """Where the first frame's time went, from the gateway's timestamps on it (ms since it got the config).

    ``pipeline``: prompt encoding, the coordinator's open, every stage and the hops back to the gateway, up to the
    first chunk's latents; ``vae``: decoding that chunk; ``encode``: the frame's codec; ``rest``: the client's
    request reaching the gateway and the frame reaching the client.
    """
    return {
        "pipeline": timing.latents_ms,
        "vae": timing.decoded_ms - timing.latents_ms,
        "encode": timing.encoded_ms - timing.decoded_ms,
        "rest": ttff_s * 1e3 - timing.encoded_ms,
    }


def stage_stats(coordinator: str) -> list[dict]:
    import grpc

    from stagecast.internal.v1 import pipeline_pb2 as pb
    from stagecast.internal.v1 import pipeline_pb2_grpc as pb_grpc

    with grpc.insecure_channel(coordinator) as ch:
        status = pb_grpc.CoordinatorServiceStub(ch).Status(pb.Empty(), timeout=10)
    return [
        {"index": s.index, "batches": s.batches, "forward_ms": s.forward_ms_total, "micro_steps": s.micro_steps}
        for s in status.stage_stats
    ]


def gpu_memory() -> list[int]:
    try:
        out = subprocess.check_output(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"], text=True
        )
        return [int(x) for x in out.split()]
    except (OSError, subprocess.CalledProcessError):
        return []


def run_system(root: Path, args, device_kind: str) -> dict:
    import stagecast
    from launcher.process import Launcher

    with Launcher() as launcher:
        pipe, gateway = start_system(launcher, root, args, device_kind)
        with stagecast.Client(gateway) as client:
            # Every prompt is new to the server (its text cache), as the protocol asks for TTFF.
            nonce = uuid.uuid4().int % 900
            stream_once(client, args, min(3.0, args.seconds), f"a dog {nonce}")  # compile, allocator, autotune
            before = stage_stats(pipe.coordinator)
            t = time.perf_counter()
            main = stream_once(client, args, args.seconds, f"a fox {nonce}")
            wall = time.perf_counter() - t  # includes the stream's set-up and its end
            after = stage_stats(pipe.coordinator)
            firsts = [stream_once(client, args, 0.3, f"a cat {nonce + i}") for i in range(args.ttff_runs)]
            ttffs = [f["ttff_s"] for f in firsts]
        mem = gpu_memory()
    stages = []
    for b, a in zip(before, after):
        busy = (a["forward_ms"] - b["forward_ms"]) / 1e3
        stages.append(
            {
                "index": a["index"],
                "batches": a["batches"] - b["batches"],
                "mean_forward_ms": (a["forward_ms"] - b["forward_ms"]) / max(1, a["batches"] - b["batches"]),
                "mean_batch": (a["micro_steps"] - b["micro_steps"]) / max(1, a["batches"] - b["batches"]),
                # Forward time over the span the frames arrived in (first to last). CUDA events time the GPU
                # stream, so where the gateway's VAE shares the GPU its kernels count in (time-slicing).
                "utilization": busy / max(main["first_to_last_frame_s"], 1e-9),
            }
        )
    util = [s["utilization"] for s in stages]
    return {
        "fps": main["fps"],
        "frames": main["frames"],
        "main_stream_wall_s": wall,
        "first_to_last_frame_s": main["first_to_last_frame_s"],
        "last_frame_to_end_s": main["last_frame_to_end_s"],
        "ttff_p50_s": statistics.median(ttffs),
        "ttff_p95_s": sorted(ttffs)[max(0, round(0.95 * len(ttffs)) - 1)],
        # Medians of each part over the TTFF streams (they need not add up to the median TTFF exactly).
        "ttff_parts_p50_ms": {
            part: statistics.median(f["ttff_parts_ms"][part] for f in firsts) for part in firsts[0]["ttff_parts_ms"]
        },
        "stages": stages,
        "bubble_fraction": 1 - sum(util) / len(util) if util else None,
        "gpu_memory_used_mib": mem,
    }


# ---- report ---------------------------------------------------------------------------------------------


def markdown_row(r: dict) -> str:
    s, p, f = r["system"], r["peer"], r["floor"]
    stage_ms = "/".join(f"{x['mean_forward_ms']:.1f}" for x in s["stages"])
    return (
        f"| {r['date']} | {r['gpu']} x{r['args']['stages']} | {r['args']['model']} @ {r['args']['height']}x"
        f"{r['args']['width']}, {r['args']['steps']} step(s), B={r['args']['batch']} | {s['fps']:.1f} | "
        f"{s['ttff_p50_s'] * 1e3:.0f} / {s['ttff_p95_s'] * 1e3:.0f} | {p['fps']:.1f} | "
        f"{f['fps']:.0f} | {s['fps'] / p['fps']:.2f}x | {s['fps'] / f['fps']:.1%} | {stage_ms} | "
        f"{s['bubble_fraction']:.0%} | {r['commit']} | `{r['command']}` |"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="wan2.1-1.3b")
    ap.add_argument("--width", type=int, default=832)
    ap.add_argument("--height", type=int, default=480)
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--partition", default=None)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--window", type=int, default=6, help="KV window in latent frames (protocol: 6)")
    ap.add_argument("--sink", type=int, default=3, help="sink frames (protocol: 3)")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--codec", default="jpeg")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--ttff-runs", type=int, default=5)
    ap.add_argument("--peer-chunks", type=int, default=8)
    ap.add_argument("--gateway-gpu", type=int, default=None, help="GPU for text encoder + VAE (default: last stage's)")
    ap.add_argument("--vae-compile", action="store_true", help="torch.compile the gateway's VAE decoder")
    ap.add_argument("--cuda-graphs", action="store_true", help="stages run their blocks as CUDA graphs")
    ap.add_argument(
        "--vae-gpus", default=None, help="GPUs the VAE decoder is cut over, e.g. 0,1 (default: every stage's GPU)"
    )
    ap.add_argument("--vae-split", default=None, help="decoder units where VAE slices 1.. start (gateway --vae-split)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--markdown", default=None)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model, small frames: proves the harness runs")
    args = ap.parse_args(argv)
    if args.smoke:
        args.model, args.width, args.height, args.stages, args.dtype = "tiny-wan2.1", 64, 64, 2, "float32"
        args.seconds, args.ttff_runs, args.peer_chunks, args.steps, args.window, args.sink = 1.0, 2, 2, 2, 2, 1
        args.codec = "raw"
    device_kind = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    device = torch.device("cuda:0" if device_kind == "cuda" else "cpu")
    dtype = getattr(torch, args.dtype)
    text_len = 512 if model_config(args.model)["text_dim"] >= 512 else 16
    command = "python -m benchmarks.harness " + " ".join(argv if argv is not None else sys.argv[1:])

    with tempfile.TemporaryDirectory(prefix="stagecast-bench-") as tmp:
        root = Path(tmp)
        write_assets(root, args)
        dit, vae = build_peer(args, device, dtype)
        flops = flops_per_frame(args, dit, vae, device, dtype, text_len)
        peak = matmul_peak_tflops(device, 8192 if device_kind == "cuda" else 512)
        floor_fps = args.stages * peak / flops["tflop_per_video_frame"]
        peer = run_peer(args, dit, vae, device, dtype, text_len, args.peer_chunks)
        del dit, vae
        if device_kind == "cuda":
            torch.cuda.empty_cache()
        system = run_system(root, args, device_kind)

    result = {
        "date": datetime.date.today().isoformat(),
        "gpu": gpu_name(),
        "commit": git_commit(),
        "command": command,
        "args": vars(args),
        "floor": {"matmul_peak_tflops": peak, **flops, "fps": floor_fps},
        "peer": peer,
        "system": system,
        "ratios": {"vs_peer": system["fps"] / peer["fps"], "of_floor": system["fps"] / floor_fps},
    }
    print(json.dumps(result, indent=2))
    print(markdown_row(result))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))
    if args.markdown:
        with open(args.markdown, "a") as fh:
            fh.write(markdown_row(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
