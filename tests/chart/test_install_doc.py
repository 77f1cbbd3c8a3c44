"""docs/install.md says what the chart and the code do: the chart rendered with exactly the values
and flags the page installs with, the endpoint and the key Secret it creates read by the code
that reads them, the names its commands use, what the install notes say, what uninstall leaves.
The steps that need a cluster are not run here (there is none); everything they rely on is."""

from __future__ import annotations

import base64
import itertools
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from .helm_kit import ROOT, only, render, run_helm

DOC = (ROOT / "docs" / "install.md").read_text()
REGISTRY = "registry.example.com/llm"  # what the page exports
RELEASE_NS = "llm-system"
KEYS_NS = "llm-system-keys"


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", DOC, re.S)


def command(start: str) -> str:
    """The whole shell command (continuation lines joined) that starts with `start`."""
    for block in blocks("bash"):
        text = block.replace("\\\n", " ")
        for line in text.splitlines():
            line = " ".join(line.split())
            if line.startswith(start):
                for name, value in (("$REGISTRY", REGISTRY), ("$RELEASE_NS", RELEASE_NS)):
                    line = line.replace(name, value)
                return line.replace("$KEYS_NS", KEYS_NS)
    raise AssertionError(f"no command starting {start!r} in docs/install.md")


def heredoc(opening: str) -> str:
    for block in blocks("bash"):
        if opening in block:
            return block.split(opening, 1)[1].split("\nYAML", 1)[0].lstrip("\n")
    raise AssertionError(f"no heredoc {opening!r}")


def set_flags(cmd: str) -> dict[str, Any]:
    """--set a.b=c flags as nested values."""
    values: dict[str, Any] = {}
    words = shlex.split(cmd)
    for flag, value in itertools.pairwise(words):
        if flag != "--set":
            continue
        path, _, raw = value.partition("=")
        node = values
        *parents, leaf = path.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = {"true": True, "false": False}.get(raw, raw)
    return values


def merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = dict(a)
    for key, value in b.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and key in out else value
    return out


@pytest.fixture(scope="module")
def installed_values() -> dict[str, Any]:
    install = command("helm install llmendpoints charts/llmendpoints")
    assert f"-n {RELEASE_NS}" in install and "-f llmendpoints-values.yaml" in install
    values = yaml.safe_load(heredoc("cat > llmendpoints-values.yaml <<'YAML'"))
    return merge(values, set_flags(install))


@pytest.fixture(scope="module")
def docs(helm: Path, tmp_path_factory, installed_values) -> list[dict[str, Any]]:
    return render(helm, tmp_path_factory.mktemp("install"), installed_values)


def _env(docs: list[dict[str, Any]], deployment: str) -> dict[str, dict[str, Any]]:
    (dep,) = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == deployment]
    return {e["name"]: e for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}


def test_every_command_is_copyable() -> None:
    """No `<placeholder>` in a shell block (a shell reads `<x>` as a redirection), and every
    variable a block uses is one the page exports."""
    exported = {
        "REGISTRY",
        "RELEASE_NS",
        "KEYS_NS",
        "KEY",
        "PROMETHEUS_RELEASE",
        "HF_TOKEN",
        "MODEL_REVISION",
    }
    for block in blocks("bash"):
        assert not re.search(r"<[A-Za-z][\w -]*>", block), block
        used = set(re.findall(r"\$([A-Z_]+)\b", block)) | set(re.findall(r"\$\{([A-Z_]+)\}", block))
        assert used <= exported, (used - exported, block)
    assert "export REGISTRY=" in DOC and "export RELEASE_NS=llm-system" in DOC


def test_scale_to_zero_is_allowed_with_exactly_the_documented_values(docs) -> None:
    """The operator gets both the gateway's URL and the queue's, so it allows minReplicas 0."""
    from llmendpoints_operator.config import OperatorSettings

    env = _env(docs, "llmendpoints")
    assert (
        env["LLMEP_OPERATOR_GATEWAY_URL"]["value"] == "http://llmendpoints-gateway.llm-system.svc"
    )
    queue = env["LLMEP_OPERATOR_JOBS_QUEUE_URL"]["value"]
    assert queue.startswith("nats://") and "@" not in queue  # no password: credentials by file
    assert env["LLMEP_OPERATOR_JOBS_QUEUE_KEYS_DIR"]["value"]  # it mints the pods' credentials
    settings = OperatorSettings(
        gateway_url=env["LLMEP_OPERATOR_GATEWAY_URL"]["value"], jobs_queue_url=queue
    )
    assert settings.scales_to_zero
    # ... and the gateway reads the same queue, with a credential of its own.
    gateway = _env(docs, "llmendpoints-gateway")
    assert gateway["JOBS_QUEUE_URL"]["value"] == queue
    assert gateway["JOBS_QUEUE_CREDS_FILE"]["value"]


def test_without_the_queue_scale_to_zero_is_refused_and_the_notes_say_so(
    helm: Path, tmp_path: Path, installed_values
) -> None:
    """What NOTES.txt and docs/gateway.md used to get wrong: the gateway alone is not enough."""
    from llmendpoints_operator.config import OperatorSettings

    values = merge(installed_values, {"queue": {"enabled": False}})
    env = _env(render(helm, tmp_path, values), "llmendpoints")
    assert "LLMEP_OPERATOR_GATEWAY_URL" in env and "LLMEP_OPERATOR_JOBS_QUEUE_URL" not in env
    assert not OperatorSettings(
        gateway_url=env["LLMEP_OPERATOR_GATEWAY_URL"]["value"]
    ).scales_to_zero
    notes = _notes(helm, tmp_path, values)
    assert "minReplicas: 0 also needs the shared queue" in notes
    assert "minReplicas: 0 is allowed" not in notes


def _notes(helm: Path, tmp_path: Path, values: dict[str, Any]) -> str:
    result = run_helm(
        helm, "install", "llmendpoints", str(ROOT / "charts" / "llmendpoints"), "--dry-run=client",
        "--namespace", RELEASE_NS, values=values, tmp_path=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return result.stdout.split("NOTES:", 1)[1]


def test_the_install_notes_say_scale_to_zero_is_on(helm: Path, tmp_path: Path, installed_values):
    notes = _notes(helm, tmp_path, installed_values)
    assert "minReplicas: 0 is allowed" in notes
    assert "http://llmendpoints-gateway.llm-system.svc/v1" in notes


def test_the_images_are_the_ones_step_1_pushes(docs) -> None:
    images = {
        c["image"]
        for d in docs
        if d["kind"] in ("Deployment", "StatefulSet")
        for c in d["spec"]["template"]["spec"]["containers"]
    }
    assert f"{REGISTRY}/operator:0.1.0" in images and f"{REGISTRY}/gateway:0.1.0" in images
    env = _env(docs, "llmendpoints")
    assert env["LLMEP_OPERATOR_RUNTIME_IMAGE"]["value"] == f"{REGISTRY}/runtime:0.1.0"
    assert "make images REGISTRY=$REGISTRY PUSH=1" in DOC


def test_the_names_the_commands_use_exist(docs) -> None:
    names = {(d["kind"], d["metadata"]["name"]) for d in docs}
    for kind, name in re.findall(r"rollout status (deployment|statefulset)/([\w-]+)", DOC):
        assert (kind.capitalize().replace("set", "Set"), name) in names, (kind, name)
    service = [
        d
        for d in docs
        if d["kind"] == "Service" and d["metadata"]["name"] == "llmendpoints-gateway"
    ]
    assert service and service[0]["spec"]["ports"][0]["port"] == 80
    assert "port-forward svc/llmendpoints-gateway 8080:80" in DOC


def test_the_documented_endpoint_scales_to_zero_only_with_gateway_and_queue() -> None:
    from llmendpoints_operator.spec import InvalidSpecError, parse

    doc = yaml.safe_load(heredoc("kubectl -n team-a apply -f - <<'YAML'"))
    assert doc["kind"] == "LLMEndpoint" and doc["metadata"]["name"] == "qwen"
    ep = parse("qwen", "team-a", doc["spec"], scale_to_zero=True)
    assert ep.spec.scaling.min_replicas == 0
    with pytest.raises(InvalidSpecError, match="minReplicas"):
        parse("qwen", "team-a", doc["spec"], scale_to_zero=False)


def test_the_documented_tenant_key_secret_is_a_key_with_limits(docs) -> None:
    from llmendpoints_gateway.keys import KEY_SECRET_LABEL, secret_api_key

    # where the page puts key Secrets is where the chart's gateway reads them
    assert f"export KEYS_NS={KEYS_NS}" in DOC
    assert _env(docs, "llmendpoints-gateway")["GATEWAY_KEYS_NAMESPACE"]["value"] == KEYS_NS
    create = command("kubectl -n $KEYS_NS create secret generic team-a-key")
    literals = dict(
        w.split("=", 1)[1].split("=", 1)
        for w in shlex.split(create)
        if w.startswith("--from-literal")
    )
    literals["key"] = "sk-" + "ab" * 24  # what $(openssl rand -hex 24) gives
    label = command("kubectl -n $KEYS_NS label secret team-a-key")
    assert f"{KEY_SECRET_LABEL}=true" in label
    secret = {
        "metadata": {
            "name": "team-a-key",
            "namespace": KEYS_NS,
            "labels": {KEY_SECRET_LABEL: "true"},
        },
        "data": {k: base64.b64encode(v.encode()).decode() for k, v in literals.items()},
    }
    _, key = secret_api_key(secret)
    assert key.name == "team-a-key" and key.endpoints == frozenset({"qwen"})
    assert key.limits.requests_per_minute == 600


def test_monitoring_scrapes_the_gateway_too(helm: Path, tmp_path: Path, installed_values) -> None:
    upgrade = command(
        "helm upgrade llmendpoints charts/llmendpoints -n $RELEASE_NS --reuse-values --set metrics"
    )
    values = merge(
        installed_values, set_flags(upgrade.replace("$PROMETHEUS_RELEASE", "kube-prometheus-stack"))
    )
    docs = render(helm, tmp_path, values)
    monitors = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ServiceMonitor"}
    assert set(monitors) == {"llmendpoints"}
    assert monitors["llmendpoints"]["spec"]["endpoints"][0]["honorLabels"] is True
    # The gateway is scraped on its pods' metrics port: no Service exposes /metrics.
    pods = {d["metadata"]["name"]: d for d in docs if d["kind"] == "PodMonitor"}
    gateway = pods["llmendpoints-gateway"]
    assert gateway["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert gateway["spec"]["podMetricsEndpoints"][0] == {
        **gateway["spec"]["podMetricsEndpoints"][0],
        "port": "metrics",
        "path": "/metrics",
        "honorLabels": True,
    }
    service = next(
        d
        for d in docs
        if d["kind"] == "Service" and d["metadata"]["name"] == "llmendpoints-gateway"
    )
    assert [p["name"] for p in service["spec"]["ports"]] == ["http"]
    dashboards = [
        d for d in docs if d["kind"] == "ConfigMap" and "llmendpoints.json" in d.get("data", {})
    ]
    assert dashboards


def test_upgrade_upgrades_the_crd_and_uninstall_leaves_what_the_page_says(docs) -> None:
    crd = only(docs, "CustomResourceDefinition")
    assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert "kubectl delete crd llmendpoints.llmendpoints.dev" in DOC
    # The NATS volumes: one PVC per server, named <claim template>-<statefulset>-<ordinal>.
    (nats,) = [d for d in docs if d["kind"] == "StatefulSet"]
    template = nats["spec"]["volumeClaimTemplates"][0]["metadata"]["name"]
    pvcs = [f"{template}-{nats['metadata']['name']}-{i}" for i in range(nats["spec"]["replicas"])]
    delete = shlex.split(command("kubectl -n $RELEASE_NS delete pvc"), comments=True)
    assert delete[delete.index("pvc") + 1 :] == pvcs
    assert "kubectl delete namespace $KEYS_NS" in DOC  # the key namespace is kept
    (keys,) = [d for d in docs if d["kind"] == "Namespace"]
    assert keys["metadata"]["name"] == KEYS_NS
    assert keys["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"


def test_the_crd_strategy_the_page_names_is_the_charts() -> None:
    assert "cert-manager's practice" in DOC and "helm.sh/resource-policy: keep" in DOC
    assert not (ROOT / "charts" / "llmendpoints" / "crds").exists()


def test_the_hold_outlasts_the_endpoints_start_up_as_the_page_says() -> None:
    from llmendpoints_gateway.holding import SCHEDULING_MARGIN_SECONDS

    assert "at least its `startupTimeoutSeconds` + 300 s" in DOC
    assert SCHEDULING_MARGIN_SECONDS == 300
