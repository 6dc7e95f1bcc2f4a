"""The exceptions the client SDK raises: one class per gRPC status code, all subclasses of ``StagecastError``.

Usage::

    try:
        for frame in client.generate(prompt="...", width=50): ...
    except stagecast_client.InvalidArgumentError as exc:
        print(exc.code, exc.details)      # StatusCode.INVALID_ARGUMENT, "width: must be a positive multiple of 16 ..."
    except stagecast_client.StagecastError:      # anything else the server or the transport said
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


# What gRPC says when the connection's security does not match the gateway's, and what to do about it.
_CONNECTION_HINTS = (
    (
        "Hostname Verification Check failed",
        "the gateway's certificate does not name the address dialled: dial a name it holds, or pass --tls-name "
        "NAME (SDK: tls_name=) with one (the chart: add the address to gateway.tls.extraNames)",
    ),
    (
        "WRONG_VERSION_NUMBER",
        "the gateway does not speak TLS: drop --tls / --tls-ca (SDK: tls, root_certificates)",
    ),
    (
        "CERTIFICATE_VERIFY_FAILED",
        "the gateway's certificate is not signed by the CA given: pass the gateway's CA with --tls-ca "
        "(SDK: root_certificates=)",
    ),
    (
        "Socket closed",
        "the gateway closed the connection while it was being set up; a gateway that speaks TLS does that to a "
        "plaintext client: pass --tls-ca or --tls (SDK: root_certificates= or tls=True)",
    ),
)


def connection_hint(details: str) -> str | None:
    """A plain explanation for a connection that failed on TLS (or its absence), else None."""
    if "failed to connect" not in details and "handshake" not in details.lower():
        return None
    return next((hint for marker, hint in _CONNECTION_HINTS if marker in details), None)


STATUS_DETAILS_KEY = "grpc-status-details-bin"  # gRPC's trailing metadata key for a google.rpc.Status


def _status_details(exc):
    """The google.rpc.Status in a failed call's trailing metadata, or None without one (or a malformed one)."""
    try:
        trailing = exc.trailing_metadata() or ()
    except Exception:  # noqa: BLE001 - not a call error, or one without metadata
        return None
    for key, value in trailing:
        if key == STATUS_DETAILS_KEY:
            from google.rpc import status_pb2

            status = status_pb2.Status()
            try:
                status.ParseFromString(value)
            except Exception:  # noqa: BLE001 - malformed details
                return None
            return status
    return None


def status_of(exc) -> tuple[grpc.StatusCode, str] | None:
    """The code and message of a failed call's status details (the server's ``abort_with_retry``), or None."""
    status = _status_details(exc)
    if status is None:
        return None
    code = next((c for c in grpc.StatusCode if c.value[0] == status.code), None)
    return (code, status.message) if code is not None else None


def retry_after_of(exc) -> float | None:
    """The RetryInfo delay in a failed call's status details (seconds), or None when it has none."""
    status = _status_details(exc)
    if status is None:
        return None
    from google.rpc import error_details_pb2

    for detail in status.details:
        info = error_details_pb2.RetryInfo()
        if detail.Unpack(info):
            return float(info.retry_delay.seconds + info.retry_delay.nanos / 1e9)
    return None


def from_rpc_error(exc: grpc.RpcError) -> StagecastError:
    """The SDK exception for a failed call (works for sync and ``grpc.aio`` errors).  A connection that failed on
    TLS says so, and what to pass, before gRPC's own text."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = (exc.details() if hasattr(exc, "details") else None) or str(exc)
    if code == grpc.StatusCode.UNAVAILABLE and (hint := connection_hint(details)):
        details = f"{hint} ({details})"
    if code == grpc.StatusCode.CANCELLED and (answered := status_of(exc)) is not None:
        code, details = answered  # a proxy (a fleet's HAProxy door) reset the stream after the gateway's answer

    return _BY_CODE.get(code, StagecastError)(details, code, retry_after_of(exc))


__all__ = [
    "StagecastError",
    "connection_hint",
    "from_rpc_error",
    "retry_after_of",
    "status_of",
    *(cls.__name__ for cls in _BY_CODE.values()),
]
