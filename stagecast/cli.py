"""The ``stagecast`` command line.

stagecast up --checkpoint DIR --stages K        coordinator + K stages on this machine
stagecast coordinator --stages K ...            one coordinator process
stagecast stage --index I --coordinator H:P ... one stage process
stagecast selftest --stages K ...               distributed run vs the reference executor, exit 1 on mismatch
stagecast simulate --stages P --steps S ...     scheduler simulator: utilization and bubble fraction
stagecast demo-checkpoint --out DIR             write the tiny random demo checkpoint
stagecast gateway --coordinator H:P --checkpoint DIR   the public streaming API (stagecast.v1)
stagecast vae-stage --checkpoint DIR --index I --num-slices N [--next H:P]   one VAE decoder slice
stagecast generate --target H:P --prompt P --seconds N --out clip.mp4   stream a clip through a gateway
stagecast demo [--seconds N] [--out demo.mp4] [--stages K]   everything on CPU with a tiny random model
stagecast trace-summary FILE                    per-stage span latencies (p50/p95/max) of an OTLP JSON trace file
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading

from stagecast.log import setup_logging

SERVICE_COMMANDS = ("coordinator", "stage", "gateway", "vae-stage")


def _stop_event() -> threading.Event:
    """An event set by SIGTERM/SIGINT, so services shut down cleanly (they run as PID 1 in containers)."""
    stop = threading.Event()

    def handler(signum, frame):
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    return stop


def _csv(kind):
    """argparse type: a comma-separated list, e.g. ``cuda:0,cuda:1`` or ``4``."""

    def parse(text: str) -> list:
        try:
            return [kind(part.strip()) for part in text.split(",") if part.strip()]
        except ValueError:
            msg = f"expected a comma-separated list of {kind.__name__}, got {text!r}"
            raise argparse.ArgumentTypeError(msg) from None

    return parse


def _add_coordinator(sub) -> None:
    p = sub.add_parser("coordinator", help="run the coordinator (registry, scheduler, rendezvous store)")
    p.add_argument("--stages", type=int, required=True, help="number of DiT stages")
    p.add_argument("--partition", default=None, help="layers per stage, e.g. 8,12,12,8 (default: even)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50050)
    p.add_argument("--advertise-host", default=None, help="address stages use to reach this coordinator")
    p.add_argument("--store-port", type=int, default=0, help="rendezvous TCPStore port (0: any free port)")
    p.add_argument(
        "--backend", choices=["auto", "gloo", "nccl"], default="auto", help="data plane (auto: nccl on GPU stages)"
    )
    p.add_argument("--max-batch", type=int, default=4, help="micro-steps per stage forward (Stream Batch)")
    p.add_argument("--max-streams", type=int, default=16, help="admission limit on concurrent streams")
    p.add_argument("--record-plan", action="store_true", help="keep the plan for GetPlan (selftest)")
    p.add_argument("--metrics-port", type=int, default=0, help="Prometheus port (0: off)")


def _add_stage(sub) -> None:
    p = sub.add_parser("stage", help="run one DiT stage")
    p.add_argument("--index", type=int, default=None, help="stage index (default: $STAGECAST_STAGE_INDEX)")
    p.add_argument("--coordinator", required=True, help="coordinator host:port")
    p.add_argument(
        "--checkpoint", required=True, help="transformer checkpoint folder (or a folder holding transformer/)"
    )
    p.add_argument("--device", default="cpu", help="cpu, cuda (-> cuda:<index>) or cuda:N")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50060)
    p.add_argument("--advertise-host", default=None)
    p.add_argument("--expected-stages", type=int, default=0, help="refuse to join a coordinator of another size")
    p.add_argument("--dist-port", type=int, default=0, help="unused with the coordinator-hosted store; kept for charts")
    p.add_argument("--cuda-graphs", action="store_true", help="run the slice's blocks as CUDA graphs (GPU)")
    p.add_argument("--metrics-port", type=int, default=0)


def _add_up(sub) -> None:
    p = sub.add_parser("up", help="start coordinator, stages and gateway on this machine; SIGTERM stops all")
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--partition", default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50050, help="coordinator port")
    p.add_argument("--gateway-port", type=int, default=50051, help="public API port (no gateway: -1)")
    p.add_argument("--max-batch", type=int, default=4)
    p.add_argument("--cuda-graphs", action="store_true", help="stages run their blocks as CUDA graphs (GPU)")
    p.add_argument("--vae-compile", action="store_true", help="torch.compile the gateway's VAE decoder (GPU)")
    p.add_argument(
        "--vae-devices",
        default=None,
        help="devices the gateway's VAE is cut over (default with --device cuda: every stage's GPU)",
    )


def _add_selftest(sub) -> None:
    p = sub.add_parser("selftest", help="run the real multi-process pipeline and compare with the reference")
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--partition", default=None)
    p.add_argument("--policy", choices=["clean", "per_level"], default="per_level")
    p.add_argument("--streams", type=int, default=2)
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--window", type=int, default=0, help="KV window in latent frames (0: unbounded)")
    p.add_argument("--sink", type=int, default=0)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--checkpoint", default=None, help="transformer folder (default: a tiny random one)")
    p.add_argument("--height", type=int, default=8, help="latent height")
    p.add_argument("--width", type=int, default=8, help="latent width")
    p.add_argument("--tolerance", type=float, default=None, help="max abs diff allowed (default: 0, exact)")
    p.add_argument("--model", default="tiny-wan2.1", help="config of the random checkpoint (no --checkpoint)")
    p.add_argument("--layers", type=int, default=None, help="override that config's layer count")
    p.add_argument("--cuda-graphs", action="store_true", help="stages run CUDA graphs (the reference stays eager)")


def _add_demo_checkpoint(sub) -> None:
    p = sub.add_parser("demo-checkpoint", help="write the tiny random demo checkpoint")
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)


def _add_gateway(sub) -> None:
    p = sub.add_parser("gateway", help="run the gateway: public streaming API, text encoder, VAE, frame encoding")
    p.add_argument("--coordinator", required=True, help="coordinator host:port")
    p.add_argument("--checkpoint", required=True, help="folder with transformer/ vae/ text_encoder/ tokenizer/")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051, help="0: any free port (printed on the READY line)")
    p.add_argument("--device", default="cpu", help="where the text encoder and VAE run: cpu, cuda, cuda:N")
    p.add_argument("--max-streams", type=int, default=8, help="concurrent streams this gateway accepts")
    p.add_argument("--metrics-port", type=int, default=0, help="Prometheus port (0: off)")
    p.add_argument("--text-len", type=int, default=None, help="text tokens (default: checkpoint's, else 512)")
    p.add_argument("--vae-dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--vae-compile", action="store_true", help="torch.compile the VAE decoder (GPU)")
    p.add_argument("--buffer-chunks", type=int, default=4, help="latent chunks buffered per stream")
    p.add_argument("--buffer-messages", type=int, default=32, help="encoded frames buffered per stream")
    p.add_argument(
        "--slow-client-timeout",
        type=float,
        default=5.0,
        help="seconds frames may wait unread by a client before its stream ends with RESOURCE_EXHAUSTED",
    )
    p.add_argument("--drain-timeout", type=float, default=60.0, help="seconds a stopped stream may take to drain")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--vae-stage", default=None, help="host:port of the first vae-stage (default: VAE in-process)")
    p.add_argument(
        "--vae-devices",
        type=_csv(str),
        default=None,
        help="cut the in-process VAE into one pipelined slice per device, e.g. cuda:0,cuda:1 (default: --device)",
    )
    p.add_argument(
        "--vae-split",
        type=_csv(int),
        default=None,
        help="decoder units where VAE slices 1.. start, e.g. 4 (default: balanced by multiply-accumulates)",
    )


def _add_vae_stage(sub) -> None:
    p = sub.add_parser("vae-stage", help="run one slice of the VAE decoder as its own process (chain them)")
    p.add_argument("--checkpoint", required=True, help="folder holding vae/ (or the VAE folder)")
    p.add_argument("--index", type=int, required=True)
    p.add_argument("--num-slices", type=int, required=True)
    p.add_argument("--next", default=None, help="host:port of the next vae-stage (every stage but the last)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50070)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="stream a clip from a gateway into an MP4 (progress bar, TTFF, FPS)")
    p.add_argument("--target", default="localhost:50051", help="gateway host:port")
    p.add_argument("--prompt", required=True)
    p.add_argument("--seconds", type=float, default=None, help="duration (default: until Ctrl-C)")
    p.add_argument("--out", default="clip.mp4")
    p.add_argument("--width", type=int, default=None, help="pixels (default: the gateway's)")
    p.add_argument("--height", type=int, default=None)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--seed", type=int, default=None, help="default: random (printed)")
    p.add_argument("--codec", choices=["h264", "jpeg", "raw"], default="h264", help="what travels on the wire")
    p.add_argument("--chunk-frames", type=int, default=None, help="latent frames per chunk")
    p.add_argument("--fps", type=float, default=None, help="target fps (default: the gateway's)")
    p.add_argument("--timeout", type=float, default=None, help="deadline for the whole call, seconds")


def _add_demo(sub) -> None:
    p = sub.add_parser("demo", help="run everything on CPU with a tiny random model and write an MP4")
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--out", default="demo.mp4")
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--prompt", default=None)
    p.add_argument("--codec", choices=["h264", "jpeg", "raw"], default="h264")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache", default=None, help="checkpoint cache (default: $STAGECAST_CACHE/demo or ~/.cache/...)")
    p.add_argument("--no-progress", action="store_true")


def _add_trace_summary(sub) -> None:
    p = sub.add_parser("trace-summary", help="per-stage span latency table (count, p50, p95, max) of an OTLP JSON file")
    p.add_argument("file", help="OTLP/JSON traces (ExportTraceServiceRequest; one per line also accepted); - for stdin")
    p.add_argument("--by", choices=["stage", "service"], default="stage", help="group rows by stage or by service")


def _resolve_transformer(path: str) -> str:
    if path.startswith("random:"):
        return path
    sub = os.path.join(path, "transformer")
    return sub if os.path.isdir(sub) else path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="stagecast", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _add_coordinator(sub)
    _add_stage(sub)
    _add_up(sub)
    _add_selftest(sub)
    _add_demo_checkpoint(sub)
    _add_gateway(sub)
    _add_vae_stage(sub)
    _add_generate(sub)
    _add_demo(sub)
    from coordinator.simulator import add_simulate_parser

    add_simulate_parser(sub)
    _add_trace_summary(sub)
    args = parser.parse_args(argv)
    setup_logging()
    try:
        return _dispatch(args, parser)
    except (ValueError, FileNotFoundError) as exc:
        if args.command not in SERVICE_COMMANDS:
            raise
        # A service that cannot start from its flags says why in one line (the traceback is at debug level).
        logging.getLogger("stagecast.cli").debug("%s failed to start", args.command, exc_info=True)
        print(f"stagecast {args.command}: error: {exc}", file=sys.stderr)
        return 2


def _dispatch(args, parser) -> int:
    if args.command == "coordinator":
        from coordinator.server import CoordinatorOptions, serve

        serve(
            CoordinatorOptions(
                stages=args.stages,
                partition=args.partition,
                host=args.host,
                port=args.port,
                advertise_host=args.advertise_host,
                store_port=args.store_port,
                backend="" if args.backend == "auto" else args.backend,
                max_batch=args.max_batch,
                max_streams=args.max_streams,
                record_plan=args.record_plan,
                metrics_port=args.metrics_port,
            ),
            stop=_stop_event(),
        )
        return 0
    if args.command == "stage":
        from stage_service.server import StageOptions, serve

        index = args.index if args.index is not None else os.environ.get("STAGECAST_STAGE_INDEX")
        if index is None:
            parser.error("stage needs --index or STAGECAST_STAGE_INDEX")
        index = int(index)
        device = args.device
        if device == "cuda":
            import torch

            device = f"cuda:{index % max(torch.cuda.device_count(), 1)}"
        serve(
            StageOptions(
                index=index,
                coordinator=args.coordinator,
                checkpoint=_resolve_transformer(args.checkpoint),
                device=device,
                dtype=args.dtype,
                host=args.host,
                port=args.port,
                advertise_host=args.advertise_host,
                expected_world_size=args.expected_stages,
                metrics_port=args.metrics_port,
                cuda_graphs=args.cuda_graphs,
            ),
            stop=_stop_event(),
        )
        return 0
    if args.command == "up":
        from stagecast.launcher import Launcher, announce_ready
        from stagecast.local_cluster import start_pipeline

        stop = _stop_event()
        with Launcher(echo=True) as launcher:
            pipe = start_pipeline(
                launcher,
                checkpoint=_resolve_transformer(args.checkpoint),
                stages=args.stages,
                partition=args.partition,
                device=args.device,
                dtype=args.dtype,
                max_batch=args.max_batch,
                host=args.host,
                port=args.port,
                cuda_graphs=args.cuda_graphs,
            )
            ready = {"coordinator": pipe.coordinator}
            root = args.checkpoint
            if args.gateway_port >= 0 and all(os.path.isdir(os.path.join(root, d)) for d in ("vae", "text_encoder")):
                # The gateway's text encoder shares the last stage's GPU; its VAE is cut over every stage's GPU.
                gw_device, vae_devices = args.device, args.vae_devices
                if args.device == "cuda":
                    import torch

                    gpus = max(torch.cuda.device_count(), 1)  # stage i runs on cuda:(i % gpus)
                    gw_device = f"cuda:{(args.stages - 1) % gpus}"
                    if vae_devices is None:
                        vae_devices = ",".join(f"cuda:{i}" for i in range(min(args.stages, gpus)))
                gw_args = ["gateway", "--coordinator", pipe.coordinator, "--checkpoint", root, "--device", gw_device]
                gw_args += ["--host", args.host, "--port", str(args.gateway_port)]
                if vae_devices:
                    gw_args += ["--vae-devices", vae_devices]
                if args.device.startswith("cuda"):
                    gw_args += ["--vae-dtype", args.dtype]
                if args.vae_compile:
                    gw_args.append("--vae-compile")
                gateway = launcher.spawn("gateway", gw_args)
                ready["gateway"] = gateway.info["address"]
            where = ", ".join(f"{role} {address}" for role, address in ready.items())
            print(f"stagecast is up: {where}, {args.stages} stages", flush=True)
            announce_ready(**ready)
            stop.wait()
            print("shutting down", flush=True)
        return 0
    if args.command == "selftest":
        from stagecast.selftest import SelftestConfig, run_selftest

        cfg = SelftestConfig(
            stages=args.stages,
            partition=args.partition,
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
            tolerance=args.tolerance,
            model=args.model,
            layers=args.layers,
            cuda_graphs=args.cuda_graphs,
        )
        return run_selftest(cfg)
    if args.command == "demo-checkpoint":
        from stagecast.demo_checkpoint import write_demo_checkpoint

        path = write_demo_checkpoint(args.out, seed=args.seed)
        print(f"wrote demo checkpoint to {path}")
        return 0
    if args.command == "gateway":
        from gateway.service import GatewayOptions, serve

        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        serve(
            GatewayOptions(
                coordinator=args.coordinator,
                checkpoint=args.checkpoint,
                host=args.host,
                port=args.port,
                device=args.device,
                max_streams=args.max_streams,
                metrics_port=args.metrics_port,
                text_len=args.text_len,
                vae_dtype=args.vae_dtype,
                vae_compile=args.vae_compile,
                buffer_chunks=args.buffer_chunks,
                buffer_messages=args.buffer_messages,
                slow_client_timeout=args.slow_client_timeout,
                drain_timeout=args.drain_timeout,
                vae_stage=args.vae_stage,
                vae_devices=args.vae_devices,
                vae_split=args.vae_split,
            ),
            stop=_stop_event(),
        )
        return 0
    if args.command == "vae-stage":
        from gateway.vae_stage import VAEStageOptions, serve

        serve(
            VAEStageOptions(
                checkpoint=args.checkpoint,
                index=args.index,
                num_slices=args.num_slices,
                next=args.next,
                host=args.host,
                port=args.port,
                device=args.device,
                dtype=args.dtype,
            ),
            stop=_stop_event(),
        )
        return 0
    if args.command == "generate":
        from stagecast.errors import StagecastError
        from stagecast.generate import generate_clip

        try:
            report = generate_clip(
                args.target,
                args.out,
                prompt=args.prompt,
                timeout=args.timeout,
                seconds=args.seconds,
                width=args.width,
                height=args.height,
                steps=args.steps,
                seed=args.seed,
                codec=args.codec,
                chunk_frames=args.chunk_frames,
                target_fps=args.fps,
            )
        except StagecastError as exc:
            print(f"stagecast generate: {exc}", file=sys.stderr)
            return 1
        print(report.summary())
        return 0
    if args.command == "demo":
        from stagecast.demo import DEFAULT_PROMPT, DemoConfig, run_demo

        return run_demo(
            DemoConfig(
                seconds=args.seconds,
                out=args.out,
                stages=args.stages,
                prompt=args.prompt or DEFAULT_PROMPT,
                codec=args.codec,
                seed=args.seed,
                cache=args.cache,
                progress=not args.no_progress,
            )
        )
    if args.command == "trace-summary":
        from stagecast.trace_summary import main as trace_summary_main

        return trace_summary_main(args)
    if args.command == "simulate":
        from coordinator.simulator import main as simulate_main

        return simulate_main(args)
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
