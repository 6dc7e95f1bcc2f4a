"""Paced first at the gateway's shared resources: the decode gate of each part (gateway.decode.decoder), on a GPU and
on a CPU, and the encode gate a stream's frame encodes pass (gateway.stream.frames)."""

import contextlib
import os
import sys
import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from gateway.decode.decoder import (
    BACKGROUND_NICE,
    BACKGROUND_SLOTS,
    CPU_GATE_SLOTS,
    DecodeGate,
    LocalDecoder,
    encode_gate,
)
from gateway.decode.tiny_decoder import load_tiny_decoder, tiny_to_uint8_frames
from gateway.metrics import GatewayMetrics
from gateway.stream.frames import ChunkTag, FrameEmitter
from gateway.stream.trace import StreamTrace
from launcher.demo_checkpoint import write_tiny_decoder
from stagecast.media import make_encoder

pytestmark = pytest.mark.unit


def waiting(gate, paced, unpaced):
    with gate.cond:
        assert gate.cond.wait_for(lambda: gate.waiting == [paced, unpaced], timeout=60)


def test_a_waiting_paced_decode_goes_before_unpaced_ones_that_waited_longer():
    gate = DecodeGate(1)
    order = []

    def decode(name, paced):
        with gate.hold(paced):
            order.append(name)

    with gate.hold(paced=False):  # the GPU is busy with someone's decode
        first = threading.Thread(target=decode, args=("unpaced-1", False))
        first.start()
        waiting(gate, 0, 1)
        second = threading.Thread(target=decode, args=("unpaced-2", False))
        second.start()
        waiting(gate, 0, 2)
        paced = threading.Thread(target=decode, args=("paced", True))
        paced.start()
        waiting(gate, 1, 2)
    for t in (first, second, paced):
        t.join()
    assert order[0] == "paced" and sorted(order[1:]) == ["unpaced-1", "unpaced-2"]
    assert gate.free == 1 and gate.waiting == [0, 0]


def test_slots_bound_the_decodes_in_flight_and_are_themselves_bounded():
    gate = DecodeGate(2)
    with gate.hold(False), gate.hold(True):
        assert gate.free == 0
        t = threading.Thread(target=lambda: gate.hold(True).__enter__())
        t.start()
        waiting(gate, 1, 0)  # a third waits
    t.join()
    for bad in (0, 65):
        with pytest.raises(ValueError, match="decode gate slots must be in 1..64"):
            DecodeGate(bad)


class Recording:
    """A part that calls ``seen(state)`` for each stream's chunk it decodes, in the decoding thread."""

    def __init__(self, part, seen):
        self.part, self.seen = part, seen

    def __getattr__(self, name):
        return getattr(self.part, name)

    def decode_chunk(self, state, x):
        self.seen(state)
        return self.part.decode_chunk(state, x)


def test_local_sessions_decode_the_paced_streams_chunk_first_and_stay_exact(tmp_path):
    part = load_tiny_decoder(write_tiny_decoder(tmp_path / "t.pth", latent_channels=16))
    log = []
    decoder = LocalDecoder(
        Recording(part, lambda s: log.append(s.name)), gate_slots=1, background=False
    )  # the GPU's gate, on a CPU part
    gate = decoder.gates[0]
    x = torch.randn(1, 16, 1, 4, 4, generator=torch.Generator().manual_seed(0))
    unpaced, paced = decoder.open(2), decoder.open(2, paced=True)
    unpaced.states[0].name, paced.states[0].name = "unpaced", "paced"
    try:
        with gate.hold(False):
            unpaced.submit(SimpleNamespace(index=0), x)
            waiting(gate, 0, 1)
            paced.submit(SimpleNamespace(index=0), x)
            waiting(gate, 1, 1)
        for s in (unpaced, paced):
            s.finish()
            (frames,) = [f for _t, f, _w in s.results()]
            want = tiny_to_uint8_frames(part.decode_chunk(part.new_state(), x)).numpy()
            assert np.array_equal(frames, want)
        assert log == ["paced", "unpaced"]
    finally:
        unpaced.close()
        paced.close()


@pytest.mark.parametrize("background", [False, True])
def test_a_hold_abandoned_while_it_waits_gives_false_at_once_and_takes_no_slot(background):
    gate = DecodeGate(1, background=background)
    lane = gate.lane or gate
    gone = threading.Event()
    got = {}

    def decode(name, paced):
        with gate.hold(paced, gone.is_set) as granted:
            got[name] = granted

    with contextlib.ExitStack() as busy:  # every slot is taken (the background lane's too)
        busy.enter_context(gate.hold(True))
        for _ in range(lane.slots if background else 0):
            busy.enter_context(lane.hold(False))
        threads = [threading.Thread(target=decode, args=(name, name == "paced")) for name in ("paced", "unpaced")]
        for t in threads:
            t.start()
        if background:
            waiting(gate, 1, 0)
            waiting(lane, 0, 1)
        else:
            waiting(gate, 1, 1)
        gone.set()
        gate.wake()
        for t in threads:
            t.join(timeout=60)
            assert not t.is_alive()  # it stopped waiting while the slots were still held
        assert got == {"paced": False, "unpaced": False}
        assert gate.free == 0 and lane.free == 0 and gate.waiting == [0, 0] and lane.waiting == [0, 0]
    assert gate.free == gate.slots and lane.free == lane.slots and gate.paced_holding == 0
    assert len(lane.unpaced_spans) == (lane.slots if background else 0)  # the abandoned hold ran none
    with gate.hold(False) as granted:  # the abandoned ones left nothing behind: a hold passes as before
        assert granted is True


def test_closing_a_session_whose_chunk_waits_at_the_gate_neither_waits_for_the_gate_nor_decodes_it(tmp_path):
    """A cancelled stream's gateway slot is free once its session closes; a chunk it had at the gate once kept it
    (and the stream's count in --max-streams) up to 3 s behind other streams' decodes on a loaded CPU, then decoded
    for nobody."""
    part = load_tiny_decoder(write_tiny_decoder(tmp_path / "t.pth", latent_channels=16))
    decoded = []
    decoder = LocalDecoder(Recording(part, decoded.append), gate_slots=1, background=False)
    gate = decoder.gates[0]
    x = torch.randn(1, 16, 1, 4, 4, generator=torch.Generator().manual_seed(0))
    session = decoder.open(2, paced=True)
    with gate.hold(True):  # another stream's decode holds the device
        assert session.submit(SimpleNamespace(index=0), x)
        waiting(gate, 1, 0)
        closing = threading.Thread(target=session.close)
        closing.start()
        closing.join(timeout=30)
        assert not closing.is_alive()  # closed with the gate still held: the worker did not wait for it
    closing.join()
    assert decoded == [] and gate.free == 1 and gate.waiting == [0, 0]


def test_a_cpu_part_gets_a_one_slot_gate_with_a_background_lane_by_default(tmp_path):
    """The gate is on for every device: on a CPU one paced decode at a time (it spreads over the cores itself), and
    unpaced ones in a lane of their own at the lowest CPU priority."""
    part = load_tiny_decoder(write_tiny_decoder(tmp_path / "t.pth", latent_channels=16))
    (gate,) = LocalDecoder(part).gates
    assert gate.slots == CPU_GATE_SLOTS == 1 and gate.background and gate.lane.slots == BACKGROUND_SLOTS == 2
    assert LocalDecoder(part, gate_slots=3).gates[0].slots == 3
    assert not LocalDecoder(part, background=False).gates[0].background
    assert LocalDecoder(part, gate_slots=0).gates == [None]
    gpu_like = SimpleNamespace(takes_latents=True, gives_video=True, device=torch.device("cuda", 0))
    (gpu_gate,) = LocalDecoder(gpu_like).gates  # a GPU part: the share, no lane (the OS does not run its kernels)
    assert gpu_gate.slots == 2 and not gpu_gate.background


def test_with_a_background_lane_unpaced_decodes_never_hold_a_paced_one_and_go_oldest_first():
    gate = DecodeGate(1, background=True)
    order = []

    def decode(name):
        with gate.hold(False):
            order.append(name)

    holds = [gate.hold(False) for _ in range(BACKGROUND_SLOTS)]
    for h in holds:  # unpaced decodes fill the lane: a paced one still passes at once
        h.__enter__()
    with gate.hold(True):
        assert gate.free == 0 and gate.lane.free == 0
    threads = [threading.Thread(target=decode, args=(f"unpaced-{i}",)) for i in range(3)]
    for i, t in enumerate(threads):
        t.start()
        waiting(gate.lane, 0, i + 1)  # they wait in the lane, one behind the other
    assert gate.waiting == [0, 0] and gate.free == 1
    holds[0].__exit__(None, None, None)  # one lane slot frees: the waiters pass through it, oldest first
    for t in threads:
        t.join()
    assert order == ["unpaced-0", "unpaced-1", "unpaced-2"] and gate.lane.free == 1
    for h in holds[1:]:
        h.__exit__(None, None, None)
    assert gate.lane.free == BACKGROUND_SLOTS and gate.free == 1


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="only Linux gives each thread its own priority")
def test_unpaced_decodes_on_a_cpu_run_at_the_lowest_priority_and_paced_ones_at_the_process_priority(tmp_path):
    part = load_tiny_decoder(write_tiny_decoder(tmp_path / "t.pth", latent_channels=16))
    seen = {}

    def nice(state):  # the CPU priority of the thread that decodes this stream's chunk
        seen[state.name] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    decoder = LocalDecoder(Recording(part, nice))
    x = torch.randn(1, 16, 1, 4, 4, generator=torch.Generator().manual_seed(0))
    unpaced, paced = decoder.open(2), decoder.open(2, paced=True)
    unpaced.states[0].name, paced.states[0].name = "unpaced", "paced"
    want = tiny_to_uint8_frames(part.decode_chunk(part.new_state(), x)).numpy()
    try:
        for s in (unpaced, paced):
            s.submit(SimpleNamespace(index=0), x)
            s.finish()
            (frames,) = [f for _t, f, _w in s.results()]
            assert np.array_equal(frames, want)  # exact either way
    finally:
        unpaced.close()
        paced.close()
    assert seen == {"unpaced": BACKGROUND_NICE, "paced": os.getpriority(os.PRIO_PROCESS, 0)}
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == os.getpriority(os.PRIO_PROCESS, 0)


class GatedJpeg:
    """A real JPEG encoder that records whose frame it encodes, in order."""

    def __init__(self, name, log):
        self.encoder = make_encoder("jpeg", width=16, height=16)
        self.name, self.log = name, log

    def encode(self, frame, keyframe=False):
        self.log.append(self.name)
        return self.encoder.encode(frame, keyframe=keyframe)


def emitter(pace: bool, gate, sent: list):
    cfg = SimpleNamespace(total_frames=None, pace=pace, fps=16.0, codec="jpeg", width=16, height=16, steps=2)
    metrics = GatewayMetrics(active=lambda: 0, vae_bytes=lambda: 0)
    trace = StreamTrace(cfg, "demo", "s", None)
    return FrameEmitter(
        cfg,
        metrics=metrics,
        trace=trace,
        now_ms=lambda: 0.0,
        send=lambda m: sent.append(m) or True,
        outcome=lambda: None,
        gate=gate,
    )


def test_a_waiting_paced_streams_frame_encodes_go_before_unpaced_ones_at_the_encode_gate():
    gate = DecodeGate(1)
    log, sent = [], []
    frames = np.zeros((2, 16, 16, 3), dtype=np.uint8)
    unpaced, paced = emitter(False, gate, sent), emitter(True, gate, sent)
    tag = ChunkTag(index=0, arrived_ms=0.0, steps=2, span=None)
    with gate.hold(False):  # the cores are busy with someone's encode
        first = threading.Thread(target=unpaced.emit, args=(tag, frames, GatedJpeg("unpaced", log), None))
        first.start()
        waiting(gate, 0, 1)
        second = threading.Thread(target=paced.emit, args=(tag, frames, GatedJpeg("paced", log), None))
        second.start()
        waiting(gate, 1, 1)
    first.join()
    second.join()
    assert log[0] == "paced" and sorted(log) == ["paced", "paced", "unpaced", "unpaced"]
    assert len(sent) == 4 and all(m.frame.data[:2] == b"\xff\xd8" for m in sent)  # JPEGs, all sent
    assert encode_gate().slots == max(1, min(64, os.cpu_count() or 1))


def test_paced_prompts_pass_the_encode_gate_at_once_and_unpaced_ones_wait_until_no_paced_one_runs():
    gate = DecodeGate(1)
    order = []

    def unpaced():
        with gate.yielding(False):
            order.append("unpaced")

    with gate.hold(False):  # every slot is taken: a paced prompt still passes (it may join a batched forward)
        with gate.yielding(True):
            order.append("paced")
    later = threading.Thread(target=unpaced)
    with gate.yielding(True):  # a paced prompt runs: an unpaced one waits for it, though a slot is free
        later.start()
        waiting(gate, 0, 1)
        assert order == ["paced"] and gate.free == 1
    later.join()
    assert order == ["paced", "unpaced"] and gate.paced_running == 0 and gate.free == 1


class FakeClock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def _ticket(gate) -> int:
    """An unpaced waiter's place at the head of the queue, for asking ``_unpaced_may_start`` directly."""
    ticket = next(gate._tickets)
    gate.unpaced_queue.append(ticket)
    return ticket


def test_between_a_paced_streams_decodes_unpaced_work_takes_at_most_its_share_of_the_gate():
    clock = FakeClock()
    gate = DecodeGate(1, share=0.25, window_s=1.0, clock=clock)
    queued = [False]
    key = gate.watch(lambda: queued[0])
    with gate.hold(False):  # an unpaced decode of 0.2 s, no paced work anywhere
        clock.t += 0.2
    assert gate.unpaced_cost_s == pytest.approx(0.2)
    ticket = _ticket(gate)
    # No paced work pending: a free slot is the unpaced stream's.
    assert gate._unpaced_may_start(ticket) == (True, None)
    # A paced session has its next latents queued (between two of its decodes): 0.2 s taken + 0.2 s more would pass
    # 25% of the last second, so the unpaced hold waits, and says for how long at most.
    queued[0] = True
    ok, retry = gate._unpaced_may_start(ticket)
    assert not ok and retry == pytest.approx(0.15)
    clock.t += 0.1
    assert not gate._unpaced_may_start(ticket)[0]
    # Once the earlier decode slides out of the window, best-effort work moves again, paced work still queued.
    clock.t += 0.86
    assert gate.unpaced_busy_s(clock()) == pytest.approx(0.04) and gate._unpaced_may_start(ticket)[0]
    clock.t += 0.1
    assert gate._unpaced_may_start(ticket) == (True, None)
    # A paced hold waiting or running always goes first.
    with gate.hold(True):
        assert gate.paced_pending() and not gate._unpaced_may_start(ticket)[0]  # and no slot is free anyway
    gate.unwatch(key)
    gate.unpaced_queue.remove(ticket)
    assert not gate.paced_pending()


def test_unpaced_holds_take_the_gate_oldest_first():
    gate = DecodeGate(1)
    order = []

    def decode(name):
        with gate.hold(False):
            order.append(name)

    threads = []
    with gate.hold(True):
        for i in range(4):
            threads.append(threading.Thread(target=decode, args=(f"unpaced-{i}",)))
            threads[-1].start()
            waiting(gate, 0, i + 1)
    for t in threads:
        t.join()
    assert order == [f"unpaced-{i}" for i in range(4)]
    with pytest.raises(ValueError, match="share must be in"):
        DecodeGate(1, share=0)


def test_a_paced_session_with_latents_queued_keeps_an_unpaced_decode_waiting_until_its_budget_allows(tmp_path):
    # The CPU host (issue 50): between two of a paced stream's decodes, its next latents already queued, the free slot
    # went to a waiting unpaced decode, so every paced chunk waited behind one (a 1 s stream took 1.87x its time
    # alone beside 8 unpaced streams).
    part = load_tiny_decoder(write_tiny_decoder(tmp_path / "t.pth", latent_channels=16))
    log = []
    clock = FakeClock()
    decoder = LocalDecoder(
        Recording(part, lambda s: log.append(s.name)), gate_slots=1, background=False
    )  # the GPU's gate, on a CPU part
    gate = decoder.gates[0]
    gate.clock = clock
    gate.unpaced_spans.append([clock.t - 0.2, clock.t])  # best-effort decodes took 0.2 of the last second
    gate.unpaced_cost_s = 0.2
    x = torch.randn(1, 16, 1, 4, 4, generator=torch.Generator().manual_seed(0))
    unpaced, paced = decoder.open(2), decoder.open(4, paced=True)
    unpaced.states[0].name, paced.states[0].name = "unpaced", "paced"
    try:
        with gate.hold(True):  # a paced decode runs; its stream's next two chunks are queued
            for i in range(2):
                paced.submit(SimpleNamespace(index=i), x)
            unpaced.submit(SimpleNamespace(index=0), x)
            with gate.cond:
                assert gate.cond.wait_for(lambda: gate.waiting[0] == 1 and gate.waiting[1] == 1, timeout=60)
        # Every queued paced chunk decodes before the unpaced one: its budget is spent while paced work is pending.
        paced.finish()
        assert [t.index for t, _f, _w in paced.results()] == [0, 1]
        # The paced session's work is done (its worker left the gate): the unpaced decode goes at once.
        unpaced.finish()
        (frames,) = [f for _t, f, _w in unpaced.results()]
        assert np.array_equal(frames, tiny_to_uint8_frames(part.decode_chunk(part.new_state(), x)).numpy())
        assert log == ["paced", "paced", "unpaced"] and not gate.probes
    finally:
        unpaced.close()
        paced.close()
