"""One CPU host under ``stagecast up`` (issue 50, done-when points 1 and 2): a paced stream beside unpaced ones, and a
burst of paced streams from several clients, on the demo checkpoint, through the public SDK.

Usage::

    python -m benchmarks.cpu_host                 # the measurement: about 35 s on 2 cores; keep the machine quiet
    python -m benchmarks.cpu_host --smoke --json /tmp/cpu_host.json     # the path only: 2 unpaced, a burst of 4

What it does:

1. writes the demo checkpoint (``launcher.demo_checkpoint``) and a token file, and starts ``stagecast up`` on them as
   a newcomer does (2 stages on the CPU; every port picked free, on loopback), then waits for its READY line;
2. **beside unpaced streams**: one paced ``--seconds`` (1 s) stream as a warm-up (recorded, not counted), then the
   same stream alone ``--alone-runs`` (3) times: its completion time, from the call to its last frame, median over the
   runs. Then ``--unpaced`` (8) unpaced streams from as many clients (one ``Client``, so one connection, each), every
   one admitted or refused before the next step, read as fast as frames come; while they run, the same paced stream
   from another client. The checks: it completes with every frame in at most ``--max-ratio`` (1.5) x its time alone;
   at least ``--min-unpaced`` (2) unpaced streams deliver frames while it runs; never more unpaced streams at once than
   the gateway's ``--max-unpaced`` (read from the gateway's command line: ``stagecast up`` passes it on only when
   given, and this benchmark gives none, so it is the gateway's default), counted both from the frames and from the
   gateway's own status;
3. **a burst**: ``--burst-clients`` (5) clients x ``--burst-per-client`` (4) paced streams opened at one instant (the
   harness's ``BurstStream``: threads released by one barrier), run ``--burst-seconds`` (3) once all have started,
   then stopped. Each admitted stream is judged by the harness's on-time rule (``capacity_stream``: frame i is due at
   the first frame's arrival + i / fps) over all its frames, from its first to the stop. Every admitted stream but the
   first (the coordinator's first: the lowest pipeline stream id, which admission always takes alone) must be at least
   ``--burst-goal`` (95%) on time, and every stream not admitted must be refused with RESOURCE_EXHAUSTED.

Why tokens: on loopback every connection has the same peer address, and a client without a token is its address, so
8 connections would be one client, held to ``--max-unpaced-per-client`` (2). One token (a tenant) per ``Client`` makes
each its own client, so the gateway's global ``--max-unpaced`` is what bounds them, as for 8 viewers on 8 machines.
``--anonymous`` runs without tokens.

The JSON (``--json``; default ``benchmarks/results/cpu_host_2core_<commit>.json``) holds every stream's arrivals, each
refusal's text, the gateway's sampled paced and unpaced counts, the coordinator's pricing (``slo_model``) and each
service's CPU seconds per phase. A table goes to stdout, progress lines to stderr. Exits 1 where a check failed (not
with ``--smoke``: its numbers mean nothing).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import secrets
import statistics
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from pathlib import Path

import stagecast
from benchmarks.harness.burst import BurstStream, refusal_ms, stop_all
from benchmarks.harness.capacity import CAPACITY_FIRST_FRAME_S, capacity_stream, process_cpu_s, wait_idle
from benchmarks.harness.rows import git_commit, tree_dirty, versions
from benchmarks.harness.system import StreamRecord, coordinator_status, slo_model
from gateway.options import GatewayOptions
from launcher.demo_checkpoint import DEMO_MODEL, DEMO_SERVING, write_demo_checkpoint
from launcher.process import Launcher

FIRST_S = CAPACITY_FIRST_FRAME_S  # how long a stream may take to its first frame or its refusal
RESULTS = Path(__file__).resolve().parent / "results"
_T0 = time.monotonic()


def progress(line: str) -> None:
    print(f"[cpu_host {time.monotonic() - _T0:6.1f} s] {line}", file=sys.stderr, flush=True)


# ---- the verdicts, from recorded arrivals (tests/test_cpu_host_bench.py) --------------------------------------------


def completion_s(arrivals: list[float]) -> float | None:
    """From the call to the last frame (arrivals are on the SDK's clock: seconds from the call)."""
    return arrivals[-1] if arrivals else None


def frames_between(t0: float, arrivals: list[float], lo: float, hi: float) -> int:
    """Frames of a stream opened at ``t0`` (monotonic) that arrived in [lo, hi] (monotonic)."""
    return sum(lo <= t0 + a <= hi for a in arrivals)


def most_at_once(intervals: list[tuple[float, float]]) -> int:
    """The most intervals that overlap at one instant (touching ends count as overlapping)."""
    events = sorted([(lo, 0) for lo, _ in intervals] + [(hi, 1) for _, hi in intervals])  # starts before ends
    now = most = 0
    for _, end in events:
        now += -1 if end else 1
        most = max(most, now)
    return most


def neighbour_verdict(
    alone_s: list[float],
    beside_s: float | None,
    beside_frames: int,
    expected_frames: int,
    delivered_meanwhile: list[int],
    at_once: int,
    max_unpaced: int,
    *,
    max_ratio: float = 1.5,
    min_unpaced: int = 2,
) -> dict:
    """Done-when point 1: the paced stream beside unpaced ones against its time alone. ``delivered_meanwhile``: each
    unpaced stream's frames while the paced one ran; ``at_once``: the most unpaced streams seen running at once (from
    their frames and the gateway's status, whichever is higher)."""
    alone = statistics.median(alone_s) if alone_s else None
    ratio = beside_s / alone if beside_s is not None and alone else None
    running = sum(n > 0 for n in delivered_meanwhile)
    checks = {
        "the paced stream completed with all its frames": beside_s is not None and beside_frames == expected_frames,
        f"its completion time is at most {max_ratio:g}x its time alone": ratio is not None and ratio <= max_ratio,
        f"at least {min_unpaced} unpaced streams delivered frames meanwhile": running >= min_unpaced,
        f"no more than --max-unpaced ({max_unpaced}) unpaced streams at once": at_once <= max_unpaced,
    }
    return {
        "alone_median_s": alone,
        "beside_s": beside_s,
        "ratio": ratio,
        "unpaced_delivering": running,
        "unpaced_at_once": at_once,
        "max_unpaced": max_unpaced,
        "checks": checks,
    }


def burst_verdict(per_stream: list[dict], not_admitted: list[dict], failed: list[str], *, goal: float = 0.95) -> dict:
    """Done-when point 2. ``per_stream``: ``capacity_stream`` of each admitted stream; ``not_admitted``: each other
    stream's ``code``. The first admitted stream (lowest pipeline stream id) is left out of the goal: a lone paced
    stream is always admitted, whatever it costs. A stream's share is over all its frames (``on_time_to_stop``)."""
    first = min(per_stream, key=lambda s: s["pipeline_stream_id"], default=None)
    after = [s for s in per_stream if s is not first]
    shares = [s["on_time_to_stop"] or 0.0 for s in after]
    refused = [r for r in not_admitted if r["code"] == "RESOURCE_EXHAUSTED"]
    checks = {
        f"every admitted stream after the first is at least {goal:.0%} on time": all(x >= goal for x in shares),
        "every stream not admitted was refused with RESOURCE_EXHAUSTED": len(refused) == len(not_admitted)
        and not failed,
    }
    return {
        "admitted": len(per_stream),
        "refused": len(refused),
        "other_failures": len(not_admitted) - len(refused) + len(failed),
        "first_stream_id": first["pipeline_stream_id"] if first else None,
        "first_on_time": first["on_time_to_stop"] if first else None,
        "after_first_on_time_min": min(shares, default=None),
        "after_first_below_goal": sum(x < goal for x in shares),
        "checks": checks,
    }


# ---- the system: stagecast up on the demo checkpoint ---------------------------------------------------------------


class Tenants:
    """One bearer token per client name (a tenant each), in a token file for ``up --tokens``; anonymous: none."""

    def __init__(self, folder: Path, names: list[str], anonymous: bool):
        self.tokens = {} if anonymous else {name: secrets.token_hex(16) for name in [*names, "watcher"]}
        self.path: Path | None = None
        if self.tokens:
            self.path = folder / "tokens"
            lines = [f"{tok} {name}" + (" status" if name == "watcher" else "") for name, tok in self.tokens.items()]
            self.path.write_text("\n".join(lines) + "\n")

    def client(self, gateway: str, name: str) -> stagecast.Client:
        return stagecast.Client(gateway, token=self.tokens.get(name))


def start_up(launcher: Launcher, checkpoint: Path, args, tokens: Path | None):
    argv = ["up", "--checkpoint", str(checkpoint), "--stages", str(args.stages), "--port", "0", "--gateway-port", "0"]
    argv += ["--web-port", "-1", "--credentials", launcher.credentials]  # the CA whose operator cert reads Status
    if tokens is not None:
        argv += ["--tokens", str(tokens)]
    return launcher.spawn("up", argv, timeout=600.0)


def services(pid: int) -> dict[str, tuple[int, list[str]]]:
    """``up``'s service processes: name (coordinator, stage-i, gateway) -> (pid, command line)."""
    out: dict[str, tuple[int, list[str]]] = {}
    todo = [pid]
    while todo:
        for task in Path(f"/proc/{todo.pop()}/task").glob("*"):
            try:
                kids = [int(k) for k in (task / "children").read_text().split()]
            except OSError:
                continue
            todo += kids
            for kid in kids:
                try:
                    argv = Path(f"/proc/{kid}/cmdline").read_bytes().decode().split("\0")
                except OSError:
                    continue
                module = argv[argv.index("-m") + 1] if "-m" in argv[:-1] else ""
                if module == "stage_service" and "--index" in argv:
                    out[f"stage-{argv[argv.index('--index') + 1]}"] = (kid, argv)
                elif module in ("coordinator", "gateway"):
                    out[module] = (kid, argv)
    return out


def gateway_max_unpaced(argv: list[str]) -> tuple[int, str]:
    """The gateway's ``--max-unpaced`` from its command line, else its default; and where it came from."""
    for i, a in enumerate(argv):
        if a == "--max-unpaced" and i + 1 < len(argv):
            return int(argv[i + 1]), "the gateway's command line"
        if a.startswith("--max-unpaced="):
            return int(a.split("=", 1)[1]), "the gateway's command line"
    default = {f.name: f.default for f in dataclasses.fields(GatewayOptions)}["max_unpaced"]
    return int(default), "the gateway's default (stagecast up was not given --max-unpaced)"


class CpuMeter:
    """CPU seconds each service used over a phase (``process_cpu_s``: user + system, every thread)."""

    def __init__(self, procs: dict[str, tuple[int, list[str]]]):
        self.pids = {name: pid for name, (pid, _) in procs.items()}
        self.start = {name: process_cpu_s(pid) for name, pid in self.pids.items()}
        self.t0 = time.monotonic()

    def used(self) -> dict:
        now = {name: process_cpu_s(pid) for name, pid in self.pids.items()}
        cpu = {k: round(now[k] - v, 2) for k, v in self.start.items() if v is not None and now[k] is not None}
        return {"wall_s": round(time.monotonic() - self.t0, 2), "cpu_s": cpu}


class GatewayCounts:
    """The gateway's paced and unpaced stream counts (its GetStatus), sampled every ``period`` s while a phase runs."""

    def __init__(self, client: stagecast.Client, period: float = 0.2):
        self.client, self.period = client, period
        self.samples: list[tuple[float, int, int]] = []  # (monotonic, paced, unpaced)
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while True:
            try:
                s = self.client.status()
                self.samples.append((time.monotonic(), s.paced_streams, s.unpaced_streams))
            except stagecast.StagecastError:
                self.errors += 1
            if self._stop.wait(self.period):
                return

    def __enter__(self) -> GatewayCounts:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def most_unpaced(self) -> int:
        return max((u for _, _, u in self.samples), default=0)


def stream_args(args) -> argparse.Namespace:
    """What ``StreamRecord`` reads: the demo checkpoint's size and steps at its frame rate, JPEG, no guidance, the
    gateway's own KV window (None leaves the field out)."""
    return argparse.Namespace(
        width=DEMO_SERVING["width"],
        height=DEMO_SERVING["height"],
        steps=DEMO_SERVING["steps"],
        target_fps=DEMO_SERVING["fps"],
        codec="jpeg",
        window=None,
        sink=None,
        load_min_steps=0,
        guidance=1.0,
        negative_prompt="",
    )


def record_json(rec: StreamRecord) -> dict:
    out = rec.json()
    out["completion_s"] = completion_s(rec.arrivals)
    out["total_frames"] = rec.gen.info.total_frames if rec.arrivals else None
    out["error_code"], out["error_details"] = rec.error_code, rec.error_details
    return out


# ---- the phases ----------------------------------------------------------------------------------------------------


def measure_alone(gateway: str, tenants: Tenants, sargs, args) -> dict:
    runs = []
    with tenants.client(gateway, "viewer") as viewer:
        for i in range(args.alone_runs + 1):  # the first is a warm-up
            rec = StreamRecord(viewer, sargs, args.seconds, f"a fox alone {i}", pace=True).run()
            progress(f"alone {'warm-up' if i == 0 else i}: {completion_s(rec.arrivals)} s, {len(rec.arrivals)} frames")
            runs.append(record_json(rec))
    return {"warmup": runs[0], "runs": runs[1:], "completion_s": [r["completion_s"] for r in runs[1:]]}


def open_unpaced(clients: list[stagecast.Client], sargs) -> tuple[list[StreamRecord], list[threading.Thread]]:
    """Each client's unbounded unpaced stream, each admitted (or refused) before the next is opened; then read."""
    hogs = [StreamRecord(c, sargs, None, f"an unpaced stream {i}", pace=False) for i, c in enumerate(clients)]
    for hog in hogs:
        try:
            hog.gen.wait_started()
        except stagecast.StagecastError:
            pass  # run() records the refusal
    readers = [threading.Thread(target=hog.run, daemon=True) for hog in hogs]
    for reader in readers:
        reader.start()
    for hog in hogs:  # an admitted one has its first frame, a refused one has ended
        hog.started.wait(CAPACITY_FIRST_FRAME_S)
    return hogs, readers


def measure_neighbours(gateway: str, tenants: Tenants, sargs, args, procs, alone_s: list[float]) -> dict:
    with ExitStack() as stack:
        clients = [stack.enter_context(tenants.client(gateway, f"unpaced-{i}")) for i in range(args.unpaced)]
        viewer = stack.enter_context(tenants.client(gateway, "viewer"))
        watcher = stack.enter_context(tenants.client(gateway, "watcher"))
        hogs, readers = open_unpaced(clients, sargs)
        progress(f"unpaced: {sum(bool(h.arrivals) for h in hogs)} of {len(hogs)} delivering; the paced stream opens")
        cpu = CpuMeter(procs)
        with GatewayCounts(watcher) as counts:
            beside = StreamRecord(viewer, sargs, args.seconds, "a fox beside unpaced streams", pace=True).run()
        used = cpu.used()
        t_lo, t_hi = beside.gen.t0, beside.gen.t0 + (completion_s(beside.arrivals) or 0.0)
        for hog in hogs:
            hog.gen.cancel()
        for reader in readers:
            reader.join(60)
    delivered = [frames_between(h.gen.t0, h.arrivals, t_lo, t_hi) for h in hogs]
    running = [(h.gen.t0 + h.arrivals[0], h.gen.t0 + h.arrivals[-1]) for h in hogs if h.arrivals]
    max_unpaced, source = gateway_max_unpaced(procs["gateway"][1])
    verdict = neighbour_verdict(
        alone_s,
        completion_s(beside.arrivals) if beside.error is None else None,
        len(beside.arrivals),
        beside.gen.info.total_frames if beside.arrivals else -1,
        delivered,
        max(most_at_once(running), counts.most_unpaced()),
        max_unpaced,
        max_ratio=args.max_ratio,
        min_unpaced=args.min_unpaced,
    )
    span = t_hi - t_lo
    return {
        **verdict,
        "max_unpaced_source": source,
        "unpaced_opened": len(hogs),
        "unpaced_admitted": sum(bool(h.arrivals) for h in hogs),
        "unpaced_at_once_from_frames": most_at_once(running),
        "unpaced_at_once_gateway": counts.most_unpaced(),
        "unpaced_frames_meanwhile": delivered,
        "unpaced_fps_meanwhile": sum(delivered) / span if span > 0 else None,
        "gateway_samples": [(round(t - t_lo, 3), p, u) for t, p, u in counts.samples],
        "status_errors": counts.errors,
        "cpu": used,
        "beside": record_json(beside),
        "unpaced": [
            {"frames": len(h.arrivals), "code": h.error_code, "details": h.error_details if not h.arrivals else None}
            for h in hogs
        ],
    }


def measure_burst(gateway: str, tenants: Tenants, sargs, args, launcher, coordinator: str, procs) -> dict:
    n = args.burst_clients * args.burst_per_client
    with ExitStack() as stack:
        clients = [stack.enter_context(tenants.client(gateway, f"burst-{c}")) for c in range(args.burst_clients)]
        watcher = stack.enter_context(tenants.client(gateway, "watcher"))
        wait_idle(watcher, coordinator, launcher)
        priced = slo_model(coordinator_status(coordinator, launcher))
        barrier = threading.Barrier(n)
        streams = [
            BurstStream(clients[i // args.burst_per_client], sargs, f"a burst stream {i}", "full", barrier)
            for i in range(n)
        ]
        cpu = CpuMeter(procs)
        for s in streams:
            s.thread.start()
        late = [i for i, s in enumerate(streams) if not s.started(FIRST_S)]
        failed = [f"stream {i}: no first frame in {FIRST_S:.0f} s" for i in late]
        failed += [f"stream {i}: {s.error}" for i, s in enumerate(streams) if s.error]
        recs = [s.rec for s in streams if s.rec is not None]
        admitted = [r for r in recs if r.arrivals]
        progress(f"burst: {len(admitted)} of {n} admitted; running {args.burst_seconds:g} s")
        t_all = time.monotonic()
        time.sleep(args.burst_seconds if admitted else 0.0)
        t_end = time.monotonic()
        stop_all(streams)
        used = cpu.used()
    per_stream = [capacity_stream(r, t_all - r.gen.t0, t_end - r.gen.t0, sargs.target_fps) for r in admitted]
    others = [r for r in recs if not r.arrivals]
    not_admitted = [
        {"code": r.error_code, "details": r.error_details, "ms": refusal_ms(r), "retry_after_s": r.retry_after}
        for r in others
    ]
    for s, r in zip(per_stream, admitted):
        s["client"] = next(i for i, b in enumerate(streams) if b.rec is r) // args.burst_per_client
        s["arrivals_s"] = [round(x, 5) for x in r.arrivals]
    return {
        **burst_verdict(per_stream, not_admitted, failed, goal=args.burst_goal),
        "streams": n,
        "clients": args.burst_clients,
        "window_s": t_end - t_all,
        "slo_model": priced,
        "cpu": used,
        "failed": failed,
        "not_admitted": not_admitted,
        "per_stream": per_stream,
    }


# ---- the run -------------------------------------------------------------------------------------------------------


def table(r: dict) -> str:
    a, n, b, g = r["alone"], r["neighbours"], r["burst"], r["flags"]
    f = lambda x, fmt=".2f": "–" if x is None else format(x, fmt)  # noqa: E731
    runs = ", ".join(f(x) for x in a["completion_s"])
    punctual = ", ".join(f(x["on_time"]) for x in a["runs"])
    lines = [
        "| measurement | result | goal |",
        "|---|---|---|",
        f"| paced {g['seconds']:g} s stream alone, completion (median of {len(a['runs'])}) | "
        f"{f(n['alone_median_s'])} s ({runs}) | – |",
        f"| its frames on time alone (first frame + i / fps) | {punctual} | – |",
        f"| the same beside {n['unpaced_opened']} unpaced streams ({n['unpaced_admitted']} admitted) | "
        f"{f(n['beside_s'])} s, {n['beside']['frames']} of {n['beside']['total_frames']} frames, "
        f"{f(n['ratio'])}x | <= {g['max_ratio']:g}x |",
        f"| unpaced streams delivering meanwhile | {n['unpaced_delivering']} "
        f"({f(n['unpaced_fps_meanwhile'], '.1f')} frames/s together) | >= {g['min_unpaced']} |",
        f"| most unpaced at once (frames / gateway status) | {n['unpaced_at_once_from_frames']} / "
        f"{n['unpaced_at_once_gateway']} | <= --max-unpaced {n['max_unpaced']} |",
        f"| burst of {b['streams']} paced from {b['clients']} clients | {b['admitted']} admitted, {b['refused']} "
        f"refused (RESOURCE_EXHAUSTED), {b['other_failures']} otherwise | the rest RESOURCE_EXHAUSTED |",
        f"| on time, every frame to the stop | first {f(b['first_on_time'])}, the others min "
        f"{f(b['after_first_on_time_min'])} ({b['after_first_below_goal']} below) | >= {g['burst_goal']:.2f} |",
    ]
    checks = {**n["checks"], **b["checks"]}
    lines += ["", *(f"{'ok  ' if ok else 'FAIL'} {name}" for name, ok in checks.items())]
    return "\n".join(lines)


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stages", type=int, default=2, help="DiT stages of stagecast up (its default)")
    ap.add_argument("--seconds", type=float, default=1.0, help="video of the paced stream")
    ap.add_argument("--alone-runs", type=int, default=3, help="runs of the paced stream alone (after one warm-up)")
    ap.add_argument("--unpaced", type=int, default=8, help="unpaced streams, one client (connection) each")
    ap.add_argument("--max-ratio", type=float, default=1.5, help="goal: beside / alone completion time")
    ap.add_argument("--min-unpaced", type=int, default=2, help="goal: unpaced streams delivering meanwhile")
    ap.add_argument("--burst-clients", type=int, default=5)
    ap.add_argument("--burst-per-client", type=int, default=4)
    ap.add_argument("--burst-seconds", type=float, default=3.0, help="the burst's run once every stream started")
    ap.add_argument("--burst-goal", type=float, default=0.95, help="goal: on-time share after the first stream")
    ap.add_argument("--anonymous", action="store_true", help="no tokens: every loopback connection is one client")
    ap.add_argument("--json", default=None, help="default: benchmarks/results/cpu_host_2core_<commit>.json")
    ap.add_argument("--smoke", action="store_true", help="the path only: 2 unpaced, a burst of 2 x 2, 1 s")
    args = ap.parse_args(argv)
    if args.smoke:
        args.alone_runs, args.unpaced, args.burst_clients, args.burst_per_client = 1, 2, 2, 2
        args.burst_seconds, args.min_unpaced = 1.0, 1
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    sargs = stream_args(args)
    names = ["viewer", *(f"unpaced-{i}" for i in range(args.unpaced))]
    names += [f"burst-{c}" for c in range(args.burst_clients)]
    with tempfile.TemporaryDirectory(prefix="stagecast-cpu-host-") as tmp, Launcher(forkserver=False) as launcher:
        root = Path(tmp)
        checkpoint = write_demo_checkpoint(root / "demo")
        tenants = Tenants(root, names, args.anonymous)
        progress("starting stagecast up on the demo checkpoint")
        t_up = time.monotonic()
        up = start_up(launcher, checkpoint, args, tenants.path)
        ready_s = time.monotonic() - t_up
        gateway, coordinator = up.info["gateway"], up.info["coordinator"]
        procs = services(up.proc.pid)
        progress(f"READY in {ready_s:.1f} s: gateway {gateway}, services {sorted(procs)}")
        alone = measure_alone(gateway, tenants, sargs, args)
        failed = [run["error"] for run in [alone["warmup"], *alone["runs"]] if run["error"]]
        if failed:  # what the services said meanwhile, for whoever reads the failure
            progress(f"an alone stream failed ({failed[0]}); stagecast up's last lines:\n" + "\n".join(up.log[-40:]))
        neighbours = measure_neighbours(gateway, tenants, sargs, args, procs, alone["completion_s"])
        progress(f"beside unpaced: {neighbours['beside_s']} s, ratio {neighbours['ratio']}")
        burst = measure_burst(gateway, tenants, sargs, args, launcher, coordinator, procs)
    result = {
        "benchmark": "cpu_host",
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "commit": git_commit(),
        "dirty": tree_dirty(),
        "versions": versions(),
        "host": {"cpus": os.cpu_count(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS")},
        "command": " ".join(["python -m benchmarks.cpu_host", *(argv if argv is not None else sys.argv[1:])]),
        # The streams' model and size (what benchmarks.report's index reads); the run's own flags beside them.
        "args": {"model": DEMO_MODEL, **{k: v for k, v in vars(sargs).items() if k in ("width", "height", "steps")}},
        "flags": {**vars(args), "tokens": not args.anonymous},
        "time_to_ready_s": ready_s,
        "services": {name: {"pid": pid, "argv": argv[argv.index("-m") + 1 :]} for name, (pid, argv) in procs.items()},
        "alone": alone,
        "neighbours": neighbours,
        "burst": burst,
    }
    out = Path(args.json) if args.json else RESULTS / f"cpu_host_2core_{result['commit']}.json"
    out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(table(result))
    progress(f"wrote {out}")
    ok = all(neighbours["checks"].values()) and all(burst["checks"].values())
    return 0 if args.smoke or ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
