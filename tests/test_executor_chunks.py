"""A last stage's chunk results say how many chunks their batch finished (``ChunkResult.finished_with``): what lets
the gateway's batching decoder wait for the others of a batch and decode them in one call."""

from __future__ import annotations

import queue

import pytest

from stage_service.dit_slice import DiTSlice
from stage_service.executor import StageExecutor
from stage_service.generation import Generation
from stage_service.runner import SliceRunner
from stagecast.microstep import MicroStep, PlanEvent
from tests.engine_helpers import TEXT, small_spec

pytestmark = pytest.mark.unit


def test_each_chunk_result_counts_the_chunks_its_batch_finished(tiny_model):
    model = tiny_model()
    sl = DiTSlice.from_model(model, layers=range(model.config.num_layers), first=True, last=True)
    events: queue.Queue = queue.Queue()
    ex = StageExecutor(SliceRunner(sl), None, events.put)
    ex.start()
    try:
        for sid, ladder in ((1, (1000.0,)), (2, (1000.0,)), (3, (1000.0, 500.0))):
            ex.submit(PlanEvent("open", seq=sid, spec=small_spec(stream_id=sid, timesteps=ladder), text=TEXT))
        # Streams 1 and 2 run their only step; stream 3 its first of two: two chunks finish in this batch.
        ex.submit(PlanEvent("batch", seq=4, steps=(MicroStep(1, 0, 0), MicroStep(2, 0, 0), MicroStep(3, 0, 0))))
        ex.submit(PlanEvent("batch", seq=5, steps=(MicroStep(3, 0, 1),)))  # stream 3's chunk, alone
        chunks, done = [], 0
        while done < 2:
            ev = events.get(timeout=60)
            assert ev.kind != "error", ev.message
            done += ev.kind == "done"
            if ev.kind == "chunk":
                chunks.append(ev)
        assert [(ev.seq, ev.stream_id, ev.finished_with) for ev in chunks] == [(4, 1, 2), (4, 2, 2), (5, 3, 1)]
        gen = Generation(1, ex, None, sl)
        proto = gen.event_to_proto(chunks[0], index=0)
        assert (proto.chunk.seq, proto.chunk.finished_with) == (4, 2)
    finally:
        ex.stop()
