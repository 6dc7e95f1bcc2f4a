"""UMT5 prompt embeddings for the gateway, computed exactly as diffusers' Wan pipelines do.

Usage::

    encoder = TextEncoder("/models/Wan2.1-T2V-1.3B-Diffusers", cache_size=256)
    embeds = encoder.encode("a red fox running through snow")  # (1, 512, 4096), padded rows are zero
    encoder.stats  # CacheStats(hits=..., misses=..., size=..., capacity=...)

The folder is laid out like the Wan diffusers repos (``text_encoder/`` and ``tokenizer/`` subfolders)
or is a single folder holding both the model and the tokenizer files.  ``encode`` reproduces
``WanPipeline._get_t5_prompt_embeds`` (diffusers 0.42) step for step, with one deliberate difference:
diffusers silently truncates a prompt longer than ``max_sequence_length`` while we reject it with a
``ValueError`` naming the ``prompt`` field, which the gateway maps to INVALID_ARGUMENT.

Results are kept in an LRU cache keyed by the cleaned prompt, bounded in entries (``cache_size``) and in bytes
(``cache_bytes``, the embeddings' own: 4 MiB a prompt at UMT5-XXL's 512 x 4096 in bf16), so a repeated prompt costs
no forward pass.  Cached tensors are shared between callers: treat them as read-only.

**Bursts are encoded in batches.**  Callers that miss the cache at the same time (a burst of streams opening, each
on its own gRPC thread) share forwards: one caller at a time runs the encoder, on every prompt queued when it starts
(up to ``batch_max``), and the others wait for it, so N prompts arriving together cost one or two batched forwards
instead of N one after the other.  A prompt already being encoded is not queued twice.  Nothing waits on purpose:
a lone prompt runs at once, alone.  On a CPU a batched encode equals the one-by-one encodes bit for bit
(``tests/test_text_encoder.py``); on a GPU cuBLAS picks kernels by shape, so a prompt encoded in a batch may differ
from the same prompt encoded alone in the last bits (the stages and the reference get the same embeddings, so the
pipeline's exactness is untouched).

**Short prompts run short.**  Every prompt is padded to ``max_len`` tokens, as diffusers pads it, but the encoder
runs on the first L of them only: L the smallest of 64, 128, 256, ... ``max_len`` that holds the batch's longest
prompt (``run_lengths``).  The padding is masked out of every attention, so the rows of the real tokens are the same
function of them either way, and the rows past them are zeros in the output whatever was run; only the summation
order inside a kernel may change with L, so on a GPU an embedding may differ in the last bits from a full-length
encode, as a batched one may (on the CPU they were equal in every case tested).  A 30-token prompt then costs an
eighth of a 512-token forward: a burst of 7 took about 255 ms at full length on an H200 (2026-12-03).

``graph=`` (a ``stagecast.cuda_graphs`` capture; the gateway passes ``cuda_graph_capture`` on a GPU) runs the forward
as captured graphs on static token buffers, one per batch size and run length: sizes 1, 2, 4, ... up to
``batch_max`` at each length of ``run_lengths`` (one memory pool); a batch of n runs the smallest graph of at least
n rows at its length, its spare rows empty (an all-zero mask) and dropped.  A burst's batch ran
eagerly before: 7 prompts took about 275 ms on an H200, where one prompt's graph takes about 40 ms (2026-12-03).
UMT5-XXL is hundreds of small kernels, each launched from Python: in a gateway whose decode and encode
threads hold the GIL, every launch can wait a switch interval (5 ms), the suspected cause of prompt updates that took
seconds on a busy gateway (BENCHMARKS.md).  A replay is one launch.  The graph is checked against the eager forward
once when it is built; a capture that fails or differs leaves the encoder eager (a warning says why).

Tests and the CPU demo have no model hub; ``launcher.demo_checkpoint.write_tiny_text_encoder`` writes a tiny random
UMT5 encoder and a tokenizer built in-process (a fixed Unigram vocabulary, no download, no training) that
``AutoTokenizer.from_pretrained`` loads like the real one.
"""

from __future__ import annotations

import html
import json
import logging
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from stagecast.cuda_graphs import Capture
from stagecast.names import DTYPE_NAMES, DTYPES

try:
    # diffusers' prompt_clean uses the third-party `regex` module; its `\s` differs from `re`'s on a few
    # control characters (U+001C..U+001F), so use the same engine to match it byte for byte.
    import regex as _re
except ImportError:  # pragma: no cover - regex ships with transformers
    import re as _re

try:
    import ftfy  # diffusers applies ftfy.fix_text when it is installed; so must we to stay identical.
except ImportError:
    ftfy = None

logger = logging.getLogger(__name__)

DEFAULT_MAX_LEN = 512  # WanPipeline.__call__'s max_sequence_length; the Wan DiT was trained with 512 text tokens.
DEFAULT_CACHE_BYTES = 1 << 30  # 256 prompts of UMT5-XXL embeddings (4 MiB each)
DEFAULT_BATCH_MAX = 16  # prompts in one batched forward at most
MIN_RUN_LEN = 64  # the shortest token length a forward runs at (see "Short prompts run short")

# A text_encoder/config.json with this key set true and no weights: the encoder is built with random weights on the
# device (``launcher.demo_checkpoint.write_random_text_encoder``; benchmarks of the real-size UMT5-XXL).
RANDOM_WEIGHTS_KEY = "stagecast_random_weights"

__all__ = [
    "DEFAULT_BATCH_MAX",
    "DEFAULT_CACHE_BYTES",
    "DEFAULT_MAX_LEN",
    "RANDOM_WEIGHTS_KEY",
    "CacheStats",
    "TextEncoder",
    "prompt_clean",
]


def prompt_clean(text: str) -> str:
    """Same as ``diffusers.pipelines.wan.pipeline_wan.prompt_clean``: ftfy, double html unescape, squeeze spaces."""
    if ftfy is not None:
        text = ftfy.fix_text(text)
    text = html.unescape(html.unescape(text))
    text = text.strip()
    text = _re.sub(r"\s+", " ", text)
    return text.strip()


@dataclass(frozen=True)
class CacheStats:
    """Snapshot of the embedding cache counters."""

    hits: int
    misses: int
    size: int
    capacity: int


def _resolve(folder: Path, sub: str) -> Path:
    # Wan diffusers repos keep each component in its own subfolder; a flat folder holding everything also works.
    candidate = folder / sub
    return candidate if candidate.is_dir() else folder


def text_dtype(name: str | None, device: str | torch.device) -> torch.dtype:
    """``--text-dtype``: a named dtype, or ``auto`` (None): bfloat16 on a GPU, float32 on CPU.

    The official UMT5-XXL config says float32 (about 23 GB, and twice the encode time of bfloat16), which is what
    ``dtype="auto"`` would load; Wan's own pipelines run it in bfloat16."""
    if name in (None, "auto"):
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if name not in DTYPE_NAMES:
        raise ValueError(f"--text-dtype must be auto or one of {', '.join(DTYPE_NAMES)}, got {name!r}")
    return DTYPES[name]


def _dtype_kwargs(dtype: torch.dtype | str | None) -> dict:
    # transformers renamed `torch_dtype` to `dtype` in 4.56; the old name still works there but warns.  "auto" keeps
    # the checkpoint's dtype (bf16 for Wan), which is also what diffusers does when it loads the pipeline.
    import transformers

    major, minor = (int(p) for p in transformers.__version__.split(".")[:2])
    key = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"
    return {key: "auto" if dtype is None else dtype}


class _Pending:
    """A prompt queued for the next batched forward; ``done`` is set once ``embeds`` or ``error`` is."""

    def __init__(self, cleaned: str):
        self.cleaned = cleaned
        self.done = threading.Event()
        self.embeds: torch.Tensor | None = None
        self.error: BaseException | None = None


class TextEncoder:
    """UMT5 encoder + tokenizer with an LRU cache of prompt embeddings.

    Args:
        folder: model folder (see module docstring).
        max_len: ``max_sequence_length``; the output is always ``(1, max_len, d_model)``.
        cache_size: how many prompts to keep; 0 disables caching.
        cache_bytes: how many bytes of embeddings to keep at most (the least recently used go first).
        batch_max: prompts one batched forward takes at most (see the module docstring).
        min_run_len: the shortest token length a forward runs at (``run_lengths``; ``max_len``: always full length).
        device: where the model runs.  The embeddings are returned on the CPU (they travel to the coordinator as
            bytes).  On a GPU the forward and that copy run on a high-priority CUDA stream of the encoder's own, so an
            encode waits for the encoder alone: on the default stream it queued behind every VAE decode the gateway's
            decode threads had launched, and the copy to the CPU waited for all of them.
        dtype: model dtype; ``None`` keeps the checkpoint's dtype.
        graph: capture the forward (see the module docstring); ``None``: eager.
    """

    def __init__(
        self,
        folder: str | os.PathLike,
        *,
        max_len: int = DEFAULT_MAX_LEN,
        cache_size: int = 128,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        batch_max: int = DEFAULT_BATCH_MAX,
        min_run_len: int = MIN_RUN_LEN,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
        graph: Capture | None = None,
    ) -> None:
        from transformers import AutoTokenizer, UMT5EncoderModel

        if max_len < 1:
            raise ValueError(f"max_len must be >= 1, got {max_len}")
        if cache_size < 0:
            raise ValueError(f"cache_size must be >= 0, got {cache_size}")
        if cache_bytes < 0:
            raise ValueError(f"cache_bytes must be >= 0, got {cache_bytes}")
        if batch_max < 1:
            raise ValueError(f"batch_max must be >= 1, got {batch_max}")
        if min_run_len < 1:
            raise ValueError(f"min_run_len must be >= 1, got {min_run_len}")
        folder = Path(folder)
        if not folder.is_dir():
            raise FileNotFoundError(f"text encoder folder not found: {folder}")

        self.max_len = int(max_len)
        self.cache_size = int(cache_size)
        self.cache_bytes_max = int(cache_bytes)
        self.batch_max = int(batch_max)
        self.run_lengths = run_lengths(self.max_len, int(min_run_len))
        self.tokenizer = AutoTokenizer.from_pretrained(_resolve(folder, "tokenizer"))
        model_folder = _resolve(folder, "text_encoder")
        config_file = model_folder / "config.json"
        if config_file.exists() and json.loads(config_file.read_text()).get(RANDOM_WEIGHTS_KEY):
            # Benchmarks: a real-size encoder (UMT5-XXL is 5.7B parameters) with random weights, built on the device
            # (writing and reading 11 GB of random weights would take longer than the benchmark).
            from transformers import UMT5Config

            config = UMT5Config.from_pretrained(model_folder)
            with torch.device(device):
                self.model = UMT5EncoderModel(config).to(dtype or torch.bfloat16)
        else:
            self.model = UMT5EncoderModel.from_pretrained(model_folder, **_dtype_kwargs(dtype))
        self.model.to(device).eval().requires_grad_(False)
        self.device = torch.device(device)
        self.dtype = self.model.dtype
        self.d_model = int(self.model.config.d_model)

        self._cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._lock = threading.Lock()  # gRPC handlers call encode from a thread pool
        self._bytes = 0  # the cache's embeddings
        self._queue: list[_Pending] = []  # prompts waiting for the next batched forward
        self._pending: dict[str, _Pending] = {}  # queued or being encoded, by cleaned prompt
        self._forward_lock = threading.Lock()  # held by the one caller running a batched forward
        # A fast tokenizer is not safe across threads: each call sets its padding and truncation on the one Rust
        # tokenizer it wraps, so a count (no padding) racing a batch (padded to max_len) yields ragged batches.
        self._tokenizer_lock = threading.Lock()
        self.batches: list[int] = []  # the size of every batched forward so far (tests, benchmarks)
        self._graphed: _GraphedBatches | None = None
        self._stream = torch.cuda.Stream(self.device, priority=-1) if self.device.type == "cuda" else None
        if graph is not None:
            self._graphed = _GraphedBatches.build(self.model, self.run_lengths, self.device, graph, self.batch_max)
        self._hits = 0
        self._misses = 0
        if self.device.type == "cuda" and self.batch_max > 1 and self._graphed is None:
            # A burst's first batched forward made the caching allocator grow by the batch's activations and paid
            # cuBLAS's first calls at its shapes: about 0.45 s for 11 prompts on an H200, with every stream of the
            # burst waiting (2026-12-03).  Pay it here, at start-up, at the largest batch (of the shortest run
            # length).  Graphs need none: capturing each shape ran it, and a replay allocates nothing.
            self._embed_many(["warm-up"] * self.batch_max)
        logger.info(
            "text encoder loaded from %s: d_model=%d max_len=%d dtype=%s device=%s cache_size=%d",
            folder,
            self.d_model,
            self.max_len,
            self.dtype,
            self.device,
            self.cache_size,
        )

    @property
    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(self._hits, self._misses, len(self._cache), self.cache_size)

    @property
    def cache_bytes(self) -> int:
        """Bytes of embeddings the cache holds now."""
        with self._lock:
            return self._bytes

    def count_tokens(self, prompt: str) -> int:
        """Tokens the prompt takes after cleaning, including the end-of-sequence token."""
        return self._count_cleaned(prompt_clean(prompt))

    def _count_cleaned(self, cleaned: str) -> int:
        with self._tokenizer_lock:
            ids = self.tokenizer(cleaned, add_special_tokens=True, truncation=False, verbose=False)
        return len(ids["input_ids"])

    def encode(self, prompt: str) -> torch.Tensor:
        """Embed one prompt: ``(1, max_len, d_model)`` in the model dtype, rows past the prompt's tokens zeroed.

        Raises ``ValueError`` (naming the ``prompt`` field) for a non-string, empty, or over-long prompt.
        """
        return self.encode_cached(prompt)[0]

    def encode_cached(self, prompt: str, *, allow_empty: bool = False) -> tuple[torch.Tensor, bool]:
        """``encode`` and whether the embeddings came from the cache (no forward pass).  ``allow_empty``: an empty
        prompt is embedded as diffusers embeds one (a negative prompt may be empty)."""
        if not isinstance(prompt, str):
            raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
        cleaned = prompt_clean(prompt)
        if not cleaned and not allow_empty:
            raise ValueError("prompt must not be empty (or only whitespace)")

        # Key on the cleaned text: prompts that clean to the same string tokenize identically.
        with self._lock:
            cached = self._cache.get(cleaned)
            if cached is not None:
                self._cache.move_to_end(cleaned)
                self._hits += 1
                return cached, True
            self._misses += 1

        n_tokens = self._count_cleaned(cleaned)
        if n_tokens > self.max_len:
            # diffusers would truncate silently and the video would ignore the tail of the prompt; say so instead.
            raise ValueError(
                f"prompt is too long: {n_tokens} tokens (including the end-of-sequence token), "
                f"the limit is {self.max_len}"
            )

        return self._encode_batched(cleaned)

    def _encode_batched(self, cleaned: str) -> tuple[torch.Tensor, bool]:
        """A cache miss: queue the prompt (once) and run batched forwards until it is done."""
        with self._lock:
            pending = self._pending.get(cleaned)
            shared = pending is not None  # another caller's forward computes it
            if pending is None:
                pending = self._pending[cleaned] = _Pending(cleaned)
                self._queue.append(pending)
        while not pending.done.is_set():
            with self._forward_lock:  # one forward at a time; a caller that waited finds its prompt done, or runs
                if not pending.done.is_set():
                    self._run_batch()
        if pending.error is not None:
            raise pending.error
        assert pending.embeds is not None
        return pending.embeds, shared

    def _run_batch(self) -> None:
        """Encode every queued prompt (up to ``batch_max``) in one forward; called under ``_forward_lock``."""
        with self._lock:
            batch, self._queue = self._queue[: self.batch_max], self._queue[self.batch_max :]
        if not batch:
            return
        try:
            embeds = self._embed_many([p.cleaned for p in batch])  # outside the lock: hits need not wait
        except BaseException as exc:  # noqa: BLE001 - every waiter of this batch sees it
            for p in batch:
                p.error = exc
        else:
            for p, e in zip(batch, embeds):
                p.embeds = e
        with self._lock:
            self.batches.append(len(batch))
            for p in batch:
                self._pending.pop(p.cleaned, None)
                if p.embeds is not None:
                    self._remember(p.cleaned, p.embeds)
        for p in batch:
            p.done.set()

    def _remember(self, cleaned: str, embeds: torch.Tensor) -> None:
        """Into the LRU cache (under ``_lock``), evicting the least recently used past either bound."""
        size = embeds.numel() * embeds.element_size()
        if not self.cache_size or size > self.cache_bytes_max:
            return
        old = self._cache.pop(cleaned, None)
        if old is not None:
            self._bytes -= old.numel() * old.element_size()
        self._cache[cleaned] = embeds
        self._bytes += size
        while len(self._cache) > self.cache_size or self._bytes > self.cache_bytes_max:
            _, gone = self._cache.popitem(last=False)
            self._bytes -= gone.numel() * gone.element_size()

    @torch.no_grad()
    def _embed_many(self, cleaned: list[str]) -> list[torch.Tensor]:
        """``(1, max_len, d_model)`` CPU embeddings of each prompt, from one forward."""
        with torch.cuda.stream(self._stream):  # None (a CPU encoder): the current stream
            embeds = self._embed_on_stream(cleaned).to("cpu")  # waits for this stream only
        return [embeds[i : i + 1].clone() for i in range(len(cleaned))] if len(cleaned) > 1 else [embeds]

    def _embed_on_stream(self, cleaned: list[str]) -> torch.Tensor:
        # Mirrors diffusers WanPipeline._get_t5_prompt_embeds for already cleaned prompts (its batch is a list too).
        max_sequence_length = self.max_len
        with self._tokenizer_lock:
            text_inputs = self.tokenizer(
                cleaned,
                padding="max_length",
                max_length=max_sequence_length,
                truncation=True,
                add_special_tokens=True,
                return_attention_mask=True,
                return_tensors="pt",
            )
        text_input_ids, mask = text_inputs.input_ids, text_inputs.attention_mask
        seq_lens = mask.gt(0).sum(dim=1).long()
        # Run on the first L tokens only (the padding is on the right, masked out of every attention).
        run_len = next(n for n in self.run_lengths if n >= int(seq_lens.max()))
        text_input_ids, mask = text_input_ids[:, :run_len].contiguous(), mask[:, :run_len].contiguous()

        if self._graphed is not None:  # the graph of the smallest captured batch that holds these prompts
            prompt_embeds = self._graphed(text_input_ids, mask)
        else:
            prompt_embeds = self.model(text_input_ids.to(self.device), mask.to(self.device)).last_hidden_state
        prompt_embeds = prompt_embeds.to(dtype=self.dtype, device=self.device)
        # The encoder still writes values at padded positions; the Wan DiT expects exact zeros there.
        rows = [u[:v] for u, v in zip(prompt_embeds, seq_lens)]
        return torch.stack(
            [torch.cat([u, u.new_zeros(max_sequence_length - u.size(0), u.size(1))]) for u in rows], dim=0
        )


def run_lengths(max_len: int, min_run_len: int = MIN_RUN_LEN) -> list[int]:
    """The token lengths a forward runs at: ``min_run_len``, twice that, ... below ``max_len``, and ``max_len``."""
    lengths, n = [], min_run_len
    while n < max_len:
        lengths.append(n)
        n *= 2
    return [*lengths, max_len]


def graph_sizes(batch_max: int) -> list[int]:
    """The batch sizes the encoder captures: 1, 2, 4, ... below ``batch_max``, and ``batch_max``."""
    sizes, b = [], 1
    while b < batch_max:
        sizes.append(b)
        b *= 2
    return [*sizes, batch_max]


class _GraphedForward:
    """The encoder's forward on static ``(batch, length)`` token and mask buffers, captured once; calls are
    serialized (one set of buffers)."""

    def __init__(self, model, batch: int, length: int, device: torch.device, capture: Capture):
        self.model = model
        self.batch = batch
        self.ids = torch.zeros(batch, length, dtype=torch.long, device=device)
        self.mask = torch.zeros(batch, length, dtype=torch.long, device=device)
        self.out: torch.Tensor | None = None
        self.lock = threading.Lock()
        self.replay = capture(self._forward)

    @torch.no_grad()
    def _forward(self) -> None:
        out = self.model(self.ids, self.mask).last_hidden_state
        if self.out is None:
            self.out = out  # the capture's output buffer: a replay writes into it
        else:
            self.out.copy_(out)

    def __call__(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The first ``len(ids)`` rows' embeddings (a copy); the buffers' other rows are emptied first."""
        n = ids.shape[0]
        with self.lock:
            self.ids[:n].copy_(ids)
            self.mask[:n].copy_(mask)
            if n < self.batch:
                self.ids[n:].zero_()
                self.mask[n:].zero_()
            self.replay()
            assert self.out is not None
            return self.out[:n].clone()


class _GraphedBatches:
    """One ``_GraphedForward`` per batch size of ``graph_sizes`` and run length; a batch runs on the smallest that
    holds it, at its length."""

    def __init__(self, graphs: dict[tuple[int, int], _GraphedForward]):
        self.graphs = dict(sorted(graphs.items()))

    @classmethod
    def build(
        cls, model, lengths: list[int], device: torch.device, capture: Capture, batch_max: int = 1
    ) -> _GraphedBatches | None:
        """The graphed forwards, each checked bit for bit against the eager forward at its own shape on a probe; None
        (eager) when one cannot be captured or differs."""
        graphs: dict[tuple[int, int], _GraphedForward] = {}
        try:
            for length in lengths:
                for b in graph_sizes(batch_max):
                    ids = torch.zeros(b, length, dtype=torch.long)
                    mask = torch.zeros(b, length, dtype=torch.long)
                    ids[0, :3] = torch.tensor([5, 7, 1])  # a few tokens and the padding the tokenizer adds
                    mask[0, :3] = 1
                    if b > 1:  # a second prompt of another length; the rest are empty rows, as a short batch pads
                        ids[1, : min(5, length)] = torch.tensor([9, 4, 6, 8, 1])[: min(5, length)]
                        mask[1, : min(5, length)] = 1
                    graphed = graphs[(b, length)] = _GraphedForward(model, b, length, device, capture)
                    with torch.no_grad():
                        eager = model(ids.to(device), mask.to(device)).last_hidden_state
                    got = graphed(ids, mask)
                    if not torch.equal(got, eager):
                        diff = (got.float() - eager.float()).abs().max().item()
                        logger.warning(
                            "text encoder: the graphed forward of %d prompts at %d tokens differs from the eager one "
                            "(max %.3g); eager",
                            b,
                            length,
                            diff,
                        )
                        return None
        except Exception as exc:  # noqa: BLE001 - any capture failure leaves the encoder eager
            logger.warning("text encoder: the forward could not be captured as a graph (%s); it runs eagerly", exc)
            return None
        logger.info(
            "text encoder: the forward runs as captured graphs (batches of %s prompts at %s tokens)",
            ", ".join(map(str, graph_sizes(batch_max))),
            ", ".join(map(str, lengths)),
        )
        return cls(graphs)

    def __call__(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        n, length = ids.shape
        graph = next((g for (b, L), g in self.graphs.items() if b >= n and L == length), None)
        if graph is None:  # never more than batch_max prompts, nor a length not in run_lengths, reach a forward
            raise ValueError(f"{n} prompts of {length} tokens in one forward: no graph holds them")
        return graph(ids, mask)
