"""A CPU host priced as a whole (coordinator/slo.py, "A CPU host"): where every stage runs on the CPU of one host, a
micro-step costs the sum of the stages' ms and a decoder measured on the CPU counts; beside GPU stages neither holds.
Pipelines sharing a host size their streams for their share of it (``--host-share``, 1/N from ``up --pipelines N``
on a CPU).  The gateway's CPU measurement includes its frames' encode."""

from __future__ import annotations

import argparse
import json

import pytest

from coordinator.options import CoordinatorOptions
from coordinator.registry import StageRegistry
from coordinator.slo import CostModel, Demand, SloController, VaeReport
from coordinator.slo_control import SloControl
from gateway.decode.vae_cost import VaeCost, with_encode
from launcher.fleet import host_share
from stagecast.model.dit_configs import model_config

pytestmark = pytest.mark.unit

RATE = 4.0  # chunks per second: 16 fps, 4 frames per chunk
CONFIG = json.dumps(model_config("tiny-wan2.1"))


def two_stages(shared: bool) -> CostModel:
    cost = CostModel(stages=2, max_batch=1, seed_ms=[30.0, 20.0], growth=0.0)
    cost.shared_host = shared
    return cost


def test_on_one_cpu_host_a_micro_step_costs_the_stages_sum_not_the_slowest():
    assert two_stages(False).micro_step_ms(1) == 30.0  # pipelined on devices of their own: the slowest stage
    assert two_stages(True).micro_step_ms(1) == 50.0  # one host's cores: both forwards are paid for
    # On the pace grid too: 3 one-step streams batch by 1 (max_batch 1), 3 forwards a period per stage.
    for shared, per_stage in ((False, 30.0), (True, 50.0)):
        aligned = CostModel(stages=2, max_batch=1, seed_ms=[30.0, 20.0], growth=0.0, aligned=True)
        aligned.shared_host = shared
        assert aligned.aligned_ms([(RATE, 1, 3)]) == pytest.approx(RATE * 3 * per_stage)


def test_a_decoder_measured_on_the_cpu_counts_only_where_the_stages_share_that_cpu():
    streams = [Demand(i, RATE, (1,)) for i in range(2)]
    for shared, want in ((False, 0.0), (True, 2 * RATE * 12.0)):
        cost = two_stages(shared)
        assert cost.report_vae(VaeReport("full", 12.0, on_cpu=True))
        assert cost.decode_ms(streams) == pytest.approx(want)
    beside_gpus = two_stages(False)
    beside_gpus.report_vae(VaeReport("full", 12.0))  # a GPU decoder: its share of the stage GPUs, as before
    assert beside_gpus.decode_ms(streams) == pytest.approx(2 * RATE * 12.0)


def test_admission_on_a_shared_cpu_host_refuses_what_the_slowest_stage_alone_would_admit():
    newcomer = Demand(9, RATE, (1,))
    admitted = [Demand(i, RATE, (1,)) for i in range(3)]
    # With the newcomer, 4 streams x 4 chunks/s: 480 ms/s of the slowest stage (48%), but 800 ms/s of the host's
    # stages plus 320 ms/s of decode on its CPU (112%).
    apart, host = two_stages(False), two_stages(True)
    for cost in (apart, host):
        cost.report_vae(VaeReport("full", 20.0, on_cpu=True))
    assert SloController(apart).admits(newcomer, admitted)  # the CPU decode is not counted beside GPU stages
    assert not SloController(host).admits(newcomer, admitted)  # (50 + 20) x 4 x 4 = 1120 ms/s: over the host


def _registry(*devices_and_hosts: tuple[str, str]) -> StageRegistry:
    reg = StageRegistry(world_size=len(devices_and_hosts))
    for i, (device, host) in enumerate(devices_and_hosts):
        reg.register(
            index=i, address=f"{host}:{6000 + i}", config_json=CONFIG, expected_world_size=len(devices_and_hosts),
            device=device,
        )  # fmt: skip
    return reg


def test_one_cpu_host_is_every_stage_on_the_cpu_at_one_address():
    assert _registry(("cpu", "127.0.0.1"), ("cpu", "127.0.0.1")).one_cpu_host()
    assert not _registry(("cpu", "10.0.0.1"), ("cpu", "10.0.0.2")).one_cpu_host()  # two machines
    assert not _registry(("cuda:0", "127.0.0.1"), ("cpu", "127.0.0.1")).one_cpu_host()  # a GPU stage
    assert not StageRegistry(world_size=1).one_cpu_host()  # none registered yet


def test_a_host_share_scales_the_targets_and_is_checked():
    from coordinator.metrics import CoordinatorTelemetry

    reg = StageRegistry(world_size=1)
    half = SloControl(reg, CoordinatorTelemetry(), max_batch=1, clock=lambda: 0.0, stage_ms=[10.0], host_share=0.5)
    assert half.controller.target == pytest.approx(0.45) and half.controller.raise_at == pytest.approx(0.4)
    for bad in (0.0, 1.5, float("nan")):
        with pytest.raises(ValueError, match="--host-share"):
            CoordinatorOptions(stages=1, host_share=bad)


def test_up_gives_each_pipeline_on_a_cpu_its_share_of_the_host():
    assert host_share(argparse.Namespace(pipelines=4, device="cpu")) == 0.25
    assert host_share(argparse.Namespace(pipelines=4, device="cuda")) == 1.0  # a GPU each: the host is not shared


def test_a_cpu_decoders_cost_includes_its_frames_encode():
    cost = with_encode(VaeCost(10.0, (10.0,), "cpu", (1, 16, 1, 4, 6)), 3.5)
    assert (cost.chunk_ms, cost.encode_ms, cost.part_ms) == (13.5, 3.5, (10.0,))
