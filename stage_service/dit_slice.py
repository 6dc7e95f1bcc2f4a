"""One depth slice of a Wan DiT: layers [a, b) plus the pre/post pieces its position needs.

Usage::

    sl = DiTSlice.from_state_dict(config, sd, layers=range(0, 2), first=True, last=False)
    cond = sl.condition(timesteps, tokens=L)            # every slice recomputes conditioning locally
    hs = sl.embed(latents)                              # first slice only: (B, C, F, H, W) -> (B, L, D)
    hs = sl.run_blocks(hs, cond, AttentionContext(...)) # the only tensor that crosses a stage boundary
    out = sl.head(hs, cond, latents.shape)              # last slice only: -> (B, C, F, H, W)

The slice is built from diffusers' own ``WanTransformer3DModel`` (constructed on the meta device, pruned to
the slice, then filled with only the slice's tensors), and every op below mirrors diffusers' forward so a
chain of slices equals ``WanTransformer3DModel.forward`` bit for bit.  Self- and cross-attention go through
our processors, which read per-item context (KV cache, cached text K/V, RoPE offset) from an
``AttentionContext`` handed to ``run_blocks``.  This module is pure computation: no transport, no RPC.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import threading
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F
from diffusers import WanTransformer3DModel
from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from stage_service.host_copy import to_device
from stage_service.parallel_state import LOCAL, SequenceGroup
from stagecast.model.dit_configs import WAN_ROPE_MAX_SEQ_LEN, expands_timesteps


class SelfAttentionKV(Protocol):
    """Per-item view of a KV cache row: what this micro-step attends to, and where it writes.

    A layer reads and then writes each item's view, item by item in batch order, before it attends; so a tensor
    that ``read`` returned must not change under a later ``write`` of the same forward."""

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None: ...

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None: ...


@dataclass
class AttentionContext:
    """Per-forward, per-item attention inputs.  Index ``b`` describes batch item ``b``.

    ``self_kv[b]`` may be None (plain bidirectional attention over the item's own tokens).
    ``cross_kv[b][layer]`` is the cached ``(k, v)`` of that item's text for the slice-local layer.
    ``self_mask`` (oracle only) is an attention mask for full-sequence reference forwards.
    ``sp`` is the stage's sequence-parallel group: with more than one rank, the hidden states handed to the
    blocks are this rank's sequence shard, and self-attention runs Ulysses-style (an all-to-all gives each rank
    the whole sequence for ``heads / sp`` heads, another brings the output back to sequence shards), so the KV
    cache of a rank holds its heads only.  ``rotary`` always covers the whole sequence.
    """

    rotary: tuple[torch.Tensor, torch.Tensor]
    cross_kv: list[list[tuple[torch.Tensor, torch.Tensor]]]
    self_kv: list[SelfAttentionKV | None] = field(default_factory=list)
    self_mask: torch.Tensor | None = None
    sp: SequenceGroup = LOCAL


@dataclass
class Conditioning:
    temb: torch.Tensor  # (B, D) or (B, L, D) for per-token timesteps
    timestep_proj: torch.Tensor  # (B, 6, D) or (B, L, 6, D)


def apply_rotary_emb(hidden_states: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor) -> torch.Tensor:
    # Copied op for op from diffusers' WanAttnProcessor so results stay bit-identical.
    x1, x2 = hidden_states.unflatten(-1, (-1, 2)).unbind(-1)
    cos = freqs_cos[..., 0::2]
    sin = freqs_sin[..., 1::2]
    out = torch.empty_like(hidden_states)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(hidden_states)


# The SDPA backends of the slice whose attention runs now (``DiTSlice.attention_scope``): torch's ``SDPBackend``
# names, the first tried alone, the rest (torch's choice among them) where it refuses the call; None: torch's choice.
_SDPA_BACKENDS: contextvars.ContextVar[tuple[str, ...] | None] = contextvars.ContextVar("sdpa_backends", default=None)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    # (B, L, H, Dh) layout in and out, exactly like diffusers' native attention backend.
    q, k, v = q.permute(0, 2, 1, 3), k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)
    backends = _SDPA_BACKENDS.get()
    if backends is None:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0)
    else:
        out = _sdpa_on(backends, q, k, v, mask)
    return out.permute(0, 2, 1, 3)


class SdpaCalls:
    """The slice's SDPA calls under a backend scope (``_sdpa_on``), by backend, shapes and outcome: ran, or refused
    with torch's first line of reason.  A forward captured into a CUDA graph runs this Python once, at capture, so
    the counts say which kernel each graphed call replays.  ``take()`` returns the counts so far and starts again."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: collections.Counter[str] = collections.Counter()

    def note(self, backend: str, q: torch.Tensor, k: torch.Tensor, refused: BaseException | None = None) -> None:
        what = f"{backend} {'refused' if refused else 'ran'} q{tuple(q.shape)} k{tuple(k.shape)} {q.dtype}"
        if refused is not None:
            what += ": " + (str(refused).strip().splitlines() or [type(refused).__name__])[0][:300]
        with self._lock:
            self._counts[what] += 1

    def take(self) -> dict[str, int]:
        with self._lock:
            counts, self._counts = dict(self._counts), collections.Counter()
        return counts

    @staticmethod
    def refusals(counts: dict[str, int]) -> dict[str, int]:
        return {what: n for what, n in counts.items() if " refused " in what}


SDPA_CALLS = SdpaCalls()
CONDITION_CACHE = 64  # conditionings a slice keeps by timestep value (``DiTSlice.condition``): a few ladders' levels


def _sdpa_on(backends: tuple[str, ...], q, k, v, mask) -> torch.Tensor:
    """SDPA on ``backends[0]`` alone, else (it refused the call: torch raises before launching anything, so a CUDA
    graph capture is unharmed) on torch's choice among the rest.  Not a priority order: torch 2.11 on an H200 kept
    flash for the DiT's calls under ``sdpa_kernel(..., set_priority=True)`` with cuDNN first."""
    try:
        if backends[0] == "CUDNN_ATTENTION" and q.is_cuda:
            # cuDNN's op itself, with no backend selection between the call and the kernel (through
            # ``sdpa_kernel`` two GPU runs saw flash's time in the blocks where a probe of the same shapes saw cuDNN's).
            out = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, mask, False)[0]
        else:
            with sdpa_kernel([getattr(SDPBackend, backends[0])]):
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0)
        SDPA_CALLS.note(backends[0], q, k)
        return out
    except RuntimeError as exc:
        SDPA_CALLS.note(backends[0], q, k, exc)
        if len(backends) == 1:
            raise
    with sdpa_kernel([getattr(SDPBackend, b) for b in backends[1:]]):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0)


def sequence_to_heads(sp: SequenceGroup, *qkv: torch.Tensor) -> list[torch.Tensor]:
    """Ulysses' first all-to-all: (B, L/sp, H, Dh) sequence shards -> (B, L, H/sp, Dh) head groups, q, k and v
    in one exchange.  Rank j receives head group j; shards are concatenated in rank (= sequence) order."""
    stacked = torch.stack(qkv)  # (3, B, Ls, H, Dh)
    heads = stacked.shape[3] // sp.size
    parts = sp.all_to_all([stacked[:, :, :, j * heads : (j + 1) * heads] for j in range(sp.size)])
    return list(torch.cat(parts, dim=2).unbind(0))


def heads_to_sequence(sp: SequenceGroup, out: torch.Tensor) -> torch.Tensor:
    """Ulysses' second all-to-all: (B, L, H/sp, Dh) -> (B, L/sp, H, Dh), heads concatenated in rank order."""
    tokens = out.shape[1] // sp.size
    parts = sp.all_to_all([out[:, j * tokens : (j + 1) * tokens] for j in range(sp.size)])
    return torch.cat(parts, dim=2)


def attend_per_item(query, key, value, cached: list) -> torch.Tensor:
    """One SDPA per batch item over its cached K/V (if any) followed by its own (``DiTSlice.grouped_attention`` off)."""
    outs = []
    for b, kv in enumerate(cached):
        k_b, v_b = key[b : b + 1], value[b : b + 1]
        if kv is not None:
            k_b = torch.cat([kv[0], k_b], dim=1)
            v_b = torch.cat([kv[1], v_b], dim=1)
        outs.append(_sdpa(query[b : b + 1], k_b, v_b))
    return torch.cat(outs, dim=0)


def in_place_reader(views: list, layer: int):
    """For ``attend_grouped``: where every item's view is a row of one static K/V stack (``GraphedBlocks``), whose
    window the forward's new K/V follow in place, a group's K/V are one view of the stack, with no copy.  Returns a
    function of (the group's items, their context length, new tokens) that gives (K, V) or None."""
    stacks = [getattr(kv, "stack", None) for kv in views]
    present = [stack for kv, stack in zip(views, stacks) if kv is not None]
    if not present or any(stack is None for stack in present):
        return None  # (an item without a view has no window: its group, of context 0, needs none)

    def group(items: list[int], length: int, tokens: int):
        first = items[0]
        row = views[first].row
        for g, b in enumerate(items):
            if stacks[b] is not stacks[first] or views[b].row != row + g:
                return None
        rows, window = slice(row, row + len(items)), slice(0, length + tokens)
        k, v = stacks[first].k[layer, rows, window], stacks[first].v[layer, rows, window]
        if not k.is_contiguous():  # rows whose windows are shorter than the stack's: the layout a cat gives
            k, v = k.contiguous(), v.contiguous()
        return k, v

    return group


def attend_grouped(query, key, value, cached: list, in_place=None) -> torch.Tensor:
    """Self-attention of a batch whose items attend to different cached contexts: items with the same context
    length (or none) form one group and run one SDPA over their stacked q/k/v, so a Stream Batch of streams with
    full KV windows launches one attention kernel per layer instead of one per item.

    Each item's result equals its own batch-1 SDPA bit for bit: the CPU kernels compute every (item, head) apart
    (``tests/test_dit_slice_attention.py`` holds this for the models' dtypes and shapes), and a GPU benchmark
    (``benchmarks/attention_check.py``) reports the difference there.  ``in_place`` (``in_place_reader``): the group's
    window and new K/V already lie together in static buffers, read as they are."""
    groups: dict[int, list[int]] = {}
    for b, kv in enumerate(cached):
        groups.setdefault(0 if kv is None else kv[0].shape[1], []).append(b)
    batch = query.shape[0]
    outs = []
    for length, items in groups.items():
        if items[-1] - items[0] + 1 == len(items):  # consecutive items: slices, no gather
            sl = slice(items[0], items[-1] + 1)
            q, k_new, v_new = query[sl], key[sl], value[sl]
        else:  # slices and cat, no index tensor: a CUDA graph capture cannot copy one from the host
            q, k_new, v_new = (torch.cat([t[b : b + 1] for b in items]) for t in (query, key, value))
        placed = in_place(items, length, k_new.shape[1]) if in_place is not None and length else None
        if placed is not None:
            k, v = placed
        elif length:
            # One copy of each item's cached window and new K/V into the group's buffer (what the per-item cat
            # made, stacked), then one SDPA for the group.
            n, tokens, heads, dim = k_new.shape
            k = k_new.new_empty((n, length + tokens, heads, dim))
            v = v_new.new_empty((n, length + tokens, heads, dim))
            for g, b in enumerate(items):
                torch.cat([cached[b][0], k_new[g : g + 1]], dim=1, out=k[g : g + 1])
                torch.cat([cached[b][1], v_new[g : g + 1]], dim=1, out=v[g : g + 1])
        else:
            k, v = k_new, v_new
        out = _sdpa(q, k, v)
        if len(items) == batch:
            return out
        outs.append((items, out))
    result = query.new_empty(query.shape)
    for items, out in outs:
        if items[-1] - items[0] + 1 == len(items):
            result[items[0] : items[-1] + 1] = out
        else:
            for g, b in enumerate(items):
                result[b : b + 1] = out[g : g + 1]
    return result


class _SliceAttnProcessor:
    """Attention processor bound to one slice-local layer; reads its inputs from the slice's context."""

    def __init__(self, owner: DiTSlice, layer: int, cross: bool):
        self._owner = [owner]  # a list so the module tree does not see a cycle
        self.layer = layer
        self.cross = cross

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        ctx = getattr(self._owner[0]._local, "ctx", None)
        if ctx is None:
            raise RuntimeError("slice attention called outside DiTSlice.run_blocks")
        if self.cross:
            out = self._cross(attn, hidden_states, ctx)
        else:
            out = self._self(attn, hidden_states, ctx)
        out = out.flatten(2, 3).type_as(hidden_states)
        out = attn.to_out[0](out)
        return attn.to_out[1](out)

    def _self(self, attn, hidden_states, ctx: AttentionContext):
        query = attn.norm_q(attn.to_q(hidden_states)).unflatten(2, (attn.heads, -1))
        key = attn.norm_k(attn.to_k(hidden_states)).unflatten(2, (attn.heads, -1))
        value = attn.to_v(hidden_states).unflatten(2, (attn.heads, -1))
        if ctx.sp.size > 1:
            query, key, value = sequence_to_heads(ctx.sp, query, key, value)
            return heads_to_sequence(ctx.sp, self._attend(query, key, value, ctx))
        return self._attend(query, key, value, ctx)

    def _attend(self, query, key, value, ctx: AttentionContext):
        query = apply_rotary_emb(query, *ctx.rotary)
        key = apply_rotary_emb(key, *ctx.rotary)
        return self._owner[0].self_attend(self.layer, query, key, value, ctx)

    def _cross(self, attn, hidden_states, ctx: AttentionContext):
        query = attn.norm_q(attn.to_q(hidden_states)).unflatten(2, (attn.heads, -1))
        return self._owner[0].cross_attend(self.layer, query, ctx)


class DiTSlice(nn.Module):
    """Layers ``[layers.start, layers.stop)`` of a Wan transformer; see the module docstring."""

    def __init__(self, config: dict, model: WanTransformer3DModel, *, layers: range, first: bool, last: bool):
        super().__init__()
        self.config = dict(config)
        self.layers = layers
        self.first = first
        self.last = last
        self.per_token_timesteps = expands_timesteps(config)
        self.model = model
        # Self-attention over KV contexts runs one SDPA per group of items with equal context length instead of
        # one per item (same result bit for bit on CPU; off: the per-item loop, which benchmarks compare with).
        self.grouped_attention = True
        # Grouped attention reads a CUDA graph's static K/V stack where window and new K/V lie together, rather than
        # concatenating them (same result bit for bit; off: the copy, which ``benchmarks/attention_check`` compares).
        self.kv_in_place = True
        # The SDPA backends this slice's attention runs on (``--dit-levers cudnn``; ``_sdpa_on``: the first alone,
        # else the rest); None: torch's choice (flash on a GPU for these shapes), bit-exact against the reference.
        self.attention_backends: tuple[str, ...] | None = None
        # The running forward's context, per thread: a CUDA graph may be captured on another thread meanwhile.
        self._local = threading.local()
        self._conditions: dict[tuple[float, torch.dtype], Conditioning] = {}  # by timestep value (``condition``)
        for i, block in enumerate(model.blocks):
            block.attn1.set_processor(_SliceAttnProcessor(self, i, cross=False))
            block.attn2.set_processor(_SliceAttnProcessor(self, i, cross=True))

    # ---- construction -------------------------------------------------------------------------------

    @staticmethod
    def required_prefixes(*, first: bool, last: bool) -> tuple[str, ...]:
        """Non-block key prefixes a slice needs (blocks are selected by index)."""
        keys = [
            "condition_embedder.time_embedder.",
            "condition_embedder.time_proj.",
            "condition_embedder.text_embedder.",
        ]
        if first:
            keys.append("patch_embedding.")
        if last:
            keys += ["proj_out.", "scale_shift_table"]
        return tuple(keys)

    @classmethod
    def from_state_dict(
        cls,
        config: dict,
        state_dict: dict[str, torch.Tensor],
        *,
        layers: range,
        first: bool,
        last: bool,
        device: torch.device | str = "cpu",
    ) -> DiTSlice:
        """Build a slice from slice-local tensors (blocks renumbered from 0), never the full model."""
        cfg = {k: v for k, v in config.items() if not k.startswith("_")}
        if cfg.get("image_dim") is not None:
            raise ValueError("image-conditioned Wan checkpoints (image_dim set) are not supported yet")
        with torch.device("meta"):
            model = WanTransformer3DModel.from_config(cfg)
        model.blocks = nn.ModuleList(list(model.blocks)[layers.start : layers.stop])
        if not first:
            model.patch_embedding = None
        if not last:
            model.proj_out = None
            model.norm_out = None
            model.scale_shift_table = None
        missing, unexpected = model.load_state_dict(state_dict, strict=False, assign=True)
        if unexpected:
            raise ValueError(f"slice {layers.start}:{layers.stop} got unexpected tensors: {sorted(unexpected)[:5]}")
        if missing:
            raise ValueError(f"slice {layers.start}:{layers.stop} is missing tensors: {sorted(missing)[:5]}")
        # RoPE tables are non-persistent buffers: they never come from a checkpoint, so rebuild them.
        model.rope = WanRotaryPosEmbed(
            cfg["attention_head_dim"], cfg["patch_size"], cfg.get("rope_max_seq_len", WAN_ROPE_MAX_SEQ_LEN)
        )
        model = model.to(device)
        model.eval().requires_grad_(False)
        return cls(cfg, model, layers=layers, first=first, last=last)

    @classmethod
    def from_model(cls, model: WanTransformer3DModel, *, layers: range, first: bool, last: bool) -> DiTSlice:
        """Cut a slice out of an in-memory model (tests and the single-process reference)."""
        prefixes = cls.required_prefixes(first=first, last=last)
        sd = {}
        for key, tensor in model.state_dict().items():
            if key.startswith("blocks."):
                idx = int(key.split(".")[1])
                if idx in layers:
                    sd[f"blocks.{idx - layers.start}." + key.split(".", 2)[2]] = tensor.clone()
            elif key.startswith(prefixes):
                sd[key] = tensor.clone()
        device = next(model.parameters()).device
        return cls.from_state_dict(dict(model.config), sd, layers=layers, first=first, last=last, device=device)

    # ---- properties -----------------------------------------------------------------------------------

    @property
    def dtype(self) -> torch.dtype:
        return self.model.condition_embedder.text_embedder.linear_1.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.condition_embedder.text_embedder.linear_1.weight.device

    @property
    def inner_dim(self) -> int:
        return self.config["num_attention_heads"] * self.config["attention_head_dim"]

    @property
    def num_layers(self) -> int:
        return len(self.model.blocks)

    # ---- computation ----------------------------------------------------------------------------------

    def rotary(
        self, frames: int, height: int, width: int, frame_offsets: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE tables for latent chunks of shape (frames, height, width) starting at each item's frame offset.

        Equals ``WanRotaryPosEmbed.forward`` on the full sequence sliced at ``offset * tokens_per_frame``.
        """
        rope = self.model.rope
        p_t, p_h, p_w = self.config["patch_size"]
        ppf, pph, ppw = frames // p_t, height // p_h, width // p_w
        sizes = [rope.t_dim, rope.h_dim, rope.w_dim]
        cos_parts = rope.freqs_cos.split(sizes, dim=1)
        sin_parts = rope.freqs_sin.split(sizes, dim=1)
        limit = rope.max_seq_len
        for f0 in frame_offsets:
            if f0 < 0 or f0 + ppf > limit:
                raise ValueError(f"temporal RoPE position {f0}+{ppf} exceeds rope_max_seq_len={limit}")
        b = len(frame_offsets)
        # One table per item even where the offsets agree: the same values (broadcasting one table gives the same
        # bits), and a batch's CUDA graph signature then depends on its size and windows only, so a graph captured
        # before serving (items at one offset) is the one a batch of streams at different offsets replays.  The
        # batch's tables are built at once (each item's frame rows stacked, then one concatenation) rather than item
        # by item: the same copies of the same values, in a few kernels a batch instead of a few an item.
        tables = []
        for parts in (cos_parts, sin_parts):
            rows = [parts[0][f0 : f0 + ppf] for f0 in frame_offsets]
            frame = (rows[0][None] if b == 1 else torch.stack(rows)).view(b, ppf, 1, 1, -1)
            f = frame.expand(b, ppf, pph, ppw, -1)
            h = parts[1][:pph].view(1, 1, pph, 1, -1).expand(b, ppf, pph, ppw, -1)
            w = parts[2][:ppw].view(1, 1, 1, ppw, -1).expand(b, ppf, pph, ppw, -1)
            tables.append(torch.cat([f, h, w], dim=-1).reshape(b, ppf * pph * ppw, 1, -1))
        return tables[0], tables[1]

    def condition(self, timestep: torch.Tensor, *, tokens: int) -> Conditioning:
        """Timestep embedding for a batch; ``timestep`` is (B,) or, for per-token models, (B,) or (B, L).

        Computed item by item: a 1-row linear runs as a GEMV and a B-row one as a GEMM, which round
        differently, and a micro-step's result must not depend on what shares its batch.  So an item's conditioning
        is a function of its timestep's value alone, and a (B,) ``timestep`` on the host (what the stage passes) of a
        model without per-token timesteps takes each item's from a cache by value (``CONDITION_CACHE`` entries): the
        same computation on the same value, so the same bits, without its dozen kernel launches an item (a stream's
        ladder has a few values; a one-step stream's forwards all share one).  Anything else is computed here, on
        the slice's device.
        """
        if timestep.device.type == "cpu" and timestep.ndim == 1 and not self.per_token_timesteps:
            parts = [self._condition_of(t, timestep.dtype) for t in timestep.tolist()]
            if len(parts) == 1:
                return parts[0]
            return Conditioning(
                temb=torch.cat([p.temb for p in parts]), timestep_proj=torch.cat([p.timestep_proj for p in parts])
            )
        timestep = to_device(timestep, self.device)
        if timestep.shape[0] > 1:
            parts = [self._condition(timestep[i : i + 1], tokens) for i in range(timestep.shape[0])]
            return Conditioning(
                temb=torch.cat([p.temb for p in parts]), timestep_proj=torch.cat([p.timestep_proj for p in parts])
            )
        return self._condition(timestep, tokens)

    def _condition_of(self, t: float, dtype: torch.dtype) -> Conditioning:
        """One item's conditioning at timestep ``t`` (a ``dtype`` value), from the cache or computed and kept."""
        key = (t, dtype)
        cond = self._conditions.get(key)
        if cond is None:
            if len(self._conditions) >= CONDITION_CACHE:
                self._conditions.clear()
            cond = self._condition(to_device(torch.tensor([t], dtype=dtype), self.device), 1)
            self._conditions[key] = cond
        return cond

    def _condition(self, timestep: torch.Tensor, tokens: int) -> Conditioning:
        ce = self.model.condition_embedder
        if self.per_token_timesteps and timestep.ndim == 1:
            timestep = timestep[:, None].expand(-1, tokens)
        ts_seq_len = None
        if timestep.ndim == 2:
            ts_seq_len = timestep.shape[1]
            timestep = timestep.flatten()
        t = ce.timesteps_proj(timestep)
        if ts_seq_len is not None:
            t = t.unflatten(0, (-1, ts_seq_len))
        te_dtype = next(iter(ce.time_embedder.parameters())).dtype
        if t.dtype != te_dtype:
            t = t.to(te_dtype)
        # diffusers casts temb to the dtype of the text input, which is the slice's compute dtype.
        temb = ce.time_embedder(t).to(self.dtype)
        proj = ce.time_proj(ce.act_fn(temb))
        proj = proj.unflatten(2, (6, -1)) if ts_seq_len is not None else proj.unflatten(1, (6, -1))
        return Conditioning(temb=temb, timestep_proj=proj)

    def embed_text(self, text: torch.Tensor) -> torch.Tensor:
        """(B, T, text_dim) raw encoder output -> (B, T, D) context."""
        return self.model.condition_embedder.text_embedder(text.to(self.dtype))

    def cross_kv(self, context: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer text K/V for one stream's context (1, T, D); constant for the prompt, so cached."""
        out = []
        for block in self.model.blocks:
            attn = block.attn2
            key = attn.norm_k(attn.to_k(context)).unflatten(2, (attn.heads, -1))
            value = attn.to_v(context).unflatten(2, (attn.heads, -1))
            out.append((key, value))
        return out

    def embed(self, latents: torch.Tensor) -> torch.Tensor:
        if not self.first:
            raise RuntimeError(f"slice {self.layers} is not the first slice and has no patch embedding")
        conv = self.model.patch_embedding
        latents = latents.to(self.dtype)
        # oneDNN picks its convolution algorithm by input shape, so a batched conv is not bit-identical to
        # per-item convs.  Embedding item by item keeps every micro-step's result independent of whatever
        # else shares its batch, which is what lets any batch schedule be compared exactly.
        hs = torch.cat([conv(latents[i : i + 1]) for i in range(latents.shape[0])], dim=0)
        return hs.flatten(2).transpose(1, 2).contiguous()

    def run_blocks(self, hidden_states: torch.Tensor, cond: Conditioning, ctx: AttentionContext) -> torch.Tensor:
        self._local.ctx = ctx
        try:
            for block in self.model.blocks:
                hidden_states = block(hidden_states, None, cond.timestep_proj, ctx.rotary)
        finally:
            self._local.ctx = None
        return hidden_states

    def current_context(self) -> AttentionContext:
        """The running forward's ``AttentionContext`` (inside ``run_blocks`` only)."""
        ctx = getattr(self._local, "ctx", None)
        if ctx is None:
            raise RuntimeError("slice attention called outside DiTSlice.run_blocks")
        return ctx

    @contextlib.contextmanager
    def attention_scope(self):
        """Where every SDPA of this slice runs (``_sdpa`` reads it): under ``attention_backends``, else under
        torch's own choice.  A context variable, so that a forward on another thread (a graph capture) has its own."""
        token = _SDPA_BACKENDS.set(self.attention_backends)
        try:
            yield
        finally:
            _SDPA_BACKENDS.reset(token)

    def self_attend(self, layer: int, query, key, value, ctx: AttentionContext) -> torch.Tensor:
        """Self-attention of slice-local ``layer`` on (B, L, H, Dh) q/k/v with RoPE applied: the items' KV window
        reads and writes, then one SDPA per group of equal windows (or per item, ``grouped_attention`` off)."""
        with self.attention_scope():
            return self._self_attend(layer, query, key, value, ctx)

    def _self_attend(self, layer: int, query, key, value, ctx: AttentionContext) -> torch.Tensor:
        if ctx.self_mask is not None or not ctx.self_kv:
            return _sdpa(query, key, value, ctx.self_mask).type_as(query)
        # KV reads and writes, item by item in batch order (read, then write), as each item's view expects.
        cached = []
        for b, kv in enumerate(ctx.self_kv):
            cached.append(kv.read(layer) if kv is not None else None)
            if kv is not None:
                kv.write(layer, key[b : b + 1], value[b : b + 1])
        if not self.grouped_attention:
            return attend_per_item(query, key, value, cached).type_as(query)
        in_place = in_place_reader(ctx.self_kv, layer) if self.kv_in_place else None
        return attend_grouped(query, key, value, cached, in_place).type_as(query)

    def cross_attend(self, layer: int, query, ctx: AttentionContext) -> torch.Tensor:
        """Cross-attention of slice-local ``layer``: (B, L, H, Dh) queries over each item's cached text K/V."""
        per_item = [item[layer] for item in ctx.cross_kv]
        key = torch.cat([k for k, _ in per_item], dim=0)
        value = torch.cat([v for _, v in per_item], dim=0)
        with self.attention_scope():
            return _sdpa(query, key, value).type_as(query)

    def head(self, hidden_states: torch.Tensor, cond: Conditioning, latent_shape: torch.Size) -> torch.Tensor:
        if not self.last:
            raise RuntimeError(f"slice {self.layers} is not the last slice and has no output head")
        m = self.model
        temb = cond.temb
        if temb.ndim == 3:
            shift, scale = (m.scale_shift_table.unsqueeze(0) + temb.unsqueeze(2)).chunk(2, dim=2)
            shift, scale = shift.squeeze(2), scale.squeeze(2)
        else:
            shift, scale = (m.scale_shift_table + temb.unsqueeze(1)).chunk(2, dim=1)
        hs = (m.norm_out(hidden_states.float()) * (1 + scale) + shift).type_as(hidden_states)
        hs = m.proj_out(hs)
        b, _, f, h, w = latent_shape
        p_t, p_h, p_w = self.config["patch_size"]
        hs = hs.reshape(b, f // p_t, h // p_h, w // p_w, p_t, p_h, p_w, -1)
        hs = hs.permute(0, 7, 1, 4, 2, 5, 3, 6)
        return hs.flatten(6, 7).flatten(4, 5).flatten(2, 3)

    def tokens_per_frame(self, height: int, width: int) -> int:
        _, p_h, p_w = self.config["patch_size"]
        return (height // p_h) * (width // p_w)


__all__ = [
    "AttentionContext",
    "Conditioning",
    "DiTSlice",
]
