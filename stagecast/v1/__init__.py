"""``stagecast.v1`` is ``stagecast_client.v1``, the public API's generated code (proto/stagecast/v1/stream.proto),
which lives in the client distribution (clients/python).  One module under both names: ``stream.proto`` is registered
once in the descriptor pool, whichever name imports it first."""

import sys

import stagecast_client.v1
import stagecast_client.v1.stream_pb2
import stagecast_client.v1.stream_pb2_grpc

sys.modules[__name__] = stagecast_client.v1
for _name in ("stream_pb2", "stream_pb2_grpc"):
    sys.modules[f"{__name__}.{_name}"] = sys.modules[f"stagecast_client.v1.{_name}"]
