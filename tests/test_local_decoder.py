"""The gateway's in-process decoder: one worker thread per VAE part, slices pipelined across devices.

On CPU every "device" is the CPU, but the code path is the one the GPUs take: each part loads its own copy of the
weights, runs in its own thread with its own cache slots, and hands one tensor per chunk to the next part.  The
frames must equal a plain ``StreamVAE`` decode of the same stream bit for bit, for every cut.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from gateway.decode.decoder import LocalDecoder
from gateway.decode.stream_vae import StreamVAE, decoder_units, to_uint8_frames
from launcher.demo_checkpoint import write_tiny_vae

pytestmark = pytest.mark.parity


@pytest.fixture(scope="module")
def vae_folder(tmp_path_factory):
    return write_tiny_vae(tmp_path_factory.mktemp("vae") / "vae", name="tiny-wan2.1", seed=3)


def latents_for(folder, seed: int, frames: int = 5) -> list[torch.Tensor]:
    z_dim = StreamVAE.from_folder(folder).vae.config.z_dim
    gen = torch.Generator().manual_seed(seed)
    return list(torch.randn(1, z_dim, frames, 4, 6, generator=gen).split(1, dim=2))


def expected_frames(folder, chunks: list[torch.Tensor]) -> list[np.ndarray]:
    vae = StreamVAE.from_folder(folder)
    state = vae.new_state()
    return [to_uint8_frames(vae.decode_chunk(state, c)).numpy() for c in chunks]


def run_session(decoder: LocalDecoder, chunks: list[torch.Tensor], capacity: int = 2):
    """Submit from one thread (as the gateway's pipeline reader does) and collect results in this one."""
    session = decoder.open(capacity)

    def produce():
        for i, c in enumerate(chunks):
            assert session.submit(i, c)
        session.finish()

    producer = threading.Thread(target=produce)
    producer.start()
    try:
        return list(session.results()), session
    finally:
        producer.join()
        session.close()


def test_every_cut_over_two_parts_gives_the_whole_decoders_frames(vae_folder):
    chunks = latents_for(vae_folder, seed=1)
    want = expected_frames(vae_folder, chunks)
    units = len(decoder_units(StreamVAE.from_folder(vae_folder).vae))
    for cut in range(1, units):
        decoder = LocalDecoder.from_folder(vae_folder, dtype=torch.float32, devices=["cpu", "cpu"], boundaries=[cut])
        assert [p.start for p in decoder.parts] == [0, cut]
        got, session = run_session(decoder, chunks)
        assert [tag for tag, _, _ in got] == list(range(len(chunks)))
        for (_, frames, (start, end)), ref in zip(got, want, strict=True):
            np.testing.assert_array_equal(frames, ref)
            assert 0 < start <= end
        assert session.state_bytes == 0 and all(s.released for s in session.states)
        assert not any(w.is_alive() for w in session.workers)


def test_three_parts_and_two_concurrent_streams_stay_separate(vae_folder):
    decoder = LocalDecoder.from_folder(vae_folder, dtype=torch.float32, devices=["cpu"] * 3)
    streams = [latents_for(vae_folder, seed=s) for s in (4, 5)]
    results = [None, None]

    def run(i):
        results[i] = run_session(decoder, streams[i], capacity=1)[0]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for chunks, got in zip(streams, results, strict=True):
        for (_, frames, _), ref in zip(got, expected_frames(vae_folder, chunks), strict=True):
            np.testing.assert_array_equal(frames, ref)


def test_a_bad_chunk_fails_the_session_with_the_parts_error_and_frees_everything(vae_folder):
    decoder = LocalDecoder.from_folder(vae_folder, dtype=torch.float32, devices=["cpu", "cpu"])
    good = latents_for(vae_folder, seed=6, frames=2)
    session = decoder.open(4)
    assert session.submit(0, good[0])
    assert session.submit(1, torch.zeros(1, 3, 1, 4, 6))  # wrong latent channels
    results = session.results()
    tag, frames, _ = next(results)
    assert tag == 0 and frames.shape[0] == 1
    with pytest.raises(ValueError, match=r"expected normalised latents of shape \(1, 16, T, h, w\)"):
        next(results)
    assert not session.submit(2, good[1])  # the failed part closed the inbox: the producer stops
    session.close()
    assert all(s.released for s in session.states)
    assert not any(w.is_alive() for w in session.workers)


def test_abort_unblocks_a_producer_and_close_joins_the_workers(vae_folder):
    decoder = LocalDecoder.from_folder(vae_folder, dtype=torch.float32, devices=["cpu", "cpu"])
    chunks = latents_for(vae_folder, seed=7, frames=12)  # more than the inbox, the parts and their hand-offs hold
    session = decoder.open(1)
    submitted = []

    def produce():  # nobody reads the results, so the pipeline fills and this blocks until abort
        for i, c in enumerate(chunks):
            ok = session.submit(i, c)
            submitted.append(ok)
            if not ok:
                return

    producer = threading.Thread(target=produce)
    producer.start()
    session.abort()
    producer.join(timeout=30)
    assert not producer.is_alive() and submitted[-1] is False and len(submitted) < len(chunks)
    session.close()
    assert not any(w.is_alive() for w in session.workers)
    assert all(s.released for s in session.states)


def test_bad_devices_are_refused_with_the_reason(vae_folder):
    with pytest.raises(ValueError, match="'gpu0' is not a device name"):
        LocalDecoder.from_folder(vae_folder, dtype=torch.float32, devices=["cpu", "gpu0"])
    missing = f"cuda:{torch.cuda.device_count()}"
    with pytest.raises(ValueError, match=f"'{missing}' does not exist here"):
        LocalDecoder.from_folder(vae_folder, dtype=torch.float32, devices=["cpu", missing])


def test_bad_splits_are_refused_with_the_reason(vae_folder):
    units = len(decoder_units(StreamVAE.from_folder(vae_folder).vae))
    with pytest.raises(ValueError, match="needs 2 devices"):
        LocalDecoder.from_folder(vae_folder, dtype=torch.float32, devices=["cpu"], boundaries=[3])
    with pytest.raises(ValueError, match="need 1 increasing boundaries"):
        LocalDecoder.from_folder(vae_folder, dtype=torch.float32, devices=["cpu", "cpu"], boundaries=[2, 3])
    with pytest.raises(ValueError, match=f"must lie in \\[1, {units - 1}\\]"):
        LocalDecoder.from_folder(vae_folder, dtype=torch.float32, devices=["cpu", "cpu"], boundaries=[units])


def test_compiled_slices_get_room_for_their_variants(vae_folder):
    # All slices share one code object; each needs up to 3 compiled variants (frame 1, frame 2, later frames).
    # Under dynamo's default limit of 8, the third slice of three would silently run eagerly.
    import torch._dynamo

    from gateway.decode.stream_vae import split_decoder

    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    before = getattr(config, name)
    try:
        setattr(config, name, 8)
        split_decoder(StreamVAE.from_folder(vae_folder).vae, 3, compile=True)
        assert getattr(config, name) >= 3 * 3
    finally:
        setattr(config, name, before)
