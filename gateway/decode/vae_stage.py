"""A VAE decoder stage process: one slice of the Wan VAE decoder, chained to the next stage.

Run the chain from its end (each stage needs the next one's address), then point the gateway at its head::

    stagecast vae-stage --checkpoint DIR --index 1 --num-slices 2 --port 50071
    stagecast vae-stage --checkpoint DIR --index 0 --num-slices 2 --port 50070 --next 127.0.0.1:50071
    stagecast gateway ... --vae-stage 127.0.0.1:50070

Every stage cuts the decoder the same way (``decoder_cut``: balanced by measured multiply-accumulates, a pure
function of the architecture) and keeps its own slice.  One ``Decode`` call per client stream: the stage decodes
each chunk with its slice and the stream's cache slots, and forwards the result on its own call to the next stage,
so a stream's consecutive chunks are in different stages at once.  The last stage returns uint8 frames.  A stream's
state lives exactly as long as its call, and is released before the call ends.
"""

from __future__ import annotations

if __name__ == "__main__":  # python -m gateway.decode.vae_stage: the VAE stage service as itself (stagecast vae-stage)
    # Dispatched before this module's imports: ``service_main`` exits, and serving imports ``gateway.decode.vae_stage``
    # as
    # a module (``gateway.cli``), so ``--help`` or a flag error does not import torch and diffusers first, and the
    # module's body runs once rather than as ``__main__`` and again as itself.
    from stagecast.service import service_main

    service_main("vae-stage")

import logging
import threading
from pathlib import Path

import grpc
import torch

from gateway.decode.stream_vae import StreamVAE, StreamVAESlice, decoder_cut, to_uint8_frames, use_cudnn_autotune
from gateway.decode.vae_graphs import capture_graphs, default_capture
from gateway.options import VAEStageOptions
from stagecast import wire
from stagecast.grpc_util import CHANNEL_OPTIONS, make_server, serve_health, set_serving
from stagecast.internal.v1 import vae_pb2 as vpb
from stagecast.internal.v1 import vae_pb2_grpc as vpb_grpc
from stagecast.model import vae_configs
from stagecast.names import DTYPES, VAE_STAGE_SERVICE
from stagecast.security import RoleGuard, connect
from stagecast.service import serve_lifecycle

logger = logging.getLogger(__name__)

SERVICE_NAME = VAE_STAGE_SERVICE
ROLE_RULES = {f"/{SERVICE_NAME}/": ["gateway", "vae-stage"]}  # the gateway, or the previous slice of the chain


class VAEStageServicer(vpb_grpc.VAEStageServiceServicer):
    def __init__(self, opts: VAEStageOptions):
        folder = Path(opts.checkpoint)
        folder = folder / "vae" if (folder / "vae").is_dir() else folder
        if opts.cudnn_benchmark:
            use_cudnn_autotune([opts.device])
        vae = StreamVAE.from_folder(folder, dtype=DTYPES[opts.dtype], device=opts.device).vae
        edges = decoder_cut(vae, opts.num_slices)
        if not 0 <= opts.index < opts.num_slices:
            raise ValueError(f"--index {opts.index} is not a slice of {opts.num_slices} (0..{opts.num_slices - 1})")
        self.slice = StreamVAESlice(vae, edges[opts.index], edges[opts.index + 1])
        self.opts = opts
        if opts.cuda_graphs is not None:
            self._capture_graphs(vae, opts.cuda_graphs, opts.graph_slots)
        self.is_last = self.slice.gives_video
        if self.is_last != (opts.next is None):
            raise ValueError(f"stage {opts.index} of {opts.num_slices}: --next is needed by every stage but the last")
        self.next_stub = None
        if opts.next:
            self.next_channel = connect(opts.next, opts.mtls, "vae-stage", CHANNEL_OPTIONS)
            self.next_stub = vpb_grpc.VAEStageServiceStub(self.next_channel)
        self.lock = threading.Lock()
        self.states: dict[int, object] = {}
        logger.info(
            "VAE stage %d/%d: decoder units [%d, %d), next %s",
            opts.index,
            opts.num_slices,
            self.slice.start,
            self.slice.stop,
            opts.next or "(last: frames go back)",
        )

    def _capture_graphs(self, vae, size: tuple[int, int], slots: int) -> None:
        """Graph slots for this slice; a scratch prefix of the decoder (units before this slice, run eagerly here
        once) gives the slice's inputs for the probe stream."""
        sf = vae_configs.spatial_factor(vae.config)
        if size[0] <= 0 or size[1] <= 0 or size[0] % sf or size[1] % sf:
            raise ValueError(f"--cuda-graphs {size[0]}x{size[1]}: height and width must be positive multiples of {sf}")
        chain = ([StreamVAESlice(vae, 0, self.slice.start)] if self.slice.start else []) + [self.slice]
        capture_graphs(
            chain,
            latent_hw=(size[0] // sf, size[1] // sf),
            slots=slots,
            capture_for=default_capture,
            targets=[len(chain) - 1],
        )

    def Decode(self, request_iterator, context):
        state = self.slice.new_state()
        with self.lock:
            self.states[id(state)] = state
        try:
            if self.next_stub is None:
                for req in request_iterator:
                    frames = to_uint8_frames(self._decode(state, req))
                    yield vpb.VAEChunk(chunk=req.chunk, data=wire.tensor_to_proto(frames))
            else:
                downstream = self.next_stub.Decode(self._forward(state, request_iterator))
                context.add_callback(downstream.cancel)  # our caller left: so does the rest of the chain
                yield from downstream  # ends after every later stage released the stream's state
        except grpc.RpcError as exc:
            context.abort(exc.code(), f"VAE stage {self.opts.index + 1}: {exc.details()}")
        finally:
            self.slice.release(state)
            with self.lock:
                self.states.pop(id(state), None)

    def _forward(self, state, request_iterator):
        for req in request_iterator:
            yield vpb.VAEChunk(chunk=req.chunk, data=wire.tensor_to_proto(self._decode(state, req)))

    def _decode(self, state, req: vpb.VAEChunk) -> torch.Tensor:
        return self.slice.decode_chunk(state, wire.tensor_from_proto(req.data))

    def Describe(self, request, context):
        with self.lock:
            states = list(self.states.values())
        return vpb.VAEStageDescription(
            index=self.opts.index,
            num_slices=self.opts.num_slices,
            unit_start=self.slice.start,
            unit_stop=self.slice.stop,
            next=self.opts.next or "",
            open_streams=len(states),
            state_bytes=sum(s.approx_bytes for s in states if not s.released),
            device=self.opts.device,
        )


def serve(opts: VAEStageOptions, stop: threading.Event | None = None) -> None:
    servicer = VAEStageServicer(opts)
    server, health, port = make_server(
        opts.port,
        [(vpb_grpc.add_VAEStageServiceServicer_to_server, servicer, SERVICE_NAME)],
        host=opts.host,
        credentials=opts.mtls.server_credentials() if opts.mtls else None,
        interceptors=[RoleGuard(ROLE_RULES)] if opts.mtls else [],
    )
    probes = []

    def start() -> dict:
        server.start()
        probes.append(serve_health(health, opts.host, opts.health_port))
        set_serving(health, [SERVICE_NAME], True)
        host = "127.0.0.1" if opts.host == "0.0.0.0" else opts.host
        return {"vae_stage": opts.index, "address": f"{host}:{port}"}

    def shutdown() -> None:
        server.stop(2).wait()
        for probe in probes:
            if probe is not None:
                probe.stop(0)

    serve_lifecycle("vae-stage", start, shutdown, stop)
