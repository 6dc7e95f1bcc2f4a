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

``serving_spec(root, config)`` is the stream a request that sets nothing runs, as far as its KV is concerned (the
checkpoint's ``stagecast.json`` size, chunk, steps, text length and window, else the API's defaults; an unbounded
default window counts as the benchmark protocol's 6 frames with 3 sinks, as the gateway's warm-up stream does): what a
stage must hold at least one of to form (``stage_service.kv_budget.stream_fit_problem``) and what ``stagecast up``'s
memory plan sizes a shared GPU for (``launcher.memory_plan``).
"""

from __future__ import annotations

import json
from pathlib import Path

from stagecast.api import DEFAULT_CHUNK_FRAMES, DEFAULT_HEIGHT, DEFAULT_STEPS, DEFAULT_TEXT_LEN, DEFAULT_WIDTH
from stagecast.microstep import StreamSpec, context_frames, stream_branches
from stagecast.model.config import DiTConfig

SERVING_FILE = "stagecast.json"  # the checkpoint's serving defaults (gateway.checkpoint.ServingDefaults reads it all)
# The window a stream at the serving defaults is counted with when the checkpoint leaves it unbounded: the benchmark
# protocol's (gateway.stream.warmup's DEFAULT_WINDOW / DEFAULT_SINK); an unbounded one grows to the RoPE limit, which
# no real model's KV holds on one GPU (a client asking for it is refused naming ``window``).
PROTOCOL_WINDOW = 6
PROTOCOL_SINK = 3


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


def spatial_factor(root: Path | None, config: dict) -> int:
    """Video pixels per latent pixel: the checkpoint's VAE's (``vae/config.json``), else the Wan VAEs'."""
    if root is not None and (root / "vae" / "config.json").is_file():
        from stagecast.model import vae_configs
        from stagecast.model.config import read_vae_config

        return vae_configs.spatial_factor(read_vae_config(root / "vae"))
    return 16 if config.get("in_channels") == 48 else 8  # the Wan2.2 VAE (48 channels) is 16x, Wan2.1's 8x


def serving_spec(root: Path | None, config: dict) -> StreamSpec:
    """The stream at the serving defaults of the checkpoint folder ``root`` (holding ``transformer/``,
    ``stagecast.json`` and ``vae/``; None: the API's defaults) for the transformer ``config``: its KV shape, the
    guidance the gateway defaults to (none: one branch) and its steps (placeholder timesteps: only their count
    matters to the KV).  Raises ValueError naming ``stagecast.json`` when it is unreadable."""
    data: dict = {}
    if root is not None and (root / SERVING_FILE).is_file():
        try:
            data = json.loads((root / SERVING_FILE).read_text())
        except ValueError as exc:
            raise ValueError(f"{root / SERVING_FILE}: not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError(f"{root / SERVING_FILE}: must hold a JSON object")

    def pick(key: str, default: int) -> int:
        value = data.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            where = root / SERVING_FILE if root else SERVING_FILE
            raise ValueError(f"{where}: {key} must be an integer, got {value!r}")
        return value

    height, width = pick("height", DEFAULT_HEIGHT), pick("width", DEFAULT_WIDTH)
    steps, window, sink = pick("steps", DEFAULT_STEPS), pick("window", 0), pick("sink", 0)
    if window == 0:
        window, sink = PROTOCOL_WINDOW, PROTOCOL_SINK
    sf = spatial_factor(root, config)
    _, p_h, p_w = config["patch_size"]
    return StreamSpec(
        stream_id=0,
        latent_channels=int(config.get("in_channels", 16)),
        chunk_frames=max(1, pick("chunk_frames", DEFAULT_CHUNK_FRAMES)),
        latent_height=max(p_h, height // sf // p_h * p_h),
        latent_width=max(p_w, width // sf // p_w * p_w),
        timesteps=tuple(1000.0 * (1 - i / max(steps, 1)) for i in range(max(steps, 1))),
        window=window,
        sink=min(sink, window),
        text_len=pick("text_len", DEFAULT_TEXT_LEN),
    )


def describe_spec(spec: StreamSpec, spatial: int) -> str:
    """A serving stream for a message (``spatial``: the VAE's ``spatial_factor``): "832x480, 1 latent frame a chunk,
    4 steps, a 6-frame window"."""
    frames = "1 latent frame" if spec.chunk_frames == 1 else f"{spec.chunk_frames} latent frames"
    return (
        f"{spec.latent_width * spatial}x{spec.latent_height * spatial}, {frames} a chunk, {spec.steps} step"
        f"{'s' if spec.steps != 1 else ''}, a {spec.window}-frame window"
    )
