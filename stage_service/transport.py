"""The stage data plane: torch.distributed point-to-point between neighbouring stages.

Usage::

    tp = PipeTransport.join(rank=r, world_size=n, store_host=h, store_port=p, generation=g, backend="gloo")
    tp.send_hidden(hs)                    # rank r -> r+1, asynchronous; the tensor is kept alive until sent
    hs = tp.recv_hidden(shape, dtype)     # rank r <- r-1
    tp.send_latent(x)                     # last -> first (the next level's input)
    x = tp.recv_latent(shape)             # first <- last
    tp.abort()                            # from any thread: pending waits raise TransportAborted
    tp.close()

Only hidden states (B, L, D) and small latents cross.  Both ends derive every shape from the plan, so
no per-message handshake is needed.  The process group lives in a ``PrefixStore`` named after the
generation, on a TCPStore the coordinator hosts: a new generation after a failure never sees the old
one's keys.  A receive blocked on a peer that died raises at once (the connection closes).  One blocked on a live
peer is released when that peer leaves the group, which every stage does on ``Reset``.  On NCCL, sends
and receives are enqueued on the GPU and ordered per peer pair; the host does not block.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

HIDDEN_TAG = 1
LATENT_TAG = 2


class TransportAborted(RuntimeError):
    pass


class PipeTransport:
    def __init__(self, group: dist.ProcessGroup, rank: int, world_size: int, device: torch.device, backend: str):
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.backend = backend
        self._pending: list[tuple[dist.Work, torch.Tensor]] = []
        self._aborted = threading.Event()
        self.wait_seconds = 0.0  # time spent blocked in receives, for bubble accounting

    @classmethod
    def join(
        cls,
        *,
        rank: int,
        world_size: int,
        store_host: str,
        store_port: int,
        generation: int,
        backend: str,
        device: torch.device | str = "cpu",
        timeout_s: float = 300.0,
    ) -> PipeTransport:
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore(store_host, store_port, world_size, is_master=False, timeout=timeout)
        prefixed = dist.PrefixStore(f"stagecast/gen{generation}", store)
        device = torch.device(device)
        if backend == "nccl":
            torch.cuda.set_device(device)
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group(backend, store=prefixed, rank=rank, world_size=world_size, timeout=timeout)
        group = dist.group.WORLD
        tp = cls(group, rank, world_size, device, backend)
        tp._warmup()
        logger.info("joined generation %d as rank %d/%d over %s", generation, rank, world_size, backend)
        return tp

    def _warmup(self) -> None:
        # Create every communicator now, not on the first real chunk.
        if self.world_size == 1:
            return
        probe = torch.zeros(1, device=self.device)
        nxt, prev = (self.rank + 1) % self.world_size, (self.rank - 1) % self.world_size
        ops = [dist.P2POp(dist.isend, probe, nxt), dist.P2POp(dist.irecv, torch.zeros_like(probe), prev)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()

    # ---- sends ----------------------------------------------------------------------------------------

    def _isend(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        tensor = tensor.contiguous()
        work = dist.isend(tensor, dst=dst, tag=tag)
        self._pending.append((work, tensor))
        self._reap()

    def _reap(self) -> None:
        self._pending = [(w, t) for w, t in self._pending if not w.is_completed()]

    def send_hidden(self, hidden: torch.Tensor) -> None:
        self._isend(hidden, self.rank + 1, HIDDEN_TAG)

    def send_latent(self, latent: torch.Tensor) -> None:
        self._isend(latent.to(self.device, torch.float32), 0, LATENT_TAG)

    # ---- receives -------------------------------------------------------------------------------------

    def _wait(self, work: dist.Work) -> None:
        if self._aborted.is_set():
            raise TransportAborted("data plane aborted")
        start = time.perf_counter()
        # gloo cannot interrupt a blocking receive (a timed-out wait even breaks the pair), so a stage
        # blocked on a live peer is freed by that peer leaving the group, which closes the connection.
        # On NCCL this enqueues a stream dependency and returns at once.
        work.wait()
        self.wait_seconds += time.perf_counter() - start

    def _recv(self, shape, dtype, src: int, tag: int) -> torch.Tensor:
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        self._wait(dist.irecv(buf, src=src, tag=tag))
        return buf

    def recv_hidden(self, shape, dtype) -> torch.Tensor:
        return self._recv(shape, dtype, self.rank - 1, HIDDEN_TAG)

    def recv_latent(self, shape) -> torch.Tensor:
        return self._recv(shape, torch.float32, self.world_size - 1, LATENT_TAG)

    # ---- teardown -------------------------------------------------------------------------------------

    def flush(self) -> None:
        """Wait for every outstanding send (used before leaving a generation cleanly)."""
        for work, _ in self._pending:
            self._wait(work)
        self._pending.clear()

    def abort(self) -> None:
        self._aborted.set()
        if self.backend == "nccl":
            try:
                self.group.abort()
            except Exception:  # noqa: BLE001 - best effort: the group is being abandoned anyway
                logger.exception("NCCL abort failed")

    def close(self) -> None:
        self._pending.clear()
        if not dist.is_initialized():
            return
        try:
            if self.backend == "nccl":
                # destroy can block on in-flight NCCL work; abort tears the communicators down at once.
                self.group.abort()
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - the group is being abandoned either way
            logger.exception("leaving the process group failed")
