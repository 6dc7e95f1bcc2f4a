"""Admission by capacity and adaptive steps end to end: a coordinator whose SLO controller keeps a calibration
(``--stage-ms``, ``--slo-fixed``), 2 stages (gloo) and a gateway, real processes on loopback.

With 85 ms per stage forward of one micro-step (growth 5%, batches of 4) one micro-step costs 24.4 ms of each stage,
and both stages run on this one CPU host, so 48.9 ms of it (their sum: coordinator/slo.py, "A CPU host").  A stream
at 16 FPS (4 chunks/s) at s steps needs 4 x s x 48.9 ms = 19.6% x s of it.  The controller holds 90% and raises steps
below 80%: one stream runs 4 steps (78%), two run 2 each (78%), a third is refused at once.
"""

from __future__ import annotations

import threading

import pytest

import stagecast
from launcher.demo_checkpoint import write_demo_checkpoint
from launcher.local_cluster import start_pipeline
from launcher.process import Launcher
from tests.pipeline_helpers import wait_until

pytestmark = pytest.mark.multiprocess

W, H = 48, 32
TIMEOUT = 120


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    root = write_demo_checkpoint(tmp_path_factory.mktemp("ckpt"))
    with Launcher() as launcher:
        pipe = start_pipeline(
            launcher,
            checkpoint=str(root / "transformer"),
            stages=2,
            coordinator_args=["--stage-ms", "85,85", "--slo-fixed", "--no-pace-grid"],  # the average-batch model
        )
        gw = launcher.spawn("gateway", ["gateway", "--coordinator", pipe.coordinator, "--checkpoint", str(root)])
        with stagecast.Client(gw.info["address"]) as client:
            yield client


def capacity(client) -> dict[int, float]:
    return {c.steps: c.streams for c in client.status().capacity}


MS = 2 * 85 * 1.15 / 4 / 1000  # seconds of the host per micro-step: the two stages' sum


def expected(admitted_steps: int) -> dict:
    """More streams at 4 chunks/s per step count, beside ``admitted_steps`` stream-steps at 4 chunks/s."""
    return {s: pytest.approx((0.9 - 4 * admitted_steps * MS) / (4 * s * MS)) for s in (1, 2, 3, 4)}


def test_capacity_is_reported_and_the_first_stream_past_it_is_refused_with_a_retry_delay(gateway):
    client = gateway
    assert capacity(client) == expected(0)  # an empty pipeline: 90% of the host, 4.5 streams at 1 step
    kw = dict(width=W, height=H, codec="jpeg", seconds=3.0, min_steps=2, max_steps=4, timeout=TIMEOUT)
    a = client.generate("a red fox", **kw)
    a.wait_started()
    b = client.generate("a grey wolf", **kw)
    b.wait_started()
    # Both counted at their min_steps (the gateway asks the coordinator at most once a second).
    wait_until(lambda: capacity(client)[2] < 1, 10, what="the capacity to count both streams")
    assert capacity(client) == expected(4)  # two at 2 steps: about half a stream at 1 step is left
    with pytest.raises(stagecast.ResourceExhaustedError) as info:
        client.generate("a third stream", **kw).wait_started()
    assert "over capacity" in info.value.details
    assert 0 < info.value.retry_after <= 3.5  # when the sooner of the two admitted streams ends
    frames = {}

    def read(name, gen):
        frames[name] = [f.steps for f in gen]

    threads = [threading.Thread(target=read, args=(n, g)) for n, g in (("a", a), ("b", b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert len(frames["a"]) == len(frames["b"]) == 48
    # Alone, a ran its max_steps; once b came the controller lowered both to min_steps (b from its start).  After one
    # ends the controller may raise the other again (below 80%): its last frames depend on how far apart the two
    # started, and on a loaded machine either may end first.  The first to end on the server ran its last frames
    # beside the other, at min_steps (which one that was, the clients' reading order does not tell: a reader may
    # drain a stream's buffered frames after the other's reader is done).
    assert frames["a"][0] == 4 and frames["b"][0] == 2, frames
    assert 2 in (frames["a"][-1], frames["b"][-1]), frames
    assert set(frames["a"]) <= {2, 3, 4} and set(frames["b"]) <= {2, 3, 4}
    wait_until(lambda: capacity(client)[2] > 2, 10, what="the capacity to come back once both ended")
    assert capacity(client) == expected(0)
