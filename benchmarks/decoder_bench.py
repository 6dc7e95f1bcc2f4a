"""The decoder table: the tiny (TAEHV-design) decoder against the full Wan2.1 VAE, per chunk, at 1/4/8/16 streams.

Usage (one GPU; random weights of the real configs: 1.3B at 480x832, 60x104 latents, 16 channels)::

    python -m benchmarks.decoder_bench --compile --vae-batched --json benchmarks/results/decoder_bench.json
    python -m benchmarks.decoder_bench --smoke --json /tmp/decoder_smoke.json      # CPU, tiny sizes (a unit test)
    python -m benchmarks.report                                                    # the table into BENCHMARKS.md

A chunk is ``--latent-frames`` latent frames (default 1: 4 video frames) of each of N streams (``--streams``). Rows:

- ``tiny`` / ``eager`` (and ``compiled`` with ``--compile``: ``torch.compile`` of one latent frame's pass, compiled
  in the warm-up): the N streams' chunks in one ``TinyStreamDecoder.decode_batch`` call, as a gateway that batches
  its streams' decodes would; weights written by ``write_tiny_decoder`` in the published layout and read back by
  ``load_tiny_decoder`` (``--tiny-weights FILE``: the real ``taew2_1.pth`` instead), in ``--tiny-dtype``;
- ``wan-vae`` / ``per-stream``: ``StreamVAE.decode_chunk`` of each stream in turn, as the gateway decodes today (one
  call per stream; on one GPU the streams' decodes serialise whatever the threads), in ``--vae-dtype``; with
  ``--vae-compile`` also ``compiled per-stream`` (``StreamVAE(compile=True)``);
- ``wan-vae`` / ``batched`` (``--vae-batched``): the N streams in one decoder call, their caches stacked along the
  batch (``ChunkDecoder._step`` on an (N, ...) latent with one cache list), to see what batching would buy; a batch
  that runs out of GPU memory is recorded with ``error``.

Each row: ``chunk_ms`` (median over ``--iters`` chunk sets after ``--warmup``, every stream moving on by one chunk
each time: CUDA events on a GPU, wall time on a CPU), ``per_stream_ms`` (``chunk_ms / N``), ``fps`` (video frames of
all N streams per second of decoding), ``state_mib`` (one stream's carried state: the tiny decoder's MemBlock
memories, the VAE's causal-conv cache), ``peak_gib`` (``torch.cuda.max_memory_allocated`` while timing the row).
Tiny rows also say how exact they are, on a 3-chunk probe stream: ``batch_max_diff`` (max |stream decoded beside
N - 1 others - decoded alone|; 0 on a CPU by construction, rounding on a GPU where the batch is one convolution)
and ``max_diff_vs_eager`` (the compiled decoder against eager, both alone).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from diffusers import AutoencoderKLWan

from benchmarks.harness import git_commit
from gateway.decode.stream_vae import StreamVAE
from gateway.decode.tiny_decoder import load_tiny_decoder
from launcher.demo_checkpoint import write_tiny_decoder
from stagecast.model.vae_configs import spatial_factor, vae_config

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
MAX_STREAMS = 64


def time_ms(fn: Callable[[], object], device: torch.device) -> float:
    """One call of ``fn``: CUDA events around it on a GPU (waiting for the end event), wall time on a CPU."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def measure(fn: Callable[[], object], device: torch.device, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return statistics.median(time_ms(fn, device) for _ in range(iters))


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_gib(device: torch.device) -> float | None:
    return round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None


def row(
    decoder: str,
    variant: str,
    dtype: torch.dtype,
    streams: int,
    frames: int,
    ms: float,
    state_bytes: int,
    device,
    **extra,
):
    r = {
        "decoder": decoder,
        "variant": variant,
        "dtype": str(dtype).removeprefix("torch."),
        "streams": streams,
        "chunk_ms": round(ms, 3),
        "per_stream_ms": round(ms / streams, 3),
        "fps": round(streams * frames / (ms / 1e3), 1),
        "state_mib": round(state_bytes / 2**20, 2),
        "peak_gib": peak_gib(device),
        **extra,
    }
    print(json.dumps(r), flush=True)
    return r


def random_latents(channels: int, frames: int, hw, seed: int, device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(1, channels, frames, *hw, generator=gen).to(device)


def probe(decoder, hw, device, streams: int, chunks: int = 3) -> torch.Tensor:
    """Stream 0's video over ``chunks`` one-latent-frame chunks, decoded beside ``streams - 1`` others; stream 0's
    latents do not depend on ``streams``."""
    states = [decoder.new_state() for _ in range(streams)]
    outs = []
    for c in range(chunks):
        xs = [
            random_latents(decoder.latent_channels, 1, hw, 1000 + c * MAX_STREAMS + s, device) for s in range(streams)
        ]
        outs.append(decoder.decode_batch(states, xs)[0])
    for state in states:
        decoder.release(state)
    return torch.cat(outs, dim=2).float()


def tiny_rows(args, device: torch.device, hw) -> list[dict]:
    dtype = DTYPES[args.tiny_dtype]
    with tempfile.TemporaryDirectory() as tmp:
        path = args.tiny_weights or write_tiny_decoder(Path(tmp) / "taew2_1.pth", latent_channels=16)
        variants = [("eager", load_tiny_decoder(path, device=device, dtype=dtype))]
        if args.compile:
            variants.append(("compiled", load_tiny_decoder(path, device=device, dtype=dtype, compile=True)))
    rows = []
    frames = 4 * args.latent_frames
    eager_alone = probe(variants[0][1], hw, device, 1)
    for label, decoder in variants:
        alone = probe(decoder, hw, device, 1)
        for n in args.streams:
            states = [decoder.new_state() for _ in range(n)]
            xs = [random_latents(decoder.latent_channels, args.latent_frames, hw, s, device) for s in range(n)]
            reset_peak(device)
            t0 = time.perf_counter()
            ms = measure(lambda: decoder.decode_batch(states, xs), device, args.warmup, args.iters)  # noqa: B023
            if label == "compiled":
                print(f"tiny compiled, {n} streams: warm-up and timing took {time.perf_counter() - t0:.1f} s")
            state_bytes = states[0].approx_bytes
            for s in states:
                decoder.release(s)
            # exactness next to speed: a stream decoded beside n - 1 others against alone, and against eager
            diffs = dict(
                batch_max_diff=(probe(decoder, hw, device, n) - alone).abs().max().item(),
                max_diff_vs_eager=(alone - eager_alone).abs().max().item(),
            )
            rows.append(row("tiny", label, dtype, n, frames, ms, state_bytes, device, **diffs))
    return rows


def vae_warmup(args) -> int:
    """A stream's first two latent frames take the VAE's eager, cache-growing path: time from the third on (the
    smoke run only checks that every row runs)."""
    return args.warmup if args.smoke else max(args.warmup, 2)


def vae_rows(args, device: torch.device, size) -> list[dict]:
    dtype = DTYPES[args.vae_dtype]
    torch.manual_seed(0)
    vae = AutoencoderKLWan(**vae_config(args.vae)).to(device, dtype).eval().requires_grad_(False)
    sf = spatial_factor(vae.config)
    hw = (size[0] // sf, size[1] // sf)
    z = vae.config.z_dim
    frames = 4 * args.latent_frames
    rows = []
    variants = [("per-stream", StreamVAE(vae))]
    if args.vae_compile:
        variants.append(("compiled per-stream", StreamVAE(vae, compile=True)))
    for label, part in variants:
        for n in args.streams:
            states = [part.new_state() for _ in range(n)]
            xs = [random_latents(z, args.latent_frames, hw, s, device) for s in range(n)]

            def each(states=states, xs=xs, part=part):
                for state, x in zip(states, xs, strict=True):
                    part.decode_chunk(state, x)

            reset_peak(device)
            ms = measure(each, device, vae_warmup(args), args.iters)
            rows.append(row("wan-vae", label, dtype, n, frames, ms, states[0].approx_bytes, device))
            for state in states:
                part.release(state)
    if args.vae_batched:
        for n in args.streams:
            try:
                rows.append(vae_batched_row(args, variants[0][1], hw, n, device))
            except torch.OutOfMemoryError:
                rows.append({"decoder": "wan-vae", "variant": "batched", "streams": n, "error": "out of GPU memory"})
                print(json.dumps(rows[-1]), flush=True)
            reset_peak(device)  # the batch's cache went with vae_batched_row's frame
    return rows


def vae_batched_row(args, part: StreamVAE, hw, n: int, device: torch.device) -> dict:
    """The N streams' latent frames as one (N, ...) batch through the decoder, one cache list for all of them (each
    cached tensor then holds the N streams along its batch dimension)."""
    cache = [None] * part.num_slots
    x = torch.cat([random_latents(part.vae.config.z_dim, 1, hw, s, device) for s in range(n)]).to(part.dtype)
    x = x / part._inv_std + part._mean  # as decode_chunk prepares the DiT's latents
    first = [True]

    def batched():
        for _ in range(args.latent_frames):
            part._step(x, cache, first=first[0])
            first[0] = False

    reset_peak(device)
    ms = measure(batched, device, vae_warmup(args), args.iters)
    state = sum(t.numel() * t.element_size() for t in cache if isinstance(t, torch.Tensor)) // n
    return row("wan-vae", "batched", part.dtype, n, 4 * args.latent_frames, ms, state, device)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="480x832", help="video HxW (multiples of 8 for Wan2.1)")
    ap.add_argument("--latent-frames", type=int, default=1, help="latent frames per chunk (4 video frames each)")
    ap.add_argument("--streams", default="1,4,8,16", help="stream counts, comma-separated")
    ap.add_argument("--warmup", type=int, default=3, help="chunk sets before timing (compiles happen here)")
    ap.add_argument("--iters", type=int, default=10, help="timed chunk sets (median)")
    ap.add_argument("--tiny-dtype", choices=sorted(DTYPES), default="float16")
    ap.add_argument("--tiny-weights", default=None, help="a taew2_1 .pth/.safetensors instead of random weights")
    ap.add_argument("--compile", action="store_true", help="also the tiny decoder under torch.compile")
    ap.add_argument("--vae", default="wan2.1", help="the full VAE's config (stagecast.model.vae_configs)")
    ap.add_argument("--vae-dtype", choices=sorted(DTYPES), default="bfloat16")
    ap.add_argument("--vae-compile", action="store_true", help="also the full VAE compiled, per stream")
    ap.add_argument("--vae-batched", action="store_true", help="also the full VAE with N streams in one call")
    ap.add_argument("--no-vae", action="store_true", help="only the tiny decoder")
    ap.add_argument("--device", default=None, help="default: cuda:0 (--smoke: cpu)")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny sizes, 1 and 2 streams, fp32 (a test runs this)")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    try:
        size = tuple(int(v) for v in args.size.lower().split("x"))
        args.streams = [int(v) for v in args.streams.split(",")]
    except ValueError:
        ap.error("--size is HxW and --streams comma-separated integers")
    if len(size) != 2 or min(size) < 8 or max(size) > 4096 or size[0] % 8 or size[1] % 8:
        ap.error(f"--size must be HxW, multiples of 8 within 8..4096, got {args.size}")
    if not all(1 <= n <= MAX_STREAMS for n in args.streams):
        ap.error(f"--streams must be within 1..{MAX_STREAMS}")
    if not 1 <= args.latent_frames <= 16 or not 0 <= args.warmup <= 100 or not 1 <= args.iters <= 1000:
        ap.error("--latent-frames must be 1..16, --warmup 0..100 and --iters 1..1000")
    if args.smoke:
        size, args.streams, args.warmup, args.iters = (8, 8), [1, 2], 0, 1
        args.vae, args.tiny_dtype, args.vae_dtype, args.vae_batched = "tiny-wan2.1", "float32", "float32", True
        args.compile = args.vae_compile = False
        device = torch.device(args.device or "cpu")
    else:
        device = torch.device(args.device or "cuda:0")
        if device.type == "cuda" and not torch.cuda.is_available():
            print("decoder_bench: needs a CUDA GPU (or --smoke, or --device cpu)", file=sys.stderr)
            return 2
    hw = (size[0] // 8, size[1] // 8)
    result = {
        "bench": "decoder",
        "when": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "size": f"{size[0]}x{size[1]}",
        "latent_hw": list(hw),
        "latent_frames": args.latent_frames,
        "vae": None if args.no_vae else args.vae,
        "command": " ".join(["python -m benchmarks.decoder_bench", *(argv if argv is not None else sys.argv[1:])]),
        "rows": [],
    }

    def save() -> None:  # after every part: a run cut short by its time limit keeps what it measured
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(result, indent=1) + "\n")

    with torch.no_grad():
        result["rows"] += tiny_rows(args, device, hw)
        save()
        if not args.no_vae:
            result["rows"] += vae_rows(args, device, size)
            save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
