#!/usr/bin/env bash
# Regenerate the Python code for proto/: the internal API into the stagecast package (stagecast/internal/v1), the
# public API (proto/stagecast/v1) into the client distribution (clients/python/stagecast_client/v1; the server's
# stagecast.v1 is an alias of it). The generated files are committed; .ci/run checks they match the .proto sources.
#   bash scripts/gen_proto.sh [OUT]     # OUT: a directory standing for the repository root (default: the checkout)
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
# The public API's code moves to the client's package, importing itself under that name (the .proto file keeps its
# name, stagecast/v1/stream.proto, and its package, stagecast.v1: the wire and the descriptor pool are unchanged).
public="$out/clients/python/stagecast_client/v1"
mkdir -p "$public"
for f in "$out"/stagecast/v1/*_pb2*.py*; do
  sed -e 's/^from stagecast\.v1 import /from stagecast_client.v1 import /' \
      -e "s/'stagecast\.v1\.\([a-z_]*_pb2\)'/'stagecast_client.v1.\1'/" "$f" > "$public/$(basename "$f")"
  rm "$f"
done
[ -f "$public/__init__.py" ] || : > "$public/__init__.py"
