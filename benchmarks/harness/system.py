"""The system a run measures: its checkpoint folder, its start (coordinator, stages, gateway as processes), the
streams a client opens on it (``StreamRecord``) and what the coordinator and stages report."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import threading
import time
from pathlib import Path

import torch

from benchmarks.harness.rows import (
    LADDER,
    TIMESTEPS_FIELD,
    VAE_FOR_MODEL,
    decodable,
    decoders_of,
    frame_stats,
    gpus_of,
    percentile,
)
from coordinator.options import CoordinatorOptions, parse_stage_ms
from gateway.edge.quotas import QuotaOptions
from gateway.options import GatewayOptions
from stage_service.options import StageOptions
from stagecast.flags import add_flags, to_argv
from stagecast.microstep import DEFAULT_MAX_BATCH
from stagecast.model.dit_configs import model_config

# ---- assets ---------------------------------------------------------------------------------------------


def write_assets(root: Path, args) -> None:
    from launcher.demo_checkpoint import write_random_text_encoder, write_tiny_text_encoder, write_tiny_vae

    cfg = model_config(args.model)
    (root / "transformer").mkdir(parents=True)
    (root / "transformer" / "config.json").write_text(json.dumps(cfg, default=list))
    write_tiny_vae(root / "vae", name=VAE_FOR_MODEL[args.model], seed=0)  # the real VAE's config, random weights
    if args.text_encoder == "umt5-xxl":
        # The real UMT5-XXL (5.7B): its config only; the gateway draws the weights on its GPU.
        write_random_text_encoder(root)
    else:  # a 2-layer encoder of the real width
        heads = 8 if cfg["text_dim"] >= 512 else 4
        write_tiny_text_encoder(
            root, d_model=cfg["text_dim"], num_layers=2, num_heads=heads, d_kv=cfg["text_dim"] // heads, d_ff=256
        )
    text_len = 512 if cfg["text_dim"] >= 512 else 16
    defaults = {"text_len": text_len, "width": args.width, "height": args.height, "steps": args.steps}
    # The protocol's ladder as the checkpoint's sampler: n steps run its first n timesteps, which is also what an
    # SLO-adaptive stream (--load-min-steps) switches between.
    defaults["sampler"] = {"ladder": list(LADDER)}
    (root / "stagecast.json").write_text(json.dumps(defaults))
    if "tiny" in decoders_of(args) and not getattr(args, "tiny_decoder", None):
        from launcher.demo_checkpoint import write_tiny_decoder

        patch = 2 if VAE_FOR_MODEL[args.model] == "wan2.2" else 1
        (root / "tiny_decoder").mkdir()
        write_tiny_decoder(root / "tiny_decoder" / "random.pth", latent_channels=cfg["in_channels"], patch_size=patch)


def config_kwargs(args, pace: bool = False, decoder: str | None = None) -> dict:
    """The streams' config.  Throughput streams run unpaced (as fast as the pipeline allows); load rows run paced at
    ``--target-fps`` (what a viewer gets), unless ``--load-unpaced``.  ``decoder``: the first of ``--decoder``."""
    kw = dict(
        decoder=decoder or decoders_of(args)[0],
        pace=pace,
        target_fps=args.target_fps,
        # Load rows with --load-min-steps: SLO-adaptive streams, the controller picks min..--steps per chunk.
        **(dict(min_steps=args.load_min_steps, max_steps=args.steps) if pace and args.load_min_steps else {}),
        width=args.width,
        height=args.height,
        steps=args.steps,
        codec=args.codec,
        chunk_frames=1,
        window=args.window,
        sink=args.sink,
        policy="per_level",
    )
    if TIMESTEPS_FIELD:
        kw["timesteps"] = list(LADDER[: args.steps])
    if args.guidance > 1.0:
        kw["guidance_scale"] = args.guidance
        kw["negative_prompt"] = args.negative_prompt
    return kw


class StreamRecord:
    """One stream read to its end: per-frame arrivals (client clock from the call's start), the gateway's per-chunk
    timestamps, TTFF to the first decodable picture, and optional prompt updates sent at given frames."""

    def __init__(
        self,
        client,
        args,
        seconds: float | None,
        prompt: str,
        updates: dict[int, str] | None = None,
        stop_at: int | None = None,
        pace: bool = False,
        decoder: str | None = None,
    ):
        self.args = args
        self.stop_at = stop_at  # frame index after which an unbounded stream is stopped
        config = config_kwargs(args, pace, decoder)
        self.gen = client.generate(prompt=prompt, seconds=seconds, timeout=1800, **config)
        self.updates = dict(updates or {})
        self.arrivals: list[float] = []
        self.chunks: dict[int, dict] = {}
        self.frame_chunk: list[int] = []
        self.update_sent: list[tuple[float, str]] = []
        # When each PromptUpdated came back (first frame seen after it; the gateway encoded the prompt and the
        # coordinator took it): splits interactive latency into the update's path and the pipeline's lead.
        self.update_acked: list[float] = []
        self.ttff_s: float | None = None
        self.first = None
        self.error: str | None = None
        self.refused = False  # RESOURCE_EXHAUSTED at admission (capacity, count cap or cost budget)
        self.retry_after: float | None = None
        self.steps: dict[int, int] = {}  # denoising steps -> frames of chunks that ran them
        # How the call failed (a refusal: its status code, its details, and seconds from the call to the error).
        self.error_code: str | None = None
        self.error_details: str | None = None
        self.error_s: float | None = None
        # Set at the first frame, or when the stream ends without one (the capacity mode waits on it).
        self.started = threading.Event()

    def run(self) -> StreamRecord:
        seen = b""
        try:
            for frame in self.gen:
                now = frame.timing.received_s  # the SDK's clock, from just before the call sent its config
                self.arrivals.append(now)
                self.started.set()
                self.frame_chunk.append(frame.chunk)
                self.steps[frame.steps] = self.steps.get(frame.steps, 0) + 1
                if frame.chunk not in self.chunks:
                    t = frame.timing
                    self.chunks[frame.chunk] = {
                        "chunk": frame.chunk,
                        "latents_ms": round(t.latents_ms, 2),
                        "decoded_ms": round(t.decoded_ms, 2),
                        "encoded_ms": round(t.encoded_ms, 2),
                        "received_ms": round(now * 1e3, 2),
                    }
                if self.ttff_s is None:
                    seen += frame.data
                    if decodable(self.args.codec, seen):
                        self.ttff_s, self.first = now, frame
                acked = getattr(self.gen, "prompt_updates", [])
                while len(self.update_acked) < len(acked):
                    self.update_acked.append(now)
                prompt = self.updates.pop(frame.index, None)
                if prompt is not None:
                    self.update_sent.append((time.monotonic() - self.gen.t0, prompt))
                    self.gen.update_prompt(prompt)
                if frame.index == self.stop_at:
                    self.gen.stop()
        except Exception as exc:  # noqa: BLE001 - recorded; a load row reports failed streams
            self.error_s = time.monotonic() - self.gen.t0
            self.error = f"{type(exc).__name__}: {exc}"
            self.refused = not self.arrivals and "RESOURCE_EXHAUSTED" in str(exc)
            self.retry_after = getattr(exc, "retry_after", None)
            code = getattr(exc, "code", None)
            self.error_code = getattr(code, "name", None) or (str(code) if code is not None else None)
            self.error_details = getattr(exc, "details", None) or str(exc)
        finally:
            self.started.set()
        return self

    def stats(self) -> dict:
        return frame_stats(self.arrivals, self.args.target_fps)

    def json(self) -> dict:
        return {
            "pipeline_stream_id": self.gen.info.pipeline_stream_id if self.arrivals else None,
            "ttff_s": self.ttff_s,
            **self.stats(),
            "steps": {str(k): v for k, v in sorted(self.steps.items())},
            "refused": self.refused,
            "retry_after_s": self.retry_after,
            "error": self.error,
            "arrivals_s": [round(x, 5) for x in self.arrivals],
            "gateway_chunks": [self.chunks[c] for c in sorted(self.chunks)],
        }


def ttff_parts(timing, ttff_s: float, info=None) -> dict:
    """Where the first frame's time went, from the gateway's timestamps on it (ms since it got the config).

    ``pipeline``: prompt encoding, the coordinator's open, every stage and the hops back to the gateway, up to the
    first chunk's latents; ``vae``: decoding that chunk; ``encode``: the frame's codec; ``rest``: the client's
    request reaching the gateway and the frame reaching the client.  With the stream's ``StreamInfo`` from a gateway
    that stamps its opening, ``pipeline`` is also split: ``prompt`` (the prompt's encoding), ``open`` (the
    coordinator's admission, the OpenStream call) and ``first_chunk`` (from then to the first chunk's latents: the
    wait for the stages and the forwards).
    """
    parts = {
        "pipeline": timing.latents_ms,
        "vae": timing.decoded_ms - timing.latents_ms,
        "encode": timing.encoded_ms - timing.decoded_ms,
        "rest": ttff_s * 1e3 - timing.encoded_ms,
    }
    if info is not None and info.opened_ms > 0:  # 0: a gateway that does not stamp its opening
        parts.update(
            prompt=info.prompt_ms,
            open=info.opened_ms - info.prompt_ms,
            first_chunk=timing.latents_ms - info.opened_ms,
        )
    return parts


# ---- the system -----------------------------------------------------------------------------------------


# What start_system reads beyond a benchmark's own flags: the values of one plain pipeline, for the other
# benchmark scripts (video-to-video, WebRTC) that start a system through it.
ONE_PIPELINE = {
    "load": [],
    "gateway_gpu": None,
    "vae_gpus": None,
    "vae_split": None,
    "balance_profile": None,
    "sp": 1,
    "cfg_parallel": 1,
    "slo_vae_ms": None,
    "slo_stage_ms": None,
    "capacity": False,
    "capacity_max": 0,
    "fp8": False,
}


def system_flags(ap, *, steps: int, stages: int, steps_help: str | None = None) -> None:
    """The flags of the benchmarks that start a system through ``start_system`` (webrtc, v2v_bench,
    kv_admission_check): the model and frame size, steps, the topology, dtype, CUDA graphs, the compiled VAE, the
    text encoder and the KV window (the benchmark protocol's 6 latent frames, 3 of them sinks)."""
    ap.add_argument("--model", default="wan2.1-1.3b")
    ap.add_argument("--width", type=int, default=832)
    ap.add_argument("--height", type=int, default=480)
    ap.add_argument("--steps", type=int, default=steps, help=steps_help)
    ap.add_argument("--stages", type=int, default=stages)
    ap.add_argument("--partition", default=None)
    ap.add_argument("--batch", type=int, default=DEFAULT_MAX_BATCH)
    ap.add_argument("--dtype", default="bfloat16")
    add_flags(ap, StageOptions, only=["cuda_graphs"])  # passed to every stage as its own flag
    add_flags(ap, GatewayOptions, only=["vae_compile"])  # passed to the gateway
    ap.add_argument("--text-encoder", default=None, choices=["umt5-xxl", "tiny"])
    ap.add_argument("--window", type=int, default=6, help="KV window in latent frames (protocol: 6)")
    ap.add_argument("--sink", type=int, default=3, help="sink frames of the window (protocol: 3)")


def smoke_system(args) -> None:
    """A smoke run's system: the tiny model at 64x64 on 2 float32 stages, on the CPU (``system_device``)."""
    args.model, args.width, args.height, args.stages, args.dtype = "tiny-wan2.1", 64, 64, 2, "float32"


def system_device(args) -> str:
    """ "cuda" where a GPU is visible and this is not a smoke run, else "cpu"; fills the text encoder that goes with
    it (UMT5-XXL on a GPU, the tiny one on a CPU) where ``--text-encoder`` was not given, and every ONE_PIPELINE
    attribute the benchmark's flags lack."""
    device_kind = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    if args.text_encoder is None:
        args.text_encoder = "umt5-xxl" if device_kind == "cuda" else "tiny"
    with_one_pipeline_defaults(args)
    return device_kind


def with_one_pipeline_defaults(args):
    """Give args every ONE_PIPELINE attribute it lacks (its own flags win); returns it."""
    for name, value in ONE_PIPELINE.items():
        if not hasattr(args, name):
            setattr(args, name, list(value) if isinstance(value, list) else value)
    return args


def start_system(launcher, root: Path, args, device_kind: str):
    from launcher.local_cluster import start_pipeline

    stage_device = "cuda" if device_kind == "cuda" else "cpu"
    ranks = gpus_of(args)  # one GPU per stage rank
    vae_devices = vae_devices_of(args, device_kind)
    partition, vae_split = balance(root, args, device_kind, vae_devices)
    gw_device = f"cuda:{args.gateway_gpu if args.gateway_gpu is not None else ranks - 1}"
    tiny = getattr(args, "tiny_decoder", None)  # else a tiny decoder, if listed, is the checkpoint's tiny_decoder/
    shares = memory_shares(root, args, device_kind, partition, gw_device, vae_devices, tiny)
    pipe = start_pipeline(
        launcher,
        # Random weights of the config written in root (write_assets): the stages then calibrate and pre-capture at
        # root's stagecast.json serving size, the size the gateway serves (--width x --height).
        checkpoint=f"random:{root / 'transformer'}",
        stages=args.stages,
        sp=args.sp,
        cfg_parallel=args.cfg_parallel,
        partition=partition,
        device=stage_device,
        dtype=args.dtype,
        max_batch=args.batch,
        max_streams=max(16, most_streams(args) + 2),
        record_plan=True,  # the interactive-latency measurement reads each prompt update's first chunk from it
        cuda_graphs=args.cuda_graphs and device_kind == "cuda",
        fp8=args.fp8,
        coordinator_args=coordinator_args(args),
        stage_extra_args=stage_extra_args(args),
        rank_args=shares.stage_args(),  # --device-memory-gib of a stage whose GPU the gateway shares
        wait=False,  # the gateway loads its models while the stages load theirs
    )
    most = max(8, most_streams(args) + 2)
    gateway_options = GatewayOptions(
        coordinator=pipe.coordinator,
        checkpoint=str(root),
        port=0,
        device=gw_device if device_kind == "cuda" else "cpu",
        vae_dtype=args.dtype,
        # The benchmarks open every stream from one client, unpaced ones too (--load-unpaced, the KV admission check).
        max_streams=most,
        quotas=QuotaOptions(unpaced=most),
        vae_compile=args.vae_compile and device_kind == "cuda",
        vae_cuda_graphs=getattr(args, "vae_cuda_graphs", False),  # the other benchmarks here lack these flags
        tiny_cuda_graphs=getattr(args, "tiny_cuda_graphs", False),
        vae_cudnn_benchmark=getattr(args, "vae_cudnn_benchmark", False),
        pipeline_warmup_s=None if getattr(args, "pipeline_warmup", True) else 0.0,
        vae_devices=vae_devices,
        vae_split=[int(v) for v in vae_split.split(",")] if vae_split else None,
        tiny_decoder=os.path.abspath(tiny) if tiny else None,
        device_memory_gib=shares.gateway_share(),
    )
    gw_args = ["gateway", *to_argv(gateway_options)]
    gateway = launcher.start("gateway", gw_args)
    pipe.wait_ready(launcher, 600.0)
    launcher.wait_ready(gateway, timeout=900)
    return pipe, gateway.info["address"]


def memory_shares(root: Path, args, device_kind: str, partition, gw_device: str, vae_devices, tiny, totals=None):
    """On GPUs, the shares of every GPU the stages and the gateway share, planned as ``stagecast up`` plans them
    (``launcher.memory_plan``; a ``Plan`` whose ``stage_args()`` and ``gateway_share()`` give each its
    ``--device-memory-gib``); raises ValueError naming the part to move when a GPU holds no stream.  ``totals``: each
    GPU's bytes (default: torch's)."""
    import argparse

    from launcher.local_cluster import Placement
    from launcher.pipeline_start import Plan
    from launcher.up import plan_memory

    if device_kind != "cuda":
        return Plan(None, partition, None)
    extra = stage_extra_args(args)
    kv = float(extra[extra.index("--kv-budget-gib") + 1]) if "--kv-budget-gib" in extra else 0.0
    ranks = gpus_of(args)
    placement = Placement([f"cuda:{i}" for i in range(ranks)], gw_device, vae_devices or [gw_device])
    flags = argparse.Namespace(
        checkpoint=str(root), stages=args.stages, sp=args.sp, cfg_parallel=args.cfg_parallel, device="cuda",
        dtype=args.dtype, cuda_graphs=args.cuda_graphs, gateway_port=0, tiny_decoder=tiny, default_decoder="full",
        vae_cuda_graphs=getattr(args, "vae_cuda_graphs", False), kv_budget_gib=kv, decoder_memory_gib=0.0, pipelines=1,
        tiny_cuda_graphs=getattr(args, "tiny_cuda_graphs", False),
    )  # fmt: skip
    return plan_memory(flags, Plan(placement, partition, None), totals=totals, who="harness")


def stage_extra_args(args) -> list[str]:
    """What every stage's command line gets beyond ``start_pipeline``'s own: a benchmark's ``stage_extra_args``
    (e.g. ``--kv-budget-gib``) and the harness's ``--dit-levers``."""
    extra = list(getattr(args, "stage_extra_args", None) or [])
    if getattr(args, "dit_levers", ""):
        extra += ["--dit-levers", args.dit_levers]
    return extra


def most_streams(args) -> int:
    """The most streams a run opens at once: its largest load row, ``--capacity-max`` (plus the one refused), or its
    burst."""
    capacity = getattr(args, "capacity_max", 0) + 1 if getattr(args, "capacity", False) else 1
    return max(max(args.load or [1]), capacity, getattr(args, "burst", 0))


def vae_what_if(value) -> dict[str, float] | None:
    """``--slo-vae-ms`` as the coordinator's ``--vae-ms-per-chunk`` (None: the gateway's measurements): a KIND=MS
    dict, or a number (older result files: the full VAE's ms; 0 there meant none)."""
    if isinstance(value, dict):
        return value or None
    return {"full": float(value)} if value else None


def coordinator_args(args) -> list[str]:
    """The SLO model's fixed parts: ``--slo-vae-ms`` (the VAE's ms per chunk), ``--slo-stage-ms`` (the stages' ms,
    kept fixed: the coordinator's ``--stage-ms ... --slo-fixed``)."""
    stage_ms = getattr(args, "slo_stage_ms", None)
    options = CoordinatorOptions(
        stages=args.stages,
        vae_ms_per_chunk=vae_what_if(args.slo_vae_ms),
        stage_ms=parse_stage_ms(stage_ms) if stage_ms else None,
        slo_learn=not stage_ms,
        pace_grid=getattr(args, "pace_grid", CoordinatorOptions.pace_grid),
        lookahead=getattr(args, "lookahead", None),
        gpu_sharing=getattr(args, "gpu_sharing", CoordinatorOptions.gpu_sharing),
    )
    only = ["vae_ms_per_chunk", "stage_ms", "slo_learn", "pace_grid", "lookahead", "gpu_sharing"]
    return to_argv(options, only=only)


def vae_devices_of(args, device_kind: str) -> list[str]:
    """The devices the gateway's VAE is cut over: ``--vae-gpus`` or every stage rank's GPU."""
    if device_kind != "cuda":
        return ["cpu", "cpu"]  # CPU smoke: the same pipelined path, two slices on the CPU
    vae_gpus = args.vae_gpus if args.vae_gpus is not None else ",".join(str(i) for i in range(gpus_of(args)))
    return [f"cuda:{g}" for g in vae_gpus.split(",")]


def balance(
    root: Path, args, device_kind: str, vae_devices: list[str], announce: bool = True
) -> tuple[str | None, str | None]:
    """``--partition`` and ``--vae-split`` as given, or with ``--partition auto`` both from the planner over
    ``--balance-profile`` (the profile must match the model, steps and size of this run); the plan and its predicted
    per-GPU times go into ``args.balance`` (and so into the result's JSON)."""
    from launcher.balance import check_flags, resolve_balance

    check_flags(args.partition, args.balance_profile, args.sp, args.cfg_parallel)
    if args.partition != "auto":
        return args.partition, args.vae_split
    if args.vae_split:
        raise ValueError("--vae-split: with --partition auto the VAE cut is the planner's (give one of them)")
    stages = [f"cuda:{i}" for i in range(args.stages)] if device_kind == "cuda" else ["cpu"] * args.stages
    choice = resolve_balance(
        args.balance_profile,
        transformer=f"random:{args.model}",
        stage_devices=stages,
        vae_folder=root / "vae",
        vae_devices=vae_devices,
    )
    choice.profile.check_run(steps=args.steps, width=args.width, height=args.height)
    if announce:
        print(f"[harness] {choice.describe()}", flush=True)
    plan = choice.plan
    args.balance = {
        "partition": plan.partition,
        "vae_split": plan.vae_split,
        "predicted_gpu_ms": {str(g): ms for g, ms in plan.gpu_ms.items()},
        "predicted_bottleneck_ms": plan.bottleneck_ms,
        "profile": str(args.balance_profile),
        "profile_device": choice.profile.device,
    }
    split = choice.vae_split
    return plan.partition, ",".join(map(str, split)) if split else None


def coordinator_status(coordinator: str, launcher):
    """The coordinator's Status over the launcher's operator certificate (the coordinator is mTLS)."""
    from stagecast.internal.v1 import pipeline_pb2 as pb
    from stagecast.internal.v1 import pipeline_pb2_grpc as pb_grpc

    with launcher.channel(coordinator, "coordinator") as ch:
        return pb_grpc.CoordinatorServiceStub(ch).Status(pb.Empty(), timeout=10)


def slo_model(status) -> dict:
    """What the coordinator's SLO model prices: the stages calibrated at READY, the full VAE's cost per chunk (the
    gateway's measurement, or the operator's --vae-ms-per-chunk), and each decoder kind's (``decoders``: per chunk
    alone, per stream at 1..n a call, and the streams its calls formed), and the Stream Batch the scheduler forms
    (``max_batch``: picked from the calibrations)."""
    return {
        "calibrated_stages": list(status.calibrated_stages),
        "max_batch": status.max_batch,
        "vae_chunk_ms": round(status.vae_chunk_ms, 3),
        "vae_source": status.vae_source,
        "decoders": {
            d.decoder: {
                "chunk_ms": round(d.chunk_ms, 3),
                "batch_ms": [round(ms, 3) for ms in d.batch_ms],
                "formed_batch": round(d.formed_batch, 3),
                "source": d.source,
            }
            for d in status.decoders
        },
    }


def stage_stats(coordinator: str, launcher) -> list[dict]:
    return [
        {
            "index": s.index,
            "batches": s.batches,
            "forward_ms": s.forward_ms_total,
            "micro_steps": s.micro_steps,
            "wait_ms": s.wait_ms_total,
            "exchange_ms": s.exchange_ms_total,
            "eager_batches": s.eager_batches,
        }
        for s in coordinator_status(coordinator, launcher).stage_stats
    ]


def plan_prompt_chunks(coordinator: str, launcher) -> dict[int, list[int]]:
    """Per pipeline stream, the first chunk of each prompt update, in order (from the recorded plan)."""
    from stagecast.internal.v1 import pipeline_pb2 as pb
    from stagecast.internal.v1 import pipeline_pb2_grpc as pb_grpc

    with launcher.channel(coordinator, "coordinator", [("grpc.max_receive_message_length", 1 << 30)]) as ch:
        dump = pb_grpc.CoordinatorServiceStub(ch).GetPlan(pb.PlanRequest(), timeout=60)
    out: dict[int, list[int]] = {}
    for ev in dump.events:
        if ev.HasField("prompt"):
            out.setdefault(ev.prompt.stream_id, []).append(ev.prompt.from_chunk)
    return out


class LeadSampler:
    """Samples every stream's lead (chunks started - consumed, and its bound) from the coordinator while it runs."""

    def __init__(self, coordinator: str, launcher, period: float = 0.25):
        import threading

        self.coordinator, self.launcher, self.period = coordinator, launcher, period
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        t0 = time.perf_counter()
        while not self._stop.wait(self.period):
            try:
                status = coordinator_status(self.coordinator, self.launcher)
            except Exception:  # noqa: BLE001 - a missed sample
                continue
            for s in status.streams:
                self.samples.append(
                    {
                        "t_s": round(time.perf_counter() - t0, 3),
                        "stream": s.stream_id,
                        "lead": s.started - s.consumed,
                        "bound": s.bound,
                        "max_lead": s.max_lead,
                    }
                )

    def __enter__(self) -> LeadSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self) -> dict:
        if not self.samples:
            return {"max": None, "bound": None, "samples": []}
        return {
            "max": max(s["max_lead"] for s in self.samples),
            "bound": max(s["bound"] for s in self.samples),
            "samples": self.samples,
        }


def gpu_memory() -> list[int]:
    try:
        out = subprocess.check_output(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"], text=True
        )
        return [int(x) for x in out.split()]
    except (OSError, subprocess.CalledProcessError):
        return []


def interactive_latencies(rec: StreamRecord, from_chunks: list[int]) -> list[float]:
    """For each update: from sending it to the arrival of the first frame of the chunk it first applies to."""
    out = []
    for (sent, _), chunk in zip(rec.update_sent, from_chunks):
        arrived = [t for t, c in zip(rec.arrivals, rec.frame_chunk) if c >= chunk]
        if arrived:
            out.append((arrived[0] - sent) * 1e3)
    return out


def load_row(n: int, recs: list[StreamRecord]) -> dict:
    ok = [r for r in recs if not r.error and len(r.arrivals) > 2]
    on_time = [r.stats()["on_time"] or 0.0 for r in ok]
    streams = [r.json() for r in recs]
    for s in streams:
        s.pop("arrivals_s")  # per-frame arrivals are kept for the single streams; a load row keeps the summaries
        s.pop("gateway_chunks")
    ttffs = [r.ttff_s for r in ok if r.ttff_s is not None]
    first = min((r.arrivals[0] for r in ok), default=0.0)
    last = max((r.arrivals[-1] for r in ok), default=0.0)
    return {
        "streams": n,
        "failed": n - len(ok),
        "per_stream": streams,
        "steady_fps_min": min((s["steady_fps"] or 0.0 for s in streams if not s["error"]), default=None),
        "steady_fps_mean": statistics.mean(s["steady_fps"] or 0.0 for s in streams if not s["error"]) if ok else None,
        "on_time_min": min((s["on_time"] or 0.0 for s in streams if not s["error"]), default=None),
        "ttff_p50_s": statistics.median(ttffs) if ttffs else None,
        "ttff_p95_s": percentile(ttffs, 0.95) if ttffs else None,
        "aggregate_fps": sum(len(r.arrivals) - 1 for r in ok) / (last - first) if last > first else None,
        # Streams held: admitted and >= 99% of frames on time; refused: RESOURCE_EXHAUSTED at once (capacity).
        "held": sum(x >= 0.99 for x in on_time),
        "refused": sum(r.refused for r in recs),
        "all_held": bool(ok) and all(x >= 0.99 for x in on_time),
        "steps": [{str(k): v for k, v in sorted(r.steps.items())} for r in ok],
    }


def stage_delta(before: list[dict], after: list[dict]) -> list[dict]:
    """Per stage over an interval: batches, micro-steps, the mean batch (micro-steps per batch) and the mean forward
    ms per batch (a 1-step chunk's DiT time on that stage at that batch)."""
    out = []
    for b, a in zip(before, after):
        batches = a["batches"] - b["batches"]
        micro = a["micro_steps"] - b["micro_steps"]
        out.append(
            {
                "index": a["index"],
                "batches": batches,
                "micro_steps": micro,
                "mean_batch": micro / batches if batches else None,
                "mean_forward_ms": (a["forward_ms"] - b["forward_ms"]) / batches if batches else None,
                # Batches that ran without a CUDA graph on a stage that has them (a signature not captured).
                "eager_batches": a.get("eager_batches", 0) - b.get("eager_batches", 0),
            }
        )
    return out
