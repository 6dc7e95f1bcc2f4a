"""``stagecast coordinator`` and ``stagecast simulate``: the coordinator's own flags and entry points."""

from __future__ import annotations

import argparse

from stagecast.microstep import DEFAULT_MAX_BATCH
from stagecast.service import add_security_flags, run_service


def add_parser(sub) -> None:
    p = sub.add_parser(
        "coordinator",
        help="run the coordinator (registry, scheduler, the stages' rendezvous store)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--stages", type=int, required=True, help="number of DiT stages (of one pipeline)")
    p.add_argument(
        "--cfg-parallel",
        type=int,
        choices=[1, 2],
        default=1,
        help="CFG-parallel groups: 2 runs two pipelines of --stages stages (indices 0..K-1 and K..2K-1), one per"
        " classifier-free guidance branch, in lockstep",
    )
    p.add_argument("--partition", default=None, help="layers per stage, e.g. 8,12,12,8 (default: even)")
    p.add_argument(
        "--sp",
        type=int,
        default=1,
        help="sequence-parallel ranks per stage (Ulysses): stages × sp stage processes register, as ranks",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind")
    p.add_argument("--port", type=int, default=50050, help="gRPC port (0: any free port)")
    p.add_argument("--advertise-host", default=None, help="address stages use to reach this coordinator")
    p.add_argument(
        "--backend", choices=["auto", "gloo", "nccl"], default="auto", help="data plane (auto: nccl on GPU stages)"
    )
    p.add_argument(
        "--max-batch", type=int, default=DEFAULT_MAX_BATCH, help="micro-steps per stage forward (Stream Batch)"
    )
    p.add_argument("--max-streams", type=int, default=16, help="admission limit on concurrent streams")
    p.add_argument(
        "--playout-s",
        type=float,
        default=0.5,
        help="pacing: a stream with a frame rate starts each chunk at most this many seconds before its real-time slot",
    )
    p.add_argument(
        "--stage-ms",
        default=None,
        help="SLO controller calibration: ms per stage forward of one micro-step, per stage, e.g. 20,21 (from "
        "`stagecast simulate` or a harness run); overrides the stages' own calibration at READY; default: each "
        "stage's calibration, refined by measured batches",
    )
    p.add_argument(
        "--vae-ms-per-chunk",
        default=None,
        help="SLO controller: ms of the busiest stage GPU one chunk's decode takes (the gateway's decoder shares the "
        "stage GPUs), counted per chunk whatever its steps: a number for the full VAE, or KIND=MS per decoder kind "
        "(full=26,tiny=5); overrides what the gateway measures and reports for those kinds (default: the gateway's "
        "measurement; 0 until it reports, or with --slo-fixed)",
    )
    p.add_argument(
        "--slo-fixed",
        action="store_true",
        help="the SLO controller keeps the --stage-ms calibration (and --vae-ms-per-chunk, 0 unless given) and ignores "
        "measured batches, the stages' calibrations and the gateway's VAE measurement (tests, what-ifs)",
    )
    p.add_argument("--record-plan", action="store_true", help="keep the plan for GetPlan (selftest)")
    p.add_argument("--metrics-port", type=int, default=0, help="Prometheus port (0: off)")
    add_security_flags(p)
    p.set_defaults(run=main)


def main(args: argparse.Namespace) -> int:
    import sys

    from coordinator.server import serve
    from stagecast.security import mtls_from_flags

    if args.cfg_parallel > 1 and args.sp > 1:
        print(
            "stagecast coordinator: --cfg-parallel 2 does not compose with --sp yet (give one of them)", file=sys.stderr
        )
        return 2

    def start(stop) -> None:
        options = _options(args, mtls_from_flags(args.mtls, args.insecure_internal, "stagecast coordinator"))
        serve(options, stop=stop)

    return run_service("coordinator", start)


def _options(args: argparse.Namespace, mtls):
    from coordinator.server import CoordinatorOptions

    if args.slo_fixed and not args.stage_ms:
        raise SystemExit("--slo-fixed keeps the --stage-ms calibration: give --stage-ms too")

    return CoordinatorOptions(
        stages=args.stages,
        cfg_parallel=args.cfg_parallel,
        partition=args.partition,
        sp=args.sp,
        host=args.host,
        port=args.port,
        advertise_host=args.advertise_host,
        backend="" if args.backend == "auto" else args.backend,
        max_batch=args.max_batch,
        max_streams=args.max_streams,
        record_plan=args.record_plan,
        playout_s=args.playout_s,
        stage_ms=_stage_ms(args.stage_ms, args.stages),
        slo_learn=not args.slo_fixed,
        vae_ms_per_chunk=_vae_ms(args.vae_ms_per_chunk),
        metrics_port=args.metrics_port,
        mtls=mtls,
        metrics_host=args.metrics_host,
        health_port=args.health_port,
    )


def _vae_ms(text: str | None) -> dict[str, float] | None:
    """``--vae-ms-per-chunk``: a number (the full VAE's ms per chunk) or ``KIND=MS[,KIND=MS]``."""
    from coordinator.slo import decoder_kind

    if text is None:
        return None
    values: dict[str, float] = {}
    try:
        for item in text.split(",") if "=" in text else [f"full={text}"]:
            kind, _, ms = item.partition("=")
            values[decoder_kind(kind.strip())] = float(ms)
    except ValueError as exc:
        what = f"a number of ms or KIND=MS[,KIND=MS] ({exc}), got {text[:80]!r}"
        raise SystemExit(f"--vae-ms-per-chunk: {what}") from None
    for kind, ms in values.items():
        if not 0 <= ms < 1e5:  # NaN too
            raise SystemExit(f"--vae-ms-per-chunk: must be in [0, 100000) ms, got {ms} for {kind}")
    return values


def _stage_ms(text: str | None, stages: int) -> list[float] | None:
    if not text:
        return None
    try:
        values = [float(x) for x in text.split(",")]
    except ValueError:
        raise SystemExit(f"--stage-ms: a comma-separated list of milliseconds, got {text!r}") from None
    if len(values) != stages or not all(0 < v < 1e5 for v in values):
        raise SystemExit(f"--stage-ms: {stages} values in (0, 100000) ms, one per stage, got {text!r}")
    return values


def add_simulate_parser(sub) -> None:
    from coordinator import simulator

    simulator.add_simulate_parser(sub)
    sub.choices["simulate"].set_defaults(run=simulator.main)
