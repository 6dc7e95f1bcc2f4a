"""``CoordinatorOptions``: the coordinator's options, each field its own ``stagecast coordinator`` flag.

``coordinator.cli`` adds the flags with ``stagecast.flags.add_flags`` and builds the options with ``from_args``;
a launcher writes a coordinator's command line with ``to_argv``.  ``__post_init__`` is the one check of the flags'
values together (a ValueError naming the flag).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from coordinator.slo import GPU_SHARING, MAX_SHARING
from stagecast.flags import flag
from stagecast.microstep import DEFAULT_MAX_BATCH
from stagecast.service import health_port_flag, metrics_host_flag

MAX_LOOKAHEAD = 64  # batches planned ahead of the last stage (--lookahead)

if TYPE_CHECKING:
    from stagecast.security import MTLS


def parse_stage_ms(text: str) -> list[float]:
    """``--stage-ms``: ms per stage forward of one micro-step, comma-separated, one per stage."""
    import argparse

    try:
        return [float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"a comma-separated list of milliseconds, got {text!r}") from None


def parse_vae_ms(text: str) -> dict[str, float]:
    """``--vae-ms-per-chunk``: a number (the full VAE's ms per chunk) or ``KIND=MS[,KIND=MS]``."""
    import argparse

    from coordinator.slo import decoder_kind

    values: dict[str, float] = {}
    try:
        for item in text.split(",") if "=" in text else [f"full={text}"]:
            kind, _, ms = item.partition("=")
            values[decoder_kind(kind.strip())] = float(ms)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"a number of ms or KIND=MS[,KIND=MS] ({exc}), got {text[:80]!r}") from None
    return values


def _vae_ms_text(values: dict[str, float]) -> str:
    return ",".join(f"{kind}={ms:g}" for kind, ms in values.items())


@dataclass
class CoordinatorOptions:
    stages: int = flag(help="number of DiT stages (of one pipeline)", required=True)  # stage processes: x cfg_parallel
    cfg_parallel: int = flag(
        1,
        choices=[1, 2],
        help="CFG-parallel groups: 2 runs two pipelines of --stages stages (indices 0..K-1 and K..2K-1), one per"
        " classifier-free guidance branch, in lockstep",
    )
    partition: str | None = flag(help="layers per stage, e.g. 8,12,12,8 (default: even)")
    sp: int = flag(
        1, help="sequence-parallel ranks per stage (Ulysses): stages × sp stage processes register, as ranks"
    )
    host: str = flag("127.0.0.1", help="address to bind")
    port: int = flag(50050, help="gRPC port (0: any free port)")
    advertise_host: str | None = flag(help="address stages use to reach this coordinator")
    backend: str = flag("auto", choices=["auto", "gloo", "nccl"], help="data plane (auto: nccl on GPU stages)")
    max_batch: int = flag(
        DEFAULT_MAX_BATCH,
        help="the most micro-steps per stage forward (Stream Batch): the stages calibrate and pre-capture 1..this; the "
        "scheduler forms the size their calibration picks within it",
    )
    max_streams: int = flag(16, help="admission limit on concurrent streams")
    playout_s: float = flag(
        0.5,
        help="pacing: a stream with a frame rate starts each chunk at most this many seconds before its real-time slot",
    )
    pace_grid: bool = flag(
        True,
        action="optional",
        help="pacing: paced streams of one chunk rate take their slots on one grid of whole chunk periods, so their "
        "chunks are due together and batch (each stream's slots move up to one chunk period sooner; one H200 held 7-8 "
        "1.3B streams with it, 5-7 without); --no-pace-grid: each stream on slots of its own",
    )
    host_share: float = flag(
        1.0,
        type=float,
        help="SLO controller: the share of its host this pipeline sizes its streams for, in (0, 1] (pipelines that "
        "share one machine's CPU or GPU split it: `stagecast up --pipelines N` on a CPU gives each 1/N)",
    )
    gpu_sharing: float = flag(
        GPU_SHARING,
        type=float,
        help="SLO controller: a stage forward beside the gateway's decoder on one GPU is priced at no less than this "
        "many times its calibration alone (two processes time-slice the GPU; measured 1.16-1.23 on one H200), in "
        "[1, 4]; 1 prices the calibration as measured",
    )
    lookahead: int | None = flag(
        type=int,
        help="pacing: batches planned ahead of the last stage; default one per stage, plus one waiting at the first "
        "while an unpaced stream runs (while every stream is paced, a joining stream's first chunk then waits behind "
        "the batches running only); a number fixes it",
    )
    stage_ms: list[float] | None = flag(
        type=parse_stage_ms,
        help="SLO controller calibration: ms per stage forward of one micro-step, per stage, e.g. 20,21 (from "
        "`stagecast simulate` or a harness run); overrides the stages' own calibration at READY; default: each "
        "stage's calibration, refined by measured batches",
    )
    # SLO controller: each chunk's decode on the busiest stage GPU, the operator's: ms per decoder kind (None, or a
    # kind not named: the gateway's measurement)
    vae_ms_per_chunk: dict[str, float] | None = flag(
        type=parse_vae_ms,
        format=_vae_ms_text,
        help="SLO controller: ms of the busiest stage GPU one chunk's decode takes (the gateway's decoder shares the "
        "stage GPUs), counted per chunk whatever its steps: a number for the full VAE, or KIND=MS per decoder kind "
        "(full=26,tiny=5); overrides what the gateway measures and reports for those kinds (default: the gateway's "
        "measurement; 0 until it reports, or with --slo-fixed)",
    )
    # False: the controller keeps the calibration instead of learning from measured batches
    slo_learn: bool = flag(
        True,
        name="--slo-fixed",
        action="store_false",
        help="the SLO controller keeps the --stage-ms calibration (and --vae-ms-per-chunk, 0 unless given) and ignores "
        "measured batches, the stages' calibrations and the gateway's VAE measurement (tests, what-ifs)",
    )
    record_plan: bool = flag(False, action="store_true", help="keep the plan for GetPlan (selftest)")
    metrics_port: int = flag(0, help="Prometheus port (0: off)")
    metrics_host: str | None = metrics_host_flag()  # None: ``host``
    health_port: int = health_port_flag()
    mtls: MTLS | None = None  # deployment credentials (role "coordinator"); None: plaintext (--insecure-internal)

    def __post_init__(self) -> None:
        if not self.slo_learn and not self.stage_ms:
            raise ValueError("--slo-fixed keeps the --stage-ms calibration: give --stage-ms too")
        if self.stage_ms is not None and (
            len(self.stage_ms) != self.stages or not all(0 < v < 1e5 for v in self.stage_ms)
        ):
            got = ",".join(f"{v:g}" for v in self.stage_ms)
            raise ValueError(f"--stage-ms: {self.stages} values in (0, 100000) ms, one per stage, got {got!r}")
        for kind, ms in (self.vae_ms_per_chunk or {}).items():
            if not 0 <= ms < 1e5 or math.isnan(ms):
                raise ValueError(f"--vae-ms-per-chunk: must be in [0, 100000) ms, got {ms} for {kind}")
        if not 0 < self.host_share <= 1:  # also NaN
            raise ValueError(f"--host-share must be in (0, 1], got {self.host_share}")
        if not 1 <= self.gpu_sharing <= MAX_SHARING:  # also NaN
            raise ValueError(f"--gpu-sharing must be in [1, {MAX_SHARING:g}], got {self.gpu_sharing}")
        if self.lookahead is not None and not 1 <= self.lookahead <= MAX_LOOKAHEAD:
            raise ValueError(f"--lookahead must be in 1..{MAX_LOOKAHEAD} batches, got {self.lookahead}")
        if self.cfg_parallel > 1 and self.sp > 1:
            raise ValueError("--cfg-parallel 2 does not compose with --sp yet (give one of them)")
