"""Predicted steady FPS on 1, 2 and 4 GPUs from measured graphed times, the VAE included (issue 24).

Usage (CPU, no GPU needed; reads ``benchmarks/results``)::

    python -m benchmarks.predict                          # the table of BENCHMARKS.md "Four GPUs (issue 24)"
    python -m benchmarks.predict --json /tmp/predict.json
    python -m benchmarks.predict --write-profile wan2.1-14b benchmarks/results/balance_14b_1step_derived.json

The model is the balance planner's (``stagecast.model.balance``): in the steady state every GPU carries its DiT
stage and the VAE slices placed on it, one after the other, so a chunk (one latent frame, 4 video frames) costs the
busiest GPU's sum, and FPS = 4000 / that many ms.  It leaves out what the measured rows pay on top: the stage and the
gateway's VAE slices are separate processes time-slicing one GPU, the VAE's activation crossing to the next slice's
GPU, the gateway's CPU work (JPEG, threads under the GIL), and the coupling of both pipelines under the bounded lead.
Each pipeline partition is also run through the scheduler simulator (``coordinator.simulator``, DiT only): the
prediction is the lower of its rate and the busiest GPU's.

Inputs (all measured on one H200):

- 1.3B: ``balance_13b_1step.json``, the balance profile (every graphed block, each stage's fixed work, the first and
  last stage's extras, every compiled VAE decoder unit);
- 14B: a profile derived from it (``derive_profile``): the 14B's 20 graphed blocks at batch 1 from
  ``attention_in_place.json`` (mode ``in_place``, the stages' default) over 20, the same per block for all 40; the
  fixed work and the VAE units of the 1.3B profile (the same Wan2.1 VAE at 480x832; the 14B's fixed work is not
  measured);
- VAE cut "by MACs": ``gateway.decode.stream_vae.decoder_cut`` (the gateway's default), computed here on a CPU copy;
- CFG-parallel: two pipelines of ``stages`` stages, group g's stage k on GPU ``g * stages + k`` (``Placement``), the
  VAE cut over every GPU, and each last stage's swap of the branches' predictions as measured in
  ``v2_13b_1step_cfg5_cfgpar2.json``;
- sequence parallel: eager (SP stages have no CUDA graphs): the eager blocks of ``attention_in_place.json`` (1.3B, 15
  blocks, batch 1 and 4, which give the share of a forward that grows with tokens), priced by the simulator's SP
  model (its all-to-all at its default 48 us + bytes / 393 GB/s, not yet measured by ``sp_bench``), plus the VAE.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys
from pathlib import Path

from coordinator.simulator import SimConfig, simulate
from stagecast.model.balance import BalancePlan, evaluate, plan_balance
from stagecast.model.balance_profile import DIT_KEYS, BalanceProfile
from stagecast.model.dit_configs import model_config
from stagecast.model.partition import even_partition

FRAMES_PER_CHUNK = 4
RESULTS = Path(__file__).resolve().parent / "results"
PROFILE_13B = "balance_13b_1step.json"
ATTENTION = "attention_in_place.json"
CFGPAR = "v2_13b_1step_cfg5_cfgpar2.json"
SIM_CHUNKS = 128


def attention_ms(attention: dict, model: str, *, batch: int = 1, mode: str = "in_place", kind: str = "graphed"):
    """(ms of one forward, blocks timed) for ``model`` in an ``attention_check`` JSON."""
    for entry in attention["models"]:
        if entry["model"] == model:
            start, stop = entry["layers"]
            return entry["batches"][str(batch)]["modes"][mode][kind]["median_ms"], stop - start
    raise KeyError(f"{model}: not in the attention_check JSON (it has {[m['model'] for m in attention['models']]})")


def derive_profile(base: BalanceProfile, attention: dict, model: str, *, mode: str = "in_place") -> BalanceProfile:
    """A balance profile of ``model`` whose blocks all take the ``attention_check`` graphed batch-1 forward over its
    block count, with ``base``'s fixed work and VAE units (the same VAE at the same size)."""
    from benchmarks.harness import VAE_FOR_MODEL

    if VAE_FOR_MODEL[model] != VAE_FOR_MODEL[base.model]:
        raise ValueError(
            f"{model} decodes with {VAE_FOR_MODEL[model]}, {base.source} timed {VAE_FOR_MODEL[base.model]}"
        )
    ms, blocks = attention_ms(attention, model, mode=mode)
    config = model_config(model)
    return BalanceProfile(
        model=model,
        dit_config={k: config[k] for k in DIT_KEYS},
        blocks_ms=[ms / blocks] * config["num_layers"],
        vae_units=list(base.vae_units),
        stage_ms=base.stage_ms,
        first_ms=base.first_ms,
        last_ms=base.last_ms,
        width=base.width,
        height=base.height,
        steps=base.steps,
        batch=base.batch,
        policy=base.policy,
        window=base.window,
        sink=base.sink,
        text_len=base.text_len,
        dtype=base.dtype,
        device=f"{base.device} (derived)",
        cuda_graphs=base.cuda_graphs,
        vae_compile=base.vae_compile,
        measured={
            "derived": f"blocks: attention_check {mode} graphed batch 1, {ms:.3f} ms over {blocks} blocks; fixed work "
            f"and VAE units: {base.model}'s profile (the {model}'s fixed work is not measured)",
            "base_measured": dict(base.measured),
            "attention_command": attention.get("command", ""),
            "command": f"python -m benchmarks.predict --write-profile {model} FILE",
        },
    )


@functools.cache
def _vae(name: str):
    import torch
    from diffusers import AutoencoderKLWan

    from stagecast.model.vae_configs import vae_config

    torch.manual_seed(0)
    return AutoencoderKLWan(**vae_config(name)).eval()


@functools.cache
def _unit_macs(name: str) -> tuple[int, ...]:
    from gateway.decode.stream_vae import unit_macs

    return tuple(unit_macs(_vae(name)))


def mac_cut(model: str, slices: int) -> list[int]:
    """Where the gateway's default cut (by multiply-accumulates) starts VAE slices 1.. over ``slices`` GPUs (the
    decoder's unit counts measured once per VAE: the 1.3B and 14B models share one)."""
    from benchmarks.harness import VAE_FOR_MODEL
    from gateway.decode.stream_vae import decoder_cut

    name = VAE_FOR_MODEL[model]
    return decoder_cut(_vae(name), slices, costs=list(_unit_macs(name)))[1:-1]


def _fps(bottleneck_ms: float) -> float:
    return FRAMES_PER_CHUNK * 1e3 / bottleneck_ms


def _busiest(gpu_ms: dict, dit_ms: dict) -> dict:
    gpu = max(gpu_ms, key=lambda g: gpu_ms[g])
    return {"gpu": gpu, "dit_ms": dit_ms.get(gpu, 0.0), "vae_ms": gpu_ms[gpu] - dit_ms.get(gpu, 0.0)}


def _dit_sim(stage_ms: list[float], steps: int):
    """The DiT pipeline alone, through the real scheduler (one stream, ``per_level``)."""
    return simulate(SimConfig(stages=len(stage_ms), steps=steps, chunks=SIM_CHUNKS, stage_ms=list(stage_ms)))


def pipeline(profile: BalanceProfile, gpus: int, *, planner: bool) -> dict:
    """PP=``gpus``: stage k and VAE slice k on GPU k; the even partition with the MAC cut, or the planner's."""
    costs, devices = profile.costs(), list(range(gpus))
    if planner:
        plan = plan_balance(costs, devices, devices)
    else:
        plan = evaluate(
            costs, even_partition(len(profile.blocks_ms), gpus), mac_cut(profile.model, gpus), devices, devices
        )
    return _row(plan, {k: plan.stage_ms[k] for k in devices}, dit_stage_ms=plan.stage_ms, steps=profile.steps)


def _row(plan: BalancePlan, dit_ms: dict, *, dit_stage_ms: list[float], steps: int, gpu_ms: dict | None = None):
    gpu_ms = dict(plan.gpu_ms if gpu_ms is None else gpu_ms)
    bottleneck = max(gpu_ms.values())
    sim = _dit_sim(dit_stage_ms, steps)
    chunks = min(sim.chunks_per_second, 1e3 / bottleneck)
    return {
        "partition": plan.partition,
        "vae_split": plan.vae_split,
        "gpu_ms": {str(g): round(t, 3) for g, t in gpu_ms.items()},
        "bottleneck_ms": bottleneck,
        "busiest": _busiest(gpu_ms, dit_ms),
        "dit_only_chunks_per_second": sim.chunks_per_second,
        "fps": FRAMES_PER_CHUNK * chunks,
    }


def _cfg_loads(profile: BalanceProfile, stages: int, counts: list[int], split: list[int], exchange_ms: float):
    gpus = 2 * stages
    plan = evaluate(profile.costs(), counts, split, list(range(stages)), list(range(gpus)))
    dit = {g: plan.stage_ms[g % stages] + (exchange_ms if g % stages == stages - 1 else 0.0) for g in range(gpus)}
    vae = {g: plan.gpu_ms.get(g, 0.0) - (plan.stage_ms[g] if g < stages else 0.0) for g in range(gpus)}
    return plan, dit, {g: dit[g] + vae[g] for g in range(gpus)}


def cfg_parallel(
    profile: BalanceProfile,
    stages: int,
    *,
    exchange_ms: float = 0.0,
    counts: list[int] | None = None,
    vae_split: list[int] | None = None,
    best: bool = False,
) -> dict:
    """Two CFG-parallel pipelines of ``stages`` stages (group g's stage k on GPU g*stages + k, both with ``counts``,
    default the even partition), the VAE cut at ``vae_split`` (default by MACs) over all ``2 * stages`` GPUs; each
    last stage adds ``exchange_ms`` (the swap of the branches' predictions).  ``best``: the partition and cut with
    the smallest busiest GPU, by trying every one (the planner does not plan CFG-parallel; these are small)."""
    gpus, n, units = 2 * stages, len(profile.blocks_ms), len(profile.vae_units)
    if best:
        tried = []
        for cuts in itertools.combinations(range(1, n), stages - 1):
            part = [b - a for a, b in itertools.pairwise([0, *cuts, n])]
            for split in itertools.combinations(range(1, units), gpus - 1):
                loads = _cfg_loads(profile, stages, part, list(split), exchange_ms)[2]
                tried.append((max(loads.values()), part, list(split)))
        _, counts, vae_split = min(tried)
    counts = even_partition(n, stages) if counts is None else counts
    split = mac_cut(profile.model, gpus) if vae_split is None else vae_split
    plan, dit, gpu_ms = _cfg_loads(profile, stages, counts, split, exchange_ms)
    return _row(plan, dit, dit_stage_ms=[dit[k] for k in range(stages)], steps=profile.steps, gpu_ms=gpu_ms)


def sequence_parallel(profile: BalanceProfile, attention: dict, stages: int, sp: int) -> dict:
    """PP=``stages`` × SP=``sp``, eager: the simulator's SP model prices each rank's forward, and rank r of stage p
    (GPU p * sp + r) also carries VAE slice p * sp + r of the MAC cut over every GPU.  One step: a chunk is one
    forward of one micro-step on every rank."""
    if profile.steps != 1:
        raise ValueError(f"sequence_parallel: priced for 1 step, {profile.source} was measured at {profile.steps}")
    eager1, blocks = attention_ms(attention, profile.model, kind="eager")
    eager4, _ = attention_ms(attention, profile.model, batch=4, kind="eager")
    growth = (eager4 / eager1 - 1) / 3  # the share of a forward that grows with tokens (1 -> 4 items)
    counts = even_partition(len(profile.blocks_ms), stages)
    stage_ms = [c * eager1 / blocks + profile.stage_ms for c in counts]
    stage_ms[0] += profile.first_ms
    stage_ms[-1] += profile.last_ms
    config = model_config(profile.model)
    dim = config["num_attention_heads"] * config["attention_head_dim"]
    sim = simulate(
        SimConfig(
            stages=stages,
            sp=sp,
            steps=profile.steps,
            chunks=SIM_CHUNKS,
            stage_ms=stage_ms,
            growth=growth,
            dim=dim,
            layers=len(profile.blocks_ms),
        )
    )
    # One stream at 1 step: every batch is one micro-step, so a rank's busy time per chunk is its forward at batch 1.
    busy = sim.forward_ms
    gpus = stages * sp
    plan = evaluate(
        profile.costs(), counts, mac_cut(profile.model, gpus), [f"stage {p}" for p in range(stages)], list(range(gpus))
    )
    dit = {g: busy[g // sp] for g in range(gpus)}
    gpu_ms = {g: dit[g] + plan.vae_slice_ms[g] for g in range(gpus)}
    bottleneck = max(gpu_ms.values())
    return {
        "partition": plan.partition,
        "vae_split": plan.vae_split,
        "eager_stage_ms": stage_ms,
        "growth": growth,
        "a2a_ms_per_forward": sim.a2a_ms_per_forward,
        "gpu_ms": {str(g): round(t, 3) for g, t in gpu_ms.items()},
        "bottleneck_ms": bottleneck,
        "busiest": _busiest(gpu_ms, dit),
        "dit_only_chunks_per_second": sim.chunks_per_second,
        "fps": FRAMES_PER_CHUNK * min(sim.chunks_per_second, 1e3 / bottleneck),
    }


def _measured(results: Path, name: str) -> float | None:
    path = results / name
    return json.loads(path.read_text())["system"]["steady_fps"] if path.exists() else None


def predictions(results: Path = RESULTS) -> list[dict]:
    """Every row of the table: model, GPUs, topology, the prediction, and the measured row where there is one."""
    p13 = BalanceProfile.load(results / PROFILE_13B)
    attention = json.loads((results / ATTENTION).read_text())
    p14 = derive_profile(p13, attention, "wan2.1-14b")
    cfgpar = json.loads((results / CFGPAR).read_text())
    exchange = max(s["mean_exchange_ms"] for s in cfgpar["system"]["stages"])
    rows = []

    def add(model, gpus, topology, row, measured_file=None):
        row = {"model": model, "gpus": gpus, "topology": topology, **row}
        row["measured_fps"] = _measured(results, measured_file) if measured_file else None
        row["measured_file"] = measured_file
        if row["measured_fps"]:
            row["measured_over_predicted"] = row["measured_fps"] / row["fps"]
        rows.append(row)

    add("1.3B", 1, "PP=1", pipeline(p13, 1, planner=False), "v2_13b_1step_1gpu_kvstack.json")
    add("1.3B", 2, "PP=2, even + MAC cut", pipeline(p13, 2, planner=False), "v2_13b_1step_2gpu.json")
    add("1.3B", 2, "PP=2, planner", pipeline(p13, 2, planner=True))
    add("1.3B", 4, "PP=4, even + MAC cut", pipeline(p13, 4, planner=False))
    add("1.3B", 4, "PP=4, planner", pipeline(p13, 4, planner=True))
    add("14B", 2, "PP=2, even + MAC cut", pipeline(p14, 2, planner=False), "v2_14b_1step_2gpu.json")
    add("14B", 2, "PP=2, planner", pipeline(p14, 2, planner=True))
    add("14B", 4, "PP=4, even + MAC cut", pipeline(p14, 4, planner=False))
    add("14B", 4, "PP=4, planner", pipeline(p14, 4, planner=True))
    add("1.3B, guidance 5", 2, "CFG-parallel 2 × PP=1", cfg_parallel(p13, 1, exchange_ms=exchange), CFGPAR)
    add("1.3B, guidance 5", 4, "CFG-parallel 2 × PP=2, even + MAC cut", cfg_parallel(p13, 2, exchange_ms=exchange))
    add(
        "1.3B, guidance 5",
        4,
        "CFG-parallel 2 × PP=2, best partition and cut",
        cfg_parallel(p13, 2, exchange_ms=exchange, best=True),
    )
    add("1.3B", 4, "PP=2 × SP=2, eager, even + MAC cut", sequence_parallel(p13, attention, 2, 2))
    # Calibrated by the measured two-GPU row of the same model and kind (SP has none: the 1.3B pipeline's), two ways:
    # times its measured / predicted, and with its ms per chunk that the model misses added to the bottleneck.
    two = {(r["model"], r["topology"].startswith("CFG")): r for r in rows if r["measured_fps"] and r["gpus"] == 2}
    for r in rows:
        ref = two.get((r["model"], r["topology"].startswith("CFG")))
        if r["gpus"] > 2 and ref is not None:
            missed_ms = FRAMES_PER_CHUNK * 1e3 / ref["measured_fps"] - ref["bottleneck_ms"]
            r["calibrated_fps"] = {
                "ratio": r["fps"] * ref["measured_over_predicted"],
                "plus_ms": _fps(r["bottleneck_ms"] + missed_ms),
                "missed_ms": missed_ms,
            }
    return rows


def table(rows: list[dict]) -> list[str]:
    lines = [
        "| model, 1 step | GPUs | topology | --partition / --vae-split | ms per chunk per GPU | busiest GPU: DiT + VAE "
        "(ms) | predicted FPS | measured FPS | measured / predicted | calibrated FPS (+ms, ×ratio) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        split = ",".join(map(str, r["vae_split"])) or "-"
        per_gpu = " / ".join(f"{t:.1f}" for t in r["gpu_ms"].values())
        b = r["busiest"]
        measured = f"{r['measured_fps']:.1f}" if r["measured_fps"] else "–"
        ratio = f"{r['measured_over_predicted']:.2f}" if r["measured_fps"] else "–"
        cal = r.get("calibrated_fps")
        calibrated = "–" if not cal else "–".join(f"{v:.0f}" for v in sorted((cal["plus_ms"], cal["ratio"])))
        lines.append(
            f"| {r['model']} | {r['gpus']} | {r['topology']} | {r['partition']} / {split} | {per_gpu} | "
            f"{b['dit_ms']:.1f} + {b['vae_ms']:.1f} | **{r['fps']:.1f}** | {measured} | {ratio} | {calibrated} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default=str(RESULTS), help="the folder of the measured JSON files")
    ap.add_argument("--json", default=None, help="also write every row (per-GPU ms, plans) here")
    ap.add_argument(
        "--write-profile",
        nargs=2,
        metavar=("MODEL", "FILE"),
        default=None,
        help="write the derived balance profile of MODEL (e.g. wan2.1-14b) and stop",
    )
    args = ap.parse_args(argv)
    results = Path(args.results)
    if args.write_profile:
        model, out = args.write_profile
        attention = json.loads((results / ATTENTION).read_text())
        derive_profile(BalanceProfile.load(results / PROFILE_13B), attention, model).save(out)
        print(f"wrote {out}")
        return 0
    rows = predictions(results)
    for line in table(rows):
        print(line)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
