"""A chain of DiT slices computes exactly what diffusers' WanTransformer3DModel computes."""

import pytest
import torch

from stage_service.dit_slice import AttentionContext, DiTSlice
from stagecast.model.partition import parse_partition, partition_ranges

pytestmark = pytest.mark.unit


def run_slices(slices, latents, timestep, text):
    first, last = slices[0], slices[-1]
    b, _, f, h, w = latents.shape
    hs = first.embed(latents)
    for sl in slices:
        cond = sl.condition(timestep, tokens=hs.shape[1])
        ctx_text = sl.embed_text(text)
        cross = [sl.cross_kv(ctx_text[i : i + 1]) for i in range(b)]
        ctx = AttentionContext(rotary=sl.rotary(f, h, w, [0] * b), cross_kv=cross)
        hs = sl.run_blocks(hs, cond, ctx)
    return last.head(hs, cond, latents.shape)


@pytest.mark.parametrize("name", ["tiny-wan2.1", "tiny-wan2.2-ti2v"])
@pytest.mark.parametrize("partition", ["4", "2,2", "1,3", "3,1", "1,2,1", "1,1,1,1"])
def test_slices_in_order_equal_diffusers_forward(tiny_model, name, partition):
    model = tiny_model(name)
    cfg = model.config
    counts = parse_partition(partition, cfg.num_layers)
    ranges = partition_ranges(counts)
    slices = [
        DiTSlice.from_model(model, layers=r, first=i == 0, last=i == len(ranges) - 1) for i, r in enumerate(ranges)
    ]
    g = torch.Generator().manual_seed(1)
    latents = torch.randn(1, cfg.in_channels, 3, 4, 6, generator=g)
    text = torch.randn(1, 7, cfg.text_dim, generator=g)
    t = torch.tensor([750.0])
    if name == "tiny-wan2.2-ti2v":
        ref_t = t[:, None].expand(1, 3 * 2 * 3)  # the pipeline's expand_timesteps path: (B, L)
    else:
        ref_t = t
    expected = model(latents, ref_t, text, return_dict=False)[0]
    got = run_slices(slices, latents, t, text)
    assert got.shape == expected.shape
    assert torch.equal(got, expected), (got - expected).abs().max()


def test_bad_partitions_are_rejected_with_a_clear_error():
    with pytest.raises(ValueError, match="sums to 5 layers but the model has 4"):
        parse_partition("2,3", 4)
    with pytest.raises(ValueError, match="fewer than 1 layer"):
        parse_partition("4,0", 4)
    with pytest.raises(ValueError, match="comma-separated integers"):
        parse_partition("2;2", 4)
    with pytest.raises(ValueError, match="has 2 stages but 3 were requested"):
        parse_partition("2,2", 4, 3)
    with pytest.raises(ValueError, match="cannot split 4 layers into 5 stages"):
        parse_partition(None, 4, 5)
    assert parse_partition(None, 30, 4) == [8, 8, 7, 7]


def test_a_host_timesteps_conditioning_comes_from_a_cache_by_value_with_the_same_bits(tiny_model, monkeypatch):
    from stage_service import dit_slice

    model = tiny_model()
    sl = DiTSlice.from_model(model, layers=range(model.config.num_layers), first=True, last=True)
    # What the uncached path computes: each item alone, in the slice's dtype.
    want = [sl._condition(torch.tensor([t]), 1) for t in (700.0, 500.0, 700.0)]
    cond = sl.condition(torch.tensor([700.0, 500.0, 700.0]), tokens=16)
    assert torch.equal(cond.temb, torch.cat([w.temb for w in want]))
    assert torch.equal(cond.timestep_proj, torch.cat([w.timestep_proj for w in want]))
    assert len(sl._conditions) == 2  # one per value
    one = sl.condition(torch.tensor([700.0]), tokens=16)
    assert one is sl.condition(torch.tensor([700.0]), tokens=16)  # the cache's, not computed again
    assert torch.equal(one.temb, want[0].temb)
    # Bounded: past CONDITION_CACHE values it starts over rather than grow.
    monkeypatch.setattr(dit_slice, "CONDITION_CACHE", 2)
    sl.condition(torch.tensor([300.0]), tokens=16)
    assert len(sl._conditions) == 1


@pytest.mark.parametrize("name", ["tiny-wan2.1", "tiny-wan2.2-ti2v"])
def test_rotary_tables_are_diffusers_full_sequence_tables_sliced_at_each_items_offset(tiny_model, name):
    """A batch's RoPE tables: item i's rows are what diffusers' WanRotaryPosEmbed gives the whole video, sliced at
    item i's frame offset; every item has its own table, also where offsets agree; an offset past the rope's length
    is refused by name."""
    model = tiny_model(name)
    sl = DiTSlice.from_model(model, layers=range(0, 1), first=True, last=True)
    p_t, p_h, p_w = model.config.patch_size
    frames, height, width = 2 * p_t, 4 * p_h, 3 * p_w  # a chunk of 2 latent frames of 4 x 3 patches
    tpf = 4 * 3
    whole = torch.zeros(1, model.config.in_channels, 12 * p_t, height, width)
    full_cos, full_sin = model.rope(whole)  # (1, 12 * tpf, 1, D)
    offsets = [0, 7, 3, 7, 10]
    cos, sin = sl.rotary(frames, height, width, offsets)
    assert cos.shape == (len(offsets), 2 * tpf, 1, full_cos.shape[-1]) and sin.shape == cos.shape
    for i, f0 in enumerate(offsets):
        assert torch.equal(cos[i], full_cos[0, f0 * tpf : (f0 + 2) * tpf])
        assert torch.equal(sin[i], full_sin[0, f0 * tpf : (f0 + 2) * tpf])
    one_cos, one_sin = sl.rotary(frames, height, width, [7])
    assert torch.equal(one_cos[0], cos[1]) and torch.equal(one_sin[0], sin[3])
    with pytest.raises(ValueError, match="rope_max_seq_len"):
        sl.rotary(frames, height, width, [0, model.rope.max_seq_len - 1])
