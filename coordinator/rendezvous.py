"""The stages' rendezvous store, served by the coordinator over its authenticated gRPC port.

torch.distributed forms a process group through a key-value store.  Instead of an open TCPStore, the coordinator
keeps the keys here and serves ``stagecast.internal.v1.RendezvousService`` to stages holding a deployment
certificate; a stage reaches it through ``stage_service.rendezvous.GrpcStore``.  Keys are under one prefix per
generation (``stagecast/gen<N>/``); once a later generation writes, earlier generations' keys are dropped.

Every input has a limit: key length, value size, key count, and how long one call may wait.
"""

from __future__ import annotations

import re
import threading
import time

import grpc

from stagecast.internal.v1 import rendezvous_pb2 as pb
from stagecast.internal.v1 import rendezvous_pb2_grpc as pb_grpc
from stagecast.names import RENDEZVOUS_SERVICE

SERVICE_NAME = RENDEZVOUS_SERVICE
MAX_KEY_CHARS = 512
MAX_VALUE_BYTES = 1024 * 1024
MAX_KEYS = 16384
MAX_WAIT_MS = 30_000
_GENERATION = re.compile(r"^stagecast/gen(\d+)/")


class RendezvousServicer(pb_grpc.RendezvousServiceServicer):
    def __init__(self):
        self.cond = threading.Condition()
        self.data: dict[str, bytes] = {}
        self.generation = 0  # the latest generation that wrote a key

    # ---- checks ---------------------------------------------------------------------------------------------

    @staticmethod
    def _key(key: str, context) -> str:
        if not key:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "key: must not be empty")
        if len(key) > MAX_KEY_CHARS:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"key: longer than {MAX_KEY_CHARS} characters")
        return key

    def _keys(self, request: pb.StoreKeys, context) -> list[str]:
        if len(request.keys) > 1024:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "keys: more than 1024")
        return [self._key(k, context) for k in request.keys]

    def _store(self, key: str, value: bytes, context) -> None:
        """Write under the lock; a write of a newer generation drops the keys of older ones."""
        if len(value) > MAX_VALUE_BYTES:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"value: more than {MAX_VALUE_BYTES} bytes")
        match = _GENERATION.match(key)
        if match and int(match.group(1)) > self.generation:
            self.generation = int(match.group(1))
            old = [k for k in self.data if (m := _GENERATION.match(k)) and int(m.group(1)) < self.generation]
            for k in old:
                del self.data[k]
        if key not in self.data and len(self.data) >= MAX_KEYS:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"the rendezvous store holds {MAX_KEYS} keys already")
        self.data[key] = value
        self.cond.notify_all()

    def _wait_for(self, keys: list[str], timeout_ms: int, context) -> None:
        timeout = min(max(timeout_ms, 0), MAX_WAIT_MS) / 1000.0
        deadline = time.monotonic() + timeout
        while not all(k in self.data for k in keys):
            left = deadline - time.monotonic()
            if left <= 0 or not context.is_active():
                context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"keys not set within {timeout:.1f}s: {keys}")
            self.cond.wait(min(left, 1.0))

    # ---- the store ------------------------------------------------------------------------------------------

    def Set(self, request: pb.StoreSet, context):
        key = self._key(request.key, context)
        with self.cond:
            self._store(key, request.value, context)
        return pb.StoreReply()

    def Get(self, request: pb.StoreKeys, context):
        keys = self._keys(request, context)
        if len(keys) != 1:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "keys: Get takes exactly one key")
        with self.cond:
            self._wait_for(keys, request.timeout_ms, context)
            return pb.StoreReply(value=self.data[keys[0]])

    def Add(self, request: pb.StoreAdd, context):
        key = self._key(request.key, context)
        with self.cond:
            current = self.data.get(key, b"0")
            try:
                number = int(current.decode()) + request.amount
            except ValueError:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"key {key!r} does not hold a number")
            self._store(key, str(number).encode(), context)
            return pb.StoreReply(number=number)

    def CompareSet(self, request: pb.StoreCompareSet, context):
        key = self._key(request.key, context)
        with self.cond:
            current = self.data.get(key)
            if current is None:
                if request.expected:
                    return pb.StoreReply(value=request.expected)
                self._store(key, request.desired, context)
                return pb.StoreReply(value=request.desired)
            if current == request.expected:
                self._store(key, request.desired, context)
                return pb.StoreReply(value=request.desired)
            return pb.StoreReply(value=current)

    def Wait(self, request: pb.StoreKeys, context):
        keys = self._keys(request, context)
        with self.cond:
            self._wait_for(keys, request.timeout_ms, context)
        return pb.StoreReply()

    def Check(self, request: pb.StoreKeys, context):
        keys = self._keys(request, context)
        with self.cond:
            return pb.StoreReply(found=all(k in self.data for k in keys))

    def DeleteKey(self, request: pb.StoreKeys, context):
        keys = self._keys(request, context)
        if len(keys) != 1:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "keys: DeleteKey takes exactly one key")
        with self.cond:
            return pb.StoreReply(found=self.data.pop(keys[0], None) is not None)

    def NumKeys(self, request: pb.StoreKeys, context):
        with self.cond:
            return pb.StoreReply(number=len(self.data))
