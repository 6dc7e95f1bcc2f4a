"""The coordinator's errors, each with the gRPC status its caller gets (``stagecast.grpc_util.StatusError``).

- ``AdmissionError``: a stream the coordinator will not open (``coordinator.admission``); ``limit`` names the check
  that refused it, for the refusal metric.
- ``StreamError``: a call about an open stream that cannot be done (NOT_FOUND, FAILED_PRECONDITION, ...:
  ``coordinator.streams``).
- ``StreamFailure``: not raised, a value: how a stream ended when it did not complete, put on its event queue.

The servicer (``coordinator.server``) answers either error with its code and message.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from stagecast.grpc_util import StatusError


class AdmissionError(StatusError):
    """A stream the coordinator will not open, with the status its caller gets; ``limit`` names the check that
    refused it (the coordinator's refusal metric)."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_after_s: float = 0.0, limit: str = ""):
        super().__init__(code, message, retry_after_s)
        self.limit = limit


class StreamError(StatusError):
    """A call about an open stream (stop, prompt, input, consumed) that the stream table refuses."""


@dataclass
class StreamFailure:
    """How a stream ended when it did not complete: the status its consumer gets."""

    code: grpc.StatusCode
    message: str
