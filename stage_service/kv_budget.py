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
  run) plus ``RESERVE_FRACTION`` of the GPU for what is not per-stream KV (the CUDA graphs' memory pool, NCCL's
  buffers, the streams' text K/V and latents, the allocator's fragmentation), and with ``--cuda-graphs`` the graphs'
  static buffers' cap (``graph_buffer_cap``: ``GRAPH_FRACTION`` of the GPU, which ``GraphedBlocks`` keeps to by
  running a batch signature eagerly when its new buffers would pass it).  What another process takes on the same GPU
  after the measurement is not seen (a gateway whose text encoder and VAE share the stage's GPU, as on one GPU): the
  reserve absorbs a little of it, and such a stage should be given ``--kv-budget-gib``.  A budget that comes
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
# Of the GPU's memory, what CUDA graphs' static buffers may hold (``GraphedBlocks.max_buffer_bytes``): each slot holds a
# copy of a batch item's KV window, per batch position and per signature captured in the background, so a window that
# keeps growing would otherwise take a new signature's buffers every chunk (an unbounded window's stream ran a one-GPU
# stage out of memory that way).  30% of an H200 holds the benchmark protocol's (6-frame windows, batches of 4)
# for the 1.3B model several times over.
GRAPH_FRACTION = 0.30
MAX_KV_BUDGET_GIB = 1 << 20  # --kv-budget-gib's upper bound (1 PiB: far above any device)


def check_kv_budget_gib(gib: float) -> float:
    """``--kv-budget-gib``: in [0, MAX_KV_BUDGET_GIB] (0: derive); raises ValueError naming the flag."""
    if not (0 <= gib <= MAX_KV_BUDGET_GIB) or math.isnan(gib):
        raise ValueError(f"--kv-budget-gib: must be in [0, {MAX_KV_BUDGET_GIB}] GiB (0: derive it), got {gib}")
    return gib


def kv_budget(operator_gib: float, *, free: int, total: int, activation_peak: int, graph_bytes: int = 0) -> int:
    """The budget in bytes from the operator's flag, else from a GPU's ``free`` bytes (free to this process) of
    ``total`` less the reserve and the graphs' buffer cap ``graph_bytes`` (see the module docstring); at least 1 when
    derived."""
    if operator_gib > 0:
        return max(1, int(operator_gib * GIB))
    reserve = activation_peak + int(RESERVE_FRACTION * total) + graph_bytes
    return max(1, free - reserve)


def graph_buffer_cap(device: torch.device, cuda_graphs: bool) -> int | None:
    """The cap on CUDA graphs' static buffers: ``GRAPH_FRACTION`` of the GPU with ``--cuda-graphs``; None (no graphs,
    or a CPU, whose rerun "graphs" are the tests') otherwise."""
    if not cuda_graphs or device.type != "cuda":
        return None
    return int(GRAPH_FRACTION * torch.cuda.get_device_properties(device).total_memory)


def measure_kv_budget(
    device: torch.device, *, operator_gib: float, activation_peak: int = 0, graph_bytes: int = 0
) -> int:
    """``kv_budget`` on ``device`` now: 0 (no limit) on a CPU without the operator's flag."""
    if operator_gib > 0:
        return kv_budget(operator_gib, free=0, total=0, activation_peak=0)
    if device.type != "cuda":
        return 0
    free, total = torch.cuda.mem_get_info(device)
    unused = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return kv_budget(0.0, free=free + unused, total=total, activation_peak=activation_peak, graph_bytes=graph_bytes)
