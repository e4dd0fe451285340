"""deploy/: every manifest parses; the kustomizations reference files that exist; each Deployment
runs a real service with flags that service takes; ports agree between args, container ports,
probes, Services and scrape annotations; HPAs target existing Deployments on exported metrics;
PDB and Service selectors match pod labels."""
import argparse
import importlib
from pathlib import Path

import pytest
import yaml

from nxdi_common.serving.launcher import MODEL_FLAGS, MODULES, SERVICE_FLAGS
from nxdi_common.serving.metrics import GAUGES

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
K8S = DEPLOY / "k8s"
BASE = K8S / "base"
NAMESPACE = "nxdi"
GRPC_PORT, METRICS_PORT, HTTP_PORT = 50051, 9090, 8000
COMPONENT = "app.kubernetes.io/component"
# Per-pod signals the HPAs may use: the gauges the services export, and what the adapter derives.
ADAPTER_METRICS = {"nxdi_kv_blocks_used_ratio", "nxdi_prefill_backlog_seconds"}


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def _base_objects() -> list[dict]:
    kustomization = _docs(BASE / "kustomization.yaml")[0]
    return [doc for name in kustomization["resources"] for doc in _docs(BASE / name)]


def _by_kind(kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in _base_objects() if o["kind"] == kind}


def _container(deployment: dict) -> dict:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1, deployment["metadata"]["name"]
    return containers[0]


def _mirror_parser(role: str) -> argparse.ArgumentParser:
    """The service's options as the launcher knows them (SERVICE_FLAGS, MODEL_FLAGS)."""
    p = argparse.ArgumentParser(prog=role, exit_on_error=False)
    for flag in (*SERVICE_FLAGS[role], *MODEL_FLAGS):
        p.add_argument(flag, action="append", default=[])
    return p


def _args(deployment: dict) -> dict[str, list[str]]:
    role = deployment["metadata"]["name"]
    args = [a.replace("$(POD_NAMESPACE)", NAMESPACE) for a in _container(deployment)["args"]]
    parsed, unknown = _mirror_parser(role).parse_known_args(args)
    assert unknown == [], f"{role}: unknown options {unknown}"
    return {k: v for k, v in vars(parsed).items() if v}


def _one(args: dict, key: str) -> str:
    assert len(args[key]) == 1, key
    return args[key][0]


def _port(container: dict, name: str) -> int:
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    return ports[name]


def test_every_yaml_parses_and_has_kind():
    files = sorted(DEPLOY.rglob("*.yaml"))
    assert len(files) >= 10
    for path in files:
        for doc in _docs(path):
            assert doc.get("apiVersion") and doc.get("kind"), path


def test_kustomizations_reference_existing_files():
    listed = set(_docs(BASE / "kustomization.yaml")[0]["resources"])
    on_disk = {p.name for p in BASE.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == on_disk
    assert _docs(K8S / "kustomization.yaml")[0]["resources"] == ["base"]
    overlay = _docs(K8S / "overlays" / "neuron" / "kustomization.yaml")[0]
    assert overlay["resources"] == ["../../base"]
    deployments = _by_kind("Deployment")
    for patch in overlay["patches"]:
        target = patch["target"]["name"]
        doc = _docs(K8S / "overlays" / "neuron" / patch["path"])[0]
        assert doc["metadata"]["name"] == target and target in deployments
        container = doc["spec"]["template"]["spec"]["containers"][0]
        assert container["name"] == _container(deployments[target])["name"]
        assert container["resources"]["limits"] == {"aws.amazon.com/neuron": "1"}


def test_deployments_run_the_services_with_known_flags():
    deployments = _by_kind("Deployment")
    assert sorted(deployments) == ["decode", "prefill", "router"]
    for role, deployment in deployments.items():
        container = _container(deployment)
        assert container["command"] == ["python", "-m", MODULES[role]]
        args = _args(deployment)
        assert _one(args, "host") == "0.0.0.0"
    models = {_one(_args(d), "model") for d in deployments.values()}
    lengths = {_one(_args(d), "max_model_len") for d in deployments.values()}
    assert len(models) == 1 and len(lengths) == 1


@pytest.mark.parametrize("role,module,fn", [("prefill", "prefill_service.server", "parse_args"),
                                            ("decode", "decode_service.main", "parse_args"),
                                            ("router", "router.server", "build_parser")])
def test_args_parse_with_the_real_service_parser(role, module, fn):
    """When the service is importable, its own command-line parser accepts the manifest's args."""
    try:
        parse = getattr(importlib.import_module(module), fn)
    except (ImportError, AttributeError) as exc:
        pytest.skip(f"{module}.{fn} not available: {exc}")
    args = [a.replace("$(POD_NAMESPACE)", NAMESPACE)
            for a in _container(_by_kind("Deployment")[role])["args"]]
    parsed = parse().parse_args(args) if fn == "build_parser" else parse(args)
    assert parsed.host == "0.0.0.0"


def test_worker_ports_agree():
    services = _by_kind("Service")
    for role in ("prefill", "decode"):
        deployment = _by_kind("Deployment")[role]
        container, args = _container(deployment), _args(deployment)
        assert int(_one(args, "port")) == _port(container, "grpc") == GRPC_PORT
        assert int(_one(args, "metrics_port")) == _port(container, "metrics") == METRICS_PORT
        annotations = deployment["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert int(annotations["prometheus.io/port"]) == METRICS_PORT
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["grpc"]["port"] == GRPC_PORT, (role, probe)
        headless = services[f"{role}-headless"]["spec"]
        assert headless["clusterIP"] == "None"
        expected = {"grpc": (GRPC_PORT, "grpc"), "metrics": (METRICS_PORT, "metrics")}
        if role == "prefill":  # the KV socket decode pods connect to
            kv_port = int(_one(args, "kv_socket_port"))
            assert kv_port == _port(container, "kv-socket") not in (GRPC_PORT, METRICS_PORT)
            expected["kv-socket"] = (kv_port, "kv-socket")
        assert {p["name"]: (p["port"], p["targetPort"]) for p in headless["ports"]} == expected


def test_router_ports_and_discovery():
    deployment = _by_kind("Deployment")["router"]
    container, args = _container(deployment), _args(deployment)
    assert int(_one(args, "grpc_port")) == _port(container, "grpc") == GRPC_PORT
    assert int(_one(args, "http_port")) == _port(container, "http") == HTTP_PORT
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == HTTP_PORT
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == GRPC_PORT, probe
    service = _by_kind("Service")["router"]["spec"]
    assert {p["name"]: (p["port"], p["targetPort"]) for p in service["ports"]} == {
        "http": (HTTP_PORT, "http"), "grpc": (GRPC_PORT, "grpc")}
    for role in ("prefill", "decode"):
        name = _one(args, f"{role}_dns")
        assert name == f"{role}-headless.{NAMESPACE}.svc.cluster.local:{GRPC_PORT}"
        assert f"{role}-headless" in _by_kind("Service")
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    assert "prefill" not in args and "decode" not in args  # discovery only, no static addresses


def test_threads_match_cpu_requests():
    for role in ("prefill", "decode"):
        deployment = _by_kind("Deployment")[role]
        container, args = _container(deployment), _args(deployment)
        env = {e["name"]: e.get("value") for e in container["env"]}
        threads = _one(args, "threads")
        assert threads == env["OMP_NUM_THREADS"] == container["resources"]["requests"]["cpu"]


def test_selectors_match_pod_labels():
    deployments = _by_kind("Deployment")
    for name, deployment in deployments.items():
        selector = deployment["spec"]["selector"]["matchLabels"]
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert selector.items() <= labels.items()
        assert labels[COMPONENT] == name

    def matching(selector: dict) -> list[str]:
        return [n for n, d in deployments.items()
                if selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()]

    pdbs = _by_kind("PodDisruptionBudget")
    assert sorted(pdbs) == ["decode", "prefill", "router"]
    for name, pdb in pdbs.items():
        assert matching(pdb["spec"]["selector"]["matchLabels"]) == [name]
    services = _by_kind("Service")
    assert sorted(services) == ["decode-headless", "prefill-headless", "router"]
    for name, service in services.items():
        assert matching(service["spec"]["selector"]) == [name.removesuffix("-headless")]


def test_hpas_target_deployments_on_exported_metrics():
    hpas, deployments = _by_kind("HorizontalPodAutoscaler"), _by_kind("Deployment")
    assert sorted(hpas) == ["decode", "prefill"]
    exported = {"nxdi_" + name for name, _ in GAUGES} | ADAPTER_METRICS
    wanted = {"prefill": {"nxdi_queue_depth_requests", "nxdi_prefill_backlog_seconds"},
              "decode": {"nxdi_kv_blocks_used_ratio", "nxdi_running_sequences"}}
    for name, hpa in hpas.items():
        assert hpa["apiVersion"] == "autoscaling/v2"
        target = hpa["spec"]["scaleTargetRef"]
        assert (target["kind"], target["apiVersion"]) == ("Deployment", "apps/v1")
        assert target["name"] == name and name in deployments
        assert 1 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]
        metrics = hpa["spec"]["metrics"]
        assert {m["type"] for m in metrics} == {"Pods"}
        names = {m["pods"]["metric"]["name"] for m in metrics}
        assert names == wanted[name] and names <= exported


def test_adapter_rules_define_the_hpa_metrics():
    config = _docs(K8S / "monitoring" / "prometheus-adapter-config.yaml")[0]
    rules = yaml.safe_load(config["data"]["config.yaml"])["rules"]
    served = {rule["name"]["as"] for rule in rules}
    used = {m["pods"]["metric"]["name"] for hpa in _by_kind("HorizontalPodAutoscaler").values()
            for m in hpa["spec"]["metrics"]}
    assert used <= served
    for rule in rules:
        assert rule["seriesQuery"].split("{")[0] in {"nxdi_" + n for n, _ in GAUGES}
