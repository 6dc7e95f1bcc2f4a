"""The reference executor's streaming outputs equal full-sequence forwards under block-causal masks."""

import pytest
import torch

from launcher.reference import ReferenceExecutor, StreamRequest
from stage_service.dit_slice import DiTSlice
from stage_service.sampler import FlowSampler
from stagecast.microstep import StreamSpec, context_frames
from tests.oracle import chunkwise_patch_embedding, frame_mask, set_self_mask

H, W = 4, 4  # latent size: 2x2 patches -> 4 tokens per frame
TPF = (H // 2) * (W // 2)


def traced_run(model, spec, text, *, num_stages=1, max_batch=4):
    calls = []

    def trace(steps, flow, results):
        for i, st in enumerate(steps):
            calls.append((st, flow[i : i + 1].clone()))

    full = DiTSlice.from_model(model, layers=range(model.config.num_layers), first=True, last=True)
    inputs = {}
    runner_take = None
    ref = ReferenceExecutor(full, trace=trace)
    runner_take = ref.runner.take_latent

    def recording_take(step):
        x = runner_take(step)
        inputs[step] = x.clone()
        return x

    ref.runner.take_latent = recording_take
    out = ref.generate([StreamRequest(spec, text)], num_stages=num_stages, max_batch=max_batch)
    return out, dict(calls), inputs


def make_spec(**kw):
    base = dict(
        stream_id=1,
        latent_channels=16,
        chunk_frames=1,
        latent_height=H,
        latent_width=W,
        timesteps=(1000.0, 600.0, 300.0),
    )
    base.update(kw)
    return StreamSpec(**base)


@pytest.mark.parametrize("chunk_frames", [1, 2])
@pytest.mark.parametrize("window,sink", [(None, 0), (2, 0), (3, 1)])
def test_per_level_streaming_equals_masked_full_sequence_per_level(tiny_model, chunk_frames, window, sink):
    model = tiny_model()
    n = 4
    spec = make_spec(chunk_frames=chunk_frames, num_chunks=n, window=window, sink=sink, policy="per_level")
    text = torch.randn(1, spec.text_len, model.config.text_dim, generator=torch.Generator().manual_seed(3))
    out, flows, inputs = traced_run(model, spec, text, num_stages=2)
    assert len(out.chunks[1]) == n
    chunkwise_patch_embedding(model, chunk_frames)
    sampler = FlowSampler(spec)
    mask = frame_mask(spec, n, TPF)
    for level in range(spec.steps):
        x = torch.cat([inputs[step] for step in sorted(inputs, key=lambda s: s.chunk) if step.level == level], dim=2)
        t = torch.tensor([sampler.model_timestep(level)])
        set_self_mask(model, mask, blockwise=True)
        full = model(x, t, text, return_dict=False)[0]
        set_self_mask(model, mask, blockwise=False)
        dense = model(x, t, text, return_dict=False)[0]
        assert torch.allclose(full, dense, atol=1e-6, rtol=0)
        for c in range(n):
            step = next(s for s in flows if s.chunk == c and s.level == level)
            part = full[:, :, c * chunk_frames : (c + 1) * chunk_frames]
            assert torch.equal(flows[step], part), f"level {level} chunk {c}: {(flows[step] - part).abs().max()}"


def test_clean_policy_chunk_equals_full_forward_over_clean_context(tiny_model):
    model = tiny_model()
    n = 3
    spec = make_spec(num_chunks=n, policy="clean", chunk_frames=1)
    text = torch.randn(1, spec.text_len, model.config.text_dim, generator=torch.Generator().manual_seed(4))
    out, flows, inputs = traced_run(model, spec, text, num_stages=1)
    chunkwise_patch_embedding(model, 1)
    clean = out.chunks[1]
    sampler = FlowSampler(spec)
    for c in range(n):
        set_self_mask(model, frame_mask(spec, c + 1, TPF))
        for level in range(spec.steps):
            step = next(s for s in flows if s.chunk == c and s.level == level)
            x = torch.cat([*clean[:c], inputs[step]], dim=2)
            per_token = torch.zeros(1, (c + 1) * TPF)
            per_token[:, c * TPF :] = sampler.model_timestep(level)
            full = model(x, per_token, text, return_dict=False)[0]
            got = flows[step]
            # Mixed timesteps need diffusers' per-token path, which differs from the scalar path in rounding.
            assert torch.allclose(got, full[:, :, c : c + 1], atol=5e-6, rtol=0), (got - full[:, :, c:]).abs().max()
            # With a single chunk (no clean context) the scalar path applies, and it must be exact.
            if c == 0:
                scalar = model(inputs[step], torch.tensor([sampler.model_timestep(level)]), text, return_dict=False)[0]
                assert torch.equal(got, scalar)


def test_clean_pass_writes_clean_kv_that_later_chunks_read(tiny_model):
    model = tiny_model()
    spec = make_spec(num_chunks=2, policy="clean")
    text = torch.randn(1, spec.text_len, model.config.text_dim, generator=torch.Generator().manual_seed(5))
    out, flows, _ = traced_run(model, spec, text)
    levels = sorted((s.chunk, s.level) for s in flows)
    assert levels == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1), (1, 2), (1, 3)]  # level 3 = clean pass


def test_window_with_sinks_keeps_first_frames_and_most_recent():
    spec = make_spec(window=3, sink=1)
    assert context_frames(spec, 0, 1024) == []
    assert context_frames(spec, 2, 1024) == [0, 1]
    assert context_frames(spec, 5, 1024) == [0, 3, 4]
    no_sink = make_spec(window=2, sink=0)
    assert context_frames(no_sink, 5, 1024) == [3, 4]
    chunked = make_spec(window=4, sink=2, chunk_frames=2)
    assert context_frames(chunked, 3, 1024) == [0, 1, 4, 5]


def test_epoch_reset_restarts_positions_and_empties_the_cache(tiny_model):
    spec = make_spec(reset_frames=2, window=None)
    assert context_frames(spec, 2, 1024) == []
    assert context_frames(spec, 3, 1024) == [2]
    model = tiny_model()
    n = 4
    spec = make_spec(num_chunks=n, reset_frames=2, policy="per_level")
    text = torch.randn(1, spec.text_len, model.config.text_dim, generator=torch.Generator().manual_seed(6))
    _, flows, inputs = traced_run(model, spec, text)
    chunkwise_patch_embedding(model, 1)
    # Chunks 2..3 form a fresh epoch: the same as chunks 0..1 of a stream fed their inputs.
    sampler = FlowSampler(spec)
    set_self_mask(model, frame_mask(make_spec(num_chunks=2), 2, TPF))
    for level in range(spec.steps):
        x = torch.cat(
            [inputs[s] for s in sorted(inputs, key=lambda s: s.chunk) if s.level == level and s.chunk >= 2], 2
        )
        full = model(x, torch.tensor([sampler.model_timestep(level)]), text, return_dict=False)[0]
        for c in (2, 3):
            step = next(s for s in flows if s.chunk == c and s.level == level)
            assert torch.equal(flows[step], full[:, :, c - 2 : c - 1])


def test_kv_memory_is_bounded_by_the_window_and_freed_on_close(tiny_model):
    model = tiny_model()
    full = DiTSlice.from_model(model, layers=range(4), first=True, last=True)
    ref = ReferenceExecutor(full)
    spec = make_spec(num_chunks=12, window=3, sink=1, policy="per_level")
    text = torch.zeros(1, spec.text_len, model.config.text_dim)
    sizes = []
    ref.runner.open_stream(spec, text)
    from coordinator.scheduler import StreamBatchScheduler

    sched = StreamBatchScheduler(num_stages=1, max_batch=4)
    sched.add_stream(spec)
    while sched.active:
        batch = sched.tick()
        if batch:
            ref.run_batch(batch)
            sizes.append(ref.runner.streams[1].kv.nbytes)
    per_frame = 2 * 4 * TPF * model.config.num_attention_heads * model.config.attention_head_dim * 4  # k+v, layers
    assert max(sizes) <= spec.steps * spec.window * per_frame
    assert max(sizes) == spec.steps * spec.window * per_frame  # the window does fill up
    kv = ref.runner.streams[1].kv
    assert all(kv.frames_held(r) == [0, 10, 11] for r in range(spec.steps))
    ref.runner.close_stream(1)
    assert ref.runner.streams == {}
    assert kv.nbytes == 0


def test_generation_is_deterministic_by_seed(tiny_model):
    model = tiny_model()
    text = torch.randn(1, 512, model.config.text_dim, generator=torch.Generator().manual_seed(7))
    runs = []
    for seed in (1, 1, 2):
        full = DiTSlice.from_model(model, layers=range(4), first=True, last=True)
        out = ReferenceExecutor(full).generate([StreamRequest(make_spec(num_chunks=2, seed=seed), text)])
        runs.append(torch.cat(out.chunks[1], 2))
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], runs[2])


def test_per_level_streaming_with_per_token_timesteps_wan22_ti2v(tiny_model):
    """Wan2.2-TI2V runs per-token timesteps (B, L); the streaming path matches the masked full forward."""
    model = tiny_model("tiny-wan2.2-ti2v")
    n = 3
    spec = make_spec(latent_channels=48, num_chunks=n, window=2, sink=1, policy="per_level")
    text = torch.randn(1, spec.text_len, model.config.text_dim, generator=torch.Generator().manual_seed(8))
    _, flows, inputs = traced_run(model, spec, text, num_stages=2)
    chunkwise_patch_embedding(model, 1)
    sampler = FlowSampler(spec)
    set_self_mask(model, frame_mask(spec, n, TPF))
    for level in range(spec.steps):
        x = torch.cat([inputs[s] for s in sorted(inputs, key=lambda s: s.chunk) if s.level == level], dim=2)
        t = torch.full((1, n * TPF), sampler.model_timestep(level))
        full = model(x, t, text, return_dict=False)[0]
        for c in range(n):
            step = next(s for s in flows if s.chunk == c and s.level == level)
            assert torch.equal(flows[step], full[:, :, c : c + 1])
