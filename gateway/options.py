"""``GatewayOptions``: the gateway's options, each flag field its own ``stagecast gateway`` flag.

``gateway.cli`` adds the flags with ``stagecast.flags.add_flags`` and builds the options with ``from_args``; ``stagecast
up`` and the benchmark harness write a gateway's command line with ``stagecast.flags.to_argv`` (the per-client quotas
are a nested ``gateway.edge.quotas.QuotaOptions``).  Fields without a flag are set by code (tests, the CLI's ``mtls``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from gateway.edge.agent import FleetOptions
from gateway.edge.quotas import QuotaOptions
from stagecast.flags import flag, nested
from stagecast.names import DTYPE_NAMES
from stagecast.service import csv_list, health_port_flag, metrics_host_flag

if TYPE_CHECKING:
    from stagecast.security import MTLS

DTYPES = list(DTYPE_NAMES)


@dataclass
class GatewayOptions:
    coordinator: str = flag(help="coordinator host:port", required=True)
    checkpoint: str = flag(help="folder with transformer/ vae/ text_encoder/ tokenizer/", required=True)
    host: str = flag("127.0.0.1", help="address to bind")
    port: int = flag(50051, help="0: any free port (printed on the READY line)")
    device: str = flag("cpu", help="where the text encoder and VAE run: cpu, cuda, cuda:N")
    max_streams: int = flag(
        16,
        help="concurrent streams this gateway accepts (above what one pipeline holds, so that past capacity the "
        "coordinator's capacity check refuses, with its retry delay, not this count)",
    )
    metrics_port: int = flag(0, help="Prometheus port (0: off)")
    # None: the checkpoint's serving defaults (512 for real Wan checkpoints)
    text_len: int | None = flag(help="text tokens (default: checkpoint's, else 512)")
    text_dtype: str = flag(
        "auto", choices=["auto", *DTYPES], help="text encoder weights (auto: bfloat16 on a GPU, float32 on CPU)"
    )
    text_device: str | None = flag(help="where the text encoder runs (default: --device)")
    # on a GPU, the text encoder's forward as one captured CUDA graph (checked at start)
    text_graph: bool = flag(
        True,
        name="--no-text-graph",
        action="store_false",
        help="run the text encoder eagerly on a GPU (default: one captured CUDA graph, checked against eager at start)",
    )
    text_cache: int = 256
    vae_dtype: str = flag("float32", choices=DTYPES, help="VAE weights and activations")
    # torch.compile the VAE decoder, and the tiny decoder's pass at each batch bucket (GPU; compiled before the
    # gateway serves)
    vae_compile: bool = flag(
        False,
        action="store_true",
        help="torch.compile the VAE decoder, and the tiny decoder's pass at each batch size it pads to (GPU)",
    )
    # Device memory the streams' decoder states may hold (gateway.edge.admission.DecoderMemory); 0: on a GPU its free
    # memory at start-up less a reserve, on a CPU unbounded.
    decoder_memory_gib: float = flag(
        0.0,
        help="device memory the streams' decoder states may hold (full VAE ~1.8 GiB per 480x832 stream, tiny ~64 MiB)"
        "; a stream past it is refused with RESOURCE_EXHAUSTED. 0: on a GPU its free memory at start-up less a "
        "reserve (8 GiB or 10%%), on a CPU unbounded",
    )
    # The most of its GPU this gateway plans for (gateway.edge.admission.DecoderMemory); 0: its free memory at start-up.
    device_memory_gib: float = flag(
        0.0,
        help="the most of its decoder's GPU this gateway plans for, in GiB: the decoder-memory budget is this share "
        "less what the gateway holds once its models are loaded and warmed and a reserve, so it does not depend on "
        "when a stage beside it on the GPU loads (stagecast up sets it when stages share the GPU); 0: the free "
        "memory at start-up; --decoder-memory-gib wins",
    )
    # A stream's steady-state VAE frames as CUDA graph replays (gateway.decode.vae_graphs), captured before serving for
    # ``vae_graph_slots`` streams at the default size (0: ``max_streams``); the rest decode eagerly.
    vae_cuda_graphs: bool = flag(
        False,
        action="store_true",
        help="decode each stream's frames from its third on as CUDA graph replays, one captured graph per stream slot "
        "and VAE part, captured before serving at the default size and checked bit for bit against eager (a stream "
        "without a free slot, or of another size, decodes eagerly)",
    )
    # The tiny decoder's pass at its small buckets as CUDA graph replays (gateway.decode.tiny_graphs), captured at
    # start-up after the compile warm-up; off until a GPU capacity run shows it pays.
    tiny_cuda_graphs: bool = flag(
        False,
        action="store_true",
        help="run the tiny decoder's pass for calls of up to 4 streams as CUDA graph replays, captured before serving "
        "at the default size and checked bit for bit against the pass (GPU; other calls run as before)",
    )
    # cuDNN picks each VAE convolution's algorithm by timing (gateway.decode.stream_vae.use_cudnn_autotune; GPU only).
    vae_cudnn_benchmark: bool = flag(
        False,
        action="store_true",
        help="let cuDNN time each VAE convolution's algorithms on first use (GPU): ~10%% more steady FPS, but on an "
        "H200 every new stream's first VAE frame then took ~0.6 s longer (TTFF 0.23 -> 0.85 s), so it is off",
    )
    vae_graph_slots: int = flag(
        0,
        help="streams that can hold a VAE graph slot at once; each holds one stream's VAE cache (0: --max-streams)",
    )
    # Decode a few chunks at the default size before serving, so that every compiled variant is built (dynamo is not
    # thread-safe and a compile on the serving path freezes streams for seconds, and cuDNN's algorithm search runs
    # now).  None: when ``vae_compile`` or the cuDNN search is on for a VAE on a GPU.
    warmup: bool | None = None
    # Before serving, one stream of the serving defaults through the pipeline (gateway.stream.warmup), so that the
    # stages capture the CUDA graphs a first stream needs: the most seconds it may take, waiting for the pipeline to
    # be ready included (0: off).  None: 120 on a GPU, off on a CPU.
    pipeline_warmup_s: float | None = flag(
        type=float,
        help="before serving, run one stream of the serving defaults through the pipeline so that the stages capture "
        "the CUDA graphs a first stream needs; the most seconds it may take, waiting for the pipeline included "
        "(0: off; default: 120 on a GPU, off on a CPU)",
    )
    buffer_chunks: int = flag(4, help="latent chunks buffered per stream")  # between the pipeline and the VAE
    buffer_messages: int = flag(32, help="encoded frames buffered per stream")  # between the encoder and the client
    # and at most this many MiB of them (gateway.stream.run: the slow-client rule)
    buffer_mib: float = flag(
        8.0, help="MiB of encoded frames buffered per stream (with --buffer-messages, whichever is reached first)"
    )
    slow_client_timeout: float = flag(
        5.0,
        help="seconds a frame may wait for the client to take it (the client fell that far behind) before its stream "
        "ends with RESOURCE_EXHAUSTED",
    )
    drain_timeout: float = flag(60.0, help="seconds a stopped stream may take to drain")  # its cooldown
    abandon_timeout: float = 30.0  # how long a failed stream's client may take to read its error before cancelling
    config_timeout: float = flag(
        10.0, help="seconds a Generate call may take to send its config before it ends with DEADLINE_EXCEEDED"
    )
    max_pending: int = flag(128, help="Generate calls that may wait for their config at once")
    max_watchers: int = flag(16, help="WatchStatus calls at once (and as many health Watch and reflection streams)")
    # grpc.health.v1 also on a server of its own (0: any free port); None: off
    health_port: int | None = flag(
        type=int,
        help="also serve grpc.health.v1 on this port, on threads of its own, for probes (0: any free port; "
        "default: only on --port)",
    )
    # per-stream cost budget (gateway.edge.admission)
    max_frame_pixels: int = flag(
        0, help="cost budget: pixels of one frame (0: stagecast.json's, else the checkpoint's size x a device headroom)"
    )
    max_stream_cost: float = flag(
        0.0,
        help="cost budget: pixels x frames/s x steps of one stream (0: stagecast.json's, else derived like pixels)",
    )
    threads: int = flag(0, help="torch CPU threads (0: torch's default)")  # the CLI sets them before serving
    # host:port of the first ``stagecast vae-stage``; None: decode in this process
    vae_stage: str | None = flag(help="host:port of the first vae-stage (default: VAE in-process)")
    vae_devices: list[str] | None = flag(
        type=csv_list(str),
        help="cut the in-process VAE into one pipelined slice per device, e.g. cuda:0,cuda:1 (default: --device)",
    )
    vae_split: list[int] | None = flag(
        type=csv_list(int),
        help="decoder units where VAE slices 1.. start, e.g. 4 (default: balanced by multiply-accumulates)",
    )
    # A tiny streaming decoder (gateway.decode.tiny_decoder) beside the VAE, for streams that ask for DECODER_TINY: its
    # weights file (None: the checkpoint's tiny_decoder/, if any), on ``device`` in ``vae_dtype``.
    tiny_decoder: str | None = flag(
        metavar="PATH",
        help="a tiny streaming decoder's weights (.pth in the TAEHV key layout, e.g. taew2_1.pth, or .safetensors) "
        "for streams that ask for DECODER_TINY: approximate, far cheaper per frame than the VAE; without it, the "
        "checkpoint's tiny_decoder/ if it has one",
    )
    default_decoder: str = flag(
        "full",
        choices=["full", "tiny"],
        help="the decoder of streams that name none: full (the model's VAE, exact) or tiny (needs a tiny decoder)",
    )
    tls_cert: str | None = flag(help="public TLS certificate chain (PEM); with --tls-key")  # None: plaintext
    tls_key: str | None = flag(help="public TLS private key (PEM)")
    # bearer-token file (``token tenant [role]`` lines); None: no tokens asked
    tokens: str | None = flag(
        help="bearer-token file, one 'token tenant [user|admin|status]' per line (e.g. a mounted Secret)"
    )
    allow_anonymous: bool = flag(
        False,
        action="store_true",
        help="serve without --tokens on an address other than loopback (anyone who reaches it may generate)",
    )
    quotas: QuotaOptions = nested(QuotaOptions)  # per client (tenant, else address): gateway.edge.quotas
    # Peers whose x-forwarded-for names the client (gateway.edge.client_identity): the fleet's door
    trusted_proxy: tuple = flag(
        (),
        action="append",
        metavar="ADDR",
        help="a proxy (address or network, e.g. the fleet's HAProxy door) whose x-forwarded-for address is the client "
        "for quotas and fair eviction; repeatable or a comma list",
    )
    max_unpaced: int = flag(
        4,
        help="unpaced (pace: false) streams this gateway holds at once, all clients together (best effort; beside "
        "--max-unpaced-per-client)",
    )
    fleet: FleetOptions = nested(FleetOptions)  # --pipeline-name, --agent-port, --drain-s: gateway.edge.agent
    metrics_host: str | None = metrics_host_flag()  # None: ``host``
    mtls: MTLS | None = None  # deployment credentials (role "gateway") towards the coordinator and VAE stages


def frame_size(text: str) -> tuple[int, int]:
    """``HEIGHTxWIDTH`` (e.g. 480x832) as (height, width)."""
    import argparse

    try:
        height, width = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected HEIGHTxWIDTH (e.g. 480x832), got {text!r}") from None
    return height, width


@dataclass
class VAEStageOptions:
    """One ``stagecast vae-stage`` process's options, each flag field its own flag."""

    checkpoint: str = flag(help="folder holding vae/ (or the VAE folder)", required=True)
    index: int = flag(help="this slice's position in the chain, from 0", required=True)
    num_slices: int = flag(help="slices the decoder is cut into", required=True)
    next: str | None = flag(help="host:port of the next vae-stage (every stage but the last)")
    host: str = flag("127.0.0.1", help="address to bind")
    port: int = flag(50070, help="gRPC port (0: any free port)")
    device: str = flag("cpu", help="cpu, cuda or cuda:N")
    dtype: str = flag("float32", choices=DTYPES, help="VAE weights and activations")
    # Frame size (height, width) whose streams decode their steady-state frames as CUDA graph replays
    # (gateway.decode.vae_graphs), captured before serving, ``graph_slots`` streams at once; None: eager.
    cuda_graphs: tuple[int, int] | None = flag(
        type=frame_size,
        format=lambda size: f"{size[0]}x{size[1]}",
        metavar="HEIGHTxWIDTH",
        help="streams of this frame size decode their frames from the third on as CUDA graph replays of this slice, "
        "captured before serving and checked bit for bit against eager (default: eager)",
    )
    graph_slots: int = flag(8, help="streams that can hold a graph slot at once")
    # cuDNN times each convolution's candidates on first use (GPU only)
    cudnn_benchmark: bool = flag(
        False,
        action="store_true",
        help="let cuDNN time each convolution's algorithms on first use (GPU; slows every stream's first frames)",
    )
    health_port: int = health_port_flag()
    mtls: MTLS | None = None  # deployment credentials (role "vae-stage"); None: plaintext (--insecure-internal)
