"""``stagecast up``: a coordinator, K stages and a gateway on this machine; SIGTERM or Ctrl-C stops them all.

Its ports are checked before anything starts (a taken one fails at once with "address already in use").  It
supervises its children: a service that dies is started again with backoff (on the same port), and one that dies
more than ``--max-restarts`` times in 10 minutes makes ``up`` stop everything and exit 1, naming it.  A stage whose
health checks fail for ``--stage-hang-s`` (15 s: a stopped process, or an executor that makes no progress) is killed
and so restarted.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

from coordinator.options import CoordinatorOptions
from gateway.options import GatewayOptions
from launcher.pipeline_start import (
    GATEWAY_FLAGS,
    Plan,
    gateway_argv,
    has_gateway,
    start_stages,
    start_web,
    watch_pipeline,
)
from stage_service.options import StageOptions
from stagecast.flags import HelpFormatter, add_flags
from stagecast.service import announce_ready, print_line, resolve_transformer, stop_event

# The service flags ``up`` takes and passes on; the rest of its flags are its own (a layout, ports it spreads).
COORDINATOR_FLAGS = ("sp", "cfg_parallel", "max_batch", "pace_grid", "gpu_sharing", "stage_ms", "slo_learn")
STAGE_FLAGS = ("dtype", "cuda_graphs", "fp8", "dit_levers", "loras", "kv_budget_gib")


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
    p.add_argument(
        "--gateway-device",
        default=None,
        metavar="cuda:N",
        help="with --device cuda, the GPU of the gateway's text encoder and decoders (default: the last stage's; its "
        "VAE too unless --vae-devices): a GPU of its own leaves the stages' GPUs to their KV",
    )
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
    p.add_argument(
        "--cuda-mps",
        action="store_true",
        help="with --device cuda: run a CUDA MPS control daemon of this run's own (nvidia-cuda-mps-control), so "
        "processes sharing a GPU (a stage and the gateway's decoders) run their kernels side by side instead of "
        "time-slicing it; stopped with up (docs/operator-guide.md, 'The most streams per GPU')",
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
    fleet = p.add_argument_group(
        "a fleet", "N pipelines behind one HAProxy door on --gateway-port (docs/operator-guide.md, 'A fleet')"
    )
    fleet.add_argument(
        "--pipelines",
        type=int,
        default=1,
        help="pipelines (coordinator, --stages stages and a gateway each) behind one HAProxy on --gateway-port that "
        "routes each new stream by their free slots; 1: one pipeline, no proxy",
    )
    fleet.add_argument(
        "--state-file",
        default=None,
        metavar="PATH",
        help="with --pipelines: write the door, each pipeline's addresses and pids here as JSON (rewritten when a "
        "process restarts)",
    )
    add_flags(fleet, GatewayOptions, only=("fleet_drain_s",))
    p.set_defaults(run=main)


def main(args: argparse.Namespace) -> int:
    # First, whatever else happens: the throwaway credentials of earlier runs killed with SIGKILL (they could not
    # delete them), found by their owner's pid.
    from launcher.process import remove_stale_credentials

    for stale in remove_stale_credentials():
        print(f"stagecast up: removed {stale}, the credentials of a run that is gone", file=sys.stderr)
    problem = _check_flags(args) or _check_ports(args)
    if problem:
        print(f"stagecast up: {problem}", file=sys.stderr)
        return 2
    stop = stop_event()
    try:
        plan = _plan(args)
        plan = plan_memory(args, plan)
    except (ValueError, OSError) as exc:
        print(f"stagecast up: error: {exc}", file=sys.stderr)
        return 2
    with contextlib.ExitStack() as stack:
        if args.cuda_mps:
            from launcher.mps import CudaMps, MpsError

            try:
                mps = stack.enter_context(CudaMps())
            except MpsError as exc:
                print(f"stagecast up: error: {exc}", file=sys.stderr)
                return 2
            print_line(f"CUDA MPS: a daemon of this run's own ({mps.env['CUDA_MPS_PIPE_DIRECTORY']})")
        if args.pipelines > 1:
            from launcher.fleet import run_fleet

            return run_fleet(args, plan, stop)
        return _run_one(args, plan, stop)


def _check_flags(args: argparse.Namespace) -> str | None:
    """The flags ``up`` itself checks before anything starts (one line naming the flag), or None."""
    if not 1.0 <= args.stage_hang_s <= 3600.0:  # also NaN
        return f"error: --stage-hang-s must be in [1, 3600], got {args.stage_hang_s}"
    if args.cuda_mps and not args.device.startswith("cuda"):
        return "error: --cuda-mps: only with --device cuda (MPS shares a GPU between processes)"
    if args.dit_levers:
        from stage_service.dit_levers import parse_levers

        try:
            levers = parse_levers(args.dit_levers)  # a bad name fails here, not in every stage after the weights load
        except ValueError as exc:
            return f"error: {exc}"
        if "fp8" in levers and args.fp8:
            return "error: --dit-levers fp8 and --fp8 both turn the block linears to float8: choose one"
    if args.fp8:
        from stagecast.fp8 import Fp8Unavailable, check_fp8

        try:
            check_fp8(args.device, args.dtype)  # every GPU the stages would use, before anything starts
        except Fp8Unavailable as exc:
            return f"error: {exc}"
    if args.health_port == 0 or args.health_port > 65535:
        return "error: --health-port: a port in [1, 65535] (a prober must know it), or -1 for none"
    if args.pipelines > 1:
        from launcher.fleet import check_fleet_flags

        return check_fleet_flags(args)
    if args.pipelines < 1:
        return f"error: --pipelines must be >= 1, got {args.pipelines}"
    return None


def _check_ports(args: argparse.Namespace) -> str | None:
    """Every fixed port free before anything starts (a taken one fails at once), or the line that says which."""
    from stagecast.grpc_util import AddressInUseError, check_port_free

    web_port = args.web_port if args.gateway_port >= 0 else -1  # the page needs the gateway
    ports = (("coordinator", args.port), ("gateway", args.gateway_port), ("web", web_port))
    for role, port in (*ports, ("coordinator health", args.health_port)):
        try:
            check_port_free(args.host, max(port, 0))
        except AddressInUseError as exc:
            return f"{role} port: {exc.strerror}"
    return None


def _plan(args: argparse.Namespace) -> Plan:
    """One pipeline's layout, checked against the model and the GPUs (raises ValueError naming the flag)."""
    from launcher.local_cluster import Placement, check_gpu_fit, check_layout

    if args.cfg_parallel > 1 and args.sp > 1:
        raise ValueError("--cfg-parallel 2 does not compose with --sp yet (give one of them)")
    if args.sp == 1:  # a sequence-parallel layout's GPUs are checked by its own rule, which names --sp
        check_gpu_fit(args.device, args.stages, args.cfg_parallel)
    check_layout(resolve_transformer(args.checkpoint), args.stages, args.sp)
    placement = Placement.plan(
        args.device, args.stages, vae_devices=args.vae_devices, sp=args.sp, cfg_parallel=args.cfg_parallel
    )
    if args.gateway_device:
        placement = _gateway_on(args, placement)
    partition, vae_split = _balance(args, placement)
    return Plan(placement, partition, vae_split)


def _gateway_on(args: argparse.Namespace, placement, gpus: int | None = None):
    """``--gateway-device cuda:N``: the gateway's text encoder and decoders there (its VAE too, unless
    ``--vae-devices``); ValueError naming the flag for a device that is not one of this machine's GPUs."""
    import dataclasses

    device = args.gateway_device
    if not args.device.startswith("cuda"):
        raise ValueError("--gateway-device: only with --device cuda (on a CPU everything shares the host)")
    if gpus is None:
        import torch

        gpus = torch.cuda.device_count()
    head, _, index = device.partition(":")
    if head != "cuda" or not index.isdigit() or int(index) >= gpus:
        raise ValueError(f"--gateway-device: must be cuda:N with N < {gpus} (this machine's GPUs), got {device!r}")
    vae = args.vae_devices or [device]
    return dataclasses.replace(placement, gateway_device=device, vae_devices=vae)


def plan_memory(
    args: argparse.Namespace, plan: Plan, totals: dict[str, int] | None = None, who: str = "stagecast up"
) -> Plan:
    """The shares of every GPU several of ``up``'s processes use (``launcher.memory_plan``), one line each; raises
    ValueError naming the part to move when one holds no stream (and, on any device, an operator's --kv-budget-gib
    that holds none).  ``totals``: each GPU's bytes (default: torch's); a fleet's pipelines are planned together."""
    import dataclasses

    if not args.device.startswith("cuda") and not args.kv_budget_gib:
        return plan  # a CPU: no budget to plan (the OS decides what fits)
    from launcher import memory_plan

    pipelines = max(1, getattr(args, "pipelines", 1))
    layouts = []
    for i in range(pipelines):
        name = f"p{i}" if pipelines > 1 else ""
        device_of = _fleet_device(args, i) if pipelines > 1 else (lambda d: d)
        layouts.append(
            memory_plan.pipeline_layout(args, plan.placement, plan.partition, pipeline=name, device_of=device_of)
        )
    transformer = resolve_transformer(args.checkpoint)
    from stagecast.kv_memory import describe_spec
    from stagecast.model.config import checkpoint_config

    spec, sf, _ = memory_plan.serving_of(transformer, checkpoint_config(transformer))
    serving = describe_spec(spec, sf)
    problems = memory_plan.stage_fit_problems(layouts[0], serving)
    if problems:
        raise ValueError(problems[0])
    if not args.device.startswith("cuda"):
        return plan
    parts = [part for layout in layouts for part in memory_plan.layout_parts(layout)]
    if totals is None:
        totals = _gpu_totals({part.device for part in parts})
    plans = memory_plan.plan_devices(totals, parts, serving)
    for device in plans:
        if device.problem:
            raise ValueError(device.problem)
    for device in plans:
        if device.shared:
            print(f"{who}: memory: {device.line()}", flush=True)
    return dataclasses.replace(plan, shares=memory_plan.share_of(plans))


def _fleet_device(args: argparse.Namespace, index: int, gpus: int | None = None):
    """Pipeline ``index``'s device names as this machine numbers its GPUs (``launcher.fleet.pipeline_gpus``)."""
    from launcher.fleet import pipeline_gpus

    visible = pipeline_gpus(args, index, gpus)

    def device_of(device: str) -> str:
        head, _, n = device.partition(":")
        return f"cuda:{visible[int(n)]}" if head == "cuda" and n.isdigit() else device

    return device_of


def _gpu_totals(devices: set[str]) -> dict[str, int]:
    """Each CUDA device's total bytes (``torch.cuda.get_device_properties``)."""
    import torch

    return {d: torch.cuda.get_device_properties(torch.device(d)).total_memory for d in devices}


def _run_one(args: argparse.Namespace, plan: Plan, stop) -> int:
    """One pipeline (``--pipelines 1``): coordinator, stages, gateway and page, supervised until SIGTERM."""
    from launcher.process import Launcher, LaunchError, Supervisor

    # Every internal connection is mTLS: the launcher makes a throwaway CA and one certificate per role in a private
    # temporary folder (or uses --credentials), and deletes it on the way out.
    from launcher.startup_view import StartupView

    with Launcher(echo=True, credentials=args.credentials, startup=StartupView()) as launcher:
        supervisor = Supervisor(launcher, stop, max_restarts=args.max_restarts, hang_s=args.stage_hang_s)
        try:
            ready = _start_one(launcher, supervisor, args, plan)
        except LaunchError as exc:
            print(f"stagecast up: {exc}", file=sys.stderr)
            return 1
        _say_up(args, ready, f"{_shape(args)}")
        failure = supervisor.wait()
        if failure is not None:
            print(f"stagecast up: {failure}", file=sys.stderr, flush=True)
        print("shutting down", flush=True)
    return 1 if failure is not None else 0


def _start_one(launcher, supervisor, args: argparse.Namespace, plan: Plan) -> dict[str, str]:
    pipe = start_stages(
        launcher,
        args,
        plan,
        port=args.port,
        metrics_port=args.metrics_port,
        health_port=args.health_port,
    )
    ready = {"coordinator": pipe.coordinator}
    gateway = gw_args = None
    if has_gateway(args):
        gw_args = gateway_argv(
            args, plan, pipe.coordinator, metrics_port=args.metrics_port + 1 if args.metrics_port else 0
        )
        gateway = launcher.start("gateway", [*gw_args, "--port", str(args.gateway_port)])
    pipe.wait_ready(launcher, 600.0)
    watch_pipeline(supervisor, pipe)
    if gateway is not None:
        launcher.wait_ready(gateway, timeout=300.0)
        ready["gateway"] = gateway.info["address"]
        bound = ready["gateway"].rsplit(":", 1)[1]
        supervisor.watch(gateway, [*gw_args, "--port", bound])  # a restart keeps the port
        if args.web_port >= 0:
            ready["web"] = start_web(launcher, supervisor, args, ready["gateway"])["url"]
    return ready


def _shape(args: argparse.Namespace) -> str:
    shape = f"{args.stages} stage{'s' if args.stages != 1 else ''}"
    shape += f" × {args.sp} sequence-parallel ranks" if args.sp > 1 else ""
    return shape + (f" × {args.cfg_parallel} CFG-parallel groups" if args.cfg_parallel > 1 else "")


WILDCARDS = ("0.0.0.0", "::", "[::]", "")


def reachable(address: str) -> str:
    """``address`` as a client on this machine dials it: a wildcard host (every interface) is 127.0.0.1."""
    host, _, port = address.rpartition(":")
    if host not in WILDCARDS:
        return address
    return f"127.0.0.1:{port}"


def summary(args: argparse.Namespace, ready: dict[str, str], shape: str, took: float | None = None) -> list[str]:
    """The lines that say ``up`` is up (``ready``: role -> address or URL; ``took``: seconds since ``up`` started):
    what answers where, from this machine, and what a client needs (TLS, tokens)."""
    lines = [f"stagecast is up{f' in {took:.1f} s' if took is not None else ''}: {shape}"]
    if "gateway" in ready:
        gateway = reachable(ready["gateway"])
        needs = []
        if args.tls_cert:
            needs.append(f"TLS (a client trusts {args.tls_cert}: --tls-ca, or --tls for a public CA)")
        else:
            needs.append("plaintext")
        if args.tokens:
            needs.append(f"a bearer token from {args.tokens} (--token-file)")
        lines.append(f"public API (gRPC): {gateway}, {' and '.join(needs)}")
    if "web" in ready:
        scheme, _, rest = ready["web"].partition("://")
        lines.append(f"watch and steer it in a browser: {scheme}://{reachable(rest.rstrip('/'))}/")
    lines.append(f"coordinator (internal, mTLS): {reachable(ready['coordinator'])}")
    if args.health_port > 0:
        lines.append(f"coordinator health (plaintext grpc.health.v1): {reachable(f'{args.host}:{args.health_port}')}")
    if args.host in WILDCARDS:
        import socket

        lines.append(
            f"--host {args.host}: every interface listens; from another machine use this one's address "
            f"(e.g. {socket.gethostname()}) with the ports above"
        )
    return lines


def _say_up(args: argparse.Namespace, ready: dict[str, str], shape: str) -> None:
    """The lines that say ``up`` is up, and its READY line (``ready``: role -> address)."""
    from stagecast.service import process_age

    for line in summary(args, ready, shape, took=process_age()):
        print_line(line)
    announce_ready(**ready)


def _balance(args: argparse.Namespace, placement) -> tuple[str | None, list[int] | None]:
    """``--partition`` as given, or with ``auto`` the planner's partition and the gateway's VAE cut (one answer)."""
    from launcher.balance import check_flags, resolve_balance

    check_flags(args.partition, args.balance_profile, args.sp, args.cfg_parallel)
    if args.partition != "auto":
        return args.partition, None
    root = args.checkpoint
    gateway = has_gateway(args)
    choice = resolve_balance(
        args.balance_profile,
        transformer=resolve_transformer(root),
        stage_devices=placement.stage_devices[: args.stages],
        vae_folder=os.path.join(root, "vae") if gateway else None,
        vae_devices=placement.vae_devices,
    )
    print(f"stagecast up: {choice.describe()}", flush=True)
    return choice.partition, choice.vae_split
