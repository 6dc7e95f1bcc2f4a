"""The burst row (``--burst N``): N paced streams opened at one instant on an idle system.

What it answers: when N viewers arrive together, how many are admitted, whether every admitted one is held (>= 99%
of its frames due in the measured window on time, the capacity rows' rule), how long the admitted wait for their
first frame (TTFF p50 / p95, from each call's first message), and how fast the others are refused (ms from the call
to its RESOURCE_EXHAUSTED).  Every prompt is new to the server, so each open encodes its prompt.

    row = measure_burst(client, launcher, coordinator, args, "tiny", tag)   # after wait_idle: nothing else open

The N calls start together: each thread opens its stream once all N threads are ready (a barrier), then the row
waits for every stream's first frame or end, runs the admitted ones ``--burst-seconds`` more (the measured window)
and stops them.
"""

from __future__ import annotations

import statistics
import threading
import time

from benchmarks.harness.capacity import CAPACITY_FIRST_FRAME_S, GpuBusy, capacity_stream, late_totals, wait_idle
from benchmarks.harness.rows import log, percentile
from benchmarks.harness.system import StreamRecord


class BurstStream:
    """One stream of a burst: opened in its own thread when the barrier lets every thread go."""

    def __init__(self, client, args, prompt: str, decoder: str, barrier: threading.Barrier):
        self.rec: StreamRecord | None = None
        self.opened = threading.Event()  # the record exists (its call is being made)
        self.error: str | None = None
        self._args = (client, args, prompt, decoder, barrier)
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        client, args, prompt, decoder, barrier = self._args
        try:
            barrier.wait()
            self.rec = StreamRecord(client, args, None, prompt, pace=True, decoder=decoder)
        except Exception as exc:  # noqa: BLE001 - recorded in the row
            self.error = f"{type(exc).__name__}: {exc}"
            return
        finally:
            self.opened.set()
        self.rec.run()

    def started(self, timeout: float) -> bool:
        """Whether the stream had its first frame, or ended, within ``timeout`` s."""
        deadline = time.monotonic() + timeout
        if not self.opened.wait(timeout) or self.rec is None:
            return self.rec is not None
        return self.rec.started.wait(max(0.0, deadline - time.monotonic()))


def refusal_ms(rec: StreamRecord) -> float | None:
    """ms from the call to its RESOURCE_EXHAUSTED, where admission refused the stream."""
    if rec.arrivals or rec.error_code != "RESOURCE_EXHAUSTED" or rec.error_s is None:
        return None
    return rec.error_s * 1e3


def burst_verdict(n: int, admitted: int, held: int, refused: int, failed: list[str]) -> str:
    if failed:
        return f"failed: {failed[0]}; {admitted} admitted, {held} held, {refused} refused"
    if held == admitted:
        return f"{admitted} of {n} admitted, every one held; {refused} refused"
    return f"admitted but not held: {held} of {admitted} admitted streams held; {refused} refused"


def stop_all(streams: list[BurstStream]) -> None:
    """Stop every stream; chunks in flight still arrive, a stream that does not end is cancelled."""
    for s in streams:
        if s.rec is not None:
            s.rec.gen.stop()
    deadline = time.monotonic() + 60
    for s in streams:
        s.thread.join(max(0.0, deadline - time.monotonic()))
        if s.thread.is_alive() and s.rec is not None:
            s.rec.gen.cancel()
            s.thread.join(10)


def measure_burst(client, launcher, coordinator: str, args, decoder: str, tag: str) -> dict:
    """``args.burst`` paced streams opened at one instant once the system is idle; see the module docstring."""
    wait_idle(client, coordinator, launcher)
    n = args.burst
    barrier = threading.Barrier(n)
    streams = [BurstStream(client, args, f"burst {tag} {i}", decoder, barrier) for i in range(n)]
    t_open = time.monotonic()
    for s in streams:
        s.thread.start()
    failed = [
        f"stream {i + 1}: no first frame in {CAPACITY_FIRST_FRAME_S:.0f} s"
        for i, s in enumerate(streams)
        if not s.started(CAPACITY_FIRST_FRAME_S)
    ]
    failed += [f"stream {i + 1}: {s.error}" for i, s in enumerate(streams) if s.error]
    recs = [s.rec for s in streams if s.rec is not None]
    admitted = [r for r in recs if r.arrivals]
    refused = [ms for ms in map(refusal_ms, recs) if ms is not None]
    failed += [f"{r.error}" for r in recs if not r.arrivals and refusal_ms(r) is None and r.error]
    t_all = time.monotonic()
    log(f"burst {decoder}: {len(admitted)} of {n} admitted, {len(refused)} refused")
    with GpuBusy() as busy:
        time.sleep(args.burst_seconds if admitted else 0.0)
    t_end = time.monotonic()
    stop_all(streams)
    per_stream = [capacity_stream(r, t_all - r.gen.t0, t_end - r.gen.t0, args.target_fps) for r in admitted]
    held = sum(s["held"] for s in per_stream)
    ttffs = [r.ttff_s for r in admitted if r.ttff_s is not None]
    return {
        "decoder": decoder,
        "streams": n,
        "seconds": args.burst_seconds,
        "open_s": t_all - t_open,
        "window_s": t_end - t_all,
        "admitted": len(admitted),
        "held": held,
        "refused": len(refused),
        "failed": failed,
        "verdict": burst_verdict(n, len(admitted), held, len(refused), failed),
        "ttff_p50_s": statistics.median(ttffs) if ttffs else None,
        "ttff_p95_s": percentile(ttffs, 0.95) if ttffs else None,
        "ttff_max_s": max(ttffs) if ttffs else None,
        "refusal_ms": sorted(refused),
        "refusal_ms_p50": statistics.median(refused) if refused else None,
        "refusal_ms_max": max(refused) if refused else None,
        "on_time_min": min((s["on_time"] or 0.0 for s in per_stream), default=None),
        "ttff_slowest_parts_ms": max(
            (s for s in per_stream if s["ttff_s"] is not None), key=lambda s: s["ttff_s"], default={}
        ).get("ttff_parts_ms"),
        "gpu_busy": busy.summary(),
        "late_causes": late_totals(per_stream),
        "per_stream": per_stream,
    }


__all__ = ["measure_burst", "refusal_ms", "burst_verdict"]
