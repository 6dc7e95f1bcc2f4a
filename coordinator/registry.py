"""Stage registry: who serves which layers, and whether the group can be formed.

Usage::

    reg = StageRegistry(world_size=4, partition="8,12,12,8")
    rec = reg.register(index=1, address="10.0.0.2:50060", config_json=..., expected_world_size=4)
    rec.layers                       # range(8, 20)
    StageRegistry(world_size=2, sp=2)   # 2 stages of 2 sequence-parallel ranks: indices are ranks 0..3,
                                        # rank r serves stage r // 2's layers
    reg.complete                     # every index has a live registration
    StageRegistry(world_size=2, cfg_parallel=2)   # CFG-parallel: two pipelines of 2 stages, indices 0-1 and 2-3
    reg.mark_lost(1)                 # a lost stage may register again (a restart)

Registration errors are ``RegistrationError`` with the gRPC status code to answer with.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass

import grpc

from stagecast.grpc_util import StatusError
from stagecast.model.dit_configs import WAN_ROPE_MAX_SEQ_LEN
from stagecast.model.parallel import LayoutError, ParallelLayout, check_sp
from stagecast.model.partition import parse_partition, partition_ranges

# Keys that must agree between stages for their slices to form one model.
_MODEL_KEYS = (
    "num_layers",
    "num_attention_heads",
    "attention_head_dim",
    "in_channels",
    "out_channels",
    "text_dim",
    "freq_dim",
    "ffn_dim",
    "patch_size",
    "cross_attn_norm",
    "qk_norm",
    "eps",
    "rope_max_seq_len",
)


class RegistrationError(StatusError):
    """A stage the registry will not take, with the status the stage gets."""


@dataclass
class StageRecord:
    index: int
    address: str
    config: dict
    device: str
    layers: range
    lost: bool = False


class StageRegistry:
    """``world_size`` is the pipeline's stage count; with ``sp`` > 1 each stage is ``sp`` ranks, registered under
    their global rank ``stage * sp + sp_rank`` (``ranks`` in all)."""

    def __init__(self, world_size: int, partition: str | None = None, sp: int = 1, cfg_parallel: int = 1):
        """With ``cfg_parallel`` 2 there are two pipelines (CFG groups) of ``world_size`` stages: index
        ``g * world_size + k`` holds the layers of pipeline position ``k``."""
        if world_size < 1:
            raise ValueError(f"stage count must be >= 1, got {world_size}")
        if cfg_parallel not in (1, 2):
            raise ValueError(f"--cfg-parallel must be 1 or 2, got {cfg_parallel}")
        if cfg_parallel > 1 and sp > 1:
            raise ValueError(
                f"--cfg-parallel {cfg_parallel} with --sp {sp}: CFG-parallel does not compose with --sp yet"
            )
        # The pipeline's shape, fixed at construction: read-only below (other parts read it, none may change it).
        self._layout = ParallelLayout(world_size, sp)
        self._world_size = world_size
        self._sp = sp
        self._cfg_parallel = cfg_parallel
        self.partition_spec = partition
        self.partition: list[range] | None = None
        self.model: dict | None = None
        self.stages: dict[int, StageRecord] = {}
        self.lock = threading.Lock()

    @property
    def layout(self) -> ParallelLayout:
        return self._layout

    @property
    def world_size(self) -> int:
        """The stage count of one pipeline (as configured)."""
        return self._world_size

    @property
    def sp(self) -> int:
        return self._sp

    @property
    def cfg_parallel(self) -> int:
        return self._cfg_parallel

    def one_cpu_host(self) -> bool:
        """Every registered stage runs on the CPU of one host (their addresses' host part is one): they, and a gateway
        decoding on the CPU beside them, share its cores (``coordinator.slo``, "A CPU host")."""
        with self.lock:
            records = list(self.stages.values())
        if not records or not all(r.device.startswith("cpu") for r in records):
            return False
        return len({r.address.rsplit(":", 1)[0] for r in records}) == 1

    @property
    def pipeline_stages(self) -> int:
        """Stages of one pipeline (one CFG group): the scheduler's depth."""
        return self.world_size

    @property
    def ranks(self) -> int:
        return self.layout.world_size * self.cfg_parallel

    def stage_of(self, index: int) -> int:
        """The pipeline position of stage process ``index``."""
        return self.layout.stage_of(index % self.layout.world_size)

    def register(
        self, *, index: int, address: str, config_json: str, expected_world_size: int, device: str, sp: int = 1
    ):
        with self.lock:
            if max(sp, 1) != self.sp:
                raise RegistrationError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"stage {index} runs --sp {max(sp, 1)} but this coordinator runs --sp {self.sp}",
                )
            if expected_world_size and expected_world_size != self.world_size:
                raise RegistrationError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"stage {index} expects {expected_world_size} stages but this coordinator runs {self.world_size}",
                )
            if not 0 <= index < self.ranks:
                what = f"{self.world_size} stages" if self.sp == 1 else f"{self.world_size} stages × --sp {self.sp}"
                if self.cfg_parallel > 1:
                    what += f" × --cfg-parallel {self.cfg_parallel}"
                raise RegistrationError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"stage index {index} is out of range for {what} (0..{self.ranks - 1})",
                )
            try:
                config = json.loads(config_json)
            except json.JSONDecodeError as exc:
                raise RegistrationError(grpc.StatusCode.INVALID_ARGUMENT, f"model config is not JSON: {exc}") from exc
            model = {k: config.get(k) for k in _MODEL_KEYS}
            try:
                check_sp(self.sp, int(model["num_attention_heads"] or 0))
            except LayoutError as exc:
                raise RegistrationError(grpc.StatusCode.FAILED_PRECONDITION, str(exc)) from exc
            if self.model is not None and model != self.model:
                diff = sorted(k for k in _MODEL_KEYS if model[k] != self.model[k])
                detail = ", ".join(f"{k}: {model[k]!r} != {self.model[k]!r}" for k in diff)
                raise RegistrationError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"stage {index} serves a different model than the other stages ({detail})",
                )
            existing = self.stages.get(index)
            if existing is not None and not existing.lost and existing.address != address:
                raise RegistrationError(
                    grpc.StatusCode.ALREADY_EXISTS,
                    f"stage index {index} is already registered by {existing.address}",
                )
            if self.partition is None:
                try:
                    counts = parse_partition(self.partition_spec, model["num_layers"], self.pipeline_stages)
                except ValueError as exc:
                    raise RegistrationError(grpc.StatusCode.FAILED_PRECONDITION, str(exc)) from exc
                self.partition = partition_ranges(counts)
                self.model = model
            rec = StageRecord(index, address, config, device, self.partition[self.stage_of(index)])
            self.stages[index] = rec
            return rec

    @property
    def complete(self) -> bool:
        with self.lock:
            return len(self.stages) == self.ranks and not any(r.lost for r in self.stages.values())

    def mark_lost(self, index: int, address: str | None = None) -> None:
        """Mark a stage lost; with ``address``, only if that incarnation still holds the index (a newer
        registration from another address must not be marked lost by news about the old one)."""
        with self.lock:
            rec = self.stages.get(index)
            if rec is not None and (address is None or rec.address == address):
                rec.lost = True

    def get(self, index: int) -> StageRecord | None:
        with self.lock:
            return self.stages.get(index)

    def records(self) -> list[StageRecord]:
        with self.lock:
            return [self.stages[i] for i in sorted(self.stages)]

    def model_config(self) -> dict | None:
        """The stages' model config (None before any stage registered): every registration agrees on it."""
        recs = self.records()
        return recs[0].config if recs else None

    def rope_limit(self) -> int:
        """The stages' model's RoPE table length (``rope_max_seq_len``; Wan's before any stage registered)."""
        return int((self.model_config() or {}).get("rope_max_seq_len") or WAN_ROPE_MAX_SEQ_LEN)
