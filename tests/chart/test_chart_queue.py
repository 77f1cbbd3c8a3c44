"""The chart's shared job queue: NATS JetStream run by the release (queue.enabled) or an existing
one (queue.url / queue.existingSecret), and the operator's LLMEP_OPERATOR_JOBS_QUEUE_URL."""

from __future__ import annotations

import base64
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from .helm_kit import CHART, only, pod_specs, render, run_helm
from .nats_chart_kit import lay_out

NATS_SERVER = Path(sys.executable).parent / "nats-server"
QUEUE = {"queue": {"enabled": True}}


def operator_env(docs: list[dict[str, Any]]) -> dict[str, Any]:
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    env = deployment["spec"]["template"]["spec"]["containers"][0]["env"]
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in env}


def test_queue_off_by_default(helm: Path, tmp_path: Path) -> None:
    docs = render(helm, tmp_path)
    assert not [d for d in docs if d["kind"] == "StatefulSet"]
    assert "LLMEP_OPERATOR_JOBS_QUEUE_URL" not in operator_env(docs)


@pytest.mark.parametrize("kube_version", ["1.29", kubernetes_validate.utils.latest_version()])
def test_enabled_queue_renders_valid_documents(helm: Path, tmp_path: Path, kube_version) -> None:
    for doc in render(helm, tmp_path, QUEUE):
        kubernetes_validate.validate(doc, kube_version, strict=True)
    result = run_helm(helm, "lint", "--strict", str(CHART), values=QUEUE, tmp_path=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_enabled_queue_is_a_replicated_durable_nats_cluster(helm: Path, tmp_path: Path) -> None:
    docs = render(helm, tmp_path, QUEUE)
    nats = only(docs, "StatefulSet")
    spec = nats["spec"]
    assert spec["replicas"] == 3
    pod = spec["template"]["spec"]
    (container,) = pod["containers"]
    image = container["image"]
    assert image.startswith("nats:") and image != "nats:latest"  # the official image, pinned
    claim = spec["volumeClaimTemplates"][0]
    assert claim["spec"]["resources"]["requests"]["storage"] == "10Gi"
    assert {"name": "data", "mountPath": "/data"} in container["volumeMounts"]
    anti = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert anti[0]["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert only(docs, "PodDisruptionBudget")["spec"]["maxUnavailable"] == 1
    assert container["resources"]["requests"] and container["resources"]["limits"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    secret = only(docs, "Secret")
    keys = {"operator", "system-account", "account", "account-signing"}
    assert set(secret["data"]) == keys | {"cluster-password"}
    for key in keys:  # 32 random bytes each, in base64 (the init container makes nkeys of them)
        assert len(base64.b64decode(base64.b64decode(secret["data"][key]))) == 32
    env = operator_env(docs)
    # No password in any URL: every client has its own creds file.
    assert env["LLMEP_OPERATOR_JOBS_QUEUE_URL"] == "nats://llmendpoints-nats.llm-system.svc:4222"
    assert env["LLMEP_OPERATOR_JOBS_QUEUE_KEYS_DIR"] == "/etc/llmendpoints/queue-keys"
    assert env["LLMEP_OPERATOR_JOBS_QUEUE_REPLICAS"] == "3"
    operator_pod = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]
    (keys_volume,) = [v for v in operator_pod["volumes"] if v["name"] == "queue-keys"]
    # The operator gets the signing half only, never the operator key that signs accounts.
    assert keys_volume["secret"] == {
        "secretName": secret["metadata"]["name"],
        "items": [
            {"key": "account", "path": "account"},
            {"key": "account-signing", "path": "account-signing"},
        ],
    }
    # Monitoring is not reachable from outside the pod: bound to 127.0.0.1, no port declared.
    assert "http: 127.0.0.1:8222" in only(docs, "ConfigMap")["data"]["nats.conf"]
    assert {p["name"] for p in container["ports"]} == {"client", "cluster"}
    for service in (d for d in docs if d["kind"] == "Service"):
        assert 8222 not in {p["port"] for p in service["spec"]["ports"]}


def test_hard_anti_affinity_requires_distinct_nodes(helm: Path, tmp_path: Path) -> None:
    values = {"queue": {"enabled": True, "nats": {"antiAffinity": "hard"}}}
    pod = only(render(helm, tmp_path, values), "StatefulSet")["spec"]["template"]["spec"]
    assert pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]


@pytest.mark.parametrize("replicas", [1, 3])
def test_rendered_nats_configuration_is_accepted_by_nats_server(
    helm: Path, tmp_path: Path, replicas: int
) -> None:
    values = {"queue": {"enabled": True, "nats": {"replicas": replicas}}}
    docs = render(helm, tmp_path, values)
    # The pod's files: the ConfigMap, the keys Secret, and what the init container writes.
    nats, _ = lay_out(docs, tmp_path / "pod")
    result = subprocess.run(
        [str(NATS_SERVER), "-c", str(nats.config), "-t"],
        capture_output=True,
        text=True,
        env={"POD_NAME": "llmendpoints-nats-0"},
        timeout=30,
    )
    assert result.returncode == 0, result.stderr + result.stdout
    config = nats.config.read_text()
    assert "max_payload: 33554432" in config
    routes = tmp_path / "pod" / "auth" / "routes.conf"
    if replicas > 1:
        # Every route carries the cluster password; a server without it cannot join.
        password = (nats.keys / "cluster-password").read_text()
        assert routes.read_text().count(f"route:{password}@") == replicas
    else:
        assert "cluster" not in config.split("jetstream")[1] and not routes.exists()


def test_existing_nats_by_url_or_secret(helm: Path, tmp_path: Path) -> None:
    by_url = render(helm, tmp_path, {"queue": {"url": "nats://nats.infra:4222"}})
    assert operator_env(by_url)["LLMEP_OPERATOR_JOBS_QUEUE_URL"] == "nats://nats.infra:4222"
    assert not [d for d in by_url if d["kind"] == "StatefulSet"]
    by_secret = render(
        helm,
        tmp_path,
        {"queue": {"existingSecret": "queue-creds", "existingSecretKey": "nats-url"}},
    )
    assert operator_env(by_secret)["LLMEP_OPERATOR_JOBS_QUEUE_URL"] == {
        "secretKeyRef": {"name": "queue-creds", "key": "nats-url"}
    }


def test_the_per_key_cap_on_queued_jobs_reaches_the_operator(
    helm: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from llmendpoints_operator.config import OperatorSettings

    name = "LLMEP_OPERATOR_JOBS_MAX_QUEUED_PER_OWNER"
    default = operator_env(render(helm, tmp_path, QUEUE))[name]
    values = {"queue": {"enabled": True, "maxQueuedJobsPerKey": 5}}
    rendered = operator_env(render(helm, tmp_path, values))[name]
    assert (default, rendered) == ("1000", "5")
    monkeypatch.setenv(name, rendered)
    assert OperatorSettings().jobs_max_queued_per_owner == 5  # the operator reads it


@pytest.mark.parametrize(
    "values",
    [
        {"queue": {"enabled": "yes"}},
        {"queue": {"url": "http://nats:4222"}},
        {"queue": {"nats": {"replicas": 2}}},
        {"queue": {"nats": {"maxPayload": 1048576}}},
        {"queue": {"nats": {"antiAffinity": "maybe"}}},
        {"queue": {"natz": {}}},
        {"queue": {"maxQueuedJobsPerKey": -1}},
    ],
)
def test_schema_refuses_bad_queue_values(helm: Path, tmp_path: Path, values) -> None:
    result = run_helm(helm, "template", "x", str(CHART), values=values, tmp_path=tmp_path)
    assert result.returncode != 0
    assert "queue" in result.stderr


def test_every_queue_container_is_locked_down(helm: Path, tmp_path: Path) -> None:
    docs = render(helm, tmp_path, QUEUE)
    for name, pod in pod_specs(docs):
        for container in pod["containers"]:
            ctx = container["securityContext"]
            assert ctx["allowPrivilegeEscalation"] is False, name
            assert ctx["capabilities"]["drop"] == ["ALL"], name
        assert yaml.safe_dump(pod)  # renders
