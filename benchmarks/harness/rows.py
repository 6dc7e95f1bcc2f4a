"""What the harness writes and reads back in rows: the versions and commit, frame statistics, labels and the
markdown row of a run (``benchmarks.report`` makes BENCHMARKS.md's tables from the same JSON)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import torch

from stagecast.model.dit_configs import model_config

VAE_FOR_MODEL = {
    "wan2.1-1.3b": "wan2.1",
    "wan2.1-14b": "wan2.1",
    "wan2.2-ti2v-5b": "wan2.2",
    "tiny-wan2.1": "tiny-wan2.1",
}
# StreamDiffusionV2's configs: timesteps truncated to the step count (the protocol in BENCHMARKS.md).
LADDER = (700.0, 500.0, 400.0, 200.0)


def _has_timesteps_field() -> bool:
    """Whether the public StreamConfig takes an explicit ladder; without it the gateway's own ladder is used (the
    ladder's values do not change the work per step, so speed figures are comparable either way)."""
    from stagecast.v1 import stream_pb2 as pb

    return "timesteps" in pb.StreamConfig.DESCRIPTOR.fields_by_name


TIMESTEPS_FIELD = _has_timesteps_field()


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


def decoders_of(args) -> list[str]:
    """``--decoder``'s list ("full,tiny" -> ["full", "tiny"]); ["full"] for benchmarks without the flag."""
    return list(getattr(args, "decoders", None) or ["full"])


def decoder_list(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names or any(n not in ("full", "tiny") for n in names) or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"expected full, tiny or both (e.g. full,tiny), got {text!r}")
    return names


# ---- what the viewer sees -------------------------------------------------------------------------------


_T0 = time.perf_counter()


def log(phase: str) -> None:
    print(f"[harness] {phase} done at {time.perf_counter() - _T0:.1f} s", flush=True)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 1])."""
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, round(q * len(ordered)) - 1))]


def frame_stats(arrivals: list[float], target_fps: float, middle: tuple[float, float] = (0.3, 0.7)) -> dict:
    """Steady FPS over the middle of the frames, whole-stream FPS, and punctuality at ``target_fps``.

    Frame i is due at arrivals[0] + i / target_fps; a gap is the time between two consecutive frames' arrivals.
    ``late_first_s`` counts the late frames due in the stream's first second and ``late_after_first_s`` the rest: a
    stream whose only late frames are its first few (chunk 1 arriving less than one frame after chunk 0) is told
    apart from one that falls behind while it runs.
    """
    n = len(arrivals)
    out = {"frames": n, "first_s": arrivals[0] if n else None, "last_s": arrivals[-1] if n else None}
    if n < 3:
        return {**out, "steady_fps": None, "whole_fps": None, "on_time": None, "max_gap_ms": None}
    a, b = int(n * middle[0]), max(int(n * middle[0]) + 2, int(n * middle[1]))
    b = min(b, n)
    gaps = [(arrivals[i] - arrivals[i - 1]) * 1e3 for i in range(1, n)]
    late = [arrivals[i] - (arrivals[0] + i / target_fps) for i in range(n)]
    return {
        **out,
        "steady_fps": (b - a - 1) / (arrivals[b - 1] - arrivals[a]) if arrivals[b - 1] > arrivals[a] else None,
        "steady_window": [a, b],
        "whole_fps": (n - 1) / (arrivals[-1] - arrivals[0]),
        "target_fps": target_fps,
        "on_time": sum(x <= 1e-9 for x in late) / n,
        "late_first_s": sum(x > 1e-9 for i, x in enumerate(late) if i < target_fps),
        "late_after_first_s": sum(x > 1e-9 for i, x in enumerate(late) if i >= target_fps),
        "max_late_ms": max(late) * 1e3,
        "max_gap_ms": max(gaps),
        "p99_gap_ms": percentile(gaps, 0.99),
        "gaps_over_250ms": sum(g > 250.0 for g in gaps),
    }


def decodable(codec: str, seen: bytes) -> bool:
    """Whether the bytes received so far hold a picture: every JPEG/raw frame does; fMP4 once a fragment is in."""
    return codec != "h264" or b"moof" in seen


def gpus_of(args) -> int:
    """Stage processes (one GPU each on a GPU machine): pipeline stages x sequence-parallel ranks x CFG groups."""
    return args.stages * args.sp * args.cfg_parallel


def branches_of(args) -> int:
    return 2 if args.guidance > 1.0 else 1


def comm_summary(args, stages: list[dict]) -> dict:
    """Communication per denoising step (one batch is one step of the micro-steps it holds): measured host waits and
    exchange times, and the bytes one micro-step of a stream puts on the data plane (from the shapes)."""
    cfg = model_config(args.model)
    vae_factor = 16 if VAE_FOR_MODEL[args.model] == "wan2.2" else 8
    h, w = args.height // vae_factor, args.width // vae_factor
    tokens = (h // 2) * (w // 2)
    elem = torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
    hidden = tokens * cfg["num_attention_heads"] * cfg["attention_head_dim"] * elem
    latent = cfg["in_channels"] * h * w * 4  # fp32, last stage -> stage 0
    flow = cfg["out_channels"] * h * w * elem  # a branch's prediction, swapped between CFG groups
    rows = branches_of(args) if args.cfg_parallel == 1 else 1
    per_group = (args.stages - 1) * rows * hidden + (latent if args.stages > 1 else 0)
    exchange = 2 * flow if args.cfg_parallel == 2 and args.guidance > 1.0 else 0  # both directions
    by_bytes = per_group * (args.cfg_parallel if args.guidance > 1.0 else 1) + exchange
    lasts = [s for s in stages if (s["index"] + 1) % args.stages == 0]
    return {
        "data_plane_bytes_per_micro_step": by_bytes,
        "exchange_bytes_per_micro_step": exchange,
        "wait_ms_per_batch": {s["index"]: s["mean_wait_ms"] for s in stages},
        "exchange_ms_per_batch": max((s["mean_exchange_ms"] for s in lasts), default=0.0),
    }


def capacity_of(rows: list[dict]) -> int | None:
    """The most concurrent streams a load row held with every admitted stream >= 99% on time."""
    held = [r["streams"] - r["refused"] for r in rows if r["all_held"] and not r["failed"] - r["refused"]]
    return max(held) if held else None


# ---- versions -------------------------------------------------------------------------------------------


def versions() -> dict:
    import diffusers

    out = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "diffusers": diffusers.__version__,
        "gpu_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "gpu": gpu_name(),
        "nccl": None,
        "driver": None,
        "torchao": None,
    }
    try:
        from importlib.metadata import version

        out["torchao"] = version("torchao")
    except Exception:  # noqa: BLE001 - not installed: the optional fp8 extra
        pass
    if torch.cuda.is_available():
        try:
            out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # noqa: BLE001 - a build without NCCL
            pass
        try:
            out["driver"] = subprocess.check_output(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], text=True
            ).split()[0]
        except (OSError, subprocess.CalledProcessError):
            pass
    return out


def cuda_mps() -> bool:
    """Whether this run's processes share their GPUs through a CUDA MPS server (their kernels run side by side)
    instead of time-slicing them: a client process finds the server through this variable (gpu_suite.sh's MPS=1)."""
    return bool(os.environ.get("CUDA_MPS_PIPE_DIRECTORY"))


def tree_dirty() -> bool | None:
    if os.environ.get("STAGECAST_DIRTY") is not None:  # the device machine's copy has no .git
        return os.environ["STAGECAST_DIRTY"] == "1"
    try:
        return bool(subprocess.check_output(["git", "status", "--porcelain"], text=True).strip())
    except (OSError, subprocess.CalledProcessError):
        return None


# ---- report ---------------------------------------------------------------------------------------------


def topology(a: dict) -> str:
    """ "2" for a pipeline of 2 stages, "PP=2×SP=2" with sequence-parallel stages, "2" for CFG-parallel 2 x PP=1."""
    sp = a.get("sp", 1)
    return str(a["stages"] * a.get("cfg_parallel", 1)) if sp == 1 else f"PP={a['stages']}×SP={sp}"


def cfg_label(a: dict) -> str:
    """ ", guidance 5, sequential CFG on PP=2" / ", guidance 5, CFG-parallel 2 x PP=1" (empty without guidance)."""
    if a.get("guidance", 1.0) <= 1.0:
        return ""
    if a.get("cfg_parallel", 1) > 1:
        return f", guidance {a['guidance']:g}, CFG-parallel {a['cfg_parallel']} x PP={a['stages']}"
    return f", guidance {a['guidance']:g}, sequential CFG on PP={a['stages']}"


def decoder_label(a: dict) -> str:
    """ ", tiny decoder" for a run whose streams asked for the tiny decoder first (empty for the full VAE)."""
    first = (a.get("decoders") or ["full"])[0]
    return ", tiny decoder" if first == "tiny" else ""


def fp8_label(a: dict) -> str:
    """ ", FP8 blocks" for a run whose stages ran ``--fp8`` (empty otherwise)."""
    return ", FP8 blocks" if a.get("fp8") else ""


def markdown_row(r: dict) -> str:
    s, a = r["system"], r["args"]
    first = s["first_stream"]
    return (
        f"| {a['model']} @ {a['height']}x{a['width']}, {a['steps']} step(s){cfg_label(a)}{fp8_label(a)}"
        f"{decoder_label(a)} | "
        f"{topology(a)} | "
        f"{s['steady_fps']:.1f} | {s['whole_fps']:.1f} | {s['main']['on_time']:.1%} | "
        f"{s['main']['max_gap_ms']:.0f} | {s['main']['gaps_over_250ms']} | "
        f"{first['on_time']:.1%} / {first['max_gap_ms']:.0f} | "
        f"{s['ttff_p50_s'] * 1e3:.0f} / {s['ttff_p95_s'] * 1e3:.0f} | {r['commit']} |"
    )
