"""Paced-first decode for the full VAE's per-stream sessions: the decode gate of each part (gateway.decoder)."""

import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from gateway.decoder import DecodeGate, LocalDecoder
from gateway.tiny_decoder import load_tiny_decoder, tiny_to_uint8_frames
from launcher.demo_checkpoint import write_tiny_decoder

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
    """A part that records which stream's chunk it decodes, in order."""

    def __init__(self, part, log):
        self.part, self.log = part, log

    def __getattr__(self, name):
        return getattr(self.part, name)

    def decode_chunk(self, state, x):
        self.log.append(state.name)
        return self.part.decode_chunk(state, x)


def test_local_sessions_decode_the_paced_streams_chunk_first_and_stay_exact(tmp_path):
    part = load_tiny_decoder(write_tiny_decoder(tmp_path / "t.pth", latent_channels=16))
    log = []
    decoder = LocalDecoder(Recording(part, log), gate_slots=1)
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


def test_a_cpu_part_gets_no_gate_by_default(tmp_path):
    part = load_tiny_decoder(write_tiny_decoder(tmp_path / "t.pth", latent_channels=16))
    assert LocalDecoder(part).gates == [None]
    assert LocalDecoder(part, gate_slots=3).gates[0].slots == 3
