"""The gloo data plane: sends are reaped once delivered, abort releases waits on a live peer, and leaving a
generation gives back its sockets, fds and threads.  Two real processes on loopback."""

from __future__ import annotations

import datetime
import multiprocessing as mp
import threading
import time

import pytest
import torch
import torch.distributed as dist

from stage_service.parallel_state import SequenceGroup
from stagecast import diagnostics


def _peer(rank: int, port: int, scenario: str, out) -> None:
    from stage_service.transport import PipeTransport

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))
    try:
        held = []
        for generation in (1, 2):  # the first generation builds what a process builds once (thread pools)
            tp = PipeTransport.join(rank=rank, world_size=2, store=store, generation=generation, backend="gloo")
            if scenario == "reap":
                if rank == 0:
                    for _ in range(50):
                        tp.send_hidden(torch.ones(64, 1024))
                    deadline = time.monotonic() + 30
                    while tp.pending_sends and time.monotonic() < deadline:
                        time.sleep(0.01)
                    out.put(("pending", tp.pending_sends))
                else:
                    for _ in range(50):
                        tp.recv_hidden((64, 1024), torch.float32)
            elif rank == 0:  # "abort": a receive blocked on a live peer that never sends
                failure: list[str] = []
                waiter = threading.Thread(target=_expect_failure, args=(tp, failure), daemon=True)
                waiter.start()
                time.sleep(0.5)  # let it block (nothing observable to wait on inside gloo)
                start = time.monotonic()
                tp.abort()
                waiter.join(10)
                out.put(("released", not waiter.is_alive(), time.monotonic() - start, failure))
                del waiter
            store.set(f"done{generation}/{rank}", "1")
            store.wait([f"done{generation}/0", f"done{generation}/1"])
            tp.close()
            del tp
            stats = diagnostics.resources()
            held.append({k: stats[k] for k in ("fds", "threads", "listening")})
        out.put(("counts", rank, held[0], held[1]))
    except Exception as exc:  # noqa: BLE001 - reported to the test
        out.put(("error", rank, repr(exc)))


def _expect_failure(tp, failure: list) -> None:
    try:
        tp._recv((4,), torch.float32, 1, 1)
    except RuntimeError as exc:
        failure.append(str(exc)[:80])


def _run(scenario: str) -> list:
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=60)
    )
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_peer, args=(r, store.port, scenario, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = []
        while len([r for r in results if r[0] in ("counts", "error")]) < 2:
            results.append(out.get(timeout=120))
        return results
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()


@pytest.mark.multiprocess
@pytest.mark.parametrize("scenario", ["reap", "abort"])
def test_gloo_transport_reaps_sends_releases_waits_and_leaves_nothing(scenario):
    results = _run(scenario)
    errors = [r for r in results if r[0] == "error"]
    assert not errors, errors
    if scenario == "reap":
        assert results.count(("pending", 0)) == 2  # every delivered send and its tensor were dropped
    else:
        for released in (r for r in results if r[0] == "released"):
            assert released[1], "abort did not release a receive blocked on a live peer"
            assert released[2] < 2.0 and released[3], released
    for _, rank, first, second in (r for r in results if r[0] == "counts"):
        assert second == first, f"rank {rank}: after generation 1 {first}, after generation 2 {second}"


class _SeqShape(SequenceGroup):
    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size


@pytest.mark.unit
@pytest.mark.parametrize("stages,sp,cfg", [(1, 1, 2), (2, 1, 1), (3, 1, 1), (4, 1, 2), (2, 2, 1), (3, 2, 1), (1, 2, 1)])
def test_the_join_warmup_pairs_are_exactly_the_pairs_serving_uses(stages, sp, cfg):
    # Every pair the warm-up connects is one a chunk crosses, and every pair a chunk crosses is warmed up: a pair
    # first met while serving would create its NCCL communicator (a store round trip) on the stream's first chunk.
    from stage_service.transport import PipeTransport

    world = stages * sp * cfg
    used, warmed = set(), set()
    for rank in range(world):
        group_size = world // cfg
        tp = PipeTransport(None, rank, world, torch.device("cpu"), "nccl", _SeqShape(rank % group_size % sp, sp), cfg)
        talks: list[int] = []
        tp._isend = lambda tensor, dst, tag, talks=talks: talks.append(dst)
        tp._recv = lambda shape, dtype, src, tag, talks=talks: talks.append(src) or torch.zeros(shape, dtype=dtype)
        stage = (rank % group_size) // sp
        if stage < stages - 1:
            tp.send_hidden(torch.zeros(1))
        if stage > 0:
            tp.recv_hidden((1,), torch.float32)
        if stage == stages - 1 and stages > 1:
            tp.send_latent(torch.zeros(1))
        if stage == 0 and stages > 1:
            tp.recv_latent((1,))
        if cfg > 1 and tp.last_in_pipe:
            tp.exchange_guidance(torch.zeros(1))
        used |= {(min(rank, p), max(rank, p)) for p in talks if p != rank}
        pairs = tp.peer_pairs()
        assert pairs == sorted(pairs) and len(set(pairs)) == len(pairs)
        warmed |= set(pairs)
    assert warmed == used


class _PythonStore(dist.Store):
    """A store implemented in Python, as the rendezvous's ``GrpcStore`` is."""

    def __init__(self, inner: dist.Store):
        super().__init__()
        self.inner = inner

    def set(self, key, value):
        self.inner.set(key, value)

    def get(self, key):
        return self.inner.get(key)

    def add(self, key, amount):
        return self.inner.add(key, amount)

    def compare_set(self, key, expected, desired):
        return self.inner.compare_set(key, expected, desired)

    def wait(self, keys, timeout=None):
        self.inner.wait(keys) if timeout is None else self.inner.wait(keys, timeout)

    def check(self, keys):
        return self.inner.check(keys)

    def set_timeout(self, timeout):
        self.inner.set_timeout(timeout)

    def num_keys(self):
        return self.inner.num_keys()

    def delete_key(self, key):
        return self.inner.delete_key(key)


@pytest.mark.multiprocess
def test_a_python_store_outlives_join_for_as_long_as_the_group():
    # NCCL reads the store again whenever it creates a communicator after join (a new peer pair, a sub-group).
    # torch's PrefixStore keeps only the C++ half of a Python store alive; once the Python object is collected,
    # such a read fails with "fn INTERNAL ASSERT FAILED ... Not implemented".  The transport holds it.
    import gc
    import weakref

    from stage_service.transport import PipeTransport

    store = _PythonStore(dist.HashStore())
    alive = weakref.ref(store)
    tp = PipeTransport.join(rank=0, world_size=1, store=store, generation=1, backend="gloo")
    try:
        del store
        gc.collect()
        assert alive() is not None
        tp.stores[-1].set("after-join", b"1")  # the prefixed store still reaches the Python store
        assert alive().get("stagecast/gen1/after-join") == b"1"
    finally:
        tp.close()
    del tp
    gc.collect()
    assert alive() is None  # and nothing keeps it once the generation is left
