"""BENCHMARKS.md, its history and the results index, generated from the JSON files in ``benchmarks/results/``.

Usage::

    python -m benchmarks.report            # BENCHMARKS.md, benchmarks/results/HISTORY.md and INDEX.md from the JSON
    python -m benchmarks.report --check    # exit 1 (naming the files) where one of them is not what the JSON makes
    python -m benchmarks.report --results DIR --out FILE

The page (``--out``, BENCHMARKS.md) gets the **current** rows: one per configuration, the newest result of each (by
the JSON's date, then the run number ``_rN`` in its file name). They replace what lies between the
``<!-- harness-v2:begin -->`` and ``<!-- harness-v2:end -->`` lines (appended at the file's end when the markers are
missing); nothing else in the file changes. The decoder tables (``benchmarks/decoder_bench.py``'s ``decoder_*.json``)
go between ``<!-- decoders:begin -->`` and ``<!-- decoders:end -->``, and the DiT lever tables
(``benchmarks/dit_levers.py``'s ``dit_levers*.json``) between ``<!-- dit-levers:begin -->`` and
``<!-- dit-levers:end -->``, the same way.

The history (``--history``, ``DIR/HISTORY.md``, only when it exists) gets every harness-v2 row of every run between
the same harness-v2 markers, and the index (``--index``, ``DIR/INDEX.md``) is written whole: every file in the
results folder with its date, commit, configuration and what it measured, then each harness-v2 run's versions and
command.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from coordinator.slo import GPU_SHARING

BEGIN, END = "<!-- harness-v2:begin -->", "<!-- harness-v2:end -->"
DEC_BEGIN, DEC_END = "<!-- decoders:begin -->", "<!-- decoders:end -->"
LEV_BEGIN, LEV_END = "<!-- dit-levers:begin -->", "<!-- dit-levers:end -->"
MODEL_NAMES = {"wan2.1-1.3b": "1.3B", "wan2.1-14b": "14B", "wan2.2-ti2v-5b": "5B", "tiny-wan2.1": "tiny"}


def _f(x, fmt: str = ".1f", none: str = "–") -> str:
    return none if x is None else format(x, fmt)


def _x(x) -> str:
    return "–" if x is None else f"{x:.2f}×"


def _ms(x) -> str:
    return _f(None if x is None else x * 1e3, ".0f")


def config_name(r: dict) -> str:
    a = r["args"]
    steps = f"{a['steps']} step" + ("s" if a["steps"] > 1 else "")
    name = f"{MODEL_NAMES.get(a['model'], a['model'])} @ {a['width']}×{a['height']}, {steps}"
    if a.get("guidance", 1.0) > 1.0:
        topology = (
            f"CFG-parallel {a['cfg_parallel']} × PP={a['stages']}"
            if a.get("cfg_parallel", 1) > 1
            else f"sequential CFG on PP={a['stages']}"
        )
        name += f", guidance {a['guidance']:g}, {topology}"
    if a.get("fp8"):
        name += ", FP8 blocks"
    if (a.get("decoders") or ["full"])[0] == "tiny":  # every measured stream on the tiny decoder
        name += ", tiny decoder"
    if a.get("vae_cudnn_benchmark"):
        name += ", VAE cuDNN search"
    if a.get("pipeline_warmup") is False:
        name += ", no warm-up stream"
    if a.get("load_min_steps") and a.get("load"):  # SLO-adaptive load rows: paced, steps chosen online
        seeds = r.get("system", {}).get("slo_model") or {}
        fixed = a.get("slo_vae_ms") or 0
        vae = seeds.get("vae_chunk_ms", fixed if not isinstance(fixed, dict) else fixed.get("full", 0))
        origin = " measured" if seeds.get("vae_source") == "gateway" else ""
        name += f", SLO load rows (steps {a['load_min_steps']}–{a['steps']}, VAE {vae:.3g} ms/chunk{origin})"
    if isinstance(a.get("slo_vae_ms"), dict):  # a what-if: the decode priced at fixed ms, not as the gateway measured
        name += ", decode priced at " + ",".join(f"{k}={v:g}" for k, v in a["slo_vae_ms"].items()) + " ms (what-if)"
    if a.get("balance"):  # --partition auto: the planner's answer from a measured profile
        b = a["balance"]
        name += f", balanced {b['partition']} / VAE split {','.join(map(str, b['vae_split'])) or '-'}"
    elif a.get("partition"):
        name += f", partition {a['partition']}"
    return name + (f" ({r['label']})" if r.get("label") else "") + (" ¹" if r.get("partial") else "")


def _steps(per_stream: list[dict] | None) -> str:
    """Frames per step count over a row's streams, e.g. "4: 640, 3: 120"."""
    if not per_stream:
        return "–"
    total: dict[str, int] = {}
    for counts in per_stream:
        for k, v in counts.items():
            total[k] = total.get(k, 0) + v
    return ", ".join(f"{k}: {v}" for k, v in sorted(total.items(), key=lambda kv: -int(kv[0])))


# The capacity table's configurations: (model, steps, min_steps or None, width, height, decoder) -> the gpu_suite
# part that measures it.  A configuration without a capacity-mode JSON is named as missing under the table.
CAPACITY_CONFIGS = {
    ("wan2.1-1.3b", 1, None, 832, 480, "tiny"): "capacity-1.3b",
    ("wan2.1-1.3b", 1, None, 832, 480, "full"): "capacity-1.3b",
    ("wan2.1-1.3b", 4, 1, 832, 480, "tiny"): "capacity-1.3b-4",
    ("wan2.1-1.3b", 4, 1, 832, 480, "full"): "capacity-1.3b-4",
    ("wan2.1-14b", 1, None, 832, 480, "tiny"): "capacity-14b",
    ("wan2.2-ti2v-5b", 1, None, 1280, 704, "tiny"): "capacity-5b",
}


def _capacity_key(a: dict, decoder: str) -> tuple:
    return (a["model"], a["steps"], a.get("load_min_steps"), a["width"], a["height"], decoder)


def _eager(stage: dict) -> str:
    """`` (k of n eager)`` where a stage with CUDA graphs ran batches without one (results that record it)."""
    eager = stage.get("eager_batches")
    return f" ({eager} of {stage.get('batches')} eager)" if eager else ""


PAGE_GPU = "H200"  # the card the page's one-GPU rows ran on; a run on another names its card in its configuration


def capacity_config(a: dict, decoder: str) -> str:
    lo = a.get("load_min_steps")
    steps = f"SLO {lo}–{a['steps']} steps" if lo else f"{a['steps']} step" + ("s" if a["steps"] > 1 else "")
    grid = ", pace grid" if a.get("pace_grid") else ""
    grid += f", lookahead {a['lookahead']}" if a.get("lookahead") else ""  # a fixed one (the coordinator's --lookahead)
    grid += f", levers {a['dit_levers']}" if a.get("dit_levers") else ""  # the stages' --dit-levers
    grid += f", batch ≤ {a['batch']}" if a.get("batch", 4) != 4 else ""  # a Stream Batch ceiling other than 4
    grid += f", GPU sharing priced {a['gpu_sharing']:g}" if a.get("gpu_sharing", GPU_SHARING) != GPU_SHARING else ""
    grid += ", CUDA MPS" if a.get("cuda_mps") else ""  # the stage and the gateway shared the GPU through MPS
    grid += ", tiny graphs" if a.get("tiny_cuda_graphs") else ""  # the gateway's --tiny-cuda-graphs
    grid += f", on {a['card']}" if a.get("card") else ""  # a GPU other than the page's (``load``)
    if isinstance(a.get("slo_vae_ms"), dict):  # a what-if: the decode priced at fixed ms, not as the gateway measured
        grid += ", decode priced " + ",".join(f"{k}={v:g}" for k, v in a["slo_vae_ms"].items()) + " ms (what-if)"
    return f"{MODEL_NAMES.get(a['model'], a['model'])}, {steps}, {a['width']}×{a['height']}, {decoder}{grid}"


def _mib(x) -> str:
    return _f(None if x is None else x / (1 << 20), ".0f")


def _share(counts: dict | None) -> str:
    """Step counts by share of samples (or frames), most steps first, e.g. "4: 20%, 1: 80%"."""
    total = sum((counts or {}).values())
    if not total:
        return "–"
    return ", ".join(f"{k}: {v / total:.0%}" for k, v in sorted(counts.items(), key=lambda kv: -int(kv[0])))


def _load_capacity(r: dict) -> dict | None:
    """A capacity look from a run's load rows (all streams opened at once, not one at a time): the first row with a
    refusal, when every admitted stream of it held."""
    for row in r["system"].get("load") or []:
        if row.get("refused"):
            errors = [p.get("error") or "" for p in row.get("per_stream", []) if p.get("refused")]
            code = "RESOURCE_EXHAUSTED" if any("RESOURCE_EXHAUSTED" in e for e in errors) else "?"
            admitted = row["streams"] - row["refused"]
            steps: dict[str, int] = {}
            for counts in row.get("steps") or []:
                for k, v in counts.items():
                    steps[k] = steps.get(k, 0) + v
            return {
                "row": row,
                "admitted": admitted,
                "held": row["held"],
                "exact": bool(row.get("all_held")) and row["held"] == admitted and not row["failed"] - row["refused"],
                "code": code,
                "steps": steps,
            }
    return None


# A capacity row's slowest first frame, in order (``benchmarks.harness.ttff_parts`` keys, and their names here).
TTFF_PARTS = (
    ("prompt", "prompt"),
    ("open", "open"),
    ("first_chunk", "first chunk"),
    ("vae", "decode"),
    ("encode", "encode"),
    ("rest", "rest"),
)


def _capacity_row(r: dict, row: dict, gpus: int) -> str:
    """One ``--capacity`` row of the table."""
    a = r["args"]
    ref = row.get("refusal") or {}
    refusal = f"{ref.get('code')}, {_f(ref.get('ms'), '.0f')} ms" if ref else "none"
    cap = row.get("capacity")
    held = f"**{cap / gpus:g}**" if cap is not None else f"– ({row['verdict']})"
    stages = row.get("stages") or []
    mem = row.get("memory") or {}
    cfg = capacity_config(a, row["decoder"])
    priced = row.get("slo_model") or {}
    kind = (priced.get("decoders") or {}).get(row["decoder"])
    if kind:  # the decode cost admission counted for this row's decoder, and where it came from
        end = ((row.get("slo_model_end") or {}).get("decoders") or {}).get(row["decoder"]) or kind
        formed = f", calls formed {end['formed_batch']:.2f} streams" if end.get("batch_ms") else ""
        cfg += f" ({row['decoder']} priced {kind['chunk_ms']:.3g} ms/chunk alone{formed}, {kind['source']})"
    elif priced.get("vae_source"):  # older results: the full VAE's cost only
        cfg += f" (VAE priced {priced.get('vae_chunk_ms', 0):.3g} ms/chunk, {priced['vae_source']})"
    cfg += " ¹" if r.get("partial") else ""
    batch = _f(row.get("mean_batch"), ".2f")
    if priced.get("max_batch"):  # the Stream Batch picked from the stages' calibrations
        batch += f" (at most {priced['max_batch']})"
    return (
        f"| {cfg} | {gpus} | {held} | {row['admitted']} / {row['held']} | {refusal} | "
        f"{_ms(row.get('ttff_p50_s'))} / {_ms(row.get('ttff_p95_s'))} | {_f(row.get('on_time_min'), '.1%')} | "
        f"{row.get('freezes', '–')} | {_share(row.get('steps_chosen'))} | {batch} | "
        + " / ".join(_f(s.get("mean_forward_ms"), ".1f") + _eager(s) for s in stages)
        + f" | {_mib(mem.get('decoder_state_bytes_per_stream'))} / {_mib(mem.get('kv_bytes_per_stream'))} | "
        f"{_f(row.get('gateway_cpu_ms_per_frame'), '.2f')} | {r['commit']} |"
    )


def _looks(runs: list[dict]) -> list[str]:
    """Capacity looks from load rows that met a refusal (runs without capacity rows)."""
    looks = []
    for r in runs:  # a look from load rows (streams opened together): no refusal timing, batch, memory nor CPU
        look = _load_capacity(r) if not (r.get("system") or {}).get("capacity") else None
        if look is None:
            continue
        a, row = r["args"], look["row"]
        gpus = a["stages"] * a.get("sp", 1) * a.get("cfg_parallel", 1)
        held = f"**{look['held'] / gpus:g}**" if look["exact"] else f"– ({look['held']} of {look['admitted']} held)"
        looks.append(
            f"| {capacity_config(a, (a.get('decoders') or ['full'])[0])} (load rows: {row['streams']} opened at once, "
            f"`{r['_file']}`) | {gpus} | {held} | {look['admitted']} / {look['held']} | {look['code']} | "
            f"{_ms(row.get('ttff_p50_s'))} / {_ms(row.get('ttff_p95_s'))} | {_f(row.get('on_time_min'), '.1%')} | "
            f"{_share(look['steps'])} (frames) | {r['commit']} |"
        )
    return looks


def _ramps(runs: list[dict]) -> list[str]:
    """The stages' ms per forward on the way to capacity, per capacity row."""
    ramps = []
    for r in runs:  # the stages' ms per forward at each batch on the way to capacity (DiT ms per chunk at 1 step)
        a = r["args"]
        main_stages = (r.get("system") or {}).get("stages") or (r.get("system") or {}).get("main_stages") or []
        for row in (r.get("system") or {}).get("capacity") or []:
            parts = [
                f"{e['streams']} open: "
                + " / ".join(
                    f"{_f(st['mean_forward_ms'], '.1f')} ms at batch {_f(st['mean_batch'], '.2f')}{_eager(st)}"
                    for st in e["stages"]
                )
                for e in row.get("ramp") or []
                if all(st.get("mean_forward_ms") is not None for st in e["stages"])
            ]
            if main_stages and (r.get("system") or {}).get("main"):
                parts.insert(
                    0,
                    "the unpaced main stream alone: "
                    + " / ".join(
                        f"{_f(st['mean_forward_ms'], '.1f')} ms at batch {_f(st['mean_batch'], '.2f')}"
                        for st in main_stages
                    ),
                )
            if parts:
                ramps.append(f"- {capacity_config(a, row['decoder'])} ({r['commit']}): " + "; ".join(parts))
    return ramps


def _slowest(runs: list[dict]) -> list[str]:
    """Each capacity row's slowest first frame, taken apart."""
    slowest = []
    for r in runs:  # where the slowest first frame's time went (results from 145e5ca on stamp the opening)
        for row in (r.get("system") or {}).get("capacity") or []:
            parts = row.get("ttff_slowest_parts_ms")
            if parts and "first_chunk" in parts:
                total = sum(parts[k] for k in ("pipeline", "vae", "encode", "rest"))
                slowest.append(
                    f"- {capacity_config(r['args'], row['decoder'])} ({r['commit']}): {total:.0f} ms = "
                    + " + ".join(f"{name} {parts[k]:.0f}" for k, name in TTFF_PARTS)
                )
    return slowest


def capacity_table(runs: list[dict], page: bool = False) -> str:
    """Capacity per GPU: paced streams (16 FPS) held (>= 99% of frames on time over the measured window) with the
    next one refused at once; from the harness's ``--capacity`` rows, and a look from load rows that met a refusal."""
    out = ["### Capacity: paced streams held per GPU (the headline)\n"]
    out.append(
        "| config | GPUs | **held per GPU** | admitted / held | first refusal (code, ms) | TTFF p50 / p95 at capacity "
        "(ms) | on time min | freezes | steps chosen | batch (micro-steps per forward) | DiT ms per batch "
        "| decoder state / KV per stream (MiB) | gateway CPU per frame (ms) | commit |"
    )
    out.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    seen: set[tuple] = set()
    rows = 0
    for r in runs:
        a = r["args"]
        gpus = a["stages"] * a.get("sp", 1) * a.get("cfg_parallel", 1)
        for row in (r.get("system") or {}).get("capacity") or []:
            rows += 1
            seen.add(_capacity_key(a, row["decoder"]))
            out.append(_capacity_row(r, row, gpus))
    if not rows:
        out.append("| (no capacity rows yet: see Missing) |||||||||||||")
    looks = [] if page else _looks(runs)  # the page keeps the capacity mode's rows; HISTORY.md these looks too
    if looks:
        out.append(
            "\nA look from load rows (not the capacity mode: the streams of a row opened together, on time over the "
            "whole stream; the first row of each run that met a refusal):\n"
        )
        out.append(
            "| config | GPUs | held per GPU | admitted / held | refusal | TTFF p50 / p95 (ms) | on time min "
            "| steps run | commit |"
        )
        out.append("|---|---|---|---|---|---|---|---|---|")
        out += looks
    ramps = [] if page else _ramps(runs)
    if ramps:
        out.append(
            "\nStages' ms per forward on the way to capacity (from one admission to the next: k streams running and "
            "the next one's first chunk; per stage):\n"
        )
        out += ramps
    slowest = _slowest(runs)
    if slowest:
        out.append(
            "\nThe slowest first frame at capacity, taken apart (ms: the prompt's encoding, the coordinator's "
            "admission, the first chunk through the stages, its decode, the frame's encoding, the rest of the way to "
            "the client):\n"
        )
        out += slowest
    missing = sorted(
        {
            (part, capacity_config(dict(zip(("model", "steps", "load_min_steps", "width", "height"), k[:5])), k[5]))
            for k, part in CAPACITY_CONFIGS.items()
            if k not in seen
        }
    )
    if missing:
        out.append(
            "\nMissing (no `--capacity` JSON yet): "
            + "; ".join(f"{cfg} (`STAGES=1 bash benchmarks/gpu_suite.sh {part}`)" for part, cfg in missing)
            + "."
        )
    out.append(
        "\nHeld per GPU: the page's Columns. Steps chosen: the SLO controller's choice per stream, as shares of the "
        "coordinator's status samples "
        "(or of frames, for a load-row look). Batch and DiT ms: the stages' forwards over the window (per stage). "
        "Memory: the gateway's decoder state per active stream and the stages' KV bytes per open stream, summed over "
        "stages (largest sample). Gateway CPU: its process's CPU seconds over the window per frame delivered.\n"
    )
    return "\n".join(out)


def load(results: Path) -> list[dict]:
    runs = []
    for path in sorted(results.glob("v2_*.json")):
        r = json.loads(path.read_text())
        if r.get("harness") == 2:
            r["_file"] = path.name
            gpu = str(r.get("gpu") or "")
            if gpu not in ("", "cpu") and PAGE_GPU not in gpu:  # another card: its rows name it, never the page's
                r["args"] = {**r["args"], "card": gpu.removeprefix("NVIDIA ")}
            runs.append(r)
    return runs


def burst_table(runs: list[dict]) -> str:
    """The burst rows (harness ``--burst N``): N paced streams opened at one instant on an idle system."""
    rows = []
    for r in runs:
        b = (r.get("system") or {}).get("burst")
        if not b:
            continue
        a = r["args"]
        rows.append(
            f"| {capacity_config(a, b['decoder'])} | {b['streams']} | {b['admitted']} / {b['held']} / "
            f"{b['refused']} | {_ms(b.get('ttff_p50_s'))} / {_ms(b.get('ttff_p95_s'))} | "
            f"{_f(b.get('refusal_ms_p50'), '.0f')} / {_f(b.get('refusal_ms_max'), '.0f')} | "
            f"{_f(b.get('on_time_min'), '.1%')} | {b['verdict']} | {r['commit']} |"
        )
    if not rows:
        return ""
    head = [
        "\n### Bursts: N paced streams opened at one instant (idle system, one GPU per stage)\n",
        "| config | opened | admitted / held / refused | TTFF p50 / p95 of the admitted (ms) | refusal p50 / max (ms) "
        "| on time min | verdict | commit |",
        "|---|---|---|---|---|---|---|---|",
    ]
    return "\n".join(head + rows)


def _has_main(r: dict) -> bool:
    """A run with the main stream's measurements (a capacity run with ``--seconds 0``, or one cut short, has none)."""
    s = r.get("system") or {}
    return bool(s.get("main") and s.get("lead") and "steady_fps" in s)


def _order(r: dict) -> tuple:
    """A run's place in time: the JSON's date, then the run number of a ``_rN`` file name (none: 1), then the name."""
    m = re.search(r"_r(\d+)\.json$", r.get("_file", ""))
    return (r.get("date") or "", int(m.group(1)) if m else 1, r.get("_file", ""))


def _gpu_count(a: dict) -> int:
    return a["stages"] * a.get("sp", 1) * a.get("cfg_parallel", 1)


def _main_key(r: dict) -> tuple:
    """A main stream's configuration: its config name from the arguments alone (no label, no measured VAE cost)."""
    return (config_name({"args": r["args"]}), _gpus(r["args"]))


def priced_by_hand(a: dict) -> bool:
    """A what-if of admission's pricing: the decode priced at fixed ms (``--slo-vae-ms``) or ``--gpu-sharing`` off
    its default.  Such runs are experiments, in HISTORY.md only: BENCHMARKS.md's rows are priced as served."""
    return isinstance(a.get("slo_vae_ms"), dict) or a.get("gpu_sharing", GPU_SHARING) != GPU_SHARING


def current(runs: list[dict]) -> list[dict]:
    """The newest result of each configuration: copies of the runs holding only the parts no later run measured again
    (capacity rows by config and decoder, a burst by config, the main stream by config, load rows by config and stream
    count); runs left with nothing, and what-ifs of the pricing (``priced_by_hand``), are dropped."""
    runs = sorted((r for r in runs if not priced_by_hand(r["args"])), key=_order)
    newest: dict[tuple, int] = {}
    for i, r in enumerate(runs):
        a, s = r["args"], r.get("system") or {}
        for row in s.get("capacity") or []:
            newest["capacity", capacity_config(a, row["decoder"]), _gpu_count(a)] = i
        if s.get("burst"):
            newest["burst", capacity_config(a, s["burst"]["decoder"]), _gpu_count(a)] = i
        if _has_main(r):
            newest[("main", *_main_key(r))] = i
        for row in s.get("load") or []:
            newest[("load", *_main_key(r), row["streams"])] = i
    peers = {}  # the newest peer and floor per model, size, steps, guidance and GPU count
    for r in runs:
        if (r.get("peer") or {}).get("fps") and (r.get("floor") or {}).get("fps"):
            peers[_peer_key(r)] = r
    out = []
    for i, r in enumerate(runs):
        a, s = r["args"], dict(r.get("system") or {})
        if s.get("capacity"):
            s["capacity"] = [
                row
                for row in s["capacity"]
                if newest["capacity", capacity_config(a, row["decoder"]), _gpu_count(a)] == i
            ]
        if s.get("burst") and newest["burst", capacity_config(a, s["burst"]["decoder"]), _gpu_count(a)] != i:
            s["burst"] = None
        main = _has_main(r) and newest[("main", *_main_key(r))] == i
        if _has_main(r) and not main:
            s["main"] = None
        if s.get("load"):
            s["load"] = [row for row in s["load"] if newest[("load", *_main_key(r), row["streams"])] == i]
        if main or s.get("capacity") or s.get("burst") or s.get("load"):
            r = {**r, "system": s}
            if main and not (r.get("peer") or {}).get("fps") and _peer_key(r) in peers:
                r = _peer_from(r, peers[_peer_key(r)])
            out.append(r)
    return out


def _peer_key(r: dict) -> tuple:
    a = r["args"]
    return (a["model"], a["width"], a["height"], a["steps"], a.get("guidance", 1.0), _gpus(a))


def _peer_from(r: dict, other: dict) -> dict:
    """A run without peers measured, given the peers and floor of ``other`` (same model, size, steps, guidance and
    GPUs) and the ratios to them recomputed from its own steady FPS."""
    fps, pc = r["system"]["steady_fps"], other.get("peer_compiled")
    ratios = {
        "vs_peer": fps / other["peer"]["fps"],
        "vs_peer_compiled": fps / pc["fps"] if pc else None,
        "of_floor": fps / other["floor"]["fps"],
    }
    return {
        **r,
        "peer": other["peer"],
        "peer_compiled": pc,
        "floor": other["floor"],
        "ratios": ratios,
        "_peer_file": other["_file"],
    }


def page_tables(runs: list[dict]) -> str:
    """BENCHMARKS.md's harness-v2 block: the current row of each configuration (``current``)."""
    return tables(current(runs), page=True)


def tables(runs: list[dict], page: bool = False) -> str:
    """The harness-v2 tables of these runs; ``page``: a short list of the files behind them instead of the runs
    table (versions and commands are in the index)."""
    out = []
    capacity = capacity_table(runs, page)
    if capacity:
        out.append(capacity)
    bursts = burst_table(runs)
    if bursts:
        out.append(bursts + "\n")
    mains = [r for r in runs if _has_main(r)]
    out += main_tables(mains, page)
    loaded = [r for r in runs if (r.get("system") or {}).get("load")]
    if loaded:
        out += load_table(loaded)
    out += decoder_guidance_tables(mains)
    notes = [f"¹ `{r['_file']}`: {r['partial']}" for r in runs if r.get("partial")]
    if notes:
        out.append("\n" + "\n".join(notes))
    if page:
        out.append(
            "\nFiles behind these rows (dates, versions and commands: `benchmarks/results/INDEX.md`; every earlier "
            "row: `benchmarks/results/HISTORY.md`): " + ", ".join(f"`{r['_file']}`" for r in runs) + "."
        )
    else:
        out += runs_table(runs)
    return "\n".join(out) + "\n"


def main_tables(runs: list[dict], page: bool = False) -> list[str]:
    out = []
    out.append("### Steady state and punctuality (the main stream)\n")
    out.append(
        "| config | GPUs | steady FPS | whole-stream FPS | on time @ target | max gap (ms) | p99 gap (ms) | "
        "gaps > 250 ms | lead max / bound (chunks) | peer eager | peer compiled | floor | vs eager | vs compiled "
        "| of floor |"
    )
    out.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in runs:
        s, m, pc = r["system"], r["system"]["main"], r.get("peer_compiled")
        peer, floor, ratios = r.get("peer") or {}, r.get("floor") or {}, r.get("ratios") or {}
        out.append(
            f"| {config_name(r)}{' ²' if r.get('_peer_file') else ''} | {_gpus(r['args'])} | "
            f"**{_f(s['steady_fps'])}** | {_f(s['whole_fps'])} | "
            f"{_f(m['on_time'], '.1%')} | {_f(m['max_gap_ms'], '.0f')} | {_f(m['p99_gap_ms'], '.0f')} | "
            f"{m['gaps_over_250ms']} | {s['lead']['max']} / {s['lead']['bound']} | {_f(peer.get('fps'))} | "
            f"{_f(pc['fps'] if pc else None)} | {_f(floor.get('fps'), '.0f')} | "
            f"{_x(ratios.get('vs_peer'))} | {_x(ratios.get('vs_peer_compiled'))} | "
            f"{_f(ratios.get('of_floor'), '.1%')} |"
        )
    borrowed = [r for r in runs if r.get("_peer_file")]
    if borrowed:
        out.append(
            "\n² The run measured no peers: "
            + "; ".join(f"`{r['_file']}` takes the peers and floor of `{r['_peer_file']}`" for r in borrowed)
            + " (same model, size, steps, guidance and GPU count; the ratios are to its own steady FPS)."
        )
    if not page:  # the page leaves the frame counts to the history
        out.append(
            "\nFrames of the main stream: "
            + "; ".join(f"{config_name(r)}: {r['system']['main']['frames']}" for r in runs)
            + "."
        )
    out.append("\n### Cold start, TTFF and interactive latency\n")
    out.append(
        "| config | time to READY (s) | first stream after READY: steady FPS / on time / max gap (ms) / gaps > 250 ms "
        "| its TTFF (ms) | TTFF p50 / p95 (ms) | TTFF parts p50: pipeline / VAE / encode / rest (ms) "
        "| PromptUpdate → first new frame p50 / p95 (ms) |"
    )
    out.append("|---|---|---|---|---|---|---|")
    for r in runs:
        # A part a run skipped (--first-seconds 0, --ttff-runs 0, --interactive-updates 0) shows as –.
        s, parts = r["system"], r["system"].get("ttff_parts_p50_ms") or {}
        fs = s.get("first_stream") or {"steady_fps": None, "on_time": None, "max_gap_ms": None, "ttff_s": None}
        inter = s.get("interactive") or {"p50_ms": None, "p95_ms": None}
        out.append(
            f"| {config_name(r)} | {_f(s['time_to_ready_s'])} | {_f(fs['steady_fps'])} / {_f(fs['on_time'], '.1%')} / "
            f"{_f(fs['max_gap_ms'], '.0f')} / {fs.get('gaps_over_250ms', '–')} | {_ms(fs['ttff_s'])} | "
            f"{_ms(s.get('ttff_p50_s'))} / {_ms(s.get('ttff_p95_s'))} | "
            + " / ".join(_f(parts.get(k), ".0f") for k in ("pipeline", "vae", "encode", "rest"))
            + f" | {_f(inter['p50_ms'], '.0f')} / {_f(inter['p95_ms'], '.0f')} |"
        )
    return out


def load_table(loaded: list[dict]) -> list[str]:
    out = []
    if loaded:
        out.append("\n### Load: concurrent streams\n")
        out.append(
            "| config | streams | per-stream steady FPS min / mean | on time min | TTFF p50 / p95 (ms) | aggregate FPS "
            "| failed | held (≥ 99% on time) | refused | steps run (frames) |"
        )
        out.append("|---|---|---|---|---|---|---|---|---|---|")
        for r in loaded:
            for row in r["system"]["load"]:
                out.append(
                    f"| {config_name(r)} | {row['streams']} | "
                    f"{_f(row['steady_fps_min'])} / {_f(row['steady_fps_mean'])} "
                    f"| {_f(row['on_time_min'], '.1%')} | {_ms(row['ttff_p50_s'])} / {_ms(row['ttff_p95_s'])} | "
                    f"{_f(row['aggregate_fps'])} | {row['failed']} | {row.get('held', '–')} "
                    f"| {row.get('refused', '–')} "
                    f"| {_steps(row.get('steps'))} |"
                )
            if r["system"].get("capacity_streams") is not None:
                out.append(f"| {config_name(r)} | capacity: {r['system']['capacity_streams']} streams held |||||||||")
    return out


def decoder_guidance_tables(runs: list[dict]) -> list[str]:
    out = []
    by_decoder = [r for r in runs if r["system"].get("main_by_decoder")]
    if by_decoder:
        out.append("\n### The main stream by decoder (one system, the same run)\n")
        out.append(
            "| config | decoder | steady FPS | whole-stream FPS | on time @ target | max gap (ms) | p99 gap (ms) "
            "| TTFF (ms) | frames | peer eager | floor |"
        )
        out.append("|---|---|---|---|---|---|---|---|---|---|---|")
        for r in by_decoder:
            s, peer, floor = r["system"], r.get("peer") or {}, r.get("floor") or {}
            mains = {s.get("decoder") or "full": {**s["main"], "steady_fps": s["steady_fps"]}, **s["main_by_decoder"]}
            for name, m in mains.items():
                out.append(
                    f"| {config_name(r)} | {name} | **{_f(m['steady_fps'])}** | {_f(m.get('whole_fps'))} | "
                    f"{_f(m['on_time'], '.1%')} | {_f(m['max_gap_ms'], '.0f')} | {_f(m['p99_gap_ms'], '.0f')} | "
                    f"{_ms(m.get('ttff_s'))} | {m['frames']} | {_f(peer.get('fps'))} | {_f(floor.get('fps'), '.0f')} |"
                )
    guided = [r for r in runs if r["args"].get("guidance", 1.0) > 1.0 and r["system"].get("comm")]
    if guided:
        out.append("\n### Classifier-free guidance: sequential CFG against CFG-parallel\n")
        out.append(
            "| config | GPUs | steady FPS | TTFF p50 (ms) | data-plane wait per step, by stage (ms) "
            "| CFG exchange per step (ms) | data-plane bytes per micro-step |"
        )
        out.append("|---|---|---|---|---|---|---|")
        for r in guided:
            s, comm = r["system"], r["system"]["comm"]
            waits = " / ".join(
                _f(v, ".2f") for _, v in sorted(comm["wait_ms_per_batch"].items(), key=lambda x: int(x[0]))
            )
            out.append(
                f"| {config_name(r)} | {_gpus(r['args'])} | **{_f(s['steady_fps'])}** | {_ms(s['ttff_p50_s'])} | "
                f"{waits} | "
                f"{_f(comm['exchange_ms_per_batch'], '.2f')} | {comm['data_plane_bytes_per_micro_step']:,} |"
            )
    return out


def runs_table(runs: list[dict]) -> list[str]:
    out = []
    out.append("\n### Runs\n")
    out.append("| file | commit | dirty | torch | CUDA | NCCL | diffusers | driver | GPUs | timesteps | command |")
    out.append("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in runs:
        v = r["versions"]
        steps = r["timesteps"] if isinstance(r["timesteps"], str) else ", ".join(f"{t:g}" for t in r["timesteps"])
        out.append(
            f"| `{r['_file']}` | {r['commit']} | {r['dirty']} | {v['torch']} | {v['cuda']} | {v['nccl']} | "
            f"{v['diffusers']} | {v['driver']} | {v['gpu_count']}× {v['gpu']} | {steps} | `{r['command']}` |"
        )
    return out


def load_decoders(results: Path) -> list[dict]:
    runs = []
    for path in sorted(results.glob("decoder_*.json")):
        r = json.loads(path.read_text())
        if r.get("bench") == "decoder":
            r["_file"] = path.name
            runs.append(r)
    return runs


def decoder_tables(runs: list[dict]) -> str:
    """One table per ``decoder_bench`` run: ms per chunk when N streams' chunks are decoded, and state per stream."""
    out = []
    for r in runs:
        frames = 4 * r["latent_frames"]
        out.append(
            f"### Decoders: {r['latent_frames']} latent frame(s) → {frames} frames per stream at {r['size']} "
            f"(`{r['_file']}`, {r['device']}, commit {r['commit']})\n"
        )
        out.append(
            "| decoder | variant | dtype | streams | ms per chunk, all streams | ms per chunk per stream "
            "| frames/s, all streams | state per stream (MiB) | peak GiB | max abs diff: batched vs alone, vs eager |"
        )
        out.append("|---|---|---|---|---|---|---|---|---|---|")
        for row in r["rows"]:
            if row.get("error"):
                out.append(f"| {row['decoder']} | {row['variant']} | – | {row['streams']} | {row['error']} |||||| ")
                continue
            out.append(
                f"| {row['decoder']} | {row['variant']} | {row['dtype']} | {row['streams']} | "
                f"{_f(row['chunk_ms'], '.2f')} | **{_f(row['per_stream_ms'], '.2f')}** | {_f(row['fps'], '.0f')} | "
                f"{_f(row['state_mib'], '.1f')} | {_f(row['peak_gib'], '.2f')} | "
                f"{_f(row.get('batch_max_diff'), '.2g')}, {_f(row.get('max_diff_vs_eager'), '.2g')} |"
            )
        out.append(f"\nCommand: `{r['command']}`\n")
    return "\n".join(out)


def load_levers(results: Path) -> list[dict]:
    runs = []
    for path in sorted(results.glob("dit_levers*.json")):
        r = json.loads(path.read_text())
        if r.get("variants") and r.get("batches"):
            r["_file"] = path.name
            runs.append(r)
    return runs


def shown_lever_runs(runs: list[dict]) -> list[dict]:
    """The lever runs BENCHMARKS.md shows: the fullest (most variant x batch cells; the newest of a tie, which
    supersedes the older) and the newest (by date, then file name) where it is dated after the fullest (a probe of a
    later day), in date order; every run stays listed in the results index."""
    if not runs:
        return []
    fullest = max(runs, key=lambda r: (len(r["variants"]) * len(r["batches"]), r.get("date", ""), r["_file"]))
    newest = max(runs, key=lambda r: (r.get("date", ""), r["_file"]))
    shown = [fullest] + ([newest] if newest.get("date", "") > fullest.get("date", "") else [])
    return sorted(shown, key=lambda r: (r.get("date", ""), r["_file"]))


def lever_tables(runs: list[dict]) -> str:
    """One table per shown ``dit_levers`` run (``shown_lever_runs``): ms per stream-chunk per lever and batch
    (``dit_levers.markdown``)."""
    from benchmarks.dit_levers import markdown  # torch and the stage's modules: only when there are lever runs

    out = []
    for r in shown_lever_runs(runs):
        p = r.get("protocol") or {}
        out.append(
            f"{r.get('date', '–')}, commit {r.get('commit', '–')}, {r.get('versions', {}).get('gpu', '–')}, "
            f"{MODEL_NAMES.get(r.get('model'), r.get('model'))} with {r.get('layers')} layers "
            f"(`{r['_file']}`, {p.get('iters', '–')} forwards after {p.get('warmup', '–')}; `{r['command']}`):\n"
        )
        out.append(markdown(r) + "\n")
    return "\n".join(out)


# What each kind of result file measures, by the start of its name (the index's last column); the first match wins.
FILE_KINDS = (
    ("v2v_", "video-to-video: throughput from a file and live input at 16 FPS (`benchmarks/v2v_bench.py`)"),
    ("webrtc_", "the browser edge: WebRTC beside gRPC (`benchmarks/webrtc.py`)"),
    ("startup_", "stage start-up from a checkpoint on disk (`benchmarks/startup.py`)"),
    ("fleet_sim", "a fleet of pipelines behind the door, simulated (`benchmarks/fleet_sim.py`)"),
    ("fairness_", "a paced stream beside unpaced ones (`benchmarks/fairness.py`)"),
    (
        "kv_admission_",
        "admission by KV memory: unbounded against windowed streams (`benchmarks/kv_admission_check.py`)",
    ),
    ("balance_", "a measured (or derived) stage and VAE profile for the balance planner (`benchmarks/predict.py`)"),
    ("attention_", "the DiT blocks' attention timed per batch and layout (`benchmarks/attention_check.py`)"),
    ("sdpa_backends", "each SDPA kernel forced alone on the DiT's attention shapes (`benchmarks/sdpa_backends.py`)"),
    ("fused_kernels", "the fused lever's kernels alone: time, bytes, rate (`benchmarks/fused_kernels.py`)"),
    ("dit_profile", "a DiT forward's costliest kernels under torch's profiler (`benchmarks/dit_levers.py --profile`)"),
    ("fp8_check", "FP8 blocks against bf16: time and error (`benchmarks/fp8_check.py`)"),
    ("vae_cudnn", "the VAE with and without cuDNN's algorithm search (`benchmarks/vae_graphs_check.py`)"),
    ("vae_graphs", "the VAE eager, compiled and CUDA-graphed (`benchmarks/vae_graphs_check.py`)"),
    ("decoder_bench", "the decoders per stream count: ms per chunk and state (`benchmarks/decoder_bench.py`)"),
    ("batched_decoder", "the batched tiny decoder (`benchmarks/batched_decoder_bench.py`)"),
    ("dit_levers", "the DiT levers at batch 1/4/8/12: ms per stream-chunk and error (`benchmarks/dit_levers.py`)"),
    ("tiny_profile", "the batched tiny decoder's call taken apart (`benchmarks/tiny_profile.py`)"),
)


def _harness_what(r: dict) -> str:
    s = r.get("system") or {}
    parts = []
    if _has_main(r):
        parts.append("main stream (steady FPS, punctuality, cold start, TTFF)")
    if s.get("load"):
        parts.append("load rows " + ", ".join(str(row["streams"]) for row in s["load"]))
    for row in s.get("capacity") or []:
        parts.append(f"capacity ({row['decoder']}: {row['admitted']} admitted / {row['held']} held)")
    if s.get("burst"):
        parts.append(f"burst of {s['burst']['streams']}")
    return "harness v2: " + ("; ".join(parts) or "no rows") + (" (cut short)" if r.get("partial") else "")


def describe(name: str, r: dict | None, of: dict | None = None) -> tuple[str, str, str, str]:
    """A result file's date, commit, configuration and what it measured, for the index (``of``: for a log beside a
    JSON, that JSON)."""
    if r is None:  # a log beside a JSON (its date and commit are the JSON's), or a file that is not JSON
        stem = name.split(".json")[0] + ".json" if ".json." in name else None
        if stem:
            date, commit, config, _ = describe(stem, of or {})
            return date, commit, config, f"the console log of `{stem}`'s run"
        what = "a run's console log"
        for prefix, kind in FILE_KINDS:
            if name.startswith(prefix):
                what += f": {kind}"
                break
        m = re.search(r"_([0-9a-f]{7})\.log$", name)
        return "–", m.group(1) if m else "–", "–", what
    date = str(r.get("date") or str(r.get("when") or "")[:10] or "–")
    commit = str(r.get("commit") or "–")
    a = r.get("args") if isinstance(r.get("args"), dict) else {}
    config = "–"
    if a.get("model") and a.get("width") and a.get("steps"):
        config = f"{MODEL_NAMES.get(a['model'], a['model'])} @ {a['width']}×{a['height']}, {a['steps']} step(s)"
        if "stages" in a:
            config += f", {_gpus(a)} GPU(s)"
    elif r.get("model"):
        config = MODEL_NAMES.get(r["model"], r["model"])
    if r.get("harness") == 2:
        what = _harness_what(r)
        capacity = (r.get("system") or {}).get("capacity") or []
        if capacity and not _has_main(r) and not (r.get("system") or {}).get("load"):  # a capacity run: its rows
            config = "; ".join(dict.fromkeys(capacity_config(a, row["decoder"]) for row in capacity))
        elif a.get("model"):
            config = config_name(r)
    elif "peer" in r and "floor" in r and "system" in r:
        what = "harness v1 (superseded: it counted a drain): steady FPS against the peer and the floor"
    else:
        what = next((kind for prefix, kind in FILE_KINDS if name.startswith(prefix)), "–")
    return date, commit, config, what


def index(results: Path) -> str:
    """``INDEX.md``: every file in the results folder, then each harness-v2 run's versions and command."""
    out = [
        "# Benchmark results: the index",
        "",
        "Generated by `python -m benchmarks.report` from the files in this folder; do not edit by hand. The current "
        "row of each configuration is in `BENCHMARKS.md`; every harness-v2 row, and the prose of earlier pages, in "
        "`HISTORY.md`.",
        "",
        "| file | date | commit | config | what it measured |",
        "|---|---|---|---|---|",
    ]
    for path in sorted(results.iterdir()):
        if not path.is_file() or path.name in ("INDEX.md", "HISTORY.md") or path.name.startswith("."):
            continue
        r = None
        if path.suffix == ".json":
            try:
                r = json.loads(path.read_text())
            except ValueError:
                r = None
        if r is not None and not isinstance(r, dict):
            r = {}
        of = None
        if r is None and ".json." in path.name:  # a log beside a JSON
            sibling = results / (path.name.split(".json")[0] + ".json")
            of = json.loads(sibling.read_text()) if sibling.exists() else None
        cells = describe(path.name, r, of if isinstance(of, dict) else None)
        out.append(f"| `{path.name}` | " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    out += runs_table(load(results))
    return "\n".join(out) + "\n"


def render(document: str, body: str, begin: str = BEGIN, end: str = END) -> str:
    block = f"{begin}\n{body}{end}"
    if begin in document and end in document:
        head, rest = document.split(begin, 1)
        return head + block + rest.split(end, 1)[1]
    return document.rstrip("\n") + "\n\n" + block + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default="benchmarks/results")
    ap.add_argument("--out", default="BENCHMARKS.md", help="the page: the current row of each configuration")
    ap.add_argument("--history", default=None, help="every harness-v2 row (default: RESULTS/HISTORY.md, if it exists)")
    ap.add_argument("--index", default=None, help="the index of the results folder (default: RESULTS/INDEX.md)")
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 naming each file that is stale")
    args = ap.parse_args(argv)
    results = Path(args.results)
    runs = load(results)
    decoders = load_decoders(results)
    levers = load_levers(results)
    if not runs and not decoders and not levers:
        print(
            f"no harness-v2 results (v2_*.json), decoder tables (decoder_*.json) nor DiT lever runs (dit_levers*.json) "
            f"in {args.results}",
            file=sys.stderr,
        )
        return 1
    written = generate(results, Path(args.out), args.history, args.index, runs, decoders, levers)
    stale = [path for path, text in written.items() if not path.exists() or path.read_text() != text]
    if args.check:
        for path in stale:
            print(f"{path}: stale; regenerate it with python -m benchmarks.report", file=sys.stderr)
        return 1 if stale else 0
    for path, text in written.items():
        path.write_text(text)
    print(
        f"{', '.join(map(str, written))}: tables from {len(runs)} harness run(s), {len(decoders)} decoder run(s) and "
        f"{len(levers)} DiT lever run(s)"
    )
    return 0


def generate(
    results: Path,
    out: Path,
    history: str | None,
    index_path: str | None,
    runs: list[dict],
    decoders: list[dict],
    levers: list[dict],
) -> dict[Path, str]:
    """What each file should hold: the page, the history (where it exists or is named) and the index."""
    written = {}
    document = out.read_text() if out.exists() else ""
    if runs:
        document = render(document, page_tables(runs))
    if decoders:
        document = render(document, decoder_tables(decoders), DEC_BEGIN, DEC_END)
    if levers:
        document = render(document, lever_tables(levers), LEV_BEGIN, LEV_END)
    written[out] = document
    hist = Path(history) if history else results / "HISTORY.md"
    if runs and (history or hist.exists()):
        written[hist] = render(hist.read_text() if hist.exists() else "", tables(runs))
    written[Path(index_path) if index_path else results / "INDEX.md"] = index(results)
    return written


def _gpus(a: dict) -> str:
    """The GPU column: the stage count, "PP=2×SP=2" for sequence-parallel stages (one GPU per rank), or the stage
    processes of CFG-parallel pipelines (stages × 2)."""
    sp = a.get("sp", 1)
    if sp == 1:
        return str(a["stages"] * a.get("cfg_parallel", 1))
    return f"PP={a['stages']}×SP={sp}"


if __name__ == "__main__":
    sys.exit(main())
