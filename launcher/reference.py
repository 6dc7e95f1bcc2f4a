"""The single-process reference executor: the oracle the distributed system must reproduce bit for bit.

Usage::

    ref = ReferenceExecutor(DiTSlice.from_model(model, layers=range(n), first=True, last=True))
    out = ref.generate([StreamRequest(spec, text, arrival_tick=0)], num_stages=2, max_batch=4)
    out.chunks[stream_id]            # list of clean latent chunks, in chunk order
    out.plan                         # the exact batches run, replayable with ref.replay(...)

It runs the same ``StreamBatchScheduler`` and the same ``SliceRunner`` a stage uses, over one slice that
holds the whole model.  ``sp=S`` runs the sequence-parallel shard layout of ``--sp S`` in this process: S
runners over the one slice, each in its own thread with a ``ThreadSequenceGroup`` handle, computing on the same
shards with the same ops as S stage ranks do (their all-to-alls move the same data through memory).

``replay`` executes a recorded plan (a list of events) so a distributed run whose batches depended on arrival
timing can still be compared exactly.

Why it is exact: every op a micro-step runs is independent of what else shares its batch (patch and timestep
embedding per item; self-attention one SDPA per group of items with equal KV context, equal on CPU to each item's
own, ``stage_service.dit_slice.attend_grouped``), so a distributed run replayed here equals it bit for bit in fp32 on
CPU for any stage count and partition (``tests/test_distributed.py``, ``stagecast selftest``).  The reference itself
is pinned by full-sequence diffusers forwards under block-causal masks (``tests/test_streaming_semantics.py``).

Classifier-free guidance: with ``cfg_parallel=1`` a guided micro-step's two branches are two rows of one forward,
as in one pipeline (sequential CFG).  With ``cfg_parallel=2`` the reference runs what two stage groups in lockstep
run: branch 0's rows in one forward and branch 1's in another (a second runner), each runner then combining its
own prediction with the other's, exactly as the groups' last stages do after exchanging them.  On CPU the two modes
agree with each other bit for bit (``tests/test_cfg.py``), since every op of a row is independent of its batch.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from coordinator.scheduler import StreamBatchScheduler
from stage_service.dit_slice import DiTSlice
from stage_service.parallel_state import LOCAL, ThreadSequenceGroup
from stage_service.runner import SliceRunner, StepResult
from stagecast.microstep import DEFAULT_MAX_BATCH, MicroStep, PlanEvent, StreamSpec, recache_steps


@dataclass
class StreamRequest:
    spec: StreamSpec
    text: torch.Tensor  # (1, text_len, text_dim)
    arrival_tick: int = 0
    stop_tick: int | None = None  # for unbounded streams: the tick a stop arrives
    # Video-to-video (``spec.input_latents``): each chunk's level-0 latents, all here at the arrival tick; the
    # stream ends after the last (its input is its clock).
    inputs: list[torch.Tensor] | None = None
    image: torch.Tensor | None = None  # image-to-video (``spec.image_latents``): the image latent (1, C, 1, h, w)
    # Step changes: at tick T the stream runs this ladder from its next chunk not yet started (the SLO
    # controller's decisions, as the coordinator plans them).
    step_changes: dict[int, tuple[float, ...]] = field(default_factory=dict)
    negative_text: torch.Tensor | None = None  # a guided stream's negative prompt (1, text_len, text_dim)


@dataclass
class GenerationResult:
    chunks: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    plan: list[PlanEvent] = field(default_factory=list)


Trace = Callable[[list[MicroStep], torch.Tensor, list[StepResult]], None]


class ReferenceExecutor:
    def __init__(self, full_slice: DiTSlice, trace: Trace | None = None, *, sp: int = 1, cfg_parallel: int = 1):
        if not (full_slice.first and full_slice.last):
            raise ValueError("the reference executor needs a slice that holds the whole model")
        if sp < 1:
            raise ValueError(f"sp must be >= 1, got {sp}")
        if cfg_parallel not in (1, 2) or (cfg_parallel > 1 and sp > 1):
            raise ValueError(f"cfg_parallel must be 1, or 2 without sp; got cfg_parallel={cfg_parallel} sp={sp}")
        groups = ThreadSequenceGroup.create(sp) if sp > 1 else [LOCAL]
        self.runners = [SliceRunner(full_slice, sp=g, cfg_size=cfg_parallel) for g in groups]
        self.runner = self.runners[0]  # sequence rank 0: the one whose results are reported
        # CFG-parallel: the second group's runner (branch 1 of guided streams); None for one pipeline.
        self.peer = SliceRunner(full_slice, cfg_rank=1, cfg_size=2) if cfg_parallel == 2 else None
        self._pool = ThreadPoolExecutor(max_workers=sp, thread_name_prefix="reference-sp") if sp > 1 else None
        self.trace = trace

    def _each(self, fn: Callable[[SliceRunner], object]) -> list:
        """Run ``fn`` on every sequence rank's runner (concurrently: their all-to-alls meet); results by rank."""
        if self._pool is None:
            return [fn(self.runner)]

        def guarded(runner: SliceRunner):
            try:
                return fn(runner)
            except BaseException:
                runner.sp.abort()  # release the ranks waiting for this one in an exchange
                raise

        futures = [self._pool.submit(guarded, r) for r in self.runners]
        return [f.result() for f in futures]

    def _all(self, fn: Callable[[SliceRunner], object]) -> None:
        """``fn`` on every runner: each sequence rank's, and the second CFG group's."""
        self._each(fn)
        if self.peer is not None:
            fn(self.peer)

    def run_batch(self, steps: list[MicroStep]) -> list[StepResult]:
        if self.peer is not None:
            flow = self.runner.forward(steps)
            other = self.peer.forward(steps) if self.peer.rows(steps) else None
            mine = self.runner.exchanged_rows(steps, flow)
            theirs = self.peer.exchanged_rows(steps, other) if other is not None else None
            results = self.runner.finish(steps, flow, peer=theirs)
            if other is not None:
                self.peer.finish(steps, other, peer=mine)
        else:

            def one(runner: SliceRunner):
                flow = runner.forward(steps)
                return flow, runner.finish(steps, flow)

            flow, results = self._each(one)[0]
        if self.trace is not None:
            self.trace(steps, flow, results)
        return results

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def replay(
        self,
        plan: list[PlanEvent],
        texts: dict[int, torch.Tensor],
        prompt_texts: dict[tuple[int, int], torch.Tensor] | None = None,
        inputs: dict[tuple[int, int], torch.Tensor] | None = None,
        images: dict[int, torch.Tensor] | None = None,
        negative_texts: dict[int, torch.Tensor] | None = None,
    ) -> dict[int, list[torch.Tensor]]:
        """Run a recorded plan.  ``texts[stream]`` is each stream's first prompt; ``prompt_texts[(stream,
        from_chunk)]`` the text of each prompt update event; ``inputs[(stream, chunk)]`` the latents of each input
        event (video-to-video), where the event does not carry them; ``images[stream]`` the image latent of an
        image-to-video stream's open event, where it does not carry it; ``negative_texts[stream]`` a guided
        stream's negative prompt."""
        chunks: dict[int, list[torch.Tensor]] = {}
        negative_texts = negative_texts or {}
        for ev in plan:
            if ev.kind == "open":
                assert ev.spec is not None
                spec = ev.spec
                image = ev.latents if ev.latents is not None else (images or {}).get(spec.stream_id)
                negative = negative_texts.get(spec.stream_id) if spec.cfg else None
                self._all(
                    lambda r, spec=spec, image=image, neg=negative: r.open_stream(
                        spec, texts[spec.stream_id], image, negative_text=neg
                    )
                )
                chunks[ev.spec.stream_id] = []
            elif ev.kind == "prompt":
                assert ev.stream_id is not None and prompt_texts is not None
                sid, first = ev.stream_id, ev.from_chunk
                self._all(lambda r, sid=sid, first=first: r.set_prompt(sid, first, prompt_texts[(sid, first)]))
                if ev.recache:  # rebuild the KV window under the new prompt, from the window's clean latents
                    given = dict(ev.window)
                    spec = self.runner.spec_at(sid, first)
                    for chunk, row in recache_steps(spec, first, self.runner.rope_limit):
                        clean = given.get(chunk)
                        clean = clean if clean is not None else chunks[sid][chunk]
                        self.runner.recache_step(sid, chunk, row, first, clean=clean)
            elif ev.kind == "input":
                assert ev.stream_id is not None
                sid, chunk = ev.stream_id, ev.chunk
                latents = ev.latents if ev.latents is not None else (inputs or {})[(sid, chunk)]
                self._all(lambda r, sid=sid, chunk=chunk, x=latents: r.put_input(sid, chunk, x))
            elif ev.kind == "steps":
                assert ev.stream_id is not None
                sid, first, ladder = ev.stream_id, ev.from_chunk, ev.timesteps
                self._all(lambda r, sid=sid, first=first, ladder=ladder: r.set_steps(sid, first, ladder))
            elif ev.kind == "close":
                assert ev.stream_id is not None
                sid = ev.stream_id
                self._all(lambda r, sid=sid: r.close_stream(sid))
            else:
                for res in self.run_batch(list(ev.steps)):
                    if res.finished is not None:
                        chunks[res.step.stream].append(res.finished)
        return chunks

    def generate(
        self, requests: list[StreamRequest], *, num_stages: int = 1, max_batch: int = DEFAULT_MAX_BATCH
    ) -> GenerationResult:
        """Schedule and run ``requests`` exactly as a ``num_stages`` pipeline would order them."""
        cfg_parallel = 1 if self.peer is None else 2
        plan = build_plan(requests, num_stages=num_stages, max_batch=max_batch, cfg_parallel=cfg_parallel)
        texts = {r.spec.stream_id: r.text for r in requests}
        inputs = {(r.spec.stream_id, c): x for r in requests for c, x in enumerate(r.inputs or [])}
        images = {r.spec.stream_id: r.image for r in requests if r.image is not None}
        negative = {r.spec.stream_id: r.negative_text for r in requests if r.negative_text is not None}
        chunks = self.replay(plan, texts, inputs=inputs, images=images, negative_texts=negative)
        return GenerationResult(chunks=chunks, plan=plan)


def build_plan(
    requests: list[StreamRequest], *, num_stages: int, max_batch: int, cfg_parallel: int = 1
) -> list[PlanEvent]:
    """Run the scheduler over logical arrival and stop ticks and record the resulting event list."""
    sched = StreamBatchScheduler(num_stages=num_stages, max_batch=max_batch, cfg_parallel=cfg_parallel)
    pending = sorted(requests, key=lambda r: r.arrival_tick)
    for r in requests:
        if r.spec.input_latents != (r.inputs is not None):
            raise ValueError(f"stream {r.spec.stream_id}: inputs are given exactly for input_latents streams")
        if r.spec.num_chunks is None and r.stop_tick is None and r.inputs is None:
            raise ValueError(f"stream {r.spec.stream_id} is unbounded and has no stop tick")
    plan: list[PlanEvent] = []
    open_ids: set[int] = set()
    while pending or sched.active:
        while pending and pending[0].arrival_tick <= sched.now:
            req = pending.pop(0)
            sched.add_stream(req.spec)
            plan.append(PlanEvent("open", spec=req.spec))
            open_ids.add(req.spec.stream_id)
            if req.inputs is not None:
                sched.set_inputs(req.spec.stream_id, len(req.inputs))
                sched.stop_stream(req.spec.stream_id)  # its input is all here: it ends after the last chunk
        for r in requests:
            if r.stop_tick == sched.now and r.spec.stream_id in sched.streams:
                sched.stop_stream(r.spec.stream_id)
            ladder = r.step_changes.get(sched.now)
            if ladder is not None and r.spec.stream_id in sched.streams:
                first = sched.set_steps(r.spec.stream_id, ladder)
                if first is not None:
                    plan.append(PlanEvent("steps", stream_id=r.spec.stream_id, from_chunk=first, timesteps=ladder))
        batch = sched.tick()
        if batch:
            # A video-to-video chunk's input is planned right before the batch that starts it.
            v2v = {r.spec.stream_id for r in requests if r.inputs is not None}
            for st in batch:
                if st.level == 0 and st.stream in v2v:
                    plan.append(PlanEvent("input", stream_id=st.stream, chunk=st.chunk))
            plan.append(PlanEvent("batch", steps=tuple(batch)))
        for sid in sorted(open_ids - set(sched.streams)):
            plan.append(PlanEvent("close", stream_id=sid))
            open_ids.discard(sid)
    return plan
