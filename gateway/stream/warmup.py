"""The gateway's warm-up stream: one stream of the serving defaults through the pipeline before the gateway serves.

Usage (``Gateway`` runs it before it reports READY, on a GPU by default; ``--pipeline-warmup-s``)::

    took = warm_pipeline(coordinator_stub, spec=spec, text=text, consumer_depth=depth, wait_s=120.0)

**Why.** A stage captures one CUDA graph per batch signature (``stage_service.graphs``): batch size, and per item its
KV context length, which grows chunk by chunk until the window is full.  The first stream after start-up meets every
signature for the first time, runs those batches eagerly while their graphs are captured in the background, and on an
H200 showed a 435-499 ms gap and a 1.4-2.9 s first frame (BENCHMARKS.md) where later streams had none.

**What.** Once the coordinator reports the pipeline ready (``Status``, polled within ``wait_s``), the gateway opens one
unpaced stream of the serving defaults (size, steps, window, text length: what a request that sets nothing gets)
marked ``StreamSpec.warmup``, long enough for its window to fill and its wavefront to reach every stage at every
level (``warmup_spec``; a default window that is unbounded becomes the protocol's 6 frames, 3 of them sinks). It
acknowledges each chunk on arrival as a real consumer would after decoding (so the stream's lead, and with it its
batches, are a real stream's) and drops the latents.  Stages capture the graphs of batches that hold only warm-up
micro-steps in line, so every graph is in when the stream ends.  The gateway's VAE is warmed separately
(``Gateway._warm_up``).

**Bounds.** At most ``MAX_WARMUP_CHUNKS`` chunks; the whole warm-up, waiting for READY included, within ``wait_s``.
It never stops the gateway from serving: a pipeline that is not ready in time, or a warm-up stream that fails, is
logged and skipped (its first real stream then captures in the background, as before).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import replace

import grpc
import torch

from stagecast import wire
from stagecast.internal.v1 import pipeline_pb2 as ipb
from stagecast.microstep import StreamSpec

logger = logging.getLogger(__name__)

MAX_WARMUP_CHUNKS = 64
DEFAULT_WAIT_S = 120.0  # the gateway's default on a GPU (--pipeline-warmup-s)
MAX_WAIT_S = 3600.0
# The window a warm-up stream runs when the serving defaults leave it unbounded: the benchmark protocol's (6 latent
# frames, 3 of them sinks).  An unbounded warm-up would meet a longer context every chunk, and each one past the
# graphs' buffers reallocates them and drops every graph captured so far.
DEFAULT_WINDOW = 6
DEFAULT_SINK = 3
POLL_S = 0.5  # how often the coordinator's readiness is asked while waiting


def warmup_spec(spec: StreamSpec, stages: int) -> StreamSpec:
    """The warm-up stream's spec: ``spec`` (the serving defaults) with a bounded window (``DEFAULT_WINDOW`` when it
    has none), marked ``warmup``, and long enough to meet every batch signature a single stream meets: its KV window
    filled (``window`` latent frames in chunks), plus the wavefront's depth (``levels x stages`` micro-steps in
    flight) so that steady-state batches reach every stage, plus two to see them repeat."""
    if spec.window is None:
        spec = replace(spec, window=DEFAULT_WINDOW, sink=DEFAULT_SINK)
    chunks = math.ceil(spec.window / spec.chunk_frames) + spec.levels * max(1, stages) + 2
    return replace(spec, stream_id=0, num_chunks=min(MAX_WARMUP_CHUNKS, chunks), warmup=True)


def wait_budget(wait_s: float | None, device: str) -> float:
    """``--pipeline-warmup-s`` resolved: None is ``DEFAULT_WAIT_S`` for a gateway on a GPU and 0 (off) on a CPU;
    a value outside [0, ``MAX_WAIT_S``] is refused naming the flag."""
    if wait_s is None:
        wait_s = DEFAULT_WAIT_S if torch.device(device).type == "cuda" else 0.0
    if not 0 <= wait_s <= MAX_WAIT_S:
        raise ValueError(f"--pipeline-warmup-s must be in [0, {MAX_WAIT_S:g}], got {wait_s}")
    return wait_s


def wait_ready(coordinator, deadline: float, *, clock: Callable[[], float], stop: threading.Event) -> int | None:
    """Poll the coordinator's ``Status`` until its pipeline is ready; its stage count, or None past ``deadline``."""
    while True:
        try:
            status = coordinator.Status(ipb.Empty(), timeout=max(0.1, min(2.0, deadline - clock())))
            if status.ready:
                return max(1, status.world_size)
        except grpc.RpcError:
            pass  # the coordinator is not up yet
        left = deadline - clock()
        if left <= 0 or stop.wait(min(POLL_S, left)):
            return None


def warm_pipeline(
    coordinator,
    *,
    spec: StreamSpec,
    text: torch.Tensor,
    consumer_depth: int,
    wait_s: float,
    decoder: str = "full",
    clock: Callable[[], float] = time.monotonic,
    stop: threading.Event | None = None,
) -> int:
    """Run the warm-up stream (module docstring); returns the chunks it received (0: skipped, and logged why)."""
    start = clock()
    deadline = start + wait_s
    logger.info(
        "pipeline warm-up: waiting up to %.0f s for the pipeline, then one stream of the serving defaults", wait_s
    )
    stages = wait_ready(coordinator, deadline, clock=clock, stop=stop or threading.Event())
    if stages is None:
        logger.warning("pipeline warm-up skipped: the pipeline was not ready within %.0f s", wait_s)
        return 0
    spec = warmup_spec(spec, stages)
    chunks = spec.num_chunks
    request = ipb.OpenStreamRequest(
        spec=wire.spec_to_proto(spec),
        text=wire.tensor_to_proto(text),
        acknowledges=True,
        consumer_depth=consumer_depth,
        decoder=decoder,
    )
    received = 0
    try:
        call = coordinator.OpenStream(request, timeout=max(1.0, deadline - clock()))
        stream_id = None
        for event in call:
            kind = event.WhichOneof("event")
            if kind == "started":
                stream_id = event.started.stream_id
            elif kind == "chunk":
                received += 1
                # Cumulative, as a real consumer acknowledges a decoded chunk: the lead stays a real stream's.  Not
                # the last: the stream ends with it, and an acknowledgement arriving after the end is NOT_FOUND.
                if event.chunk.chunk + 1 < chunks:
                    coordinator.Consumed(
                        ipb.ChunksConsumed(stream_id=stream_id, chunks=event.chunk.chunk + 1), timeout=10
                    )
            elif kind == "ended":
                break
    except grpc.RpcError as exc:
        logger.warning(
            "pipeline warm-up stopped after %d of %d chunks: %s %s", received, chunks, exc.code().name, exc.details()
        )
        return received
    logger.info(
        "pipeline warmed up: %d of %d chunks of the serving defaults through %d stage(s) in %.1f s",
        received,
        chunks,
        stages,
        clock() - start,
    )
    return received
