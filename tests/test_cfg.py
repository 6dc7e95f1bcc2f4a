"""Classifier-free guidance: the reference's two branches against masked full-sequence forwards, the scheduler's
row count, validation, and the multi-process pipeline (sequential CFG and CFG-parallel) against the reference."""

import pytest
import torch

from coordinator.requests import check_negative_text
from coordinator.scheduler import StreamBatchScheduler
from launcher.reference import ReferenceExecutor, StreamRequest
from stage_service.dit_slice import DiTSlice
from stage_service.runner import SliceRunner, combine_guidance
from stage_service.sampler import FlowSampler
from stagecast.microstep import MicroStep
from tests.oracle import chunkwise_patch_embedding, frame_mask, set_self_mask
from tests.test_streaming_semantics import TPF, make_spec

pytestmark = pytest.mark.parity


def _texts(model, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, 512, model.config.text_dim, generator=g) for _ in range(2)]


def _full(model):
    return DiTSlice.from_model(model, layers=range(model.config.num_layers), first=True, last=True)


@pytest.mark.parametrize("window,sink", [(None, 0), (2, 1)])
def test_each_branch_equals_masked_full_sequence_under_per_level(tiny_model, window, sink):
    """Every guided micro-step runs two rows; branch b at level i equals one forward over every chunk's level-i
    input with branch b's text under the block-causal mask: each branch reads its own KV rows.  The chunk is the
    sampler step of u + g * (c - u)."""
    model = tiny_model()
    n = 3
    spec = make_spec(num_chunks=n, window=window, sink=sink, policy="per_level", guidance_scale=4.5)
    text, negative = _texts(model)
    rows, inputs = {}, {}
    ref = ReferenceExecutor(_full(model))

    def trace(steps, flow, results):
        for (st, branch), row in zip(ref.runner.rows(steps), flow):
            rows[(st, branch)] = row.unsqueeze(0).clone()

    ref.trace = trace
    take = ref.runner.take_latent

    def recording_take(step):
        inputs[step] = take(step).clone()
        return inputs[step]

    ref.runner.take_latent = recording_take
    out = ref.generate([StreamRequest(spec, text, negative_text=negative)], num_stages=2, max_batch=4)
    assert len(out.chunks[1]) == n
    chunkwise_patch_embedding(model, 1)
    sampler = FlowSampler(spec)
    mask = frame_mask(spec, n, TPF)
    set_self_mask(model, mask, blockwise=True)
    for level in range(spec.steps):
        x = torch.cat([inputs[MicroStep(1, c, level)] for c in range(n)], dim=2)
        t = torch.tensor([sampler.model_timestep(level)])
        for branch, context in ((0, text), (1, negative)):
            full = model(x, t, context, return_dict=False)[0]
            for c in range(n):
                got = rows[(MicroStep(1, c, level), branch)]
                assert torch.equal(got, full[:, :, c : c + 1]), f"level {level} chunk {c} branch {branch}"
    last = spec.steps - 1
    for c in range(n):
        st = MicroStep(1, c, last)
        v = combine_guidance(rows[(st, 0)], rows[(st, 1)], spec.guidance_scale)
        assert torch.equal(out.chunks[1][c], sampler.step(inputs[st], v, last))


@pytest.mark.parametrize("policy", ["per_level", "clean"])
def test_guidance_modes_agree_and_a_negative_equal_to_the_prompt_is_no_guidance(tiny_model, policy):
    """With the negative prompt equal to the prompt, u == c and the guided stream equals the unguided one bit for
    bit (the two branches' KV rows hold the same values); CFG-parallel's reference (two groups) equals sequential
    CFG's (two rows of one batch) bit for bit, with a prompt update (the conditional branch's text changes from
    chunk 2 on, the negative prompt stays)."""
    model = tiny_model()
    text, negative = _texts(model)
    new_prompt = _texts(model, seed=9)[0]
    spec = make_spec(num_chunks=4, policy=policy, window=2, sink=1)
    guided = make_spec(num_chunks=4, policy=policy, window=2, sink=1, guidance_scale=6.0)

    def run(s, neg, cfg_parallel=1, update=True):
        ref = ReferenceExecutor(_full(model), cfg_parallel=cfg_parallel)
        from launcher.reference import build_plan

        plan = build_plan([StreamRequest(s, text)], num_stages=2, max_batch=4, cfg_parallel=cfg_parallel)
        # A prompt update from chunk 2 on, where a live stream would put it.
        at = next(i for i, ev in enumerate(plan) if ev.kind == "batch" and MicroStep(1, 2, 0) in ev.steps)
        from stagecast.microstep import PlanEvent

        if update:
            plan.insert(at, PlanEvent("prompt", stream_id=1, from_chunk=2))
        negative_texts = {1: neg} if neg is not None else None
        return ref.replay(plan, {1: text}, {(1, 2): new_prompt}, negative_texts=negative_texts)[1]

    plain = run(spec, None, update=False)
    same = run(guided, text, update=False)
    seq = run(guided, negative)
    par = run(guided, negative, cfg_parallel=2)
    assert len(plain) == len(same) == len(seq) == len(par) == 4
    assert all(torch.equal(a, b) for a, b in zip(plain, same))
    assert all(torch.equal(a, b) for a, b in zip(seq, par))
    assert all((a - b).abs().max() > 1e-3 for a, b in zip(plain, seq))  # guidance changes every chunk


def test_guided_and_unguided_streams_share_batches_and_the_unguided_one_is_unchanged(tiny_model):
    """A guided and an unguided stream in the same Stream Batches: the unguided stream's chunks equal a run of it
    alone (each row is independent of its batch), and CFG-parallel (the second group skipping the unguided stream)
    equals sequential CFG, bit for bit."""
    model = tiny_model()
    text, negative = _texts(model)
    guided = make_spec(stream_id=1, num_chunks=4, guidance_scale=5.0)
    plain = make_spec(stream_id=2, num_chunks=4, seed=3)
    requests = [StreamRequest(guided, text, negative_text=negative), StreamRequest(plain, text)]
    seq = ReferenceExecutor(_full(model)).generate(requests, num_stages=2, max_batch=4)
    mixed = [ev for ev in seq.plan if ev.kind == "batch" and len({s.stream for s in ev.steps}) > 1]
    assert mixed, "the streams never shared a batch"
    par = ReferenceExecutor(_full(model), cfg_parallel=2).generate(requests, num_stages=2, max_batch=4)
    alone = ReferenceExecutor(_full(model)).generate([StreamRequest(plain, text)], num_stages=2, max_batch=4)
    for sid in (1, 2):
        assert len(seq.chunks[sid]) == len(par.chunks[sid]) == 4
        assert all(torch.equal(a, b) for a, b in zip(seq.chunks[sid], par.chunks[sid]))
    assert all(torch.equal(a, b) for a, b in zip(seq.chunks[2], alone.chunks[2]))


def test_a_guided_micro_step_takes_two_rows_of_a_batch_in_one_pipeline():
    guided = make_spec(stream_id=1, guidance_scale=5.0, num_chunks=8)
    plain = make_spec(stream_id=2, num_chunks=8)
    for cfg_parallel, most in ((1, 4), (2, 4)):
        sched = StreamBatchScheduler(num_stages=1, max_batch=4, cfg_parallel=cfg_parallel)
        sched.add_stream(guided)
        sched.add_stream(plain)
        widest = 0
        while sched.active:
            batch = sched.tick()
            rows = sum(sched.rows(guided if st.stream == 1 else plain) for st in batch)
            assert rows <= most
            widest = max(widest, rows)
        assert widest == most
    one = StreamBatchScheduler(num_stages=1, max_batch=1)
    one.add_stream(guided)
    assert one.tick() == [MicroStep(1, 0, 0)]  # a batch always takes its first micro-step, even at 2 rows


def test_guidance_validation_names_the_field(tiny_model):
    with pytest.raises(ValueError, match="guidance_scale must be in"):
        make_spec(guidance_scale=0.5)
    with pytest.raises(ValueError, match="guidance_scale must be in"):
        make_spec(guidance_scale=float("nan"))
    spec = make_spec(guidance_scale=3.0)
    text = torch.zeros(1, 512, 32)
    with pytest.raises(ValueError, match="negative_text: required"):
        check_negative_text(spec, text, None)
    with pytest.raises(ValueError, match="negative_text: has shape"):
        check_negative_text(spec, text, torch.zeros(1, 16, 32))
    with pytest.raises(ValueError, match="negative_text: only a guided stream"):
        check_negative_text(make_spec(), text, text)
    model = tiny_model()
    runner = SliceRunner(_full(model))
    with pytest.raises(ValueError, match="needs negative_text"):
        runner.open_stream(spec, torch.zeros(1, 512, model.config.text_dim))
    with pytest.raises(ValueError, match="cfg_size"):
        SliceRunner(_full(model), cfg_rank=2, cfg_size=2)


def test_an_open_event_carries_the_guidance_scale_and_the_negative_text_over_the_wire():
    from stagecast import wire
    from stagecast.microstep import PlanEvent

    spec = make_spec(guidance_scale=4.5)
    text, negative = torch.randn(1, 512, 32), torch.randn(1, 512, 32)
    back = wire.event_from_proto(
        wire.event_to_proto(PlanEvent("open", seq=3, spec=spec, text=text, negative_text=negative), 1)
    )
    assert back.spec == spec and back.spec.guidance_scale == 4.5
    assert torch.equal(back.text, text) and torch.equal(back.negative_text, negative)
    plain = wire.event_from_proto(wire.event_to_proto(PlanEvent("open", seq=4, spec=make_spec(), text=text), 1))
    assert plain.negative_text is None and plain.spec.guidance_scale == 1.0


def test_the_slo_controller_counts_a_guided_stream_in_one_pipeline_as_two_rows_per_micro_step():
    from coordinator.slo import Demand

    plain = Demand(1, chunk_rate=4.0, allowed=(2,))
    guided = Demand(2, chunk_rate=4.0, allowed=(2,), rows=2)
    assert plain.load(2) == 8.0 and guided.load(2) == 16.0
