"""Every stream's ready chunk in one decode call: the tiny decoder shared by all streams of a gateway.

Usage (the surface of ``gateway.decode.decoder.LocalDecoder``; ``gateway.stream.run`` drives a session from two
threads)::

    decoder = BatchedDecoder(load_tiny_decoder(path, device="cuda", dtype=torch.float16, compile=True),
                             buckets=(1, 2, 3, 4, 8, 16))
    decoder.warm((1, 16, 1, 60, 104))      # before serving: every bucket's compiled pass built, and timed
    session = decoder.open(capacity=4, paced=True)
    session.submit(tag, latents)           # producer thread; blocks while ``capacity`` chunks wait
    session.finish()
    for tag, frames, when in session.results():  # (n, H, W, 3) uint8 numpy, in submit order
        ...
    session.abort(); session.close()       # close frees the stream's state (after a batch holding its chunk)
    decoder.batch_ms(16)                   # per-stream ms per chunk at 1..16 streams in one call
    decoder.close()

One worker thread per decoder. Each round it takes, from every open session whose previous chunk is done and whose
results have room, its oldest chunk (so a stream's chunks decode strictly in order, one per call): paced streams' first,
then unpaced ones, each by how long their chunk has waited, at most ``max_batch`` in all; an unpaced flood therefore
never pushes a paced stream's chunk out of a call. Chunks one pipeline batch finished (``ChunkTag.batch_seq``, with
``batch_chunks`` of them) reach the gateway one stream at a time: a round whose ready chunks all belong to such batches,
some of whose chunks have not arrived yet, waits for them, at most ``SIBLING_WAIT_NS`` after a batch's first, so that
the batch decodes in one call; and a call that starts for other chunks leaves a batch still arriving to the next. The
chunks are grouped by latent shape, each group is one ``decode_batch`` call (on a GPU
padded up to the next of ``buckets``, so a compiled pass sees few batch sizes), its video becomes uint8 on the device,
one copy brings all of it to the host, and each stream's frames go to its session's results. A chunk that fails alone
(bad shape, another size than its stream's) fails only its stream; a group whose call fails is decoded again stream by
stream (``decode_batch`` changes no state before it finishes), so that only the streams that fail alone fail. Waiting is
on one condition variable, never by polling.

Costs: every call is timed, its uint8 conversion and copy to the host included (CUDA events on a GPU, wall time on a
CPU), and each batch size's cost is the least per-stream ms among its recent calls once it has a few (``BatchTimes``):
the call that waited least for other work on the GPU.  On a GPU the decoder shares with the DiT stage, a call's time
also holds the stage's kernels that ran between its own, which the stage's measured forwards count already (the SLO
model adds both); the least-waiting call is the decoder's own work under the conditions it serves in.  ``warm``
measures each bucket before serving.  ``batch_ms`` merges both for the coordinator's SLO model
(``VaeCost.batch_ms``, ``gateway.decode.vae_cost``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

import numpy as np
import torch

from gateway.decode.tiny_decoder import MAX_BATCH, TinyStreamDecoder, tiny_to_uint8_frames

logger = logging.getLogger(__name__)

# Bucket 3: a Stream Batch of 3 (which ``pick_batch`` may choose) hands the decoder calls of 3, which bucket 4 padded
# (one H200, r24 at 619ccb5: 229 of 311 calls held 3 streams, each run at the 4-stream cost, 11.8 ms against 6.8 for 2).
DEFAULT_BUCKETS = (1, 2, 3, 4, 8, 16)
# With --tiny-cuda-graphs, the buckets up to this many streams a call replay CUDA graphs (serving forms 1-4); each
# graph holds its rows' memory in and out (64 MiB a stream at 480x832), so larger buckets stay compiled kernels.
GRAPHED_MAX_ROWS = 4


def graphed_rows(buckets: tuple[int, ...]) -> list[int]:
    """The buckets whose passes ``--tiny-cuda-graphs`` captures."""
    return [r for r in buckets if r <= GRAPHED_MAX_ROWS]


OUT_CAPACITY = 2  # decoded chunks a session holds for its consumer before the worker skips it
SERVED_WINDOW = 32  # a batch size's recent served calls, the least of which is its cost
# Served calls of a size before they replace its start-up measurement (one call is one sample of how long it waited).
SERVED_MIN = 3
MAX_CAPACITY = 1024  # chunks a session may hold waiting
REPORTED_BATCH = 16  # batch sizes whose cost is reported (VaeCost.batch_ms) by default
FORMED_CALLS = 64  # the recent calls whose streams per call are reported (VaeCost.formed_batch)
# How long a chunk waits for the other chunks its pipeline batch finished (ChunkTag.batch_chunks) to arrive, so that
# one call decodes them together: the coordinator sends them one stream at a time, a millisecond or so apart.
SIBLING_WAIT_NS = 5_000_000
BATCH_RECORD_NS = 1_000_000_000  # how long a pipeline batch's arrivals are remembered


def _held_bytes(state) -> int:
    return 0 if state.released else state.approx_bytes


class _Failure:
    def __init__(self, exc: BaseException):
        self.exc = exc


class BatchTimes:
    """Per-stream ms per chunk at each batch size: measured at start-up (per bucket, the whole call's ms) and the
    least of the last ``window`` calls served since, once ``min_calls`` were: a slow call (a compile, a stall, or
    waiting for another process's kernels on a shared GPU, which that process's own times count) does not become a
    size's cost.  Thread-safe."""

    def __init__(self, window: int = SERVED_WINDOW, *, min_calls: int = SERVED_MIN, padded: bool = True):
        if window < 1 or not 1 <= min_calls <= window:
            raise ValueError(f"window must be >= 1 and min_calls in [1, window], got {window} and {min_calls}")
        self.window, self.min_calls = window, min_calls
        self.padded = padded  # calls run at the measured sizes (buckets); else at any size, interpolated
        self.lock = threading.Lock()
        self.samples: dict[int, deque[float]] = {}  # streams in the call -> recent per-stream ms
        self.measured: dict[int, float] = {}  # rows of the call (a bucket) -> whole call's ms
        self.calls: dict[int, int] = {}

    def record(self, streams: int, call_ms: float) -> None:
        with self.lock:
            self.samples.setdefault(streams, deque(maxlen=self.window)).append(call_ms / streams)
            self.calls[streams] = self.calls.get(streams, 0) + 1

    def set_measured(self, rows: int, call_ms: float) -> None:
        with self.lock:
            self.measured[rows] = call_ms

    def per_stream_ms(self, up_to: int) -> list[float]:
        """[i]: per-stream ms with i + 1 streams in a call: served if seen, else from the start-up measurements:
        padded, the smallest measured batch of at least i + 1 rows shared by i + 1 streams (what padding to it
        costs); not padded, the call's ms interpolated between the measured sizes around i + 1; past the largest
        measured size its per-stream cost; with no measurement the nearest served size's.  Empty when nothing is
        known."""
        with self.lock:
            measured = dict(self.measured)
            served = {  # with no measurement, any served size is better than nothing
                n: min(d) for n, d in self.samples.items() if len(d) >= self.min_calls or not measured
            }
        if not served and not measured:
            return []
        out = []
        for n in range(1, up_to + 1):
            if n in served:
                out.append(served[n])
                continue
            above = [r for r in measured if r >= n]
            below = [r for r in measured if r <= n]
            if above and (self.padded or not below):
                out.append(measured[min(above)] / n)
            elif above:
                lo, hi = max(below), min(above)
                call = measured[lo] if lo == hi else measured[lo] + (measured[hi] - measured[lo]) * (n - lo) / (hi - lo)
                out.append(call / n)
            elif measured:
                top = max(measured)
                out.append(measured[top] / top)  # beyond the largest bucket: at least its per-stream cost
            else:
                near = min(served, key=lambda k: abs(k - n))
                out.append(served[near])
        return out


class BatchedDecoder:
    """A ``TinyStreamDecoder`` shared by every stream through one worker thread (module docstring)."""

    takes_latents = True

    def __init__(
        self,
        part: TinyStreamDecoder,
        *,
        max_batch: int | None = None,
        buckets: tuple[int, ...] | None = None,
        timer=None,
    ):
        if buckets is not None:
            buckets = tuple(sorted(set(buckets)))
            if not buckets or buckets[0] < 1 or buckets[-1] > MAX_BATCH:
                raise ValueError(f"buckets must be batch sizes in 1..{MAX_BATCH}, got {buckets}")
        limit = buckets[-1] if buckets else MAX_BATCH
        max_batch = limit if max_batch is None else max_batch
        if not 1 <= max_batch <= limit:
            raise ValueError(f"max_batch must be in 1..{limit} (the largest bucket or MAX_BATCH), got {max_batch}")
        self.part = part
        self.parts = [part]  # as LocalDecoder's: what the gateway's warm-up and cost measurement look at
        self.max_batch = max_batch
        self.buckets = buckets
        self.times = BatchTimes(padded=buckets is not None)
        self._timer = timer  # tests: () -> (start(), stop() -> ms)
        self.cond = threading.Condition()
        self.sessions: list[BatchedSession] = []
        self.closed = False
        self.calls = 0  # decode_batch calls made
        self.batch_sizes: list[int] = []  # streams per call, the last 1000
        self._seq = 0
        # Pipeline batch (ChunkTag.batch_seq) -> [its chunks, those arrived here, the first arrival's ns] (under cond).
        self._batches: dict[int, list[int]] = {}
        self.sibling_waits = 0  # times the worker waited for a pipeline batch's other chunks
        self.worker = threading.Thread(target=self._run, daemon=True, name="tiny-decode")
        self.worker.start()

    @classmethod
    def tiny(cls, path, *, compile: bool = False, buckets: tuple[int, ...] | None = None, **checks) -> BatchedDecoder:
        """The checked tiny decoder (``gateway.decode.decoder.load_checked_tiny``, given ``checks``: its device, dtype
        and the
        geometry it must fit) behind one worker; compiled on a GPU, padded to ``buckets`` (default
        ``DEFAULT_BUCKETS``), else not padded."""
        from gateway.decode.decoder import load_checked_tiny

        part = load_checked_tiny(path, compile=compile, **checks)
        if buckets is None and part.device.type == "cuda" and compile:
            buckets = DEFAULT_BUCKETS  # eager kernels take any batch: padding would only add work
        if compile:
            allow_variants(len(buckets or DEFAULT_BUCKETS))
        return cls(part, buckets=buckets)

    # ---- the LocalDecoder surface -----------------------------------------------------------------------------

    def open(self, capacity: int, paced: bool = False) -> BatchedSession:
        if not 1 <= capacity <= MAX_CAPACITY:
            raise ValueError(f"capacity must be in 1..{MAX_CAPACITY}, got {capacity}")
        with self.cond:
            if self.closed:
                raise RuntimeError("the batched decoder is closed")
            self._seq += 1
            session = BatchedSession(self, capacity, paced, self._seq)
            self.sessions.append(session)
            return session

    def depth(self, capacity: int) -> int:
        """Chunks a stream needs queued here: the one in a call and the next one waiting."""
        return min(2, capacity + 1)

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        if self.worker is not threading.current_thread():
            self.worker.join()

    # ---- costs --------------------------------------------------------------------------------------------------

    def batch_ms(self, up_to: int | None = None) -> list[float]:
        """Per-stream ms per chunk at 1..``up_to`` streams per call (default: ``max_batch``, at most
        ``REPORTED_BATCH``)."""
        return self.times.per_stream_ms(up_to or min(self.max_batch, REPORTED_BATCH))

    def formed_batch(self, calls: int = FORMED_CALLS) -> float:
        """Streams per call over the last ``calls`` calls (0.0 before any): the batch serving forms, which the
        coordinator prices streams at (paced streams' chunks are ready at different times)."""
        with self.cond:
            recent = self.batch_sizes[-calls:]
        return sum(recent) / len(recent) if recent else 0.0

    def formed_summary(self) -> str:
        """The streams per call of the recent calls (``batch_sizes``), counted by size, and the sibling waits: one
        log line a closed stream (why serving forms the batches it does)."""
        with self.cond:
            sizes, waits, calls = list(self.batch_sizes), self.sibling_waits, self.calls
        counts = {n: sizes.count(n) for n in sorted(set(sizes))}
        by_size = ", ".join(f"{n}: {c}" for n, c in counts.items()) or "none"
        return (
            f"tiny decoder: {calls} calls; the last {len(sizes)} by streams a call {{{by_size}}}; "
            f"{waits} waits for a pipeline batch's other chunks"
        )

    def bucket(self, n: int) -> int:
        """The batch size a call of ``n`` streams runs at."""
        if self.buckets is None:
            return n
        return next((b for b in self.buckets if b >= n), n)

    @torch.no_grad()
    def warm(self, latent_shape: tuple[int, ...], chunks: int = 4, *, graphs: bool = False) -> dict[int, float]:
        """Before serving: ``chunks`` chunks at every bucket (or batch sizes 1, 2, 4, .. up to ``max_batch`` without
        buckets) on fresh scratch states, so that every compiled variant is built now, and the steady chunks (from
        the third) timed: returns rows -> median ms of a call, also kept for ``batch_ms``.  ``graphs``: then the
        passes of the buckets up to ``GRAPHED_MAX_ROWS`` streams are captured as CUDA graphs
        (``TinyStreamDecoder.capture_graphs``) and every bucket is timed again, as it will run."""
        from gateway.decode.vae_cost import STEADY_FROM

        if chunks <= STEADY_FROM:
            raise ValueError(f"chunks must be > {STEADY_FROM}, got {chunks}")
        sizes = self.buckets or tuple(b for b in DEFAULT_BUCKETS if b <= self.max_batch)
        out = self._time_sizes(sizes, latent_shape, chunks, STEADY_FROM)
        if graphs:
            graphed = self.part.capture_graphs((latent_shape[-2], latent_shape[-1]), graphed_rows(sizes))
            logger.info("tiny decoder: CUDA graphs for %s streams a call", graphed or "no")
            out = self._time_sizes(sizes, latent_shape, chunks, STEADY_FROM)
        logger.info(
            "tiny decoder batches (%s latents): %s",
            "x".join(map(str, latent_shape[2:])),
            ", ".join(f"{r} streams {ms:.2f} ms ({ms / r:.2f} each)" for r, ms in out.items()),
        )
        return out

    def _time_sizes(
        self, sizes: tuple[int, ...], latent_shape: tuple[int, ...], chunks: int, steady_from: int
    ) -> dict[int, float]:
        gen = torch.Generator(device="cpu").manual_seed(0)
        out = {}
        for rows in sizes:
            states = [self.part.new_state() for _ in range(rows)]
            samples = []
            try:
                for c in range(chunks):
                    xs = [torch.randn(latent_shape, generator=gen) for _ in range(rows)]
                    start, stop = self._start_timer()
                    start()
                    to_host_uint8(self.part.decode_batch(states, xs, pad_to=rows))
                    ms = stop()
                    if c >= steady_from:
                        samples.append(ms)
            finally:
                for s in states:
                    self.part.release(s)
            out[rows] = float(np.median(samples))
            self.times.set_measured(rows, out[rows])
        return out

    def state_bytes_at(self, latent_hw: tuple[int, int]) -> int:
        """One stream's state for latents of ``latent_hw`` (what admission counts per tiny stream)."""
        return self.part.model.state_bytes(latent_hw, torch.empty(0, dtype=self.part.dtype).element_size())

    def _start_timer(self):
        if self._timer is not None:
            return self._timer()
        if self.part.device.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

            def stop() -> float:
                end.record()
                end.synchronize()
                return float(begin.elapsed_time(end))

            return begin.record, stop
        t0 = [0.0]

        def start() -> None:
            t0[0] = time.perf_counter()

        return start, lambda: (time.perf_counter() - t0[0]) * 1e3

    # ---- the worker ---------------------------------------------------------------------------------------------

    def _ready(self) -> list[BatchedSession]:
        """Sessions with a chunk to decode, paced first, each kind oldest chunk first (under the lock)."""
        ready = [s for s in self.sessions if s._ready()]
        ready.sort(key=lambda s: (not s.paced, s.pending[0][2], s.seq))
        return ready

    def _due(self, session: BatchedSession, now: int) -> bool:
        """Whether the session's next chunk may go into a call now (under the lock): its pipeline batch has all
        arrived here, was never announced, or has waited ``SIBLING_WAIT_NS`` since its first chunk arrived."""
        entry = self._batches.get(getattr(session.pending[0][0], "batch_seq", 0))
        return entry is None or entry[1] >= entry[0] or now - entry[2] >= SIBLING_WAIT_NS

    def _take(self) -> list[BatchedSession]:
        """The sessions whose chunks the next call decodes (under the lock): the ready ones that are due, in
        ``_ready``'s order (paced first), at most ``max_batch``.  The chunks of a batch still arriving stay for the
        next call, so that a batch is not split between two calls (on a CPU pipeline, a call that started for a
        complete batch took the first chunk of the next, whose sibling arrived 0.2 ms later and was decoded alone)."""
        now = time.monotonic_ns()
        return [s for s in self._ready() if self._due(s, now)][: self.max_batch]

    def _arrived(self, tag) -> None:
        """A chunk reached a session (under the lock): counted in its pipeline batch's arrivals."""
        seq, chunks = getattr(tag, "batch_seq", 0), getattr(tag, "batch_chunks", 0)
        if seq and chunks > 1:
            now = time.monotonic_ns()
            for old in [k for k, (_n, _got, first) in self._batches.items() if now - first > BATCH_RECORD_NS]:
                del self._batches[old]
            self._batches.setdefault(seq, [chunks, 0, now])[1] += 1

    def _sibling_wait_s(self, ready: list[BatchedSession]) -> float:
        """0: decode now; else how long to wait for the rest of a pipeline batch (under the lock).  A call starts as
        soon as any ready chunk is due: its batch is complete here, was never announced, or has waited
        ``SIBLING_WAIT_NS`` since its first chunk arrived.  So no chunk waits longer than that, however batches
        keep arriving.  A batch's chunk that goes to another decoder (a stream on the full VAE) never arrives here:
        its siblings wait the bound."""
        now, wait = time.monotonic_ns(), None
        for s in ready:
            if self._due(s, now):
                return 0.0
            entry = self._batches[getattr(s.pending[0][0], "batch_seq", 0)]
            left = entry[2] + SIBLING_WAIT_NS - now
            wait = left if wait is None else min(wait, left)
        return 0.0 if wait is None else wait / 1e9

    def _run(self) -> None:
        if self.part.device.type == "cuda":
            torch.cuda.set_device(self.part.device)
        while True:
            with self.cond:
                while True:
                    self.cond.wait_for(lambda: self.closed or any(s._ready() for s in self.sessions))
                    if self.closed:
                        return
                    wait_s = self._sibling_wait_s(self._ready())
                    if wait_s <= 0:
                        break
                    self.sibling_waits += 1
                    self.cond.notify_all()
                    self.cond.wait(timeout=wait_s)  # an arrival, or the bound
                taken = []
                for s in self._take():
                    tag, x, _queued_ns = s.pending.popleft()
                    s.busy = True
                    taken.append((s, tag, x))
                self.cond.notify_all()  # producers blocked on a full session may go on
            try:
                self._decode_round(taken)
            except BaseException as exc:  # noqa: BLE001 - a bug here must not leave sessions busy forever
                logger.exception("tiny decoder round failed")
                self._deliver([(s, _Failure(exc)) for s, _tag, _x in taken])

    def _decode_round(self, taken: list) -> None:
        groups: dict[tuple, list] = {}
        failed = []
        for s, tag, x in taken:
            try:
                self.part._check(x, f"chunk {tag.index}")
                hw = (x.shape[3], x.shape[4])
                if s.state.latent_hw is not None and s.state.latent_hw != hw:
                    raise ValueError(
                        f"chunk {tag.index}: the stream's latents are {s.state.latent_hw[0]}x{s.state.latent_hw[1]}, "
                        f"got {hw[0]}x{hw[1]}"
                    )
            except ValueError as exc:
                failed.append((s, _Failure(exc)))
                continue
            groups.setdefault(tuple(x.shape), []).append((s, tag, x))
        if failed:
            self._deliver(failed)
        for group in groups.values():  # dict order: the paced-first order of each group's first chunk
            self._deliver(self._decode_group(group))

    def _decode_group(self, group: list) -> list:
        started_ns = time.time_ns()
        states = [s.state for s, _tag, _x in group]
        xs = [x for _s, _tag, x in group]
        try:
            start, stop = self._start_timer()
            start()
            videos = self.part.decode_batch(states, xs, pad_to=self.bucket(len(group)))
        except Exception as exc:  # noqa: BLE001 - find the stream(s) at fault: each alone
            if len(group) == 1:
                logger.exception("tiny decoder: a stream's chunk failed")
                return [(group[0][0], _Failure(exc))]
            out = []
            for item in group:
                out += self._decode_group([item])
            return out
        frames = to_host_uint8(videos)  # its copy waits for the call: the timer's end has passed then
        self.times.record(len(group), stop())
        ended_ns = time.time_ns()
        with self.cond:
            self.calls += 1
            self.batch_sizes.append(len(group))
            del self.batch_sizes[:-1000]
        return [(s, (tag, f, (started_ns, ended_ns))) for (s, tag, _x), f in zip(group, frames, strict=True)]

    def _deliver(self, results: list) -> None:
        with self.cond:
            for s, item in results:
                s.busy = False
                if s.aborted:
                    continue
                if isinstance(item, _Failure):
                    s.failure = item
                    s.pending.clear()
                else:
                    s.out.append(item)
            self.cond.notify_all()


def allow_variants(buckets: int) -> None:
    """Let dynamo keep a compiled pass per bucket (and a few sizes each) rather than falling back to eager after its
    default cache limit of 8."""
    import torch._dynamo

    config = torch._dynamo.config
    config.cache_size_limit = max(config.cache_size_limit, 4 * buckets)


def to_host_uint8(videos: list[torch.Tensor]) -> list[np.ndarray]:
    """Each stream's video ``(1, 3, F, H, W)`` -> ``(F, H, W, 3)`` uint8 on the device, then one copy of all of them
    to the host.

    From a GPU the copy lands in page-locked memory (torch's caching host allocator: a block comes back for reuse
    once every stream let go of its frames).  Measured on an H200 host (``benchmarks/tiny_profile.py``): into fresh
    pageable memory the copy of 8 streams' frames (38 MB, past glibc's 32 MB mmap threshold, so every call faulted
    its pages in anew) took 32 ms beside a 21 ms decode."""
    frames = [tiny_to_uint8_frames(v) for v in videos]
    flat = torch.cat([f.reshape(-1) for f in frames])
    if flat.is_cuda:
        host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
        host.copy_(flat)  # blocking: the frames are on the host when it returns
        flat = host
    flat = flat.numpy()
    out, at = [], 0
    for f in frames:
        n = f.numel()
        out.append(flat[at : at + n].reshape(tuple(f.shape)))
        at += n
    return out


class BatchedSession:
    """One stream's chunks waiting for, and frames coming out of, its ``BatchedDecoder`` (all state under the
    decoder's condition variable)."""

    def __init__(self, decoder: BatchedDecoder, capacity: int, paced: bool, seq: int):
        self.decoder = decoder
        self.capacity = capacity
        self.paced = bool(paced)
        self.seq = seq
        self.state = decoder.part.new_state()
        self.pending: deque = deque()  # (tag, latents, queued_ns)
        self.out: deque = deque()  # (tag, frames, (start_ns, end_ns))
        self.busy = False  # a chunk of this stream is in a call
        self.finished = False
        self.aborted = False
        self.closed = False
        self.failure: _Failure | None = None

    def _ready(self) -> bool:
        return (
            not self.busy
            and not self.aborted
            and self.failure is None
            and bool(self.pending)
            and len(self.out) < OUT_CAPACITY
        )

    def submit(self, tag, latents: torch.Tensor) -> bool:
        """Queue a chunk; blocks while ``capacity`` wait. False once the session is aborted, failed or finished."""
        cond = self.decoder.cond
        with cond:
            cond.wait_for(
                lambda: self.aborted or self.failure is not None or self.finished or len(self.pending) < self.capacity
            )
            if self.aborted or self.failure is not None or self.finished:
                return False
            self.pending.append((tag, latents, time.monotonic_ns()))
            self.decoder._arrived(tag)
            cond.notify_all()
            return True

    def finish(self) -> None:
        with self.decoder.cond:
            self.finished = True
            self.decoder.cond.notify_all()

    def abort(self) -> None:
        with self.decoder.cond:
            self.aborted = True
            self.pending.clear()
            self.out.clear()
            self.decoder.cond.notify_all()

    def results(self):
        cond = self.decoder.cond
        while True:
            with cond:
                cond.wait_for(
                    lambda: (
                        self.out
                        or self.aborted
                        or self.failure is not None
                        or (self.finished and not self.pending and not self.busy)
                        or self.decoder.closed
                    )
                )
                if self.out:
                    item = self.out.popleft()
                    cond.notify_all()  # the worker may take this stream's next chunk
                elif self.failure is not None and not self.aborted:
                    raise self.failure.exc
                elif self.decoder.closed and not self.aborted and not (self.finished and not self.pending):
                    raise RuntimeError("the tiny decoder was closed while the stream was decoding")
                else:
                    return
            yield item

    def close(self) -> None:
        """Abort, wait for a call holding this stream's chunk to end, and free the stream's state."""
        cond = self.decoder.cond
        with cond:
            self.aborted = True
            self.pending.clear()
            self.out.clear()
            cond.notify_all()
            cond.wait_for(lambda: not self.busy or self.decoder.closed and not self.decoder.worker.is_alive())
            self.closed = True
            if self in self.decoder.sessions:
                self.decoder.sessions.remove(self)
        self.decoder.part.release(self.state)
        logger.info("%s", self.decoder.formed_summary())

    @property
    def queued(self) -> int:
        with self.decoder.cond:
            return len(self.pending) + int(self.busy) + len(self.out)

    @property
    def state_bytes(self) -> int:
        return _held_bytes(self.state)
