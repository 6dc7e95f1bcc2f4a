"""A stage executor's ``prepare`` (the graph pre-capture): it runs first, on the executor's own thread, while the
events submitted meanwhile wait, so the Form RPC returns at once (the stage's lock is not held through it); and it
learns when the executor is stopped (the stage leaves its generation), so leaving never waits for it to finish."""

from __future__ import annotations

import queue
import threading

import pytest

from stage_service.dit_slice import DiTSlice
from stage_service.executor import StageExecutor
from stage_service.runner import SliceRunner
from stagecast.microstep import MicroStep, PlanEvent
from tests.engine_helpers import TEXT, small_spec

pytestmark = pytest.mark.unit


def whole_slice(tiny_model) -> DiTSlice:
    model = tiny_model()
    return DiTSlice.from_model(model, layers=range(model.config.num_layers), first=True, last=True)


def test_prepare_runs_first_on_the_executors_thread_and_events_wait_for_it(tiny_model):
    events: queue.Queue = queue.Queue()
    entered, released = threading.Event(), threading.Event()
    seen: dict = {}

    def prepare(stopping) -> None:
        seen["thread"] = threading.current_thread().name
        entered.set()
        assert released.wait(30)
        seen["queued"] = ex.queue.qsize()  # what was submitted meanwhile is still waiting
        seen["streams"] = list(ex.runner.streams)

    ex = StageExecutor(SliceRunner(whole_slice(tiny_model)), None, events.put, prepare=prepare)
    ex.start()
    try:
        assert entered.wait(30)
        ex.submit(PlanEvent("open", seq=1, spec=small_spec(stream_id=1, timesteps=(1000.0,)), text=TEXT))
        ex.submit(PlanEvent("batch", seq=2, steps=(MicroStep(1, 0, 0),)))
        released.set()
        kinds = []
        while "done" not in kinds:
            ev = events.get(timeout=30)
            assert ev.kind != "error", ev.message
            kinds.append(ev.kind)
        assert seen == {"thread": "stage-executor", "queued": 2, "streams": []}
        assert kinds == ["chunk", "done"]  # then the events ran, in order
    finally:
        released.set()
        ex.stop()
    assert not ex.alive


def test_prepare_sees_the_executor_stop_and_the_executor_ends_after_it(tiny_model):
    entered, released = threading.Event(), threading.Event()
    seen: dict = {}

    def prepare(stopping) -> None:
        seen["before"] = stopping()
        entered.set()
        assert released.wait(30)
        seen["after"] = stopping()

    ex = StageExecutor(SliceRunner(whole_slice(tiny_model)), None, lambda ev: None, prepare=prepare)
    ex.start()
    assert entered.wait(30)
    ex.stop(timeout=0.0)  # the stage leaves: prepare is told through stopping()
    released.set()
    ex.stop(timeout=30)
    assert not ex.alive and seen == {"before": False, "after": True}


def test_a_failing_prepare_is_logged_and_the_executor_still_serves(tiny_model, caplog):
    events: queue.Queue = queue.Queue()

    def prepare(stopping) -> None:
        raise RuntimeError("out of memory")

    ex = StageExecutor(SliceRunner(whole_slice(tiny_model)), None, events.put, prepare=prepare)
    ex.start()
    try:
        ex.submit(PlanEvent("open", seq=1, spec=small_spec(stream_id=1, timesteps=(1000.0,)), text=TEXT))
        ex.submit(PlanEvent("batch", seq=2, steps=(MicroStep(1, 0, 0),)))
        kinds = [events.get(timeout=30).kind, events.get(timeout=30).kind]
        assert kinds == ["chunk", "done"]
        assert "preparing failed" in caplog.text
    finally:
        ex.stop()
