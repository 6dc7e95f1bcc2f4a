"""Prompt transitions that re-cache: at a ``recache`` prompt update the KV window is rebuilt under the new prompt
from the window's clean latents before the next chunk (``stagecast.microstep.recache_steps``).

The oracle, the slow way: one masked full-sequence forward over every frame so far (the window's chunks at their
clean latents, re-noised to the level under ``per_level``), the next chunk's input after them, everything under the
new prompt, where each window frame sees the window frames up to its own chunk and evicted frames are seen by no one.
The next chunk's output at every level must equal the oracle's; with a plain cut it does not.
"""

from __future__ import annotations

import pytest
import torch

from launcher.reference import ReferenceExecutor
from stage_service.dit_slice import DiTSlice
from stage_service.sampler import FlowSampler, chunk_noise
from stagecast.microstep import MicroStep, PlanEvent, StreamSpec, context_frames, recache_steps
from tests.oracle import chunkwise_patch_embedding, set_self_mask

pytestmark = pytest.mark.unit

H = W = 4
TPF = 4  # 2x2 patches per latent frame
N, AT = 5, 3  # chunks, and the chunk the new prompt starts at


def serial_plan(spec: StreamSpec, recache: bool) -> list[PlanEvent]:
    plan = [PlanEvent("open", spec=spec)]
    for c in range(N):
        if c == AT:
            plan.append(PlanEvent("prompt", stream_id=1, from_chunk=AT, recache=recache))
        plan += [PlanEvent("batch", steps=(MicroStep(1, c, level),)) for level in range(spec.levels)]
    return plan + [PlanEvent("close", stream_id=1)]


def run(model, spec, texts, recache):
    flows, inputs = {}, {}
    full = DiTSlice.from_model(model, layers=range(model.config.num_layers), first=True, last=True)

    def trace(steps, flow, results):
        for i, st in enumerate(steps):
            flows[st] = flow[i : i + 1].clone()

    ref = ReferenceExecutor(full, trace=trace)
    take = ref.runner.take_latent
    ref.runner.take_latent = lambda step: inputs.setdefault(step, take(step).clone())
    chunks = ref.replay(serial_plan(spec, recache), {1: texts[0]}, {(1, AT): texts[1]})[1]
    return chunks, flows, inputs


def window_mask(spec: StreamSpec, window: list[int]) -> torch.Tensor:
    """Frames 0..AT: a window frame sees the window frames up to its own chunk, chunk AT sees the window and itself,
    an evicted frame only itself (its output is not used)."""
    frames = AT * spec.chunk_frames + spec.chunk_frames
    allowed = torch.zeros(frames, frames, dtype=torch.bool)
    for f in range(frames):
        chunk_end = (f // spec.chunk_frames + 1) * spec.chunk_frames
        if f >= AT * spec.chunk_frames:
            seen = [*window, *range(AT * spec.chunk_frames, frames)]
        elif f in window:
            seen = [g for g in window if g < chunk_end]
        else:
            seen = [f]
        allowed[f, seen] = True
    return allowed.repeat_interleave(TPF, 0).repeat_interleave(TPF, 1)


@pytest.mark.parametrize("policy", ["clean", "per_level"])
def test_the_chunk_after_a_recache_equals_the_oracle_over_the_rebuilt_window(tiny_model, policy):
    model = tiny_model()
    spec = StreamSpec(
        stream_id=1,
        latent_channels=16,
        chunk_frames=1,
        latent_height=H,
        latent_width=W,
        timesteps=(1000.0, 500.0),
        seed=2,
        policy=policy,
        window=2,
        sink=1,
        num_chunks=N,
        text_len=16,
    )
    g = torch.Generator().manual_seed(6)
    texts = [torch.randn(1, 16, model.config.text_dim, generator=g) for _ in range(2)]
    window = context_frames(spec, AT, 1024)
    assert window == [0, 2]  # the sink and the most recent frame; frame 1 was evicted
    assert recache_steps(spec, AT, 1024) == [(c, r) for c in (0, 2) for r in range(1 if policy == "clean" else 2)]
    chunks, flows, inputs = run(model, spec, texts, recache=True)
    cut_chunks, cut_flows, _ = run(model, spec, texts, recache=False)
    assert all(torch.equal(a, b) for a, b in zip(chunks[:AT], cut_chunks[:AT]))  # nothing changes before the switch

    chunkwise_patch_embedding(model, 1)
    set_self_mask(model, window_mask(spec, window))
    sampler = FlowSampler(spec)
    for level in range(spec.steps):
        t_level = sampler.model_timestep(level)
        if policy == "clean":
            context = torch.cat(chunks[:AT], dim=2)
            t = torch.zeros(1, (AT + 1) * TPF)
        else:
            sigma = sampler.sigmas[level]
            context = torch.cat([(1 - sigma) * chunks[c] + sigma * chunk_noise(spec, c, level) for c in range(AT)], 2)
            t = torch.zeros(1, (AT + 1) * TPF)
            t[:, : AT * TPF] = t_level
        t[:, AT * TPF :] = t_level
        x = torch.cat([context, inputs[MicroStep(1, AT, level)]], dim=2)
        want = model(x, t, texts[1], return_dict=False)[0][:, :, AT : AT + 1]
        got = flows[MicroStep(1, AT, level)]
        assert (got - want).abs().max() < 1e-5, (level, (got - want).abs().max().item())
        # A cut keeps the window's KV from the old prompt: the same chunk then differs from the oracle.
        assert (cut_flows[MicroStep(1, AT, level)] - want).abs().max() > 1e-4
