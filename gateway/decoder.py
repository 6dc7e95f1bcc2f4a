"""Where a stream's latents become frames: the StreamVAE in the gateway process, or a chain of VAE stage processes.

Usage (one session per client stream; ``gateway.stream`` drives it from two threads)::

    decoder = LocalDecoder(StreamVAE.from_folder(root / "vae"))       # or RemoteDecoder("127.0.0.1:50070")
    session = decoder.open(capacity=4)
    session.submit(tag, latents)          # producer thread; blocks while ``capacity`` chunks are queued/in flight;
                                          # ``tag`` is the caller's, with the chunk number as ``tag.index``
    session.finish()                      # no more chunks: results() ends after the last one
    for tag, frames in session.results(): # consumer thread; frames (n, H, W, 3) uint8, in submit order
        ...
    session.abort()                       # from any thread: stop taking chunks, drop what is queued
    session.close()                       # consumer thread, last: frees the stream's VAE cache (remote: waits
                                          # until every stage has freed it)

Both are exact: ``gateway.stream_vae`` decodes chunk by chunk bit-identically however the decoder is cut.
"""

from __future__ import annotations

import logging
import queue
import threading

import grpc
import numpy as np
import torch

from gateway.channel import CLOSED, BoundedChannel
from gateway.stream_vae import StreamVAE, to_uint8_frames
from stagecast import wire
from stagecast.grpc_util import CHANNEL_OPTIONS
from stagecast.internal.v1 import vae_pb2 as vpb
from stagecast.internal.v1 import vae_pb2_grpc as vpb_grpc

logger = logging.getLogger(__name__)

_DONE = object()


class LocalDecoder:
    def __init__(self, vae: StreamVAE):
        self.vae = vae

    def open(self, capacity: int) -> LocalSession:
        return LocalSession(self.vae, capacity)

    def close(self) -> None:
        pass


class LocalSession:
    """Latents wait in a bounded queue; ``results()`` decodes them in the consumer's thread."""

    def __init__(self, vae: StreamVAE, capacity: int):
        self.vae = vae
        self.state = vae.new_state()
        self.inbox = BoundedChannel(capacity)

    def submit(self, tag, latents: torch.Tensor) -> bool:
        return self.inbox.put((tag, latents))

    def finish(self) -> None:
        self.inbox.close()

    def abort(self) -> None:
        self.inbox.close(drop=True)

    def results(self):
        while (item := self.inbox.get()) is not CLOSED:
            tag, latents = item
            yield tag, to_uint8_frames(self.vae.decode_chunk(self.state, latents)).cpu().numpy()

    def close(self) -> None:
        self.abort()
        self.vae.release(self.state)

    @property
    def queued(self) -> int:
        return len(self.inbox)

    @property
    def state_bytes(self) -> int:
        return 0 if self.state.released else self.state.approx_bytes


class RemoteDecoder:
    """The first of a chain of ``stagecast vae-stage`` processes."""

    def __init__(self, address: str, drain_timeout: float = 30.0):
        self.address = address
        self.drain_timeout = drain_timeout
        self.channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        self.stub = vpb_grpc.VAEStageServiceStub(self.channel)

    def open(self, capacity: int) -> RemoteSession:
        return RemoteSession(self, capacity)

    def close(self) -> None:
        self.channel.close()


class RemoteSession:
    """One Decode call; up to ``capacity`` chunks in flight through the chain, so its stages work concurrently."""

    def __init__(self, decoder: RemoteDecoder, capacity: int):
        self.decoder = decoder
        self.inflight = BoundedChannel(capacity)  # tags of the chunks sent and not yet answered, in order
        self.requests: queue.Queue = queue.Queue()
        self.call = decoder.stub.Decode(self._requests())
        self._finished = False
        self._lock = threading.Lock()

    def _requests(self):
        while (msg := self.requests.get()) is not _DONE:
            yield msg

    def submit(self, tag, latents: torch.Tensor) -> bool:
        if not self.inflight.put(tag):
            return False
        self.requests.put(vpb.VAEChunk(chunk=tag.index, data=wire.tensor_to_proto(latents)))
        return True

    def finish(self) -> None:
        with self._lock:
            if self._finished:
                return
            self._finished = True
        self.requests.put(_DONE)  # half-close: the stages answer what they have, free the state and end the call

    def abort(self) -> None:
        self.inflight.close()  # a blocked submit returns False; tags already sent still pair with their replies
        self.finish()

    def results(self):
        try:
            for reply in self.call:
                tag = self.inflight.get()
                yield tag, np.asarray(wire.tensor_from_proto(reply.data))
        except grpc.RpcError as exc:
            raise RuntimeError(f"VAE stage {self.decoder.address}: {exc.code().name}: {exc.details()}") from None

    def close(self) -> None:
        """End the call the graceful way, so that when this returns every stage has released the stream's state."""
        self.abort()
        timer = threading.Timer(self.decoder.drain_timeout, self.call.cancel)
        timer.daemon = True
        timer.start()
        try:
            for _ in self.results():
                pass
        except RuntimeError as exc:
            logger.debug("draining a VAE stage call: %s", exc)
        finally:
            timer.cancel()

    @property
    def queued(self) -> int:
        return len(self.inflight)

    @property
    def state_bytes(self) -> int:
        return 0  # held by the VAE stages; see their Describe
