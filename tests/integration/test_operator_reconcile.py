"""The real operator (`python -m llmendpoints_operator run`) against an in-memory Kubernetes API.

One emulator and one operator process for the whole module (the emulator slows down as requests
pile up). Each test uses its own endpoint names, so the order of tests does not matter, except
for the restart test, which replaces the operator process and runs last.
"""

from __future__ import annotations

import asyncio
import pathlib
from typing import Any

import pytest

from .kube_emulator import CHILD_RESOURCES, LLMEP, Cluster, Operator, endpoint, until

pytestmark = [pytest.mark.kube, pytest.mark.asyncio(loop_scope="module")]

NS = "models"
DEPLOYMENTS = CHILD_RESOURCES["Deployment"]
# Every endpoint is reconciled again every few seconds (the default is 300 s).
# A cluster-admin policy (docs/security.md): endpoints run images of one registry only.
OPERATOR_ENV = {
    "LLMEP_OPERATOR_RESYNC_SECONDS": "3",
    "LLMEP_OPERATOR_ALLOWED_IMAGES": "registry.example.com/*",
}
# What the Deployment controller reports once one pod passes its readiness probe.
OPERATOR = "llmendpoints-operator"  # the operator's default field manager
AVAILABLE = {"replicas": 1, "readyReplicas": 1, "availableReplicas": 1, "updatedReplicas": 1}


def _status(cluster: Cluster, name: str) -> dict[str, Any]:
    return (cluster.get(LLMEP, NS, name) or {}).get("status") or {}


def _condition(cluster: Cluster, name: str, type_: str) -> dict[str, Any]:
    return next((c for c in _status(cluster, name).get("conditions", []) if c["type"] == type_), {})


async def _resyncs(operator: Operator) -> float:
    """Reconciles the resync has done, whatever their result (the operator's /metrics)."""
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in (await operator.metrics()).splitlines()
        if line.startswith("llmendpoints_operator_reconciles_total{") and 'trigger="resync"' in line
    )


def _env(deployment: dict[str, Any]) -> dict[str, Any]:
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    return {var["name"]: var.get("value", var.get("valueFrom")) for var in container["env"]}


FULL_SPEC = {
    "model": {
        "name": "org/model",
        "chatTemplate": "{% for m in messages %}{{ m.content }}{% endfor %}",
        "hfTokenSecretRef": {"name": "hf", "key": "token"},
    },
    "engine": {"maxModelLen": 4096, "args": {"max-num-seqs": 64}},
    "cache": {"size": "100Gi"},
    "scaling": {"minReplicas": 1, "maxReplicas": 3},
    "api": {
        "apiKeysSecretRef": {"name": "keys", "key": "api-keys"},
        "ingress": {"enabled": True, "host": "llm.example.com"},
    },
}


async def test_create_builds_every_child_with_owner_and_reports_status(
    cluster: Cluster, operator: Operator
) -> None:
    await cluster.create(LLMEP, NS, endpoint("full", NS, FULL_SPEC))
    # observedGeneration is written once the reconcile of that generation is complete.
    await until(operator, lambda: _status(cluster, "full").get("observedGeneration") == 1, "status")
    owner_uid = cluster.get(LLMEP, NS, "full")["metadata"]["uid"]

    expected = {
        "Deployment": "full",
        "Service": "full",
        "ConfigMap": "full-chat-template",
        "Secret": "full-admin-key",
        "PersistentVolumeClaim": "full-model-cache",
        "PodDisruptionBudget": "full",
        "Ingress": "full",
    }
    for kind, name in expected.items():
        child = cluster.get(CHILD_RESOURCES[kind], NS, name)
        assert child is not None, f"{kind} {name} was not created"
        refs = child["metadata"]["ownerReferences"]
        assert [(r["kind"], r["name"], r["uid"], r["controller"]) for r in refs] == [
            ("LLMEndpoint", "full", owner_uid, True)
        ]

    env = _env(cluster.get(DEPLOYMENTS, NS, "full"))
    assert env["MODEL_NAME"] == "org/model"
    assert env["MAX_NUM_SEQS"] == "64"
    assert env["HF_TOKEN"] == {"secretKeyRef": {"name": "hf", "key": "token"}}
    assert env["ADMIN_API_KEYS_FILE"] == "/etc/llmendpoints/admin-key/admin-api-key"
    assert cluster.get(DEPLOYMENTS, NS, "full")["spec"]["replicas"] == 1

    status = _status(cluster, "full")
    assert status["phase"] == "Pending"
    assert status["url"] == "http://full.models.svc.cluster.local"
    assert status["ingressUrl"] == "http://llm.example.com"
    # The claim has no status in the emulator (no provisioner): the endpoint waits for it.
    assert _condition(cluster, "full", "CacheReady")["reason"] == "ClaimPending"
    assert _condition(cluster, "full", "Ready")["reason"] == "WaitingForCache"
    await until(
        operator,
        lambda: "Created" in [e["reason"] for e in cluster.events(NS, "full")],
        "a Created event",
    )

    # A provisioner binds the claim: the claim's watch event updates the endpoint's status.
    claims = CHILD_RESOURCES["PersistentVolumeClaim"]
    await cluster.patch(claims, NS, "full-model-cache", {"status": {"phase": "Bound"}})
    await until(
        operator,
        lambda: _condition(cluster, "full", "CacheReady").get("reason") == "Bound",
        "CacheReady=True",
    )
    assert _status(cluster, "full")["phase"] == "Starting"


async def test_children_becoming_ready_make_the_endpoint_ready(
    cluster: Cluster, operator: Operator
) -> None:
    await cluster.create(LLMEP, NS, endpoint("ready", NS, {"model": {"name": "org/m"}}))
    await until(operator, lambda: cluster.get(DEPLOYMENTS, NS, "ready"), "deployment")
    await until(operator, lambda: _status(cluster, "ready").get("phase") == "Starting", "Starting")

    # What the Deployment controller would report once the pod passes its readiness probe.
    generation = cluster.get(DEPLOYMENTS, NS, "ready")["metadata"]["generation"]
    await cluster.patch(
        DEPLOYMENTS, NS, "ready", {"status": {**AVAILABLE, "observedGeneration": generation}}
    )
    await until(operator, lambda: _status(cluster, "ready").get("phase") == "Ready", "Ready")
    ready = _condition(cluster, "ready", "Ready")
    assert (ready["status"], ready["reason"]) == ("True", "Serving")
    assert _status(cluster, "ready")["readyReplicas"] == 1
    await until(
        operator,
        lambda: "Ready" in [e["reason"] for e in cluster.events(NS, "ready")],
        "a Ready event",
    )


async def test_an_existing_claim_is_reported_until_it_exists_and_is_bound(
    cluster: Cluster, operator: Operator
) -> None:
    spec = {"model": {"name": "org/m"}, "cache": {"existingClaim": "shared-weights"}}
    await cluster.create(LLMEP, NS, endpoint("shared", NS, spec))
    await until(
        operator,
        lambda: _condition(cluster, "shared", "CacheReady").get("reason") == "ClaimNotFound",
        "ClaimNotFound",
    )
    claims = CHILD_RESOURCES["PersistentVolumeClaim"]
    assert cluster.get(claims, NS, "shared-model-cache") is None  # not created: it is the user's
    claim = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": "shared-weights", "namespace": NS},
        "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "1Ti"}}},
        "status": {"phase": "Bound"},
    }
    await cluster.create(claims, NS, claim)
    await until(
        operator,
        lambda: _condition(cluster, "shared", "CacheReady").get("reason") == "Bound",
        "CacheReady=True once the user's claim exists",
    )


async def test_spec_change_updates_the_deployment_and_observed_generation(
    cluster: Cluster, operator: Operator
) -> None:
    await cluster.create(LLMEP, NS, endpoint("change", NS, {"model": {"name": "org/old"}}))
    await until(operator, lambda: cluster.get(DEPLOYMENTS, NS, "change"), "deployment")
    secrets = CHILD_RESOURCES["Secret"]
    admin_key = cluster.get(secrets, NS, "change-admin-key")
    assert admin_key is not None and admin_key["data"]["admin-api-key"]

    await cluster.patch(LLMEP, NS, "change", {"spec": {"model": {"name": "org/new"}}})
    await until(
        operator,
        lambda: _env(cluster.get(DEPLOYMENTS, NS, "change"))["MODEL_NAME"] == "org/new",
        "the new model in the Deployment",
    )
    await until(
        operator,
        lambda: _status(cluster, "change").get("observedGeneration") == 2,
        "observedGeneration 2",
    )
    # The admin key is created once: neither the update nor the resyncs (every 3 s) rewrite it.
    await asyncio.sleep(7)
    assert cluster.get(secrets, NS, "change-admin-key") == admin_key


async def test_reconcile_leaves_replicas_to_the_autoscaler_within_bounds(
    cluster: Cluster, operator: Operator
) -> None:
    spec = {"model": {"name": "org/m"}, "scaling": {"minReplicas": 1, "maxReplicas": 4}}
    await cluster.create(LLMEP, NS, endpoint("scaled", NS, spec))
    await until(operator, lambda: cluster.get(DEPLOYMENTS, NS, "scaled"), "deployment")
    # Created with replicas by an Update (the POST), never by an apply: the operator's applies
    # leave replicas out, and the emulator resets a count its last applier stops sending.
    assert cluster.replicas_owners(NS, "scaled") == {(OPERATOR, "Update")}

    # Another writer (the autoscaler, an HPA) decides 3; a later spec change must not undo it.
    await cluster.patch(
        DEPLOYMENTS, NS, "scaled", {"spec": {"replicas": 3}}, field_manager="autoscaler"
    )
    await cluster.patch(LLMEP, NS, "scaled", {"spec": {"engine": {"maxModelLen": 2048}}})
    await until(
        operator,
        lambda: _env(cluster.get(DEPLOYMENTS, NS, "scaled")).get("MAX_MODEL_LEN") == "2048",
        "the spec change",
    )
    assert cluster.get(DEPLOYMENTS, NS, "scaled")["spec"]["replicas"] == 3
    assert cluster.replicas_owners(NS, "scaled") == {("autoscaler", "Update")}

    # Lowering maxReplicas below the current count clamps it.
    await cluster.patch(LLMEP, NS, "scaled", {"spec": {"scaling": {"maxReplicas": 2}}})
    await until(
        operator,
        lambda: cluster.get(DEPLOYMENTS, NS, "scaled")["spec"]["replicas"] == 2,
        "replicas clamped to maxReplicas",
    )
    assert cluster.replicas_owners(NS, "scaled") == {(OPERATOR, "Update")}


async def test_invalid_spec_is_reported_and_fixing_it_recovers(
    cluster: Cluster, operator: Operator
) -> None:
    spec = {"model": {"name": "org/m"}, "scaling": {"minReplicas": 3, "maxReplicas": 2}}
    await cluster.create(LLMEP, NS, endpoint("broken", NS, spec))
    await until(operator, lambda: _status(cluster, "broken").get("phase") == "Failed", "Failed")

    ready = _condition(cluster, "broken", "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "InvalidSpec")
    assert ready["message"].startswith("spec.scaling.minReplicas:")
    assert _condition(cluster, "broken", "SpecValid")["status"] == "False"
    await until(
        operator,
        lambda: [e for e in cluster.events(NS, "broken") if e["reason"] == "InvalidSpec"],
        "an InvalidSpec event",
    )
    warning = next(e for e in cluster.events(NS, "broken") if e["reason"] == "InvalidSpec")
    assert warning["type"] == "Warning"
    assert "spec.scaling.minReplicas" in warning["message"]
    for resource in CHILD_RESOURCES.values():
        assert "broken" not in cluster.names(resource, NS)

    await cluster.patch(LLMEP, NS, "broken", {"spec": {"scaling": {"maxReplicas": 3}}})
    await until(operator, lambda: cluster.get(DEPLOYMENTS, NS, "broken"), "recovery")
    assert cluster.get(DEPLOYMENTS, NS, "broken")["spec"]["replicas"] == 3
    await until(
        operator,
        lambda: _condition(cluster, "broken", "SpecValid").get("status") == "True",
        "SpecValid=True",
    )
    assert operator.alive


async def test_children_the_spec_no_longer_asks_for_are_deleted(
    cluster: Cluster, operator: Operator
) -> None:
    spec = {
        "model": {"name": "org/m"},
        "api": {"ingress": {"enabled": True}, "allowUnauthenticated": True},
    }
    await cluster.create(LLMEP, NS, endpoint("prune", NS, spec))
    ingresses = CHILD_RESOURCES["Ingress"]
    await until(operator, lambda: cluster.get(ingresses, NS, "prune"), "the ingress")

    await cluster.patch(LLMEP, NS, "prune", {"spec": {"api": {"ingress": {"enabled": False}}}})
    await until(operator, lambda: cluster.get(ingresses, NS, "prune") is None, "ingress deleted")
    assert cluster.get(DEPLOYMENTS, NS, "prune") is not None


async def test_adapters_reach_pods_through_a_configmap_without_a_rollout(
    cluster: Cluster, operator: Operator
) -> None:
    configmaps = CHILD_RESOURCES["ConfigMap"]
    one = [{"name": "sql", "source": "org/sql-lora", "rank": 8}]
    await cluster.create(
        LLMEP, NS, endpoint("lora", NS, {"model": {"name": "org/m"}, "adapters": one})
    )
    await until(operator, lambda: cluster.get(configmaps, NS, "lora-adapters"), "adapters list")
    # The children are written concurrently (the fit check among them): the list can land first.
    await until(operator, lambda: cluster.get(DEPLOYMENTS, NS, "lora"), "deployment")
    assert '"name": "sql"' in cluster.get(configmaps, NS, "lora-adapters")["data"]["adapters.json"]
    template = cluster.get(DEPLOYMENTS, NS, "lora")["spec"]["template"]
    env = _env(cluster.get(DEPLOYMENTS, NS, "lora"))
    assert (env["ENABLE_LORA"], env["MAX_LORA_RANK"]) == ("true", "8")
    # The adapter watcher reports every declared adapter (no ready replica yet: 0 of 0).
    await until(
        operator,
        lambda: (
            _status(cluster, "lora").get("adapters")
            == [{"name": "sql", "readyReplicas": 0, "replicas": 0}]
        ),
        "status.adapters",
    )

    two = [*one, {"name": "legal", "source": "/models/adapters/legal"}]
    await cluster.patch(LLMEP, NS, "lora", {"spec": {"adapters": two}})
    await until(
        operator,
        lambda: '"legal"' in cluster.get(configmaps, NS, "lora-adapters")["data"]["adapters.json"],
        "the new adapter in the list",
    )
    await until(
        operator, lambda: len(_status(cluster, "lora").get("adapters", [])) == 2, "its status"
    )
    # Pods pick the list up from the refreshed volume: the pod template did not change.
    assert cluster.get(DEPLOYMENTS, NS, "lora")["spec"]["template"] == template
    assert _condition(cluster, "lora", "SpecValid")["status"] == "True"

    await cluster.patch(LLMEP, NS, "lora", {"spec": {"adapters": None}})
    await until(
        operator, lambda: cluster.get(configmaps, NS, "lora-adapters") is None, "list deleted"
    )
    await until(operator, lambda: not _status(cluster, "lora").get("adapters"), "status cleared")


async def test_a_deleted_deployment_is_recreated(cluster: Cluster, operator: Operator) -> None:
    await cluster.create(LLMEP, NS, endpoint("drift", NS, {"model": {"name": "org/m"}}))
    await until(operator, lambda: cluster.get(DEPLOYMENTS, NS, "drift"), "deployment")
    await cluster.delete(DEPLOYMENTS, NS, "drift")
    await until(operator, lambda: cluster.get(DEPLOYMENTS, NS, "drift"), "the deployment back")


async def test_resync_repairs_drift_nothing_watches(cluster: Cluster, operator: Operator) -> None:
    await cluster.create(LLMEP, NS, endpoint("resync", NS, {"model": {"name": "org/m"}}))
    services = CHILD_RESOURCES["Service"]
    await until(operator, lambda: cluster.get(services, NS, "resync"), "service")
    # The operator does not watch Services: only the periodic resync notices this.
    await cluster.delete(services, NS, "resync")
    await until(operator, lambda: cluster.get(services, NS, "resync"), "the service back")

    # A status someone else overwrote is repaired too (and the resync can post events).
    await cluster.patch(DEPLOYMENTS, NS, "resync", {"status": AVAILABLE})
    await until(operator, lambda: _status(cluster, "resync").get("phase") == "Ready", "Ready")
    await cluster.patch(LLMEP, NS, "resync", {"status": {"phase": "Starting"}})
    await until(
        operator,
        lambda: [e["reason"] for e in cluster.events(NS, "resync")].count("Ready") == 2,
        "the resync's status repair and its Ready event",
    )
    assert _status(cluster, "resync")["phase"] == "Ready"


async def test_publishing_without_keys_is_refused_and_changes_nothing(
    cluster: Cluster, operator: Operator
) -> None:
    """docs/security.md: in-cluster without keys is a warning; published without keys is refused
    unless spec.api.allowUnauthenticated says so."""
    services = CHILD_RESOURCES["Service"]
    await cluster.create(LLMEP, NS, endpoint("open", NS, {"model": {"name": "org/m"}}))
    await until(operator, lambda: _condition(cluster, "open", "Authenticated"), "Authenticated")
    assert _condition(cluster, "open", "Authenticated")["reason"] == "NoAPIKeys"
    await until(
        operator,
        lambda: [e for e in cluster.events(NS, "open") if e["reason"] == "Unauthenticated"],
        "an Unauthenticated warning",
    )

    await cluster.patch(LLMEP, NS, "open", {"spec": {"api": {"service": {"type": "LoadBalancer"}}}})
    await until(operator, lambda: _status(cluster, "open").get("phase") == "Failed", "refused")
    ready = _condition(cluster, "open", "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "InvalidSpec")
    assert ready["message"].startswith("spec.api.apiKeysSecretRef: is required")
    await until(
        operator,
        lambda: [e for e in cluster.events(NS, "open") if e["reason"] == "InvalidSpec"],
        "an InvalidSpec warning",
    )
    assert cluster.get(services, NS, "open")["spec"]["type"] == "ClusterIP"  # nothing changed

    await cluster.patch(LLMEP, NS, "open", {"spec": {"api": {"allowUnauthenticated": True}}})
    await until(
        operator,
        lambda: cluster.get(services, NS, "open")["spec"]["type"] == "LoadBalancer",
        "published once the spec allows it",
    )
    await until(
        operator,
        lambda: (
            _condition(cluster, "open", "Authenticated").get("reason") == "UnauthenticatedAllowed"
        ),
        "Authenticated=False/UnauthenticatedAllowed",
    )


async def test_policy_and_managed_variables_refuse_a_spec_and_change_nothing(
    cluster: Cluster, operator: Operator
) -> None:
    spec = {"model": {"name": "org/m"}, "engine": {"image": "registry.example.com/llm:1"}}
    await cluster.create(LLMEP, NS, endpoint("policed", NS, spec))
    await until(operator, lambda: cluster.get(DEPLOYMENTS, NS, "policed"), "deployment")

    def image() -> str:
        return cluster.get(DEPLOYMENTS, NS, "policed")["spec"]["template"]["spec"]["containers"][0][
            "image"
        ]

    def ready_message() -> str:
        return _condition(cluster, "policed", "Ready").get("message", "")

    await cluster.patch(LLMEP, NS, "policed", {"spec": {"engine": {"image": "docker.io/x/y:1"}}})
    await until(operator, lambda: "LLMEP_OPERATOR_ALLOWED_IMAGES" in ready_message(), "refusal")
    assert ready_message().startswith("spec.engine.image: 'docker.io/x/y:1' is not allowed")
    assert image() == "registry.example.com/llm:1"  # the last good workload is untouched

    env = [{"name": "UNAUTHENTICATED_PATHS", "value": "/v1"}]
    await cluster.patch(
        LLMEP,
        NS,
        "policed",
        {"spec": {"engine": {"image": "registry.example.com/llm:2", "env": env}}},
    )
    await until(operator, lambda: "UNAUTHENTICATED_PATHS" in ready_message(), "refusal")
    assert ready_message().startswith("spec.engine.env[0].name: UNAUTHENTICATED_PATHS is managed")
    assert image() == "registry.example.com/llm:1"
    await until(
        operator,
        lambda: [
            e
            for e in cluster.events(NS, "policed")
            if e["reason"] == "InvalidSpec" and "UNAUTHENTICATED_PATHS" in e["message"]
        ],
        "an InvalidSpec warning naming the variable",
    )


async def test_a_model_name_served_in_another_namespace_is_reported_on_the_newcomer(
    cluster: Cluster, operator: Operator
) -> None:
    """docs/security.md (Tenancy): the gateway routes a served model name to the oldest endpoint
    declaring it, in any namespace; the newer one gets a condition and one Warning Event naming
    the owner, keeps its pods, and gets the name once the owner is deleted."""
    spec = {"model": {"name": "org/m", "servedModelName": "shared-llama"}}
    for namespace, name, created in [
        ("elsewhere", "llama", "2026-01-01T00:00:00Z"),
        (NS, "llama-copy", "2026-01-01T00:00:01Z"),
    ]:
        body = endpoint(name, namespace, spec)
        body["metadata"]["creationTimestamp"] = created  # the emulator would stamp "now"
        await cluster.create(LLMEP, namespace, body)

    def taken() -> dict[str, Any]:
        return _condition(cluster, "llama-copy", "ModelNameAvailable")

    await until(operator, lambda: taken().get("status") == "False", "ModelNameAvailable=False")
    assert taken()["reason"] == "ModelNameTaken"
    assert "'shared-llama' is served by elsewhere/llama" in taken()["message"]
    owner = (cluster.get(LLMEP, "elsewhere", "llama") or {}).get("status") or {}
    assert {c["type"]: c["status"] for c in owner.get("conditions", [])}["ModelNameAvailable"] == (
        "True"
    )
    assert cluster.get(DEPLOYMENTS, NS, "llama-copy")  # served, not refused

    def warnings() -> list[dict[str, Any]]:
        return [e for e in cluster.events(NS, "llama-copy") if e["reason"] == "ModelNameTaken"]

    await until(operator, warnings, "a ModelNameTaken warning")
    # Two resync rounds (every endpoint is reconciled again each 3 s here) say nothing new.
    endpoints = len(cluster.names(LLMEP, NS)) + 1
    start, log_start = await _resyncs(operator), len(operator.log())
    for touch in range(3):  # events that do not change the name (as the autoscaler's writes)
        await cluster.patch(LLMEP, NS, "llama-copy", {"metadata": {"labels": {"t": str(touch)}}})
    while await _resyncs(operator) < start + 2 * endpoints:
        assert operator.alive, operator.log()[-3000:]
        await asyncio.sleep(0.5)
    # The claim handler is not run for them (kopf would log a line each: every tick's status).
    assert "model_name_claim_seen" not in operator.log()[log_start:]
    (warning,) = warnings()
    assert warning["type"] == "Warning" and "elsewhere/llama" in warning["message"]

    await cluster.delete(LLMEP, "elsewhere", "llama")
    await until(operator, lambda: taken().get("status") == "True", "the name handed over")


async def test_operator_metrics_count_reconciles_by_result(operator: Operator) -> None:
    text = await operator.metrics()
    samples = {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("llmendpoints_operator_reconciles_total{")
    }
    assert samples['llmendpoints_operator_reconciles_total{result="ok",trigger="create"}'] >= 1
    assert samples['llmendpoints_operator_reconciles_total{result="invalid",trigger="create"}'] == 1
    assert "llmendpoints_operator_reconcile_duration_seconds_count" in text


async def test_restarted_operator_resumes_and_repairs_drift(
    cluster: Cluster, operator: Operator, tmp_path: pathlib.Path
) -> None:
    await cluster.create(LLMEP, NS, endpoint("resume", NS, {"model": {"name": "org/m"}}))
    services = CHILD_RESOURCES["Service"]
    await until(operator, lambda: cluster.get(services, NS, "resume"), "service")
    await until(operator, lambda: _status(cluster, "resume").get("phase"), "status")

    assert await operator.stop() == 0  # a clean shutdown on SIGTERM
    # While no operator runs: one endpoint loses its Service, another one's spec changes.
    await cluster.delete(services, NS, "resume")
    await cluster.patch(LLMEP, NS, "change", {"spec": {"model": {"name": "org/newer"}}})

    restarted = Operator(operator.kubeconfig, tmp_path / "restarted.log", OPERATOR_ENV)
    await restarted.start()
    try:
        await until(restarted, lambda: cluster.get(services, NS, "resume"), "service back")
        await until(
            restarted,
            lambda: _env(cluster.get(DEPLOYMENTS, NS, "change"))["MODEL_NAME"] == "org/newer",
            "the change made while the operator was down",
        )
        # Endpoints untouched while it was down are resumed, not re-created.
        assert _status(cluster, "full").get("observedGeneration") == 1
    finally:
        await restarted.stop()
