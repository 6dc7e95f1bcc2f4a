"""Each decoder kind priced by what runs: the costs the gateway reports (VaeCost.decoder, batch_ms, state_bytes),
re-sent when they move; the decoder each stream opens with; admission by decoder memory."""

import threading
from types import SimpleNamespace

import grpc
import pytest
import torch

from gateway.decode.batched_decoder import BatchedDecoder
from gateway.decode.tiny_decoder import load_tiny_decoder
from gateway.decode.vae_cost import VaeCost, VaeReporter, measure_vae, tiny_cost
from gateway.edge.admission import GIB, Admission, DecoderMemory, Refused
from gateway.edge.config import resolve_config
from gateway.stream.run import StreamRun
from launcher.demo_checkpoint import write_tiny_decoder
from stagecast.client import stream_config
from tests.gateway_helpers import resolve, stub_stream_host

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return write_tiny_decoder(tmp_path_factory.mktemp("costs") / "taew.pth", latent_channels=16, seed=4)


class Capture:
    """A coordinator stub that keeps every VaeCost it is sent."""

    def __init__(self, fail_first: int = 0):
        self.sent = []
        self.fail_first = fail_first
        self.got = threading.Semaphore(0)

    def ReportVaeCost(self, msg, timeout=None):  # noqa: N802 - the stub's name
        if self.fail_first:
            self.fail_first -= 1
            raise Unreachable()
        self.sent.append(msg)
        self.got.release()


class Unreachable(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE


def full(ms=20.0):
    return VaeCost(ms, (ms,), "cuda:0", (1, 16, 1, 60, 104), state_bytes=1800)


def tiny(batch):
    return VaeCost(batch[0], (batch[0],), "cuda:0", (1, 16, 1, 60, 104), "tiny", tuple(batch), 64)


def test_each_cost_goes_out_with_its_decoder_its_batches_and_its_state():
    msg = tiny([4.0, 2.5, 2.0]).to_proto()
    assert (msg.decoder, list(msg.batch_ms), msg.state_bytes, msg.chunk_ms) == ("tiny", [4.0, 2.5, 2.0], 64, 4.0)
    msg = full().to_proto()
    assert (msg.decoder, list(msg.batch_ms), msg.state_bytes) == ("full", [], 1800)


def test_the_reporter_resends_a_cost_that_moved_materially_and_all_of_them_when_due():
    now = [0.0]
    current = [full(), tiny([4.0, 2.5])]
    stub = Capture()
    reporter = VaeReporter(stub, lambda: list(current), every_s=30.0, clock=lambda: now[0])
    assert reporter.send_due() == 2
    assert [m.decoder for m in stub.sent] == ["full", "tiny"]
    now[0] = 5.0
    current[1] = tiny([4.1, 2.6])  # within 10 %: not material
    assert reporter.send_due() == 0
    current[1] = tiny([4.1, 1.5])  # the 2-stream batch got 40 % cheaper
    assert reporter.send_due() == 1
    assert stub.sent[-1].decoder == "tiny" and list(stub.sent[-1].batch_ms) == [4.1, 1.5]
    current[1] = tiny([4.1, 1.5, 1.2])  # a batch size seen for the first time
    assert reporter.send_due() == 1
    now[0] = 31.0  # the full VAE's last report is 31 s old; the tiny one's 26 s
    assert [m.decoder for m in stub.sent[-1:]] == ["tiny"]
    assert reporter.send_due() == 1 and stub.sent[-1].decoder == "full"


def test_the_reporter_thread_retries_an_unreachable_coordinator_and_skips_unknown_costs():
    stub = Capture(fail_first=1)
    reporter = VaeReporter(stub, lambda: [None, tiny([3.0])], every_s=30.0, check_every_s=0.01)
    reporter.start()
    try:
        assert reporter.reported.wait(30)
    finally:
        reporter.stop()
    assert [m.decoder for m in stub.sent] == ["tiny"]


def test_a_single_cost_is_still_accepted_as_before():
    stub = Capture()
    reporter = VaeReporter(stub, full(12.5))
    assert reporter.send_due() == 1 and stub.sent[0].chunk_ms == 12.5


def test_measured_costs_carry_one_streams_state(tiny_path):
    part = load_tiny_decoder(tiny_path)
    cost = measure_vae([part], (1, 16, 1, 4, 6), chunks=3)
    assert cost.decoder == "full"  # measure_vae is the full VAE's measurement; the part here only stands in
    assert cost.state_bytes == part.model.state_bytes((4, 6), 4) > 0
    decoder = BatchedDecoder(load_tiny_decoder(tiny_path), max_batch=2)
    try:
        assert tiny_cost(decoder, (1, 16, 1, 4, 6)) is None  # nothing measured or served yet
        decoder.warm((1, 16, 1, 4, 6), chunks=3)
        got = tiny_cost(decoder, (1, 16, 1, 4, 6))
    finally:
        decoder.close()
    assert got.decoder == "tiny" and len(got.batch_ms) == 2 and got.chunk_ms == got.batch_ms[0] > 0
    assert got.state_bytes == cost.state_bytes


def test_every_stream_opens_its_pipeline_naming_its_decoder():
    requests = []

    class Coordinator:
        def OpenStream(self, request, timeout=None, **kw):  # noqa: N802
            requests.append(request)
            raise RuntimeError("captured")

    host = stub_stream_host(Coordinator())
    for kind in ("tiny", "full"):
        run = StreamRun(host, resolve(decoder=kind), torch.zeros(1, 32, 8), None, 0.0)
        with pytest.raises(RuntimeError, match="captured"):
            run.open_pipeline()
        assert requests[-1].decoder == kind


def cfg(decoder, width=64, height=48):
    return SimpleNamespace(decoder=decoder, width=width, height=height)


def test_decoder_memory_admits_up_to_its_budget_per_decoder_and_gives_back():
    memory = DecoderMemory.derive(
        "cuda:0", {"full": 2 * GIB, "tiny": GIB // 16}, (48, 64), free_bytes=lambda: (20 * GIB, 100 * GIB)
    )
    assert memory.budget == 10 * GIB  # 20 free less the larger reserve: 10 % of the device
    fulls = [memory.check(cfg("full")) for _ in range(5)]
    with pytest.raises(Refused) as refused:
        memory.check(cfg("full"))
    assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "full decoder holds 2.00 GiB" in refused.value.message and "10.00 GiB" in refused.value.message
    assert "--decoder-memory-gib" in refused.value.message
    fulls.pop()()  # a full stream ends: 2 GiB free again, room for 32 tiny streams
    tinies = [memory.check(cfg("tiny")) for _ in range(32)]
    with pytest.raises(Refused, match="tiny decoder holds 0.06 GiB"):
        memory.check(cfg("tiny"))
    for release in tinies + fulls:
        release()
    assert memory.held == 0
    # A larger frame holds more: the state scales with the frame's pixels.
    assert memory.need(cfg("full", 128, 96)) == 8 * GIB


def test_decoder_memory_is_unbounded_on_a_cpu_settable_and_bounded_itself():
    cpu = DecoderMemory.derive("cpu", {"full": GIB}, (48, 64))
    assert cpu.budget is None
    for _ in range(100):
        cpu.check(cfg("full"))
    assert DecoderMemory.derive("cuda:0", {"full": GIB}, (48, 64), budget_gib=3).budget == 3 * GIB
    assert cpu.check(cfg("remote")) is None  # a decoder holding nothing here takes nothing
    with pytest.raises(ValueError, match="--decoder-memory-gib must be in"):
        DecoderMemory.derive("cuda:0", {"full": GIB}, (48, 64), budget_gib=-1)
    with pytest.raises(ValueError, match="'tiny' must be >= 0"):
        DecoderMemory.derive("cuda:0", {"tiny": -1}, (48, 64), budget_gib=1)


def test_a_memory_refusal_in_the_chain_gives_back_what_earlier_checks_took():
    memory = DecoderMemory.derive("cuda:0", {"full": GIB}, (48, 64), budget_gib=1)
    taken = []

    def slot(cfg):
        taken.append(1)
        return taken.pop

    admission = Admission([slot, memory.check])
    release = admission.admit(cfg("full"))
    with pytest.raises(Refused):
        admission.admit(cfg("full"))
    assert len(taken) == 1  # the refused stream's slot was given back
    release()
    assert taken == [] and memory.held == 0


def test_the_gateway_serves_tiny_streams_on_the_batched_decoder_and_admits_by_decoder_memory(tmp_path):
    from gateway import service
    from launcher.demo_checkpoint import write_demo_checkpoint

    root = write_demo_checkpoint(tmp_path / "ckpt", tiny_decoder=True)
    base = dict(coordinator="127.0.0.1:1", checkpoint=str(root), port=0, pipeline_warmup_s=0, default_decoder="tiny")
    # Each kind's state per pixel, from a gateway without a bound (a CPU's), then a bound that holds one stream of the
    # default (tiny) decoder at the serving size and a half, but no full one.
    probe = service.Gateway(service.GatewayOptions(**base))
    try:
        per_pixel = dict(probe.table.decoder_memory.per_pixel)
    finally:
        probe.stop(grace=0)
    serving = probe.defaults.width * probe.defaults.height
    assert per_pixel["full"] > 1.5 * per_pixel["tiny"] > 0
    opts = service.GatewayOptions(**base, decoder_memory_gib=1.5 * per_pixel["tiny"] * serving / GIB)
    gw = service.Gateway(opts)
    try:
        assert isinstance(gw.models.tiny_decoder, BatchedDecoder)
        # A CPU measures its full VAE, the frames' encode included (coordinator/slo.py, "A CPU host"); the tiny
        # decoder is measured only on a GPU.
        (full,) = gw.models.decoder_costs()
        assert gw.vae_reporter is not None and full.device == "cpu" and full.chunk_ms > full.encode_ms > 0
        memory = gw.table.decoder_memory
        assert memory.per_pixel["full"] > memory.per_pixel["tiny"] > 0
        full_cfg = resolve_config(
            stream_config("a cat", decoder="full"), defaults=gw.defaults, model=gw.model, decoders=gw.models.decoders
        )
        with pytest.raises(Refused, match="decoder memory: .* on the full decoder holds"):
            gw.table.admit(full_cfg, "client")
        assert gw.table.admitted == 0  # the count cap's slot was given back
    finally:
        gw.stop(grace=0)
