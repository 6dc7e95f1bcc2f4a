"""A stage's timing of its own slice at READY: the SLO controller's first model of this stage.

Usage (the stage runs it right after loading its slice, before it reports READY)::

    shape = serving_shape("/models/wan/transformer", config)      # stagecast.json's serving size, or 832x480
    cal = calibrate(dit_slice, max_batch=4, shape=shape, budget_s=5.0, graphs=True)
    cal.empty_ms[b - 1], cal.full_ms[b - 1]                       # ms per forward of b micro-steps
    cal.to_proto()                                                # travels in FormReply.calibration

**What is timed.** Forwards of this slice (``SliceRunner.forward``: what ``BatchDone.forward_ms`` times while
serving, CUDA events on a GPU, wall time on a CPU) for every batch size 1..``max_batch`` (the coordinator's Stream
Batch, sent in ``RegisterReply.max_batch``), at the serving size, on synthetic inputs: random text and hidden states
from a private generator, noise latents on the first slice.  Each batch size is timed twice: with an empty KV window
(a stream's first chunk) and with a full one (``CALIBRATION_WINDOW`` latent frames, ``CALIBRATION_SINK`` of them
sinks: the benchmark protocol's window), since attention over the window costs more.  Every timed forward follows an
identical untimed one (same batch signature, on twin streams), so one-time costs (allocator, kernel loading, a CUDA
graph's capture) are never counted; every size is timed ``PASSES`` times, within the budget, and keeps the least.  A
size whose time no forward of that size can take by itself (``implausible``: more than a larger batch's, or more than
a smaller one's plus a lone forward's) waited on other work on the device, such as the gateway starting beside the
stage: it is timed again after the others (``RECHECKS`` rounds at most, within the budget) and keeps the least of its
times; one still implausible then is kept at the most the other sizes' times let it take (``plausible_bound``).  The
window is filled without forwards: the K/V of a stream's chunk 0 stand in for every earlier frame (attention costs
what its context's length costs, whatever the values).

**What a forward needs in memory** (``Calibration.activation_bytes``, on a GPU): the most any one calibrated forward
allocated above what was allocated when it began, less what it added to the CUDA graphs' static buffers (their cap is
reserved apart: ``stage_service.kv_budget``).  The streams' K/V windows, which the calibration fills without forwards,
were allocated before, so they are not counted: the stage's KV budget is for them.  Measured over the whole
calibration instead, the peak held the K/V of every calibration stream open at once (8 full 6-frame windows at a
batch of 4: 12.85 GiB of a 13.48 GiB "activation peak" for 1.3B) and took it from the streams' budget a second time:
an H100 stage gave streams 8.56 GiB, 4 streams (r29).

**What it leaves alone.** It runs on a runner of its own with its own streams (closed at the end), so serving state
is untouched: no KV cache, no stream, no graph (with ``--cuda-graphs`` it captures into a ``GraphedBlocks`` of its
own, dropped afterwards) and no random generator it does not own (the global CPU and CUDA generators are restored).

**Bounds.** It stops once ``budget_s`` has passed (checked before every forward) and keeps the batch sizes it
finished; a failure is reported, never raised.  It runs 4 forwards per batch size and pass (32 at the default
Stream Batch of 4): on an H200 a 1.3B half-slice forward takes 10-40 ms (plus a capture per signature with
``--cuda-graphs``).  A stage on a CPU calibrates only when ``--calibration-s`` is given (its cores are shared with
the other processes, all starting at once): the tiny test models take milliseconds on an idle machine, and a real
model at 480p runs out of budget (its stage reports what it finished).
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from stage_service.dit_slice import DiTSlice
from stage_service.runner import SliceRunner
from stagecast.internal.v1 import pipeline_pb2 as pb
from stagecast.microstep import MicroStep, StreamSpec
from stagecast.model.config import checkpoint_folder

logger = logging.getLogger(__name__)

CALIBRATION_WINDOW = 6  # latent frames of KV context in the "full" timing (the benchmark protocol's window)
CALIBRATION_SINK = 3
DEFAULT_BUDGET_S = 10.0  # on a GPU: 1..4 at 1.3B or 5B on an H200 took 4-5.5 s with a graph capture per size
MAX_BUDGET_S = 600.0
MAX_CALIBRATION_BATCH = 64
SERVING_DEFAULTS_FILE = "stagecast.json"  # the checkpoint's serving defaults (docs/checkpoints.md: stagecast.json)
DEFAULT_SIZE = (480, 832)  # height, width: the serving default without a stagecast.json
DEFAULT_TEXT_LEN = 512
# A size timed implausibly (``implausible``) is timed again after the others, this many rounds at most, within the
# budget: on one H200 a stage's calibration beside the gateway's start-up had single sizes at 1.6-2x (1.3B: 26, 86,
# 61, 77 ms at 1..4), which priced the pace grid's remainder batch at the outlier and refused a stream it held.
RECHECKS = 2
# Every size is timed this many times in all (the rounds after the first within the budget, which a round that runs
# out of it ends quietly), keeping the least: on one H200 (619ccb5) one size's single timing differed by 9% between two
# starts of the same system (1.3B, batch 3: 49.4 and 53.9 ms, its neighbours within 2%), plausible either way, and the
# Stream Batch ``pick_batch`` chose and the price of the next stream followed it.
PASSES = 2
PLAUSIBLE_SLACK = 0.05  # timing noise between sizes


@dataclass(frozen=True)
class ServingShape:
    chunk_frames: int
    latent_height: int
    latent_width: int
    text_len: int


def _spatial_factor(root: Path | None, config: dict) -> int:
    if root is not None and (root / "vae" / "config.json").is_file():
        try:
            from stagecast.model import vae_configs
            from stagecast.model.config import read_vae_config

            return vae_configs.spatial_factor(read_vae_config(root / "vae"))
        except Exception as exc:  # noqa: BLE001
            logger.warning("calibration: cannot read %s: %s; assuming the Wan VAE's factor", root / "vae", exc)
    return 16 if config.get("in_channels") == 48 else 8  # the Wan2.2 VAE (48 channels) is 16x, Wan2.1's 8x


def serving_shape(checkpoint: str, config: dict) -> ServingShape:
    """The serving size the gateway defaults to for this checkpoint (a folder, or ``random:FOLDER``):
    ``stagecast.json``'s ``width``, ``height``, ``chunk_frames`` and ``text_len`` beside ``transformer/`` (as the
    gateway reads them), else 832x480, one latent
    frame per chunk, 512 text tokens; latent pixels through the checkpoint's VAE (``vae/config.json``).  A value that
    is unusable falls back to the default (logged): the calibration is a seed, never a reason not to start."""
    folder = checkpoint_folder(checkpoint)  # None for random:NAME (no folder: the defaults)
    root = None
    if folder is not None:
        root = folder.parent if folder.name == "transformer" else folder
    data: dict = {}
    if root is not None and (root / SERVING_DEFAULTS_FILE).is_file():
        try:
            raw = json.loads((root / SERVING_DEFAULTS_FILE).read_text())
            data = raw if isinstance(raw, dict) else {}
        except (OSError, ValueError) as exc:
            logger.warning("calibration: %s unreadable (%s); using the default serving size", root, exc)

    def pick(key: str, default: int) -> int:
        value = data.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= 16384:
            logger.warning("calibration: stagecast.json %s=%r is not a size; using %d", key, value, default)
            return default
        return value

    height, width = pick("height", DEFAULT_SIZE[0]), pick("width", DEFAULT_SIZE[1])
    sf = _spatial_factor(root, config)
    _, p_h, p_w = config["patch_size"]
    lat_h = max(p_h, height // sf // p_h * p_h)
    lat_w = max(p_w, width // sf // p_w * p_w)
    return ServingShape(pick("chunk_frames", 1), lat_h, lat_w, pick("text_len", DEFAULT_TEXT_LEN))


@dataclass
class Calibration:
    shape: ServingShape
    window: int
    graphs: bool = False
    empty_ms: list[float] = field(default_factory=list)  # index b - 1: a forward of b micro-steps, no KV context
    full_ms: list[float] = field(default_factory=list)  # the same with a full window
    seconds: float = 0.0
    error: str = ""  # why it stopped before max_batch ("" when complete)
    # The most one forward allocated above what it began with, graph buffers it added not counted (module docstring,
    # "What a forward needs in memory"); None: not measured (a CPU, or no forward ran).
    activation_bytes: int | None = None

    def to_proto(self) -> pb.StageCalibration:
        return pb.StageCalibration(
            empty_ms=self.empty_ms,
            full_ms=self.full_ms,
            latent_height=self.shape.latent_height,
            latent_width=self.shape.latent_width,
            chunk_frames=self.shape.chunk_frames,
            text_len=self.shape.text_len,
            window=self.window,
            graphs=self.graphs,
            seconds=self.seconds,
            error=self.error,
        )

    def summary(self) -> str:
        if not self.full_ms:
            return f"no batch size measured ({self.error or 'nothing to measure'})"
        pairs = ", ".join(f"B={b + 1}: {e:.2f}/{f:.2f}" for b, (e, f) in enumerate(zip(self.empty_ms, self.full_ms)))
        tail = f"; stopped: {self.error}" if self.error else ""
        return (
            f"ms per forward (empty/full {self.window}-frame window) {pairs} at {self.shape.latent_height}x"
            f"{self.shape.latent_width} latents{' (CUDA graphs)' if self.graphs else ''} in {self.seconds:.2f}s{tail}"
        )


class _Budget(Exception):
    pass


class CudaMemory:
    """The caching allocator's counters on one device: what ``track_activation`` reads around each forward."""

    def __init__(self, device: torch.device):
        self.device = device

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)


def track_activation(run: Callable, cal: Calibration, memory) -> Callable:
    """``run`` (``forward(runner, steps, inputs)``) that also keeps in ``cal.activation_bytes`` the most one call
    allocated above what was allocated when it began, less what it added to the runner's graphs' static buffers
    (``GraphedBlocks.nbytes``).  ``memory``: ``CudaMemory``, or any object with its three methods."""

    def tracked(runner, steps, inputs):
        graphs = runner.graphs
        buffers = graphs.nbytes if graphs is not None else 0
        before = memory.allocated()
        memory.reset_peak()
        out = run(runner, steps, inputs)
        grown = (graphs.nbytes if graphs is not None else 0) - buffers
        used = max(0, memory.peak() - before - max(0, grown))
        cal.activation_bytes = max(cal.activation_bytes or 0, used)
        return out

    return tracked


def _timer(device: torch.device) -> Callable[[Callable[[], object]], float]:
    if device.type == "cuda":

        def cuda_ms(fn: Callable[[], object]) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return float(start.elapsed_time(end))

        return cuda_ms

    def wall_ms(fn: Callable[[], object]) -> float:
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3

    return wall_ms


def calibrate(
    dit_slice: DiTSlice,
    max_batch: int,
    shape: ServingShape,
    *,
    budget_s: float = DEFAULT_BUDGET_S,
    graphs: bool = False,
    window: int = CALIBRATION_WINDOW,
    sink: int = CALIBRATION_SINK,
    clock: Callable[[], float] = time.perf_counter,
    timer: Callable[[Callable[[], object]], float] | None = None,
    forward: Callable[[SliceRunner, list[MicroStep], torch.Tensor | None], object] | None = None,
    on_batch: Callable[[int, int], None] | None = None,
    memory=None,
) -> Calibration:
    """Time this slice (see the module docstring).  ``on_batch(b, max_batch)`` is called as each batch size is timed
    (start-up progress).  ``clock``, ``timer``, ``forward`` and ``memory`` are for tests: a fake clock, a timing
    function ``timer(fn) -> ms``, what runs one forward (default ``runner.forward(steps, inputs)``) and the memory
    counters a forward's activation is read from (``CudaMemory``, the default on a GPU; none on a CPU)."""
    if not 1 <= max_batch <= MAX_CALIBRATION_BATCH:
        raise ValueError(f"max_batch must be in [1, {MAX_CALIBRATION_BATCH}], got {max_batch}")
    if not 0 < budget_s <= MAX_BUDGET_S:
        raise ValueError(f"budget_s must be in (0, {MAX_BUDGET_S}], got {budget_s}")
    device = dit_slice.device
    use_graphs = graphs and device.type == "cuda"
    cal = Calibration(shape=shape, window=window, graphs=use_graphs)
    if memory is None and device.type == "cuda":
        memory = CudaMemory(device)
    started = clock()
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    runner = None
    try:
        graphed = None
        if use_graphs:
            from stage_service.graphs import GraphedBlocks

            # Its own graphs and buffers, captured in line, dropped afterwards.
            graphed = GraphedBlocks(dit_slice, reserve_rows=max_batch)
        runner = SliceRunner(dit_slice, graphs=graphed)
        timer = timer or _timer(device)
        run = forward or (lambda r, steps, inputs: r.forward(steps, inputs))
        if memory is not None:
            run = track_activation(run, cal, memory)
        _measure(runner, cal, max_batch, shape, window, sink, started, budget_s, clock, timer, run, on_batch)
    except _Budget as exc:
        cal.error = str(exc)
    except Exception as exc:  # noqa: BLE001 - a seed, never a reason not to serve
        logger.warning("calibration failed", exc_info=True)
        cal.error = f"failed: {type(exc).__name__}: {exc}"
    finally:
        if runner is not None:
            for sid in list(runner.streams):
                runner.close_stream(sid)
            if runner.graphs is not None:
                runner.graphs.close()
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state(cuda_rng, device)
    cal.seconds = clock() - started
    return cal


def _measure(runner, cal, max_batch, shape, window, sink, started, budget_s, clock, timer, forward, on_batch) -> None:
    sl = runner.slice
    gen = torch.Generator(device="cpu").manual_seed(0)
    text = torch.randn(1, shape.text_len, sl.config["text_dim"], generator=gen)
    tokens = sl.tokens_per_frame(shape.latent_height, shape.latent_width) * shape.chunk_frames
    chunks = math.ceil(window / shape.chunk_frames)  # chunk index whose window is full
    run = forward
    next_id = itertools.count(1)  # the calibration's own streams, on a runner of its own

    def check(what: str) -> None:
        if clock() - started > budget_s:
            done = f"batch sizes 1..{len(cal.full_ms)}" if cal.full_ms else "no batch size"
            raise _Budget(f"budget of {budget_s:g}s spent at {what} ({done} measured)")

    def spec(sid: int) -> StreamSpec:
        return synthetic_spec(sid, shape, sl.config["in_channels"], window, sink)

    def time_size(b: int) -> dict[int, float]:
        twins = []
        for _ in range(2):  # the first set warms (or captures) each signature, the second is timed
            ids = [next(next_id) for _ in range(b)]
            for sid in ids:
                runner.open_stream(spec(sid), text)
            twins.append(ids)
        inputs = None
        if not sl.first:
            inputs = torch.randn(b, tokens, sl.inner_dim, generator=gen).to(sl.device, sl.dtype)
        try:
            return _time_batch(runner, twins, chunks, inputs, run, timer, lambda c, b=b: check(_at(b, c)))
        finally:
            for ids in twins:
                for sid in ids:
                    runner.close_stream(sid)

    for b in range(1, max_batch + 1):
        timed = time_size(b)
        cal.empty_ms.append(timed[0])
        cal.full_ms.append(timed[chunks])
        if on_batch is not None:
            on_batch(b, max_batch)
    if _again(cal, time_size, chunks, range(1, max_batch + 1), PASSES - 1):
        _recheck(cal, time_size, chunks)


def _again(cal: Calibration, time_size: Callable[[int], dict[int, float]], chunks: int, sizes, rounds: int) -> bool:
    """``sizes`` timed ``rounds`` more times, each keeping the least of its times (waiting only ever adds); False
    where the budget ran out first (what was timed is kept, and no error is reported)."""
    for _ in range(rounds):
        for b in sizes:
            try:
                timed = time_size(b)
            except _Budget:
                logger.info("calibration: no budget left to time batch size %d again", b)
                return False
            cal.empty_ms[b - 1] = min(cal.empty_ms[b - 1], timed[0])
            cal.full_ms[b - 1] = min(cal.full_ms[b - 1], timed[chunks])
    return True


def _recheck(cal: Calibration, time_size: Callable[[int], dict[int, float]], chunks: int) -> None:
    """A size whose one forward waited on other work on the device (another process starting beside the stage) is
    timed again, after the others, and keeps the least of its times: waiting only ever adds.  Within the budget."""
    for _ in range(RECHECKS):
        again = implausible(cal.full_ms)
        if not again or not _again(cal, time_size, chunks, again, 1):
            break
    left = implausible(cal.full_ms)
    if left:
        timed = list(cal.full_ms)
        cal.full_ms = plausible_bound(cal.full_ms, left)
        cal.empty_ms = plausible_bound(cal.empty_ms, left)
        logger.warning(
            "calibration: batch sizes %s still time implausibly (%s ms); each kept at the most a forward of its size "
            "can take by the other sizes' times: %s ms",
            left,
            ", ".join(f"{t:.2f}" for t in timed),
            ", ".join(f"{t:.2f}" for t in cal.full_ms),
        )


def plausible_bound(ms: list[float], sizes: list[int]) -> list[float]:
    """``ms`` with each of ``sizes`` (1-based, those ``implausible`` found) lowered to the most a forward of its size
    can take by itself, by the other sizes' times: no more than a larger batch's, nor than the next smaller batch's
    plus a lone forward's (``implausible``'s two rules, without the slack).  Every time here is at least the true one
    (waiting only ever adds), so the bound is too: the price stays on the safe side of the truth.  Kept as timed, a
    size that waited (on one H100, a stage's calibration beside the gateway's cold start: 1.3B 21, 36, 82, 133 ms at
    1..4, against 21, 35, 51, 67 on a warm start) made ``pick_batch`` choose batches of 2, and a size never served
    is never measured again: the Stream Batch stayed at 2 for the system's life."""
    out = list(ms)
    for b in sorted(sizes):
        i = b - 1
        if i >= len(out):
            continue
        bounds = out[i + 1 :] + ([out[i - 1] + out[0]] if i > 0 else [])
        if bounds:
            out[i] = min(out[i], *bounds)
    return out


def implausible(ms: list[float]) -> list[int]:
    """The batch sizes (1-based) of ``ms`` (ms per forward of 1, 2, ... micro-steps) whose time no forward of that
    size can take by itself: more than a larger batch's (a batch of b rows does part of the work of b + 1), or more
    than the next smaller batch's plus a lone forward's (one more row never costs more than a forward of its own),
    either by over ``PLAUSIBLE_SLACK``.  Such a time waited on other work."""
    out = []
    for i, t in enumerate(ms):
        over_larger = any(t > later * (1 + PLAUSIBLE_SLACK) for later in ms[i + 1 :])
        over_row = i > 0 and t > (ms[i - 1] + ms[0]) * (1 + PLAUSIBLE_SLACK)
        if over_larger or over_row:
            out.append(i + 1)
    return out


def _at(batch: int, chunk: int) -> str:
    return f"batch size {batch}, {'full' if chunk else 'empty'} window"


def _time_batch(runner, twins: list[list[int]], chunks: int, inputs, run, timer, check) -> dict[int, float]:
    """One batch size's forwards at an empty window (chunk 0) and a full one (chunk ``chunks``): the first set of
    ``twins`` warms (or captures) each signature, the second is timed; ``check(chunk)`` before each forward."""
    timed = {}
    for c in (0, chunks):
        if c:
            for ids in twins:
                fill_window(runner, ids, chunks)
        for k, ids in enumerate(twins):
            check(c)
            steps = [MicroStep(sid, c, 0) for sid in ids]
            if k == 1:
                if c:  # as serving draws a chunk's noise while the batch before it runs (``prefetch_noise``)
                    runner.prefetch_noise([MicroStep(sid, c - 1, 0) for sid in ids])
                timed[c] = timer(lambda steps=steps, inputs=inputs: run(runner, steps, inputs))
            else:
                run(runner, steps, inputs)
    return timed


def synthetic_spec(
    sid: int, shape: ServingShape, channels: int, window: int, sink: int, *, warmup: bool = False
) -> StreamSpec:
    """A one-step stream of the serving ``shape`` with a bounded window: what the calibration times and what
    ``stage_service.precapture`` captures graphs for (``warmup``: its batches capture in line)."""
    return StreamSpec(
        stream_id=sid,
        latent_channels=channels,
        chunk_frames=shape.chunk_frames,
        latent_height=shape.latent_height,
        latent_width=shape.latent_width,
        timesteps=(1000.0,),
        policy="per_level",
        window=window,
        sink=min(sink, window),
        text_len=shape.text_len,
        warmup=warmup,
    )


def fill_window(runner: SliceRunner, ids: list[int], chunk: int) -> None:
    """Make ``chunk`` of each stream see a full window without running the chunks before it: the K/V its chunk 0
    wrote stand in for every earlier frame (the cost of attention depends on how much context there is, not on its
    values)."""
    for sid in ids:
        stream = runner.streams[sid]
        for kv in stream.kv.values():
            for row in kv.rows.values():
                first = [row.frames[f] for f in sorted(row.frames)]
                if not first:
                    continue
                for f in range(chunk * stream.spec.chunk_frames):
                    row.frames[f] = first[f % len(first)]
                row.next_chunk = chunk
