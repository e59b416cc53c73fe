"""The Helm chart: lint, render and validate every object; sync, rules, dashboards, token, policy.

Core kinds are validated with kubernetes-validate (strict: unknown fields are errors) for the
oldest and newest Kubernetes the chart supports. Prometheus-operator kinds are validated with
jsonschema against their CRDs' openAPIV3Schema (tests/helm/crds/, see NOTICE.md there), made
strict the same way. The token's "kept across upgrades" is proven with Helm's real ``lookup``
against a fake Kubernetes API server on 127.0.0.1.
"""

from __future__ import annotations

import base64
import importlib.util
import json
import re
import shutil
import subprocess
import sys
import threading
import urllib.parse
from collections.abc import Iterator
from functools import cache
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import helm_python
import jsonschema
import kubernetes_validate
import pytest
import yaml

from servers import answer_json

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "trainpatrol"
CI_VALUES = sorted((CHART / "ci").glob("*-values.yaml"))
CRDS = Path(__file__).resolve().parent / "crds"
EXAMPLES = REPO / "helm" / "examples"
RELEASE, NAMESPACE = "tp", "monitoring"
# kubeVersion ">=1.29.0-0": the oldest supported minor and the newest kubernetes-validate knows.
KUBE_VERSIONS = ("1.29.0", kubernetes_validate.latest_version() + ".0")
PROMTOOL = shutil.which("promtool")



def _load(name: str) -> Any:
    """helm/<name>.py, imported under a private name (helm/ is not a package)."""
    spec = importlib.util.spec_from_file_location(f"_trainpatrol_helm_{name}", REPO / "helm" / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


sync = _load("sync")
values_doc = _load("values_doc")

Doc = dict[str, Any]


# --- rendering ----------------------------------------------------------------------------------


@cache
def _chart() -> helm_python.Chart:
    return helm_python.Chart.load(CHART)


def ci_values(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text()) or {}


def render(values: dict[str, Any] | None = None) -> list[Doc]:
    """Every object the chart renders with these values (NOTES.txt left out)."""
    manifests = _chart().render(values or {}, name=RELEASE, namespace=NAMESPACE)
    return _parse(manifests)


def _parse(manifests: dict[str, str]) -> list[Doc]:
    docs = []
    for path, text in sorted(manifests.items()):
        if path.endswith("NOTES.txt"):
            continue
        docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


@cache
def _render_ci(name: str) -> tuple[Doc, ...]:
    return tuple(render(ci_values(CHART / "ci" / name)))


def one(docs: list[Doc] | tuple[Doc, ...], kind: str, name_part: str = "") -> Doc:
    found = [d for d in docs if d["kind"] == kind and name_part in d["metadata"]["name"]]
    assert len(found) == 1, f"expected one {kind} named *{name_part}*, got {[d['metadata']['name'] for d in found]}"
    return found[0]


def kinds(docs: list[Doc] | tuple[Doc, ...]) -> list[str]:
    return sorted(d["kind"] for d in docs)


def container(doc: Doc) -> Doc:
    containers = doc["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def env(c: Doc) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env", [])}


# --- validation of rendered objects ----------------------------------------------------------------


def _strict(node: Any) -> Any:
    """Unknown fields become errors wherever the CRD lists properties and keeps no unknown fields."""
    if isinstance(node, dict):
        node = {k: _strict(v) for k, v in node.items()}
        if ("properties" in node and "additionalProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields")):
            node["additionalProperties"] = False
        return node
    if isinstance(node, list):
        return [_strict(v) for v in node]
    return node


@cache
def crd_validators() -> dict[tuple[str, str], jsonschema.Draft7Validator]:
    schemas = {
        ("monitoring.coreos.com/v1", "ServiceMonitor"): "monitoring.coreos.com_servicemonitors.v1.schema.yaml",
        ("monitoring.coreos.com/v1", "PodMonitor"): "monitoring.coreos.com_podmonitors.v1.schema.yaml",
        ("monitoring.coreos.com/v1alpha1", "AlertmanagerConfig"):
            "monitoring.coreos.com_alertmanagerconfigs.v1alpha1.schema.yaml",
    }
    out = {key: yaml.safe_load((CRDS / f).read_text()) for key, f in schemas.items()}
    crd = yaml.safe_load((CRDS / "monitoring.coreos.com_prometheusrules.yaml").read_text())
    (version,) = crd["spec"]["versions"]
    out[("monitoring.coreos.com/v1", "PrometheusRule")] = version["schema"]["openAPIV3Schema"]
    validators = {}
    for key, schema in out.items():
        strict = _strict(schema)
        # Meta-validated without the `regex` format check: a few CRD patterns use Go's RE2 inline
        # flags mid-pattern, which Python's re rejects. They guard fields the chart never renders;
        # if one ever is rendered, re.error fails the test loudly.
        meta = jsonschema.Draft7Validator(jsonschema.Draft7Validator.META_SCHEMA)
        assert not list(meta.iter_errors(strict)), key
        validators[key] = jsonschema.Draft7Validator(strict)
    return validators


OBJECT_META_KEYS = {"name", "namespace", "labels", "annotations"}


def validate(doc: Doc, kube_version: str) -> None:
    """Raise on any schema error; every kind the chart renders must have a schema here."""
    key = (doc["apiVersion"], doc["kind"])
    if doc["apiVersion"].startswith("monitoring.coreos.com/"):
        assert key in crd_validators(), f"no CRD schema for {key}"
        errors = sorted(crd_validators()[key].iter_errors(doc), key=lambda e: list(e.path))
        assert not errors, f"{key} {doc['metadata']['name']}: " + "; ".join(
            f"{'/'.join(map(str, e.path))}: {e.message}" for e in errors)
        # The CRDs leave metadata open; the API server validates it as ObjectMeta.
        assert set(doc["metadata"]) <= OBJECT_META_KEYS, doc["metadata"]
        for field in ("labels", "annotations"):
            assert all(isinstance(v, str) for v in doc["metadata"].get(field, {}).values()), doc["metadata"]
        return
    kubernetes_validate.validate(doc, kube_version, strict=True)


# --- lint ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("values_file", CI_VALUES, ids=[p.name for p in CI_VALUES])
def test_lint_strict(values_file: Path) -> None:
    report = helm_python.lint(CHART, values=ci_values(values_file), strict=True,
                              kube_version="v" + KUBE_VERSIONS[0], namespace=NAMESPACE)
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert report["errors"] == [] and problems == [], (report["errors"], problems)


@pytest.mark.parametrize("values, message", [
    ({"port": "9400x"}, "want integer"),
    ({"portt": 9400}, "'portt' not allowed"),
    ({"serviceMonitor": {"interval": "15 seconds"}}, "interval"),
    ({"allowedActions": ["resume"]}, "allowedActions"),
    ({"gpuSource": "dcgm-exporter"}, "gpuSource"),
    ({"prometheusRule": {"alerts": {"Stragler": {"enabled": False}}}}, "Stragler"),
    ({"prometheusRule": {"alerts": {"Straggler": {"severity": "page"}}}}, "severity"),
    ({"agent": {"hostPort": {"enabled": True}}}, "hostPort"),
    ({"networkPolicy": {"extraFrom": [{"podSelectr": {}}]}}, "podSelectr"),
])
def test_lint_rejects_bad_values(values: dict[str, Any], message: str) -> None:
    report = helm_python.lint(CHART, values=values, strict=True, kube_version="v" + KUBE_VERSIONS[0])
    assert any(message in e for e in report["errors"]), report["errors"]


def test_ci_values_cover_every_optional_object() -> None:
    rendered = {kind for p in CI_VALUES for kind in kinds(_render_ci(p.name))}
    assert rendered >= {"DaemonSet", "Service", "Deployment", "ServiceAccount", "Secret", "NetworkPolicy",
                        "ConfigMap", "PodDisruptionBudget", "ServiceMonitor", "PodMonitor", "PrometheusRule",
                        "AlertmanagerConfig"}


def test_packaged_chart_holds_the_synced_files(tmp_path: Path) -> None:
    archive = helm_python.package(CHART, destination=tmp_path)
    with helm_python.Chart.load(archive) as packaged:
        names = {f["name"] for f in packaged.files}
        assert {"files/rules.yml", "files/rules-dcgm.yml"} <= names
        assert {f"files/dashboards/{p.name}" for p in (REPO / "dashboards").glob("*.json")} <= names
        assert not [n for n in names if n.startswith("ci/")]
        values = {"prometheusRule": {"enabled": True}, "auth": {"token": "t"}}
        assert packaged.render(values, name=RELEASE, namespace=NAMESPACE) == _chart().render(
            values, name=RELEASE, namespace=NAMESPACE)


# --- render and validate ---------------------------------------------------------------------------


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
@pytest.mark.parametrize("values_file", CI_VALUES, ids=[p.name for p in CI_VALUES])
def test_every_rendered_object_is_valid(values_file: Path, kube_version: str) -> None:
    docs = _render_ci(values_file.name)
    assert docs
    for doc in docs:
        validate(doc, kube_version)
    names = [(d["kind"], d["metadata"]["name"]) for d in docs]
    assert len(names) == len(set(names)), names
    assert all(len(d["metadata"]["name"]) <= 63 for d in docs)


def test_crd_validation_catches_unknown_and_wrong_fields() -> None:
    sm = json.loads(json.dumps(one(_render_ci("servicemonitor-values.yaml"), "ServiceMonitor", "agent")))
    validate(sm, KUBE_VERSIONS[0])
    sm["spec"]["endpoints"][0]["intervall"] = "15s"
    with pytest.raises(AssertionError, match="intervall"):
        validate(sm, KUBE_VERSIONS[0])
    amc = json.loads(json.dumps(one(_render_ci("alertmanagerconfig-values.yaml"), "AlertmanagerConfig")))
    amc["spec"]["route"]["groupWait"] = "soon"
    with pytest.raises(AssertionError, match="groupWait"):
        validate(amc, KUBE_VERSIONS[0])


def test_core_validation_is_strict() -> None:
    ds = json.loads(json.dumps(one(_render_ci("default-values.yaml"), "DaemonSet")))
    ds["spec"]["template"]["spec"]["containers"][0]["hostPorts"] = [9400]
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(ds, KUBE_VERSIONS[0])


def _dashboards(gpu_source: str = "nvml") -> dict[str, str]:
    """The dashboards a release holds: every one but the other GPU source's GPU dashboard."""
    files = sorted((REPO / "dashboards").glob("*.json"))
    dcgm = gpu_source == "dcgm"
    return {p.name: p.read_text() for p in files
            if not p.name.startswith("gpu-node") or p.name.endswith("-dcgm.json") == dcgm}


def test_defaults_render_core_objects_only() -> None:
    assert kinds(render()) == ["ConfigMap"] * len(_dashboards()) + [
        "DaemonSet", "Deployment", "NetworkPolicy", "Secret", "Service", "Service", "Service", "ServiceAccount"]


@pytest.mark.parametrize("values, message", [
    ({"serviceMonitor": {"enabled": True}, "podMonitor": {"enabled": True}}, "scraped twice"),
    ({"alertmanagerConfig": {"enabled": True}, "router": {"enabled": False}}, "needs router.enabled"),
    ({"auth": {"token": "t", "existingSecret": "s"}}, "give the token one way"),
])
def test_conflicting_values_fail_with_a_message(values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm_python.HelmRenderError, match=message):
        render(values)


# --- the agent and the router ----------------------------------------------------------------------


def _cli_args(c: Doc) -> Any:
    from trainpatrol.cli import build_parser

    assert c["args"][0] == "agent"
    return build_parser().parse_args(c["args"])


def test_agent_daemonset() -> None:
    docs = _render_ci("default-values.yaml")
    ds = one(docs, "DaemonSet", "agent")
    pod = ds["spec"]["template"]["spec"]
    c = container(ds)
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert pod["automountServiceAccountToken"] is False
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert c["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                    "capabilities": {"drop": ["ALL"]}}
    # Not dcgm-exporter's 9400, and no host port unless asked.
    assert c["ports"] == [{"name": "http", "containerPort": 9402, "protocol": "TCP"}]
    assert pod["priorityClassName"] == "system-node-critical"
    assert "hostPID" not in pod
    for probe in ("livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert c["resources"]["limits"]["memory"] and c["resources"]["requests"]["cpu"]
    e = env(c)
    assert e["NODE_IP"] == {"fieldRef": {"fieldPath": "status.hostIP"}}
    assert e["NODE_NAME"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert e["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert "nvidia.com/gpu" not in json.dumps(c["resources"])  # NVML without taking a GPU from training
    assert c["image"] == "ghcr.io/trainpatrol/trainpatrol:" + _chart().metadata["appVersion"]

    args = _cli_args(c)
    svc = one(docs, "Service", "agent-peers")
    assert (args.mode, args.host, args.port, args.nvml) == ("agent", "0.0.0.0", 9402, None)
    assert args.nvml_interval_seconds == 1.0
    assert args.peers_dns == f"{svc['metadata']['name']}.{NAMESPACE}.svc.cluster.local"
    assert args.allowed_actions == "checkpoint,pause,capture,empty_cache,stop"
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    assert args.token_file == mounts["token"]["mountPath"] + "/token"
    assert mounts["token"]["readOnly"] is True
    volumes = {v["name"]: v for v in pod["volumes"]}
    secret = one(docs, "Secret", "token")
    assert volumes["token"]["secret"]["secretName"] == secret["metadata"]["name"]
    assert volumes["token"]["secret"]["items"] == [{"key": "token", "path": "token"}]


def test_agent_options_reach_the_cli() -> None:
    nvml = _cli_args(container(one(_render_ci("nvml-values.yaml"), "DaemonSet")))
    assert (nvml.nvml_interval_seconds, nvml.nvml_pcie, nvml.nvml_processes) == (0.5, True, True)
    ds = one(_render_ci("nvml-values.yaml"), "DaemonSet")
    assert ds["spec"]["template"]["spec"]["runtimeClassName"] == "nvidia"
    off = one(_render_ci("no-nvml-values.yaml"), "DaemonSet")
    assert _cli_args(container(off)).nvml is False
    assert "NVIDIA_VISIBLE_DEVICES" not in env(container(off))
    assert "hostPort" not in container(off)["ports"][0]
    assert off["spec"]["template"]["spec"]["nodeSelector"] == {"kubernetes.io/os": "linux"}


def test_router_deployment_and_service() -> None:
    docs = _render_ci("default-values.yaml")
    dep = one(docs, "Deployment", "router")
    args = _cli_args(container(dep))
    assert (args.mode, args.nvml, args.peers_dns) == (
        "router", False, f"{one(docs, 'Service', 'agent-peers')['metadata']['name']}.{NAMESPACE}.svc.cluster.local")
    svc = one(docs, "Service", "router")
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    assert svc["spec"]["ports"] == [{"name": "http", "port": 9402, "targetPort": "http", "protocol": "TCP"}]
    assert "router" not in kinds(_render_ci("no-router-values.yaml"))
    assert not [d for d in _render_ci("no-router-values.yaml") if "router" in d["metadata"]["name"]]
    pdb = one(_render_ci("router-ha-values.yaml"), "PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()


def test_agents_and_router_answer_to_their_pod_ip_node_ip_and_service_names_only() -> None:
    """The Host check (agent.auth): Prometheus and probes use the pod IP, ranks the node IP (hostPort),
    Alertmanager the router Service's name; each of them must be an allowed host, and nothing else."""
    docs = _render_ci("default-values.yaml")
    peers = one(docs, "Service", "agent-peers")["metadata"]["name"]
    local = one(docs, "DaemonSet", "agent")["metadata"]["name"]  # the node-local Service's name
    router = one(docs, "Service", "router")["metadata"]["name"]

    def names(svc: str) -> list[str]:
        return [svc, f"{svc}.{NAMESPACE}", f"{svc}.{NAMESPACE}.svc", f"{svc}.{NAMESPACE}.svc.cluster.local"]

    agent = container(one(docs, "DaemonSet", "agent"))
    assert _cli_args(agent).allowed_hosts.split(",") == ["$(POD_IP)", *names(peers), *names(local), "$(NODE_IP)"]
    assert {"POD_IP", "NODE_IP"} <= env(agent).keys()  # defined, so Kubernetes expands them in args
    routing = container(one(docs, "Deployment", "router"))
    assert _cli_args(routing).allowed_hosts.split(",") == ["$(POD_IP)", *names(router)]
    assert "POD_IP" in env(routing)
    webhook = urllib.parse.urlparse(f"http://{router}.{NAMESPACE}.svc.cluster.local:9400")
    assert webhook.hostname in _cli_args(routing).allowed_hosts.split(",")
    extra = render({"allowedHosts": ["trainpatrol.example.org"]})
    assert _cli_args(container(one(extra, "Deployment", "router"))).allowed_hosts.endswith(",trainpatrol.example.org")


def test_peers_service_is_headless_and_selects_the_agents() -> None:
    docs = _render_ci("default-values.yaml")
    svc = one(docs, "Service", "agent-peers")
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    ds_labels = one(docs, "DaemonSet")["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= ds_labels.items()
    router_labels = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert not svc["spec"]["selector"].items() <= router_labels.items()


def test_agent_cli_runs_without_torch() -> None:
    """The image has no torch (the agent never needs it): `trainpatrol agent` must still parse."""
    code = ("import sys; sys.modules['torch'] = None\n"
            "from trainpatrol.cli import build_parser\n"
            "build_parser().parse_args(['agent', '--mode=router'])\n"
            "from trainpatrol.agent.app import Agent\n"
            "from trainpatrol.agent.config import AgentConfig\n"
            "Agent(AgentConfig(nvml=False, mode='router').load())\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


# --- scrape objects -------------------------------------------------------------------------------


def _rules_job() -> str:
    jobs = set(re.findall(r'job="([^"]+)"', (REPO / "alerting" / "rules.yml").read_text()))
    assert len(jobs) == 1, jobs
    return jobs.pop()


def test_training_pods_reach_the_agent_on_their_node_through_a_node_local_service() -> None:
    docs = _render_ci("default-values.yaml")
    ds = one(docs, "DaemonSet", "agent")
    (local,) = [d for d in docs if d["kind"] == "Service" and d["spec"].get("internalTrafficPolicy") == "Local"]
    assert local["metadata"]["name"] == ds["metadata"]["name"]
    assert local["spec"]["type"] == "ClusterIP"
    assert local["spec"]["selector"].items() <= ds["spec"]["template"]["metadata"]["labels"].items()
    assert local["spec"]["ports"] == [{"name": "http", "port": 9402, "targetPort": "http", "protocol": "TCP"}]
    # the examples' URL: release "trainpatrol" in namespace "monitoring"
    named = _parse(_chart().render({}, name="trainpatrol", namespace="monitoring"))
    assert [d["metadata"]["name"] for d in named if d["kind"] == "Service"
            and d["spec"].get("internalTrafficPolicy") == "Local"] == ["trainpatrol-agent"]
    off = render({"agent": {"localService": {"enabled": False}}})
    assert not [d for d in off if d["kind"] == "Service" and d["spec"].get("internalTrafficPolicy") == "Local"]


def test_servicemonitor() -> None:
    docs = _render_ci("servicemonitor-values.yaml")
    sm = one(docs, "ServiceMonitor", "agent")
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert sm["metadata"]["namespace"] == NAMESPACE
    assert sm["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    svc = one(docs, "Service", "agent-peers")
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    router_svc = one(docs, "Service", "router")
    assert not sm["spec"]["selector"]["matchLabels"].items() <= router_svc["metadata"]["labels"].items()
    local = next(d for d in docs if d["kind"] == "Service" and d["spec"].get("internalTrafficPolicy") == "Local")
    assert not sm["spec"]["selector"]["matchLabels"].items() <= local["metadata"]["labels"].items()  # scraped once
    (ep,) = sm["spec"]["endpoints"]
    assert (ep["port"], ep["path"], ep["interval"], ep["scrapeTimeout"]) == ("http", "/metrics", "10s", "5s")
    assert ep["honorLabels"] is True  # the workload's namespace/pod/container/node win over the agent pod's
    assert ep["relabelings"][0] == {"targetLabel": "job", "replacement": _rules_job()}
    assert {"sourceLabels": ["__meta_kubernetes_pod_node_name"], "targetLabel": "node"} in ep["relabelings"]
    assert ep["metricRelabelings"] == [{"sourceLabels": ["__name__"], "regex": "go_.*", "action": "drop"}]


def test_podmonitor() -> None:
    docs = _render_ci("podmonitor-values.yaml")
    pm = one(docs, "PodMonitor", "agent")
    assert pm["metadata"]["namespace"] == "monitoring"
    assert pm["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    ds_labels = one(docs, "DaemonSet")["spec"]["template"]["metadata"]["labels"]
    assert pm["spec"]["selector"]["matchLabels"].items() <= ds_labels.items()
    (ep,) = pm["spec"]["podMetricsEndpoints"]
    assert (ep["port"], ep["interval"], ep["honorLabels"]) == ("http", "30s", True)
    assert ep["relabelings"][0] == {"targetLabel": "job", "replacement": _rules_job()}


# --- sync, rules and dashboards --------------------------------------------------------------------


def test_sync_copies_are_current() -> None:
    assert sync.differences() == []
    assert (CHART / "files" / "rules.yml").read_bytes() == (REPO / "alerting" / "rules.yml").read_bytes()
    sources = sorted(p.name for p in (REPO / "dashboards").glob("*.json"))
    copies = sorted(p.name for p in (CHART / "files" / "dashboards").glob("*.json"))
    assert sources == copies and sources
    for name in sources:
        assert (CHART / "files" / "dashboards" / name).read_bytes() == (REPO / "dashboards" / name).read_bytes()


def test_prometheusrule_spec_is_the_shipped_rules() -> None:
    manifests = _chart().render({"prometheusRule": {"enabled": True}}, name=RELEASE, namespace=NAMESPACE)
    rules = (REPO / "alerting" / "rules.yml").read_text()
    rule = one(_parse(manifests), "PrometheusRule")
    assert rule["spec"] == yaml.safe_load(rules)
    assert rule["metadata"]["labels"]["app.kubernetes.io/component"] == "alerting"


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed")
def test_prometheusrule_spec_passes_promtool(tmp_path: Path) -> None:
    rule = one(_render_ci("prometheusrule-values.yaml"), "PrometheusRule")
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump(rule["spec"], sort_keys=False))
    result = subprocess.run([PROMTOOL, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_dashboard_configmaps_equal_the_dashboards() -> None:
    for values_file, label, value in (("default-values.yaml", "grafana_dashboard", "1"),
                                      ("dashboards-values.yaml", "grafana_dashboard_trainpatrol", "yes")):
        cms = [d for d in _render_ci(values_file) if d["kind"] == "ConfigMap"]
        sources = _dashboards()
        assert len(cms) == len(sources)
        data = {}
        for cm in cms:
            assert cm["metadata"]["labels"][label] == value
            assert len(cm["data"]) == 1
            data.update(cm["data"])
        assert data == sources
        for text in data.values():
            assert json.loads(text)["uid"]
    cm = next(d for d in _render_ci("dashboards-values.yaml") if d["kind"] == "ConfigMap")
    assert cm["metadata"]["namespace"] == "grafana"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "TrainPatrol"}
    assert not [d for d in render({"dashboards": {"enabled": False}}) if d["kind"] == "ConfigMap"]


# --- Alertmanager routing --------------------------------------------------------------------------


def test_alertmanagerconfig_routes_actions_to_the_router_with_the_token() -> None:
    docs = _render_ci("alertmanagerconfig-values.yaml")
    amc = one(docs, "AlertmanagerConfig")
    route = amc["spec"]["route"]
    assert route["matchers"] == [{"name": "action", "matchType": "=~", "value": ".+"}]
    assert (route["groupWait"], route["repeatInterval"]) == ("0s", "4h")
    (receiver,) = amc["spec"]["receivers"]
    assert route["receiver"] == receiver["name"]
    (hook,) = receiver["webhookConfigs"]
    svc = one(docs, "Service", "router")
    assert hook["url"] == (f"http://{svc['metadata']['name']}.{NAMESPACE}.svc.cluster.local:"
                           f"{svc['spec']['ports'][0]['port']}/v1/alertmanager")
    secret = one(docs, "Secret", "token")
    assert hook["httpConfig"] == {"authorization": {"type": "Bearer", "credentials": {
        "name": secret["metadata"]["name"], "key": "token"}}}
    assert hook["maxAlerts"] == 10 and hook["sendResolved"] is True

    existing = one(_render_ci("existing-secret-values.yaml"), "AlertmanagerConfig")
    creds = existing["spec"]["receivers"][0]["webhookConfigs"][0]["httpConfig"]["authorization"]["credentials"]
    assert creds == {"name": "trainpatrol-token", "key": "bearer"}


def test_every_alert_action_is_allowed_by_default() -> None:
    groups = yaml.safe_load((REPO / "alerting" / "rules.yml").read_text())["groups"]
    actions = {r["labels"]["action"] for g in groups for r in g["rules"] if "action" in r.get("labels", {})}
    assert actions, "no alert carries an action label"
    allowed = set(yaml.safe_load((CHART / "values.yaml").read_text())["allowedActions"])
    assert actions <= allowed, actions - allowed


# --- token Secret ---------------------------------------------------------------------------------


def _token(docs: list[Doc] | tuple[Doc, ...]) -> str:
    return base64.b64decode(one(docs, "Secret", "token")["data"]["token"]).decode()


def test_token_is_generated_when_not_given() -> None:
    first, second = _token(render()), _token(render())
    assert re.fullmatch(r"[A-Za-z0-9]{48}", first) and re.fullmatch(r"[A-Za-z0-9]{48}", second)
    assert first != second  # random on install: only lookup keeps it (next test)


def test_given_token_and_existing_secret() -> None:
    docs = _render_ci("token-values.yaml")
    assert _token(docs) == "not-a-real-token-0123456789abcdef"
    assert one(docs, "Secret")["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}
    docs = _render_ci("existing-secret-values.yaml")
    assert "Secret" not in kinds(docs)
    for workload in (one(docs, "DaemonSet"), one(docs, "Deployment")):
        (vol,) = [v for v in workload["spec"]["template"]["spec"]["volumes"] if v["name"] == "token"]
        assert vol["secret"]["secretName"] == "trainpatrol-token"
        assert vol["secret"]["items"] == [{"key": "bearer", "path": "token"}]


class _FakeKubeAPI(BaseHTTPRequestHandler):
    """Just enough of the Kubernetes API for Helm's ``lookup "v1" "Secret"``."""

    secrets: dict[str, Doc] = {}
    requests: list[str] = []

    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        path = self.path.split("?")[0]
        self.requests.append(path)
        prefix = f"/api/v1/namespaces/{NAMESPACE}/secrets/"
        status, body = 200, None
        if path == "/api":
            body = {"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": []}
        elif path == "/apis":
            body = {"kind": "APIGroupList", "apiVersion": "v1", "groups": []}
        elif path == "/api/v1":
            body = {"kind": "APIResourceList", "groupVersion": "v1", "resources": [
                {"name": "secrets", "singularName": "secret", "namespaced": True, "kind": "Secret",
                 "verbs": ["get", "list"]}]}
        elif path.startswith(prefix) and path[len(prefix):] in self.secrets:
            body = self.secrets[path[len(prefix):]]
        if body is None:
            status, body = 404, {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                 "reason": "NotFound", "code": 404}
        answer_json(self, status, body)


@pytest.fixture
def kube_api() -> Iterator[tuple[helm_python.Config, type[_FakeKubeAPI]]]:
    handler = type("Handler", (_FakeKubeAPI,), {"secrets": {}, "requests": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    kubeconfig = yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "fake",
        "clusters": [{"name": "fake", "cluster": {"server": f"http://127.0.0.1:{server.server_address[1]}"}}],
        "users": [{"name": "fake", "user": {"token": "fake"}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake", "namespace": NAMESPACE}}],
    })
    config = helm_python.Config(kubeconfig_content=kubeconfig, namespace=NAMESPACE)
    try:
        yield config, handler
    finally:
        config.close()
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def test_token_is_kept_across_upgrades(kube_api: tuple[helm_python.Config, type[_FakeKubeAPI]]) -> None:
    config, api = kube_api

    def upgrade(values: dict[str, Any]) -> str:
        manifests = config.render(_chart(), values, name=RELEASE, namespace=NAMESPACE, is_upgrade=True)
        return _token(_parse(manifests))

    # First install: nothing in the cluster, so a new token (lookup really asked the API).
    name = f"{RELEASE}-trainpatrol-token"
    installed = upgrade({})
    assert f"/api/v1/namespaces/{NAMESPACE}/secrets/{name}" in api.requests
    # The release's Secret now exists: every upgrade keeps its token.
    api.secrets[name] = {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                         "metadata": {"name": name, "namespace": NAMESPACE},
                         "data": {"token": base64.b64encode(installed.encode()).decode()}}
    assert upgrade({}) == installed
    assert upgrade({"router": {"replicas": 3}}) == installed
    # A token given in values replaces it (rotation is explicit).
    assert upgrade({"auth": {"token": "rotated"}}) == "rotated"


# --- NetworkPolicy --------------------------------------------------------------------------------


def test_networkpolicy_admits_only_the_named_peers_on_the_one_port() -> None:
    docs = _render_ci("default-values.yaml")
    np = one(docs, "NetworkPolicy")
    spec = np["spec"]
    release = {"app.kubernetes.io/name": "trainpatrol", "app.kubernetes.io/instance": RELEASE}
    assert spec["podSelector"] == {"matchLabels": release}
    for workload in (one(docs, "DaemonSet"), one(docs, "Deployment")):
        assert release.items() <= workload["spec"]["template"]["metadata"]["labels"].items()
    assert spec["policyTypes"] == ["Ingress"] and "egress" not in spec
    (rule,) = spec["ingress"]
    assert rule["ports"] == [{"port": 9402, "protocol": "TCP"}]
    assert rule["from"] == [
        {"podSelector": {"matchLabels": release}},  # the router and peer agents
        {"namespaceSelector": {}, "podSelector": {"matchLabels": {"app.kubernetes.io/name": "alertmanager"}}},
        {"namespaceSelector": {}, "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}},
        {"namespaceSelector": {}, "podSelector": {"matchLabels": {"trainpatrol.io/patrol": "true"}}},
    ]


def test_networkpolicy_custom_peers_and_off() -> None:
    (rule,) = one(_render_ci("networkpolicy-values.yaml"), "NetworkPolicy")["spec"]["ingress"]
    assert rule["from"][1]["podSelector"] == {"matchLabels": {"alertmanager": "main"}}
    assert rule["from"][3]["namespaceSelector"] == {"matchLabels": {"team": "ml"}}
    assert rule["from"][-1] == {"ipBlock": {"cidr": "10.0.0.0/16"}}
    assert len(rule["from"]) == 5
    no_amp = render({"networkPolicy": {"alertmanagerFrom": [], "prometheusFrom": [], "trainingPodsFrom": []}})
    (rule,) = one(no_amp, "NetworkPolicy")["spec"]["ingress"]
    assert len(rule["from"]) == 1
    assert "NetworkPolicy" not in kinds(_render_ci("no-networkpolicy-values.yaml"))


# --- training pods: NOTES and examples -------------------------------------------------------------


def _check_training_pod(template: Doc, container_name: str) -> None:
    labels = template["metadata"]["labels"]
    assert labels["trainpatrol.io/patrol"] == "true"  # admitted by the default NetworkPolicy
    pod = template["spec"]
    (c,) = [c for c in pod["containers"] if c["name"] == container_name]
    names = [e["name"] for e in c["env"]]
    e = env(c)
    assert "NODE_IP" not in names  # no host port: the node-local Service of release "trainpatrol" reaches the agent
    assert e["TRAINPATROL_AGENT_URL"] == "http://trainpatrol-agent.monitoring.svc:9402"
    # the workload's identity from the downward API, on Kubernetes (probe.workload)
    assert e["POD_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    assert e["POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert e["NODE_NAME"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert e["CONTAINER_NAME"] == container_name
    assert e["TRAINPATROL_RUN"]
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    token_volume = volumes["trainpatrol-token"]["secret"]
    (item,) = token_volume["items"]
    assert e["TRAINPATROL_TOKEN_FILE"] == f"{mounts['trainpatrol-token']}/{item['path']}"


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
def test_job_example(kube_version: str) -> None:
    from trainpatrol.actions import STOP_EXIT_CODE

    job = yaml.safe_load((EXAMPLES / "job.yaml").read_text())
    kubernetes_validate.validate(job, kube_version, strict=True)
    assert job["spec"]["template"]["spec"]["restartPolicy"] == "Never"  # podFailurePolicy needs it
    fail_job = [r for r in job["spec"]["podFailurePolicy"]["rules"] if r["action"] == "FailJob"]
    assert fail_job[0]["onExitCodes"] == {"containerName": "train", "operator": "In", "values": [STOP_EXIT_CODE]}
    _check_training_pod(job["spec"]["template"], "train")


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
def test_pytorchjob_example(kube_version: str) -> None:
    job = yaml.safe_load((EXAMPLES / "pytorchjob.yaml").read_text())
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert set(specs) == {"Master", "Worker"}
    runs = set()
    for spec in specs.values():
        # ExitCode: only 128-255 are retried, so `stop` (86) is final.
        assert spec["restartPolicy"] == "ExitCode"
        # No PyTorchJob schema here: validate each replica's pod template as a core PodTemplate.
        kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"},
                                      "template": spec["template"]}, kube_version, strict=True)
        _check_training_pod(spec["template"], "pytorch")
        runs.add(env(spec["template"]["spec"]["containers"][0])["TRAINPATROL_RUN"])
    assert len(runs) == 1  # every node's ranks are one run


def test_notes_show_how_to_point_training_pods_at_the_agent() -> None:
    notes = _chart().render({}, name=RELEASE, namespace=NAMESPACE)["trainpatrol/templates/NOTES.txt"]
    for text in ("TRAINPATROL_AGENT_URL", f"http://{RELEASE}-trainpatrol-agent.{NAMESPACE}.svc.cluster.local:9402",
                 "TRAINPATROL_RUN",
                 "TRAINPATROL_TOKEN_FILE", f"secretName: {RELEASE}-trainpatrol-token", "trainpatrol.io/patrol",
                 "values: [86]", "helm/examples/job.yaml", "helm/examples/pytorchjob.yaml"):
        assert text in notes, text


# --- values documentation --------------------------------------------------------------------------


def test_values_table_in_docs_is_current() -> None:
    doc = values_doc.DOC.read_text()
    assert values_doc.render(doc) == doc, "run: python helm/values_doc.py"


def test_every_schema_property_has_a_default_in_values_yaml() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    schema = json.loads((CHART / "values.schema.json").read_text())
    values_doc.rows(values, schema)  # every value has a schema entry with a description

    def walk(prefix: str, node: dict[str, Any], vals: dict[str, Any]) -> None:
        for key, child in node.get("properties", {}).items():
            assert key in vals, f"schema property '{prefix}{key}' has no default in values.yaml"
            if "properties" in child:
                walk(f"{prefix}{key}.", child, vals[key])

    walk("", schema, values)
    _chart().validate_schema(values)


# --- beside dcgm-exporter, tuned alerts, umbrella charts --------------------------------------------


def _rule_ci_values() -> list[Path]:
    return [p for p in CI_VALUES if ci_values(p).get("prometheusRule", {}).get("enabled")]


def _tuned(values: dict[str, Any]) -> bool:
    rule = values.get("prometheusRule", {})
    return bool(rule.get("alerts") or "runbookBaseUrl" in rule or "xidCriticalCodes" in rule)


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed")
@pytest.mark.parametrize("values_file", _rule_ci_values(), ids=[p.name for p in _rule_ci_values()])
def test_rendered_prometheusrule_passes_promtool_check_and_the_rule_tests(values_file: Path, tmp_path: Path) -> None:
    """Every ci values file's PrometheusRule is valid; untuned, it is the shipped rule file of its GPU source
    (rules-dcgm.yml for dcgm, rules.yml for nvml) rule for rule, so the shipped promtool tests
    (tests/alerting/test_rules.py) hold for it as they stand."""
    values = ci_values(values_file)
    dcgm = values.get("gpuSource") == "dcgm"
    rule = one(_render_ci(values_file.name), "PrometheusRule")
    name = "rules-dcgm.yml" if dcgm else "rules.yml"
    (tmp_path / name).write_text(yaml.safe_dump(rule["spec"], sort_keys=False))
    check = subprocess.run([PROMTOOL, "check", "rules", name], cwd=tmp_path, capture_output=True, text=True,
                           timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    if _tuned(values):
        return  # tuned rules differ from the shipped tests on purpose: test_tuned_alerts checks them
    assert rule["spec"] == yaml.safe_load((REPO / "alerting" / name).read_text())


def test_dcgm_mode_turns_nvml_off_and_ships_the_dcgm_rules_and_dashboard() -> None:
    docs = _render_ci("dcgm-values.yaml")
    c = container(one(docs, "DaemonSet"))
    assert _cli_args(c).nvml is False
    assert "NVIDIA_VISIBLE_DEVICES" not in env(c)
    rule = one(docs, "PrometheusRule")
    assert rule["spec"] == yaml.safe_load((REPO / "alerting" / "rules-dcgm.yml").read_text())
    data = {k: v for d in docs if d["kind"] == "ConfigMap" for k, v in d["data"].items()}
    assert data == _dashboards("dcgm")
    assert "gpu-node-dcgm.json" in data and "gpu-node.json" not in data
    assert "gpu-node-dcgm.json" not in {k for d in render() if d["kind"] == "ConfigMap" for k in d["data"]}


def test_tuned_alerts_apply_enabled_severity_for_labels_runbooks_and_xid_codes() -> None:
    rule = one(_render_ci("tuned-alerts-values.yaml"), "PrometheusRule")
    alerts = [r for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r]
    names = {r["alert"] for r in alerts}
    shipped = yaml.safe_load((REPO / "alerting" / "rules.yml").read_text())
    shipped_alerts = [r for g in shipped["groups"] for r in g["rules"] if "alert" in r]
    assert names == {r["alert"] for r in shipped_alerts} - {"TrainPatrolStraggler"}
    (idle,) = [r for r in alerts if r["alert"] == "TrainPatrolGPUUnderutilized"]
    assert (idle["for"], idle["labels"]) == ("30m", {"severity": "info", "team": "ml-platform"})
    (spike,) = [r for r in alerts if r["alert"] == "TrainPatrolLossSpike"]
    assert spike["labels"] == {"severity": "warning", "action": "capture", "route": "slack"}
    assert spike["for"] == "0s"
    for r in alerts:
        assert r["annotations"]["runbook_url"] == f"https://wiki.example.com/ml/trainpatrol-runbooks#{r['alert'].lower()}"
    xid = [r["expr"] for r in alerts if r["alert"] == "TrainPatrolGPUXidError"]
    assert sum('xid=~"48|79"' in e for e in xid) == 2 and sum('xid!~"48|79"' in e for e in xid) == 1
    assert not [e for e in xid if "62" in e]
    # Untuned alerts are as shipped.
    (stalled,) = [r for r in alerts if r["alert"] == "TrainPatrolRankStalled"]
    assert stalled == next(r for r in shipped_alerts if r["alert"] == "TrainPatrolRankStalled") | {
        "annotations": stalled["annotations"]}


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed")
@pytest.mark.parametrize("gpu_source", ["nvml", "dcgm"])
def test_xid_critical_codes_from_values_decide_the_severity(gpu_source: str, tmp_path: Path) -> None:
    """With xidCriticalCodes [48, 79], XID 62 warns and XID 48 pages, from either GPU source."""
    values = {"gpuSource": gpu_source, "prometheusRule": {"enabled": True, "xidCriticalCodes": [48, 79]}}
    rule = one(render(values), "PrometheusRule")
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(rule["spec"], sort_keys=False))
    if gpu_source == "dcgm":
        gpu = 'job="dcgm-exporter",instance="10.0.1.5:9400",gpu="0",UUID="GPU-aaa",Hostname="n"'
        other = gpu.replace('gpu="0",UUID="GPU-aaa"', 'gpu="1",UUID="GPU-bbb"')
        series = {f"DCGM_FI_DEV_XID_ERRORS{{{gpu}}}": "62x10", f"DCGM_FI_DEV_XID_ERRORS{{{other}}}": "48x10"}
    else:
        gpu = 'job="trainpatrol",instance="n:9402",gpu="0",uuid="GPU-aaa"'
        series = {f'trainpatrol_gpu_xid_last_timestamp_seconds{{{gpu},xid="62"}}': "300x10",
                  f'trainpatrol_gpu_xid_last_timestamp_seconds{{{gpu},xid="48"}}': "300x10"}
    inputs = [{"series": k, "values": v} for k, v in series.items()]
    expr = 'count by (severity) (ALERTS{alertname="TrainPatrolGPUXidError",alertstate="firing"})'
    doc = {"rule_files": ["rules.yml"], "evaluation_interval": "1m", "tests": [{
        "interval": "1m", "input_series": inputs, "promql_expr_test": [{
            "expr": expr, "eval_time": "6m", "exp_samples": [
                {"labels": '{severity="critical"}', "value": 1}, {"labels": '{severity="warning"}', "value": 1}]}]}]}
    (tmp_path / "xid.test.yml").write_text(yaml.safe_dump(doc, sort_keys=False))
    result = subprocess.run([PROMTOOL, "test", "rules", "xid.test.yml"], cwd=tmp_path, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_xid_codes_in_the_chart_match_the_rule_config() -> None:
    """The template finds the shipped codes in the rules by the list in _helpers.tpl."""
    sys.path.insert(0, str(REPO))
    try:
        from alerting.config import DEFAULT
    finally:
        sys.path.remove(str(REPO))
    helpers = (CHART / "templates" / "_helpers.tpl").read_text()
    shipped = re.search(r'define "trainpatrol.shippedXidCodes" -}}\n([0-9,]+)\n', helpers)
    assert shipped and shipped.group(1) == ",".join(map(str, DEFAULT.xid_critical_codes))
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert tuple(values["prometheusRule"]["xidCriticalCodes"]) == DEFAULT.xid_critical_codes


def test_global_values_namespace_override_registry_host_port_and_host_pid() -> None:
    docs = _render_ci("global-values.yaml")
    assert {d["metadata"]["namespace"] for d in docs} == {"gpu-monitoring"}
    ds = one(docs, "DaemonSet")
    pod, c = ds["spec"]["template"]["spec"], container(ds)
    assert c["image"] == "mirror.example.com/trainpatrol/trainpatrol:" + _chart().metadata["appVersion"]
    assert c["ports"] == [{"name": "http", "containerPort": 9402, "protocol": "TCP", "hostPort": 9402}]
    assert pod["hostPID"] is True and _cli_args(c).nvml_processes is True
    peers = one(docs, "Service", "agent-peers")["metadata"]["name"]
    assert _cli_args(c).peers_dns == f"{peers}.gpu-monitoring.svc.cluster.local"
    digest = container(one(_render_ci("image-digest-values.yaml"), "DaemonSet"))["image"]
    assert digest.startswith("registry.example.com/ml/trainpatrol@sha256:")
    bare = container(one(render({"image": {"registry": ""}}), "DaemonSet"))["image"]
    assert bare.startswith("trainpatrol/trainpatrol:")


def test_the_router_is_scraped_under_its_own_job() -> None:
    for values_file, kind, endpoints in (("servicemonitor-values.yaml", "ServiceMonitor", "endpoints"),
                                         ("podmonitor-values.yaml", "PodMonitor", "podMetricsEndpoints")):
        docs = _render_ci(values_file)
        mon = one(docs, kind, "router")
        pod = one(docs, "Deployment", "router")["spec"]["template"]["metadata"]
        target = one(docs, "Service", "router")["metadata"] if kind == "ServiceMonitor" else pod
        assert mon["spec"]["selector"]["matchLabels"].items() <= target["labels"].items()
        (ep,) = mon["spec"][endpoints]
        assert ep["relabelings"] == [{"targetLabel": "job", "replacement": "trainpatrol-router"}]
    assert not [d for d in _render_ci("no-router-values.yaml") if d["kind"] == "ServiceMonitor"]


def test_umbrella_chart_with_global_values_lints_and_renders(tmp_path: Path) -> None:
    umbrella = tmp_path / "ml-platform"
    (umbrella / "charts").mkdir(parents=True)
    (umbrella / "templates").mkdir()
    shutil.copytree(CHART, umbrella / "charts" / "trainpatrol", ignore=shutil.ignore_patterns("ci"))
    version = _chart().metadata["version"]
    (umbrella / "Chart.yaml").write_text(yaml.safe_dump({
        "apiVersion": "v2", "name": "ml-platform", "version": "1.0.0",
        "dependencies": [{"name": "trainpatrol", "version": version, "repository": "file://charts/trainpatrol"}]}))
    values = {"global": {"imageRegistry": "mirror.example.com", "storageClass": "fast"},
              "trainpatrol": {"prometheusRule": {"enabled": True}, "gpuSource": "dcgm"}}
    (umbrella / "values.yaml").write_text(yaml.safe_dump(values))
    report = helm_python.lint(umbrella, values=values, strict=True, kube_version="v" + KUBE_VERSIONS[0],
                              namespace=NAMESPACE)
    assert report["errors"] == [], report["errors"]
    docs = _parse(helm_python.Chart.load(umbrella).render(values, name=RELEASE, namespace=NAMESPACE))
    ds = one(docs, "DaemonSet")
    assert container(ds)["image"].startswith("mirror.example.com/trainpatrol/trainpatrol:")
    assert one(docs, "PrometheusRule")["spec"] == yaml.safe_load((REPO / "alerting" / "rules-dcgm.yml").read_text())
