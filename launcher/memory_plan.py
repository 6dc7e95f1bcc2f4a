"""One memory budget per shared GPU: ``stagecast up`` splits a device that several of its processes use into shares.

Usage (``launcher.up.plan_memory`` before anything starts, when the stages run on GPUs; the benchmark harness too)::

    layout = pipeline_layout(args, placement, partition)            # what each process holds and needs per stream
    plans = plan_devices({"cuda:0": total_bytes}, layout_parts(layout), serving)   # pure: injected totals and parts
    for p in plans: p.problem or p.line()                           # why no stream fits, or one line per shared GPU
    share_of(plans)                                                 # {part key: GiB} for each --device-memory-gib

Each process sizes its memory budget itself (a stage its KV, ``stage_service.kv_budget``; the gateway its decoder
states, ``gateway.edge.admission.DecoderMemory``).  Measured from the device's free memory, those budgets depend on
when the neighbour loads: on one H200 with 14B, stage 0 and the gateway side by side each read the other still loading,
and every stream was refused.  Given a share (``--device-memory-gib``), a process counts its own memory instead, and
this plan makes the shares of one device add up to it.

The plan of a device that more than one process uses (stages with their layer slices, the gateway with its text
encoder, VAE or VAE slice and tiny decoder; processes of every pipeline of ``up --pipelines N`` placed on it):

- each stage's fixed part: its slice's weights in the serving dtype (``stage_service.checkpoint``'s shapes, the same
  tensors the stage loads), ``CONTEXT_BYTES``, an activation allowance (``ACTIVATION_BYTES``; the stage subtracts its
  calibration's measured peak), and the graphs' buffer cap and reserve as fractions of its share
  (``stage_service.kv_budget.share_for_kv``);
- the gateway's fixed part: its models on this device (the safetensors headers' tensors in the serving dtype, else the
  config's parameters), CUDA context and reserve (``gateway.edge.admission.share_for_decoder``);
- per stream: each stage's KV of one stream at the serving defaults (``stagecast.kv_memory.serving_spec``) and, on the
  gateway's decoder device, one stream's state on its default decoder.

The most streams ``n`` whose fixed parts and per-stream parts fit the device are planned for (the gateway's decoder
room for ``min(n, --max-streams)``), and what is left over goes to the stages' KV in proportion to their per-stream
KV.  With ``n`` 0 nothing can serve: ``problem`` names the parts and their GiB and what to move, and ``up`` exits 2
before starting anything.  A device with one process gets no share (today's behaviour: its free memory).  The
operator's ``--kv-budget-gib`` / ``--decoder-memory-gib`` win: such a part's room is fixed at that number.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from gateway.edge.admission import (
    FULL_VAE_STATE_BYTES,
    FULL_VAE_STATE_ITEMSIZE,
    STATE_PIXELS,
    TINY_STATE_BYTES,
    planned_reserve,
    share_decoder_budget,
    share_for_decoder,
)
from stage_service.kv_budget import (
    GRAPH_FRACTION,
    RESERVE_FRACTION,
    planned_kv_budget,
    share_for_kv,
)

GIB = 1 << 30
MIB = 1 << 20
# What the plan allows for a stage's activations (its calibration's forwards of the coordinator's batch sizes above
# the weights).  The stage subtracts what it measured; a larger peak leaves it less KV, and the coordinator's start-up
# then fails if that holds no stream (``stage_service.kv_budget.stream_fit_problem``).
ACTIVATION_BYTES = 2 * GIB
MAX_STREAMS = 4096  # the search's bound on streams a device's stages may hold
# A VAE without safetensors files to read (its weights drawn where it loads): the Wan2.1 VAE's parameters.
VAE_PARAMS = 127_000_000
_FLOAT_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1}
_SIZES = {**_FLOAT_SIZES, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


@dataclass(frozen=True)
class StagePart:
    """A stage process on a device: its slice's bytes and one serving stream's KV on it (``kv_room``: the operator's
    ``--kv-budget-gib`` in bytes, fixed; None: planned)."""

    key: tuple
    name: str  # "stage 0", "p1's stage 0"
    device: str
    weights: int
    stream_kv: int
    cuda_graphs: bool
    kv_room: int | None = None
    activation: int = ACTIVATION_BYTES

    def share(self, streams: int) -> int:
        kv = self.kv_room if self.kv_room is not None else streams * self.stream_kv
        return share_for_kv(kv, weights=self.weights, activation_peak=self.activation, cuda_graphs=self.cuda_graphs)

    def room(self, share: int) -> int:
        if self.kv_room is not None:
            return self.kv_room
        return planned_kv_budget(
            share, weights=self.weights, activation_peak=self.activation, cuda_graphs=self.cuda_graphs
        )

    def holds(self, share: int) -> int:
        return self.room(share) // max(self.stream_kv, 1)


@dataclass(frozen=True)
class GatewayPart:
    """The gateway's models on a device (name -> bytes) and, on its decoder device (``decoder``), one stream's state
    on its default decoder (0 elsewhere).  ``room``: the operator's ``--decoder-memory-gib`` in bytes, fixed."""

    key: tuple
    name: str  # "the gateway", "p1's gateway"
    device: str
    models: tuple[tuple[str, int], ...]
    stream_state: int = 0
    decoder: str = ""  # the default decoder's name, on the decoder device ("": no decoder state here)
    max_streams: int = 16
    fixed_room: int | None = None

    @property
    def held(self) -> int:
        return sum(b for _, b in self.models)

    def share(self, streams: int) -> int:
        room = self.fixed_room if self.fixed_room is not None else min(streams, self.max_streams) * self.stream_state
        return share_for_decoder(room, self.held)

    def room(self, share: int) -> int:
        return self.fixed_room if self.fixed_room is not None else share_decoder_budget(share, self.held)

    def holds(self, share: int) -> int:
        return self.room(share) // self.stream_state if self.stream_state else MAX_STREAMS


Part = StagePart | GatewayPart


@dataclass(frozen=True)
class Share:
    part: Part
    bytes: int
    room: int  # a stage's KV budget, the gateway's decoder-state budget, as the process will derive them
    streams: int  # streams that room holds

    @property
    def gib(self) -> float:
        return self.bytes / GIB


@dataclass(frozen=True)
class DevicePlan:
    """One device's shares (empty: one process or none, nothing planned) and the streams it holds, or why none."""

    device: str
    total: int
    parts: tuple[Part, ...]
    shares: tuple[Share, ...] = ()
    streams: int = 0
    problem: str | None = None
    serving: str = ""  # the serving stream, for messages

    @property
    def shared(self) -> bool:
        return len(self.parts) > 1

    def line(self) -> str:
        """``up``'s line for a shared device: every part and its GiB."""
        parts = "; ".join(_describe_share(s) for s in self.shares)
        return f"{self.device} ({_g(self.total)} GiB) shared, planned for {self.streams} stream(s): {parts}"


def _mib_up(n: int) -> int:
    return -(-n // MIB) * MIB


def _g(n: float) -> str:
    return f"{n / GIB:.1f}"


def _describe_share(share: Share) -> str:
    part = share.part
    if isinstance(part, StagePart):
        graphs = f", graph buffers {_g(GRAPH_FRACTION * share.bytes)}" if part.cuda_graphs else ""
        return (
            f"{part.name} {_g(share.bytes)} GiB (weights {_g(part.weights)}{graphs}, reserve "
            f"{_g(RESERVE_FRACTION * share.bytes)}, KV {_g(share.room)}: {share.streams} stream(s))"
        )
    models = ", ".join(f"{name} {_g(b)}" for name, b in part.models)
    state = f", {part.decoder} decoder states {_g(share.room)}" if part.stream_state else ""
    return f"{part.name} {_g(share.bytes)} GiB ({models}{state}, reserve {_g(planned_reserve(share.bytes))})"


def plan_device(device: str, total: int, parts: Iterable[Part], serving: str = "") -> DevicePlan:
    """Split ``total`` bytes of ``device`` among ``parts`` (see the module docstring); pure."""
    parts = tuple(parts)
    if len(parts) <= 1:
        return DevicePlan(device, total, parts, serving=serving)
    stages = [p for p in parts if isinstance(p, StagePart)]

    def need(n: int) -> int:
        return sum(p.share(n) for p in parts)

    cap = MAX_STREAMS if stages else max((p.max_streams for p in parts if isinstance(p, GatewayPart)), default=1)
    if need(1) + len(parts) * MIB > total or any(p.holds(p.share(1)) < 1 for p in parts):
        return DevicePlan(device, total, parts, problem=_problem(device, total, parts, serving), serving=serving)
    lo, hi = 1, cap  # need(lo) fits; find the most streams that fit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if need(mid) + len(parts) * MIB <= total else (lo, mid - 1)
    sizes = {p.key: _mib_up(p.share(lo)) for p in parts}  # whole MiB: --device-memory-gib carries them exactly
    left = total - sum(sizes.values())
    planned = [p for p in stages if p.kv_room is None]
    weight = sum(p.stream_kv for p in planned)
    for p in planned:  # the rest to the stages' KV, in proportion to what a stream takes on each
        sizes[p.key] += max(0, left * p.stream_kv // max(weight, 1)) >> 20 << 20
    shares = tuple(Share(p, sizes[p.key], p.room(sizes[p.key]), p.holds(sizes[p.key])) for p in parts)
    streams = min(s.streams for s in shares)
    return DevicePlan(device, total, parts, shares, streams, serving=serving)


def _problem(device: str, total: int, parts: tuple[Part, ...], serving: str) -> str:
    """Why not one stream fits ``device``: the parts that take it, what they leave, and what to move."""
    stages = [p for p in parts if isinstance(p, StagePart)]
    gateways = [p for p in parts if isinstance(p, GatewayPart)]
    taken = []
    for p in stages:
        share = p.share(1)
        graphs = f", its graph buffers {_g(GRAPH_FRACTION * share)} GiB" if p.cuda_graphs else ""
        taken.append(f"{p.name}'s {_g(p.weights)} GiB of weights{graphs}")
    for p in gateways:
        taken += [f"{p.name}'s {name} {_g(b)} GiB" for name, b in p.models if b >= GIB // 10]
    taken_text = ", ".join(taken[:-1]) + (" and " if len(taken) > 1 else "") + taken[-1] if taken else "its processes"
    fixed_flags = [
        p for p in parts if (isinstance(p, StagePart) and p.kv_room) or (isinstance(p, GatewayPart) and p.fixed_room)
    ]
    for p in fixed_flags:
        if p.holds(p.share(1)) < 1:
            flag, per = (
                ("--kv-budget-gib", p.stream_kv)
                if isinstance(p, StagePart)
                else ("--decoder-memory-gib", p.stream_state)
            )
            return (
                f"{device}: {flag} gives {p.name} {_g(p.room(0))} GiB, and one stream at {serving} needs "
                f"{per / GIB:.2f} GiB there: raise {flag} or leave it out (0: planned)"
            )
    # What the stages get when every other part has room for one stream.
    others = sum(p.share(1) for p in gateways)
    detail = ""
    for p in stages:
        rest = total - others - sum(q.share(1) for q in stages if q is not p)
        kv = p.room(max(rest, 0)) if rest > 0 else 0
        if kv < p.stream_kv:
            detail = f" leave {_g(kv)} GiB for {p.name}'s KV; one stream at {serving} needs {p.stream_kv / GIB:.2f} GiB"
            break
    if not detail and gateways:
        g = gateways[0]
        rest = total - sum(p.share(1) for p in stages) - sum(q.share(1) for q in gateways if q is not g)
        detail = (
            f" leave {_g(max(g.room(max(rest, 0)), 0))} GiB for {g.name}'s decoder states; one stream on its "
            f"{g.decoder} decoder holds {g.stream_state / GIB:.2f} GiB"
        )
    fix = "put the gateway on another GPU (--gateway-device) or use more stages (--stages)" if gateways else ""
    if len({p.key[0] for p in parts}) > 1:  # pipelines of a fleet share it
        fix = f"{fix}, or run fewer pipelines (--pipelines)" if fix else "run fewer pipelines (--pipelines)"
    fix = fix or "use more stages (--stages)"
    return f"{device} ({_g(total)} GiB): {taken_text}{detail}: {fix}"


def plan_devices(totals: dict[str, int], parts: Iterable[Part], serving: str = "") -> list[DevicePlan]:
    """``plan_device`` for every device a part is on (``totals``: bytes by device name)."""
    by_device: dict[str, list[Part]] = {}
    for p in parts:
        by_device.setdefault(p.device, []).append(p)
    return [plan_device(d, totals[d], ps, serving) for d, ps in sorted(by_device.items())]


def share_of(plans: Iterable[DevicePlan]) -> dict[tuple, float]:
    """Each planned part's share in GiB (``--device-memory-gib``), by its key; parts of unshared devices are absent.
    A gateway's share is its decoder device's (the one its decoder-memory budget counts)."""
    out: dict[tuple, float] = {}
    for plan in plans:
        for s in plan.shares:
            if isinstance(s.part, GatewayPart) and not s.part.decoder:
                continue  # its models there are planned, but its budget is on its decoder device
            out[s.part.key] = s.bytes / GIB  # whole MiB: exact as a float and in its repr
    return out


# ---- what a process holds: weights from the checkpoint, without loading them -----------------------------------


def safetensors_bytes(folder: Path, itemsize: int) -> int | None:
    """The bytes of every tensor in ``folder``'s ``*.safetensors`` files with floating-point tensors converted to
    ``itemsize`` bytes an element (read from the files' headers); None when the folder has none."""
    files = sorted(Path(folder).glob("*.safetensors")) if Path(folder).is_dir() else []
    if not files:
        return None
    total = 0
    for path in files:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            numel = math.prod(meta["shape"])
            total += numel * (itemsize if meta["dtype"] in _FLOAT_SIZES else _SIZES.get(meta["dtype"], 4))
    return total


def umt5_parameters(config: dict) -> int:
    """A (U)MT5 encoder's parameters from its ``config.json``: the embedding, each layer's attention (with its own
    relative-position bias in UMT5), gated or plain feed-forward and norms, and the final norm."""
    d, inner = config["d_model"], config["num_heads"] * config["d_kv"]
    gated = str(config.get("feed_forward_proj", "")).startswith("gated")
    ff = (3 if gated else 2) * d * config["d_ff"]
    bias = config.get("relative_attention_num_buckets", 32) * config["num_heads"]
    layer = 4 * d * inner + ff + 2 * d + bias
    return config["vocab_size"] * d + config["num_layers"] * layer + d


def text_encoder_bytes(root: Path, itemsize: int) -> int:
    folder = root / "text_encoder"
    found = safetensors_bytes(folder, itemsize)
    if found is not None:
        return found
    return umt5_parameters(json.loads((folder / "config.json").read_text())) * itemsize


def vae_bytes(root: Path, itemsize: int) -> int:
    found = safetensors_bytes(root / "vae", itemsize)
    return found if found is not None else VAE_PARAMS * itemsize


def decoder_state_bytes(decoder: str, width: int, height: int, itemsize: int) -> int:
    """One stream's decoder state at ``width`` x ``height``, as the gateway estimates it before measuring."""
    if decoder == "tiny":
        return TINY_STATE_BYTES * width * height // STATE_PIXELS
    return FULL_VAE_STATE_BYTES * itemsize // FULL_VAE_STATE_ITEMSIZE * width * height // STATE_PIXELS


@dataclass
class Layout:
    """One pipeline as ``up`` places it: what the plan needs of its flags and placement (no argparse here)."""

    pipeline: str  # "" for one pipeline, "p0" ... in a fleet
    stage_devices: list[str]  # by rank
    stage_weights: list[int]  # by rank
    stage_kv: list[int]  # one serving stream's KV, by rank
    cuda_graphs: bool
    kv_room: int | None = None  # --kv-budget-gib in bytes
    gateway_device: str | None = None  # None: no gateway
    vae_devices: list[str] = field(default_factory=list)
    text_bytes: int = 0
    cache_bytes: int = 0  # the text encoder's prompt cache bound (embeddings on its device)
    vae_bytes: int = 0
    vae_graph_bytes: int = 0  # --vae-cuda-graphs: each graph slot holds a stream's VAE cache
    tiny_bytes: int = 0
    tiny_graph_bytes: int = 0  # --tiny-cuda-graphs: each graphed row's memory in and out, and its frames out
    stream_state: int = 0
    decoder: str = "full"
    max_streams: int = 16
    decoder_room: int | None = None  # --decoder-memory-gib in bytes


def layout_parts(layout: Layout) -> list[Part]:
    """The parts of one pipeline, keyed (pipeline, "stage", rank) and (pipeline, "gateway", device)."""
    own = f"{layout.pipeline}'s " if layout.pipeline else ""
    parts: list[Part] = []
    for rank, device in enumerate(layout.stage_devices):
        parts.append(
            StagePart(
                (layout.pipeline, "stage", rank),
                f"{own}stage {rank}",
                device,
                layout.stage_weights[rank],
                layout.stage_kv[rank],
                layout.cuda_graphs,
                layout.kv_room,
            )
        )
    if layout.gateway_device is None:
        return parts
    vae = layout.vae_devices or [layout.gateway_device]
    decoder_device = vae[0]
    devices = list(dict.fromkeys([layout.gateway_device, *vae]))
    name = f"{own}gateway" if own else "the gateway"
    for device in devices:
        models = []
        if device == layout.gateway_device:
            models.append(("text encoder", layout.text_bytes))
            if layout.cache_bytes:
                models.append(("prompt cache", layout.cache_bytes))
        if device in vae:
            models.append(("VAE" if len(vae) == 1 else "VAE slice", layout.vae_bytes // len(vae)))
            if layout.vae_graph_bytes:
                models.append(("VAE graph slots", layout.vae_graph_bytes // len(vae)))
        if device == layout.gateway_device and layout.tiny_bytes:
            models.append(("tiny decoder", layout.tiny_bytes))
            if layout.tiny_graph_bytes:
                models.append(("tiny decoder graphs", layout.tiny_graph_bytes))
        here = device == decoder_device
        parts.append(
            GatewayPart(
                (layout.pipeline, "gateway", device),
                name,
                device,
                tuple(models),
                stream_state=layout.stream_state if here else 0,
                decoder=layout.decoder if here else "",
                max_streams=layout.max_streams,
                fixed_room=layout.decoder_room if here else None,
            )
        )
    return parts


def gateway_share(shares: dict[tuple, float], pipeline: str) -> float:
    """The gateway of ``pipeline``'s ``--device-memory-gib`` (0: its decoder device is not shared)."""
    return next((gib for key, gib in shares.items() if key[0] == pipeline and key[1] == "gateway"), 0.0)


def pipeline_layout(args, placement, partition: str | None, *, pipeline: str = "", device_of=lambda d: d) -> Layout:
    """One pipeline of ``up``'s flags (``args``) and ``placement`` (``launcher.local_cluster.Placement``), its devices
    named by ``device_of`` (a fleet's pipeline sees its GPUs as cuda:0.., the plan their host's names).  Reads the
    checkpoint's configs, ``stagecast.json`` and weight headers; loads no weights."""
    import torch

    from gateway.checkpoint import tiny_decoder_file
    from gateway.decode.batched_decoder import DEFAULT_BUCKETS, graphed_rows
    from gateway.decode.vae_graphs import MAX_SLOTS as MAX_GRAPH_SLOTS
    from gateway.options import GatewayOptions
    from gateway.text_encoder import DEFAULT_CACHE_BYTES
    from launcher.pipeline_start import has_gateway
    from stage_service.checkpoint import slice_parameter_bytes
    from stagecast.kv_memory import stream_kv_bytes
    from stagecast.model.config import DiTConfig, checkpoint_config
    from stagecast.model.partition import parse_partition, partition_ranges
    from stagecast.names import DTYPES
    from stagecast.service import resolve_transformer

    transformer = resolve_transformer(args.checkpoint)
    config = checkpoint_config(transformer)
    spec, sf, root = serving_of(transformer, config)
    dtype = DTYPES[args.dtype]
    element = torch.empty((), dtype=dtype).element_size()
    ranges = partition_ranges(parse_partition(partition, config["num_layers"], args.stages))
    model = DiTConfig.from_kwargs(config)
    per_group = args.stages * args.sp
    weights, kv = [], []
    for rank in range(len(placement.stage_devices)):
        i = rank % per_group // args.sp
        first, last = i == 0, i == args.stages - 1
        weights.append(slice_parameter_bytes(config, layers=ranges[i], first=first, last=last, dtype=dtype))
        kv.append(
            stream_kv_bytes(
                spec,
                model,
                layers=len(ranges[i]),
                element_bytes=element,
                sp=args.sp,
                cfg_rank=rank // per_group,
                cfg_size=args.cfg_parallel,
            )
        )
    gib = lambda value: int(value * GIB) if value and value > 0 else None  # noqa: E731
    layout = Layout(
        pipeline=pipeline,
        stage_devices=[device_of(d) for d in placement.stage_devices],
        stage_weights=weights,
        stage_kv=kv,
        cuda_graphs=bool(args.cuda_graphs),
        kv_room=gib(getattr(args, "kv_budget_gib", 0)),
    )
    if not has_gateway(args):
        return layout
    checkpoint_root = Path(args.checkpoint)
    tiny = tiny_decoder_file(checkpoint_root, args.tiny_decoder)
    layout.gateway_device = device_of(placement.gateway_device)
    layout.vae_devices = [device_of(d) for d in (placement.vae_devices or [placement.gateway_device])]
    cuda = placement.gateway_device.startswith("cuda")
    vae_item = element if cuda else 4
    layout.text_bytes = text_encoder_bytes(checkpoint_root, 2 if cuda else 4)  # --text-dtype auto
    layout.vae_bytes = vae_bytes(checkpoint_root, vae_item)
    layout.tiny_bytes = tiny.stat().st_size if tiny is not None else 0
    layout.decoder = args.default_decoder
    width, height = spec.latent_width * sf, spec.latent_height * sf
    layout.stream_state = decoder_state_bytes(args.default_decoder, width, height, vae_item)
    layout.max_streams = GatewayOptions.__dataclass_fields__["max_streams"].default
    layout.cache_bytes = DEFAULT_CACHE_BYTES if cuda else 0
    if args.vae_cuda_graphs and cuda:
        slots = min(layout.max_streams, MAX_GRAPH_SLOTS)
        layout.vae_graph_bytes = slots * decoder_state_bytes("full", width, height, vae_item)
    if getattr(args, "tiny_cuda_graphs", False) and cuda and tiny is not None:
        rows = sum(graphed_rows(DEFAULT_BUCKETS))
        frames = 4 * 3 * width * height * vae_item  # a latent frame's four raw output frames
        layout.tiny_graph_bytes = rows * (2 * decoder_state_bytes("tiny", width, height, vae_item) + frames)
    layout.decoder_room = gib(getattr(args, "decoder_memory_gib", 0))
    return layout


def serving_of(transformer: str, config: dict):
    """The serving stream of a ``--checkpoint``'s transformer (``stagecast.kv_memory.serving_spec``), its VAE's spatial
    factor and the checkpoint root (None for ``random:NAME``)."""
    from stagecast.kv_memory import serving_spec, spatial_factor
    from stagecast.model.config import checkpoint_folder

    folder = checkpoint_folder(transformer)
    root = None if folder is None else folder.parent if folder.name == "transformer" else folder
    return serving_spec(root, config), spatial_factor(root, config), root


def stage_fit_problems(layout: Layout, serving: str) -> list[str]:
    """With the operator's ``--kv-budget-gib`` (on any device): each stage it leaves without one serving stream."""
    from stagecast.kv_memory import format_bytes

    if layout.kv_room is None:
        return []
    return [
        f"--kv-budget-gib gives stage {rank} {format_bytes(layout.kv_room)} of KV, and one stream at {serving} needs "
        f"{format_bytes(need)} on it: raise --kv-budget-gib or leave it out"
        for rank, need in enumerate(layout.stage_kv)
        if need > layout.kv_room
    ]
