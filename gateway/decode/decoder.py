"""Where a stream's latents become frames: the VAE in the gateway process (whole, or cut into slices over several
devices), or a chain of VAE stage processes.

Usage (one session per client stream; ``gateway.stream.run`` drives it from two threads)::

    decoder = LocalDecoder(StreamVAE.from_folder(root / "vae"))       # or RemoteDecoder("127.0.0.1:50070"), or
    decoder = LocalDecoder.from_folder(root / "vae", dtype=torch.bfloat16, devices=["cuda:0", "cuda:1"])
    session = decoder.open(capacity=4)
    session.submit(tag, latents)          # producer thread; blocks while ``capacity`` chunks are queued/in flight;
                                          # ``tag`` is the caller's, with the chunk number as ``tag.index``
    session.finish()                      # no more chunks: results() ends after the last one
    for tag, frames, when in session.results():  # consumer thread; frames (n, H, W, 3) uint8, in submit order;
        ...                               # when: (start_ns, end_ns) of the chunk's decode, or None if unknown
    session.abort()                       # from any thread: stop taking chunks, drop what is queued
    session.close()                       # consumer thread, last: frees the stream's VAE cache (remote: waits
                                          # until every stage has freed it)

Both are exact: ``gateway.decode.stream_vae`` decodes chunk by chunk bit-identically however the decoder is cut.

In process (``--vae-devices cuda:0,cuda:1``, ``--vae-split``), each part runs in a worker thread of its own per stream
with its own cache slots and hands one tensor per chunk to the next, so consecutive chunks are in different parts at
once.  Each part's decodes pass a ``DecodeGate`` (two slots on a GPU: one launching while one finishes; one on a CPU)
where a waiting paced stream's decode goes before any unpaced one's (``open(capacity, paced=...)``), so unpaced
streams' full-VAE decodes never queue ahead of a paced stream's. On a GPU, while a paced stream has latents queued
there, unpaced decodes take only a bounded share of the part; on a CPU they run beside paced ones, two at a time, at
the lowest CPU priority, on what the cores have left (``DecodeGate``).

A tiny streaming decoder (``gateway.decode.tiny_decoder``) is one more part:
``LocalDecoder([load_tiny_decoder(path)])``.
Each part says what range its video is in (``output_range``: the Wan VAE's [-1, 1], a tiny decoder's [0, 1]) and
``uint8_frames`` maps it with that range's own arithmetic.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Callable

import grpc
import numpy as np
import torch

from gateway.decode.stream_vae import ChunkDecoder, StreamVAE, StreamVAESlice, decoder_cut, to_uint8_frames
from gateway.stream.channel import CLOSED, BoundedChannel
from gateway.stream.timers import Timers
from stagecast import wire
from stagecast.grpc_util import CHANNEL_OPTIONS
from stagecast.internal.v1 import vae_pb2 as vpb
from stagecast.internal.v1 import vae_pb2_grpc as vpb_grpc
from stagecast.security import MTLS, connect

logger = logging.getLogger(__name__)

_DONE = object()


def uint8_frames(part, video: torch.Tensor) -> torch.Tensor:
    """The last part's video ``(1, 3, n, H, W)`` as ``(n, H, W, 3)`` uint8, by the part's ``output_range``: [-1, 1]
    (the Wan VAE: ``to_uint8_frames``, diffusers' arithmetic) or [0, 1] (a tiny decoder: ``round(255 x)``)."""
    low, high = getattr(part, "output_range", (-1.0, 1.0))
    if (low, high) == (-1.0, 1.0):
        return to_uint8_frames(video)
    if (low, high) == (0.0, 1.0):
        from gateway.decode.tiny_decoder import tiny_to_uint8_frames

        return tiny_to_uint8_frames(video)
    raise ValueError(f"a decoder part whose video is in [{low}, {high}]: no uint8 mapping for that range")


def _held_bytes(state) -> int:
    """A stream state's memory (``approx_bytes``, a property of the VAE's states and possibly a method of others);
    0 once released."""
    if getattr(state, "released", False):
        return 0
    held = state.approx_bytes
    return int(held() if callable(held) else held)


def load_checked_tiny(
    path,
    *,
    device: str,
    dtype: torch.dtype,
    latent_channels: int,
    spatial_factor: int,
    temporal_factor: int,
    compile: bool = False,
):
    """A tiny streaming decoder (``gateway.decode.tiny_decoder``) checked against the checkpoint it serves: a file for
    other
    latents (taew2_1 is for Wan2.1 / Wan2.2-A14B, taew2_2 for Wan2.2-TI2V-5B) or another frame geometry is refused,
    naming ``--tiny-decoder``."""
    from gateway.decode.tiny_decoder import load_tiny_decoder

    try:
        part = load_tiny_decoder(path, device=device, dtype=dtype, compile=compile)
    except ValueError as exc:
        raise ValueError(f"--tiny-decoder: {exc}") from None
    if part.latent_channels != latent_channels:
        raise ValueError(
            f"--tiny-decoder {path}: decodes {part.latent_channels}-channel latents; this checkpoint's DiT makes "
            f"{latent_channels} (taew2_1: 16, Wan2.1 and Wan2.2-A14B; taew2_2: 48, Wan2.2-TI2V-5B)"
        )
    if part.spatial_factor != spatial_factor or temporal_factor != 4:
        raise ValueError(
            f"--tiny-decoder {path}: gives {part.spatial_factor}x pixels per latent pixel and 4 frames per latent "
            f"frame; this checkpoint's VAE gives {spatial_factor}x and {temporal_factor}"
        )
    logger.info("tiny decoder %s: %d latent channels, on %s (%s)", path, latent_channels, device, dtype)
    return part


MAX_GATE_SLOTS = 64
GPU_GATE_SLOTS = 2  # decodes in flight per GPU part: one launching while one finishes; the rest wait, paced first
# On a CPU a decode already spreads over every core (torch's intra-op threads): one at a time costs no throughput,
# and a waiting paced stream's decode then goes before every unpaced one's instead of sharing the cores with them.
CPU_GATE_SLOTS = 1


# While paced work is pending at a gate (queued in a paced session, waiting, or running), unpaced work takes at most
# this share of the gate's time over any window of UNPACED_WINDOW_S (its next hold priced at its recent holds), so a
# paced stream's decodes lose at most about that share to best-effort ones, and best-effort streams still move.
UNPACED_SHARE = 0.25
UNPACED_WINDOW_S = 1.0
UNPACED_COST_HOLDS = 8  # an unpaced hold is priced at the longest of this many recent ones
# Unpaced decodes at once in a CPU part's background lane: two, so that two best-effort streams move in the cores'
# spare time, not one at a time behind each other (on 2 cores beside a paced stream, one alone often finished a
# single chunk in a second, two finished one each).
BACKGROUND_SLOTS = 2


class DecodeGate:
    """At most ``slots`` decodes at once on one part (one device), paced streams first.

    Usage: ``with gate.hold(paced): ...decode...``; a paced session with work queued for this gate says so with
    ``watch(probe)`` (``probe()`` True while it has latents waiting for this part; ``unwatch`` at its end).

    - A paced hold that waits goes before every unpaced one.
    - While paced work is pending here (a paced hold waiting or running, or a watched paced session with work
      queued), an unpaced hold starts only if the unpaced holds of the last ``window_s`` plus its own (priced at
      the longest recent one) stay within ``share`` of that window, or if no unpaced hold ran in that window:
      between two decodes of a paced stream whose next latents are already queued, the free slot is not the
      unpaced stream's for the asking.  So best-effort work gets ``share`` of the gate or one hold per
      ``window_s``, whichever is more, and a paced stream loses no more (a decode is not preempted: one that runs
      when the paced stream's work arrives finishes first).
    - With no paced work pending, unpaced holds take free slots as they come, oldest waiter first.
    - ``background`` (a part on a CPU, ``LocalDecoder``'s default there): unpaced holds take none of the slots nor
      the share. They pass a lane of their own (``BACKGROUND_SLOTS``), oldest waiter first, from threads at the
      lowest CPU priority (``lower_thread_priority``, which the caller does: ``LocalSession``'s unpaced workers), so
      the OS scheduler, which can preempt a decode where this gate cannot, gives them only the cores that paced
      work leaves: a paced decode never waits here for one, and where both want a core the unpaced thread gets
      about 1.5% of it (nice 19 against 0). On 2 cores beside a decode-bound paced stream, best-effort decodes
      then move at two to three chunks a second in all (``benchmarks.cpu_host``).

    The gateway's encodes (prompts, JPEG and H.264 frames) pass one of their own (``encode_gate``)."""

    def __init__(
        self,
        slots: int,
        *,
        share: float = UNPACED_SHARE,
        window_s: float = UNPACED_WINDOW_S,
        clock=time.monotonic,
        background: bool = False,
    ):
        if not 1 <= slots <= MAX_GATE_SLOTS:
            raise ValueError(f"decode gate slots must be in 1..{MAX_GATE_SLOTS}, got {slots}")
        if not 0 < share <= 1 or not window_s > 0:
            raise ValueError(f"decode gate: share must be in (0, 1] and window_s > 0, got {share}, {window_s}")
        self.slots = slots
        self.free = slots
        self.waiting = [0, 0]  # paced, unpaced
        self.paced_running = 0  # paced work that passed ``yielding`` (it takes no slot)
        self.paced_holding = 0  # paced holds in progress
        self.share = share
        self.window_s = window_s
        self.clock = clock
        self.probes: dict[int, object] = {}  # watched paced sessions' "work queued here?" probes
        self._probe_ids = itertools.count()
        self.unpaced_spans: list[list[float]] = []  # [start, end] of recent unpaced holds (end inf: running)
        # The next unpaced hold is priced at the longest of the last few (a stream's first chunk decodes in a fraction
        # of a later one's time); None before one.
        self.unpaced_costs: collections.deque[float] = collections.deque(maxlen=UNPACED_COST_HOLDS)
        self.unpaced_cost_s: float | None = None
        self._tickets = itertools.count()
        self.unpaced_queue: list[int] = []  # waiting unpaced holds' tickets, oldest first
        self.cond = threading.Condition()
        # background: unpaced holds pass this lane instead (no paced hold ever waits in it)
        self.lane: DecodeGate | None = (
            DecodeGate(BACKGROUND_SLOTS, share=share, window_s=window_s, clock=clock) if background else None
        )

    @property
    def background(self) -> bool:
        return self.lane is not None

    def watch(self, probe) -> int:
        """A paced session's probe: True while it has work queued for this gate.  Returns a key for ``unwatch``."""
        with self.cond:
            key = next(self._probe_ids)
            self.probes[key] = probe
            return key

    def unwatch(self, key: int) -> None:
        with self.cond:
            self.probes.pop(key, None)
            self.cond.notify_all()

    def paced_pending(self) -> bool:
        """Paced work waits, runs or is queued here (under ``cond``)."""
        return bool(
            self.waiting[0] or self.paced_running or self.paced_holding or any(p() for p in self.probes.values())
        )

    def unpaced_busy_s(self, now: float) -> float:
        """Seconds of the last ``window_s`` unpaced holds took, the running ones up to ``now`` (under ``cond``)."""
        since = now - self.window_s
        self.unpaced_spans = [s for s in self.unpaced_spans if s[1] > since]
        return sum(min(end, now) - max(start, since) for start, end in self.unpaced_spans)

    def _unpaced_may_start(self, ticket: int) -> tuple[bool, float | None]:
        """Whether the unpaced hold ``ticket`` may take a slot now, else how long until the budget could allow it
        (None: wait for a notification)."""
        if self.free <= 0 or self.waiting[0] or self.paced_running or self.unpaced_queue[0] != ticket:
            return False, None
        if not self.paced_pending():
            return True, None
        now = self.clock()
        busy = self.unpaced_busy_s(now)
        room = self.share * self.window_s - busy - (self.unpaced_cost_s or 0.0)
        if room >= 0 or busy == 0:  # within the share, or none in the window: best-effort work always moves
            return True, None
        # The window slides at one second per second: by then either the room is there or the window is empty.
        return False, min(-room, self.window_s)

    def hold(self, paced: bool, abandoned: Callable[[], bool] | None = None):
        """A context manager: one decode through this gate (``paced`` first).  It gives True once the decode holds a
        slot.  ``abandoned``: True once nobody wants this decode (its stream was cancelled); checked while waiting
        (``wake`` has waiters check it at once), the hold then gives False and takes no slot, so a cancelled stream
        is not kept waiting behind other streams' decodes for one whose frames nobody reads."""
        if not paced and self.lane is not None:
            return self.lane._hold(False, abandoned)
        return self._hold(paced, abandoned)

    def wake(self) -> None:
        """Have the waiting holds check their ``abandoned`` at once (a session calls it when it aborts)."""
        for gate in (self, self.lane):
            if gate is not None:
                with gate.cond:
                    gate.cond.notify_all()

    @contextlib.contextmanager
    def _hold(self, paced: bool, abandoned: Callable[[], bool] | None = None):
        gone = abandoned or (lambda: False)
        with self.cond:
            if paced:
                self.waiting[0] += 1
                self.cond.notify_all()  # whoever watches the queue (a test) sees it grow
                try:
                    self.cond.wait_for(lambda: self.free > 0 or gone())
                finally:
                    self.waiting[0] -= 1
                    # The last paced waiter leaving may let an unpaced one take a slot still free (slots > 1).
                    self.cond.notify_all()
                granted = not gone()
                if granted:
                    self.paced_holding += 1
            else:
                ticket = next(self._tickets)
                self.waiting[1] += 1
                self.unpaced_queue.append(ticket)
                self.cond.notify_all()
                try:
                    while granted := not gone():
                        ok, retry_s = self._unpaced_may_start(ticket)
                        if ok:
                            break
                        self.cond.wait(retry_s)
                finally:
                    self.waiting[1] -= 1
                    self.unpaced_queue.remove(ticket)
                    self.cond.notify_all()  # the next unpaced waiter is first now
                if granted:
                    span = [self.clock(), float("inf")]
                    self.unpaced_spans.append(span)
            if granted:
                self.free -= 1
        if not granted:
            yield False
            return
        try:
            yield True
        finally:
            with self.cond:
                self.free += 1
                if paced:
                    self.paced_holding -= 1
                else:
                    span[1] = self.clock()
                    took = span[1] - span[0]
                    self.unpaced_costs.append(took)
                    self.unpaced_cost_s = max(self.unpaced_costs)
                self.cond.notify_all()

    @contextlib.contextmanager
    def yielding(self, paced: bool):
        """For work that batches across callers (the text encoder's batched prompts): paced work passes at once and
        takes no slot, so paced prompts still share one forward; unpaced work takes a slot only while no paced work
        runs or waits here, so it never delays a paced stream's prompt."""
        if not paced:
            with self.hold(False):
                yield
            return
        with self.cond:
            self.paced_running += 1
        try:
            yield
        finally:
            with self.cond:
                self.paced_running -= 1
                self.cond.notify_all()


BACKGROUND_NICE = 19  # the lowest CPU priority: a thread at it gets a core only when nothing else wants one


def lower_thread_priority() -> bool:
    """Run the calling thread (and the OpenMP threads it starts from now on, which inherit it) at
    ``BACKGROUND_NICE``, for good: an unprivileged thread cannot raise its priority again, so call it only from a
    thread that does best-effort work alone. False where the OS refuses or has no per-thread priority (only Linux
    gives each thread its own: elsewhere ``setpriority`` takes a process id, not a thread's)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
    except (AttributeError, OSError) as exc:
        logger.debug("best-effort decode thread keeps its priority: %s", exc)
        return False
    return True


def encode_gate() -> DecodeGate:
    """The gateway's one gate for CPU encodes (prompts, JPEG and H.264 frames), a slot per core: a paced stream's
    encode that waits goes before every unpaced stream's (``StreamHost.encode_gate``, ``Gateway.encode_prompt``)."""
    return DecodeGate(max(1, min(MAX_GATE_SLOTS, os.cpu_count() or 1)))


class LocalDecoder:
    """The VAE in this process: one ``StreamVAE``, or ``StreamVAESlice`` s (each on its own device) as a pipeline.

    ``parts`` is a decoder or a list of them, first to last: the first takes latents, the last gives video.  Every
    part runs in its own thread per stream, so with several parts a stream's consecutive chunks are in different
    parts (and devices) at once, and with one part the next chunk decodes while the consumer encodes this one.

    ``gate_slots``: each part's decodes pass a ``DecodeGate`` of that many slots (paced streams' first); None: one of
    ``GPU_GATE_SLOTS`` for a part on a GPU, of ``CPU_GATE_SLOTS`` on a CPU (where the threads share the cores); 0:
    none. ``background``: unpaced decodes pass the gate's lane at the lowest CPU priority (``DecodeGate``); None:
    for a part on a CPU, where the OS scheduler shares the cores, not for one on a GPU (whose kernels it does not
    schedule), where unpaced decodes take a bounded share of the gate instead.
    """

    def __init__(
        self,
        parts: ChunkDecoder | list[ChunkDecoder],
        gate_slots: int | None = None,
        background: bool | None = None,
    ):
        self.parts = list(parts) if isinstance(parts, list | tuple) else [parts]
        if not self.parts or not self.parts[0].takes_latents or not self.parts[-1].gives_video:
            raise ValueError("a local decoder needs parts that take latents first and give video last")
        self.gates = []
        for part in self.parts:
            on_gpu = getattr(part.device, "type", "cpu") == "cuda"
            slots = gate_slots
            if slots is None:
                slots = GPU_GATE_SLOTS if on_gpu else CPU_GATE_SLOTS
            lane = (not on_gpu) if background is None else background
            self.gates.append(DecodeGate(slots, background=lane) if slots else None)

    @classmethod
    def tiny(
        cls, path, *, device: str, dtype: torch.dtype, latent_channels: int, spatial_factor: int, temporal_factor: int
    ) -> LocalDecoder:
        """A tiny streaming decoder (``gateway.decode.tiny_decoder``) as the one part, decoding one stream per call
        (``load_checked_tiny``; the gateway shares one across its streams instead:
        ``gateway.decode.batched_decoder``)."""
        return cls(
            load_checked_tiny(
                path,
                device=device,
                dtype=dtype,
                latent_channels=latent_channels,
                spatial_factor=spatial_factor,
                temporal_factor=temporal_factor,
            )
        )

    @classmethod
    def from_folder(
        cls,
        folder,
        *,
        dtype: torch.dtype,
        devices: list[str],
        boundaries: list[int] | None = None,
        compile: bool = False,
    ) -> LocalDecoder:
        """One part per device: the whole ``StreamVAE`` for one device, else the ``decoder_cut`` slices.

        ``boundaries`` are the decoder unit indices where parts 1.. start (``decoder_units``); by default the cut
        balances multiply-accumulates.  Each device loads its own copy of the weights and runs only its slice.
        """
        if not devices:
            raise ValueError("no VAE devices given")
        count = torch.cuda.device_count()
        for name in devices:
            try:
                device = torch.device(name)
            except RuntimeError:
                raise ValueError(f"VAE device {name!r} is not a device name (e.g. cpu, cuda:0)") from None
            if device.type == "cuda" and (device.index or 0) >= count:
                raise ValueError(f"VAE device {name!r} does not exist here: this machine has {count} CUDA device(s)")
        if boundaries and len(devices) == 1:
            raise ValueError(f"VAE split {boundaries} needs {len(boundaries) + 1} devices, got 1")
        if len(devices) == 1:
            return cls(StreamVAE.from_folder(folder, dtype=dtype, device=devices[0], compile=compile))
        vaes = [StreamVAE.from_folder(folder, dtype=dtype, device=device).vae for device in devices]
        edges = decoder_cut(vaes[0], len(devices), boundaries)
        parts = [
            StreamVAESlice(vae, a, b, compile=compile)
            for vae, (a, b) in zip(vaes, itertools.pairwise(edges), strict=True)
        ]
        logger.info(
            "VAE decoder split over %s at units %s",
            ", ".join(devices),
            [p.start for p in parts[1:]],
        )
        return cls(parts)

    def capture_graphs(self, latent_hw: tuple[int, int], slots: int, capture_for=None) -> list[bool]:
        """Capture ``slots`` CUDA graph slots per part for streams of ``latent_hw`` latents
        (``gateway.decode.vae_graphs``:
        a stream's frames from its third on replay its slot's graph; a stream without a free slot decodes eagerly).
        Call before serving, after any compile warm-up. Returns, per part, whether it is graphed."""
        from gateway.decode.vae_graphs import capture_graphs, default_capture

        return capture_graphs(self.parts, latent_hw=latent_hw, slots=slots, capture_for=capture_for or default_capture)

    def open(self, capacity: int, paced: bool = False) -> LocalSession:
        """``paced``: the stream's decodes go before unpaced streams' at each part's gate."""
        return LocalSession(self.parts, capacity, paced=paced, gates=self.gates)

    def depth(self, capacity: int) -> int:
        """Chunks a stream needs queued here to keep every part busy: one per part and one waiting (at most
        ``capacity`` + 1, what a session can hold before the producer blocks)."""
        return min(len(self.parts) + 1, capacity + 1)

    def close(self) -> None:
        pass


class _Failure:
    def __init__(self, exc: BaseException):
        self.exc = exc


class LocalSession:
    """Latents wait in a bounded queue; one worker thread per part decodes, each handing on to the next."""

    def __init__(self, parts: list[ChunkDecoder], capacity: int, *, paced: bool = False, gates: list | None = None):
        self.parts = parts
        self.paced = paced
        self.gates = gates or [None] * len(parts)
        self.states = [part.new_state() for part in parts]
        # inbox (capacity) -> part 0 -> [1] -> part 1 -> ... -> [1] -> results()
        self.channels = [BoundedChannel(capacity)] + [BoundedChannel(1) for _ in parts]
        # A paced session tells each part's gate while it has latents queued for that part (``DecodeGate.watch``),
        # so that an unpaced decode does not take the slot between two of its decodes.
        self.watched = [
            gate.watch(lambda ch=channel: len(ch) > 0) if paced and gate is not None else None
            for gate, channel in zip(self.gates, self.channels, strict=False)
        ]
        self.workers = [
            threading.Thread(target=self._work, args=(i,), daemon=True, name=f"vae-part-{i}") for i in range(len(parts))
        ]
        for worker in self.workers:
            worker.start()

    def _work(self, i: int) -> None:
        part, state = self.parts[i], self.states[i]
        inbox, outbox = self.channels[i], self.channels[i + 1]
        try:
            if part.device.type == "cuda":
                torch.cuda.set_device(part.device)  # per thread; the .cpu() sync below then waits on this GPU
            gate = self.gates[i]
            if not self.paced and gate is not None and gate.background:
                lower_thread_priority()  # before its first decode: the OpenMP threads it starts inherit it
            while (item := inbox.get()) is not CLOSED:
                if isinstance(item, _Failure):
                    outbox.put_final(item)
                    return
                tag, x, started_ns = item
                # An abort closes every channel: a chunk waiting at the gate then is dropped, not decoded for nobody.
                hold = (
                    gate.hold(self.paced, lambda: outbox.closed) if gate is not None else contextlib.nullcontext(True)
                )
                with hold as granted:
                    if not granted or outbox.closed:
                        inbox.close(drop=True)
                        return
                    started_ns = started_ns or time.time_ns()  # the first part stamps when the decode began
                    y = part.decode_chunk(state, x)
                    if part.gives_video:
                        y = uint8_frames(part, y).cpu().numpy()
                if not outbox.put((tag, y, started_ns)):
                    inbox.close(drop=True)  # aborted downstream: stop the parts upstream too
                    return
            outbox.close()  # finished: what is queued still drains
        except Exception as exc:
            logger.exception("VAE part %d failed", i)
            inbox.close(drop=True)  # the producer's submit returns False from now on
            # Chunks this part finished before failing are good and still queued for the next part: they go
            # first, then the failure (dropping them lost a good chunk whenever the next part had not taken it).
            outbox.put_final(_Failure(exc))
        finally:
            if self.watched[i] is not None:  # no more work for this part's gate from this stream
                self.gates[i].unwatch(self.watched[i])

    def submit(self, tag, latents: torch.Tensor) -> bool:
        return self.channels[0].put((tag, latents, None))

    def finish(self) -> None:
        self.channels[0].close()

    def abort(self) -> None:
        for channel in self.channels:
            channel.close(drop=True)
        for gate in self.gates:
            if gate is not None:
                gate.wake()  # a worker waiting at its gate stops waiting (it would decode for nobody)

    def results(self):
        while (item := self.channels[-1].get()) is not CLOSED:
            if isinstance(item, _Failure):
                raise item.exc
            tag, frames, started_ns = item
            yield tag, frames, (started_ns, time.time_ns())

    def close(self) -> None:
        self.abort()
        for worker in self.workers:
            if worker is not threading.current_thread():
                worker.join()  # at most the chunk each is decoding; then no thread touches the states
        for part, state in zip(self.parts, self.states, strict=True):
            part.release(state)

    @property
    def queued(self) -> int:
        return sum(len(channel) for channel in self.channels)

    @property
    def state_bytes(self) -> int:
        return sum(_held_bytes(s) for s in self.states)


class RemoteDecoder:
    """The first of a chain of ``stagecast vae-stage`` processes."""

    def __init__(
        self, address: str, drain_timeout: float = 30.0, timers: Timers | None = None, mtls: MTLS | None = None
    ):
        self.address = address
        self.drain_timeout = drain_timeout
        self.timers = timers or Timers("vae-drain")
        self.channel = connect(address, mtls, "vae-stage", CHANNEL_OPTIONS)
        self.stub = vpb_grpc.VAEStageServiceStub(self.channel)

    def open(self, capacity: int, paced: bool = False) -> RemoteSession:
        return RemoteSession(self, capacity)

    def depth(self, capacity: int) -> int:
        """Chunks a stream keeps in flight through the chain."""
        return capacity

    def close(self) -> None:
        self.channel.close()


class RemoteSession:
    """One Decode call; up to ``capacity`` chunks in flight through the chain, so its stages work concurrently."""

    def __init__(self, decoder: RemoteDecoder, capacity: int):
        self.decoder = decoder
        self.inflight = BoundedChannel(capacity)  # tags of the chunks sent and not yet answered, in order
        self.requests: queue.Queue = queue.Queue()
        self.call = decoder.stub.Decode(self._requests())
        self._finished = False
        self._lock = threading.Lock()

    def _requests(self):
        while (msg := self.requests.get()) is not _DONE:
            yield msg

    def submit(self, tag, latents: torch.Tensor) -> bool:
        if not self.inflight.put(tag):
            return False
        self.requests.put(vpb.VAEChunk(chunk=tag.index, data=wire.tensor_to_proto(latents)))
        return True

    def finish(self) -> None:
        with self._lock:
            if self._finished:
                return
            self._finished = True
        self.requests.put(_DONE)  # half-close: the stages answer what they have, free the state and end the call

    def abort(self) -> None:
        self.inflight.close()  # a blocked submit returns False; tags already sent still pair with their replies
        self.finish()

    def results(self):
        try:
            for reply in self.call:
                tag = self.inflight.get()
                yield tag, np.asarray(wire.tensor_from_proto(reply.data)), None
        except grpc.RpcError as exc:
            raise RuntimeError(f"VAE stage {self.decoder.address}: {exc.code().name}: {exc.details()}") from None

    def close(self) -> None:
        """End the call the graceful way, so that when this returns every stage has released the stream's state."""
        self.abort()
        deadline = self.decoder.timers.call_later(self.decoder.drain_timeout, self.call.cancel)
        try:
            for _ in self.results():
                pass
        except RuntimeError as exc:
            logger.debug("draining a VAE stage call: %s", exc)
        finally:
            self.decoder.timers.cancel(deadline)

    @property
    def queued(self) -> int:
        return len(self.inflight)

    @property
    def state_bytes(self) -> int:
        return 0  # held by the VAE stages; see their Describe
