"""Admission by KV memory on a real pipeline: what each stage gives to streams' KV, which streams the coordinator
admits, and that the admitted ones run to the end beside each other without a stage running out of memory.

Usage::

    python -m benchmarks.kv_admission_check --stages 1 --cuda-graphs --vae-compile \
        --json benchmarks/results/kv_admission_1gpu.json      # GPU: Wan2.1-1.3B 480x832, random weights
    python -m benchmarks.kv_admission_check --smoke           # CPU, tiny model, a budget of 1.5 windowed streams

What it does, through the public API (unpaced streams, so that only memory limits how many are admitted):

1. reads each stage's KV budget from the coordinator's status (``--kv-budget-gib`` 0: the stage derives it);
2. opens the request that ran a one-GPU stage out of memory before admission by KV memory: a ``--seconds`` stream
   without a window.  It is either refused at once naming ``window`` or admitted and read to the end;
3. opens windowed streams (``--window``/``--sink``, the benchmark protocol's 6 and 3) one after another until one is
   refused (or ``--max-open``), then reads them all to the end at once while it samples every stage's actual KV
   bytes (``StageService.Describe``) against what the coordinator reserved for them;
4. checks that every admitted stream completed, that no stage held more KV than was reserved on it, and that the
   reservations went back to 0.  Exits 1 if any check fails.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from pathlib import Path

import stagecast
from benchmarks.harness import smoke_system, start_system, system_device, system_flags, write_assets
from launcher.process import Launcher
from stage_service.options import StageOptions
from stagecast.api import DEFAULT_FPS
from stagecast.flags import argv_for
from stagecast.internal.v1 import pipeline_pb2 as pb
from stagecast.internal.v1 import pipeline_pb2_grpc as pb_grpc

SAMPLE_S = 0.2  # how often the stages' actual KV is read while the streams run


def stream_config(args) -> dict:
    return dict(
        width=args.width,
        height=args.height,
        steps=args.steps,
        codec="jpeg",
        pace=False,
        policy="per_level",
        chunk_frames=1,
        seconds=args.seconds,
        timeout=args.timeout,
    )


def read_all(gen) -> dict:
    """Read a stream to its end: frames and how it ended (or the error that ended it)."""
    frames = 0
    try:
        for _ in gen:
            frames += 1
        return {"frames": frames, "end": gen.end.reason if gen.end is not None else "?"}
    except stagecast.StagecastError as exc:
        return {"frames": frames, "error": f"{type(exc).__name__}: {exc.details}"}


def open_stream(client, prompt: str, **config):
    """(generation, None) when admitted, (None, refusal) when refused."""
    gen = client.generate(prompt, **config)
    try:
        gen.wait_started()
        return gen, None
    except stagecast.StagecastError as exc:
        return None, {"error": type(exc).__name__, "details": exc.details, "retry_after": exc.retry_after}


def measure(launcher, coordinator: str, gateway: str, args) -> dict:
    channel = launcher.channel(coordinator, "coordinator")
    coord = pb_grpc.CoordinatorServiceStub(channel)

    def stages():
        return sorted(coord.Status(pb.Empty(), timeout=10).stages, key=lambda s: s.index)

    budgets = {s.index: s.kv_budget_bytes for s in stages()}
    describe = {s.index: pb_grpc.StageServiceStub(launcher.channel(s.address, "stage")) for s in stages()}
    peak = {i: 0 for i in describe}
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(SAMPLE_S):
            for i, stub in describe.items():
                peak[i] = max(peak[i], stub.Describe(pb.Empty(), timeout=10).kv_bytes)

    config = stream_config(args)
    out: dict = {"kv_budget_bytes": budgets}
    with stagecast.Client(gateway) as client:
        # The request that ran a one-GPU stage out of memory: no window.
        gen, refusal = open_stream(client, "no window", **config)
        unbounded = {"admitted": gen is not None, "refusal": refusal}
        if gen is not None:
            unbounded["reserved_bytes"] = {s.index: s.kv_reserved_bytes for s in stages()}
            unbounded.update(read_all(gen))
        out["unbounded"] = unbounded

        windowed = {**config, "window": args.window, "sink": args.sink}
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()  # from the first windowed stream on
        gens, refusal = [], None
        while len(gens) < args.max_open and refusal is None:
            gen, refusal = open_stream(client, f"window {len(gens)}", **windowed)
            if gen is not None:
                gens.append(gen)
        reserved = {s.index: s.kv_reserved_bytes for s in stages()}
        t0 = time.monotonic()
        results: list[dict] = [{} for _ in gens]
        readers = [
            threading.Thread(target=lambda k=k, g=g: results.__setitem__(k, read_all(g))) for k, g in enumerate(gens)
        ]
        for t in readers:
            t.start()
        for t in readers:
            t.join()
        stop.set()
        sampler.join()
        out["windowed"] = {
            "admitted": len(gens),
            "refusal": refusal,
            "reserved_bytes": reserved,
            "peak_kv_bytes": peak,
            "streams": results,
            "seconds": time.monotonic() - t0,
        }
        deadline = time.monotonic() + 30
        while any(s.kv_reserved_bytes for s in stages()) and time.monotonic() < deadline:
            time.sleep(SAMPLE_S)
        out["reserved_after"] = {s.index: s.kv_reserved_bytes for s in stages()}
    channel.close()
    frames = round(args.seconds * DEFAULT_FPS)  # the serving rate of every checkpoint here
    checks = {
        "unbounded refused naming window, or completed": (
            (not unbounded["admitted"] and "window:" in (unbounded["refusal"] or {}).get("details", ""))
            or unbounded.get("end") == "completed"
        ),
        "every admitted windowed stream completed": bool(gens)
        and all(r.get("end") == "completed" and r.get("frames") == frames for r in results),
        "no stage held more KV than was reserved on it": all(peak[i] <= reserved.get(i, 0) for i in peak),
        # (a smoke run's streams may end between two samples; a real one's run for many)
        "the stages' KV was sampled while it was held": args.smoke or all(peak[i] > 0 for i in peak),
        "reservations given back": not any(out["reserved_after"].values()),
    }
    out["checks"] = checks
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    system_flags(ap, steps=4, stages=1, steps_help="per_level: one KV row per step")
    ap.add_argument("--seconds", type=float, default=15.0, help="video per stream (the defect's: 15 s)")
    ap.add_argument("--max-open", type=int, default=12, help="windowed streams opened at most")
    ap.add_argument("--kv-budget-gib", type=float, default=0.0, help="every stage's --kv-budget-gib (0: derived)")
    ap.add_argument("--timeout", type=float, default=540.0, help="seconds a stream may take")
    ap.add_argument("--json", default=None)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model, a budget of 1.5 windowed streams")
    args = ap.parse_args(argv)

    if args.smoke:
        smoke_system(args)
        # The protocol's window (6, 3 sinks): a stage whose budget holds no stream at the serving defaults (counted
        # with that window) does not form; 3 s: two such streams overflow the budget, and so does one without a window.
        args.steps, args.seconds, args.window, args.sink, args.timeout = 2, 3.0, 6, 3, 120.0
        args.kv_budget_gib = smoke_budget_gib(args)
    device_kind = system_device(args)
    args.load = [args.max_open]  # the gateway's and the coordinator's stream caps leave room for every stream
    args.stage_extra_args = argv_for(StageOptions, kv_budget_gib=args.kv_budget_gib)  # 0 (derive it): nothing
    env = {"OMP_NUM_THREADS": "1"} if device_kind == "cpu" else {}
    with tempfile.TemporaryDirectory(prefix="stagecast-kv-") as tmp, Launcher(env=env) as launcher:
        root = Path(tmp)
        write_assets(root, args)
        pipe, gateway = start_system(launcher, root, args, device_kind)
        result = measure(launcher, pipe.coordinator, gateway, args)
    result = {"benchmark": "kv_admission", "device": device_kind, "args": vars(args), **result}
    print(json.dumps(result, indent=2, default=str))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=str) + "\n")
    return 0 if all(result["checks"].values()) else 1


def smoke_budget_gib(args) -> float:
    """A budget of one and a half windowed streams of the smoke run on its busiest stage: one is admitted, a second
    is refused, and so is the stream without a window (it would hold every frame of its chunks)."""
    from stagecast.kv_memory import stream_kv_bytes
    from stagecast.microstep import StreamSpec
    from stagecast.model.config import DiTConfig
    from stagecast.model.dit_configs import model_config
    from stagecast.model.partition import parse_partition, partition_ranges

    model = DiTConfig.from_kwargs(model_config(args.model))
    spec = StreamSpec(
        stream_id=1,
        latent_channels=model.in_channels,
        chunk_frames=1,
        latent_height=args.height // 8,
        latent_width=args.width // 8,
        timesteps=tuple(1000.0 * (1 - i / args.steps) for i in range(args.steps)),
        window=args.window,
        sink=args.sink,
    )
    layers = max(len(r) for r in partition_ranges(parse_partition(None, model.num_layers, args.stages)))
    return 1.5 * stream_kv_bytes(spec, model, layers=layers, element_bytes=4) / (1 << 30)


if __name__ == "__main__":
    raise SystemExit(main())
