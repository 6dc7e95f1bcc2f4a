"""Scheduler simulator: the real StreamBatchScheduler driven against simulated stage times.

Usage::

    stagecast simulate --stages 8 --steps 4 --streams 1 --batch 4 --policy per_level --chunks 64
    report = simulate(SimConfig(stages=8, steps=4)); report.bubble_fraction

The scheduler produces the plan exactly as the coordinator would.  Execution is then simulated event by
event: every stage runs the batches in plan order; a batch starts on stage p when stage p is free and
stage p-1 has sent its output; on stage 0 it also waits for the latents its items need from the last
stage.  A batch of b micro-steps costs ``stage_ms[p] * (1 + growth * (b - 1))`` (small batches are
launch-bound, so ``growth`` is well below 1 on GPUs; measured on an H200).

Sequence parallelism (``--sp S``): each stage is S ranks that run every batch together.  Only the part of a
forward that grows with tokens shrinks: a rank holds 1/S of each item's tokens, so a batch of b costs
``stage_ms[p] * ((1 - growth) + growth * b / S)`` (the same ``growth`` that prices a bigger batch).  Each layer
adds Ulysses' two all-to-alls (q/k/v in, the attention output back), each rank sending
``(S-1)/S`` of its shard, ``4 * b * tokens * dim * bytes * (S-1) / S**2`` bytes per layer, priced at
``a2a_latency_ms`` per collective plus bytes over ``a2a_gbps`` (measure both with ``benchmarks/sp_bench.py``; the
defaults fit the NCCL point-to-point times between two H200s in the design notes: 4.8 MB in 0.06 ms, 48 MB in
0.17 ms).  The last stage gathers the shards once before its head.

Utilization and bubble fraction are measured in steady state: from the moment the first chunk leaves the
pipeline until the last chunk starts (warmup and cooldown excluded).  The report also says why a
configuration cannot keep every stage busy.

``--controller`` asks the SLO controller (``coordinator.slo``) instead: with these stage times, how many streams
at ``--fps`` (one latent frame per chunk) the topology holds and at which steps, as streams arrive one by one
(each may run ``--min-steps`` .. ``--steps``), and where admission refuses.  Each chunk's decode is priced by the
decoder the streams run on (``--decoder``): the full VAE at ``--vae-ms-per-chunk``, the tiny decoder at
``--tiny-ms-per-chunk``, or, for a tiny decoder that decodes several streams in one call, ``--tiny-batch-ms`` (its
per-stream ms at 1, 2, .. streams together).  Each row is checked against this
simulator: the real scheduler, run at that load and those steps, must produce the chunks the streams need
(``simulated`` column)::

    stagecast simulate --controller --stages 2 --stage-ms 20,20 --steps 4 --min-steps 1 --streams 12
    stagecast simulate --controller --stages 1 --stage-ms 20 --steps 1 --streams 16 --decoder tiny \\
        --tiny-batch-ms 6,5,4.5
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, field

from coordinator.scheduler import StreamBatchScheduler
from stagecast.api import DEFAULT_FPS
from stagecast.flags import HelpFormatter
from stagecast.microstep import DEFAULT_MAX_BATCH, MicroStep, StreamSpec
from stagecast.model.parallel import check_gpus
from stagecast.model.partition import even_partition, parse_partition


@dataclass
class SimConfig:
    stages: int = 2
    steps: int = 4
    streams: int = 1
    chunks: int = 64
    batch: int = 4
    policy: str = "per_level"
    stage_ms: list[float] | None = None  # per stage, batch of one; default 10 ms each
    growth: float = 0.05
    comm_ms: float = 0.06
    sp: int = 1  # sequence-parallel ranks per stage
    a2a_gbps: float = 393.0  # all-to-all bandwidth per rank, GB/s (= bytes per microsecond / 1000)
    a2a_latency_ms: float = 0.048  # fixed cost of one collective
    tokens: int = 1560  # per micro-step (one latent frame at 480x832)
    dim: int = 1536  # hidden size (1.3B: 1536, 14B: 5120)
    layers: int = 30  # of the whole model (1.3B: 30, 14B: 40)
    dtype_bytes: int = 2


@dataclass
class SimReport:
    config: dict
    a2a_ms_per_forward: list[float]  # per stage, batch of one: the all-to-alls (and the last stage's gather)
    forward_ms: list[float]  # per stage, batch of one: what one forward costs (with sp > 1: each rank's, a2a included)
    batches: int
    makespan_ms: float
    steady_window_ms: float
    utilization: list[float]
    bubble_fraction: float
    chunks_per_second: float
    mean_batch: float
    chunk_latency_ms: float
    notes: list[str] = field(default_factory=list)


def _specs(cfg: SimConfig) -> list[StreamSpec]:
    ladder = tuple(1000.0 * (cfg.steps - i) / cfg.steps for i in range(cfg.steps))
    return [
        StreamSpec(
            stream_id=i + 1,
            latent_channels=16,
            chunk_frames=1,
            latent_height=60,
            latent_width=104,
            timesteps=ladder,
            policy=cfg.policy,
            num_chunks=cfg.chunks,
        )
        for i in range(cfg.streams)
    ]


class _Costs:
    """A stage forward's modelled time: the stage's ms at batch one, growing with the batch; under ``sp`` > 1 each
    rank's share of the token-proportional part plus Ulysses' all-to-alls (and the last stage's gather)."""

    def __init__(self, cfg: SimConfig, stage_ms: list[float]):
        self.cfg = cfg
        self.stage_ms = stage_ms
        self.layers = even_partition(cfg.layers, cfg.stages)

    def forward(self, p: int, b: int) -> float:
        cfg = self.cfg
        if cfg.sp == 1:
            return self.stage_ms[p] * (1 + cfg.growth * (b - 1))
        return self.stage_ms[p] * ((1 - cfg.growth) + cfg.growth * b / cfg.sp) + self.a2a(p, b)

    def a2a(self, p: int, b: int) -> float:
        cfg = self.cfg
        if cfg.sp == 1:
            return 0.0
        shard_bytes = b * cfg.tokens * cfg.dim * cfg.dtype_bytes / cfg.sp
        per_layer = 2 * cfg.a2a_latency_ms + 4 * shard_bytes * (cfg.sp - 1) / cfg.sp / (cfg.a2a_gbps * 1e6)
        total = self.layers[p] * per_layer
        if p == cfg.stages - 1:  # the shards gathered before the head
            total += cfg.a2a_latency_ms + shard_bytes * (cfg.sp - 1) / (cfg.a2a_gbps * 1e6)
        return total


@dataclass
class _Timeline:
    """The plan replayed on the modelled stages: each stage's busy intervals and each chunk's start and end."""

    free: list[float]
    busy: list[list[tuple[float, float]]]
    chunk_start: dict[tuple[int, int], float]
    chunk_done: dict[tuple[int, int], float]
    last_level0_start: float


def _plan(cfg: SimConfig, specs: list[StreamSpec]) -> list[list[MicroStep]]:
    """The real scheduler's batches for these streams, to the end."""
    sched = StreamBatchScheduler(num_stages=cfg.stages, max_batch=cfg.batch)
    for spec in specs:
        sched.add_stream(spec)
    plan: list[list[MicroStep]] = []
    while sched.active:
        batch = sched.tick()
        if batch:
            plan.append(batch)
    return plan


def _replay(cfg: SimConfig, plan: list[list[MicroStep]], costs: _Costs, levels: int, steps: int) -> _Timeline:
    p_count = cfg.stages
    t = _Timeline([0.0] * p_count, [[] for _ in range(p_count)], {}, {}, 0.0)
    produced: dict[MicroStep, float] = {}  # successor step -> time its input latent reaches stage 0
    for batch in plan:
        t_prev = max((produced[st] for st in batch if st.level > 0), default=0.0)
        for p in range(p_count):
            start = max(t.free[p], t_prev + (cfg.comm_ms if p > 0 else 0.0))
            end = start + costs.forward(p, len(batch))
            t.busy[p].append((start, end))
            t.free[p] = end
            t_prev = end
            if p == 0:
                for st in batch:
                    if st.level == 0:
                        t.chunk_start[(st.stream, st.chunk)] = start
                        t.last_level0_start = max(t.last_level0_start, start)
        for st in batch:
            if st.level + 1 < levels:
                produced[MicroStep(st.stream, st.chunk, st.level + 1)] = t_prev + cfg.comm_ms
            if st.level == steps - 1:
                t.chunk_done[(st.stream, st.chunk)] = t_prev
    return t


def _notes(cfg: SimConfig, stage_ms: list[float], levels: int, window: float, costs: _Costs) -> list[str]:
    """Why this configuration cannot fill the pipeline, where it cannot."""
    p_count = cfg.stages
    notes = []
    slowest = max(stage_ms)
    if max(stage_ms) > min(stage_ms) * 1.05:
        idle = 1 - sum(stage_ms) / (slowest * p_count)
        notes.append(
            f"unbalanced stages: stage {stage_ms.index(slowest)} takes {slowest} ms per batch, so the others idle "
            f"about {idle:.0%} of the time; rebalance the partition by measured time"
        )
    if cfg.policy == "clean" and cfg.streams < p_count:
        notes.append(
            f"clean policy: each stream has one micro-step in flight and its next level waits {p_count} ticks for "
            f"its latent, so {cfg.streams} stream(s) can fill at most {cfg.streams}/{p_count} of the pipeline; "
            f"use per_level or run at least {p_count} streams"
        )
    if cfg.chunks * cfg.streams < 4 * p_count * levels:
        notes.append("too few chunks for a steady state: warmup and cooldown dominate; simulate more chunks")
    if cfg.policy == "per_level" and cfg.batch < levels * cfg.streams:
        notes.append(
            f"batch {cfg.batch} < {levels * cfg.streams} micro-steps per tick: stages stay busy but throughput is "
            f"{cfg.batch}/{levels * cfg.streams} chunk per tick"
        )
    if window <= 0:
        notes.append("no steady state was reached")
    if cfg.sp > 1:
        a2a = max(costs.a2a(p, 1) for p in range(p_count))
        notes.append(
            f"sequence parallel: each stage's {cfg.sp} ranks spend {a2a:.2f} ms per forward of one micro-step "
            f"in all-to-alls ({max(costs.layers)} layers × 2), and only the token-proportional {cfg.growth:.0%} of a "
            "forward shrinks with the shard"
        )
    return notes


def simulate(cfg: SimConfig) -> SimReport:
    p_count = cfg.stages
    stage_ms = cfg.stage_ms or [10.0] * p_count
    if len(stage_ms) != p_count:
        raise ValueError(f"stage_ms has {len(stage_ms)} entries for {p_count} stages")
    if cfg.sp < 1:
        raise ValueError(f"sp must be >= 1, got {cfg.sp}")
    costs = _Costs(cfg, stage_ms)
    specs = _specs(cfg)
    levels, steps = specs[0].levels, specs[0].steps
    plan = _plan(cfg, specs)
    t = _replay(cfg, plan, costs, levels, steps)

    first_done = min(t.chunk_done.values())
    lo, hi = first_done, max(t.last_level0_start, first_done)
    window = hi - lo
    util = [
        sum(max(0.0, min(e, hi) - max(s, lo)) for s, e in t.busy[p]) / window if window > 0 else 0.0
        for p in range(p_count)
    ]
    bubble = 1.0 - sum(util) / p_count if window > 0 else 1.0
    in_window = [k for k, done in t.chunk_done.items() if lo <= done <= hi]
    rate = (len(in_window) / (window / 1e3)) if window > 0 else 0.0
    latency = sum(t.chunk_done[k] - t.chunk_start[k] for k in t.chunk_done) / len(t.chunk_done)
    return SimReport(
        config=asdict(cfg) | {"stage_ms": stage_ms},
        a2a_ms_per_forward=[costs.a2a(p, 1) for p in range(p_count)],
        forward_ms=[costs.forward(p, 1) for p in range(p_count)],
        batches=len(plan),
        makespan_ms=max(t.free),
        steady_window_ms=window,
        utilization=util,
        bubble_fraction=bubble,
        chunks_per_second=rate,
        mean_batch=sum(len(b) for b in plan) / len(plan),
        chunk_latency_ms=latency,
        notes=_notes(cfg, stage_ms, levels, window, costs),
    )


@dataclass
class ControllerRow:
    streams: int
    admitted: bool
    steps: list[int]
    utilization: float
    needed_chunks_per_second: float
    simulated_chunks_per_second: float


def simulate_controller(
    cfg: SimConfig,
    *,
    min_steps: int = 1,
    fps: float = DEFAULT_FPS,
    frames_per_chunk: int = 4,
    vae_ms: float = 0.0,
    decoder: str = "full",
    tiny_ms: float = 0.0,
    tiny_batch_ms: tuple[float, ...] = (),
) -> tuple[list[ControllerRow], dict[int, float]]:
    """Streams on ``decoder`` arrive one by one (up to ``cfg.streams``); the controller admits or refuses each and picks
    steps.  The full VAE costs ``vae_ms`` per chunk; the tiny decoder ``tiny_ms``, or with ``tiny_batch_ms`` the
    per-stream ms at 1..n streams decoding in one call, every stream's chunks decoding together (the best case: the
    live coordinator prices the batch the gateway's calls form, ``DecoderCost.formed_batch``).  Returns the rows and
    the capacity (streams at ``fps`` on ``decoder``) of an empty pipeline per step count."""
    from coordinator.slo import CostModel, DecoderCost, Demand, SloController

    stage_ms = cfg.stage_ms or [10.0] * cfg.stages
    decoders = {
        "full": DecoderCost(vae_ms),
        "tiny": DecoderCost(tiny_ms, tuple(tiny_batch_ms), formed_batch=len(tiny_batch_ms)),
    }
    cost = CostModel(cfg.stages, cfg.batch, seed_ms=stage_ms, growth=cfg.growth, chunk_ms=decoders)
    ctl = SloController(cost)
    rate = fps / frames_per_chunk
    allowed = tuple(range(min_steps, cfg.steps + 1))
    clean = cfg.policy == "clean"
    admitted: list[Demand] = []
    rows = []
    for i in range(1, cfg.streams + 1):
        newcomer = Demand(i, rate, allowed, clean=clean, decoder=decoder)
        ok = ctl.admits(newcomer, admitted)
        if ok:
            admitted.append(newcomer)
            decision = ctl.decide(admitted)
            for d in admitted:
                d.steps = decision[d.stream_id]
        steps = [d.steps for d in admitted]
        # The real scheduler at this load: every stream at the fewest steps chosen (a lower bound on its rate).
        sim = simulate(
            SimConfig(
                stages=cfg.stages,
                steps=min(steps),
                streams=len(admitted),
                chunks=cfg.chunks,
                batch=cfg.batch,
                policy=cfg.policy,
                stage_ms=stage_ms,
                growth=cfg.growth,
                comm_ms=cfg.comm_ms,
            )
        )
        rows.append(
            ControllerRow(
                streams=len(admitted),
                admitted=ok,
                steps=steps,
                utilization=ctl.utilization(admitted) or 0.0,
                needed_chunks_per_second=rate * len(admitted),
                simulated_chunks_per_second=sim.chunks_per_second,
            )
        )
        if not ok:
            break
    capacity = {s: ctl.capacity_streams([], rate, s, clean, decoder=decoder) or 0.0 for s in allowed}
    return rows, capacity


def add_simulate_parser(sub) -> None:
    p = sub.add_parser(
        "simulate",
        help="simulate the scheduler: utilization and bubble fraction",
        formatter_class=HelpFormatter,
    )
    p.add_argument("--stages", type=int, default=2, help="pipeline stages")
    p.add_argument(
        "--steps", type=int, default=None, help="denoising steps per chunk (default 4; with --balance-profile, its own)"
    )
    p.add_argument("--streams", type=int, default=1, help="concurrent streams")
    p.add_argument("--chunks", type=int, default=64, help="chunks per stream")
    p.add_argument("--batch", type=int, default=DEFAULT_MAX_BATCH, help="micro-steps per stage forward (Stream Batch)")
    p.add_argument("--policy", choices=["clean", "per_level"], default="per_level", help="KV policy")
    p.add_argument("--stage-ms", default=None, help="per-stage ms for a batch of one, e.g. 10,10,12")
    p.add_argument("--growth", type=float, default=0.05, help="extra cost per extra micro-step in a batch")
    p.add_argument("--comm-ms", type=float, default=0.06, help="ms to send a batch's hidden states between stages")
    p.add_argument("--sp", type=int, default=1, help="sequence-parallel ranks per stage (Ulysses)")
    p.add_argument("--a2a-gbps", type=float, default=393.0, help="measured all-to-all bandwidth per rank (GB/s)")
    p.add_argument("--a2a-latency-us", type=float, default=48.0, help="measured fixed cost of one collective (µs)")
    p.add_argument("--tokens", type=int, default=1560, help="tokens per micro-step (480x832, one latent frame: 1560)")
    p.add_argument("--dim", type=int, default=1536, help="hidden size (1.3B 1536, 14B 5120)")
    p.add_argument("--layers", type=int, default=30, help="layers of the whole model (1.3B 30, 14B 40)")
    p.add_argument("--gpus", type=int, default=None, help="GPUs the topology must fill exactly (stages × sp)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument(
        "--controller",
        action="store_true",
        help="the SLO controller: streams at --fps arrive until admission refuses; steps in --min-steps..--steps",
    )
    p.add_argument("--min-steps", type=int, default=1, help="--controller: the fewest steps a stream may run")
    p.add_argument(
        "--fps", type=float, default=DEFAULT_FPS, help="--controller: each stream's frame rate (4 frames/chunk)"
    )
    p.add_argument(
        "--vae-ms-per-chunk",
        type=float,
        default=0.0,
        help="--controller: the full VAE's ms per chunk on each stage GPU",
    )
    p.add_argument(
        "--decoder",
        choices=["full", "tiny"],
        default="full",
        help="--controller: the decoder the streams run on (the full VAE or the tiny decoder)",
    )
    p.add_argument(
        "--tiny-ms-per-chunk", type=float, default=0.0, help="--controller: the tiny decoder's ms per chunk, alone"
    )
    p.add_argument(
        "--tiny-batch-ms",
        default=None,
        help="--controller: the tiny decoder's ms per chunk per stream when 1, 2, .. streams decode in one call, e.g. "
        "6,5.2,4.8,4.5 (beyond the last: the last; default: it does not batch)",
    )
    p.add_argument(
        "--balance-profile",
        default=None,
        help="measured ms per chunk of every block and VAE unit (python -m benchmarks.balance): stage times come from"
        " it and the report adds each GPU's DiT + VAE time per chunk",
    )
    p.add_argument(
        "--partition",
        default="auto",
        help="with --balance-profile: layers per stage, e.g. 15,15, or auto (the planner's, with the VAE cut)",
    )
    p.add_argument(
        "--vae-split",
        default=None,
        help="with --balance-profile and a --partition: decoder units where VAE slices "
        "1.. start (default: the best cut for that partition)",
    )
    p.add_argument(
        "--vae-slices",
        type=int,
        default=None,
        help="with --balance-profile: VAE slices, slice j on stage j's GPU (default: one per stage; 0: no VAE)",
    )


def main(args: argparse.Namespace) -> int:
    stage_ms = [float(x) for x in args.stage_ms.split(",")] if args.stage_ms else None
    balance = None
    if args.balance_profile:
        try:
            balance = balance_from_profile(args)
        except ValueError as exc:
            print(f"stagecast simulate: error: {exc}", file=sys.stderr)
            return 2
        stage_ms = balance["stage_ms_batch_of_one"]
        args.steps, args.layers = balance["steps"], balance["layers"]
    args.steps = args.steps or 4
    cfg = SimConfig(
        stages=args.stages,
        steps=args.steps,
        streams=args.streams,
        chunks=args.chunks,
        batch=args.batch,
        policy=args.policy,
        stage_ms=stage_ms,
        growth=args.growth,
        comm_ms=args.comm_ms,
        sp=args.sp,
        a2a_gbps=args.a2a_gbps,
        a2a_latency_ms=args.a2a_latency_us / 1e3,
        tokens=args.tokens,
        dim=args.dim,
        layers=args.layers,
    )
    if args.controller:
        return _controller_main(cfg, args)
    try:
        if args.gpus is not None:
            check_gpus(args.stages, args.sp, args.gpus)
        rep = simulate(cfg)
    except ValueError as exc:
        print(f"stagecast simulate: error: {exc}", file=sys.stderr)
        return 2
    if balance is not None:
        # Stage times differ on purpose when the VAE slices load the GPUs unevenly: the GPUs are what is balanced.
        rep.notes = [n for n in rep.notes if not n.startswith("unbalanced stages")]
        gpu_bound = 1e3 / balance["bottleneck_ms"] if balance["bottleneck_ms"] > 0 else float("inf")
        balance["gpu_bound_chunks_per_second"] = gpu_bound
        balance["predicted_chunks_per_second"] = min(rep.chunks_per_second, gpu_bound)
    if args.json:
        print(json.dumps(asdict(rep) | ({"balance": balance} if balance else {}), indent=2))
        return 0
    print(
        f"stages={cfg.stages} sp={cfg.sp} steps={cfg.steps} streams={cfg.streams} batch={cfg.batch} policy={cfg.policy}"
    )
    print(f"batches={rep.batches} mean batch={rep.mean_batch:.2f} makespan={rep.makespan_ms:.1f} ms")
    print("utilization per stage: " + " ".join(f"{u:.1%}" for u in rep.utilization))
    print(f"steady-state bubble fraction: {rep.bubble_fraction:.1%}")
    print(f"throughput: {rep.chunks_per_second:.1f} chunks/s, mean chunk latency {rep.chunk_latency_ms:.1f} ms")
    if cfg.sp > 1:
        print("all-to-all per forward (batch of one): " + " ".join(f"{a:.2f} ms" for a in rep.a2a_ms_per_forward))
    for note in rep.notes:
        print(f"note: {note}")
    if balance is not None:
        for line in balance["lines"]:
            print(line)
        print(
            f"each GPU carries its stage and its VAE slices: at most {balance['gpu_bound_chunks_per_second']:.1f} "
            f"chunks/s; predicted {balance['predicted_chunks_per_second']:.1f} chunks/s "
            f"({4 * balance['predicted_chunks_per_second']:.1f} FPS at 4 frames per latent frame)"
        )
    return 0


def balance_from_profile(args: argparse.Namespace) -> dict:
    """Stage times and per-GPU DiT + VAE times from a balance profile (stage k and VAE slice k on GPU k), for the
    partition asked for (or the planner's), beside the even partition with its best VAE cut."""
    from stagecast.model.balance import evaluate, plan_balance
    from stagecast.model.balance_profile import BalanceProfile

    profile = BalanceProfile.load(args.balance_profile)
    if args.steps is not None and args.steps != profile.steps:
        raise ValueError(f"--steps {args.steps}: {profile.source} was measured at steps {profile.steps}")
    if args.sp != 1:
        raise ValueError("--balance-profile: not with --sp (the profile times whole-sequence stages)")
    costs = profile.costs()
    gpus = [f"cuda:{k}" for k in range(args.stages)]
    slices = args.stages if args.vae_slices is None else args.vae_slices
    if not 0 <= slices <= args.stages:
        raise ValueError(f"--vae-slices: 0..{args.stages} (one per stage GPU at most), got {slices}")
    vae = gpus[:slices]
    n = len(profile.blocks_ms)
    if args.partition == "auto":
        if args.vae_split:
            raise ValueError("--vae-split: with --partition auto the VAE cut is the planner's (give one of them)")
        plan = plan_balance(costs, gpus, vae)
    else:
        counts = parse_partition(args.partition, n, args.stages)
        if args.vae_split:
            try:
                split = [int(x) for x in args.vae_split.split(",")]
            except ValueError:
                raise ValueError(f"--vae-split: comma-separated unit indices, got {args.vae_split!r}") from None
            plan = evaluate(costs, counts, split, gpus, vae)
        else:
            plan = plan_balance(costs, gpus, vae, counts=counts)
    even = plan_balance(costs, gpus, vae, counts=even_partition(n, args.stages))
    lines = []
    for label, p in (("even", even), ("chosen", plan)):
        lines.append(
            f"{label}: {p.flags()}: DiT + VAE ms per chunk per GPU {p.gpu_ms_text()} "
            f"(bottleneck {p.bottleneck_ms:.2f} ms)"
        )
    # The profile's stage times are one forward of ``batch`` micro-steps; the scheduler prices a batch of one.
    scale = 1 + args.growth * (profile.batch - 1)
    return {
        "profile": str(args.balance_profile),
        "steps": profile.steps,
        "layers": n,
        "partition": plan.partition,
        "vae_split": plan.vae_split,
        "stage_ms_batch_of_one": [ms / scale for ms in plan.stage_ms],
        "gpu_ms": plan.gpu_ms,
        "bottleneck_ms": plan.bottleneck_ms,
        "even": {
            "partition": even.partition,
            "vae_split": even.vae_split,
            "gpu_ms": even.gpu_ms,
            "bottleneck_ms": even.bottleneck_ms,
        },
        "lines": lines,
    }


def _controller_main(cfg: SimConfig, args: argparse.Namespace) -> int:
    from coordinator.slo import MAX_DECODE_BATCH

    if not 1 <= args.min_steps <= cfg.steps:
        print(f"stagecast simulate: error: --min-steps must be in [1, --steps={cfg.steps}]")
        return 2
    if not 0 < args.fps <= 240:
        print("stagecast simulate: error: --fps must be in (0, 240]")
        return 2
    if not 0 <= args.vae_ms_per_chunk < 1e5:
        print("stagecast simulate: error: --vae-ms-per-chunk must be in [0, 100000)")
        return 2
    if not 0 <= args.tiny_ms_per_chunk < 1e5:
        print("stagecast simulate: error: --tiny-ms-per-chunk must be in [0, 100000)")
        return 2
    try:
        batch = tuple(float(x) for x in args.tiny_batch_ms.split(",")) if args.tiny_batch_ms else ()
    except ValueError:
        batch = (float("nan"),)
    if len(batch) > MAX_DECODE_BATCH or not all(0 <= ms < 1e5 for ms in batch):
        print(f"stagecast simulate: error: --tiny-batch-ms: at most {MAX_DECODE_BATCH} ms values in [0, 100000)")
        return 2
    rows, capacity = simulate_controller(
        cfg,
        min_steps=args.min_steps,
        fps=args.fps,
        vae_ms=args.vae_ms_per_chunk,
        decoder=args.decoder,
        tiny_ms=args.tiny_ms_per_chunk,
        tiny_batch_ms=batch,
    )
    if args.json:
        print(json.dumps({"rows": [asdict(r) for r in rows], "capacity": capacity}, indent=2))
        return 0
    stage_ms = cfg.stage_ms or [10.0] * cfg.stages
    print(
        f"stages={cfg.stages} stage_ms={','.join(f'{m:g}' for m in stage_ms)} batch={cfg.batch} "
        f"policy={cfg.policy} fps={args.fps:g} steps={args.min_steps}..{cfg.steps} decoder={args.decoder}"
    )
    print(
        "capacity of an empty pipeline (streams held at the fps): "
        + ", ".join(f"{n:.1f} at {s} step{'s' if s > 1 else ''}" for s, n in capacity.items())
    )
    print(f"{'streams':>7}  {'admitted':>8}  {'utilization':>11}  {'chunks/s needed':>15}  {'simulated':>9}  steps")
    for r in rows:
        held = "" if r.simulated_chunks_per_second >= r.needed_chunks_per_second else "  (scheduler falls short)"
        print(
            f"{r.streams + (0 if r.admitted else 1):>7}  {'yes' if r.admitted else 'REFUSED':>8}  "
            f"{r.utilization:>11.0%}  {r.needed_chunks_per_second:>15.1f}  {r.simulated_chunks_per_second:>9.1f}  "
            f"{','.join(map(str, r.steps))}{held}"
        )
    return 0
