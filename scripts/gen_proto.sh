#!/usr/bin/env bash
# Regenerate the Python code for proto/ into the stagecast package (stagecast/internal/v1, stagecast/v1).
# The generated files are committed; tests/test_proto.py checks they match the .proto sources.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p "${1:-.}"
out="$(cd "${1:-.}" && pwd)"
files=$(cd proto && find . -name '*.proto' | sed 's#^\./##' | sort)
(cd proto && python -m grpc_tools.protoc -I. --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" $files)
for d in $(cd proto && find . -name '*.proto' -exec dirname {} \; | sed 's|^\./||' | sort -u); do
  p="$out/$d"
  while [ "$p" != "$out/stagecast" ] && [ "$p" != "$out" ]; do
    [ -f "$p/__init__.py" ] || : > "$p/__init__.py"
    p=$(dirname "$p")
  done
done
