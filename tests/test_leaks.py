"""Nothing leaks, and a cancelled stream is freed everywhere: real processes (coordinator, 2 stages, gateway) on
loopback, driven through the client SDK.

Streams of three kinds cycle: completed, cancelled mid-stream, cancelled before the first frame.  Every process
reports what it holds on SIGUSR2 (``stagecast.diagnostics``: RSS after ``malloc_trim``, fds, threads, listening
sockets).  The soak test (``pytest -m soak``) runs 500 streams after a warm-up and fits RSS over streams 100-500;
the CI-sized test runs a few dozen and checks the counts.  Both check that generation changes (a stage paused until
it is lost, then resumed: it rejoins) leave fds, threads and listening sockets where they were.
"""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import pytest

import stagecast
from launcher.demo_checkpoint import write_demo_checkpoint
from launcher.local_cluster import start_pipeline
from launcher.process import Child, Launcher
from stagecast import diagnostics
from stagecast.grpc_util import CHANNEL_OPTIONS
from stagecast.internal.v1 import pipeline_pb2 as ipb
from stagecast.internal.v1 import pipeline_pb2_grpc as ipb_grpc
from stagecast.v1 import stream_pb2 as pb
from stagecast.v1 import stream_pb2_grpc as pb_grpc
from tests.pipeline_helpers import fixed_fast_stages, wait_for_generation, wait_until

pytestmark = pytest.mark.multiprocess

PROMPT = "a red fox running through snow"
KINDS = ("complete", "cancel_mid_stream", "cancel_before_first_frame")


@dataclass
class System:
    coordinator: str
    gateway: str
    stages: list[str]
    children: dict[str, Child]
    launcher: Launcher  # holds the operator's certificate for the internal services (mTLS)


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    root = write_demo_checkpoint(tmp_path_factory.mktemp("ckpt"))
    with Launcher() as launcher:
        pipe = start_pipeline(
            launcher,
            checkpoint=str(root / "transformer"),
            stages=2,
            max_streams=8,
            coordinator_args=fixed_fast_stages(2),
        )
        gw = ["gateway", "--coordinator", pipe.coordinator, "--checkpoint", str(root), "--port", "0"]
        gateway = launcher.spawn("gateway", [*gw, "--max-streams", "8"])
        children = {"coordinator": pipe.coordinator_child, "gateway": gateway}
        children.update({f"stage-{i}": child for i, child in pipe.stage_children.items()})
        yield System(
            coordinator=pipe.coordinator,
            gateway=gateway.info["address"],
            stages=[child.info["address"] for child in pipe.stage_children.values()],
            children=children,
            launcher=launcher,
        )


def run_stream(client: stagecast.Client, kind: str) -> None:
    if kind == "complete":
        frames = client.generate(prompt=PROMPT, seconds=0.25, codec="raw").collect()
        assert frames
        return
    gen = client.generate(prompt=PROMPT, codec="raw")  # unbounded
    if kind == "cancel_mid_stream":
        next(iter(gen))
    else:
        gen.wait_started()
    gen.cancel()


def run_streams(system: System, first: int, count: int, workers: int = 3) -> None:
    with stagecast.Client(system.gateway) as client, ThreadPoolExecutor(workers) as pool:
        list(pool.map(lambda i: run_stream(client, KINDS[i % len(KINDS)]), range(first, first + count)))


def held(system: System) -> dict[str, int]:
    """What the pipeline and the gateway still hold for streams."""
    with grpc.insecure_channel(system.gateway) as ch:
        gw = pb_grpc.StreamServiceStub(ch).GetStatus(pb.StatusRequest(), timeout=10)
    with system.launcher.channel(system.coordinator, "coordinator", CHANNEL_OPTIONS) as ch:
        coord = ipb_grpc.CoordinatorServiceStub(ch).Status(ipb.Empty(), timeout=10)
    out = {"gateway_streams": gw.active_streams, "gateway_vae_bytes": gw.vae_state_bytes}
    out["coordinator_streams"] = coord.active_streams
    for i, address in enumerate(system.stages):
        with system.launcher.channel(address, "stage") as ch:
            desc = ipb_grpc.StageServiceStub(ch).Describe(ipb.Empty(), timeout=10)
        out[f"stage{i}_streams"] = desc.open_streams
        out[f"stage{i}_kv_bytes"] = desc.kv_bytes
    return out


def wait_idle(system: System, timeout: float = 30.0) -> float:
    """Poll until nothing is held for any stream anywhere; returns how long that took."""
    start = time.monotonic()
    wait_until(lambda: not any(held(system).values()), timeout, what="every process freeing every stream")
    return time.monotonic() - start


def report(child: Child, timeout: float = 30.0) -> dict[str, int]:
    """SIGUSR2 the child and read the line it prints (``stagecast.diagnostics``)."""

    def last():
        return next((line for line in reversed(child.log) if line.startswith(diagnostics.PREFIX)), None)

    before = last()
    os.kill(child.pid, signal.SIGUSR2)
    line = wait_until(lambda: (lambda now: now if now is not None and now is not before else None)(last()), timeout)
    return diagnostics.parse(line)


def reports(system: System) -> dict[str, dict[str, int]]:
    return {name: report(child) for name, child in system.children.items()}


def counts(stats: dict[str, int]) -> dict[str, int]:
    # The gRPC servers' worker pools and gRPC core's EventEngine pool grow on demand up to a limit: not a leak, so
    # not compared.  A stage held one thread more after its second generation change in about one fresh-clone CI run
    # in five; the engine's pool, which grows while a stopped and resumed process's callbacks back up, is the likely
    # one (the counts did not name it).
    threads = stats["threads"] - stats["pool_threads"] - stats["engine_threads"]
    return {"fds": stats["fds"], "threads": threads, "listening": stats["listening"]}


def change_generation(system: System) -> None:
    """Pause stage 1 until the coordinator ends the generation, then resume it: it rejoins a new one."""
    with system.launcher.channel(system.coordinator, "coordinator", CHANNEL_OPTIONS) as ch:
        before = ipb_grpc.CoordinatorServiceStub(ch).Status(ipb.Empty(), timeout=10).generation
        stage = system.children["stage-1"]
        os.kill(stage.pid, signal.SIGSTOP)
        try:
            wait_until(
                lambda: not ipb_grpc.CoordinatorServiceStub(ch).Status(ipb.Empty(), timeout=10).ready,
                timeout=60,
                what="the paused stage being noticed",
            )
        finally:
            os.kill(stage.pid, signal.SIGCONT)
    wait_for_generation(system.coordinator, before + 1, system.launcher, timeout=60)


def counts_when(system: System, want: dict, timeout: float = 10.0) -> dict:
    """Every process's counts once they equal ``want``, else as they stand after ``timeout``: a thread or socket of
    an old generation that is still being torn down is not a leak (one left a stage's thread count one high once, on a
    loaded 2-core machine), one that stays is."""
    now: dict = {}

    def equal() -> bool:
        now.update({name: counts(stats) for name, stats in reports(system).items()})
        return now == want

    try:
        wait_until(equal, timeout, interval=0.5, what="the counts coming back")
    except TimeoutError:
        pass
    return now


def settled_counts(system: System, timeout: float = 10.0) -> dict:
    """Every process's counts once two reports in a row agree (else the last after ``timeout``): a base not taken
    while an old generation's thread is still exiting."""
    last: dict = {}

    def same() -> bool:
        now = {name: counts(stats) for name, stats in reports(system).items()}
        agreed = now == last
        last.clear()
        last.update(now)
        return agreed

    try:
        wait_until(same, timeout, interval=0.5, what="the counts settling")
    except TimeoutError:
        pass
    return dict(last)


def check_generation_changes(system: System, changes: int) -> None:
    """``changes`` generation changes (at least 2), each followed by a stream of every kind.  The first may leave a
    thread started once for good (a stage's count was one high after it in two fresh-clone CI runs, 10 s on); each
    change after it must bring the counts back to where the first left them: a leak grows with every change."""
    assert changes >= 2, "one change cannot tell a leak from a thread started once"
    run_streams(system, 0, 3)  # every kind once in this generation
    wait_idle(system)
    base: dict = {}
    for change in range(changes):
        change_generation(system)
        run_streams(system, 0, 3)
        wait_idle(system)
        if change == 0:
            base = settled_counts(system)
            continue
        now = counts_when(system, base)
        assert now == base, f"after generation change {change + 1}: {now} != {base} (after the first)"


def test_a_cancelled_stream_is_freed_at_every_stage_and_in_the_gateway_within_2s(system):
    with stagecast.Client(system.gateway) as client:
        for kind in ("cancel_mid_stream", "cancel_before_first_frame"):
            gen = client.generate(prompt=PROMPT, codec="raw")
            if kind == "cancel_mid_stream":
                next(iter(gen))
                state = held(system)
                assert state["stage0_kv_bytes"] > 0 and state["stage1_kv_bytes"] > 0  # the check can fail
            else:
                gen.wait_started()
            gen.cancel()
            took = wait_idle(system, timeout=10)
            assert took < 2.0, f"{kind}: KV and VAE state were freed {took:.2f}s after the cancel"


def test_streams_and_generation_changes_leave_nothing_behind(system):
    run_streams(system, 0, 24)  # warm-up: pools, caches and lazily built things reach their size
    wait_idle(system)
    snapshots = [reports(system)]
    for window in range(3):
        run_streams(system, 24 + 36 * window, 36)
        wait_idle(system)
        snapshots.append(reports(system))
    # The counts come back to the warm-up's (a stream's thread still exiting right after the last one went idle is not
    # a leak: a stage's count was one high at that instant once, on a loaded 2-core machine); one that stays fails.
    base = {name: counts(stats) for name, stats in snapshots[0].items()}
    now = counts_when(system, base)
    for name in snapshots[0]:
        assert now[name] == base[name], name
        # Growth in each of three windows of 36 streams: a leak grows every one.  A one-off step (a gRPC worker
        # thread started on demand on a loaded machine, with its stack and malloc arena) shows in one window, and the
        # gateway's RSS swings by up to about 100 KB per stream between windows on the 2-core CI machine (measured:
        # +85 KB then -103 KB; +70-90 KB then +19-28 KB in two CI runs, which failed the two-window check).
        grew = [(b[name]["rss_kb"] - a[name]["rss_kb"]) * 1024 / 36 for a, b in zip(snapshots, snapshots[1:])]
        assert min(grew) < 16 * 1024, f"{name}: RSS grew {', '.join(f'{g:.0f}' for g in grew)} B per stream"
    check_generation_changes(system, changes=2)


@pytest.mark.soak
def test_500_streams_grow_no_process_by_2kb_per_stream_and_generation_changes_leave_nothing(system):
    run_streams(system, 0, 100)  # warm-up
    wait_idle(system)
    points = {name: [] for name in system.children}
    for done in range(100, 501, 25):  # 17 points: the fit is not at the mercy of one noisy report
        if done > 100:
            run_streams(system, done - 25, 25)
            wait_idle(system)
        for name, stats in reports(system).items():
            points[name].append((done, stats))
    slopes, lines = {}, []
    for name, series in points.items():
        xs = [x for x, _ in series]
        ys = [stats["rss_kb"] * 1024 for _, stats in series]
        mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
        slopes[name] = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum((x - mean_x) ** 2 for x in xs)
        lines.append(f"{name}: {slopes[name]:.0f} B/stream over streams 100-500 (RSS KB {[y // 1024 for y in ys]})")
        assert counts(series[-1][1]) == counts(series[0][1]), name
    print("\n" + "\n".join(lines))
    assert all(slope < 2048 for slope in slopes.values()), lines
    check_generation_changes(system, changes=3)


STOP_UNDER_LOCK = """
import os, signal, sys
from stagecast.service import stop_event

stop = stop_event()
with stop._cond:  # the main thread holds the event's lock, as inside Event.set or Event.wait
    for _ in range(3):  # a launcher's SIGTERM, its second one, and the parent's death
        os.kill(os.getpid(), signal.SIGTERM)
sys.exit(0 if stop.wait(30) else 3)
"""


def test_sigterm_arriving_while_the_main_thread_holds_the_stop_events_lock_still_stops_the_service():
    # A gateway once outlived its test run: its SIGTERM handler set the stop event while the main thread held the
    # event's lock (a second SIGTERM inside the first handler), and waited for that lock forever.
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", STOP_UNDER_LOCK], timeout=60, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
