"""The chart's fleet (``fleet.enabled``): pipelines as LeaderWorkerSet groups, the HAProxy door, KEDA autoscaling.

No cluster is contacted. The rendered LeaderWorkerSet and ScaledObject are validated against the
``openAPIV3Schema`` of pinned LWS and KEDA releases (tests/fixtures/crds/, provenance in its README), the door's
``haproxy.cfg`` with ``haproxy -c``, and everything else with kubernetes-validate, as tests/test_helm_chart.py does.
Without ``fleet`` values the chart renders exactly as it did before the fleet existed
(tests/fixtures/helm_nofleet_render.json.gz, written by tests/fixtures/capture_nofleet_render.py).
"""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import pytest

from tests.test_helm_chart import RELEASE, VALUES_FILES, _load_values, helm  # noqa: F401 - helm is a fixture

pytestmark = pytest.mark.unit

FIXTURES = Path(__file__).resolve().parent / "fixtures"
NOFLEET_GOLDEN = FIXTURES / "helm_nofleet_render.json.gz"
# Values beside the shipped files whose render must not move either: the paths the fleet templates branch on.
NOFLEET_EXTRA = {
    "sp2": {"stages": {"count": 2, "sp": 2, "cudaGraphs": False}},
    "cfg2": {"stages": {"count": 2, "cfgParallel": 2}},
    "no-tls-no-web": {"security": {"gatewayTLS": {"enabled": False}}, "web": {"enabled": False}},
}
# Generated per render (genCA, genSignedCert, randAlphaNum): masked before comparing.
_RANDOM_DATA = re.compile(r"^(\s+(?:ca\.crt|tls\.crt|tls\.key|tokens|admin-token|test-token): ).+$", re.M)


def _masked(manifests: dict[str, str]) -> dict[str, str]:
    return {name: _RANDOM_DATA.sub(r"\1<generated>", text) for name, text in sorted(manifests.items())}


def _render_raw(helm_mod, values: dict) -> dict[str, str]:
    from tests.test_helm_chart import CHART, NAMESPACE

    with helm_mod.Chart.load(str(CHART)) as chart:
        return chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)


def nofleet_renders(helm_mod, extra: dict | None = None) -> dict[str, dict[str, str]]:
    """Every golden case's render, masked: the shipped values files and NOFLEET_EXTRA, each merged with ``extra``."""
    from tests.test_helm_chart import _deep_merge

    cases = {name: _load_values(name) for name in VALUES_FILES}
    cases.update({name: _deep_merge(_load_values("default"), over) for name, over in NOFLEET_EXTRA.items()})
    return {name: _masked(_render_raw(helm_mod, _deep_merge(v, extra or {}))) for name, v in cases.items()}


def write_golden(renders: dict[str, dict[str, str]]) -> None:
    NOFLEET_GOLDEN.write_bytes(gzip.compress(json.dumps(renders, indent=1, sort_keys=True).encode(), mtime=0))


def read_golden() -> dict[str, dict[str, str]]:
    return json.loads(gzip.decompress(NOFLEET_GOLDEN.read_bytes()))


# ----------------------------------------------------------------------------------------------
# Without fleet values: the chart as it was.


def test_without_fleet_values_the_chart_renders_exactly_as_before_the_fleet(helm):  # noqa: F811
    golden = read_golden()
    for name, manifests in nofleet_renders(helm).items():
        assert manifests.keys() == golden[name].keys(), name
        for template, text in manifests.items():
            assert text == golden[name][template], (
                f"{name}: {template} moved without fleet values (a deliberate change: "
                "python tests/fixtures/capture_nofleet_render.py)"
            )
