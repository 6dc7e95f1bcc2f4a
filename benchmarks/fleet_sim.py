"""A fleet of pipelines behind the door, simulated past this machine: pure Python, deterministic for a seed.

Usage::

    python -m benchmarks.fleet_sim --out benchmarks/results/fleet_sim.json       # 100 pipelines, loads 50-120%
    python -m benchmarks.fleet_sim --table benchmarks/results/fleet_sim.json     # BENCHMARKS.md's table, from the JSON
    python -m benchmarks.fleet_sim --table benchmarks/results/fleet_sim.json --into BENCHMARKS.md   # ... written there
    python -m benchmarks.fleet_sim --pipelines 20 --loads 0.9 --seconds 600 --out /tmp/f.json   # a smaller run

What each pipeline can take is the coordinator's own arithmetic: a ``coordinator.slo.SloController`` over a
``CostModel`` whose micro-step time is set so that an empty pipeline holds the measured capacity (BENCHMARKS.md: 7
paced 1.3B streams per H200 by default, 8 with ``--pace-grid`` and the fused levers), and free slots are its dry run
(``coordinator.slots.free_slots``: newcomers of the public defaults added until ``admits`` refuses).  Every stream
here is of the public defaults, so a pipeline's free slots depend only on how many it holds: ``slots_table``.

Viewers arrive as a Poisson process at a share of the fleet's capacity, for lognormal session lengths (median 60 s,
sigma ``SIGMA``); a refused viewer retries after the coordinator's ``RETRY_AFTER_S`` until ``PATIENCE_S`` has passed.
Three policies pick a pipeline for a new stream:

- ``round-robin``: HAProxy ``balance roundrobin`` with equal weights and no caps;
- ``least-connections``: ``balance leastconn``, equal weights, no caps;
- ``agent``: the door (``launcher/door.py``'s template), as HAProxy runs it: each pipeline's agent is asked every
  ``AGENT_INTERVAL_S`` (phases spread) and its answer is ``gateway.edge.agent.agent_reply``'s, the gateway's own:
  weight =
  free slots in % of its slots and ``maxconn`` = the streams it holds through the door plus its free slots, and for a
  full pipeline weight 1% capped at its streams; the capped ``grpc`` backend picks by smooth weighted round-robin among
  servers below their maxconn (HAProxy counts only that backend's connections); when its free connections
  (``be_conn_free``) are none, the uncapped ``overflow`` backend takes the stream round-robin and the pipeline refuses
  it itself.  The weights are as old as the last check: not an oracle;
- ``agent-zero``: the same door with the reply the gateway gave before, weight 0% for a full pipeline: a slot freed
  since the last check is then out of the door's choice for up to an agent interval, which at saturation sends the
  streams that could have had it to the overflow route (kept to show why the gateway answers 1%).

A refusal "while room existed" is one answered while another ready pipeline had a free slot.  With ``--autoscale`` the
pipeline count follows KEDA and the HPA as the chart sets them up (``helm/stagecast/values.yaml``): every
``POLL_S`` the metric busy / (busy + free) over ready pipelines, desired = ceil(replicas x metric / target) outside the
10% tolerance, a scale-down stabilisation window (the highest recommendation of the window), scale-up at once; a new
pipeline is READY ``READY_S`` after it is asked for (the measured time to READY; pod scheduling and image pulls not
counted); scale-in removes the highest index, which drains: no new streams, its streams run up to ``DRAIN_S``, the
rest are cut and reconnect at once (the SDK's ``reconnect=True``) for their remaining seconds.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import sys
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path

from coordinator.admission import RETRY_AFTER_S
from coordinator.slo import CostModel, Demand, SloController
from gateway.edge.agent import PipelineSlots, agent_reply
from stagecast.api import DEFAULT_FPS

CAPACITIES = (7, 8)  # held per H200 (BENCHMARKS.md, Capacity): default flags, --pace-grid + fused levers
READY_S = 105.1  # time to READY, 1.3B 832x480 1 step with the tiny decoder on one H200 (BENCHMARKS.md, Cold start)
CHUNK_RATE = DEFAULT_FPS / 4  # chunks per second of a paced stream of the public defaults (4 frames per chunk)
MEDIAN_S = 60.0  # median session length
SIGMA = 0.8  # the lognormal's sigma: mean = median x exp(sigma^2 / 2), about 82.6 s
PATIENCE_S = 60.0  # a refused viewer retries every RETRY_AFTER_S for this long, then leaves
AGENT_INTERVAL_S = 1.0  # the door's agent-check interval (launcher/door.py)
TICKS_PER_INTERVAL = 10  # agent checks spread over ten phases per interval
POLL_S = 15.0  # KEDA's pollingInterval (and the HPA's sync period)
TOLERANCE = 0.10  # the HPA's tolerance: the hysteresis
DRAIN_S = 30.0  # fleet.drainSeconds
POLICIES = ("round-robin", "least-connections", "agent", "agent-zero")

TABLE_BEGIN, TABLE_END = "<!-- fleet_sim:table -->", "<!-- fleet_sim:table end -->"  # inside BENCHMARKS.md's section


def slots_table(capacity: int) -> list[int]:
    """Free slots of a pipeline holding n streams (index n), from the coordinator's own admission: a ``SloController``
    whose seed stage time makes an empty pipeline hold ``capacity`` streams, dry-run as ``coordinator.slots`` does."""
    lo, hi = 1.0, 1000.0  # ms per forward: lo admits more than capacity, hi fewer
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _dry_run(mid, 0) > capacity else (lo, mid)
    upper = hi  # the fastest stage time that holds exactly `capacity`
    lo, hi = upper, 1000.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _dry_run(mid, 0) >= capacity else (lo, mid)
    ms = (upper + lo) / 2  # the middle of the stage times that hold `capacity`
    table = [_dry_run(ms, n) for n in range(capacity + 1)]
    if table[0] != capacity:
        raise ValueError(f"capacity {capacity}: the cost model holds {table[0]}")
    return table


def _dry_run(stage_ms: float, held: int) -> int:
    ctl = SloController(CostModel(1, 4, seed_ms=[stage_ms]))
    admitted = [Demand(i, CHUNK_RATE, (1,), decoder="tiny") for i in range(held)]
    free = 0
    while free < 64 and ctl.admits(Demand(held + free, CHUNK_RATE, (1,), decoder="tiny"), admitted):
        admitted.append(Demand(held + free, CHUNK_RATE, (1,), decoder="tiny"))
        free += 1
    return free


@dataclass
class Pipeline:
    index: int
    table: list[int]
    ready_at: float = 0.0
    created: float = 0.0
    draining: bool = False
    held: int = 0
    grpc_conns: int = 0  # streams that came through the capped backend (HAProxy counts per backend)
    weight: int = 0  # the door's view, from the last agent check
    maxconn: int = 0
    current: float = 0.0  # smooth weighted round-robin's running score
    phase: int = 0  # which tenth of the agent interval its check falls in
    streams: dict = field(default_factory=dict)  # id(session) -> session

    @property
    def capacity(self) -> int:
        return self.table[0]

    @property
    def free(self) -> int:
        return self.table[self.held] if self.held < len(self.table) else 0

    def ready(self, now: float) -> bool:
        return now >= self.ready_at and not self.draining


def door_view(p: Pipeline, now: float) -> tuple[int, int]:
    """The weight and maxconn the door takes from the pipeline's agent: ``gateway.edge.agent.agent_reply`` itself (every
    stream here comes through the door); ``drain`` and ``down`` weigh 0."""
    slots = PipelineSlots(ready=now >= p.ready_at, free=p.free, total=p.capacity)
    reply = agent_reply(slots, draining=p.draining, streams=p.held, backend="grpc").split()
    if reply[0] != "up":
        return 0, p.maxconn
    weight = next(int(w[:-1]) for w in reply if w.endswith("%"))
    return weight, next(int(w.split(":")[1]) for w in reply if w.startswith("maxconn:"))


@dataclass
class Session:
    arrival: float
    length: float
    via_grpc: bool = False
    pipeline: int = -1
    refused: bool = False
    refused_with_room: bool = False
    admitted_at: float | None = None
    ends_at: float = 0.0


@dataclass
class Result:
    policy: str
    load: float
    autoscale: bool
    sessions: int
    refused_pct: float
    refused_while_room_pct: float
    abandoned_pct: float
    utilisation: float
    p95_admission_s: float
    gpu_hours: float
    mean_pipelines: float
    cut_by_scale_in: int


@dataclass
class Fleet:
    policy: str
    pipelines: list[Pipeline]
    rr: int = 0
    overflow_rr: int = 0

    def live(self, now: float) -> list[Pipeline]:
        return [p for p in self.pipelines if p.ready(now)]

    def pick(self, now: float) -> tuple[Pipeline | None, bool]:
        """The pipeline a new stream is sent to, and whether through the capped backend."""
        live = self.live(now)
        if not live:
            return None, False
        if self.policy == "round-robin":
            self.rr = (self.rr + 1) % len(live)
            return live[self.rr], False
        if self.policy == "least-connections":
            least = min(p.held for p in live)
            ties = [p for p in live if p.held == least]
            self.rr = (self.rr + 1) % len(ties)
            return ties[self.rr], False
        usable = [p for p in live if p.weight > 0 and p.grpc_conns < p.maxconn]
        if not usable:  # be_conn_free(grpc) le 0: the overflow route, every pipeline at 100%
            self.overflow_rr = (self.overflow_rr + 1) % len(live)
            return live[self.overflow_rr], False
        total = sum(p.weight for p in usable)
        for p in usable:
            p.current += p.weight
        best = max(usable, key=lambda p: p.current)
        best.current -= total
        return best, True


def arrivals(rng: random.Random, rate: float, seconds: float) -> list[tuple[float, float]]:
    out, t = [], 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= seconds:
            return out
        out.append((t, rng.lognormvariate(math.log(MEDIAN_S), SIGMA)))


@dataclass
class Autoscaler:
    target: float = 0.75
    min_pipelines: int = 1
    max_pipelines: int = 100
    window_s: float = 300.0  # scaleDownStabilizationSeconds
    history: deque = field(default_factory=deque)

    def desired(self, now: float, replicas: int, busy: int, free: int) -> int:
        want = replicas
        if busy + free > 0:
            ratio = busy / (busy + free) / self.target
            if abs(ratio - 1) > TOLERANCE:
                want = math.ceil(replicas * ratio)
        want = max(self.min_pipelines, min(self.max_pipelines, want))
        self.history.append((now, want))
        while self.history and self.history[0][0] < now - self.window_s:
            self.history.popleft()
        if want < replicas:  # scale-down: the highest recommendation of the window
            return min(replicas, max(w for _, w in self.history))
        return want


def run(
    policy: str,
    load: float,
    *,
    pipelines: int = 100,
    seconds: float = 3600.0,
    warmup: float = 600.0,
    seed: int = 1,
    autoscaler: Autoscaler | None = None,
) -> Result:
    """One run: ``pipelines`` pipelines (alternating CAPACITIES), arrivals at ``load`` of their capacity."""
    return _Run(policy, load, pipelines, seconds, warmup, seed, autoscaler).result()


class _Run:
    """One run's event loop: the viewers' tries, the streams' ends, the agent checks, the autoscaler's polls and the
    drains, each event handled by its own method; the areas under busy, capacity and GPUs accrue between events."""

    def __init__(self, policy, load, pipelines, seconds, warmup, seed, autoscaler):
        self.policy, self.load, self.seconds, self.warmup, self.autoscaler = policy, load, seconds, warmup, autoscaler
        self.tables = {c: slots_table(c) for c in CAPACITIES}
        capacity = sum(CAPACITIES[i % len(CAPACITIES)] for i in range(pipelines))
        mean_s = MEDIAN_S * math.exp(SIGMA**2 / 2)
        self.horizon = warmup + seconds
        trace = arrivals(random.Random(f"{seed}:{load}"), load * capacity / mean_s, self.horizon)
        self.phases = random.Random(f"{seed}:phases")
        start = min(pipelines, autoscaler.max_pipelines) if autoscaler else pipelines
        self.fleet = Fleet(policy, [self.new_pipeline(i, 0.0, 0.0) for i in range(start)])
        self.sessions: list[Session] = []
        self.events: list[tuple[float, int, str, object]] = []
        self.seq = 0
        for t, length in trace:
            s = Session(t, length)
            self.sessions.append(s)
            self.push(t, "try", s)
        for k in range(int(self.horizon * TICKS_PER_INTERVAL / AGENT_INTERVAL_S) + 1):
            self.push(k * AGENT_INTERVAL_S / TICKS_PER_INTERVAL, "agent", k % TICKS_PER_INTERVAL)
        if autoscaler:
            for k in range(1, int(self.horizon / POLL_S) + 1):
                self.push(k * POLL_S, "scale", None)
        self.busy_area = self.cap_area = self.gpu_area = 0.0
        self.last = 0.0
        self.cut = 0

    def new_pipeline(self, i: int, now: float, ready_at: float) -> Pipeline:
        table = self.tables[CAPACITIES[i % len(CAPACITIES)]]
        return Pipeline(i, table, ready_at=ready_at, created=now, phase=self.phases.randrange(TICKS_PER_INTERVAL))

    def push(self, t: float, kind: str, what: object) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, what))

    def loop(self) -> None:
        handlers = {
            "agent": self.on_agent,
            "try": self.on_try,
            "end": self.on_end,
            "drained": self.on_drained,
            "scale": self.on_scale,
        }
        while self.events:
            now, _, kind, what = heapq.heappop(self.events)
            if now > self.horizon:
                break
            self.accrue(now)
            handlers[kind](now, what)

    def accrue(self, now: float) -> None:
        if now > self.warmup:
            span = now - max(self.last, self.warmup)
            serving = [p for p in self.fleet.pipelines if now >= p.ready_at]  # ready, or draining
            self.busy_area += span * sum(p.held for p in serving)
            self.cap_area += span * sum(p.capacity for p in serving)
            self.gpu_area += span * len(self.fleet.pipelines)
        self.last = now

    def on_agent(self, now: float, phase) -> None:
        for p in self.fleet.pipelines:
            if p.phase == phase:
                p.weight, p.maxconn = door_view(p, now)
                if self.policy == "agent-zero" and p.free <= 0:
                    p.weight = 0

    def on_try(self, now: float, s) -> None:
        p, via_grpc = self.fleet.pick(now)
        if p is not None and p.free > 0:
            p.held += 1
            p.grpc_conns += via_grpc
            p.streams[id(s)] = s
            s.pipeline, s.via_grpc, s.admitted_at = p.index, via_grpc, now
            s.ends_at = now + s.length
            self.push(s.ends_at, "end", (p, s))
            return
        s.refused = True
        if any(q.free > 0 for q in self.fleet.live(now) if q is not p):
            s.refused_with_room = True
        if now + RETRY_AFTER_S <= s.arrival + PATIENCE_S:
            self.push(now + RETRY_AFTER_S, "try", s)

    def on_end(self, now: float, what) -> None:
        p, s = what
        if id(s) in p.streams and s.ends_at == now:
            self.end_stream(p, s)

    def end_stream(self, p: Pipeline, s: Session) -> None:
        p.held -= 1
        p.grpc_conns -= s.via_grpc
        p.streams.pop(id(s), None)
        if p.draining and p.held == 0 and p in self.fleet.pipelines:  # drained early: its GPU goes at once
            self.fleet.pipelines.remove(p)

    def on_drained(self, now: float, p) -> None:
        if p not in self.fleet.pipelines:
            return  # its streams ended before the drain deadline
        for s in list(p.streams.values()):
            self.end_stream(p, s)
            self.cut += 1
            s2 = Session(now, s.ends_at - now)  # the SDK's reconnect: the remaining seconds, through the door
            self.sessions.append(s2)
            self.push(now, "try", s2)
        if p in self.fleet.pipelines:
            self.fleet.pipelines.remove(p)

    def on_scale(self, now: float, _) -> None:
        assert self.autoscaler is not None
        fleet = self.fleet
        live = fleet.live(now)
        replicas = len([p for p in fleet.pipelines if not p.draining])
        want = self.autoscaler.desired(now, replicas, sum(p.held for p in live), sum(p.free for p in live))
        for _ in range(want - replicas):
            index = max((p.index for p in fleet.pipelines), default=-1) + 1
            fleet.pipelines.append(self.new_pipeline(index, now, now + READY_S))
        for _ in range(replicas - want):  # scale-in: the highest group index, not the emptiest
            p = max((p for p in fleet.pipelines if not p.draining), key=lambda p: p.index)
            p.draining = True
            self.push(now if p.held == 0 else now + DRAIN_S, "drained", p)

    def result(self) -> Result:
        self.loop()
        counted = [s for s in self.sessions if s.arrival >= self.warmup and s.arrival + PATIENCE_S <= self.horizon]
        n = max(1, len(counted))
        waits = sorted(s.admitted_at - s.arrival for s in counted if s.admitted_at is not None)
        p95 = waits[min(len(waits) - 1, math.ceil(0.95 * len(waits)) - 1)] if waits else 0.0
        return Result(
            policy=self.policy,
            load=self.load,
            autoscale=self.autoscaler is not None,
            sessions=len(counted),
            refused_pct=100 * sum(s.refused for s in counted) / n,
            refused_while_room_pct=100 * sum(s.refused_with_room for s in counted) / n,
            abandoned_pct=100 * sum(s.admitted_at is None for s in counted) / n,
            utilisation=self.busy_area / self.cap_area if self.cap_area else 0.0,
            p95_admission_s=p95,
            gpu_hours=self.gpu_area / 3600,
            mean_pipelines=self.gpu_area / self.seconds,
            cut_by_scale_in=self.cut,
        )


def simulate(
    *,
    pipelines: int,
    loads: list[float],
    seconds: float,
    warmup: float,
    seed: int,
    target: float,
    window_s: float,
    max_pipelines: int,
) -> dict:
    results = []
    for load in loads:
        for policy in POLICIES:
            results.append(run(policy, load, pipelines=pipelines, seconds=seconds, warmup=warmup, seed=seed))
        scaler = Autoscaler(target=target, max_pipelines=max_pipelines, window_s=window_s)
        results.append(
            run("agent", load, pipelines=pipelines, seconds=seconds, warmup=warmup, seed=seed, autoscaler=scaler)
        )
    return {
        "config": {
            "pipelines": pipelines,
            "capacities": list(CAPACITIES),
            "loads": loads,
            "seconds": seconds,
            "warmup": warmup,
            "seed": seed,
            "median_s": MEDIAN_S,
            "sigma": SIGMA,
            "retry_after_s": RETRY_AFTER_S,
            "patience_s": PATIENCE_S,
            "agent_interval_s": AGENT_INTERVAL_S,
            "ready_s": READY_S,
            "target": target,
            "scale_down_window_s": window_s,
            "max_pipelines": max_pipelines,
            "drain_s": DRAIN_S,
            "poll_s": POLL_S,
        },
        "results": [asdict(r) for r in results],
    }


def table(report: dict) -> str:
    """BENCHMARKS.md's table, from ``simulate``'s JSON."""
    cfg = report["config"]
    head = (
        f"{cfg['pipelines']} pipelines (capacities {' and '.join(map(str, cfg['capacities']))}, alternating), "
        f"{cfg['seconds']:g} s measured after {cfg['warmup']:g} s, seed {cfg['seed']}; sessions lognormal (median "
        f"{cfg['median_s']:g} s, sigma {cfg['sigma']:g}); a refused viewer retries every {cfg['retry_after_s']:g} s "
        f"for {cfg['patience_s']:g} s. Autoscaled: agent weighting from {cfg['pipelines']} pipelines, min 1, max "
        f"{cfg['max_pipelines']}, KEDA target {cfg['target']:g}, scale-down window {cfg['scale_down_window_s']:g} s, "
        f"READY {cfg['ready_s']:g} s after the request, drain {cfg['drain_s']:g} s."
    )
    rows = [
        "| load | policy | sessions | refused (%) | refused while another had room (%) | left unserved (%) | mean "
        "utilisation | time to admission p95 (s) | GPU-hours | mean pipelines | cut by scale-in |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        name = f"{r['policy']}, autoscaled" if r["autoscale"] else r["policy"]
        rows.append(
            f"| {100 * r['load']:.0f}% | {name} | {r['sessions']} | {r['refused_pct']:.2f} | "
            f"{r['refused_while_room_pct']:.2f} | {r['abandoned_pct']:.2f} | {r['utilisation']:.3f} | "
            f"{r['p95_admission_s']:.1f} | {r['gpu_hours']:.1f} | {r['mean_pipelines']:.1f} | {r['cut_by_scale_in']} |"
        )
    return head + "\n\n" + "\n".join(rows) + "\n"


def write_into(path: Path, text: str) -> None:
    """Replace what lies between ``TABLE_BEGIN`` and ``TABLE_END`` in ``path`` with ``text``; nothing else changes."""
    doc = path.read_text()
    if doc.count(TABLE_BEGIN) != 1 or doc.count(TABLE_END) != 1:
        raise SystemExit(f"{path}: needs one {TABLE_BEGIN} line and one {TABLE_END} line")
    head, rest = doc.split(TABLE_BEGIN)
    _, tail = rest.split(TABLE_END)
    path.write_text(f"{head}{TABLE_BEGIN}\n{text}{TABLE_END}{tail}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.fleet_sim", description=__doc__.split("\n\n")[0])
    ap.add_argument("--pipelines", type=int, default=100)
    ap.add_argument("--loads", default="0.5,0.7,0.9,1.0,1.1,1.2", help="arrival rates as shares of fleet capacity")
    ap.add_argument("--seconds", type=float, default=3600.0, help="simulated seconds measured, after --warmup")
    ap.add_argument("--warmup", type=float, default=600.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--target", type=float, default=0.75, help="the autoscaler's slot utilisation target")
    ap.add_argument("--scale-down-window", type=float, default=300.0, help="scale-down stabilisation seconds")
    ap.add_argument("--max-pipelines", type=int, help="the autoscaler's most pipelines (default: 1.5 x --pipelines)")
    ap.add_argument("--out", help="write the JSON here")
    ap.add_argument("--table", metavar="JSON", help="print the markdown table of this JSON (no simulation)")
    ap.add_argument("--into", metavar="MD", help="with --table: replace the table between its markers in this file")
    args = ap.parse_args(argv)
    if args.table:
        text = table(json.loads(Path(args.table).read_text()))
        if args.into:
            write_into(Path(args.into), text)
        else:
            sys.stdout.write(text)
        return 0
    loads = [float(x) for x in args.loads.split(",") if x]
    report = simulate(
        pipelines=args.pipelines,
        loads=loads,
        seconds=args.seconds,
        warmup=args.warmup,
        seed=args.seed,
        target=args.target,
        window_s=args.scale_down_window,
        max_pipelines=args.max_pipelines or math.ceil(1.5 * args.pipelines),
    )
    text = json.dumps(report, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    sys.stdout.write(table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
