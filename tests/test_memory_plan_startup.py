"""READY only if a stream fits, end to end on the CPU: a coordinator and a stage (real processes on loopback) whose
operator budget (``--kv-budget-gib``) holds no stream at the checkpoint's serving defaults.  The stage refuses to form
naming the numbers, and the coordinator's start-up fails with that line (exit status 2) instead of becoming READY
and refusing every stream; ``LocalPipeline.wait_ready`` (what ``stagecast up`` waits on) says so at once."""

from __future__ import annotations

import time

import pytest

from launcher.demo_checkpoint import write_demo_checkpoint
from launcher.local_cluster import start_pipeline
from launcher.process import Launcher, LaunchError

pytestmark = pytest.mark.multiprocess


def test_a_stage_that_holds_no_serving_stream_fails_the_coordinators_start_up(tmp_path):
    root = write_demo_checkpoint(tmp_path / "demo")
    started = time.monotonic()
    with Launcher() as launcher:
        with pytest.raises(LaunchError) as failed:
            start_pipeline(
                launcher,
                checkpoint=str(root / "transformer"),
                stages=1,
                stage_extra_args=["--kv-budget-gib", "1e-06"],
                ready_timeout=120.0,
            )
        coordinator = next(c for c in launcher.children if c.name == "coordinator")
        assert coordinator.proc.poll() == 2  # stagecast.service.run_service: one line, exit status 2
    message = str(failed.value)
    assert "the coordinator exited with code 2 before it was ready" in message
    assert "stagecast coordinator: error: stage 0 holds no stream: one stream at the serving defaults (64x64" in message
    assert "it gives streams 1.05 KiB (--kv-budget-gib 1e-06)" in message
    assert time.monotonic() - started < 120.0  # at once, not at the health wait's timeout
