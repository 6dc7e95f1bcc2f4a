"""The chart's README says what its default render does: the live page's port-forward names the Service that serves
it, and the default model is a real-time checkpoint's layout (issue 51, findings a and d)."""

from __future__ import annotations

import re

import pytest

from tests.test_helm_chart import CHART, RELEASE, arg_value, helm, main_container, render  # noqa: F401 - helm: fixture

pytestmark = pytest.mark.unit


def test_the_readmes_port_forward_for_the_page_names_the_service_that_serves_web_port(helm):  # noqa: F811
    readme = (CHART / "README.md").read_text()
    forwards = re.findall(r"port-forward svc/(\S+) (\d+):(\d+)`", readme)
    assert forwards, "the README's step 5 port-forwards the page"
    r = render(helm)
    for service, _local, remote in forwards:
        # The README's release is "wan": the Service of this render's release with the same suffix.
        name = service.replace("wan-stagecast", f"{RELEASE}-stagecast", 1)
        ports = [p["port"] for p in r.get("Service", name)["spec"]["ports"]]
        assert int(remote) in ports and int(remote) == r.values["web"]["port"], (service, ports)
    assert "the ClusterIP Service `<fullname>-gateway-web` exposes it" in readme


def test_the_default_model_is_a_real_time_checkpoints_layout(helm):  # noqa: F811
    r = render(helm)
    model = r.values["model"]
    assert "14B" not in model["subPath"] and model["subPath"] == "self-forcing-1.3b"
    assert model["numLayers"] == 30  # Self-Forcing is Wan2.1-1.3B's 30 blocks
    stage = main_container(r.component("StatefulSet", "stage"))
    assert arg_value(stage["args"], "--checkpoint") == f"{model['mountPath']}/self-forcing-1.3b"
