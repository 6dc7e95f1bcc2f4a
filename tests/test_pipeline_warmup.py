"""The gateway's warm-up stream (``gateway.stream.warmup``): one stream of the serving defaults through the pipeline
before the gateway serves, marked ``warmup`` so that stages capture its batches' CUDA graphs in line (the in-line
capture itself is tested in ``tests/test_graphs.py``).  End to end with real processes on loopback (gloo)."""

from __future__ import annotations

import time

import grpc
import pytest

from gateway.checkpoint import ModelInfo, ServingDefaults
from gateway.edge.config import resolve_config
from gateway.stream.warmup import MAX_WARMUP_CHUNKS, warm_pipeline, warmup_spec
from launcher.demo_checkpoint import write_demo_checkpoint
from launcher.local_cluster import start_pipeline
from launcher.process import Launcher
from stagecast import Client
from stagecast.internal.v1 import pipeline_pb2 as ipb
from stagecast.microstep import StreamSpec
from stagecast.v1 import stream_pb2 as pb
from tests.pipeline_helpers import coordinator_stub

TIMEOUT = 120


def spec(**kw) -> StreamSpec:
    base = dict(stream_id=0, latent_channels=16, chunk_frames=1, latent_height=4, latent_width=6, text_len=8)
    return StreamSpec(**{**base, **kw})


@pytest.mark.unit
def test_the_warm_up_fills_the_window_and_the_wavefront():
    def chunks(stages, **kw):
        got = warmup_spec(spec(**kw), stages)
        assert got.warmup and got.stream_id == 0
        return got.num_chunks

    # window 6 frames of 1 latent frame per chunk, 4 levels on 2 stages: 6 + 8 + 2
    assert chunks(2, window=6, sink=3, timesteps=(700.0, 500.0, 400.0, 200.0)) == 16
    assert chunks(4, window=6, chunk_frames=2, timesteps=(700.0,)) == 3 + 4 + 2
    assert chunks(1, window=3, timesteps=(700.0,), policy="clean") == 3 + 2 + 2  # the clean pass is a level
    assert chunks(2, window=400, timesteps=(700.0,)) == MAX_WARMUP_CHUNKS
    # Defaults without a window: the protocol's 6 frames, 3 sinks (an unbounded context would outgrow the graphs'
    # buffers every chunk, and each time they grow every graph captured so far is dropped).
    unbounded = warmup_spec(spec(timesteps=(700.0,)), 1)
    assert (unbounded.window, unbounded.sink, unbounded.num_chunks) == (6, 3, 6 + 1 + 2)


class NoWait:
    """The poll's pause between two Status calls, skipped: the fake clock says how much time passed."""

    def wait(self, timeout=None):
        return False


class NeverReady:
    def __init__(self):
        self.asked = 0

    def Status(self, request, timeout=None):  # noqa: N802 - the stub's name
        self.asked += 1
        return ipb.ClusterStatus(ready=False)

    def OpenStream(self, request, timeout=None):  # noqa: N802
        raise AssertionError("a pipeline that is not ready is never sent a stream")


@pytest.mark.unit
def test_a_pipeline_not_ready_in_time_is_skipped_and_the_gateway_serves_anyway():
    coordinator, times = NeverReady(), iter([0.0, 0.0, 30.0, 61.0, 61.0])
    got = warm_pipeline(
        coordinator,
        spec=spec(window=3),
        text=None,
        consumer_depth=3,
        wait_s=60.0,
        clock=lambda: next(times),
        stop=NoWait(),
    )
    assert got == 0 and coordinator.asked == 2  # asked at 0 s and 30 s; past the deadline at 61 s, skipped


@pytest.mark.multiprocess
def test_the_gateway_runs_one_warm_up_stream_before_it_serves(tmp_path):
    root = write_demo_checkpoint(tmp_path / "ckpt")
    defaults, model = ServingDefaults.load(root), ModelInfo.from_checkpoint(root)
    cfg = resolve_config(pb.StreamConfig(prompt="x"), defaults=defaults, model=model)
    want = warmup_spec(cfg.stream_spec(latent_channels=model.latent_channels, text_len=defaults.text_len), 2)
    with Launcher() as launcher:
        pipe = start_pipeline(launcher, checkpoint=str(root / "transformer"), stages=2, record_plan=True)
        gw_args = ["gateway", "--coordinator", pipe.coordinator, "--checkpoint", str(root), "--port", "0"]
        gateway = launcher.spawn("gateway", [*gw_args, "--pipeline-warmup-s", str(TIMEOUT)])
        channel, stub = coordinator_stub(pipe.coordinator, launcher)
        with channel:
            plan = stub.GetPlan(ipb.PlanRequest(), timeout=30).events
            opens = [ev.open.spec for ev in plan if ev.WhichOneof("event") == "open"]
            closes = [ev.close.stream_id for ev in plan if ev.WhichOneof("event") == "close"]
            # Before the gateway was READY: one stream of the defaults, marked warm-up, run to its end and closed.
            assert len(opens) == 1 and opens[0].warmup and opens[0].num_chunks == want.num_chunks
            assert (opens[0].window, opens[0].sink) == (want.window, want.sink)
            assert (opens[0].latent_height, opens[0].latent_width) == (cfg.latent_height, cfg.latent_width)
            assert list(opens[0].timesteps) == pytest.approx(list(cfg.pipeline_timesteps))
            assert closes == [opens[0].stream_id]
            status = stub.Status(ipb.Empty(), timeout=10)
            assert status.active_streams == 0  # its resources are freed

            # A real stream after it is not a warm-up stream, and runs to its end.
            with Client(gateway.info["address"]) as client:
                frames = sum(1 for _ in client.generate("a cat", seconds=0.5, timeout=TIMEOUT))
            assert frames == round(0.5 * defaults.fps)  # every frame of the 0.5 s asked for
            opens = [ev.open.spec for ev in stub.GetPlan(ipb.PlanRequest(), timeout=30).events if ev.HasField("open")]
            assert len(opens) == 2 and not opens[1].warmup


@pytest.mark.unit
def test_a_broken_warm_up_stream_is_logged_and_skipped(caplog):
    class Breaks(NeverReady):
        def Status(self, request, timeout=None):  # noqa: N802
            return ipb.ClusterStatus(ready=True, world_size=2)

        def OpenStream(self, request, timeout=None):  # noqa: N802
            assert request.spec.warmup and request.acknowledges
            raise _RpcError()

    class _RpcError(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.UNAVAILABLE

        def details(self):
            return "the coordinator went away"

    got = warm_pipeline(Breaks(), spec=spec(window=3), text=_tensor(), consumer_depth=3, wait_s=5.0)
    assert got == 0 and "UNAVAILABLE the coordinator went away" in caplog.text


@pytest.mark.unit
def test_a_warm_up_that_ran_every_chunk_says_so_though_its_stream_ended_first(caplog):
    # On an H200 every start logged "pipeline warm-up stopped after 9 of 9 chunks: NOT_FOUND unknown stream": the
    # last chunk's acknowledgement reached the coordinator after the stream had ended.
    class EndsAtItsLastChunk(NeverReady):
        def __init__(self):
            super().__init__()
            self.consumed: list[int] = []
            self.chunks = 0

        def Status(self, request, timeout=None):  # noqa: N802
            return ipb.ClusterStatus(ready=True, world_size=1)

        def OpenStream(self, request, timeout=None):  # noqa: N802
            self.chunks = request.spec.num_chunks
            yield ipb.StreamEvent(started=ipb.StreamStarted(stream_id=1))
            for c in range(self.chunks):
                yield ipb.StreamEvent(chunk=ipb.ChunkResult(stream_id=1, chunk=c))
            yield ipb.StreamEvent(ended=ipb.StreamEnded(reason="completed"))

        def Consumed(self, request, timeout=None):  # noqa: N802
            if request.chunks >= self.chunks:  # the stream is gone once its last chunk was sent
                raise _NotFound()
            self.consumed.append(request.chunks)

    class _NotFound(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.NOT_FOUND

        def details(self):
            return "unknown stream 1"

    coordinator = EndsAtItsLastChunk()
    caplog.set_level("INFO")
    got = warm_pipeline(
        coordinator, spec=spec(window=3, timesteps=(700.0,)), text=_tensor(), consumer_depth=3, wait_s=5.0
    )
    assert got == coordinator.chunks > 1 and coordinator.consumed == list(range(1, coordinator.chunks))
    assert "pipeline warmed up" in caplog.text and "stopped" not in caplog.text


def _tensor():
    import torch

    return torch.zeros(1, 8, 4)


@pytest.mark.unit
def test_the_gateway_refuses_a_warm_up_budget_out_of_range(tmp_path):
    from gateway.service import Gateway, GatewayOptions

    root = write_demo_checkpoint(tmp_path / "ckpt")
    with pytest.raises(ValueError, match="--pipeline-warmup-s must be in"):
        Gateway(GatewayOptions(coordinator="127.0.0.1:1", checkpoint=str(root), port=0, pipeline_warmup_s=-1.0))


@pytest.mark.unit
def test_a_warm_up_that_fails_never_stops_the_gateway(tmp_path, monkeypatch, caplog):
    import gateway.models as models
    import gateway.service as service

    def broken(*args, **kwargs):
        raise RuntimeError("no pipeline here")

    monkeypatch.setattr(models, "warm_pipeline", broken)
    root = write_demo_checkpoint(tmp_path / "ckpt")
    opts = service.GatewayOptions(coordinator="127.0.0.1:1", checkpoint=str(root), port=0, pipeline_warmup_s=0.5)
    gateway = service.Gateway(opts)
    try:
        assert gateway.pipeline_warmup_chunks == 0
        assert "pipeline warm-up failed" in caplog.text and "no pipeline here" in caplog.text
        # No pipeline answered within the budget before the decoders were measured either: measured anyway, and said.
        assert "measuring the decoders beside it" in caplog.text
    finally:
        gateway.stop(grace=0)


@pytest.mark.unit
@pytest.mark.parametrize("wait_s", [5.0, 0.0])
def test_the_gateway_measures_its_decoders_once_its_pipeline_is_ready(tmp_path, monkeypatch, caplog, wait_s):
    # The gateway starts beside the stages (it loads while they load); a stage's calibration at READY and the
    # decoders' measurements would share the GPU, so the measurements wait for the pipeline (within the warm-up
    # budget; no budget, as on a CPU by default: no wait).
    import logging

    import gateway.models as models
    import gateway.service as service

    asked = []
    monkeypatch.setattr(service, "wait_ready", lambda *a, **k: asked.append(a[1] - time.monotonic()) or 2)
    monkeypatch.setattr(models, "warm_pipeline", lambda *a, **k: 0)
    root = write_demo_checkpoint(tmp_path / "ckpt")
    opts = service.GatewayOptions(coordinator="127.0.0.1:1", checkpoint=str(root), port=0, pipeline_warmup_s=wait_s)
    with caplog.at_level(logging.INFO):
        gateway = service.Gateway(opts)
    try:
        said = [m for m in caplog.messages if "for the pipeline before measuring" in m or "VAE on the CPU" in m]
        if wait_s:
            assert len(asked) == 1 and 0 < asked[0] <= wait_s  # within the warm-up budget
            assert said[0].startswith("waited") and "VAE on the CPU" in said[1]  # then measured, its encode included
        else:
            assert not asked and len(said) == 1 and "VAE on the CPU" in said[0]
    finally:
        gateway.stop(grace=0)
