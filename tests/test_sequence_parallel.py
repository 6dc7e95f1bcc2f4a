"""Sequence parallelism (Ulysses, ``--sp``): the shard layout in one process, its bound against the unsharded
model, and the start-up errors.  The distributed runs (gloo, real processes) are ``tests/test_sequence_parallel_
distributed.py``."""

from __future__ import annotations

import threading

import pytest
import torch

from launcher.reference import ReferenceExecutor, StreamRequest
from stage_service.dit_slice import DiTSlice
from stage_service.parallel_state import ThreadSequenceGroup
from stagecast.microstep import StreamSpec
from stagecast.model.parallel import LayoutError, ParallelLayout, check_gpus, check_sp

pytestmark = pytest.mark.unit

# The stated bound of a sharded forward against the unsharded one, fp32: sharding changes the shapes of the
# sequence-wise GEMMs and of the cross-attention, which round differently (measured: 0 at sp=2 and 4.8e-7 at
# sp=4 on these tiny models, whose outputs reach |x| ~ 4).  Exactness is held against the sharded reference.
SHARDED_VS_UNSHARDED_FP32 = 2e-6


def _requests(model, height=4, width=8, streams=2, chunks=4):
    gen = torch.Generator().manual_seed(7)
    out = []
    for i in range(streams):
        spec = StreamSpec(
            stream_id=i,
            latent_channels=model.config.in_channels,
            chunk_frames=1,
            latent_height=height,
            latent_width=width,
            timesteps=(1000.0, 600.0),
            num_chunks=chunks,
            text_len=16,
            seed=i,
            window=3,
            sink=1,
        )
        out.append(StreamRequest(spec, torch.randn(1, 16, model.config.text_dim, generator=gen), i))
    return out


def _generate(model, sp, **kw):
    full = DiTSlice.from_model(model, layers=range(model.config.num_layers), first=True, last=True)
    ref = ReferenceExecutor(full, sp=sp)
    try:
        return ref.generate(_requests(model, **kw), num_stages=2, max_batch=3).chunks
    finally:
        ref.close()


@pytest.mark.parametrize("name", ["tiny-wan2.1", "tiny-wan2.2-ti2v"])
def test_sharded_reference_is_repeatable_and_within_the_bound_of_the_unsharded_model(tiny_model, name):
    model = tiny_model(name, num_attention_heads=4)
    unsharded = _generate(model, 1)
    for sp in (2, 4):
        sharded = _generate(model, sp)
        again = _generate(model, sp)
        assert sharded.keys() == unsharded.keys()
        worst = 0.0
        for sid, want in unsharded.items():
            assert len(sharded[sid]) == len(want) == 4
            for got, w, g2 in zip(sharded[sid], want, again[sid]):
                assert torch.equal(got, g2), "the sharded reference must be a deterministic function of its plan"
                worst = max(worst, (got - w).abs().max().item())
        assert worst <= SHARDED_VS_UNSHARDED_FP32, f"sp={sp}: {worst:.3e} over the stated bound"


def test_a_chunk_whose_tokens_do_not_split_is_refused(tiny_model):
    model = tiny_model(num_attention_heads=4)
    with pytest.raises(ValueError, match=r"6 tokens, which do not split into 4 sequence shards \(--sp\)"):
        _generate(model, 4, width=6, streams=1, chunks=1)


def test_thread_group_all_to_all_and_all_gather_move_data_by_rank():
    groups = ThreadSequenceGroup.create(3)
    out: dict[int, tuple] = {}

    def rank(r):
        sent = [torch.full((2,), 10.0 * r + j) for j in range(3)]
        out[r] = (groups[r].all_to_all(sent), groups[r].all_gather(torch.tensor([float(r)])))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for r in range(3):
        received, gathered = out[r]
        assert [x[0].item() for x in received] == [10.0 * src + r for src in range(3)]
        assert [x.item() for x in gathered] == [0.0, 1.0, 2.0]


def test_layout_and_start_up_checks_name_the_flag():
    layout = ParallelLayout(pipeline=2, sp=2)
    assert layout.world_size == 4 and layout.stage_of(3) == 1 and layout.sp_rank_of(3) == 1
    assert layout.sequence_ranks(1) == [2, 3]
    check_sp(2, heads=12)
    with pytest.raises(LayoutError, match=r"--sp 5: the model has 12 attention heads"):
        check_sp(5, heads=12)
    check_gpus(2, 2, gpus=4)
    with pytest.raises(LayoutError, match=r"--stages 2 × --sp 2 = 4 ranks, but 2 GPU\(s\) were given"):
        check_gpus(2, 2, gpus=2)
    with pytest.raises(LayoutError, match="--sp must be >= 1"):
        ParallelLayout(pipeline=1, sp=0)
