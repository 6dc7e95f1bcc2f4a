"""How many bytes a stage process gives to streams' self-attention KV: what it tells the coordinator at Form.

Usage (``stage_service.slice_loader`` after loading and calibrating its slice)::

    budget = measure_kv_budget(device, operator_gib=opts.kv_budget_gib, activation_peak=peak,
                               graph_bytes=cap, share_gib=opts.device_memory_gib)
    pb.FormReply(..., kv_budget_bytes=budget.bytes)
    short = stream_fit_problem(budget, need, index=0, what="...")   # Form refuses a stage that holds no stream

The coordinator admits a stream only while, on every stage, the worst cases of the admitted streams plus the
newcomer's (``stagecast.kv_memory.stream_kv_bytes``) fit this budget, so one stream's growing KV window can no longer
run a stage out of memory and take every other stream down with it.

- ``--kv-budget-gib`` > 0 (the operator's) is the budget, on any device, whatever else is set.
- ``--device-memory-gib`` G > 0 (this process's share of its GPU, e.g. ``stagecast up``'s plan when the gateway or
  another pipeline's processes share the device: ``launcher.memory_plan``): the budget counts the process's own
  memory, not the device's free memory, so it does not depend on when a neighbour loads: G less what this process
  holds after loading and calibrating (``torch.cuda.memory_allocated``, plus ``CONTEXT_BYTES`` for the CUDA context,
  cuBLAS / NCCL workspaces and whatever else the allocator does not see), less the calibration's activation peak,
  less the graphs' static buffers' cap (``GRAPH_FRACTION`` of G) and a reserve (``RESERVE_FRACTION`` of G).
- Otherwise on a GPU it is measured once the slice is loaded and calibrated: the memory free to this process (what the
  driver reports free plus what PyTorch's allocator holds unused) less a reserve of ``activation_peak`` (what one
  calibration forward of the coordinator's batch sizes allocated above what it began with, measured, twice with CUDA
  graphs: ``activation_reserve``; 0 when it did not run) plus ``RESERVE_FRACTION`` of the GPU for what is not
  per-stream KV (NCCL's buffers, the streams' text K/V and latents, the allocator's fragmentation), and with
  ``--cuda-graphs`` the graphs' static buffers' cap (``graph_buffer_cap``: ``GRAPH_FRACTION`` of the GPU, which
  ``GraphedBlocks`` keeps to by running a batch signature eagerly when its new buffers would pass it).  What another
  process takes on the same GPU after the measurement is not seen (a gateway whose text encoder and VAE share the
  stage's GPU): on a shared GPU give the stage its share (``--device-memory-gib``, which ``stagecast up`` plans) or
  ``--kv-budget-gib``.
- A budget that comes out below one byte is one byte (0 would mean "no limit").  A stage whose budget holds no stream
  at the serving defaults (``stagecast.kv_memory.serving_spec``) refuses to form (``stream_fit_problem``), so the
  coordinator never becomes READY on it: its start-up fails naming the numbers.
- On a CPU the budget is 0, "no limit": a CPU stage shares the host's memory with its peers (a local cluster runs
  every stage, the coordinator and the gateway on one host), so a figure read from the host would count the same
  memory once per stage, and the OS, not a fixed pool, decides what fits.  The operator's flag bounds it there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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


# What a process holds on its GPU that ``torch.cuda.memory_allocated`` does not count: the CUDA context, cuBLAS and
# cuDNN workspaces, NCCL's buffers, the allocator's rounding.  Counted against a process's share
# (``--device-memory-gib``).
CONTEXT_BYTES = 1 * GIB
MAX_DEVICE_MEMORY_GIB = MAX_KV_BUDGET_GIB


def check_device_memory_gib(gib: float) -> float:
    """``--device-memory-gib``: in [0, MAX_DEVICE_MEMORY_GIB] (0: derive from the device's free memory)."""
    if not (0 <= gib <= MAX_DEVICE_MEMORY_GIB) or math.isnan(gib):
        raise ValueError(
            f"--device-memory-gib: must be in [0, {MAX_DEVICE_MEMORY_GIB}] GiB (0: the device's free memory), got {gib}"
        )
    return gib


@dataclass(frozen=True)
class KvBudget:
    """A stage's KV budget (bytes; 0: no limit) and where it came from, for its log line and a refusal."""

    bytes: int
    origin: str


def activation_reserve(per_forward: int | None, whole_peak: int, *, cuda_graphs: bool) -> int:
    """What a stage keeps out of its KV budget for its forwards' activations (``activation_peak`` below): its
    calibration's per-forward measurement (``Calibration.activation_bytes``), twice with CUDA graphs (a new batch
    signature captures in the background while the batch runs eagerly: two forwards' activations at once, and the
    graphs' pool keeps the captured ones'); where that was not measured, ``whole_peak``, the calibration's peak over
    everything it allocated (its own streams' K/V included: too much, never too little)."""
    if per_forward is None:
        return max(0, whole_peak)
    return max(0, per_forward) * (2 if cuda_graphs else 1)


def kv_budget(operator_gib: float, *, free: int, total: int, activation_peak: int, graph_bytes: int = 0) -> int:
    """The budget in bytes from the operator's flag, else from a GPU's ``free`` bytes (free to this process) of
    ``total`` less the reserve and the graphs' buffer cap ``graph_bytes`` (see the module docstring); at least 1 when
    derived."""
    if operator_gib > 0:
        return max(1, int(operator_gib * GIB))
    reserve = activation_peak + int(RESERVE_FRACTION * total) + graph_bytes
    return max(1, free - reserve)


def share_kv_budget(share: int, *, held: int, activation_peak: int, graph_bytes: int) -> int:
    """The budget of a process given ``share`` bytes of its GPU (``--device-memory-gib``): the share less what it
    holds (``held``: ``torch.cuda.memory_allocated`` after loading and calibrating) and ``CONTEXT_BYTES``, the
    activation peak, the graphs' buffer cap (``graph_bytes``: ``GRAPH_FRACTION`` of the share with graphs) and
    ``RESERVE_FRACTION`` of the share; at least 1."""
    reserve = int(RESERVE_FRACTION * share)
    return max(1, share - held - CONTEXT_BYTES - activation_peak - graph_bytes - reserve)


def share_fractions(cuda_graphs: bool) -> float:
    """What of a share is kept out of the KV budget in proportion to it: the reserve, and the graphs' cap."""
    return RESERVE_FRACTION + (GRAPH_FRACTION if cuda_graphs else 0.0)


def planned_kv_budget(share: int, *, weights: int, activation_peak: int, cuda_graphs: bool) -> int:
    """What ``share_kv_budget`` will give a stage whose slice holds ``weights`` bytes (a plan's forecast: the stage
    itself counts what it really holds)."""
    graph_bytes = int(GRAPH_FRACTION * share) if cuda_graphs else 0
    return share_kv_budget(share, held=weights, activation_peak=activation_peak, graph_bytes=graph_bytes)


def share_for_kv(kv: int, *, weights: int, activation_peak: int, cuda_graphs: bool) -> int:
    """The smallest share whose ``planned_kv_budget`` is at least ``kv`` bytes (the inverse, for a plan)."""
    fixed = kv + weights + CONTEXT_BYTES + activation_peak
    share = math.ceil(fixed / (1.0 - share_fractions(cuda_graphs)))
    while planned_kv_budget(share, weights=weights, activation_peak=activation_peak, cuda_graphs=cuda_graphs) < kv:
        share += 1 << 20  # int() rounding of the fractions: a MiB more
    return share


def graph_buffer_cap(device: torch.device, cuda_graphs: bool, share_gib: float = 0.0) -> int | None:
    """The cap on CUDA graphs' static buffers: ``GRAPH_FRACTION`` of the process's share (``--device-memory-gib``),
    else of the GPU, with ``--cuda-graphs``; None (no graphs, or a CPU, whose rerun "graphs" are the tests')
    otherwise."""
    if not cuda_graphs or device.type != "cuda":
        return None
    if share_gib > 0:
        return int(GRAPH_FRACTION * share_gib * GIB)
    return int(GRAPH_FRACTION * torch.cuda.get_device_properties(device).total_memory)


def measure_kv_budget(
    device: torch.device, *, operator_gib: float, activation_peak: int = 0, graph_bytes: int = 0, share_gib: float = 0.0
) -> int:
    """``kv_budget`` on ``device`` now: 0 (no limit) on a CPU without the operator's flag."""
    return measure_kv_budget_detail(
        device, operator_gib=operator_gib, activation_peak=activation_peak, graph_bytes=graph_bytes, share_gib=share_gib
    ).bytes


def measure_kv_budget_detail(
    device: torch.device,
    *,
    operator_gib: float,
    activation_peak: int = 0,
    graph_bytes: int = 0,
    share_gib: float = 0.0,
    allocated: int | None = None,
    free_total: tuple[int, int] | None = None,
) -> KvBudget:
    """The budget and its origin (see the module docstring): the operator's, this process's share less what it holds,
    or the device's free memory now.  ``allocated`` / ``free_total``: injected for tests (default: read from
    ``device``)."""
    if operator_gib > 0:
        budget = kv_budget(operator_gib, free=0, total=0, activation_peak=0)
        return KvBudget(budget, f"--kv-budget-gib {operator_gib:g}")
    if device.type != "cuda":
        return KvBudget(0, "no limit on a CPU (--kv-budget-gib sets one)")
    peak = f"{activation_peak / GIB:.2f} GiB of activation peak"
    graphs = f", {graph_bytes / GIB:.1f} GiB for CUDA graphs' buffers" if graph_bytes else ""
    if share_gib > 0:
        held = torch.cuda.memory_allocated(device) if allocated is None else allocated
        share = int(share_gib * GIB)
        budget = share_kv_budget(share, held=held, activation_peak=activation_peak, graph_bytes=graph_bytes)
        origin = (
            f"its {share_gib:.1f} GiB share of {device} (--device-memory-gib) less the {held / GIB:.1f} GiB it holds, "
            f"{CONTEXT_BYTES / GIB:.0f} GiB of CUDA context, {peak}{graphs} and a {RESERVE_FRACTION:.0%} reserve"
        )
        return KvBudget(budget, origin)
    if free_total is None:
        free, total = torch.cuda.mem_get_info(device)
        free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    else:
        free, total = free_total
    budget = kv_budget(0.0, free=free, total=total, activation_peak=activation_peak, graph_bytes=graph_bytes)
    origin = (
        f"{device}'s {free / GIB:.1f} GiB free after loading less {peak}{graphs} and a {RESERVE_FRACTION:.0%} reserve "
        "(a GPU shared with the gateway or another pipeline: give --device-memory-gib)"
    )
    return KvBudget(budget, origin)


def stream_fit_problem(budget: KvBudget, need: int, *, stage: int, stream: str) -> str | None:
    """Why a stage whose budget is ``budget`` cannot form (one stream at the serving defaults, ``stream``, needs
    ``need`` bytes of KV on it), or None when it holds one (or has no limit)."""
    if budget.bytes <= 0 or need <= budget.bytes:
        return None
    from stagecast.kv_memory import format_bytes

    return (
        f"stage {stage} holds no stream: one stream at the serving defaults ({stream}) needs {format_bytes(need)} of "
        f"KV on it, and it gives streams {format_bytes(budget.bytes)} ({budget.origin}); give the stage more memory "
        "(--kv-budget-gib, or --device-memory-gib on a shared GPU), put the gateway on another GPU, use more stages, "
        "or serve a smaller window, size or fewer steps (stagecast.json)"
    )
