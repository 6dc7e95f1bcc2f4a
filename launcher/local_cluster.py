"""Start a coordinator and its stages as local processes and wait until the pipeline is formed.

Usage::

    with Launcher() as launcher:
        pipe = start_pipeline(launcher, checkpoint="ckpt/transformer", stages=2, partition="1,3")
        pipe.coordinator          # "127.0.0.1:PORT"
        pipe.stage_children[1]    # the Child for stage 1 (tests kill and restart stages)

    pipe = start_pipeline(launcher, ..., wait=False)   # started, not waited for: start the gateway now
    pipe.wait_ready(launcher, timeout=600)             # every stage READY and the coordinator healthy

``stagecast up`` (``launcher.pipeline_start``) and the benchmark harness start the gateway beside the stages this way:
the gateway loads its models while the stages load theirs, and waits for the pipeline only before it measures its
decoders (``GatewayModels(before_measure=...)``), so a stage's calibration and those measurements do not share a GPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from coordinator.options import CoordinatorOptions
from launcher.process import Child, Launcher, LaunchError
from stage_service.options import StageOptions
from stagecast.flags import to_argv
from stagecast.grpc_util import wait_healthy
from stagecast.microstep import DEFAULT_MAX_BATCH
from stagecast.model.parallel import ParallelLayout, check_gpus, check_sp
from stagecast.names import COORDINATOR_SERVICE
from web.options import WebConfig


@dataclass
class LocalPipeline:
    coordinator: str
    coordinator_child: Child
    coordinator_args: list[str] = field(default_factory=list)  # to start it again on the same port
    stage_children: dict[int, Child] = field(default_factory=dict)
    stage_args: dict[int, list[str]] = field(default_factory=dict)

    def wait_ready(self, launcher: Launcher, timeout: float) -> LocalPipeline:
        """Block until every stage printed its READY line and the coordinator reports itself healthy."""
        for child in self.stage_children.values():
            launcher.wait_ready(child, timeout=timeout)
        try:
            wait_healthy(
                self.coordinator,
                timeout,
                service=COORDINATOR_SERVICE,
                channel=lambda: launcher.channel(self.coordinator, "coordinator"),
            )
        except TimeoutError:
            # A coordinator whose start-up failed (a stage that holds no stream: coordinator.generations) exits
            # saying why: that line, not a health timeout.
            proc = self.coordinator_child.proc
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10.0)
            if proc.poll() is None:
                raise
            tail = "\n".join(self.coordinator_child.log[-10:])
            raise LaunchError(f"the coordinator exited with code {proc.poll()} before it was ready:\n{tail}") from None
        return self


def stage_args(
    index: int,
    coordinator: str,
    checkpoint: str,
    device: str,
    dtype: str,
    host: str,
    cuda_graphs: bool = False,
    loras: Sequence[str] = (),
    metrics_port: int = 0,
    sp: int = 1,
    sp_rank: int = 0,
    fp8: bool = False,
) -> list[str]:
    """A stage's command line on ``host`` (any free port), from its ``StageOptions``."""
    options = StageOptions(
        index=index,
        coordinator=coordinator,
        checkpoint=checkpoint,
        device=device,
        dtype=dtype,
        host=host,
        port=0,
        loras=tuple(loras),
        metrics_port=metrics_port,
        sp=sp,
        sp_rank=sp_rank if sp > 1 else None,
        fp8=fp8,
        cuda_graphs=cuda_graphs,
    )
    return ["stage", *to_argv(options)]


def start_pipeline(
    launcher: Launcher,
    *,
    checkpoint: str,
    stages: int,
    partition: str | None = None,
    device: str = "cpu",
    dtype: str = "float32",
    max_batch: int = DEFAULT_MAX_BATCH,
    max_streams: int = 16,
    record_plan: bool = False,
    host: str = "127.0.0.1",
    port: int = 0,
    ready_timeout: float = 600.0,
    cuda_graphs: bool = False,
    loras: Sequence[str] = (),
    metrics_port: int = 0,
    sp: int = 1,
    coordinator_args: Sequence[str] = (),
    cfg_parallel: int = 1,
    fp8: bool = False,
    stage_extra_args: Sequence[str] = (),
    rank_args: dict[int, list[str]] | None = None,
    wait: bool = True,
) -> LocalPipeline:
    """``metrics_port`` N (0: off): the coordinator's /metrics on N, stage rank i's on N+2+i (N+1 is the gateway's).
    ``sp`` S: each stage is S processes (sequence-parallel ranks), keyed by rank ``stage * S + sp_rank``.
    ``cfg_parallel`` 2 starts two pipelines of ``stages`` stages (indices 0..stages-1 and stages..2*stages-1).
    ``fp8``: every stage runs ``--fp8`` (float8 block linears; each stage refuses it where it cannot run).
    ``stage_extra_args``: appended to every stage's command line (e.g. ``--calibration-s 0``); ``rank_args``: to one
    rank's (e.g. its ``--device-memory-gib``, ``launcher.memory_plan``).
    ``wait`` False: return once the stages are started, not ready (``LocalPipeline.wait_ready``), so that a gateway
    loads its models while the stages load theirs."""
    options = CoordinatorOptions(
        stages=stages,
        partition=partition or None,
        sp=sp,
        cfg_parallel=cfg_parallel,
        host=host,
        port=port,
        backend="nccl" if device.startswith("cuda") else "gloo",
        max_batch=max_batch,
        max_streams=max_streams,
        record_plan=record_plan,
        metrics_port=metrics_port,
    )
    coord = launcher.spawn("coordinator", ["coordinator", *to_argv(options), *coordinator_args])
    address = coord.info["address"]
    bound = int(address.rsplit(":", 1)[1])
    again = ["coordinator", *to_argv(dataclasses.replace(options, port=bound)), *coordinator_args]
    pipe = LocalPipeline(address, coord, again)
    for g in range(cfg_parallel):
        for i in range(stages):
            for r in range(sp):
                rank = (g * stages + i) * sp + r
                stage_metrics = metrics_port + 2 + rank if metrics_port else 0
                index = i if sp > 1 else rank  # a sequence-parallel stage derives its rank from --sp-rank
                pipe.stage_args[rank] = stage_args(
                    index, address, checkpoint, device, dtype, host, cuda_graphs, loras, stage_metrics, sp, r, fp8
                ) + [*stage_extra_args, *(rank_args or {}).get(rank, [])]
                name = f"stage-{rank}" if sp == 1 else f"stage-{i}-sp{r}"
                pipe.stage_children[rank] = launcher.start(name, pipe.stage_args[rank])
    return pipe.wait_ready(launcher, ready_timeout) if wait else pipe


def check_gpu_fit(device: str, stages: int, cfg_parallel: int, gpus: int | None = None) -> None:
    """On GPUs every stage process needs a GPU of its own: the stages talk NCCL, which cannot put two ranks of one
    group on one device (the start would hang).  Raise ValueError, in one line naming the stages, the device and
    what to do, when ``stages x cfg_parallel`` GPUs are not there."""
    if cfg_parallel < 1 or cfg_parallel > 2:
        raise ValueError(f"--cfg-parallel: must be 1 or 2, got {cfg_parallel}")
    if stages < 1:
        raise ValueError(f"--stages: must be >= 1, got {stages}")
    if not device.startswith("cuda"):
        return
    if gpus is None:
        import torch

        gpus = torch.cuda.device_count()
    need = stages * cfg_parallel
    if need <= gpus:
        return
    if cfg_parallel > 1:
        raise ValueError(
            f"--cfg-parallel {cfg_parallel} with --stages {stages} needs {need} GPUs (one per stage of each CFG group),"
            f" this machine has {gpus}"
        )
    if gpus == 0:
        raise ValueError(f"--device {device}: this machine has no GPU that torch can use; use --device cpu")
    raise ValueError(
        f"--stages {stages} on {gpus} GPU(s): stages 0 and {gpus} would share cuda:0, and NCCL cannot put two "
        f"stages on one GPU; give --stages {gpus} or fewer on this machine (or --device cpu)"
    )


@dataclass(frozen=True)
class Placement:
    """Where each process of a one-machine deployment runs: the rule ``stagecast up`` and the harness share."""

    stage_devices: list[str]
    gateway_device: str
    vae_devices: list[str] | None

    @classmethod
    def plan(
        cls,
        device: str,
        stages: int,
        gpus: int | None = None,
        vae_devices: list[str] | None = None,
        sp: int = 1,
        cfg_parallel: int = 1,
    ):
        """``device`` "cuda": stage i on ``cuda:(i % gpus)``, the gateway (text encoder, VAE tail) on the last
        stage's GPU, and the VAE cut over every GPU a stage uses.  Any other device: everything on it.  With ``sp``
        > 1 the stages × sp ranks take one GPU each, rank r on ``cuda:r``: stages × sp must equal ``gpus``
        (``LayoutError`` otherwise, naming the flags).  With ``cfg_parallel`` 2 there are two pipelines of
        ``stages`` stages, one GPU each (``check_gpu_fit``)."""
        ranks = ParallelLayout(stages, sp).world_size * cfg_parallel
        if device != "cuda":
            return cls([device] * ranks, device, vae_devices)
        if gpus is None:
            import torch

            gpus = torch.cuda.device_count()
        if sp > 1:
            check_gpus(stages, sp, gpus)
        check_gpu_fit(device, stages, cfg_parallel, gpus)
        gpus = max(gpus, 1)
        stage_devices = [f"cuda:{i % gpus}" for i in range(ranks)]
        if vae_devices is None:
            vae_devices = [f"cuda:{i}" for i in range(min(ranks, gpus))]
        return cls(stage_devices, stage_devices[-1], vae_devices)


def web_args(
    gateway: str, host: str, port: int, tokens: str | None = None, gateway_ca: str | None = None, **options: Any
) -> list[str]:
    """``stagecast web`` in front of ``gateway``: the page on ``host:port``, offering WebRTC media on ``host`` too
    (every socket binds ``--host``; on a wildcard, every interface), with other ``WebConfig`` fields from ``options``.
    ``--port`` comes last (a restart replaces it)."""
    name = certificate_name(gateway_ca) if gateway_ca else None
    config = WebConfig(gateway=gateway, host=host, tokens=tokens, gateway_ca=gateway_ca, gateway_tls_name=name)
    config = dataclasses.replace(config, **options)
    return ["web", *to_argv(config), "--port", str(port)]


def certificate_name(pem_file: str) -> str | None:
    """The first DNS name of a PEM certificate (None without one): what a client on 127.0.0.1 must expect."""
    from cryptography import x509

    with open(pem_file, "rb") as f:
        cert = x509.load_pem_x509_certificate(f.read())
    try:
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return None
    dns = names.get_values_for_type(x509.DNSName)
    return dns[0] if dns else None


def check_layout(checkpoint: str, stages: int, sp: int) -> None:
    """Refuse, before anything starts, a layout the model cannot take: ``LayoutError`` names the flag."""
    ParallelLayout(stages, sp)
    if sp == 1:
        return
    from stagecast.model.config import checkpoint_config

    check_sp(sp, checkpoint_config(checkpoint)["num_attention_heads"])
