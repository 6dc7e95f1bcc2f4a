"""The gateway's acknowledgements of consumed chunks (``PipelineCall.acknowledge``): the coordinator bounds a stream's
lead by what it has seen consumed, so the latest acknowledgement must reach it.  A fake coordinator stub answers each
``Consumed`` with a chosen status, when the test says."""

import grpc
import pytest

from gateway.stream.pipeline import ACK_RETRIES, PipelineCall

pytestmark = pytest.mark.unit


class FakeError(grpc.RpcError):
    def __init__(self, code):
        self._code = code

    def code(self):
        return self._code


class FakeFuture:
    def __init__(self):
        self.error = None
        self.callbacks = []
        self.done = False

    def finish(self, code=None):
        self.error, self.done = (None if code is None else FakeError(code)), True
        for cb in self.callbacks:
            cb(self)

    def exception(self):
        return self.error

    def add_done_callback(self, cb):
        if self.done:
            cb(self)
        else:
            self.callbacks.append(cb)


class FakeConsumed:
    """Records each call; ``answers`` (a list of status codes, None: OK) answers calls at once, in order."""

    def __init__(self, answers=None):
        self.calls, self.futures, self.answers = [], [], list(answers or [])

    def future(self, request, timeout=None, wait_for_ready=None):
        self.calls.append((request.chunks, wait_for_ready))
        fut = FakeFuture()
        self.futures.append(fut)
        if self.answers:
            fut.finish(self.answers.pop(0))
        return fut


def call_with(consumed):
    stub = type("Stub", (), {"Consumed": consumed})()
    call = PipelineCall(stub, "coordinator", trace=None)
    call.pipeline_id = 7
    return call


def test_a_failed_latest_acknowledgement_is_sent_again_until_it_lands():
    consumed = FakeConsumed([grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE, None])
    call_with(consumed).acknowledge(5)
    # The first try as usual, then twice more, waiting for the channel to be ready; the third landed.
    assert consumed.calls == [(5, False), (5, True), (5, True)]


def test_retries_are_bounded():
    consumed = FakeConsumed([grpc.StatusCode.UNAVAILABLE] * 10)
    call_with(consumed).acknowledge(3)
    assert consumed.calls == [(3, False)] + [(3, True)] * ACK_RETRIES


@pytest.mark.parametrize(
    "code", [grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.CANCELLED]
)
def test_an_acknowledgement_refused_for_good_or_cancelled_is_not_sent_again(code):
    consumed = FakeConsumed([code])
    call_with(consumed).acknowledge(2)
    assert consumed.calls == [(2, False)]


def test_a_superseded_acknowledgement_is_not_sent_again():
    consumed = FakeConsumed()
    call = call_with(consumed)
    call.acknowledge(1)
    call.acknowledge(2)  # cumulative: it covers chunk 1 too
    consumed.futures[0].finish(grpc.StatusCode.DEADLINE_EXCEEDED)
    assert consumed.calls == [(1, False), (2, False)]
    consumed.futures[1].finish(grpc.StatusCode.DEADLINE_EXCEEDED)  # the latest: sent again
    assert consumed.calls == [(1, False), (2, False), (2, True)]


def test_no_acknowledgement_is_sent_again_once_the_stream_ended():
    consumed = FakeConsumed()
    call = call_with(consumed)
    call.acknowledge(4)
    call._ended = True  # what events() records when the coordinator ends the stream
    consumed.futures[0].finish(grpc.StatusCode.UNAVAILABLE)
    assert consumed.calls == [(4, False)]
