"""A stage's DiT slice: the layers the coordinator assigns, loaded, converted, timed and budgeted.

Usage (``stage_service.server.StageServicer`` holds one)::

    loader = SliceLoader(opts, config, device=device, dtype=dtype, telemetry=telemetry)
    took = loader.load(range(0, 15))     # 0.0 when those layers are already loaded
    loader.slice, loader.layers          # the DiTSlice and its layer range
    loader.calibration                   # its timings for the SLO model (FormReply.calibration), or None
    loader.kv_budget                     # the bytes it gives streams' KV (FormReply.kv_budget_bytes; 0: no limit)

After loading (only the assigned layers: ``stage_service.checkpoint``), FP8 conversion (``--fp8``), a calibration
within ``--calibration-s`` (``stage_service.calibration``) and the KV budget measured after it
(``stage_service.kv_budget``).
"""

from __future__ import annotations

import logging
import time

import torch

from stage_service.calibration import DEFAULT_BUDGET_S, Calibration, ServingShape, calibrate, serving_shape
from stage_service.checkpoint import load_slice_state_dict, random_slice_state_dict
from stage_service.dit_levers import apply_levers, cudnn_refusal, parse_levers, warm_levers
from stage_service.dit_slice import SDPA_CALLS, DiTSlice
from stage_service.fp8 import convert_to_fp8
from stage_service.kv_budget import (
    KvBudget,
    activation_reserve,
    graph_buffer_cap,
    measure_kv_budget_detail,
    stream_fit_problem,
)
from stage_service.metrics import StageTelemetry
from stagecast.kv_memory import describe_spec, serving_spec, spatial_factor, stream_kv_bytes
from stagecast.microstep import DEFAULT_MAX_BATCH
from stagecast.model.config import RANDOM_PREFIX, DiTConfig, checkpoint_folder
from stagecast.startup import Startup

logger = logging.getLogger(__name__)


class SliceLoader:
    """The loaded slice, its layer range, its calibration and its KV budget."""

    def __init__(
        self,
        opts,
        config: dict,
        *,
        device: torch.device,
        dtype: torch.dtype,
        telemetry: StageTelemetry,
        startup: Startup | None = None,
    ):
        self.opts = opts  # stage_service.server.StageOptions
        self.config = config
        self.device = device
        self.dtype = dtype
        self.telemetry = telemetry
        self.startup = startup  # the stage's start-up steps: weights, calibration k of n
        self.layers: range | None = None
        self.slice: DiTSlice | None = None
        # the coordinator's Stream Batch (RegisterReply.max_batch): what the calibration times
        self.max_batch = DEFAULT_MAX_BATCH
        self.calibration: Calibration | None = None  # of the loaded slice; None: not calibrated
        self.kv_budget = 0  # bytes for streams' KV, measured after loading (FormReply.kv_budget_bytes; 0: no limit)
        self.kv_budget_origin = ""  # where it came from (a Form refused for want of room for one stream says it)
        # What the CUDA graphs' static buffers may hold (None: no cap, no graphs); kept out of the KV budget: a
        # fraction of this process's share of its GPU (--device-memory-gib), else of the GPU.
        self.graph_cap = graph_buffer_cap(device, opts.cuda_graphs, opts.device_memory_gib)

    def load(self, layers: range) -> float:
        """Load ``layers`` unless they are loaded already; returns the seconds it took (the caller holds the lock)."""
        if self.layers == layers and self.slice is not None:
            return 0.0
        start = time.perf_counter()
        n = self.config["num_layers"]
        first, last = layers.start == 0, layers.stop == n
        if self.opts.checkpoint.startswith(RANDOM_PREFIX):
            config = self.config
            sd = random_slice_state_dict(
                config, layers=layers, first=first, last=last, dtype=self.dtype, device=self.device
            )
        else:
            config, sd = load_slice_state_dict(
                self.opts.checkpoint,
                layers=layers,
                first=first,
                last=last,
                dtype=self.dtype,
                device=self.device,
                loras=self.opts.loras,
            )
        self.slice = DiTSlice.from_state_dict(config, sd, layers=layers, first=first, last=last, device=self.device)
        if self.opts.fp8:  # before Form builds CUDA graphs over the blocks
            convert_to_fp8(self.slice)
        if self.opts.dit_levers:  # likewise before the graphs: they capture what the levers made of the blocks
            logger.info("--dit-levers: %s", apply_levers(self.slice, parse_levers(self.opts.dit_levers)))
            self._warm_levers()
        self.layers = layers
        self.telemetry.set_layers(layers)
        took = time.perf_counter() - start
        logger.info("stage %d loaded layers %d:%d in %.2fs", self.opts.index, layers.start, layers.stop, took)
        self.telemetry.startup("load", took)
        if self.startup is not None:
            self.startup.step("weights", detail=f"layers {layers.start}:{layers.stop} in {took:.2f} s")
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            loaded = torch.cuda.memory_allocated(self.device)
        self.calibration = self._calibrate()
        whole = torch.cuda.max_memory_allocated(self.device) - loaded if cuda else 0
        per_forward = self.calibration.activation_bytes if self.calibration is not None else None
        peak = activation_reserve(per_forward, whole, cuda_graphs=bool(self.graph_cap)) if cuda else 0
        if cuda:
            torch.cuda.empty_cache()
        budget: KvBudget = measure_kv_budget_detail(
            self.device,
            operator_gib=self.opts.kv_budget_gib,
            activation_peak=peak,
            graph_bytes=self.graph_cap or 0,
            share_gib=self.opts.device_memory_gib,
        )
        self.kv_budget, self.kv_budget_origin = budget.bytes, budget.origin
        gib = self.kv_budget / (1 << 30)
        limit = f"{gib:.3f} GiB ({budget.origin})" if self.kv_budget else budget.origin
        logger.info("stage %d gives streams' KV %s", self.opts.index, limit)
        return took

    def stream_fit_problem(self, *, sp: int, cfg_rank: int, cfg_size: int) -> str | None:
        """Why this stage may not form: its KV budget holds no stream at the serving defaults
        (``stagecast.kv_memory.serving_spec``, priced as the coordinator prices it); None when it holds one, has no
        limit, or the serving defaults cannot be read (logged: the gateway refuses such a checkpoint itself)."""
        if self.kv_budget <= 0 or self.layers is None:
            return None
        folder = checkpoint_folder(self.opts.checkpoint)
        root = None if folder is None else folder.parent if folder.name == "transformer" else folder
        try:
            spec = serving_spec(root, self.config)
            spatial = spatial_factor(root, self.config)
            need = stream_kv_bytes(
                spec,
                DiTConfig.from_kwargs(self.config),
                layers=len(self.layers),
                element_bytes=torch.empty((), dtype=self.dtype).element_size(),
                sp=sp,
                cfg_rank=cfg_rank,
                cfg_size=cfg_size,
            )
        except (ValueError, KeyError, TypeError) as exc:
            logger.warning("stage %d: no serving stream to check the KV budget against (%s)", self.opts.index, exc)
            return None
        budget = KvBudget(self.kv_budget, self.kv_budget_origin)
        what = f"{describe_spec(spec, spatial)}, on layers {self.layers.start}:{self.layers.stop}"
        return stream_fit_problem(budget, need, stage=self.opts.index, stream=what)

    def _warm_levers(self) -> None:
        """The fused lever's kernels compiled at the serving shape before the calibration times the slice; with
        ``cudnn``, whether cuDNN takes the blocks' attention (logged where it refuses: the lever then changes
        nothing)."""
        levers = parse_levers(self.opts.dit_levers)
        if self.device.type != "cuda" or not {"fused", "cudnn"} & set(levers):
            return
        shape = self.serving_shape()
        if shape is None:
            return
        if "cudnn" in levers:
            why = cudnn_refusal(self.slice, shape.chunk_frames, shape.latent_height, shape.latent_width, shape.text_len)
            if why is None:
                logger.info("stage %d: --dit-levers cudnn: cuDNN runs the blocks' attention", self.opts.index)
            else:
                logger.warning(
                    "stage %d: --dit-levers cudnn: cuDNN refuses the blocks' attention, which runs on the next "
                    "backend (flash): %s",
                    self.opts.index,
                    why,
                )
        if "fused" not in levers:
            return
        t = time.perf_counter()
        warm_levers(self.slice, shape.chunk_frames, shape.latent_height, shape.latent_width, shape.text_len)
        logger.info("stage %d: --dit-levers fused compiled in %.1fs", self.opts.index, time.perf_counter() - t)

    def serving_shape(self) -> ServingShape | None:
        """The serving size its checkpoint gives (``stage_service.calibration.serving_shape``); None where it cannot
        be read (logged): the graphs are then captured while serving."""
        try:
            return serving_shape(self.opts.checkpoint, self.config)
        except Exception as exc:  # noqa: BLE001
            logger.warning("stage %d: no serving size (%s); graphs are captured while serving", self.opts.index, exc)
            return None

    def _calibrate(self) -> Calibration | None:
        """Time the freshly loaded slice for the coordinator's SLO model (never raises: a stage that cannot calibrate
        still serves, and the coordinator learns its times from measured batches)."""
        budget = self.opts.calibration_s
        if budget is None:
            # On a CPU the stages, the gateway and the text encoder share the cores, and a timing taken while they all
            # start says little about serving: calibrate there only when asked.
            budget = DEFAULT_BUDGET_S if self.device.type == "cuda" else 0.0
        if budget <= 0:
            return None
        if self.opts.sp > 1:
            logger.info("stage %d: no calibration under --sp (its forwards need the whole group)", self.opts.index)
            return None
        assert self.slice is not None
        try:
            shape = serving_shape(self.opts.checkpoint, self.config)
            cal = calibrate(
                self.slice,
                min(max(self.max_batch, 1), 64),
                shape,
                budget_s=budget,
                graphs=self.opts.cuda_graphs,
                on_batch=(lambda b, n: self.startup.step("calibration", b, n)) if self.startup is not None else None,
            )
        except Exception as exc:  # noqa: BLE001
            logger.warning("stage %d: calibration failed: %s; times come from batches", self.opts.index, exc)
            return None
        if cal.error:
            logger.warning("stage %d: calibration incomplete: %s", self.opts.index, cal.summary())
        else:
            logger.info("stage %d: calibration: %s", self.opts.index, cal.summary())
        ran = SDPA_CALLS.take()  # --dit-levers cudnn: which backend its calls ran on
        refused = SDPA_CALLS.refusals(ran)
        for what, calls in ran.items():
            log = logger.warning if what in refused else logger.info
            log("stage %d: calibration: %d attention call(s): %s", self.opts.index, calls, what)
        self.telemetry.startup("calibration", cal.seconds)
        return cal
