"""The exceptions the client SDK raises: one class per gRPC status code, all subclasses of ``StagecastError``.

Usage::

    try:
        for frame in client.generate(prompt="...", width=50): ...
    except stagecast.InvalidArgumentError as exc:
        print(exc.code, exc.details)      # StatusCode.INVALID_ARGUMENT, "width: must be a positive multiple of 16 ..."
    except stagecast.StagecastError:      # anything else the server or the transport said
        ...
"""

from __future__ import annotations

import grpc


class StagecastError(Exception):
    """A call to a stagecast gateway ended with a non-OK status."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, details: str, code: grpc.StatusCode | None = None, retry_after: float | None = None):
        super().__init__(details)
        self.details = details
        if code is not None:
            self.code = code
        # Seconds after which a retry may succeed (google.rpc.RetryInfo in the status details), e.g. when the
        # pipeline cannot hold another stream in real time now; None: the server gave no hint.
        self.retry_after = retry_after

    def __str__(self) -> str:
        return f"{self.code.name}: {self.details}"


class CancelledError(StagecastError):
    code = grpc.StatusCode.CANCELLED


class UnknownError(StagecastError):
    code = grpc.StatusCode.UNKNOWN


class InvalidArgumentError(StagecastError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class DeadlineExceededError(StagecastError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class NotFoundError(StagecastError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExistsError(StagecastError):
    code = grpc.StatusCode.ALREADY_EXISTS


class PermissionDeniedError(StagecastError):
    code = grpc.StatusCode.PERMISSION_DENIED


class ResourceExhaustedError(StagecastError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class FailedPreconditionError(StagecastError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class AbortedError(StagecastError):
    code = grpc.StatusCode.ABORTED


class OutOfRangeError(StagecastError):
    code = grpc.StatusCode.OUT_OF_RANGE


class UnimplementedError(StagecastError):
    code = grpc.StatusCode.UNIMPLEMENTED


class InternalError(StagecastError):
    code = grpc.StatusCode.INTERNAL


class UnavailableError(StagecastError):
    code = grpc.StatusCode.UNAVAILABLE


class DataLossError(StagecastError):
    code = grpc.StatusCode.DATA_LOSS


class UnauthenticatedError(StagecastError):
    code = grpc.StatusCode.UNAUTHENTICATED


_BY_CODE: dict[grpc.StatusCode, type[StagecastError]] = {
    cls.code: cls
    for cls in (
        CancelledError,
        UnknownError,
        InvalidArgumentError,
        DeadlineExceededError,
        NotFoundError,
        AlreadyExistsError,
        PermissionDeniedError,
        ResourceExhaustedError,
        FailedPreconditionError,
        AbortedError,
        OutOfRangeError,
        UnimplementedError,
        InternalError,
        UnavailableError,
        DataLossError,
        UnauthenticatedError,
    )
}


def from_rpc_error(exc: grpc.RpcError) -> StagecastError:
    """The SDK exception for a failed call (works for sync and ``grpc.aio`` errors)."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = (exc.details() if hasattr(exc, "details") else None) or str(exc)
    from stagecast.grpc_util import retry_after_of

    return _BY_CODE.get(code, StagecastError)(details, code, retry_after_of(exc))


__all__ = ["StagecastError", "from_rpc_error", *(cls.__name__ for cls in _BY_CODE.values())]
