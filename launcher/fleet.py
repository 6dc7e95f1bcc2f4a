"""``stagecast up --pipelines N``: N pipelines on this machine behind one HAProxy door (``launcher.door``).

Usage (``launcher.up.main`` calls it for N >= 2)::

    problem = check_fleet_flags(args)         # a line naming the flag (or `apt-get install haproxy`), or None
    code = run_fleet(args, plan, stop)        # until SIGTERM (every pipeline drains) or every pipeline stopped

Pipeline i is named ``p<i>``: its coordinator (on ``--port`` + i, or any free port with 0), its ``--stages`` stages
and its gateway (any free port, its agent on another) are started as ``up`` starts one pipeline, and supervised the
same way.  HAProxy listens on ``--gateway-port`` and routes each new stream by the gateways' agents (free slots,
``gateway.edge.agent``); the page (``--web-port``) talks to the door, and the door also serves its HTTP and WebSocket.
``up`` is READY once every pipeline is and the door sees every gateway up.

A process that exits with code 0 stopped, it did not crash (``Supervisor.clean_exit_stops``): a gateway after its
drain (SIGTERM to its pid), or a coordinator or stage given SIGTERM.  That pipeline is stopped, not restarted: its
gateway drains (if it was not the one), then its other processes stop.  When every pipeline has stopped, ``up``
exits 0.  SIGTERM to ``up`` drains every gateway at once, within ``--drain-s`` (plus the stop's own seconds).

``--state-file PATH`` holds ``{"door": "HOST:PORT", "pipelines": [{"name", "gateway", "coordinator", "pids":
{"gateway", "coordinator", "stages": [...]}}]}``, written at READY and again whenever a process restarts.

On GPUs pipeline i takes the next stages x sp x cfg-parallel GPUs (``CUDA_VISIBLE_DEVICES``, ``pipeline_gpus``),
wrapping around: with more pipelines than that many GPUs hold, pipelines share GPUs, and every shared GPU is split
into shares by one memory plan across the pipelines (``launcher.memory_plan``: each process gets its
``--device-memory-gib``; ``up`` exits 2 before starting anything when a share holds no stream).  On a CPU the
pipelines share the host's cores: the coordinator has no knob for a share of the host yet, so each pipeline prices
its admission as if it had the host alone (docs/operator-guide.md says so).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

from gateway.edge.agent import FleetOptions
from gateway.options import GatewayOptions
from launcher.door import Door, DoorError, Server, find_haproxy, render
from launcher.pipeline_start import Plan, gateway_argv, has_gateway, start_stages, start_web, watch_pipeline
from launcher.process import Child, Launcher, LaunchError, Supervisor
from stagecast.flags import flag_names
from stagecast.service import announce_ready, print_line

DOOR_READY_S = 30.0  # after every pipeline is READY, the most the door may take to see each gateway up
STOP_EXTRA_S = 15.0  # beyond --drain-s: a drained gateway's own stop


def check_fleet_flags(args: argparse.Namespace) -> str | None:
    """What ``--pipelines N`` needs before anything starts (one line), or None."""
    if args.gateway_port < 0:
        return "error: --pipelines needs gateways (the door's servers): give --gateway-port"
    if not has_gateway(args):
        return f"error: --pipelines needs gateways: {args.checkpoint} has no vae/ and text_encoder/"
    if args.cfg_parallel > 1:
        return "error: --pipelines does not compose with --cfg-parallel 2 yet (give one of them)"
    try:
        find_haproxy()
    except DoorError as exc:
        return f"error: {exc}"
    if not 0 <= args.fleet_drain_s <= 3600:  # also NaN
        return f"error: --drain-s must be in [0, 3600], got {args.fleet_drain_s}"
    return None


def host_share(args: argparse.Namespace) -> float:
    """Each pipeline's share of the host its coordinator sizes its streams for (``--host-share``): on a CPU the
    pipelines share its cores, 1/N each; on GPUs each pipeline prices its own GPUs' time (``pipeline_gpus``)."""
    return 1.0 / args.pipelines if args.device == "cpu" else 1.0


def pipeline_gpus(args: argparse.Namespace, index: int, gpus: int | None = None) -> list[int]:
    """Pipeline ``index``'s GPUs, by rank: the next stages x sp x cfg-parallel of this machine's, wrapping around
    (pipelines then share GPUs, planned together by ``launcher.memory_plan``)."""
    if gpus is None:
        import torch

        gpus = torch.cuda.device_count()
    ranks = args.stages * args.sp * args.cfg_parallel
    return [(index * ranks + j) % max(gpus, 1) for j in range(ranks)]


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


@dataclass
class FleetPipeline:
    """One pipeline of the fleet: its launcher, its processes now (restarts replace them) and whether it stopped."""

    name: str
    launcher: Launcher
    coordinator: str = ""
    gateway: str = ""
    agent_port: int = 0
    children: dict[str, Child] = field(default_factory=dict)  # by the child's name: "p0/gateway", "p0/stage-0"
    stopped: bool = False

    def gateway_child(self) -> Child | None:
        return self.children.get(f"{self.name}/gateway")

    def pids(self) -> dict:
        stages = sorted((name, c.pid) for name, c in self.children.items() if name.startswith(f"{self.name}/stage-"))
        return {
            "gateway": self.children[f"{self.name}/gateway"].pid,
            "coordinator": self.children[f"{self.name}/coordinator"].pid,
            "stages": [pid for _, pid in stages],
        }


class Fleet:
    """The pipelines, the door and the state file of one ``up --pipelines N``."""

    def __init__(self, args: argparse.Namespace, plan: Plan, supervisor: Supervisor, folder: str):
        self.args = args
        self.plan = plan
        self.supervisor = supervisor
        self.folder = folder
        self.pipelines: list[FleetPipeline] = []
        self.door: Door | None = None
        self.door_address = ""
        self._lock = threading.Lock()
        supervisor.clean_exit_stops = True
        supervisor.on_restart = self._restarted
        supervisor.on_stop = self._stopped

    # ---- start -------------------------------------------------------------------------------------------------

    def start(self, launchers: list[Launcher]) -> None:
        args = self.args
        ranks = args.stages * args.sp * args.cfg_parallel
        pipes = []
        for i, launcher in enumerate(launchers):
            pipeline = FleetPipeline(f"p{i}", launcher)
            self.pipelines.append(pipeline)
            metrics = args.metrics_port + i * (2 + ranks) if args.metrics_port else 0
            health = args.health_port + i if args.health_port > 0 else -1
            pipe = start_stages(
                launcher, args, self.plan, port=args.port + i if args.port else 0, metrics_port=metrics,
                health_port=health, host_share=host_share(args), pipeline=pipeline.name,
            )  # fmt: skip
            pipeline.coordinator = pipe.coordinator
            gateway = launcher.start("gateway", [*self._gateway_args(pipeline, metrics, 0), "--port", "0"])
            pipes.append((pipe, gateway, metrics))
        for pipeline, (pipe, gateway, metrics) in zip(self.pipelines, pipes):
            pipe.wait_ready(pipeline.launcher, 600.0)
            watch_pipeline(self.supervisor, pipe, pipeline.launcher)
            pipeline.children.update({pipe.coordinator_child.name: pipe.coordinator_child})
            pipeline.children.update({child.name: child for child in pipe.stage_children.values()})
            self._watch_gateway(pipeline, pipeline.launcher.wait_ready(gateway, timeout=300.0), metrics)
        self._start_door()

    def _gateway_args(self, pipeline: FleetPipeline, metrics: int, agent_port: int) -> list[str]:
        args = self.args
        fleet = FleetOptions(pipeline_name=pipeline.name, agent_port=agent_port, drain_s=args.fleet_drain_s)
        # The public TLS moves to the door; behind it, the gateways speak plaintext on --host.
        argv = gateway_argv(
            args, self.plan, pipeline.coordinator, metrics_port=metrics + 1 if metrics else 0, fleet=fleet,
            tls_cert=None, tls_key=None, pipeline=pipeline.name,
        )  # fmt: skip
        if "trusted_proxy" in flag_names(GatewayOptions):  # the door's x-forwarded-for names the client
            argv += ["--trusted-proxy", self._door_source()]
        return argv

    def _door_source(self) -> str:
        """The address the door's connections to the gateways come from."""
        return "127.0.0.1" if self.args.host in ("0.0.0.0", "::") else self.args.host

    def _watch_gateway(self, pipeline: FleetPipeline, child: Child, metrics: int) -> None:
        pipeline.gateway = child.info["address"]
        pipeline.agent_port = int(child.info["agent_address"].rsplit(":", 1)[1])
        pipeline.children[child.name] = child
        bound = pipeline.gateway.rsplit(":", 1)[1]
        again = [*self._gateway_args(pipeline, metrics, pipeline.agent_port), "--port", bound]  # the same ports
        self.supervisor.watch(child, again, launcher=pipeline.launcher)

    def _start_door(self) -> None:
        args = self.args
        port = args.gateway_port or _free_port(args.host)
        self.door_address = f"{self._door_source()}:{port}"
        self.web_port = -1 if args.web_port < 0 else args.web_port or _free_port(args.host)
        servers = [Server(p.name, p.gateway, p.agent_port) for p in self.pipelines]
        web = f"{self._door_source()}:{self.web_port}" if self.web_port > 0 else None
        config = render(bind=f"{args.host}:{port}", servers=servers, web=web, tls_pem=self._tls_pem())
        self.door = Door(find_haproxy(), self.folder, config)
        self.door.wait_listening(self._door_source(), port, 10.0)
        self._wait_door_sees_all()

    def _tls_pem(self) -> str | None:
        """The public certificate and key in the one file HAProxy reads (private folder), or None (plaintext)."""
        if not self.args.tls_cert:
            return None
        path = os.path.join(self.folder, "door.pem")
        with open(self.args.tls_cert) as cert, open(self.args.tls_key) as key:
            text = cert.read().rstrip("\n") + "\n" + key.read()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        return path

    def _wait_door_sees_all(self) -> None:
        """Until the door's agent and h2 checks have every gateway up (HAProxy checks every half second)."""
        assert self.door is not None
        deadline = time.monotonic() + DOOR_READY_S
        while True:
            try:
                servers = self.door.servers("grpc")
            except OSError:  # its master CLI is not up yet
                servers = {}
            if len(servers) == len(self.pipelines) and all(s["status"] == "UP" for s in servers.values()):
                return
            if time.monotonic() > deadline:
                seen = ", ".join(f"{name} {s['status']}" for name, s in servers.items())
                raise DoorError(f"the door did not see every pipeline up within {DOOR_READY_S:g} s: {seen}")
            if self.door.proc.poll() is not None:
                raise DoorError(f"HAProxy exited with code {self.door.proc.returncode}")
            if self.supervisor.stop.is_set():
                raise LaunchError("stopped while starting")
            self.supervisor.stop.wait(0.2)  # HAProxy's checks run every second; nothing else to wait on

    def ready_fields(self) -> dict[str, str]:
        return {"gateway": self.door_address, "door": self.door_address, "pipelines": str(len(self.pipelines))}

    # ---- the state file ----------------------------------------------------------------------------------------

    def write_state(self) -> None:
        path = self.args.state_file
        if not path:
            return
        with self._lock:
            state = {
                "door": self.door_address,
                "pipelines": [
                    {"name": p.name, "gateway": p.gateway, "coordinator": p.coordinator, "pids": p.pids()}
                    for p in self.pipelines
                ],
            }
            tmp = f"{path}.tmp{os.getpid()}"
            with open(tmp, "w") as f:
                json.dump(state, f, indent=2)
            os.replace(tmp, path)  # a reader sees the old file or the new one, never half of one

    def _pipeline_of(self, child: Child) -> FleetPipeline:
        return next(p for p in self.pipelines if child.name.startswith(f"{p.name}/"))

    def _restarted(self, child: Child) -> None:
        self._pipeline_of(child).children[child.name] = child
        self.write_state()

    # ---- stop --------------------------------------------------------------------------------------------------

    def _stopped(self, child: Child) -> None:
        """A process of a pipeline stopped (exit code 0): stop that pipeline, draining its gateway first."""
        pipeline = self._pipeline_of(child)
        gateway = pipeline.gateway_child()
        if child is not gateway and gateway is not None and gateway.proc.poll() is None:
            print_line(f"stagecast up: {child.name} stopped: draining {pipeline.name}", sys.stderr)
            gateway.proc.send_signal(signal.SIGTERM)  # its drained exit comes back here
            return
        for name, other in pipeline.children.items():
            if other is not child and name not in self.supervisor.retired:
                self.supervisor.retire(other)
        pipeline.stopped = True
        print_line(f"stagecast up: pipeline {pipeline.name} stopped; the door sends its streams elsewhere")
        if all(p.stopped for p in self.pipelines):
            print_line("stagecast up: every pipeline stopped")
            self.supervisor.stop.set()

    def drain_all(self) -> None:
        """SIGTERM to every running gateway (each drains), then wait for them within --drain-s and the stop's own."""
        gateways = [g for p in self.pipelines if (g := p.gateway_child()) is not None and g.proc.poll() is None]
        for gateway in gateways:
            gateway.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.args.fleet_drain_s + STOP_EXTRA_S
        for gateway in gateways:
            with contextlib.suppress(Exception):
                gateway.proc.wait(max(0.0, deadline - time.monotonic()))

    def stop_door(self) -> None:
        if self.door is not None:
            self.door.stop()


def _gpu_env(args: argparse.Namespace, index: int) -> dict[str, str]:
    """Pipeline ``index``'s GPUs (the next stages x sp x cfg-parallel), as its processes see them."""
    if not args.device.startswith("cuda"):
        return {}
    return {"CUDA_VISIBLE_DEVICES": ",".join(str(gpu) for gpu in pipeline_gpus(args, index))}


def run_fleet(args: argparse.Namespace, plan: Plan, stop: threading.Event) -> int:
    """Start the fleet, say READY, supervise until SIGTERM (or every pipeline stopped), then drain and stop."""
    with contextlib.ExitStack() as stack:
        main = stack.enter_context(Launcher(echo=True, credentials=args.credentials))
        folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="stagecast-door-"))
        launchers = [
            stack.enter_context(
                Launcher(echo=True, credentials=main.credentials, env=_gpu_env(args, i), prefix=f"p{i}/")
            )
            for i in range(args.pipelines)
        ]
        supervisor = Supervisor(main, stop, max_restarts=args.max_restarts, hang_s=args.stage_hang_s)
        fleet = Fleet(args, plan, supervisor, folder)
        stack.callback(fleet.stop_door)  # first on the way out (the ExitStack unwinds in reverse), then the rest
        try:
            fleet.start(launchers)
            ready = fleet.ready_fields()
            if fleet.web_port > 0:
                page = start_web(main, supervisor, _with_web_port(args, fleet.web_port), fleet.door_address)
                ready["web"] = page["url"]
        except (LaunchError, DoorError) as exc:
            print(f"stagecast up: {exc}", file=sys.stderr)
            return 1
        fleet.write_state()
        _say_fleet_up(fleet, ready)
        failure = supervisor.wait()
        signal.alarm(0)  # the stop's usual deadline is for one service; a fleet's is --drain-s (drain_all)
        if failure is not None:
            print_line(f"stagecast up: {failure}", sys.stderr)
        print_line("draining every pipeline" if failure is None else "shutting down")
        fleet.drain_all()
    return 1 if failure is not None else 0


def _with_web_port(args: argparse.Namespace, port: int) -> argparse.Namespace:
    copy = argparse.Namespace(**vars(args))
    copy.web_port = port
    return copy


def _say_fleet_up(fleet: Fleet, ready: dict[str, str]) -> None:
    for p in fleet.pipelines:
        print_line(f"pipeline {p.name}: gateway {p.gateway} (agent port {p.agent_port}), coordinator {p.coordinator}")
    shape = f"{len(fleet.pipelines)} pipelines of {fleet.args.stages} stages"
    print_line(f"stagecast is up: door {fleet.door_address} (HAProxy), {shape}")
    if fleet.door is not None:
        print_line(f"the door's HAProxy master CLI (show stat): {fleet.door.socket}")
    if "web" in ready:
        print_line(f"watch and steer it in a browser: {ready['web']}")
    announce_ready(**ready)
