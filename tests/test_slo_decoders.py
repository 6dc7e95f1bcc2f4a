"""The SLO model prices each stream by the decoder it runs on: the full Wan VAE, or the tiny decoder, which may decode
several streams' chunks in one call (its per-stream cost falls as its streams grow)."""

import grpc
import pytest
import torch

from coordinator.errors import AdmissionError
from coordinator.slo import CostModel, DecoderCost, Demand, SloController, VaeReport
from tests.engine_helpers import engine_options, hand_driven_engine, stream_opener

pytestmark = pytest.mark.unit

RATE = 4.0  # 16 fps, 4 frames per chunk
LADDERS = [(1000.0,), (1000.0, 500.0)]
# Two stages seeded at 40 ms a batch of one: 40 x 1.15 / 4 = 11.5 ms per micro-step at the largest batch, so a stream at
# 1 step takes 4 x 11.5 = 4.6% of the slowest stage for the DiT.
STAGE_MS = 40.0
DIT = 4 * 11.5 / 1000


def _engine(vae_ms=None):
    # slo_learn: the gateway's reports count (no batch is ever measured here, so the seeds stay as they are).  Off the
    # pace grid: the arithmetic prices the average batch (tests/test_slo_grid.py: the grid's).
    eng = hand_driven_engine(
        lookahead=10**6,
        stage_ms=[STAGE_MS, STAGE_MS],
        clock=lambda: 0.0,
        vae_ms_per_chunk=vae_ms,
        pace_grid=False,
    )
    return eng, stream_opener(eng, chunk_rate=RATE, ladders=LADDERS, running=True)  # priced at their steady rate


def _open_until_refused(open_stream, limit=40, **kw) -> int:
    for n in range(limit):
        try:
            open_stream(**kw)
        except AdmissionError as exc:
            assert exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "over capacity" in exc.message
            return n
    raise AssertionError(f"{limit} streams admitted")


def test_a_set_of_tiny_decoder_streams_is_admitted_where_the_same_set_on_the_full_vae_is_refused():
    # Full VAE 30 ms a chunk: 4.6% + 12% = 16.6% a stream, 5 fit (83%) and the 6th is refused (99.6%).  Tiny decoder
    # 6 ms a chunk: 4.6% + 2.4% = 7% a stream, 12 fit (84%).
    full_eng, open_full = _engine()
    full_eng.report_vae(VaeReport("full", 30.0))
    full_eng.report_vae(VaeReport("tiny", 6.0))
    assert _open_until_refused(open_full) == 5
    tiny_eng, open_tiny = _engine()
    tiny_eng.report_vae(VaeReport("full", 30.0))
    tiny_eng.report_vae(VaeReport("tiny", 6.0))
    assert _open_until_refused(open_tiny, decoder="tiny") == 12
    # The same six streams: held on the tiny decoder, not on the full VAE.
    ctl = tiny_eng.slo.controller
    six = [Demand(i, RATE, (1,), decoder="tiny") for i in range(6)]
    assert ctl.utilization(six) == pytest.approx(6 * (DIT + 4 * 6.0 / 1000))
    assert ctl.utilization(six) <= 0.9 < ctl.utilization([Demand(i, RATE, (1,)) for i in range(6)])
    # A mix is priced stream by stream: 5 full streams (83%) leave room for one tiny one (7%) but not a full one.
    mix = [Demand(i, RATE, (1,)) for i in range(5)]
    assert ctl.admits(Demand(9, RATE, (1,), decoder="tiny"), mix) and not ctl.admits(Demand(9, RATE, (1,)), mix)


def test_a_tiny_stream_is_never_priced_at_the_full_vaes_cost():
    cost = CostModel(stages=1, max_batch=1, seed_ms=[10.0])
    ctl = SloController(cost)
    assert cost.report_vae(VaeReport("full", 64.0)) and cost.vae_source == "gateway"
    tiny = [Demand(1, RATE, (1,), decoder="tiny")]
    # Not reported yet: the tiny decoder costs nothing in the model (0 until reported), never the full VAE's 64 ms.
    assert cost.decoders["tiny"] == DecoderCost() and ctl.utilization(tiny) == pytest.approx(RATE * 10.0 / 1000)
    assert ctl.utilization([Demand(1, RATE, (1,))]) == pytest.approx(RATE * (10.0 + 64.0) / 1000)
    assert cost.report_vae(VaeReport("tiny", 5.0))
    assert ctl.utilization(tiny) == pytest.approx(RATE * 15.0 / 1000)
    # The operator's --vae-ms-per-chunk as a plain number is the full VAE's: it does not price the tiny decoder.
    operator = SloController(CostModel(stages=1, max_batch=1, seed_ms=[10.0], chunk_ms=64.0))
    assert operator.utilization(tiny) == pytest.approx(RATE * 10.0 / 1000)
    assert not operator.cost.report_vae(VaeReport("full", 5.0))
    assert operator.cost.chunk_ms == 64.0  # the operator's is kept
    assert operator.cost.report_vae(VaeReport("tiny", 5.0))
    assert operator.utilization(tiny) == pytest.approx(RATE * 15.0 / 1000)
    # Capacity for a kind counts that kind's cost.
    assert operator.capacity_streams([], RATE, 1, decoder="tiny") == pytest.approx(0.9 / (RATE * 15.0 / 1000))
    assert operator.capacity_streams([], RATE, 1) == pytest.approx(0.9 / (RATE * 74.0 / 1000))


def test_a_batching_decoder_is_priced_at_the_batch_its_calls_form():
    cost = CostModel(stages=1, max_batch=1, seed_ms=[10.0])
    batch = [6.0, 4.0, 3.0, 2.5]
    # No call served yet: every stream is priced as decoding alone, however many there are.
    cost.report_vae(VaeReport("tiny", 6.0, batch_ms=batch))
    assert [cost.decoders["tiny"].per_stream_ms(n) for n in range(1, 6)] == [6.0] * 5
    # Calls holding 2.5 streams on average: at most that batch, interpolated between 2 and 3 streams a call.
    assert cost.report_vae(VaeReport("tiny", 6.0, batch_ms=batch, formed_batch=2.5))
    assert [cost.decoders["tiny"].per_stream_ms(n) for n in range(1, 6)] == [6.0, 4.0, 3.5, 3.5, 3.5]
    with pytest.raises(ValueError, match="formed_batch"):
        cost.report_vae(VaeReport("tiny", 6.0, batch_ms=batch, formed_batch=float("inf")))
    # Every stream's chunks in one call: the per-stream cost falls with the streams.
    assert cost.report_vae(VaeReport("tiny", 6.0, batch_ms=batch, formed_batch=8.0))
    tiny = cost.decoders["tiny"]
    per = [tiny.per_stream_ms(n) for n in range(1, 8)]
    assert per == [6.0, 4.0, 3.0, 2.5, 2.5, 2.5, 2.5]  # beyond the largest measured batch: its per-stream cost
    # The decode a set costs: each stream's rate x the per-stream ms at the number of the kind's paced streams.
    for n in range(1, 8):
        streams = [Demand(i, RATE, (1,), decoder="tiny") for i in range(n)]
        assert cost.decode_ms(streams) == pytest.approx(n * RATE * per[n - 1])
    # Unpaced streams and streams on another decoder do not join the batch.
    mixed = [Demand(1, RATE, (1,), decoder="tiny"), Demand(2, 0.0, (1,), decoder="tiny"), Demand(3, RATE, (1,))]
    assert cost.decode_ms(mixed) == pytest.approx(RATE * 6.0)
    # So each stream's share falls as the batch grows, and capacity beats a decoder priced at batch 1.
    ctl = SloController(cost)
    share = [ctl.utilization([Demand(i, RATE, (1,), decoder="tiny") for i in range(n)]) / n for n in range(1, 6)]
    assert share[0] > share[1] > share[2] > share[3] == pytest.approx(share[4])
    batched = ctl.capacity_streams([], RATE, 1, decoder="tiny")
    alone = SloController(CostModel(stages=1, max_batch=1, seed_ms=[10.0], chunk_ms={"tiny": 6.0}))
    assert alone.capacity_streams([], RATE, 1, decoder="tiny") == pytest.approx(0.9 / (RATE * 16.0 / 1000))
    assert batched == pytest.approx(0.9 / (RATE * 12.5 / 1000))  # beyond 4 streams every one costs 10 + 2.5 ms
    # Reports are bounded, naming the field.
    with pytest.raises(ValueError, match=r"batch_ms\[1\]"):
        cost.report_vae(VaeReport("tiny", 6.0, batch_ms=[6.0, float("nan")]))
    with pytest.raises(ValueError, match="decoder"):
        cost.report_vae(VaeReport("huge", 6.0))
    with pytest.raises(ValueError, match="state_bytes"):
        cost.report_vae(VaeReport("tiny", 6.0, state_bytes=-1))
    with pytest.raises(ValueError, match="batch_ms: at most"):
        cost.report_vae(VaeReport("tiny", 6.0, batch_ms=[1.0] * 1000))
    assert cost.decoders["tiny"].batch_ms == (6.0, 4.0, 3.0, 2.5)  # a refused report changed nothing


def test_a_report_while_serving_changes_admission_and_steps():
    eng, open_stream = _engine()
    eng.report_vae(VaeReport("tiny", 6.0))
    streams = [open_stream(decoder="tiny") for _ in range(6)]  # 6 x (4.6% + 2.4%) at 1 step: 42%
    eng.planner.tick()
    assert [eng.steps(s.id) for s in streams] == [
        2,
        2,
        2,
        2,
        2,
        2,
    ]  # 6 x (9.2% + 2.4%) = 70%, under the raise threshold
    status = eng.status()
    tiny = next(d for d in status.decoders if d.decoder == "tiny")
    assert (tiny.chunk_ms, tiny.source, list(tiny.batch_ms)) == (6.0, "gateway", [])
    before = {c.steps: c.streams for c in tiny.capacity}
    assert eng.slo.controller.admits(Demand(99, RATE, (1,), decoder="tiny"), eng.slo.demands())  # 7 x 7% = 49%
    # The gateway measures again at the batches it forms (it is slower there than alone): 24 ms a chunk per stream
    # at 6 streams and beyond.
    batch = [6.0, 12.0, 16.0, 20.0, 22.0, 24.0]
    assert eng.report_vae(VaeReport("tiny", 6.0, batch_ms=batch, state_bytes=64 << 20, formed_batch=6.0))
    assert not eng.report_vae(VaeReport("tiny", 6.0, batch_ms=batch, state_bytes=64 << 20, formed_batch=6.0))
    # Decided again at once: 6 x (9.2% + 9.6%) = 113% at 2 steps is over the target; steps fall towards the raise
    # threshold (80%), which even all at 1 step (6 x 14.2% = 85.2%) does not reach: every stream at its min_steps.
    events = eng.planner.tick()
    assert [e.WhichOneof("event") for e in events].count("steps") == 6
    assert sorted(eng.steps(s.id) for s in streams) == [1, 1, 1, 1, 1, 1]
    with pytest.raises(AdmissionError) as info:
        open_stream(decoder="tiny")  # 7 x (4.6% + 9.6%) = 99% at 1 step
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    tiny = next(d for d in eng.status().decoders if d.decoder == "tiny")
    assert list(tiny.batch_ms) == batch and tiny.state_bytes == 64 << 20 and tiny.formed_batch == 6.0
    assert {c.steps: c.streams for c in tiny.capacity}[1] < before[1]
    # The full VAE's numbers and the compatible fields are untouched.
    status = eng.status()
    assert (status.vae_chunk_ms, status.vae_source) == (0.0, "none")
    assert [c.decoder for c in status.capacity] == ["full"] * 4


def test_the_operators_cost_per_kind_is_kept_and_slo_fixed_fixes_every_kind():
    eng, _ = _engine(vae_ms={"full": 26.0, "tiny": 5.0})
    assert not eng.report_vae(VaeReport("tiny", 7.0)) and eng.slo.cost.decoders["tiny"].chunk_ms == 5.0
    from coordinator.engine import PipelineEngine
    from coordinator.registry import StageRegistry

    fixed = PipelineEngine(StageRegistry(2), engine_options(2, stage_ms=[10.0, 10.0], slo_learn=False))
    assert {k: (c.chunk_ms, c.source) for k, c in fixed.slo.cost.decoders.items()} == {
        "full": (0.0, "operator"),
        "tiny": (0.0, "operator"),
    }
    assert not fixed.report_vae(VaeReport("tiny", 7.0))


class _Aborted(Exception):
    pass


class _Context:
    def abort(self, code, message):
        self.code, self.message = code, message
        raise _Aborted

    def add_callback(self, fn):
        return True


def test_an_unknown_decoder_is_refused_naming_decoder():
    from coordinator.server import CoordinatorServicer
    from stagecast import wire
    from stagecast.internal.v1 import pipeline_pb2 as pb
    from stagecast.microstep import StreamSpec

    eng, _ = _engine()
    servicer = CoordinatorServicer(eng.registry, eng)
    spec = StreamSpec(
        stream_id=0, latent_channels=16, chunk_frames=1, latent_height=4, latent_width=6, text_len=8, timesteps=(1.0,)
    )
    request = pb.OpenStreamRequest(
        spec=wire.spec_to_proto(spec), text=wire.tensor_to_proto(torch.zeros(1, 8, 16)), decoder="x" * 10_000
    )
    context = _Context()
    with pytest.raises(_Aborted):
        next(servicer._open_stream(request, context, None))
    assert context.code == grpc.StatusCode.INVALID_ARGUMENT and context.message.startswith("decoder:")
    assert len(context.message) < 200  # the echoed name is bounded
    assert not eng.sessions
    # A gateway's report of an unknown kind, or a bad batch cost, is refused the same way.
    for report, field in [
        (pb.VaeCost(chunk_ms=5.0, decoder="huge"), "decoder:"),
        (pb.VaeCost(chunk_ms=5.0, decoder="tiny", batch_ms=[5.0, -1.0]), "batch_ms[1]:"),
        (pb.VaeCost(chunk_ms=5.0, decoder="tiny", state_bytes=-5), "state_bytes:"),
    ]:
        context = _Context()
        with pytest.raises(_Aborted):
            servicer.ReportVaeCost(report, context)
        assert context.code == grpc.StatusCode.INVALID_ARGUMENT and context.message.startswith(field)
    servicer.ReportVaeCost(pb.VaeCost(chunk_ms=5.0, decoder="tiny", batch_ms=[5.0, 4.0]), _Context())
    assert eng.slo.cost.decoders["tiny"].batch_ms == (5.0, 4.0)
