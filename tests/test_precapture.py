"""Graphs captured when a generation forms (``stage_service.precapture``): the batches a paced set forms replay them.

On the CPU a "graph" re-runs the captured function on its static buffers (``rerun_capture``, as in
``tests/test_graphs.py``): what is checked is that every batch signature a set of streams meets was captured before
the first stream (none runs eagerly, none is captured later), including a batch of streams at different RoPE offsets,
and that the replays equal an eager run bit for bit.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from launcher.reference import ReferenceExecutor
from stage_service.calibration import ServingShape
from stage_service.dit_slice import DiTSlice
from stage_service.graphs import GraphedBlocks
from stage_service.precapture import precapture
from stagecast.cuda_graphs import rerun_capture
from stagecast.microstep import MicroStep, PlanEvent, StreamSpec
from tests.engine_helpers import small_spec

pytestmark = pytest.mark.parity

SHAPE = ServingShape(chunk_frames=1, latent_height=4, latent_width=6, text_len=16)
WINDOW, SINK = 3, 1


def spec(sid: int) -> StreamSpec:
    return small_spec(stream_id=sid, timesteps=(1000.0,), num_chunks=9, text_len=16, seed=sid, window=WINDOW, sink=SINK)


def paced_set_plan() -> list[PlanEvent]:
    """Three streams in step (their windows filling, then full), then a fourth that fills its window alone and joins
    two of them at a full window but another RoPE offset, and the third alone."""
    plan = [PlanEvent("open", spec=spec(s)) for s in (1, 2, 3)]
    plan += [PlanEvent("batch", steps=tuple(MicroStep(s, c, 0) for s in (1, 2, 3))) for c in range(6)]
    plan.append(PlanEvent("open", spec=spec(4)))
    plan += [PlanEvent("batch", steps=(MicroStep(4, c, 0),)) for c in range(WINDOW)]
    plan.append(PlanEvent("batch", steps=(MicroStep(4, WINDOW, 0), MicroStep(1, 6, 0), MicroStep(2, 6, 0))))
    plan.append(PlanEvent("batch", steps=(MicroStep(3, 6, 0),)))
    plan += [PlanEvent("close", stream_id=s) for s in (1, 2, 3, 4)]
    return plan


def texts() -> dict[int, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return {s: torch.randn(1, 16, 32, generator=gen) for s in (1, 2, 3, 4)}


def whole_slice(tiny_model) -> DiTSlice:
    model = tiny_model()
    return DiTSlice.from_model(model, layers=range(model.config.num_layers), first=True, last=True)


def graphed(full: DiTSlice, background: bool = False) -> tuple[ReferenceExecutor, GraphedBlocks]:
    """A reference executor whose runner replays CPU "graphs" (``rerun_capture``); ``background``: as a stage serves,
    a signature it has no graph for runs eagerly while its graph is captured."""
    ref = ReferenceExecutor(full)
    ref.runner.graphs = GraphedBlocks(full, capture=rerun_capture, background=background)
    return ref, ref.runner.graphs


def test_a_paced_sets_batches_replay_graphs_captured_before_it_and_equal_eager(tiny_model):
    full = whole_slice(tiny_model)
    want = ReferenceExecutor(full).replay(paced_set_plan(), texts())

    ref, graphs = graphed(full, background=True)
    captured = precapture(ref.runner, 3, SHAPE, window=WINDOW, sink=SINK)
    assert captured == graphs.captures > 0
    assert not ref.runner.streams  # its synthetic streams are gone
    got = ref.replay(paced_set_plan(), texts())
    assert graphs.eager_batches == 0 and graphs.captures == captured and not graphs.pending
    for s in (1, 2, 3, 4):
        assert len(got[s]) == len(want[s])
        for a, b in zip(got[s], want[s], strict=True):
            assert torch.equal(a, b), s


def test_without_precapture_the_same_set_meets_signatures_it_has_no_graph_for(tiny_model):
    # The check above can fail: without it, the set's batches of several streams run eagerly at first.
    ref, graphs = graphed(whole_slice(tiny_model), background=True)
    ref.replay(paced_set_plan(), texts())
    assert graphs.eager_batches > 0


def test_a_precapture_past_its_budget_stops_and_leaves_no_stream(tiny_model):
    ref, graphs = graphed(whole_slice(tiny_model))
    ticks = itertools.count()
    captured = precapture(ref.runner, 3, SHAPE, window=WINDOW, sink=SINK, budget_s=5.0, clock=lambda: next(ticks))
    assert 0 < captured < 3 * (WINDOW + 1)
    assert not ref.runner.streams


def test_a_precapture_told_to_stop_stops_at_once_and_leaves_no_stream(tiny_model):
    # The stage left its generation (its executor stopped): at most the forward under way finishes.
    ref, graphs = graphed(whole_slice(tiny_model))
    asked = itertools.count()
    captured = precapture(ref.runner, 3, SHAPE, window=WINDOW, sink=SINK, stop=lambda: next(asked) >= 2)
    assert captured == graphs.captures == 2  # the first two forwards (batch of one, windows 0 and 1) and no more
    assert not ref.runner.streams


def test_no_graphs_no_precapture(tiny_model):
    ref = ReferenceExecutor(whole_slice(tiny_model))
    assert precapture(ref.runner, 3, SHAPE) == 0 and not ref.runner.streams


def test_a_precapture_reports_each_batch_size_as_it_is_captured(tiny_model):
    ref, _ = graphed(whole_slice(tiny_model))
    seen = []
    precapture(ref.runner, 3, SHAPE, window=WINDOW, sink=SINK, on_batch=lambda b, n: seen.append((b, n)))
    assert seen == [(1, 3), (2, 3), (3, 3)]  # the stage's start-up step "graphs k of n"
