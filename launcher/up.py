"""``stagecast up``: a coordinator, K stages and a gateway on this machine; SIGTERM or Ctrl-C stops them all.

Its ports are checked before anything starts (a taken one fails at once with "address already in use").  It
supervises its children: a service that dies is started again with backoff (on the same port), and one that dies
more than ``--max-restarts`` times in 10 minutes makes ``up`` stop everything and exit 1, naming it.  A stage whose
health checks fail for ``--stage-hang-s`` (15 s: a stopped process, or an executor that makes no progress) is killed
and so restarted.
"""

from __future__ import annotations

import argparse
import os
import sys

from coordinator.options import CoordinatorOptions
from gateway.options import GatewayOptions
from stage_service.options import StageOptions
from stagecast.flags import HelpFormatter, add_flags, argv_for, from_args, to_argv
from stagecast.service import announce_ready, resolve_transformer, stop_event

# The service flags ``up`` takes and passes on; the rest of its flags are its own (a layout, ports it spreads).
COORDINATOR_FLAGS = ("sp", "cfg_parallel", "max_batch")
STAGE_FLAGS = ("dtype", "cuda_graphs", "fp8", "loras")
GATEWAY_FLAGS = (
    "vae_compile",
    "vae_cuda_graphs",
    "vae_devices",
    "tiny_decoder",
    "default_decoder",
    "tokens",
    "tls_cert",
    "tls_key",
)


def add_parser(sub) -> None:
    p = sub.add_parser(
        "up",
        help="start coordinator, stages and gateway on this machine; SIGTERM stops all",
        formatter_class=HelpFormatter,
    )
    p.add_argument("--checkpoint", required=True, help="checkpoint folder (transformer/, vae/, text_encoder/, ...)")
    p.add_argument("--stages", type=int, default=2, help="DiT stages (one process each)")
    p.add_argument(
        "--partition",
        default=None,
        help="layers per stage, e.g. 8,12,12,8 (default: even); auto: the stage partition and the gateway's VAE cut "
        "chosen together from --balance-profile",
    )
    p.add_argument(
        "--balance-profile",
        default=None,
        help="measured ms per chunk of every block and VAE unit (python -m benchmarks.balance), for --partition auto",
    )
    p.add_argument("--device", default="cpu", help="cpu, or cuda (stage i on cuda:i: one GPU per stage)")
    p.add_argument("--host", default="127.0.0.1", help="address every service binds")
    p.add_argument("--port", type=int, default=50050, help="coordinator port")
    p.add_argument(
        "--health-port",
        type=int,
        default=-1,
        help="the coordinator's plaintext grpc.health.v1 on --host, for health checks without the throwaway mTLS "
        "certificates (e.g. grpc_health_probe -addr HOST:PORT); none: -1",
    )
    p.add_argument("--gateway-port", type=int, default=50051, help="public API port (no gateway: -1)")
    p.add_argument(
        "--web-port", type=int, default=8080, help="the live browser page (stagecast web) on --host (none: -1)"
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        help="Prometheus ports from here: coordinator N, gateway N+1, stage i N+2+i, all on --host (0: off)",
    )
    p.add_argument(
        "--credentials",
        default=None,
        help="deployment credentials folder (ca.crt and one folder per role, e.g. made for a test) instead of a"
        " throwaway CA in a private temporary folder",
    )
    p.add_argument(
        "--max-restarts",
        type=int,
        default=5,
        help="restarts of one dead service within 10 minutes before up exits non-zero naming it (0: none)",
    )
    p.add_argument(
        "--stage-hang-s",
        type=float,
        default=15.0,
        help="a stage whose health checks fail this long (stopped, or its executor hung) is killed and restarted",
    )
    # The services' own flags, declared once in their options and passed on as given.
    layout = p.add_argument_group(
        "coordinator flags, passed on", "with --device cuda, one GPU per stage process: stages × sp × cfg-parallel"
    )
    add_flags(layout, CoordinatorOptions, only=COORDINATOR_FLAGS)
    stage = p.add_argument_group("stage flags, passed to every stage", "with --device cuda, --dtype is the VAE's too")
    add_flags(stage, StageOptions, only=STAGE_FLAGS)
    gateway = p.add_argument_group(
        "gateway flags, passed on", "with --device cuda, --vae-devices defaults to every stage's GPU"
    )
    add_flags(gateway, GatewayOptions, only=GATEWAY_FLAGS)
    p.set_defaults(run=main)


def main(args: argparse.Namespace) -> int:
    from launcher.local_cluster import Placement, check_gpu_fit, check_layout, start_pipeline, web_args
    from launcher.process import Launcher, LaunchError, Supervisor, remove_stale_credentials
    from stagecast.grpc_util import AddressInUseError, check_port_free

    # First, whatever else happens: the throwaway credentials of earlier runs killed with SIGKILL (they could not
    # delete them), found by their owner's pid.
    for stale in remove_stale_credentials():
        print(f"stagecast up: removed {stale}, the credentials of a run that is gone", file=sys.stderr)
    if not 1.0 <= args.stage_hang_s <= 3600.0:  # also NaN
        print(f"stagecast up: error: --stage-hang-s must be in [1, 3600], got {args.stage_hang_s}", file=sys.stderr)
        return 2

    if args.fp8:
        from stagecast.fp8 import Fp8Unavailable, check_fp8

        try:
            check_fp8(args.device, args.dtype)  # every GPU the stages would use, before anything starts
        except Fp8Unavailable as exc:
            print(f"stagecast up: error: {exc}", file=sys.stderr)
            return 2
    if args.health_port == 0 or args.health_port > 65535:
        print(
            "stagecast up: error: --health-port: a port in [1, 65535] (a prober must know it), or -1 for none",
            file=sys.stderr,
        )
        return 2
    web_port = args.web_port if args.gateway_port >= 0 else -1  # the page needs the gateway
    ports = (("coordinator", args.port), ("gateway", args.gateway_port), ("web", web_port))
    for role, port in (*ports, ("coordinator health", args.health_port)):
        try:
            check_port_free(args.host, max(port, 0))  # before anything starts: fail at once
        except AddressInUseError as exc:
            print(f"stagecast up: {role} port: {exc.strerror}", file=sys.stderr)
            return 2
    stop = stop_event()
    try:
        if args.cfg_parallel > 1 and args.sp > 1:
            raise ValueError("--cfg-parallel 2 does not compose with --sp yet (give one of them)")
        if args.sp == 1:  # a sequence-parallel layout's GPUs are checked by its own rule, which names --sp
            check_gpu_fit(args.device, args.stages, args.cfg_parallel)
        check_layout(resolve_transformer(args.checkpoint), args.stages, args.sp)
        placement = Placement.plan(
            args.device, args.stages, vae_devices=args.vae_devices, sp=args.sp, cfg_parallel=args.cfg_parallel
        )
        partition, vae_split = _balance(args, placement)
    except (ValueError, OSError) as exc:
        print(f"stagecast up: error: {exc}", file=sys.stderr)
        return 2
    # Every internal connection is mTLS: the launcher makes a throwaway CA and one certificate per role in a private
    # temporary folder (or uses --credentials), and deletes it on the way out.
    with Launcher(echo=True, credentials=args.credentials) as launcher:
        supervisor = Supervisor(launcher, stop, max_restarts=args.max_restarts, hang_s=args.stage_hang_s)
        try:
            pipe = start_pipeline(
                launcher,
                checkpoint=resolve_transformer(args.checkpoint),
                stages=args.stages,
                partition=partition,
                device=args.device,
                dtype=args.dtype,
                max_batch=args.max_batch,
                host=args.host,
                port=args.port,
                cuda_graphs=args.cuda_graphs,
                fp8=args.fp8,
                loras=args.loras,
                metrics_port=args.metrics_port,
                sp=args.sp,
                cfg_parallel=args.cfg_parallel,
                coordinator_args=argv_for(CoordinatorOptions, health_port=max(args.health_port, 0)),
                wait=False,  # the gateway (started below) loads its models while the stages load theirs
            )
            ready = {"coordinator": pipe.coordinator}
            root = args.checkpoint
            gateway = None
            if args.gateway_port >= 0 and all(os.path.isdir(os.path.join(root, d)) for d in ("vae", "text_encoder")):
                gateway_options = from_args(
                    GatewayOptions,
                    args,
                    only=GATEWAY_FLAGS,
                    coordinator=pipe.coordinator,
                    checkpoint=root,
                    device=placement.gateway_device,
                    host=args.host,
                    vae_devices=placement.vae_devices,
                    vae_split=vae_split,
                    vae_dtype=args.dtype if args.device.startswith("cuda") else "float32",
                    metrics_port=args.metrics_port + 1 if args.metrics_port else 0,
                    tiny_decoder=os.path.abspath(args.tiny_decoder) if args.tiny_decoder else None,
                )
                gw_args = ["gateway", *to_argv(gateway_options, skip=("port",))]
                gateway = launcher.start("gateway", [*gw_args, "--port", str(args.gateway_port)])
            pipe.wait_ready(launcher, 600.0)
            supervisor.watch(pipe.coordinator_child, pipe.coordinator_args)
            for index, child in pipe.stage_children.items():
                supervisor.watch(child, pipe.stage_args[index], health="stage")  # a hung stage is replaced too
            if gateway is not None:
                launcher.wait_ready(gateway, timeout=300.0)
                ready["gateway"] = gateway.info["address"]
                bound = ready["gateway"].rsplit(":", 1)[1]
                supervisor.watch(gateway, [*gw_args, "--port", bound])  # a restart keeps the port
                if args.web_port >= 0:
                    page_args = web_args(ready["gateway"], args.host, args.web_port, args.tokens, args.tls_cert)
                    page = launcher.spawn("web", page_args)
                    ready["web"] = page.info["url"]
                    page_port = page.info["address"].rsplit(":", 1)[1]
                    supervisor.watch(page, [*page_args[:-1], page_port])
        except LaunchError as exc:
            print(f"stagecast up: {exc}", file=sys.stderr)
            return 1
        where = ", ".join(f"{role} {address}" for role, address in ready.items())
        shape = f"{args.stages} stages" + (f" × {args.sp} sequence-parallel ranks" if args.sp > 1 else "")
        shape += f" × {args.cfg_parallel} CFG-parallel groups" if args.cfg_parallel > 1 else ""
        print(f"stagecast is up: {where}, {shape}", flush=True)
        if args.health_port > 0:
            print(f"coordinator health (plaintext grpc.health.v1): {args.host}:{args.health_port}", flush=True)
        if "web" in ready:
            print(f"watch and steer it in a browser: {ready['web']}", flush=True)
        announce_ready(**ready)
        failure = supervisor.wait()
        if failure is not None:
            print(f"stagecast up: {failure}", file=sys.stderr, flush=True)
        print("shutting down", flush=True)
    return 1 if failure is not None else 0


def _balance(args: argparse.Namespace, placement) -> tuple[str | None, list[int] | None]:
    """``--partition`` as given, or with ``auto`` the planner's partition and the gateway's VAE cut (one answer)."""
    from launcher.balance import check_flags, resolve_balance

    check_flags(args.partition, args.balance_profile, args.sp, args.cfg_parallel)
    if args.partition != "auto":
        return args.partition, None
    root = args.checkpoint
    gateway = args.gateway_port >= 0 and all(os.path.isdir(os.path.join(root, d)) for d in ("vae", "text_encoder"))
    choice = resolve_balance(
        args.balance_profile,
        transformer=resolve_transformer(root),
        stage_devices=placement.stage_devices[: args.stages],
        vae_folder=os.path.join(root, "vae") if gateway else None,
        vae_devices=placement.vae_devices,
    )
    print(f"stagecast up: {choice.describe()}", flush=True)
    return choice.partition, choice.vae_split
