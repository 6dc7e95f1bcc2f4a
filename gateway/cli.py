"""``stagecast gateway`` and ``stagecast vae-stage``: the gateway's entry points.

Their flags are ``GatewayOptions``' and ``VAEStageOptions``' fields (``gateway.options``); only ``--mtls`` /
``--insecure-internal`` are added here, as every internal service adds them.
"""

from __future__ import annotations

import argparse
import logging
import os

from gateway.options import GatewayOptions, VAEStageOptions
from stagecast.flags import HelpFormatter, add_flags, from_args
from stagecast.log import GRPC_VERBOSITY
from stagecast.service import add_security_flags, run_service

logger = logging.getLogger("gateway")


def add_parser(sub) -> None:
    p = sub.add_parser(
        "gateway",
        help="run the gateway: public streaming API, text encoder, VAE, frame encoding",
        formatter_class=HelpFormatter,
    )
    add_flags(p, GatewayOptions)
    add_security_flags(p)
    p.set_defaults(run=main)


def main(args: argparse.Namespace) -> int:
    from gateway.service import serve

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)

    def start(stop) -> None:
        opts = _gateway_options(args)
        if opts.tls_cert and os.environ.get("GRPC_VERBOSITY", "").upper() == GRPC_VERBOSITY:
            # Said once here: gRPC's own "Handshake failed" line for every plaintext client is off
            # (stagecast.log.quiet_grpc_core).
            logger.info(
                "the public API speaks TLS: a plaintext client's handshake fails, and the SDK and CLI tell it to pass "
                "--tls-ca or --tls (gRPC's own handshake lines are off; GRPC_VERBOSITY=INFO shows them)"
            )
        serve(opts, stop=stop)

    return run_service("gateway", start)


def _gateway_options(args: argparse.Namespace) -> GatewayOptions:
    from stagecast.security import is_loopback, mtls_from_flags

    if not args.tokens and not args.allow_anonymous and not is_loopback(args.host):
        raise ValueError(
            f"--host {args.host} is reachable from other machines: give --tokens FILE (or --allow-anonymous)"
        )
    return from_args(GatewayOptions, args, mtls=mtls_from_flags(args.mtls, args.insecure_internal, "stagecast gateway"))


def add_vae_stage_parser(sub) -> None:
    p = sub.add_parser(
        "vae-stage",
        help="run one slice of the VAE decoder as its own process (chain them)",
        formatter_class=HelpFormatter,
    )
    add_flags(p, VAEStageOptions)
    add_security_flags(p)
    p.set_defaults(run=vae_stage_main)


def vae_stage_main(args: argparse.Namespace) -> int:
    from gateway.decode.vae_stage import serve
    from stagecast.security import mtls_from_flags

    def start(stop) -> None:
        serve(_vae_options(args, mtls_from_flags(args.mtls, args.insecure_internal, "stagecast vae-stage")), stop=stop)

    return run_service("vae-stage", start)


def _vae_options(args: argparse.Namespace, mtls) -> VAEStageOptions:
    return from_args(VAEStageOptions, args, mtls=mtls)
