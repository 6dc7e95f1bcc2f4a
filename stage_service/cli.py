"""``stagecast stage``: one DiT stage process's flags and entry point."""

from __future__ import annotations

import argparse
import os
import sys

from stagecast.names import DTYPE_NAMES
from stagecast.service import add_security_flags, resolve_transformer, run_service


def add_parser(sub) -> None:
    p = sub.add_parser("stage", help="run one DiT stage", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--index", type=int, default=None, help="stage index (default: $STAGECAST_STAGE_INDEX)")
    p.add_argument("--coordinator", required=True, help="coordinator host:port")
    p.add_argument(
        "--checkpoint", required=True, help="transformer checkpoint folder (or a folder holding transformer/)"
    )
    p.add_argument("--device", default="cpu", help="cpu, cuda (-> cuda:<index %% GPUs>) or cuda:N")
    p.add_argument("--dtype", default="float32", choices=DTYPE_NAMES, help="weights")
    p.add_argument("--host", default="127.0.0.1", help="address to bind")
    p.add_argument("--port", type=int, default=50060, help="gRPC port (0: any free port)")
    p.add_argument("--advertise-host", default=None, help="address the coordinator and peers use for this stage")
    p.add_argument("--expected-stages", type=int, default=0, help="refuse to join a coordinator of another size")
    p.add_argument(
        "--sp",
        type=int,
        default=1,
        help="sequence-parallel ranks of this stage (Ulysses; the coordinator runs the same --sp); this process "
        "registers as rank index * sp + sp-rank",
    )
    p.add_argument(
        "--sp-rank",
        type=int,
        default=None,
        help="this process's rank within its stage's --sp ranks (default: the index is the global rank "
        "stage * sp + sp-rank, as a StatefulSet's pod index is)",
    )
    p.add_argument("--cuda-graphs", action="store_true", help="run the slice's blocks as CUDA graphs (GPU)")
    p.add_argument(
        "--fp8",
        action="store_true",
        help="run the transformer blocks' linear layers in float8 (torchao, rowwise scales; norms, embeddings, head "
        "and attention stay bf16): GPU of compute capability 8.9+, --dtype bfloat16, the fp8 extra; not bit-exact",
    )
    p.add_argument(
        "--calibration-s",
        type=float,
        default=None,
        help="at READY, time this slice's forwards (batch sizes 1..the coordinator's --max-batch, the serving size of "
        "stagecast.json or 832x480, empty and full KV window) for the coordinator's SLO model, for at most this many "
        "seconds (0: skip; the coordinator then learns from measured batches); default: 5 on a GPU, 0 on a CPU (the "
        "processes sharing its cores make a start-up timing say little about serving)",
    )
    p.add_argument(
        "--kv-budget-gib",
        type=float,
        default=0.0,
        help="GiB this stage gives to streams' self-attention KV: the coordinator admits a stream only while every "
        "stage holds the admitted streams' worst-case KV plus its own (0: derive it: on a GPU the memory free after "
        "loading and calibrating less a reserve for activations and graphs; on a CPU no limit)",
    )
    p.add_argument("--metrics-port", type=int, default=0, help="Prometheus port (0: off)")
    p.add_argument(
        "--lora",
        action="append",
        default=[],
        metavar="PATH[:SCALE]",
        help="a LoRA safetensors file (diffusers, PEFT or kohya keys) merged into this stage's layers at load; "
        "repeatable, applied in order",
    )
    add_security_flags(p)
    p.set_defaults(run=main)


def main(args: argparse.Namespace) -> int:
    from stage_service.lora import MAX_LORAS, parse_lora
    from stage_service.server import StageOptions, serve
    from stagecast.security import mtls_from_flags

    index = args.index if args.index is not None else os.environ.get("STAGECAST_STAGE_INDEX")
    if index is None:
        print("stagecast stage: error: stage needs --index or STAGECAST_STAGE_INDEX", file=sys.stderr)
        return 2
    try:
        index = int(index)
    except ValueError:
        print(f"stagecast stage: error: STAGECAST_STAGE_INDEX: not an integer: {index!r}", file=sys.stderr)
        return 2
    if index < 0:
        print(f"stagecast stage: error: --index: must be >= 0, got {index}", file=sys.stderr)
        return 2
    if args.sp < 1:
        print(f"stagecast stage: error: --sp: must be >= 1, got {args.sp}", file=sys.stderr)
        return 2
    if args.sp_rank is not None and not 0 <= args.sp_rank < args.sp:
        print(f"stagecast stage: error: --sp-rank: must be in [0, {args.sp}), got {args.sp_rank}", file=sys.stderr)
        return 2
    if args.sp > 1 and args.cuda_graphs:
        print("stagecast stage: error: --cuda-graphs: not supported with --sp > 1 yet", file=sys.stderr)
        return 2
    if args.calibration_s is not None and not 0 <= args.calibration_s <= 600:
        print(
            f"stagecast stage: error: --calibration-s: must be in [0, 600], got {args.calibration_s}",
            file=sys.stderr,
        )
        return 2
    from stage_service.kv_budget import check_kv_budget_gib

    try:
        check_kv_budget_gib(args.kv_budget_gib)
    except ValueError as exc:
        print(f"stagecast stage: error: {exc}", file=sys.stderr)
        return 2
    if args.sp_rank is not None:
        index = index * args.sp + args.sp_rank  # the rank this process registers as
    try:
        if len(args.lora) > MAX_LORAS:
            raise ValueError(f"--lora: at most {MAX_LORAS} LoRAs, got {len(args.lora)}")
        loras = tuple(parse_lora(text) for text in args.lora)
    except (ValueError, FileNotFoundError) as exc:
        print(f"stagecast stage: error: {exc}", file=sys.stderr)
        return 2
    device = args.device
    if device == "cuda":
        import torch

        device = f"cuda:{index % max(torch.cuda.device_count(), 1)}"
    if args.fp8:
        from stagecast.fp8 import Fp8Unavailable, check_fp8

        try:
            check_fp8(device, args.dtype)  # before any weights are read
        except Fp8Unavailable as exc:
            print(f"stagecast stage: error: {exc}", file=sys.stderr, flush=True)
            return 2
    try:
        mtls = mtls_from_flags(args.mtls, args.insecure_internal, "stagecast stage")
    except (ValueError, FileNotFoundError) as exc:
        print(f"stagecast stage: error: {exc}", file=sys.stderr, flush=True)
        return 2
    options = StageOptions(
        index=index,
        sp=args.sp,
        coordinator=args.coordinator,
        checkpoint=resolve_transformer(args.checkpoint),
        device=device,
        dtype=args.dtype,
        host=args.host,
        port=args.port,
        advertise_host=args.advertise_host,
        expected_world_size=args.expected_stages,
        metrics_port=args.metrics_port,
        cuda_graphs=args.cuda_graphs,
        fp8=args.fp8,
        calibration_s=args.calibration_s,
        kv_budget_gib=args.kv_budget_gib,
        loras=loras,
        mtls=mtls,
        metrics_host=args.metrics_host,
        health_port=args.health_port,
    )
    return run_service("stage", lambda stop: serve(options, stop=stop))
