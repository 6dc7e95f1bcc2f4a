"""Video-to-video in the reference executor and the scheduler: level 0 comes from the stream's input latents.

A video-to-video stream fed, as its input, exactly the noise a text stream would draw for level 0 is that text stream
bit for bit (everything after level 0, the sampler's fresh noise included, is the same function of the spec); fed
other latents, only the chunks from the changed one on differ.  The scheduler starts a chunk only once its input is
there, and a stop ends the stream after the chunks whose input arrived.
"""

from dataclasses import replace

import pytest
import torch

from coordinator.scheduler import StreamBatchScheduler
from launcher.reference import ReferenceExecutor, StreamRequest, build_plan
from stage_service.dit_slice import DiTSlice
from stage_service.kv_cache import KVOrderError
from stage_service.sampler import chunk_noise
from stagecast.microstep import MicroStep, StreamSpec

pytestmark = pytest.mark.unit

CHUNKS = 3


def spec(policy="per_level", **kw):
    base = dict(
        stream_id=1,
        latent_channels=16,
        chunk_frames=1,
        latent_height=4,
        latent_width=4,
        timesteps=(600.0, 300.0),
        seed=5,
        policy=policy,
        num_chunks=CHUNKS,
    )
    base.update(kw)
    return StreamSpec(**base)


def run(model, requests, num_stages=2):
    full = DiTSlice.from_model(model, layers=range(model.config.num_layers), first=True, last=True)
    return ReferenceExecutor(full).generate(requests, num_stages=num_stages).chunks


@pytest.mark.parametrize("policy", ["per_level", "clean"])
def test_input_latents_replace_level_zero_noise_and_nothing_else(tiny_model, policy):
    model = tiny_model()
    text = torch.randn(1, 512, model.config.text_dim, generator=torch.Generator().manual_seed(3))
    t2v = spec(policy)
    v2v = replace(t2v, num_chunks=None, input_latents=True)
    noise = [chunk_noise(t2v, c, 0) for c in range(CHUNKS)]
    want = run(model, [StreamRequest(t2v, text)])[1]
    got = run(model, [StreamRequest(v2v, text, inputs=noise)])[1]
    assert len(got) == len(want) == CHUNKS
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    other = list(noise)
    other[1] = torch.randn(t2v.latent_shape, generator=torch.Generator().manual_seed(9))
    changed = run(model, [StreamRequest(v2v, text, inputs=other)])[1]
    assert torch.equal(changed[0], want[0])
    assert not torch.equal(changed[1], want[1]) and not torch.equal(changed[2], want[2])


def test_a_chunk_starts_only_once_its_input_is_there_and_a_stop_keeps_the_inputs_already_here():
    sched = StreamBatchScheduler(num_stages=2, max_batch=4)
    s = spec(num_chunks=None, input_latents=True)
    sched.add_stream(s)
    assert [sched.tick() for _ in range(3)] == [[], [], []]
    sched.set_inputs(1, 2)
    sched.stop_stream(1)  # the input ended after two chunks
    started = []
    while sched.active:
        started += [st.chunk for st in sched.tick() if st.level == 0]
    assert started == [0, 1]
    text_stream = spec(stream_id=2)
    sched.add_stream(text_stream)
    with pytest.raises(ValueError, match="no input latents"):
        sched.set_inputs(2, 1)


def test_a_plan_puts_each_input_right_before_the_batch_that_starts_its_chunk():
    s = spec(num_chunks=None, input_latents=True)
    inputs = [torch.zeros(s.latent_shape)] * CHUNKS
    plan = build_plan([StreamRequest(s, torch.zeros(1, 512, 8), inputs=inputs)], num_stages=2, max_batch=4)
    kinds = [ev.kind for ev in plan]
    assert kinds.count("input") == CHUNKS and kinds[-1] == "close"
    for i, ev in enumerate(plan):
        if ev.kind == "input":
            assert plan[i + 1].kind == "batch" and MicroStep(1, ev.chunk, 0) in plan[i + 1].steps


def test_runner_refuses_a_missing_or_misshapen_input(tiny_model):
    model = tiny_model()
    full = DiTSlice.from_model(model, layers=range(model.config.num_layers), first=True, last=True)
    ref = ReferenceExecutor(full)
    s = spec(num_chunks=None, input_latents=True)
    ref.runner.open_stream(s, torch.zeros(1, 512, model.config.text_dim))
    with pytest.raises(KVOrderError, match="have not arrived"):
        ref.run_batch([MicroStep(1, 0, 0)])
    with pytest.raises(ValueError, match="expected"):
        ref.runner.put_input(1, 0, torch.zeros(1, 16, 1, 4, 2))
    ref.runner.put_input(1, 0, torch.zeros(s.latent_shape))
    with pytest.raises(ValueError, match="twice"):
        ref.runner.put_input(1, 0, torch.zeros(s.latent_shape))
    ref.runner.open_stream(spec(stream_id=2), torch.zeros(1, 512, model.config.text_dim))
    with pytest.raises(ValueError, match="not a video-to-video stream"):
        ref.runner.put_input(2, 0, torch.zeros(s.latent_shape))
