"""Full-sequence oracles for the streaming semantics: diffusers' own model with a masked self-attention.

A block-causal mask can be evaluated two ways:
  * ``dense``: one SDPA call over all keys with a boolean mask;
  * ``blockwise``: for each query chunk, SDPA over exactly the keys the mask allows, in sequence order.
Both are the same mathematical function.  They differ in float rounding because a GEMM's accumulation
order depends on the reduction length (12 masked zeros change the SIMD partial sums), so only the
blockwise form can be compared bit for bit with a KV-cached stream; the dense form is checked to 1e-6.
Everything else (projections, norms, RoPE at absolute positions, FFN, head) runs as one full-sequence
diffusers forward either way.
"""

import torch
import torch.nn.functional as F
from diffusers.models.transformers.transformer_wan import WanAttnProcessor, _get_qkv_projections

from stage_service.dit_slice import apply_rotary_emb
from stagecast.microstep import StreamSpec, context_frames


class MaskedSelfAttnProcessor(WanAttnProcessor):
    """diffusers' WanAttnProcessor with a boolean (L, L) mask on self-attention."""

    def __init__(self, mask, blockwise):
        super().__init__()
        self.mask = mask
        self.blockwise = blockwise

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        if not self.blockwise:
            return super().__call__(attn, hidden_states, encoder_hidden_states, self.mask, rotary_emb)
        query, key, value = _get_qkv_projections(attn, hidden_states, None)
        query = attn.norm_q(query).unflatten(2, (attn.heads, -1))
        key = attn.norm_k(key).unflatten(2, (attn.heads, -1))
        value = value.unflatten(2, (attn.heads, -1))
        query = apply_rotary_emb(query, *rotary_emb)
        key = apply_rotary_emb(key, *rotary_emb)
        out = torch.empty_like(query)
        rows = self.mask
        start = 0
        while start < rows.shape[0]:
            end = start + 1
            while end < rows.shape[0] and torch.equal(rows[end], rows[start]):
                end += 1
            keys = rows[start].nonzero().flatten()
            o = F.scaled_dot_product_attention(
                query[:, start:end].transpose(1, 2), key[:, keys].transpose(1, 2), value[:, keys].transpose(1, 2)
            )
            out[:, start:end] = o.transpose(1, 2)
            start = end
        out = out.flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out))


class ChunkwisePatchEmbedding(torch.nn.Module):
    """The model's own Conv3d applied one chunk of frames at a time, as a stream feeds it.

    The patch kernel spans one frame, so this is the same function; it only pins the conv algorithm oneDNN
    picks (which depends on the input's frame count) to the one the streaming path uses.
    """

    def __init__(self, conv, chunk_frames):
        super().__init__()
        self.conv = conv
        self.chunk_frames = chunk_frames

    def forward(self, x):
        n = self.chunk_frames
        return torch.cat([self.conv(x[:, :, f : f + n]) for f in range(0, x.shape[2], n)], dim=2)


def chunkwise_patch_embedding(model, chunk_frames):
    conv = model.patch_embedding.conv if isinstance(model.patch_embedding, ChunkwisePatchEmbedding) else None
    model.patch_embedding = ChunkwisePatchEmbedding(conv or model.patch_embedding, chunk_frames)


def set_self_mask(model, mask, blockwise=True):
    for block in model.blocks:
        block.attn1.set_processor(MaskedSelfAttnProcessor(mask, blockwise) if mask is not None else WanAttnProcessor())


def frame_mask(spec: StreamSpec, num_chunks: int, tokens_per_frame: int, rope_limit: int = 1024) -> torch.Tensor:
    """Boolean (L, L) mask over chunks 0..num_chunks-1: each chunk sees itself and its KV window."""
    fpc = spec.chunk_frames
    frames = num_chunks * fpc
    allowed = torch.zeros(frames, frames, dtype=torch.bool)
    for c in range(num_chunks):
        own = range(c * fpc, (c + 1) * fpc)
        visible = list(context_frames(spec, c, rope_limit)) + list(own)
        for q in own:
            allowed[q, visible] = True
    return allowed.repeat_interleave(tokens_per_frame, 0).repeat_interleave(tokens_per_frame, 1)
