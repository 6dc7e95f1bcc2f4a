"""Stage 0 receives a closed stream's owed latents at its close, not at some later batch.

The last stage sends stage 0 each micro-step's next-level latent; stage 0 receives them in send order when a batch
needs one (``StageExecutor._receive_owed``).  A stream cancelled with chunks in flight left latents that no later batch
needed: they were received only when some other stream's batch came, and on gloo a send is done only once received.
A pipeline left idle past the group's timeout (300 s) then closed the pair ("Application timeout caused pair
closure"), and the next stream on it failed (seen in CI on a test session's shared system).  The transport here is a
stand-in that records what stage 0 receives.
"""

from __future__ import annotations

import pytest
import torch

from stage_service.dit_slice import DiTSlice
from stage_service.executor import StageExecutor
from stage_service.runner import SliceRunner
from stagecast.microstep import MicroStep, PlanEvent, StreamSpec
from tests.engine_helpers import small_spec

pytestmark = pytest.mark.unit


class RecordingTransport:
    """Stage 0's view of a 2-stage pipeline: sends go nowhere, each latent received is a zero tensor, counted."""

    pipeline = 2
    world_size = 2
    wait_seconds = 0.0
    exchange_seconds = 0.0

    def __init__(self):
        self.received: list[tuple[int, ...]] = []

    def send_hidden(self, hidden: torch.Tensor) -> None:
        pass

    def recv_latent(self, shape) -> torch.Tensor:
        self.received.append(tuple(shape))
        return torch.zeros(shape)


def spec(sid: int) -> StreamSpec:
    return small_spec(stream_id=sid, timesteps=(1000.0, 750.0, 500.0), text_len=16, seed=sid, window=2, sink=0)


def stage0(tiny_model) -> tuple[StageExecutor, RecordingTransport]:
    model = tiny_model()
    first = DiTSlice.from_model(model, layers=range(1), first=True, last=False)
    tp = RecordingTransport()
    ex = StageExecutor(SliceRunner(first), tp, lambda ev: None)
    return ex, tp


def test_a_stream_closed_with_chunks_in_flight_has_its_owed_latents_received_at_its_close(tiny_model):
    ex, tp = stage0(tiny_model)
    ex._run(PlanEvent("open", seq=1, spec=spec(1), text=torch.randn(1, 16, 32)))
    ex._run(PlanEvent("open", seq=2, spec=spec(2), text=torch.randn(1, 16, 32)))
    # Level 0 of chunk 0 of both streams, then chunk 1 of stream 1: each owes stage 0 its level-1 latent.
    ex._run(PlanEvent("batch", seq=3, steps=(MicroStep(1, 0, 0), MicroStep(2, 0, 0))))
    ex._run(PlanEvent("batch", seq=4, steps=(MicroStep(1, 1, 0),)))
    assert tp.received == []  # nothing needed them yet
    ex._run(PlanEvent("close", seq=5, stream_id=1))
    # Stream 1's two owed latents, and stream 2's sent between them, are received now; stream 2's waits for it.
    assert len(tp.received) == 3 and not any(step.stream == 1 for step, _ in ex._owed)
    assert ex.runner.holds_latent(MicroStep(2, 0, 1))
    # Stream 2 goes on with the latent already here: no receive.
    ex._run(PlanEvent("batch", seq=6, steps=(MicroStep(2, 0, 1),)))
    assert len(tp.received) == 3


def test_a_stream_closed_with_nothing_owed_receives_nothing(tiny_model):
    ex, tp = stage0(tiny_model)
    ex._run(PlanEvent("open", seq=1, spec=spec(1), text=torch.randn(1, 16, 32)))
    ex._run(PlanEvent("close", seq=2, stream_id=1))
    assert tp.received == [] and not ex._owed
