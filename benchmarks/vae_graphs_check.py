"""GPU check of ``--vae-cuda-graphs``: the streaming VAE decode eager, compiled, graphed and compiled+graphed.

Usage (one GPU; random weights of the real configs, bf16)::

    python -m benchmarks.vae_graphs_check --json benchmarks/results/vae_graphs_check.json
    python -m benchmarks.vae_graphs_check --smoke --json /tmp/vae_graphs_smoke.json     # CPU, tiny VAE (a test)

Cases: the Wan2.1 VAE at 480x832 (60x104 latents) and the Wan2.2 VAE at 704x1280 (44x80 latents), one latent frame
per chunk (4 video frames), as the gateway decodes them.  Variants, each a ``StreamVAE`` as the gateway builds it:

- ``eager``; ``compiled`` (``compile=True``, warmed up on a scratch stream first);
- ``graphed`` / ``compiled+graphed``: the same decoder after ``capture_graphs`` (``gateway.decode.vae_graphs``) with as
many
  slots as streams, so every stream replays its slot's graph from its third frame on;
- ``channels-last`` / ``channels-last+graphed``: a copy of the VAE with its decoder's conv weights channels-last
  (``to_channels_last`` below), eager and graphed, for the record only: not bit-exact against the default layout
  even on a CPU, so the gateway does not offer it (``--no-channels-last`` skips them); ``compiled+channels-last``,
  the compiled decoder over those weights;
- ``--cudnn-benchmark on|both``: the rows timed with ``torch.backends.cudnn.benchmark`` (cuDNN picks each
  convolution's algorithm by timing them on first use), ``both`` times every row off and then on; ``--variants``
  keeps only the labels named.

Per variant and stream count (``--streams``, default 1 and 4): that many threads, each its own stream, decode
``--warmup`` chunks and then ``--iters`` measured chunks, each as the gateway's part thread does (``decode_chunk``
then ``to_uint8_frames(...).cpu()``, which waits for the GPU).  Reported: ``gpu_ms`` (one stream only: CUDA events
around ``decode_chunk``, median), ``chunk_ms`` (median wall time of a chunk in its thread, the decode span a stream
sees), ``aggregate_ms`` (wall time of the measured phase / chunks decoded by all threads) and ``fps`` (video frames per
second over all streams), and ``peak_gib`` (``torch.cuda.max_memory_allocated`` during the variant, graph slots
included).  ``max_diff``: max |variant - eager| over a 6-chunk stream's frames in [-1, 1] (0 means bit-identical);
``graphed_parts``: whether the capture passed its build-time check (else the variant ran eagerly).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import torch
from diffusers import AutoencoderKLWan
from torch import nn

from gateway.decode.stream_vae import StreamVAE, to_uint8_frames
from gateway.decode.vae_graphs import capture_graphs, default_capture
from stagecast.model.vae_configs import spatial_factor, vae_config

CASES = {"wan2.1": (480, 832), "wan2.2": (704, 1280)}
SMOKE_CASES = {"tiny-wan2.1": (32, 48), "tiny-wan2.2": (64, 64)}


def to_channels_last(vae: AutoencoderKLWan) -> AutoencoderKLWan:
    """Store the decoder's conv weights channels-last (``channels_last_3d`` / ``channels_last``), in place: a
    convolution runs channels-last when its weight is, and its output keeps the layout, so the activations and the
    cache follow.  Measured here only: it is not bit-exact against the default layout even on a CPU (~1e-6 on the
    tiny VAEs), so the gateway does not offer it."""
    for m in vae.decoder.modules():
        if isinstance(m, nn.Conv3d):
            m.weight.data = m.weight.data.contiguous(memory_format=torch.channels_last_3d)
        elif isinstance(m, nn.Conv2d):
            m.weight.data = m.weight.data.contiguous(memory_format=torch.channels_last)
    return vae


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def latents(vae, hw, frames: int, seed: int, device) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(1, vae.config.z_dim, frames, *hw, generator=gen)
    return [c.to(device) for c in z.split(1, dim=2)]


def decode_all(part: StreamVAE, chunks: list[torch.Tensor]) -> list[torch.Tensor]:
    state = part.new_state()
    try:
        return [part.decode_chunk(state, c).float() for c in chunks]
    finally:
        part.release(state)


def decode_timed(part: StreamVAE, state, chunk: torch.Tensor, gpu_timed: bool) -> tuple[float, float | None]:
    """One chunk's decode and host copy: (wall ms, GPU ms between CUDA events around the decode, or None)."""
    if gpu_timed:
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
    t0 = time.perf_counter()
    y = part.decode_chunk(state, chunk)
    if gpu_timed:
        end.record()
    to_uint8_frames(y).cpu()
    took = (time.perf_counter() - t0) * 1e3
    return took, begin.elapsed_time(end) if gpu_timed else None


def run_streams(part: StreamVAE, hw, streams: int, warmup: int, iters: int) -> dict:
    device = part.device
    inputs = [latents(part.vae, hw, warmup + iters, 1000 + s, device) for s in range(streams)]
    chunk_ms: list[float] = []
    gpu_ms: list[float] = []
    lock = threading.Lock()
    ready = threading.Barrier(streams + 1)
    done = threading.Barrier(streams + 1)
    errors: list[BaseException] = []

    def work(s: int) -> None:
        try:
            if device.type == "cuda":
                torch.cuda.set_device(device)
            state = part.new_state()
            for i, c in enumerate(inputs[s]):
                if i == warmup:
                    ready.wait()
                took, gpu = decode_timed(part, state, c, device.type == "cuda" and streams == 1 and i >= warmup)
                if i >= warmup:
                    with lock:
                        chunk_ms.append(took)
                        gpu_ms.extend([gpu] if gpu is not None else [])
            part.release(state)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)
            ready.abort()
        finally:
            try:
                done.wait()
            except threading.BrokenBarrierError:
                pass

    threads = [threading.Thread(target=work, args=(s,), daemon=True) for s in range(streams)]
    for t in threads:
        t.start()
    try:
        ready.wait()
    except threading.BrokenBarrierError:
        pass
    t0 = time.perf_counter()
    try:
        done.wait()
    except threading.BrokenBarrierError:
        pass
    wall = time.perf_counter() - t0
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    total = streams * iters
    frames_per_chunk = part.temporal_factor
    return {
        "streams": streams,
        "chunk_ms": round(statistics.median(chunk_ms), 2),
        "gpu_ms": round(statistics.median(gpu_ms), 2) if gpu_ms else None,
        "aggregate_ms": round(wall * 1e3 / total, 2),
        "fps": round(total * frames_per_chunk / wall, 1),
    }


def check_case(name: str, size, args, device: torch.device, dtype: torch.dtype) -> dict:
    torch.manual_seed(0)
    vae = AutoencoderKLWan(**vae_config(name)).to(device, dtype).eval().requires_grad_(False)
    sf = spatial_factor(vae.config)
    hw = (size[0] // sf, size[1] // sf)
    probe = latents(vae, hw, 6, 7, device)
    slots = max(args.streams)
    eager_part = StreamVAE(vae)
    reference = decode_all(eager_part, probe)
    rows = []
    # (label, compiled, graphed, channels-last)
    variants = [("eager", False, False, False), ("graphed", False, True, False)]
    if not args.no_compile:
        variants += [("compiled", True, False, False), ("compiled+graphed", True, True, False)]
    if not args.no_channels_last:
        variants += [("channels-last", False, False, True), ("channels-last+graphed", False, True, True)]
        if not args.no_compile:
            variants += [("compiled+channels-last", True, False, True)]
    if args.variants:
        variants = [v for v in variants if v[0] in args.variants]
    parts: dict[tuple[bool, bool], StreamVAE] = {(False, False): eager_part}
    for label, compiled, graphed, channels_last in variants:
        key = (compiled, channels_last)
        if key not in parts:
            model = to_channels_last(copy.deepcopy(vae)) if channels_last else vae
            parts[key] = StreamVAE(model, compile=compiled)
            if compiled:
                t0 = time.perf_counter()
                for seed in range(3):  # as the gateway's warm-up: every compiled variant built before timing
                    decode_all(parts[key], latents(vae, hw, 4, 50 + seed, device))
                sync(device)
                print(f"{name} {label}: compiled in {time.perf_counter() - t0:.1f} s", flush=True)
        part = parts[key]
        part.graphs = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        graphed_parts = None
        if graphed:
            t0 = time.perf_counter()
            graphed_parts = capture_graphs([part], latent_hw=hw, slots=slots, capture_for=default_capture)
            print(f"{name} {label}: captured {slots} slots in {time.perf_counter() - t0:.1f} s: {graphed_parts}")
        got = decode_all(part, probe)
        diff = max((a - b).abs().max().item() for a, b in zip(got, reference, strict=True))
        for streams in args.streams:
            for bench in args.cudnn_benchmark:
                torch.backends.cudnn.benchmark = bench
                row = {"case": name, "size": f"{size[0]}x{size[1]}", "variant": label, "graphed_parts": graphed_parts}
                row["cudnn_benchmark"] = bench
                row.update(run_streams(part, hw, streams, args.warmup, args.iters))
                row["max_diff"] = diff
                row["peak_gib"] = (
                    round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None
                )
                print(json.dumps(row), flush=True)
                rows.append(row)
        torch.backends.cudnn.benchmark = False
        part.graphs = None  # frees the slots' buffers (and the graphs) before the next variant
    return {"case": name, "size": list(size), "latent_hw": list(hw), "rows": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="wan2.1,wan2.2", help=f"comma-separated, of {sorted(CASES)}")
    ap.add_argument("--streams", default="1,4", help="concurrent streams (threads), comma-separated")
    ap.add_argument("--warmup", type=int, default=3, help="chunks per stream before timing (>= 3: frames 0, 1 eager)")
    ap.add_argument("--iters", type=int, default=10, help="timed chunks per stream")
    ap.add_argument("--no-compile", action="store_true", help="skip the compiled variants")
    ap.add_argument("--no-channels-last", action="store_true", help="skip the channels-last variants")
    ap.add_argument("--variants", default=None, help="comma-separated labels to run (default: every one enabled)")
    ap.add_argument(
        "--cudnn-benchmark",
        choices=("off", "on", "both"),
        default="off",
        help="torch.backends.cudnn.benchmark while timing (both: every row twice, off then on)",
    )
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny VAEs, few chunks, no compile (a test runs this)")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    args.streams = [int(v) for v in args.streams.split(",")]
    args.variants = set(args.variants.split(",")) if args.variants else None
    args.cudnn_benchmark = {"off": [False], "on": [True], "both": [False, True]}[args.cudnn_benchmark]
    if any(s < 1 for s in args.streams) or args.warmup < 3 or args.iters < 1:
        ap.error("--streams must be positive, --warmup at least 3 and --iters at least 1")
    if args.smoke:
        device, dtype, cases = torch.device("cpu"), torch.float32, SMOKE_CASES
        args.no_compile, args.iters = True, min(args.iters, 2)
    else:
        if not torch.cuda.is_available():
            print("vae_graphs_check: needs a CUDA GPU (or --smoke on CPU)", file=sys.stderr)
            return 2
        device, dtype = torch.device("cuda:0"), torch.bfloat16
        unknown = [c for c in args.cases.split(",") if c not in CASES]
        if unknown:
            ap.error(f"--cases: unknown {unknown}; known {sorted(CASES)}")
        cases = {c: CASES[c] for c in args.cases.split(",")}
    result = {
        "when": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "dtype": str(dtype).removeprefix("torch."),
        "command": " ".join(["python -m benchmarks.vae_graphs_check", *(argv if argv is not None else sys.argv[1:])]),
        "cases": [],
    }
    for name, size in cases.items():
        result["cases"].append(check_case(name, size, args, device, dtype))
        if args.json:  # after every case: a run cut short by its time limit keeps what it measured
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
