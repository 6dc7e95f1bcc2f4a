"""``stagecast stage``: one DiT stage process's entry point.

Its flags are ``StageOptions``' fields (``stage_service.options``); ``main`` checks them and settles what the command
line leaves open before the stage starts.
"""

from __future__ import annotations

import argparse
import os
import sys

from stage_service.options import StageOptions
from stagecast.flags import HelpFormatter, add_flags, from_args
from stagecast.service import add_security_flags, resolve_transformer, run_service


def add_parser(sub) -> None:
    p = sub.add_parser("stage", help="run one DiT stage", formatter_class=HelpFormatter)
    add_flags(p, StageOptions)
    add_security_flags(p)
    p.set_defaults(run=main)


def main(args: argparse.Namespace) -> int:
    from stage_service.lora import MAX_LORAS, parse_lora
    from stage_service.server import serve
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
        if len(args.loras) > MAX_LORAS:
            raise ValueError(f"--lora: at most {MAX_LORAS} LoRAs, got {len(args.loras)}")
        loras = tuple(parse_lora(text) for text in args.loras)
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
    options = from_args(
        StageOptions,
        args,
        index=index,
        sp_rank=None,  # folded into the index: the rank this process registers as
        checkpoint=resolve_transformer(args.checkpoint),
        device=device,
        loras=loras,
        mtls=mtls,
    )
    return run_service("stage", lambda stop: serve(options, stop=stop))
