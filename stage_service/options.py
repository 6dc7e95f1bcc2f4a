"""``StageOptions``: one stage process's options, each field its own ``stagecast stage`` flag.

``stage_service.cli`` adds the flags with ``stagecast.flags.add_flags`` and builds the options with ``from_args``,
then settles what the command line leaves open (the index from ``$STAGECAST_STAGE_INDEX`` and ``--sp-rank``, a
``cuda`` device, the checkpoint's transformer folder, the LoRA files); a launcher writes a stage's command line with
``stagecast.flags.to_argv``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from stagecast.flags import flag
from stagecast.names import DTYPE_NAMES
from stagecast.service import health_port_flag, metrics_host_flag

if TYPE_CHECKING:
    from stagecast.security import MTLS


def _lora_text(lora) -> str:
    return lora if isinstance(lora, str) else f"{lora.path}:{lora.scale:g}"


@dataclass(kw_only=True)
class StageOptions:
    # The rank this process registers as (stage * sp + sp_rank); on the command line the stage index, with --sp-rank.
    index: int | None = flag(type=int, help="stage index (default: $STAGECAST_STAGE_INDEX)")
    coordinator: str = flag(help="coordinator host:port", required=True)
    checkpoint: str = flag(help="transformer checkpoint folder (or a folder holding transformer/)", required=True)
    device: str = flag("cpu", help="cpu, cuda (-> cuda:<index %% GPUs>) or cuda:N")
    dtype: str = flag("float32", choices=DTYPE_NAMES, help="weights")
    host: str = flag("127.0.0.1", help="address to bind")
    port: int = flag(50060, help="gRPC port (0: any free port)")
    advertise_host: str | None = flag(help="address the coordinator and peers use for this stage")
    expected_world_size: int = flag(0, name="--expected-stages", help="refuse to join a coordinator of another size")
    sp: int = flag(
        1,
        help="sequence-parallel ranks of this stage (Ulysses; the coordinator runs the same --sp); this process "
        "registers as rank index * sp + sp-rank",
    )
    sp_rank: int | None = flag(
        type=int,
        help="this process's rank within its stage's --sp ranks (default: the index is the global rank "
        "stage * sp + sp-rank, as a StatefulSet's pod index is)",
    )
    # run the blocks as CUDA graphs (``stage_service.graphs``); ignored on CPU
    cuda_graphs: bool = flag(False, action="store_true", help="run the slice's blocks as CUDA graphs (GPU)")
    # block linears as torchao float8 (``stage_service.fp8``); refused where it cannot run
    fp8: bool = flag(
        False,
        action="store_true",
        help="run the transformer blocks' linear layers in float8 (torchao, rowwise scales; norms, embeddings, head "
        "and attention stay bf16): GPU of compute capability 8.9+, --dtype bfloat16, the fp8 extra; not bit-exact",
    )
    # opt-in DiT levers (``stage_service.dit_levers``), checked at start-up; empty: the exact default path
    dit_levers: str = flag(
        "",
        help="comma-separated DiT levers, none by default: fp8 (block linears as float8 with rowwise scales, "
        "torch._scaled_mm), fused (the work between the GEMMs compiled into a few kernels per block), cudnn (cuDNN's "
        "attention op itself; torch 2.11 on an H200 already picks it); fused@dynamic compiles fused with every "
        "dimension symbolic (the default, fused@rows, keeps the channels static); each changes the numbers a little "
        "(benchmarks/dit_levers.py measures time and error)",
    )
    # READY calibration's budget (0: none; None: 10 s on a GPU, none on a CPU)
    calibration_s: float | None = flag(
        type=float,
        help="at READY, time this slice's forwards (batch sizes 1..the coordinator's --max-batch, the serving size of "
        "stagecast.json or 832x480, empty and full KV window) for the coordinator's SLO model, for at most this many "
        "seconds (0: skip; the coordinator then learns from measured batches); default: 10 on a GPU, 0 on a CPU (the "
        "processes sharing its cores make a start-up timing say little about serving)",
    )
    # bytes given to streams' KV (``stage_service.kv_budget``); 0: derive it
    kv_budget_gib: float = flag(
        0.0,
        help="GiB this stage gives to streams' self-attention KV: the coordinator admits a stream only while every "
        "stage holds the admitted streams' worst-case KV plus its own (0: derive it: on a GPU the memory free after "
        "loading and calibrating less a reserve for activations and graphs; on a CPU no limit)",
    )
    # this process's share of its GPU (``stage_service.kv_budget``; ``stagecast up`` plans it on a shared GPU); 0: none
    device_memory_gib: float = flag(
        0.0,
        help="the most of its GPU this stage plans for, in GiB: the KV budget is this share less what the stage holds "
        "after loading and calibrating, its activation peak, the graphs' buffer cap and a reserve (fractions of the "
        "share), so it does not depend on when a process beside it on the GPU loads (stagecast up sets it when the "
        "gateway or another pipeline shares the GPU); 0: derive from the device's free memory; --kv-budget-gib wins",
    )
    metrics_port: int = flag(0, help="Prometheus port (0: off)")
    # ``stage_service.lora.LoraSpec`` s merged into the slice at load, in order (PATH[:SCALE] texts on the command line)
    loras: tuple = flag(
        (),
        name="--lora",
        action="append",
        metavar="PATH[:SCALE]",
        format=_lora_text,
        help="a LoRA safetensors file (diffusers, PEFT or kohya keys) merged into this stage's layers at load; "
        "repeatable, applied in order",
    )
    metrics_host: str | None = metrics_host_flag()  # None: ``host``
    health_port: int = health_port_flag()
    mtls: MTLS | None = None  # deployment credentials (role "stage"); None: plaintext (--insecure-internal)
