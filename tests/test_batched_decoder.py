"""The batched tiny decoder (gateway.decode.batched_decoder): one call for every stream's ready chunk, exact per stream,
paced streams first, failures isolated, state freed on close."""

import dataclasses
import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from gateway.decode import batched_decoder
from gateway.decode.batched_decoder import SERVED_MIN, BatchedDecoder, BatchTimes
from gateway.decode.tiny_decoder import load_tiny_decoder, tiny_to_uint8_frames
from gateway.decode.vae_cost import tiny_cost
from launcher.demo_checkpoint import write_tiny_decoder

pytestmark = pytest.mark.unit

HW = (8, 8)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return write_tiny_decoder(tmp_path_factory.mktemp("batched") / "taew.pth", latent_channels=16, seed=3)


def latents(frames, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, 16, frames, *HW, generator=g)


def lone(path, x) -> np.ndarray:
    """The stream's whole video decoded at once by a decoder of its own."""
    part = load_tiny_decoder(path)
    return tiny_to_uint8_frames(part.decode_chunk(part.new_state(), x)).numpy()


class Gated:
    """A tiny decoder whose calls wait for the test's go-ahead (``hold``), recording each call's streams."""

    def __init__(self, part, hold=False, poison=None):
        self.part, self.hold, self.poison = part, hold, poison
        self.calls: list[list] = []
        self.entered = threading.Semaphore(0)
        self.go = threading.Semaphore(0)

    def __getattr__(self, name):
        return getattr(self.part, name)

    def decode_batch(self, states, xs, pad_to=None):
        self.calls.append(list(states))
        if self.hold:
            self.entered.release()
            self.go.acquire()
        if self.poison is not None and any(s is self.poison for s in states):
            raise RuntimeError("poisoned stream")
        return self.part.decode_batch(states, xs, pad_to=pad_to)


def tag(i):
    return SimpleNamespace(index=i)


def drain(session):
    return [frames for _tag, frames, _when in session.results()]


def test_streams_of_different_starts_and_lengths_decode_bit_for_bit_as_alone_and_share_calls(tiny_path):
    decoder = BatchedDecoder(load_tiny_decoder(tiny_path))
    # stream -> (the round it starts in, its chunks' latent frames)
    plan = {0: (0, [1, 2, 1, 1]), 1: (1, [1, 1, 2]), 2: (1, [1, 1]), 3: (2, [2, 1, 1, 1])}
    videos = {s: latents(sum(sizes), seed=10 + s) for s, (_r, sizes) in plan.items()}
    chunks = {s: list(videos[s].split(sizes, dim=2)) for s, (_r, sizes) in plan.items()}
    sessions, got = {}, {s: [] for s in plan}
    try:
        for rnd in range(6):
            for s, (start, _sizes) in plan.items():
                if start == rnd:
                    sessions[s] = decoder.open(4)
            live = [s for s in sessions if rnd - plan[s][0] < len(chunks[s])]
            for s in live:  # every live stream's chunk submitted before any is read: the worker may batch them
                assert sessions[s].submit(tag(rnd - plan[s][0]), chunks[s][rnd - plan[s][0]])
            for s in live:
                it = sessions[s].results()
                got[s].append(next(it))
        for s, session in sessions.items():
            session.finish()
            assert drain(session) == []
            assert [t.index for t, _f, _w in got[s]] == list(range(len(chunks[s])))  # in order
            frames = np.concatenate([f for _t, f, _w in got[s]])
            assert np.array_equal(frames, lone(tiny_path, videos[s])), f"stream {s}"
    finally:
        for session in sessions.values():
            session.close()
        decoder.close()
    assert decoder.calls < sum(len(c) for c in chunks.values())
    assert max(decoder.batch_sizes) > 1


def test_a_waiting_round_becomes_one_call_of_every_ready_stream(tiny_path):
    gated = Gated(load_tiny_decoder(tiny_path), hold=True)
    decoder = BatchedDecoder(gated)
    blocker = decoder.open(2)
    others = [decoder.open(2) for _ in range(4)]
    try:
        blocker.submit(tag(0), latents(1, 0))
        gated.entered.acquire()  # the worker is inside the blocker's call
        for i, s in enumerate(others):
            s.submit(tag(0), latents(1, i + 1))
        gated.go.release()
        gated.entered.acquire()
        gated.go.release()
        assert len(gated.calls) == 2
        assert {id(s) for s in gated.calls[1]} == {id(s.state) for s in others}
        for s in others:
            (frames,) = drain_one(s)
            assert frames.shape == (1, 64, 64, 3)
        # The batch serving formed (1 stream, then 4) is what the coordinator prices streams at.
        assert decoder.formed_batch() == 2.5 and decoder.formed_batch(calls=1) == 4.0
        cost = tiny_cost(decoder, (1, 16, 1, 8, 8))
        assert cost.formed_batch == 2.5 and cost.to_proto().formed_batch == 2.5
        assert cost.differs(dataclasses.replace(cost, formed_batch=1.0))  # a change the reporter sends at once
    finally:
        gated.hold = False
        for s in [blocker, *others]:
            s.close()
        decoder.close()


def drain_one(session):
    session.finish()
    return drain(session)


def test_paced_streams_go_first_when_a_call_is_bounded(tiny_path):
    gated = Gated(load_tiny_decoder(tiny_path), hold=True)
    decoder = BatchedDecoder(gated, max_batch=2)
    blocker = decoder.open(2)
    unpaced = [decoder.open(2) for _ in range(3)]
    paced = decoder.open(2, paced=True)
    try:
        blocker.submit(tag(0), latents(1, 0))
        gated.entered.acquire()
        for i, s in enumerate(unpaced):  # the unpaced flood's chunks arrive first
            s.submit(tag(0), latents(1, i + 1))
        paced.submit(tag(0), latents(1, 9))
        gated.go.release()
        gated.entered.acquire()
        second = gated.calls[1]
        assert len(second) == 2
        assert second[0] is paced.state  # the paced stream's chunk is in the very next call, ahead of older ones
        assert second[1] is unpaced[0].state  # then the oldest unpaced chunk
        gated.hold = False
        gated.go.release()
        for _ in range(2):
            gated.go.release()  # any later call that raced the switch
        for s in [paced, *unpaced]:
            assert len(drain_one(s)) == 1
    finally:
        gated.hold = False
        for _ in range(4):
            gated.go.release()
        for s in [blocker, *unpaced, paced]:
            s.close()
        decoder.close()


def test_a_bad_chunk_fails_only_its_stream(tiny_path):
    decoder = BatchedDecoder(load_tiny_decoder(tiny_path))
    good, bad = decoder.open(4), decoder.open(4)
    try:
        x = latents(2, 1)
        good.submit(tag(0), x[:, :, :1])
        bad.submit(tag(0), torch.randn(1, 8, 1, *HW))  # 8 channels: not this decoder's latents
        good.submit(tag(1), x[:, :, 1:])
        good.finish()
        bad.finish()
        with pytest.raises(ValueError, match="chunk 0: expected latents of shape"):
            drain(bad)
        assert not bad.submit(tag(1), x)  # a failed stream takes no more
        frames = np.concatenate(drain(good))
        assert np.array_equal(frames, lone(tiny_path, x))
    finally:
        good.close()
        bad.close()
        decoder.close()


def test_a_call_that_fails_is_retried_stream_by_stream_and_fails_only_the_culprit(tiny_path):
    gated = Gated(load_tiny_decoder(tiny_path), hold=True)
    decoder = BatchedDecoder(gated)
    blocker, good, bad = decoder.open(2), decoder.open(2), decoder.open(2)
    gated.poison = bad.state
    try:
        blocker.submit(tag(0), latents(1, 0))
        gated.entered.acquire()
        x = latents(1, 5)
        good.submit(tag(0), x)
        bad.submit(tag(0), latents(1, 6))
        gated.hold = False
        gated.go.release()
        good.finish()
        bad.finish()
        with pytest.raises(RuntimeError, match="poisoned stream"):
            drain(bad)
        assert np.array_equal(np.concatenate(drain(good)), lone(tiny_path, x))
        assert any(len(c) == 2 for c in gated.calls)  # the two were in one call first
    finally:
        for s in [blocker, good, bad]:
            s.close()
        decoder.close()


def test_close_waits_for_a_call_holding_its_chunk_then_frees_the_state(tiny_path):
    gated = Gated(load_tiny_decoder(tiny_path), hold=True)
    decoder = BatchedDecoder(gated)
    first, other = decoder.open(2), decoder.open(2)
    try:
        first.submit(tag(0), latents(1, 1))
        gated.entered.acquire()
        gated.hold = False
        gated.go.release()
        assert len(drain_one(first)) == 1
        assert first.state_bytes > 0  # the stream's memories
        gated.hold = True
        live = decoder.open(2)
        live.submit(tag(0), latents(1, 2))
        other.submit(tag(0), latents(1, 3))
        gated.entered.acquire()  # the call holds live's (and maybe other's) chunk
        closer = threading.Thread(target=live.close)
        closer.start()
        closer.join(0.2)
        assert closer.is_alive()  # waits for the call
        gated.hold = False
        gated.go.release()
        closer.join()
        assert live.state_bytes == 0
        assert live not in decoder.sessions
        assert len(drain_one(other)) == 1  # a stream sharing the call is unaffected
    finally:
        gated.hold = False
        for _ in range(3):
            gated.go.release()
        first.close()
        other.close()
        decoder.close()
    assert first.state_bytes == 0 and other.state_bytes == 0


def test_abort_drops_what_is_queued_and_ends_results(tiny_path):
    decoder = BatchedDecoder(load_tiny_decoder(tiny_path))
    s = decoder.open(3)
    try:
        s.abort()
        assert not s.submit(tag(0), latents(1, 0))
        assert drain(s) == []
        assert s.queued == 0
    finally:
        s.close()
        decoder.close()
    assert s.state_bytes == 0


def test_inputs_are_bounded_naming_the_field(tiny_path):
    part = load_tiny_decoder(tiny_path)
    with pytest.raises(ValueError, match="max_batch must be in 1..64"):
        BatchedDecoder(part, max_batch=0)
    with pytest.raises(ValueError, match="buckets must be"):
        BatchedDecoder(part, buckets=(0, 2))
    with pytest.raises(ValueError, match="max_batch must be in 1..4"):
        BatchedDecoder(part, buckets=(1, 4), max_batch=8)
    decoder = BatchedDecoder(part)
    try:
        with pytest.raises(ValueError, match="capacity must be in"):
            decoder.open(0)
    finally:
        decoder.close()


def test_padding_to_a_bucket_keeps_each_stream_exact(tiny_path):
    decoder = BatchedDecoder(load_tiny_decoder(tiny_path), buckets=(1, 4))
    sessions = [decoder.open(2) for _ in range(3)]
    x = [latents(2, 20 + i) for i in range(3)]
    try:
        for c in range(2):
            for i, s in enumerate(sessions):
                s.submit(tag(c), x[i][:, :, c : c + 1])
        for i, s in enumerate(sessions):
            assert np.array_equal(np.concatenate(drain_one(s)), lone(tiny_path, x[i]))
        assert decoder.bucket(3) == 4 and decoder.bucket(1) == 1
    finally:
        for s in sessions:
            s.close()
        decoder.close()


def test_warm_measures_every_bucket_and_batch_ms_merges_it_with_served_calls(tiny_path):
    def timer():  # each call "takes" 10 ms per row it ran
        return (lambda: None), lambda: 10.0 * decoder_rows[-1]

    decoder_rows = []
    part = load_tiny_decoder(tiny_path)
    original = part.decode_batch

    def counting(states, xs, pad_to=None):
        decoder_rows.append(pad_to or len(states))
        return original(states, xs, pad_to=pad_to)

    part.decode_batch = counting
    decoder = BatchedDecoder(part, buckets=(1, 2, 4), timer=timer)
    try:
        measured = decoder.warm((1, 16, 1, 2, 2), chunks=3)
        assert measured == {1: 10.0, 2: 20.0, 4: 40.0}
        assert decoder.batch_ms(4) == [10.0, 10.0, 40.0 / 3, 10.0]  # 3 streams pad to 4 rows
        for _ in range(SERVED_MIN):  # served calls of 3 streams
            decoder.times.record(3, 36.0)
        assert decoder.batch_ms(4)[2] == 12.0
    finally:
        decoder.close()


def test_batch_times_take_each_sizes_least_waiting_call_and_fall_back_to_measurements():
    times = BatchTimes(window=4, min_calls=3)
    assert times.per_stream_ms(2) == []
    times.record(2, 40.0)
    times.record(2, 20.0)
    assert times.per_stream_ms(2) == [10.0, 10.0]  # nothing measured: size 2's least, and size 1 the nearest's
    times.set_measured(1, 8.0)
    assert times.per_stream_ms(2) == [8.0, 8.0]  # 2 calls of 2 streams do not yet replace the measurement
    times.record(2, 60.0)
    assert times.per_stream_ms(3) == [8.0, 10.0, 8.0]  # past the largest measurement: its per-stream cost
    for ms in (16.0, 14.0, 12.0):  # the window keeps the last 4 calls: the 10 ms per stream (20 ms) falls out
        times.record(2, ms)
    assert times.per_stream_ms(2) == [8.0, 6.0]
    with pytest.raises(ValueError, match="window"):
        BatchTimes(window=0)
    with pytest.raises(ValueError, match="min_calls"):
        BatchTimes(window=2, min_calls=3)
    unpadded = BatchTimes(padded=False)
    unpadded.set_measured(2, 20.0)
    unpadded.set_measured(4, 28.0)
    # 1 stream: at most the smallest call; 3 streams: a 24 ms call between 2 streams' and 4's; 5: 4's per-stream
    assert unpadded.per_stream_ms(5) == [20.0, 10.0, 8.0, 7.0, 7.0]


def test_slow_served_calls_do_not_become_a_sizes_cost():
    # On an H200 the tiny decoder's first call served at batch 1 took 675 ms (9 ms steady): averaged from there, it
    # priced every stream at 675 ms and admission held one stream where the GPU holds several.  Beside a DiT stage,
    # calls that waited behind its forwards ran 2-4 times their own work (which the stage's times already count).
    times = BatchTimes()
    times.set_measured(1, 8.0)
    times.record(1, 675.0)
    assert times.per_stream_ms(1) == [8.0]
    times.record(1, 31.0)
    times.record(1, 9.5)
    times.record(1, 37.0)
    assert times.per_stream_ms(1) == [9.5]


def test_the_state_a_stream_holds_is_known_before_it_starts(tiny_path):
    decoder = BatchedDecoder(load_tiny_decoder(tiny_path))
    s = decoder.open(2)
    try:
        s.submit(tag(0), latents(1, 0))
        drain_one(s)
        assert s.state_bytes == decoder.state_bytes_at(HW) > 0
    finally:
        s.close()
        decoder.close()


def next_frames(session):
    """The session's next decoded chunk's frames (the session stays open)."""
    return next(session.results())[1]


def batch_tag(i, seq, chunks):
    return SimpleNamespace(index=i, batch_seq=seq, batch_chunks=chunks)


def wait_for_sibling_waits(decoder, n):
    with decoder.cond:
        assert decoder.cond.wait_for(lambda: decoder.sibling_waits >= n, timeout=30), "the worker never waited"


def test_the_chunks_one_pipeline_batch_finished_wait_for_each_other_and_decode_in_one_call(tiny_path, monkeypatch):
    monkeypatch.setattr(batched_decoder, "SIBLING_WAIT_NS", 120 * 10**9)  # only the arrival ends this wait
    gated = Gated(load_tiny_decoder(tiny_path))
    decoder = BatchedDecoder(gated)
    a, b = decoder.open(2), decoder.open(2)
    try:
        a.submit(batch_tag(0, seq=7, chunks=2), latents(1, 1))
        wait_for_sibling_waits(decoder, 1)  # the first of two arrived: the worker waits for the other
        assert gated.calls == []
        b.submit(batch_tag(0, seq=7, chunks=2), latents(1, 2))
        assert next_frames(a).shape == next_frames(b).shape == (1, 64, 64, 3)
        assert [{id(s) for s in call} for call in gated.calls] == [{id(a.state), id(b.state)}]
        # The next batch's chunks of the same two streams: a batch of one (or unknown) never waits.
        a.submit(batch_tag(1, seq=8, chunks=1), latents(1, 3))
        next_frames(a)
        assert len(gated.calls) == 2 and decoder.sibling_waits == 1
        # What a closed stream logs: the calls by streams a call, and the waits.
        assert decoder.formed_summary() == (
            "tiny decoder: 2 calls; the last 2 by streams a call {1: 1, 2: 1}; "
            "1 waits for a pipeline batch's other chunks"
        )
    finally:
        for s in (a, b):
            s.close()
        decoder.close()


def test_a_chunk_that_is_due_is_decoded_at_once_and_a_waiting_batch_keeps_waiting_for_its_sibling(
    tiny_path, monkeypatch
):
    monkeypatch.setattr(batched_decoder, "SIBLING_WAIT_NS", 120 * 10**9)
    gated = Gated(load_tiny_decoder(tiny_path))
    decoder = BatchedDecoder(gated)
    a, b, c = decoder.open(2), decoder.open(2), decoder.open(2)
    try:
        a.submit(batch_tag(0, seq=3, chunks=2), latents(1, 1))
        wait_for_sibling_waits(decoder, 1)
        c.submit(tag(0), latents(1, 3))  # not announced as part of a batch: due now; a's batch is not
        next_frames(c)
        assert [{id(s) for s in call} for call in gated.calls] == [{id(c.state)}]
        b.submit(batch_tag(0, seq=3, chunks=2), latents(1, 2))  # a's sibling: the batch decodes whole
        next_frames(a), next_frames(b)
        assert [{id(s) for s in call} for call in gated.calls] == [{id(c.state)}, {id(a.state), id(b.state)}]
    finally:
        for s in (a, b, c):
            s.close()
        decoder.close()


def test_a_batch_whose_other_chunks_never_come_decodes_after_the_bound(tiny_path):
    # One of its two chunks went to another decoder (a stream on the full VAE): the wait is bounded.
    decoder = BatchedDecoder(load_tiny_decoder(tiny_path))
    a = decoder.open(2)
    try:
        a.submit(batch_tag(0, seq=5, chunks=2), latents(1, 1))
        frames = next_frames(a)
        assert frames.shape == (1, 64, 64, 3) and decoder.calls == 1
    finally:
        a.close()
        decoder.close()


def test_the_gateway_exports_the_streams_per_call_its_tiny_decoder_formed(tiny_path):
    from prometheus_client import generate_latest

    from gateway.metrics import GatewayMetrics

    decoder = BatchedDecoder(load_tiny_decoder(tiny_path))
    metrics = GatewayMetrics(active=lambda: 0, vae_bytes=lambda: 0, tiny_formed_batch=decoder.formed_batch)
    a, b = decoder.open(2), decoder.open(2)
    try:
        assert b"stagecast_gateway_tiny_formed_batch 0.0" in generate_latest(metrics.registry)
        a.submit(tag(0), latents(1, 1))
        next_frames(a)
        b.submit(tag(0), latents(1, 2))
        next_frames(b)
        assert decoder.formed_batch() == 1.0
        assert b"stagecast_gateway_tiny_formed_batch 1.0" in generate_latest(metrics.registry)
    finally:
        for s in (a, b):
            s.close()
        decoder.close()


def test_a_call_for_a_complete_batch_leaves_the_next_batch_still_arriving_to_the_next_call(tiny_path, monkeypatch):
    """A batch is not split between calls: the first chunk of a batch whose sibling has not arrived stays when a
    call starts for a complete one, and decodes with its sibling."""
    monkeypatch.setattr(batched_decoder, "SIBLING_WAIT_NS", 120 * 10**9)  # only arrivals end a wait
    gated = Gated(load_tiny_decoder(tiny_path), hold=True)
    decoder = BatchedDecoder(gated)
    a, b, c, d, e = (decoder.open(2) for _ in range(5))
    try:
        e.submit(tag(0), latents(1, 9))  # an unannounced chunk: due at once, and its call holds the worker
        assert gated.entered.acquire(timeout=30)
        a.submit(batch_tag(0, seq=7, chunks=2), latents(1, 1))
        b.submit(batch_tag(0, seq=7, chunks=2), latents(1, 2))  # batch 7: complete
        c.submit(batch_tag(0, seq=8, chunks=2), latents(1, 3))  # batch 8: its first chunk only
        gated.go.release()  # the next call starts with batch 7 complete and batch 8 half here
        assert gated.entered.acquire(timeout=30)
        d.submit(batch_tag(0, seq=8, chunks=2), latents(1, 4))
        gated.go.release()
        assert gated.entered.acquire(timeout=30)
        gated.go.release()
        for s in (a, b, c, d, e):
            assert next_frames(s).shape == (1, 64, 64, 3)
        calls = [{id(st) for st in call} for call in gated.calls]
        assert calls == [{id(e.state)}, {id(a.state), id(b.state)}, {id(c.state), id(d.state)}], calls
    finally:
        gated.hold = False
        gated.go.release(10)
        for s in (a, b, c, d, e):
            s.close()
        decoder.close()
