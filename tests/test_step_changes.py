"""Step changes (the SLO controller's) have exact semantics, pinned by full-sequence oracles.

* ``per_level``: a change starts a new KV segment (a window reset): each segment's streaming outputs equal one
  masked full-sequence forward over that segment's level-i inputs, with its own ladder, bit for bit.
* ``clean``: a chunk runs its own ladder and attends to the clean K/V of every earlier chunk, whatever ladder
  made them: it equals a forward over [earlier clean chunks at t=0, itself at its level's timestep].
"""

import pytest
import torch

from coordinator.scheduler import StreamBatchScheduler
from launcher.reference import ReferenceExecutor, StreamRequest, build_plan
from stage_service.dit_slice import DiTSlice
from stage_service.kv_cache import KVOrderError
from stage_service.sampler import FlowSampler
from stagecast.microstep import ChunkSpecs, MicroStep, StreamSpec, context_frames, rope_offset
from tests.oracle import chunkwise_patch_embedding, frame_mask, set_self_mask

pytestmark = pytest.mark.parity

H, W = 4, 4
TPF = (H // 2) * (W // 2)
THREE = (1000.0, 600.0, 300.0)
TWO = (1000.0, 500.0)


def make_spec(**kw) -> StreamSpec:
    base = dict(stream_id=1, latent_channels=16, chunk_frames=1, latent_height=H, latent_width=W, timesteps=THREE)
    return StreamSpec(**{**base, **kw})


def traced(model, request: StreamRequest, num_stages=2, max_batch=4):
    flows, inputs = {}, {}
    full = DiTSlice.from_model(model, layers=range(model.config.num_layers), first=True, last=True)
    ref = ReferenceExecutor(
        full, trace=lambda steps, flow, _: flows.update({s: flow[i : i + 1].clone() for i, s in enumerate(steps)})
    )
    take = ref.runner.take_latent

    def recording_take(step):
        x = take(step)
        inputs[step] = x.clone()
        return x

    ref.runner.take_latent = recording_take
    plan = build_plan([request], num_stages=num_stages, max_batch=max_batch)
    chunks = ref.replay(plan, {request.spec.stream_id: request.text})
    return plan, chunks, flows, inputs


def segments(plan, spec: StreamSpec, num_chunks: int) -> list[tuple[int, int, tuple[float, ...]]]:
    """(first chunk, end chunk, ladder) of every ladder the plan ran."""
    starts = [(0, spec.timesteps)] + [(ev.from_chunk, ev.timesteps) for ev in plan if ev.kind == "steps"]
    return [(a, b, ladder) for (a, ladder), (b, _) in zip(starts, starts[1:] + [(num_chunks, ())])]


def test_chunk_specs_resolve_each_chunks_ladder_and_segment():
    specs = ChunkSpecs(make_spec(policy="per_level"))
    assert specs.change(3, TWO) and not specs.change(3, TWO)  # the same ladder again changes nothing
    assert specs.at(2).timesteps == THREE and specs.at(3).steps == 2 and specs.at(3).segment_start == 3
    assert specs.starts_segment(3) and not specs.starts_segment(4)
    with pytest.raises(ValueError, match="chunks from 3 on were already changed"):
        specs.change(2, THREE)
    with pytest.raises(ValueError, match="strictly decreasing"):
        specs.change(5, (500.0, 600.0))
    # A segment restarts context and positions, as an epoch does.
    seg = specs.at(3)
    assert (
        context_frames(seg, 3, 1024) == [] and context_frames(seg, 5, 1024) == [3, 4] and rope_offset(seg, 5, 1024) == 2
    )
    specs.change(6, THREE)
    specs.prune(before=6)
    assert [first for first, _ in specs.changes] == [6]
    clean = ChunkSpecs(make_spec(policy="clean"))
    clean.change(2, TWO)
    assert clean.at(2).segment_start == 0 and not clean.starts_segment(2)


def test_scheduler_starts_a_per_level_segment_while_the_old_ladder_finishes_and_keeps_chunk_order():
    sched = StreamBatchScheduler(num_stages=2, max_batch=8)
    sched.add_stream(make_spec(num_chunks=6, policy="per_level"))
    issued = []
    while sched.active:
        if sched.now == 2:
            assert sched.set_steps(1, TWO) == 2
        issued.append(sched.tick())
    levels = {}
    for tick, batch in enumerate(issued):
        for st in batch:
            levels.setdefault(st.chunk, []).append((tick, st.level))
    assert [len(levels[c]) for c in range(6)] == [3, 3, 2, 2, 2, 2]
    last_old = max(t for c in (0, 1) for t, _ in levels[c])
    assert min(t for t, _ in levels[2]) < last_old  # chunk 2 did not wait for chunks 0 and 1 to leave (no drain)
    finished = [max(t for t, _ in levels[c]) for c in range(6)]
    assert finished == sorted(finished) and len(set(finished)) == 6  # chunks finish in order, one per tick at most
    at = {(c, lv): t for c, ticks in levels.items() for t, lv in ticks}
    assert at[(2, 0)] > at[(1, 0)] and at[(2, 1)] > at[(1, 1)]  # level i after the chunk before it at level i


def test_per_level_step_changes_equal_the_masked_full_sequence_forward_of_each_segment(tiny_model):
    model = tiny_model()
    n = 8
    spec = make_spec(num_chunks=n, window=3, sink=1, policy="per_level")
    text = torch.randn(1, spec.text_len, model.config.text_dim, generator=torch.Generator().manual_seed(11))
    plan, chunks, flows, inputs = traced(model, StreamRequest(spec, text, step_changes={2: TWO, 8: THREE}))
    assert len(chunks[1]) == n
    segs = segments(plan, spec, n)
    assert [len(ladder) for _, _, ladder in segs] == [3, 2, 3] and all(b > a for a, b, _ in segs), segs
    chunkwise_patch_embedding(model, 1)
    for a, b, ladder in segs:
        seg_spec = make_spec(num_chunks=b - a, window=3, sink=1, timesteps=ladder)
        set_self_mask(model, frame_mask(seg_spec, b - a, TPF))
        sampler = FlowSampler(seg_spec)
        for level in range(len(ladder)):
            x = torch.cat([inputs[MicroStep(1, c, level)] for c in range(a, b)], dim=2)
            full = model(x, torch.tensor([sampler.model_timestep(level)]), text, return_dict=False)[0]
            for c in range(a, b):
                got = flows[MicroStep(1, c, level)]
                want = full[:, :, c - a : c - a + 1]
                assert torch.equal(got, want), f"chunk {c} level {level}: {(got - want).abs().max()}"
        assert MicroStep(1, a, len(ladder)) not in flows  # each chunk ran exactly its own ladder's levels


def test_clean_step_changes_attend_to_clean_context_whatever_ladder_made_it(tiny_model):
    model = tiny_model()
    n = 4
    spec = make_spec(num_chunks=n, policy="clean")
    text = torch.randn(1, spec.text_len, model.config.text_dim, generator=torch.Generator().manual_seed(12))
    plan, chunks, flows, inputs = traced(model, StreamRequest(spec, text, step_changes={3: TWO}), num_stages=1)
    (change,) = [ev for ev in plan if ev.kind == "steps"]
    assert 0 < change.from_chunk < n
    clean = chunks[1]
    chunkwise_patch_embedding(model, 1)
    for c in range(n):
        ladder = TWO if c >= change.from_chunk else THREE
        sampler = FlowSampler(make_spec(timesteps=ladder))
        set_self_mask(model, frame_mask(spec, c + 1, TPF))
        for level in range(len(ladder)):
            x = torch.cat([*clean[:c], inputs[MicroStep(1, c, level)]], dim=2)
            per_token = torch.zeros(1, (c + 1) * TPF)
            per_token[:, c * TPF :] = sampler.model_timestep(level)
            full = model(x, per_token, text, return_dict=False)[0]
            got = flows[MicroStep(1, c, level)]
            # Mixed timesteps take diffusers' per-token path, which differs from the scalar path in rounding.
            assert torch.allclose(got, full[:, :, c : c + 1], atol=5e-6, rtol=0), (got - full[:, :, c:]).abs().max()
        assert MicroStep(1, c, len(ladder) + 1) not in flows  # its ladder's levels and one clean pass


def test_a_step_change_for_a_chunk_already_started_is_refused(tiny_model):
    model = tiny_model()
    full = DiTSlice.from_model(model, layers=range(model.config.num_layers), first=True, last=True)
    ref = ReferenceExecutor(full)
    spec = make_spec(num_chunks=3, policy="per_level")
    ref.runner.open_stream(spec, torch.zeros(1, spec.text_len, model.config.text_dim))
    ref.run_batch([MicroStep(1, 0, 0)])
    with pytest.raises(ValueError, match="chunk 0, which has already started"):
        ref.runner.set_steps(1, 0, TWO)
    # A segment that is over cannot be written again.
    ref.runner.set_steps(1, 1, TWO)
    ref.run_batch([MicroStep(1, 0, 1)])
    ref.run_batch([MicroStep(1, 0, 2)])
    ref.run_batch([MicroStep(1, 1, 0)])
    with pytest.raises(KVOrderError, match="segment"):
        ref.runner.streams[1].kv[0].enter_segment(0)  # the conditional branch's cache
