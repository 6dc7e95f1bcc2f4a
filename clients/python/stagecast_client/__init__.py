"""stagecast_client: the Python client of a stagecast server (the SDK, its errors, frames and the public stubs),
without the server (no torch, diffusers or aiortc).

Usage::

    import stagecast_client
    with stagecast_client.Client("localhost:50051") as client:
        client.generate(prompt="a red fox running through snow", seconds=2).write_mp4("clip.mp4")

``stagecast_client.AsyncClient`` is the asyncio twin; ``stagecast_client.StagecastError`` and its per-status
subclasses (``InvalidArgumentError``, ``ResourceExhaustedError``, ``UnavailableError``, ...) are what failed calls
raise.  The public stubs are ``stagecast_client.v1`` (``stream_pb2``, ``stream_pb2_grpc``).  Install with
``pip install "./clients/python[media]"`` (``media``: PyAV and Pillow, for MP4 files and JPEG frames; ``cli``: tqdm,
for the ``stagecast-client`` command's progress bar).  Names are imported lazily: importing this package does not
load grpc (``stagecast_client.cli.quiet_grpc_core`` must run first).  The server's ``stagecast.Client`` is this one.
"""

from __future__ import annotations

import importlib

SDK: dict[str, str] = {
    "Client": "stagecast_client.client",
    "AsyncClient": "stagecast_client.client",
    "Generation": "stagecast_client.client",
    "Transform": "stagecast_client.client",
    "AsyncTransform": "stagecast_client.client",
    "AsyncGeneration": "stagecast_client.client",
    "Frame": "stagecast_client.frames",
    "FrameTiming": "stagecast_client.frames",
    "StreamInfo": "stagecast_client.frames",
    "EndInfo": "stagecast_client.frames",
    "save_mp4": "stagecast_client.frames",
}
ERRORS = [
    "StagecastError",
    "CancelledError",
    "UnknownError",
    "InvalidArgumentError",
    "DeadlineExceededError",
    "NotFoundError",
    "AlreadyExistsError",
    "PermissionDeniedError",
    "ResourceExhaustedError",
    "FailedPreconditionError",
    "AbortedError",
    "OutOfRangeError",
    "UnimplementedError",
    "InternalError",
    "UnavailableError",
    "DataLossError",
    "UnauthenticatedError",
]
SDK.update({name: "stagecast_client.errors" for name in ERRORS})

__all__ = sorted(SDK)


def __getattr__(name: str):
    if name in SDK:
        return getattr(importlib.import_module(SDK[name]), name)
    raise AttributeError(f"module 'stagecast_client' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *SDK])
