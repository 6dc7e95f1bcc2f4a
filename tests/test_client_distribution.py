"""The thin client distribution (clients/python, ``stagecast-client``) on its own: a fresh virtual environment gets
``pip install "clients/python[media]"`` (grpcio, protobuf, googleapis-common-protos, numpy, PyAV, Pillow from the
registry, through pip's cache; no torch, diffusers or aiortc), and the script of docs/api-guide.md's "Using the SDK",
run by that environment's Python from a directory outside the checkout, streams from the shared demo system into an
MP4 and catches the documented error type of a refused stream.

The install runs while the shared system forms (both are mostly waiting); the package is copied out of the checkout
first, so pip's in-tree build leaves nothing in the working tree.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[1]
INSTALL_TIMEOUT_S = 480.0  # a bound only: from pip's cache it takes seconds, from the registry a minute or two
SERVER_STACK = {"torch", "diffusers", "aiortc", "transformers", "stagecast"}  # what the thin client must not pull
DOCS_SERVER = "localhost:50051"  # the address the guide's script uses


def _clean_env() -> dict[str, str]:
    """The environment without anything that points a Python at the checkout or at the main venv."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if not p.startswith(sys.prefix))
    return env


@pytest.fixture(scope="session")
def client_venv(tmp_path_factory):
    """A fresh venv installing ``clients/python[media]`` (started here, awaited by ``ready``), and its pip report.
    Session-scoped, so that it is set up before the shared system (a test asks for it first) and installs meanwhile."""
    root = tmp_path_factory.mktemp("client-venv")
    source = root / "stagecast-client"
    shutil.copytree(
        REPO / "clients" / "python",
        source,
        ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"),
    )
    venv, report, log = root / "venv", root / "report.json", root / "install.log"
    python = venv / "bin" / "python"
    script = (
        f"{sys.executable} -m venv {venv} && {python} -m pip install --disable-pip-version-check --prefer-binary "
        f"--report {report} '{source}[media]'"
    )
    with open(log, "wb") as out:
        proc = subprocess.Popen(["bash", "-c", script], stdout=out, stderr=subprocess.STDOUT, env=_clean_env())

    def ready() -> tuple[Path, dict]:
        try:
            code = proc.wait(timeout=INSTALL_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        assert code == 0, f"pip install clients/python[media] failed ({code}):\n{log.read_text()[-4000:]}"
        return python, json.loads(report.read_text())

    try:
        yield ready
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _installed(report: dict) -> dict[str, str]:
    return {i["metadata"]["name"].lower().replace("_", "-"): i["metadata"]["version"] for i in report["install"]}


def _docs_script() -> str:
    """The first Python block under docs/api-guide.md's "Using the SDK"."""
    guide = (REPO / "docs" / "api-guide.md").read_text()
    section = guide[guide.index("## Using the SDK") :]
    block = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert block is not None, "docs/api-guide.md: no python block under 'Using the SDK'"
    return block.group(1)


def test_the_guides_script_streams_into_an_mp4_and_a_refusal_raises_its_documented_type(
    client_venv, shared_system, tmp_path
):
    script = _docs_script()
    assert "import stagecast_client" in script and DOCS_SERVER in script
    assert "except stagecast_client.InvalidArgumentError" in script  # the refusal's documented type
    (tmp_path / "client.py").write_text(script.replace(DOCS_SERVER, shared_system.gateway))
    python, _ = client_venv()
    run = subprocess.run(
        [str(python), "-I", "client.py"], cwd=tmp_path, env=_clean_env(), capture_output=True, text=True, timeout=120
    )
    # Another error type than the documented one would end the script with a traceback.
    assert run.returncode == 0, f"stdout:\n{run.stdout}\nstderr:\n{run.stderr}"
    assert "refused: width" in run.stdout, run.stdout
    assert not (tmp_path / "refused.mp4").exists() or (tmp_path / "refused.mp4").stat().st_size == 0

    import av

    with av.open(str(tmp_path / "clip.mp4")) as container:
        stream = container.streams.video[0]
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(stream)]
        rate = float(stream.average_rate)
    assert frames and frames[0].shape == (64, 64, 3), "the demo checkpoint serves 64x64"
    assert rate == pytest.approx(16.0)
    # seconds=2 at the stream's 16 fps, up to one chunk (the demo checkpoint's chunk: 1 latent frame, 4 frames).
    assert abs(len(frames) - 32) <= 4, len(frames)


def test_the_client_installs_alone_without_the_server_stack(client_venv, tmp_path):
    python, report = client_venv()
    installed = _installed(report)
    assert {"stagecast-client", "grpcio", "protobuf", "googleapis-common-protos", "numpy", "av", "pillow"} <= set(
        installed
    ), installed
    assert not SERVER_STACK & set(installed), f"the thin client pulled {sorted(SERVER_STACK & set(installed))}"
    # Outside the checkout, its Python finds the client in its own site-packages and no server package at all.
    probe = (
        "import importlib.util as u, stagecast_client, stagecast_client.v1.stream_pb2 as pb, stagecast_client.media; "
        "print(stagecast_client.__file__); "
        "print([n for n in ('torch', 'diffusers', 'aiortc', 'stagecast', 'tqdm') if u.find_spec(n)])"
    )
    out = subprocess.run(
        [str(python), "-I", "-c", probe], cwd=tmp_path, env=_clean_env(), capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    where, found = out.stdout.splitlines()
    assert Path(where).is_relative_to(python.parent.parent), where
    assert found == "[]", f"importable beside the thin client: {found}"
