"""The capacity rows: paced streams opened one at a time until admission refuses one, then all of them held for a
measured window, per decoder."""

from __future__ import annotations

import os
import statistics
import threading
import time
from pathlib import Path

from benchmarks.harness.rows import log, percentile
from benchmarks.harness.system import StreamRecord, coordinator_status, slo_model, stage_delta, stage_stats, ttff_parts

# ---- capacity -------------------------------------------------------------------------------------------

# How long the capacity mode waits for a newly admitted stream's first frame before it gives up on the row.
CAPACITY_FIRST_FRAME_S = 30.0
FREEZE_MS = 250.0
LATE_LISTED = 12  # late frames a capacity stream's row lists (``late_listed``)


def process_cpu_s(pid: int | None) -> float | None:
    """CPU seconds (user + system, every thread) a process has used so far: /proc/<pid>/stat, else psutil."""
    if pid is None:
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime (fields 14, 15)
    except (OSError, ValueError, IndexError):
        pass
    try:
        import psutil

        t = psutil.Process(pid).cpu_times()
        return t.user + t.system
    except Exception:  # noqa: BLE001 - no /proc and no psutil: the row says None
        return None


def gateway_pid(launcher) -> int | None:
    """The gateway process the launcher started last (its CPU is the gateway's CPU per frame)."""
    for child in reversed(launcher.children):
        if child.name == "gateway":
            return child.pid
    return None


class Sampler:
    """Calls ``_sample()`` every ``period`` seconds on a thread of its own while the ``with`` block runs (a sample that
    raises is counted in ``errors`` and skipped); a subclass with nothing to sample sets ``active`` False."""

    active = True

    def __init__(self, period: float):
        self.period = period
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        raise NotImplementedError

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            try:
                self._sample()
            except Exception:  # noqa: BLE001 - a missed sample
                self.errors += 1

    def __enter__(self):
        if self.active:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()


class StatusSampler(Sampler):
    """While a capacity row's streams run: the coordinator's per-stream steps (the SLO controller's choice), the
    model's busy share of the open set (``ClusterStatus.utilization``) and the stages' KV bytes, and the gateway's
    decoder state bytes, sampled every ``period`` seconds.

    Fields read with ``getattr`` (a status without them samples 0 and the row says None): ``StageDescription.kv_bytes``
    / ``kv_reserved_bytes`` / ``open_streams`` (coordinator), ``GatewayStatus.vae_state_bytes`` and
    ``StreamStatus.vae_state_bytes`` (gateway)."""

    def __init__(self, coordinator: str, launcher, client, period: float = 0.5):
        super().__init__(period)
        self.coordinator, self.launcher, self.client = coordinator, launcher, client
        self.steps: dict[int, dict[int, int]] = {}  # pipeline stream id -> steps -> samples
        self.kv_per_stream: list[float] = []  # sum over stages of kv_bytes / open_streams
        self.kv_reserved_per_stream: list[float] = []
        self.vae_per_stream: list[float] = []  # gateway vae_state_bytes / its active streams
        self.vae_stream_bytes: list[int] = []  # each StreamStatus.vae_state_bytes seen
        self.priced: list[float] = []  # ClusterStatus.utilization: the SLO model's busy share of the open set
        self._stages: dict = {}  # stage address -> StageService stub

    def _describe(self, address: str):
        """A stage's own Describe (its actual KV bytes and open streams; the coordinator's copy may lag or be 0)."""
        from stagecast.internal.v1 import pipeline_pb2 as pb
        from stagecast.internal.v1 import pipeline_pb2_grpc as pb_grpc

        if address not in self._stages:
            self._stages[address] = pb_grpc.StageServiceStub(self.launcher.channel(address, "stage"))
        return self._stages[address].Describe(pb.Empty(), timeout=10)

    def _sample(self) -> None:
        status = coordinator_status(self.coordinator, self.launcher)
        if getattr(status, "utilization", 0.0) > 0:
            self.priced.append(float(status.utilization))
        for s in status.streams:
            per = self.steps.setdefault(int(s.stream_id), {})
            steps = int(getattr(s, "steps", 0))
            per[steps] = per.get(steps, 0) + 1
        kv = reserved = 0.0
        for st in status.stages:
            n = int(getattr(st, "open_streams", 0))
            actual = int(getattr(st, "kv_bytes", 0))
            if st.address:
                try:
                    d = self._describe(st.address)
                    n, actual = int(getattr(d, "open_streams", n)), int(getattr(d, "kv_bytes", actual))
                except Exception:  # noqa: BLE001 - the coordinator's copy then
                    self.errors += 1
            if n > 0:
                kv += actual / n
                reserved += getattr(st, "kv_reserved_bytes", 0) / n
        if kv:
            self.kv_per_stream.append(kv)
        if reserved:
            self.kv_reserved_per_stream.append(reserved)
        gw = self.client.status()
        total, active = int(getattr(gw, "vae_state_bytes", 0)), int(getattr(gw, "active_streams", 0))
        if total and active:
            self.vae_per_stream.append(total / active)
        self.vae_stream_bytes += [int(getattr(s, "vae_state_bytes", 0)) for s in gw.streams if s.vae_state_bytes]


class GpuBusy(Sampler):
    """While a measured window runs: how busy each visible GPU was, from NVML's utilization (the share of each
    sample period, 1/6 s to 1 s, in which any kernel ran, whichever process launched it), read every ``period``
    seconds.  It sees what admission's model cannot: the stages' forwards, the decoder's calls and whatever runs
    between them, together.  ``summary()``: None where NVML is missing (a CPU run, or no ``nvidia-ml-py``)."""

    def __init__(self, period: float = 0.25):
        super().__init__(period)
        self.samples: list[list[int]] = []  # per sample: each GPU's percent busy
        self._handles: list = []
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        except Exception:  # noqa: BLE001 - no NVML here: nothing to sample
            self._nvml = None
        self.active = bool(self._handles)

    def _sample(self) -> None:
        self.samples.append([int(self._nvml.nvmlDeviceGetUtilizationRates(h).gpu) for h in self._handles])

    def summary(self) -> dict | None:
        """Per GPU, the mean and the 10th and 90th percentiles of the samples (percent busy), and how many."""
        if not self.samples:
            return None
        per_gpu = list(zip(*self.samples))
        return {
            "mean_pct": [round(statistics.mean(g), 1) for g in per_gpu],
            "p10_pct": [percentile(list(g), 0.10) for g in per_gpu],
            "p90_pct": [percentile(list(g), 0.90) for g in per_gpu],
            "samples": len(self.samples),
        }


LATE_CAUSES = ("pipeline", "decode", "encode", "delivery")


def late_causes(rec: StreamRecord, late: list[tuple[int, float, float | None]]) -> dict | None:
    """Where each late frame's time went, from the gateway's stamps on its chunk (ms since the gateway got the stream's
    config, which the SDK's clock starts with to within the call's first hop): ``pipeline`` when the chunk's latents
    reached the gateway after the frame was due, else ``decode`` when its decode ended after it, else ``encode`` when
    the chunk's first frame was encoded after it, else ``delivery`` (the gateway's send and the network); ``missing``:
    a frame that never came.  Also, over every chunk the stream got, the ms from its latents to its decoded frames
    (p50, p95, max): a decoder that falls behind shows there before its frames are late.  None without the stamps."""
    chunks, frame_chunk = getattr(rec, "chunks", None), getattr(rec, "frame_chunk", None)
    if not chunks or frame_chunk is None:
        return None
    counts = dict.fromkeys((*LATE_CAUSES, "missing"), 0)
    for i, due, _ in late:
        stamps = chunks.get(frame_chunk[i]) if i < len(frame_chunk) else None
        if stamps is None:
            counts["missing"] += 1
            continue
        due_ms = due * 1e3
        after = [stamps["latents_ms"], stamps["decoded_ms"], stamps["encoded_ms"]]
        counts[next((c for c, t in zip(LATE_CAUSES, after) if t > due_ms), "delivery")] += 1
    waits = [c["decoded_ms"] - c["latents_ms"] for c in chunks.values()]
    return {
        "late_frames_by_cause": counts,
        "decode_wait_ms": {
            "p50": round(percentile(waits, 0.5), 1),
            "p95": round(percentile(waits, 0.95), 1),
            "max": round(max(waits), 1),
        },
    }


def late_totals(per_stream: list[dict]) -> dict | None:
    """A row's late frames by cause over its streams (``late_causes``), and the worst stream's p95 decode wait."""
    causes = [s["late_causes"] for s in per_stream if s.get("late_causes")]
    if not causes:
        return None
    return {
        "late_frames_by_cause": {
            k: sum(c["late_frames_by_cause"][k] for c in causes) for k in causes[0]["late_frames_by_cause"]
        },
        "decode_wait_ms_p95_max": max(c["decode_wait_ms"]["p95"] for c in causes),
    }


def capacity_stream(rec: StreamRecord, start: float, end: float, target_fps: float) -> dict:
    """One admitted stream of a capacity row.  ``start``/``end``: the measured window on the stream's own clock (all
    admitted streams running).  Frame i is due at the first frame's arrival + i / fps (the harness's rule); the
    stream is **held** when >= 99% of the frames due inside the window arrived by then."""
    arr = rec.arrivals
    # Every frame due by the end of the window, arrived or not (a frame that never came is late).
    due = [(i, arr[0] + i / target_fps) for i in range(int((end - arr[0]) * target_fps) + 1)] if arr else []

    def punctual(frames: list[tuple[int, float]]) -> float | None:
        return sum(i < len(arr) and arr[i] <= d + 1e-9 for i, d in frames) / len(frames) if frames else None

    in_window = [(i, d) for i, d in due if d >= start]
    on_time = punctual(in_window)
    # The window's late frames: how many, how late the worst was, and when the first was due (s into the window).
    late = [(i, d, (arr[i] - d) * 1e3 if i < len(arr) else None) for i, d in in_window if not punctual([(i, d)])]
    before_stop = [t for t in arr if t <= end]
    gaps = [(b - a) * 1e3 for a, b in zip(before_stop, before_stop[1:])]
    win = [t for t in arr if start <= t <= end]
    return {
        "pipeline_stream_id": rec.gen.info.pipeline_stream_id if arr else None,
        "ttff_s": rec.ttff_s,
        "ttff_parts_ms": (
            {k: round(v, 1) for k, v in ttff_parts(rec.first.timing, rec.ttff_s, rec.gen.info).items()}
            if rec.first is not None
            else None
        ),
        "frames": len(arr),
        "window_frames_due": len(in_window),
        "on_time": on_time,  # over the measured window
        "on_time_to_stop": punctual(due),  # from the first frame, the ramp included
        "held": on_time is not None and on_time >= 0.99 and rec.error is None,
        "late_frames": len(late),
        "late_max_ms": max((ms for _, _, ms in late if ms is not None), default=None),  # None: only frames never sent
        "late_first_s": late[0][1] - start if late else None,
        # The first late frames themselves, on the stream's own clock (s from its call, as ``start``): frame index,
        # when it was due, ms late (None: never came).  In a burst every call starts at once, so these line up
        # across streams with each one's TTFF, and say which chunk of which stream the start-up pushed late.
        "late_listed": [[i, round(d, 4), None if ms is None else round(ms, 1)] for i, d, ms in late[:LATE_LISTED]],
        "late_causes": late_causes(rec, late),
        "steady_fps": (len(win) - 1) / (win[-1] - win[0]) if len(win) > 2 and win[-1] > win[0] else None,
        "max_gap_ms": max(gaps) if gaps else None,
        "freezes": sum(g > FREEZE_MS for g in gaps),  # gaps over 250 ms from the first frame to the stop
        "frame_steps": {str(k): v for k, v in sorted(rec.steps.items())},
        "error": rec.error,
    }


def measure_capacity(client, launcher, coordinator: str, args, decoder: str, tag: str, pid: int | None) -> dict:
    """Capacity on one decoder: paced streams (``--target-fps``, SLO-adaptive with ``--load-min-steps``) opened one at
    a time, each once the previous one's first frame arrived, until admission refuses one or ``--capacity-max`` are
    open; then every admitted stream runs ``--capacity-seconds`` more (the measured window) and is stopped."""
    recs: list[StreamRecord] = []
    threads: list[threading.Thread] = []
    refusal, failure = None, None
    ramp: list[dict] = []  # stage stats from each admission to the next (k streams running, plus a first chunk)
    # What admission prices each stream's decode at (the gateway's measured VAE, or --slo-vae-ms): where the
    # coordinator does not price streams by their decoder, a tiny-decoder row is admitted at the full VAE's cost.
    priced = slo_model(coordinator_status(coordinator, launcher))
    snap = stage_stats(coordinator, launcher)
    t_open = time.monotonic()
    while len(recs) < args.capacity_max:
        rec = StreamRecord(client, args, None, f"cap {tag} {len(recs)}", pace=True, decoder=decoder)
        th = threading.Thread(target=rec.run, daemon=True)
        th.start()
        if not rec.started.wait(CAPACITY_FIRST_FRAME_S):
            rec.gen.cancel()
            th.join(30)
            failure = f"stream {len(recs) + 1}: no first frame in {CAPACITY_FIRST_FRAME_S:.0f} s"
            break
        if not rec.arrivals:  # ended before its first frame: refused, or failed
            th.join(30)
            info = {
                "stream": len(recs) + 1,
                "code": rec.error_code,
                "details": rec.error_details,
                "ms": rec.error_s * 1e3 if rec.error_s is not None else None,
                "retry_after_s": rec.retry_after,
            }
            if rec.error_code == "RESOURCE_EXHAUSTED":
                refusal = info
            else:
                failure = f"stream {len(recs) + 1}: {rec.error}"
                refusal = info
            break
        recs.append(rec)
        threads.append(th)
        now = stage_stats(coordinator, launcher)
        ramp.append({"streams": len(recs) - 1, "stages": stage_delta(snap, now)})
        snap = now
        log(f"capacity {decoder}: stream {len(recs)} admitted (TTFF {rec.ttff_s * 1e3:.0f} ms)")
    ramp = ramp[1:]  # the first entry holds only stream 1's first chunk
    t_all = time.monotonic()
    before = stage_stats(coordinator, launcher)
    cpu0 = process_cpu_s(pid)
    with StatusSampler(coordinator, launcher, client) as sampler, GpuBusy() as busy:
        time.sleep(args.capacity_seconds if recs else 0.0)
    cpu1 = process_cpu_s(pid)
    t_end = time.monotonic()
    after = stage_stats(coordinator, launcher)
    priced_end = slo_model(coordinator_status(coordinator, launcher))  # as learned over the window
    for rec in recs:
        rec.gen.stop()
    deadline = time.monotonic() + 60  # chunks in flight still arrive; a stream that does not end is cancelled
    for rec, th in zip(recs, threads):
        th.join(max(0.0, deadline - time.monotonic()))
        if th.is_alive():
            rec.gen.cancel()
            th.join(10)
    per_stream = [capacity_stream(r, t_all - r.gen.t0, t_end - r.gen.t0, args.target_fps) for r in recs]
    held = sum(s["held"] for s in per_stream)
    frames = sum(s["window_frames_due"] for s in per_stream)  # frames delivered over the window (paced: one per due)
    delivered = sum(sum(t_all - r.gen.t0 <= t <= t_end - r.gen.t0 for t in r.arrivals) for r in recs)
    ttffs = [r.ttff_s for r in recs if r.ttff_s is not None]
    stages = stage_delta(before, after)
    chosen: dict[str, int] = {}
    for r in recs:
        for steps, n in sampler.steps.get(int(r.gen.info.pipeline_stream_id), {}).items():
            chosen[str(steps)] = chosen.get(str(steps), 0) + n
    refused_at_once = refusal is not None and refusal["code"] == "RESOURCE_EXHAUSTED"
    exact = refused_at_once and held == len(recs) and failure is None
    if exact:
        verdict = f"capacity {held}: every admitted stream held, stream {len(recs) + 1} refused"
    elif refusal is None and failure is None:
        verdict = f"no refusal up to --capacity-max {args.capacity_max}: {held} of {len(recs)} held"
    elif failure is not None:
        verdict = f"failed: {failure}; {held} of {len(recs)} held"
    else:
        verdict = f"admitted but not held: {held} of {len(recs)} admitted streams held"
    mean = statistics.mean
    return {
        "decoder": decoder,
        "max": args.capacity_max,
        "seconds": args.capacity_seconds,
        "window_s": t_end - t_all,
        "ramp_s": t_all - t_open,
        "admitted": len(recs),
        "held": held,
        "capacity": held if exact else None,
        "verdict": verdict,
        "refusal": refusal,
        "failure": failure,
        "slo_model": priced,
        "slo_model_end": priced_end,
        "ttff_p50_s": statistics.median(ttffs) if ttffs else None,
        "ttff_p95_s": percentile(ttffs, 0.95) if ttffs else None,
        # Where the slowest first frame's time went (``ttff_parts``): the one the p95 stands for at a few streams.
        "ttff_slowest_parts_ms": max(
            (s for s in per_stream if s["ttff_s"] is not None), key=lambda s: s["ttff_s"], default={}
        ).get("ttff_parts_ms"),
        "steady_fps_min": min((s["steady_fps"] or 0.0 for s in per_stream), default=None),
        "on_time_min": min((s["on_time"] or 0.0 for s in per_stream), default=None),
        "freezes": sum(s["freezes"] for s in per_stream),
        "steps_chosen": chosen,  # coordinator status samples per step count, over every admitted stream
        "stages": stages,
        "mean_batch": max((s["mean_batch"] for s in stages if s["mean_batch"]), default=None),
        "ramp": ramp,
        "memory": {
            "decoder_state_bytes_per_stream": max(sampler.vae_per_stream) if sampler.vae_per_stream else None,
            "decoder_state_bytes_stream_max": max(sampler.vae_stream_bytes) if sampler.vae_stream_bytes else None,
            "kv_bytes_per_stream": max(sampler.kv_per_stream) if sampler.kv_per_stream else None,
            "kv_reserved_bytes_per_stream": (
                mean(sampler.kv_reserved_per_stream) if sampler.kv_reserved_per_stream else None
            ),
            "samples_missed": sampler.errors,
        },
        "gateway_cpu_s": None if cpu0 is None or cpu1 is None else cpu1 - cpu0,
        "gpu_busy": busy.summary(),  # NVML over the window: what the admitted set really kept each GPU busy
        # What admission's model priced the same set at over the window (its bottleneck's busy share, percent).
        "priced_busy_pct": round(100 * mean(sampler.priced), 1) if sampler.priced else None,
        "frames_delivered": delivered,
        "frames_due": frames,
        "gateway_cpu_ms_per_frame": (
            (cpu1 - cpu0) * 1e3 / delivered if cpu0 is not None and cpu1 is not None and delivered else None
        ),
        "late_causes": late_totals(per_stream),
        "per_stream": per_stream,
    }


def wait_idle(client, coordinator: str, launcher, timeout: float = 60.0) -> None:
    """Until neither the gateway nor the coordinator holds a stream (between two capacity rows)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if client.status().active_streams == 0 and not coordinator_status(coordinator, launcher).streams:
                return
        except Exception:  # noqa: BLE001 - try again
            pass
        time.sleep(0.25)
