"""The tiny decoder's pass as CUDA graphs (gateway.decode.tiny_graphs), held on a CPU through the capture stand-in that
re-runs the pass on the static buffers: what is copied in and out, that streams never share a graph's buffers, which
calls replay, and that a graph differing from its pass is left out."""

from __future__ import annotations

import pytest
import torch

from gateway.decode.batched_decoder import GRAPHED_MAX_ROWS, BatchedDecoder
from gateway.decode.tiny_decoder import load_tiny_decoder
from gateway.decode.tiny_graphs import TinyFrameGraphs
from launcher.demo_checkpoint import write_tiny_decoder
from stagecast.cuda_graphs import rerun_capture

pytestmark = pytest.mark.unit

HW = (2, 3)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return write_tiny_decoder(tmp_path_factory.mktemp("tiny_graphs") / "taew.pth", latent_channels=16, seed=5)


def chunk(seed: int, hw=HW) -> torch.Tensor:
    return torch.randn(1, 16, 1, *hw, generator=torch.Generator().manual_seed(seed))


def run_schedule(part, schedule, hw=HW):
    """Decode ``schedule`` (a list of calls, each a list of stream ids) on ``part``: each stream's videos in order."""
    states: dict[int, object] = {}
    videos: dict[int, list[torch.Tensor]] = {}
    for call, ids in enumerate(schedule):
        for i in ids:
            states.setdefault(i, part.new_state())
        xs = [chunk(100 * call + i, hw) for i in ids]
        for i, video in zip(ids, part.decode_batch([states[i] for i in ids], xs, pad_to=None), strict=True):
            videos.setdefault(i, []).append(video)
    return videos


# Streams 0-2 meet in calls of 3 and 1: the one-stream graph serves 0, then 1, and 0's state must come out of it as its
# own (a state aliasing the graph's buffers would take 1's values, which the last call would then decode from).
SCHEDULE = [[0, 1, 2], [0], [1], [2, 0, 1]]


def test_graphed_calls_decode_every_stream_as_the_pass_does_bit_for_bit(tiny_path):
    plain, graphed = load_tiny_decoder(tiny_path), load_tiny_decoder(tiny_path)
    assert graphed.capture_graphs(HW, [1, 3], capture=rerun_capture) == [1, 3]
    want, got = run_schedule(plain, SCHEDULE), run_schedule(graphed, SCHEDULE)
    assert graphed.graphs is not None and graphed.graphs.replays == len(SCHEDULE)  # one replay a call: 1 latent frame
    for i in want:
        assert len(got[i]) == len(want[i])
        assert all(torch.equal(a, b) for a, b in zip(got[i], want[i], strict=True)), i


def test_a_call_no_graph_fits_runs_its_pass(tiny_path):
    plain, graphed = load_tiny_decoder(tiny_path), load_tiny_decoder(tiny_path)
    graphed.capture_graphs(HW, [2], capture=rerun_capture)
    other = [[0], [0, 1]]  # a batch size and (below) a latent size without a graph
    want, got = run_schedule(plain, other, hw=(3, 2)), run_schedule(graphed, other, hw=(3, 2))
    assert graphed.graphs.replays == 0
    assert all(torch.equal(a, b) for i in want for a, b in zip(got[i], want[i], strict=True))
    run_schedule(graphed, [[0, 1]])
    assert graphed.graphs.replays == 1


def test_a_graph_that_differs_from_its_pass_is_left_out(tiny_path):
    part = load_tiny_decoder(tiny_path)

    def drifting(fn):  # a "capture" whose replays add to the first raw frame: not the pass it recorded
        fn()

        def replay():
            fn()
            graph = fn.__self__
            graph.frames[0].add_(1.0)

        return replay

    graphs = TinyFrameGraphs.capture(
        part._pass,
        rows=[1, 2],
        latent_channels=16,
        memory_shapes=part.model.memory_shapes(HW),
        latent_hw=HW,
        device=part.device,
        dtype=part.dtype,
        capture=drifting,
    )
    assert graphs.rows == []


def test_warm_with_graphs_captures_the_small_buckets_and_times_them_as_they_run(tiny_path):
    part = load_tiny_decoder(tiny_path)
    decoder = BatchedDecoder(part, buckets=(1, 2, GRAPHED_MAX_ROWS + 1))
    try:
        measured = decoder.warm((1, 16, 1, *HW), chunks=3, graphs=True)
        assert sorted(measured) == [1, 2, GRAPHED_MAX_ROWS + 1]
        assert part.graphs is not None and part.graphs.rows == [1, 2]  # the largest bucket stays the pass
        assert part.graphs.replays > 0  # the second timing ran the graphs
    finally:
        decoder.close()
