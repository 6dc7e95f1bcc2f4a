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


def _stage_index(args: argparse.Namespace) -> int:
    """The rank this process registers as, from ``--index`` or ``STAGECAST_STAGE_INDEX`` (and ``--sp-rank``), with
    every flag ``main`` checks before loading anything; ValueError names the flag."""
    from stage_service.kv_budget import check_device_memory_gib, check_kv_budget_gib

    index = args.index if args.index is not None else os.environ.get("STAGECAST_STAGE_INDEX")
    if index is None:
        raise ValueError("stage needs --index or STAGECAST_STAGE_INDEX")
    try:
        index = int(index)
    except ValueError:
        raise ValueError(f"STAGECAST_STAGE_INDEX: not an integer: {index!r}") from None
    if index < 0:
        raise ValueError(f"--index: must be >= 0, got {index}")
    if args.sp < 1:
        raise ValueError(f"--sp: must be >= 1, got {args.sp}")
    if args.sp_rank is not None and not 0 <= args.sp_rank < args.sp:
        raise ValueError(f"--sp-rank: must be in [0, {args.sp}), got {args.sp_rank}")
    if args.sp > 1 and args.cuda_graphs:
        raise ValueError("--cuda-graphs: not supported with --sp > 1 yet")
    if args.calibration_s is not None and not 0 <= args.calibration_s <= 600:
        raise ValueError(f"--calibration-s: must be in [0, 600], got {args.calibration_s}")
    check_kv_budget_gib(args.kv_budget_gib)
    check_device_memory_gib(args.device_memory_gib)
    if args.sp_rank is not None:
        index = index * args.sp + args.sp_rank  # the rank this process registers as
    return index


def main(args: argparse.Namespace) -> int:
    from stage_service.lora import MAX_LORAS, parse_lora
    from stage_service.server import serve
    from stagecast.security import mtls_from_flags

    try:
        index = _stage_index(args)
    except ValueError as exc:
        print(f"stagecast stage: error: {exc}", file=sys.stderr)
        return 2
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
