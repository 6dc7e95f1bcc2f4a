"""StreamBatchScheduler: which micro-steps enter stage 0 at each logical tick.

Usage::

    sched = StreamBatchScheduler(num_stages=2, max_batch=4)
    sched.add_stream(spec)                 # joins at the current tick
    while sched.active:
        batch = sched.tick()               # list[MicroStep], possibly empty (a pipeline bubble)
        ...                                # send the batch to every stage, in this order
    sched.stop_stream(stream_id)           # cooldown: no new chunks, in-flight chunks finish

The model of time is logical: a batch that enters stage 0 at tick T leaves the last stage at tick
T + P - 1, so the next level of a chunk may enter at T + P.  Decisions depend only on ticks and on the
order of ``add_stream``/``stop_stream`` calls, never on wall-clock time, so a plan is reproducible and the
reference executor can replay it exactly.

Readiness rules for micro-step (s, c, i):
  * level 0 starts chunks in order, at most one new chunk per stream per tick, while the stream is running
    and has fewer than ``max_inflight`` chunks in flight;
  * video-to-video (``spec.input_latents``): chunk c starts only once its input has arrived (``set_inputs``);
    such a stream's clock is its input, so a stop still starts every chunk whose input arrived before it;
  * ``per_level``: (s, c-1, i) entered in an earlier tick (it writes the KV row that (s, c, i) reads);
  * ``clean``: the clean pass of (s, c-1) entered in an earlier tick before any level of chunk c;
  * i > 0: (s, c, i-1) entered at least P ticks ago (its latent has come back from the last stage);
  * a step change (``set_steps``) applies from the next chunk not yet started; under ``per_level`` that chunk
    starts a new KV segment (``stagecast.microstep.ChunkSpecs``), which reads none of the earlier chunks' K/V, so
    it enters while the chunks of the old ladder finish: the pipeline does not drain at a step change;
  * a chunk's last level waits until the chunk before it has issued its own (chunks of a stream finish in order,
    also when a chunk on a shorter ladder follows one on a longer).
Among ready micro-steps the one whose chunk its viewer needs soonest goes first (``set_due``: each paced stream's
deadlines, ``coordinator.pacing.Pacing.deadline``; a stream without them after those with them): a joining stream's
first chunk (its viewer is waiting for it: the time to first frame) and its second (due one frame after the first)
before the running streams' later chunks, which start up to their playout buffer before they are due.  Among equal
deadlines (streams on one pace grid), or without any, a stream's first chunk goes first, then the oldest chunk (it
finishes soonest), ties broken by stream arrival; up to ``max_batch`` rows that share a latent shape form the batch.

Best effort (``add_stream(spec, best_effort=True)``: an unpaced stream, which has no real-time clock) yields to the
other streams: its ready micro-steps are taken only after every other stream's, so a paced stream's micro-step is
never left out of a batch for a best-effort one (nor does a best-effort stream set the batch's latent shape while
a paced micro-step is ready), and while any other stream is scheduled, best-effort rows only fill a batch up to the
size the other streams' own demand sets: best-effort streams never make a batch larger than the paced streams' load
calls for, so the paced streams keep their rate whatever best-effort streams arrive.  Alone, best-effort streams fill
batches as any stream does (a lone unpaced stream runs flat out).  A micro-step of a guided stream
(classifier-free guidance) is two rows in one pipeline (its conditional and unconditional branches) and one
row per group under CFG-parallel (``cfg_parallel=2``, each group running one branch); a batch always takes
at least its first micro-step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from stagecast.microstep import DEFAULT_MAX_BATCH, ChunkSpecs, MicroStep, StreamSpec, context_frames
from stagecast.model.dit_configs import WAN_ROPE_MAX_SEQ_LEN


def batch_limit(demand: int, num_stages: int, max_batch: int) -> int:
    """Rows a batch may take when the streams ask ``demand`` rows of the pipeline: ``max_batch`` at most, and no more
    than 1/P of the demand, so the rows spread over the P stages (every row in flight comes back once per P ticks)."""
    return min(max_batch, max(1, -(-demand // num_stages)))


@dataclass
class _Chunk:
    index: int
    started: int  # tick its level 0 entered
    levels: int  # micro-steps of this chunk (its ladder, plus the clean pass under ``clean``)
    level: int = -1  # highest level issued so far
    issued_at: int = -1  # tick the highest level entered


@dataclass
class _StreamState:
    spec: StreamSpec
    order: int
    joined: int
    max_inflight: int | None  # None: one wavefront of the next chunk's ladder (levels x stages)
    specs: ChunkSpecs = field(init=False)
    next_chunk: int = 0
    stopping: bool = False
    inflight: dict[int, _Chunk] = field(default_factory=dict)
    first_finished_tick: int | None = None
    credit: int | None = None  # chunks this stream may have started in total (delivery-paced); None: no limit
    clean_issued: dict[int, int] = field(default_factory=dict)  # chunk -> tick of its clean pass (last two kept)
    inputs: int = 0  # video-to-video: chunks whose input latents have arrived
    best_effort: bool = False  # yields to the other streams (see the module docstring)
    held: bool = False  # a recache waits for the stream's chunks in flight: start no new one
    due: Callable[[int], float | None] | None = None  # chunk -> when its viewer needs it (``set_due``)

    def __post_init__(self) -> None:
        self.specs = ChunkSpecs(self.spec)

    @property
    def finished(self) -> bool:
        limit_hit = self.spec.num_chunks is not None and self.next_chunk >= self.spec.num_chunks
        if self.spec.input_latents and self.stopping and not limit_hit:
            return self.next_chunk >= self.inputs and not self.inflight
        return (self.stopping or limit_hit) and not self.inflight


class StreamBatchScheduler:
    def __init__(
        self,
        num_stages: int,
        max_batch: int = DEFAULT_MAX_BATCH,
        max_inflight: int | None = None,
        cfg_parallel: int = 1,
        equal_windows: bool = False,
        rope_limit: int = WAN_ROPE_MAX_SEQ_LEN,
    ):
        if cfg_parallel not in (1, 2):
            raise ValueError(f"cfg_parallel must be 1 or 2, got {cfg_parallel}")
        self.cfg_parallel = cfg_parallel
        if num_stages < 1:
            raise ValueError(f"num_stages must be >= 1, got {num_stages}")
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.num_stages = num_stages
        self.max_batch = max_batch
        # Batch only micro-steps whose KV windows hold equal frames (stages running CUDA graphs: a batch mixing a
        # filling window with full ones has a signature of its own, run eagerly at about twice a graph's time).
        self.equal_windows = equal_windows
        self.rope_limit = rope_limit
        self.max_inflight = max_inflight
        self.now = 0
        self.streams: dict[int, _StreamState] = {}
        self._arrivals = 0
        # Chunks each stream started, kept after the stream finishes until the caller pops it.
        self.started_chunks: dict[int, int] = {}

    # ---- stream events ----------------------------------------------------------------------------------

    def add_stream(self, spec: StreamSpec, best_effort: bool = False) -> None:
        """Schedule a stream from the current tick; ``best_effort``: it yields to the other streams."""
        if spec.stream_id in self.streams:
            raise ValueError(f"stream {spec.stream_id} is already scheduled")
        if spec.policy == "clean":
            cap = 1  # the next chunk waits for this one's clean pass: a single stream is serial
        else:
            cap = self.max_inflight  # None: levels x stages of the chunk to start
        self.streams[spec.stream_id] = _StreamState(spec, self._arrivals, self.now, cap, best_effort=best_effort)
        self._arrivals += 1

    def stop_stream(self, stream_id: int) -> None:
        """Cooldown: start no new chunks; the chunks already in flight complete."""
        self._state(stream_id).stopping = True

    def set_credit(self, stream_id: int, credit: int | None) -> None:
        """Let the stream start chunks only while fewer than ``credit`` have started: the consumer's pace
        reaches the scheduler, so a slow consumer never makes finished chunks pile up."""
        self._state(stream_id).credit = credit

    def set_due(self, stream_id: int, due: Callable[[int], float | None] | None) -> None:
        """Order the stream's ready micro-steps by when its viewer needs each chunk: ``due(chunk)``, a time on any
        one clock that every stream's ``due`` shares (the coordinator's: ``Pacing.deadline``); None: no deadline.
        Among the ready micro-steps of streams that are not best effort the earliest deadline goes first (see the
        module docstring)."""
        self._state(stream_id).due = due

    def set_inputs(self, stream_id: int, inputs: int) -> None:
        """A video-to-video stream has the input latents of its first ``inputs`` chunks: it may start those."""
        st = self._state(stream_id)
        if not st.spec.input_latents:
            raise ValueError(f"stream {stream_id} takes no input latents")
        st.inputs = max(st.inputs, inputs)

    def set_steps(self, stream_id: int, timesteps) -> int | None:
        """Run ``timesteps`` from the stream's next chunk not yet started; returns that chunk, or None when the
        stream already runs this ladder there.  Raises ValueError for an invalid ladder."""
        st = self._state(stream_id)
        return st.next_chunk if st.specs.change(st.next_chunk, timesteps) else None

    def steps_of(self, stream_id: int) -> int:
        """The steps the stream's next chunk will run."""
        st = self._state(stream_id)
        return st.specs.at(st.next_chunk).steps

    def hold(self, stream_id: int, held: bool) -> None:
        """Start no new chunk of the stream while ``held`` (a prompt recache waits for the chunks in flight)."""
        self._state(stream_id).held = held

    def inflight(self, stream_id: int) -> int:
        """Chunks of the stream in flight (started, not yet past their last level)."""
        return len(self._state(stream_id).inflight)

    def cancel_stream(self, stream_id: int) -> None:
        """Drop a stream at once (a failure): nothing more of it is scheduled."""
        self.streams.pop(stream_id, None)

    def _state(self, stream_id: int) -> _StreamState:
        try:
            return self.streams[stream_id]
        except KeyError:
            raise KeyError(f"unknown stream {stream_id}") from None

    # ---- queries --------------------------------------------------------------------------------------

    @property
    def active(self) -> bool:
        return bool(self.streams)

    def rows(self, spec: StreamSpec) -> int:
        """Batch rows one micro-step of the stream takes on a stage."""
        return 2 if spec.cfg and self.cfg_parallel == 1 else 1

    # ---- the tick -------------------------------------------------------------------------------------

    def _ready(self, st: _StreamState) -> list[tuple[tuple, MicroStep]]:
        spec, now, p = st.spec, self.now, self.num_stages
        out = []
        for ch in st.inflight.values():
            nxt = ch.level + 1
            if nxt >= ch.levels or now - ch.issued_at < p:
                continue
            prev = st.inflight.get(ch.index - 1)
            # (s, c-1, nxt) must have entered in an earlier tick; this tick's picks are issued only after
            # every stream was asked, so a level issued at all was issued before now.
            if spec.policy == "per_level" and prev is not None and prev.level < nxt:
                continue
            # A chunk's last level waits for the chunk before it to finish: chunks of a stream finish in order, also
            # across a step change, where a chunk on the shorter ladder would otherwise overtake one on the longer.
            if nxt == ch.levels - 1 and prev is not None:
                continue
            key = (st.best_effort, self._due(st, ch.index), ch.index > 0, ch.started, st.order, -nxt)
            out.append((key, MicroStep(spec.stream_id, ch.index, nxt)))
        c = st.next_chunk
        nxt_spec = st.specs.at(c)
        cap = st.max_inflight or nxt_spec.levels * p
        can_start = not st.stopping and len(st.inflight) < cap
        if spec.input_latents:
            # The input is the clock: a stop ends the stream after the chunks whose input has arrived.
            can_start = st.next_chunk < st.inputs and len(st.inflight) < cap
        if nxt_spec.levels == 1 and c - 1 in st.inflight:
            can_start = False  # its one level is its last: it finishes after the chunk before it (see below)
        if spec.num_chunks is not None and st.next_chunk >= spec.num_chunks:
            can_start = False
        if st.credit is not None and st.next_chunk >= st.credit:
            can_start = False
        if st.held:
            can_start = False
        # per_level: chunk c-1 started in an earlier tick (at most one start per stream and tick).
        if can_start and c > 0 and spec.policy == "clean" and st.clean_issued.get(c - 1, now) >= now:
            can_start = False
        if can_start:
            out.append(((st.best_effort, self._due(st, c), c > 0, now, st.order, 0), MicroStep(spec.stream_id, c, 0)))
        return out

    @staticmethod
    def _due(st: _StreamState, chunk: int) -> float:
        """The chunk's deadline as a sort key: to the microsecond (streams on one pace grid tie, and the rest of the
        key decides), a stream without one after every stream with one."""
        due = st.due(chunk) if st.due is not None else None
        return math.inf if due is None else round(due, 6)

    def tick(self) -> list[MicroStep]:
        """Advance one tick and return the batch that enters stage 0 now (empty when nothing is ready)."""
        ready = []
        for st in self.streams.values():
            ready.extend(self._ready(st))
        ready.sort(key=lambda x: x[0])
        # Smooth the work over the pipeline: every micro-step in flight comes back once per P ticks, so
        # taking more than 1/P of them now would leave the next ticks empty (a bubble on every stage).
        # Beside other streams, best-effort ones do not raise the batch size: their rows only fill what is left.
        others = [st for st in self.streams.values() if not st.best_effort]
        demand = sum(self._demand(st) for st in others or self.streams.values())
        limit = batch_limit(demand, self.num_stages, self.max_batch)
        batch: list[MicroStep] = []
        shape = None
        rows = 0
        for _, step in ready:
            st = self.streams[step.stream]
            spec = st.spec
            key = (spec.latent_shape, spec.text_len)
            if self.equal_windows:
                key += (len(context_frames(st.specs.at(step.chunk), step.chunk, self.rope_limit)),)
            if shape is None:
                shape = key
            if key != shape:
                continue
            if batch and rows + self.rows(spec) > limit:
                continue
            batch.append(step)
            rows += self.rows(spec)
            if rows >= limit:
                break
        for step in batch:
            self._issue(step)
        self.now += 1
        for sid in [sid for sid, st in self.streams.items() if st.finished]:
            del self.streams[sid]
        return batch

    def _demand(self, st: _StreamState) -> int:
        """Rows the stream asks of the pipeline: its levels still to issue in flight, and a new chunk unless idle."""
        waiting = sum(1 for ch in st.inflight.values() if ch.level + 1 < ch.levels)
        return self.rows(st.spec) * (waiting + (0 if self._idle(st) else 1))

    @staticmethod
    def _idle(st: _StreamState) -> bool:
        """No new chunk can come from this stream now: it is stopping, or it waits for its input."""
        if st.spec.input_latents:
            return st.next_chunk >= st.inputs
        return st.stopping

    def _issue(self, step: MicroStep) -> None:
        st = self.streams[step.stream]
        spec = st.specs.at(step.chunk)
        if step.level == 0:
            st.inflight[step.chunk] = _Chunk(step.chunk, started=self.now, levels=spec.levels)
            st.next_chunk = step.chunk + 1
            self.started_chunks[step.stream] = st.next_chunk
        ch = st.inflight[step.chunk]
        ch.level, ch.issued_at = step.level, self.now
        if spec.is_clean_pass(step.level):
            st.clean_issued = {step.chunk: self.now}
        if step.level == spec.levels - 1:
            del st.inflight[step.chunk]
            st.specs.prune(step.chunk + 1)  # chunks of a stream finish in order
        if step.level == spec.steps - 1 and st.first_finished_tick is None:
            st.first_finished_tick = self.now + self.num_stages - 1
