"""Benchmark harness v2 (``python -m benchmarks.harness``; the usage is ``benchmarks.harness.cli``'s docstring).

Its jobs, one module each: ``cli`` (the flags and the run's phases), ``system`` (the system measured and the streams
opened on it), ``capacity`` (the capacity and burst rows), ``peers`` (the single-GPU peers and the compute floor),
``rows`` (versions, frame statistics, labels and the markdown row).  The names other benchmarks and the tests use
are re-exported here.
"""

from benchmarks.harness.capacity import capacity_stream, measure_capacity
from benchmarks.harness.cli import main, run_system
from benchmarks.harness.rows import (
    LADDER,
    VAE_FOR_MODEL,
    cfg_label,
    comm_summary,
    fp8_label,
    frame_stats,
    git_commit,
    gpu_name,
    log,
    markdown_row,
    percentile,
    tree_dirty,
    versions,
)
from benchmarks.harness.system import (
    StreamRecord,
    balance,
    coordinator_args,
    smoke_system,
    start_system,
    system_device,
    system_flags,
    vae_devices_of,
    write_assets,
)

__all__ = [
    "LADDER",
    "VAE_FOR_MODEL",
    "StreamRecord",
    "balance",
    "capacity_stream",
    "cfg_label",
    "comm_summary",
    "coordinator_args",
    "fp8_label",
    "frame_stats",
    "git_commit",
    "gpu_name",
    "log",
    "main",
    "markdown_row",
    "measure_capacity",
    "percentile",
    "run_system",
    "smoke_system",
    "start_system",
    "system_device",
    "system_flags",
    "tree_dirty",
    "vae_devices_of",
    "versions",
    "write_assets",
]
