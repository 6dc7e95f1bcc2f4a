"""The SLO controller: per-stream denoising steps chosen online from measured stage times, and capacity.

Usage (the engine calls it under its lock; ``stagecast simulate --controller`` drives it with simulated times)::

    cost = CostModel(stages=2, max_batch=4, seed_ms=[20.0, 20.0])      # seed: the operator's, or None
    cost.calibrate(stage=0, ms_by_batch={1: 20.0, 2: 21.0, 4: 23.0})    # the stage's own timing at READY
    cost.report_vae(VaeReport("full", 26.0))                            # the gateway's measured Wan VAE decode
    cost.report_vae(VaeReport("tiny", 6.0, (6.0, 5.1, 4.8, 4.5)))       # a cross-stream batching tiny decoder
    cost.observe(stage=0, micro_steps=4, forward_ms=41.0)               # every BatchDone
    ctl = SloController(cost)
    steps = ctl.decide([Demand(1, chunk_rate=4.0, allowed=(1, 2, 3, 4), decoder="tiny"), ...])  # {stream: steps}
    ctl.admits(Demand(9, chunk_rate=4.0, allowed=(1, 2)), admitted)                       # capacity admission
    ctl.price(Demand(9, chunk_rate=4.0, allowed=(1, 2)), admitted)     # Fit(fits, steady, start, starting): why
    ctl.capacity_streams(admitted, chunk_rate=4.0, steps=1, decoder="tiny")               # streams at 16 FPS left

**The model.** A stage forward of a batch of b micro-steps costs ``a_p + g_p * b`` ms on stage p (small batches are
launch-bound, so g is well below a on GPUs). The pipeline's rate is set by its slowest stage: at the batch size B
the scheduler forms, one micro-step costs ``max_p (a_p + g_p B) / B`` ms of the bottleneck's time. B is the average
batch of the measured batches (``typical_batch``; the largest batch before any is measured), and the ms at a
fractional B lie between the two whole sizes around it. Paced streams rarely fill the largest batch, and the batches
they do form are measured while the VAE slices time-slice the same GPUs: pricing at the largest batch took its
calibrated time, measured alone, and on one H200 judged a set of two streams under 80% that kept the GPU saturated
(BENCHMARKS.md, "SLO-adaptive serving"). A paced stream at ``chunk_rate`` r running s steps needs ``r * levels(s)``
micro-steps per second (levels: s, plus the clean pass under ``clean``), so a set of streams is held when ``(sum_s
r_s levels_s * cost_ms + decode_ms) / 1000 <= target_utilization`` (default 0.9, the headroom for jitter;
``decode_ms``: the decode per second, below). Under the coordinator's ``--pace-grid`` (``CostModel(aligned=True)``)
paced streams of one chunk rate have their chunks due in the same tick, so the batches a set forms follow from the
set itself rather than from the batches measured so far (which, in a ramp of streams opened one by one, are mostly
batches of one): each chunk period, the set's level-l micro-steps form ``floor(n_l / B)`` batches of B and one of
the rest, B being ``max_batch`` (or fewer, to spread the rows over the stages), and each is priced at its own size
(``aligned_ms``). The fit is per stage: an exponential average of ms per batch for each
batch size seen, from which a and g follow by least squares; until two batch sizes are seen the slope is taken as
``growth * a`` (``growth`` 0.05, the simulator's).

**The decode.** Besides the DiT, each chunk costs its decode on the stage GPUs (the gateway's decoder shares them),
whatever its steps, priced by the decoder the stream runs on (``Demand.decoder``: ``"full"``, the Wan VAE, or
``"tiny"``; ``OpenStreamRequest.decoder``). Each kind has its own numbers (``DecoderCost``), which the gateway
measures and reports (``report_vae(VaeReport(...))``; it reports again while serving, as its measurements at the
batches formed change, and each report replaces that kind's numbers): ``chunk_ms``, the slowest
GPU's steady-state ms for one stream's chunk (a decoder split over GPUs: its slowest slice), and for a decoder that
decodes several streams' chunks in one call, ``batch_ms[i]``, the ms per chunk *per stream* when i + 1 of its
streams decode together. A set of streams is charged, per decoder kind, ``sum r_s * chunk_ms`` for a decoder that
does not batch, and ``sum r_s * batch_ms[n - 1]`` for one that does, n being the number of that kind's paced streams
(they decode together), clamped to the measured range (beyond the largest measured batch its per-stream ms; a kind
measured at batch 1 only is priced at it): the per-stream cost falls as a batching decoder's streams grow. A kind
not reported yet costs the operator's ``--vae-ms-per-chunk`` for it (``full=26,tiny=5``; a plain number is the full
VAE's), else 0 until reported; the operator's number, where given, is kept over the gateway's reports. A stream on
the tiny decoder is never priced at the full VAE's numbers, and the reverse.

**A CPU host.** Where the stages all run on the CPU of one host (``CostModel.shared_host``: their registrations
say ``cpu`` at one address), they and the gateway's decoder and encoders share its cores: nothing runs beside
anything else for free.  There a micro-step costs the *sum* of the stages' ms, not the slowest one's, and a decoder
measured on the CPU (``VaeReport.on_cpu``: the gateway times its VAE there too, the frames' encode included) is
counted; beside GPU stages a CPU decoder costs them nothing and is not.  Pipelines that share one host split it by a
fixed share (the coordinator's ``--host-share``, which ``stagecast up --pipelines N`` sets to 1/N on a CPU): the
targets are that share of the host.  Best-effort work is never counted: it yields.  The lateness correction below
still applies on top: a CPU host whose real cost the sum misses (threads contending, the prompt encodes) is found
from the streams that fall behind, and scales the whole model.

**Two processes on one GPU.**  Where a decoder is charged to the stage GPUs (``decoder_on_gpu``: the gateway's
decoder, or its VAE slices, time-slice them with the stage), a forward beside it runs longer than its calibration,
taken alone at READY, and the more so the more the decoder has to do: the two CUDA contexts take turns, and each
forward's work outside its timed kernels waits behind the decode.  Summing the costs each measured alone
underpriced a ramp on one H200 by 16-18% (9 streams priced at 82.7% of the GPU ran at 97.5%, 16.4 FPS of 16 and
ever later; none held), and a size served early in a ramp, while the decoder had few streams, ran faster than the
same size later at load.  So every calibrated size is priced at no less than ``gpu_sharing`` times its
calibration (the coordinator's ``--gpu-sharing``, default ``GPU_SHARING`` = 1.2), served or not; a size served
slower than that is priced as served.  A CPU host has no such factor (its stages' and decoder's costs are summed).

**Where the stage times start.**  In order of precedence: the operator's ``--stage-ms`` (ms for a batch of one per
stage, ``seed_ms``; the stages' calibrations are then ignored), else each stage's calibration at READY
(``calibrate``: its measured ms per batch size 1..max_batch with a full KV window, ``FormReply.calibration``), else
nothing until the first measured batches.  Either way a measured batch refines the model: the first measurement of a
batch size is averaged into its calibrated value, not put in its place.  Calibrated sizes not served yet are scaled by
how much slower the served sizes ran than their calibration (``_StageFit.sharing``): on a GPU the stage shares with
the decoder, its forwards stretch by the decode work between their kernels, and a ramp of streams forms its largest
batches only once the set is in, after the admission that priced them.  The scale is never below 1: served sizes
that ran faster than their calibration (one taken beside the gateway's start-up work) leave the others at theirs.

**The batch.** ``--max-batch`` is a ceiling: the stages calibrate (and pre-capture the graphs of) batches of
1..``--max-batch`` micro-steps, and the coordinator's scheduler forms batches of at most the size their calibration
picks (``pick_batch``, at every Form): a bigger batch costs a joining stream's first frame a longer forward for each
one it waits behind, and on a GPU the per-micro-step cost stops falling past a few (1.3B on an H200: 26 ms at 1, 22
at 4, 8 and 12).  Sizes whose forward, times the forwards a joining stream waits for plus its own, passes
``BATCH_TTFF_MS`` are out; of the rest, those that hold the most one-step streams at 16 FPS by the calibrations (on
the pace grid, with each period's remainder batch priced at its own size), and of those the largest: fewer forwards a
period carry less of the work each forward costs outside its timed kernels (its plan, its results, the decode
between).  On one H200 the smallest of a tie (2, where 3 and 4 held as many by the calibration) held 6 1.3B
tiny-decoder streams with TTFF p95 485 ms, where 4 had held 7 at 330-392 ms.  Without a calibration from every stage
(``--stage-ms``, ``--slo-fixed``, a CPU stage without ``--calibration-s``) the ceiling is the batch.

**The decision.** Every stream starts at its ``max_steps``.  When the set is not held, the controller lowers
one stream one offered step count at a time (the stream with the most steps; among equals, the newest; none below
its ``min_steps``) until the set is back at ``raise_utilization``: quality falls evenly before anyone misses a
deadline, and a set left just under the target has no room for what a lowering does not undo at once (on one H200,
a ramp of 6 SLO 1-4 streams lowered to just under the target, two still at 2 steps, ran two streams late: the
chunks planned at more steps before it, and a 2-step chunk's second pass waiting on its first).  Steps rise again,
one count at a time (oldest stream first), only while the set stays held at ``raise_utilization`` (default 0.8):
the gap between the two thresholds keeps decisions from flapping.  Steps do not rise for a few seconds after a
stream joins (``decide(raise_steps=False)``; the engine's ``RAISE_HOLD_S``): a ramp of joins only lowers.
``latency_first`` streams stay at their ``min_steps``.  Unpaced streams (``chunk_rate`` 0) are best-effort: they
are not counted and keep their steps.

**Correction from missed deadlines.** The model sees the DiT stages and a decode cost per chunk, not everything a
chunk costs: the stage and the decoder are separate processes time-slicing each GPU, a batching decoder's streams do
not always decode together, and the gateway's CPU does work per stream. So the engine also watches what viewers see:
when a paced stream's consumption keeps falling behind its real-time schedule (its first chunk's consumption + c /
chunk_rate, the harness's on-time rule; ``SloControl.check_late``) while the model judged the set held,
``observe_late`` scales the whole model (``correction``, at least 1) until the set now running is judged just past
the target. Steps then fall at the next decision, and admission refuses what would not be held. The correction
relaxes (``relax``, half-life ``CORRECTION_HALF_LIFE_S``) while no stream is late, so capacity that comes back is
found again.

**Admission** refuses a stream when the admitted streams at their ``min_steps`` plus the newcomer at its ``min_steps``
would not be held, or when their start would not be (``startup_utilization``): a stream's first second holds one chunk
more than its rate (Wan's chunk 0 decodes to one frame, and chunk 1 comes due one frame after it), and streams that
start together (the newcomer, and those whose viewer has no frame yet: ``Demand.starting``) ask for that chunk at
once.  The set with each starting stream's extra chunk must stay within ``STARTUP_UTILIZATION`` (all of the
bottleneck: a start may use the headroom the target keeps for jitter, not more).  One stream joining a running set (a
ramp) adds a quarter of its own share at 16 FPS, which refuses it below the target only where it alone takes over 40%
of the bottleneck; a burst of joiners on an idle pipeline is held to ``STARTUP_UTILIZATION / (1 + 1 / (chunk_rate x
STARTUP_WINDOW_S))`` of it, 80% at 16 FPS.  On one H200 a burst of 12 admitted 9 at the steady price and one of them
ran 5 frames late in its first second; on an H100, a burst of 9 ran every stream 4-20 frames late in its first two
seconds and on time after (r27, r30).  A paced stream on a pipeline with no other paced stream is always admitted (it
can push no admitted stream below its rate), even where the model says it alone is not held (a CPU deployment): it
runs at its ``min_steps`` as fast as the pipeline goes. Capacity in "streams at 16 FPS" is how many more streams of a
given rate, step count and decoder fit beside the admitted ones at their ``min_steps``: the largest whole number n of
such streams that is held, plus the fraction of the next one that the utilization left over pays for."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from coordinator.scheduler import batch_limit
from stagecast.api import DECODERS
from stagecast.microstep import chunk_levels

TARGET_UTILIZATION = 0.9
RAISE_UTILIZATION = 0.8
UTILIZATION_EPS = 1e-9  # a set priced at the raise threshold to within rounding is at it
EWMA = 0.2  # weight of a new measurement in a batch size's average
BATCH_EWMA = 0.05  # weight of a new batch in the average batch size the stages form (about the last 20 batches)
LATE_MARGIN = 1.05  # a late stream puts the set it ran in this far past the target
MAX_CORRECTION = 20.0
CORRECTION_HALF_LIFE_S = 300.0
FULL = "full"  # the Wan VAE: the decoder a stream without one named runs on
MAX_DECODE_BATCH = 256  # entries of a decoder's batch_ms (per-stream ms at 1..n streams decoding together)
MAX_STATE_BYTES = 1 << 40
MAX_SHARING = 4.0  # the most a calibrated size is scaled by (served / calibrated stage time, _StageFit.sharing)
# A stage and the gateway's decoder on one GPU (``CostModel.gpu_sharing``, the coordinator's ``--gpu-sharing``): how
# much longer a forward runs beside the decoder at load than its calibration alone.  One H200 (2026-12-03, 1.3B 1
# step, tiny decoder, pace grid): alone-summed costs of 9 streams 82.7% of the GPU ran at 97.5%, of 10 streams 90.2%
# at 105% (1.16-1.18); the batch of 4 served at 89.7 ms a forward where it calibrated at 73.0 (1.23).
GPU_SHARING = 1.2
# A starting stream's extra chunk (module docstring, "Admission") is priced over this much of its start, and the set
# with it must stay within this share of the bottleneck.
STARTUP_WINDOW_S = 1.0
STARTUP_UTILIZATION = 1.0
MAX_CAPACITY_STREAMS = 1 << 20  # capacity_streams stops counting here (a model that costs next to nothing)
# The DiT's share of a joining stream's first frame a Stream Batch may cost (``CostModel.pick_batch``): the 400 ms
# first-frame goal at capacity, less its decode, encode and delivery.
BATCH_TTFF_MS = 300.0
MAX_PICK_STREAMS = 4096  # pick_batch stops counting streams here


def decoder_kind(name: str) -> str:
    """A decoder kind as the wire names it (``OpenStreamRequest.decoder``, ``VaeCost.decoder``): "" reads as "full";
    anything but a known kind is refused naming ``decoder``."""
    kind = name or FULL
    if kind not in DECODERS:
        raise ValueError(f"decoder: must be one of {', '.join(DECODERS)} ('' reads as full), got {name[:64]!r}")
    return kind


@dataclass
class DecoderCost:
    """One decoder kind's cost per chunk on the busiest stage GPU (``CostModel.decoders``)."""

    chunk_ms: float = 0.0  # one stream's chunk decoded alone
    batch_ms: tuple[float, ...] = ()  # per-stream ms when i + 1 streams decode in one call; (): it does not batch
    state_bytes: int = 0  # one stream's decoder state on the GPU (0: not known)
    source: str = "none"  # "operator" (--vae-ms-per-chunk) | "gateway" (ReportVaeCost) | "none" (0 until reported)
    formed_batch: float = 0.0  # streams per call the gateway's recent calls held (0: none served yet)
    on_cpu: bool = False  # measured on the CPU: counted only where the stages share that CPU (``shared_host``)

    def per_stream_ms(self, streams: int) -> float:
        """The ms each of ``streams`` streams' chunks costs: at the batch its calls form, which is ``streams`` at
        most and the gateway's measured ``formed_batch`` (paced streams' chunks are ready at different times, so a
        call rarely holds them all; none measured yet: one stream a call), interpolated between the measured sizes
        around it; beyond the largest measured batch, its per-stream ms."""
        if not self.batch_ms or streams <= 0:
            return self.chunk_ms
        batch = min(float(streams), max(1.0, self.formed_batch), float(len(self.batch_ms)))
        lo = int(batch)
        ms = self.batch_ms[lo - 1]
        if batch > lo:
            ms += (self.batch_ms[lo] - ms) * (batch - lo)
        return ms


@dataclass(frozen=True)
class VaeReport:
    """What the gateway measured of one decoder kind (``pb.VaeCost``): ``chunk_ms`` per chunk alone on the busiest
    GPU, ``batch_ms`` per stream at 1..n streams decoding together (empty: it does not batch), one stream's
    ``state_bytes``, and ``formed_batch``, the streams its recent calls held.  Checked by ``CostModel.report_vae``."""

    decoder: str
    chunk_ms: float
    batch_ms: tuple[float, ...] = ()
    state_bytes: int = 0
    formed_batch: float = 0.0  # streams per call its recent calls held (0: none served yet)
    on_cpu: bool = False  # its slowest part runs on the CPU (``VaeCost.device``)


def _check_ms(what: str, ms: float) -> float:
    if not (math.isfinite(ms) and 0 <= ms < 1e5):
        raise ValueError(f"{what}: must be in [0, 100000) ms, got {ms}")
    return float(ms)


def _levels(steps: int, clean: bool) -> int:
    """Micro-steps per chunk at ``steps`` (``stagecast.microstep.chunk_levels``; the controller knows only whether
    the policy is ``clean``)."""
    return chunk_levels(steps, "clean" if clean else "per_level")


@dataclass(frozen=True)
class Fit:
    """The SLO model's verdict on a newcomer beside the admitted streams (``SloController.price``): whether it fits,
    and the shares of the bottleneck that decided, each None where it was not priced."""

    fits: bool
    steady: float | None = None  # the set with the newcomer, everyone at min_steps
    start: float | None = None  # the same while its starting streams start (priced only when the steady set fits)
    starting: int = 0  # streams of that set starting at once


@dataclass
class Demand:
    """One stream as the controller sees it."""

    stream_id: int
    chunk_rate: float  # chunks per second it must be generated at; 0: unpaced (best-effort)
    allowed: tuple[int, ...]  # step counts it may run (the sampler's offered counts in [min_steps, max_steps])
    steps: int = 0  # what it runs now (0: not decided yet: its max)
    clean: bool = False  # the clean KV policy adds one pass per chunk
    latency_first: bool = False  # hold min_steps; spare capacity goes to latency, not steps
    rows: int = 1  # batch rows per micro-step: 2 for a guided stream in one pipeline (sequential CFG)
    decoder: str = FULL  # the decoder its chunks are decoded on ("full" | "tiny"): what each chunk's decode costs
    # Its viewer has no frame yet (a stream asking to open, or open with no chunk consumed): admission prices its
    # start (``SloController.startup_utilization``).
    starting: bool = False

    def __post_init__(self) -> None:
        self.decoder = decoder_kind(self.decoder)
        if not self.allowed or any(s < 1 for s in self.allowed):
            raise ValueError(f"stream {self.stream_id}: allowed step counts must be >= 1, got {self.allowed}")
        self.allowed = tuple(sorted(set(self.allowed)))
        if not self.steps:
            self.steps = self.min_steps if self.latency_first else self.max_steps

    @property
    def min_steps(self) -> int:
        return self.allowed[0]

    @property
    def max_steps(self) -> int:
        return self.allowed[-1]

    def levels(self, steps: int) -> int:
        return _levels(steps, self.clean)

    def load(self, steps: int) -> float:
        """Batch rows per second at ``steps`` (micro-steps, twice for sequential CFG's two branches)."""
        return self.chunk_rate * self.levels(steps) * self.rows


@dataclass
class _StageFit:
    by_batch: dict[int, float] = field(default_factory=dict)  # batch size -> ms per batch (EWMA)
    seed_ms: float | None = None  # ms for a batch of one, the operator's (--stage-ms)
    calibrated: dict[int, float] = field(default_factory=dict)  # batch size -> ms, the stage's calibration
    # The least a calibrated size is scaled by, served or not (``CostModel.gpu_sharing`` where a decoder shares the
    # stage's GPU; 1 otherwise).
    floor: float = 1.0

    def observe(self, batch: int, ms: float) -> None:
        old = self.by_batch.get(batch, self.points().get(batch))
        self.by_batch[batch] = ms if old is None else (1 - EWMA) * old + EWMA * ms

    def sharing(self) -> float:
        """How much slower the stage's served batches ran than its calibration at the same sizes (the mean ratio;
        1 before any calibrated size is served): on a GPU the stage shares with the decoder, its forwards stretch by
        the decode work that runs between their kernels, which the calibration, alone at READY, did not see.  Never
        below 1: served sizes that ran faster than their calibration say that calibration was slow (the gateway's
        start-up work on the same GPU ran beside it), not that the sizes not served yet will be.  On one H200 a
        calibration taken beside the gateway's warm-up (41.5 ms at batch 1, served at 25.7) scaled the batch of 4 to
        ~0.6 of its 77.7 ms, and a ramp admitted 10 streams of which none held (2026-12-03)."""
        ratios = [self.by_batch[b] / c for b, c in self.calibrated.items() if b in self.by_batch and c > 0]
        return min(MAX_SHARING, max(1.0, sum(ratios) / len(ratios))) if ratios else 1.0

    def points(self) -> dict[int, float]:
        """ms per batch size: served sizes as served, calibrated sizes not served yet scaled by ``sharing``; where a
        decoder shares the GPU (``floor`` > 1), no calibrated size below ``floor`` times its calibration, served or
        not (a size served while the decoder had little to do ran faster than it will at load)."""
        share = max(self.sharing(), self.floor)
        points = {**{b: c * share for b, c in self.calibrated.items()}, **self.by_batch}
        if self.floor > 1.0:
            for b, c in self.calibrated.items():
                points[b] = max(points[b], c * self.floor)
        return points

    def ms(self, batch: int, growth: float) -> float | None:
        pts = self.points()
        if batch in pts:
            return pts[batch]
        if len(pts) >= 2:
            n = len(pts)
            mx = sum(pts) / n
            my = sum(pts.values()) / n
            var = sum((b - mx) ** 2 for b in pts)
            slope = max(0.0, sum((b - mx) * (v - my) for b, v in pts.items()) / var)
            base = my - slope * mx
            return max(base + slope * batch, min(pts.values()))
        if len(pts) == 1:
            ((b0, v0),) = pts.items()
            one = v0 / (1 + growth * (b0 - 1))
            return one * (1 + growth * (batch - 1))
        if self.seed_ms is not None:
            return self.seed_ms * (1 + growth * (batch - 1))
        return None

    def ms_at(self, batch: float, growth: float) -> float | None:
        """``ms`` at a fractional batch size (an average): linear between the two whole sizes around it."""
        low = max(1, math.floor(batch))
        high = max(low, math.ceil(batch))
        a, b = self.ms(low, growth), self.ms(high, growth)
        if a is None or b is None or high == low:
            return a
        return a + (b - a) * (batch - low)


class CostModel:
    """Stage time per batch size, from a calibration (``seed_ms``) and the stages' measured batches."""

    def __init__(
        self,
        stages: int,
        max_batch: int,
        seed_ms: list[float] | None = None,
        growth: float = 0.05,
        chunk_ms: float | dict[str, float | DecoderCost] | None = None,
        aligned: bool = False,
        gpu_sharing: float = 1.0,
    ):
        if not 1.0 <= gpu_sharing <= MAX_SHARING:  # also NaN
            raise ValueError(f"--gpu-sharing must be in [1, {MAX_SHARING:g}], got {gpu_sharing}")
        if seed_ms is not None and len(seed_ms) != stages:
            raise ValueError(f"seed_ms has {len(seed_ms)} entries for {stages} stages")
        # Work per chunk on the busiest stage GPU besides the DiT, whatever the steps: the decode of the decoder the
        # stream runs on (it shares the stage GPUs).  Lowering steps does not shrink it.  The operator's (``chunk_ms``:
        # the full VAE's ms, or per decoder kind its ms or ``DecoderCost``) is fixed; any other kind is 0 until the
        # gateway reports it (``report_vae``).
        fixed = {} if chunk_ms is None else chunk_ms if isinstance(chunk_ms, dict) else {FULL: chunk_ms}
        self.decoders: dict[str, DecoderCost] = {kind: DecoderCost() for kind in DECODERS}
        for kind, value in fixed.items():
            given = value if isinstance(value, DecoderCost) else DecoderCost(chunk_ms=value)
            self.decoders[decoder_kind(kind)] = DecoderCost(
                _check_ms("chunk_ms", given.chunk_ms),
                tuple(_check_ms(f"batch_ms[{i}]", ms) for i, ms in enumerate(given.batch_ms[:MAX_DECODE_BATCH])),
                given.state_bytes,
                "operator",
                min(max(0.0, float(given.formed_batch)), float(MAX_DECODE_BATCH)),
            )

        self.stages = stages
        # The operator's --max-batch: the most micro-steps a forward may take, the sizes the stages calibrate.  The
        # batch the scheduler forms (``max_batch``) is picked from their calibrations within it (``pick_batch``).
        self.ceiling = max_batch
        self.max_batch = max_batch
        # The average batch the stages form, from every measured batch; None until one is measured (then the
        # largest batch is assumed).  A micro-step is priced at it, not at the largest batch (``micro_step_ms``).
        self.batch_avg: float | None = None
        self.growth = growth
        # Paced streams' slots on one grid (the coordinator's --pace-grid): the batches a set forms are predicted from
        # the set (``aligned_ms``), not taken from the batches measured so far.
        self.aligned = aligned
        self.fits = [_StageFit(seed_ms=None if seed_ms is None else seed_ms[p]) for p in range(stages)]
        # Every stage on the CPU of one host (module docstring, "A CPU host"): a micro-step costs the sum of the stages'
        # ms, and a decoder measured on the CPU counts.  Set at each Form from the stages' registrations.
        self._shared_host = False
        # A decoder on the stage GPUs stretches the forwards beside it (module docstring, "Two processes on one GPU").
        self.gpu_sharing = gpu_sharing
        self._share_floor()

    @property
    def shared_host(self) -> bool:
        return self._shared_host

    @shared_host.setter
    def shared_host(self, shared: bool) -> None:
        self._shared_host = shared
        self._share_floor()

    @property
    def decoder_on_gpu(self) -> bool:
        """A decode is charged to the stage GPUs: some decoder kind costs time there (measured on a GPU, or the
        operator's), and the stages are not one CPU host."""
        return not self._shared_host and any(d.chunk_ms > 0 and not d.on_cpu for d in self.decoders.values())

    def _share_floor(self) -> None:
        floor = self.gpu_sharing if self.decoder_on_gpu else 1.0
        for fit in self.fits:
            fit.floor = floor

    def calibrate(self, stage: int, ms_by_batch: dict[int, float]) -> bool:
        """Seed ``stage`` with its own timing (batch size -> ms per forward) unless the operator seeded the model
        (``seed_ms``: it takes precedence).  Entries outside (0, 100000) ms or batch sizes outside 1..``ceiling`` are
        dropped.  Returns whether the stage's model changed."""
        if not 0 <= stage < self.stages or self.fits[stage].seed_ms is not None:
            return False
        good = {
            int(b): float(v)
            for b, v in ms_by_batch.items()
            if 1 <= b <= self.ceiling and math.isfinite(v) and 0 < v < 1e5
        }
        if not good:
            return False
        self.fits[stage].calibrated = good
        return True

    @property
    def chunk_ms(self) -> float:
        """The full VAE's ms per chunk (``ClusterStatus.vae_chunk_ms``)."""
        return self.decoders[FULL].chunk_ms

    @property
    def vae_source(self) -> str:
        """Where the full VAE's cost came from: "operator" | "gateway" | "none"."""
        return self.decoders[FULL].source

    def report_vae(self, report: VaeReport) -> bool:
        """The gateway's measured cost of one decoder kind (``VaeReport``).  It replaces that kind's numbers, unless
        the operator fixed them.  Raises ``ValueError`` naming the field for a value out of range; returns whether
        the model changed."""
        kind = decoder_kind(report.decoder)
        chunk_ms = _check_ms("chunk_ms", report.chunk_ms)
        if len(report.batch_ms) > MAX_DECODE_BATCH:
            raise ValueError(f"batch_ms: at most {MAX_DECODE_BATCH} entries, got {len(report.batch_ms)}")
        batch = tuple(_check_ms(f"batch_ms[{i}]", ms) for i, ms in enumerate(report.batch_ms))
        if not 0 <= report.state_bytes <= MAX_STATE_BYTES:
            raise ValueError(f"state_bytes: must be in [0, {MAX_STATE_BYTES}], got {report.state_bytes}")
        if not (math.isfinite(report.formed_batch) and 0 <= report.formed_batch <= MAX_DECODE_BATCH):
            raise ValueError(f"formed_batch: must be in [0, {MAX_DECODE_BATCH}], got {report.formed_batch}")
        if self.decoders[kind].source == "operator":
            return False
        new = DecoderCost(
            chunk_ms, batch, int(report.state_bytes), "gateway", float(report.formed_batch), bool(report.on_cpu)
        )
        changed = new != self.decoders[kind]
        self.decoders[kind] = new
        self._share_floor()
        return changed

    def decode_ms(self, demands: list[Demand], extra: tuple[str, float, int] | None = None) -> float:
        """The decode ms per second the paced ``demands`` (and ``extra``: (decoder, chunk_rate, streams) more) cost the
        busiest GPU: per decoder kind, the sum of its streams' chunk rates times its per-stream ms at the number of
        its paced streams (a batching decoder's streams decode together)."""
        load: dict[str, list[float]] = {}  # kind -> [sum of chunk rates, streams]
        for d in demands:
            if d.chunk_rate > 0:
                acc = load.setdefault(d.decoder, [0.0, 0])
                acc[0] += d.chunk_rate
                acc[1] += 1
        if extra is not None and extra[1] > 0 and extra[2] > 0:
            acc = load.setdefault(decoder_kind(extra[0]), [0.0, 0])
            acc[0] += extra[1] * extra[2]
            acc[1] += extra[2]
        return sum(
            rate * self.decoders[kind].per_stream_ms(int(n))
            for kind, (rate, n) in load.items()
            if self.shared_host or not self.decoders[kind].on_cpu  # a CPU decoder beside GPU stages costs them nothing
        )

    def observe(self, stage: int, micro_steps: int, forward_ms: float) -> None:
        """One stage's measured batch (``BatchDone``); batches with no micro-steps (GPU timings not read yet) skip."""
        if 0 <= stage < self.stages and micro_steps > 0 and forward_ms > 0 and math.isfinite(forward_ms):
            self.fits[stage].observe(micro_steps, forward_ms)
            size = min(micro_steps, self.max_batch)
            self.batch_avg = size if self.batch_avg is None else (1 - BATCH_EWMA) * self.batch_avg + BATCH_EWMA * size

    @property
    def typical_batch(self) -> float:
        """The batch size a micro-step is priced at: the stages' average batch, or the largest before any."""
        return self.max_batch if self.batch_avg is None else min(max(self.batch_avg, 1.0), self.max_batch)

    @property
    def known(self) -> bool:
        return all(f.ms(1, self.growth) is not None for f in self.fits)

    def micro_step_ms(self, batch: float | None = None) -> float | None:
        """Bottleneck-stage ms per micro-step at ``batch`` (default: ``typical_batch``; on a shared CPU host the stages'
        sum); None before any data."""
        b = batch or self.typical_batch
        per = [f.ms_at(b, self.growth) for f in self.fits]
        if any(v is None for v in per):
            return None
        return (sum(per) if self.shared_host else max(per)) / b  # type: ignore[type-var,arg-type]

    def aligned_ms(self, loads: list[tuple[float, int, int]], max_batch: int | None = None) -> float | None:
        """Bottleneck-stage ms per second of paced streams whose slots share one grid (``aligned``), from the
        batches they form: ``loads`` holds (chunk_rate, micro-steps per chunk, rows per micro-step) per stream (or per
        group of like streams: their rows summed).
        Streams of one chunk rate have their chunks due in the same tick, so every chunk period the scheduler
        batches their level-l micro-steps together, in batches of its limit (``max_batch``, the model's unless given,
        or fewer to spread the rows over the pipeline's stages) and one of the rest: n one-step streams at
        ``max_batch`` B cost ``floor(n / B)`` forwards at B and one at ``n mod B`` a period.  Streams of different
        rates are counted as batching apart.  None before any data."""
        groups: dict[float, list[tuple[int, int]]] = {}
        for rate, levels, rows in loads:
            if rate > 0 and levels > 0 and rows > 0:
                groups.setdefault(rate, []).append((levels, rows))
        total = 0.0
        for rate, group in groups.items():
            per_stage = [0.0] * self.stages
            for level in range(max(levels for levels, _ in group)):
                rows = sum(r for levels, r in group if levels > level)
                limit = batch_limit(rows, self.stages, max_batch or self.max_batch)
                full, rest = divmod(rows, limit)
                for p, fit in enumerate(self.fits):
                    at_limit, at_rest = fit.ms(limit, self.growth), fit.ms(rest, self.growth) if rest else 0.0
                    if at_limit is None or at_rest is None:
                        return None
                    per_stage[p] += full * at_limit + at_rest
            total += rate * (sum(per_stage) if self.shared_host else max(per_stage))
        return total

    def stage_ms(self, batch: int) -> list[float | None]:
        return [f.ms(batch, self.growth) for f in self.fits]

    def pick_batch(self, *, chunk_rate: float, waits: int, target: float, ttff_ms: float = BATCH_TTFF_MS) -> int | None:
        """The Stream Batch measurement picks (module docstring, "The batch"): of the sizes 1..``ceiling`` every
        stage calibrated, those whose forward keeps a joining stream's first chunk within ``ttff_ms`` (it waits up to
        ``waits`` forwards of the slowest stage, then runs its own), the largest of those that hold the most one-step
        streams at ``chunk_rate`` (``streams_held``).  None when no size was calibrated by every stage."""
        sizes: list[int] = []
        for b in range(1, self.ceiling + 1):
            if not all(b in f.calibrated for f in self.fits):
                break
            sizes.append(b)
        if not sizes or chunk_rate <= 0:
            return None
        quick = [b for b in sizes if (waits + 1) * max(self.stage_ms(b)) <= ttff_ms] or [1]  # sizes all known
        held = {b: self.streams_held(b, chunk_rate, target) for b in quick}
        most = max(held.values())
        return max(b for b in quick if held[b] == most)

    def streams_held(self, limit: int, chunk_rate: float, target: float) -> int:
        """One-step streams at ``chunk_rate`` an empty pipeline holds at ``target`` with batches of at most ``limit``
        micro-steps (sizes 1..``limit`` known), priced as admission prices them: on the pace grid (``aligned``) the
        batches the set forms (``aligned_ms``: ``floor(n / B)`` forwards at the limit B a chunk period and one of the
        rest); paced apart, every micro-step at the per-micro-step cost of a full batch (``micro_step_ms``)."""
        n = 0
        while n < MAX_PICK_STREAMS:
            m = n + 1
            if self.aligned:
                cost = self.aligned_ms([(chunk_rate, 1, m)], max_batch=limit)
            else:
                per = self.micro_step_ms(limit)
                cost = None if per is None else chunk_rate * m * per
            if cost is None or cost > target * 1000.0:  # ms of the busiest stage per second
                break
            n = m
        return n


class SloController:
    def __init__(
        self,
        cost: CostModel,
        target_utilization: float = TARGET_UTILIZATION,
        raise_utilization: float = RAISE_UTILIZATION,
    ):
        if not 0 < raise_utilization <= target_utilization <= 1:
            raise ValueError("need 0 < raise_utilization <= target_utilization <= 1")
        self.cost = cost
        self.target = target_utilization
        self.raise_at = raise_utilization
        self.correction = 1.0  # the model's costs times this (>= 1): learned from missed deadlines

    def _modelled(
        self, demands: list[Demand], steps: dict[int, int] | None = None, extra: Demand | None = None, n: int = 0
    ) -> float | None:
        """The model's busy share (uncorrected) of ``demands`` at ``steps``, plus ``n`` more streams like ``extra``."""
        ms = self.cost.micro_step_ms()
        if ms is None:
            return None
        steps = steps or {}
        more = (extra.decoder, extra.chunk_rate, n) if extra is not None and n > 0 else None
        loads = [(d.chunk_rate, d.levels(steps.get(d.stream_id, d.steps)), d.rows) for d in demands]
        if extra is not None and n > 0:
            loads.append((extra.chunk_rate, extra.levels(extra.steps), extra.rows * n))
        if self.cost.aligned:  # on the grid: the batches this set forms
            dit = self.cost.aligned_ms(loads)
            if dit is None:
                return None
        else:  # paced apart: each micro-step at the batch the stages have formed so far
            dit = sum(rate * levels * rows * ms for rate, levels, rows in loads)
        return (dit + self.cost.decode_ms(demands, more)) / 1e3

    @property
    def bottleneck(self) -> str:
        """What the busy share is of: the slowest stage, or on one CPU host the host (the stages' sum)."""
        return "the host" if self.cost.shared_host else "the slowest stage"

    def micro_step_ms(self) -> float | None:
        """A micro-step's modelled ms (None until stage times are known): whether capacity can be priced."""
        return self.cost.micro_step_ms()

    def utilization(self, demands: list[Demand], steps: dict[int, int] | None = None) -> float | None:
        """The bottleneck stage's busy share for these streams at ``steps`` (default: their current)."""
        util = self._modelled(demands, steps)
        return None if util is None else util * self.correction

    def observe_late(self, demands: list[Demand]) -> bool:
        """A paced stream of ``demands`` (the streams running, at their current steps) fell behind its schedule:
        scale the model so that this set is judged ``LATE_MARGIN`` past the target.  True when the model changed."""
        util = self._modelled([d for d in demands if d.chunk_rate > 0])
        if not util:
            return False
        want = min(MAX_CORRECTION, self.target * LATE_MARGIN / util)
        if want <= self.correction:
            return False  # the model already judged the set over the target: steps are falling
        self.correction = want
        return True

    def relax(self, seconds: float) -> None:
        """``seconds`` passed with no stream late: the correction decays towards 1."""
        if seconds > 0 and self.correction > 1.0:
            self.correction = max(1.0, self.correction * 0.5 ** (seconds / CORRECTION_HALF_LIFE_S))

    def decide(self, demands: list[Demand], *, raise_steps: bool = True) -> dict[int, int]:
        """The steps each stream should run now (``demands`` in arrival order); ``raise_steps`` False only lowers (a
        stream joined a moment ago: ``coordinator.slo_control.RAISE_HOLD_S``)."""
        steps = {d.stream_id: d.steps for d in demands}
        paced = [d for d in demands if d.chunk_rate > 0 and not d.latency_first]
        for d in demands:
            if d.latency_first:
                steps[d.stream_id] = d.min_steps
            elif d.steps not in d.allowed:
                steps[d.stream_id] = max([s for s in d.allowed if s <= d.steps] or [d.min_steps])
        if self.cost.micro_step_ms() is None:
            return steps  # nothing measured yet: keep what runs
        # Past the target, lower, most steps first (the newest among equals), down to the raise threshold: a set left
        # just under the target has no room for the chunks already planned at more steps, nor for a stream's second
        # pass waiting on its first.
        if (self.utilization(demands, steps) or 0.0) > self.target:
            order = {d.stream_id: i for i, d in enumerate(demands)}
            while (self.utilization(demands, steps) or 0.0) > self.raise_at + UTILIZATION_EPS:
                lowerable = [d for d in paced if steps[d.stream_id] > d.min_steps]
                if not lowerable:
                    break
                d = max(lowerable, key=lambda d: (steps[d.stream_id], order[d.stream_id]))
                steps[d.stream_id] = max(s for s in d.allowed if s < steps[d.stream_id])
        # Raise, fewest steps first (the oldest among equals), while the set stays under the raise threshold.
        while raise_steps:
            raisable = [d for d in paced if steps[d.stream_id] < d.max_steps]
            if not raisable:
                break
            d = min(raisable, key=lambda d: steps[d.stream_id])
            trial = dict(steps)
            trial[d.stream_id] = min(s for s in d.allowed if s > steps[d.stream_id])
            if (self.utilization(demands, trial) or 0.0) > self.raise_at:
                break
            steps = trial
        return steps

    def price(self, newcomer: Demand, admitted: list[Demand]) -> Fit:
        """Whether ``newcomer`` fits beside ``admitted`` with everyone at min_steps, and their start with it
        (``startup_utilization``), with the shares that decided (it fits while unmeasured)."""
        if newcomer.chunk_rate <= 0:
            return Fit(True)  # best-effort
        if not any(d.chunk_rate > 0 for d in admitted):
            return Fit(True)  # alone it pushes no admitted stream below its rate; refusing it would serve no one
        every = admitted + [newcomer]
        util = self.utilization(every, {d.stream_id: d.min_steps for d in every})
        if util is None:
            return Fit(True)
        if util > self.target:
            return Fit(False, steady=util)  # the steady set does not fit: its start need not be priced
        start = self.startup_utilization(every)
        starting = sum(d.starting for d in every)
        return Fit(start is None or start <= STARTUP_UTILIZATION, steady=util, start=start, starting=starting)

    def admits(self, newcomer: Demand, admitted: list[Demand]) -> bool:
        """``price(...).fits``."""
        return self.price(newcomer, admitted).fits

    def startup_utilization(self, demands: list[Demand]) -> float | None:
        """The busy share of ``demands`` at their min_steps while the starting ones (``Demand.starting``) start: the
        set's, plus each starting stream's extra chunk over ``STARTUP_WINDOW_S`` (the starting streams' own share
        divided by their chunks in that window, at the slowest of their rates).  None while unmeasured."""
        paced = [d for d in demands if d.chunk_rate > 0]
        floor = {d.stream_id: d.min_steps for d in paced}
        util = self.utilization(paced, floor)
        starting = [d for d in paced if d.starting]
        if util is None or not starting:
            return util
        own = self.utilization(starting, floor) or 0.0
        return util + own / (min(d.chunk_rate for d in starting) * STARTUP_WINDOW_S)

    def capacity_streams(
        self, admitted: list[Demand], chunk_rate: float, steps: int, clean: bool = False, decoder: str = FULL
    ) -> float | None:
        """How many more streams at ``chunk_rate`` and ``steps`` on ``decoder`` fit beside ``admitted`` at their
        min_steps: the most whole streams that are held, plus the share of one more that the headroom left pays for
        (a batching decoder's streams cost less each as they grow, so the count is searched, not divided)."""
        if self.cost.micro_step_ms() is None or chunk_rate <= 0:
            return None
        floor = {d.stream_id: d.min_steps for d in admitted}
        extra = Demand(0, chunk_rate, (steps,), clean=clean, decoder=decoder)

        def util(n: int) -> float:
            return self.correction * (self._modelled(admitted, floor, extra, n) or 0.0)

        if util(0) > self.target:
            return 0.0
        lo, hi = 0, 1  # util(lo) is held; find an hi that is not (the utilization grows with every stream)
        while util(hi) <= self.target:
            lo, hi = hi, hi * 2
            if hi > MAX_CAPACITY_STREAMS:
                return float(lo)
        while hi - lo > 1:  # the most whole streams held
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if util(mid) <= self.target else (lo, mid)
        at, after = util(lo), util(lo + 1)
        return lo + (max(0.0, (self.target - at) / (after - at)) if after > at else 0.0)
