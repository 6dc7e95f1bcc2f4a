"""TextEncoder matches diffusers' Wan prompt recipe, caches, validates; the tiny offline model is deterministic."""

from __future__ import annotations

import json
import shutil
import types
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, UMT5EncoderModel

from gateway.text_encoder import CacheStats, TextEncoder, prompt_clean
from launcher.demo_checkpoint import write_tiny_text_encoder

pytestmark = pytest.mark.unit

MAX_LEN = 16
D_MODEL = 32

PROMPTS = [
    "A cat on the moon, slow motion",
    "  a red fox\trunning\n\nthrough   snow  ",
    "fish &amp;amp; chips &lt;3 at the beach",  # double html unescape in prompt_clean
    "Zoe-42 in 日本",  # characters outside the tiny vocabulary become <unk>
]


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    return write_tiny_text_encoder(tmp_path_factory.mktemp("umt5"), d_model=D_MODEL)


@pytest.fixture(scope="module")
def reference(tiny_folder):
    """The same checkpoint loaded directly with transformers, independent of TextEncoder."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_folder / "tokenizer")
    model = UMT5EncoderModel.from_pretrained(tiny_folder / "text_encoder").eval()
    return tokenizer, model


@pytest.fixture()
def encoder(tiny_folder) -> TextEncoder:
    return TextEncoder(tiny_folder, max_len=MAX_LEN, cache_size=4)


def _diffusers_recipe(tokenizer, text_encoder, prompt: str, max_sequence_length: int) -> torch.Tensor:
    # Written out from diffusers 0.42.1 WanPipeline._get_t5_prompt_embeds, using diffusers' own prompt_clean.
    from diffusers.pipelines.wan.pipeline_wan import prompt_clean as diffusers_prompt_clean

    prompt = [diffusers_prompt_clean(prompt)]
    text_inputs = tokenizer(
        prompt,
        padding="max_length",
        max_length=max_sequence_length,
        truncation=True,
        add_special_tokens=True,
        return_attention_mask=True,
        return_tensors="pt",
    )
    ids, mask = text_inputs.input_ids, text_inputs.attention_mask
    seq_lens = mask.gt(0).sum(dim=1).long()
    with torch.no_grad():
        embeds = text_encoder(ids, mask).last_hidden_state.to(dtype=text_encoder.dtype)
    embeds = [u[:v] for u, v in zip(embeds, seq_lens)]
    return torch.stack([torch.cat([u, u.new_zeros(max_sequence_length - u.size(0), u.size(1))]) for u in embeds])


@pytest.mark.parametrize("prompt", PROMPTS)
def test_matches_manual_diffusers_recipe(reference, encoder, prompt):
    tokenizer, model = reference
    expected = _diffusers_recipe(tokenizer, model, prompt, MAX_LEN)

    got = encoder.encode(prompt)
    assert got.shape == (1, MAX_LEN, D_MODEL)
    assert got.dtype == torch.float32
    assert torch.equal(got, expected)

    n = len(tokenizer(prompt_clean(prompt))["input_ids"])
    assert n < MAX_LEN  # the prompts leave padding, so the zeroing is exercised
    assert got[0, n:].abs().sum() == 0
    assert (got[0, :n].abs().sum(dim=-1) > 0).all()


def test_matches_diffusers_pipeline_method(encoder):
    # Call the real WanPipeline._get_t5_prompt_embeds with a stand-in `self` holding our tokenizer and model.
    from diffusers.pipelines.wan.pipeline_wan import WanPipeline

    fake_pipe = types.SimpleNamespace(
        tokenizer=encoder.tokenizer, text_encoder=encoder.model, _execution_device=torch.device("cpu")
    )
    for prompt in PROMPTS:
        expected = WanPipeline._get_t5_prompt_embeds(fake_pipe, prompt=prompt, max_sequence_length=MAX_LEN)
        assert torch.equal(encoder.encode(prompt), expected)


def test_prompt_clean_matches_diffusers():
    from diffusers.pipelines.wan.pipeline_wan import prompt_clean as diffusers_prompt_clean

    for text in PROMPTS + ["\u00a0nbsp\u2003em space\x1cfile sep ", "&amp;lt;b&amp;gt;", "   ", ""]:
        assert prompt_clean(text) == diffusers_prompt_clean(text)


def test_flat_folder_layout(tiny_folder, tmp_path, encoder):
    flat = tmp_path / "flat"
    shutil.copytree(tiny_folder / "text_encoder", flat)
    shutil.copytree(tiny_folder / "tokenizer", flat, dirs_exist_ok=True)
    flat_encoder = TextEncoder(flat, max_len=MAX_LEN)
    assert torch.equal(flat_encoder.encode(PROMPTS[0]), encoder.encode(PROMPTS[0]))


def test_repeat_prompt_hits_cache_without_forward(encoder, monkeypatch):
    first = encoder.encode("a dog in the rain")
    assert encoder.stats == CacheStats(hits=0, misses=1, size=1, capacity=4)

    def no_forward(*args, **kwargs):
        raise AssertionError("cache hit must not run the model")

    monkeypatch.setattr(encoder.model, "forward", no_forward)
    assert encoder.encode("a dog in the rain") is first
    # Same text after prompt_clean -> same tokens -> same cache entry.
    assert encoder.encode("  a dog   in the\train ") is first
    assert encoder.stats == CacheStats(hits=2, misses=1, size=1, capacity=4)


def test_cache_is_bounded_lru(tiny_folder):
    enc = TextEncoder(tiny_folder, max_len=MAX_LEN, cache_size=2)
    enc.encode("a")
    enc.encode("b")
    enc.encode("a")  # a becomes most recent, so c evicts b
    enc.encode("c")
    assert enc.stats == CacheStats(hits=1, misses=3, size=2, capacity=2)
    enc.encode("a")
    assert enc.stats.hits == 2
    enc.encode("b")
    assert enc.stats.misses == 4
    assert enc.stats.size == 2


def test_cache_disabled(tiny_folder):
    enc = TextEncoder(tiny_folder, max_len=MAX_LEN, cache_size=0)
    a, b = enc.encode("a cat"), enc.encode("a cat")
    assert a is not b and torch.equal(a, b)
    assert enc.stats == CacheStats(hits=0, misses=2, size=0, capacity=0)


@pytest.mark.parametrize("bad", ["", "   \n\t ", None, 42])
def test_empty_or_non_string_prompt_names_field(encoder, bad):
    with pytest.raises(ValueError, match=r"^prompt "):
        encoder.encode(bad)


def test_length_limit_counts_eos_and_names_field(encoder):
    # Each "cat" is one token in the tiny vocabulary, plus </s>.
    fits = " ".join(["cat"] * (MAX_LEN - 1))
    assert encoder.count_tokens(fits) == MAX_LEN
    out = encoder.encode(fits)
    assert out[0, -1].abs().sum() > 0  # no padding left

    too_long = fits + " cat"
    with pytest.raises(ValueError, match=rf"^prompt is too long: {MAX_LEN + 1} tokens .* limit is {MAX_LEN}"):
        encoder.encode(too_long)
    assert encoder.stats.size == 1  # rejected prompts are not cached


def test_tiny_tokenizer_is_t5_like(tiny_folder):
    tok = AutoTokenizer.from_pretrained(tiny_folder / "tokenizer")
    assert (tok.pad_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2)
    ids = tok("the cat")["input_ids"]
    assert tok.convert_ids_to_tokens(ids) == ["\u2581the", "\u2581cat", "</s>"]
    # Unknown words fall back to characters rather than <unk>.
    assert tok.decode(tok("Qwzx 123")["input_ids"], skip_special_tokens=True) == "Qwzx 123"


def _folder_bytes(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_write_tiny_is_deterministic_and_keeps_rng(tmp_path):
    torch.manual_seed(123)
    state = torch.random.get_rng_state()
    a = _folder_bytes(write_tiny_text_encoder(tmp_path / "a", seed=7))
    assert torch.equal(torch.random.get_rng_state(), state)
    b = _folder_bytes(write_tiny_text_encoder(tmp_path / "b", seed=7))
    c = _folder_bytes(write_tiny_text_encoder(tmp_path / "c", seed=8))
    assert set(a) == {
        "text_encoder/config.json",
        "text_encoder/model.safetensors",
        "tokenizer/tokenizer.json",
        "tokenizer/tokenizer_config.json",
    }
    assert a == b
    assert a["text_encoder/model.safetensors"] != c["text_encoder/model.safetensors"]
    assert a["tokenizer/tokenizer.json"] == c["tokenizer/tokenizer.json"]


def test_missing_folder(tmp_path):
    with pytest.raises(FileNotFoundError):
        TextEncoder(tmp_path / "nope")


def test_a_random_weight_encoder_is_built_where_it_loads_from_its_config_alone(tmp_path):
    from gateway.text_encoder import RANDOM_WEIGHTS_KEY
    from launcher.demo_checkpoint import write_random_text_encoder

    # The real UMT5-XXL's shape but small, so it builds on a CPU: a config and a tokenizer, no weight files.
    write_random_text_encoder(tmp_path, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, vocab_size=1000)
    files = sorted(p.name for p in (tmp_path / "text_encoder").iterdir())
    assert files == ["config.json"]
    assert json.loads((tmp_path / "text_encoder" / "config.json").read_text())[RANDOM_WEIGHTS_KEY] is True
    enc = TextEncoder(tmp_path, max_len=16, dtype=torch.float32)
    out = enc.encode("a red fox")
    assert out.shape == (1, 16, 64) and out.dtype == torch.float32 and torch.isfinite(out).all()
    assert out[0, :4].abs().sum() > 0  # real tokens carry values (the tail is zeroed padding)
    with pytest.raises(ValueError, match="vocab_size=10 is smaller"):
        write_random_text_encoder(tmp_path / "x", vocab_size=10)


def test_text_dtype_defaults_to_bf16_on_gpu_and_fp32_on_cpu():
    from gateway.text_encoder import text_dtype

    assert text_dtype("auto", "cuda:1") == torch.bfloat16 and text_dtype(None, "cuda") == torch.bfloat16
    assert text_dtype("auto", "cpu") == torch.float32
    assert text_dtype("float16", "cpu") == torch.float16
    with pytest.raises(ValueError, match="--text-dtype"):
        text_dtype("int8", "cpu")


def test_text_encoder_loads_in_the_asked_dtype_and_reports_cache_hits(tmp_path):
    from gateway.text_encoder import TextEncoder
    from launcher.demo_checkpoint import write_tiny_text_encoder

    write_tiny_text_encoder(tmp_path, d_model=32)
    enc = TextEncoder(tmp_path, max_len=16, dtype=torch.bfloat16)
    assert enc.dtype == torch.bfloat16 and next(enc.model.parameters()).dtype == torch.bfloat16
    first, cached = enc.encode_cached("a red fox")
    again, cached_again = enc.encode_cached("a red fox")
    assert (cached, cached_again) == (False, True) and again is first and first.dtype == torch.bfloat16


def test_gateway_flags_and_prompt_encode_metric():
    from gateway.metrics import GatewayMetrics
    from launcher.cli import build_parser

    args = build_parser().parse_args(
        ["gateway", "--coordinator", "h:1", "--checkpoint", "c", "--text-dtype", "bfloat16", "--text-device", "cpu"]
    )
    assert (args.text_dtype, args.text_device) == ("bfloat16", "cpu")
    metrics = GatewayMetrics(active=lambda: 0, vae_bytes=lambda: 0)
    metrics.prompt_encoded(0.2, cached=False)
    metrics.prompt_encoded(0.0001, cached=True)
    r = metrics.registry
    assert r.get_sample_value("stagecast_gateway_prompt_encode_seconds_count", {"cached": "false"}) == 1
    assert r.get_sample_value("stagecast_gateway_prompt_encode_seconds_sum", {"cached": "false"}) == 0.2
    assert r.get_sample_value("stagecast_gateway_prompt_encode_seconds_count", {"cached": "true"}) == 1


def test_the_graphed_forward_equals_the_eager_one_and_serves_concurrent_callers(tiny_folder, caplog):
    # On the CPU the "graph" re-runs the forward on the same static buffers (rerun_capture), so this holds all but the
    # capture itself: one static (1, max_len) token buffer serves every prompt, and calls from gRPC threads at once
    # each get their own prompt's embeddings.
    import threading

    from stagecast.cuda_graphs import rerun_capture

    eager = TextEncoder(tiny_folder, max_len=MAX_LEN, cache_size=0)
    with caplog.at_level("INFO", logger="gateway.text_encoder"):
        graphed = TextEncoder(tiny_folder, max_len=MAX_LEN, cache_size=0, graph=rerun_capture)
    assert graphed._graphed is not None and "captured graphs" in caplog.text
    for prompt in PROMPTS:
        assert torch.equal(graphed.encode(prompt), eager.encode(prompt))
    want = {p: eager.encode(p) for p in PROMPTS}
    got: dict[tuple[int, str], torch.Tensor] = {}

    def worker(i: int) -> None:
        for _ in range(3):
            for p in PROMPTS:
                got[(i, p)] = graphed.encode(p)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 4 * len(PROMPTS) and all(torch.equal(v, want[p]) for (_, p), v in got.items())
    first = graphed.encode(PROMPTS[0])
    graphed.encode(PROMPTS[1])
    assert torch.equal(first, want[PROMPTS[0]])  # a result is a copy: the next replay does not overwrite it


def test_a_graph_that_cannot_be_captured_or_differs_leaves_the_encoder_eager(tiny_folder, caplog):
    from stagecast.cuda_graphs import rerun_capture

    eager = TextEncoder(tiny_folder, max_len=MAX_LEN, cache_size=0)

    def broken(fn):
        raise RuntimeError("operation not permitted when stream is capturing")

    def wrong(fn):
        replay = rerun_capture(fn)

        def bad() -> None:
            replay()
            fn.__self__.out.add_(1.0)  # a replay that does not reproduce the forward

        return bad

    for capture, says in ((broken, "could not be captured"), (wrong, "differs from the eager one")):
        caplog.clear()
        with caplog.at_level("WARNING", logger="gateway.text_encoder"):
            enc = TextEncoder(tiny_folder, max_len=MAX_LEN, cache_size=0, graph=capture)
        assert enc._graphed is None and says in caplog.text
        assert torch.equal(enc.encode(PROMPTS[0]), eager.encode(PROMPTS[0]))


def _queue_while_held(enc: TextEncoder, prompts: list[str]) -> dict[str, tuple[torch.Tensor, bool]]:
    """Encode ``prompts`` from one thread each while the test holds the forward, then let the first waiter run: the
    burst a gateway sees when streams open together."""
    import threading
    import time

    got: dict[str, tuple[torch.Tensor, bool]] = {}
    threads = [threading.Thread(target=lambda p=p: got.__setitem__(p, enc.encode_cached(p))) for p in prompts]
    with enc._forward_lock:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while len(enc._queue) < len(set(map(prompt_clean, prompts))) and time.monotonic() < deadline:
            time.sleep(0.001)  # polls a condition (every caller queued), with a deadline
    for t in threads:
        t.join(30)
    return got


def test_a_burst_of_prompts_is_one_batched_forward_equal_to_one_by_one_encodes(tiny_folder):
    alone = TextEncoder(tiny_folder, max_len=MAX_LEN, cache_size=0)
    want = {p: alone.encode(p) for p in PROMPTS}
    assert alone.batches == [1] * len(PROMPTS)
    enc = TextEncoder(tiny_folder, max_len=MAX_LEN, cache_size=16)
    got = _queue_while_held(enc, PROMPTS)
    assert enc.batches == [len(PROMPTS)]  # one forward for the whole burst
    for p in PROMPTS:
        embeds, cached = got[p]
        assert embeds.shape == (1, MAX_LEN, D_MODEL) and not cached
        assert torch.equal(embeds, want[p])  # bit for bit, each prompt as if encoded alone
    assert enc.stats == CacheStats(hits=0, misses=len(PROMPTS), size=len(PROMPTS), capacity=16)


def test_a_burst_past_batch_max_takes_more_forwards_and_a_repeated_prompt_is_encoded_once(tiny_folder):
    enc = TextEncoder(tiny_folder, max_len=MAX_LEN, cache_size=16, batch_max=3)
    prompts = [*PROMPTS, PROMPTS[0], "one more prompt"]  # the repeat cleans to a prompt already queued
    got = _queue_while_held(enc, prompts)
    assert sorted(enc.batches) == [2, 3] and sum(enc.batches) == len(set(prompts))
    assert got[PROMPTS[0]][0] is enc.encode(PROMPTS[0])  # the cached entry, shared
    with pytest.raises(ValueError, match="batch_max must be >= 1"):
        TextEncoder(tiny_folder, max_len=MAX_LEN, batch_max=0)


def test_the_cache_is_bounded_in_bytes_and_evicts_the_least_recently_used(tiny_folder):
    one = MAX_LEN * D_MODEL * 4  # a float32 (1, 16, 32) embedding
    enc = TextEncoder(tiny_folder, max_len=MAX_LEN, cache_size=100, cache_bytes=2 * one + one // 2)
    a = enc.encode("a")
    enc.encode("b")
    assert enc.cache_bytes == 2 * one and enc.stats.size == 2
    assert enc.encode("a") is a  # a hit, and now the most recent
    enc.encode("c")  # past the bytes: b, the least recently used, goes
    assert enc.cache_bytes == 2 * one and enc.stats.size == 2
    assert enc.encode("a") is a
    enc.encode("b")  # encoded again
    assert enc.stats.misses == 4 and enc.stats.hits == 2
    tiny = TextEncoder(tiny_folder, max_len=MAX_LEN, cache_size=100, cache_bytes=one - 1)  # smaller than one
    first = tiny.encode("a")
    assert tiny.encode("a") is not first and tiny.cache_bytes == 0 and tiny.stats.size == 0


def test_counting_and_batched_misses_from_many_threads_never_race_on_the_tokenizer(tiny_folder):
    # A fast tokenizer keeps its padding and truncation on the one Rust tokenizer it wraps: a count (no padding) from
    # one gRPC thread racing a padded batch from another gave ragged batches ("Unable to create tensor").  Every miss
    # here counts and then joins a batch, so without the tokenizer's lock this fails within a few hundred calls.
    import threading

    enc = TextEncoder(tiny_folder, max_len=MAX_LEN, cache_size=0)
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            for k in range(150):
                enc.encode(f"prompt {i} {k} x")
                enc.count_tokens(f"a count {i} {k}")
        except BaseException as exc:  # noqa: BLE001 - the test reports it
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert sum(enc.batches) == 8 * 150  # every miss was embedded once


def test_a_burst_on_the_graphed_encoder_runs_the_smallest_graph_that_holds_it_equal_to_one_by_one(tiny_folder):
    # 3 prompts run the graph of 4 (spare row empty and dropped), 5 the graph of batch_max 5: sizes 1, 2, 4 and 5.
    from gateway.text_encoder import graph_sizes
    from stagecast.cuda_graphs import rerun_capture

    assert graph_sizes(1) == [1] and graph_sizes(5) == [1, 2, 4, 5] and graph_sizes(16) == [1, 2, 4, 8, 16]
    alone = TextEncoder(tiny_folder, max_len=MAX_LEN, cache_size=0)
    prompts = [*PROMPTS, "a fifth prompt"]
    want = {p: alone.encode(p) for p in prompts}
    enc = TextEncoder(tiny_folder, max_len=MAX_LEN, cache_size=0, batch_max=5, graph=rerun_capture)
    assert enc._graphed is not None and list(enc._graphed.graphs) == [(b, MAX_LEN) for b in (1, 2, 4, 5)]
    replays: list[int] = []

    def counted(replay, size: int):
        def run() -> None:
            replays.append(size)
            replay()

        return run

    for (b, _), g in enc._graphed.graphs.items():
        g.replay = counted(g.replay, b)
    for burst in (prompts[:3], prompts):
        replays.clear()
        got = _queue_while_held(enc, burst)
        assert replays == [4 if len(burst) == 3 else 5]  # one replay, of the smallest graph that holds the burst
        for p in burst:
            assert got[p][0].shape == (1, MAX_LEN, D_MODEL) and torch.equal(got[p][0], want[p])


def test_short_prompts_run_at_the_shortest_length_that_holds_them_and_equal_a_full_length_encode(tiny_folder):
    from gateway.text_encoder import run_lengths
    from stagecast.cuda_graphs import rerun_capture

    assert run_lengths(512) == [64, 128, 256, 512] and run_lengths(16) == [16] and run_lengths(100, 32) == [32, 64, 100]
    full = TextEncoder(tiny_folder, max_len=64, cache_size=0, min_run_len=64)
    short = TextEncoder(tiny_folder, max_len=64, cache_size=0, min_run_len=16, graph=rerun_capture)
    assert short.run_lengths == [16, 32, 64] and short._graphed is not None
    ran: list[tuple[int, ...]] = []
    short.model.register_forward_pre_hook(lambda _m, args: ran.append(tuple(args[0].shape)))
    long_prompt = "a cat and a dog on the moon in slow motion at the beach with fish and chips"  # past 16 tokens
    for prompt in [*PROMPTS, long_prompt]:
        ran.clear()
        got = short.encode(prompt)
        n = short.count_tokens(prompt)
        assert got.shape == (1, 64, D_MODEL) and torch.equal(got, full.encode(prompt))
        assert ran == [(1, 16 if n <= 16 else 32)]  # the graph replay runs the model at the run length
        assert not got[0, n:].any()  # the rows past the prompt are zeros, as at full length
    with pytest.raises(ValueError, match="min_run_len must be >= 1"):
        TextEncoder(tiny_folder, max_len=64, min_run_len=0)
