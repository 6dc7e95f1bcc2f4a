"""The fleet's commands run for real: the door's rendered haproxy.cfg through ``haproxy -c``, and the stage workers'
shell command through ``/bin/sh`` (the index arithmetic the downward API cannot do). Renders as in
tests/test_helm_fleet.py.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.test_helm_chart import helm  # noqa: F401 - a fixture
from tests.test_helm_fleet import FLEET_CASES, container, fleet, haproxy_cfg, pod_specs

pytestmark = pytest.mark.multiprocess


def _haproxy() -> str:
    import shutil

    path = shutil.which("haproxy") or ("/usr/sbin/haproxy" if Path("/usr/sbin/haproxy").exists() else None)
    if path is None:
        msg = "haproxy is not installed (apt-get install -y haproxy)"
        if os.environ.get("CI"):
            pytest.fail(msg, pytrace=False)
        pytest.skip(msg)
    return path


def _self_signed(folder: Path) -> Path:
    """A certificate at folder/door.pem and its key beside it as door.pem.key, as the door's Secret mounts them."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "door")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(1)
        .not_valid_before(now)
        .not_valid_after(now + datetime.timedelta(days=1))
        .sign(key, hashes.SHA256())
    )
    pem = folder / "door.pem"
    pem.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (folder / "door.pem.key").write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return pem


@pytest.mark.parametrize("case", ["done-when", "no-tls-no-web"])
def test_the_doors_config_passes_haproxy_check(helm, case, tmp_path):  # noqa: F811
    haproxy = _haproxy()
    cfg = haproxy_cfg(fleet(helm, **FLEET_CASES[case]))
    mounted = "/etc/stagecast/door-tls/door.pem"
    assert (mounted in cfg) == (case == "done-when")
    path = tmp_path / "haproxy.cfg"
    path.write_text(cfg.replace(mounted, str(_self_signed(tmp_path))))
    check = subprocess.run([haproxy, "-c", "-f", str(path)], capture_output=True, text=True, timeout=30)
    assert check.returncode == 0, check.stdout + check.stderr
    # The check can fail: a server-template naming resolvers that do not exist is refused.
    path.write_text(path.read_text().replace("resolvers kube\n", "resolvers other\n"))
    bad = subprocess.run([haproxy, "-c", "-f", str(path)], capture_output=True, text=True, timeout=30)
    assert bad.returncode != 0 and "kube" in bad.stdout + bad.stderr


@pytest.mark.parametrize(
    "case,role,worker,index", [("done-when", "worker", "3", "2"), ("one-stage", "leader", "0", "0")]
)
def test_a_stage_pods_command_registers_its_worker_index_less_one(helm, tmp_path, case, role, worker, index):  # noqa: F811
    """Run the container's command with a stand-in ``stagecast`` on PATH that prints what it was given."""
    spec = pod_specs(next(iter(fleet(helm, **FLEET_CASES[case]).of_kind("LeaderWorkerSet"))))[role]
    stage = container(spec, "stage")
    fake = tmp_path / "stagecast"
    fake.write_text('#!/bin/sh\necho "index=$STAGECAST_STAGE_INDEX args=$*"\n')
    fake.chmod(0o755)
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin", "LWS_WORKER_INDEX": worker}
    out = subprocess.run(stage["command"] + stage["args"], capture_output=True, text=True, env=env, timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"index={index} args=stage --coordinator "), out.stdout
    assert "STAGECAST_STAGE_INDEX" not in {e["name"] for e in stage["env"]}  # not the StatefulSet's pod-index label
