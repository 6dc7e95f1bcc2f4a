"""A client that opens a stream and never reads: the gateway ends it, naming why, and gives back what it held.

A gateway with its own flags runs on the shared system (real processes on loopback).  Its per-stream queue is made
larger than the test can fill (1,000 messages, 64 MiB), so what ends the stream is the send watchdog alone: the
message gRPC is sending waits ``--slow-client-timeout`` seconds for the client to make room.  The client turns BDP
probing off, so its HTTP/2 window (64 KiB) fills within a few frames; gRPC's default client window (about 4 MiB)
would only take the demo pipeline's CPU frames longer to fill, and the rule is the same once it has.  Another client
streams beside it, reading, and gets every frame.  The gateway's RSS (after ``malloc_trim``, ``stagecast.diagnostics``)
is measured after a warm-up stream and again once the slow stream is gone.
"""

from __future__ import annotations

import threading

import pytest

import stagecast
from tests.test_leaks import report

pytestmark = pytest.mark.multiprocess

PROMPT = "a red fox running through snow"
SLOW_S = 2.0
TIMEOUT = 120
RSS_MARGIN_KB = 16 * 1024  # allocator noise; a 64x64 demo stream holds less, so the bound is on what stays behind


def test_a_client_that_never_reads_is_ended_naming_why_and_the_gateway_gives_its_memory_back(shared_system):
    args = ["gateway", "--coordinator", shared_system.coordinator, "--checkpoint", str(shared_system.root)]
    args += ["--port", "0", "--buffer-messages", "1000", "--buffer-mib", "64", "--slow-client-timeout", str(SLOW_S)]
    with shared_system.spawned("gateway-slow", args) as gateway:
        address = gateway.info["address"]
        with stagecast.Client(address) as reader:
            assert len(reader.generate(PROMPT, seconds=0.5, codec="raw", timeout=TIMEOUT).collect()) > 0  # warm-up
            reader.wait_for_status(lambda s: s.active_streams == 0 and s.vae_state_bytes == 0, timeout=TIMEOUT)
            before = report(gateway)["rss_kb"]

            with stagecast.Client(address, options=[("grpc.http2.bdp_probe", 0)]) as slow:
                gen = slow.generate(PROMPT, codec="raw", timeout=TIMEOUT)  # unbounded; 12 KiB frames
                next(iter(gen))  # the first frame, then nothing more
                normal: dict = {}
                beside = threading.Thread(
                    target=lambda: normal.update(
                        frames=reader.generate(PROMPT, seconds=1.0, codec="raw", timeout=TIMEOUT).collect()
                    )
                )
                beside.start()
                status = reader.wait_for_status(
                    lambda s: s.ended_by_reason["client_too_slow"] == 1 and s.active_streams == 0, timeout=TIMEOUT
                )
                beside.join(TIMEOUT)
                assert status.vae_state_bytes == 0 and status.ended_by_reason["completed"] >= 2
                # The reading client beside it got its whole stream: 1 s at the default 16 FPS.
                assert [f.index for f in normal["frames"]] == list(range(16))
                after = report(gateway)["rss_kb"]
                assert after - before < RSS_MARGIN_KB, (before, after)
                # What the client finds once it reads again: the frames its window held, then the reason.
                with pytest.raises(stagecast.ResourceExhaustedError, match=f"fell more than {SLOW_S:g} s behind"):
                    for _ in gen:
                        pass
