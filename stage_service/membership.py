"""A stage's place in the coordinator's generations, and what its health service says of it.

Usage (``stage_service.server.StageServicer`` holds one of each)::

    members = Membership(opts, config, control, on_registered=..., held_generation=..., leave=..., report_progress=...)
    members.register(address)            # the first registration; on_registered(reply) loads the assigned layers
    threading.Thread(target=members.run, args=(stop,)).start()   # heartbeats until ``stop``

    health = StageHealth(index)
    health.attach(health_servicer)       # the server's grpc.health.v1 servicer, once it serves
    health.report_progress(gen)          # "" NOT_SERVING while one plan event has run for EXECUTOR_STALL_S
    health.set_member(True)              # StageService SERVING while in a formed generation

The stage heartbeats twice a second naming the generation it holds.  When the coordinator answers that the stage is
outside its current generation, or stays unreachable for three heartbeats, the stage leaves its generation and
registers again, with backoff; a late ``Reset`` (carrying its generation) never ends a newer generation.  So a paused
stage, a restarted coordinator and a failed generation all re-form without restarting anything.  ``reexec`` replaces
the process with a fresh copy of itself: the only way to release a thread blocked inside a gloo receive.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
from collections.abc import Callable

import grpc

from stagecast import telemetry
from stagecast.grpc_util import NOT_SERVING, RECONNECT_OPTIONS, SERVING
from stagecast.internal.v1 import pipeline_pb2 as pb
from stagecast.internal.v1 import pipeline_pb2_grpc as pb_grpc
from stagecast.names import STAGE_SERVICE
from stagecast.security import connect

logger = logging.getLogger(__name__)

# One plan event running longer than this means a hung executor (a batch takes milliseconds to seconds; a peer that
# died releases the data plane when its generation fails, within seconds): the process then reports NOT_SERVING.
EXECUTOR_STALL_S = 20.0


class Membership:
    """Registration with the coordinator and the heartbeat loop that leaves and registers again when needed."""

    def __init__(
        self,
        opts,
        config: dict,
        control: grpc.Channel,
        *,
        on_registered: Callable[[pb.RegisterReply], None],
        held_generation: Callable[[], int],
        leave: Callable[[int, str], bool],
        report_progress: Callable[[], None],
    ):
        self.opts = opts  # stage_service.server.StageOptions
        self.config = config
        self.control = control  # the channel registration and the rendezvous store use
        self.on_registered = on_registered  # takes the reply: world size, max batch, the layers to load
        self.held_generation = held_generation
        self.leave = leave  # (held, reason) -> whether the stage now holds no generation
        self.report_progress = report_progress
        self.address = ""

    def register(self, address: str, timeout: float = 120.0) -> None:
        self.address = address
        self._register(pb_grpc.CoordinatorServiceStub(self.control), timeout, wait_for_ready=True)

    def _register(self, stub, timeout: float, wait_for_ready: bool = False) -> None:
        reply = stub.Register(
            pb.RegisterRequest(
                index=self.opts.index,
                address=self.address,
                model_config_json=json.dumps(self.config, sort_keys=True, default=list),
                expected_world_size=self.opts.expected_world_size,
                device=self.opts.device,
                sp=self.opts.sp,
            ),
            timeout=timeout,
            wait_for_ready=wait_for_ready,
        )
        self.on_registered(reply)

    def run(self, stop: threading.Event, interval: float = 0.5, max_backoff: float = 1.0) -> None:
        """Heartbeat until ``stop``; leave and register again whenever this stage is outside the current
        generation (see the module docstring).  Runs in its own thread."""
        channel = connect(self.opts.coordinator, self.opts.mtls, "coordinator", RECONNECT_OPTIONS)
        stub = pb_grpc.CoordinatorServiceStub(channel)
        registered, misses, delay = True, 0, interval
        try:
            while not stop.wait(delay):
                self.report_progress()
                held = self.held_generation()
                try:
                    if not registered:
                        self._register(stub, timeout=10.0)
                        registered, misses, delay = True, 0, interval
                        logger.info("stage %d registered again", self.opts.index)
                        continue
                    request = pb.HeartbeatRequest(index=self.opts.index, address=self.address, generation=held)
                    reply = stub.Heartbeat(request, timeout=2.0)
                except grpc.RpcError as exc:
                    misses += 1
                    delay = min(max_backoff, interval * 2**misses)
                    if misses == 1 or misses % 20 == 0:
                        logger.warning(
                            "stage %d: coordinator %s: %s: %s",
                            self.opts.index,
                            "registration failed" if not registered else "heartbeat failed",
                            exc.code().name,
                            exc.details(),
                        )
                    if registered and misses >= 3 and held:
                        # Whatever the coordinator knows when it is back, this generation cannot go on.
                        registered = not self.leave(held, f"lost the coordinator ({exc.code().name})")
                    continue
                misses, delay = 0, interval
                if reply.rejoin:
                    logger.warning("stage %d: %s; registering again", self.opts.index, reply.reason)
                    registered = not self.leave(held, reply.reason)
                    delay = 0.0
        finally:
            channel.close()


class StageHealth:
    """The stage's grpc.health.v1 answers: ``""`` follows its executor's progress, ``StageService`` its membership
    of a formed generation."""

    def __init__(self, index: int):
        self.index = index
        self.health = None  # the server's grpc.health.v1 servicer, once serving
        self._progressing = True  # what "" health last said of the executor's progress

    def attach(self, health) -> None:
        self.health = health

    def report_progress(self, gen) -> None:
        """The process's ``""`` health follows its executor: NOT_SERVING while one plan event has run for longer than
        ``EXECUTOR_STALL_S`` (a hung executor, whose gRPC threads still answer), so ``up`` and the chart's liveness
        probe replace the stage."""
        stalled = gen.executor.stalled_s() if gen is not None else 0.0
        progressing = stalled < EXECUTOR_STALL_S
        if self.health is not None and progressing != self._progressing:
            self._progressing = progressing
            self.health.set("", SERVING if progressing else NOT_SERVING)
            if not progressing:
                logger.error("stage %d: one plan event has run for %.0f s: reporting not serving", self.index, stalled)

    def set_member(self, member: bool) -> None:
        if self.health is not None:
            self.health.set(STAGE_SERVICE, SERVING if member else NOT_SERVING)


def reexec(index: int, why: str) -> None:
    """Replace this process with a fresh copy of itself (same PID, same arguments).  The only way to
    release a thread blocked inside a gloo receive; the new process registers again."""
    logger.error("stage %d restarting itself: %s", index, why)
    telemetry.shutdown(timeout_s=2.0)
    for handler in logging.getLogger().handlers:
        handler.flush()
    os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])  # the same command line, as started
