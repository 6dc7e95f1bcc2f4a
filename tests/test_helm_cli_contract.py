"""Every command the chart runs is accepted by the real ``stagecast`` CLI, and the rendezvous is reachable."""

import argparse
from unittest import mock

import pytest

from launcher import cli
from tests.test_helm_chart import arg_value, fqdn, helm, render  # noqa: F401 - helm is a fixture

VALUES = ["default", "multinode", "cpu"]


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
            if args and args[0] in {"coordinator", "stage", "gateway", "generate", "demo-checkpoint", "vae-stage"}:
                commands.append(args)
    assert {a[0] for a in commands} >= {"coordinator", "stage", "gateway", "generate"}
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
