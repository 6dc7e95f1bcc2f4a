"""The gateway process: the public ``stagecast.v1.StreamService`` in front of a coordinator.

Run with ``stagecast gateway --coordinator HOST:PORT --checkpoint DIR [--port 50051] [--max-streams 8]``, or::

    gw = Gateway(GatewayOptions(coordinator="127.0.0.1:50050", checkpoint="/models/Wan2.1-T2V-1.3B-Diffusers"))
    gw.start(); ...; gw.stop()

The gateway encodes prompts (UMT5, cached per prompt), opens one coordinator stream per client stream, decodes the
finished latent chunks with a per-stream StreamVAE cache (in this process, or in a chain of ``stagecast vae-stage``
processes with ``--vae-stage``) and encodes frames (``gateway.stream`` holds the per-stream machinery and its
buffering policy).  Errors that end a call are gRPC status codes: INVALID_ARGUMENT names the bad
field, RESOURCE_EXHAUSTED means this gateway's ``--max-streams`` (or the coordinator's own limit, passed through)
or a client too slow to keep up.  ``GetStatus``/``WatchStatus`` and the Prometheus metrics show the streams the
gateway holds and the VAE cache memory they use.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import grpc
import torch

from gateway.checkpoint import ModelInfo, ServingDefaults
from gateway.config import ConfigError, resolve_config
from gateway.decoder import LocalDecoder, RemoteDecoder
from gateway.metrics import GatewayMetrics
from gateway.stream import StreamFailed, StreamRun
from gateway.stream_vae import DTYPES
from gateway.text_encoder import TextEncoder
from stagecast import telemetry
from stagecast.grpc_util import CHANNEL_OPTIONS, make_server, set_serving
from stagecast.internal.v1 import pipeline_pb2_grpc as ipb_grpc
from stagecast.service import announce_ready
from stagecast.v1 import stream_pb2 as pb
from stagecast.v1 import stream_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

SERVICE_NAME = "stagecast.v1.StreamService"


@dataclass
class GatewayOptions:
    coordinator: str
    checkpoint: str
    host: str = "127.0.0.1"
    port: int = 50051
    device: str = "cpu"
    max_streams: int = 8
    metrics_port: int = 0
    text_len: int | None = None  # None: the checkpoint's serving defaults (512 for real Wan checkpoints)
    text_cache: int = 256
    vae_dtype: str = "float32"
    vae_compile: bool = False  # torch.compile the VAE decoder (GPU; compiled before the gateway serves)
    # Decode a few chunks at the default size before serving, so that every compiled variant is built (dynamo is not
    # thread-safe and a compile on the serving path freezes streams for seconds).  None: when ``vae_compile``.
    warmup: bool | None = None
    vae_stage: str | None = None  # host:port of the first ``stagecast vae-stage``; None: decode in this process
    vae_devices: list[str] | None = None  # in-process VAE cut into one slice per device (None: all on ``device``)
    vae_split: list[int] | None = None  # decoder units where slices 1.. start (None: balanced by MACs)
    buffer_chunks: int = 4  # latent chunks queued per stream between the pipeline and the VAE
    buffer_messages: int = 32  # encoded messages queued per stream between the encoder and the client
    slow_client_timeout: float = 5.0  # how long a full buffer may stay full before the stream ends
    drain_timeout: float = 60.0  # how long a stopped pipeline stream may take to finish its cooldown
    abandon_timeout: float = 30.0  # how long a failed stream's client may take to read its error before cancelling


class Gateway:
    def __init__(self, opts: GatewayOptions):
        self.opts = opts
        root = Path(opts.checkpoint)
        self.defaults = ServingDefaults.load(root)
        self.model = ModelInfo.from_checkpoint(root)
        self.model_name = root.resolve().name  # gen_ai.request.model on the stream spans
        self.text_len = opts.text_len or self.defaults.text_len
        self.encoder = TextEncoder(root, max_len=self.text_len, cache_size=opts.text_cache, device=opts.device)
        if opts.vae_stage:
            self.decoder = RemoteDecoder(opts.vae_stage, drain_timeout=opts.drain_timeout)
        else:
            self.decoder = LocalDecoder.from_folder(
                root / "vae",
                dtype=DTYPES[opts.vae_dtype],
                devices=opts.vae_devices or [opts.device],
                boundaries=opts.vae_split,
                compile=opts.vae_compile,
            )
        self.warmup_s = 0.0
        if opts.warmup if opts.warmup is not None else opts.vae_compile:
            self.warmup_s = self._warm_up()
        self.channel = grpc.insecure_channel(opts.coordinator, options=CHANNEL_OPTIONS)
        self.coordinator = ipb_grpc.CoordinatorServiceStub(self.channel)

        self.cond = threading.Condition()
        self.streams: dict[str, StreamRun] = {}
        self.reserved = 0  # admitted calls still being set up (prompt encoding, coordinator open)
        self.version = 0  # bumped on every change WatchStatus reports
        self.started = 0
        self.finished = 0
        self.ended_by_reason: collections.Counter[str] = collections.Counter()
        self.metrics = GatewayMetrics(
            active=lambda: len(self.streams),
            vae_bytes=self.vae_state_bytes,
            queued_chunks=lambda: sum(run.session.queued for run in self._runs() if run.session is not None),
            queued_messages=lambda: sum(len(run.out) for run in self._runs()),
        )

        servicer = StreamServicer(self)
        self.server, self.health, self.port = make_server(
            opts.port,
            [(pb_grpc.add_StreamServiceServicer_to_server, servicer, SERVICE_NAME)],
            host=opts.host,
            # One handler thread per stream, plus room to refuse the streams over the limit and serve status.
            max_workers=opts.max_streams + 16,
        )
        host = "127.0.0.1" if opts.host == "0.0.0.0" else opts.host
        self.address = f"{host}:{self.port}"

    def _warm_up(self, chunks: int = 4) -> float:
        """Before serving: encode a prompt and decode ``chunks`` chunks of the default size through a decode session
        (every VAE part, in its own thread, as a stream would), so that kernels are loaded and every compiled variant
        (the first chunk's, the steady cache's) is built now rather than while a stream waits."""
        start = time.perf_counter()
        self.encoder.encode("warm-up")
        if isinstance(self.decoder, LocalDecoder):
            sf = self.model.spatial_factor
            shape = (1, self.model.latent_channels, 1, self.defaults.height // sf, self.defaults.width // sf)
            session = self.decoder.open(chunks)
            try:
                for c in range(chunks):
                    session.submit(SimpleNamespace(index=c), torch.zeros(shape))
                session.finish()
                for _ in session.results():
                    pass
            finally:
                session.close()
        took = time.perf_counter() - start
        logger.info("gateway warmed up in %.1f s (text encoder, %d VAE chunks of the default size)", took, chunks)
        return took

    def start(self) -> None:
        self.server.start()
        self.metrics.serve(self.opts.metrics_port)
        set_serving(self.health, [SERVICE_NAME], True)
        logger.info(
            "gateway on %s -> coordinator %s (text_len=%d, VAE %s)",
            self.address,
            self.opts.coordinator,
            self.text_len,
            self.opts.vae_stage or "in process",
        )

    def stop(self, grace: float = 5.0) -> None:
        set_serving(self.health, [SERVICE_NAME], False)
        self.server.stop(grace).wait()
        self.channel.close()
        self.decoder.close()
        self.metrics.close()

    # ---- used by the streams -------------------------------------------------------------------------

    def encode_prompt(self, prompt: str) -> torch.Tensor:
        try:
            return self.encoder.encode(prompt)
        except ValueError as exc:
            raise ConfigError("prompt", str(exc).removeprefix("prompt ")) from None

    def reserve(self) -> bool:
        with self.cond:
            if len(self.streams) + self.reserved >= self.opts.max_streams:
                return False
            self.reserved += 1
            return True

    def unreserve(self) -> None:
        with self.cond:
            self.reserved -= 1

    def register(self, run: StreamRun) -> None:
        with self.cond:
            self.reserved -= 1
            self.streams[run.id] = run
            self.started += 1
            self._changed()

    def forget(self, run: StreamRun) -> None:
        """The stream's pipeline side and VAE state are gone: it no longer counts against the limit."""
        with self.cond:
            if self.streams.pop(run.id, None) is None:
                return
            reason = run.outcome or "unknown"
            self.finished += 1
            self.ended_by_reason[reason] += 1
            self._changed()
        self.metrics.stream_ended(reason)
        logger.info("stream %s finished: %s, %d frames", run.id, reason, run.frames_emitted)

    def touch(self) -> None:
        with self.cond:
            self._changed()

    def _changed(self) -> None:
        self.version += 1
        self.cond.notify_all()

    # ---- status ------------------------------------------------------------------------------------

    def _runs(self) -> list[StreamRun]:
        with self.cond:
            return list(self.streams.values())

    def vae_state_bytes(self) -> int:
        return sum(_vae_bytes(run) for run in self._runs())

    def status(self) -> pb.GatewayStatus:
        with self.cond:
            runs = list(self.streams.values())
            msg = pb.GatewayStatus(
                active_streams=len(runs),
                max_streams=self.opts.max_streams,
                streams_started=self.started,
                streams_finished=self.finished,
                ended_by_reason=dict(self.ended_by_reason),
                coordinator=self.opts.coordinator,
            )
        for run in runs:
            msg.streams.add(
                stream_id=run.id,
                pipeline_stream_id=run.pipeline_id,
                state=run.state,
                frames_sent=run.frames_sent,
                chunks_received=run.chunks_received,
                vae_state_bytes=_vae_bytes(run),
                queued_chunks=run.session.queued if run.session is not None else 0,
                queued_messages=len(run.out),
            )
        msg.vae_state_bytes = sum(s.vae_state_bytes for s in msg.streams)
        return msg


def _vae_bytes(run: StreamRun) -> int:
    session = run.session
    return 0 if session is None else session.state_bytes


class StreamServicer(pb_grpc.StreamServiceServicer):
    def __init__(self, gw: Gateway):
        self.gw = gw

    def Generate(self, request_iterator, context):
        with telemetry.server_span(f"{SERVICE_NAME}/Generate", context, target=self.gw.address) as span:
            yield from self._generate(request_iterator, context, span)

    def _generate(self, request_iterator, context, rpc_span):
        t0 = time.monotonic()
        gw = self.gw
        try:
            first = next(request_iterator)
        except StopIteration:
            self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, "config: the client sent no message; send a config")
        kind = first.WhichOneof("msg")
        if kind != "config":
            self._abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"config: the first message must be a config, got {kind or 'an empty message'}",
            )
        try:
            cfg = resolve_config(first.config, defaults=gw.defaults, model=gw.model)
        except ConfigError as exc:
            self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if not gw.reserve():
            self._abort(
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"too many streams: this gateway serves at most {gw.opts.max_streams} at once (--max-streams)",
            )
        run = self._open(cfg, context, t0, rpc_span)
        gw.register(run)
        if not context.add_callback(run.on_rpc_done):
            run.on_rpc_done()  # the client left while we were opening
        run.start(request_iterator)
        logger.info(
            "stream %s (pipeline %d): %dx%d, %s frames, codec %s",
            run.id,
            run.pipeline_id,
            cfg.width,
            cfg.height,
            cfg.total_frames or "unbounded",
            cfg.codec,
        )
        try:
            yield from run.messages()
        except StreamFailed as exc:
            self._abort(context, exc.code, exc.message)

    def _open(self, cfg, context, t0: float, rpc_span=None) -> StreamRun:
        """Encode the prompt and open the pipeline stream; on failure free the reserved slot and end the call."""
        gw = self.gw
        try:
            run = StreamRun(gw, cfg, gw.encode_prompt(cfg.prompt), context, t0, parent_span=rpc_span)
            run.open_pipeline()
            return run
        except ConfigError as exc:
            code, message = grpc.StatusCode.INVALID_ARGUMENT, str(exc)
        except grpc.RpcError as exc:
            code, message = exc.code(), f"pipeline (coordinator {gw.opts.coordinator}): {exc.details()}"
        except StreamFailed as exc:
            code, message = exc.code, exc.message
        gw.unreserve()
        self._abort(context, code, message)

    def _abort(self, context, code: grpc.StatusCode, message: str):
        self.gw.metrics.rejected(code.name)
        logger.info("call ended with %s: %s", code.name, message)
        context.abort(code, message)

    def GetStatus(self, request, context):
        return self.gw.status()

    def WatchStatus(self, request, context):
        gw = self.gw
        done = threading.Event()

        def on_done():
            done.set()
            gw.touch()

        context.add_callback(on_done)
        seen = [-1]  # a cell, so the predicate sees the current value
        while True:
            with gw.cond:
                gw.cond.wait_for(lambda: gw.version != seen[0] or done.is_set())
                if done.is_set():
                    return
                seen[0] = gw.version
            yield gw.status()


def serve(opts: GatewayOptions, stop: threading.Event | None = None) -> None:
    telemetry.init("gateway")
    gw = Gateway(opts)
    gw.start()
    announce_ready("gateway", address=gw.address)
    stop = stop or threading.Event()
    try:
        stop.wait()
    finally:
        gw.stop()
        telemetry.shutdown()  # flush queued spans before the process ends
