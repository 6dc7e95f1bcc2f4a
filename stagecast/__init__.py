"""stagecast: real-time streaming video generation with a Wan DiT cut into pipeline stages.

The client SDK is the ``stagecast-client`` distribution (``clients/python``, import package ``stagecast_client``),
re-exported here::

    import stagecast
    with stagecast.Client("localhost:50051") as client:
        client.generate(prompt="a red fox running through snow", seconds=2).write_mp4("clip.mp4")

``stagecast.AsyncClient`` is the asyncio twin; ``stagecast.StagecastError`` and its per-status subclasses
(``InvalidArgumentError``, ``ResourceExhaustedError``, ``UnavailableError``, ...) are what failed calls raise.
The SDK is imported lazily, so service processes that import ``stagecast.*`` modules do not pay for it.  Its modules
keep their server names as aliases (``stagecast.client`` is ``stagecast_client.client``, ``stagecast.v1`` is
``stagecast_client.v1``: one module each, so ``stream.proto`` is registered once).
"""

from __future__ import annotations

import importlib

from stagecast_client import SDK as _SDK

__all__ = sorted(_SDK)


def __getattr__(name: str):
    if name in _SDK:
        return getattr(importlib.import_module(_SDK[name]), name)
    raise AttributeError(f"module 'stagecast' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_SDK])
