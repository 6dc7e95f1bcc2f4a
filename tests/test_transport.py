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
