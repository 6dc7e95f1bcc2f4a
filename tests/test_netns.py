"""Across hosts: the pipeline forms over three network namespaces, each its own "machine" with one address.

The test makes the namespaces itself (``ip netns``): A holds the coordinator and the gateway, B stage 0, C stage 1,
each joined by a veth pair to a bridge in a fourth namespace.  With mTLS on, a client in A streams a clip through the
gateway; then, in each namespace, every listening socket must sit on the address assigned to it (gRPC, metrics and
the gloo data plane alike).  Making namespaces needs root and iproute2: elsewhere the test skips and says why.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid

import pytest

from launcher.demo_checkpoint import write_demo_checkpoint
from launcher.local_cluster import stage_args
from launcher.process import Launcher
from stagecast.security import issue, make_ca
from tests.listening import listening_table

TOKEN = "netns-tenant-token-0123456789"
SUBNET = "10.231.77"
ADDRESSES = {"a": f"{SUBNET}.1", "b": f"{SUBNET}.2", "c": f"{SUBNET}.3"}
METRICS = 9400  # each namespace has its own ports: the same numbers in every one


def _why_not() -> str | None:
    if not sys.platform.startswith("linux"):
        return "network namespaces are Linux only"
    if os.geteuid() != 0:
        return "making network namespaces needs root (run as root, or in CI)"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is missing: apt-get install -y iproute2"
    probe = f"sc-probe-{uuid.uuid4().hex[:6]}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot make a network namespace here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], check=False)
    return None


WHY_NOT = _why_not()
pytestmark = [pytest.mark.multiprocess, pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@pytest.fixture
def namespaces():
    tag = uuid.uuid4().hex[:6]
    names = {key: f"sc-{tag}-{key}" for key in (*ADDRESSES, "sw")}
    try:
        for name in names.values():
            _ip("netns", "add", name)
        sw = names["sw"]
        _ip("-n", sw, "link", "add", "br0", "type", "bridge")
        _ip("-n", sw, "link", "set", "br0", "up")
        for key, address in ADDRESSES.items():
            ns = names[key]
            _ip("link", "add", "name", "eth0", "netns", ns, "type", "veth", "peer", "name", f"p-{key}", "netns", sw)
            _ip("-n", sw, "link", "set", f"p-{key}", "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield names
    finally:
        for name in names.values():
            subprocess.run(["ip", "netns", "del", name], check=False, capture_output=True)


CLIENT = """
import json, sys
import grpc
import stagecast
from stagecast.grpc_util import wait_healthy
from stagecast.security import MTLS, connect
coordinator, gateway, operator, token, public_ca = sys.argv[1:6]
mtls = MTLS.load(operator)
service = "stagecast.internal.v1.CoordinatorService"
wait_healthy(coordinator, 600, service, channel=lambda: connect(coordinator, mtls, "coordinator"))
with stagecast.Client(gateway, token=token, root_certificates=public_ca) as client:
    frames = client.generate(prompt="a red fox crossing three hosts", seconds=0.5, codec="raw").collect()
print(json.dumps({"frames": len(frames)}))
"""


def test_the_pipeline_forms_across_three_network_namespaces_with_mtls(namespaces, tmp_path):
    root = write_demo_checkpoint(tmp_path / "ckpt")
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{TOKEN} fox\n")
    public_ca, public_key = make_ca("public CA of the test")
    cert, key = issue(public_ca, public_key, "gateway", hosts=[ADDRESSES["a"]])
    for name, data in (("public-ca.crt", public_ca), ("gw.crt", cert), ("gw.key", key)):
        (tmp_path / name).write_bytes(data)

    def inside(key: str) -> list[str]:
        return ["ip", "netns", "exec", namespaces[key]]

    a, b, c = ADDRESSES["a"], ADDRESSES["b"], ADDRESSES["c"]
    with Launcher() as launcher:
        coord = launcher.spawn(
            "coordinator",
            ["coordinator", "--stages", "2", "--host", a, "--port", "50050", "--backend", "gloo"]
            + ["--metrics-port", str(METRICS)],
            prefix=inside("a"),
        )
        coordinator = coord.info["address"]
        assert coordinator == f"{a}:50050"
        stages = [
            launcher.start(
                f"stage-{i}",
                stage_args(i, coordinator, str(root / "transformer"), "cpu", "float32", host, metrics_port=METRICS),
                prefix=inside(key),
            )
            for i, (key, host) in enumerate((("b", b), ("c", c)))
        ]
        for child in stages:
            launcher.wait_ready(child, timeout=600)
        assert stages[0].info["address"].startswith(f"{b}:") and stages[1].info["address"].startswith(f"{c}:")
        gateway = launcher.spawn(
            "gateway",
            ["gateway", "--coordinator", coordinator, "--checkpoint", str(root), "--host", a, "--port", "50051"]
            + ["--tokens", str(tokens), "--metrics-port", str(METRICS + 1)]
            + ["--tls-cert", str(tmp_path / "gw.crt"), "--tls-key", str(tmp_path / "gw.key")],
            prefix=inside("a"),
        )
        operator = os.path.join(launcher.credentials, "operator")
        out = subprocess.run(
            [*inside("a"), sys.executable, "-c", CLIENT, coordinator, gateway.info["address"], operator, TOKEN]
            + [str(tmp_path / "public-ca.crt")],
            capture_output=True,
            text=True,
            timeout=900,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        )
        assert out.returncode == 0, out.stderr[-3000:]
        assert json.loads(out.stdout.strip().splitlines()[-1]) == {"frames": 8}

        # Every listening socket of every namespace sits on that namespace's address.
        pids = {"a": coord.pid, "b": stages[0].pid, "c": stages[1].pid}
        for key, pid in pids.items():
            sockets = sorted(listening_table(pid).values())
            wrong = [(addr, port) for addr, port in sockets if addr != ADDRESSES[key]]
            assert wrong == [], f"namespace {key}: listening outside {ADDRESSES[key]}: {wrong}"
            ports = {port for _, port in sockets}
            if key == "a":
                assert {50050, 50051, METRICS, METRICS + 1} <= ports, sockets  # coordinator and gateway
            else:
                stage = stages["bc".index(key)]
                assert int(stage.info["address"].rsplit(":", 1)[1]) in ports, sockets
                assert METRICS in ports, sockets
                assert len(sockets) >= 3, f"namespace {key}: no data-plane listener among {sockets}"
