"""The gateway's VAE cost for the coordinator's SLO model: one chunk's steady-state decode on the busiest GPU.

Usage (the gateway runs it after its warm-up, then reports it with ``CoordinatorService.ReportVaeCost``)::

    cost = measure_vae(decoder.parts, latent_shape=(1, 16, 1, 60, 104))
    cost.chunk_ms, cost.device                          # the slowest decoder part's ms per chunk, and where it runs
    cost.state_bytes                                    # one stream's caches after the steady chunks
    tiny = tiny_cost(batched, latent_shape)             # the batched tiny decoder: ms per stream at each batch size,
                                                        # and the streams per call its recent calls held
    VaeReporter(stub, lambda: [cost, tiny_cost(batched, latent_shape)]).start(); ...; reporter.stop()

Each decoder kind is reported on its own (``VaeCost.decoder``: "full", "tiny"); the coordinator prices each stream
by the decoder it runs on (``OpenStreamRequest.decoder``).  The reporter sends every cost at once, again whenever one
changed materially (``MATERIAL_CHANGE``, checked every ``CHECK_EVERY_S``: the batched decoder's averages move as
batches form while serving), and every ``REPORT_EVERY_S`` anyway.

The decoder may be cut into parts on several GPUs (``--vae-devices``, ``--vae-split``), each running beside a stage
on that GPU.  A chunk passes every part, so the GPU that limits the rate is the one whose part takes longest: that
part's ms is what each chunk costs the busiest stage GPU (``CostModel.chunk_ms``).  Each part is timed on its own
device (CUDA events on a GPU, wall time on a CPU) over chunks after the first two (latent frame 0 and the cache
filling are not the steady state), on fresh per-stream states that are released afterwards: no stream's cache and no
global random generator is touched.  A VAE on the CPU is measured too, with its frames' encode added (``with_encode``):
the coordinator counts it only where the stages share that CPU (``coordinator.slo``, "A CPU host").
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import grpc
import torch

from stagecast.internal.v1 import pipeline_pb2 as pb

logger = logging.getLogger(__name__)

STEADY_FROM = 2  # chunks before this are not timed: frame 0 and the first chunk after it fill the caches
REPORT_EVERY_S = 30.0  # the report is sent again this often (a restarted coordinator hears it again)
CHECK_EVERY_S = 2.0  # how often the reporter looks for a changed cost
MATERIAL_CHANGE = 0.1  # a cost whose chunk_ms or any batch_ms moved by this fraction is sent again at once


@dataclass(frozen=True)
class VaeCost:
    chunk_ms: float  # the slowest part's median steady-state ms per chunk
    part_ms: tuple[float, ...]  # each part's
    device: str  # where the slowest part runs
    latent_shape: tuple[int, ...]
    decoder: str = "full"  # "full" (the Wan VAE) or "tiny"
    batch_ms: tuple[float, ...] = ()  # [i]: per-stream ms per chunk at i + 1 streams in one call (batched decoders)
    state_bytes: int = 0  # one stream's decoder state (0: not known)
    formed_batch: float = 0.0  # streams per call of the recent calls served (batched decoders; 0: none yet)
    encode_ms: float = 0.0  # of chunk_ms, the frames' encode (a decoder on the CPU: ``with_encode``)

    def to_proto(self) -> pb.VaeCost:
        return pb.VaeCost(
            chunk_ms=self.chunk_ms,
            parts=len(self.part_ms),
            latent_height=self.latent_shape[-2],
            latent_width=self.latent_shape[-1],
            device=self.device,
            decoder=self.decoder,
            batch_ms=list(self.batch_ms),
            state_bytes=int(self.state_bytes),
            formed_batch=float(self.formed_batch),
        )

    def differs(self, other: VaeCost | None, fraction: float = MATERIAL_CHANGE) -> bool:
        """Whether ``other`` (the one last sent) is off by more than ``fraction`` anywhere that prices a stream."""
        if other is None or len(other.batch_ms) != len(self.batch_ms) or other.state_bytes != self.state_bytes:
            return True
        pairs = [
            (self.chunk_ms, other.chunk_ms),
            (self.formed_batch, other.formed_batch),
            *zip(self.batch_ms, other.batch_ms, strict=True),
        ]
        return any(abs(a - b) > fraction * max(abs(b), 1e-9) for a, b in pairs)


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
    held = 0
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
        held = sum(_state_bytes(state) for state in states)
    finally:
        for part, state in zip(parts, states, strict=True):
            part.release(state)
    if not parts or not all(samples):
        return None
    per = tuple(statistics.median(s) for s in samples)
    slowest = max(range(len(parts)), key=per.__getitem__)
    return VaeCost(per[slowest], per, str(parts[slowest].device), tuple(latent_shape), state_bytes=held)


def with_encode(cost: VaeCost, encode_ms: float) -> VaeCost:
    """A CPU decoder's cost with its frames' encode per chunk added (on one CPU host they share the cores)."""
    return replace(cost, chunk_ms=cost.chunk_ms + max(0.0, encode_ms), encode_ms=max(0.0, encode_ms))


def _state_bytes(state) -> int:
    held = getattr(state, "approx_bytes", 0)
    return int(held() if callable(held) else held)


def tiny_cost(decoder, latent_shape: tuple[int, ...], up_to: int | None = None) -> VaeCost | None:
    """The batched tiny decoder's (``gateway.decode.batched_decoder``) cost as it stands: per-stream ms at each batch
    size
    (start-up measurements merged with the calls served), ``chunk_ms`` one stream alone, and the streams its recent
    calls held; None before any is known."""
    batch = decoder.batch_ms(up_to)
    if not batch:
        return None
    return VaeCost(
        chunk_ms=batch[0],
        part_ms=(batch[0],),
        device=str(decoder.part.device),
        latent_shape=tuple(latent_shape),
        decoder="tiny",
        batch_ms=tuple(batch),
        state_bytes=decoder.state_bytes_at((latent_shape[-2], latent_shape[-1])),
        formed_batch=decoder.formed_batch(),
    )


class VaeReporter:
    """Sends the measured costs to the coordinator in a daemon thread: at once (retrying while it is unreachable),
    again as soon as one changed materially, and every ``every_s`` anyway so that a restarted coordinator hears them.

    ``costs`` is a ``VaeCost``, a list of them (one per decoder kind) or a callable giving the current list (Nones
    are skipped: a cost not known yet)."""

    def __init__(
        self,
        stub,
        costs: VaeCost | list[VaeCost] | Callable[[], list[VaeCost | None]],
        every_s: float = REPORT_EVERY_S,
        check_every_s: float = CHECK_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        if isinstance(costs, VaeCost):
            costs = [costs]
        self.current = costs if callable(costs) else (lambda fixed=list(costs): fixed)
        self.stub, self.every_s, self.check_every_s, self.clock = stub, every_s, check_every_s, clock
        self.sent: dict[str, tuple[VaeCost, float]] = {}  # decoder kind -> (what the coordinator accepted, when)
        self.stop_event = threading.Event()
        self.reported = threading.Event()  # set after the first report the coordinator accepted
        self.thread = threading.Thread(target=self._run, daemon=True, name="vae-cost-report")

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stop_event.set()
        if self.thread.is_alive():
            self.thread.join(5.0)

    def due(self) -> list[VaeCost]:
        """The costs to send now: never sent, changed materially since sent, or sent ``every_s`` ago."""
        now = self.clock()
        out = []
        for cost in self.current():
            if cost is None:
                continue
            last = self.sent.get(cost.decoder)
            if last is None or cost.differs(last[0]) or now - last[1] >= self.every_s:
                out.append(cost)
        return out

    def send_due(self) -> int:
        """Send what is due; returns how many were sent. Raises grpc.RpcError when the coordinator cannot be
        reached (what was sent before stays sent)."""
        sent = 0
        for cost in self.due():
            self.stub.ReportVaeCost(cost.to_proto(), timeout=5.0)
            first = cost.decoder not in self.sent
            self.sent[cost.decoder] = (cost, self.clock())
            sent += 1
            if first:
                logger.info(
                    "reported the %s decoder's cost to the coordinator: %.2f ms per chunk%s",
                    cost.decoder,
                    cost.chunk_ms,
                    f" alone, per stream at batches 1..{len(cost.batch_ms)}: "
                    + ", ".join(f"{ms:.2f}" for ms in cost.batch_ms)
                    if cost.batch_ms
                    else "",
                )
        return sent

    def _run(self) -> None:
        delay, failures = 0.0, 0
        while not self.stop_event.wait(delay):
            try:
                self.send_due()
            except grpc.RpcError as exc:
                failures += 1
                if failures == 1 or failures % 30 == 0:
                    logger.info("VAE cost report to the coordinator: %s (retrying)", exc.code().name)
                delay = min(10.0, 0.5 * 2 ** min(failures, 5))
                continue
            if self.sent:
                self.reported.set()
            failures, delay = 0, min(self.check_every_s, self.every_s)
