"""A gateway in a fleet: its pipeline's name, its free slots told to the door, and drain on SIGTERM.

Usage (``gateway.service.Gateway`` builds one; ``docs/operator-guide.md``, "A fleet")::

    fleet = Fleet(FleetOptions(pipeline_name="p0", agent_port=0), coordinator_stub, host="127.0.0.1",
                  streams=table.door_streams)   # the streams that came through the door
    fleet.start()                       # polls the coordinator's status every POLL_S; serves the agent port
    fleet.agent_address                 # "127.0.0.1:PORT" (None without --agent-port)
    fleet.reply("grpc")                 # "up ready 40% maxconn:7", "drain" or "down" (what HAProxy reads)
    fleet.drain(table)                  # SIGTERM: admit nothing, let streams run --drain-s, end the rest
    fleet.stop()

The free slots are the coordinator's own arithmetic (``ClusterStatus.slots_free`` / ``slots_total``: a dry run of
the admission that refuses, for a stream of the public defaults), never the gateway's guess.  The agent speaks
HAProxy's agent-check protocol: HAProxy connects, sends one line (the template's ``agent-send``: ``grpc`` or
``overflow``), reads one line and closes.  On ``grpc`` (the capped backend) the answer is ``up ready P% maxconn:N``
with P the free slots in percent of the pipeline's slots and N the streams this gateway holds through the door (those
with an ``x-forwarded-for``, from a ``--trusted-proxy`` where one is named: HAProxy counts only its own) plus its
free slots, so the door may send exactly the free ones more; a full pipeline answers 1% capped at those streams (0%
when it has none through the door), so a slot freed by one ending is the door's at once; ``drain`` while draining and
``down`` while the pipeline is not ready (or its coordinator cannot be reached).  On ``overflow`` (the
uncapped twin a full fleet takes) it is ``up ready 100%``, ``drain`` or ``down``: there a full pipeline refuses the
stream itself, with its retry delay.

Drain: a gateway with ``--agent-port`` takes its first SIGTERM as "drain" (``sigterm_drains``): the agent says
``drain`` at once, new streams are refused with UNAVAILABLE (a client reconnects, and the door sends it to another
pipeline), the streams in flight run until they end or ``--drain-s`` passes, the rest end with UNAVAILABLE and a
message to reconnect, the gateway prints ``DRAINED_LINE`` (what ``stagecast up`` reads: a stop, not a crash) and
stops.  A second SIGTERM, or SIGINT, stops at once.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass

from stagecast.flags import flag  # the rest is imported where used: gateway.options (so gateway.cli) reads the flags

logger = logging.getLogger(__name__)

POLL_S = 0.5  # how often the coordinator's status is read (HAProxy asks the agent every second)
DRAINED_LINE = "STAGECAST_DRAINED"  # printed once a drain ends, before the gateway exits
AGENT_READ_S = 0.5  # how long the agent waits for HAProxy's line


@dataclass
class FleetOptions:
    """A gateway's fleet flags (a nested part of ``GatewayOptions``)."""

    pipeline_name: str | None = flag(
        metavar="NAME",
        help="this pipeline's name, unique in a fleet: in Started.pipeline, GetStatus, a refusal's trailers and traces",
    )
    agent_port: int | None = flag(
        type=int,
        help="serve the HAProxy agent protocol on this port on --host (free slots as weight and maxconn, drain, down)"
        "; with it, SIGTERM drains (0: any free port; default: none)",
    )
    drain_s: float = flag(
        30.0,
        help="with --agent-port: after SIGTERM, how long streams in flight may run before they end with UNAVAILABLE",
    )


@dataclass(frozen=True)
class PipelineSlots:
    """What the coordinator last said: formed, and its free and total slots for a default stream."""

    ready: bool = False
    free: int = 0
    total: int = 0


def agent_reply(slots: PipelineSlots, *, draining: bool, streams: int, backend: str) -> str:
    """The agent's answer (one line, no newline) for ``backend`` ("grpc": capped; "overflow": the uncapped twin);
    ``streams``: the streams this gateway holds that came through the door."""
    if draining:
        return "drain"
    if not slots.ready:
        return "down"
    if backend == "overflow":
        return "up ready 100%"
    if slots.free <= 0 or slots.total <= 0:
        if streams > 0:
            # Full: capped at the door's own streams here, so the cap alone keeps new ones out, and weight 1% keeps
            # the pipeline in the door's choice: a slot freed by one of them ending is taken at once, not an agent
            # interval later (a 0% weight hides it until the next check: at saturation the stream that could have
            # had it goes to the overflow route and is refused; benchmarks/fleet_sim.py measures both).
            return f"up ready 1% maxconn:{streams}"
        # None through the door: maxconn 0 would mean "no limit" to HAProxy, so weight 0 keeps new streams out
        return "up ready 0% maxconn:1"
    percent = max(1, round(100 * slots.free / slots.total))
    return f"up ready {percent}% maxconn:{streams + slots.free}"


class Fleet:
    """The pipeline's name, its slots (polled from the coordinator), the agent port and the drain."""

    def __init__(
        self,
        opts: FleetOptions,
        coordinator,
        *,
        host: str,
        streams: Callable[[], int],
        poll_s: float = POLL_S,
    ):
        if opts.drain_s < 0 or opts.drain_s != opts.drain_s:  # also NaN
            raise ValueError(f"--drain-s must be >= 0, got {opts.drain_s}")
        if opts.agent_port is not None and not 0 <= opts.agent_port <= 65535:
            raise ValueError(f"--agent-port must be in [0, 65535], got {opts.agent_port}")
        self.opts = opts
        self.name = opts.pipeline_name or ""
        self.coordinator = coordinator  # the CoordinatorService stub
        self.streams = streams
        self.poll_s = poll_s
        self.draining = threading.Event()
        self._closed = threading.Event()
        self._slots = PipelineSlots()
        self._sock: socket.socket | None = None
        self.agent_address: str | None = None
        if opts.agent_port is not None:
            self._sock = socket.create_server((host, opts.agent_port), reuse_port=False)  # binds where it is told
            shown = "127.0.0.1" if host == "0.0.0.0" else host
            self.agent_address = f"{shown}:{self._sock.getsockname()[1]}"

    @property
    def slots(self) -> PipelineSlots:
        return self._slots

    def start(self) -> None:
        threading.Thread(target=self._poll, daemon=True, name="fleet-slots").start()
        if self._sock is not None:
            threading.Thread(target=self._serve, daemon=True, name="fleet-agent").start()

    def stop(self) -> None:
        self._closed.set()
        if self._sock is not None:
            self._sock.close()

    def reply(self, backend: str = "grpc") -> str:
        return agent_reply(self._slots, draining=self.draining.is_set(), streams=self.streams(), backend=backend)

    def refuse_while_draining(self, cfg) -> None:
        """An admission check (``gateway.edge.admission.Admission``): nothing new is admitted while draining."""
        if self.draining.is_set():
            import grpc

            from gateway.edge.admission import Refused

            where = f"pipeline {self.name}" if self.name else "this pipeline"
            raise Refused(
                grpc.StatusCode.UNAVAILABLE,
                f"{where} is draining (stopping): reconnect; through the fleet's door the stream goes to another one",
            )

    # ---- the coordinator's slots -------------------------------------------------------------------------------

    def _poll(self) -> None:
        while not self._closed.is_set():
            self._slots = self._read_slots()
            self._closed.wait(self.poll_s)

    def _read_slots(self) -> PipelineSlots:
        import grpc

        from stagecast.internal.v1 import pipeline_pb2 as ipb

        try:
            status = self.coordinator.Status(ipb.Empty(), timeout=1.0)
        except grpc.RpcError:
            return PipelineSlots()
        return PipelineSlots(ready=status.ready, free=status.slots_free, total=status.slots_total)

    # ---- the agent port ----------------------------------------------------------------------------------------

    def _serve(self) -> None:
        assert self._sock is not None
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            with conn:
                self._answer(conn)

    def _answer(self, conn: socket.socket) -> None:
        conn.settimeout(AGENT_READ_S)
        data = b""
        try:
            while b"\n" not in data and len(data) < 64:
                chunk = conn.recv(64)
                if not chunk:
                    break
                data += chunk
        except OSError:
            pass  # no line in time: answer for the capped backend
        backend = "overflow" if data.strip() == b"overflow" else "grpc"
        try:
            conn.sendall((self.reply(backend) + "\n").encode())
        except OSError:
            logger.debug("agent: HAProxy left before the answer")

    # ---- drain -------------------------------------------------------------------------------------------------

    def drain(self, table) -> int:
        """Admit nothing new (the agent says ``drain``), let the streams in flight run until they end or ``drain_s``
        passes, then end the rest with UNAVAILABLE; returns how many were ended so.  ``table``: the gateway's
        ``StreamTable``, whose admission must include ``refuse_while_draining``."""
        import grpc

        self.draining.set()
        table.touch()
        where = f"pipeline {self.name}" if self.name else "this pipeline"
        logger.info("%s draining: %d streams in flight, at most %.0f s", where, len(table.streams), self.opts.drain_s)
        with table.cond:
            done = table.cond.wait_for(lambda: not table.streams and table.admitted == 0, self.opts.drain_s)
        if done:
            return 0
        runs = [run for run in table.runs() if run.outcome is None]
        for run in runs:
            run.fail(
                grpc.StatusCode.UNAVAILABLE,
                f"{where} drained: it stopped after --drain-s {self.opts.drain_s:g} s; reconnect (through the fleet's "
                "door a new stream goes to another pipeline)",
                "drained",
            )
        with table.cond:  # their calls end with the error (bounded: the gateway stops anyway)
            table.cond.wait_for(lambda: not table.streams, 5.0)
        return len(runs)


class DrainSignal:
    """SIGTERM as "drain" (``sigterm_drains``): ``requested`` is set by the first SIGTERM; ``finish()`` then stops
    the service as that SIGTERM would have (``stagecast.service.stop_event``'s reader), with its deadline."""

    def __init__(self, stop: threading.Event):
        self.requested = threading.Event()
        self._stop = stop
        self._previous = -1

    def install(self) -> DrainSignal:
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        # Python's C handler writes each signal's number to the wakeup fd; from now on that is ours, and what is not
        # the first SIGTERM goes on to the service's own reader (SIGINT, a second SIGTERM, SIGUSR2...).
        self._previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        signal.signal(signal.SIGTERM, _no_op)  # the number reaches the pipe; the reader thread acts on it
        threading.Thread(target=self._read, args=(read_fd,), daemon=True, name="drain-signal").start()
        return self

    def _read(self, read_fd: int) -> None:
        while data := os.read(read_fd, 64):
            for number in data:
                if number == signal.SIGTERM and not self.requested.is_set():
                    self.requested.set()
                else:
                    self._forward(number)

    def _forward(self, number: int) -> None:
        if self._previous < 0:
            self._stop.set()  # no service reader (in process): stop directly, from this thread
            return
        try:
            os.write(self._previous, bytes([number]))
        except BlockingIOError:
            pass  # its pipe is full of signals: a stop is on its way

    def finish(self) -> None:
        """The drain is over: stop the service (SIGTERM's usual path, with its shutdown deadline)."""
        print(DRAINED_LINE, flush=True)
        self._forward(signal.SIGTERM)


def _no_op(signum, frame) -> None:
    pass


def sigterm_drains(stop: threading.Event) -> DrainSignal:
    """Make this process's first SIGTERM a drain request (call from the main thread, after ``run_service`` set its
    stop signals up)."""
    return DrainSignal(stop).install()
