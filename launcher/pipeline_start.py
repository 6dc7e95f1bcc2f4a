"""One pipeline of ``stagecast up``, piece by piece: what ``up`` (one pipeline) and its fleet (``launcher.fleet``,
``--pipelines N``) both start: the coordinator and stages, the gateway's command line, the page, and their watch.

Usage::

    plan = Plan(placement, partition, vae_split)               # launcher.up._plan makes it from the flags
    pipe = start_stages(launcher, args, plan, port=p, metrics_port=m, health_port=h)   # not waited for
    argv = gateway_argv(args, plan, pipe.coordinator, metrics_port=m2)                 # without --port
    watch_pipeline(supervisor, pipe)                           # restart its coordinator and stages when they die
    start_web(launcher, supervisor, args, gateway_address)     # the live page, watched
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from typing import Any

from coordinator.options import CoordinatorOptions
from gateway.options import GatewayOptions
from stagecast.flags import argv_for, from_args, to_argv
from stagecast.service import resolve_transformer

# The gateway flags ``up`` takes and passes on (declared by ``launcher.up.add_parser`` from GatewayOptions).
GATEWAY_FLAGS = (
    "vae_compile",
    "vae_cuda_graphs",
    "tiny_cuda_graphs",
    "vae_devices",
    "tiny_decoder",
    "default_decoder",
    "tokens",
    "tls_cert",
    "tls_key",
    "decoder_memory_gib",
    "max_unpaced",
    "quotas_unpaced",
)


@dataclass(frozen=True)
class Plan:
    """What one pipeline of ``up`` runs where: the placement, the stage partition and the gateway's VAE cut, and the
    shares of shared GPUs (``launcher.memory_plan.share_of``: GiB by (pipeline, "stage", rank) and (pipeline,
    "gateway", device); none: no GPU shared)."""

    placement: Any  # launcher.local_cluster.Placement
    partition: str | None
    vae_split: list[int] | None
    shares: dict = field(default_factory=dict)

    def stage_args(self, pipeline: str = "") -> dict[int, list[str]]:
        """Each stage rank's ``--device-memory-gib`` where its GPU is shared."""
        return {
            key[2]: ["--device-memory-gib", repr(gib)]
            for key, gib in self.shares.items()
            if key[0] == pipeline and key[1] == "stage"
        }

    def gateway_share(self, pipeline: str = "") -> float:
        """The gateway's ``--device-memory-gib`` (0: its decoder's GPU is not shared)."""
        return next((gib for key, gib in self.shares.items() if key[0] == pipeline and key[1] == "gateway"), 0.0)


def has_gateway(args: argparse.Namespace) -> bool:
    """A gateway runs: a public port, and a checkpoint with its VAE and text encoder."""
    root = args.checkpoint
    return args.gateway_port >= 0 and all(os.path.isdir(os.path.join(root, d)) for d in ("vae", "text_encoder"))


def start_stages(
    launcher,
    args: argparse.Namespace,
    plan: Plan,
    *,
    port: int,
    metrics_port: int,
    health_port: int,
    host_share: float = 1.0,
    pipeline: str = "",
):
    """The coordinator and stages of one pipeline, started, not waited for (``LocalPipeline.wait_ready``);
    ``host_share``: the share of the host its coordinator sizes streams for (``--host-share``); ``pipeline``: its
    name in the plan's shares (a fleet's "p0", ...)."""
    from launcher.local_cluster import start_pipeline

    coordinator_args = argv_for(
        CoordinatorOptions,
        health_port=max(health_port, 0),
        host_share=host_share,
        pace_grid=args.pace_grid,
        stage_ms=args.stage_ms,
        slo_learn=args.slo_learn,
    )
    return start_pipeline(
        launcher,
        checkpoint=resolve_transformer(args.checkpoint),
        stages=args.stages,
        partition=plan.partition,
        device=args.device,
        dtype=args.dtype,
        max_batch=args.max_batch,
        host=args.host,
        port=port,
        cuda_graphs=args.cuda_graphs,
        fp8=args.fp8,
        loras=args.loras,
        metrics_port=metrics_port,
        sp=args.sp,
        cfg_parallel=args.cfg_parallel,
        coordinator_args=coordinator_args,
        stage_extra_args=[
            *(["--dit-levers", args.dit_levers] if args.dit_levers else []),
            *(["--kv-budget-gib", repr(args.kv_budget_gib)] if getattr(args, "kv_budget_gib", 0) else []),
        ],
        rank_args=plan.stage_args(pipeline),
        wait=False,  # the gateway (started next) loads its models while the stages load theirs
    )


def gateway_argv(
    args: argparse.Namespace, plan: Plan, coordinator: str, *, metrics_port: int, pipeline: str = "", **values
) -> list[str]:
    """A gateway's command line, without ``--port`` (``values``: other ``GatewayOptions`` fields, e.g. ``fleet``;
    ``pipeline``: its name in the plan's shares)."""
    values.setdefault("device_memory_gib", plan.gateway_share(pipeline))
    options = from_args(
        GatewayOptions,
        args,
        only=GATEWAY_FLAGS,
        coordinator=coordinator,
        checkpoint=args.checkpoint,
        device=plan.placement.gateway_device,
        host=args.host,
        vae_devices=plan.placement.vae_devices,
        vae_split=plan.vae_split,
        vae_dtype=args.dtype if args.device.startswith("cuda") else "float32",
        metrics_port=metrics_port,
        tiny_decoder=os.path.abspath(args.tiny_decoder) if args.tiny_decoder else None,
        **values,
    )
    return ["gateway", *to_argv(options, skip=("port",))]


def watch_pipeline(supervisor, pipe, launcher=None) -> None:
    """Restart the coordinator and stages of ``pipe`` when they die (a hung stage too)."""
    supervisor.watch(pipe.coordinator_child, pipe.coordinator_args, launcher=launcher)
    for index, child in pipe.stage_children.items():
        supervisor.watch(child, pipe.stage_args[index], health="stage", launcher=launcher)


def start_web(launcher, supervisor, args: argparse.Namespace, gateway: str) -> dict[str, str]:
    """The live page in front of ``gateway``, watched; returns its READY fields (url, address)."""
    from launcher.local_cluster import web_args

    page_args = web_args(gateway, args.host, args.web_port, args.tokens, args.tls_cert)
    page = launcher.spawn("web", page_args)
    page_port = page.info["address"].rsplit(":", 1)[1]
    supervisor.watch(page, [*page_args[:-1], page_port])
    return page.info
