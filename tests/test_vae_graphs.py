"""VAE graph slots (gateway.decode.vae_graphs): a graphed decode equals the eager one bit for bit, streams never share a
slot's cache, slots come back when streams end, and a capture that fails or differs leaves the part eager.

On CPU the capture is ``rerun_capture`` (a replay re-runs the frame on the slot's static buffers), so everything but
the CUDA capture itself is exercised: which buffers are static, what is copied in and out, when a slot is reused.
"""

from __future__ import annotations

import json
import logging
import threading

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKLWan

from benchmarks import vae_graphs_check
from gateway.decode.decoder import LocalDecoder
from gateway.decode.stream_vae import (
    StreamVAE,
    StreamVAESlice,
    split_decoder,
    to_uint8_frames,
)
from gateway.decode.vae_graphs import capture_graphs
from launcher.demo_checkpoint import write_tiny_vae
from stagecast.cuda_graphs import rerun_capture
from stagecast.model.vae_configs import vae_config

pytestmark = pytest.mark.parity

H, W = 4, 6


def rerun(_part):
    return rerun_capture


def build(name: str) -> AutoencoderKLWan:
    torch.manual_seed(7)
    return AutoencoderKLWan(**vae_config(name)).eval()


@pytest.fixture(scope="module")
def vae() -> AutoencoderKLWan:
    return build("tiny-wan2.1")


def latents(vae, seed: int, frames: int = 6, hw=(H, W)) -> torch.Tensor:
    return torch.randn(1, vae.config.z_dim, frames, *hw, generator=torch.Generator().manual_seed(seed))


def reference(vae, z: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    eager = StreamVAE(vae)
    state = eager.new_state()
    return [eager.decode_chunk(state, c) for c in z.split(sizes, dim=2)]


def decode(parts, states, chunk):
    x = chunk
    for part, state in zip(parts, states, strict=True):
        x = part.decode_chunk(state, x)
    return x


@pytest.mark.parametrize("name", ["tiny-wan2.1", "tiny-wan2.2"])
@pytest.mark.parametrize("num_parts", [1, 2])
def test_interleaved_streams_equal_eager_across_slot_reuse(name, num_parts):
    vae = build(name)
    parts = [StreamVAE(vae)] if num_parts == 1 else split_decoder(vae, 2)
    assert capture_graphs(parts, latent_hw=(H, W), slots=2, capture_for=rerun) == [True] * num_parts
    sizes = [1, 1, 1, 2, 1]  # a two-frame chunk replays the same slot twice within one chunk
    streams = {name: latents(vae, seed) for name, seed in (("a", 1), ("b", 2), ("c", 3), ("d", 4))}
    want = {name: reference(vae, z, sizes) for name, z in streams.items()}
    chunks = {name: list(z.split(sizes, dim=2)) for name, z in streams.items()}
    got = {name: [] for name in streams}
    states = {name: [p.new_state() for p in parts] for name in streams}

    def step(name):
        got[name].append(decode(parts, states[name], chunks[name][len(got[name])]))

    # a, b and c interleave over 2 slots: c finds none and decodes eagerly.
    for _ in range(4):
        for name in "abc":
            step(name)
    held = {name: [s.graph for s in states[name]] for name in "abc"}
    assert all(g is not None for g in held["a"] + held["b"]) and held["c"] == [None] * num_parts
    assert all(x is not y for x, y in zip(held["a"], held["b"], strict=True))  # no two streams share a cache
    for name in "abc":
        step(name)
    a_slots = held["a"]
    for p, s in zip(parts, states["a"], strict=True):
        p.release(s)
    assert all(p.graphs.free_slots == 1 for p in parts)
    # d starts after a ended: it takes a's slots at its third frame (its first two are eager), c keeps eager or
    # takes one only when free (none is: d took it).
    for _ in range(5):
        step("d")
    assert [s.graph for s in states["d"]] == a_slots
    for name in "bcd":
        assert len(got[name]) == len(sizes)
        for g, w in zip(got[name], want[name], strict=True):
            assert torch.equal(g, w), name
    for g, w in zip(got["a"], want["a"], strict=True):
        assert torch.equal(g, w)
    for name in "bcd":
        for p, s in zip(parts, states[name], strict=True):
            p.release(s)
    assert all(p.graphs.free_slots == 2 for p in parts)


def test_an_eager_stream_takes_a_slot_freed_mid_stream_and_stays_exact(vae):
    part = StreamVAE(vae)
    capture_graphs([part], latent_hw=(H, W), slots=1, capture_for=rerun)
    za, zb = latents(vae, 5), latents(vae, 6)
    want = reference(vae, zb, [1] * 6)
    sa, sb = part.new_state(), part.new_state()
    for c in za.split(1, dim=2)[:3]:
        part.decode_chunk(sa, c)
    got = []
    for i, c in enumerate(zb.split(1, dim=2)):
        got.append(part.decode_chunk(sb, c))
        if i == 2:
            assert sb.graph is None  # a holds the only slot
            part.release(sa)
        if i == 3:
            assert sb.graph is not None  # b's cache was copied into the slot a gave back
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_first_two_frames_are_eager_and_another_size_never_takes_a_slot(vae):
    part = StreamVAE(vae)
    capture_graphs([part], latent_hw=(H, W), slots=1, capture_for=rerun)
    state = part.new_state()
    for i, c in enumerate(latents(vae, 8, frames=3).split(1, dim=2)):
        part.decode_chunk(state, c)
        assert (state.graph is not None) == (i >= 2)
    part.release(state)
    other = latents(vae, 9, frames=4, hw=(2, 4))
    want = reference(vae, other, [1] * 4)
    state = part.new_state()
    got = [part.decode_chunk(state, c) for c in other.split(1, dim=2)]
    assert state.graph is None and part.graphs.free_slots == 1
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_a_graphed_states_snapshot_is_a_copy_and_continues_exactly(vae):
    part = StreamVAE(vae)
    capture_graphs([part], latent_hw=(H, W), slots=1, capture_for=rerun)
    z = latents(vae, 10)
    want = reference(vae, z, [1] * 6)
    state = part.new_state()
    chunks = z.split(1, dim=2)
    for c in chunks[:4]:
        part.decode_chunk(state, c)
    snapshot = state.state_dict()
    assert not any(t is s for t, s in zip(snapshot["feat_cache"], state.graph.cache, strict=True) if t is not None)
    part.decode_chunk(state, chunks[4])  # moves the slot on; the snapshot must not move with it
    moved = StreamVAE(vae).load_state(snapshot)
    eager = StreamVAE(vae)
    assert torch.equal(eager.decode_chunk(moved, chunks[4]), want[4])


def test_a_capture_that_raises_leaves_the_part_eager_with_a_warning(vae, caplog):
    def broken(_part):
        def capture(fn):
            raise RuntimeError("operation not permitted when stream is capturing")

        return capture

    part = StreamVAE(vae)
    with caplog.at_level(logging.WARNING, logger="gateway.decode.vae_graphs"):
        assert capture_graphs([part], latent_hw=(H, W), slots=2, capture_for=broken) == [False]
    assert part.graphs is None and "could not be captured" in caplog.text
    z = latents(vae, 11)
    state = part.new_state()
    got = [part.decode_chunk(state, c) for c in z.split(1, dim=2)]
    assert all(torch.equal(g, w) for g, w in zip(got, reference(vae, z, [1] * 6), strict=True))


@pytest.mark.parametrize("fault", ["replays twice", "replays nothing"])
def test_a_graph_that_differs_from_eager_at_build_leaves_the_part_eager(vae, caplog, fault):
    def wrong(_part):
        def capture(fn):
            fn()
            return (lambda: (fn(), fn())) if fault == "replays twice" else (lambda: None)

        return capture

    parts = split_decoder(vae, 2)
    with caplog.at_level(logging.WARNING, logger="gateway.decode.vae_graphs"):
        assert capture_graphs(parts, latent_hw=(H, W), slots=1, capture_for=wrong) == [False, False]
    assert all(p.graphs is None for p in parts) and "differs from the eager one" in caplog.text


def test_a_slot_given_back_twice_is_refused(vae):
    part = StreamVAE(vae)
    capture_graphs([part], latent_hw=(H, W), slots=1, capture_for=rerun)
    state = part.new_state()
    for c in latents(vae, 12, frames=3).split(1, dim=2):
        part.decode_chunk(state, c)
    slot = state.graph
    part.release(state)
    with pytest.raises(ValueError, match="not held"):
        part.graphs.free(slot)
    part.release(state)  # releasing a released state gives nothing back twice
    assert part.graphs.free_slots == 1


def test_slot_counts_are_bounded(vae):
    with pytest.raises(ValueError, match="graph slots"):
        capture_graphs([StreamVAE(vae)], latent_hw=(H, W), slots=0, capture_for=rerun)
    with pytest.raises(ValueError, match="first part"):
        capture_graphs([StreamVAESlice(vae, 2, 4)], latent_hw=(H, W), slots=1, capture_for=rerun)


# -- the gateway's decoder: one worker thread per part per stream ------------------------------------------------


@pytest.fixture(scope="module")
def vae_folder(tmp_path_factory):
    return write_tiny_vae(tmp_path_factory.mktemp("vae") / "vae", name="tiny-wan2.1", seed=4)


def test_local_sessions_in_threads_equal_eager_and_give_every_slot_back(vae_folder):
    eager = StreamVAE.from_folder(vae_folder)
    decoder = LocalDecoder.from_folder(vae_folder, dtype=torch.float32, devices=["cpu", "cpu"])
    assert decoder.capture_graphs((H, W), slots=2, capture_for=rerun) == [True, True]
    z_dim = eager.vae.config.z_dim
    streams = [
        list(torch.randn(1, z_dim, 6, H, W, generator=torch.Generator().manual_seed(s)).split(1, 2)) for s in range(3)
    ]

    def expected(chunks):
        state = eager.new_state()
        return [to_uint8_frames(eager.decode_chunk(state, c)).numpy() for c in chunks]

    results = [None] * len(streams)

    def run(i):
        session = decoder.open(2)
        try:
            for k, c in enumerate(streams[i]):
                assert session.submit(k, c)
            session.finish()
            results[i] = [frames for _, frames, _ in session.results()]
        finally:
            session.close()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(streams))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for got, chunks in zip(results, streams, strict=True):
        assert len(got) == len(chunks)
        for g, w in zip(got, expected(chunks), strict=True):
            np.testing.assert_array_equal(g, w)
    assert all(p.graphs.free_slots == 2 for p in decoder.parts)


def test_a_failed_stream_gives_its_slots_back(vae_folder):
    decoder = LocalDecoder.from_folder(vae_folder, dtype=torch.float32, devices=["cpu"])
    decoder.capture_graphs((H, W), slots=1, capture_for=rerun)
    z_dim = decoder.parts[0].vae.config.z_dim
    session = decoder.open(8)
    for k in range(4):
        assert session.submit(k, torch.randn(1, z_dim, 1, H, W))
    session.submit(4, torch.randn(1, z_dim, 1, H + 2, W))  # another size mid-stream: the part fails
    session.finish()
    with pytest.raises(ValueError, match="stream latents"):
        for _ in session.results():
            pass
    assert decoder.parts[0].graphs.free_slots == 0  # held until the stream is closed
    session.close()
    assert decoder.parts[0].graphs.free_slots == 1


def test_the_gpu_checks_smoke_mode_reports_every_variant_exact(tmp_path):
    out = tmp_path / "vae_graphs.json"
    assert vae_graphs_check.main(["--smoke", "--streams", "1,2", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = [r for case in result["cases"] for r in case["rows"]]
    assert {r["case"] for r in rows} == {"tiny-wan2.1", "tiny-wan2.2"}
    assert {(r["variant"], r["streams"]) for r in rows if r["case"] == "tiny-wan2.1"} == {
        (v, s) for v in ("eager", "graphed", "channels-last", "channels-last+graphed") for s in (1, 2)
    }
    for r in rows:
        assert r["fps"] > 0 and r["chunk_ms"] > 0
        assert r["graphed_parts"] == ([True] if "graphed" in r["variant"] else None)
        if not r["variant"].startswith("channels-last"):  # the layout changes the bits; graphs must not
            assert r["max_diff"] == 0.0, r


def test_the_gateway_captures_its_slots_before_serving_and_refuses_bad_slot_counts(tmp_path):
    from gateway.service import Gateway, GatewayOptions
    from launcher.demo_checkpoint import write_demo_checkpoint

    root = write_demo_checkpoint(tmp_path / "ckpt")
    opts = dict(coordinator="127.0.0.1:1", checkpoint=str(root), port=0, max_streams=3)  # nothing is served
    gateway = Gateway(GatewayOptions(**opts, vae_cuda_graphs=True, vae_devices=["cpu", "cpu"]))
    try:
        assert [p.graphs.free_slots for p in gateway.models.decoder.parts] == [3, 3]  # --max-streams slots per part
        part = gateway.models.decoder.parts[0]
        assert part.graphs.slots[0].x.shape[-2:] == (64 // 8, 64 // 8)  # the checkpoint's serving size
    finally:
        gateway.stop(grace=0)  # never started: stops its timers, channel and metrics
    with pytest.raises(ValueError, match="--vae-graph-slots must be in"):
        Gateway(GatewayOptions(**opts, vae_cuda_graphs=True, vae_graph_slots=-1))


@pytest.fixture
def cudnn_benchmark_flag():
    before = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = False
    yield
    torch.backends.cudnn.benchmark = before


def test_cudnn_autotune_is_turned_on_only_for_a_vae_on_a_gpu(cudnn_benchmark_flag):
    from gateway.decode.stream_vae import use_cudnn_autotune

    assert use_cudnn_autotune(["cpu", "cpu"]) is False
    assert torch.backends.cudnn.benchmark is False  # CPU outputs, and so the parity tests, never see it
    assert use_cudnn_autotune(["cpu", "cuda:1"]) is True  # one VAE slice on a GPU is enough
    assert torch.backends.cudnn.benchmark is True


def test_the_gateway_and_vae_stage_flags_switch_the_cudnn_search(cudnn_benchmark_flag):
    from gateway.cli import _gateway_options, _vae_options
    from launcher.cli import build_parser

    parser = build_parser()
    base = ["gateway", "--coordinator", "127.0.0.1:1", "--checkpoint", "x", "--insecure-internal"]
    assert _gateway_options(parser.parse_args(base)).vae_cudnn_benchmark is False  # off: it slows first frames
    assert _gateway_options(parser.parse_args([*base, "--vae-cudnn-benchmark"])).vae_cudnn_benchmark is True
    stage = ["vae-stage", "--checkpoint", "x", "--index", "0", "--num-slices", "1", "--insecure-internal"]
    assert _vae_options(parser.parse_args(stage), None).cudnn_benchmark is False
    assert _vae_options(parser.parse_args([*stage, "--cudnn-benchmark"]), None).cudnn_benchmark is True
