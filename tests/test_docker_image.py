"""The GPU image's stack agrees with itself, checked offline (no docker engine, no network): the locked packages
(docker/requirements-gpu.txt, from `bash docker/lock.sh`) are CUDA builds of the base image's major, the Dockerfile
installs exactly that lock, the `gpu` extra names what that torch loads, and the build's smoke check imports
torch.cuda and NCCL."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCKER = REPO / "docker"


def _dockerfile_text() -> str:
    return re.sub(r"\\\n", " ", (DOCKER / "Dockerfile").read_text())


def _lock() -> dict[str, str]:
    pins = {}
    for line in (DOCKER / "requirements-gpu.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version, f"requirements-gpu.txt: {line!r} is not pinned with =="
            pins[name.lower()] = version
    return pins


def _base_cuda_major() -> int:
    match = re.search(r"^ARG CUDA_IMAGE=nvidia/cuda:(\d+)\.\d+\.\d+-\S+$", (DOCKER / "Dockerfile").read_text(), re.M)
    assert match, "docker/Dockerfile: ARG CUDA_IMAGE=nvidia/cuda:<major>.<minor>.<patch>-... not found"
    return int(match.group(1))


@pytest.mark.unit
def test_every_cuda_wheel_in_the_lock_matches_the_base_images_cuda_major():
    major = _base_cuda_major()
    pins = _lock()
    suffixed = {name: int(m.group(1)) for name in pins if (m := re.fullmatch(r"nvidia-.+-cu(\d+)", name))}
    assert suffixed, "no nvidia-*-cuNN wheel in the lock: is torch a CUDA build?"
    wrong = {name: cu for name, cu in suffixed.items() if cu != major}
    assert not wrong, f"base image is CUDA {major}; these wheels are for another CUDA: {wrong}"
    # The CUDA runtime torch runs on, and the toolkit metapackage, are of the same major.
    for name in ("nvidia-cuda-runtime", "cuda-toolkit"):
        if name in pins:
            assert int(pins[name].split(".")[0]) == major, (name, pins[name], major)
    assert f"nvidia-nccl-cu{major}" in pins, "the image's torch needs NCCL for its CUDA"


@pytest.mark.unit
def test_the_dockerfile_installs_the_lock_and_the_project_without_moving_a_pin():
    text = _dockerfile_text()
    assert "COPY docker/requirements-gpu.txt" in text and "pip install --requirement /tmp/requirements-gpu.txt" in text
    assert 'pip install --no-deps "/src[gpu,fp8]"' in text
    # The client distribution the project depends on (not on PyPI) is installed from the source first.
    assert text.index("pip install --no-deps /src/clients/python") < text.index('pip install --no-deps "/src[gpu,fp8]"')
    assert "pip check" in text
    assert "nvidia-nccl-cu12" not in text and "--index-url" not in text
    # The CPU image and the lock agree on the torch version.
    torch_cpu = re.search(r"torch==([\d.]+) --index-url", (DOCKER / "Dockerfile.cpu").read_text()).group(1)
    assert _lock()["torch"] == torch_cpu


@pytest.mark.unit
def test_the_smoke_check_imports_torch_cuda_and_nccl():
    text = _dockerfile_text()
    check = text[text.index('python -c "import torch') :]
    assert "torch.cuda" in check and "is_nccl_available()" in check and "torch.cuda.nccl.version()" in check
    assert f"== '{_base_cuda_major()}'" in check


@pytest.mark.unit
def test_the_gpu_extra_names_what_the_locked_torch_loads():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    pins = _lock()
    for requirement in (*extras["gpu"], *extras["fp8"]):
        name = re.match(r"[A-Za-z0-9_.-]+", requirement).group(0).lower()
        assert name in pins, f"the extra's {requirement!r} is not in docker/requirements-gpu.txt: run docker/lock.sh"
        if m := re.fullmatch(r"nvidia-.+-cu(\d+)", name):
            assert int(m.group(1)) == _base_cuda_major(), requirement


@pytest.mark.unit
def test_the_images_document_the_driver_and_expose_no_rendezvous_port():
    readme = (DOCKER / "README.md").read_text()
    assert f"CUDA {_base_cuda_major()}" in readme and ">= 580" in readme
    for name in ("Dockerfile", "Dockerfile.cpu", "README.md"):
        assert "29500" not in (DOCKER / name).read_text(), f"docker/{name}: the stages rendezvous over gRPC"


def _cpu_lock() -> dict[str, str]:
    pins = {}
    for line in (DOCKER / "requirements-cpu.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version, f"requirements-cpu.txt: {line!r} is not pinned with =="
            pins[name.lower().replace("_", "-")] = version  # PEP 503 names
    return pins


@pytest.mark.unit
def test_the_cpu_image_installs_its_lock_beside_the_cpu_torch_without_moving_a_pin():
    text = re.sub(r"\\\n", " ", (DOCKER / "Dockerfile.cpu").read_text())
    assert "COPY docker/requirements-cpu.txt" in text and "pip install --requirement /tmp/requirements-cpu.txt" in text
    assert text.index("torch==") < text.index("--requirement /tmp/requirements-cpu.txt")  # the CPU build first
    assert "pip install --no-deps /src/clients/python" in text and "pip check" in text
    assert text.index("pip install --no-deps /src/clients/python") < text.index("pip install --no-deps /src ")
    pins = _cpu_lock()
    cuda = [name for name in pins if re.match(r"(nvidia-|cuda-|triton$|torch$)", name)]
    assert not cuda, f"the CPU lock holds {cuda}: torch is the CPU build, installed from its own index"
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    for pyproject in (REPO / "pyproject.toml", REPO / "clients" / "python" / "pyproject.toml"):
        for requirement in tomllib.loads(pyproject.read_text())["project"]["dependencies"]:
            name = re.match(r"[A-Za-z0-9_.-]+", requirement).group(0).lower().replace("_", "-")
            if name == "stagecast-client":  # installed from /src/clients/python, its dependencies checked here
                continue
            assert name == "torch" or name in pins, f"{requirement!r} is not in requirements-cpu.txt: run lock.sh"
