"""``stagecast selftest``: run the real multi-process pipeline and compare it with the reference executor.

Usage::

    stagecast selftest --stages 3 --partition 1,2,1 --policy per_level --streams 3 --chunks 4
    stagecast selftest --stages 1 --cfg-parallel 2 --guidance 5,1 --prompt-update   # two CFG groups in lockstep
    run_selftest(SelftestConfig(stages=2, ...)) -> exit code (0: every chunk matched)

Streams open one after another: stream i+1 opens once stream i has started, and each stream is one
chunk longer than the previous one, so streams start and end at different times while in flight together.  The
coordinator records the plan it actually ran (batches depend on when streams arrived); the reference
executor replays that plan over the whole model in this process and every chunk is compared.  fp32
must match bit for bit.

With ``--guidance`` streams run classifier-free guidance (each with its own random negative prompt), in one
pipeline or, with ``--cfg-parallel 2``, on two stage groups that the reference models as such.  With
``--prompt-update`` every stream changes its prompt once its first chunk has arrived, before acknowledging it
(the stream is paced by acknowledgements, so the update lands on a chunk not yet started), and the reference
replays the update where the plan put it.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import torch

from coordinator.options import CoordinatorOptions
from launcher.local_cluster import check_layout, start_pipeline
from launcher.process import Launcher
from stagecast import wire
from stagecast.flags import HelpFormatter, to_argv
from stagecast.generate import ladder_arg
from stagecast.internal.v1 import pipeline_pb2 as pb
from stagecast.internal.v1 import pipeline_pb2_grpc as pb_grpc
from stagecast.microstep import DEFAULT_MAX_BATCH, MAX_GUIDANCE, PlanEvent, StreamSpec
from stagecast.model.balance import BalanceError
from stagecast.model.balance_profile import BalanceProfileError
from stagecast.model.config import read_config
from stagecast.model.parallel import LayoutError, check_gpus
from stagecast.names import DTYPES
from stagecast.sampling import UPDATES, SamplerError, check_ladder, check_shift

logger = logging.getLogger(__name__)

LADDER = (1000.0, 750.0, 500.0, 250.0, 125.0, 60.0)


@dataclass
class SelftestConfig:
    stages: int = 2
    partition: str | None = None  # layers per stage; "auto": the planner's, from balance_profile
    balance_profile: str | None = None
    sp: int = 1  # sequence-parallel ranks per stage; the reference runs the same shard layout in one process
    policy: str = "per_level"
    streams: int = 2
    chunks: int = 4
    steps: int = 3
    window: int | None = None
    sink: int = 0
    batch: int = 4
    device: str = "cpu"
    dtype: str = "float32"
    checkpoint: str | None = None
    height: int = 8
    width: int = 8
    tolerance: float | None = None
    seed: int = 0
    model: str = "tiny-wan2.1"  # config of the random checkpoint written when no checkpoint is given
    layers: int | None = None  # override its layer count (a real config, fewer layers: fast GPU checks)
    cuda_graphs: bool = False  # stages run CUDA graphs; the reference stays eager, so parity checks the graphs
    loras: tuple[str, ...] = ()  # ``--lora PATH[:SCALE]`` for every stage; the reference merges them the same way
    # Samplers, stream i taking entry i % len: ladders (None: LADDER[:steps]), shifts, and update rules.
    ladders: list[tuple[float, ...]] | None = None
    shifts: list[float] = field(default_factory=lambda: [1.0])
    updates: list[str] = field(default_factory=lambda: ["x0"])
    # Video-to-video: even-numbered streams take their level-0 latents from SubmitInput (random latents standing
    # for the gateway's noised VAE encodings), end by a stop after their last input, and share batches with the
    # text streams between them.
    v2v: bool = False
    # SLO-adaptive steps: streams may run 1..steps steps (LADDER truncations), paced at chunk_rate, under a coordinator
    # whose controller keeps the stage_ms calibration (--stage-ms, --slo-fixed): its step changes are recorded in the
    # plan and replayed by the reference.
    adaptive: bool = False
    chunk_rate: float = 4.0
    # 160 ms a forward of one micro-step, 5% more a micro-step: 46 ms each in batches of 4.  One stream at 3 steps
    # takes 55% of the bottleneck and two 110%, so steps fall; two clean streams at 1 step (2 passes) 74%, whose start
    # together (x 1.25: each one's first second holds one chunk more, coordinator/slo.py, "Admission") stays within
    # 100%: both are admitted.
    stage_ms: float = 160.0
    guidance: list[float] = field(default_factory=lambda: [1.0])  # guidance scales, cycled like the ladders
    cfg_parallel: int = 1  # 2: two pipelines of ``stages`` stages, one per CFG branch
    prompt_update: bool = False  # every text stream changes its prompt after its first chunk


@dataclass
class SelftestResult:
    chunks: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    reference: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    max_diff: float = 0.0
    ok: bool = False
    plan: list[PlanEvent] = field(default_factory=list)
    texts: dict[int, torch.Tensor] = field(default_factory=dict)  # each stream's text, to replay with other weights
    inputs: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)  # video-to-video (stream, chunk) inputs
    negative_texts: dict[int, torch.Tensor] = field(default_factory=dict)  # guided streams' negative prompts
    prompt_texts: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)  # (stream, from_chunk) -> text
    partition: str | None = None  # the layers per stage the pipeline ran (None: even)


def stream_specs(cfg: SelftestConfig, model_cfg: dict) -> list[StreamSpec]:
    ladders = cfg.ladders or [LADDER[: cfg.steps]]
    return [
        StreamSpec(
            stream_id=0,
            latent_channels=model_cfg["in_channels"],
            chunk_frames=1,
            latent_height=cfg.height,
            latent_width=cfg.width,
            timesteps=tuple(ladders[i % len(ladders)]),
            shift=cfg.shifts[i % len(cfg.shifts)],
            sampler=cfg.updates[i % len(cfg.updates)],
            seed=cfg.seed + 17 * i,
            policy=cfg.policy,
            window=cfg.window,
            sink=cfg.sink,
            num_chunks=None if cfg.v2v and i % 2 == 0 else cfg.chunks + i,
            text_len=16 if model_cfg["text_dim"] < 512 else 512,
            input_latents=cfg.v2v and i % 2 == 0,
            guidance_scale=cfg.guidance[i % len(cfg.guidance)],
        )
        for i in range(cfg.streams)
    ]


def stream_inputs(cfg: SelftestConfig, specs: list[StreamSpec]) -> list[list[torch.Tensor] | None]:
    """The input latents of each video-to-video stream (``cfg.chunks + i`` chunks for stream i), None for the others."""
    g = torch.Generator().manual_seed(cfg.seed + 1)
    return [
        [torch.randn(spec.latent_shape, generator=g) for _ in range(cfg.chunks + i)] if spec.input_latents else None
        for i, spec in enumerate(specs)
    ]


def plan_from_proto(events: list[pb.PlanEvent]) -> list[PlanEvent]:
    """A recorded plan (texts stripped) as the reference executor replays it."""
    return [wire.event_from_proto(ev) for ev in events]


def run_streams(
    connect: Callable[[], grpc.Channel],
    specs: list[StreamSpec],
    texts: list[torch.Tensor],
    inputs: list[list[torch.Tensor] | None] | None = None,
    configure: Callable[[pb.OpenStreamRequest], None] = lambda req: None,
    negative_texts: list[torch.Tensor | None] | None = None,
    updates: list[torch.Tensor | None] | None = None,
) -> dict[int, list[torch.Tensor]]:
    """Open the streams in order, each once its predecessor has started; collect every chunk.  ``connect`` makes
    a channel to the coordinator (an operator's, over mTLS: ``launcher.channel(address, "coordinator")``).
    A video-to-video stream is fed ``inputs[i]`` through SubmitInput (waiting for a chunk to come back whenever the
    coordinator says enough wait already) and stopped after its last input.  ``negative_texts[i]``: stream i's
    negative prompt (guided streams).  ``updates[i]``: a prompt stream i sends once its first chunk arrives; such a
    stream acknowledges each chunk after receiving it (and the update), so the update lands on a chunk not yet
    started."""
    run = _StreamRun(connect, specs, texts, inputs or [None] * len(specs), configure, negative_texts, updates)
    threads = []
    for i in range(len(specs)):
        if i > 0:
            run.started[i - 1].wait()
        t = threading.Thread(target=run.consume, args=(i,), daemon=True)
        t.start()
        threads.append(t)
    for t in threads:
        t.join()
    if run.errors:
        raise RuntimeError("; ".join(run.errors))
    return run.results


class _StreamRun:
    """The streams of one ``run_streams`` call: each one's chunks as they arrive, and what went wrong."""

    def __init__(self, connect, specs, texts, inputs, configure, negative_texts, updates):
        self.connect, self.specs, self.texts, self.inputs = connect, specs, texts, inputs
        self.configure, self.negative_texts, self.updates = configure, negative_texts, updates
        self.results: dict[int, list[torch.Tensor]] = {}
        self.errors: list[str] = []
        self.started = [threading.Event() for _ in specs]

    def feed(self, stub, sid: int, latents: list[torch.Tensor], progress: threading.Condition) -> None:
        results = self.results
        try:
            for chunk, x in enumerate(latents):
                req = pb.InputLatents(stream_id=sid, chunk=chunk, latents=wire.tensor_to_proto(x))
                while True:
                    with progress:
                        seen = len(results[sid])
                    try:
                        stub.SubmitInput(req, timeout=60)
                        break
                    except grpc.RpcError as exc:
                        if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                            raise
                    with progress:  # the pipeline is full: wait until a chunk comes back, then offer it again
                        progress.wait_for(lambda seen=seen: len(results[sid]) > seen, timeout=60)
            stub.StopStream(pb.StopRequest(stream_id=sid), timeout=60)
        except grpc.RpcError as exc:
            self.errors.append(f"stream {sid} input: {exc.code().name}: {exc.details()}")

    def request(self, i: int) -> pb.OpenStreamRequest:
        req = pb.OpenStreamRequest(spec=wire.spec_to_proto(self.specs[i]), text=wire.tensor_to_proto(self.texts[i]))
        self.configure(req)
        negative = self.negative_texts[i] if self.negative_texts else None
        if negative is not None:
            req.negative_text.CopyFrom(wire.tensor_to_proto(negative))
        req.acknowledges = self.update(i) is not None
        return req

    def update(self, i: int) -> torch.Tensor | None:
        return self.updates[i] if self.updates else None

    def consume(self, i: int) -> None:
        with self.connect() as ch:
            stub = pb_grpc.CoordinatorServiceStub(ch)
            sid = None
            progress = threading.Condition()
            feeder = None
            want = "stopped" if self.inputs[i] is not None else "completed"
            try:
                for ev in stub.OpenStream(self.request(i), timeout=600):
                    kind = ev.WhichOneof("event")
                    if kind == "started":
                        sid = ev.started.stream_id
                        self.results[sid] = []
                        self.started[i].set()
                        if self.inputs[i] is not None:
                            args = (stub, sid, self.inputs[i], progress)
                            feeder = threading.Thread(target=self.feed, args=args, daemon=True)
                            feeder.start()
                    elif kind == "chunk":
                        assert sid is not None
                        self.on_chunk(stub, i, sid, ev.chunk, progress)
                    elif kind == "ended" and ev.ended.reason != want:
                        self.errors.append(f"stream {sid} ended early: {ev.ended.reason}")
            except grpc.RpcError as exc:
                self.errors.append(f"stream {i}: {exc.code().name}: {exc.details()}")
            finally:
                self.started[i].set()
                if feeder is not None:
                    feeder.join()

    def on_chunk(self, stub, i: int, sid: int, chunk, progress: threading.Condition) -> None:
        got = self.results[sid]
        if chunk.chunk != len(got):
            self.errors.append(f"stream {sid}: chunk {chunk.chunk} arrived out of order")
        with progress:
            got.append(wire.tensor_from_proto(chunk.latents))
            progress.notify_all()
        update = self.update(i)
        if update is None:
            return
        if len(got) == 1:
            stub.UpdatePrompt(pb.PromptUpdate(stream_id=sid, text=wire.tensor_to_proto(update)), timeout=60)
        if len(got) < (self.specs[i].num_chunks or 0):  # after the last, the stream is over
            try:
                stub.Consumed(pb.ChunksConsumed(stream_id=sid, chunks=len(got)), timeout=60)
            except grpc.RpcError as exc:
                # NOT_FOUND: its last chunks started without waiting for this acknowledgement (one wavefront ahead)
                # and it ended while earlier chunks were still being read here; all it sent is in this call's
                # events.  The gateway reads it the same way.
                if exc.code() != grpc.StatusCode.NOT_FOUND:
                    raise


def compare(
    cfg: SelftestConfig,
    transformer: str,
    connect: Callable[[], grpc.Channel],
    texts_by_order,
    chunks,
    inputs_by_order: list[list[torch.Tensor] | None] | None = None,
    negative_by_order: list[torch.Tensor | None] | None = None,
    updates_by_order: list[torch.Tensor | None] | None = None,
    since: int = 0,
) -> SelftestResult:
    """``since``: the length of the recorded plan before these streams opened (earlier runs on the same pipeline);
    the reference replays this run's events only."""
    with connect() as ch:
        dump = pb_grpc.CoordinatorServiceStub(ch).GetPlan(pb.PlanRequest(), timeout=60)
    plan = own_events(plan_from_proto(list(dump.events)[since:]))
    opened = [ev.spec.stream_id for ev in plan if ev.kind == "open" and ev.spec is not None]
    texts = {sid: texts_by_order[i] for i, sid in enumerate(opened)}
    by_order = inputs_by_order or [None] * len(opened)
    inputs = {(sid, c): x for i, sid in enumerate(opened) for c, x in enumerate(by_order[i] or [])}
    negative = {
        sid: negative_by_order[i]
        for i, sid in enumerate(opened)
        if negative_by_order and negative_by_order[i] is not None
    }
    order = {sid: i for i, sid in enumerate(opened)}
    prompt_texts = {
        (ev.stream_id, ev.from_chunk): updates_by_order[order[ev.stream_id]]
        for ev in plan
        if ev.kind == "prompt" and updates_by_order
    }
    device = torch.device("cuda:0" if cfg.device.startswith("cuda") else cfg.device)
    model_cfg = read_config(transformer)
    n = model_cfg["num_layers"]
    # The reference and the model code load only when a selftest runs, so the CLI table stays quick to build.
    from launcher.reference import ReferenceExecutor
    from stage_service.checkpoint import load_slice_state_dict
    from stage_service.dit_slice import DiTSlice
    from stage_service.lora import parse_lora

    loras = [parse_lora(text) for text in cfg.loras]
    config, sd = load_slice_state_dict(
        transformer, layers=range(n), first=True, last=True, dtype=DTYPES[cfg.dtype], device=device, loras=loras
    )
    full = DiTSlice.from_state_dict(config, sd, layers=range(n), first=True, last=True, device=device)
    executor = ReferenceExecutor(full, sp=cfg.sp, cfg_parallel=cfg.cfg_parallel)
    try:
        reference = executor.replay(plan, texts, prompt_texts, inputs=inputs, negative_texts=negative)
    finally:
        executor.close()
    result = SelftestResult(
        chunks=chunks,
        reference=reference,
        plan=plan,
        texts=texts,
        inputs=inputs,
        negative_texts=negative,
        prompt_texts=prompt_texts,
    )
    tolerance = cfg.tolerance if cfg.tolerance is not None else 0.0
    result.ok, result.max_diff = judge(chunks, reference, tolerance)
    if updates_by_order:
        specs = {ev.spec.stream_id: ev.spec for ev in plan if ev.kind == "open" and ev.spec is not None}
        for sid, spec in specs.items():
            if updates_by_order[order[sid]] is None:
                continue
            landed = [c for s, c in prompt_texts if s == sid and c < (spec.num_chunks or c + 1)]
            if not landed:
                print(f"stream {sid}: its prompt update reached no chunk")
                result.ok = False
    return result


def judge(chunks: dict[int, list[torch.Tensor]], reference: dict[int, list[torch.Tensor]], tolerance: float):
    """Print one line per stream; return (ok, worst max-abs difference).  Tolerance 0 demands bit equality
    (so a NaN can never pass), otherwise every difference must be finite and within the tolerance."""
    ok = set(chunks) == set(reference)
    if not ok:
        print(f"streams differ: distributed {sorted(chunks)}, reference {sorted(reference)}")
    worst = 0.0
    for sid in sorted(reference):
        got, want = chunks.get(sid, []), reference[sid]
        if len(got) != len(want):
            print(f"stream {sid}: {len(got)} chunks, reference has {len(want)}")
            ok = False
            continue
        diffs = [(g.float().cpu() - w.float().cpu()).abs().max().item() for g, w in zip(got, want)]
        stream_max = max(diffs) if diffs else 0.0
        exact = all(g.shape == w.shape and torch.equal(g.cpu(), w.cpu()) for g, w in zip(got, want))
        print(f"stream {sid}: {len(got)} chunks, max |distributed - reference| = {stream_max:.3e}, exact={exact}")
        worst = max(worst, stream_max) if stream_max == stream_max else float("nan")
        within = exact if tolerance == 0 else all(d <= tolerance for d in diffs)  # NaN compares False
        ok = ok and within
    return ok, worst


def own_events(plan: list[PlanEvent]) -> list[PlanEvent]:
    """The events of the streams opened in ``plan`` (a recorded plan cut where a run began): an earlier run's
    stream may still have its close recorded after the cut.  A batch holding an earlier run's stream cannot be
    replayed alone, and is an error: a run begins once the one before it has ended."""
    opened = {ev.spec.stream_id for ev in plan if ev.kind == "open" and ev.spec is not None}
    own = []
    for ev in plan:
        if ev.kind == "open":
            own.append(ev)
        elif ev.kind == "batch":
            foreign = {s.stream for s in ev.steps} - opened
            if foreign:
                raise RuntimeError(f"batch {ev.seq} holds streams {sorted(foreign)} of an earlier run")
            own.append(ev)
        elif ev.stream_id in opened:
            own.append(ev)
    return own


@dataclass
class SelftestPipeline:
    """A formed pipeline that selftest runs go through, one after another (``run_on``).  ``key``: what its
    processes were started with (``pipeline_key``): a config with the same key runs on it."""

    key: tuple
    transformer: str
    partition: str | None
    coordinator: str
    launcher: Launcher


def pipeline_key(cfg: SelftestConfig) -> tuple:
    """Everything the pipeline's processes are started with; the streams' own settings (policy, window, ladders,
    guidance, v2v, ...) are not in it."""
    weights = cfg.checkpoint if cfg.checkpoint is not None else (cfg.model, cfg.layers, cfg.seed)
    return (
        weights,
        cfg.stages,
        cfg.partition,
        cfg.balance_profile,
        cfg.sp,
        cfg.cfg_parallel,
        cfg.batch,
        cfg.device,
        cfg.dtype,
        cfg.cuda_graphs,
        tuple(cfg.loras),
        tuple(adaptive_args(cfg)),
    )


def form_pipeline(cfg: SelftestConfig, launcher: Launcher, folder: str | Path) -> SelftestPipeline:
    """Start ``cfg``'s pipeline under ``launcher`` (its random checkpoint written in ``folder`` when it names
    none)."""
    if cfg.checkpoint is None:
        from launcher.demo_checkpoint import write_transformer

        transformer = f"{folder}/transformer"
        overrides = {"num_layers": cfg.layers} if cfg.layers else {}
        shard = 64 * 1024 if cfg.model.startswith("tiny") else 2 * 1024**3
        write_transformer(Path(transformer), seed=cfg.seed, name=cfg.model, max_shard_bytes=shard, **overrides)
    else:
        transformer = cfg.checkpoint
    check_layout(transformer, cfg.stages, cfg.sp)  # before anything starts: LayoutError names the flag
    if cfg.sp > 1 and cfg.device.startswith("cuda"):
        check_gpus(cfg.stages, cfg.sp, torch.cuda.device_count())
    partition = balanced_partition(cfg, transformer)
    pipe = start_pipeline(
        launcher,
        checkpoint=transformer,
        stages=cfg.stages,
        partition=partition,
        device=cfg.device,
        dtype=cfg.dtype,
        max_batch=cfg.batch,
        record_plan=True,
        cuda_graphs=cfg.cuda_graphs,
        loras=cfg.loras,
        sp=cfg.sp,
        coordinator_args=adaptive_args(cfg),
        cfg_parallel=cfg.cfg_parallel,
    )
    return SelftestPipeline(pipeline_key(cfg), transformer, partition, pipe.coordinator, launcher)


def run_on(pipeline: SelftestPipeline, cfg: SelftestConfig) -> SelftestResult:
    """Run ``cfg``'s streams through a formed pipeline (its key must be ``cfg``'s) and compare with the reference
    replaying this run's part of the recorded plan."""
    if pipeline.key != pipeline_key(cfg):
        raise ValueError(f"this pipeline was formed as {pipeline.key}, the config asks for {pipeline_key(cfg)}")
    model_cfg = read_config(pipeline.transformer)
    specs = stream_specs(cfg, model_cfg)
    g = torch.Generator().manual_seed(cfg.seed)
    texts = [torch.randn(1, s.text_len, model_cfg["text_dim"], generator=g) for s in specs]
    inputs = stream_inputs(cfg, specs)
    # Drawn after the texts, so that a run without guidance or updates keeps the texts it always had.
    negative = [torch.randn(1, s.text_len, model_cfg["text_dim"], generator=g) if s.cfg else None for s in specs]
    updates = None
    if cfg.prompt_update:  # text streams only: a video-to-video stream's input paces it
        updates = [
            None if s.input_latents else torch.randn(1, s.text_len, model_cfg["text_dim"], generator=g) for s in specs
        ]
    connect = lambda: pipeline.launcher.channel(pipeline.coordinator, "coordinator")  # noqa: E731
    with connect() as ch:  # what earlier runs on this pipeline recorded
        since = len(pb_grpc.CoordinatorServiceStub(ch).GetPlan(pb.PlanRequest(), timeout=60).events)
    chunks = run_streams(connect, specs, texts, inputs, lambda req: adaptive_request(cfg, req), negative, updates)
    result = compare(cfg, pipeline.transformer, connect, texts, chunks, inputs, negative, updates, since=since)
    result.partition = pipeline.partition
    return result


def execute_selftest(cfg: SelftestConfig, launcher: Launcher) -> SelftestResult:
    """Start the pipeline under ``launcher``, run the streams, compare with the reference."""
    with tempfile.TemporaryDirectory(prefix="stagecast-selftest-") as tmp:
        return run_on(form_pipeline(cfg, launcher, tmp), cfg)


def balanced_partition(cfg: SelftestConfig, transformer: str) -> str | None:
    """``cfg.partition``, or with "auto" the planner's from ``cfg.balance_profile`` (the DiT alone: no gateway)."""
    from launcher.balance import check_flags, resolve_balance

    check_flags(cfg.partition, cfg.balance_profile, cfg.sp, cfg.cfg_parallel)
    if cfg.partition != "auto":
        return cfg.partition
    devices = [f"cuda:{i}" for i in range(cfg.stages)] if cfg.device.startswith("cuda") else [cfg.device] * cfg.stages
    choice = resolve_balance(cfg.balance_profile, transformer=transformer, stage_devices=devices)
    logger.info("%s", choice.describe())
    return choice.partition


def adaptive_args(cfg: SelftestConfig) -> list[str]:
    if not cfg.adaptive:
        return []
    # ``stage_ms`` is what one micro-step costs the pipeline's bottleneck: each stage's on devices of their own, and
    # on one CPU host, where a micro-step costs the stages' sum (coordinator/slo.py, "A CPU host"), a share of it.
    per_stage = cfg.stage_ms / cfg.stages if cfg.device == "cpu" else cfg.stage_ms
    # Off the pace grid: ``stage_ms`` is sized for the average-batch model (one stream at 3 steps 55% of the
    # bottleneck, two 110%), which lowers steps while both streams are admitted; the grid prices each period's own
    # batches (tests/test_slo_grid.py), and on a CPU host it refuses the second stream.
    fixed = CoordinatorOptions(stages=cfg.stages, stage_ms=[per_stage] * cfg.stages, slo_learn=False, pace_grid=False)
    return to_argv(fixed, only=["stage_ms", "slo_learn", "pace_grid"])  # --stage-ms ... --slo-fixed --no-pace-grid


def adaptive_request(cfg: SelftestConfig, req: pb.OpenStreamRequest) -> None:
    """An adaptive stream may run every truncation of its ladder, and is paced (the controller counts paced
    streams)."""
    if not cfg.adaptive:
        return
    ladder = tuple(req.spec.timesteps)
    req.ladders.extend(pb.Ladder(timesteps=ladder[:n]) for n in range(1, len(ladder) + 1))
    req.chunk_rate = cfg.chunk_rate


def run_selftest(cfg: SelftestConfig) -> int:
    """The CLI entry point: prints a verdict and returns the exit code."""
    from launcher.local_cluster import check_gpu_fit

    try:
        if cfg.cfg_parallel > 1 and cfg.sp > 1:
            raise ValueError("--cfg-parallel 2 does not compose with --sp yet (give one of them)")
        if cfg.sp == 1:  # a sequence-parallel layout's GPUs are checked by its own rule, which names --sp
            check_gpu_fit(cfg.device, cfg.stages, cfg.cfg_parallel)
    except ValueError as exc:
        print(f"stagecast selftest: {exc}", file=sys.stderr)
        return 2
    try:
        from launcher.balance import check_flags

        check_flags(cfg.partition, cfg.balance_profile, cfg.sp, cfg.cfg_parallel)
    except ValueError as exc:
        print(f"stagecast selftest: error: {exc}", file=sys.stderr)
        return 2
    try:
        with Launcher() as launcher:
            result = execute_selftest(cfg, launcher)
    except (LayoutError, BalanceProfileError, BalanceError) as exc:
        print(f"stagecast selftest: error: {exc}", file=sys.stderr)
        return 2
    verdict = "PASS" if result.ok else "FAIL"
    print(
        f"selftest {verdict}: stages={cfg.stages} sp={cfg.sp} cfg_parallel={cfg.cfg_parallel} "
        f"guidance={','.join(f'{g:g}' for g in cfg.guidance)} prompt_updates={len(result.prompt_texts)} "
        f"partition={result.partition or 'even'} "
        f"policy={cfg.policy} streams={cfg.streams} batch={cfg.batch} device={cfg.device} dtype={cfg.dtype} "
        f"v2v={cfg.v2v} "
        f"max_diff={result.max_diff:.3e}"
    )
    return 0 if result.ok else 1


def _checked(parse):
    """An argparse type from a parser that raises ValueError (SamplerError included): one line, exit 2."""

    def convert(text: str):
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return convert


_ladders_arg = _checked(lambda text: [check_ladder(ladder_arg(lad)) for lad in text.split(";")])
_shifts_arg = _checked(lambda text: [check_shift(float(x)) for x in text.split(",")])


def _update(name: str) -> str:
    if name not in UPDATES:
        raise SamplerError("update", f"must be one of {', '.join(UPDATES)}, got {name!r}")
    return name


_updates_arg = _checked(lambda text: [_update(u) for u in text.split(",")])


def _guidance(text: str) -> float:
    value = float(text)
    if not 1.0 <= value <= MAX_GUIDANCE:  # also NaN
        raise ValueError(f"guidance: must be in [1, {MAX_GUIDANCE:g}], got {text}")
    return value


_guidance_arg = _checked(lambda text: [_guidance(x) for x in text.split(",")])


def add_parser(sub) -> None:
    p = sub.add_parser(
        "selftest",
        help="run the real multi-process pipeline and compare with the reference",
        formatter_class=HelpFormatter,
    )
    p.add_argument("--stages", type=int, default=2, help="DiT stage processes")
    p.add_argument(
        "--partition", default=None, help="layers per stage, e.g. 1,3 (default: even; auto: from --balance-profile)"
    )
    p.add_argument("--balance-profile", default=None, help="measured costs (benchmarks.balance) for --partition auto")
    p.add_argument(
        "--sp", type=int, default=1, help="sequence-parallel ranks per stage (the reference runs the same shards)"
    )
    p.add_argument("--policy", choices=["clean", "per_level"], default="per_level", help="KV policy of every stream")
    p.add_argument("--streams", type=int, default=2, help="concurrent streams")
    p.add_argument("--chunks", type=int, default=4, help="chunks per stream")
    p.add_argument("--steps", type=int, default=3, help="denoising steps per chunk")
    p.add_argument("--window", type=int, default=0, help="KV window in latent frames (0: unbounded)")
    p.add_argument("--sink", type=int, default=0, help="sink latent frames kept in the window")
    p.add_argument("--batch", type=int, default=DEFAULT_MAX_BATCH, help="micro-steps per stage forward (Stream Batch)")
    p.add_argument("--device", default="cpu", help="cpu, or cuda (stage i on cuda:i)")
    p.add_argument("--dtype", default="float32", help="weights and activations of stages and reference")
    p.add_argument("--checkpoint", default=None, help="transformer folder (default: a tiny random one)")
    p.add_argument("--height", type=int, default=8, help="latent height")
    p.add_argument("--width", type=int, default=8, help="latent width")
    p.add_argument("--tolerance", type=float, default=None, help="max abs diff allowed (default: 0, exact)")
    p.add_argument("--model", default="tiny-wan2.1", help="config of the random checkpoint (no --checkpoint)")
    p.add_argument("--layers", type=int, default=None, help="override that config's layer count")
    p.add_argument("--cuda-graphs", action="store_true", help="stages run CUDA graphs (the reference stays eager)")
    p.add_argument("--lora", action="append", default=[], metavar="PATH[:SCALE]", help="LoRA merged by every stage")
    p.add_argument(
        "--timesteps",
        type=_ladders_arg,
        default=None,
        help="ladders, stream i taking the (i mod n)-th, e.g. '700,500,400,200;1000,500' "
        "(default: 1000,750,500,250,125,60 cut to --steps)",
    )
    p.add_argument("--shift", type=_shifts_arg, default=[1.0], help="shifts, stream i taking the (i mod n)-th: 5,1")
    p.add_argument("--update", type=_updates_arg, default=["x0"], help="update rules (x0 | euler), cycled the same way")
    p.add_argument(
        "--v2v", action="store_true", help="even-numbered streams are video-to-video: level 0 from submitted latents"
    )
    p.add_argument(
        "--adaptive",
        action="store_true",
        help="SLO-adaptive streams (1..--steps steps, paced at 4 chunks/s) under a controller calibrated so that "
        "concurrent streams lower their steps: the plan's step changes are replayed by the reference",
    )
    p.add_argument(
        "--guidance",
        type=_guidance_arg,
        default=[1.0],
        help="classifier-free guidance scales in [1, 30], stream i taking the (i mod n)-th: 5,1 (each guided stream"
        " gets a random negative prompt)",
    )
    p.add_argument(
        "--cfg-parallel",
        type=int,
        choices=[1, 2],
        default=1,
        help="2: two pipelines of --stages stages, one per guidance branch, in lockstep",
    )
    p.add_argument(
        "--prompt-update", action="store_true", help="every text stream changes its prompt after its first chunk"
    )
    p.set_defaults(run=main)


def main(args: argparse.Namespace) -> int:
    return run_selftest(
        SelftestConfig(
            stages=args.stages,
            partition=args.partition,
            balance_profile=args.balance_profile,
            sp=args.sp,
            policy=args.policy,
            streams=args.streams,
            chunks=args.chunks,
            steps=args.steps,
            window=args.window or None,
            sink=args.sink,
            batch=args.batch,
            device=args.device,
            dtype=args.dtype,
            checkpoint=args.checkpoint,
            height=args.height,
            width=args.width,
            adaptive=args.adaptive,
            tolerance=args.tolerance,
            model=args.model,
            layers=args.layers,
            cuda_graphs=args.cuda_graphs,
            loras=tuple(args.lora),
            ladders=args.timesteps,
            shifts=args.shift,
            updates=args.update,
            v2v=args.v2v,
            guidance=args.guidance,
            cfg_parallel=args.cfg_parallel,
            prompt_update=args.prompt_update,
        )
    )
