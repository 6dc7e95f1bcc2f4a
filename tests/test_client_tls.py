"""TLS to the gateway from the SDK and the CLI: ``tls_name`` / ``--tls-name`` verifies a certificate that does not name
the address dialled, and a connection whose security does not match the gateway's says so and what to pass.

Each test serves ``StreamService.GetStatus`` in process on loopback, over TLS or plaintext."""

from __future__ import annotations

import argparse
from concurrent import futures

import grpc
import pytest

from stagecast.client import Client
from stagecast.errors import UnavailableError
from stagecast.security import issue, make_ca
from stagecast.v1 import stream_pb2 as pb
from stagecast.v1 import stream_pb2_grpc as pb_grpc


class _Status(pb_grpc.StreamServiceServicer):
    def GetStatus(self, request, context):
        return pb.GatewayStatus(max_streams=3)


@pytest.fixture(scope="module")
def ca_and_cert():
    ca, ca_key = make_ca("test gateway CA", days=1)
    cert, key = issue(ca, ca_key, "gateway", hosts=["gw.example.com"], days=1)
    return ca, cert, key


def _serve(cert_and_key=None):
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_StreamServiceServicer_to_server(_Status(), server)
    if cert_and_key:
        port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials([cert_and_key[::-1]]))
    else:
        port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


@pytest.fixture
def tls_gateway(ca_and_cert):
    _, cert, key = ca_and_cert
    server, target = _serve((cert, key))
    yield target
    server.stop(None)


@pytest.fixture
def plain_gateway():
    server, target = _serve()
    yield target
    server.stop(None)


@pytest.mark.unit
def test_tls_name_verifies_a_certificate_that_names_another_host(tls_gateway, ca_and_cert):
    ca = ca_and_cert[0]
    with Client(tls_gateway, root_certificates=ca, tls_name="gw.example.com") as client:
        assert client.status(timeout=10).max_streams == 3


@pytest.mark.unit
def test_without_tls_name_the_hostname_mismatch_is_explained(tls_gateway, ca_and_cert):
    with Client(tls_gateway, root_certificates=ca_and_cert[0]) as client:
        with pytest.raises(UnavailableError) as info:
            client.status(timeout=10)
    assert "does not name the address dialled" in info.value.details and "--tls-name" in info.value.details
    # gRPC's own words stay, after the explanation
    assert "Hostname Verification Check failed" in info.value.details


@pytest.mark.unit
def test_a_plaintext_client_of_a_tls_gateway_is_told_to_pass_tls(tls_gateway):
    with Client(tls_gateway) as client:
        with pytest.raises(UnavailableError) as info:
            client.status(timeout=10)
    assert "pass --tls-ca or --tls" in info.value.details


@pytest.mark.unit
def test_a_tls_client_of_a_plaintext_gateway_is_told_it_does_not_speak_tls(plain_gateway, ca_and_cert):
    with Client(plain_gateway, root_certificates=ca_and_cert[0]) as client:
        with pytest.raises(UnavailableError) as info:
            client.status(timeout=10)
    assert "the gateway does not speak TLS" in info.value.details


@pytest.mark.unit
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tls_name": "gw.example.com"}, "tls_name: needs TLS"),
        ({"tls": True, "tls_name": "two words"}, "tls_name: a DNS name or IP"),
        ({"tls": True, "tls_name": "a" * 254}, "tls_name: a DNS name or IP"),
    ],
)
def test_a_bad_tls_name_is_refused_naming_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Client("127.0.0.1:1", **kwargs)


def _cli(command: str, argv: list[str]) -> argparse.Namespace:
    from stagecast import generate, transform

    parser = argparse.ArgumentParser(prog="stagecast")
    sub = parser.add_subparsers()
    {"generate": generate, "transform": transform}[command].add_parser(sub)
    return parser.parse_args([command, *argv])


@pytest.mark.unit
def test_generate_without_tls_ca_against_a_tls_gateway_prints_what_to_pass(tls_gateway, tmp_path, capsys):
    args = _cli(
        "generate", ["--target", tls_gateway, "--prompt", "x", "--out", str(tmp_path / "c.mp4"), "--timeout", "10"]
    )
    assert args.run(args) == 1
    err = capsys.readouterr().err
    assert err.startswith("stagecast generate: UNAVAILABLE: ") and "pass --tls-ca or --tls" in err


@pytest.mark.unit
def test_generate_and_transform_take_tls_name(tls_gateway, ca_and_cert, tmp_path, capsys):
    ca_file = tmp_path / "ca.crt"
    ca_file.write_bytes(ca_and_cert[0])
    common = ["--target", tls_gateway, "--tls-ca", str(ca_file), "--tls-name", "gw.example.com"]
    args = _cli("generate", [*common, "--prompt", "x", "--out", str(tmp_path / "c.mp4"), "--timeout", "10"])
    assert args.tls_name == "gw.example.com"
    # The handshake passes with the name; the test server serves only GetStatus, so the stream is UNIMPLEMENTED.
    assert args.run(args) == 1
    assert "UNIMPLEMENTED" in capsys.readouterr().err
    plain = _cli("generate", ["--target", tls_gateway, "--tls-name", "gw.example.com", "--prompt", "x"])
    assert plain.run(plain) == 2
    assert "stagecast generate: error: tls_name: needs TLS" in capsys.readouterr().err
    tr = _cli("transform", [*common, "--input", "in.mp4", "--prompt", "x"])
    assert tr.tls_name == "gw.example.com"
