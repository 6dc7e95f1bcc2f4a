"""Every command the chart runs is accepted by the real ``stagecast`` CLI, and the rendezvous is reachable."""

import argparse
from unittest import mock

import pytest

from launcher import cli
from tests.test_helm_chart import arg_value, fqdn, helm, render  # noqa: F401 - helm is a fixture

pytestmark = pytest.mark.unit

VALUES = ["default", "multinode", "cpu"]
COMMANDS = {"coordinator", "stage", "gateway", "generate", "demo-checkpoint", "vae-stage", "web"}


def parse(args: list[str]) -> argparse.Namespace:
    """Parse with the real parser, stopping before the command runs."""
    seen = {}

    def capture(self, argv=None, namespace=None):
        ns = original(self, argv, namespace)
        seen["ns"] = ns
        raise SystemExit(0)

    original = argparse.ArgumentParser.parse_args
    with mock.patch.object(argparse.ArgumentParser, "parse_args", capture), pytest.raises(SystemExit) as info:
        cli.main(args)
    assert info.value.code == 0, f"the CLI rejected {args}"
    return seen["ns"]


@pytest.mark.parametrize("name", VALUES)
def test_every_container_command_parses_with_the_real_cli(helm, name):  # noqa: F811
    rendered = render(helm, name)
    commands = []
    for workload in rendered.workloads() + rendered.of_kind("Pod"):
        spec = workload["spec"]["template"]["spec"] if "template" in workload["spec"] else workload["spec"]
        for container in spec.get("initContainers", []) + spec["containers"]:
            args = container.get("args") or []
            if args and args[0] in COMMANDS:
                commands.append(args)
    assert {a[0] for a in commands} >= {"coordinator", "stage", "gateway", "generate", "web"}
    for args in commands:
        parse(args)


@pytest.mark.parametrize("name", VALUES)
def test_stages_rendezvous_through_the_coordinators_grpc_service(helm, name):  # noqa: F811
    """No open rendezvous store: stages reach the store over the coordinator's mTLS gRPC Service port."""
    rendered = render(helm, name)
    coord = parse(rendered.component("Deployment", "coordinator")["spec"]["template"]["spec"]["containers"][0]["args"])
    service = rendered.component("Service", "coordinator")
    assert coord.advertise_host == fqdn(service["metadata"]["name"])
    assert coord.mtls and not coord.insecure_internal
    ports = {p["name"]: p["port"] for p in service["spec"]["ports"]}
    assert set(ports) == {"grpc", "metrics"} and ports["grpc"] == coord.port
    stage = rendered.component("StatefulSet", "stage")["spec"]["template"]["spec"]["containers"][0]["args"]
    ns = parse(stage)
    assert ns.coordinator == fqdn(service["metadata"]["name"], coord.port) and ns.mtls


@pytest.mark.parametrize(
    "media",
    [
        {"mode": "direct"},
        {"mode": "turn", "turn": {"url": "turn:turn.example.com:3478", "username": "u", "credentialSecret": "t"}},
        {"mode": "hostNetwork"},
    ],
)
def test_the_web_container_reaches_the_gateway_with_its_tls_and_offers_the_media_path(helm, media):  # noqa: F811
    rendered = render(helm, web={"media": media})
    pod = rendered.component("Deployment", "gateway")["spec"]["template"]["spec"]
    web = next(c for c in pod["containers"] if c["name"] == "web")
    ns = parse(web["args"])
    gateway = rendered.get("Service", "sc-stagecast-gateway")
    grpc_port = next(p["port"] for p in gateway["spec"]["ports"] if p["name"] == "grpc")
    # TLS is on by default: the gateway is reached by the Service name its certificate holds, with its CA.
    assert ns.gateway == fqdn(gateway["metadata"]["name"], grpc_port)
    assert ns.gateway_ca == "/etc/stagecast/gateway-tls/ca.crt" and ns.tokens == "/etc/stagecast/tokens/tokens"
    # The page has a Service of its own (ClusterIP), off the public gateway Service.
    page = rendered.get("Service", "sc-stagecast-gateway-web")
    assert ns.host == "0.0.0.0" and next(p for p in page["spec"]["ports"] if p["name"] == "http")
    assert page["spec"].get("type", "ClusterIP") == "ClusterIP"
    assert not any(p["name"] == "http" for p in gateway["spec"]["ports"])
    if media["mode"] == "turn":
        assert ns.turn == "turn:turn.example.com:3478" and ns.turn_credential_file == "/etc/stagecast/turn/credential"
        assert any(v.get("secret", {}).get("secretName") == "t" for v in pod["volumes"])
    else:
        assert ns.turn is None
    assert pod.get("hostNetwork", False) == (media["mode"] == "hostNetwork")
    assert (ns.ice_hosts == ["$(HOST_IP)"]) == (media["mode"] == "hostNetwork")


def test_web_values_that_cannot_work_are_refused_and_web_can_be_left_out(helm):  # noqa: F811
    from tests.test_helm_chart import render_error

    assert "web.media.turn.url is empty" in render_error(helm, web={"media": {"mode": "turn"}})
    tls = [{"secretName": "live-tls", "hosts": ["live.example.com"]}]  # an exposed page needs TLS and an allow-list
    controller = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress-nginx"}}}]
    off = render(helm, web={"enabled": False, "ingress": {"enabled": True, "tls": tls, "from": controller}})
    pod = off.component("Deployment", "gateway")["spec"]["template"]["spec"]
    assert [c["name"] for c in pod["containers"]] == ["gateway"]
    assert [p["name"] for p in off.get("Service", "sc-stagecast-gateway")["spec"]["ports"]] == ["grpc"]
    assert not off.of_kind("Ingress")
    exposed = {"enabled": True, "host": "live.example.com", "tls": tls, "from": controller}
    ingress = render(helm, web={"ingress": exposed}).of_kind("Ingress")
    rule = ingress[0]["spec"]["rules"][0]
    assert rule["host"] == "live.example.com"
    assert rule["http"]["paths"][0]["backend"]["service"]["port"] == {"name": "http"}
