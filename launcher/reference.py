"""The single-process reference executor: the oracle the distributed system must reproduce bit for bit.

Usage::

    ref = ReferenceExecutor(DiTSlice.from_model(model, layers=range(n), first=True, last=True))
    out = ref.generate([StreamRequest(spec, text, arrival_tick=0)], num_stages=2, max_batch=4)
    out.chunks[stream_id]            # list of clean latent chunks, in chunk order
    out.plan                         # the exact batches run, replayable with ref.replay(...)

It runs the same ``StreamBatchScheduler`` and the same ``SliceRunner`` a stage uses, over one slice that
holds the whole model.  ``replay`` executes a recorded plan (a list of events) so a distributed run whose
batches depended on arrival timing can still be compared exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from coordinator.scheduler import StreamBatchScheduler
from stage_service.dit_slice import DiTSlice
from stage_service.runner import SliceRunner, StepResult
from stagecast.microstep import MicroStep, PlanEvent, StreamSpec


@dataclass
class StreamRequest:
    spec: StreamSpec
    text: torch.Tensor  # (1, text_len, text_dim)
    arrival_tick: int = 0
    stop_tick: int | None = None  # for unbounded streams: the tick a stop arrives


@dataclass
class GenerationResult:
    chunks: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    plan: list[PlanEvent] = field(default_factory=list)


Trace = Callable[[list[MicroStep], torch.Tensor, list[StepResult]], None]


class ReferenceExecutor:
    def __init__(self, full_slice: DiTSlice, trace: Trace | None = None):
        if not (full_slice.first and full_slice.last):
            raise ValueError("the reference executor needs a slice that holds the whole model")
        self.runner = SliceRunner(full_slice)
        self.trace = trace

    def run_batch(self, steps: list[MicroStep]) -> list[StepResult]:
        flow = self.runner.forward(steps)
        results = self.runner.finish(steps, flow)
        if self.trace is not None:
            self.trace(steps, flow, results)
        return results

    def replay(
        self,
        plan: list[PlanEvent],
        texts: dict[int, torch.Tensor],
        prompt_texts: dict[tuple[int, int], torch.Tensor] | None = None,
    ) -> dict[int, list[torch.Tensor]]:
        """Run a recorded plan.  ``texts[stream]`` is each stream's first prompt; ``prompt_texts[(stream,
        from_chunk)]`` the text of each prompt update event."""
        chunks: dict[int, list[torch.Tensor]] = {}
        for ev in plan:
            if ev.kind == "open":
                assert ev.spec is not None
                self.runner.open_stream(ev.spec, texts[ev.spec.stream_id])
                chunks[ev.spec.stream_id] = []
            elif ev.kind == "prompt":
                assert ev.stream_id is not None and prompt_texts is not None
                self.runner.set_prompt(ev.stream_id, ev.from_chunk, prompt_texts[(ev.stream_id, ev.from_chunk)])
            elif ev.kind == "close":
                assert ev.stream_id is not None
                self.runner.close_stream(ev.stream_id)
            else:
                for res in self.run_batch(list(ev.steps)):
                    if res.finished is not None:
                        chunks[res.step.stream].append(res.finished)
        return chunks

    def generate(self, requests: list[StreamRequest], *, num_stages: int = 1, max_batch: int = 4) -> GenerationResult:
        """Schedule and run ``requests`` exactly as a ``num_stages`` pipeline would order them."""
        plan = build_plan(requests, num_stages=num_stages, max_batch=max_batch)
        texts = {r.spec.stream_id: r.text for r in requests}
        return GenerationResult(chunks=self.replay(plan, texts), plan=plan)


def build_plan(requests: list[StreamRequest], *, num_stages: int, max_batch: int) -> list[PlanEvent]:
    """Run the scheduler over logical arrival and stop ticks and record the resulting event list."""
    sched = StreamBatchScheduler(num_stages=num_stages, max_batch=max_batch)
    pending = sorted(requests, key=lambda r: r.arrival_tick)
    for r in requests:
        if r.spec.num_chunks is None and r.stop_tick is None:
            raise ValueError(f"stream {r.spec.stream_id} is unbounded and has no stop tick")
    plan: list[PlanEvent] = []
    open_ids: set[int] = set()
    while pending or sched.active:
        while pending and pending[0].arrival_tick <= sched.now:
            req = pending.pop(0)
            sched.add_stream(req.spec)
            plan.append(PlanEvent("open", spec=req.spec))
            open_ids.add(req.spec.stream_id)
        for r in requests:
            if r.stop_tick == sched.now and r.spec.stream_id in sched.streams:
                sched.stop_stream(r.spec.stream_id)
        batch = sched.tick()
        if batch:
            plan.append(PlanEvent("batch", steps=tuple(batch)))
        for sid in sorted(open_ids - set(sched.streams)):
            plan.append(PlanEvent("close", stream_id=sid))
            open_ids.discard(sid)
    return plan
