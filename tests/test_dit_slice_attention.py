"""Grouped self-attention (``DiTSlice.grouped_attention``): items of a Stream Batch with equal KV context lengths run
one batched SDPA, and that equals the per-item loop bit for bit, KV reads and writes included."""

from __future__ import annotations

import json
import threading

import pytest
import torch

from launcher.reference import ReferenceExecutor, StreamRequest
from stage_service.dit_slice import AttentionContext, DiTSlice, _sdpa
from stage_service.parallel_state import ThreadSequenceGroup
from stagecast.microstep import StreamSpec

pytestmark = pytest.mark.unit

# (heads, head_dim, query tokens, context lengths): the tiny test models (2 x 12), and head_dim 128 with the heads
# of Wan2.1-1.3B (12) and 14B (40).  Query lengths cross the CPU flash kernel's query-block sizes (32 / 64 / 256
# for < 192 / < 768 / >= 768 queries) and contexts its 512-key blocks, so every blocking the models meet is hit.
SHAPES = [
    (2, 12, 24, (0, 24, 72, 144)),
    (12, 128, 200, (0, 200, 600)),
    (40, 128, 64, (0, 384)),
    (3, 128, 800, (0, 1600)),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads,head_dim,tokens,contexts", SHAPES)
def test_batched_sdpa_equals_per_item_sdpa_bit_for_bit(dtype, heads, head_dim, tokens, contexts):
    gen = torch.Generator().manual_seed(heads * 1000 + tokens)
    for context in contexts:
        q = torch.randn(4, tokens, heads, head_dim, generator=gen).to(dtype)
        k = torch.randn(4, context + tokens, heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(4, context + tokens, heads, head_dim, generator=gen).to(dtype)
        single = [_sdpa(q[b : b + 1], k[b : b + 1], v[b : b + 1]) for b in range(4)]
        for batch in (2, 3, 4):
            stacked = _sdpa(q[:batch], k[:batch], v[:batch])
            for b in range(batch):
                assert torch.equal(stacked[b : b + 1], single[b]), (
                    f"{dtype} heads={heads} head_dim={head_dim} tokens={tokens} context={context} B={batch} item {b}: "
                    f"{(stacked[b : b + 1].float() - single[b].float()).abs().max().item():.3e}"
                )


class _RecordingKV:
    """A KV view with a fixed cached context per layer that logs every read and write (into a shared log)."""

    def __init__(self, item, log, cached, writes=True):
        self.item, self.log, self.cached, self.writes = item, log, cached, writes
        self.written = {}

    def read(self, layer):
        self.log.append(("read", self.item, layer))
        return None if self.cached is None else self.cached[layer]

    def write(self, layer, key, value):
        self.log.append(("write", self.item, layer))
        if self.writes:
            self.written[layer] = (key.clone(), value.clone())


# Per item: cached context frames (None: no cache view at all; 0: a view with nothing cached yet).  Items 0, 2 and 5
# share a context length but are not adjacent; 3 and 4 are adjacent with one length; item 1 attends only to itself.
MIXED = [2, None, 2, 1, 1, 2, 0]


def _mixed_forward(sl, contexts, dtype, sp=None, sp_rank=0):
    gen = torch.Generator().manual_seed(3)
    heads, dim = sl.config["num_attention_heads"], sl.config["attention_head_dim"]
    frames, height, width = 1, 4, 6
    tokens = sl.tokens_per_frame(height, width) * frames
    batch = len(contexts)
    hidden = torch.randn(batch, tokens, sl.inner_dim, generator=gen).to(dtype)
    text = torch.randn(batch, 7, sl.config["text_dim"], generator=gen)
    local_heads = heads // (sp.size if sp else 1)
    log, views = [], []
    for b, frames_b in enumerate(contexts):
        if frames_b is None:
            views.append(None)
            continue
        cached = None
        if frames_b:
            shape = (1, frames_b * tokens, local_heads, dim)
            cached = [
                (torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype))
                for _ in range(sl.num_layers)
            ]
        views.append(_RecordingKV(b, log, cached, writes=b % 2 == 0))
    offsets = [frames_b or 0 for frames_b in contexts]
    ctx_text = sl.embed_text(text)
    ctx = AttentionContext(
        rotary=sl.rotary(frames, height, width, offsets),
        cross_kv=[sl.cross_kv(ctx_text[b : b + 1]) for b in range(batch)],
        self_kv=views,
    )
    if sp is not None:
        ctx.sp = sp
        shard = tokens // sp.size
        hidden = hidden[:, sp_rank * shard : (sp_rank + 1) * shard]
    cond = sl.condition(torch.linspace(900.0, 100.0, batch), tokens=hidden.shape[1])
    out = sl.run_blocks(hidden, cond, ctx)
    return out, log, [None if v is None else v.written for v in views]


def _assert_same(a, b):
    out_a, log_a, writes_a = a
    out_b, log_b, writes_b = b
    assert torch.equal(out_a, out_b), (out_a.float() - out_b.float()).abs().max()
    assert log_a == log_b  # the same reads and writes, in the same order
    assert len(writes_a) == len(writes_b)
    for wa, wb in zip(writes_a, writes_b):
        assert (wa is None) == (wb is None)
        if wa is not None:
            assert wa.keys() == wb.keys()
            for layer in wa:
                assert all(torch.equal(x, y) for x, y in zip(wa[layer], wb[layer]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "contexts",
    [MIXED, [2, 2, 2], [None, None, None], [3, 3, None, 1]],
    ids=["mixed", "equal", "no-cache", "one-group-and-rest"],
)
def test_grouped_forward_equals_per_item_forward_and_writes_the_same_kv(tiny_model, dtype, contexts):
    model = tiny_model().to(dtype)
    sl = DiTSlice.from_model(model, layers=range(4), first=True, last=True)
    grouped = _mixed_forward(sl, contexts, dtype)
    sl.grouped_attention = False
    per_item = _mixed_forward(sl, contexts, dtype)
    _assert_same(grouped, per_item)
    writers = [b for b, c in enumerate(contexts) if c is not None and b % 2 == 0]
    assert all(len(grouped[2][b]) == sl.num_layers for b in writers)


def test_grouped_forward_equals_per_item_forward_under_sequence_parallelism(tiny_model):
    model = tiny_model(num_attention_heads=4)
    sl = DiTSlice.from_model(model, layers=range(4), first=True, last=True)
    results: dict[tuple[bool, int], tuple] = {}
    errors: list[BaseException] = []

    def rank(groups, grouped, r):
        try:
            results[grouped, r] = _mixed_forward(sl, MIXED, torch.float32, sp=groups[r], sp_rank=r)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
            groups[r].abort()

    # ``grouped_attention`` lives on the shared slice, so the two runs go one after the other.
    for grouped in (True, False):
        sl.grouped_attention = grouped
        groups = ThreadSequenceGroup.create(2)
        threads = [threading.Thread(target=rank, args=(groups, grouped, r)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
    for r in range(2):
        _assert_same(results[True, r], results[False, r])


def test_reference_stream_batch_is_the_same_with_and_without_grouped_attention(tiny_model):
    """Whole streams through the reference executor: Stream Batch of 3 streams (warm-up batches mix context lengths,
    steady-state ones share the full window) gives the same chunks either way."""
    model = tiny_model()
    gen = torch.Generator().manual_seed(5)
    requests = []
    for i in range(3):
        spec = StreamSpec(
            stream_id=i,
            latent_channels=model.config.in_channels,
            chunk_frames=1,
            latent_height=4,
            latent_width=6,
            timesteps=(1000.0, 500.0),
            num_chunks=5,
            text_len=7,
            seed=i,
            window=3,
            sink=1,
        )
        requests.append(StreamRequest(spec, torch.randn(1, 7, model.config.text_dim, generator=gen), i))
    chunks = {}
    for grouped in (True, False):
        full = DiTSlice.from_model(model, layers=range(4), first=True, last=True)
        full.grouped_attention = grouped
        ref = ReferenceExecutor(full)
        try:
            chunks[grouped] = ref.generate(requests, num_stages=2, max_batch=3).chunks
        finally:
            ref.close()
    assert chunks[True].keys() == chunks[False].keys() == {0, 1, 2}
    for sid in chunks[True]:
        assert len(chunks[True][sid]) == 5
        assert all(torch.equal(a, b) for a, b in zip(chunks[True][sid], chunks[False][sid]))


def test_attention_check_smoke_mode_times_both_modes_and_finds_them_equal_on_cpu(tmp_path, capsys):
    from benchmarks import attention_check

    out = tmp_path / "attention.json"
    assert attention_check.main(["--smoke", "--batches", "1,2", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["device"] == "cpu" and result["dtype"] == "float32"
    (model,) = result["models"]
    assert model["model"] == "tiny-wan2.1" and model["layers"] == [0, 2]
    assert model["batches"].keys() == {"1", "2"}
    for row in model["batches"].values():
        assert row["tokens"] == 6 and row["context_tokens"] == 18
        for mode in ("per_item", "grouped", "in_place"):
            entry = row["modes"][mode]
            assert entry["graphs_captured"] == 1 and entry["graph_failure"] is None
            assert entry["graphed_vs_eager_max_abs"] == 0.0
            assert entry["eager"]["median_ms"] > 0 and entry["graphed"]["iters"] == 2
        assert row["grouped_vs_per_item_max_abs_eager"] == row["grouped_vs_per_item_max_abs_graphed"] == 0.0
        assert row["in_place_vs_grouped_max_abs_graphed"] == 0.0 and row["speedup_in_place_graphed"] > 0
        assert row["attention_only"]["grouped_vs_per_item_max_abs"] == 0.0
        assert row["speedup_eager"] > 0 and row["attention_only"]["speedup"] > 0
        copies = row["kv_copies"]
        # K and V, 2 layers, per item: 18 context tokens x 2 heads x 12 head dim (tiny) x 4 bytes (float32).
        batch = int(next(b for b, r in model["batches"].items() if r is row))
        assert copies["window_bytes"] == 2 * 2 * batch * 18 * 2 * 12 * 4
        assert copies["read_into"]["iters"] == 2 and copies["attention_cat_graphed"]["median_ms"] > 0
        assert copies["share_of_graphed_forward"] > 0
    out = capsys.readouterr().out
    assert "tiny-wan2.1 x2 layers batch 2: eager per_item" in out and "window copies per forward" in out


def test_attention_check_refuses_bad_batches_naming_the_flag(capsys):
    from benchmarks import attention_check

    with pytest.raises(SystemExit):
        attention_check.main(["--smoke", "--batches", "0,2"])
    assert "--batches: integers from 1 to 16" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        attention_check.main(["--smoke", "--batches", "x"])
    assert "--batches: comma-separated positive integers" in capsys.readouterr().err
