"""One home for the names every floor shares: gRPC service names (health, routing, spans) and dtype names.

Usage::

    from stagecast.names import COORDINATOR_SERVICE, DTYPES
    wait_healthy(address, 60, service=COORDINATOR_SERVICE)
    torch_dtype = DTYPES["bfloat16"]
"""

from __future__ import annotations

from stagecast.internal.v1 import pipeline_pb2, rendezvous_pb2, vae_pb2
from stagecast.v1 import stream_pb2

# Read from the compiled protos, so a renamed service cannot leave a stale string behind.
COORDINATOR_SERVICE = pipeline_pb2.DESCRIPTOR.services_by_name["CoordinatorService"].full_name
STAGE_SERVICE = pipeline_pb2.DESCRIPTOR.services_by_name["StageService"].full_name
VAE_STAGE_SERVICE = vae_pb2.DESCRIPTOR.services_by_name["VAEStageService"].full_name
RENDEZVOUS_SERVICE = rendezvous_pb2.DESCRIPTOR.services_by_name["RendezvousService"].full_name
STREAM_SERVICE = stream_pb2.DESCRIPTOR.services_by_name["StreamService"].full_name

# The dtypes weights and activations may have (``--dtype``, ``--vae-dtype``), by their flag names.  ``DTYPES``
# maps them to torch dtypes; it is built on first use, so command-line parsers need no torch import.
DTYPE_NAMES = ("float32", "bfloat16", "float16")


def __getattr__(name: str):
    if name == "DTYPES":
        import torch

        return {n: getattr(torch, n) for n in DTYPE_NAMES}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
