"""The public ``stagecast.v1.StreamService`` handlers: each takes the request's bytes and parses them.

Usage (``gateway.service.Gateway`` builds its server with these)::

    servicer = StreamServicer(gateway.stream_parts())   # StreamParts: what it needs of the gateway, no more
    make_server(port, [(add_stream_service, servicer, SERVICE_NAME)], ...)

``Generate`` waits for its config within a bounded budget of pending calls (each client within its quota), resolves
and admits the config, encodes the prompt, opens the pipeline stream (``gateway.stream.run.StreamRun``) and yields its
messages; every refusal ends the call with a gRPC status (``_abort``) and counts in the rejected-calls metric.
``GetStatus`` and ``WatchStatus`` report ``gateway.edge.status.StatusReport`` as the caller may see it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

from gateway.edge.admission import Refused
from gateway.edge.config import (
    MAX_REQUEST_BYTES,
    ConfigError,
    Decoders,
    RequestTooLarge,
    parse_client_message,
    parse_status_request,
    resolve_config,
)
from gateway.edge.revocation import credentials_of
from gateway.stream.run import StreamFailed, StreamRun, release_hold, reserve
from stagecast import telemetry
from stagecast.fair_pool import PoolFull
from stagecast.grpc_util import abort_with_retry, retry_after_of
from stagecast.names import STREAM_SERVICE
from stagecast.security import principal_of
from stagecast.v1 import stream_pb2 as pb

if TYPE_CHECKING:
    import torch

    from gateway.checkpoint import ModelInfo, ServingDefaults
    from gateway.edge.client_identity import ClientIdentity
    from gateway.edge.status import StatusReport
    from gateway.edge.stream_table import StreamTable
    from gateway.metrics import GatewayMetrics
    from gateway.stream.run import StreamHost
    from stagecast.security import TokenAuth

logger = logging.getLogger(__name__)

SERVICE_NAME = STREAM_SERVICE


PIPELINE_TRAILER = "stagecast-pipeline"  # a refusal's trailing metadata: the pipeline's --pipeline-name
_TIMED_OUT = object()
_NO_MESSAGE = object()
_EVICTED = object()  # the call gave its place in the full pending pool to another client's


def _read_first(request_iterator, box: queue.SimpleQueue) -> None:
    """Reads the first request (bytes) into ``box`` in a thread of its own, so that the handler can stop waiting."""
    try:
        box.put(next(request_iterator))
    except StopIteration:
        box.put(_NO_MESSAGE)
    except Exception as exc:  # the call ended (cancelled, or aborted when its deadline passed)
        box.put(exc)


def _parsed(request_iterator):
    """The call's later requests as ClientMessages; raises ``ConfigError`` at bytes that are not one and
    ``RequestTooLarge`` at a message other than an input frame over ``MAX_REQUEST_BYTES`` (the server's own limit
    leaves room for a raw frame)."""
    for data in request_iterator:
        msg = parse_client_message(data)
        if len(data) > MAX_REQUEST_BYTES and msg.WhichOneof("msg") != "frame":
            raise RequestTooLarge(
                "request", f"{len(data)} bytes; a message other than an input frame is at most {MAX_REQUEST_BYTES}"
            )
        yield msg


def add_stream_service(servicer: StreamServicer, server: grpc.Server) -> None:
    """Registers StreamService with handlers that take the request bytes (``request_deserializer=None``) and parse
    them: a sync grpc server answers INTERNAL (and logs a traceback) for bytes its deserializer cannot decode."""
    handlers = {
        "Generate": grpc.stream_stream_rpc_method_handler(
            servicer.Generate, response_serializer=pb.ServerMessage.SerializeToString
        ),
        "GetStatus": grpc.unary_unary_rpc_method_handler(
            servicer.GetStatus, response_serializer=pb.GatewayStatus.SerializeToString
        ),
        "WatchStatus": grpc.unary_stream_rpc_method_handler(
            servicer.WatchStatus, response_serializer=pb.GatewayStatus.SerializeToString
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))


@dataclass(frozen=True)
class StreamParts:
    """What the public StreamService needs of its gateway, and nothing more (``gateway.service.Gateway.stream_parts``
    builds it once the models are loaded)."""

    table: StreamTable  # admission, the streams, the calls waiting for their config
    identity: ClientIdentity  # whose quotas a call counts against
    report: StatusReport  # GetStatus / WatchStatus
    stream_host: StreamHost  # what each StreamRun is given
    metrics: GatewayMetrics
    auth: TokenAuth | None  # --tokens
    defaults: ServingDefaults  # the checkpoint's serving defaults (resolve_config)
    model: ModelInfo
    decoders: Decoders  # the decoders this gateway serves (resolve_config checks a stream's)
    encode_prompt: Callable[..., torch.Tensor]  # (prompt, parent_span=..., field=..., paced=...) -> embeddings
    address: str  # where the public server answers (the span's target)
    pipeline_name: str  # --pipeline-name ("" outside a fleet): in a refusal's trailers and the spans
    coordinator: str  # --coordinator, named in a pipeline error
    config_timeout: float  # --config-timeout
    max_pending: int  # --max-pending
    text_shape: tuple[int, ...]  # (1, tokens, width) of a prompt's embeddings: what the coordinator's Reserve checks


class StreamServicer:
    """``stagecast.v1.StreamService``; every method takes the request's bytes (see ``add_stream_service``)."""

    def __init__(self, parts: StreamParts):
        self.parts = parts

    def Generate(self, request_iterator, context):
        with telemetry.server_span(f"{SERVICE_NAME}/Generate", context, target=self.parts.address) as span:
            if span is not None and self.parts.pipeline_name:
                span.set_attribute("stagecast.pipeline", self.parts.pipeline_name)  # which pipeline of a fleet
            yield from self._generate(request_iterator, context, span)

    def _first_message(self, request_iterator, context) -> pb.ClientMessage | None:
        """The call's first message, parsed; ends the call if none comes in time (None: the client already left)."""
        gw = self.parts
        box: queue.SimpleQueue = queue.SimpleQueue()
        waited = time.monotonic()
        try:  # the client's quota, then the pool (full: fair eviction, stagecast.fair_pool)
            entry = gw.table.enter_pending(gw.identity.of(context), on_evict=lambda: box.put(_EVICTED))
        except PoolFull as exc:
            self._abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, f"{exc}; send the config as the first message")
        try:
            threading.Thread(target=_read_first, args=(request_iterator, box), daemon=True, name="config").start()
            try:
                first = box.get(timeout=gw.config_timeout)
            except queue.Empty:
                first = _TIMED_OUT
        finally:
            gw.table.leave_pending(entry)
        if first is _EVICTED:
            self._abort(
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"config: none arrived in {time.monotonic() - waited:.1f} s, and this call's place went to another "
                f"client's (the {gw.max_pending} calls waiting for their config were full: --max-pending); send "
                "the config as the first message",
            )
        if first is _TIMED_OUT:
            self._abort(
                context,
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"config: none arrived within {gw.config_timeout:g} s of the call's start (--config-timeout)",
            )
        if first is _NO_MESSAGE:
            self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, "config: the client sent no message; send a config")
        if isinstance(first, Exception):
            logger.debug("call ended before its config: %s", first)
            return None
        try:
            msg = parse_client_message(first)
        except ConfigError as exc:
            if len(first) > MAX_REQUEST_BYTES:
                self._abort(
                    context, grpc.StatusCode.RESOURCE_EXHAUSTED, f"request: {len(first)} bytes that are not a config"
                )
            self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        # A config is at most MAX_REQUEST_BYTES besides its first-frame image (bounded by the server's own limit).
        if len(first) - len(msg.config.image) > MAX_REQUEST_BYTES:
            self._abort(
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"request: {len(first)} bytes; a config is at most {MAX_REQUEST_BYTES} besides its image",
            )
        return msg

    def _generate(self, request_iterator, context, rpc_span):
        t0 = time.monotonic()
        gw = self.parts
        first = self._first_message(request_iterator, context)
        if first is None:
            return
        kind = first.WhichOneof("msg")
        if kind != "config":
            self._abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"config: the first message must be a config, got {kind or 'an empty message'}",
            )
        try:
            cfg = resolve_config(first.config, defaults=gw.defaults, model=gw.model, decoders=gw.decoders)
        except ConfigError as exc:
            self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        try:
            release = gw.table.admit(cfg, gw.identity.of(context))
        except Refused as exc:
            self._abort(context, exc.code, exc.message)
        run = self._open(cfg, context, t0, rpc_span, release)
        run.tenant = principal_of(gw.auth, context).tenant  # whose stream: status shows it to its tenant only
        run.credentials = credentials_of(context) if gw.auth else None  # checked again while it runs (revocation)
        run.via_door = gw.identity.via_proxy(context)
        gw.table.register(run, release)
        if not context.add_callback(run.on_rpc_done):
            run.on_rpc_done()  # the client left while we were opening
        run.start(_parsed(request_iterator))
        logger.info(
            "stream %s (pipeline %d): %dx%d, %s frames, codec %s, %s decoder",
            run.id,
            run.pipeline_id,
            cfg.width,
            cfg.height,
            cfg.total_frames or "unbounded",
            cfg.codec,
            cfg.decoder,
        )
        try:
            yield from run.messages()
        except StreamFailed as exc:
            self._abort(context, exc.code, exc.message)

    def _open(self, cfg, context, t0: float, rpc_span, release) -> StreamRun:
        """Encode the prompt and open the pipeline stream; on failure give back what admission took and end the call."""
        gw = self.parts
        retry_after = None  # a capacity refusal's retry delay, from the coordinator's status details
        hold = ""
        try:
            # Admission first, from the coordinator's arithmetic: a refusal never waits on the prompt's encode.
            hold = reserve(cfg, gw.stream_host, gw.text_shape)
            text = gw.encode_prompt(cfg.prompt, parent_span=rpc_span, paced=cfg.pace)
            negative = None
            if cfg.guidance_scale > 1.0:
                negative = gw.encode_prompt(
                    cfg.negative_prompt, parent_span=rpc_span, field="negative_prompt", paced=cfg.pace
                )
            run = StreamRun(gw.stream_host, cfg, text, context, t0, parent_span=rpc_span, negative_text=negative)
            run.open_pipeline(hold)
            return run
        except ConfigError as exc:
            code, message = grpc.StatusCode.INVALID_ARGUMENT, str(exc)
        except grpc.RpcError as exc:
            code, message = exc.code(), f"pipeline (coordinator {gw.coordinator}): {exc.details()}"
            retry_after = retry_after_of(exc)  # a capacity refusal's retry delay reaches the client
        except StreamFailed as exc:
            code, message = exc.code, exc.message
        if hold:
            release_hold(gw.stream_host, hold)  # admitted, then failed before it opened: the place goes back now
        release()
        self._abort(context, code, message, retry_after)

    def _abort(self, context, code: grpc.StatusCode, message: str, retry_after: float | None = None):
        self.parts.metrics.rejected(code.name)
        logger.info("call ended with %s: %s", code.name, message)
        name = self.parts.pipeline_name  # behind a fleet's door, the refusal says which pipeline refused
        trailers = ((PIPELINE_TRAILER, name),) if name else ()
        abort_with_retry(context, code, message, retry_after or 0.0, metadata=trailers)

    def GetStatus(self, request: bytes, context):
        try:
            parse_status_request(request)
        except ConfigError as exc:
            self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        msg = self.parts.report.status(principal_of(self.parts.auth, context))
        msg.capacity.extend(self.parts.report.capacity())
        return msg

    def WatchStatus(self, request: bytes, context):
        gw = self.parts
        try:
            parse_status_request(request)
        except ConfigError as exc:
            self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        who = principal_of(gw.auth, context)
        try:
            give_back = gw.table.quotas.take("watchers", gw.identity.of(context))
        except Refused as exc:
            self._abort(context, exc.code, exc.message)
        try:
            yield from self._watch(who, context)
        finally:
            give_back()

    def _watch(self, who, context):
        gw = self.parts
        done = threading.Event()

        def on_done():
            done.set()
            gw.table.touch()

        context.add_callback(on_done)
        seen = [-1]  # a cell, so the predicate sees the current value
        table = gw.table
        while True:
            with table.cond:
                table.cond.wait_for(lambda: table.version != seen[0] or done.is_set())
                if done.is_set():
                    return
                seen[0] = table.version
            yield gw.report.status(who)
