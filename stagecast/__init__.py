"""stagecast: real-time streaming video generation with a Wan DiT cut into pipeline stages.

The client SDK is exported here::

    import stagecast
    with stagecast.Client("localhost:50051") as client:
        client.generate(prompt="a red fox running through snow", seconds=2).write_mp4("clip.mp4")

``stagecast.AsyncClient`` is the asyncio twin; ``stagecast.StagecastError`` and its per-status subclasses
(``InvalidArgumentError``, ``ResourceExhaustedError``, ``UnavailableError``, ...) are what failed calls raise.
The SDK is imported lazily, so service processes that import ``stagecast.*`` modules do not pay for it.
"""

from __future__ import annotations

import importlib

_SDK = {
    "Client": "stagecast.client",
    "AsyncClient": "stagecast.client",
    "Generation": "stagecast.client",
    "Transform": "stagecast.client",
    "AsyncTransform": "stagecast.client",
    "AsyncGeneration": "stagecast.client",
    "Frame": "stagecast.frames",
    "FrameTiming": "stagecast.frames",
    "StreamInfo": "stagecast.frames",
    "EndInfo": "stagecast.frames",
    "save_mp4": "stagecast.frames",
}
_ERRORS = [
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
_SDK.update({name: "stagecast.errors" for name in _ERRORS})

__all__ = sorted(_SDK)


def __getattr__(name: str):
    if name in _SDK:
        return getattr(importlib.import_module(_SDK[name]), name)
    raise AttributeError(f"module 'stagecast' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_SDK])
