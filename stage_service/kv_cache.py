"""Per-stream, per-slice self-attention KV cache with a rolling window, sinks and epoch resets.

Usage::

    cache = StreamKVCache(spec, num_layers=slice.num_layers, tokens_per_frame=tpf, rope_limit=WAN_ROPE_MAX_SEQ_LEN)
    view = cache.view(step)          # implements dit_slice.SelfAttentionKV for one micro-step
    ... slice.run_blocks(..., AttentionContext(self_kv=[view, ...]))
    cache.commit(view)               # store the chunk's K/V (if its level writes) and evict
    cache.prune(done)                # chunks < done ran their last level: earlier KV segments that ended go
    cache.nbytes                     # bounded: rows * (window frames) * layers
    cache.clear()                    # when the stream ends

K/V are stored after ``norm_k`` and RoPE, per absolute latent frame (one ``FrameKV``: every layer's K and V of the
frame in two tensors, so that a window is read into a CUDA graph's buffers with one copy per K and V, and a chunk is
kept with one, where per-layer tensors took one per layer each), in one row per KV row of the policy
(one per level under ``per_level``, one clean row under ``clean``).  A chunk reads exactly the frames that
``stagecast.microstep.context_frames`` names, in ascending order, so chunked attention equals a
full-sequence forward under the corresponding block-causal mask.  Rows must be written in chunk order; a
plan that violates this is a scheduling bug and raises instead of silently attending to the wrong context.

A step change (``stagecast.microstep.ChunkSpecs``) under ``per_level`` is a window reset: "the K/V of level i" would
be another timestep on the new ladder, so the change's first chunk starts a new KV segment (empty cache, RoPE
positions from 0, as an epoch reset).  The new segment reads nothing of the old one, so it enters while the old
ladder's chunks finish: the old segment's rows stay in ``older`` until its last chunk has committed each (``prune``),
so a stream holds no more KV rows than its longest ladder.  Under ``clean`` a chunk attends to the clean K/V of
earlier chunks whatever ladders made them, so a step change needs no new segment.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stagecast.microstep import MicroStep, StreamSpec, context_frames


class KVOrderError(RuntimeError):
    """A micro-step needs KV that has not been written, or writes out of chunk order."""


@dataclass(frozen=True)
class FrameKV:
    """One latent frame's K and V for every layer of the slice: ``(layers, 1, tokens, heads, head_dim)`` each."""

    k: torch.Tensor
    v: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()


class _Row:
    def __init__(self, first_chunk: int = 0):
        self.frames: dict[int, FrameKV] = {}
        self.next_chunk = first_chunk


class KVView:
    """One micro-step's window onto its row, plus the writes it makes during the forward."""

    def __init__(self, cache: StreamKVCache, step: MicroStep, spec: StreamSpec | None = None):
        self.cache = cache
        self.step = step
        spec = spec or cache.spec  # the chunk's spec (``ChunkSpecs.at``): its ladder and KV segment
        self.spec = spec
        self.rows = cache.enter_segment(spec.segment_start)  # the rows of the chunk's segment
        self.row_id = spec.kv_row(step.level)
        self.frames = context_frames(spec, step.chunk, cache.rope_limit)
        self.writes = spec.writes_kv(step.level)
        self.pending: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * cache.num_layers
        self.pending_all: tuple[torch.Tensor, torch.Tensor] | None = None  # ``write_all``'s
        row = self.rows.get(self.row_id)
        stored = row.frames if row is not None else {}
        missing = [f for f in self.frames if f not in stored]
        if missing:
            raise KVOrderError(f"{step}: KV row {self.row_id} lacks frames {missing}; the plan ran it too early")

    @property
    def context_tokens(self) -> int:
        """Tokens this micro-step attends to besides its own (what ``read`` returns per layer)."""
        return len(self.frames) * self.cache.tokens_per_frame

    @property
    def max_context_tokens(self) -> int:
        """The most any chunk of this stream attends to: the window, or (no window) at least this step's."""
        window = self.cache.spec.window
        return max(self.context_tokens, (window or 0) * self.cache.tokens_per_frame)

    def read_into(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Every layer's ``read`` into ``(layers, 1, context_tokens, heads, head_dim)`` buffers: one copy for K and
        one for V."""
        frames = self.rows[self.row_id].frames
        torch.cat([frames[f].k for f in self.frames], dim=2, out=keys)
        torch.cat([frames[f].v for f in self.frames], dim=2, out=values)

    def read(self, layer: int):
        if not self.frames:
            return None
        frames = self.rows[self.row_id].frames
        keys = [frames[f].k[layer] for f in self.frames]
        values = [frames[f].v[layer] for f in self.frames]
        return torch.cat(keys, dim=1), torch.cat(values, dim=1)

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        if self.writes:
            self.pending[layer] = (key, value)

    def write_all(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Every layer's ``write`` at once: ``(layers, 1, tokens, heads, head_dim)`` (a CUDA graph's buffers)."""
        if self.writes:
            self.pending_all = (keys, values)

    @property
    def pending_bytes(self) -> int:
        """The bytes of the K/V written so far."""
        if self.pending_all is not None:
            return FrameKV(*self.pending_all).nbytes
        return sum(FrameKV(k, v).nbytes for k, v in filter(None, self.pending))

    def check_written(self, what: str) -> None:
        """Raise ``KVOrderError`` (``what`` names the forward) unless the forward wrote every layer's K/V."""
        if self.pending_all is None and any(p is None for p in self.pending):
            raise KVOrderError(f"{what}: forward did not produce K/V for every layer")

    def frame(self, j: int) -> FrameKV:
        """Frame ``j`` of the chunk's written K/V, as tensors of their own (so that evicting it frees it)."""
        tpf = self.cache.tokens_per_frame
        sl = slice(j * tpf, (j + 1) * tpf)
        if self.pending_all is not None:
            k, v = self.pending_all
            return FrameKV(k[:, :, sl].clone(), v[:, :, sl].clone())
        self.check_written(str(self.step))
        return FrameKV(
            torch.stack([k[:, sl] for k, _ in self.pending]),  # type: ignore[misc]
            torch.stack([v[:, sl] for _, v in self.pending]),  # type: ignore[misc]
        )


class RecacheView(KVView):
    """A recache forward's window onto a row: it reads the window frames before its chunk (already rebuilt) and
    writes its chunk's frames that lie in the window, over the old ones."""

    def __init__(self, cache: StreamKVCache, chunk: int, row: int, window: list[int]):
        self.cache = cache
        self.step = MicroStep(-1, chunk, -1)
        self.rows = cache.rows
        self.row_id = row
        f0 = chunk * cache.spec.chunk_frames
        self.frames = [f for f in window if f < f0]
        self.window = set(window)
        self.writes = True
        self.pending = [None] * cache.num_layers
        self.pending_all = None
        stored = cache.rows[row].frames if row in cache.rows else {}
        missing = [f for f in self.frames if f not in stored]
        if missing:
            raise KVOrderError(f"recache of chunk {chunk}: KV row {row} lacks window frames {missing}")


class StreamKVCache:
    def __init__(self, spec: StreamSpec, *, num_layers: int, tokens_per_frame: int, rope_limit: int):
        self.spec = spec
        self.num_layers = num_layers
        self.tokens_per_frame = tokens_per_frame
        self.rope_limit = rope_limit
        self.rows: dict[int, _Row] = {}  # the newest KV segment's rows
        self.segment = 0  # the first chunk of the KV segment ``rows`` hold (``StreamSpec.segment_start``)
        # Earlier per_level segments whose last chunks are still in the pipeline (a step change does not wait for
        # them): segment start -> (its last chunk, its rows).  A row goes once that last chunk has committed it.
        self.older: dict[int, tuple[int, dict[int, _Row]]] = {}
        self.done = 0  # chunks below this have run their last level (``prune``)

    def view(self, step: MicroStep, spec: StreamSpec | None = None) -> KVView:
        """``spec``: the chunk's spec when the stream's steps changed (default: the stream's)."""
        return KVView(self, step, spec)

    def enter_segment(self, segment_start: int) -> dict[int, _Row]:
        """The rows of the per_level KV segment that starts at ``segment_start``.  A later segment than any seen (a
        step change) starts empty; the earlier one's rows that its last chunk has not committed yet stay for its
        chunks still in the pipeline (``commit`` drops each once that chunk has)."""
        if segment_start > self.segment:
            last = segment_start - 1
            if last >= self.done:  # its last chunk still runs: keep the rows it has not committed yet
                for r in [r for r, row in self.rows.items() if row.next_chunk > last]:
                    del self.rows[r]  # in place: views of this batch made before hold this dict
                self.older[self.segment] = (last, self.rows)  # until that chunk is done (``prune``)
            self.rows = {}
            self.segment = segment_start
        if segment_start == self.segment:
            return self.rows
        if segment_start in self.older:
            return self.older[segment_start][1]
        raise KVOrderError(f"KV segment from chunk {segment_start} is over (the cache holds {self.segment} on)")

    def commit(self, view: KVView) -> None:
        if not view.writes:
            return
        view.check_written(str(view.step))
        chunk = view.step.chunk
        spec = view.spec
        row = view.rows.setdefault(view.row_id, _Row(spec.segment_start))
        if chunk != row.next_chunk:
            raise KVOrderError(f"{view.step}: KV row {view.row_id} expected chunk {row.next_chunk} next, got {chunk}")
        older = self.older.get(spec.segment_start)
        if older is not None and view.rows is older[1] and chunk == older[0]:
            del view.rows[view.row_id]  # the last chunk of an earlier segment: no chunk reads this row again
            return
        f0 = chunk * spec.chunk_frames
        for j in range(spec.chunk_frames):
            row.frames[f0 + j] = view.frame(j)
        row.next_chunk = chunk + 1
        # Keep only what the next chunk can still see; later chunks see a subset of that plus newer frames.
        keep = set(context_frames(spec, chunk + 1, self.rope_limit))
        for f in [f for f in row.frames if f not in keep]:
            del row.frames[f]

    def prune(self, done: int) -> None:
        """Chunks below ``done`` have run their last level: forget the earlier segments that ended before it."""
        self.done = max(self.done, done)
        for start in [start for start, (last, _) in self.older.items() if last < done]:
            del self.older[start]

    def recache_view(self, chunk: int, row: int, window: list[int]) -> RecacheView:
        return RecacheView(self, chunk, row, window)

    def commit_recache(self, view: RecacheView) -> None:
        view.check_written(f"recache of chunk {view.step.chunk}")
        row = self.rows[view.row_id]
        f0 = view.step.chunk * self.spec.chunk_frames
        for j in range(self.spec.chunk_frames):
            if f0 + j in view.window:
                row.frames[f0 + j] = view.frame(j)

    @property
    def nbytes(self) -> int:
        total = 0
        for row in [*self.rows.values(), *(r for _, rows in self.older.values() for r in rows.values())]:
            total += sum(frame.nbytes for frame in row.frames.values())
        return total

    def frames_held(self, row: int) -> list[int]:
        return sorted(self.rows[row].frames) if row in self.rows else []

    def clear(self) -> None:
        self.rows.clear()
        self.older.clear()
