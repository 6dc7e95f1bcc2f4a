"""What a service process holds, on demand: ``kill -USR2 <pid>`` prints one line to stdout::

    STAGECAST_RESOURCES rss_kb=181234 fds=41 threads=37 pool_threads=12 engine_threads=4 listening=2

after collecting garbage and handing freed heap back to the OS (``malloc_trim``), so that RSS is comparable
between two reports (leak measurements read it; operators may too).  ``pool_threads`` counts the gRPC servers'
worker threads (a pool that grows on demand up to its limit and is not a leak), and ``engine_threads`` gRPC core's
own (its EventEngine's work pool, OS threads named ``event_engine``, which likewise grows while callbacks back up,
as after a process stopped and resumed, and shrinks on gRPC's schedule).

Usage: ``diagnostics.install()`` once, from the main thread, in every service (the CLI does).  It also bounds
glibc's heap (``tune_malloc``): with its defaults, a process that frees tensors of a few MB from many short-lived
threads (the gateway decodes each stream's VAE in threads of its own) keeps hundreds of MB of freed memory in
per-thread arenas, because the mmap threshold rises to the largest size ever freed.  A fixed threshold and two
arenas keep RSS flat across thousands of streams; ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_ARENA_MAX`` in the
environment still win.  Likewise glibc caches up to 40 MB of dead threads' stacks, resident, so a process that
starts threads per stream drifts by MBs with the number of streams in flight; launchers and images start services
with ``GLIBC_TUNABLES=glibc.pthread.stack_cache_size=0`` (``STACK_CACHE_OFF``; it must be set before the
process starts).
"""

from __future__ import annotations

import ctypes
import gc
import os
import signal
import threading

PREFIX = "STAGECAST_RESOURCES"
STACK_CACHE_OFF = "glibc.pthread.stack_cache_size=0"
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8


def install() -> None:
    tune_malloc()
    if threading.current_thread() is threading.main_thread() and hasattr(signal, "SIGUSR2"):
        signal.signal(signal.SIGUSR2, _report)


def tune_malloc(mmap_threshold: int = 256 * 1024, arenas: int = 2) -> None:
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return  # not glibc
    if "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        libc.mallopt(_M_MMAP_THRESHOLD, mmap_threshold)
    if "MALLOC_ARENA_MAX" not in os.environ:
        libc.mallopt(_M_ARENA_MAX, arenas)


def _report(signum, frame) -> None:
    print(report_line(), flush=True)


def report_line() -> str:
    stats = resources()
    return " ".join([PREFIX, *(f"{key}={value}" for key, value in stats.items())])


def resources() -> dict[str, int]:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    rss_kb = 0
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                rss_kb = int(line.split()[1])
    fds = os.listdir("/proc/self/fd")
    pool = sum(1 for t in threading.enumerate() if t.name.startswith("ThreadPoolExecutor"))
    tasks = os.listdir("/proc/self/task")
    return {
        "rss_kb": rss_kb,
        "fds": len(fds),
        "threads": len(tasks),
        "pool_threads": pool,
        "engine_threads": sum(_thread_name(tid) == GRPC_ENGINE_THREAD for tid in tasks),
        "listening": _listening(fds),
    }


GRPC_ENGINE_THREAD = "event_engine"  # what gRPC core names its EventEngine's work-pool threads (comm)


def _thread_name(tid: str) -> str:
    try:
        with open(f"/proc/self/task/{tid}/comm") as comm:
            return comm.read().strip()
    except OSError:  # it ended meanwhile
        return ""


def _listening(fds: list[str]) -> int:
    """Listening TCP sockets among this process's fds."""
    inodes = set()
    for fd in fds:
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    count = 0
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(table) as rows:
                next(rows)
                for row in rows:
                    cols = row.split()
                    if cols[3] == "0A" and cols[9] in inodes:  # state LISTEN
                        count += 1
        except OSError:
            continue
    return count


def parse(line: str) -> dict[str, int]:
    return {k: int(v) for k, v in (kv.split("=", 1) for kv in line.split()[1:])}
