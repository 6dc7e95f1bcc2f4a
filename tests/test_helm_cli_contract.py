"""Every command the chart runs is accepted by the real ``stagecast`` CLI, and the rendezvous is reachable."""

import argparse
import re
from pathlib import Path
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


# ---- every service flag reaches the chart and the docs ------------------------------------------------------

TEMPLATES = Path(__file__).resolve().parent.parent / "helm" / "stagecast" / "templates"
DOCS = Path(__file__).resolve().parent.parent / "docs"
SECURITY = ["--mtls", "--insecure-internal"]  # every internal service's, added by stagecast.service

# The service flags the chart does not set, each with why (two kinds, below); every other flag must appear in its
# container's args.
# The chart must not set these: it fixes the answer (mTLS, metrics on the pod's address, tokens, the pod index as
# the rank), or they are for tests and what-ifs.
MUST_NOT_SET = {
    "coordinator": {
        "--stage-ms": "a what-if calibration; the stages calibrate themselves at READY",
        "--vae-ms-per-chunk": "a what-if; the gateway measures and reports its decoders' cost",
        "--slo-fixed": "tests and what-ifs: it needs --stage-ms",
        "--record-plan": "selftest only: the plan grows without bound",
        "--metrics-host": "the chart binds metrics with --host (the pod's address)",
        "--insecure-internal": "the chart always runs mTLS",
    },
    "stage": {
        "--expected-stages": "the coordinator's --stages is the one size the chart sets",
        "--sp-rank": "a StatefulSet's pod index is the global rank (--index from STAGECAST_STAGE_INDEX)",
        "--metrics-host": "the chart binds metrics with --host (the pod's address)",
        "--insecure-internal": "the chart always runs mTLS",
    },
    "gateway": {
        "--vae-stage": "the chart runs the VAE in the gateway pod, cut over its GPUs with --vae-devices",
        "--allow-anonymous": "the chart always gives --tokens",
        "--metrics-host": "the chart binds metrics with --host (the pod's address)",
        "--insecure-internal": "the chart always runs mTLS",
    },
    "web": {
        "--allow-anonymous": "the chart always gives --tokens",
        "--tls-cert": "the page is served behind the chart's Ingress, which terminates TLS",
        "--tls-key": "the page is served behind the chart's Ingress, which terminates TLS",
        "--gateway-tls": "--gateway-ca names the chart's own CA instead of the system roots",
        "--gateway-tls-name": "the web container reaches the gateway by the Service name its certificate holds",
    },
}

# The service's default is the deployment's (the Stream Batch, buffers, timeouts: `tests/test_one_home.py` wants the
# services' constants to run): a release tunes it through the component's `extraArgs`.
SERVICE_DEFAULT = {
    "coordinator": {
        "--backend": "auto picks nccl on GPU stages and gloo on CPU ones, which is what a deployment wants",
        "--max-batch": "the Stream Batch default; tuning through extraArgs",
        "--max-streams": "admission by the SLO controller's capacity; the count through extraArgs",
        "--playout-s": "pacing tuning through extraArgs",
        "--pace-grid": "off until a GPU run shows it pays (BENCHMARKS.md); pacing tuning through extraArgs",
        "--lookahead": "the default bound fits every topology; an A/B knob for benchmarks, through extraArgs",
        "--host-share": "each pipeline of the chart has its own GPUs (1, the default); a shared host through extraArgs",
        "--gpu-sharing": "the measured default prices a stage beside the gateway's decoder; tuning through extraArgs",
    },
    "stage": {
        "--calibration-s": "the GPU default (10 s) is the deployment's; through extraArgs",
        "--kv-budget-gib": "derived from free GPU memory by default; through extraArgs",
        "--device-memory-gib": "each stage pod has a GPU of its own (the free memory is its own); through extraArgs",
        "--lora": "LoRA files are per deployment; through extraArgs with the model volume's paths",
        "--dit-levers": "opt-in levers that change the numbers (none by default); through extraArgs",
    },
    "gateway": {
        "--text-len": "the checkpoint's serving defaults",
        "--device-memory-gib": "the gateway pod's GPU is its own (its free memory is its own); through extraArgs",
        "--text-dtype": "auto: bfloat16 on a GPU",
        "--text-device": "the gateway's --device",
        "--no-text-graph": "the captured text encoder is checked against eager at start; through extraArgs",
        "--vae-cudnn-benchmark": "off: it slows every stream's first frames; through extraArgs",
        "--vae-graph-slots": "--max-streams slots; fewer through extraArgs (values.yaml says so)",
        "--pipeline-warmup-s": "the GPU default (120 s) is the deployment's; through extraArgs",
        "--buffer-chunks": "buffer tuning through extraArgs",
        "--buffer-messages": "buffer tuning through extraArgs",
        "--buffer-mib": "buffer tuning through extraArgs",
        "--slow-client-timeout": "timeout tuning through extraArgs",
        "--drain-timeout": "timeout tuning through extraArgs",
        "--config-timeout": "timeout tuning through extraArgs",
        "--max-pending": "limit tuning through extraArgs",
        "--max-watchers": "limit tuning through extraArgs",
        "--max-frame-pixels": "the checkpoint's stagecast.json budget",
        "--max-stream-cost": "the checkpoint's stagecast.json budget",
        "--threads": "torch's default in a container sized by its resources",
        "--vae-split": "balanced by multiply-accumulates; through extraArgs",
        "--max-unpaced": "limit tuning through extraArgs",
    },
    "web": {
        "--max-peers-per-tenant": "half of --max-peers; through extraArgs",
        "--max-preauth": "limit tuning through extraArgs",
        "--max-preauth-per-address": "limit tuning through extraArgs",
        "--trusted-proxy": "the chart's page sits in the gateway pod, behind no proxy of its own",
    },
}

NOT_IN_CHART = {cmd: {**MUST_NOT_SET[cmd], **SERVICE_DEFAULT[cmd]} for cmd in MUST_NOT_SET}


def service_flags() -> dict[str, list[str]]:
    from launcher.flag_reference import service_options
    from stagecast.flags import flag_names

    return {
        command: flag_names(cls) + ([] if command == "web" else SECURITY) for command, cls in service_options().items()
    }


def container_args_template(command: str) -> str:
    """The chart's template text of ``command``'s container args (the gateway pod holds the web container)."""
    helpers = (TEMPLATES / "_helpers.tpl").read_text()
    security = helpers[helpers.index('define "stagecast.securityArgs"') :].split("{{- end -}}", 2)
    # The containers are defined once (_containers.tpl), for the one-pipeline workloads and the fleet's.
    containers = (TEMPLATES / "_containers.tpl").read_text()
    name = {"coordinator": "coordinator.container", "stage": "stage.container"}.get(command, "gateway.containers")
    block = containers[containers.index(f'define "stagecast.{name}"') :].split("{{- define", 1)[0]
    if command in ("coordinator", "stage"):
        return block + security[0]
    gateway, web = block.split("- name: web\n", 1)
    gateway += (TEMPLATES / "fleet-leaderworkerset.yaml").read_text()  # a fleet's gateway flags (--pipeline-name, ...)
    return gateway + security[0] if command == "gateway" else web


def mentions(text: str, flag: str) -> bool:
    return re.search(re.escape(flag) + r"(?![\w-])", text) is not None


@pytest.mark.parametrize("command", sorted(NOT_IN_CHART))
def test_every_service_flag_is_set_by_the_chart_or_exempted_with_a_reason(command):
    flags = service_flags()[command]
    text = container_args_template(command)
    unset = [f for f in flags if not mentions(text, f) and f not in NOT_IN_CHART[command]]
    assert not unset, f"stagecast {command}: flags the chart neither sets nor exempts (NOT_IN_CHART): {unset}"
    stale = [f for f in NOT_IN_CHART[command] if f not in flags or mentions(text, f)]
    assert not stale, f"stagecast {command}: NOT_IN_CHART names flags that are gone or set: {stale}"
    assert all(NOT_IN_CHART[command].values()), "each exemption says why"
    assert not set(MUST_NOT_SET[command]) & set(SERVICE_DEFAULT[command]), "one kind of exemption per flag"


def test_every_service_flag_has_a_line_in_the_docs():
    text = (DOCS / "operator-guide.md").read_text() + (DOCS / "api-guide.md").read_text()
    missing = {cmd: [f for f in flags if not mentions(text, f)] for cmd, flags in service_flags().items()}
    assert not any(missing.values()), f"flags no guide mentions: {missing}"


def test_the_guides_flag_reference_is_what_the_options_declare():
    from launcher import flag_reference

    text = flag_reference.GUIDE.read_text()
    assert flag_reference.updated(text) == text, "the flag reference is stale: run python -m launcher.flag_reference"
