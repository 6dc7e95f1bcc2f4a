#!/usr/bin/env bash
# Resolve the images' packages, without installing anything here:
# - docker/requirements-gpu.txt: what `pip install /src/clients/python "/src[gpu,fp8]"` with torch==$TORCH_VERSION
#   installs on the GPU image (Ubuntu 24.04: CPython 3.12, glibc 2.39, x86_64);
# - docker/requirements-cpu.txt: what `pip install /src/clients/python /src` installs beside the CPU build of
#   torch==$TORCH_VERSION on the CPU image (python:3.11-slim: CPython 3.11, x86_64). torch itself comes from the
#   PyTorch CPU index (the Dockerfile installs it first); its CUDA-only requirements (nvidia-*, cuda-*, triton), which
#   the PyPI build declares and the CPU build does not, are left out.
# The client distribution (stagecast-client, clients/python) is not on PyPI: each resolve is given its path, and the
# locks leave it out with the project (the Dockerfiles install both from /src).
# Run it from the repository root after changing a dependency or TORCH_VERSION; tests/test_docker_image.py checks the
# results against the Dockerfiles offline.
#
#   bash docker/lock.sh
set -euo pipefail
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
platforms=()
for v in $(seq 39 -1 17); do platforms+=(--platform "manylinux_2_${v}_x86_64"); done

resolve() {  # resolve PYTHON_VERSION ABI REPORT SPEC...: a dry run for that interpreter on manylinux x86_64
  local version="$1" abi="$2" report="$3"
  shift 3
  # --isolated: PyPI only, whatever this machine's pip configuration adds.
  pip install --isolated --quiet --dry-run --ignore-installed --report "$report" --target "$work/target-$abi" \
    "${platforms[@]}" --platform manylinux2014_x86_64 --platform linux_x86_64 \
    --python-version "$version" --implementation cp --abi "$abi" --abi abi3 --abi none --only-binary=:all: "$@"
}

write_lock() {  # write_lock REPORT HEADER DROP_REGEX > FILE: the pins, without DROP_REGEX's names
  python3 - "$@" <<'PY'
import json, re, sys
report, header, drop = sys.argv[1:4]
pins = sorted(
    (i["metadata"]["name"].lower(), i["metadata"]["version"])
    for i in json.load(open(report))["install"]
    if not re.fullmatch(drop, i["metadata"]["name"].lower())
)
print(header)
for name, version in pins:
    print(f"{name}=={version}")
PY
}

resolve 3.12 cp312 "$work/gpu.json" "torch==${TORCH_VERSION}" ./clients/python ".[gpu,fp8]"
write_lock "$work/gpu.json" "# The GPU image's packages (docker/Dockerfile), resolved by docker/lock.sh for torch==${TORCH_VERSION},
# CPython 3.12, manylinux x86_64. Do not edit: run \`bash docker/lock.sh\`." 'stagecast|stagecast-client' > docker/requirements-gpu.txt
resolve 3.11 cp311 "$work/cpu.json" "torch==${TORCH_VERSION}" ./clients/python "."
write_lock "$work/cpu.json" "# The CPU image's packages (docker/Dockerfile.cpu) beside torch==${TORCH_VERSION} from the PyTorch CPU index,
# resolved by docker/lock.sh for CPython 3.11, manylinux x86_64. Do not edit: run \`bash docker/lock.sh\`." \
  'stagecast|stagecast-client|torch|triton|nvidia-.*|cuda-.*' > docker/requirements-cpu.txt
for lock in docker/requirements-gpu.txt docker/requirements-cpu.txt; do
  echo "wrote $lock ($(grep -vc '^#' "$lock") packages)"
done
