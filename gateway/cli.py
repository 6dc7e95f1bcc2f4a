"""``stagecast gateway`` and ``stagecast vae-stage``: the gateway's own flags and entry points."""

from __future__ import annotations

import argparse
import os

from gateway.quotas import add_quota_flags, quota_options
from stagecast.names import DTYPE_NAMES
from stagecast.service import add_security_flags, csv_list, run_service

DTYPES = list(DTYPE_NAMES)


def add_parser(sub) -> None:
    p = sub.add_parser(
        "gateway",
        help="run the gateway: public streaming API, text encoder, VAE, frame encoding",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--coordinator", required=True, help="coordinator host:port")
    p.add_argument("--checkpoint", required=True, help="folder with transformer/ vae/ text_encoder/ tokenizer/")
    p.add_argument("--host", default="127.0.0.1", help="address to bind")
    p.add_argument("--port", type=int, default=50051, help="0: any free port (printed on the READY line)")
    p.add_argument("--device", default="cpu", help="where the text encoder and VAE run: cpu, cuda, cuda:N")
    p.add_argument(
        "--max-streams",
        type=int,
        default=16,
        help="concurrent streams this gateway accepts (above what one pipeline holds, so that past capacity the "
        "coordinator's capacity check refuses, with its retry delay, not this count)",
    )
    p.add_argument("--metrics-port", type=int, default=0, help="Prometheus port (0: off)")
    p.add_argument("--text-len", type=int, default=None, help="text tokens (default: checkpoint's, else 512)")
    p.add_argument(
        "--text-dtype",
        default="auto",
        choices=["auto", *DTYPES],
        help="text encoder weights (auto: bfloat16 on a GPU, float32 on CPU)",
    )
    p.add_argument("--text-device", default=None, help="where the text encoder runs (default: --device)")
    p.add_argument(
        "--no-text-graph",
        dest="text_graph",
        action="store_false",
        help="run the text encoder eagerly on a GPU (default: one captured CUDA graph, checked against eager at start)",
    )
    p.add_argument("--vae-dtype", default="float32", choices=DTYPES, help="VAE weights and activations")
    p.add_argument(
        "--vae-compile",
        action="store_true",
        help="torch.compile the VAE decoder, and the tiny decoder's pass at each batch size it pads to (GPU)",
    )
    p.add_argument(
        "--decoder-memory-gib",
        type=float,
        default=0,
        help="device memory the streams' decoder states may hold (full VAE ~1.8 GiB per 480x832 stream, tiny ~64 MiB)"
        "; a stream past it is refused with RESOURCE_EXHAUSTED. 0: on a GPU its free memory at start-up less a "
        "reserve (8 GiB or 10%%), on a CPU unbounded",
    )
    p.add_argument(
        "--vae-cuda-graphs",
        action="store_true",
        help="decode each stream's frames from its third on as CUDA graph replays, one captured graph per stream slot "
        "and VAE part, captured before serving at the default size and checked bit for bit against eager (a stream "
        "without a free slot, or of another size, decodes eagerly)",
    )
    p.add_argument(
        "--vae-cudnn-benchmark",
        action="store_true",
        help="let cuDNN time each VAE convolution's algorithms on first use (GPU): ~10%% more steady FPS, but on an "
        "H200 every new stream's first VAE frame then took ~0.6 s longer (TTFF 0.23 -> 0.85 s), so it is off",
    )
    p.add_argument(
        "--vae-graph-slots",
        type=int,
        default=0,
        help="streams that can hold a VAE graph slot at once; each holds one stream's VAE cache (0: --max-streams)",
    )
    p.add_argument(
        "--pipeline-warmup-s",
        type=float,
        default=None,
        help="before serving, run one stream of the serving defaults through the pipeline so that the stages capture "
        "the CUDA graphs a first stream needs; the most seconds it may take, waiting for the pipeline included "
        "(0: off; default: 120 on a GPU, off on a CPU)",
    )
    p.add_argument("--buffer-chunks", type=int, default=4, help="latent chunks buffered per stream")
    p.add_argument("--buffer-messages", type=int, default=32, help="encoded frames buffered per stream")
    p.add_argument(
        "--buffer-mib",
        type=float,
        default=8.0,
        help="MiB of encoded frames buffered per stream (with --buffer-messages, whichever is reached first)",
    )
    p.add_argument(
        "--slow-client-timeout",
        type=float,
        default=5.0,
        help="seconds a frame may wait for the client to take it (the client fell that far behind) before its stream "
        "ends with RESOURCE_EXHAUSTED",
    )
    p.add_argument("--drain-timeout", type=float, default=60.0, help="seconds a stopped stream may take to drain")
    p.add_argument(
        "--config-timeout",
        type=float,
        default=10.0,
        help="seconds a Generate call may take to send its config before it ends with DEADLINE_EXCEEDED",
    )
    p.add_argument("--max-pending", type=int, default=128, help="Generate calls that may wait for their config at once")
    p.add_argument(
        "--max-watchers",
        type=int,
        default=16,
        help="WatchStatus calls at once (and as many health Watch and reflection streams)",
    )
    p.add_argument(
        "--health-port",
        type=int,
        default=None,
        help="also serve grpc.health.v1 on this port, on threads of its own, for probes (0: any free port; "
        "default: only on --port)",
    )
    p.add_argument(
        "--max-frame-pixels",
        type=int,
        default=0,
        help="cost budget: pixels of one frame (0: stagecast.json's, else the checkpoint's size x a device headroom)",
    )
    p.add_argument(
        "--max-stream-cost",
        type=float,
        default=0,
        help="cost budget: pixels x frames/s x steps of one stream (0: stagecast.json's, else derived like pixels)",
    )
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--vae-stage", default=None, help="host:port of the first vae-stage (default: VAE in-process)")
    p.add_argument(
        "--vae-devices",
        type=csv_list(str),
        default=None,
        help="cut the in-process VAE into one pipelined slice per device, e.g. cuda:0,cuda:1 (default: --device)",
    )
    p.add_argument(
        "--vae-split",
        type=csv_list(int),
        default=None,
        help="decoder units where VAE slices 1.. start, e.g. 4 (default: balanced by multiply-accumulates)",
    )
    add_decoder_flags(p)
    p.add_argument("--tls-cert", default=None, help="public TLS certificate chain (PEM); with --tls-key")
    p.add_argument("--tls-key", default=None, help="public TLS private key (PEM)")
    p.add_argument(
        "--tokens",
        default=None,
        help="bearer-token file, one 'token tenant [user|admin|status]' per line (e.g. a mounted Secret)",
    )
    p.add_argument(
        "--allow-anonymous",
        action="store_true",
        help="serve without --tokens on an address other than loopback (anyone who reaches it may generate)",
    )
    add_quota_flags(p)
    add_security_flags(p, health=False)  # --health-port is the gateway's own, above
    p.set_defaults(run=main)


def add_decoder_flags(p) -> None:
    """The tiny decoder's flags, declared here once; ``stagecast up`` and the benchmark harness add them with this
    and pass them on with ``decoder_args``."""
    p.add_argument(
        "--tiny-decoder",
        default=None,
        metavar="PATH",
        help="a tiny streaming decoder's weights (.pth in the TAEHV key layout, e.g. taew2_1.pth, or .safetensors) "
        "for streams that ask for DECODER_TINY: approximate, far cheaper per frame than the VAE; without it, the "
        "checkpoint's tiny_decoder/ if it has one",
    )
    p.add_argument(
        "--default-decoder",
        default="full",
        choices=["full", "tiny"],
        help="the decoder of streams that name none: full (the model's VAE, exact) or tiny (needs a tiny decoder)",
    )


def decoder_args(args: argparse.Namespace) -> list[str]:
    """``add_decoder_flags``' values as gateway arguments."""
    out = ["--tiny-decoder", os.path.abspath(args.tiny_decoder)] if args.tiny_decoder else []
    return out + (["--default-decoder", args.default_decoder] if args.default_decoder != "full" else [])


def main(args: argparse.Namespace) -> int:
    from gateway.service import serve

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)

    def start(stop) -> None:
        serve(_gateway_options(args), stop=stop)

    return run_service("gateway", start)


def _gateway_options(args: argparse.Namespace):
    from gateway.service import GatewayOptions
    from stagecast.security import is_loopback, mtls_from_flags

    if not args.tokens and not args.allow_anonymous and not is_loopback(args.host):
        raise ValueError(
            f"--host {args.host} is reachable from other machines: give --tokens FILE (or --allow-anonymous)"
        )
    return GatewayOptions(
        coordinator=args.coordinator,
        checkpoint=args.checkpoint,
        host=args.host,
        port=args.port,
        device=args.device,
        max_streams=args.max_streams,
        metrics_port=args.metrics_port,
        text_len=args.text_len,
        text_dtype=args.text_dtype,
        text_device=args.text_device,
        text_graph=args.text_graph,
        vae_dtype=args.vae_dtype,
        vae_compile=args.vae_compile,
        vae_cuda_graphs=args.vae_cuda_graphs,
        vae_cudnn_benchmark=args.vae_cudnn_benchmark,
        pipeline_warmup_s=args.pipeline_warmup_s,
        vae_graph_slots=args.vae_graph_slots,
        buffer_chunks=args.buffer_chunks,
        buffer_messages=args.buffer_messages,
        buffer_mib=args.buffer_mib,
        slow_client_timeout=args.slow_client_timeout,
        drain_timeout=args.drain_timeout,
        config_timeout=args.config_timeout,
        max_pending=args.max_pending,
        max_watchers=args.max_watchers,
        health_port=args.health_port,
        max_frame_pixels=args.max_frame_pixels,
        max_stream_cost=args.max_stream_cost,
        vae_stage=args.vae_stage,
        vae_devices=args.vae_devices,
        vae_split=args.vae_split,
        tiny_decoder=args.tiny_decoder,
        default_decoder=args.default_decoder,
        decoder_memory_gib=args.decoder_memory_gib,
        mtls=mtls_from_flags(args.mtls, args.insecure_internal, "stagecast gateway"),
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tokens=args.tokens,
        metrics_host=args.metrics_host,
        quotas=quota_options(args),
    )


def add_vae_stage_parser(sub) -> None:
    p = sub.add_parser(
        "vae-stage",
        help="run one slice of the VAE decoder as its own process (chain them)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--checkpoint", required=True, help="folder holding vae/ (or the VAE folder)")
    p.add_argument("--index", type=int, required=True, help="this slice's position in the chain, from 0")
    p.add_argument("--num-slices", type=int, required=True, help="slices the decoder is cut into")
    p.add_argument("--next", default=None, help="host:port of the next vae-stage (every stage but the last)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind")
    p.add_argument("--port", type=int, default=50070, help="gRPC port (0: any free port)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="float32", choices=DTYPES, help="VAE weights and activations")
    p.add_argument(
        "--cuda-graphs",
        type=_frame_size,
        default=None,
        metavar="HEIGHTxWIDTH",
        help="streams of this frame size decode their frames from the third on as CUDA graph replays of this slice, "
        "captured before serving and checked bit for bit against eager (default: eager)",
    )
    p.add_argument("--graph-slots", type=int, default=8, help="streams that can hold a graph slot at once")
    p.add_argument(
        "--cudnn-benchmark",
        action="store_true",
        help="let cuDNN time each convolution's algorithms on first use (GPU; slows every stream's first frames)",
    )
    add_security_flags(p, metrics=False)
    p.set_defaults(run=vae_stage_main)


def _frame_size(text: str) -> tuple[int, int]:
    try:
        height, width = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected HEIGHTxWIDTH (e.g. 480x832), got {text!r}") from None
    return height, width


def vae_stage_main(args: argparse.Namespace) -> int:
    from gateway.vae_stage import serve
    from stagecast.security import mtls_from_flags

    def start(stop) -> None:
        serve(_vae_options(args, mtls_from_flags(args.mtls, args.insecure_internal, "stagecast vae-stage")), stop=stop)

    return run_service("vae-stage", start)


def _vae_options(args: argparse.Namespace, mtls):
    from gateway.vae_stage import VAEStageOptions

    return VAEStageOptions(
        checkpoint=args.checkpoint,
        index=args.index,
        num_slices=args.num_slices,
        next=args.next,
        host=args.host,
        port=args.port,
        device=args.device,
        dtype=args.dtype,
        cuda_graphs=args.cuda_graphs,
        graph_slots=args.graph_slots,
        cudnn_benchmark=args.cudnn_benchmark,
        mtls=mtls,
        health_port=args.health_port,
    )
