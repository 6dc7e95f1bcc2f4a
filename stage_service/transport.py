"""The stage data plane: torch.distributed point-to-point between neighbouring stages.

Usage::

    bind_data_plane("10.0.0.2")           # GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME: the interface holding --host
    tp = PipeTransport.join(rank=r, world_size=n, store=GrpcStore(channel), generation=g, backend="gloo")
    tp.send_hidden(hs)                    # rank r -> r+1, asynchronous; the tensor is kept alive until sent
    hs = tp.recv_hidden(shape, dtype)     # rank r <- r-1
    tp.send_latent(x)                     # last -> first (the next level's input)
    x = tp.recv_latent(shape)             # first <- last
    tp.sequence                           # this rank's sequence-parallel group (--sp; LOCAL when 1)
    peer = tp.exchange_guidance(flow)     # CFG-parallel: last stage <-> the other group's last stage
    tp.abort()                            # from any thread: blocked sends and receives raise at once
    tp.close()                            # leaves the group: its sockets, fds and threads are gone

With ``sp`` > 1 the world is ``stages × sp`` ranks (``stagecast.model.parallel.ParallelLayout``): rank
``(k, r)`` sends its sequence shard to ``(k + 1, r)``, the last stage's rank r sends latents to stage 0's rank r,
and each stage's ranks share a ``SequenceGroup`` (``stage_service.parallel_state``) for Ulysses' all-to-alls.

With CFG-parallel (``cfg_parallel=2``, no ``sp``) the world is two pipelines of ``pipeline`` ranks each: group g
holds ranks ``[g*pipeline, (g+1)*pipeline)``, hidden states and latents stay inside a group, and the two last
stages swap their branch's flow predictions once per batch that has a guided micro-step.

Only hidden states (B, L, D) and small latents cross.  Both ends derive every shape from the plan, so
no per-message handshake is needed.  The process group lives in a ``PrefixStore`` named after the
generation, on the store the coordinator serves over mTLS gRPC (``stage_service.rendezvous``): a new
generation after a failure never sees the old one's keys, and only stages holding a deployment certificate
can publish or read a peer's address.  gloo and NCCL sockets cannot be authenticated, so they bind to the
interface that holds the stage's own address (``bind_data_plane``).  A receive blocked on a peer that died
raises at once (the connection closes).  On NCCL, sends and receives are enqueued on the GPU and ordered per
peer pair; the host does not block.

gloo cannot interrupt a wait, and a gloo send completes only once the receiver has posted its receive
(``is_completed()`` stays false until ``wait()``).  So:

* sends are reaped by one thread per generation that waits on them in order (the executor never blocks
  on a send, and no send handle or tensor outlives its delivery);
* ``abort`` shuts down this generation's gloo connections (found by port: every pair socket has our
  listener's port or a peer's listener port at one end), which makes every blocked wait, here and at the
  peers, raise at once, as a peer's death would;
* ``close`` joins the reaper and destroys the group, so nothing of the generation stays behind.

A peer's death is one line at a stage, not a traceback: every data-plane operation that fails (a send, a receive, a
sequence group's collective) raises ``PeerLost`` naming the peer's stage with gloo's or NCCL's reason in one sentence
(``stage_service.parallel_state.short_reason``), or ``TransportAborted`` when this stage is the one leaving; the
executor's "leaving generation" line then does not repeat it, and a wait its own leaving released is logged at DEBUG.
"""

from __future__ import annotations

import datetime
import fcntl
import ipaddress
import logging
import os
import queue
import socket
import struct
import threading
import time

import torch
import torch.distributed as dist

from stage_service.parallel_state import LOCAL, PeerLost, SequenceGroup, init_sequence_groups, short_reason
from stagecast.model.parallel import ParallelLayout

logger = logging.getLogger(__name__)

HIDDEN_TAG = 1
LATENT_TAG = 2
GUIDANCE_TAG = 3
WARMUP_TAG = 4  # the probes that create each pair's communicator at join


class TransportAborted(RuntimeError):
    pass


IFNAME_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def _ipv4_of(name: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def interface_for(host: str) -> str | None:
    """The name of the network interface holding the (IPv4) address ``host`` resolves to; None if none does."""
    try:
        address = socket.gethostbyname(host)
        if ipaddress.ip_address(address).is_unspecified:
            return None
    except (OSError, ValueError):
        return None
    for _, name in socket.if_nameindex():
        if _ipv4_of(name) == address:
            return name
    return None


def bind_data_plane(host: str) -> str | None:
    """Set ``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME`` to the interface holding ``host``, so the data
    plane listens and connects only there (values already set by the operator are kept).  Returns the name."""
    name = interface_for(host)
    if name is None:
        logger.warning("no interface holds %s: the data plane binds where gloo / NCCL choose", host)
        return None
    for variable in IFNAME_VARIABLES:
        os.environ.setdefault(variable, name)
    return os.environ["GLOO_SOCKET_IFNAME"]


class PipeTransport:
    def __init__(
        self,
        group: dist.ProcessGroup,
        rank: int,
        world_size: int,
        device: torch.device,
        backend: str,
        sequence: SequenceGroup = LOCAL,
        cfg_parallel: int = 1,
    ):
        if cfg_parallel not in (1, 2) or world_size % cfg_parallel:
            raise ValueError(f"cfg_parallel={cfg_parallel} does not divide world_size={world_size} into groups")
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.backend = backend
        self.sequence = sequence
        self.cfg_parallel = cfg_parallel
        group_size = world_size // cfg_parallel  # ranks of one pipeline (one CFG group)
        self.layout = ParallelLayout(group_size // sequence.size, sequence.size)
        self.pipeline = self.layout.pipeline  # pipeline stages (world_size / sp / cfg_parallel)
        self.cfg_rank = rank // group_size
        self.base = self.cfg_rank * group_size  # this group's first rank
        self.exchange_seconds = 0.0  # time in CFG-parallel exchanges (send posted, the peer's predictions received)
        self._aborted = threading.Event()
        self.wait_seconds = 0.0  # time spent blocked in receives, for bubble accounting
        self.sockets: list[tuple[int, int]] = []  # (fd, inode) of this generation's gloo connections
        self._sends: queue.Queue = queue.Queue()  # (work, tensor) until delivered; None ends the reaper
        self._reaper: threading.Thread | None = None
        self._nccl_sends: list[tuple[dist.Work, torch.Tensor]] = []
        # The rendezvous store, held for the group's life: NCCL reads it again whenever it creates a communicator
        # (a new peer pair, a sub-group), and a Python store (``GrpcStore``) that nothing in Python references is
        # collected, after which torch finds no ``get`` on it ("fn INTERNAL ASSERT FAILED ... Not implemented").
        self.stores: tuple[dist.Store, ...] = ()
        if backend != "nccl" and world_size > 1:
            self._reaper = threading.Thread(target=self._reap_loop, daemon=True, name="send-reaper")
            self._reaper.start()

    @classmethod
    def join(
        cls,
        *,
        rank: int,
        world_size: int,
        store: dist.Store,
        generation: int,
        backend: str,
        device: torch.device | str = "cpu",
        timeout_s: float = 300.0,
        sp: int = 1,
        cfg_parallel: int = 1,
    ) -> PipeTransport:
        timeout = datetime.timedelta(seconds=timeout_s)
        prefixed = dist.PrefixStore(f"stagecast/gen{generation}", store)
        device = torch.device(device)
        if backend == "nccl":
            torch.cuda.set_device(device)
        if dist.is_initialized():
            dist.destroy_process_group()
        before = _socket_fds()
        dist.init_process_group(backend, store=prefixed, rank=rank, world_size=world_size, timeout=timeout)
        group = dist.group.WORLD
        if cfg_parallel > 1 and sp > 1:
            raise ValueError(f"--cfg-parallel {cfg_parallel} does not compose with --sp {sp}")
        layout = ParallelLayout(world_size // cfg_parallel // sp, sp)
        if layout.world_size * cfg_parallel != world_size:
            raise ValueError(f"world size {world_size} is not a multiple of --sp {sp} x --cfg-parallel {cfg_parallel}")
        sequence = init_sequence_groups(layout, rank, backend)  # every rank creates every stage's group
        tp = cls(group, rank, world_size, device, backend, sequence, cfg_parallel=cfg_parallel)
        tp.stores = (store, prefixed)
        if backend == "gloo" and world_size > 1:
            tp.sockets = _gloo_connections(before, prefixed, rank, world_size)
        tp._warmup()
        logger.info("joined generation %d as rank %d/%d over %s", generation, rank, world_size, backend)
        return tp

    def peer_pairs(self) -> list[tuple[int, int]]:
        """Every pair of ranks (low, high) that exchanges tensors while serving, over the whole world, sorted: the
        pipeline ring of each CFG group (rank (k, r) to (k + 1, r), the last stage back to the first) and, with
        CFG-parallel, the two groups' last stages."""
        size = self.layout.world_size
        sp = self.sequence.size
        pairs = set()
        for base in range(0, self.world_size, size):
            for local in range(size):
                a, b = base + local, base + (local + sp) % size
                if a != b:
                    pairs.add((min(a, b), max(a, b)))
                if self.cfg_parallel > 1 and local >= size - sp:
                    c = (a + size) % self.world_size
                    pairs.add((min(a, c), max(a, c)))
        return sorted(pairs)

    def _warmup(self) -> None:
        # Create every communicator now, not on the first real chunk, with the very operations serving uses (a
        # single isend / irecv per pair: NCCL keys a point-to-point communicator by its two ranks).  Every rank
        # takes the pairs in the same global order and blocks on each until its peer has done it too; the lowest
        # pair not yet done always has both ranks at it, so this cannot deadlock on a ring of any length.  The
        # device is synchronized at the end, so a join that returns has working communicators.
        probe = torch.zeros(1, device=self.device)
        for low, high in self.peer_pairs():
            if self.rank not in (low, high):
                continue
            # One communicator carries both directions of a pair, on one stream per rank: the lower rank sends
            # first and the higher one receives first, or each send would queue behind a receive that waits for it.
            got = torch.zeros_like(probe)
            if self.rank == low:
                works = [dist.isend(probe, dst=high, tag=WARMUP_TAG), dist.irecv(got, src=high, tag=WARMUP_TAG)]
            else:
                works = [dist.irecv(got, src=low, tag=WARMUP_TAG), dist.isend(probe, dst=low, tag=WARMUP_TAG)]
            for work in works:
                work.wait()
        if self.sequence.size > 1:
            self.sequence.all_gather(probe)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @property
    def last_in_pipe(self) -> bool:
        return self.rank - self.base >= self.layout.world_size - self.sequence.size

    @property
    def guidance_peer(self) -> int:
        """The other CFG group's rank at this pipeline position."""
        return (self.rank + self.layout.world_size) % self.world_size

    # ---- sends ----------------------------------------------------------------------------------------

    def peer_name(self, rank: int) -> str:
        """A rank as the coordinator's registry names it (``stage N``: stage processes register under their rank),
        with its pipeline stage and sequence rank under --sp."""
        sp = self.sequence.size
        return f"stage {rank} (pipeline stage {rank // sp}, sp-rank {rank % sp})" if sp > 1 else f"stage {rank}"

    def _lost(self, exc: BaseException, peer: int) -> RuntimeError:
        """What a failed operation with ``peer`` raises: our own abort, or the peer gone, named, in one line."""
        if self._aborted.is_set():
            return TransportAborted("data plane aborted: this stage is leaving the generation")
        return PeerLost(f"data plane: lost {self.peer_name(peer)}: {short_reason(exc)}")

    def _isend(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        tensor = tensor.contiguous()
        try:
            work = dist.isend(tensor, dst=dst, tag=tag)
        except RuntimeError as exc:  # gloo refuses a send on a pair whose peer is gone
            raise self._lost(exc, dst) from None
        if self._reaper is not None:
            self._sends.put((work, tensor))  # kept alive until delivered
        else:
            # NCCL: a send completes on the GPU by itself and ``is_completed`` sees it without blocking.
            self._nccl_sends = [(w, t) for w, t in self._nccl_sends if not w.is_completed()]
            self._nccl_sends.append((work, tensor))

    def _reap_loop(self) -> None:
        # Sends to one peer complete in order, so waiting on them in order never waits on a later one.
        while True:
            item = self._sends.get()
            if item is None:
                return
            try:
                item[0].wait()
            except RuntimeError:
                pass  # the generation is being abandoned (abort, or a peer left): nothing to deliver
            del item

    @property
    def pending_sends(self) -> int:
        return self._sends.qsize() + len(self._nccl_sends)

    def send_hidden(self, hidden: torch.Tensor) -> None:
        self._isend(hidden, self.rank + self.sequence.size, HIDDEN_TAG)

    def send_latent(self, latent: torch.Tensor) -> None:
        self._isend(latent.to(self.device, torch.float32), self.base + self.sequence.rank, LATENT_TAG)

    def exchange_guidance(self, flow: torch.Tensor) -> torch.Tensor:
        """CFG-parallel, last stages: send this group's predictions of the batch's guided micro-steps to the other
        group's last stage and receive its own (same shape and dtype: both derive it from the same plan)."""
        start = time.perf_counter()
        peer = self.guidance_peer
        self._isend(flow, peer, GUIDANCE_TAG)
        out = self._recv(tuple(flow.shape), flow.dtype, peer, GUIDANCE_TAG)
        self.exchange_seconds += time.perf_counter() - start
        return out

    # ---- receives -------------------------------------------------------------------------------------

    def _wait(self, work: dist.Work, peer: int) -> None:
        if self._aborted.is_set():
            raise TransportAborted("data plane aborted: this stage is leaving the generation")
        start = time.perf_counter()
        # gloo cannot interrupt a blocking receive (a timed-out wait even breaks the pair), so a stage
        # blocked on a live peer is freed by that peer leaving the group, which closes the connection.
        # On NCCL this enqueues a stream dependency and returns at once.
        try:
            work.wait()
        except RuntimeError as exc:
            raise self._lost(exc, peer) from None
        self.wait_seconds += time.perf_counter() - start

    def _recv(self, shape, dtype, src: int, tag: int) -> torch.Tensor:
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        try:
            work = dist.irecv(buf, src=src, tag=tag)
        except RuntimeError as exc:
            raise self._lost(exc, src) from None
        self._wait(work, src)
        return buf

    def recv_hidden(self, shape, dtype) -> torch.Tensor:
        return self._recv(shape, dtype, self.rank - self.sequence.size, HIDDEN_TAG)

    def recv_latent(self, shape) -> torch.Tensor:
        last = self.base + self.layout.rank(self.pipeline - 1, self.sequence.rank)
        return self._recv(shape, torch.float32, last, LATENT_TAG)

    # ---- teardown -------------------------------------------------------------------------------------

    def abort(self) -> None:
        """Release every wait on this generation's data plane, in this process and at its peers."""
        self._aborted.set()
        if self.backend == "nccl":
            groups = [self.group, getattr(self.sequence, "group", None)]
            for group in [g for g in groups if g is not None]:
                try:
                    group.abort()
                except Exception:  # noqa: BLE001 - best effort: the group is being abandoned anyway
                    logger.exception("NCCL abort failed")
            return
        for fd, inode in self.sockets:
            _shutdown_socket(fd, inode)

    def close(self, timeout: float = 5.0) -> bool:
        """Leave the group.  Returns False if a send could not be released (the caller restarts the process)."""
        released = True
        self.abort()  # a send the peer will never receive would hold the reaper; peers blocked on us are freed
        if self._reaper is not None:
            self._sends.put(None)
            self._reaper.join(timeout)
            released = not self._reaper.is_alive()
            self._reaper = None
        self._nccl_sends.clear()
        self.group = None
        self.sequence = LOCAL  # destroyed below with every other group
        if not dist.is_initialized():
            return released
        try:
            if self.backend == "nccl":
                # destroy can block on in-flight NCCL work; abort tears the communicators down at once.
                dist.group.WORLD.abort()
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - the group is being abandoned either way
            logger.exception("leaving the process group failed")
        return released


def _socket_fds() -> dict[int, int]:
    """fd -> socket inode of this process's open sockets."""
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if link.startswith("socket:["):
            out[int(name)] = int(link[8:-1])
    return out


def _port_pair(fd: int) -> tuple[int, int, bool] | None:
    """(local port, remote port, listening) of a TCP socket fd, or None for anything else."""
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        return None
    try:
        if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
            return None
        local = sock.getsockname()[1]
        if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            return local, 0, True
        return local, sock.getpeername()[1], False
    except OSError:
        return None
    finally:
        sock.close()


def _gloo_connections(before: dict[int, int], store, rank: int, world_size: int) -> list[tuple[int, int]]:
    """The gloo pair sockets that init_process_group opened.  Other threads (gRPC, metrics) may open sockets
    meanwhile, so a new socket counts only if one of its ends is a gloo listener of this generation: every
    rank publishes its listener's port, and every pair connects one rank's listener to another rank."""
    new = {fd: ino for fd, ino in _socket_fds().items() if before.get(fd) != ino}
    ports = {fd: _port_pair(fd) for fd in new}
    listening = [p[0] for p in ports.values() if p is not None and p[2]]
    store.set(f"stagecast/gloo-listeners/{rank}", ",".join(map(str, listening)))
    keys = [f"stagecast/gloo-listeners/{r}" for r in range(world_size)]
    store.wait(keys)
    gloo_ports = {int(p) for key in keys for p in store.get(key).decode().split(",") if p}
    return [
        (fd, new[fd])
        for fd, p in ports.items()
        if p is not None and not p[2] and (p[0] in gloo_ports or p[1] in gloo_ports)
    ]


def _shutdown_socket(fd: int, inode: int) -> None:
    """Shut a gloo connection down (both directions), if ``fd`` still is that socket.  gloo's loop then fails
    the pair as if the peer had died, which raises in every wait on it (the listener is left alone: gloo
    aborts the process if its accept fails)."""
    try:
        if os.readlink(f"/proc/self/fd/{fd}") != f"socket:[{inode}]":
            return
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        sock.close()
