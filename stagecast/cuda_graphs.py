"""CUDA graph capture, shared by the stages' transformer blocks and the gateway's text encoder.

Usage::

    capture = cuda_graph_capture(torch.device("cuda:0"))   # a GPU: torch.cuda.CUDAGraph, warmed up on a side stream
    capture = rerun_capture                                # a CPU stand-in: replay runs the function again
    capture = device_capture(device)                       # the first on a GPU, the second elsewhere
    replay = capture(fn)                                   # fn reads and writes only static buffers
    replay()

A ``Capture`` records ``fn`` (which must read its inputs from, and write its outputs to, tensors that outlive it) and
returns a callable that replays it.  On a CPU, ``rerun_capture`` runs ``fn`` again on the same buffers, so tests hold
everything but the capture itself: which buffers are static, what is copied in and out, and when a graph is reused.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Capture = Callable[[Callable[[], None]], Callable[[], None]]  # records fn, returns a replay callable


def rerun_capture(fn: Callable[[], None]) -> Callable[[], None]:
    """The CPU stand-in for a graph: replay runs ``fn`` again on the same static buffers."""
    fn()
    return fn


def device_capture(device: torch.device) -> Capture:
    """A CUDA graph capture on ``device`` (its own memory pool) where it is a GPU, else ``rerun_capture``."""
    return cuda_graph_capture(device) if device.type == "cuda" else rerun_capture


def cuda_graph_capture(device: torch.device, pool=None, warmup: int = 2) -> Capture:
    """Capture into ``torch.cuda.CUDAGraph`` s on ``device``, sharing one memory pool (warmed up on a side stream).

    Streams belong to the *current* device, which is per thread: a thread that never selected the slice's device
    would capture on another GPU's stream while the kernels run eagerly on their own, so every step here runs under
    ``torch.cuda.device(device)``.
    """
    pool = pool if pool is not None else torch.cuda.graph_pool_handle()

    def capture(fn: Callable[[], None]) -> Callable[[], None]:
        with torch.cuda.device(device):
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                for _ in range(warmup):
                    fn()
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # thread_local: the stage's gRPC threads may use the GPU (a new stream's text K/V) during a capture.
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                fn()

        def replay() -> None:
            with torch.cuda.device(device):
                graph.replay()

        return replay

    return capture
