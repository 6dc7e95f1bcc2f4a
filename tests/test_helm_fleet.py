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


def _nonempty(manifests: dict[str, str]) -> dict[str, str]:
    """The templates that render something (a template that renders nothing is no object)."""
    return {name: text for name, text in manifests.items() if text.strip()}


def write_golden(renders: dict[str, dict[str, str]]) -> None:
    NOFLEET_GOLDEN.write_bytes(gzip.compress(json.dumps(renders, indent=1, sort_keys=True).encode(), mtime=0))


def read_golden() -> dict[str, dict[str, str]]:
    return json.loads(gzip.decompress(NOFLEET_GOLDEN.read_bytes()))


# ----------------------------------------------------------------------------------------------
# Without fleet values: the chart as it was.


def test_without_fleet_values_the_chart_renders_exactly_as_before_the_fleet(helm):  # noqa: F811
    golden = {name: _nonempty(m) for name, m in read_golden().items()}
    for name, manifests in nofleet_renders(helm).items():
        manifests = _nonempty(manifests)
        assert manifests.keys() == golden[name].keys(), name
        for template, text in manifests.items():
            assert text == golden[name][template], (
                f"{name}: {template} moved without fleet values (a deliberate change: "
                "python tests/fixtures/capture_nofleet_render.py)"
            )


# ----------------------------------------------------------------------------------------------
# The fleet: the issue's render (fleet.enabled, 3 pipelines, autoscaling 1..6).

PROMETHEUS = "http://prometheus-operated.monitoring.svc:9090"
DONE_WHEN = {
    "fleet": {
        "enabled": True,
        "pipelines": 3,
        "autoscaling": {
            "enabled": True,
            "minPipelines": 1,
            "maxPipelines": 6,
            "prometheus": {"serverAddress": PROMETHEUS},
        },
    }
}
LWS_CRD = FIXTURES / "crds" / "lws-v0.10.0-leaderworkersets.json.gz"
KEDA_CRD = FIXTURES / "crds" / "keda-v2.20.2-scaledobjects.json.gz"
LWS_NAME = f"{RELEASE}-stagecast-pipeline"


def fleet(helm_mod, name: str = "default", **overrides):
    """A fleet render: DONE_WHEN merged under ``overrides``."""
    from tests.test_helm_chart import _deep_merge, render

    return render(helm_mod, name, **_deep_merge(DONE_WHEN, overrides))


def fleet_error(helm_mod, **overrides) -> str:
    from tests.test_helm_chart import _deep_merge, render_error

    return render_error(helm_mod, **_deep_merge(DONE_WHEN, overrides))


def pod_specs(lws: dict) -> dict[str, dict]:
    t = lws["spec"]["leaderWorkerTemplate"]
    return {"leader": t["leaderTemplate"]["spec"], "worker": t["workerTemplate"]["spec"]}


def container(spec: dict, name: str) -> dict:
    (found,) = [c for c in spec["containers"] if c["name"] == name]
    return found


def haproxy_cfg(r) -> str:
    (cm,) = [c for c in r.of_kind("ConfigMap") if c["metadata"]["labels"]["app.kubernetes.io/component"] == "door"]
    return cm["data"]["haproxy.cfg"]


def test_the_fleet_render_is_one_leaderworkerset_a_scaledobject_and_an_haproxy_door(helm):  # noqa: F811
    r = fleet(helm)
    (lws,) = r.of_kind("LeaderWorkerSet")
    assert lws["metadata"]["name"] == LWS_NAME and lws["spec"]["replicas"] == 3
    assert lws["spec"]["leaderWorkerTemplate"]["restartPolicy"] == "None"
    (so,) = r.of_kind("ScaledObject")
    assert so["spec"]["scaleTargetRef"] == {
        "apiVersion": "leaderworkerset.x-k8s.io/v1",
        "kind": "LeaderWorkerSet",
        "name": LWS_NAME,
    }
    assert (so["spec"]["minReplicaCount"], so["spec"]["maxReplicaCount"]) == (1, 6)
    (trigger,) = so["spec"]["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "Value"
    assert trigger["metadata"]["serverAddress"] == PROMETHEUS and trigger["metadata"]["threshold"] == "0.75"
    query = trigger["metadata"]["query"]
    assert "stagecast_gateway_slots_free{" in query and "stagecast_gateway_slots{" in query
    behavior = so["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] == 300
    assert "cooldownPeriod" not in so["spec"]  # KEDA's cooldown is for scaling to zero only
    (door,) = [d for d in r.of_kind("Deployment") if d["metadata"]["labels"]["app.kubernetes.io/component"] == "door"]
    (haproxy,) = door["spec"]["template"]["spec"]["containers"]
    assert re.fullmatch(r"docker\.io/library/haproxy:2\.6(\.\d+)?(@sha256:[0-9a-f]{64})?", haproxy["image"])
    cfg = haproxy_cfg(r)
    assert "agent-check" in cfg and "agent-port 9200" in cfg
    assert "use_backend overflow" in cfg
    # The one-pipeline workloads are gone: every pipeline is a group of the LeaderWorkerSet.
    assert [d["metadata"]["name"] for d in r.of_kind("Deployment")] == [door["metadata"]["name"]]
    assert not r.of_kind("StatefulSet") and not r.of_kind("PodDisruptionBudget")


def test_without_autoscaling_the_fleet_has_no_scaledobject_and_keeps_its_count(helm):  # noqa: F811
    r = fleet(helm, fleet={"pipelines": 2, "autoscaling": {"enabled": False}})
    assert not r.of_kind("ScaledObject")
    (lws,) = r.of_kind("LeaderWorkerSet")
    assert lws["spec"]["replicas"] == 2
    assert "server-template pipeline 1-2 " in haproxy_cfg(r)  # one server slot per pipeline there can be
    assert "server-template pipeline 1-6 " in haproxy_cfg(fleet(helm))  # with autoscaling: maxPipelines


# ----------------------------------------------------------------------------------------------
# Validation with no cluster: the pinned CRDs' openAPIV3Schema, kubernetes-validate, haproxy -c.


def _crd(path: Path) -> dict:
    return json.loads(gzip.decompress(path.read_bytes()))


def _strict(node):
    """A structural schema as JSON Schema that refuses unknown fields (the API server's strict field validation)."""
    if isinstance(node, list):
        return [_strict(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: _strict(v) for k, v in node.items()}
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


def validate_against_crd(obj: dict, crd_path: Path) -> None:
    import jsonschema

    crd = _crd(crd_path)
    group = crd["spec"]["group"]
    (version,) = [v for v in crd["spec"]["versions"] if v["served"] and f"{group}/{v['name']}" == obj["apiVersion"]]
    assert obj["kind"] == crd["spec"]["names"]["kind"]
    schema = _strict(version["schema"]["openAPIV3Schema"])
    body = {k: v for k, v in obj.items() if k != "_template"}
    if not body["metadata"].get("annotations"):
        body["metadata"].pop("annotations", None)
    jsonschema.validate(body, schema, cls=jsonschema.Draft4Validator)


def test_the_crd_fixtures_are_the_pinned_releases_and_refuse_what_their_schemas_refuse():
    import jsonschema

    lws = _crd(LWS_CRD)
    assert lws["metadata"]["name"] == "leaderworkersets.leaderworkerset.x-k8s.io"
    (v1,) = lws["spec"]["versions"]
    assert v1["subresources"]["scale"]["specReplicasPath"] == ".spec.replicas"  # what KEDA's HPA scales
    so = _crd(KEDA_CRD)
    assert so["metadata"]["name"] == "scaledobjects.keda.sh"
    good = {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": {"name": "x"},
        "spec": {"scaleTargetRef": {"name": "x"}, "triggers": [{"type": "prometheus", "metadata": {"a": "b"}}]},
    }
    validate_against_crd(good, KEDA_CRD)
    for bad in (
        {"triggers": [{"type": "prometheus", "metadata": {"threshold": 0.75}}]},  # trigger metadata are strings
        {"minReplicas": 1},  # an HPA field, not a ScaledObject's
        {"triggers": []},  # at least one trigger
    ):
        with pytest.raises(jsonschema.ValidationError):
            validate_against_crd({**good, "spec": {**good["spec"], **bad}}, KEDA_CRD)
    lws_obj = {
        "apiVersion": "leaderworkerset.x-k8s.io/v1",
        "kind": "LeaderWorkerSet",
        "metadata": {"name": "x"},
        "spec": {"leaderWorkerTemplate": {"restartPolicy": "Never", "workerTemplate": {"spec": {"containers": []}}}},
    }
    with pytest.raises(jsonschema.ValidationError, match="Never"):  # not one of the policies
        validate_against_crd(lws_obj, LWS_CRD)


FLEET_CASES = {
    "done-when": {},
    "one-stage": {"stages": {"count": 1, "partition": []}, "model": {"numLayers": 30}},
    "no-tls-no-web": {"security": {"gatewayTLS": {"enabled": False}}, "web": {"enabled": False}},
    "sp2": {"stages": {"count": 2, "sp": 2, "cudaGraphs": False, "partition": []}},
}
# Every case on the default values, the issue's case on every shipped values file.
FLEET_RENDERS = [("default", c) for c in FLEET_CASES] + [(n, "done-when") for n in VALUES_FILES if n != "default"]


@pytest.mark.parametrize("name,case", FLEET_RENDERS)
def test_the_fleet_validates_against_the_pinned_crds_and_kubernetes_schemas(helm, name, case):  # noqa: F811
    from tests.test_helm_chart import KUBE_VERSIONS, _need

    kv = _need("kubernetes_validate", "kubernetes_validate (PyPI: kubernetes-validate)")
    r = fleet(helm, name, **FLEET_CASES[case])
    (lws,) = r.of_kind("LeaderWorkerSet")
    validate_against_crd(lws, LWS_CRD)
    for so in r.of_kind("ScaledObject"):
        validate_against_crd(so, KEDA_CRD)
        assert so["spec"]["minReplicaCount"] <= so["spec"]["maxReplicaCount"]  # the CRD's CEL rule
    # The pod templates inside the LeaderWorkerSet, as core PodTemplates, and every other object.
    for role, template in (("leader", "leaderTemplate"), ("worker", "workerTemplate")):
        t = lws["spec"]["leaderWorkerTemplate"][template]
        body = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": f"{LWS_NAME}-{role}"}, "template": t}
        for version in KUBE_VERSIONS:
            kv.validate(body, version, strict=True)
    for obj in r.objects:
        if obj["apiVersion"].startswith(("leaderworkerset.x-k8s.io/", "keda.sh/", "monitoring.coreos.com/")):
            continue
        body = {k: v for k, v in obj.items() if k != "_template"}
        if not body["metadata"]["annotations"]:
            del body["metadata"]["annotations"]
        for version in KUBE_VERSIONS:
            try:
                kv.validate(body, version, strict=True)
            except kv.ValidationError as exc:
                pytest.fail(
                    f"{obj['_template']}: {body['kind']}/{body['metadata']['name']} invalid for {version}: {exc}"
                )


def test_the_chart_fills_the_same_template_as_up_does(helm):  # noqa: F811
    """One template: Python's string.Template (launcher/door.py's way) with the chart's fills gives the chart's text."""
    import string

    from tests.test_helm_chart import CHART

    cfg = haproxy_cfg(fleet(helm))
    template = (CHART / "files" / "haproxy.cfg.tmpl").read_text()
    bind = re.search(r"^    bind (.+)$", cfg, re.M).group(1)
    servers = re.search(r"^(    server-template pipeline .+)$", cfg, re.M).group(1)
    web = re.search(r"^(    server-template page .+)$", cfg, re.M).group(1)
    filled = string.Template(template).substitute(bind=bind, servers=servers, web=web)
    assert cfg.startswith(filled.rstrip("\n") + "\n")
    assert cfg[len(filled.rstrip("\n")) :].lstrip().startswith("# The pipelines by DNS")  # then the resolvers only
    assert bind == "*:50051 ssl crt /etc/stagecast/door-tls/door.pem alpn h2,http/1.1"


# ----------------------------------------------------------------------------------------------
# One pipeline = one group: leader (coordinator + gateway), workers (stage ranks).


def test_a_group_is_the_leader_and_one_worker_per_stage_rank_all_parsed_by_the_real_cli(helm):  # noqa: F811
    from tests.test_helm_chart import arg_value
    from tests.test_helm_cli_contract import parse

    r = fleet(helm)
    (lws,) = r.of_kind("LeaderWorkerSet")
    v = r.values
    assert lws["spec"]["leaderWorkerTemplate"]["size"] == 1 + v["stages"]["count"]
    specs = pod_specs(lws)
    assert [c["name"] for c in specs["leader"]["containers"]] == ["coordinator", "gateway", "web"]
    assert [c["name"] for c in specs["worker"]["containers"]] == ["stage"]
    leader_dns = f"$(LWS_LEADER_ADDRESS).svc.cluster.local:{v['coordinator']['port']}"
    coord = parse(container(specs["leader"], "coordinator")["args"])
    assert coord.stages == v["stages"]["count"] and coord.mtls
    assert coord.advertise_host == f"$(POD_NAME).{LWS_NAME}.video.svc.cluster.local"  # the leader's own name
    gateway = container(specs["leader"], "gateway")
    gw = parse(gateway["args"])
    # The pipeline's name is its group's (the leader pod's name, "<lws>-<group index>"), its agent on agentPort.
    assert gw.fleet_pipeline_name == "$(POD_NAME)" and gw.fleet_agent_port == v["fleet"]["agentPort"]
    assert gw.fleet_drain_s == v["fleet"]["drainSeconds"] and gw.coordinator == leader_dns
    assert gw.tls_cert is None  # TLS ends at the door
    web = parse(container(specs["leader"], "web")["args"])
    assert web.gateway == "sc-stagecast-gateway.video.svc.cluster.local:50051"  # its streams go through the door
    stage = container(specs["worker"], "stage")
    ns = parse(stage["args"])
    assert ns.coordinator == leader_dns and ns.advertise_host == f"$(POD_NAME).{LWS_NAME}.video.svc.cluster.local"
    assert arg_value(stage["args"], "--index") is None
    # Every pod outlives the drain; the coordinator and stages wait for the gateway's in preStop.
    drain = v["fleet"]["drainSeconds"]
    for role in ("leader", "worker"):
        assert specs[role]["terminationGracePeriodSeconds"] >= drain
    for c in (container(specs["leader"], "coordinator"), stage):
        script = c["lifecycle"]["preStop"]["exec"]["command"]
        assert script[:2] == ["python", "-c"] and f", {v['fleet']['agentPort']})" in script[2]
        compile(script[2], "preStop", "exec")
    # One network per pod: every port of the leader's containers is its own, by number and by name.
    ports = [p for c in specs["leader"]["containers"] for p in c["ports"]]
    assert len({p["containerPort"] for p in ports}) == len(ports)
    assert len({p["name"] for p in ports}) == len(ports)


def test_a_one_stage_pipeline_is_a_group_of_size_one(helm):  # noqa: F811
    from tests.test_helm_cli_contract import parse

    r = fleet(helm, stages={"count": 1, "partition": []}, model={"numLayers": 30})
    (lws,) = r.of_kind("LeaderWorkerSet")
    assert lws["spec"]["leaderWorkerTemplate"]["size"] == 1
    leader = pod_specs(lws)["leader"]
    assert [c["name"] for c in leader["containers"]] == ["coordinator", "gateway", "web", "stage"]
    stage = container(leader, "stage")
    ns = parse(stage["args"])
    assert ns.metrics_port == r.values["fleet"]["leader"]["stageMetricsPort"]
    assert {m["name"] for m in stage["volumeMounts"]} >= {"mtls-stage", "model"}
    assert {v["name"] for v in leader["volumes"]} >= {"mtls-coordinator", "mtls-gateway", "mtls-stage"}
    ports = [p["containerPort"] for c in leader["containers"] for p in c["ports"]]
    assert len(set(ports)) == len(ports)


def test_the_door_finds_the_leaders_by_a_headless_service_and_takes_the_public_services(helm):  # noqa: F811
    r = fleet(helm)
    headless = r.get("Service", f"{LWS_NAME}-gateways")
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    selector = headless["spec"]["selector"]
    assert selector["leaderworkerset.sigs.k8s.io/worker-index"] == "0"
    (lws,) = r.of_kind("LeaderWorkerSet")
    leader_labels = lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["metadata"]["labels"]
    # LWS adds its own name and worker-index labels to the pods; the rest comes from the template.
    lws_labels = {"leaderworkerset.sigs.k8s.io/name": LWS_NAME, "leaderworkerset.sigs.k8s.io/worker-index": "0"}
    assert selector.items() <= {**leader_labels, **lws_labels}.items()
    worker_labels = lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["metadata"]["labels"]
    assert (
        not selector.items() <= {**worker_labels, **lws_labels, "leaderworkerset.sigs.k8s.io/worker-index": "1"}.items()
    )
    cfg = haproxy_cfg(r)
    host = f"{headless['metadata']['name']}.video.svc.cluster.local"
    assert f"server-template pipeline 1-6 {host}:50051 agent-port 9200 resolvers kube" in cfg
    assert "\nresolvers kube\n" in cfg
    leader_ports = {p["name"] for c in pod_specs(lws)["leader"]["containers"] for p in c["ports"]}
    assert {p["targetPort"] for p in headless["spec"]["ports"]} <= leader_ports
    (door,) = [d for d in r.of_kind("Deployment") if d["metadata"]["name"] == f"{RELEASE}-stagecast-door"]
    door_pod = door["spec"]["template"]
    public = r.get("Service", f"{RELEASE}-stagecast-gateway")
    assert public["spec"]["selector"].items() <= door_pod["metadata"]["labels"].items()
    assert public["spec"]["ports"][0]["targetPort"] in {p["name"] for p in door_pod["spec"]["containers"][0]["ports"]}
    # TLS at the door, with the certificate the chart makes for the gateway Service's names.
    tls = next(v for v in door_pod["spec"]["volumes"] if v["name"] == "tls")
    assert tls["secret"]["secretName"] == f"{RELEASE}-stagecast-gateway-tls"
    assert {i["path"] for i in tls["secret"]["items"]} == {"door.pem", "door.pem.key"}
    assert "bind *:50051 ssl crt /etc/stagecast/door-tls/door.pem" in cfg


@pytest.mark.parametrize(
    "overrides,words",
    [
        ({"fleet": {"autoscaling": {"prometheus": {"serverAddress": ""}}}}, "prometheus.serverAddress"),
        ({"fleet": {"pipelines": 7}}, "fleet.pipelines (7) must lie in"),
        (
            {"fleet": {"autoscaling": {"minPipelines": 4, "maxPipelines": 2}, "pipelines": 3}},
            "minPipelines (4) exceeds",
        ),
        ({"fleet": {"door": {"maxPipelines": 2}}}, "fleet.door.maxPipelines (2) is below"),
        ({"fleet": {"agentPort": 50051}}, "ports collide"),
        ({"fleet": {"leader": {"coordinatorMetricsPort": 9100}}}, "ports collide"),
        ({"fullnameOverride": "a" * 40, "fleet": {"door": {"maxPipelines": 1000}}}, "within 52 characters"),
    ],
)
def test_fleet_values_that_cannot_work_are_refused_by_name(helm, overrides, words):  # noqa: F811
    assert words in fleet_error(helm, **overrides)


def test_the_fleet_values_lint_clean_and_match_the_schema(helm):  # noqa: F811
    from tests.test_helm_chart import CHART, KUBE_VERSIONS, _deep_merge

    values = _deep_merge(_load_values("default"), DONE_WHEN)
    report = helm.lint(str(CHART), values, strict=True, kube_version="v" + KUBE_VERSIONS[0])
    assert not report["errors"] and not [m for m in report["messages"] if m["severity"] >= 2], report
    with helm.Chart.load(str(CHART)) as chart:
        chart.validate_schema(values)
    assert "fleet" in fleet_error(helm, fleet={"autoscaling": {"targetUtilization": 1.5}})
