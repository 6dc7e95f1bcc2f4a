"""Our entry points keep gRPC C-core's raw lines (``Handshake failed ...`` for every plaintext client of a TLS port)
out of the terminal, unless the user set ``GRPC_VERBOSITY`` themselves (``stagecast.log.quiet_grpc_core``).

Each test runs one child process that enters through the ``stagecast`` console module (``launcher.cli``), serves
TLS on loopback and dials it in plaintext, and reads the child's stderr."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.multiprocess

CHILD = textwrap.dedent(
    """
    import launcher.cli  # the console entry point's module: it sets GRPC_VERBOSITY before grpc loads
    from concurrent import futures
    import grpc
    from stagecast.security import issue, make_ca

    ca, ca_key = make_ca("test CA", days=1)
    cert, key = issue(ca, ca_key, "gateway", hosts=["localhost"], days=1)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials([(key, cert)]))
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        grpc.channel_ready_future(channel).result(timeout=2)
        print("connected")
    except grpc.FutureTimeoutError:
        print("refused")
    server.stop(None)
    """
)


def _run(env_extra: dict[str, str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "GRPC_VERBOSITY"}
    env.update(env_extra)
    return subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=60)


def test_a_plaintext_client_of_a_tls_port_leaves_no_c_core_line_on_stderr():
    done = _run({})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "refused"
    assert "Handshake failed" not in done.stderr, done.stderr


def test_a_users_own_grpc_verbosity_wins():
    done = _run({"GRPC_VERBOSITY": "INFO"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "refused"
    assert "Handshake failed" in done.stderr  # the same failure, shown because the user asked for it
