"""Benchmark harness v2: what a viewer sees, from the real system, beside the single-GPU peers and the compute floor.

Usage (on a machine with GPUs; one command per configuration)::

    python -m benchmarks.harness --model wan2.1-1.3b --steps 1 --stages 2 --cuda-graphs --vae-compile \
        --load 1,2,4,8 --json benchmarks/results/v2_13b_1step_2gpu.json
    python -m benchmarks.harness --smoke          # CPU, tiny model, a few seconds (CI runs this)
    python -m benchmarks.harness --steps 1 --stages 1 --cfg-parallel 2 --guidance 5 ...   # CFG-parallel on 2 GPUs
    python -m benchmarks.harness ... --partition auto --balance-profile profile.json   # stages and VAE cut planned
                                                  # from a measured profile (python -m benchmarks.balance)
    python -m benchmarks.harness ... --decoder full,tiny   # every stream on the full VAE, and the main stream again
                                                  # on a tiny decoder (random weights, or --tiny-decoder PATH)
    python -m benchmarks.harness --stages 1 --decoder tiny,full --capacity --seconds 0 --first-seconds 0 \
        --ttff-runs 0 --interactive-updates 0 --no-peers ...   # capacity rows only (benchmarks/gpu_suite.sh capacity-*)
    python -m benchmarks.harness --smoke --capacity --slo-stage-ms 320,320   # CPU: the capacity mode, refused past 2
    python -m benchmarks.report                   # BENCHMARKS.md's tables from benchmarks/results/v2_*.json

What one run does (the benchmark protocol, BENCHMARKS.md):

1. writes a checkpoint folder holding the real VAE / DiT *configs* (stages build their own random slices on their
   GPUs from its transformer config: ``--checkpoint random:<folder>/transformer``, so they calibrate at its serving
   size) and the real-size UMT5-XXL text encoder, built with random weights on the
   gateway's GPU (``--text-encoder tiny`` for a 2-layer one);
2. the **compute floor**: FLOPs per video frame (the DiT at every step, the KV-window attention, the VAE) counted with
   ``torch.utils.flop_counter``, over a bf16 matmul peak measured here, times the GPU count;
3. the **peers**, on one GPU, sequential: diffusers eager (``WanTransformer3DModel`` every step, then the
   ``AutoencoderKLWan`` chunk decode), and the same work under ``torch.compile`` (DiT and VAE decoder);
4. **cold start**: coordinator, N stages and the gateway as processes (gRPC + NCCL), timed to READY (the gateway
   serving); then the **first stream after READY** (``--first-seconds``), measured on its own;
5. the **main stream**, ``--seconds`` of video (60 by default): per-frame arrivals at the client, steady FPS over the
   middle 40% of frames (the DiT is still producing there: the lead is bounded), whole-stream FPS beside it, and at
   ``--target-fps``: the share of frames on time (frame i due at the first frame's arrival + i / fps), the max and
   p99 gap between frames and the count of gaps over 250 ms; the lead (chunks started - consumed) sampled from the
   coordinator; the gateway's timestamps per chunk;
6. **TTFF** over fresh prompts, to the first decodable picture (for h264, the first fragment), split by the
   gateway's timestamps; **interactive latency**: PromptUpdate to the first frame of the first chunk generated under
   the new prompt (the coordinator's recorded plan names that chunk);
7. **load** (``--load 1,2,4,8``): N concurrent streams, per-stream steady FPS, on-time share, TTFF p50/p95, and the
   aggregate;
8. **capacity** (``--capacity``), once per ``--decoder`` listed (every stream closed between): paced streams
   (``--target-fps``; SLO-adaptive with ``--load-min-steps``) opened one at a time, each once the previous one's first
   frame arrived, until admission refuses one or ``--capacity-max`` are open.  The refusal: its status code, details
   and ms from the request to the error ("at once" is well under a second).  Then every admitted stream runs
   ``--capacity-seconds`` more, the **measured window**, and is stopped.  Per stream: TTFF, the on-time share of the
   frames due inside the window (frame i due at its first frame + i / fps, as above; **held** at >= 99%), its
   on-time share from the first frame (the ramp included), steady FPS over the window, freezes (gaps > 250 ms).  Per
   row: admitted, held, ``capacity`` (the held count only where admission refused the stream right past them and
   every admitted one held; else None, and ``verdict`` says which: admitted but not held, no refusal up to the max,
   failed), TTFF p50/p95, the steps the SLO controller chose (the coordinator's status per stream, sampled), each
   stage's batch and ms per forward over the window (and, in ``ramp``, between successive admissions), memory per
   stream (the gateway's ``vae_state_bytes`` per active stream; the stages' ``kv_bytes`` per open stream, from their
   ``Describe``, summed over stages; read with ``getattr``, None where a status lacks them) and the gateway process's
   CPU seconds over the window (``/proc/<pid>/stat``) per frame delivered;
9. JSON with all of it, the versions (torch, CUDA, NCCL, diffusers, driver, GPU count), the commit and whether the
   tree was dirty.  What is measured is also in ``<json>.partial`` as each phase ends; a run cut by SIGTERM (e.g.
   ``timeout``) writes it as its result with ``partial`` saying where it was cut, and exits 124.

Parts a run may skip (a capacity run fits a 10-minute device call so): ``--first-seconds 0`` (no first stream),
``--seconds 0`` (no main stream), ``--ttff-runs 0``, ``--interactive-updates 0``, no ``--load``, ``--no-peers`` (no
peers and no floor: the DiT is never built in the harness's process).  ``--slo-stage-ms`` fixes the coordinator's SLO
model (``--stage-ms ... --slo-fixed``; tests and what-ifs).

Decoders (``--decoder full|tiny|full,tiny``): every measured stream asks for the first decoder listed; the main
stream runs once more for each other one, in the same system right after it, and ``system.main_by_decoder`` holds
each one's steady FPS side by side.  The gateway gets ``--tiny-decoder PATH`` when given, else (when a tiny decoder is
listed) a tiny decoder with random weights written into the checkpoint's ``tiny_decoder/`` (the protocol's random
weights; ``launcher.demo_checkpoint.write_tiny_decoder``).

Classifier-free guidance (``--guidance 5``): every stream runs a conditional and an unconditional branch (the
negative prompt, ``--negative-prompt``, empty by default), sequentially through one pipeline of ``--stages`` stages,
or with ``--cfg-parallel 2`` on two pipelines of ``--stages`` stages each (``stages x 2`` GPUs).  The peers and the
floor count both branches.  ``system.comm`` gives the communication per denoising step: each stage's host time
blocked on data-plane receives per batch, the CFG-parallel exchange time per batch of the last stages, and the
bytes a micro-step puts on the data plane.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import torch

from coordinator.options import CoordinatorOptions, parse_stage_ms
from gateway.options import GatewayOptions
from gateway.quotas import QuotaOptions
from stage_service.options import StageOptions
from stagecast.api import DEFAULT_FPS
from stagecast.flags import add_flags, to_argv
from stagecast.microstep import DEFAULT_MAX_BATCH
from stagecast.model.dit_configs import model_config

VAE_FOR_MODEL = {
    "wan2.1-1.3b": "wan2.1",
    "wan2.1-14b": "wan2.1",
    "wan2.2-ti2v-5b": "wan2.2",
    "tiny-wan2.1": "tiny-wan2.1",
}
# StreamDiffusionV2's configs: timesteps truncated to the step count (the protocol in BENCHMARKS.md).
LADDER = (700.0, 500.0, 400.0, 200.0)


def _has_timesteps_field() -> bool:
    """Whether the public StreamConfig takes an explicit ladder; without it the gateway's own ladder is used (the
    ladder's values do not change the work per step, so speed figures are comparable either way)."""
    from stagecast.v1 import stream_pb2 as pb

    return "timesteps" in pb.StreamConfig.DESCRIPTOR.fields_by_name


TIMESTEPS_FIELD = _has_timesteps_field()


def git_commit() -> str:
    if os.environ.get("STAGECAST_COMMIT"):  # the device machine gets a copy of the tree without .git
        return os.environ["STAGECAST_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def gpu_name() -> str:
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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


def decoders_of(args) -> list[str]:
    """``--decoder``'s list ("full,tiny" -> ["full", "tiny"]); ["full"] for benchmarks without the flag."""
    return list(getattr(args, "decoders", None) or ["full"])


def decoder_list(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names or any(n not in ("full", "tiny") for n in names) or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"expected full, tiny or both (e.g. full,tiny), got {text!r}")
    return names


# ---- floor ----------------------------------------------------------------------------------------------


def matmul_peak_tflops(device: torch.device, n: int) -> float:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    sync(device)
    reps = 10
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync(device)
    return 2 * n**3 * reps / (time.perf_counter() - t) / 1e12


def build_peer(args, device, dtype):
    from diffusers import AutoencoderKLWan, WanTransformer3DModel

    from stagecast.model.vae_configs import vae_config

    torch.manual_seed(0)
    with torch.device(device):
        dit = WanTransformer3DModel(**model_config(args.model)).to(dtype).eval().requires_grad_(False)
        vae = AutoencoderKLWan(**vae_config(VAE_FOR_MODEL[args.model])).to(dtype).eval().requires_grad_(False)
    return dit, vae


def latent_geometry(args, vae) -> tuple[int, int, int]:
    from stagecast.model.vae_configs import spatial_factor

    f = spatial_factor(dict(vae.config))
    return vae.config.z_dim, args.height // f, args.width // f


def flops_per_frame(args, dit, vae, device, dtype, text_len) -> dict:
    from torch.utils.flop_counter import FlopCounterMode

    from gateway.stream_vae import StreamVAE

    c, h, w = latent_geometry(args, vae)
    x = torch.randn(1, c, 1, h, w, device=device, dtype=dtype)
    text = torch.randn(1, text_len, dit.config.text_dim, device=device, dtype=dtype)
    with torch.no_grad(), FlopCounterMode(display=False) as fc:
        dit(x, torch.tensor([500.0], device=device), text)
    dit_flops = fc.get_total_flops()
    # KV window attention (not in a single-chunk forward): q.k and p.v over the cached frames, every layer.
    tokens = h // 2 * (w // 2)
    d = dit.config.num_attention_heads * dit.config.attention_head_dim
    window_flops = 4 * tokens * (args.window * tokens) * d * dit.config.num_layers
    sv = StreamVAE(vae)
    state = sv.new_state()
    with torch.no_grad():
        sv.decode_chunk(state, torch.randn(1, c, 1, h, w, device=device, dtype=dtype))  # frame 0: 1 video frame
        with FlopCounterMode(display=False) as fc:
            sv.decode_chunk(state, torch.randn(1, c, 1, h, w, device=device, dtype=dtype))
    vae_flops = fc.get_total_flops()
    sv.release(state)
    # Guidance runs the DiT twice per step (conditional and unconditional branch).
    per_latent = args.steps * branches_of(args) * (dit_flops + window_flops) + vae_flops
    return {
        "dit_tflop_per_forward": dit_flops / 1e12,
        "window_tflop_per_forward": window_flops / 1e12,
        "vae_tflop_per_latent_frame": vae_flops / 1e12,
        "tflop_per_video_frame": per_latent / 4 / 1e12,
    }


def run_peer(args, dit, vae, device, dtype, text_len, chunks: int, compiled: bool = False) -> dict:
    """diffusers, one GPU, sequential: every step of a chunk through the whole DiT, then VAE decode; eager, or with
    ``torch.compile`` on the DiT and the VAE decoder (compiled during the warm-up chunks, not timed)."""
    from gateway.stream_vae import StreamVAE

    c, h, w = latent_geometry(args, vae)
    text = torch.randn(1, text_len, dit.config.text_dim, device=device, dtype=dtype)
    negative = torch.randn(1, text_len, dit.config.text_dim, device=device, dtype=dtype)
    model = torch.compile(dit, dynamic=False) if compiled else dit
    sv = StreamVAE(vae, compile=compiled)
    state = sv.new_state()
    timesteps = LADDER[: args.steps]
    frames, warm = 0, 3 if compiled else 2
    t0 = time.perf_counter()
    with torch.no_grad():
        for i in range(chunks + warm):
            if i == warm:  # warm-up chunks: frame 0 decodes alone, then the cache settles (and compiles run)
                sync(device)
                start, frames = time.perf_counter(), 0
            x = torch.randn(1, c, 1, h, w, device=device, dtype=dtype)
            for t in timesteps:
                v = model(x, torch.tensor([t], device=device), text, return_dict=False)[0]
                if args.guidance > 1.0:  # diffusers' WanPipeline: a second call with the negative prompt
                    u = model(x, torch.tensor([t], device=device), negative, return_dict=False)[0]
                    v = u + args.guidance * (v - u)
                x = x - (t / 1000.0) * v
            video = sv.decode_chunk(state, x)
            frames += video.shape[2]
        sync(device)
    elapsed = time.perf_counter() - start
    sv.release(state)
    return {"fps": frames / elapsed, "frames": frames, "seconds": elapsed, "warmup_s": start - t0}


# ---- what the viewer sees -------------------------------------------------------------------------------


_T0 = time.perf_counter()


def log(phase: str) -> None:
    print(f"[harness] {phase} done at {time.perf_counter() - _T0:.1f} s", flush=True)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 1])."""
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, round(q * len(ordered)) - 1))]


def frame_stats(arrivals: list[float], target_fps: float, middle: tuple[float, float] = (0.3, 0.7)) -> dict:
    """Steady FPS over the middle of the frames, whole-stream FPS, and punctuality at ``target_fps``.

    Frame i is due at arrivals[0] + i / target_fps; a gap is the time between two consecutive frames' arrivals.
    ``late_first_s`` counts the late frames due in the stream's first second and ``late_after_first_s`` the rest: a
    stream whose only late frames are its first few (chunk 1 arriving less than one frame after chunk 0) is told
    apart from one that falls behind while it runs.
    """
    n = len(arrivals)
    out = {"frames": n, "first_s": arrivals[0] if n else None, "last_s": arrivals[-1] if n else None}
    if n < 3:
        return {**out, "steady_fps": None, "whole_fps": None, "on_time": None, "max_gap_ms": None}
    a, b = int(n * middle[0]), max(int(n * middle[0]) + 2, int(n * middle[1]))
    b = min(b, n)
    gaps = [(arrivals[i] - arrivals[i - 1]) * 1e3 for i in range(1, n)]
    late = [arrivals[i] - (arrivals[0] + i / target_fps) for i in range(n)]
    return {
        **out,
        "steady_fps": (b - a - 1) / (arrivals[b - 1] - arrivals[a]) if arrivals[b - 1] > arrivals[a] else None,
        "steady_window": [a, b],
        "whole_fps": (n - 1) / (arrivals[-1] - arrivals[0]),
        "target_fps": target_fps,
        "on_time": sum(x <= 1e-9 for x in late) / n,
        "late_first_s": sum(x > 1e-9 for i, x in enumerate(late) if i < target_fps),
        "late_after_first_s": sum(x > 1e-9 for i, x in enumerate(late) if i >= target_fps),
        "max_late_ms": max(late) * 1e3,
        "max_gap_ms": max(gaps),
        "p99_gap_ms": percentile(gaps, 0.99),
        "gaps_over_250ms": sum(g > 250.0 for g in gaps),
    }


def decodable(codec: str, seen: bytes) -> bool:
    """Whether the bytes received so far hold a picture: every JPEG/raw frame does; fMP4 once a fragment is in."""
    return codec != "h264" or b"moof" in seen


def gpus_of(args) -> int:
    """Stage processes (one GPU each on a GPU machine): pipeline stages x sequence-parallel ranks x CFG groups."""
    return args.stages * args.sp * args.cfg_parallel


def branches_of(args) -> int:
    return 2 if args.guidance > 1.0 else 1


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
    "slo_vae_ms": 0.0,
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
        stage_extra_args=list(getattr(args, "stage_extra_args", None) or []),  # e.g. --kv-budget-gib
        wait=False,  # the gateway loads its models while the stages load theirs
    )
    gw_device = f"cuda:{args.gateway_gpu if args.gateway_gpu is not None else ranks - 1}"
    most = max(8, most_streams(args) + 2)
    tiny = getattr(args, "tiny_decoder", None)  # else a tiny decoder, if listed, is the checkpoint's tiny_decoder/
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
        vae_cudnn_benchmark=getattr(args, "vae_cudnn_benchmark", False),
        pipeline_warmup_s=None if getattr(args, "pipeline_warmup", True) else 0.0,
        vae_devices=vae_devices,
        vae_split=[int(v) for v in vae_split.split(",")] if vae_split else None,
        tiny_decoder=os.path.abspath(tiny) if tiny else None,
    )
    gw_args = ["gateway", *to_argv(gateway_options)]
    gateway = launcher.start("gateway", gw_args)
    pipe.wait_ready(launcher, 600.0)
    launcher.wait_ready(gateway, timeout=900)
    return pipe, gateway.info["address"]


def most_streams(args) -> int:
    """The most streams a run opens at once: its largest load row, or ``--capacity-max`` (plus the one refused)."""
    return max(max(args.load or [1]), getattr(args, "capacity_max", 0) + 1 if getattr(args, "capacity", False) else 1)


def coordinator_args(args) -> list[str]:
    """The SLO model's fixed parts: ``--slo-vae-ms`` (the VAE's ms per chunk), ``--slo-stage-ms`` (the stages' ms,
    kept fixed: the coordinator's ``--stage-ms ... --slo-fixed``)."""
    stage_ms = getattr(args, "slo_stage_ms", None)
    options = CoordinatorOptions(
        stages=args.stages,
        vae_ms_per_chunk={"full": float(args.slo_vae_ms)} if args.slo_vae_ms else None,
        stage_ms=parse_stage_ms(stage_ms) if stage_ms else None,
        slo_learn=not stage_ms,
        pace_grid=getattr(args, "pace_grid", False),
        lookahead=getattr(args, "lookahead", None),
    )
    return to_argv(options, only=["vae_ms_per_chunk", "stage_ms", "slo_learn", "pace_grid", "lookahead"])


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


# What run_system has measured so far (written to ``<json>.partial`` as phases finish; main() writes it as the
# result, marked partial, when the run is cut by SIGTERM, e.g. by ``timeout``).
PARTIAL: dict = {}


def run_system(root: Path, args, device_kind: str) -> dict:
    """The system's measurements.  A part with a zero count is skipped (``--first-seconds 0``, ``--seconds 0``,
    ``--ttff-runs 0``, ``--interactive-updates 0``): its keys are None, so that a capacity run fits its time."""
    import stagecast
    from launcher.process import Launcher

    nonce = uuid.uuid4().int % 9000
    partial = PARTIAL
    partial.clear()

    def done(phase: str, **data) -> None:
        """Progress on stdout, and what is measured so far in ``<json>.partial`` (kept if a later phase is cut)."""
        partial.update(data)
        partial["phase"] = phase
        log(phase)
        if args.json:
            Path(args.json + ".partial").write_text(json.dumps(partial, indent=1, default=str))

    first = main = inter = None
    firsts: list[StreamRecord] = []
    by_decoder: dict[str, StreamRecord] = {}
    prompt_chunks: dict[int, list[int]] = {}
    lead_summary, before, after, wall = None, [], [], None
    with Launcher() as launcher:
        t = time.perf_counter()
        pipe, gateway = start_system(launcher, root, args, device_kind)
        time_to_ready = time.perf_counter() - t
        if args.json:  # what each service printed on its way to READY (where the start-up time went), beside the JSON
            lines = [f"[{c.name}] {line}" for c in launcher.children for line in c.log]
            Path(args.json + ".startup.log").write_text("\n".join(lines) + "\n")
        done("ready", time_to_ready_s=time_to_ready)
        with stagecast.Client(gateway) as client:
            # Every prompt is new to the server (its text cache), as the protocol asks for TTFF.
            if args.first_seconds > 0:
                first = StreamRecord(client, args, args.first_seconds, f"a dog {nonce}").run()
            seeds = slo_model(coordinator_status(pipe.coordinator, launcher))
            done("first stream", first_stream=first.json() if first else None, slo_model=seeds)
            if args.seconds > 0:
                before = stage_stats(pipe.coordinator, launcher)
                with LeadSampler(pipe.coordinator, launcher) as lead:
                    t = time.perf_counter()
                    main = StreamRecord(client, args, args.seconds, f"a fox {nonce}").run()
                    wall = time.perf_counter() - t
                after = stage_stats(pipe.coordinator, launcher)
                lead_summary = lead.summary()
                done("main stream", main=main.json(), lead=lead_summary, main_stages=stage_delta(before, after))
                # The same main stream on each other decoder listed, in this system, right after it: side by side.
                by_decoder = {decoders_of(args)[0]: main}
                for name in decoders_of(args)[1:]:
                    by_decoder[name] = StreamRecord(
                        client, args, args.seconds, f"a fox {nonce} {name}", decoder=name
                    ).run()
                    done(f"main stream, {name} decoder", main_by_decoder={k: r.stats() for k, r in by_decoder.items()})
            firsts = [StreamRecord(client, args, 0.5, f"a cat {nonce} {i}").run() for i in range(args.ttff_runs)]
            done("ttff", ttff_s=[f.ttff_s for f in firsts])
            if args.interactive_updates > 0:
                # Interactive: an unbounded stream with a new prompt every `every` frames, stopped well after the
                # last update (encoding a new prompt with the real-size encoder on a busy GPU is not instant).
                every = max(8, int(args.target_fps))
                updates = {every * (k + 1): f"a bird {nonce} {k}" for k in range(args.interactive_updates)}
                stop_at = every * (args.interactive_updates + 10)
                inter = StreamRecord(client, args, None, f"a cow {nonce}", updates, stop_at=stop_at).run()
                prompt_chunks = plan_prompt_chunks(pipe.coordinator, launcher)
                done("interactive", interactive_sent=inter.update_sent, prompt_chunks=prompt_chunks)
            load_rows = []
            for n in args.load or []:
                recs = [
                    StreamRecord(client, args, args.load_seconds, f"load {nonce} {n} {i}", pace=not args.load_unpaced)
                    for i in range(n)
                ]
                threads = [threading.Thread(target=r.run) for r in recs]
                for th in threads:
                    th.start()
                for th in threads:
                    th.join()
                load_rows.append(load_row(n, recs))
                done(f"load {n}", load=load_rows)
            capacity_rows = []
            if args.capacity:
                pid = gateway_pid(launcher)
                for name in decoders_of(args):  # one decoder kind after the other, every stream closed between
                    wait_idle(client, pipe.coordinator, launcher)
                    row = measure_capacity(client, launcher, pipe.coordinator, args, name, f"{nonce} {name[0]}", pid)
                    capacity_rows.append(row)
                    print(f"[harness] capacity, {name} decoder: {row['verdict']}", flush=True)
                    done(f"capacity {name}", capacity=capacity_rows)
        mem = gpu_memory()
    for rec in (first, main, *firsts, inter, *by_decoder.values()):
        if rec is not None and rec.error:
            raise RuntimeError(f"a measured stream failed: {rec.error}")
    latencies = interactive_latencies(inter, prompt_chunks.get(inter.gen.info.pipeline_stream_id, [])) if inter else []
    stages = []
    if main is not None:
        span = main.stats()
        for b, a in zip(before, after):
            busy = (a["forward_ms"] - b["forward_ms"]) / 1e3
            n = max(1, a["batches"] - b["batches"])
            stages.append(
                {
                    "index": a["index"],
                    "batches": a["batches"] - b["batches"],
                    "mean_forward_ms": (a["forward_ms"] - b["forward_ms"]) / n,
                    # Parallel exchanges per batch: --sp, the all-to-alls (and the gather before the head) inside
                    # those forwards; --cfg-parallel 2, the last stages' swap of guided predictions.
                    "mean_exchange_ms": (a.get("exchange_ms", 0.0) - b.get("exchange_ms", 0.0)) / n,
                    "mean_batch": (a["micro_steps"] - b["micro_steps"]) / n,
                    # Host time blocked on data-plane receives (hidden states, returned latents) per batch.
                    "mean_wait_ms": (a["wait_ms"] - b["wait_ms"]) / n,
                    "eager_batches": a.get("eager_batches", 0) - b.get("eager_batches", 0),
                    # Forward time over the frames' span. CUDA events time the GPU stream, so where the gateway's
                    # VAE shares the GPU its kernels count in (time-slicing).
                    "utilization": busy / max(span["last_s"] - span["first_s"], 1e-9),
                }
            )
    else:
        span = {"steady_fps": None, "whole_fps": None}
    ttffs = [f.ttff_s for f in firsts]
    return {
        "time_to_ready_s": time_to_ready,
        "first_stream": first.json() if first else None,
        "slo_model": seeds,
        "main": {**main.json(), "wall_s": wall} if main else None,
        "decoder": decoders_of(args)[0],
        # Each decoder's main stream (the first is "main" itself): steady FPS and punctuality side by side.
        "main_by_decoder": {
            name: {k: v for k, v in rec.json().items() if k not in ("arrivals_s", "gateway_chunks")}
            for name, rec in by_decoder.items()
        },
        "steady_fps": span["steady_fps"],
        "whole_fps": span["whole_fps"],
        "lead": lead_summary,
        "ttff_p50_s": statistics.median(ttffs) if ttffs else None,
        "ttff_p95_s": percentile(ttffs, 0.95) if ttffs else None,
        "ttff_s": ttffs,
        # Medians of each part over the TTFF streams (they need not add up to the median TTFF exactly).
        "ttff_parts_p50_ms": {
            part: statistics.median(ttff_parts(f.first.timing, f.ttff_s)[part] for f in firsts)
            for part in ("pipeline", "vae", "encode", "rest")
        }
        if firsts
        else None,
        "interactive": {
            "updates_sent_s": [round(t, 4) for t, _ in inter.update_sent],
            # PromptUpdated back at the client, after each update's send: the gateway's encode and the
            # coordinator's answer (the rest of the latency is the pipeline's lead and the decode).
            "acked_ms": [round((a - t) * 1e3, 1) for (t, _), a in zip(inter.update_sent, inter.update_acked)],
            "from_chunks": prompt_chunks.get(inter.gen.info.pipeline_stream_id, []),
            "frames": len(inter.arrivals),
            "latencies_ms": latencies,
            "p50_ms": statistics.median(latencies) if latencies else None,
            "p95_ms": percentile(latencies, 0.95) if latencies else None,
        }
        if inter
        else None,
        "load": load_rows,
        "capacity_streams": capacity_of(load_rows),
        # --capacity: one row per decoder (measure_capacity); each row's "capacity" is its held count only where
        # admission refused the stream right past it and every admitted one held.
        "capacity": capacity_rows,
        "stages": stages,
        "comm": comm_summary(args, stages),
        "gpu_memory_used_mib": mem,
    }


def comm_summary(args, stages: list[dict]) -> dict:
    """Communication per denoising step (one batch is one step of the micro-steps it holds): measured host waits and
    exchange times, and the bytes one micro-step of a stream puts on the data plane (from the shapes)."""
    cfg = model_config(args.model)
    vae_factor = 16 if VAE_FOR_MODEL[args.model] == "wan2.2" else 8
    h, w = args.height // vae_factor, args.width // vae_factor
    tokens = (h // 2) * (w // 2)
    elem = torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
    hidden = tokens * cfg["num_attention_heads"] * cfg["attention_head_dim"] * elem
    latent = cfg["in_channels"] * h * w * 4  # fp32, last stage -> stage 0
    flow = cfg["out_channels"] * h * w * elem  # a branch's prediction, swapped between CFG groups
    rows = branches_of(args) if args.cfg_parallel == 1 else 1
    per_group = (args.stages - 1) * rows * hidden + (latent if args.stages > 1 else 0)
    exchange = 2 * flow if args.cfg_parallel == 2 and args.guidance > 1.0 else 0  # both directions
    by_bytes = per_group * (args.cfg_parallel if args.guidance > 1.0 else 1) + exchange
    lasts = [s for s in stages if (s["index"] + 1) % args.stages == 0]
    return {
        "data_plane_bytes_per_micro_step": by_bytes,
        "exchange_bytes_per_micro_step": exchange,
        "wait_ms_per_batch": {s["index"]: s["mean_wait_ms"] for s in stages},
        "exchange_ms_per_batch": max((s["mean_exchange_ms"] for s in lasts), default=0.0),
    }


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


def capacity_of(rows: list[dict]) -> int | None:
    """The most concurrent streams a load row held with every admitted stream >= 99% on time."""
    held = [r["streams"] - r["refused"] for r in rows if r["all_held"] and not r["failed"] - r["refused"]]
    return max(held) if held else None


# ---- capacity -------------------------------------------------------------------------------------------

# How long the capacity mode waits for a newly admitted stream's first frame before it gives up on the row.
CAPACITY_FIRST_FRAME_S = 30.0
FREEZE_MS = 250.0


def process_cpu_s(pid: int | None) -> float | None:
    """CPU seconds (user + system, every thread) a process has used so far: /proc/<pid>/stat, else psutil."""
    if pid is None:
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime (fields 14, 15)
    except (OSError, ValueError, IndexError):
        pass
    try:
        import psutil

        t = psutil.Process(pid).cpu_times()
        return t.user + t.system
    except Exception:  # noqa: BLE001 - no /proc and no psutil: the row says None
        return None


def gateway_pid(launcher) -> int | None:
    """The gateway process the launcher started last (its CPU is the gateway's CPU per frame)."""
    for child in reversed(launcher.children):
        if child.name == "gateway":
            return child.pid
    return None


class StatusSampler:
    """While a capacity row's streams run: the coordinator's per-stream steps (the SLO controller's choice) and the
    stages' KV bytes, and the gateway's decoder state bytes, sampled every ``period`` seconds.

    Fields read with ``getattr`` (a status without them samples 0 and the row says None): ``StageDescription.kv_bytes``
    / ``kv_reserved_bytes`` / ``open_streams`` (coordinator), ``GatewayStatus.vae_state_bytes`` and
    ``StreamStatus.vae_state_bytes`` (gateway)."""

    def __init__(self, coordinator: str, launcher, client, period: float = 0.5):
        self.coordinator, self.launcher, self.client, self.period = coordinator, launcher, client, period
        self.steps: dict[int, dict[int, int]] = {}  # pipeline stream id -> steps -> samples
        self.kv_per_stream: list[float] = []  # sum over stages of kv_bytes / open_streams
        self.kv_reserved_per_stream: list[float] = []
        self.vae_per_stream: list[float] = []  # gateway vae_state_bytes / its active streams
        self.vae_stream_bytes: list[int] = []  # each StreamStatus.vae_state_bytes seen
        self.errors = 0
        self._stages: dict = {}  # stage address -> StageService stub
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _describe(self, address: str):
        """A stage's own Describe (its actual KV bytes and open streams; the coordinator's copy may lag or be 0)."""
        from stagecast.internal.v1 import pipeline_pb2 as pb
        from stagecast.internal.v1 import pipeline_pb2_grpc as pb_grpc

        if address not in self._stages:
            self._stages[address] = pb_grpc.StageServiceStub(self.launcher.channel(address, "stage"))
        return self._stages[address].Describe(pb.Empty(), timeout=10)

    def _sample(self) -> None:
        status = coordinator_status(self.coordinator, self.launcher)
        for s in status.streams:
            per = self.steps.setdefault(int(s.stream_id), {})
            steps = int(getattr(s, "steps", 0))
            per[steps] = per.get(steps, 0) + 1
        kv = reserved = 0.0
        for st in status.stages:
            n = int(getattr(st, "open_streams", 0))
            actual = int(getattr(st, "kv_bytes", 0))
            if st.address:
                try:
                    d = self._describe(st.address)
                    n, actual = int(getattr(d, "open_streams", n)), int(getattr(d, "kv_bytes", actual))
                except Exception:  # noqa: BLE001 - the coordinator's copy then
                    self.errors += 1
            if n > 0:
                kv += actual / n
                reserved += getattr(st, "kv_reserved_bytes", 0) / n
        if kv:
            self.kv_per_stream.append(kv)
        if reserved:
            self.kv_reserved_per_stream.append(reserved)
        gw = self.client.status()
        total, active = int(getattr(gw, "vae_state_bytes", 0)), int(getattr(gw, "active_streams", 0))
        if total and active:
            self.vae_per_stream.append(total / active)
        self.vae_stream_bytes += [int(getattr(s, "vae_state_bytes", 0)) for s in gw.streams if s.vae_state_bytes]

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            try:
                self._sample()
            except Exception:  # noqa: BLE001 - a missed sample
                self.errors += 1

    def __enter__(self) -> StatusSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


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


def capacity_stream(rec: StreamRecord, start: float, end: float, target_fps: float) -> dict:
    """One admitted stream of a capacity row.  ``start``/``end``: the measured window on the stream's own clock (all
    admitted streams running).  Frame i is due at the first frame's arrival + i / fps (the harness's rule); the
    stream is **held** when >= 99% of the frames due inside the window arrived by then."""
    arr = rec.arrivals
    # Every frame due by the end of the window, arrived or not (a frame that never came is late).
    due = [(i, arr[0] + i / target_fps) for i in range(int((end - arr[0]) * target_fps) + 1)] if arr else []

    def punctual(frames: list[tuple[int, float]]) -> float | None:
        return sum(i < len(arr) and arr[i] <= d + 1e-9 for i, d in frames) / len(frames) if frames else None

    in_window = [(i, d) for i, d in due if d >= start]
    on_time = punctual(in_window)
    # The window's late frames: how many, how late the worst was, and when the first was due (s into the window).
    late = [(i, d, (arr[i] - d) * 1e3 if i < len(arr) else None) for i, d in in_window if not punctual([(i, d)])]
    before_stop = [t for t in arr if t <= end]
    gaps = [(b - a) * 1e3 for a, b in zip(before_stop, before_stop[1:])]
    win = [t for t in arr if start <= t <= end]
    return {
        "pipeline_stream_id": rec.gen.info.pipeline_stream_id if arr else None,
        "ttff_s": rec.ttff_s,
        "ttff_parts_ms": (
            {k: round(v, 1) for k, v in ttff_parts(rec.first.timing, rec.ttff_s, rec.gen.info).items()}
            if rec.first is not None
            else None
        ),
        "frames": len(arr),
        "window_frames_due": len(in_window),
        "on_time": on_time,  # over the measured window
        "on_time_to_stop": punctual(due),  # from the first frame, the ramp included
        "held": on_time is not None and on_time >= 0.99 and rec.error is None,
        "late_frames": len(late),
        "late_max_ms": max((ms for _, _, ms in late if ms is not None), default=None),  # None: only frames never sent
        "late_first_s": late[0][1] - start if late else None,
        "steady_fps": (len(win) - 1) / (win[-1] - win[0]) if len(win) > 2 and win[-1] > win[0] else None,
        "max_gap_ms": max(gaps) if gaps else None,
        "freezes": sum(g > FREEZE_MS for g in gaps),  # gaps over 250 ms from the first frame to the stop
        "frame_steps": {str(k): v for k, v in sorted(rec.steps.items())},
        "error": rec.error,
    }


def measure_capacity(client, launcher, coordinator: str, args, decoder: str, tag: str, pid: int | None) -> dict:
    """Capacity on one decoder: paced streams (``--target-fps``, SLO-adaptive with ``--load-min-steps``) opened one at
    a time, each once the previous one's first frame arrived, until admission refuses one or ``--capacity-max`` are
    open; then every admitted stream runs ``--capacity-seconds`` more (the measured window) and is stopped."""
    recs: list[StreamRecord] = []
    threads: list[threading.Thread] = []
    refusal, failure = None, None
    ramp: list[dict] = []  # stage stats from each admission to the next (k streams running, plus a first chunk)
    # What admission prices each stream's decode at (the gateway's measured VAE, or --slo-vae-ms): where the
    # coordinator does not price streams by their decoder, a tiny-decoder row is admitted at the full VAE's cost.
    priced = slo_model(coordinator_status(coordinator, launcher))
    snap = stage_stats(coordinator, launcher)
    t_open = time.monotonic()
    while len(recs) < args.capacity_max:
        rec = StreamRecord(client, args, None, f"cap {tag} {len(recs)}", pace=True, decoder=decoder)
        th = threading.Thread(target=rec.run, daemon=True)
        th.start()
        if not rec.started.wait(CAPACITY_FIRST_FRAME_S):
            rec.gen.cancel()
            th.join(30)
            failure = f"stream {len(recs) + 1}: no first frame in {CAPACITY_FIRST_FRAME_S:.0f} s"
            break
        if not rec.arrivals:  # ended before its first frame: refused, or failed
            th.join(30)
            info = {
                "stream": len(recs) + 1,
                "code": rec.error_code,
                "details": rec.error_details,
                "ms": rec.error_s * 1e3 if rec.error_s is not None else None,
                "retry_after_s": rec.retry_after,
            }
            if rec.error_code == "RESOURCE_EXHAUSTED":
                refusal = info
            else:
                failure = f"stream {len(recs) + 1}: {rec.error}"
                refusal = info
            break
        recs.append(rec)
        threads.append(th)
        now = stage_stats(coordinator, launcher)
        ramp.append({"streams": len(recs) - 1, "stages": stage_delta(snap, now)})
        snap = now
        log(f"capacity {decoder}: stream {len(recs)} admitted (TTFF {rec.ttff_s * 1e3:.0f} ms)")
    ramp = ramp[1:]  # the first entry holds only stream 1's first chunk
    t_all = time.monotonic()
    before = stage_stats(coordinator, launcher)
    cpu0 = process_cpu_s(pid)
    with StatusSampler(coordinator, launcher, client) as sampler:
        time.sleep(args.capacity_seconds if recs else 0.0)
    cpu1 = process_cpu_s(pid)
    t_end = time.monotonic()
    after = stage_stats(coordinator, launcher)
    priced_end = slo_model(coordinator_status(coordinator, launcher))  # as learned over the window
    for rec in recs:
        rec.gen.stop()
    deadline = time.monotonic() + 60  # chunks in flight still arrive; a stream that does not end is cancelled
    for rec, th in zip(recs, threads):
        th.join(max(0.0, deadline - time.monotonic()))
        if th.is_alive():
            rec.gen.cancel()
            th.join(10)
    per_stream = [capacity_stream(r, t_all - r.gen.t0, t_end - r.gen.t0, args.target_fps) for r in recs]
    held = sum(s["held"] for s in per_stream)
    frames = sum(s["window_frames_due"] for s in per_stream)  # frames delivered over the window (paced: one per due)
    delivered = sum(sum(t_all - r.gen.t0 <= t <= t_end - r.gen.t0 for t in r.arrivals) for r in recs)
    ttffs = [r.ttff_s for r in recs if r.ttff_s is not None]
    stages = stage_delta(before, after)
    chosen: dict[str, int] = {}
    for r in recs:
        for steps, n in sampler.steps.get(int(r.gen.info.pipeline_stream_id), {}).items():
            chosen[str(steps)] = chosen.get(str(steps), 0) + n
    refused_at_once = refusal is not None and refusal["code"] == "RESOURCE_EXHAUSTED"
    exact = refused_at_once and held == len(recs) and failure is None
    if exact:
        verdict = f"capacity {held}: every admitted stream held, stream {len(recs) + 1} refused"
    elif refusal is None and failure is None:
        verdict = f"no refusal up to --capacity-max {args.capacity_max}: {held} of {len(recs)} held"
    elif failure is not None:
        verdict = f"failed: {failure}; {held} of {len(recs)} held"
    else:
        verdict = f"admitted but not held: {held} of {len(recs)} admitted streams held"
    mean = statistics.mean
    return {
        "decoder": decoder,
        "max": args.capacity_max,
        "seconds": args.capacity_seconds,
        "window_s": t_end - t_all,
        "ramp_s": t_all - t_open,
        "admitted": len(recs),
        "held": held,
        "capacity": held if exact else None,
        "verdict": verdict,
        "refusal": refusal,
        "failure": failure,
        "slo_model": priced,
        "slo_model_end": priced_end,
        "ttff_p50_s": statistics.median(ttffs) if ttffs else None,
        "ttff_p95_s": percentile(ttffs, 0.95) if ttffs else None,
        # Where the slowest first frame's time went (``ttff_parts``): the one the p95 stands for at a few streams.
        "ttff_slowest_parts_ms": max(
            (s for s in per_stream if s["ttff_s"] is not None), key=lambda s: s["ttff_s"], default={}
        ).get("ttff_parts_ms"),
        "steady_fps_min": min((s["steady_fps"] or 0.0 for s in per_stream), default=None),
        "on_time_min": min((s["on_time"] or 0.0 for s in per_stream), default=None),
        "freezes": sum(s["freezes"] for s in per_stream),
        "steps_chosen": chosen,  # coordinator status samples per step count, over every admitted stream
        "stages": stages,
        "mean_batch": max((s["mean_batch"] for s in stages if s["mean_batch"]), default=None),
        "ramp": ramp,
        "memory": {
            "decoder_state_bytes_per_stream": max(sampler.vae_per_stream) if sampler.vae_per_stream else None,
            "decoder_state_bytes_stream_max": max(sampler.vae_stream_bytes) if sampler.vae_stream_bytes else None,
            "kv_bytes_per_stream": max(sampler.kv_per_stream) if sampler.kv_per_stream else None,
            "kv_reserved_bytes_per_stream": (
                mean(sampler.kv_reserved_per_stream) if sampler.kv_reserved_per_stream else None
            ),
            "samples_missed": sampler.errors,
        },
        "gateway_cpu_s": None if cpu0 is None or cpu1 is None else cpu1 - cpu0,
        "frames_delivered": delivered,
        "frames_due": frames,
        "gateway_cpu_ms_per_frame": (
            (cpu1 - cpu0) * 1e3 / delivered if cpu0 is not None and cpu1 is not None and delivered else None
        ),
        "per_stream": per_stream,
    }


def wait_idle(client, coordinator: str, launcher, timeout: float = 60.0) -> None:
    """Until neither the gateway nor the coordinator holds a stream (between two capacity rows)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if client.status().active_streams == 0 and not coordinator_status(coordinator, launcher).streams:
                return
        except Exception:  # noqa: BLE001 - try again
            pass
        time.sleep(0.25)


# ---- versions -------------------------------------------------------------------------------------------


def versions() -> dict:
    import diffusers

    out = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "diffusers": diffusers.__version__,
        "gpu_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "gpu": gpu_name(),
        "nccl": None,
        "driver": None,
        "torchao": None,
    }
    try:
        from importlib.metadata import version

        out["torchao"] = version("torchao")
    except Exception:  # noqa: BLE001 - not installed: the optional fp8 extra
        pass
    if torch.cuda.is_available():
        try:
            out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # noqa: BLE001 - a build without NCCL
            pass
        try:
            out["driver"] = subprocess.check_output(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], text=True
            ).split()[0]
        except (OSError, subprocess.CalledProcessError):
            pass
    return out


def tree_dirty() -> bool | None:
    if os.environ.get("STAGECAST_DIRTY") is not None:  # the device machine's copy has no .git
        return os.environ["STAGECAST_DIRTY"] == "1"
    try:
        return bool(subprocess.check_output(["git", "status", "--porcelain"], text=True).strip())
    except (OSError, subprocess.CalledProcessError):
        return None


# ---- report ---------------------------------------------------------------------------------------------


def topology(a: dict) -> str:
    """ "2" for a pipeline of 2 stages, "PP=2×SP=2" with sequence-parallel stages, "2" for CFG-parallel 2 x PP=1."""
    sp = a.get("sp", 1)
    return str(a["stages"] * a.get("cfg_parallel", 1)) if sp == 1 else f"PP={a['stages']}×SP={sp}"


def cfg_label(a: dict) -> str:
    """ ", guidance 5, sequential CFG on PP=2" / ", guidance 5, CFG-parallel 2 x PP=1" (empty without guidance)."""
    if a.get("guidance", 1.0) <= 1.0:
        return ""
    if a.get("cfg_parallel", 1) > 1:
        return f", guidance {a['guidance']:g}, CFG-parallel {a['cfg_parallel']} x PP={a['stages']}"
    return f", guidance {a['guidance']:g}, sequential CFG on PP={a['stages']}"


def decoder_label(a: dict) -> str:
    """ ", tiny decoder" for a run whose streams asked for the tiny decoder first (empty for the full VAE)."""
    first = (a.get("decoders") or ["full"])[0]
    return ", tiny decoder" if first == "tiny" else ""


def fp8_label(a: dict) -> str:
    """ ", FP8 blocks" for a run whose stages ran ``--fp8`` (empty otherwise)."""
    return ", FP8 blocks" if a.get("fp8") else ""


def markdown_row(r: dict) -> str:
    s, a = r["system"], r["args"]
    first = s["first_stream"]
    return (
        f"| {a['model']} @ {a['height']}x{a['width']}, {a['steps']} step(s){cfg_label(a)}{fp8_label(a)}"
        f"{decoder_label(a)} | "
        f"{topology(a)} | "
        f"{s['steady_fps']:.1f} | {s['whole_fps']:.1f} | {s['main']['on_time']:.1%} | "
        f"{s['main']['max_gap_ms']:.0f} | {s['main']['gaps_over_250ms']} | "
        f"{first['on_time']:.1%} / {first['max_gap_ms']:.0f} | "
        f"{s['ttff_p50_s'] * 1e3:.0f} / {s['ttff_p95_s'] * 1e3:.0f} | {r['commit']} |"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="wan2.1-1.3b")
    ap.add_argument("--width", type=int, default=832)
    ap.add_argument("--height", type=int, default=480)
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument(
        "--partition",
        default=None,
        help="layers per stage, e.g. 17,13 (default: even); auto: the partition and the VAE cut from --balance-profile",
    )
    ap.add_argument(
        "--balance-profile", default=None, help="measured costs (python -m benchmarks.balance) for --partition auto"
    )
    add_flags(ap, CoordinatorOptions, only=["sp", "cfg_parallel"])  # the layout's, passed on; one GPU per rank
    add_flags(ap, CoordinatorOptions, only=["pace_grid", "lookahead"])  # passed on to the coordinator
    ap.add_argument("--guidance", type=float, default=1.0, help="classifier-free guidance scale (1: none)")
    ap.add_argument("--negative-prompt", default="", help="the unconditional branch's prompt (with --guidance > 1)")
    ap.add_argument("--batch", type=int, default=DEFAULT_MAX_BATCH)
    ap.add_argument("--window", type=int, default=6, help="KV window in latent frames (protocol: 6)")
    ap.add_argument("--sink", type=int, default=3, help="sink frames (protocol: 3)")
    ap.add_argument(
        "--seconds", type=float, default=60.0, help="video of the main stream (protocol: 60 or more; 0: no main stream)"
    )
    ap.add_argument("--first-seconds", type=float, default=10.0, help="video of the first stream after READY (0: none)")
    ap.add_argument("--target-fps", type=float, default=DEFAULT_FPS, help="presentation rate for on-time figures")
    ap.add_argument("--codec", default="jpeg")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--ttff-runs", type=int, default=5, help="fresh-prompt streams for TTFF (0: none)")
    ap.add_argument(
        "--interactive-updates", type=int, default=5, help="prompt updates in the interactive stream (0: no stream)"
    )
    ap.add_argument("--load", default=None, help="concurrent-stream counts for load rows, e.g. 1,2,4,8")
    ap.add_argument(
        "--load-unpaced", action="store_true", help="load rows' streams run as fast as possible (default: paced)"
    )
    ap.add_argument(
        "--load-min-steps",
        type=int,
        default=None,
        help="load rows' and capacity rows' streams are SLO-adaptive: min_steps this, max_steps --steps (default: "
        "fixed --steps)",
    )
    ap.add_argument(
        "--slo-vae-ms",
        type=float,
        default=0.0,
        help="the coordinator's --vae-ms-per-chunk: the VAE's ms per chunk on each GPU, in the SLO controller's model",
    )
    ap.add_argument("--load-seconds", type=float, default=20.0, help="video per stream in a load row")
    ap.add_argument(
        "--capacity",
        action="store_true",
        help="capacity rows, one per --decoder: paced streams opened one at a time until admission refuses one (or "
        "--capacity-max), then all of them run --capacity-seconds; held = >= 99%% on time",
    )
    ap.add_argument("--capacity-max", type=int, default=12, help="streams a capacity row opens at most")
    ap.add_argument(
        "--capacity-seconds", type=float, default=20.0, help="the measured window of a capacity row, all streams open"
    )
    ap.add_argument(
        "--slo-stage-ms",
        default=None,
        help="the coordinator's --stage-ms with --slo-fixed: the SLO model's per-stage ms kept fixed (tests, what-ifs)",
    )
    ap.add_argument(
        "--no-peers",
        action="store_true",
        help="skip the peers and the compute floor (capacity runs: the DiT is not built in the harness's process)",
    )
    ap.add_argument("--peer-chunks", type=int, default=8)
    ap.add_argument("--no-compiled-peer", action="store_true", help="skip the torch.compile peer")
    ap.add_argument(
        "--text-encoder", choices=("umt5-xxl", "tiny"), default=None, help="default: umt5-xxl on GPU, tiny on CPU"
    )
    ap.add_argument("--gateway-gpu", type=int, default=None, help="GPU for text encoder + VAE (default: last stage's)")
    # The gateway's and the stages' own flags, passed on as given.
    add_flags(ap, GatewayOptions, only=["vae_compile", "vae_cuda_graphs", "vae_cudnn_benchmark", "tiny_decoder"])
    add_flags(ap, StageOptions, only=["cuda_graphs", "fp8"])
    ap.add_argument(
        "--no-pipeline-warmup",
        dest="pipeline_warmup",
        action="store_false",
        help="no warm-up stream before the gateway's READY (gateway --pipeline-warmup-s 0), to measure what it buys",
    )
    ap.add_argument(
        "--vae-gpus", default=None, help="GPUs the VAE decoder is cut over, e.g. 0,1 (default: every stage's GPU)"
    )
    ap.add_argument("--vae-split", default=None, help="decoder units where VAE slices 1.. start (gateway --vae-split)")
    ap.add_argument(
        "--decoder",
        dest="decoders",
        type=decoder_list,
        default=["full"],
        help="full (the VAE), tiny, or full,tiny: every stream asks for the first; the main stream runs again on the "
        "other (side by side, same system); tiny without --tiny-decoder: random weights",
    )
    ap.add_argument("--json", default=None)
    ap.add_argument("--markdown", default=None, help="append a one-line table row here")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model, small frames: proves the harness runs")
    args = ap.parse_args(argv)
    if args.smoke and args.capacity:
        # Capacity smoke: the capacity rows, a 2 s main stream and the first stream; no TTFF, interactive, load rows
        # nor peers (what the capacity parts of gpu_suite.sh run).
        smoke_system(args)
        args.seconds = min(args.seconds, 2.0)
        args.first_seconds, args.ttff_runs, args.interactive_updates, args.load = 1.0, 0, 0, None
        args.steps, args.window, args.sink, args.codec = 1, 2, 1, "raw"
        args.capacity_seconds = min(args.capacity_seconds, 3.0)
        args.no_peers = True
    elif args.smoke:
        smoke_system(args)
        args.seconds, args.first_seconds, args.ttff_runs, args.peer_chunks = 2.0, 1.0, 2, 2
        args.steps, args.window, args.sink, args.codec = 2, 2, 1, "raw"
        args.interactive_updates, args.load, args.load_seconds = 2, "1,2", 1.0
        args.load_min_steps = args.load_min_steps or 1  # the load rows' path: paced, SLO-adaptive (1..2 steps)
        args.no_compiled_peer = True
    args.load = [int(x) for x in args.load.split(",")] if args.load else []
    if args.cfg_parallel > 1 and args.guidance <= 1.0:
        ap.error("--cfg-parallel 2 runs the two branches of guidance: give --guidance > 1")
    if args.cfg_parallel > 1 and args.smoke:
        args.stages = 1  # smoke: two CFG groups of one stage each
    if args.smoke and not args.capacity:
        # The SLO model fixed at 1 ms per stage (as the test systems keep it): measured on a loaded CPU it refused the
        # second stream of a load row once (256% of the slowest stage); the smoke proves the paths, not a speed.
        args.slo_stage_ms = args.slo_stage_ms or ",".join(["1"] * args.stages)
    device_kind = system_device(args)
    if args.fp8:
        from stagecast.fp8 import Fp8Unavailable, check_fp8

        try:
            check_fp8("cuda" if device_kind == "cuda" else "cpu", args.dtype)  # before any work, naming --fp8
        except Fp8Unavailable as exc:
            ap.error(str(exc))
    if args.cfg_parallel > 1 and args.sp > 1:
        ap.error("--cfg-parallel 2 does not compose with --sp yet")
    if device_kind == "cuda" and args.sp > 1:
        from stagecast.model.parallel import check_gpus

        check_gpus(args.stages, args.sp, torch.cuda.device_count())  # LayoutError names the flags, before any work
    if device_kind == "cuda":
        from launcher.local_cluster import check_gpu_fit

        try:
            check_gpu_fit("cuda", args.stages, args.cfg_parallel)
        except ValueError as exc:
            ap.error(str(exc))
    device = torch.device("cuda:0" if device_kind == "cuda" else "cpu")
    dtype = getattr(torch, args.dtype)
    text_len = 512 if model_config(args.model)["text_dim"] >= 512 else 16
    command = "python -m benchmarks.harness " + " ".join(argv if argv is not None else sys.argv[1:])

    import signal

    def cut(signum, frame):  # `timeout` sends SIGTERM: write what was measured, marked partial
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, cut)
    peak = floor_fps = flops = peer = peer_compiled = None
    cut_by = None
    with tempfile.TemporaryDirectory(prefix="stagecast-bench-") as tmp:
        root = Path(tmp)
        write_assets(root, args)
        try:  # a profile that does not fit this run is refused before any measurement
            balance(root, args, device_kind, vae_devices_of(args, device_kind), announce=False)
        except ValueError as exc:
            ap.error(str(exc))
        if not args.no_peers:
            dit, vae = build_peer(args, device, dtype)
            flops = flops_per_frame(args, dit, vae, device, dtype, text_len)
            peak = matmul_peak_tflops(device, 8192 if device_kind == "cuda" else 512)
            floor_fps = gpus_of(args) * peak / flops["tflop_per_video_frame"]
            log("floor")
            peer = run_peer(args, dit, vae, device, dtype, text_len, args.peer_chunks)
            log("peer")
            if not args.no_compiled_peer:
                peer_compiled = run_peer(args, dit, vae, device, dtype, text_len, args.peer_chunks, compiled=True)
                log("compiled peer")
            del dit, vae
            if device_kind == "cuda":
                torch._dynamo.reset()
                torch.cuda.empty_cache()
        try:
            system = run_system(root, args, device_kind)
        except KeyboardInterrupt as exc:
            cut_by = f"cut ({exc}) after phase '{PARTIAL.get('phase', 'none')}'"
            system = {k: v for k, v in PARTIAL.items() if k != "phase"}
            if system.get("main"):  # the main stream finished: its figures where a whole run has them
                system.setdefault("steady_fps", system["main"].get("steady_fps"))
                system.setdefault("whole_fps", system["main"].get("whole_fps"))
            print(f"[harness] {cut_by}: writing what was measured", flush=True)

    steady = system.get("steady_fps")
    result = {
        "harness": 2,
        "date": datetime.date.today().isoformat(),
        "gpu": gpu_name(),
        "commit": git_commit(),
        "dirty": tree_dirty(),
        "versions": versions(),
        "command": command,
        "args": vars(args),
        "timesteps": list(LADDER[: args.steps]) if TIMESTEPS_FIELD else "gateway default (evenly spaced from 1000)",
        "floor": {"matmul_peak_tflops": peak, **flops, "fps": floor_fps} if flops else None,
        "peer": peer,
        "peer_compiled": peer_compiled,
        "system": system,
        "ratios": {
            "vs_peer": steady / peer["fps"] if steady and peer else None,
            "vs_peer_compiled": steady / peer_compiled["fps"] if steady and peer_compiled else None,
            "of_floor": steady / floor_fps if steady and floor_fps else None,
        },
    }
    if cut_by:
        result["partial"] = cut_by
    summary = {k: v for k, v in result.items() if k != "system"}
    skip = ("first_stream", "main", "lead", "load", "capacity")
    summary["system"] = {k: v for k, v in system.items() if k not in skip}
    print(json.dumps(summary, indent=2, default=str))
    for row in system.get("capacity") or []:
        print(f"[harness] capacity, {row['decoder']} decoder: {row['verdict']}")
    if system.get("main") and system.get("first_stream") and system.get("ttff_p50_s") is not None:
        print(markdown_row(result))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))
        Path(args.json + ".partial").unlink(missing_ok=True)
    if args.markdown and system.get("main") and system.get("first_stream") and system.get("ttff_p50_s") is not None:
        with open(args.markdown, "a") as fh:
            fh.write(markdown_row(result) + "\n")
    return 0 if not cut_by else 124


if __name__ == "__main__":
    sys.exit(main())
