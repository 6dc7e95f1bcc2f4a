"""CUDA graphs for a slice's transformer blocks: one captured graph per batch signature, replayed with copied inputs.

An eager forward of a small Wan model is bound by kernel launches (measured on an H200: 1.3B at 56.8 ms eager
against 14.2 ms as a CUDA graph).  ``GraphedBlocks`` runs ``DiTSlice.run_blocks`` on static buffers instead::

    graphed = GraphedBlocks(dit_slice)                  # capture=cuda_graph_capture on a GPU
    hidden = graphed.run(hidden, cond, ctx)             # same result as dit_slice.run_blocks(hidden, cond, ctx)

A batch's *signature* is everything that fixes the kernels and their shapes: the hidden-state and conditioning
shapes, the RoPE table batch, and per item its KV context length (in tokens), whether it writes KV, and its text
length.  The first batch of a signature is captured; later ones copy their inputs into the graph's static buffers
(hidden states, timestep projections, RoPE tables, each item's KV window and text K/V) and replay it.  KV writes land
in the static buffers right after each item's window, where self-attention reads them in place; the caller's
``KVView`` takes them before the next replay (``StreamKVCache.commit`` clones what it keeps).

With ``background=True`` (the stage's default on a GPU) a signature first seen at run time never stalls the serving
path: its batch runs eagerly, the inputs are copied into buffers of its own, and a worker thread captures its graph
(on its own CUDA stream, ``capture_error_mode="thread_local"``) while the executor keeps running batches; batches of
that signature run eagerly until the graph is in, then replay it.  Such a graph keeps its own slots (it was captured
while other graphs replayed on the shared ones).  ``run(..., inline=True)`` captures in line even then: the batches of
the gateway's warm-up stream (``StreamSpec.warmup``), which nothing waits on, before the gateway serves.

A signature is captured in the background only once it has been seen ``min_sightings`` times (default 2): while a
stream's KV window fills, each chunk makes a signature seen once and never again, and capturing those took the
graph-buffer cap (each background graph holds a copy of its items' windows) from the signatures that repeat: on one
H200, six 1.3B streams left the batches that recur running eagerly at twice a graph's time.  For the same reason a
background graph idle for ``idle_batches`` batches is evicted (its buffers freed) when a new signature would pass
``max_graphs`` or ``max_buffer_bytes``; past them with nothing idle to evict, or once a new signature's static buffers
would take the graphs' buffers past ``max_buffer_bytes`` (the stage's cap: a window that keeps growing makes a new
signature, and buffers, every chunk), new ones run eagerly; if a capture fails, the stage logs it and runs every batch
eagerly from then on (``failure`` says why; the stage metric ``stagecast_stage_eager_batches`` counts them).

Static buffers are per shape class (tokens per item, text length), shared by every graph of that class, so memory
grows with the largest batch and window, not with the number of graphs: one K/V stack ``(layers, rows, window +
chunk tokens, heads, head_dim)`` whose row ``b`` holds batch item ``b``'s window followed by the K/V its forward
writes, and text K/V per row.  Self-attention reads a group of consecutive rows with equal windows as one view of
the stack, where the eager forward concatenates window and new K/V for every item and layer (``attention_check``
prices that copy at about 4% of a graphed forward); a view that is not contiguous (rows whose windows are shorter
than the stack's) is copied first, so SDPA always gets the layout the eager forward gives it.  A stack is made for
``reserve_rows`` rows (the stage's Stream Batch); rows past them get a stack of their own, so growing batches do not
re-capture.  Graphs share one memory pool; they are replayed one at a time on one stream.

Around it, on a stage with ``--cuda-graphs``: the buffers' cap is ``GRAPH_FRACTION`` (30%) of the GPU, kept out of
the KV budget (``stage_service.kv_budget``); the graphs a paced set forms are captured when a generation forms
(``stage_service.precapture``), and the gateway's warm-up stream captures in line before READY, its batches' time left
out of ``BatchDone``.  Each timed batch is in ``BatchDone.timed``; one that ran eagerly is flagged, and the SLO model
does not learn from it (``BatchDone.eager``, ``StageStats.eager_batches``).  The stage says so at Form
(``FormReply.cuda_graphs``), and the coordinator then batches only micro-steps whose KV windows hold equal frames
(``StreamBatchScheduler(equal_windows=True)``), since a batch mixing a filling window with full ones has a signature
of its own.

A graph replays the kernels the eager forward launches, less the concatenations, on equal inputs, so results equal
the eager path bit for bit (``stagecast selftest --cuda-graphs`` checks it on a GPU).  On a CPU ``capture`` defaults
to plain re-execution of the same static-buffer code, which is what the CPU tests hold against the eager forward.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from stage_service.dit_slice import AttentionContext, Conditioning, DiTSlice
from stagecast.cuda_graphs import Capture, device_capture

logger = logging.getLogger(__name__)


@dataclass
class _Stack:
    """K and V of a shape class's batch rows, ``(layers, rows, context + tokens, heads, head_dim)`` each.  Row ``r``
    holds its item's KV window in ``[:context]`` and the chunk's new K/V right after the window, so self-attention
    reads window and new K/V where they lie (``DiTSlice``'s grouped attention takes consecutive rows of equal context
    as one view) instead of concatenating them in every layer of every forward."""

    k: torch.Tensor
    v: torch.Tensor
    context: int  # tokens of window a row holds
    tokens: int  # tokens of new K/V a row holds after its window

    @property
    def rows(self) -> int:
        return self.k.shape[1]

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


class _StaticKV:
    """What the attention processor sees while capturing: a slot's row of the static K/V stack.  It reads the
    window ``[:tokens]`` and writes the chunk's K/V right after it (always: attention reads them there); the graph's
    caller hands the written K/V over to the stream's cache only where the micro-step ``writes``."""

    def __init__(self, slot: _Slot, tokens: int, writes: bool):
        self.stack, self.row = slot.stack, slot.row
        self.tokens = tokens
        self.writes = writes

    def read(self, layer: int):
        if self.tokens == 0:
            return None
        rows = slice(self.row, self.row + 1)
        return self.stack.k[layer, rows, : self.tokens], self.stack.v[layer, rows, : self.tokens]

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        rows, new = slice(self.row, self.row + 1), slice(self.tokens, self.tokens + key.shape[1])
        self.stack.k[layer, rows, new].copy_(key)
        self.stack.v[layer, rows, new].copy_(value)


@dataclass
class _Slot:
    """One batch position's static buffers: its row of a K/V stack, and its text K/V ``(layers, 1, text, heads,
    head_dim)``."""

    stack: _Stack
    row: int
    text_k: torch.Tensor
    text_v: torch.Tensor
    text_source: object = None  # the cross K/V list last copied in (kept alive, so identity means same values)

    @property
    def context_capacity(self) -> int:
        return self.stack.context

    def window(self, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(layers, 1, tokens, heads, head_dim)`` views of the row's window (what ``KVView.read_into`` fills)."""
        rows = slice(self.row, self.row + 1)
        return self.stack.k[:, rows, :tokens], self.stack.v[:, rows, :tokens]

    def written(self, context: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The K/V the forward wrote after a window of ``context`` tokens: ``(layers, 1, tokens, heads, head_dim)``."""
        rows, new = slice(self.row, self.row + 1), slice(context, context + self.stack.tokens)
        return self.stack.k[:, rows, new], self.stack.v[:, rows, new]


@dataclass
class _Graph:
    replay: Callable[[], None]
    hidden: torch.Tensor
    timestep_proj: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    out: list  # [the blocks' output]: a graph replays into the tensor captured there; a rerun makes a new one
    slots: list[_Slot]  # the slots the graph was captured on, one per batch item
    private: bool = False  # captured in the background on slots of its own (evictable)
    last_run: int = 0  # the batch (GraphedBlocks.runs) that last replayed it


class GraphedBlocks:
    def __init__(
        self,
        dit_slice: DiTSlice,
        *,
        capture: Capture | None = None,
        max_graphs: int = 64,
        background: bool = False,
        max_buffer_bytes: int | None = None,
        reserve_rows: int = 1,
        min_sightings: int = 2,
        idle_batches: int = 64,
    ):
        self.slice = dit_slice
        # Batch rows a shape class's K/V stack is first made for (the stage's Stream Batch): a batch with more rows
        # adds a stack for the rows missing, and the graphs captured on the first stay valid.
        self.reserve_rows = max(1, reserve_rows)
        # The static buffers' cap (None: none): a signature whose buffers would pass it runs eagerly.
        self.max_buffer_bytes = max_buffer_bytes
        self._pending_bytes = 0  # private slots of background captures not yet in ``private_slots``
        self._over_cap_logged = False
        if capture is None:
            capture = device_capture(dit_slice.device)
        self.capture = capture
        self.max_graphs = max_graphs
        self.graphs: dict[tuple, _Graph] = {}
        # Background capture: signatures being captured off the serving path, and the one worker that does it.
        self.background = background
        self.min_sightings = max(1, min_sightings)  # sightings of a signature before it is captured in the background
        self.idle_batches = idle_batches  # batches without a replay after which a background graph may be evicted
        self._sightings: dict[tuple, int] = {}  # signatures seen without a graph yet (cleared past a bound)
        self.runs = 0  # batches run so far
        self.evictions = 0  # background graphs evicted to make room for a new signature
        self.pending: dict[tuple, Future] = {}
        self._lock = threading.Lock()  # graphs/pending between the executor and the capture worker
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="graph-capture") if background else None
        self.background_captures = 0  # graphs captured off the serving path
        self.private_slots: list[_Slot] = []  # the slots of graphs captured in the background
        # Slots per shape class (tokens per item, text length): streams of another resolution get their own, so
        # batches of two resolutions can alternate without reallocating (and re-capturing) every time.
        self.pools: dict[tuple[int, int], list[_Slot]] = {}
        self.captures = 0  # graphs captured so far (a new signature, or after the buffers grew)
        # Of those, captured in line (the batch waited for it): its forward time is the capture's, not serving's.
        self.inline_captures = 0
        self.eager_batches = 0  # batches that could not use a graph (oracle masks, the graph limit, a failure)
        self.failure: str | None = None  # why capturing failed, after which every batch runs eagerly

    @staticmethod
    def signature(hidden: torch.Tensor, cond: Conditioning, ctx: AttentionContext) -> tuple:
        return (
            tuple(hidden.shape),
            hidden.dtype,
            tuple(cond.timestep_proj.shape),
            tuple(ctx.rotary[0].shape),
            tuple(None if kv is None else (kv.context_tokens, kv.writes) for kv in ctx.self_kv),
            tuple(item[0][0].shape[1] for item in ctx.cross_kv),
        )

    @property
    def nbytes(self) -> int:
        """Static buffer memory (the graphs' own pool comes on top)."""
        return self.nbytes_of([s for group in [*self.pools.values(), list(self.private_slots)] for s in group])

    def run(
        self, hidden: torch.Tensor, cond: Conditioning, ctx: AttentionContext, *, inline: bool = False
    ) -> torch.Tensor:
        """The blocks' forward, replayed from this batch signature's graph.  A signature without one is captured in
        line first, or with ``background`` runs eagerly while a worker captures it; ``inline`` captures in line even
        then (a warm-up stream's batch: nothing waits on it), after any background capture of it already started."""
        self.runs += 1
        if ctx.self_mask is not None or self.failure is not None:
            self.eager_batches += 1
            return self.slice.run_blocks(hidden, cond, ctx)
        sig = self.signature(hidden, cond, ctx)
        graph = self.graphs.get(sig)
        if graph is None and self.background and not inline:
            return self._eager_while_capturing(sig, hidden, cond, ctx)
        if graph is None and inline:
            with self._lock:
                pending = self.pending.get(sig)
            if pending is not None:  # already being captured in the background: wait for it rather than twice
                pending.exception()
                graph = self.graphs.get(sig)
                if graph is None:  # that capture failed: the signature stays eager, as for any other batch
                    self.eager_batches += 1
                    return self.slice.run_blocks(hidden, cond, ctx)
        if graph is None:
            if len(self.graphs) >= self.max_graphs:
                if self.eager_batches == 0:
                    logger.warning("%d CUDA graphs captured; further batch signatures run eagerly", self.max_graphs)
                self.eager_batches += 1
                return self.slice.run_blocks(hidden, cond, ctx)
            ensured = self._ensure_slots(hidden, ctx)
            if ensured is None:  # its buffers would pass the cap
                self.eager_batches += 1
                return self.slice.run_blocks(hidden, cond, ctx)
            slots, grew = ensured
            if grew:
                with self._lock:
                    self.graphs.clear()  # buffers were reallocated: the captured graphs point at the old ones
            try:
                graph = self._capture(sig, hidden, cond, ctx, slots)
            except Exception as exc:  # a kernel that cannot be captured: keep serving, eagerly
                self.failure = f"{type(exc).__name__}: {exc}"
                self.graphs.clear()
                logger.exception("CUDA graph capture failed; this stage runs eagerly from now on")
                self.eager_batches += 1
                return self.slice.run_blocks(hidden, cond, ctx)
            with self._lock:
                self.graphs[sig] = graph
        graph.last_run = self.runs
        self._copy_inputs(graph, hidden, cond, ctx)
        graph.replay()
        self._hand_over_writes(graph, ctx)
        return graph.out[0].clone()  # the next replay overwrites graph.out; the caller may still be sending this

    def wait_captures(self, timeout: float | None = None) -> None:
        """Block until every background capture started so far has finished (tests, shutdown)."""
        with self._lock:
            futures = list(self.pending.values())
        for future in futures:
            future.exception(timeout)

    def close(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True, cancel_futures=True)

    def _eager_while_capturing(
        self, sig: tuple, hidden: torch.Tensor, cond: Conditioning, ctx: AttentionContext
    ) -> torch.Tensor:
        """A signature without a graph: start capturing it off the serving path (once) and run this batch eagerly."""
        need = self._stack_bytes(*self._shape(hidden, ctx, rows=hidden.shape[0], context=self._context(ctx, "now")))
        with self._lock:
            start = sig not in self.pending and self._sighted(sig)
            if start:
                self._evict_idle(need + self._pending_bytes)
                start = len(self.graphs) + len(self.pending) < self.max_graphs and self._fits(
                    need + self._pending_bytes
                )
            if start:
                self._sightings.pop(sig, None)
                self.pending[sig] = Future()  # placeholder until submitted, so the signature is not started twice
                self._pending_bytes += need
        if start:
            # Inputs go into buffers of the new graph's own, here on the executor thread: the KV window and text are
            # read before the executor moves on (commits evict frames), and no shared slot is touched meanwhile.
            slots = self._private_slots(hidden, ctx)
            graph, forward = self._prepare(sig, hidden, cond, ctx, slots)
            with self._lock:
                self.pending[sig] = self._worker.submit(self._capture_in_background, sig, graph, forward, need)
        self.eager_batches += 1
        return self.slice.run_blocks(hidden, cond, ctx)

    def _sighted(self, sig: tuple) -> bool:
        """Count a sighting of ``sig`` (no graph yet); whether it has now been seen ``min_sightings`` times."""
        if len(self._sightings) >= 16 * self.max_graphs:  # bounded: a forgotten count only delays a capture
            self._sightings.clear()
        seen = self._sightings[sig] = self._sightings.get(sig, 0) + 1
        return seen >= self.min_sightings

    def _evict_idle(self, extra: int) -> None:
        """Evict background graphs idle for ``idle_batches`` batches, least recently replayed first, until one more
        graph fits ``max_graphs`` and ``extra`` more bytes fit ``max_buffer_bytes``.  Called on the executor thread
        (the only one that replays) under the lock."""
        idle = [(g.last_run, sig) for sig, g in self.graphs.items() if g.private]
        idle = [item for item in idle if self.runs - item[0] >= self.idle_batches]
        for _, sig in sorted(idle, key=lambda item: item[0]):
            if len(self.graphs) + len(self.pending) < self.max_graphs and self._fits(extra, log=False):
                return
            graph = self.graphs.pop(sig)
            held = {id(s) for s in graph.slots}
            self.private_slots = [s for s in self.private_slots if id(s) not in held]
            self.evictions += 1
            logger.info("evicted the idle graph of batch signature %s (%d graphs)", sig, len(self.graphs))

    def _capture_in_background(self, sig: tuple, graph: _Graph, forward: Callable[[], None], need: int = 0) -> None:
        try:
            graph.replay = self.capture(forward)
        except Exception:
            logger.exception("background CUDA graph capture failed; signature %s stays eager", sig)
            with self._lock:
                self._pending_bytes -= need  # the graph and its slots are dropped
            return  # it stays pending: the signature is not retried, and runs eagerly
        with self._lock:
            self._pending_bytes -= need
            graph.private, graph.last_run = True, self.runs
            self.graphs[sig] = graph
            self.pending.pop(sig, None)
            self.private_slots.extend(graph.slots)
            self.captures += 1
            self.background_captures += 1
        logger.info("captured a graph in the background for batch signature %s (%d graphs)", sig, len(self.graphs))

    def _shape(self, hidden: torch.Tensor, ctx: AttentionContext, *, rows: int, context: int) -> tuple:
        """(layers, rows, context, tokens, text_len, heads, head_dim, dtype) of a K/V stack and its text slots."""
        heads, head_dim = ctx.cross_kv[0][0][0].shape[2:]
        text_len = ctx.cross_kv[0][0][0].shape[1]  # one per batch (validate_batch)
        dtype = ctx.cross_kv[0][0][0].dtype
        return self.slice.num_layers, rows, context, hidden.shape[1], text_len, heads, head_dim, dtype

    @staticmethod
    def _context(ctx: AttentionContext, which: str) -> int:
        """The window tokens a batch's items need now (``"now"``) or at most (``"most"``), at least 1."""
        need = 1
        for kv in ctx.self_kv or []:
            if kv is not None:
                need = max(need, kv.context_tokens if which == "now" else kv.max_context_tokens)
        return need

    def _private_slots(self, hidden: torch.Tensor, ctx: AttentionContext) -> list[_Slot]:
        """A background capture's own stack and text slots, one row per item."""
        shape = self._shape(hidden, ctx, rows=hidden.shape[0], context=self._context(ctx, "now"))
        return self._new_slots(*shape, device=hidden.device)

    @staticmethod
    def _stack_bytes(layers, rows, context, tokens, text_len, heads, head_dim, dtype) -> int:
        """What ``_new_slots`` allocates: per row, K and V of the window, the chunk written and the text, per layer."""
        size = torch.empty((), dtype=dtype).element_size()
        return 2 * layers * rows * (context + tokens + text_len) * heads * head_dim * size

    def _fits(self, extra: int, log: bool = True) -> bool:
        """Whether ``extra`` more bytes of static buffers stay within ``max_buffer_bytes`` (logged once when not)."""
        if self.max_buffer_bytes is None or self.nbytes + extra <= self.max_buffer_bytes:
            return True
        if log and not self._over_cap_logged:
            self._over_cap_logged = True
            logger.warning(
                "CUDA graph buffers would pass their cap (%d MiB held, %d MiB more, cap %d MiB): batch signatures "
                "that need new buffers run eagerly",
                self.nbytes >> 20,
                extra >> 20,
                self.max_buffer_bytes >> 20,
            )
        return False

    @staticmethod
    def _new_slots(
        layers, rows, context, tokens, text_len, heads, head_dim, dtype, *, device, texts: list | None = None
    ) -> list[_Slot]:
        """A K/V stack of ``rows`` rows and a slot per row; ``texts`` keeps earlier rows' text buffers."""
        opts = dict(device=device, dtype=dtype)
        stack = _Stack(
            k=torch.zeros(layers, rows, context + tokens, heads, head_dim, **opts),
            v=torch.zeros(layers, rows, context + tokens, heads, head_dim, **opts),
            context=context,
            tokens=tokens,
        )
        slots = []
        for row in range(rows):
            if texts is not None and row < len(texts):
                text_k, text_v, source = texts[row]
            else:
                text_k = torch.zeros(layers, 1, text_len, heads, head_dim, **opts)
                text_v = torch.zeros(layers, 1, text_len, heads, head_dim, **opts)
                source = None
            slots.append(_Slot(stack, row, text_k, text_v, source))
        return slots

    def forget_text(self, sources: list) -> None:
        """A stream closed: let go of its text K/V (a slot keeps the last list it copied alive)."""
        for slots in [*self.pools.values(), self.private_slots]:
            for slot in slots:
                if any(slot.text_source is src for src in sources):
                    slot.text_source = None

    # ---- buffers ----------------------------------------------------------------------------------------

    def _ensure_slots(self, hidden: torch.Tensor, ctx: AttentionContext) -> tuple[list[_Slot], bool] | None:
        """A slot per item, large enough for every item's KV window: ``(the batch's slots, whether buffers that
        captured graphs use were replaced)``; None (nothing allocated) when new buffers would pass
        ``max_buffer_bytes``.  A wider window than the shape class's makes one new stack for all its rows (the
        graphs are captured again); more rows than it has add a stack for the rows missing (at least
        ``reserve_rows`` in all), so graphs on the first rows stay valid."""
        rows, context = hidden.shape[0], self._context(ctx, "most")
        key = (hidden.shape[1], ctx.cross_kv[0][0][0].shape[1])  # tokens per item, text length
        slots = self.pools.get(key, [])
        have_rows, have_context = len(slots), slots[0].context_capacity if slots else 0
        if rows <= have_rows and context <= have_context:
            return slots[:rows], False
        texts = [(s.text_k, s.text_v, s.text_source) for s in slots]
        if context > have_context:  # every row anew, as wide as the widest window seen
            kept, old, first = [], self.nbytes_of(slots), 0
        else:  # the rows missing, on a stack of their own
            kept, old, texts, first, context = slots, 0, [], have_rows, have_context
        # As many rows as the reserve asks, or (past the buffer cap) only those the batch needs.
        for new_rows, last in (
            (max(rows, have_rows, self.reserve_rows) - first, False),
            (max(rows, have_rows) - first, True),
        ):
            shape = self._shape(hidden, ctx, rows=new_rows, context=context)
            if self._fits(self._stack_bytes(*shape) - old, log=last):
                break
        else:
            return None
        self.pools[key] = slots = kept + self._new_slots(*shape, device=hidden.device, texts=texts)
        logger.debug("graph K/V stack: %d rows of %d context tokens, %d MiB", shape[1], context, self.nbytes >> 20)
        return slots[:rows], not kept and have_rows > 0

    @staticmethod
    def nbytes_of(slots: list[_Slot]) -> int:
        """The bytes of ``slots``' stacks and text buffers."""
        stacks = {id(s.stack): s.stack for s in slots}
        text = sum(2 * s.text_k.numel() * s.text_k.element_size() for s in slots)
        return text + sum(stack.nbytes for stack in stacks.values())

    def _capture(
        self, sig: tuple, hidden: torch.Tensor, cond: Conditioning, ctx: AttentionContext, slots: list[_Slot]
    ) -> _Graph:
        graph, forward = self._prepare(sig, hidden, cond, ctx, slots)
        graph.replay = self.capture(forward)
        self.captures += 1
        self.inline_captures += 1
        logger.info("captured a graph for batch signature %s (%d graphs)", sig, len(self.graphs) + 1)
        return graph

    def _prepare(
        self, sig: tuple, hidden: torch.Tensor, cond: Conditioning, ctx: AttentionContext, slots: list[_Slot]
    ) -> tuple[_Graph, Callable[[], None]]:
        """The graph's static inputs, filled with this batch's, and the forward to capture over them."""
        static_hidden = hidden.clone()
        static_proj = cond.timestep_proj.clone()
        cos, sin = (t.clone() for t in ctx.rotary)
        static_ctx = AttentionContext(
            rotary=(cos, sin),
            cross_kv=[[(s.text_k[i], s.text_v[i]) for i in range(self.slice.num_layers)] for s in slots],
            self_kv=[
                None if kv is None else _StaticKV(s, tokens=kv.context_tokens, writes=kv.writes)
                for kv, s in zip(ctx.self_kv, slots, strict=False)
            ],
        )
        out: list[torch.Tensor] = []
        graph = _Graph(lambda: None, static_hidden, static_proj, cos, sin, out, slots)
        self._copy_inputs(graph, hidden, cond, ctx)

        def forward() -> None:
            out[:] = [self.slice.run_blocks(static_hidden, Conditioning(cond.temb, static_proj), static_ctx)]

        return graph, forward

    def _copy_inputs(self, graph: _Graph, hidden: torch.Tensor, cond: Conditioning, ctx: AttentionContext) -> None:
        graph.hidden.copy_(hidden)
        graph.timestep_proj.copy_(cond.timestep_proj)
        graph.cos.copy_(ctx.rotary[0])
        graph.sin.copy_(ctx.rotary[1])
        for b, slot in enumerate(graph.slots):
            kv = ctx.self_kv[b] if ctx.self_kv else None
            if kv is not None and kv.context_tokens:
                kv.read_into(*slot.window(kv.context_tokens))
            text = ctx.cross_kv[b]
            if slot.text_source is not text:
                torch.stack([k for k, _ in text], out=slot.text_k)
                torch.stack([v for _, v in text], out=slot.text_v)
                slot.text_source = text

    def _hand_over_writes(self, graph: _Graph, ctx: AttentionContext) -> None:
        for kv, slot in zip(ctx.self_kv, graph.slots, strict=False):
            if kv is not None and kv.writes:
                kv.write_all(*slot.written(kv.context_tokens))
