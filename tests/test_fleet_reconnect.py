"""The SDK's ``reconnect=True`` through a real fleet: ``stagecast up --pipelines 2 --stages 1`` on the demo checkpoint
behind HAProxy.  A stream through the door runs on one pipeline; that pipeline is drained (SIGTERM to its gateway,
``--drain-s 2``), its stream is ended with UNAVAILABLE when the drain runs out, and the SDK reopens it through the
door, which sends it to the other pipeline: the stream completes there, no frame index repeated, the gap reported.
One ``up`` serves the module."""

import json
import os
import signal
import tempfile
from pathlib import Path

import pytest

import stagecast
from launcher.demo_checkpoint import write_demo_checkpoint
from launcher.process import Launcher
from tests.pipeline_helpers import wait_until

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.skipif(
        not any(os.access(p, os.X_OK) for p in ("/usr/sbin/haproxy", "/usr/bin/haproxy")),
        reason="HAProxy is not installed (apt-get install haproxy; .ci/run installs it)",
    ),
]

STEPS = 4  # one slot each at the public defaults (tests/test_fleet.py)
DRAIN_S = 2  # short, so the drained stream is cut while it still has frames to go
SECONDS = 8.0  # at 16 FPS: 128 frames, most of them after the drain's end


@pytest.fixture(scope="module")
def fleet():
    with tempfile.TemporaryDirectory() as tmp, Launcher() as launcher:
        write_demo_checkpoint(tmp)
        state = Path(tmp) / "state.json"
        args = ["up", "--checkpoint", tmp, "--pipelines", "2", "--stages", "1", "--port", "0", "--gateway-port", "0"]
        args += ["--web-port", "-1", "--state-file", str(state), "--stage-ms", "60", "--slo-fixed"]
        args += ["--drain-s", str(DRAIN_S)]
        up = launcher.spawn("up", args, timeout=600)
        yield up, state


def test_a_drained_stream_goes_on_through_the_other_pipeline(fleet):
    up, state_file = fleet
    state = json.loads(state_file.read_text())
    pipelines = {p["name"]: p for p in state["pipelines"]}
    frames = []
    with stagecast.Client(state["door"]) as client:
        gen = client.generate(prompt="outlives its pipeline", seconds=SECONDS, steps=STEPS, reconnect=True)
        first = gen.info.pipeline
        (other,) = set(pipelines) - {first}
        for frame in gen:
            frames.append(frame)
            if len(frames) == 8:  # running on its first pipeline: drain that one
                os.kill(pipelines[first]["pids"]["gateway"], signal.SIGTERM)
    assert gen.end is not None and gen.end.reason == "completed"
    indices = [f.index for f in frames]
    assert indices == list(range(len(frames)))  # the index goes on: none repeated, none skipped
    assert len(frames) == gen.info.total_frames == int(SECONDS * 16)
    assert gen.reconnects, "the stream was never reopened"
    last = gen.reconnects[-1]
    assert last.pipeline == other  # the door sent the reopened stream to the pipeline that was not draining
    assert 8 <= gen.reconnects[0].at_index < len(frames)
    assert last.gap_s > 0 and last.gap_frames >= 0
    assert all(r.error for r in gen.reconnects)
    wait_until(lambda: any(f"pipeline {first} stopped" in line for line in up.log), 30, what=f"up: {first} stopped")
