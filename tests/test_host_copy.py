"""``stage_service.host_copy``: the stage's copies between the host and its device.  On a CPU they are plain copies
(what the CPU suite holds bit for bit against the reference); on a GPU ``benchmarks.host_sync`` counts the
synchronizations a batch makes (0) and what a batch's host work cost the GPU before.  The benchmark's CPU smoke runs
here so it cannot rot between GPU runs."""

import json

import pytest
import torch

from stage_service.host_copy import HostTensor, to_device, to_host


@pytest.mark.unit
def test_on_a_cpu_both_copies_give_the_tensor_as_to_does():
    x = torch.randn(1, 16, 1, 4, 4, generator=torch.Generator().manual_seed(0))
    assert torch.equal(to_device(x, torch.device("cpu")), x)
    out = to_host(x)
    assert isinstance(out, HostTensor) and out.ready is None
    assert torch.equal(out.wait(), x) and out.wait().device.type == "cpu"


@pytest.mark.multiprocess  # the result names its commit (git)
def test_the_host_sync_benchmark_times_a_stages_batches_both_ways(tmp_path):
    from benchmarks import host_sync

    out = tmp_path / "host_sync.json"
    args = ["--num-layers", "1", "--height", "8", "--width", "8", "--text-len", "8", "--window", "2"]
    assert host_sync.main([*args, "--batches", "1,2", "--forwards", "2", "--repeats", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["benchmark"] == "host_sync" and result["layers"] == 1
    assert [row["batch"] for row in result["rows"]] == [1, 2]
    for row in result["rows"]:
        assert row["syncs"] is None  # counted on a GPU only
        assert row["back_to_back_ms"] > 0 and row["one_at_a_time_ms"] > 0 and row["span_ms"] > 0
        assert row["calibrated_ms"] > 0  # the stage's own calibration at that size, beside them


@pytest.mark.unit
def test_a_chunks_noise_made_ahead_is_the_one_drawn_at_its_take_and_is_taken_once(tiny_model):
    from stage_service.dit_slice import DiTSlice
    from stage_service.runner import SliceRunner
    from stage_service.sampler import chunk_noise
    from stagecast.microstep import MicroStep
    from tests.engine_helpers import TEXT, small_spec

    model = tiny_model()
    runner = SliceRunner(DiTSlice.from_model(model, layers=range(model.config.num_layers), first=True, last=True))
    spec = small_spec(stream_id=1, timesteps=(1000.0,), num_chunks=3)
    runner.open_stream(spec, TEXT)
    step = MicroStep(1, 0, 0)
    runner.finish([step], runner.forward([step]))
    runner.prefetch_noise([step])  # what the executor does once the batch is launched
    chunk, made = runner.streams[1].noise_ahead
    assert chunk == 1 and torch.equal(made, chunk_noise(spec, 1, 0))
    assert runner.take_latent(MicroStep(1, 1, 0)) is made  # taken, not drawn again
    assert runner.streams[1].noise_ahead is None
    assert torch.equal(runner.take_latent(MicroStep(1, 1, 0)), made)  # drawn again: the same draws
    runner.prefetch_noise([MicroStep(1, 2, 0)])  # the stream's last chunk: nothing after it
    assert runner.streams[1].noise_ahead is None
