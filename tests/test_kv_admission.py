"""Admission by KV memory end to end: 2 stages (gloo) whose operator budget (--kv-budget-gib) holds one stream's
worst-case KV window and a half, a coordinator and a gateway, real processes on loopback.

A stream without a window is refused at once naming ``window``; a stream with a 6-frame window is admitted; a second
one, which would overflow the stages beside it, is refused with a retry delay while the first keeps serving; once the
first has ended its bytes are given back and the second is admitted.
"""

from __future__ import annotations

import pytest

import stagecast
from launcher.demo_checkpoint import write_demo_checkpoint
from launcher.local_cluster import start_pipeline
from launcher.process import Launcher
from stagecast.internal.v1 import pipeline_pb2 as pb
from stagecast.kv_memory import stream_kv_bytes
from stagecast.microstep import StreamSpec
from stagecast.model.config import DiTConfig, read_config
from stagecast.model.partition import parse_partition, partition_ranges
from tests.pipeline_helpers import coordinator_stub, wait_until
from tests.test_telemetry_e2e import _free_port, scrape

pytestmark = pytest.mark.multiprocess

W, H = 64, 64  # latents 8 x 8: the demo checkpoint's serving size (a stage must hold one such stream to form)
STAGES = 2
TIMEOUT = 120
STREAM = dict(width=W, height=H, codec="jpeg", steps=2, chunk_frames=1, policy="per_level", timeout=TIMEOUT)
WINDOW = dict(window=6, sink=3)


def worst_case(root) -> list[int]:
    """What a windowed stream of ``STREAM`` reserves on each stage, as the coordinator computes it."""
    model = DiTConfig.from_kwargs(read_config(str(root / "transformer")))
    spec = StreamSpec(
        stream_id=1,
        latent_channels=model.in_channels,
        chunk_frames=1,
        latent_height=H // 8,
        latent_width=W // 8,
        timesteps=(1000.0, 500.0),
        **WINDOW,
    )
    ranges = partition_ranges(parse_partition(None, model.num_layers, STAGES))
    return [stream_kv_bytes(spec, model, layers=len(r), element_bytes=4) for r in ranges]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = write_demo_checkpoint(tmp_path_factory.mktemp("ckpt"))
    need = worst_case(root)
    budget = max(need) * 3 // 2  # one windowed stream fits every stage, two do not
    metrics = _free_port()
    with Launcher() as launcher:
        pipe = start_pipeline(
            launcher,
            checkpoint=str(root / "transformer"),
            stages=STAGES,
            stage_extra_args=["--kv-budget-gib", repr(budget / (1 << 30))],
            coordinator_args=["--metrics-port", str(metrics)],
        )
        gw = launcher.spawn("gateway", ["gateway", "--coordinator", pipe.coordinator, "--checkpoint", str(root)])
        channel, coordinator = coordinator_stub(pipe.coordinator, launcher)
        with stagecast.Client(gw.info["address"]) as client, channel:
            yield client, coordinator, need, metrics


def kv(coordinator) -> list[tuple[int, int]]:
    """(budget, reserved) of each stage, from the coordinator's status."""
    status = coordinator.Status(pb.Empty(), timeout=10)
    return [(s.kv_budget_bytes, s.kv_reserved_bytes) for s in sorted(status.stages, key=lambda s: s.index)]


def test_streams_are_admitted_by_the_kv_memory_every_stage_has_for_them(cluster):
    client, coordinator, need, metrics = cluster
    budgets = [b for b, _ in kv(coordinator)]
    assert all(max(need) < b < 2 * min(need) for b in budgets) and [r for _, r in kv(coordinator)] == [0, 0]

    # No window: it would grow to the RoPE limit, which no stage holds.  Refused at once, naming window.
    with pytest.raises(stagecast.ResourceExhaustedError) as info:
        client.generate("an endless stream", **STREAM).wait_started()
    assert "): window: an unbounded KV window grows to 1023 latent frames" in info.value.details
    assert "set window (at most" in info.value.details and not info.value.retry_after

    first = client.generate("a red fox", seconds=30.0, **STREAM, **WINDOW)
    first.wait_started()
    assert [r for _, r in kv(coordinator)] == need

    # A second windowed stream fits a stage alone, not beside the first: refused with a retry delay.
    with pytest.raises(stagecast.ResourceExhaustedError) as info:
        client.generate("a grey wolf", seconds=1.0, **STREAM, **WINDOW).wait_started()
    assert "fits the stage alone but not beside the admitted streams" in info.value.details
    assert 0 < info.value.retry_after <= 31  # when the first ends: its 121 chunks at 4 chunks/s

    # Prometheus says the same, and counts both refusals by their limit.
    samples = scrape(metrics)
    for i in range(STAGES):
        stage = frozenset({("stage", str(i))})
        assert samples[("stagecast_coordinator_stage_kv_budget_bytes", stage)] == budgets[i]
        assert samples[("stagecast_coordinator_stage_kv_reserved_bytes", stage)] == need[i]
    assert samples[("stagecast_coordinator_streams_refused_total", frozenset({("limit", "kv_memory")}))] == 2

    # The first keeps serving meanwhile.
    frames = iter(first)
    assert [next(frames).index for _ in range(8)] == list(range(8))
    first.cancel()
    wait_until(lambda: [r for _, r in kv(coordinator)] == [0, 0], 30, what="the first stream's KV to be given back")

    second = client.generate("a grey wolf", seconds=1.0, **STREAM, **WINDOW)
    assert len(second.collect()) == 16
    wait_until(lambda: [r for _, r in kv(coordinator)] == [0, 0], 30, what="the second stream's KV to be given back")
    assert [b for b, _ in kv(coordinator)] == budgets


def test_the_pipeline_still_serves_after_the_refusals(cluster):
    """Nothing a refusal did left the pipeline in another state: the generation is the same and streams run."""
    client, coordinator, _, _ = cluster
    before = coordinator.Status(pb.Empty(), timeout=10).generation
    with pytest.raises(stagecast.ResourceExhaustedError):
        client.generate("an endless stream", **STREAM).wait_started()
    assert len(client.generate("a calm lake", seconds=0.5, **STREAM, **WINDOW).collect()) == 8
    status = coordinator.Status(pb.Empty(), timeout=10)
    assert status.generation == before and status.ready
