"""The multi-process pipeline (real processes, gRPC, gloo) reproduces the reference executor bit for bit."""

import json

import pytest
import torch

from launcher.selftest import SelftestConfig
from tests.selftest_pipelines import on_pipeline, shares_pipeline

# Cases that start the same processes run through one formed pipeline (tests/selftest_pipelines.py), each with its
# own streams and its own part of the recorded plan.
pytestmark = [pytest.mark.multiprocess, pytest.mark.parity]

CASES = [
    # stages, partition, policy, streams, window, sink, batch
    (1, None, "clean", 2, None, 0, 4),
    (2, "1,3", "per_level", 3, 3, 1, 4),
    (3, "1,2,1", "clean", 2, None, 0, 2),
    (4, None, "per_level", 2, None, 0, 4),
    (2, None, "per_level", 1, None, 0, 1),
]


def distributed_config(stages, partition, policy, streams, window, sink, batch):
    return SelftestConfig(
        stages=stages,
        partition=partition,
        policy=policy,
        streams=streams,
        chunks=6,
        steps=3,
        window=window,
        sink=sink,
        batch=batch,
    )


@pytest.mark.parametrize(
    "stages,partition,policy,streams,window,sink,batch", [on_pipeline(distributed_config(*c), *c) for c in CASES]
)
def test_distributed_equals_reference_bit_for_bit(
    selftest_pipelines, stages, partition, policy, streams, window, sink, batch
):
    result = selftest_pipelines.run(distributed_config(stages, partition, policy, streams, window, sink, batch))
    assert set(result.chunks) == set(result.reference) and len(result.chunks) == streams
    for sid, want in result.reference.items():
        got = result.chunks[sid]
        assert len(got) == len(want) > 0
        for g, w in zip(got, want):
            assert g.dtype == w.dtype and g.shape == w.shape
            assert (g == w).all(), f"stream {sid}: max diff {(g - w).abs().max()}"
    # Streams of different lengths were in flight together: each opened before its predecessor closed,
    # and they closed in a different order of time than a serial run would.
    opens = [i for i, ev in enumerate(result.plan) if ev.kind == "open"]
    closes = [i for i, ev in enumerate(result.plan) if ev.kind == "close"]
    for k in range(1, streams):
        assert opens[k] < closes[k - 1]
    assert result.ok and result.max_diff == 0.0


SAMPLERS = SelftestConfig(
    stages=2,
    policy="per_level",
    streams=3,
    chunks=4,
    batch=4,
    ladders=[(700.0, 500.0, 400.0, 200.0), (1000.0, 2000 / 3, 1000 / 3), (900.0, 450.0)],
    shifts=[5.0, 1.0, 3.0],
    updates=["x0", "euler", "x0"],
)


@shares_pipeline(SAMPLERS)
def test_streams_with_different_ladders_shifts_and_updates_share_batches_bit_for_bit(selftest_pipelines):
    """Three samplers at once: the protocol ladder at shift 5 (x0), an even ladder with Euler steps, and a two-step
    ladder at shift 3.  Their micro-steps share Stream Batches, and every stage derives each item's timestep and
    sigma from its own stream's ladder, exactly as the reference does."""
    result = selftest_pipelines.run(SAMPLERS)
    specs = {ev.spec.stream_id: ev.spec for ev in result.plan if ev.kind == "open"}
    assert sorted((s.steps, s.shift, s.sampler) for s in specs.values()) == [
        (2, 3.0, "x0"),
        (3, 1.0, "euler"),
        (4, 5.0, "x0"),
    ]
    mixed = [ev for ev in result.plan if ev.kind == "batch" and len({specs[s.stream].timesteps for s in ev.steps}) > 1]
    assert mixed, "no batch held micro-steps of streams with different ladders"
    for sid, want in result.reference.items():
        got = result.chunks[sid]
        assert len(got) == len(want) > 0
        for g, w in zip(got, want):
            assert torch.equal(g, w), f"stream {sid}: max diff {(g - w).abs().max()}"
    assert result.ok and result.max_diff == 0.0


# Each on the pipeline of a case above (the same stages, partition and max batch), so they form none of their own.
V2V_BATCH = {(2, "1,3"): 4, (3, "1,2,1"): 2}


def v2v_config(stages, partition, policy):
    batch = V2V_BATCH[(stages, partition)]
    return SelftestConfig(
        stages=stages, partition=partition, policy=policy, streams=3, chunks=4, steps=2, batch=batch, v2v=True
    )


@pytest.mark.parametrize(
    "stages,partition,policy",
    [on_pipeline(v2v_config(*c), *c) for c in [(2, "1,3", "per_level"), (3, "1,2,1", "clean")]],
)
def test_video_to_video_streams_equal_the_reference_fed_the_same_latents(selftest_pipelines, stages, partition, policy):
    """Video-to-video streams (level 0 from submitted input latents, fed against the coordinator's pending bound and
    stopped after their last input) share batches with a text stream; every chunk equals the reference executor
    replaying the recorded plan with the same input latents, bit for bit.  The first and last stages keep the
    inputs (embedding, sampler step); a middle stage drops them."""
    result = selftest_pipelines.run(v2v_config(stages, partition, policy))
    specs = {ev.spec.stream_id: ev.spec for ev in result.plan if ev.kind == "open"}
    v2v = sorted(sid for sid, spec in specs.items() if spec.input_latents)
    assert len(v2v) == 2 and len(specs) == 3
    for sid in v2v:  # every input reached the stages, right before the batch that started its chunk
        inputs = [i for i, ev in enumerate(result.plan) if ev.kind == "input" and ev.stream_id == sid]
        assert [result.plan[i].chunk for i in inputs] == list(range(len(result.chunks[sid])))
        for i in inputs:
            nxt = result.plan[i + 1]
            while nxt.kind == "input":
                nxt = result.plan[result.plan.index(nxt) + 1]
            assert nxt.kind == "batch" and any(s.stream == sid and s.level == 0 for s in nxt.steps)
    assert [len(result.chunks[sid]) for sid in v2v] == [4, 6]  # every input chunk came back: none was lost
    for sid, want in result.reference.items():
        got = result.chunks[sid]
        assert len(got) == len(want) > 0
        for g, w in zip(got, want):
            assert torch.equal(g, w), f"stream {sid}: max diff {(g - w).abs().max()}"
    assert result.ok and result.max_diff == 0.0


def adaptive_config(policy):
    return SelftestConfig(stages=2, policy=policy, streams=2, chunks=8, steps=3, window=3, sink=1, adaptive=True)


@pytest.mark.parametrize("policy", [on_pipeline(adaptive_config(p), p) for p in ["per_level", "clean"]])
def test_adaptive_steps_replay_bit_for_bit(selftest_pipelines, policy):
    """The SLO controller lowers the steps of concurrent streams and raises them when one ends; the steps events are
    in the recorded plan, and the reference replaying them equals the distributed run bit for bit."""
    result = selftest_pipelines.run(adaptive_config(policy))
    changes = [ev for ev in result.plan if ev.kind == "steps"]
    assert changes, "the controller changed no stream's steps"
    assert {len(ev.timesteps) for ev in changes} <= {1, 2, 3} and any(len(ev.timesteps) < 3 for ev in changes)
    for sid, want in result.reference.items():
        got = result.chunks[sid]
        assert len(got) == len(want) > 0
        for g, w in zip(got, want):
            assert torch.equal(g, w), f"stream {sid}: max diff {(g - w).abs().max()}"
    assert result.ok and result.max_diff == 0.0


CFG_CASES = [
    # stages, partition, cfg_parallel, policy, steps, chunks (> levels x stages: the prompt update lands)
    (2, "1,3", 1, "per_level", 2, 6),
    (2, None, 1, "clean", 2, 7),
    (1, None, 2, "per_level", 2, 6),
    (2, "1,3", 2, "clean", 2, 7),
]


def cfg_config(stages, partition, cfg_parallel, policy, steps, chunks):
    return SelftestConfig(
        stages=stages,
        partition=partition,
        policy=policy,
        streams=2,
        chunks=chunks,
        steps=steps,
        batch=4,
        guidance=[5.0, 1.0],
        cfg_parallel=cfg_parallel,
        prompt_update=True,
    )


@pytest.mark.parametrize(
    "stages,partition,cfg_parallel,policy,steps,chunks", [on_pipeline(cfg_config(*c), *c) for c in CFG_CASES]
)
def test_classifier_free_guidance_equals_reference_bit_for_bit(
    selftest_pipelines, stages, partition, cfg_parallel, policy, steps, chunks
):
    """A guided stream (guidance 5, its own negative prompt) and an unguided one run together (whether they share a
    batch depends on arrival timing; tests/test_cfg.py holds mixed batches), in one pipeline (sequential CFG: two
    rows per guided micro-step) or on two stage groups in lockstep (CFG-parallel, where the second group skips the
    unguided stream); each stream changes its prompt after its first chunk.  Every chunk equals the reference bit
    for bit."""
    result = selftest_pipelines.run(cfg_config(stages, partition, cfg_parallel, policy, steps, chunks))
    specs = {ev.spec.stream_id: ev.spec for ev in result.plan if ev.kind == "open"}
    assert sorted(s.guidance_scale for s in specs.values()) == [1.0, 5.0]
    assert set(result.negative_texts) == {sid for sid, s in specs.items() if s.cfg}
    # Each stream's update reached a chunk it still had to start.
    assert sorted(sid for sid, c in result.prompt_texts if c < specs[sid].num_chunks) == sorted(specs)
    for sid, want in result.reference.items():
        got = result.chunks[sid]
        assert len(got) == len(want) == specs[sid].num_chunks
        for g, w in zip(got, want):
            assert torch.equal(g, w), f"stream {sid}: max diff {(g - w).abs().max()}"
    assert result.ok and result.max_diff == 0.0


def test_a_pipeline_partitioned_by_the_balance_planner_equals_the_reference_bit_for_bit(selftest_pipelines, tmp_path):
    """``--partition auto``: the planner's partition (uneven here: block 0 is measured slow) changes where layers run,
    never what they compute."""
    from launcher.balance import resolve_balance
    from tests.test_balance import profile_json

    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(profile_json()))  # blocks 5, 1, 1, 1 ms
    cfg = SelftestConfig(
        stages=3, partition="auto", balance_profile=str(profile), policy="per_level", streams=2, chunks=5, window=3
    )
    result = selftest_pipelines.run(cfg)  # its own pipeline: the profile is in its key
    planned = resolve_balance(profile, transformer="random:tiny-wan2.1", stage_devices=["cpu"] * 3).partition
    assert result.partition == planned != "2,1,1"  # the planner's answer, not the even split
    assert result.ok and result.max_diff == 0.0 and len(result.chunks) == 2
    for sid, want in result.reference.items():
        assert len(result.chunks[sid]) == len(want) > 0
        for g, w in zip(result.chunks[sid], want):
            assert (g == w).all()
