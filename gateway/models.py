"""What the gateway computes with: the text encoder, the decoders and the input encoder, ready before it serves.

Usage (``gateway.service.Gateway`` holds one)::

    models = GatewayModels(opts, root, defaults=defaults, model=model, text_len=512, timers=timers)
    models.encoder.encode_cached(prompt)     # the text encoder (UMT5, cached per prompt)
    models.decoder, models.tiny_decoder      # the full VAE (in process, or VAE stages) and the tiny decoder, if any
    models.decoder_costs()                   # what the VaeReporter sends the coordinator
    models.decoder_memory()                  # the bound on the streams' decoder state (ValueError: no stream fits)
    models.warm_pipeline(coordinator, wait_s, buffer_chunks)   # one stream through the pipeline before serving
    models.input_encoder()                   # the VAE encoder video-to-video streams share, loaded on first use
    models.close()

Building them is the gateway's start-up: the decoders are warmed (compiled variants built, cuDNN's search run), the
in-process VAE's steady-state frames captured as CUDA graphs, and each decoder's cost measured for the coordinator's
SLO model, all before the gateway reports READY.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from gateway.checkpoint import ModelInfo, ServingDefaults, tiny_decoder_file
from gateway.decode.batched_decoder import BatchedDecoder
from gateway.decode.decoder import LocalDecoder, RemoteDecoder
from gateway.decode.stream_vae import StreamVAE, StreamVAEEncoder, use_cudnn_autotune
from gateway.decode.vae_cost import VaeCost, measure_vae, tiny_cost, with_encode
from gateway.decode.vae_graphs import MAX_SLOTS as MAX_GRAPH_SLOTS
from gateway.edge.admission import FULL_VAE_STATE_BYTES, FULL_VAE_STATE_ITEMSIZE, DecoderMemory
from gateway.edge.config import Decoders, resolve_config
from gateway.stream.timers import Timers
from gateway.stream.warmup import warm_pipeline
from gateway.text_encoder import TextEncoder, text_dtype
from stagecast.api import DEFAULT_CODEC
from stagecast.cuda_graphs import cuda_graph_capture
from stagecast.media import make_encoder
from stagecast.names import DTYPES
from stagecast.startup import Startup
from stagecast.v1 import stream_pb2 as pb

logger = logging.getLogger(__name__)


class GatewayModels:
    """The text encoder, the full VAE (or the VAE stages' client), the tiny decoder and the shared input encoder:
    built, warmed, graphed and measured at start-up."""

    def __init__(
        self,
        opts,
        root: Path,
        *,
        defaults: ServingDefaults,
        model: ModelInfo,
        text_len: int,
        timers: Timers,
        before_measure: Callable[[], object] | None = None,
        startup: Startup | None = None,
    ):
        """``before_measure``: called once the decoders are built and warmed, before their costs are measured (the
        gateway waits there for its pipeline, so that a stage's calibration and these measurements do not share the
        GPU: the gateway starts beside the stages and loads while they load).  ``startup``: the gateway's start-up
        steps (text_encoder, decoders, warm_up, vae_graphs, measured), each recorded as it is done."""
        step = startup.step if startup is not None else (lambda *a, **k: None)
        self.opts = opts  # gateway.service.GatewayOptions
        self.defaults = defaults
        self.model = model
        self.text_len = text_len
        text_device = opts.text_device or opts.device
        self.encoder = TextEncoder(
            root,
            max_len=text_len,
            cache_size=opts.text_cache,
            device=text_device,
            dtype=text_dtype(opts.text_dtype, text_device),
            graph=cuda_graph_capture(torch.device(text_device))
            if opts.text_graph and torch.device(text_device).type == "cuda"
            else None,
        )
        step("text_encoder", detail=f"on {text_device}")
        if opts.vae_stage:
            self.decoder = RemoteDecoder(
                opts.vae_stage, drain_timeout=opts.drain_timeout, timers=timers, mtls=opts.mtls
            )
            autotuned = False
        else:
            autotuned = opts.vae_cudnn_benchmark and use_cudnn_autotune(opts.vae_devices or [opts.device])
            self.decoder = LocalDecoder.from_folder(
                root / "vae",
                dtype=DTYPES[opts.vae_dtype],
                devices=opts.vae_devices or [opts.device],
                boundaries=opts.vae_split,
                compile=opts.vae_compile,
            )
        tiny_path = tiny_decoder_file(root, opts.tiny_decoder)
        # Every tiny stream's ready chunk in one call (gateway.decode.batched_decoder): one worker for all of them.
        self.tiny_decoder = (
            BatchedDecoder.tiny(
                tiny_path,
                device=opts.device,
                dtype=DTYPES[opts.vae_dtype],
                latent_channels=model.latent_channels,
                spatial_factor=model.spatial_factor,
                temporal_factor=model.temporal_factor,
                compile=opts.vae_compile and torch.device(opts.device).type == "cuda",
            )
            if tiny_path is not None
            else None
        )
        self.decoders = Decoders(tiny=self.tiny_decoder is not None, default=opts.default_decoder)
        step("decoders", detail="full, tiny" if self.decoders.tiny else "full")
        self._encoder_lock = threading.Lock()
        self._input_encoder: StreamVAEEncoder | None = None
        self.warmup_s = 0.0
        if opts.warmup if opts.warmup is not None else opts.vae_compile or autotuned:
            self.warmup_s = self._warm_up()
            step("warm_up", detail=f"{self.warmup_s:.1f} s")
        if opts.vae_cuda_graphs:
            # After the compile warm-up (a graph of a compiled part records the compiled kernels), before serving.
            start = time.perf_counter()
            sf = model.spatial_factor
            slots = opts.vae_graph_slots or min(opts.max_streams, MAX_GRAPH_SLOTS)
            graphed = self.decoder.capture_graphs((defaults.height // sf, defaults.width // sf), slots)
            self.warmup_s += time.perf_counter() - start
            logger.info("VAE graphs: parts graphed %s, captured in %.1f s", graphed, time.perf_counter() - start)
            step("vae_graphs", detail=f"parts {graphed}")
        if before_measure is not None:
            before_measure()
        # Measured after the capture: what streams will cost, graphed where they hold a slot.
        self.vae_cost = self._measure_vae()
        self.tiny_measured = self._warm_tiny()
        if self.vae_cost is not None or self.tiny_measured:
            step("measured", detail="decoder costs for the SLO model")

    def by_kind(self) -> dict:
        """The decoders by ``StreamConfig.decoder``: "full", and "tiny" where the deployment has one."""
        return {"full": self.decoder, **({"tiny": self.tiny_decoder} if self.tiny_decoder else {})}

    def close(self) -> None:
        self.decoder.close()
        if self.tiny_decoder is not None:
            self.tiny_decoder.close()

    def warm_pipeline(self, coordinator, wait_s: float, buffer_chunks: int) -> int:
        """One stream of the serving defaults through the pipeline before serving (``gateway.stream.warmup``): what
        a request that sets nothing gets, unpaced, its latents dropped.  Returns the chunks it ran (0: skipped)."""
        try:
            cfg = resolve_config(
                pb.StreamConfig(prompt="warm-up"), defaults=self.defaults, model=self.model, decoders=self.decoders
            )
            spec = cfg.stream_spec(latent_channels=self.model.latent_channels, text_len=self.text_len)
            decoder = self.tiny_decoder if cfg.decoder == "tiny" else self.decoder
            return warm_pipeline(
                coordinator,
                spec=spec,
                text=self.encoder.encode("warm-up"),
                consumer_depth=decoder.depth(buffer_chunks),
                wait_s=wait_s,
                decoder=cfg.decoder,
            )
        except Exception:  # noqa: BLE001 - a warm-up is never a reason not to serve
            logger.warning("pipeline warm-up failed; serving without it", exc_info=True)
            return 0

    def _warm_up(self, chunks: int = 4, sessions: int = 3) -> float:
        """Before serving: encode a prompt and decode ``chunks`` chunks of the default size through ``sessions`` decode
        sessions one after the other (every VAE part, in its own thread, as streams would), so that kernels are
        loaded and every compiled variant is built now rather than while a stream waits.  One session is not enough:
        on an H200 the first stream after a one-session warm-up still recompiled once (a 26 s stall at its second
        chunk), as the second stream did without any warm-up; from the third stream on nothing compiles."""
        start = time.perf_counter()
        self.encoder.encode("warm-up")
        sf = self.model.spatial_factor
        shape = (1, self.model.latent_channels, 1, self.defaults.height // sf, self.defaults.width // sf)
        local = [self.decoder] if isinstance(self.decoder, LocalDecoder) else []
        local += [self.tiny_decoder] if self.tiny_decoder is not None else []
        for decoder in local:
            for _ in range(sessions):
                session = decoder.open(chunks)
                try:
                    for c in range(chunks):
                        session.submit(SimpleNamespace(index=c), torch.randn(shape))
                    session.finish()
                    for _ in session.results():
                        pass
                finally:
                    session.close()
        took = time.perf_counter() - start
        logger.info(
            "gateway warmed up in %.1f s (text encoder; %d x %d VAE chunks of the default size)", took, sessions, chunks
        )
        return took

    def _measure_vae(self) -> VaeCost | None:
        """Time a steady-state chunk decode of the default size on every in-process VAE part (after the warm-up, if
        any): the slowest part's ms is what each chunk costs the busiest device (``gateway.decode.vae_cost``).  On a
        GPU that
        is the stage GPU's share; on the CPU the frames' encode (the default codec) is added, since there the decode,
        the encode and the stages share the host's cores (the coordinator counts a CPU decoder only where its stages
        run on that CPU: ``coordinator.slo``, "A CPU host")."""
        if not isinstance(self.decoder, LocalDecoder):
            return None  # VAE stages (--vae-stage) run elsewhere: not measured here
        shape = self.latent_shape()
        try:
            cost = measure_vae(self.decoder.parts, shape)
            if cost is not None and cost.device.startswith("cpu"):
                cost = with_encode(cost, self._encode_ms_per_chunk())
        except Exception:  # noqa: BLE001 - a measurement for the SLO model, never a reason not to serve
            logger.warning("measuring the VAE's cost per chunk failed", exc_info=True)
            return None
        if cost is not None:
            logger.info(
                "VAE%s: %.2f ms per chunk of %s latents on the busiest device (%s; parts: %s ms%s)",
                " on the CPU" if cost.encode_ms else "",
                cost.chunk_ms,
                "x".join(map(str, shape[2:])),
                cost.device,
                ", ".join(f"{ms:.2f}" for ms in cost.part_ms),
                f"; the frames' encode {cost.encode_ms:.2f} ms included" if cost.encode_ms else "",
            )
        return cost

    def _encode_ms_per_chunk(self) -> float:
        """The median ms to encode one chunk's frames at the serving size with the default codec (on this CPU)."""
        d = self.defaults
        frames = d.chunk_frames * self.model.temporal_factor
        encoder = make_encoder(DEFAULT_CODEC, width=d.width, height=d.height, fps=d.fps, chunked=True)
        frame = np.random.default_rng(0).integers(0, 256, (d.height, d.width, 3), dtype=np.uint8)
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            for i in range(frames):
                encoder.encode(frame, keyframe=i == 0)
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    def latent_shape(self) -> tuple[int, ...]:
        """One chunk of the serving defaults' latents."""
        sf = self.model.spatial_factor
        return (
            1,
            self.model.latent_channels,
            self.defaults.chunk_frames,
            self.defaults.height // sf,
            self.defaults.width // sf,
        )

    def _warm_tiny(self) -> bool:
        """A tiny decoder on a GPU: every batch bucket's pass built (compiled with ``--vae-compile``) and timed before
        serving, the start-up ``batch_ms`` the coordinator hears.  Returns whether it was measured."""
        if self.tiny_decoder is None or self.tiny_decoder.part.device.type != "cuda":
            return False
        start = time.perf_counter()
        try:
            self.tiny_decoder.warm(self.latent_shape(), graphs=self.opts.tiny_cuda_graphs)
        except Exception:  # noqa: BLE001 - a measurement for the SLO model, never a reason not to serve
            logger.warning("warming and measuring the tiny decoder's batches failed", exc_info=True)
            return False
        self.warmup_s += time.perf_counter() - start
        return True

    def decoder_costs(self) -> list[VaeCost | None]:
        """What the reporter sends: the full VAE's measured cost, and the tiny decoder's as it stands now."""
        costs: list[VaeCost | None] = [self.vae_cost]
        if self.tiny_measured:
            costs.append(tiny_cost(self.tiny_decoder, self.latent_shape()))
        return costs

    def decoder_memory(self) -> DecoderMemory:
        """The admission bound on decoder state (``--decoder-memory-gib``, else from ``--device-memory-gib`` or the
        free memory): each local decoder's one-stream state at the serving size (the VAE's as measured, else
        estimated; VAE stages hold theirs elsewhere).  Raises ValueError when it holds no stream of the default
        decoder at the serving size."""
        shape = self.latent_shape()
        per_stream: dict[str, int] = {}
        if isinstance(self.decoder, LocalDecoder):
            measured = self.vae_cost.state_bytes if self.vae_cost is not None else 0
            per_stream["full"] = measured or int(
                FULL_VAE_STATE_BYTES
                * DTYPES[self.opts.vae_dtype].itemsize
                / FULL_VAE_STATE_ITEMSIZE
                * (self.defaults.height * self.defaults.width)
                / (480 * 832)
            )
        if self.tiny_decoder is not None:
            per_stream["tiny"] = self.tiny_decoder.state_bytes_at((shape[-2], shape[-1]))
        devices = self.opts.vae_devices or [self.opts.device]
        serving_hw = (self.defaults.height, self.defaults.width)
        memory = DecoderMemory.derive(
            devices[0],
            per_stream,
            serving_hw,
            budget_gib=self.opts.decoder_memory_gib,
            share_gib=self.opts.device_memory_gib,
            held_bytes=lambda: self._held_bytes(devices[0]),
        )
        # A gateway that holds no stream of its default decoder fails start-up naming the numbers, rather than serve
        # READY and refuse every stream (stagecast.service.run_service: one line, exit status 2).
        problem = memory.stream_fit_problem(self.decoders.default, serving_hw)
        if problem is not None:
            raise ValueError(problem)
        return memory

    def _held_bytes(self, device: str) -> int:
        """What this gateway holds on ``device`` now (its models loaded, warmed and graphed), and the prompt cache's
        room still to fill there: the part of a planned share (``--device-memory-gib``) that is not decoder state."""
        held = torch.cuda.memory_allocated(torch.device(device))
        if torch.device(self.opts.text_device or self.opts.device) == torch.device(device):
            held += max(0, self.encoder.cache_bytes_max - self.encoder.cache_bytes)
        return held

    def input_encoder(self) -> StreamVAEEncoder:
        """The VAE encoder video-to-video streams share (each holds its own cache): the in-process decoder's VAE, or,
        when decoding happens in VAE stages, the checkpoint's VAE loaded here on first use."""
        with self._encoder_lock:
            if self._input_encoder is None:
                if isinstance(self.decoder, LocalDecoder):
                    vae = self.decoder.parts[0].vae
                else:
                    vae = StreamVAE.from_folder(
                        Path(self.opts.checkpoint) / "vae", dtype=DTYPES[self.opts.vae_dtype], device=self.opts.device
                    ).vae
                self._input_encoder = StreamVAEEncoder(vae)
            return self._input_encoder
