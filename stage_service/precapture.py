"""CUDA graphs of the batches paced streams form, captured when a generation forms, before the stage serves.

Usage (``Generation.form`` has the executor run it first, on its own thread: ``StageExecutor(prepare=...)``)::

    captured = precapture(runner, max_batch=4, shape=serving_shape(checkpoint, config))

**Why.** A stage replays one CUDA graph per batch signature: batch size and each item's KV window length
(``stage_service.graphs``).  The gateway's warm-up stream (``gateway.stream.warmup``) is one stream, so before
serving only batches of one were captured; the calibration captures batches of every size, into graphs of its own that
it drops.  On one H200 the batches of 2..4 streams a paced set forms ran eagerly (about twice a graph's time) until
each signature was seen twice and captured in the background: 11 of 165 batches of a capacity run, and during a ramp
of SLO-adaptive streams every batch, since each step change starts a KV segment whose window fills again.

**What.** For every batch size 1..``max_batch``, that many synthetic warm-up streams (``StreamSpec.warmup``: their
batches capture in line) run their chunks 0..``window`` together at the serving size: every filling window's
signature and the full window's, at that size.  Synthetic inputs come from a private generator (text, and the hidden
states a later slice receives); the streams are closed at the end, so no serving state remains but the graphs.

**Bounds.** At most ``budget_s`` seconds (checked before every forward); past the graphs' buffer cap, signatures run
eagerly as they would while serving.  Not under sequence parallelism (its forwards need the whole group) or without
graphs.  A failure is logged, never raised: the stage then captures while serving, as before.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

import torch

from stage_service.calibration import CALIBRATION_SINK, CALIBRATION_WINDOW, ServingShape, synthetic_spec
from stage_service.runner import SliceRunner
from stagecast.microstep import MicroStep

logger = logging.getLogger(__name__)

DEFAULT_BUDGET_S = 60.0
FIRST_ID = 1 << 40  # synthetic stream ids: far above any the coordinator gives


def precapture(
    runner: SliceRunner,
    max_batch: int,
    shape: ServingShape,
    *,
    window: int = CALIBRATION_WINDOW,
    sink: int = CALIBRATION_SINK,
    budget_s: float = DEFAULT_BUDGET_S,
    clock: Callable[[], float] = time.perf_counter,
    stop: Callable[[], bool] = lambda: False,
    on_batch: Callable[[int, int], None] | None = None,
) -> int:
    """Capture the graphs of batches of 1..``max_batch`` streams at every window length (module docstring), until
    ``stop()`` (checked before every forward: the stage leaves its generation).  ``on_batch(b, max_batch)`` is called
    as each batch size is done (start-up progress).  Returns the graphs captured."""
    graphs = runner.graphs
    if graphs is None or runner.sp.size > 1:
        return 0
    sl = runner.slice
    started, before = clock(), graphs.captures
    gen = torch.Generator(device="cpu").manual_seed(0)
    text = torch.randn(1, shape.text_len, sl.config["text_dim"], generator=gen)
    tokens = sl.tokens_per_frame(shape.latent_height, shape.latent_width) * shape.chunk_frames
    chunks = math.ceil(window / shape.chunk_frames)  # the chunk whose window is full
    next_id = FIRST_ID
    opened: list[int] = []
    try:
        for b in range(1, max_batch + 1):
            ids = list(range(next_id, next_id + b))
            next_id += b
            for sid in ids:
                spec = synthetic_spec(sid, shape, sl.config["in_channels"], window, sink, warmup=True)
                runner.open_stream(spec, text)
                opened.append(sid)
            for c in range(chunks + 1):
                if stop():
                    logger.info("graph pre-capture: stopped at batch size %d, chunk %d (leaving)", b, c)
                    return graphs.captures - before
                if clock() - started > budget_s:
                    logger.warning(
                        "graph pre-capture: budget of %.0f s spent at batch size %d, chunk %d", budget_s, b, c
                    )
                    return graphs.captures - before
                inputs = None
                if not sl.first:
                    inputs = torch.randn(b, tokens, sl.inner_dim, generator=gen).to(sl.device, sl.dtype)
                runner.forward([MicroStep(sid, c, 0) for sid in ids], inputs)
            for sid in ids:
                runner.close_stream(sid)
                opened.remove(sid)
            if on_batch is not None:
                on_batch(b, max_batch)
    except Exception:  # noqa: BLE001 - a head start, never a reason not to serve
        logger.warning("graph pre-capture failed; batch signatures are captured while serving", exc_info=True)
    finally:
        for sid in opened:
            runner.close_stream(sid)
    captured = graphs.captures - before
    logger.info(
        "graph pre-capture: %d graphs for batches of 1..%d streams at every window length in %.1f s",
        captured,
        max_batch,
        clock() - started,
    )
    return captured
