"""The Helm chart, rendered by the real helm binary and checked against the real Kubernetes schemas."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from .helm_kit import (
    ALL_FEATURES,
    CHART,
    NAMESPACED,
    ROOT,
    only,
    pod_specs,
    pyproject,
    render,
    run_helm,
)

pytestmark = pytest.mark.helm

# The chart's kubeVersion floor and the newest schemas kubernetes-validate ships.
KUBE_VERSIONS = ["1.29", kubernetes_validate.utils.latest_version()]
PROMETHEUS_OPERATOR_KINDS = {"ServiceMonitor", "PodMonitor"}
VALUE_SETS = {
    "defaults": {},
    "all-features": ALL_FEATURES,
    "namespaced": {**ALL_FEATURES, **NAMESPACED},
}

# The fields of the Prometheus Operator's monitoring.coreos.com/v1 CRDs this chart uses, with the
# types and patterns of the real CRDs (their schemas are not in kubernetes-validate).
_DURATION = {
    "type": "string",
    "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$",
}
_LABEL_NAME = {"type": "string", "pattern": r"^[a-zA-Z_][a-zA-Z0-9_]*$"}
_ENDPOINT = {
    "type": "object",
    "additionalProperties": False,
    "required": ["port"],
    "properties": {
        "port": {"type": "string", "minLength": 1},
        "path": {"type": "string", "pattern": "^/"},
        "interval": _DURATION,
        "scrapeTimeout": _DURATION,
        "honorLabels": {"type": "boolean"},
        "relabelings": {
            "type": "array",
            "items": {
                "type": "object",
                "additionalProperties": False,
                "properties": {
                    "sourceLabels": {"type": "array", "items": _LABEL_NAME},
                    "separator": {"type": "string"},
                    "targetLabel": _LABEL_NAME,
                },
            },
        },
    },
}
_MONITOR_SPEC = {
    "type": "object",
    "additionalProperties": False,
    "required": ["selector"],
    "properties": {
        "selector": {
            "type": "object",
            "additionalProperties": False,
            "required": ["matchLabels"],
            "properties": {
                "matchLabels": {
                    "type": "object",
                    "minProperties": 1,
                    "additionalProperties": {"type": "string"},
                }
            },
        },
        "namespaceSelector": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "any": {"type": "boolean"},
                "matchNames": {"type": "array", "items": {"type": "string"}},
            },
        },
        "endpoints": {"type": "array", "minItems": 1, "items": _ENDPOINT},
        "podMetricsEndpoints": {"type": "array", "minItems": 1, "items": _ENDPOINT},
    },
}


def _monitor_schema(kind: str) -> dict[str, Any]:
    endpoints = "endpoints" if kind == "ServiceMonitor" else "podMetricsEndpoints"
    spec = {**_MONITOR_SPEC, "required": ["selector", endpoints]}
    return {
        "type": "object",
        "additionalProperties": False,
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "monitoring.coreos.com/v1"},
            "kind": {"const": kind},
            "metadata": {"type": "object", "required": ["name", "namespace"]},
            "spec": spec,
        },
    }


@pytest.fixture(scope="module", params=list(VALUE_SETS))
def rendered(
    request: pytest.FixtureRequest, helm: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, list[dict[str, Any]]]:
    name = request.param
    return name, render(helm, tmp_path_factory.mktemp(name), VALUE_SETS[name])


@pytest.mark.parametrize("values", list(VALUE_SETS))
def test_helm_lint_strict_passes(helm: Path, tmp_path: Path, values: str) -> None:
    result = run_helm(
        helm, "lint", "--strict", str(CHART), values=VALUE_SETS[values], tmp_path=tmp_path
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
def test_every_document_validates_strictly(
    rendered: tuple[str, list[dict[str, Any]]], kube_version: str
) -> None:
    _, docs = rendered
    for doc in docs:
        if doc["kind"] in PROMETHEUS_OPERATOR_KINDS:
            jsonschema.validate(doc, _monitor_schema(doc["kind"]))
        else:
            # Raises on any unknown field or wrong type; SchemaNotFoundError on an unknown kind.
            kubernetes_validate.validate(doc, kube_version, strict=True)


def test_defaults_render_only_the_operator_and_its_rbac(helm: Path, tmp_path: Path) -> None:
    kinds = sorted(d["kind"] for d in render(helm, tmp_path))
    assert kinds == [
        "ClusterRole",
        "ClusterRoleBinding",
        "CustomResourceDefinition",
        "Deployment",
        "ServiceAccount",
    ]


def test_all_features_render_monitoring_and_dashboard(helm: Path, tmp_path: Path) -> None:
    docs = render(helm, tmp_path, ALL_FEATURES)
    monitor = only(docs, "ServiceMonitor")
    service = only(docs, "Service")
    deployment = only(docs, "Deployment")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    # The Service selects the operator pod, and the ServiceMonitor selects the Service by its port.
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    container_ports = {
        p["name"]: p["containerPort"]
        for p in deployment["spec"]["template"]["spec"]["containers"][0]["ports"]
    }
    assert service["spec"]["ports"][0]["targetPort"] == "metrics"
    assert container_ports["metrics"] == 8080
    assert monitor["spec"]["endpoints"][0]["port"] == "metrics"
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    pod_monitor = only(docs, "PodMonitor")
    assert pod_monitor["spec"]["podMetricsEndpoints"][0]["port"] == "http"
    assert pod_monitor["spec"]["namespaceSelector"] == {"any": True}
    dashboard = only(docs, "ConfigMap")
    assert dashboard["metadata"]["namespace"] == "monitoring"
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = json.loads((CHART / "dashboards" / "llmendpoints.json").read_text())
    assert json.loads(dashboard["data"]["llmendpoints.json"]) == shipped


def test_chart_crds_are_byte_identical_to_the_source_of_truth() -> None:
    source = sorted(p.name for p in (ROOT / "crds").glob("*.yaml"))
    chart = sorted(p.name for p in (CHART / "files" / "crds").glob("*.yaml"))
    assert source, "crds/ holds no CRD"
    assert chart == source, "run scripts/sync_crds.sh"
    for name in source:
        assert (CHART / "files" / "crds" / name).read_bytes() == (
            ROOT / "crds" / name
        ).read_bytes(), (
            f"charts/llmendpoints/files/crds/{name} differs from crds/{name}: "
            "run scripts/sync_crds.sh"
        )
    # No crds/ folder: Helm would install it once and never upgrade it (templates/crds.yaml).
    assert not (CHART / "crds").exists()


def test_the_crd_is_a_template_helm_upgrades_and_uninstall_keeps(
    helm: Path, tmp_path: Path
) -> None:
    """cert-manager's practice: the CRD rendered from the repository's crds/ (so `helm upgrade`
    upgrades it), kept on `helm uninstall` (deleting it deletes every LLMEndpoint)."""
    source = yaml.safe_load((ROOT / "crds" / "llmendpoints.dev_llmendpoints.yaml").read_text())
    crd = only(render(helm, tmp_path), "CustomResourceDefinition")
    assert crd["spec"] == source["spec"]
    assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert crd["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "Helm"
    loose = only(render(helm, tmp_path, {"crds": {"keep": False}}), "CustomResourceDefinition")
    assert "helm.sh/resource-policy" not in (loose["metadata"].get("annotations") or {})
    off = render(helm, tmp_path, {"crds": {"enabled": False}})
    assert not [d for d in off if d["kind"] == "CustomResourceDefinition"]


def test_rendered_crd_is_the_llmendpoint_resource(helm: Path, tmp_path: Path) -> None:
    crd = only(render(helm, tmp_path), "CustomResourceDefinition")
    assert crd["metadata"]["name"] == "llmendpoints.llmendpoints.dev"
    assert crd["spec"]["names"]["kind"] == "LLMEndpoint"


def _rbac_rules(docs: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    return [
        (f"{d['kind']}/{d['metadata'].get('namespace', '')}/{d['metadata']['name']}", rule)
        for d in docs
        if d["kind"] in {"Role", "ClusterRole"}
        for rule in d["rules"]
    ]


def test_rbac_has_no_wildcards_and_never_reads_secrets(
    rendered: tuple[str, list[dict[str, Any]]],
) -> None:
    _, docs = rendered
    rules = _rbac_rules(docs)
    assert rules
    for where, rule in rules:
        for field in ("apiGroups", "resources", "verbs", "resourceNames", "nonResourceURLs"):
            assert "*" not in rule.get(field, []), f"{where}: wildcard in {field}: {rule}"
        if "secrets" in rule.get("resources", []):
            # Only the endpoints' admin keys are written, created once: never read or changed.
            assert rule["verbs"] == ["create"], f"{where}: the operator never reads Secrets"
        assert not {"escalate", "bind", "impersonate"} & set(rule["verbs"]), f"{where}: {rule}"


def _grants(rules: list[tuple[str, dict[str, Any]]]) -> dict[tuple[str, str], set[str]]:
    grants: dict[tuple[str, str], set[str]] = {}
    for _, rule in rules:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                grants.setdefault((group, resource), set()).update(rule["verbs"])
    return grants


def test_rbac_grants_what_the_operator_does_and_nothing_else(helm: Path, tmp_path: Path) -> None:
    docs = render(helm, tmp_path)
    grants = _grants(_rbac_rules(docs))
    assert grants == {
        ("apiextensions.k8s.io", "customresourcedefinitions"): {"list", "watch"},
        ("llmendpoints.dev", "llmendpoints"): {"list", "watch", "patch"},
        ("llmendpoints.dev", "llmendpoints/status"): {"patch"},
        ("apps", "deployments"): {"list", "watch", "create", "patch", "delete"},
        ("leaderworkerset.x-k8s.io", "leaderworkersets"): {
            "list",
            "watch",
            "create",
            "patch",
            "delete",
        },
        ("", "pods"): {"list"},
        ("", "persistentvolumeclaims"): {"list", "watch", "create", "patch", "delete"},
        ("", "services"): {"create", "patch"},
        ("", "configmaps"): {"create", "patch", "delete"},
        ("", "secrets"): {"create"},
        ("policy", "poddisruptionbudgets"): {"create", "patch", "delete"},
        ("networking.k8s.io", "ingresses"): {"create", "patch", "delete"},
        ("inference.networking.k8s.io", "inferencepools"): {"create", "patch", "delete"},
        ("discovery.k8s.io", "endpointslices"): {"list"},
        ("", "events"): {"create"},
        ("", "nodes"): {"list"},
    }
    binding = only(docs, "ClusterRoleBinding")
    account = only(docs, "ServiceAccount")
    deployment = only(docs, "Deployment")
    assert binding["roleRef"]["name"] == only(docs, "ClusterRole")["metadata"]["name"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account["metadata"]["name"], "namespace": "llm-system"}
    ]
    assert (
        deployment["spec"]["template"]["spec"]["serviceAccountName"] == account["metadata"]["name"]
    )


@pytest.mark.parametrize("values", [{}, NAMESPACED])
def test_the_fit_check_reads_secrets_only_when_asked_and_nodes_only_when_on(
    helm: Path, tmp_path: Path, values: dict[str, Any]
) -> None:
    reads = render(helm, tmp_path, {**values, "fit": {"readTokenSecrets": True}})
    assert _grants(_rbac_rules(reads))[("", "secrets")] == {"create", "get"}
    env = {e["name"]: e.get("value") for e in _operator_env(reads)}
    assert env["LLMEP_OPERATOR_FIT_READ_TOKEN_SECRETS"] == "true"
    off = render(helm, tmp_path, {**values, "fit": {"enabled": False, "readTokenSecrets": True}})
    grants = _grants(_rbac_rules(off))
    assert grants[("", "secrets")] == {"create"}
    assert ("", "nodes") not in grants
    env = {e["name"]: e.get("value") for e in _operator_env(off)}
    assert env["LLMEP_OPERATOR_FIT_CHECK"] == "false"
    assert env["LLMEP_OPERATOR_FIT_READ_TOKEN_SECRETS"] == "false"


def _operator_env(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return only(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["env"]


def test_watch_namespaces_switches_to_namespaced_roles(helm: Path, tmp_path: Path) -> None:
    docs = render(helm, tmp_path, NAMESPACED)
    roles = [d for d in docs if d["kind"] == "Role"]
    bindings = [d for d in docs if d["kind"] == "RoleBinding"]
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["team-a", "team-b"]
    for binding in bindings:
        assert binding["subjects"][0]["namespace"] == "llm-system"
        assert binding["roleRef"] == {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "Role",
            "name": roles[0]["metadata"]["name"],
        }
    # Cluster-wide, only read-only discovery remains: no write verb on anything cluster-scoped.
    cluster_rules = [rule for d in docs if d["kind"] == "ClusterRole" for rule in d["rules"]]
    assert {
        (g, r) for rule in cluster_rules for g in rule["apiGroups"] for r in rule["resources"]
    } == {
        ("apiextensions.k8s.io", "customresourcedefinitions"),
        ("", "namespaces"),
        ("", "nodes"),  # the fit check's GPU labels
    }
    assert {v for rule in cluster_rules for v in rule["verbs"]} == {"list", "watch"}
    args = only(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=team-a" in args and "--namespace=team-b" in args
    assert "--all-namespaces" not in args


def test_clusterwide_by_default(helm: Path, tmp_path: Path) -> None:
    docs = render(helm, tmp_path)
    args = only(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--all-namespaces" in args
    assert not [a for a in args if a.startswith("--namespace")]
    assert not [d for d in docs if d["kind"] in {"Role", "RoleBinding"}]


def test_every_container_is_locked_down(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    _, docs = rendered
    pods = list(pod_specs(docs))
    assert pods
    for name, pod in pods:
        pod_ctx = pod.get("securityContext", {})
        for container in pod.get("initContainers", []) + pod["containers"]:
            ctx = container.get("securityContext", {})
            where = f"{name}/{container['name']}"
            run_as_non_root = ctx.get("runAsNonRoot", pod_ctx.get("runAsNonRoot"))
            uid = ctx.get("runAsUser", pod_ctx.get("runAsUser"))
            seccomp = ctx.get("seccompProfile", pod_ctx.get("seccompProfile", {}))
            assert run_as_non_root is True, where
            assert isinstance(uid, int) and uid > 0, f"{where}: needs a fixed non-root uid"
            assert ctx.get("allowPrivilegeEscalation") is False, where
            assert ctx.get("readOnlyRootFilesystem") is True, where
            assert ctx.get("privileged", False) is False, where
            assert ctx.get("capabilities", {}).get("drop") == ["ALL"], where
            assert not ctx.get("capabilities", {}).get("add"), where
            assert seccomp.get("type") == "RuntimeDefault", where
            assert container.get("resources", {}).get("requests") and container["resources"].get(
                "limits"
            ), where
        assert not pod.get("hostNetwork") and not pod.get("hostPID") and not pod.get("hostIPC"), (
            name
        )


def test_operator_deployment_shape(helm: Path, tmp_path: Path) -> None:
    deployment = only(render(helm, tmp_path), "Deployment")
    spec = deployment["spec"]
    pod = spec["template"]["spec"]
    container = pod["containers"][0]
    assert spec["replicas"] == 1
    assert spec["strategy"] == {"type": "Recreate"}
    assert (
        container["image"] == f"ghcr.io/llmendpoints/operator:{pyproject()['project']['version']}"
    )
    assert container["args"][:2] == ["--standalone", "--liveness=http://0.0.0.0:8081/healthz"]
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"metrics": 8080, "health": 8081}
    # The read-only root filesystem gets one writable scratch directory.
    assert container["volumeMounts"] == [{"name": "tmp", "mountPath": "/tmp"}]
    assert pod["volumes"][0]["emptyDir"]["medium"] == "Memory"


def test_image_digest_wins_over_tag(helm: Path, tmp_path: Path) -> None:
    digest = "sha256:" + "b" * 64
    deployment = only(
        render(helm, tmp_path, {"image": {"tag": "9.9.9", "digest": digest}}), "Deployment"
    )
    assert (
        deployment["spec"]["template"]["spec"]["containers"][0]["image"]
        == f"ghcr.io/llmendpoints/operator@{digest}"
    )


def test_operator_settings_come_from_values(helm: Path, tmp_path: Path) -> None:
    values = {
        "runtimeDefaults": {
            "image": {"repository": "registry.example.com/llm/runtime", "tag": "2.0.0"},
            "gpuResourceName": "amd.com/gpu",
            "podSecurityContext": {"runAsNonRoot": True, "runAsUser": 4242},
            "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True},
            "inferencePool": True,
        },
        "operator": {"resyncSeconds": 120, "metricsPort": 9090},
        "clusterDomain": "corp.example",
    }
    container = only(render(helm, tmp_path, values), "Deployment")["spec"]["template"]["spec"][
        "containers"
    ][0]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["LLMEP_OPERATOR_RUNTIME_IMAGE"] == "registry.example.com/llm/runtime:2.0.0"
    assert env["LLMEP_OPERATOR_GPU_RESOURCE_NAME"] == "amd.com/gpu"
    # Helm merges maps from your values into the defaults, key by key.
    assert json.loads(env["LLMEP_OPERATOR_RUNTIME_POD_SECURITY_CONTEXT"]) == {
        "runAsNonRoot": True,
        "runAsUser": 4242,
        "runAsGroup": 1000,
        "fsGroup": 1000,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    assert json.loads(env["LLMEP_OPERATOR_RUNTIME_SECURITY_CONTEXT"]) == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    assert env["LLMEP_OPERATOR_RESYNC_SECONDS"] == "120"
    assert env["LLMEP_OPERATOR_METRICS_PORT"] == "9090"
    assert env["LLMEP_OPERATOR_CLUSTER_DOMAIN"] == "corp.example"
    assert env["LLMEP_OPERATOR_INFERENCE_POOL_DEFAULT"] == "true"
    assert {p["name"]: p["containerPort"] for p in container["ports"]}["metrics"] == 9090


def test_rendered_environment_is_what_the_operator_settings_read(
    helm: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The contract with operator/llmendpoints_operator/config.py: every LLMEP_OPERATOR_* variable
    the chart sets is a real setting, it parses, and default values give the operator's defaults."""
    from llmendpoints_operator.config import OperatorSettings

    container = only(render(helm, tmp_path), "Deployment")["spec"]["template"]["spec"][
        "containers"
    ][0]
    env = {e["name"]: e["value"] for e in container["env"]}
    fields = {f"LLMEP_OPERATOR_{name.upper()}" for name in OperatorSettings.model_fields}
    assert set(env) <= fields, f"not operator settings: {set(env) - fields}"
    for name in [n for n in os.environ if n.startswith("LLMEP_OPERATOR_")]:
        monkeypatch.delenv(name)
    defaults = OperatorSettings()
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert OperatorSettings() == defaults


@pytest.mark.parametrize(
    ("values", "complaint"),
    [
        ({"watchNamespace": ["team-a"]}, "watchNamespace"),  # misspelt top-level key
        ({"image": {"respository": "x"}}, "respository"),  # misspelt nested key
        ({"metrics": {"podMonitor": {"enable": True}}}, "enable"),
        ({"operator": {"resyncSeconds": "soon"}}, "resyncSeconds"),
        ({"operator": {"metricsPort": 70000}}, "metricsPort"),
        ({"clusterDomain": "Cluster_Local"}, "clusterDomain"),
        ({"watchNamespaces": "team-a"}, "watchNamespaces"),
        ({"watchNamespaces": ["Team_A"]}, "watchNamespaces"),
        ({"grafanaDashboard": {"enabled": "yes"}}, "enabled"),
        ({"image": {"pullPolicy": "Sometimes"}}, "pullPolicy"),
        ({"metrics": {"serviceMonitor": {"interval": "30 seconds"}}}, "interval"),
        ({"runtimeDefaults": {"securityContext": "privileged"}}, "securityContext"),
    ],
)
def test_values_schema_rejects_typos_and_wrong_types(
    helm: Path, tmp_path: Path, values: dict[str, Any], complaint: str
) -> None:
    for command in (["template", "x", str(CHART)], ["lint", "--strict", str(CHART)]):
        result = run_helm(helm, *command, values=values, tmp_path=tmp_path)
        assert result.returncode != 0, f"helm {command[0]} accepted {values}"
        assert complaint in result.stdout + result.stderr


def test_metrics_and_health_ports_must_differ(helm: Path, tmp_path: Path) -> None:
    result = run_helm(
        helm,
        "template",
        "x",
        str(CHART),
        values={"operator": {"healthPort": 8080}},
        tmp_path=tmp_path,
    )
    assert result.returncode != 0
    assert "must differ" in result.stderr


def test_chart_version_follows_the_package() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    version = pyproject()["project"]["version"]
    assert chart["version"] == version
    assert chart["appVersion"] == version


def test_default_runtime_image_is_the_operators_default(helm: Path, tmp_path: Path) -> None:
    from llmendpoints_operator.config import DEFAULT_RUNTIME_IMAGE

    container = only(render(helm, tmp_path), "Deployment")["spec"]["template"]["spec"][
        "containers"
    ][0]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["LLMEP_OPERATOR_RUNTIME_IMAGE"] == DEFAULT_RUNTIME_IMAGE


def test_every_value_is_documented_and_in_the_schema() -> None:
    """Each chart setting in values.yaml has a comment right above it and a described schema entry
    (the contents of free-form Kubernetes objects such as `resources` are not settings)."""
    text = (CHART / "values.yaml").read_text()
    lines = text.splitlines()
    schema = json.loads((CHART / "values.schema.json").read_text())
    problems: list[str] = []

    def walk(node: yaml.Node, schema_node: dict[str, Any], path: str) -> None:
        if (
            not isinstance(node, yaml.MappingNode)
            or schema_node.get("additionalProperties") is not False
        ):
            return
        for key_node, value_node in node.value:
            key = f"{path}{key_node.value}"
            above = lines[key_node.start_mark.line - 1].strip() if key_node.start_mark.line else ""
            if not above.startswith("#"):
                problems.append(f"{key}: no comment above it")
            sub = schema_node["properties"].get(key_node.value)
            if sub is None:
                problems.append(f"{key}: not in values.schema.json")
                continue
            if not sub.get("description") and sub.get("additionalProperties") is not False:
                problems.append(f"{key}: no description in values.schema.json")
            walk(value_node, sub, f"{key}.")

    walk(yaml.compose(text), schema, "")
    assert not problems, problems


@pytest.mark.parametrize("values", ["defaults", "namespaced"])
def test_operator_cli_accepts_the_charts_arguments(helm: Path, tmp_path: Path, values: str) -> None:
    """The image's entrypoint is `llmendpoints-operator run`; the chart passes only flags, and the
    operator's own argument parser must accept every one of them."""
    from llmendpoints_operator.__main__ import _parser

    container = only(render(helm, tmp_path, VALUE_SETS[values]), "Deployment")["spec"]["template"][
        "spec"
    ]["containers"][0]
    args = _parser().parse_args(["run", *container["args"]])
    assert args.standalone is True
    assert args.liveness == "http://0.0.0.0:8081/healthz"
    if values == "namespaced":
        assert args.namespaces == ["team-a", "team-b"] and not args.all_namespaces
    else:
        assert args.all_namespaces and not args.namespaces


def test_pod_monitor_selects_the_runtime_pods_the_operator_builds(
    helm: Path, tmp_path: Path
) -> None:
    from llmendpoints_operator import manifests, spec
    from llmendpoints_operator.config import OperatorSettings

    endpoint = spec.parse("chat", "team-a", {"model": {"name": "Qwen/Qwen2.5-0.5B-Instruct"}})
    pod = manifests.build_deployment(endpoint, OperatorSettings(), replicas=1)["spec"]["template"]
    monitor = only(render(helm, tmp_path, ALL_FEATURES), "PodMonitor")["spec"]
    assert monitor["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    port_names = {p["name"] for c in pod["spec"]["containers"] for p in c.get("ports", [])}
    assert monitor["podMetricsEndpoints"][0]["port"] in port_names
    # The relabelling reads the pod label that names the endpoint (Prometheus sanitises its name).
    (relabel,) = monitor["podMetricsEndpoints"][0]["relabelings"]
    assert pod["metadata"]["labels"][manifests.LABEL_ENDPOINT] == "chat"
    sanitised = "__meta_kubernetes_pod_label_" + "".join(
        ch if ch.isalnum() else "_" for ch in manifests.LABEL_ENDPOINT
    )
    # ... joined to its namespace: endpoint="team-a/chat", as the gateway and the operator label.
    assert relabel["sourceLabels"] == ["__meta_kubernetes_namespace", sanitised]
    assert (relabel["separator"], relabel["targetLabel"]) == ("/", "endpoint")


@pytest.mark.parametrize("values", ["defaults", "namespaced"])
def test_install_notes_tell_the_next_steps(helm: Path, tmp_path: Path, values: str) -> None:
    result = run_helm(
        helm, "install", "llmendpoints", str(CHART), "-n", "llm-system", "--dry-run=client",
        values=VALUE_SETS[values], tmp_path=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    notes = result.stdout.split("NOTES:", 1)[1]
    manifest = result.stdout.split("MANIFEST:", 1)[1].split("NOTES:", 1)[0]
    docs = [d for d in yaml.safe_load_all(manifest) if d]
    deployment = only(docs, "Deployment")["metadata"]["name"]
    assert f"kubectl -n llm-system rollout status deployment/{deployment}" in notes
    assert "kubectl apply -f examples/minimal.yaml" in notes
    assert "/v1/chat/completions" in notes
    assert ("team-a, team-b" in notes) == (values == "namespaced")


# Kinds of the children the operator builds, as RBAC names them.
CHILD_RESOURCES = {
    "Deployment": ("apps", "deployments"),
    "Service": ("", "services"),
    "ConfigMap": ("", "configmaps"),
    "PersistentVolumeClaim": ("", "persistentvolumeclaims"),
    "PodDisruptionBudget": ("policy", "poddisruptionbudgets"),
    "Ingress": ("networking.k8s.io", "ingresses"),
    "InferencePool": ("inference.networking.k8s.io", "inferencepools"),
    "LeaderWorkerSet": ("leaderworkerset.x-k8s.io", "leaderworkersets"),
}


@pytest.mark.parametrize("values", ["defaults", "namespaced"])
def test_rbac_covers_what_the_operator_code_watches_and_writes(
    helm: Path, tmp_path: Path, values: str
) -> None:
    """Derived from the operator itself: every resource its kopf handlers watch, every child kind
    its builders produce (server-side apply: create + patch), every optional child it prunes
    (delete), the EndpointSlices the autoscaler lists, and the Events it posts — and nothing more."""
    import kopf
    import llmendpoints_operator.handlers  # noqa: F401  (registers the kopf handlers)
    from llmendpoints_operator import groups, kube, manifests, spec
    from llmendpoints_operator.autoscaling import controller
    from llmendpoints_operator.config import OperatorSettings

    docs = render(helm, tmp_path, VALUE_SETS[values])
    rbac_docs = [d for d in docs if d["kind"] in {"Role", "ClusterRole"}]
    grants = _grants(_rbac_rules(rbac_docs))
    needed: dict[tuple[str, str], set[str]] = {}

    def need(group: str, resource: str, *verbs: str) -> None:
        needed.setdefault((group, resource), set()).update(verbs)

    registry = kopf.get_default_registry()
    for handlers, verbs in [
        (registry._indexing, ("list", "watch")),
        (registry._watching, ("list", "watch")),
        (registry._changing, ("list", "watch", "patch")),
        (registry._spawning, ("list", "watch", "patch")),
    ]:
        for handler in handlers.get_all_handlers():
            selector = handler.selector
            need(selector.group or "", selector.plural or selector.any_name, *verbs)

    every_child = {**yaml.safe_load((ROOT / "examples" / "ingress.yaml").read_text())["spec"]}
    every_child["scaling"] = {"minReplicas": 2, "maxReplicas": 3}  # a PodDisruptionBudget too
    every_child["api"] = {**every_child["api"], "inferencePool": {"enabled": True}}
    endpoint = spec.parse("chat", "team-a", every_child)
    children = [*manifests.build_children(endpoint, OperatorSettings())]
    children.append(manifests.build_deployment(endpoint, OperatorSettings(), replicas=2))
    children.append(manifests.build_inference_pool(endpoint, OperatorSettings()))
    # A multi-node endpoint's workload, and one of either kind deleted when nodes changes.
    every_child["resources"] = {"gpus": 8, "nodes": 2}
    in_groups = spec.parse("chat", "team-a", every_child)
    children.append(groups.build_workload(in_groups, OperatorSettings(), replicas=2))
    for workload in (endpoint, in_groups):
        need(*CHILD_RESOURCES[groups.other_workload_ref(workload).kind], "delete")
    built = {child["kind"] for child in children}
    assert set(CHILD_RESOURCES) >= built, f"unknown child kinds {built - set(CHILD_RESOURCES)}"
    assert built == set(CHILD_RESOURCES), "the example should produce every kind of child"
    for kind in built:
        need(*CHILD_RESOURCES[kind], "create", "patch")
    for ref in manifests.optional_children("chat"):
        need(*CHILD_RESOURCES[ref.kind], "delete")
    # The InferencePool is optional too: deleted when the spec stops asking for it.
    need(*CHILD_RESOURCES[manifests.INFERENCE_POOL_KIND], "delete")
    need(manifests.GROUP, f"{manifests.PLURAL}/status", "patch")
    # The endpoint's admin key: created once (POST; a 409 means it exists), never read.
    assert manifests.build_admin_key_secret(endpoint, "k")["kind"] == "Secret"
    need("", "secrets", "create")
    group, _, _ = controller.ENDPOINTSLICE_API[0].rpartition("/")
    need(group, "endpointslices", "list")
    # The pods of a multi-node endpoint whose groups are not all ready (reconcile.py).
    need("", "pods", "list")
    # The fit check reads the nodes' GPU labels (kube.KubeClient.list_nodes).
    assert kube.KubeClient.list_nodes
    need("", "nodes", "list")
    need("", "events", "create")
    # kopf itself: CRD discovery, and namespace names when it serves a list of namespaces.
    need("apiextensions.k8s.io", "customresourcedefinitions", "list", "watch")
    if values == "namespaced":
        need("", "namespaces", "list", "watch")

    for (group, resource), verbs in needed.items():
        missing = verbs - grants.get((group, resource), set())
        assert not missing, f"RBAC lacks {sorted(missing)} on {group or 'core'}/{resource}"
    for (group, resource), verbs in grants.items():
        extra = verbs - needed.get((group, resource), set())
        assert not extra, f"RBAC grants {sorted(extra)} on {group or 'core'}/{resource}: unused"
