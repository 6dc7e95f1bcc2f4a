"""Every stagecast server answers gRPC reflection in both protocol versions: v1 (what grpcurl and Postman ask first)
and v1alpha, with the same services and the same descriptors.  In process, on loopback."""

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2 as rpb

from stagecast.grpc_util import make_server
from stagecast.v1 import stream_pb2_grpc as pb_grpc

SERVICE = "stagecast.v1.StreamService"


@pytest.fixture
def server():
    server, _, port = make_server(
        0, [(pb_grpc.add_StreamServiceServicer_to_server, pb_grpc.StreamServiceServicer(), SERVICE)]
    )
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(None)


def _ask(target: str, version: str, request: rpb.ServerReflectionRequest) -> rpb.ServerReflectionResponse:
    with grpc.insecure_channel(target) as channel:
        call = channel.stream_stream(
            f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
            request_serializer=rpb.ServerReflectionRequest.SerializeToString,
            response_deserializer=rpb.ServerReflectionResponse.FromString,
        )
        (reply,) = list(call(iter([request]), timeout=10))
    return reply


@pytest.mark.unit
@pytest.mark.parametrize("version", ["v1", "v1alpha"])
def test_reflection_lists_the_services_and_describes_them_in_both_versions(server, version):
    listed = _ask(server, version, rpb.ServerReflectionRequest(list_services=""))
    names = {s.name for s in listed.list_services_response.service}
    assert {SERVICE, "grpc.reflection.v1.ServerReflection", "grpc.reflection.v1alpha.ServerReflection"} <= names
    described = _ask(server, version, rpb.ServerReflectionRequest(file_containing_symbol=SERVICE))
    assert described.file_descriptor_response.file_descriptor_proto, described
