"""A refusal's retry hint (google.rpc.RetryInfo in the status details) never says more than MAX_RETRY_AFTER_S (60 s),
whatever the coordinator computed (a one-hour stream's end), and reaches the client as ``retry_after``."""

from __future__ import annotations

import grpc
import pytest

from stagecast.grpc_util import MAX_RETRY_AFTER_S, abort_with_retry, retry_after_of

pytestmark = pytest.mark.unit


class Aborted(Exception):
    pass


class Context:
    """What a servicer context does with an abort: the trailers set, then the abort raised (as gRPC's does)."""

    def __init__(self):
        self.trailers = ()

    def set_trailing_metadata(self, trailers):
        self.trailers = tuple(trailers)

    def abort(self, code, message):
        raise Aborted(code, message)

    def trailing_metadata(self):  # read back as a client's call error reads it
        return self.trailers


@pytest.mark.parametrize("asked, told", [(3600.2, 60.0), (61.0, 60.0), (12.5, 12.5), (0.4, 0.4)])
def test_a_retry_hint_is_capped_at_60_s(asked, told):
    context = Context()
    with pytest.raises(Aborted):
        abort_with_retry(context, grpc.StatusCode.RESOURCE_EXHAUSTED, "capacity", asked)
    assert MAX_RETRY_AFTER_S == 60.0
    assert retry_after_of(context) == pytest.approx(told, abs=1e-6)


def test_no_hint_without_a_delay():
    context = Context()
    with pytest.raises(Aborted):
        abort_with_retry(context, grpc.StatusCode.RESOURCE_EXHAUSTED, "quota", 0.0)
    assert retry_after_of(context) is None
