"""What ``GetStatus`` and ``WatchStatus`` report: the part of ``gateway.service.Gateway`` that describes it.

Usage::

    status = StatusReport(table, coordinator_stub, max_streams=8, coordinator_target="host:port",
                          cost_budget=describe_budget(budget, defaults, model))
    msg = status.status(who)                 # the streams ``who`` may see (a tenant: only its own)
    msg.capacity.extend(status.capacity())   # the coordinator's remaining capacity, asked at most once a second

    front = StartingFront(gateway)           # the StreamService the server holds from the start: while the gateway
    front.open(servicer)                     # loads, start-up status and UNAVAILABLE; once open, the servicer's

Both carry ``GatewayStatus.startup``: the gateway's own start-up steps, then each stage's as its coordinator has them.
"""

from __future__ import annotations

import threading
import time

import grpc

from gateway.checkpoint import ModelInfo, ServingDefaults
from gateway.edge.admission import CostBudget, passes
from gateway.edge.config import resolve_config
from gateway.edge.stream_table import StreamTable, vae_bytes
from stagecast import api
from stagecast.grpc_util import abort_with_retry
from stagecast.internal.v1 import pipeline_pb2 as ipb
from stagecast.security import Principal
from stagecast.startup import Startup
from stagecast.v1 import stream_pb2 as pb

COORDINATOR_STATUS_S = 1.0  # the coordinator's Status is asked at most this often, and waited for this long
STARTING = "the gateway is starting (loading its models): retry once its health is SERVING"
STARTING_RETRY_S = 5.0  # the retry hint (google.rpc.RetryInfo) a Generate refused while starting carries


def stage_startup(cluster: ipb.ClusterStatus | None) -> list[pb.StartupProgress]:
    """Each stage's start-up as the coordinator reported it, in the public message."""
    out = []
    for s in cluster.startup if cluster is not None else ():
        msg = pb.StartupProgress(process=s.process, ready=s.ready, ready_s=s.ready_s)
        for step in s.steps:
            msg.steps.add(name=step.name, done=step.done, total=step.total, at_s=step.at_s, detail=step.detail)
        out.append(msg)
    return out


def describe_budget(budget: CostBudget, defaults: ServingDefaults, model: ModelInfo) -> pb.CostBudget:
    """The cost budget as GatewayStatus tells clients (the page offers only the sizes it admits)."""
    default = resolve_config(pb.StreamConfig(prompt="budget"), defaults=defaults, model=model)
    return pb.CostBudget(
        max_frame_pixels=budget.max_frame_pixels,
        max_stream_cost=budget.max_stream_cost,
        min_fps=budget.floor_fps,
        default_width=default.width,
        default_height=default.height,
        default_fps=default.fps,
        default_steps=default.steps,
        default_passes=passes(default),
    )


class StatusReport:
    """The gateway's status message, per principal, and the coordinator's capacity, cached for a second."""

    def __init__(
        self,
        table: StreamTable,
        coordinator,
        *,
        max_streams: int,
        coordinator_target: str,
        cost_budget: pb.CostBudget,
        fleet=None,
        startup: Startup | None = None,
    ):
        self.table = table
        self.coordinator = coordinator  # the CoordinatorService stub
        self.max_streams = max_streams
        self.coordinator_target = coordinator_target
        self.cost_budget = cost_budget
        self.fleet = fleet  # gateway.edge.agent.Fleet: the pipeline's name, slots and drain (None: not reported)
        self.startup = startup  # the gateway's own start-up steps (None: not reported)
        self._lock = threading.Lock()
        self._cluster: tuple[float, ipb.ClusterStatus | None] | None = None  # (when asked, the answer)

    def cluster(self) -> ipb.ClusterStatus | None:
        """The coordinator's Status, asked at most once a second; None when it cannot be reached in time."""
        now = time.monotonic()
        with self._lock:
            cached = self._cluster
            if cached is not None and now - cached[0] < COORDINATOR_STATUS_S:
                return cached[1]
        try:
            status = self.coordinator.Status(ipb.Empty(), timeout=COORDINATOR_STATUS_S)
        except grpc.RpcError:
            status = None
        with self._lock:
            self._cluster = (now, status)
        return status

    def capacity(self) -> list[pb.Capacity]:
        """The coordinator's remaining capacity (streams at 16 FPS per step count); empty when it does not know stage
        times yet or cannot be reached in time."""
        status = self.cluster()
        return [pb.Capacity(steps=c.steps, streams=c.streams) for c in status.capacity] if status is not None else []

    def startup_progress(self) -> list[pb.StartupProgress]:
        """The gateway's start-up, then each stage's (the coordinator's Status, asked at most once a second)."""
        cluster = self.cluster()
        own = [self.startup.to_proto(pb.StartupProgress)] if self.startup is not None else []
        return own + stage_startup(cluster)

    def status(self, who: Principal | None = None) -> pb.GatewayStatus:
        """The gateway's state as ``who`` may see it: a tenant sees only its own streams (and no totals or
        internal addresses); an admin or status token, or anyone on a gateway without tokens, sees everything."""
        everything = who is None or who.sees_all
        table = self.table
        with table.cond:
            runs = [run for run in table.streams.values() if everything or getattr(run, "tenant", None) == who.tenant]
            msg = pb.GatewayStatus(active_streams=len(runs), max_streams=self.max_streams, cost_budget=self.cost_budget)
            if everything:
                msg.streams_started = table.started
                msg.streams_finished = table.finished
                msg.ended_by_reason.update(table.ended_by_reason)
                msg.coordinator = self.coordinator_target
                msg.waiting_calls = table.pending
        for run in runs:
            msg.streams.add(
                stream_id=run.id,
                pipeline_stream_id=run.pipeline_id,
                state=api.state_value(run.state),
                frames_sent=run.frames_sent,
                chunks_received=run.chunks_received,
                steps=run.last_steps,
                paced=run.cfg.pace,
                vae_state_bytes=vae_bytes(run),
                queued_chunks=run.session.queued if run.session is not None else 0,
                queued_messages=len(run.out),
                input_frames_received=run.input.received if run.input is not None else 0,
                input_frames_dropped=run.input.dropped if run.input is not None else 0,
            )
        if self.fleet is not None:
            slots = self.fleet.slots
            msg.pipeline = self.fleet.name
            msg.slots_free, msg.slots_total = slots.free, slots.total
            msg.draining = self.fleet.draining.is_set()
        msg.vae_state_bytes = sum(s.vae_state_bytes for s in msg.streams)
        msg.paced_streams = sum(1 for s in msg.streams if s.paced)
        msg.unpaced_streams = len(msg.streams) - msg.paced_streams
        msg.startup.extend(self.startup_progress())
        return msg


class StartingFront:
    """The StreamService the public server holds from the moment its port is bound.  While the gateway loads, GetStatus
    and WatchStatus answer its start-up (``GatewayStatus.starting``, ``startup``: its own steps and its stages') and
    Generate is refused UNAVAILABLE; once ``open()``, every call is the servicer's (``gateway.edge.handlers``)."""

    def __init__(self, gw):
        self.gw = gw  # gateway.service.Gateway: its startup, options and coordinator stub
        self.servicer = None  # gateway.edge.handlers.StreamServicer, once the parts it serves with are loaded
        self._open = threading.Event()

    def open(self, servicer) -> None:
        self.servicer = servicer
        self._open.set()

    def starting_status(self) -> pb.GatewayStatus:
        gw = self.gw
        try:
            cluster = gw.coordinator.Status(ipb.Empty(), timeout=COORDINATOR_STATUS_S)
        except grpc.RpcError:
            cluster = None
        msg = pb.GatewayStatus(max_streams=gw.opts.max_streams, starting=True)
        msg.startup.append(gw.startup.to_proto(pb.StartupProgress))
        msg.startup.extend(stage_startup(cluster))
        return msg

    def Generate(self, request_iterator, context):
        if not self._open.is_set():
            abort_with_retry(context, grpc.StatusCode.UNAVAILABLE, STARTING, STARTING_RETRY_S)
        return self.servicer.Generate(request_iterator, context)

    def GetStatus(self, request: bytes, context):
        if not self._open.is_set():
            return self.starting_status()
        return self.servicer.GetStatus(request, context)

    def WatchStatus(self, request: bytes, context):
        sent, version = b"", -1
        while not self._open.is_set() and context.is_active():
            msg = self.starting_status()  # a step of the gateway's, or a stage's (checked every second)
            if msg.SerializeToString() != sent:
                sent = msg.SerializeToString()
                yield msg
            version = self.gw.startup.wait_change(version, COORDINATOR_STATUS_S)
        if context.is_active():
            yield from self.servicer.WatchStatus(request, context)
