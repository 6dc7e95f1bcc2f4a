"""Whether a stage's batches make the host wait for the GPU, and what that wait costs: batches through the stage's own
executor (``StageExecutor`` over a ``SliceRunner`` with CUDA graphs), as a one-stage pipeline runs them.

Usage (one GPU; the model's real config with random bf16 weights, the benchmark protocol's shapes)::

    python -m benchmarks.host_sync --dit-levers fused@rows --json /tmp/host_sync.json
    python -m benchmarks.host_sync --num-layers 2 --height 8 --width 8 --text-len 16 --batches 1,2 --forwards 4

Per batch size b (b streams, each chunk one latent frame at a full KV window of ``--window`` frames, one step):

- ``syncs``: the CUDA synchronizations one batch made on the executor's path (its forward, the sampler step, the
  finished latents' copy to the host), counted with ``torch.cuda.set_sync_debug_mode("warn")``; 0 is the goal
  (``stage_service.host_copy``);
- ``back_to_back_ms``: wall ms per batch of ``--forwards`` batches submitted at once, from the first submit to the
  last chunk's latents on the host: the host launches a batch while the GPU still runs the one before;
- ``one_at_a_time_ms``: the same batches, each submitted once the previous one's latents were on the host: the
  GPU waits for every batch's host work (what a batch cost while its noise copy synchronized);
- ``span_ms``: the median of the executor's own timings (``BatchDone.timed``, CUDA events), what the SLO model
  learns from;
- ``calibrated_ms``: the stage's calibration at that size (``stage_service.calibration``, full window, graphed): what
  admission prices a batch at (times ``--gpu-sharing``), each forward timed alone.

``one_at_a_time_ms - back_to_back_ms`` is the host work a batch no longer makes the GPU wait for.  On a CPU the
timings are wall times and ``syncs`` is not counted (None).
"""

from __future__ import annotations

import argparse
import json
import queue
import statistics
import sys
import time
import warnings

import torch

from benchmarks.dit_levers import commit, random_slice
from benchmarks.fp8_check import parse_batches, versions, write_result
from stage_service.calibration import ServingShape, calibrate, fill_window, synthetic_spec
from stage_service.dit_levers import parse_levers
from stage_service.dit_slice import DiTSlice
from stage_service.executor import ExecutorEvent, StageExecutor
from stage_service.graphs import GraphedBlocks
from stage_service.host_copy import to_host
from stage_service.runner import SliceRunner
from stagecast.microstep import MicroStep, PlanEvent
from stagecast.model.dit_configs import model_config

WAIT_S = 600.0  # a bound only: a batch takes milliseconds


class Batches:
    """b streams at a full window on one runner, and its executor; ``run(n, one_at_a_time)`` times n batches."""

    def __init__(self, sl: DiTSlice, b: int, args):
        cuda = sl.device.type == "cuda"
        self.graphs = GraphedBlocks(sl, reserve_rows=b) if cuda else None
        self.runner = SliceRunner(sl, graphs=self.graphs)
        shape = ServingShape(args.chunk_frames, args.height, args.width, args.text_len)
        gen = torch.Generator().manual_seed(0)
        text = torch.randn(1, args.text_len, sl.config["text_dim"], generator=gen)
        self.ids = list(range(1, b + 1))
        for sid in self.ids:
            self.runner.open_stream(synthetic_spec(sid, shape, sl.config["in_channels"], args.window, 3), text)
        self.events: queue.Queue[ExecutorEvent] = queue.Queue()
        self.executor = StageExecutor(self.runner, None, self.events.put)
        self.executor.start()
        self.seq = 0
        self.spans: list[float] = []
        # Chunk 0 writes each stream's first K/V, which then stands in for a full window (as the calibration does).
        self.chunk = 0
        self._submit()
        self._finish()
        self.chunk = -(-args.window // args.chunk_frames)  # the first chunk whose window is full
        fill_window(self.runner, self.ids, self.chunk)

    def _submit(self) -> None:
        self.seq += 1
        steps = tuple(MicroStep(sid, self.chunk, 0) for sid in self.ids)
        self.chunk += 1
        self.executor.submit(PlanEvent("batch", seq=self.seq, steps=steps))

    def _finish(self) -> None:
        """Wait for one batch's done event and every chunk before it, with the latents on the host."""
        while True:
            ev = self.events.get(timeout=WAIT_S)
            if ev.kind == "error":
                raise RuntimeError(ev.message)
            if ev.kind == "chunk":
                assert ev.latents is not None
                ev.latents.wait()
            if ev.kind == "done":
                self.spans += [t.forward_ms for t in ev.timed]
                return

    def run(self, n: int, one_at_a_time: bool) -> float:
        """Wall ms per batch of ``n`` batches."""
        start = time.perf_counter()
        if one_at_a_time:
            for _ in range(n):
                self._submit()
                self._finish()
        else:
            for _ in range(n):
                self._submit()
            for _ in range(n):
                self._finish()
        return (time.perf_counter() - start) * 1e3 / n

    def syncs(self) -> int | None:
        """The synchronizations one batch makes on the executor's path (None on a CPU)."""
        if self.runner.slice.device.type != "cuda":
            return None
        self._submit()
        self._finish()  # a batch's latents copied: nothing left in flight
        torch.cuda.synchronize()
        steps = [MicroStep(sid, self.chunk, 0) for sid in self.ids]
        self.chunk += 1
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                out = self.runner.forward(steps)
                results = self.runner.finish(steps, out)
                copies = [to_host(r.finished) for r in results if r.finished is not None]
            finally:
                torch.cuda.set_sync_debug_mode("default")
        for c in copies:
            c.wait()
        return sum("synchroniz" in str(w.message) for w in seen)

    def close(self) -> None:
        self.executor.stop()
        for sid in self.ids:
            self.runner.close_stream(sid)
        if self.graphs is not None:
            self.graphs.close()


def measure(sl: DiTSlice, b: int, args) -> dict:
    batches = Batches(sl, b, args)
    try:
        batches.run(args.warmup, one_at_a_time=False)  # graph capture, allocator
        batches.spans.clear()
        free = [batches.run(args.forwards, one_at_a_time=False) for _ in range(args.repeats)]
        serial = [batches.run(args.forwards, one_at_a_time=True) for _ in range(args.repeats)]
        return {
            "batch": b,
            "syncs": batches.syncs(),
            "back_to_back_ms": round(min(free), 3),
            "one_at_a_time_ms": round(min(serial), 3),
            "span_ms": round(statistics.median(batches.spans), 3) if batches.spans else None,
            "eager_batches": batches.graphs.eager_batches if batches.graphs is not None else None,
        }
    finally:
        batches.close()


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="wan2.1-1.3b")
    ap.add_argument("--num-layers", type=int, default=None, help="override the model's layer count (smoke runs)")
    ap.add_argument("--dit-levers", default="", help="the stage's --dit-levers (e.g. fused@rows)")
    ap.add_argument("--batches", default="1,4", help="micro-steps per batch, comma-separated")
    ap.add_argument("--height", type=int, default=60, help="latent height (480 / 8)")
    ap.add_argument("--width", type=int, default=104, help="latent width (832 / 8)")
    ap.add_argument("--chunk-frames", type=int, default=1, help="latent frames per chunk (protocol: 1)")
    ap.add_argument("--window", type=int, default=6, help="KV window in latent frames (protocol: 6, 3 of them sinks)")
    ap.add_argument("--text-len", type=int, default=512)
    ap.add_argument("--warmup", type=int, default=3, help="untimed batches first (graph capture)")
    ap.add_argument("--forwards", type=int, default=20, help="batches per timing")
    ap.add_argument("--repeats", type=int, default=3, help="timings per mode; the least is kept")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    args.batches = parse_batches(ap, args.batches)
    for name in ("warmup", "forwards", "repeats"):
        if not 1 <= getattr(args, name) <= 1000:
            ap.error(f"--{name}: must be in [1, 1000], got {getattr(args, name)}")
    try:
        args.levers = parse_levers(args.dit_levers)
    except ValueError as exc:
        ap.error(str(exc))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    cfg = model_config(args.model, **({"num_layers": args.num_layers} if args.num_layers else {}))
    sl, _ = random_slice(cfg, device, args.levers, torch.bfloat16 if device.type == "cuda" else torch.float32)
    rows = [measure(sl, b, args) for b in args.batches]
    shape = ServingShape(args.chunk_frames, args.height, args.width, args.text_len)
    cal = calibrate(sl, max(args.batches), shape, budget_s=120.0, graphs=True, window=args.window)
    for row in rows:
        b = row["batch"]
        row["calibrated_ms"] = round(cal.full_ms[b - 1], 3) if b <= len(cal.full_ms) else None
        print(json.dumps(row), flush=True)
    if cal.error:
        print(f"calibration: {cal.error}", flush=True)
    result = {
        "benchmark": "host_sync",
        "commit": commit(),
        "command": "python -m benchmarks.host_sync " + " ".join(argv if argv is not None else sys.argv[1:]),
        "versions": versions(),
        "model": args.model,
        "layers": cfg["num_layers"],
        "dit_levers": args.dit_levers,
        "shape": [args.chunk_frames, args.height, args.width, args.text_len, args.window],
        "rows": rows,
        "calibration_error": cal.error,
    }
    write_result(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
