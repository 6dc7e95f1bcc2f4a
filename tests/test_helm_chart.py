"""Render the Helm chart with real Helm and check the manifests.

The renderer is Helm's own Go SDK (``helm.sh/helm/v4`` engine, template funcs, ``fail``,
values.schema.json validation, ``helm lint`` rules), shipped as the shared library inside the
PyPI wheel ``helm-python-sdk`` (import name ``helm_python``); ``.ci/install-helm.sh`` installs it
from ``.ci/helm-requirements.txt``. No cluster is contacted. Every rendered object is validated
offline against the Kubernetes OpenAPI schemas shipped in ``kubernetes-validate`` (strict: unknown
fields are errors); the prometheus-operator ServiceMonitor CRD has no schema there and gets a
structural check instead.

Without the renderer the tests fail when the ``CI`` environment variable is set, and skip
otherwise. A ``helm`` binary on PATH (or ``$HELM_BIN``), when present, is cross-checked too.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import re
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "helm" / "stagecast"
RELEASE = "sc"
NAMESPACE = "video"
# Oldest Kubernetes the chart supports (pod-index label) and the newest schemas we ship.
KUBE_VERSIONS = ("1.28.0", "1.37.0")
VALUES_FILES = {
    "default": None,
    "multinode": CHART / "values-multinode.yaml",
    "cpu": CHART / "values-cpu.yaml",
}
# Parsing the rendered manifests is most of these tests' time: libyaml's safe loader where PyYAML has it (the same
# safe schema), the pure-Python one otherwise.
SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def load_yaml(text: str):
    return yaml.load(text, Loader=SAFE_LOADER)


def load_yaml_all(text: str):
    return yaml.load_all(text, Loader=SAFE_LOADER)


def chart_defaults() -> dict:
    """The chart's values.yaml, parsed."""
    return load_yaml((CHART / "values.yaml").read_text())


INSTALL_HINT = "run `bash .ci/install-helm.sh` (installs .ci/helm-requirements.txt into the active Python)"
WORKLOAD_KINDS = ("Deployment", "StatefulSet")
COMPONENT_SERVICE = {"coordinator": "stagecast-coordinator", "stage": "stagecast-stage", "gateway": "stagecast-gateway"}


def _need(module: str, what: str):
    try:
        return __import__(module)
    except Exception as exc:  # ImportError, or OSError from a broken native library
        msg = f"{what} is not importable ({exc!r}): {INSTALL_HINT}"
        if os.environ.get("CI"):
            pytest.fail(msg, pytrace=False)
        pytest.skip(msg)


@pytest.fixture(scope="session")
def helm():
    mod = _need("helm_python", "the real Helm renderer helm_python (PyPI: helm-python-sdk)")
    assert mod.helm_sdk_version().startswith(("v3.", "v4.")), mod.helm_sdk_version()
    return mod


@pytest.fixture(scope="session")
def kv():
    return _need("kubernetes_validate", "kubernetes_validate (PyPI: kubernetes-validate)")


# No image is published: an operator sets image.repository (an empty one stops the render), and so do the tests.
TEST_IMAGE = "registry.example.com/stagecast"


def _load_values(name: str) -> dict:
    path = VALUES_FILES[name]
    values = load_yaml(path.read_text()) if path else {}
    values.setdefault("image", {}).setdefault("repository", TEST_IMAGE)
    return values


def _deep_merge(base: dict, override: dict) -> dict:
    out = copy.deepcopy(base)
    for key, val in override.items():
        if isinstance(val, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], val)
        else:
            out[key] = copy.deepcopy(val)
    return out


class Rendered:
    """Objects of one render, indexed by kind and name."""

    def __init__(self, manifests: dict[str, str], values: dict):
        self.manifests = manifests
        self.values = values  # user-supplied values merged over values.yaml
        self.objects: list[dict] = []
        for template, text in sorted(manifests.items()):
            if template.endswith("NOTES.txt"):
                continue
            for doc in load_yaml_all(text):
                if doc:
                    doc.setdefault("metadata", {}).setdefault("annotations", {})
                    self.objects.append({**doc, "_template": template})

    def of_kind(self, kind: str) -> list[dict]:
        return [o for o in self.objects if o["kind"] == kind]

    def get(self, kind: str, name: str) -> dict:
        found = [o for o in self.objects if o["kind"] == kind and o["metadata"]["name"] == name]
        assert len(found) == 1, f"expected one {kind}/{name}, got {[o['metadata']['name'] for o in self.of_kind(kind)]}"
        return found[0]

    def component(self, kind: str, component: str) -> dict:
        found = [
            o
            for o in self.of_kind(kind)
            if o["metadata"].get("labels", {}).get("app.kubernetes.io/component") == component
        ]
        assert len(found) == 1, f"expected one {kind} of component {component}, got {len(found)}"
        return found[0]

    def workloads(self) -> list[dict]:
        return [o for o in self.objects if o["kind"] in WORKLOAD_KINDS]


@functools.cache
def _render_cached(helm, values_json: str) -> dict[str, str]:
    with helm.Chart.load(str(CHART)) as chart:
        return chart.render(json.loads(values_json), name=RELEASE, namespace=NAMESPACE, is_install=True)


def render(helm, name: str = "default", **overrides) -> Rendered:
    values = _deep_merge(_load_values(name), overrides)
    manifests = _render_cached(helm, json.dumps(values, sort_keys=True))
    defaults = chart_defaults()
    return Rendered(manifests, _deep_merge(defaults, values))


def render_error(helm, name: str = "default", **overrides) -> str:
    values = _deep_merge(_load_values(name), overrides)
    with helm.Chart.load(str(CHART)) as chart:
        with pytest.raises(helm.HelmError) as info:
            chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    return str(info.value)


def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def arg_value(args: list[str], flag: str) -> str | None:
    if flag not in args:
        return None
    assert args.count(flag) == 1, f"{flag} given twice in {args}"
    return args[args.index(flag) + 1]


def main_container(workload: dict) -> dict:
    """The workload's own container (a gateway pod also runs the ``web`` container beside it)."""
    containers = [c for c in workload["spec"]["template"]["spec"]["containers"] if c["name"] != "web"]
    assert len(containers) == 1, containers
    return containers[0]


def fqdn(service: str, port: int | str | None = None) -> str:
    host = f"{service}.{NAMESPACE}.svc.cluster.local"
    return f"{host}:{port}" if port is not None else host


# ----------------------------------------------------------------------------------------------
# Lint and schema-valid output for every shipped values file.


@pytest.mark.parametrize("name", list(VALUES_FILES))
def test_helm_lint_is_clean(helm, name):
    report = helm.lint(str(CHART), _load_values(name), strict=True, kube_version="v" + KUBE_VERSIONS[0])
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert not report["errors"] and not problems, report


@pytest.mark.parametrize("name", list(VALUES_FILES))
def test_values_files_match_values_schema(helm, name):
    with helm.Chart.load(str(CHART)) as chart:
        chart.validate_schema(_load_values(name))


@pytest.mark.parametrize("name", list(VALUES_FILES))
def test_manifests_validate_against_kubernetes_schemas(helm, kv, name):
    r = render(helm, name)
    kinds = {o["kind"] for o in r.objects}
    assert {"Deployment", "StatefulSet", "Service", "NetworkPolicy", "Pod", "ServiceAccount"} <= kinds, kinds
    checked = 0
    for obj in r.objects:
        body = {k: v for k, v in obj.items() if k != "_template"}
        assert body["metadata"]["name"], obj["_template"]
        if not body["metadata"]["annotations"]:
            del body["metadata"]["annotations"]
        if body["apiVersion"].startswith(("monitoring.coreos.com/", "cert-manager.io/")):
            # CRDs: no schema in kubernetes-validate; structural checks in test_service_monitor_and_dashboard and
            # test_cert_manager_signs_the_internal_certificates.
            continue
        for version in KUBE_VERSIONS:
            try:
                kv.validate(body, version, strict=True)
            except kv.ValidationError as exc:
                pytest.fail(
                    f"{obj['_template']}: {body['kind']}/{body['metadata']['name']} invalid for k8s {version}: {exc}"
                )
        checked += 1
    assert checked >= 10, checked


@pytest.mark.parametrize("name", list(VALUES_FILES))
def test_names_are_valid_dns_labels(helm, name):
    r = render(helm, name)
    for obj in r.objects:
        obj_name = obj["metadata"]["name"]
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", obj_name) and len(obj_name) <= 63, obj_name
        assert obj["metadata"].get("namespace") == NAMESPACE, obj_name
    count = int(r.values["stages"]["count"])
    sts = r.component("StatefulSet", "stage")
    assert len(f"{sts['metadata']['name']}-{count - 1}") <= 63


# ----------------------------------------------------------------------------------------------
# Stage pods: index, rendezvous, placement.


@pytest.mark.parametrize("name", list(VALUES_FILES))
def test_stage_pods_get_index_and_rendezvous(helm, name):
    r = render(helm, name)
    v = r.values
    sts = r.component("StatefulSet", "stage")
    spec = sts["spec"]
    assert spec["replicas"] == v["stages"]["count"]
    assert spec["podManagementPolicy"] == "Parallel"

    # Headless Service of the StatefulSet: stable per-pod DNS, resolvable before Ready.
    headless = r.get("Service", spec["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["publishNotReadyAddresses"] is True
    pod_labels = spec["template"]["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= pod_labels.items()
    assert headless["spec"]["selector"].items() <= pod_labels.items()
    headless_ports = {p["name"]: p["port"] for p in headless["spec"]["ports"]}
    assert headless_ports["grpc"] == v["stages"]["port"]

    c = main_container(sts)
    env = env_of(c)
    # Index from the pod-index label (downward API), not from an argument.
    assert env["STAGECAST_STAGE_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"] == (
        "metadata.labels['apps.kubernetes.io/pod-index']"
    )
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    args = c["args"]
    assert args[0] == "stage" and "--index" not in args

    # Coordinator address points at the coordinator Service, which selects the coordinator pod.
    coord_svc = r.component("Service", "coordinator")
    coord_port = next(p["port"] for p in coord_svc["spec"]["ports"] if p["name"] == "grpc")
    assert arg_value(args, "--coordinator") == fqdn(coord_svc["metadata"]["name"], coord_port)
    coord = r.component("Deployment", "coordinator")
    assert coord_svc["spec"]["selector"].items() <= coord["spec"]["template"]["metadata"]["labels"].items()

    # Advertised host = the pod's name under the headless Service; $(POD_NAME) is defined before use.
    advertise = arg_value(args, "--advertise-host")
    assert advertise == "$(POD_NAME)." + fqdn(headless["metadata"]["name"])
    hosts = {advertise.replace("$(POD_NAME)", f"{sts['metadata']['name']}-{i}") for i in range(spec["replicas"])}
    assert len(hosts) == v["stages"]["count"]
    assert "--dist-port" not in args
    assert arg_value(args, "--port") == str(v["stages"]["port"])
    # The pod's own address only: gRPC, metrics and the data plane's interface (NCCL/GLOO_SOCKET_IFNAME) follow it.
    assert arg_value(args, "--host") == "$(POD_IP)"
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert arg_value(args, "--device") == v["device"]
    assert arg_value(args, "--metrics-port") == str(v["metrics"]["port"])
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    health = v["stages"]["healthPort"]
    assert ports == {"grpc": v["stages"]["port"], "metrics": v["metrics"]["port"], "health": health}


def test_cfg_parallel_runs_two_pipelines_of_stage_pods(helm):
    r = render(helm, stages={"count": 2, "cfgParallel": 2})
    assert r.component("StatefulSet", "stage")["spec"]["replicas"] == 4
    args = main_container(r.component("Deployment", "coordinator"))["args"]
    assert arg_value(args, "--stages") == "2" and arg_value(args, "--cfg-parallel") == "2"
    plain = main_container(render(helm).component("Deployment", "coordinator"))["args"]
    assert "--cfg-parallel" not in plain
    assert "cfgParallel" in render_error(helm, stages={"count": 2, "cfgParallel": 3})
    both = {"count": 2, "cfgParallel": 2, "sp": 2, "cudaGraphs": False}
    assert "does not compose with stages.sp" in render_error(helm, stages=both)


@pytest.mark.parametrize("name", list(VALUES_FILES))
def test_coordinator_and_gateway_arguments(helm, name):
    r = render(helm, name)
    v = r.values
    coord = main_container(r.component("Deployment", "coordinator"))
    assert r.component("Deployment", "coordinator")["spec"]["replicas"] == 1
    args = coord["args"]
    assert args[0] == "coordinator"
    assert arg_value(args, "--stages") == str(v["stages"]["count"])
    assert arg_value(args, "--port") == str(v["coordinator"]["port"])
    partition = v["stages"]["partition"]
    if partition:
        assert arg_value(args, "--partition") == ",".join(str(p) for p in partition)
    else:
        assert "--partition" not in args

    gw = main_container(r.component("Deployment", "gateway"))
    args = gw["args"]
    assert args[0] == "gateway"
    coord_svc = r.component("Service", "coordinator")
    assert arg_value(args, "--coordinator") == fqdn(coord_svc["metadata"]["name"], v["coordinator"]["port"])
    assert arg_value(args, "--max-streams") == str(v["gateway"]["maxStreams"])
    assert arg_value(args, "--device") == v["device"]


@pytest.mark.unit
def test_the_gateway_gets_per_tenant_quotas_from_the_values(helm):
    flags = {
        "streams": "--max-streams-per-client",
        "unpaced": "--max-unpaced-per-client",
        "pending": "--max-pending-per-client",
        "watchers": "--max-watchers-per-client",
    }
    args = main_container(render(helm).component("Deployment", "gateway"))["args"]
    # The defaults: every stream slot for one tenant (it may reach capacity alone), 2 unpaced, 32 waiting, 4 watching.
    assert {k: arg_value(args, f) for k, f in flags.items()} == {
        "streams": "0",
        "unpaced": "2",
        "pending": "32",
        "watchers": "4",
    }
    quotas = {"streams": 3, "unpaced": 1, "pending": 8, "watchers": 2}
    args = main_container(render(helm, gateway={"quotas": quotas}).component("Deployment", "gateway"))["args"]
    assert {k: arg_value(args, f) for k, f in flags.items()} == {k: str(n) for k, n in quotas.items()}
    assert "/gateway/quotas/pending" in render_error(helm, gateway={"quotas": {"pending": 0}})


@pytest.mark.parametrize("name", list(VALUES_FILES))
def test_gpu_speed_flags_follow_the_values(helm, name):
    r = render(helm, name)
    v = r.values
    stage = main_container(r.component("StatefulSet", "stage"))["args"]
    gw = main_container(r.component("Deployment", "gateway"))["args"]
    if v["device"] == "cuda":
        assert arg_value(stage, "--dtype") == arg_value(gw, "--vae-dtype") == v["dtype"]
        assert ("--cuda-graphs" in stage) == v["stages"]["cudaGraphs"]
        assert ("--fp8" in stage) == v["stages"]["fp8"]
        assert ("--vae-compile" in gw) == v["gateway"]["vaeCompile"]
    else:  # the CPU demo runs float32 and eager everywhere
        assert not {"--dtype", "--cuda-graphs", "--fp8"} & set(stage)
        assert not {"--vae-dtype", "--vae-compile", "--vae-devices"} & set(gw)


def test_fp8_is_opt_in_and_refused_where_the_stages_would_refuse_it(helm):
    stage = main_container(render(helm, stages={"fp8": True}).component("StatefulSet", "stage"))["args"]
    assert stage.count("--fp8") == 1 and arg_value(stage, "--dtype") == "bfloat16"
    assert "--fp8" not in main_container(render(helm).component("StatefulSet", "stage"))["args"]
    assert 'stages.fp8 needs device "cuda" (got "cpu")' in render_error(helm, "cpu", stages={"fp8": True})
    err = render_error(helm, dtype="float16", stages={"fp8": True})
    assert 'stages.fp8 needs dtype "bfloat16" (got "float16")' in err


def test_a_multi_gpu_gateway_cuts_its_vae_over_every_gpu(helm):
    gw = main_container(render(helm, gateway={"gpus": 2}).component("Deployment", "gateway"))
    assert arg_value(gw["args"], "--vae-devices") == "cuda:0,cuda:1"
    assert gw["resources"]["limits"]["nvidia.com/gpu"] == 2
    one = main_container(render(helm).component("Deployment", "gateway"))["args"]
    assert "--vae-devices" not in one
    off = main_container(render(helm, stages={"cudaGraphs": False}).component("StatefulSet", "stage"))["args"]
    assert "--cuda-graphs" not in off


@pytest.mark.unit
def test_a_tiny_decoder_on_the_model_volume_reaches_the_gateways_args(helm):
    values = {"tinyDecoder": "taehv/taew2_1.pth", "defaultDecoder": "tiny"}
    r = render(helm, gateway=values, model={"mountPath": "/weights"})
    args = main_container(r.component("Deployment", "gateway"))["args"]
    assert arg_value(args, "--tiny-decoder") == "/weights/taehv/taew2_1.pth"
    assert arg_value(args, "--default-decoder") == "tiny"
    plain = main_container(render(helm).component("Deployment", "gateway"))["args"]
    assert "--tiny-decoder" not in plain and "--default-decoder" not in plain  # the full VAE only, the default
    escape = render_error(helm, gateway={"tinyDecoder": "../etc/taew2_1.pth"})
    assert "gateway.tinyDecoder" in escape and "inside the model volume" in escape


def test_the_decoder_memory_budget_reaches_the_gateways_args_and_parses(helm):
    from tests.test_helm_cli_contract import parse

    args = main_container(render(helm, gateway={"decoderMemoryGib": 40.5}).component("Deployment", "gateway"))["args"]
    assert arg_value(args, "--decoder-memory-gib") == "40.5"
    assert parse(args).decoder_memory_gib == 40.5  # the real CLI takes it
    plain = main_container(render(helm).component("Deployment", "gateway"))["args"]
    assert "--decoder-memory-gib" not in plain  # 0: derived by the gateway
    assert "decoderMemoryGib" in render_error(helm, gateway={"decoderMemoryGib": -1})


def test_multinode_spreads_stages_with_partition(helm):
    r = render(helm, "multinode")
    sts = r.component("StatefulSet", "stage")
    assert sts["spec"]["replicas"] == 4
    coord_args = main_container(r.component("Deployment", "coordinator"))["args"]
    assert arg_value(coord_args, "--partition") == "6,8,8,8"
    terms = sts["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]
    assert terms[0]["topologyKey"] == "kubernetes.io/hostname"
    assert terms[0]["labelSelector"]["matchLabels"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()
    # tpl in values: the gateway's anti-affinity names the release.
    gw_aff = r.component("Deployment", "gateway")["spec"]["template"]["spec"]["affinity"]
    term = gw_aff["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"]
    assert term["labelSelector"]["matchLabels"]["app.kubernetes.io/instance"] == RELEASE


def test_default_keeps_stages_packable_on_one_node(helm):
    sts = render(helm).component("StatefulSet", "stage")
    assert "affinity" not in sts["spec"]["template"]["spec"]


# ----------------------------------------------------------------------------------------------
# GPUs, model volume, /dev/shm.


@pytest.mark.parametrize("name", list(VALUES_FILES))
def test_gpu_requests_equal_limits(helm, name):
    r = render(helm, name)
    v = r.values
    for wl in r.workloads() + r.of_kind("Pod"):
        pod = wl["spec"]["template"]["spec"] if wl["kind"] in WORKLOAD_KINDS else wl["spec"]
        for c in pod.get("initContainers", []) + pod["containers"]:
            res = c.get("resources", {})
            req = res.get("requests", {}).get("nvidia.com/gpu")
            lim = res.get("limits", {}).get("nvidia.com/gpu")
            assert req == lim, f"{wl['metadata']['name']}/{c['name']}: gpu requests {req} != limits {lim}"
    stage = main_container(r.component("StatefulSet", "stage"))["resources"]
    gateway = main_container(r.component("Deployment", "gateway"))["resources"]
    coord = main_container(r.component("Deployment", "coordinator"))["resources"]
    assert "nvidia.com/gpu" not in coord.get("limits", {})
    if v["device"] == "cuda":
        assert stage["limits"]["nvidia.com/gpu"] == v["stages"]["gpusPerStage"] >= 1
        assert gateway["limits"]["nvidia.com/gpu"] == v["gateway"]["gpus"]
    else:
        assert "nvidia.com/gpu" not in stage.get("limits", {}) and "nvidia.com/gpu" not in gateway.get("limits", {})


@pytest.mark.unit
def test_more_than_one_gpu_per_stage_is_refused_since_a_stage_drives_one(helm):
    err = render_error(helm, stages={"gpusPerStage": 2})
    assert "stages.gpusPerStage is 2 but a stage process drives one GPU" in err and "stages.sp" in err
    res = main_container(render(helm, stages={"gpusPerStage": 1}).component("StatefulSet", "stage"))["resources"]
    assert res["requests"]["nvidia.com/gpu"] == res["limits"]["nvidia.com/gpu"] == 1
    cpu = render(helm, "cpu", stages={"gpusPerStage": 2})  # no GPU is requested on cpu, so nothing to refuse
    assert "nvidia.com/gpu" not in str(main_container(cpu.component("StatefulSet", "stage"))["resources"])


@pytest.mark.parametrize("name", list(VALUES_FILES))
def test_model_volume_and_shm(helm, name):
    r = render(helm, name)
    v = r.values
    checkpoint = f"{v['model']['mountPath'].rstrip('/')}/{v['model']['subPath']}"
    for component, kind in (("stage", "StatefulSet"), ("gateway", "Deployment")):
        wl = r.component(kind, component)
        pod = wl["spec"]["template"]["spec"]
        c = main_container(wl)
        assert arg_value(c["args"], "--checkpoint") == checkpoint
        volumes = {vol["name"]: vol for vol in pod["volumes"]}
        mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
        model_mount = mounts[v["model"]["mountPath"]]
        assert model_mount["readOnly"] is True
        model_vol = volumes[model_mount["name"]]
        if v["model"]["demo"]["enabled"]:
            assert "emptyDir" in model_vol
            (init,) = pod["initContainers"]
            assert init["args"] == ["demo-checkpoint", "--out", checkpoint]
            assert any(
                m["name"] == model_mount["name"] and m["mountPath"] == v["model"]["mountPath"]
                for m in init["volumeMounts"]
            )
        elif v["model"]["pvc"]["claimName"]:
            assert model_vol["persistentVolumeClaim"]["claimName"] == v["model"]["pvc"]["claimName"]
            inits = [c["name"] for c in pod.get("initContainers", [])]
            assert inits == (["wait-for-model"] if v["model"]["fill"]["enabled"] else [])
        shm = volumes[mounts["/dev/shm"]["name"]]["emptyDir"]
        assert shm["medium"] == "Memory"
        assert shm["sizeLimit"] == v[{"stage": "stages"}.get(component, component)]["shm"]["sizeLimit"]


def _containers(obj: dict) -> list[dict]:
    spec = obj["spec"]["template"]["spec"] if "template" in obj["spec"] else obj["spec"]
    return spec.get("initContainers", []) + spec["containers"]


@pytest.mark.parametrize("name", list(VALUES_FILES))
def test_every_container_has_a_read_only_root_and_writes_only_to_empty_dirs(helm, name):
    r = render(helm, name)
    pods = r.workloads() + r.of_kind("Pod")
    assert {"Pod", "Deployment", "StatefulSet"} <= {o["kind"] for o in pods}
    for obj in pods:
        spec = obj["spec"]["template"]["spec"] if "template" in obj["spec"] else obj["spec"]
        volumes = {vol["name"]: vol for vol in spec.get("volumes", [])}
        for c in _containers(obj):
            where = (obj["metadata"]["name"], c["name"])
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False, where
            mounts = {m["mountPath"]: m for m in c.get("volumeMounts", [])}
            assert "emptyDir" in volumes[mounts["/tmp"]["name"]], where
            # Every writable mount is an emptyDir; everything else is mounted read-only.
            for m in mounts.values():
                vol = volumes[m["name"]]
                assert "emptyDir" in vol or m.get("readOnly") is True, (where, m)
            # What caches on disk (HOME, torch.compile, Triton, CUDA) writes under /tmp.
            env = {e["name"]: e.get("value") for e in c.get("env", [])}
            if c["name"] not in ("demo-checkpoint", "wait-for-model"):  # these two cache nothing
                for var in ("HOME", "XDG_CACHE_HOME", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "CUDA_CACHE_PATH"):
                    assert env[var].startswith("/tmp"), (where, var)


def test_host_path_model(helm):
    r = render(helm, model={"pvc": {"claimName": ""}, "hostPath": {"path": "/data/wan"}})
    pod = r.component("StatefulSet", "stage")["spec"]["template"]["spec"]
    (vol,) = [vol for vol in pod["volumes"] if vol["name"] == "model"]
    assert vol["hostPath"] == {"path": "/data/wan", "type": "Directory"}


def test_cpu_values_are_cpu_only_demo(helm):
    r = render(helm, "cpu")
    assert r.values["device"] == "cpu"
    for wl in r.workloads():
        for c in wl["spec"]["template"]["spec"]["containers"]:
            assert "nvidia.com/gpu" not in json.dumps(c.get("resources", {}))
    init = r.component("StatefulSet", "stage")["spec"]["template"]["spec"]["initContainers"][0]
    assert init["args"] == ["demo-checkpoint", "--out", "/models/demo"]
    assert not r.of_kind("PodDisruptionBudget")


# ----------------------------------------------------------------------------------------------
# Probes, tracing.


@pytest.mark.parametrize("name", list(VALUES_FILES))
def test_probes_use_grpc_health(helm, name):
    r = render(helm, name)
    for wl in r.workloads():
        component = wl["metadata"]["labels"]["app.kubernetes.io/component"]
        c = main_container(wl)
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        # The gRPC ports ask for a client certificate (mTLS) or speak TLS, and client load on the public port must not
        # fail a probe: every probe calls a health-only port of its own.
        values_key = {"stage": "stages"}.get(component, component)
        health_port = ports["health"]
        assert health_port == r.values[values_key]["healthPort"] and health_port != ports["grpc"]
        assert arg_value(c["args"], "--health-port") == str(health_port)
        for probe_name in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = c[probe_name]
            assert set(probe) & {"httpGet", "exec", "tcpSocket"} == set(), (component, probe)
            assert probe["grpc"]["port"] == health_port, (component, probe_name)
            assert isinstance(probe["grpc"]["service"], str)
        startup = c["startupProbe"]
        budget = startup["failureThreshold"] * startup["periodSeconds"]
        if component in ("stage", "gateway") and r.values["device"] == "cuda":
            assert budget >= 600, f"{component}: startup budget {budget}s is too short for weight loading"
        assert budget >= 120, (component, budget)


def test_stage_readiness_means_serving_in_a_generation_and_liveness_means_alive(helm):
    from coordinator.server import SERVICE_NAME as COORDINATOR_HEALTH
    from stage_service.server import SERVICE_NAME as STAGE_HEALTH

    r = render(helm)
    stage = main_container(r.component("StatefulSet", "stage"))
    assert stage["readinessProbe"]["grpc"]["service"] == STAGE_HEALTH  # NOT_SERVING while waiting to join
    assert stage["startupProbe"]["grpc"]["service"] == stage["livenessProbe"]["grpc"]["service"] == ""
    # Stages register through the coordinator Service while no generation is formed: it must stay routable.
    coordinator = main_container(r.component("Deployment", "coordinator"))
    services = {coordinator[p]["grpc"]["service"] for p in ("startupProbe", "readinessProbe", "livenessProbe")}
    assert services == {""} and COORDINATOR_HEALTH not in services


def test_probe_service_name_is_configurable(helm):
    r = render(helm, stages={"probes": {"readiness": {"service": "stagecast.v1.Stage"}}})
    c = main_container(r.component("StatefulSet", "stage"))
    assert c["readinessProbe"]["grpc"] == {"port": 8081, "service": "stagecast.v1.Stage"}
    assert c["livenessProbe"]["grpc"]["service"] == ""


@pytest.mark.parametrize("name", list(VALUES_FILES))
def test_otel_env_on_every_component(helm, name):
    r = render(helm, name)
    t = r.values["tracing"]
    pods = [(wl["metadata"]["labels"]["app.kubernetes.io/component"], main_container(wl)) for wl in r.workloads()]
    pods += [("test", p["spec"]["containers"][0]) for p in r.of_kind("Pod")]
    assert {c for c, _ in pods} >= {"coordinator", "stage", "gateway"}
    service_names = set()
    for component, c in pods:
        env = env_of(c)
        names = list(env)
        service_names.add(env["OTEL_SERVICE_NAME"]["value"])
        if component in COMPONENT_SERVICE:
            assert env["OTEL_SERVICE_NAME"]["value"] == COMPONENT_SERVICE[component]
        attrs = dict(pair.split("=", 1) for pair in env["OTEL_RESOURCE_ATTRIBUTES"]["value"].split(","))
        assert attrs["stagecast.component"] == component
        assert attrs["k8s.pod.name"] == "$(POD_NAME)"
        assert names.index("POD_NAME") < names.index("OTEL_RESOURCE_ATTRIBUTES")
        for key, val in t["resourceAttributes"].items():
            assert attrs[key] == str(val)
        if t["enabled"]:
            assert env["OTEL_EXPORTER_OTLP_ENDPOINT"]["value"] == t["endpoint"]
            assert env["OTEL_EXPORTER_OTLP_PROTOCOL"]["value"] == t["protocol"]
            assert env["OTEL_TRACES_SAMPLER"]["value"] == t["sampler"]
            assert float(env["OTEL_TRACES_SAMPLER_ARG"]["value"]) == float(t["ratio"])
            assert env["OTEL_SDK_DISABLED"]["value"] == "false"
        else:
            assert env["OTEL_SDK_DISABLED"]["value"] == "true"
            assert env["OTEL_TRACES_EXPORTER"]["value"] == "none"
            assert "OTEL_EXPORTER_OTLP_ENDPOINT" not in env
    assert len(service_names) == len(pods)


def test_multinode_enables_tracing(helm):
    env = env_of(main_container(render(helm, "multinode").component("StatefulSet", "stage")))
    assert env["OTEL_TRACES_SAMPLER_ARG"]["value"] == "0.05"
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"]["value"].startswith("http")


# ----------------------------------------------------------------------------------------------
# Exposure and network policy.


@pytest.mark.parametrize("name", list(VALUES_FILES))
def test_only_gateway_service_is_exposed(helm, name):
    r = render(helm, name)
    v = r.values
    gw_public = r.get("Service", f"{RELEASE}-stagecast-gateway")
    assert gw_public["spec"]["type"] == v["gateway"]["service"]["type"]
    # gRPC only: the live page (stagecast web) has a ClusterIP Service of its own; metrics too.
    assert [p["name"] for p in gw_public["spec"]["ports"]] == ["grpc"]
    for svc in r.of_kind("Service"):
        if svc is gw_public:
            continue
        assert svc["spec"].get("type", "ClusterIP") == "ClusterIP", svc["metadata"]["name"]
        assert "externalIPs" not in svc["spec"]
    assert not r.of_kind("Ingress")
    for wl in r.workloads() + r.of_kind("Pod"):
        pod = wl["spec"]["template"]["spec"] if wl["kind"] in WORKLOAD_KINDS else wl["spec"]
        assert not pod.get("hostNetwork") and not pod.get("hostPID")
        for c in pod["containers"]:
            assert all("hostPort" not in p for p in c.get("ports", []))


def test_gateway_service_type_is_configurable(helm):
    r = render(helm, gateway={"service": {"type": "LoadBalancer", "loadBalancerSourceRanges": ["10.0.0.0/8"]}})
    svc = r.get("Service", f"{RELEASE}-stagecast-gateway")
    assert svc["spec"]["type"] == "LoadBalancer"
    assert svc["spec"]["loadBalancerSourceRanges"] == ["10.0.0.0/8"]
    assert render(helm, "multinode").get("Service", f"{RELEASE}-stagecast-gateway")["spec"]["type"] == "LoadBalancer"


@pytest.mark.parametrize("name", list(VALUES_FILES))
def test_network_policies_restrict_to_release(helm, name):
    r = render(helm, name)
    v = r.values
    release_peer = {
        "podSelector": {"matchLabels": {"app.kubernetes.io/instance": RELEASE, "app.kubernetes.io/name": "stagecast"}}
    }

    def peer(component):
        labels = {"app.kubernetes.io/instance": RELEASE, "app.kubernetes.io/name": "stagecast"}
        return {"podSelector": {"matchLabels": {**labels, "app.kubernetes.io/component": component}}}

    metrics_peers = v["networkPolicy"]["metrics"]["from"]
    assert metrics_peers, "the shipped values let a monitoring namespace scrape"
    expected = {
        # The coordinator's gRPC port (control plane and the stages' rendezvous) only from stages and gateways.
        "coordinator": [([peer("stage"), peer("gateway")], [{"port": "grpc", "protocol": "TCP"}])],
        # A stage's gRPC port only from the coordinator; its data plane (ephemeral ports) only from stages.
        "stage": [
            ([peer("coordinator")], [{"port": "grpc", "protocol": "TCP"}]),
            ([peer("stage")], [{"port": 1024, "endPort": 65535, "protocol": "TCP"}]),
        ],
    }
    for component, rules in expected.items():
        np = r.component("NetworkPolicy", component)
        wl = r.component("StatefulSet" if component == "stage" else "Deployment", component)
        assert np["spec"]["podSelector"]["matchLabels"].items() <= wl["spec"]["template"]["metadata"]["labels"].items()
        assert np["spec"]["policyTypes"] == ["Ingress"]
        metrics = [([release_peer, *metrics_peers], [{"port": "metrics", "protocol": "TCP"}])]
        got = [(rule["from"], rule["ports"]) for rule in np["spec"]["ingress"]]
        assert got == rules + metrics, component
    # Release pods carry the labels the peers select on.
    for wl in r.workloads() + r.of_kind("Pod"):
        labels = (
            wl["spec"]["template"]["metadata"]["labels"] if wl["kind"] in WORKLOAD_KINDS else wl["metadata"]["labels"]
        )
        assert release_peer["podSelector"]["matchLabels"].items() <= labels.items()
    # Gateway: gRPC open (networkPolicy.gateway.from is empty), metrics not.
    gw = r.component("NetworkPolicy", "gateway")
    grpc_rule = next(rule for rule in gw["spec"]["ingress"] if rule["ports"][0].get("port") == "grpc")
    assert "from" not in grpc_rule and [p["port"] for p in grpc_rule["ports"]] == ["grpc", "health"]
    gw_pod = r.component("Deployment", "gateway")["spec"]["template"]["spec"]
    gw_ports = {p["name"] for c in gw_pod["containers"] for p in c["ports"]}
    assert gw_ports == {"grpc", "health", "metrics", "http"}  # every port the policies name exists
    metrics_rule = next(rule for rule in gw["spec"]["ingress"] if rule["ports"][0].get("port") == "metrics")
    assert metrics_rule["from"]
    # The page only from the release (not exposed by default); WebRTC media on UDP (aiortc's ports are random).
    web_rules = [rule for rule in gw["spec"]["ingress"] if rule["ports"][0].get("port") in (None, "http")]
    assert [rule["ports"] for rule in web_rules] == [[{"port": "http", "protocol": "TCP"}], [{"protocol": "UDP"}]]
    assert web_rules[0]["from"] == [release_peer]


INGRESS_PEER = {
    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress-nginx"}},
    "podSelector": {"matchLabels": {"app.kubernetes.io/name": "ingress-nginx"}},
}


def _page_rule(r) -> dict:
    rules = r.component("NetworkPolicy", "gateway")["spec"]["ingress"]
    (rule,) = [rule for rule in rules if rule["ports"] == [{"port": "http", "protocol": "TCP"}]]
    return rule


@pytest.mark.unit
@pytest.mark.parametrize("name", list(VALUES_FILES))
def test_by_default_the_page_is_not_exposed_outside_the_release(helm, name):
    r = render(helm, name)
    page = r.get("Service", f"{RELEASE}-stagecast-gateway-web")
    assert page["spec"]["type"] == "ClusterIP" and [p["name"] for p in page["spec"]["ports"]] == ["http"]
    for svc in r.of_kind("Service"):  # the page's port is on no Service that may leave the cluster
        if svc["spec"].get("type", "ClusterIP") != "ClusterIP":
            assert r.values["web"]["port"] not in [p.get("targetPort") for p in svc["spec"]["ports"]]
            assert "http" not in [p.get("targetPort") for p in svc["spec"]["ports"]]
    assert not r.of_kind("Ingress")
    release = {"app.kubernetes.io/instance": RELEASE, "app.kubernetes.io/name": "stagecast"}
    assert _page_rule(r)["from"] == [{"podSelector": {"matchLabels": release}}]


@pytest.mark.unit
def test_an_exposed_page_is_served_with_tls_and_reached_only_from_the_allow_list(helm):
    web = {"ingress": {"enabled": True, "host": "live.example.com", "from": [INGRESS_PEER]}}
    r = render(helm, web={**web, "ingress": {**web["ingress"], "certManager": {"clusterIssuer": "letsencrypt"}}})
    (ingress,) = r.of_kind("Ingress")
    assert ingress["metadata"]["annotations"]["cert-manager.io/cluster-issuer"] == "letsencrypt"
    assert ingress["spec"]["tls"] == [
        {"secretName": f"{RELEASE}-stagecast-gateway-web-tls", "hosts": ["live.example.com"]}
    ]
    backend = ingress["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend == {"name": f"{RELEASE}-stagecast-gateway-web", "port": {"name": "http"}}
    release = {"app.kubernetes.io/instance": RELEASE, "app.kubernetes.io/name": "stagecast"}
    assert _page_rule(r)["from"] == [{"podSelector": {"matchLabels": release}}, INGRESS_PEER]
    own = [{"secretName": "live-tls", "hosts": ["live.example.com"]}]
    (ingress,) = render(helm, web={"ingress": {**web["ingress"], "tls": own}}).of_kind("Ingress")
    assert ingress["spec"]["tls"] == own and "cert-manager.io/cluster-issuer" not in ingress["metadata"].get(
        "annotations", {}
    )
    # Exposed over plain HTTP, or open to everyone: refused when the chart renders.
    assert "serve it with TLS" in render_error(helm, web=web)
    no_peers = {"ingress": {**web["ingress"], "from": [], "tls": own}}
    assert "web.ingress.from" in render_error(helm, web=no_peers)
    both = {"clusterIssuer": "a", "issuer": "b"}
    assert "only one of" in render_error(helm, web={"ingress": {**web["ingress"], "certManager": both}})


def test_metrics_scrapers_are_configurable(helm):
    peer = {
        "namespaceSelector": {"matchLabels": {"team": "obs"}},
        "podSelector": {"matchLabels": {"app": "prometheus"}},
    }
    r = render(helm, networkPolicy={"metrics": {"from": [peer]}})
    for component in ("coordinator", "stage", "gateway"):
        rules = r.component("NetworkPolicy", component)["spec"]["ingress"]
        metrics_rules = [rule for rule in rules if peer in rule.get("from", [])]
        assert len(metrics_rules) == 1 and metrics_rules[0]["ports"] == [{"port": "metrics", "protocol": "TCP"}]
        # The list replaces the default peer, it is not merged into it.
        assert "monitoring" not in json.dumps(rules)
    r = render(helm, networkPolicy={"metrics": {"from": []}})
    rules = r.component("NetworkPolicy", "stage")["spec"]["ingress"]
    metrics_rules = [rule for rule in rules if rule["ports"] == [{"port": "metrics", "protocol": "TCP"}]]
    assert len(metrics_rules) == 1 and len(metrics_rules[0]["from"]) == 1  # the release only
    assert not render(helm, networkPolicy={"enabled": False}).of_kind("NetworkPolicy")


# ----------------------------------------------------------------------------------------------
# Monitoring, PDB, helm test.


def test_service_monitor_and_dashboard(helm):
    r = render(helm, "multinode")
    (sm,) = r.of_kind("ServiceMonitor")
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    (ep,) = sm["spec"]["endpoints"]
    assert ep["port"] == "metrics" and ep["path"] == "/metrics"
    selector = sm["spec"]["selector"]["matchLabels"]
    scraped = {
        s["metadata"]["labels"]["app.kubernetes.io/component"]
        for s in r.of_kind("Service")
        if selector.items() <= s["metadata"]["labels"].items()
    }
    assert scraped == {"coordinator", "stage", "gateway"}
    for svc in r.of_kind("Service"):
        if selector.items() <= svc["metadata"]["labels"].items():
            assert "metrics" in [p["name"] for p in svc["spec"]["ports"]]
    (cm,) = r.of_kind("ConfigMap")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(cm["data"]["stagecast.json"])
    assert dashboard["title"] and dashboard["panels"]
    assert dashboard == json.loads((CHART / "dashboards" / "stagecast.json").read_text())
    default = render(helm)
    assert not default.of_kind("ServiceMonitor") and not default.of_kind("ConfigMap")


def test_stage_pdb(helm):
    r = render(helm)
    (pdb,) = r.of_kind("PodDisruptionBudget")
    sts = r.component("StatefulSet", "stage")
    assert pdb["spec"]["selector"]["matchLabels"] == sts["spec"]["selector"]["matchLabels"]
    assert pdb["spec"]["maxUnavailable"] == 1


@pytest.mark.parametrize("name", list(VALUES_FILES))
def test_helm_test_pod_generates_through_gateway(helm, name):
    r = render(helm, name)
    (pod,) = r.of_kind("Pod")
    assert pod["_template"].endswith("templates/tests/test-generate.yaml")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    assert pod["spec"]["restartPolicy"] == "Never"
    args = pod["spec"]["containers"][0]["args"]
    assert args[0] == "generate"
    gw = r.get("Service", f"{RELEASE}-stagecast-gateway")
    assert arg_value(args, "--target") == fqdn(gw["metadata"]["name"], gw["spec"]["ports"][0]["port"])
    assert arg_value(args, "--prompt") and arg_value(args, "--seconds") == str(r.values["tests"]["seconds"])
    assert arg_value(args, "--out") == "/tmp/clip.mp4"
    # A tenant's token from the tokens Secret, TLS trusting the CA the chart made for the gateway.
    mounts = {m["mountPath"]: m["name"] for m in pod["spec"]["containers"][0]["volumeMounts"]}
    volumes = {vol["name"]: vol for vol in pod["spec"]["volumes"]}
    token_file = arg_value(args, "--token-file")
    token_volume = volumes[mounts[token_file.rsplit("/", 1)[0]]]["secret"]
    assert token_volume["secretName"] == f"{RELEASE}-stagecast-tokens"
    assert token_volume["items"] == [{"key": "test-token", "path": "test-token"}]
    ca = arg_value(args, "--tls-ca")
    assert volumes[mounts[ca.rsplit("/", 1)[0]]]["secret"]["secretName"] == f"{RELEASE}-stagecast-gateway-tls"


# ----------------------------------------------------------------------------------------------
# Bad values fail the render with a clear message.


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"stages": {"count": 0}}, "stages.count must be >= 1 (got 0)"),
        ({"stages": {"count": -2}}, "stages.count must be >= 1 (got -2)"),
        ({"stages": {"count": 4, "partition": [10, 10, 20]}}, "has 3 entries but stages.count is 4"),
        ({"stages": {"count": 4, "partition": [8, 8, 8, 5]}}, "sums to 29 but model.numLayers is 30"),
        (
            {"stages": {"count": 2, "partition": [20, 20]}, "model": {"numLayers": 30}},
            "sums to 40 but model.numLayers is 30",
        ),
        ({"stages": {"count": 2, "partition": [0, 40]}}, "stages.partition entries must be >= 1"),
        ({"stages": {"count": 31}}, "cannot exceed model.numLayers (30)"),
        ({"model": {"pvc": {"claimName": ""}}}, "no model path"),
        ({"model": {"pvc": {"claimName": "x"}, "hostPath": {"path": "/data"}}}, "set only one of"),
        ({"stages": {"gpusPerStage": 0}}, "stages.gpusPerStage < 1"),
        ({"image": {"repository": ""}}, "image.repository is empty: stagecast publishes no image. Build docker/"),
    ],
)
def test_bad_values_fail_with_clear_message(helm, overrides, message):
    err = render_error(helm, **overrides)
    assert message in err, err
    assert "stagecast:" in err


def test_multinode_partition_must_match_count(helm):
    err = render_error(helm, "multinode", stages={"count": 3})
    assert "stages.partition [6 8 8 8] has 4 entries but stages.count is 3" in err


@pytest.mark.parametrize(
    ("overrides", "path"),
    [
        ({"device": "tpu"}, "/device"),
        ({"stages": {"gpusPerStage": "one"}}, "/stages/gpusPerStage"),
        ({"gateway": {"service": {"type": "ExternalName"}}}, "/gateway/service/type"),
        ({"tracing": {"ratio": 2}}, "/tracing/ratio"),
        ({"stagess": {"count": 2}}, "stagess"),
    ],
)
def test_values_schema_rejects_bad_types(helm, overrides, path):
    err = render_error(helm, **overrides)
    assert "schema" in err and path in err, err


# ----------------------------------------------------------------------------------------------
# Documentation stays in step with values.yaml.


def _leaf_paths(node, prefix=""):
    if isinstance(node, dict) and node:
        for key, val in node.items():
            yield from _leaf_paths(val, f"{prefix}.{key}" if prefix else key)
    else:
        yield prefix


def test_readme_documents_every_value():
    defaults = chart_defaults()
    readme = (CHART / "README.md").read_text().split("\n## Values\n", 1)[1]
    documented = set(re.findall(r"^\| `([^`]+)` \|", readme, flags=re.M))
    # Maps meant to be filled by the user (resources, probes, selectors...) are documented as a whole.
    missing = [p for p in _leaf_paths(defaults) if not any(p == d or p.startswith(d + ".") for d in documented)]
    assert not missing, f"values missing from the README table: {missing}"
    stale = [d for d in documented if not any(p == d or p.startswith(d + ".") for p in _leaf_paths(defaults))]
    assert not stale, f"README documents values that do not exist: {stale}"


def test_schema_covers_every_value():
    schema = json.loads((CHART / "values.schema.json").read_text())
    defaults = chart_defaults()

    def walk(node, sch, path):
        if sch.get("additionalProperties") is False and isinstance(node, dict):
            for key, val in node.items():
                assert key in sch["properties"], f"{path}.{key} is not in values.schema.json"
                walk(val, sch["properties"][key], f"{path}.{key}")

    walk(defaults, schema, "")


# ----------------------------------------------------------------------------------------------
# The images the chart runs (text checks: no docker engine in CI).


def _instructions(path: Path) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", path.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            cmd, _, rest = line.partition(" ")
            out.append((cmd.upper(), rest.strip()))
    return out


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.cpu"])
def test_dockerfiles_match_the_chart(dockerfile):
    ins = _instructions(REPO / "docker" / dockerfile)
    final_stage = ins[max(i for i, (cmd, _) in enumerate(ins) if cmd == "FROM") :]
    entrypoints = [json.loads(rest) for cmd, rest in final_stage if cmd == "ENTRYPOINT"]
    assert entrypoints == [["stagecast"]], "the chart passes only sub-commands: ENTRYPOINT must be exec-form stagecast"
    users = [rest for cmd, rest in final_stage if cmd == "USER"]
    run_as = chart_defaults()["podSecurityContext"]["runAsUser"]
    assert users and users[-1].split(":")[0] == str(run_as), (users, run_as)
    runs = " ".join(rest for cmd, rest in ins if cmd == "RUN")
    args = {rest.split("=", 1)[0]: rest.split("=", 1)[1] for cmd, rest in ins if cmd == "ARG" and "=" in rest}
    if dockerfile == "Dockerfile":
        assert "nvidia/cuda" in args["CUDA_IMAGE"] and "runtime" in args["CUDA_IMAGE"]
        assert '"/src[gpu,fp8]"' in runs  # torchao: the chart's stages.fp8 runs on this image
    else:
        assert args["PYTHON_IMAGE"] == "python:3.11-slim"
        assert "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in runs
        project = re.search(r"pip install (--no-deps )?/src\b", runs)  # the project, after its CPU torch
        assert project is not None and runs.index("torch==2.13.0") < project.start()
    ignore = (REPO / "docker" / f"{dockerfile}.dockerignore").read_text().split()
    assert {".git", ".venv", "**/*.safetensors"} <= set(ignore), "weights and venvs stay out of the build context"


def test_long_release_name_keeps_names_valid(helm):
    release = "a-very-long-release-name-for-testing-the-dns-limits1"  # 53: Helm's maximum
    with helm.Chart.load(str(CHART)) as chart:
        manifests = chart.render(_load_values("default"), name=release, namespace=NAMESPACE)
    for template, text in manifests.items():
        if template.endswith("NOTES.txt"):
            continue
        for doc in load_yaml_all(text):
            if doc:
                assert len(doc["metadata"]["name"]) <= 63, doc["metadata"]["name"]
                if doc["kind"] == "StatefulSet":
                    # Pod hostnames <sts>-<ordinal> and the controller-revision-hash label value.
                    assert len(doc["metadata"]["name"]) + 1 + 11 <= 63


# ----------------------------------------------------------------------------------------------
# Security: mTLS inside, tokens and TLS at the gateway, secure by default.


def _secret_data(secret: dict) -> dict[str, bytes]:
    import base64

    return {k: base64.b64decode(v) for k, v in secret["data"].items()}


def _mounted_secret(wl: dict, path: str) -> str:
    c = main_container(wl)
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    volumes = {vol["name"]: vol for vol in wl["spec"]["template"]["spec"]["volumes"]}
    return volumes[mounts[path]]["secret"]["secretName"]


@pytest.mark.parametrize("name", list(VALUES_FILES))
def test_defaults_are_secure(helm, name):
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    r = render(helm, name)
    cas = set()
    for wl in r.workloads():
        component = wl["metadata"]["labels"]["app.kubernetes.io/component"]
        args = main_container(wl)["args"]
        # Every service runs with its own role's certificate of the deployment CA; none runs without mTLS.
        assert arg_value(args, "--mtls") == "/etc/stagecast/mtls" and "--insecure-internal" not in args
        secret = r.get("Secret", _mounted_secret(wl, "/etc/stagecast/mtls"))
        assert secret["type"] == "kubernetes.io/tls"
        data = _secret_data(secret)
        cert = x509.load_pem_x509_certificate(data["tls.crt"])
        assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == component
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
            x509.DNSName
        )
        assert f"{component}.stagecast.internal" in names
        cas.add(data["ca.crt"])
        assert b"PRIVATE KEY" in data["tls.key"]
        assert "--store-port" not in args  # no open rendezvous store: stages rendezvous over mTLS gRPC
    assert len(cas) == 1, "one deployment CA"
    # The public API asks for a token and speaks TLS.
    gw = r.component("Deployment", "gateway")
    args = main_container(gw)["args"]
    assert arg_value(args, "--tokens") == "/etc/stagecast/tokens/tokens"
    assert "--allow-anonymous" not in args
    tokens = _secret_data(r.get("Secret", _mounted_secret(gw, "/etc/stagecast/tokens")))
    lines = tokens["tokens"].decode().splitlines()
    assert [line.split()[1:] for line in lines] == [["admin", "admin"], ["helm-test", "user"]]
    assert {tokens["admin-token"], tokens["test-token"]} == {line.split()[0].encode() for line in lines}
    assert all(len(t) >= 32 for t in (tokens["admin-token"], tokens["test-token"]))
    assert arg_value(args, "--tls-cert") == "/etc/stagecast/gateway-tls/tls.crt"
    tls = _secret_data(r.get("Secret", _mounted_secret(gw, "/etc/stagecast/gateway-tls")))
    cert = x509.load_pem_x509_certificate(tls["tls.crt"])
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
    assert fqdn(f"{RELEASE}-stagecast-gateway") in names
    # No port of the rendezvous store anywhere.
    for svc in r.of_kind("Service"):
        assert {p["name"] for p in svc["spec"]["ports"]} <= {"grpc", "metrics", "http"}, svc["metadata"]["name"]


def test_operators_bring_their_own_tokens_and_gateway_certificate(helm):
    r = render(helm, security={"tokens": {"existingSecret": "my-tokens"}, "gatewayTLS": {"secretName": "my-tls"}})
    gw = r.component("Deployment", "gateway")
    assert _mounted_secret(gw, "/etc/stagecast/tokens") == "my-tokens"
    assert _mounted_secret(gw, "/etc/stagecast/gateway-tls") == "my-tls"
    names = {s["metadata"]["name"] for s in r.of_kind("Secret")}
    assert f"{RELEASE}-stagecast-tokens" not in names and f"{RELEASE}-stagecast-gateway-tls" not in names
    (pod,) = r.of_kind("Pod")
    args = pod["spec"]["containers"][0]["args"]
    assert "--tls" in args and "--tls-ca" not in args  # a public certificate: the system's roots
    plain = render(helm, security={"gatewayTLS": {"enabled": False}})
    args = main_container(plain.component("Deployment", "gateway"))["args"]
    assert "--tls-cert" not in args and arg_value(args, "--tokens")  # behind a TLS proxy, tokens still asked


def test_cert_manager_signs_the_internal_certificates(helm):
    issuer = {"name": "stagecast-ca", "kind": "ClusterIssuer"}
    r = render(helm, security={"mtls": {"source": "certManager", "certManager": {"issuerRef": issuer}}})
    certs = {c["metadata"]["name"]: c for c in r.of_kind("Certificate")}
    assert set(certs) == {f"{RELEASE}-stagecast-mtls-{role}" for role in ("coordinator", "stage", "gateway")}
    for name, cert in certs.items():
        role = name.rsplit("-", 1)[1]
        spec = cert["spec"]
        assert cert["apiVersion"] == "cert-manager.io/v1"
        assert spec["secretName"] == name and spec["commonName"] == role
        assert spec["dnsNames"] == [f"{role}.stagecast.internal"]
        assert {"server auth", "client auth"} <= set(spec["usages"])
        assert spec["issuerRef"] == {**issuer, "group": "cert-manager.io"}
    assert not [s for s in r.of_kind("Secret") if "-mtls-" in s["metadata"]["name"]]
    for wl in r.workloads():
        component = wl["metadata"]["labels"]["app.kubernetes.io/component"]
        assert _mounted_secret(wl, "/etc/stagecast/mtls") == f"{RELEASE}-stagecast-mtls-{component}"
    err = render_error(helm, security={"mtls": {"source": "certManager"}})
    assert "security.mtls.certManager.issuerRef.name is empty" in err


def test_sequence_parallel_stages_run_count_times_sp_ranks(helm):
    r = render(helm, "default", stages={"count": 2, "sp": 2, "cudaGraphs": False})
    sts = r.component("StatefulSet", "stage")
    assert sts["spec"]["replicas"] == 4  # pod N is rank N: its index comes from the pod-index label
    args = main_container(sts)["args"]
    assert arg_value(args, "--sp") == "2" and "--sp-rank" not in args and "--cuda-graphs" not in args
    coord = main_container(r.component("Deployment", "coordinator"))["args"]
    assert arg_value(coord, "--stages") == "2" and arg_value(coord, "--sp") == "2"
    plain = render(helm, "default")
    assert "--sp" not in main_container(plain.component("StatefulSet", "stage"))["args"]
    assert "--sp" not in main_container(plain.component("Deployment", "coordinator"))["args"]
    err = render_error(helm, "default", stages={"sp": 2, "cudaGraphs": True})
    assert "stages.cudaGraphs is not supported with stages.sp > 1" in err


# ----------------------------------------------------------------------------------------------
# The gateway's public certificate names the address clients dial.

EXTRA_NAMES = ["stagecast.example.com", "203.0.113.7"]


def _gateway_tls(r: Rendered) -> dict[str, bytes]:
    return _secret_data(r.get("Secret", f"{RELEASE}-stagecast-gateway-tls"))


def _notes(r: Rendered) -> str:
    return next(text for template, text in r.manifests.items() if template.endswith("NOTES.txt"))


def _serve_tls(cert: bytes, key: bytes):
    from concurrent import futures

    import grpc

    from stagecast.v1 import stream_pb2 as pb
    from stagecast.v1 import stream_pb2_grpc as pb_grpc

    class Status(pb_grpc.StreamServiceServicer):
        def GetStatus(self, request, context):
            return pb.GatewayStatus(max_streams=2)

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_StreamServiceServicer_to_server(Status(), server)
    port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials([(key, cert)]))
    server.start()
    return server, f"127.0.0.1:{port}"


@pytest.mark.unit
def test_a_load_balancer_certificate_with_extra_names_verifies_against_them(helm):
    from cryptography import x509

    from stagecast.client import Client
    from stagecast.errors import UnavailableError

    r = render(helm, gateway={"service": {"type": "LoadBalancer"}, "tls": {"extraNames": EXTRA_NAMES}})
    tls = _gateway_tls(r)
    cert = x509.load_pem_x509_certificate(tls["tls.crt"])
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {"stagecast.example.com", fqdn(f"{RELEASE}-stagecast-gateway"), "localhost"} <= set(
        san.get_values_for_type(x509.DNSName)
    )
    assert {"203.0.113.7", "127.0.0.1"} <= {str(ip) for ip in san.get_values_for_type(x509.IPAddress)}
    # Real TLS on loopback with the rendered key and certificate: the client checks the extra name.
    server, target = _serve_tls(tls["tls.crt"], tls["tls.key"])
    try:
        with Client(target, root_certificates=tls["ca.crt"], tls_name="stagecast.example.com") as client:
            assert client.status(timeout=10).max_streams == 2
        with Client(target, root_certificates=tls["ca.crt"], tls_name="203.0.113.7") as client:
            assert client.status(timeout=10).max_streams == 2
        with Client(target, root_certificates=tls["ca.crt"], tls_name="elsewhere.example.com") as client:
            with pytest.raises(UnavailableError, match="does not name the address dialled"):
                client.status(timeout=10)
    finally:
        server.stop(None)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("service", "extra", "target", "tls_name"),
    [
        ("ClusterIP", [], "localhost:50051", None),
        ("LoadBalancer", [], "<ADDRESS>:50051", fqdn(f"{RELEASE}-stagecast-gateway").removesuffix(".cluster.local")),
        ("LoadBalancer", EXTRA_NAMES, "stagecast.example.com:50051", None),
        ("NodePort", EXTRA_NAMES, "stagecast.example.com:<NODE-PORT>", None),
    ],
)
def test_notes_print_a_client_command_the_certificate_verifies(helm, service, extra, target, tls_name):
    from cryptography import x509

    r = render(helm, gateway={"service": {"type": service}, "tls": {"extraNames": extra}})
    line = next(line for line in _notes(r).splitlines() if "stagecast generate" in line).split()
    assert arg_value(line, "--target") == target and arg_value(line, "--tls-ca") == "gateway-ca.crt"
    assert arg_value(line, "--tls-name") == tls_name
    cert = x509.load_pem_x509_certificate(_gateway_tls(r)["tls.crt"])
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
    assert (tls_name or target.rsplit(":", 1)[0]) in names


@pytest.mark.unit
def test_cert_manager_issues_the_gateway_certificate_with_the_extra_names(helm):
    issuer = {"name": "public-ca", "kind": "ClusterIssuer"}
    r = render(helm, gateway={"tls": {"extraNames": EXTRA_NAMES, "certManager": {"issuerRef": issuer}}})
    name = f"{RELEASE}-stagecast-gateway-tls"
    assert name not in {s["metadata"]["name"] for s in r.of_kind("Secret")}
    spec = r.get("Certificate", name)["spec"]
    assert spec["secretName"] == name and spec["issuerRef"] == {**issuer, "group": "cert-manager.io"}
    assert {"stagecast.example.com", fqdn(f"{RELEASE}-stagecast-gateway")} <= set(spec["dnsNames"])
    assert "203.0.113.7" in spec["ipAddresses"] and "203.0.113.7" not in spec["dnsNames"]
    assert _mounted_secret(r.component("Deployment", "gateway"), "/etc/stagecast/gateway-tls") == name


@pytest.mark.unit
def test_a_generated_gateway_certificate_records_its_names_so_a_change_reissues_it(helm):
    r = render(helm, gateway={"tls": {"extraNames": EXTRA_NAMES}})
    recorded = r.get("Secret", f"{RELEASE}-stagecast-gateway-tls")["metadata"]["annotations"]["stagecast.io/tls-names"]
    assert set(EXTRA_NAMES) <= set(recorded.split(","))
    plain = render(helm).get("Secret", f"{RELEASE}-stagecast-gateway-tls")["metadata"]["annotations"]
    assert plain["stagecast.io/tls-names"] != recorded


@pytest.mark.unit
@pytest.mark.parametrize("bad", ["has space.example.com", "-leading.example.com", ""])
def test_values_schema_rejects_a_bad_extra_name(helm, bad):
    err = render_error(helm, gateway={"tls": {"extraNames": [bad]}})
    assert "schema" in err and "/gateway/tls/extraNames/0" in err, err


@pytest.mark.unit
def test_the_chart_as_shipped_asks_for_an_image_before_anything_is_pulled(helm):
    with helm.Chart.load(str(CHART)) as chart:
        with pytest.raises(helm.HelmError) as info:
            chart.render({}, name=RELEASE, namespace=NAMESPACE, is_install=True)
    message = str(info.value)
    assert "image.repository is empty" in message and "push it to a registry" in message and "kind load" in message
    # The CPU demo names the image `kind load docker-image` puts on the nodes, as docker/README.md builds it.
    cpu = load_yaml(VALUES_FILES["cpu"].read_text())["image"]
    built = f"{cpu['repository']}:{cpu['tag']}"
    assert f"-t {built} ." in (REPO / "docker" / "README.md").read_text()
    r = render(helm, "cpu")
    assert {c["image"] for wl in r.workloads() for c in _containers(wl)} == {built}


# ----------------------------------------------------------------------------------------------
# The model volume: a PVC the chart may create, a Job that fills it once, pods that wait for it.

SELF_FORCING_FILL = {
    "enabled": True,
    "repo": "Wan-AI/Wan2.1-T2V-1.3B-Diffusers",
    "convert": {"repo": "gdhe17/Self-Forcing", "file": "checkpoints/self_forcing_dmd.pt", "source": "self-forcing"},
}


def _fill_job(r: Rendered) -> dict:
    (job,) = r.of_kind("Job")
    assert job["metadata"]["name"].startswith(f"{RELEASE}-stagecast-model-")
    return job


@pytest.mark.unit
def test_the_chart_creates_the_model_pvc_and_a_job_that_fills_it_and_the_pods_wait(helm):
    from launcher.fetch_model import build_parser

    r = render(helm, model={"pvc": {"create": {"enabled": True, "size": "40Gi"}}, "fill": SELF_FORCING_FILL})
    pvc = r.get("PersistentVolumeClaim", "stagecast-models")
    assert pvc["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"  # weights outlive the release
    assert pvc["spec"]["resources"]["requests"]["storage"] == "40Gi"
    job = _fill_job(r)
    pod = job["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["command"] == ["python", "-m", "launcher.fetch_model"]
    args = build_parser().parse_args(c["args"])  # the Job's arguments parse with the real parser
    checkpoint = f"{r.values['model']['mountPath']}/{r.values['model']['subPath']}"
    assert (args.command, args.out, args.repo) == ("fill", checkpoint, SELF_FORCING_FILL["repo"])
    assert (args.convert_repo, args.convert_file, args.convert_source) == (
        "gdhe17/Self-Forcing",
        "checkpoints/self_forcing_dmd.pt",
        "self-forcing",
    )
    assert env_of(c)["HF_HUB_OFFLINE"]["value"] == "0"  # the one place that downloads
    assert f"logs -f -l app.kubernetes.io/instance={RELEASE},app.kubernetes.io/component=model" in _notes(r)
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    assert not mounts["model"].get("readOnly") and pod["volumes"][0]["persistentVolumeClaim"] == {
        "claimName": "stagecast-models"
    }
    for wl in (r.component("Deployment", "gateway"), r.component("StatefulSet", "stage")):
        (init,) = wl["spec"]["template"]["spec"]["initContainers"]
        wait = build_parser().parse_args(init["args"])
        assert init["command"] == c["command"] and (wait.command, wait.out) == ("wait", checkpoint)
        assert wait.timeout == r.values["model"]["fill"]["waitSeconds"]
    assert args.tiny_decoder_repo is None
    tiny = {**SELF_FORCING_FILL, "tinyDecoder": {"repo": "madebyollin/taehv", "file": "taew2_1.pth"}}
    (placed,) = _fill_job(render(helm, model={"fill": tiny}))["spec"]["template"]["spec"]["containers"]
    placing = build_parser().parse_args(placed["args"])
    assert (placing.tiny_decoder_repo, placing.tiny_decoder_file) == ("madebyollin/taehv", "taew2_1.pth")
    # A changed fill is a new Job (a Job's template cannot be patched); the same values keep the name.
    other = render(helm, model={"fill": {**SELF_FORCING_FILL, "revision": "v2"}})
    assert _fill_job(other)["metadata"]["name"] != job["metadata"]["name"]
    assert _fill_job(render(helm, model={"fill": SELF_FORCING_FILL}))["metadata"]["name"] == job["metadata"]["name"]


@pytest.mark.unit
def test_a_fill_can_copy_from_a_mounted_volume_without_internet(helm):
    seed = {"persistentVolumeClaim": {"claimName": "seed", "readOnly": True}}
    r = render(helm, model={"fill": {"enabled": True, "copyFrom": {"volume": seed, "path": "/wan-1.3b"}}})
    pod = _fill_job(r)["spec"]["template"]["spec"]
    args = pod["containers"][0]["args"]
    assert arg_value(args, "--copy-from") == "/seed/wan-1.3b" and "--repo" not in args
    assert {"name": "seed", **seed} in pod["volumes"]


@pytest.mark.unit
def test_without_fill_there_is_no_job_and_no_wait(helm):
    r = render(helm)
    assert not r.of_kind("Job") and not r.of_kind("PersistentVolumeClaim")
    assert "initContainers" not in r.component("StatefulSet", "stage")["spec"]["template"]["spec"]


@pytest.mark.unit
@pytest.mark.parametrize(
    ("model", "message"),
    [
        ({"pvc": {"claimName": ""}, "hostPath": {"path": "/data"}, "fill": SELF_FORCING_FILL}, "needs a PVC to fill"),
        ({"fill": {"enabled": True}}, "set exactly one of model.fill.repo (Hugging Face) and model.fill.copyFrom.path"),
        ({"fill": {"enabled": True, "copyFrom": {"path": "x"}}}, "model.fill.copyFrom.path needs model.fill.copyFrom"),
        (
            {"fill": {"enabled": True, "repo": "a/b", "convert": {"repo": "c/d"}}},
            "model.fill.convert: set repo, file and source together",
        ),
        (
            {"pvc": {"claimName": "", "create": {"enabled": True}}, "demo": {"enabled": True}},
            "needs model.pvc.claimName",
        ),
    ],
)
def test_bad_model_fill_values_fail_naming_the_value(helm, model, message):
    err = render_error(helm, model=model)
    assert message in err, err


@pytest.mark.unit
def test_the_multinode_example_serves_a_real_time_model(helm):
    r = render(helm, "multinode")
    args = build = _fill_job(r)["spec"]["template"]["spec"]["containers"][0]["args"]
    assert arg_value(build, "--convert-source") in ("self-forcing", "causvid", "streamdiffusionv2")
    assert "14B" not in " ".join(args) and "14B" not in r.values["model"]["subPath"]
    assert r.values["model"]["numLayers"] == 30  # Self-Forcing is Wan2.1-1.3B's 30 blocks
    assert r.get("PersistentVolumeClaim", r.values["model"]["pvc"]["claimName"])
