"""The gateway's VAE cost for the coordinator's SLO model: one chunk's steady-state decode on the busiest GPU.

Usage (the gateway runs it after its warm-up, then reports it with ``CoordinatorService.ReportVaeCost``)::

    cost = measure_vae(decoder.parts, latent_shape=(1, 16, 1, 60, 104))
    cost.chunk_ms, cost.device                          # the slowest decoder part's ms per chunk, and where it runs
    VaeReporter(stub, cost).start(); ...; reporter.stop()

The decoder may be cut into parts on several GPUs (``--vae-devices``, ``--vae-split``), each running beside a stage
on that GPU.  A chunk passes every part, so the GPU that limits the rate is the one whose part takes longest: that
part's ms is what each chunk costs the busiest stage GPU (``CostModel.chunk_ms``).  Each part is timed on its own
device (CUDA events on a GPU, wall time on a CPU) over chunks after the first two (latent frame 0 and the cache
filling are not the steady state), on fresh per-stream states that are released afterwards: no stream's cache and no
global random generator is touched.  The gateway measures only a VAE on GPUs (``Gateway._measure_vae``): a VAE on
the CPU takes none of the stage GPUs' time.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import torch

from stagecast.internal.v1 import pipeline_pb2 as pb

logger = logging.getLogger(__name__)

STEADY_FROM = 2  # chunks before this are not timed: frame 0 and the first chunk after it fill the caches
REPORT_EVERY_S = 30.0  # the report is sent again this often (a restarted coordinator hears it again)


@dataclass(frozen=True)
class VaeCost:
    chunk_ms: float  # the slowest part's median steady-state ms per chunk
    part_ms: tuple[float, ...]  # each part's
    device: str  # where the slowest part runs
    latent_shape: tuple[int, ...]

    def to_proto(self) -> pb.VaeCost:
        return pb.VaeCost(
            chunk_ms=self.chunk_ms,
            parts=len(self.part_ms),
            latent_height=self.latent_shape[-2],
            latent_width=self.latent_shape[-1],
            device=self.device,
        )


def _time_on(device: torch.device, fn: Callable[[], torch.Tensor]) -> tuple[float, torch.Tensor]:
    if device.type == "cuda":
        with torch.cuda.device(device):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            end.record()
            end.synchronize()
            return float(start.elapsed_time(end)), out
    t0 = time.perf_counter()
    out = fn()
    return (time.perf_counter() - t0) * 1e3, out


def measure_vae(
    parts: list,
    latent_shape: tuple[int, ...],
    *,
    chunks: int = 5,
    budget_s: float = 10.0,
    timer: Callable[[torch.device, Callable[[], torch.Tensor]], tuple[float, torch.Tensor]] = _time_on,
    clock: Callable[[], float] = time.perf_counter,
) -> VaeCost | None:
    """Decode ``chunks`` chunks of random latents through ``parts`` (``ChunkDecoder`` s in order) and time each part
    per chunk; None when no steady-state chunk was decoded within ``budget_s`` (checked before each chunk).
    ``timer(device, fn) -> (ms, result)`` and ``clock`` are for tests."""
    if chunks <= STEADY_FROM:
        raise ValueError(f"chunks must be > {STEADY_FROM}, got {chunks}")
    gen = torch.Generator(device="cpu").manual_seed(0)
    states = [part.new_state() for part in parts]
    samples: list[list[float]] = [[] for _ in parts]
    started = clock()
    try:
        for c in range(chunks):
            if c > STEADY_FROM and clock() - started > budget_s:
                break
            x = torch.randn(latent_shape, generator=gen)
            for i, part in enumerate(parts):
                ms, x = timer(part.device, lambda part=part, state=states[i], x=x: part.decode_chunk(state, x))
                if c >= STEADY_FROM:
                    samples[i].append(ms)
    finally:
        for part, state in zip(parts, states, strict=True):
            part.release(state)
    if not parts or not all(samples):
        return None
    per = tuple(statistics.median(s) for s in samples)
    slowest = max(range(len(parts)), key=per.__getitem__)
    return VaeCost(per[slowest], per, str(parts[slowest].device), tuple(latent_shape))


class VaeReporter:
    """Sends the measured cost to the coordinator in a daemon thread: at once (retrying while it is unreachable), then
    every ``every_s`` so that a restarted coordinator hears it again."""

    def __init__(self, stub, cost: VaeCost, every_s: float = REPORT_EVERY_S):
        self.stub, self.cost, self.every_s = stub, cost, every_s
        self.stop_event = threading.Event()
        self.reported = threading.Event()  # set after the first report the coordinator accepted
        self.thread = threading.Thread(target=self._run, daemon=True, name="vae-cost-report")

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stop_event.set()
        if self.thread.is_alive():
            self.thread.join(5.0)

    def _run(self) -> None:
        delay, failures = 0.0, 0
        while not self.stop_event.wait(delay):
            try:
                self.stub.ReportVaeCost(self.cost.to_proto(), timeout=5.0)
            except grpc.RpcError as exc:
                failures += 1
                if failures == 1 or failures % 30 == 0:
                    logger.info("VAE cost report to the coordinator: %s (retrying)", exc.code().name)
                delay = min(10.0, 0.5 * 2 ** min(failures, 5))
                continue
            if not self.reported.is_set():
                logger.info("reported the VAE cost to the coordinator: %.2f ms per chunk", self.cost.chunk_ms)
            self.reported.set()
            failures, delay = 0, self.every_s
