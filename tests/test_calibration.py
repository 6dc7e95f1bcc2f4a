"""The SLO model's seeds, in process: a stage's calibration of its slice (``stage_service.calibration``), the gateway's
VAE measurement (``gateway.decode.vae_cost``) and how ``CostModel`` takes them (operator flags first, measured batches
refine).  Timing-dependent behaviour runs on an injected timer and clock, never on sleeps."""

from __future__ import annotations

import json

import pytest
import torch

from coordinator.slo import EWMA, CostModel, Demand, SloController, VaeReport
from gateway.decode.vae_cost import STEADY_FROM, measure_vae
from stage_service.calibration import (
    PASSES,
    RECHECKS,
    ServingShape,
    calibrate,
    implausible,
    plausible_bound,
    serving_shape,
)
from stage_service.checkpoint import random_slice_state_dict
from stage_service.dit_slice import DiTSlice
from stage_service.runner import SliceRunner
from stagecast.microstep import MicroStep, StreamSpec
from stagecast.model.config import checkpoint_config, checkpoint_folder, read_config
from stagecast.model.dit_configs import model_config

pytestmark = pytest.mark.unit

CFG = model_config("tiny-wan2.1")
SHAPE = ServingShape(chunk_frames=1, latent_height=4, latent_width=6, text_len=16)


def make_slice(first: bool, last: bool) -> DiTSlice:
    n = CFG["num_layers"]
    layers = range(0 if first else n // 2, n if last else n // 2)
    torch.manual_seed(1)
    sd = random_slice_state_dict(CFG, layers=layers, first=first, last=last, dtype=torch.float32)
    return DiTSlice.from_state_dict(CFG, sd, layers=layers, first=first, last=last)


def fake_timer(runner_calls: list):
    """A timer whose ms tell which forward it timed: 10 x batch size, +5 with a full window."""

    def timer(fn):
        before = len(runner_calls)
        fn()
        steps, context = runner_calls[before]
        return 10.0 * len(steps) + (5.0 if context else 0.0)

    return timer


def recording_forward(calls: list):
    def forward(runner, steps, inputs):
        stream = runner.streams[steps[0].stream]
        frames = stream.kv[0].view(steps[0], stream.spec_at(steps[0].chunk)).frames
        calls.append((steps, len(frames)))
        return runner.forward(steps, inputs)

    return forward


@pytest.mark.parametrize("first,last", [(True, False), (False, True), (True, True)])
def test_calibration_times_each_batch_size_with_an_empty_and_a_full_window(first, last):
    calls: list = []
    sl = make_slice(first, last)
    cal = calibrate(
        sl, 3, SHAPE, window=4, sink=2, budget_s=600, timer=fake_timer(calls), forward=recording_forward(calls)
    )
    assert not cal.error
    assert cal.empty_ms == [10.0, 20.0, 30.0] and cal.full_ms == [15.0, 25.0, 35.0]
    # Every batch size: twin forwards (untimed, timed) with no context, then twins that see the whole window; every
    # size again in a second pass.
    assert PASSES == 2
    assert [(len(s), ctx) for s, ctx in calls] == [(b, c) for _ in range(2) for b in (1, 2, 3) for c in (0, 0, 4, 4)]
    proto = cal.to_proto()
    assert (
        list(proto.full_ms) == cal.full_ms and proto.window == 4 and (proto.latent_height, proto.latent_width) == (4, 6)
    )


def test_calibration_leaves_serving_state_and_random_generators_alone():
    sl = make_slice(True, True)
    spec = StreamSpec(
        stream_id=1, latent_channels=16, chunk_frames=1, latent_height=4, latent_width=6, timesteps=(1000.0, 500.0),
        text_len=16, window=4, sink=1,
    )  # fmt: skip
    text = torch.randn(1, 16, CFG["text_dim"], generator=torch.Generator().manual_seed(3))

    def serve_two_chunks(runner: SliceRunner) -> list[torch.Tensor]:
        out = []
        for chunk in range(2):
            for level in range(2):
                step = MicroStep(1, chunk, level)
                out.append(runner.forward([step]))
                runner.finish([step], out[-1])
        return out

    serving = SliceRunner(sl)
    serving.open_stream(spec, text)
    first = serve_two_chunks(serving)
    kv_before = serving.memory_bytes()
    cpu_rng = torch.get_rng_state()
    cal = calibrate(sl, 4, SHAPE, budget_s=600)
    assert not cal.error and len(cal.full_ms) == 4
    assert torch.equal(torch.get_rng_state(), cpu_rng)
    assert serving.memory_bytes() == kv_before and list(serving.streams) == [1]
    # The same slice serves exactly as before: a fresh runner reproduces the first run bit for bit.
    again = SliceRunner(sl)
    again.open_stream(spec, text)
    assert all(torch.equal(a, b) for a, b in zip(first, serve_two_chunks(again), strict=True))


def test_calibration_stops_at_its_budget_and_keeps_the_batch_sizes_it_finished():
    now = [0.0]

    def clock():  # one second per look: the budget check before every forward
        now[0] += 1.0
        return now[0]

    cal = calibrate(make_slice(True, False), 4, SHAPE, budget_s=6.5, clock=clock, timer=lambda fn: (fn(), 1.0)[1])
    assert "budget of 6.5s" in cal.error and "batch size 2" in cal.error
    assert cal.empty_ms == [1.0] and cal.full_ms == [1.0]  # batch size 1 finished; 2 did not


@pytest.mark.parametrize(
    ("ms", "flagged"),
    [
        ([26.14, 85.68, 61.31, 76.88], [2]),  # one H200, 1.3B beside the gateway's start-up: 2 over 3 and 4
        ([28.28, 47.88, 105.87, 89.60], [3]),  # over 4, and a row that cost more than a lone forward
        ([21.87, 37.92, 54.83, 143.82], [4]),  # the largest size: only the row rule sees it
        ([74.02, 131.18, 186.93, 120.45], [2, 3]),  # 5B: two sizes over the largest
        ([22.51, 37.99, 53.81, 73.78], []),  # a clean one
        ([15.0, 25.0, 35.0], []),
        ([20.0, 19.5, 40.0], []),  # within the timing noise
    ],
)
def test_a_size_is_implausible_when_it_times_over_a_larger_one_or_a_row_over_a_lone_forward(ms, flagged):
    assert implausible(ms) == flagged


def waiting_timer(runner_calls: list, waits: dict[int, int]):
    """``fake_timer`` whose first ``waits[b]`` full-window timings of batch size b waited 50 ms on other work."""
    plain = fake_timer(runner_calls)

    def timer(fn):
        before = len(runner_calls)
        ms = plain(fn)
        steps, context = runner_calls[before]
        if context and waits.get(len(steps), 0) > 0:
            waits[len(steps)] -= 1
            ms += 50.0
        return ms

    return timer


@pytest.mark.parametrize(
    ("ms", "sizes", "bounded"),
    [
        # One H100's cold start (sizes 3 and 4 timed beside the gateway's start-up): each no more than the size
        # below it plus a lone forward, so 36.22 + 21.22 and then that plus 21.22; the warm start timed 50.91, 67.32.
        ([21.22, 36.22, 82.39, 133.30], [3, 4], [21.22, 36.22, 57.44, 78.66]),
        ([40.0, 36.0, 50.0], [1], [36.0, 36.0, 50.0]),  # over a larger batch: no more than it
        ([10.0, 30.0, 24.0], [2], [10.0, 20.0, 24.0]),  # the tighter of the two bounds
        ([10.0, 19.0, 28.0], [], [10.0, 19.0, 28.0]),  # nothing flagged: nothing moves
    ],
)
def test_an_implausible_size_is_bounded_by_the_other_sizes_times(ms, sizes, bounded):
    assert implausible(ms) == sizes
    assert plausible_bound(ms, sizes) == pytest.approx(bounded)
    assert implausible(plausible_bound(ms, sizes)) == []


def test_a_size_that_waited_on_other_work_is_timed_again_after_the_others_and_keeps_its_least_time():
    calls: list = []
    sl = make_slice(True, True)
    timer = waiting_timer(calls, {2: 1})
    cal = calibrate(sl, 3, SHAPE, window=4, sink=2, budget_s=600, timer=timer, forward=recording_forward(calls))
    assert not cal.error and cal.full_ms == [15.0, 25.0, 35.0] and cal.empty_ms == [10.0, 20.0, 30.0]
    # 1, 2 and 3 in each pass (2's 75 ms of the first is replaced by the second's 25): four forwards a size.
    assert [len(s) for s, _ in calls] == [b for b in (1, 2, 3) * PASSES for _ in range(4)]
    # Waited on twice: still over 3's time after both passes, so timed once more after them.
    calls.clear()
    timer = waiting_timer(calls, {2: 2})
    cal = calibrate(sl, 3, SHAPE, window=4, sink=2, budget_s=600, timer=timer, forward=recording_forward(calls))
    assert not cal.error and cal.full_ms == [15.0, 25.0, 35.0]
    assert [len(s) for s, _ in calls] == [b for b in (1, 2, 3) * PASSES + (2,) for _ in range(4)]


def test_each_size_keeps_the_least_of_its_passes_even_where_every_pass_was_plausible():
    calls: list = []
    timer = fake_timer(calls)
    slow_first = {"n": 0}

    def timer_slow_first_pass(fn):  # every full-window timing of the first pass waited 3 ms (plausible throughout)
        before = len(calls)
        ms = timer(fn)
        if calls[before][1]:
            slow_first["n"] += 1
            ms += 3.0 if slow_first["n"] <= 3 else 0.0
        return ms

    cal = calibrate(
        make_slice(True, True), 3, SHAPE, window=4, sink=2, budget_s=600, timer=timer_slow_first_pass,
        forward=recording_forward(calls),
    )  # fmt: skip
    assert not cal.error and cal.full_ms == [15.0, 25.0, 35.0]


def test_a_size_that_stays_implausible_is_timed_again_a_bounded_number_of_times_and_kept_at_the_others_bound():
    calls: list = []
    timer = waiting_timer(calls, {2: 99})  # always slow: 75 ms where it takes 25
    cal = calibrate(
        make_slice(True, True), 3, SHAPE, window=4, sink=2, budget_s=600, timer=timer, forward=recording_forward(calls)
    )
    # Kept at the most a forward of 2 can take by the others: 1's time twice (30), under 3's (35); still over the
    # true 25, so the price errs on the safe side.  The empty window's times were plausible and stay as timed.
    assert not cal.error and cal.full_ms == [15.0, 30.0, 35.0] and cal.empty_ms == [10.0, 20.0, 30.0]
    assert sum(1 for s, ctx in calls if len(s) == 2 and ctx) == 2 * (PASSES + RECHECKS)  # untimed + timed, each


def test_timing_a_size_again_never_spends_more_than_the_budget_nor_reports_an_error():
    now = [0.0]

    def clock():  # one second per look: the budget check before every forward
        now[0] += 1.0
        return now[0]

    calls: list = []
    timer = waiting_timer(calls, {2: 99})
    # 3 sizes x 4 forwards = 12 looks, plus the start, then size 1's second pass (4): the budget runs out while size
    # 2 is timed in the second pass.
    cal = calibrate(
        make_slice(True, True), 3, SHAPE, window=4, sink=2, budget_s=19.5, clock=clock, timer=timer,
        forward=recording_forward(calls),
    )  # fmt: skip
    assert not cal.error and cal.full_ms == [15.0, 75.0, 35.0]
    assert [len(s) for s, _ in calls].count(2) == 4 + 3  # the second timing of 2 stopped before its last forward


def test_a_failing_calibration_is_reported_not_raised():
    def broken(runner, steps, inputs):
        raise RuntimeError("out of memory")

    sl = make_slice(False, True)
    cal = calibrate(sl, 2, SHAPE, budget_s=600, forward=broken)
    assert cal.error.startswith("failed: RuntimeError: out of memory") and cal.full_ms == []


def test_serving_shape_follows_stagecast_json_and_the_vae(tmp_path):
    (tmp_path / "transformer").mkdir()
    assert serving_shape(str(tmp_path / "transformer"), CFG) == ServingShape(1, 60, 104, 512)  # 832x480, 8x VAE
    (tmp_path / "stagecast.json").write_text(json.dumps({"width": 64, "height": 48, "text_len": 16}))
    assert serving_shape(str(tmp_path / "transformer"), CFG) == ServingShape(1, 6, 8, 16)
    wan22 = dict(CFG, in_channels=48)  # the Wan2.2 VAE: 16x
    assert serving_shape("random:wan2.2-ti2v-5b", wan22) == ServingShape(1, 30, 52, 512)


def test_a_random_checkpoint_of_a_folder_takes_its_config_and_serving_size(tmp_path):
    """``random:FOLDER`` (the benchmarks' stages): random weights of the folder's config, calibrated at the serving
    size its root's stagecast.json gives the gateway, not at the 832x480 default (a 5B stage served at 1280x704 had
    been priced at a quarter of its tokens)."""
    cfg = model_config("wan2.2-ti2v-5b")
    (tmp_path / "transformer").mkdir()
    (tmp_path / "transformer" / "config.json").write_text(json.dumps(cfg, default=list))
    (tmp_path / "stagecast.json").write_text(json.dumps({"width": 1280, "height": 704}))
    spec = f"random:{tmp_path / 'transformer'}"
    assert checkpoint_folder(spec) == tmp_path / "transformer" and checkpoint_folder("random:wan2.2-ti2v-5b") is None
    assert checkpoint_config(spec) == checkpoint_config("random:wan2.2-ti2v-5b")
    assert checkpoint_config(spec) == read_config(tmp_path / "transformer")
    assert serving_shape(spec, cfg) == ServingShape(1, 44, 80, 512)  # 1280x704 through the 16x VAE
    with pytest.raises(KeyError):
        checkpoint_config("random:no-such-model")


class _Part:
    def __init__(self, device: str, ms: float):
        self.device, self.ms = torch.device(device), ms
        self.released = 0

    def new_state(self):
        return {"chunks": 0}

    def release(self, state):
        self.released += 1

    def decode_chunk(self, state, x):
        state["chunks"] += 1
        return x


def test_vae_cost_is_the_slowest_parts_steady_state_chunk():
    parts = [_Part("cpu", 3.0), _Part("cpu", 8.0)]
    seen = []

    def timer(device, fn):
        out = fn()
        seen.append(out)
        return (100.0 if len(seen) <= 2 * STEADY_FROM else parts[(len(seen) - 1) % 2].ms), out

    cost = measure_vae(parts, (1, 16, 1, 4, 6), chunks=5, timer=timer)
    assert cost is not None and cost.chunk_ms == 8.0 and cost.part_ms == (3.0, 8.0)  # the warm-up chunks excluded
    assert all(p.released == 1 for p in parts)
    assert cost.to_proto().parts == 2


def test_cost_model_precedence_seed_calibration_and_refinement():
    cost = CostModel(stages=2, max_batch=4)
    assert cost.micro_step_ms() is None
    assert cost.calibrate(0, {1: 10.0, 2: 11.0, 4: 13.0}) and cost.calibrate(1, {1: 20.0, 4: 24.0})
    assert not cost.calibrate(1, {9: 5.0, 1: float("nan")})  # nothing usable: unchanged
    assert cost.micro_step_ms() == pytest.approx(24.0 / 4)
    cost.observe(1, 4, 34.0)  # a measured batch refines the calibrated value rather than replacing it
    assert cost.stage_ms(4)[1] == pytest.approx((1 - EWMA) * 24.0 + EWMA * 34.0)

    operator = CostModel(stages=2, max_batch=4, seed_ms=[50.0, 50.0], chunk_ms=7.0)
    assert not operator.calibrate(0, {1: 1.0}) and not operator.report_vae(VaeReport("full", 30.0))
    assert operator.stage_ms(1) == [50.0, 50.0] and (operator.chunk_ms, operator.vae_source) == (7.0, "operator")


def test_the_gateways_vae_cost_lowers_capacity():
    cost = CostModel(stages=1, max_batch=1)
    cost.calibrate(0, {1: 20.0})
    ctl = SloController(cost)
    assert ctl.capacity_streams([], chunk_rate=4.0, steps=1) == pytest.approx(0.9 / (4 * 20 / 1000))
    assert cost.report_vae(VaeReport("full", 25.0)) and cost.vae_source == "gateway"
    assert ctl.capacity_streams([], chunk_rate=4.0, steps=1) == pytest.approx(0.9 / (4 * 45 / 1000))
    admitted = [Demand(i, chunk_rate=4.0, allowed=(1,)) for i in range(5)]  # 18% of the GPU each
    newcomer = Demand(9, chunk_rate=4.0, allowed=(1,))
    assert ctl.admits(newcomer, admitted[:3]) and not ctl.admits(newcomer, admitted)


class FakeMemory:
    """The allocator's counters: ``held`` bytes allocated, and the peak since the last reset."""

    def __init__(self, held: int):
        self.held, self.top = held, held

    def allocated(self) -> int:
        return self.held

    def reset_peak(self) -> None:
        self.top = self.held

    def peak(self) -> int:
        return self.top

    def spike(self, transient: int, kept: int = 0) -> None:
        """A forward's activations (``transient``, freed by its end) and what it keeps (``kept``)."""
        self.top = max(self.top, self.held + kept + transient)
        self.held += kept


def test_a_forwards_activation_is_what_it_allocated_above_what_it_began_with_not_the_streams_kv():
    # 1.3B on an H100 (r29): the calibration's peak over everything held its 8 streams' full K/V windows (12.85 of
    # 13.48 GiB), and the stage took it from the streams' KV budget a second time: 8.56 GiB for streams, 4 streams.
    mem = FakeMemory(held=50_000)  # weights and the calibration streams' windows, filled without forwards
    calls: list = []

    def forward(runner, steps, inputs):
        mem.spike(transient=1000 * len(steps), kept=10 * len(steps))  # activations; the chunk's own K/V rows
        return recording_forward(calls)(runner, steps, inputs)

    sl = make_slice(True, True)
    cal = calibrate(sl, 3, SHAPE, window=4, sink=2, budget_s=600, timer=fake_timer(calls), forward=forward, memory=mem)
    assert not cal.error and len(cal.full_ms) == 3
    assert cal.activation_bytes == 1000 * 3 + 10 * 3  # the largest batch's forward, not the 50 000 held before it
    assert calibrate(sl, 2, SHAPE, budget_s=600).activation_bytes is None  # a CPU: nothing measured


def test_graph_buffers_a_forward_adds_are_not_its_activation():
    from stage_service.calibration import Calibration, track_activation
    from stage_service.graphs import GraphedBlocks

    assert isinstance(GraphedBlocks.nbytes, property)  # what ``track_activation`` reads, as the fake below has it

    class Graphs:  # GraphedBlocks' static buffer bytes
        def __init__(self):
            self.nbytes = 0

    class Runner:
        graphs = Graphs()

    mem, cal = FakeMemory(held=1_000), Calibration(SHAPE, window=4)

    def capture(runner, steps, inputs):  # a first forward of a signature: its static buffers, then its activations
        runner.graphs.nbytes += 4_000
        mem.spike(transient=300, kept=4_000)

    track_activation(capture, cal, mem)(Runner(), [], None)
    assert cal.activation_bytes == 300
    track_activation(lambda r, s, i: mem.spike(transient=200), cal, mem)(Runner(), [], None)  # a replay
    assert cal.activation_bytes == 300  # the most of any forward


def test_a_stage_reserves_twice_a_forwards_activation_with_cuda_graphs_and_the_whole_peak_when_unmeasured():
    from stage_service.kv_budget import activation_reserve

    assert activation_reserve(1_000, 13_000, cuda_graphs=True) == 2_000  # a capture beside an eager forward
    assert activation_reserve(1_000, 13_000, cuda_graphs=False) == 1_000
    assert activation_reserve(None, 13_000, cuda_graphs=True) == 13_000  # no forward measured: never too little
