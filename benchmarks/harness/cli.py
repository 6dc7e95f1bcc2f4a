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
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import torch

from benchmarks.harness.burst import measure_burst
from benchmarks.harness.capacity import gateway_pid, measure_capacity, wait_idle
from benchmarks.harness.peers import build_peer, flops_per_frame, matmul_peak_tflops, run_peer
from benchmarks.harness.rows import (
    LADDER,
    TIMESTEPS_FIELD,
    capacity_of,
    comm_summary,
    cuda_mps,
    decoder_list,
    decoders_of,
    git_commit,
    gpu_name,
    gpus_of,
    log,
    markdown_row,
    percentile,
    tree_dirty,
    versions,
)
from benchmarks.harness.system import (
    LeadSampler,
    StreamRecord,
    balance,
    coordinator_status,
    gpu_memory,
    interactive_latencies,
    load_row,
    plan_prompt_chunks,
    slo_model,
    smoke_system,
    stage_delta,
    stage_stats,
    start_system,
    system_device,
    ttff_parts,
    vae_devices_of,
    write_assets,
)
from coordinator.options import CoordinatorOptions, parse_vae_ms
from gateway.options import GatewayOptions
from stage_service.options import StageOptions
from stagecast.api import DEFAULT_FPS
from stagecast.flags import add_flags
from stagecast.microstep import DEFAULT_MAX_BATCH
from stagecast.model.dit_configs import model_config

# What run_system has measured so far (written to ``<json>.partial`` as phases finish; main() writes it as the
# result, marked partial, when the run is cut by SIGTERM, e.g. by ``timeout``).
PARTIAL: dict = {}


def main_stages(before: list[dict], after: list[dict], span_s: float) -> list[dict]:
    """Each stage's batches, forward, exchange and wait times, batch size and utilization over the main stream."""
    stages = []
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
                "utilization": busy / max(span_s, 1e-9),
            }
        )
    return stages


def interactive_summary(inter, prompt_chunks: dict, latencies: list[float]) -> dict:
    """The interactive stream's prompt updates: when sent and acknowledged, each one's latency to its first frame."""
    return {
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


def run_load_rows(client, args, nonce: int, done) -> list[dict]:
    """``--load``: N concurrent streams per row, each row after the last."""
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
    return load_rows


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
            load_rows = run_load_rows(client, args, nonce, done)
            capacity_rows = []
            if args.capacity:
                pid = gateway_pid(launcher)
                for name in decoders_of(args):  # one decoder kind after the other, every stream closed between
                    wait_idle(client, pipe.coordinator, launcher)
                    row = measure_capacity(client, launcher, pipe.coordinator, args, name, f"{nonce} {name[0]}", pid)
                    capacity_rows.append(row)
                    print(f"[harness] capacity, {name} decoder: {row['verdict']}", flush=True)
                    done(f"capacity {name}", capacity=capacity_rows)
            burst = None
            if args.burst:  # after every capacity row: the system idle again, the first decoder listed
                burst = measure_burst(client, launcher, pipe.coordinator, args, decoders_of(args)[0], f"{nonce} b")
                print(f"[harness] burst of {args.burst}: {burst['verdict']}", flush=True)
                done("burst", burst=burst)
            if args.json:  # each service's last lines while serving (e.g. the tiny decoder's batches), beside the JSON
                lines = [f"[{c.name}] {line}" for c in launcher.children for line in c.log]
                Path(args.json + ".serving.log").write_text("\n".join(lines) + "\n")
        mem = gpu_memory()
    for rec in (first, main, *firsts, inter, *by_decoder.values()):
        if rec is not None and rec.error:
            raise RuntimeError(f"a measured stream failed: {rec.error}")
    latencies = interactive_latencies(inter, prompt_chunks.get(inter.gen.info.pipeline_stream_id, [])) if inter else []
    span = main.stats() if main is not None else {"steady_fps": None, "whole_fps": None}
    stages = main_stages(before, after, span["last_s"] - span["first_s"]) if main is not None else []
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
        "interactive": interactive_summary(inter, prompt_chunks, latencies) if inter else None,
        "load": load_rows,
        "capacity_streams": capacity_of(load_rows),
        # --capacity: one row per decoder (measure_capacity); each row's "capacity" is its held count only where
        # admission refused the stream right past it and every admitted one held.
        "capacity": capacity_rows,
        "burst": burst,  # --burst N: N paced streams opened at one instant (benchmarks.harness.burst)
        "stages": stages,
        "comm": comm_summary(args, stages),
        "gpu_memory_used_mib": mem,
    }


def build_parser() -> argparse.ArgumentParser:
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
    add_flags(ap, CoordinatorOptions, only=["pace_grid", "lookahead", "gpu_sharing"])  # passed on to the coordinator
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
        type=parse_vae_ms,
        default=None,
        help="the coordinator's --vae-ms-per-chunk, a what-if: a number (the full VAE's ms per chunk on each GPU) or "
        "KIND=MS[,KIND=MS] per decoder kind, fixed in the SLO controller's model over the gateway's measurements",
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
        "--burst",
        type=int,
        default=0,
        help="after the capacity rows: this many paced streams opened at one instant on the idle system (admitted, "
        "held, refused, TTFF of the admitted, time to refusal; 0: none)",
    )
    ap.add_argument("--burst-seconds", type=float, default=20.0, help="the measured window of the burst row")
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
    gateway_flags = ["vae_compile", "vae_cuda_graphs", "tiny_cuda_graphs", "vae_cudnn_benchmark", "tiny_decoder"]
    add_flags(ap, GatewayOptions, only=gateway_flags)
    add_flags(ap, StageOptions, only=["cuda_graphs", "fp8", "dit_levers"])
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
    return ap


def settle(ap: argparse.ArgumentParser, args) -> str:
    """What ``--smoke`` and the flags imply, and the refusals before any work; returns the device kind."""
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
    return device_kind


def measure_peers(args, device, dtype, text_len: int, device_kind: str) -> tuple:
    """The peers and the compute floor (``--no-peers``: all None): (peak, floor FPS, FLOPs, peer, compiled peer)."""
    peak = floor_fps = flops = peer = peer_compiled = None
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
    return peak, floor_fps, flops, peer, peer_compiled


def report(result: dict, args) -> None:
    """The summary on stdout, the JSON (``--json``) and the markdown row (``--markdown``)."""
    system = result["system"]
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


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    device_kind = settle(ap, args)
    device = torch.device("cuda:0" if device_kind == "cuda" else "cpu")
    dtype = getattr(torch, args.dtype)
    text_len = 512 if model_config(args.model)["text_dim"] >= 512 else 16
    command = "python -m benchmarks.harness " + " ".join(argv if argv is not None else sys.argv[1:])

    import signal

    def cut(signum, frame):  # `timeout` sends SIGTERM: write what was measured, marked partial
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, cut)
    cut_by = None
    with tempfile.TemporaryDirectory(prefix="stagecast-bench-") as tmp:
        root = Path(tmp)
        write_assets(root, args)
        try:  # a profile that does not fit this run is refused before any measurement
            balance(root, args, device_kind, vae_devices_of(args, device_kind), announce=False)
        except ValueError as exc:
            ap.error(str(exc))
        peak, floor_fps, flops, peer, peer_compiled = measure_peers(args, device, dtype, text_len, device_kind)
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
        "args": {**vars(args), "cuda_mps": cuda_mps()},
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
    report(result, args)
    return 0 if not cut_by else 124


if __name__ == "__main__":
    sys.exit(main())
