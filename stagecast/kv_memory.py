"""What one stream's self-attention KV cache can grow to on one stage process: the coordinator admits by it.

Usage::

    model = DiTConfig.from_kwargs(cfg)
    need = stream_kv_bytes(spec, model, layers=15, element_bytes=2, max_steps=4)
    held = max_context_frames(spec, rope_limit=model.rope_max_seq_len)  # the most cached frames any chunk attends to
    format_bytes(need)                                    # "7.50 GiB"

A stage keeps, per stream, one ``StreamKVCache`` (``stage_service.kv_cache``) per CFG branch it computes
(``stagecast.microstep.stream_branches``: both under sequential CFG, its own under CFG-parallel), each with one KV
row per denoising level under ``per_level`` (as many as the stream's longest ladder: a step change starts a new
segment of that many rows) or one clean row under ``clean``.  A row holds, per layer of the stage, K and V of every
latent frame the next chunk attends to (``stagecast.microstep.context_frames``); while a chunk's K/V are committed
the row also holds that chunk's own frames before the frames it no longer sees are evicted.  So a row holds at most
``max_context_frames + chunk_frames`` frames, each ``tokens_per_frame`` tokens of K and V over the rank's heads
(``heads / sp`` under sequence parallelism: Ulysses gives each rank the whole sequence for its head group).

``stream_kv_bytes`` is that bound with every row at its peak at once: exact for a stream whose rows all end full (an
unbounded window over a bounded stream), an upper bound by at most ``rows - 1`` chunks' frames otherwise.  The
stream's text K/V, latents in flight and the forward's activations are not counted here; a stage leaves them in the
reserve it keeps out of its budget (``stage_service.server``).
"""

from __future__ import annotations

from stagecast.microstep import StreamSpec, context_frames, stream_branches
from stagecast.model.config import DiTConfig


def max_context_frames(spec: StreamSpec, rope_limit: int) -> int:
    """The most cached latent frames (sinks included) any chunk of the stream attends to.

    Within an epoch (``StreamSpec.epoch_frames``) a chunk attends to at least as many frames as the one before it, and
    every epoch starts empty, so the most is what the last chunk of the first epoch sees, or the stream's last chunk
    when it ends sooner (``num_chunks``).  A step change that starts a new per_level segment only starts it empty.
    """
    epoch_chunks = spec.epoch_frames(rope_limit) // spec.chunk_frames
    chunks = epoch_chunks if spec.num_chunks is None else min(spec.num_chunks, epoch_chunks)
    return len(context_frames(spec, chunks - 1, rope_limit))


def kv_rows(spec: StreamSpec, max_steps: int | None = None) -> int:
    """KV rows of one CFG branch: a row per denoising level under ``per_level`` (``max_steps``: the most steps any of
    the stream's ladders runs), the one clean row under ``clean``."""
    if spec.policy == "per_level":
        return max(spec.steps, max_steps or 0)
    return 1


def stream_kv_bytes(
    spec: StreamSpec,
    model: DiTConfig,
    *,
    layers: int,
    element_bytes: int,
    max_steps: int | None = None,
    sp: int = 1,
    cfg_rank: int = 0,
    cfg_size: int = 1,
) -> int:
    """The most bytes of self-attention KV the stream can hold on one stage process of ``layers`` layers whose KV
    elements take ``element_bytes`` (its dtype's size): CFG branches x KV rows x layers x (the most context frames +
    the chunk being written) x tokens per frame x 2 (K and V) x the rank's inner dim x ``element_bytes``.

    ``max_steps``: the longest ladder the stream may run (the SLO controller's choices; default its own).  ``sp``: the
    stage's sequence-parallel ranks (each holds ``heads / sp`` heads).  ``cfg_rank`` / ``cfg_size``: the process's CFG
    group under CFG-parallel."""
    branches = len(stream_branches(spec, cfg_rank, cfg_size))
    p_h, p_w = model.patch_hw
    tokens_per_frame = (spec.latent_height // p_h) * (spec.latent_width // p_w)
    inner = (model.num_attention_heads // max(sp, 1)) * model.attention_head_dim
    frames = max_context_frames(spec, model.rope_max_seq_len) + spec.chunk_frames
    return branches * kv_rows(spec, max_steps) * layers * frames * tokens_per_frame * 2 * inner * element_bytes


def format_bytes(n: float) -> str:
    """``n`` bytes for a message: "147 GiB", "60.0 MiB", "512 B"."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            value = n / size
            return f"{value:.0f} {unit}" if value >= 100 else f"{value:.3g} {unit}"
    return f"{int(n)} B"
