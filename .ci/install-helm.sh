#!/usr/bin/env bash
# Install the real Helm renderer used by tests/test_helm_chart.py.
#
# No helm CLI binary can be installed from the package registries CI reaches (PyPI, Debian,
# npm): Debian bookworm has no helm package, PyPI's helm-package ships only macOS/Windows
# binaries, and no npm package was found that bundles a Linux binary in its tarball.
# The PyPI wheel helm-python-sdk bundles Helm's Go SDK (v4.2.3) as a shared library
# (libhelm_c), so the test renders and lints with Helm's real engine.
#
# Installs .ci/helm-requirements.txt into one Python environment, chosen as:
#   $PYTHON if set, else the active virtualenv ($VIRTUAL_ENV), else ./.venv, else python3.
# Idempotent: exits early when the pinned versions are already installed and the library loads.
#
#   bash .ci/install-helm.sh
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
REQ=.ci/helm-requirements.txt

if [[ -n "${PYTHON:-}" ]]; then
  PY="$PYTHON"
elif [[ -n "${VIRTUAL_ENV:-}" && -x "$VIRTUAL_ENV/bin/python" ]]; then
  PY="$VIRTUAL_ENV/bin/python"
elif [[ -x .venv/bin/python ]]; then
  PY=.venv/bin/python
else
  PY=python3
fi

check() {
  "$PY" - "$REQ" <<'PYEOF'
import importlib.metadata as md
import re
import sys

for line in open(sys.argv[1]):
    line = line.split("#", 1)[0].strip()
    m = re.fullmatch(r"([A-Za-z0-9_.-]+)==(\S+)", line)
    if m and md.version(m.group(1)) != m.group(2):
        sys.exit(1)
import helm_python  # noqa: E402  (loads libhelm_c)
import kubernetes_validate  # noqa: E402,F401

print(f"helm renderer ready: helm-python-sdk {md.version('helm-python-sdk')}, Helm SDK {helm_python.helm_sdk_version()}")
PYEOF
}

if check 2>/dev/null; then
  exit 0
fi

echo "installing $REQ into $("$PY" -c 'import sys; print(sys.prefix)')"
"$PY" -m pip install --disable-pip-version-check --no-input -r "$REQ"
check
