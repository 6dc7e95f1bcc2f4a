"""The SLO model's seeds end to end, real processes on loopback (gloo): each stage's calibration at READY, the
gateway's VAE cost report (``ReportVaeCost``), and the operator flags that take precedence over both.

Capacity in "streams at 16 FPS" (4 chunks/s, one step, nothing admitted) is 0.9 / (4 x (m + v) / 1000) with m the
ms per micro-step at the largest batch (the slowest stage's; here, every stage on this one CPU host, their sum) and v
the VAE's ms per chunk, so capacity before and after the gateway's report tells what the controller counts for the
VAE.
"""

from __future__ import annotations

import grpc
import pytest

from gateway.decode.vae_cost import VaeCost, VaeReporter
from launcher.demo_checkpoint import write_demo_checkpoint
from launcher.local_cluster import start_pipeline
from launcher.process import Launcher
from stagecast.internal.v1 import pipeline_pb2 as pb
from tests.pipeline_helpers import coordinator_stub

pytestmark = pytest.mark.multiprocess

TIMEOUT = 120


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return write_demo_checkpoint(tmp_path_factory.mktemp("ckpt"))


def one_step(status: pb.ClusterStatus) -> float | None:
    return next((c.streams for c in status.capacity if c.steps == 1), None)


def test_stages_seed_the_model_at_ready_and_the_gateways_vae_cost_lowers_capacity(root):
    with Launcher() as launcher:
        pipe = start_pipeline(
            launcher,
            checkpoint=str(root / "transformer"),
            stages=2,
            coordinator_args=["--no-pace-grid"],  # the capacity below is the average-batch model's arithmetic
            stage_extra_args=["--calibration-s", "60"],
        )
        channel, stub = coordinator_stub(pipe.coordinator, launcher)
        with channel:
            status = stub.Status(pb.Empty(), timeout=10)
            # Formed, no stream ever ran: the model comes from the stages' own calibration.
            assert status.ready and not status.stage_stats
            assert list(status.calibrated_stages) == [0, 1]
            assert 1 <= status.max_batch <= 4  # picked from those calibrations (tests/test_batch_pick)
            assert status.vae_source == "none" and status.vae_chunk_ms == 0
            before = one_step(status)
            assert before is not None and before > 0
            stage_ms = 0.9 * 1000 / (4 * before)  # ms per micro-step as the model holds it (here: the stages' sum)

            # The gateway's reporter, as a gateway on GPUs runs it after measuring its VAE (a CPU gateway measures
            # its VAE and encode too: tests/test_cpu_host_pricing.py).
            cost = VaeCost(chunk_ms=12.5, part_ms=(9.0, 12.5), device="cuda:1", latent_shape=(1, 16, 1, 60, 104))
            reporter = VaeReporter(stub, cost)
            reporter.start()
            try:
                assert reporter.reported.wait(TIMEOUT)
            finally:
                reporter.stop()
            status = stub.Status(pb.Empty(), timeout=10)
            assert (status.vae_source, status.vae_chunk_ms) == ("gateway", 12.5)
            vae = status.vae_chunk_ms
            assert one_step(status) == pytest.approx(0.9 * 1000 / (4 * (stage_ms + vae)))
            assert one_step(status) < before

            # An out-of-range report is refused naming the field, and changes nothing.
            with pytest.raises(grpc.RpcError) as err:
                stub.ReportVaeCost(pb.VaeCost(chunk_ms=-1.0), timeout=10)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "chunk_ms" in err.value.details()
            assert stub.Status(pb.Empty(), timeout=10).vae_chunk_ms == vae


def test_operator_flags_take_precedence_and_a_stage_out_of_calibration_budget_still_serves(root):
    with Launcher() as launcher:
        pipe = start_pipeline(
            launcher,
            checkpoint=str(root / "transformer"),
            stages=2,
            coordinator_args=["--stage-ms", "170,170", "--vae-ms-per-chunk", "7", "--no-pace-grid"],
            stage_extra_args=["--calibration-s", "60"],
        )
        channel, stub = coordinator_stub(pipe.coordinator, launcher)
        with channel:
            status = stub.Status(pb.Empty(), timeout=10)
            assert status.ready and list(status.calibrated_stages) == []  # --stage-ms wins over the calibration
            assert status.max_batch == 4  # nothing calibrated to pick from: --max-batch
            assert (status.vae_source, status.vae_chunk_ms) == ("operator", 7.0)
            stub.ReportVaeCost(pb.VaeCost(chunk_ms=55.0, parts=1, device="cpu"), timeout=10)  # a gateway's report
            status = stub.Status(pb.Empty(), timeout=10)
            assert (status.vae_source, status.vae_chunk_ms) == ("operator", 7.0)
            ms = 170 * 1.15 / 4  # --stage-ms at batch 1, growth 5% per micro-step, per micro-step at batch 4
            # Both stages on this one CPU host: a micro-step costs their sum (coordinator/slo.py, "A CPU host").
            assert one_step(status) == pytest.approx(0.9 * 1000 / (4 * (2 * ms + 7.0)))

    with Launcher() as launcher:
        # A budget no forward fits in: the stages still become READY, unseeded (the model learns from batches).
        pipe = start_pipeline(
            launcher, checkpoint=str(root / "transformer"), stages=2, stage_extra_args=["--calibration-s", "1e-9"]
        )
        channel, stub = coordinator_stub(pipe.coordinator, launcher)
        with channel:
            status = stub.Status(pb.Empty(), timeout=10)
            assert status.ready and list(status.calibrated_stages) == [] and list(status.capacity) == []
