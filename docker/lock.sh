#!/usr/bin/env bash
# Resolve the GPU image's packages into docker/requirements-gpu.txt: what `pip install "/src[gpu,fp8]"` with
# torch==$TORCH_VERSION installs on the image (Ubuntu 24.04: CPython 3.12, glibc 2.39, x86_64), without
# installing anything here. Run it from the repository root after changing a dependency or TORCH_VERSION;
# tests/test_docker_image.py checks the result against the Dockerfile offline.
#
#   bash docker/lock.sh
set -euo pipefail
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
report="$(mktemp)"
target="$(mktemp -d)"
trap 'rm -rf "$report" "$target"' EXIT
platforms=()
for v in $(seq 39 -1 17); do platforms+=(--platform "manylinux_2_${v}_x86_64"); done
# --isolated: PyPI only, whatever this machine's pip configuration adds.
pip install --isolated --quiet --dry-run --ignore-installed --report "$report" --target "$target" \
  "${platforms[@]}" --platform manylinux2014_x86_64 --platform linux_x86_64 \
  --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none --only-binary=:all: \
  "torch==${TORCH_VERSION}" ".[gpu,fp8]"
python3 - "$report" "$TORCH_VERSION" > docker/requirements-gpu.txt <<'PY'
import json, sys
report, torch_version = sys.argv[1], sys.argv[2]
pins = sorted(
    (i["metadata"]["name"].lower(), i["metadata"]["version"])
    for i in json.load(open(report))["install"]
    if i["metadata"]["name"].lower() != "stagecast"
)
print(f"# The GPU image's packages (docker/Dockerfile), resolved by docker/lock.sh for torch=={torch_version},")
print("# CPython 3.12, manylinux x86_64. Do not edit: run `bash docker/lock.sh`.")
for name, version in pins:
    print(f"{name}=={version}")
PY
echo "wrote docker/requirements-gpu.txt ($(grep -vc '^#' docker/requirements-gpu.txt) packages)"
