"""How many bytes a stage process gives to streams' self-attention KV: what it tells the coordinator at Form.

Usage (``stage_service.server`` after loading and calibrating its slice)::

    budget = measure_kv_budget(device, operator_gib=opts.kv_budget_gib, activation_peak=peak)
    pb.FormReply(..., kv_budget_bytes=budget)

The coordinator admits a stream only while, on every stage, the worst cases of the admitted streams plus the
newcomer's (``stagecast.kv_memory.stream_kv_bytes``) fit this budget, so one stream's growing KV window can no longer
run a stage out of memory and take every other stream down with it.

- ``--kv-budget-gib`` > 0 (the operator's) is the budget, on any device.
- On a GPU the budget is measured once the slice is loaded and calibrated: the memory free to this process (what the
  driver reports free plus what PyTorch's allocator holds unused) less a reserve of ``activation_peak`` (the most the
  calibration's forwards of the coordinator's batch sizes allocated above the weights, measured; 0 when it did not
  run) plus ``RESERVE_FRACTION`` of the GPU for what is not per-stream KV: CUDA graphs' static buffers and memory
  pool, NCCL's buffers, the streams' text K/V and latents, and the allocator's fragmentation.  A budget that comes
  out below one byte is one byte (0 would mean "no limit"): such a stage admits no stream, and says so.
- On a CPU the budget is 0, "no limit": a CPU stage shares the host's memory with its peers (a local cluster runs
  every stage, the coordinator and the gateway on one host), so a figure read from the host would count the same
  memory once per stage, and the OS, not a fixed pool, decides what fits.  The operator's flag bounds it there.
"""

from __future__ import annotations

import math

import torch

GIB = 1 << 30
RESERVE_FRACTION = 0.10  # of the GPU's memory, kept out of the KV budget for everything that is not per-stream KV
MAX_KV_BUDGET_GIB = 1 << 20  # --kv-budget-gib's upper bound (1 PiB: far above any device)


def check_kv_budget_gib(gib: float) -> float:
    """``--kv-budget-gib``: in [0, MAX_KV_BUDGET_GIB] (0: derive); raises ValueError naming the flag."""
    if not (0 <= gib <= MAX_KV_BUDGET_GIB) or math.isnan(gib):
        raise ValueError(f"--kv-budget-gib: must be in [0, {MAX_KV_BUDGET_GIB}] GiB (0: derive it), got {gib}")
    return gib


def kv_budget(operator_gib: float, *, free: int, total: int, activation_peak: int) -> int:
    """The budget in bytes from the operator's flag, else from a GPU's ``free`` bytes (free to this process) of
    ``total`` less the reserve (see the module docstring); at least 1 when derived."""
    if operator_gib > 0:
        return max(1, int(operator_gib * GIB))
    reserve = activation_peak + int(RESERVE_FRACTION * total)
    return max(1, free - reserve)


def measure_kv_budget(device: torch.device, *, operator_gib: float, activation_peak: int = 0) -> int:
    """``kv_budget`` on ``device`` now: 0 (no limit) on a CPU without the operator's flag."""
    if operator_gib > 0:
        return kv_budget(operator_gib, free=0, total=0, activation_peak=0)
    if device.type != "cuda":
        return 0
    free, total = torch.cuda.mem_get_info(device)
    unused = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return kv_budget(0.0, free=free + unused, total=total, activation_peak=activation_peak)
