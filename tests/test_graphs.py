"""GraphedBlocks: the static-buffer forward a CUDA graph replays must equal the eager forward bit for bit.

On the CPU the "graph" re-runs the captured function on the same static buffers (``rerun_capture``), so these tests
hold everything but the capture itself: the batch signature, the copies into the per-slot buffers (KV window, text
K/V, RoPE, hidden states), KV writes handed back through the static outputs, and re-capture when buffers grow.
``stagecast selftest --cuda-graphs`` checks the real capture on a GPU.
"""

from __future__ import annotations

import threading

import pytest
import torch

from launcher.reference import ReferenceExecutor, StreamRequest
from stage_service.dit_slice import DiTSlice
from stage_service.graphs import GraphedBlocks
from stagecast.cuda_graphs import rerun_capture
from stagecast.microstep import StreamSpec

pytestmark = pytest.mark.parity

TIMEOUT = 60


def spec(stream_id: int, **kw) -> StreamSpec:
    base = dict(
        stream_id=stream_id,
        latent_channels=16,
        chunk_frames=1,
        latent_height=4,
        latent_width=6,
        timesteps=(1000.0, 600.0),
        num_chunks=6,
        text_len=16,
        seed=stream_id,
        window=3,
        sink=1,
    )
    base.update(kw)
    return StreamSpec(**base)


def requests(specs, arrivals, text_dim=32):
    gen = torch.Generator().manual_seed(7)
    return [StreamRequest(s, torch.randn(1, s.text_len, text_dim, generator=gen), t) for s, t in zip(specs, arrivals)]


def run(model, reqs, *, graphed: bool, num_stages=2, max_batch=3):
    full = DiTSlice.from_model(model, layers=range(model.config.num_layers), first=True, last=True)
    ref = ReferenceExecutor(full)
    graphs = None
    if graphed:
        graphs = GraphedBlocks(full, capture=rerun_capture)
        ref.runner.graphs = graphs
    out = ref.generate(reqs, num_stages=num_stages, max_batch=max_batch)
    return out, graphs


@pytest.mark.parametrize("policy", ["per_level", "clean"])
def test_graphed_blocks_equal_eager_for_concurrent_streams(tiny_model, policy):
    model = tiny_model()
    specs = [spec(1, policy=policy), spec(2, policy=policy, num_chunks=4, seed=9), spec(3, policy=policy, window=None)]
    reqs = requests(specs, arrivals=[0, 2, 3])
    eager, _ = run(model, reqs, graphed=False)
    graphed, graphs = run(model, reqs, graphed=True)
    for s in specs:
        assert len(graphed.chunks[s.stream_id]) == s.num_chunks
        for a, b in zip(eager.chunks[s.stream_id], graphed.chunks[s.stream_id], strict=True):
            assert torch.equal(a, b)
    assert graphs.captures > 0 and graphs.eager_batches == 0
    (slots,) = graphs.pools.values()  # one resolution and text length: one set of slots
    assert len(slots) == max(len(ev.steps) for ev in eager.plan if ev.kind == "batch")


def test_signatures_repeat_once_the_window_is_full(tiny_model):
    model = tiny_model()
    reqs = requests([spec(1, num_chunks=12, window=2, sink=1)], arrivals=[0])
    eager, _ = run(model, reqs, graphed=False, num_stages=1, max_batch=1)
    graphed, graphs = run(model, reqs, graphed=True, num_stages=1, max_batch=1)
    assert all(torch.equal(a, b) for a, b in zip(eager.chunks[1], graphed.chunks[1], strict=True))
    batches = sum(ev.kind == "batch" for ev in eager.plan)
    # Per level: context 0, 1 and 2 frames, writing KV or not -> a handful of graphs for 24 batches.
    assert batches == 24 and graphs.captures <= 6


def test_a_wider_window_regrows_the_buffers_and_recaptures(tiny_model):
    model = tiny_model()
    full = DiTSlice.from_model(model, layers=range(model.config.num_layers), first=True, last=True)
    graphs = GraphedBlocks(full, capture=rerun_capture)
    eager_ref, graphed_ref = ReferenceExecutor(full), ReferenceExecutor(full)
    graphed_ref.runner.graphs = graphs
    for stream, window in ((1, 2), (2, 4)):  # one after the other: the second needs bigger KV buffers
        reqs = requests([spec(stream, window=window, sink=0)], arrivals=[0])
        want = eager_ref.generate(reqs).chunks[stream]
        got = graphed_ref.generate(reqs).chunks[stream]
        assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
        tokens = graphed_ref.runner.slice.tokens_per_frame(4, 6)
        assert graphs.pools[(tokens, 16)][0].context_capacity == window * tokens
    # Closing a stream lets go of its text K/V.
    assert all(slot.text_source is None for slot in graphs.pools[(tokens, 16)])


def test_past_the_graph_limit_batches_run_eagerly_and_still_match(tiny_model):
    model = tiny_model()
    reqs = requests([spec(1)], arrivals=[0])
    eager, _ = run(model, reqs, graphed=False)
    full = DiTSlice.from_model(model, layers=range(model.config.num_layers), first=True, last=True)
    ref = ReferenceExecutor(full)
    ref.runner.graphs = graphs = GraphedBlocks(full, capture=rerun_capture, max_graphs=1)
    got = ref.generate(reqs, num_stages=2, max_batch=3)
    assert graphs.captures == 1 and graphs.eager_batches > 0
    assert all(torch.equal(a, b) for a, b in zip(eager.chunks[1], got.chunks[1], strict=True))


def test_stage_metrics_report_the_graphs(tiny_model):
    from types import SimpleNamespace

    from prometheus_client import generate_latest

    from stage_service.metrics import StageTelemetry

    model = tiny_model()
    reqs = requests([spec(1)], arrivals=[0])
    _, graphs = run(model, reqs, graphed=True)
    runner = SimpleNamespace(graphs=graphs, streams={}, memory_bytes=lambda: dict(kv=0, text_kv=0, latents=0))
    executor = SimpleNamespace(runner=runner, queue=SimpleNamespace(qsize=lambda: 0))
    gen = SimpleNamespace(executor=executor, number=1)
    text = generate_latest(StageTelemetry(0, state=lambda: gen).registry).decode()
    assert f'stagecast_stage_cuda_graphs{{stage="0"}} {float(len(graphs.graphs))}' in text
    assert f'stagecast_stage_graph_buffer_bytes{{stage="0"}} {float(graphs.nbytes)}' in text
    assert graphs.nbytes > 0 and len(graphs.graphs) > 0
    eager = generate_latest(StageTelemetry(0, state=lambda: None).registry).decode()
    assert 'stagecast_stage_cuda_graphs{stage="0"} 0.0' in eager


def test_graphed_blocks_with_per_token_timesteps_wan22_ti2v(tiny_model):
    # TI2V embeds a timestep per token: the conditioning is (B, L, 6, D), and the static buffer must follow.
    model = tiny_model("tiny-wan2.2-ti2v")
    specs = [spec(1, latent_channels=48), spec(2, latent_channels=48, num_chunks=3, seed=5)]
    reqs = requests(specs, arrivals=[0, 1], text_dim=model.config.text_dim)
    eager, _ = run(model, reqs, graphed=False)
    graphed, graphs = run(model, reqs, graphed=True)
    for s in specs:
        pairs = zip(eager.chunks[s.stream_id], graphed.chunks[s.stream_id], strict=True)
        assert all(torch.equal(a, b) for a, b in pairs)
    assert graphs.captures > 0 and graphs.eager_batches == 0


def test_a_failed_capture_falls_back_to_eager_for_good(tiny_model, caplog):
    model = tiny_model()
    reqs = requests([spec(1)], arrivals=[0])
    eager, _ = run(model, reqs, graphed=False)

    def broken(fn):
        raise RuntimeError("operation not permitted when stream is capturing")

    full = DiTSlice.from_model(model, layers=range(model.config.num_layers), first=True, last=True)
    ref = ReferenceExecutor(full)
    ref.runner.graphs = graphs = GraphedBlocks(full, capture=broken)
    got = ref.generate(reqs, num_stages=2, max_batch=3)
    assert all(torch.equal(a, b) for a, b in zip(eager.chunks[1], got.chunks[1], strict=True))
    batches = sum(ev.kind == "batch" for ev in eager.plan)
    assert graphs.eager_batches == batches and not graphs.graphs
    assert "not permitted" in graphs.failure and "runs eagerly from now on" in caplog.text


def test_two_resolutions_keep_their_own_slots_and_graphs(tiny_model):
    # Batches of two streams at different sizes alternate; each size keeps its buffers, so once both windows
    # are full nothing is captured again.
    model = tiny_model()
    specs = [
        spec(1, num_chunks=10, window=2, sink=0),
        spec(2, num_chunks=10, window=2, sink=0, latent_height=8, latent_width=6),
    ]
    reqs = requests(specs, arrivals=[0, 0])
    eager, _ = run(model, reqs, graphed=False, num_stages=1, max_batch=1)
    graphed, graphs = run(model, reqs, graphed=True, num_stages=1, max_batch=1)
    for s in specs:
        pairs = zip(eager.chunks[s.stream_id], graphed.chunks[s.stream_id], strict=True)
        assert all(torch.equal(a, b) for a, b in pairs)
    assert len(graphs.pools) == 2
    batches = sum(ev.kind == "batch" for ev in eager.plan)
    assert batches == 40 and graphs.captures <= 12  # per size: context 0, 1, 2 frames x writes or not


def background_refs(model, capture, **kw):
    """Graphs that capture new signatures in the background with ``capture`` (on first sight unless ``kw`` says
    otherwise), a reference executor that runs them and an eager one beside it, over one whole-model slice."""
    full = DiTSlice.from_model(model, layers=range(model.config.num_layers), first=True, last=True)
    graphs = GraphedBlocks(full, capture=capture, background=True, **{"min_sightings": 1, **kw})
    graphed_ref, eager_ref = ReferenceExecutor(full), ReferenceExecutor(full)
    graphed_ref.runner.graphs = graphs
    return graphs, graphed_ref, eager_ref


def test_a_new_signature_is_captured_in_the_background_and_never_stops_another_streams_chunks(tiny_model):
    # The capture hook stands in for a slow GPU capture: it holds until the gate opens.
    gate, started = threading.Event(), []

    def slow_capture(fn):
        started.append(threading.current_thread().name)
        assert gate.wait(TIMEOUT), "the gate never opened"
        return rerun_capture(fn)

    graphs, graphed_ref, eager_ref = background_refs(tiny_model(), slow_capture)

    # Stream 1 alone, the gate open: its signatures get graphs (first seen: eager, captured off the serving path).
    gate.set()
    first = requests([spec(1, num_chunks=8, window=2, sink=0)], arrivals=[0])
    got = graphed_ref.generate(first, num_stages=2, max_batch=2).chunks[1]
    graphs.wait_captures(TIMEOUT)
    assert all(torch.equal(a, b) for a, b in zip(eager_ref.generate(first, num_stages=2, max_batch=2).chunks[1], got))
    known, captured = set(graphs.graphs), graphs.captures
    assert captured > 0 and captured == graphs.background_captures and not graphs.pending
    assert all(name.startswith("graph-capture") for name in started)

    # The gate shut: stream 3 (stream 1's size) runs with stream 2, the first at a new size.  Its captures hang, and
    # both streams still run to the end.
    gate.clear()
    specs = [
        spec(3, num_chunks=8, window=2, sink=0),
        spec(2, num_chunks=6, window=2, sink=0, latent_height=8, latent_width=6),
    ]
    both = requests(specs, arrivals=[0, 3])
    result = {}
    worker = threading.Thread(
        target=lambda: result.update(graphed_ref.generate(both, num_stages=2, max_batch=2).chunks)
    )
    worker.start()
    worker.join(TIMEOUT)
    assert not worker.is_alive(), "a capture held the serving path"
    want = eager_ref.generate(both, num_stages=2, max_batch=2).chunks
    for s in specs:
        assert len(result[s.stream_id]) == s.num_chunks
        assert all(torch.equal(a, b) for a, b in zip(want[s.stream_id], result[s.stream_id], strict=True))
    assert graphs.captures == captured and graphs.pending  # nothing new was captured, the new size is waiting
    assert all(sig[0][1] != next(iter(known))[0][1] for sig in graphs.pending)  # only the new size's signatures

    # Open the gate: the new size's graphs arrive and are replayed, still bit for bit.  A stream of that size alone
    # forms some batches the mixed run did not (its first chunks there went ahead of stream 3's, in batches of their
    # own), and a signature is captured at its second sighting: after two such streams, a third replays every batch.
    gate.set()
    graphs.wait_captures(TIMEOUT)
    assert graphs.captures > captured and not graphs.pending and graphs.private_slots
    eager_before = None
    for sid in (4, 5, 6):
        if sid == 6:
            graphs.wait_captures(TIMEOUT)
            eager_before = graphs.eager_batches
        again = requests([spec(sid, num_chunks=6, window=2, sink=0, latent_height=8, latent_width=6)], arrivals=[0])
        got = graphed_ref.generate(again, num_stages=2, max_batch=2).chunks[sid]
        want = eager_ref.generate(again, num_stages=2, max_batch=2).chunks[sid]
        assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
    assert graphs.eager_batches == eager_before  # every signature of that size now replays a graph
    graphs.close()


@pytest.mark.parametrize("policy", ["per_level", "clean"])
def test_graphed_blocks_equal_eager_for_guided_streams(tiny_model, policy):
    """Classifier-free guidance: a guided stream's two rows (its own text K/V per branch, its own KV rows) share
    graphed batches with an unguided stream, bit for bit the eager forward."""
    model = tiny_model()
    specs = [spec(1, policy=policy, guidance_scale=5.0), spec(2, policy=policy, num_chunks=4, seed=9)]
    reqs = requests(specs, arrivals=[0, 1])
    gen = torch.Generator().manual_seed(8)
    reqs[0].negative_text = torch.randn(1, specs[0].text_len, 32, generator=gen)
    eager, _ = run(model, reqs, graphed=False)
    graphed, graphs = run(model, reqs, graphed=True)
    for s in specs:
        assert len(graphed.chunks[s.stream_id]) == s.num_chunks
        for a, b in zip(eager.chunks[s.stream_id], graphed.chunks[s.stream_id], strict=True):
            assert torch.equal(a, b)
    assert graphs.captures > 0 and graphs.eager_batches == 0


def test_a_warm_up_streams_batches_capture_in_line_and_the_next_stream_replays_only(tiny_model):
    # The gateway's warm-up stream (spec.warmup) before it serves: its batches wait for their captures, on the
    # executor's thread, so the first real stream of the same defaults finds every graph it needs.
    threads = []

    def capture(fn):
        threads.append(threading.current_thread().name)
        return rerun_capture(fn)

    graphs, graphed_ref, eager_ref = background_refs(tiny_model(), capture)

    warm = requests([spec(1, num_chunks=8, window=3, sink=1, warmup=True)], arrivals=[0])
    got = graphed_ref.generate(warm, num_stages=2, max_batch=2).chunks[1]
    want = eager_ref.generate(warm, num_stages=2, max_batch=2).chunks[1]
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))  # captured in line, still exact
    assert graphs.captures > 0 and graphs.background_captures == 0 and not graphs.pending
    assert graphs.eager_batches == 0  # no batch of the warm-up ran eagerly: each waited for its graph
    assert threads and not any(name.startswith("graph-capture") for name in threads)

    captured = graphs.captures
    real = requests([spec(2, num_chunks=8, window=3, sink=1)], arrivals=[0])
    got = graphed_ref.generate(real, num_stages=2, max_batch=2).chunks[2]
    want = eager_ref.generate(real, num_stages=2, max_batch=2).chunks[2]
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
    assert graphs.captures == captured and graphs.eager_batches == 0 and not graphs.pending  # replays only


def test_a_batch_mixing_a_warm_up_stream_with_another_still_captures_in_the_background(tiny_model):
    gate = threading.Event()

    def slow_capture(fn):
        assert gate.wait(TIMEOUT), "the gate never opened"
        return rerun_capture(fn)

    graphs, ref, _ = background_refs(tiny_model(), slow_capture)
    # Both streams arrive together and every batch holds both: the real one is never held by a capture.
    both = requests([spec(1, num_chunks=4, warmup=True), spec(2, num_chunks=4)], arrivals=[0, 0])
    worker = threading.Thread(target=lambda: ref.generate(both, num_stages=1, max_batch=2))
    worker.start()
    worker.join(TIMEOUT)
    assert not worker.is_alive(), "a mixed batch waited for its capture"
    assert graphs.pending and graphs.eager_batches > 0
    gate.set()
    graphs.wait_captures(TIMEOUT)


def one_stream_executor(model, *, warmup: bool):
    """A graphed stage executor (background captures) with stream 1 open (one step, a 2-frame window); its events,
    and ``run(c)``, which runs the stream's chunk c as a batch of its own."""
    from stage_service.executor import StageExecutor
    from stage_service.runner import SliceRunner
    from stagecast.microstep import MicroStep, PlanEvent

    full = DiTSlice.from_model(model, layers=range(model.config.num_layers), first=True, last=True)
    runner = SliceRunner(full, graphs=GraphedBlocks(full, capture=rerun_capture, background=True))
    events = []
    ex = StageExecutor(runner, None, events.append)
    s = spec(1, timesteps=(700.0,), num_chunks=6, window=2, sink=0, warmup=warmup)
    ex._run(PlanEvent("open", seq=1, spec=s, text=torch.randn(1, s.text_len, model.config.text_dim)))
    return runner, events, lambda c: ex._run(PlanEvent("batch", seq=2 + c, steps=(MicroStep(1, c, 0),)))


def test_a_batch_that_captured_in_line_reports_no_time_to_the_slo_model(tiny_model):
    # A warm-up stream's forward that waited for its capture took the capture's time (seconds on a GPU): the stage
    # reports it with no micro-steps, which the coordinator's SLO model skips; a replayed batch is reported as usual.
    runner, events, run_chunk = one_stream_executor(tiny_model(), warmup=True)
    for c in range(6):
        run_chunk(c)
    done = [e for e in events if e.kind == "done"]
    # Chunks 0, 1, 2 meet contexts of 0, 1 and 2 frames (new signatures, captured in line); 3-5 replay.
    assert [e.micro_steps for e in done] == [0, 0, 0, 1, 1, 1]
    assert all(e.forward_ms > 0 for e in done[3:]) and all(e.forward_ms == 0 for e in done[:3])
    assert runner.graphs.inline_captures == 3 and runner.graphs.background_captures == 0


def test_a_batch_run_without_its_graph_is_reported_as_eager_in_its_own_timing(tiny_model):
    # The SLO model learns a batch size's time from each timed batch, and skips those run eagerly (a signature not
    # captured yet, about twice a graph's time): each BatchDone carries its batches' times one by one, flagged.
    runner, events, run_chunk = one_stream_executor(tiny_model(), warmup=False)
    for c in range(4):
        run_chunk(c)
    runner.graphs.wait_captures(TIMEOUT)  # chunk 3 met chunk 2's signature again: its graph was captured beside it
    for c in range(4, 6):
        run_chunk(c)
    done = [e for e in events if e.kind == "done"]
    assert [[t.eager for t in e.timed] for e in done] == [[True]] * 4 + [[False]] * 2
    assert [e.eager for e in done] == [True] * 4 + [False] * 2
    assert all(len(e.timed) == e.batches == 1 and e.timed[0].micro_steps == 1 for e in done)
    assert all(e.forward_ms == e.timed[0].forward_ms > 0 for e in done)


@pytest.mark.parametrize("background", [False, True])
def test_graph_buffers_stay_within_their_cap_and_the_rest_runs_eagerly_bit_for_bit(tiny_model, background):
    # A window that keeps growing gives every chunk a new signature: with no cap its buffers grow with it (a copy of
    # the window per slot, per background signature); with one, signatures past it run eagerly, and results agree.
    model = tiny_model()
    reqs = requests([spec(1, num_chunks=8, window=None, sink=0)], arrivals=[0])
    full = DiTSlice.from_model(model, layers=range(model.config.num_layers), first=True, last=True)
    want = ReferenceExecutor(full).generate(reqs, num_stages=2, max_batch=2).chunks[1]

    def graphed(cap):
        ref = ReferenceExecutor(full)
        graphs = GraphedBlocks(
            full,
            capture=rerun_capture,
            background=background,
            max_buffer_bytes=cap,
            min_sightings=1,
            idle_batches=1 << 30,
        )
        ref.runner.graphs = graphs
        got = ref.generate(reqs, num_stages=2, max_batch=2).chunks[1]
        graphs.wait_captures(TIMEOUT)
        graphs.close()
        assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
        return graphs

    free = graphed(None)
    cap = free.nbytes // 2
    capped = graphed(cap)
    assert 0 < capped.nbytes <= cap < free.nbytes
    assert 0 < capped.captures < free.captures
    if not background:  # (in the background every new signature's first batch runs eagerly anyway)
        assert capped.eager_batches > free.eager_batches == 0


def test_attention_reads_consecutive_rows_of_the_kv_stack_in_place(tiny_model):
    # The static K/V stack holds each row's window with the forward's new K/V right after it: a group of consecutive
    # rows with full windows is one view of the stack (no copy); shorter windows, other stacks or a gap fall back.
    from stage_service.dit_slice import in_place_reader
    from stage_service.graphs import _StaticKV

    model = tiny_model()
    full = DiTSlice.from_model(model, layers=range(model.config.num_layers), first=True, last=True)
    graphs = GraphedBlocks(full, capture=rerun_capture, reserve_rows=3)
    layers, tokens, window = full.num_layers, 4, 8
    slots = graphs._new_slots(layers, 3, window, tokens, 16, 2, 12, torch.float32, device=torch.device("cpu"))
    other = graphs._new_slots(layers, 1, window, tokens, 16, 2, 12, torch.float32, device=torch.device("cpu"))
    gen = torch.Generator().manual_seed(3)
    for slot in slots:
        slot.stack.k.copy_(torch.randn(slot.stack.k.shape, generator=gen))
    views = [_StaticKV(s, tokens=window, writes=True) for s in slots]
    group = in_place_reader(views, layer=1)
    k, v = group([0, 1, 2], window, tokens)
    assert k.data_ptr() == slots[0].stack.k[1].data_ptr() and k.shape == (3, window + tokens, 2, 12)
    new = torch.randn(1, tokens, 2, 12, generator=gen)
    views[1].write(1, new, new)  # the new K/V land right after row 1's window, where the view reads them
    assert torch.equal(k[1:2, window:], new) and torch.equal(v[1:2, window:], new)
    short = [_StaticKV(s, tokens=window - 2, writes=False) for s in slots]
    k, _ = in_place_reader(short, layer=0)([0, 1], window - 2, tokens)
    assert k.is_contiguous() and k.data_ptr() != slots[0].stack.k.data_ptr()
    assert torch.equal(k, slots[0].stack.k[0, 0:2, : window - 2 + tokens])
    assert in_place_reader(views, layer=0)([0, 2], window, tokens) is None  # not consecutive rows
    mixed = [views[0], _StaticKV(other[0], tokens=window, writes=True)]
    assert in_place_reader(mixed, layer=0)([0, 1], window, tokens) is None  # two stacks
    assert in_place_reader([None, None], layer=0) is None  # no windows at all


def test_the_kv_stack_is_made_for_the_reserved_rows_and_more_rows_add_a_stack(tiny_model):
    model = tiny_model()
    reqs = requests([spec(1)], arrivals=[0])
    eager, _ = run(model, reqs, graphed=False, num_stages=1, max_batch=1)
    full = DiTSlice.from_model(model, layers=range(model.config.num_layers), first=True, last=True)
    ref = ReferenceExecutor(full)
    ref.runner.graphs = graphs = GraphedBlocks(full, capture=rerun_capture, reserve_rows=3)
    got = ref.generate(reqs, num_stages=1, max_batch=1)
    assert all(torch.equal(a, b) for a, b in zip(eager.chunks[1], got.chunks[1], strict=True))
    (slots,) = graphs.pools.values()
    assert len(slots) == 3 and len({id(s.stack) for s in slots}) == 1 and slots[0].stack.rows == 3
    captured, signatures = graphs.captures, set(graphs.graphs)
    # A batch of 4 rows (past the reserve) adds a one-row stack; the graphs on the first stack stay.
    specs = [spec(s, seed=s) for s in (2, 3, 4, 5)]
    reqs = requests(specs, arrivals=[0, 0, 0, 0])
    eager4, _ = run(model, reqs, graphed=False, num_stages=1, max_batch=4)
    got4 = ref.generate(reqs, num_stages=1, max_batch=4)
    for s in specs:
        assert all(torch.equal(a, b) for a, b in zip(eager4.chunks[s.stream_id], got4.chunks[s.stream_id], strict=True))
    (slots,) = graphs.pools.values()
    assert len(slots) == 4 and slots[3].stack is not slots[0].stack and slots[3].row == 0
    assert graphs.captures > captured and graphs.eager_batches == 0
    assert signatures <= set(graphs.graphs)  # not captured again


def one_step(stream_id: int, **kw) -> StreamSpec:
    """A one-level stream: each chunk's batch is seen once, so the window's filling chunks make signatures that
    never repeat, and the full window's signature repeats every chunk."""
    return spec(stream_id, **{"timesteps": (1000.0,), "num_chunks": 8, "window": 2, "sink": 0, **kw})


def test_a_background_capture_waits_for_a_signature_to_repeat(tiny_model):
    graphs, graphed_ref, eager_ref = background_refs(tiny_model(), rerun_capture, min_sightings=2)
    reqs = requests([one_step(1)], arrivals=[0])
    got = graphed_ref.generate(reqs, num_stages=1, max_batch=1).chunks[1]
    graphs.wait_captures(TIMEOUT)
    want = eager_ref.generate(reqs, num_stages=1, max_batch=1).chunks[1]
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
    # The filling window's contexts (0 and 1 chunk) were seen once each: only the full window's signature, seen on
    # every later chunk, was captured (from its second sighting; its batches ran eagerly until the graph landed).
    tokens = {sig[0][1] for sig in graphs.graphs}  # per chunk
    contexts = [sig[4] for sig in graphs.graphs]
    assert graphs.captures == 1 and contexts == [((2 * min(tokens), True),)], contexts
    assert graphs.eager_batches >= 4 and graphs.runs == 8  # (how many more depends on when the capture landed)
    # A second stream of that spec: its full window replays the graph, and the filling contexts, seen a second time
    # now, run eagerly once more while they are captured.
    eager_before = graphs.eager_batches
    again = requests([one_step(2)], arrivals=[0])
    got = graphed_ref.generate(again, num_stages=1, max_batch=1).chunks[2]
    graphs.wait_captures(TIMEOUT)
    want = eager_ref.generate(again, num_stages=1, max_batch=1).chunks[2]
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
    assert graphs.eager_batches - eager_before == 2 and graphs.captures == 3
    graphs.close()


def test_an_idle_background_graph_is_evicted_for_a_new_signature_past_the_buffer_cap(tiny_model):
    model = tiny_model()
    small, large = one_step(1), one_step(2, latent_height=8)

    def alone(s):
        graphs, ref, _ = background_refs(model, rerun_capture, min_sightings=2)
        ref.generate(requests([s], arrivals=[0]), num_stages=1, max_batch=1)
        graphs.wait_captures(TIMEOUT)
        graphs.close()
        (sig,) = graphs.graphs
        return graphs.nbytes, sig[0][1]

    (small_bytes, small_tokens), (large_bytes, large_tokens) = alone(small), alone(large)
    cap = max(small_bytes, large_bytes)  # either stream's graph fits, both do not

    def small_then_large(idle_batches):
        graphs, ref, eager = background_refs(
            model, rerun_capture, min_sightings=2, max_buffer_bytes=cap, idle_batches=idle_batches
        )
        eager_runs = []
        for s in (small, large, large):  # the large stream twice: the second run meets what the first left
            reqs = requests([s], arrivals=[0])
            before = graphs.eager_batches
            got = ref.generate(reqs, num_stages=1, max_batch=1).chunks[s.stream_id]
            graphs.wait_captures(TIMEOUT)
            eager_runs.append(graphs.eager_batches - before)
            want = eager.generate(reqs, num_stages=1, max_batch=1).chunks[s.stream_id]
            assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
        graphs.close()
        assert graphs.nbytes <= cap
        return graphs, {sig[0][1] for sig in graphs.graphs}, eager_runs[-1]  # tokens per item of the graphs kept

    # The small stream's graph has been idle for the large stream's 4 batches: it makes room for the large one's,
    # which the large stream's second run replays from its full window on (its 2 filling chunks run eagerly).
    evicting, kept, last_eager = small_then_large(idle_batches=4)
    assert evicting.evictions == 1 and kept == {large_tokens} and last_eager == 2
    # Not idle long enough: the small stream's graph stays, and every batch of the large stream runs eagerly.
    keeping, kept, last_eager = small_then_large(idle_batches=1 << 30)
    assert keeping.evictions == 0 and kept == {small_tokens} and last_eager == large.num_chunks
