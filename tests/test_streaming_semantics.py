"""The reference executor's streaming outputs equal full-sequence forwards under block-causal masks."""

import pytest
import torch

from launcher.reference import ReferenceExecutor, StreamRequest
from stage_service.dit_slice import DiTSlice
from stage_service.sampler import FlowSampler, chunk_noise
from stagecast.microstep import MicroStep, StreamSpec, context_frames
from tests.oracle import chunkwise_patch_embedding, frame_mask, set_self_mask

pytestmark = pytest.mark.parity

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
            sizes.append(ref.runner.streams[1].kv[0].nbytes)
    per_frame = 2 * 4 * TPF * model.config.num_attention_heads * model.config.attention_head_dim * 4  # k+v, layers
    assert max(sizes) <= spec.steps * spec.window * per_frame
    assert max(sizes) == spec.steps * spec.window * per_frame  # the window does fill up
    kv = ref.runner.streams[1].kv[0]
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


def test_streams_with_different_ladders_in_one_batch_each_equal_their_own_oracle(tiny_model):
    """Two streams with different samplers (the protocol ladder at shift 5 with x0 re-noising; an even ladder at
    shift 1 with Euler steps) share Stream Batches.  Each item is conditioned on its own stream's shifted
    timestep: every flow equals the masked full-sequence forward at ``1000 * shift*s / (1 + (shift-1)*s)``, and
    every next latent equals that stream's update rule, both bit for bit."""
    model = tiny_model()
    n = 3
    samplers = {1: ((700.0, 500.0, 400.0, 200.0), 5.0, "x0"), 2: ((1000.0, 600.0, 300.0), 1.0, "euler")}
    specs = {
        sid: make_spec(stream_id=sid, timesteps=lad, shift=sh, sampler=up, num_chunks=n, seed=sid, policy="per_level")
        for sid, (lad, sh, up) in samplers.items()
    }
    g = torch.Generator().manual_seed(9)
    texts = {sid: torch.randn(1, spec.text_len, model.config.text_dim, generator=g) for sid, spec in specs.items()}

    flows, inputs, batches = {}, {}, []

    def trace(steps, flow, results):
        batches.append({st.stream for st in steps})
        for i, st in enumerate(steps):
            flows[st] = flow[i : i + 1].clone()

    full = DiTSlice.from_model(model, layers=range(model.config.num_layers), first=True, last=True)
    ref = ReferenceExecutor(full, trace=trace)
    take = ref.runner.take_latent

    def recording_take(step):
        inputs[step] = take(step).clone()
        return inputs[step]

    ref.runner.take_latent = recording_take
    requests = [StreamRequest(specs[sid], texts[sid]) for sid in specs]
    out = ref.generate(requests, num_stages=2, max_batch=4)
    assert any(len(b) == 2 for b in batches), "the two streams never shared a batch"

    chunkwise_patch_embedding(model, 1)
    for sid, spec in specs.items():
        ladder, shift, update = samplers[sid]
        sig = [shift * (t / 1000) / (1 + (shift - 1) * (t / 1000)) for t in ladder] + [0.0]
        set_self_mask(model, frame_mask(spec, n, TPF), blockwise=True)
        for level in range(spec.steps):
            steps = [MicroStep(sid, c, level) for c in range(n)]
            x = torch.cat([inputs[st] for st in steps], dim=2)
            oracle = model(x, torch.tensor([sig[level] * 1000]), texts[sid], return_dict=False)[0]
            for c, st in enumerate(steps):
                assert torch.equal(flows[st], oracle[:, :, c : c + 1]), f"{st}: {(flows[st] - oracle).abs().max()}"
                s, s_next, v = sig[level], sig[level + 1], flows[st]
                if update == "euler":
                    want = inputs[st] + (s_next - s) * v
                else:
                    x0 = inputs[st] - s * v
                    want = x0 if s_next == 0 else (1 - s_next) * x0 + s_next * chunk_noise(spec, c, level + 1)
                got = inputs[MicroStep(sid, c, level + 1)] if level + 1 < spec.steps else out.chunks[sid][c]
                assert torch.equal(got, want), f"{st}: the {update} step"
