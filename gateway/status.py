"""What ``GetStatus`` and ``WatchStatus`` report: the part of ``gateway.service.Gateway`` that describes it.

Usage::

    status = StatusReport(table, coordinator_stub, max_streams=8, coordinator_target="host:port",
                          cost_budget=describe_budget(budget, defaults, model))
    msg = status.status(who)                 # the streams ``who`` may see (a tenant: only its own)
    msg.capacity.extend(status.capacity())   # the coordinator's remaining capacity, asked at most once a second
"""

from __future__ import annotations

import threading
import time

import grpc

from gateway.admission import CostBudget, passes
from gateway.checkpoint import ModelInfo, ServingDefaults
from gateway.config import resolve_config
from gateway.stream_table import StreamTable, vae_bytes
from stagecast import api
from stagecast.internal.v1 import pipeline_pb2 as ipb
from stagecast.security import Principal
from stagecast.v1 import stream_pb2 as pb


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
    ):
        self.table = table
        self.coordinator = coordinator  # the CoordinatorService stub
        self.max_streams = max_streams
        self.coordinator_target = coordinator_target
        self.cost_budget = cost_budget
        self.fleet = fleet  # gateway.agent.Fleet: the pipeline's name, slots and drain (None: not reported)
        self._lock = threading.Lock()
        self._capacity: tuple[float, list[pb.Capacity]] | None = None  # (when asked, the answer)

    def capacity(self) -> list[pb.Capacity]:
        """The coordinator's remaining capacity (streams at 16 FPS per step count), asked at most once a second;
        empty when it does not know stage times yet or cannot be reached in time."""
        now = time.monotonic()
        with self._lock:
            cached = self._capacity
            if cached is not None and now - cached[0] < 1.0:
                return list(cached[1])
        try:
            status = self.coordinator.Status(ipb.Empty(), timeout=1.0)
            out = [pb.Capacity(steps=c.steps, streams=c.streams) for c in status.capacity]
        except grpc.RpcError:
            out = []
        with self._lock:
            self._capacity = (now, out)
        return list(out)

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
        return msg
