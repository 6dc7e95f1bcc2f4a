"""``GrpcStore``: a torch.distributed Store over the coordinator's authenticated gRPC port.

Usage::

    store = GrpcStore(channel, timeout_s=300)            # channel: mTLS to the coordinator (stagecast.security)
    dist.init_process_group("gloo", store=dist.PrefixStore("stagecast/gen3", store), rank=r, world_size=n)

gloo and NCCL exchange their connection details through the store (set / get / wait / add / compare_set); the
coordinator's ``coordinator.rendezvous`` keeps them.  Only holders of a deployment certificate may read or
write, so no stranger can join a group or learn or replace a peer's address.
"""

from __future__ import annotations

import datetime
import time

import grpc
import torch.distributed as dist

from stagecast.internal.v1 import rendezvous_pb2 as pb
from stagecast.internal.v1 import rendezvous_pb2_grpc as pb_grpc

SLICE_MS = 10_000  # one server-side wait; the client repeats until its own timeout


def _bytes(value) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


class GrpcStore(dist.Store):
    def __init__(self, channel: grpc.Channel, timeout_s: float = 300.0):
        super().__init__()
        self.stub = pb_grpc.RendezvousServiceStub(channel)
        self._timeout_s = timeout_s

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._timeout_s = timeout.total_seconds()

    def _call(self, method, request, deadline_s: float = 30.0, waiting: bool = False):
        try:
            return method(request, timeout=deadline_s, wait_for_ready=True)
        except grpc.RpcError as exc:
            if waiting and exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise  # one slice of a wait ran out: _wait_keys repeats it
            raise RuntimeError(f"rendezvous store: {exc.code().name}: {exc.details()}") from None

    def _wait_keys(self, method, keys: list[str], timeout_s: float | None):
        total = self._timeout_s if timeout_s is None else timeout_s
        end = time.monotonic() + total
        while True:
            left_ms = int((end - time.monotonic()) * 1000)
            if left_ms <= 0:
                raise TimeoutError(f"rendezvous: keys {keys} not set within {total:.0f}s")
            try:
                request = pb.StoreKeys(keys=keys, timeout_ms=min(left_ms, SLICE_MS))
                return self._call(method, request, deadline_s=SLICE_MS / 1000 + 15, waiting=True)
            except grpc.RpcError:
                continue  # this slice of the wait ran out; the loop checks the overall timeout

    def set(self, key, value) -> None:
        self._call(self.stub.Set, pb.StoreSet(key=key, value=_bytes(value)))

    def get(self, key) -> bytes:
        return self._wait_keys(self.stub.Get, [key], None).value

    def add(self, key, amount) -> int:
        return self._call(self.stub.Add, pb.StoreAdd(key=key, amount=int(amount))).number

    def compare_set(self, key, expected, desired) -> bytes:
        reply = self._call(
            self.stub.CompareSet, pb.StoreCompareSet(key=key, expected=_bytes(expected), desired=_bytes(desired))
        )
        return reply.value

    def wait(self, keys, timeout=None) -> None:
        seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
        self._wait_keys(self.stub.Wait, list(keys), seconds)

    def check(self, keys) -> bool:
        return self._call(self.stub.Check, pb.StoreKeys(keys=list(keys))).found

    def delete_key(self, key) -> bool:
        return self._call(self.stub.DeleteKey, pb.StoreKeys(keys=[key])).found

    def num_keys(self) -> int:
        return self._call(self.stub.NumKeys, pb.StoreKeys()).number
