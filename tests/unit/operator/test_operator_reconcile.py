"""reconcile.Reconciler against a fake of kube.py's narrow interface, with plain dicts as kopf's
indexes: which objects it writes, with which verb, what status and Events it publishes."""

from __future__ import annotations

import base64
import datetime
import logging
from collections.abc import Mapping
from typing import Any

import pytest
from llmendpoints_common.gateway_token import derive
from llmendpoints_common.model_names import Claim, creation_time, served_model_name
from llmendpoints_operator import kube, status
from llmendpoints_operator.config import OperatorSettings
from llmendpoints_operator.fit.verdict import Fit
from llmendpoints_operator.reconcile import (
    SECRETS_CREATED,
    AutoscaledSubjects,
    Indexes,
    NotOurSecret,
    ReconcileMetrics,
    Reconciler,
    snapshot,
)
from llmendpoints_operator.spec import InvalidSpecError
from prometheus_client import CollectorRegistry

NS = "team"
LOG = logging.getLogger("test")
NOW = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)
AVAILABLE = {"replicas": 1, "readyReplicas": 1, "availableReplicas": 1, "updatedReplicas": 1}
Ref = tuple[str, str, str]  # (kind, namespace, name)


class FakeKube:
    """Objects by (kind, namespace, name); every call recorded as (verb, kind, name)."""

    def __init__(self) -> None:
        self.objects: dict[Ref, dict[str, Any]] = {}
        self.calls: list[tuple[str, str, str]] = []
        self.refuse: str | None = None  # a verb the "API server" answers with 403
        self.fail: dict[tuple[str, str], kube.ApiError] = {}  # (verb, kind) -> the answer
        self.pods: list[dict[str, Any]] = []  # what a list of Pods answers

    async def list(
        self, api_version: str, kind: str, namespace: str, *, label_selector: str
    ) -> list[dict[str, Any]]:
        self._check("list", kind, label_selector)
        wanted = dict(part.split("=", 1) for part in label_selector.split(","))
        return [
            pod
            for pod in self.pods
            if wanted.items() <= ((pod.get("metadata") or {}).get("labels") or {}).items()
        ]

    def _check(self, verb: str, kind: str, name: str) -> None:
        self.calls.append((verb, kind, name))
        if verb == self.refuse:
            raise kube.ApiError(403, "Forbidden", f"cannot {verb} {kind}")
        if (verb, kind) in self.fail:
            raise self.fail[(verb, kind)]

    async def apply(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        meta = obj["metadata"]
        self._check("apply", obj["kind"], meta["name"])
        ref = (obj["kind"], meta["namespace"], meta["name"])
        stored = {**self.objects.get(ref, {}), **obj}
        if "replicas" in self.objects.get(ref, {}).get("spec", {}):  # owned by another write
            stored["spec"] = {**obj["spec"], "replicas": self.objects[ref]["spec"]["replicas"]}
        self.objects[ref] = stored
        return stored

    async def create(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        meta = obj["metadata"]
        self._check("create", obj["kind"], meta["name"])
        ref = (obj["kind"], meta["namespace"], meta["name"])
        if ref in self.objects:
            raise kube.Conflict(409, "AlreadyExists", f"{meta['name']} exists")
        self.objects[ref] = dict(obj)
        return self.objects[ref]

    async def patch(
        self,
        api_version: str,
        kind: str,
        namespace: str,
        name: str,
        patch: Mapping[str, Any],
        *,
        subresource: str | None = None,
    ) -> dict[str, Any]:
        self._check(f"patch/{subresource}" if subresource else "patch", kind, name)
        obj = self.objects.setdefault((kind, namespace, name), {"kind": kind})
        for field, value in patch.items():
            obj[field] = {**obj.get(field, {}), **value}
        return obj

    async def delete(self, api_version: str, kind: str, namespace: str, name: str) -> bool:
        self._check("delete", kind, name)
        return self.objects.pop((kind, namespace, name), None) is not None

    def writes(self) -> list[tuple[str, str, str]]:
        return [call for call in self.calls if call[0] != "patch/status"]

    def status_of(self, name: str) -> dict[str, Any]:
        return self.objects[("LLMEndpoint", NS, name)]["status"]


class World:
    """A Reconciler with its fake client, indexes as dicts, and the Events it posted."""

    def __init__(
        self, settings: OperatorSettings | None = None, fit_checker: Any | None = None
    ) -> None:
        self.kube = FakeKube()
        self.endpoints: dict[Any, list[Any]] = {}
        self.deployments: dict[Any, list[Any]] = {}
        self.groups: dict[Any, list[Any]] = {}
        self.model_claims: dict[str, list[Claim]] = {}
        self.indexes = Indexes(
            llmendpoints=self.endpoints,
            runtime_deployments=self.deployments,
            claim_phases={},
            claim_users={},
            model_claims=self.model_claims,
            runtime_groups=self.groups,
        )
        self.events: list[tuple[str, str, str]] = []
        self.registry = CollectorRegistry()
        self.reconciler = Reconciler(
            kube=lambda: self.kube,
            indexes=self.indexes,
            settings=settings or OperatorSettings(),
            post_event=lambda obj, type_, reason, message: self.events.append(
                (type_, reason, message)
            ),
            metrics=ReconcileMetrics(self.registry),
            clock=lambda: NOW,
            fit_checker=fit_checker,
        )

    def add(
        self,
        name: str,
        spec: dict[str, Any],
        generation: int = 1,
        *,
        namespace: str = NS,
        created: str | None = "2026-01-01T00:00:00Z",
    ) -> dict[str, Any]:
        """The endpoint as kopf's indexes hold it (the model_claims index as handlers.py makes
        it: one claim per endpoint, under its served model name)."""
        body = {
            "apiVersion": "llmendpoints.dev/v1alpha1",
            "kind": "LLMEndpoint",
            "metadata": {
                "name": name,
                "namespace": namespace,
                "uid": f"uid-{name}",
                "generation": generation,
                **({"creationTimestamp": created} if created else {}),
            },
            "spec": spec,
        }
        self.forget(name, namespace)
        self.endpoints[(namespace, name)] = [snapshot(body)]
        served = served_model_name(name, spec)
        self.model_claims.setdefault(served, []).append(
            Claim(namespace, name, creation_time(created))
        )
        return snapshot(body)

    def forget(self, name: str, namespace: str = NS) -> None:
        """The endpoint leaves kopf's indexes (deleted)."""
        self.endpoints.pop((namespace, name), None)
        for claims in self.model_claims.values():
            claims[:] = [c for c in claims if (c.namespace, c.name) != (namespace, name)]

    def observe_deployment(self, name: str, **status_fields: Any) -> None:
        """What kopf's Deployment index holds once the watch brings the stored Deployment."""
        stored = self.kube.objects[("Deployment", NS, name)]
        self.deployments[(NS, name)] = [
            status.DeploymentState.from_object({**stored, "status": status_fields})
        ]

    def observe_groups(self, name: str, **status_fields: Any) -> None:
        """What kopf's LeaderWorkerSet index holds once the watch brings the stored one."""
        stored = self.kube.objects[("LeaderWorkerSet", NS, f"{name}-group")]
        self.groups[(NS, name)] = [
            status.DeploymentState.from_leader_worker_set({**stored, "status": status_fields})
        ]

    async def reconcile(self, endpoint: Mapping[str, Any], trigger: str = "update") -> None:
        await self.reconciler.reconcile(
            endpoint, prune=trigger != "create", logger=LOG, trigger=trigger
        )

    def count(self, trigger: str, result: str) -> float | None:
        return self.registry.get_sample_value(
            "llmendpoints_operator_reconciles_total", {"trigger": trigger, "result": result}
        )


KEYS = {"apiKeysSecretRef": {"name": "keys", "key": "api-keys"}}
FULL = {
    "model": {"name": "org/m", "chatTemplate": "{{ messages }}"},
    "scaling": {"minReplicas": 1, "maxReplicas": 4},
    "api": {"ingress": {"enabled": True, "host": "llm.example.com"}, **KEYS},
}


async def test_a_new_endpoint_gets_its_children_a_status_and_a_created_event() -> None:
    world = World()
    await world.reconcile(world.add("chat", FULL), trigger="create")

    assert world.kube.writes() == [
        # Before anything that mounts it: the endpoint's admin key (created once, never updated),
        # recorded on the endpoint as the operator's own.
        ("create", "Secret", "chat-admin-key"),
        ("patch", "LLMEndpoint", "chat"),
        ("apply", "ConfigMap", "chat-chat-template"),
        ("apply", "Service", "chat"),
        ("apply", "PodDisruptionBudget", "chat"),
        ("apply", "Ingress", "chat"),
        # POST, not apply: replicas then belongs to an Update, which later applies never remove.
        ("create", "Deployment", "chat"),
    ]
    deployment = world.kube.objects[("Deployment", NS, "chat")]
    assert deployment["spec"]["replicas"] == 1
    for (kind, _, _), obj in world.kube.objects.items():
        if kind != "LLMEndpoint":
            assert [
                (r["kind"], r["uid"], r["controller"]) for r in obj["metadata"]["ownerReferences"]
            ] == [("LLMEndpoint", "uid-chat", True)]
    st = world.kube.status_of("chat")
    assert (st["phase"], st["observedGeneration"]) == ("Starting", 1)
    assert st["url"] == "http://chat.team.svc.cluster.local"
    assert [reason for _, reason, _ in world.events] == ["Created"]
    assert world.count("create", "ok") == 1


async def test_reconciling_again_changes_nothing() -> None:
    world = World()
    endpoint = world.add("chat", FULL)
    await world.reconcile(endpoint, trigger="create")
    world.observe_deployment("chat")
    before = {ref: dict(obj) for ref, obj in world.kube.objects.items()}
    world.kube.calls.clear()

    await world.reconcile(endpoint, trigger="resync")

    assert ("create", "Deployment", "chat") not in world.kube.calls
    assert not [c for c in world.kube.calls if c[0].startswith("patch")], "nothing to patch"
    assert world.kube.objects == before
    assert [reason for _, reason, _ in world.events] == ["Created"]  # no second one


async def test_the_admin_key_is_created_once_and_never_rewritten() -> None:
    world = World()
    endpoint = world.add("chat", FULL)
    await world.reconcile(endpoint, trigger="create")
    secret = world.kube.objects[("Secret", NS, "chat-admin-key")]
    key = base64.b64decode(secret["data"]["admin-api-key"]).decode()
    assert len(key) >= 40  # 32 random bytes
    world.observe_deployment("chat")
    for generation in (2, 3):
        await world.reconcile(world.add("chat", {**FULL, "engine": {"maxModelLen": 8}}, generation))
    # Every reconcile asks to create it (the operator cannot read Secrets); none replaces it.
    assert [c for c in world.kube.calls if c[1] == "Secret"] == [
        ("create", "Secret", "chat-admin-key")
    ] * 3
    assert world.kube.objects[("Secret", NS, "chat-admin-key")] is secret
    assert not [c for c in world.kube.calls if c[1] == "Secret" and c[0] != "create"]
    other = World()
    await other.reconcile(other.add("chat", FULL), trigger="create")
    other_secret = other.kube.objects[("Secret", NS, "chat-admin-key")]
    assert other_secret["data"] != secret["data"]  # generated, not derived from the spec


async def test_replicas_are_left_to_the_autoscaler_inside_the_bounds_and_clamped_outside() -> None:
    world = World()
    endpoint = world.add("chat", FULL)
    await world.reconcile(endpoint, trigger="create")

    world.kube.objects[("Deployment", NS, "chat")]["spec"]["replicas"] = 3  # the autoscaler's
    world.observe_deployment("chat")
    world.kube.calls.clear()
    await world.reconcile(endpoint)
    assert ("patch", "Deployment", "chat") not in world.kube.calls
    assert world.kube.objects[("Deployment", NS, "chat")]["spec"]["replicas"] == 3

    lowered = world.add("chat", {**FULL, "scaling": {"minReplicas": 1, "maxReplicas": 2}}, 2)
    await world.reconcile(lowered)
    assert ("patch", "Deployment", "chat") in world.kube.calls
    assert world.kube.objects[("Deployment", NS, "chat")]["spec"]["replicas"] == 2
    assert world.kube.status_of("chat")["observedGeneration"] == 2


async def test_children_the_spec_no_longer_asks_for_are_deleted() -> None:
    world = World()
    await world.reconcile(world.add("chat", FULL), trigger="create")
    world.observe_deployment("chat")
    world.kube.calls.clear()

    await world.reconcile(world.add("chat", {"model": {"name": "org/m"}, "api": KEYS}, 2))

    deleted = {name for verb, _, name in world.kube.calls if verb == "delete"}
    kinds = {kind for kind, _, _ in world.kube.objects}
    assert kinds == {"Secret", "Service", "Deployment", "LLMEndpoint"}
    assert "chat-chat-template" in deleted and "chat" in deleted


async def test_an_invalid_spec_is_published_creates_nothing_and_raises() -> None:
    world = World()
    endpoint = world.add(
        "bad", {"model": {"name": "org/m"}, "scaling": {"minReplicas": 3, "maxReplicas": 2}}
    )

    with pytest.raises(InvalidSpecError, match=r"spec\.scaling\.minReplicas"):
        await world.reconcile(endpoint, trigger="create")

    assert world.kube.writes() == []
    st = world.kube.status_of("bad")
    ready = next(c for c in st["conditions"] if c["type"] == "Ready")
    assert (st["phase"], ready["reason"]) == ("Failed", "InvalidSpec")
    assert ready["message"].startswith("spec.scaling.minReplicas:")
    assert world.count("create", "invalid") == 1


async def test_an_available_deployment_makes_the_endpoint_ready_with_one_event() -> None:
    world = World()
    endpoint = world.add("chat", {"model": {"name": "org/m"}, "api": KEYS})
    await world.reconcile(endpoint, trigger="create")
    world.observe_deployment("chat", **AVAILABLE)

    await world.reconciler.publish_status(endpoint)
    await world.reconciler.publish_status(endpoint)  # nothing new: neither written nor posted

    assert world.kube.status_of("chat")["phase"] == "Ready"
    assert [reason for _, reason, _ in world.events] == ["Created", "Ready"]
    assert [c for c in world.kube.calls if c[0] == "patch/status"] == [
        ("patch/status", "LLMEndpoint", "chat")
    ] * 2


async def test_an_api_refusal_raises_and_the_resync_reports_it() -> None:
    world = World()
    world.add("chat", {"model": {"name": "org/m"}})
    world.kube.refuse = "apply"

    with pytest.raises(kube.ApiError, match="403"):
        await world.reconcile(world.indexes.endpoint((NS, "chat")), trigger="create")
    assert world.count("create", "error") == 1

    await world.reconciler.resync_one((NS, "chat"), LOG)
    assert world.events == [("Warning", "ReconcileFailed", "403 Forbidden: cannot apply Service")]
    assert world.count("resync", "error") == 1


async def test_only_endpoints_with_a_choice_and_a_deployment_are_autoscaled() -> None:
    world = World()
    for name, scaling in {
        "auto": {"minReplicas": 1, "maxReplicas": 3},
        "fixed": {"minReplicas": 2},
        "pinned": {"minReplicas": 1, "maxReplicas": 3, "replicas": 2},
        "invalid": {"minReplicas": 3, "maxReplicas": 2},
        "nodeployment": {"minReplicas": 1, "maxReplicas": 3},
    }.items():
        world.add(name, {"model": {"name": "org/m"}, "scaling": scaling})
        if name != "nodeployment":
            world.deployments[(NS, name)] = [status.DeploymentState(desired=2, ready=1)]

    subjects = AutoscaledSubjects(world.indexes, OperatorSettings())()

    assert [(s.key, s.deployment, s.replicas, s.ready_replicas) for s in subjects] == [
        ((NS, "auto"), "auto", 2, 1)
    ]


async def test_the_autoscalers_listing_follows_every_change_of_spec_and_workload() -> None:
    # The listing remembers each endpoint's Subject while its body and workload stay the same
    # (the loop lists every endpoint up to four times a second); any change is seen at once.
    world = World()
    world.add("auto", {"model": {"name": "org/m"}, "scaling": {"minReplicas": 1, "maxReplicas": 3}})
    world.deployments[(NS, "auto")] = [status.DeploymentState(desired=2, ready=1)]
    listing = AutoscaledSubjects(world.indexes, OperatorSettings())
    [first] = listing()
    [again] = listing()
    assert again is first

    world.deployments[(NS, "auto")] = [status.DeploymentState(desired=3, ready=3)]
    [scaled] = listing()
    assert (scaled.replicas, scaled.ready_replicas) == (3, 3)

    world.add("auto", {"model": {"name": "org/m"}, "scaling": {"minReplicas": 1, "maxReplicas": 5}})
    [changed] = listing()
    assert changed.policy.max_replicas == 5

    world.add("auto", {"model": {"name": "org/m"}, "scaling": {"minReplicas": 2}})
    assert listing() == []  # a fixed size now: no longer the autoscaler's


async def test_the_status_url_uses_the_clusters_domain() -> None:
    world = World(OperatorSettings(cluster_domain="corp.example"))
    await world.reconcile(world.add("chat", {"model": {"name": "org/m"}}), trigger="create")
    assert world.kube.status_of("chat")["url"] == "http://chat.team.svc.corp.example"


# --- the InferencePool: an optional child whose API may be missing ----------------------------

POOL = {"enabled": True, "endpointPickerRef": {"name": "epp", "port": {"number": 9002}}}
NO_API = kube.NotFound(404, "NotFound", "the server could not find the requested resource")


def _pool_condition(world: World, name: str = "chat") -> dict[str, Any] | None:
    conditions = world.kube.status_of(name)["conditions"]
    return next((c for c in conditions if c["type"] == "InferencePool"), None)


async def test_an_asked_for_pool_is_applied_owned_and_reported() -> None:
    world = World()
    await world.reconcile(
        world.add("chat", {"model": {"name": "org/m"}, "api": {"inferencePool": POOL}}),
        trigger="create",
    )

    pool = world.kube.objects[("InferencePool", NS, "chat")]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    [owner] = pool["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["name"], owner["uid"]) == ("LLMEndpoint", "chat", "uid-chat")
    assert owner["controller"] is True
    assert world.kube.status_of("chat")["inferencePool"] == "chat"
    assert _pool_condition(world)["reason"] == "Created"
    assert ("Normal", "InferencePoolCreated") in [(t, r) for t, r, _ in world.events]


async def test_without_the_pool_api_the_endpoint_is_served_and_the_status_says_why() -> None:
    world = World()
    world.kube.fail[("apply", "InferencePool")] = NO_API
    spec = {"model": {"name": "org/m"}, "api": {"inferencePool": POOL}}

    await world.reconcile(world.add("chat", spec), trigger="create")  # does not raise

    assert {kind for kind, _, _ in world.kube.objects} >= {"Deployment", "Service", "Secret"}
    condition = _pool_condition(world)
    assert (condition["status"], condition["reason"]) == ("False", "CRDNotInstalled")
    assert "inferencePool" not in world.kube.status_of("chat")
    assert world.count("create", "ok") == 1
    assert [e for e in world.events if e[1] == "InferencePoolCRDNotInstalled"]
    assert [e["metadata"]["name"] for e in world.reconciler.waiting_for_pool_api()] == ["chat"]

    # The CRD gets installed: the next reconcile creates the pool (handlers.py triggers it).
    del world.kube.fail[("apply", "InferencePool")]
    await world.reconcile(world.indexes.endpoint((NS, "chat")), trigger="inference-pool-api")
    assert _pool_condition(world)["reason"] == "Created"
    assert world.reconciler.waiting_for_pool_api() == []


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (kube.ApiError(422, "Invalid", "spec.endpointPickerRef: Required value"), "Rejected"),
        (kube.ApiError(403, "Forbidden", "inferencepools is forbidden"), "Forbidden"),
    ],
)
async def test_a_refused_pool_is_a_condition_not_a_failed_reconcile(
    error: kube.ApiError, reason: str
) -> None:
    world = World()
    world.kube.fail[("apply", "InferencePool")] = error
    spec = {"model": {"name": "org/m"}, "api": {"inferencePool": {"enabled": True}}}
    await world.reconcile(world.add("chat", spec), trigger="create")
    condition = _pool_condition(world)
    assert (condition["status"], condition["reason"]) == ("False", reason)
    assert error.message in condition["message"]


async def test_a_pool_no_longer_asked_for_is_deleted_and_unreported() -> None:
    world = World()
    spec = {"model": {"name": "org/m"}, "api": {"inferencePool": POOL}}
    await world.reconcile(world.add("chat", spec), trigger="create")
    world.observe_deployment("chat")

    await world.reconcile(world.add("chat", {"model": {"name": "org/m"}}, generation=2))

    assert ("delete", "InferencePool", "chat") in world.kube.calls
    assert ("InferencePool", NS, "chat") not in world.kube.objects
    assert _pool_condition(world) is None
    assert world.kube.status_of("chat")["inferencePool"] is None  # nulled in the merge patch


async def test_endpoints_that_never_asked_cost_no_pool_requests() -> None:
    world = World()
    await world.reconcile(world.add("chat", {"model": {"name": "org/m"}}), trigger="create")
    world.observe_deployment("chat")
    await world.reconcile(world.add("chat", {"model": {"name": "org/m"}}, generation=2))
    assert [c for c in world.kube.calls if c[1] == "InferencePool"] == []
    assert _pool_condition(world) is None


async def test_the_operator_default_gives_every_endpoint_a_pool_unless_it_says_no() -> None:
    world = World(OperatorSettings(inference_pool_default=True))
    await world.reconcile(world.add("yes", {"model": {"name": "org/m"}}), trigger="create")
    no = {"model": {"name": "org/m"}, "api": {"inferencePool": {"enabled": False}}}
    await world.reconcile(world.add("no", no), trigger="create")
    assert ("InferencePool", NS, "yes") in world.kube.objects
    assert ("InferencePool", NS, "no") not in world.kube.objects


async def test_a_secret_planted_under_the_admin_keys_name_is_refused_until_deleted() -> None:
    """Anyone who may create Secrets in the namespace could plant <endpoint>-admin-key before
    the endpoint exists, and so hold its admin key: the operator starts no pod with a Secret it
    did not make (it cannot read Secrets, so it records the ones it creates)."""
    world = World()
    planted = {"kind": "Secret", "metadata": {"name": "chat-admin-key", "namespace": NS}}
    world.kube.objects[("Secret", NS, "chat-admin-key")] = planted
    endpoint = world.add("chat", {"model": {"name": "org/m"}})
    with pytest.raises(NotOurSecret, match=r"chat-admin-key .* was not created by the operator"):
        await world.reconcile(endpoint, trigger="create")
    assert ("Deployment", NS, "chat") not in world.kube.objects
    assert world.count("create", "error") == 1

    del world.kube.objects[("Secret", NS, "chat-admin-key")]  # the admin removes it
    await world.reconcile(endpoint)
    assert world.kube.objects[("Secret", NS, "chat-admin-key")] is not planted
    assert ("Deployment", NS, "chat") in world.kube.objects
    annotations = world.kube.objects[("LLMEndpoint", NS, "chat")]["metadata"]["annotations"]
    assert annotations[SECRETS_CREATED] == "chat-admin-key"
    # A restarted operator (nothing in memory) reads the record from the endpoint.
    again = World()
    again.kube.objects = world.kube.objects
    recorded = {**endpoint, "metadata": {**endpoint["metadata"], "annotations": annotations}}
    await again.reconcile(recorded)


async def test_the_gateway_token_is_derived_for_the_endpoint_and_mounted(tmp_path) -> None:
    secret_file = tmp_path / "gateway-token-secret"
    secret_file.write_bytes(b"an-installation-secret-of-32-bytes!!")
    world = World(OperatorSettings(gateway_token_secret_file=str(secret_file)))
    await world.reconcile(world.add("chat", {"model": {"name": "org/m"}}), trigger="create")
    secret = world.kube.objects[("Secret", NS, "chat-gateway-token")]
    token = base64.b64decode(secret["data"]["token"]).decode()
    assert token == derive(b"an-installation-secret-of-32-bytes!!", f"{NS}/chat")
    pod = world.kube.objects[("Deployment", NS, "chat")]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["GATEWAY_TOKEN_FILE"] == "/etc/llmendpoints/gateway-token/token"
    volume = next(v for v in pod["volumes"] if v["name"] == "gateway-token")
    assert volume["secret"]["secretName"] == "chat-gateway-token"
    # another endpoint's token is another token
    await world.reconcile(world.add("other", {"model": {"name": "org/m"}}), trigger="create")
    other = world.kube.objects[("Secret", NS, "other-gateway-token")]
    assert other["data"]["token"] != secret["data"]["token"]


def _model_name_condition(st: Mapping[str, Any]) -> dict[str, Any]:
    return next(c for c in st["conditions"] if c["type"] == "ModelNameAvailable")


async def test_a_model_name_served_by_an_older_endpoint_is_reported_once_naming_it() -> None:
    """docs/security.md (Tenancy): the gateway routes a served model name to the oldest endpoint
    declaring it. The newer one's author reads why in its status and in one Warning Event (not
    one per resync), its pods still run, and it gets the name when the owner goes."""
    world = World()
    llama = {"model": {"name": "org/m", "servedModelName": "llama"}}
    older = world.add("chat", llama, namespace="team-a", created="2026-01-01T00:00:00Z")
    newer = world.add("copy", llama, created="2026-01-01T00:00:05Z")
    # kopf's event handler sees both (model_claims_changed: nothing else declares llama yet).
    for key in (("team-a", "chat"), (NS, "copy")):
        await world.reconciler.model_claims_changed(key, "llama", LOG)
    await world.reconcile(older, trigger="create")
    await world.reconcile(newer, trigger="create")

    owner = _model_name_condition(world.kube.objects[("LLMEndpoint", "team-a", "chat")]["status"])
    assert (owner["status"], owner["reason"]) == ("True", "ModelNameClaimed")
    st = world.kube.status_of("copy")
    taken = _model_name_condition(st)
    assert (taken["status"], taken["reason"], taken["observedGeneration"]) == (
        "False",
        "ModelNameTaken",
        1,
    )
    assert taken["message"].startswith(
        "the model name 'llama' is served by team-a/chat, created earlier: the gateway routes "
        '"model": "llama" there, not here.'
    )
    # Not refused: its children exist and its phase is the pods' (their Service and /v2 work).
    assert ("Deployment", NS, "copy") in world.kube.objects and st["phase"] == "Starting"
    assert [e for e in world.events if e[1].startswith("ModelName")] == [
        ("Warning", "ModelNameTaken", taken["message"])
    ]

    # The watch brings the status written; a resync compares with it: nothing new is said.
    world.endpoints[(NS, "copy")][0]["status"] = st
    await world.reconciler.resync_one((NS, "copy"), LOG)
    assert [e[1] for e in world.events].count("ModelNameTaken") == 1
    assert _model_name_condition(world.kube.status_of("copy"))["status"] == "False"

    # The owner is deleted: kopf drops it from its indexes, then its DELETED event arrives.
    world.forget("chat", namespace="team-a")
    await world.reconciler.model_claims_changed(("team-a", "chat"), None, LOG)
    now = _model_name_condition(world.kube.status_of("copy"))
    assert (now["status"], now["reason"]) == ("True", "ModelNameClaimed")
    assert world.events[-1] == ("Normal", "ModelNameAvailable", now["message"])


async def test_an_endpoint_of_unknown_age_never_takes_a_model_name() -> None:
    """An object without creationTimestamp (an emulator's, a hand-made one; the API server always
    sets it) counts as the newest, as the gateway counts it."""
    world = World()
    world.add("dated", {"model": {"name": "org/m"}}, namespace="team-a")
    undated = world.add("dated", {"model": {"name": "org/m"}}, namespace="team-b", created=None)
    state = world.reconciler.model_name(undated)
    assert (state.name, state.owner) == ("dated", "team-a/dated")


# --- multi-node endpoints: a LeaderWorkerSet of groups ------------------------------------------

GROUPS = {
    "model": {"name": "org/big"},
    "resources": {"gpus": 8, "nodes": 2},
    "scaling": {"minReplicas": 1, "maxReplicas": 3},
}


def _conditions_of(st: Mapping[str, Any]) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in st["conditions"]}


async def test_a_multi_node_endpoint_is_a_leader_worker_set_and_no_deployment() -> None:
    world = World()
    await world.reconcile(world.add("big", GROUPS), trigger="create")

    writes = world.kube.writes()
    assert ("create", "LeaderWorkerSet", "big-group") in writes
    assert not [w for w in writes if w[1] == "Deployment"]
    lws = world.kube.objects[("LeaderWorkerSet", NS, "big-group")]
    assert lws["spec"]["replicas"] == 1 and lws["spec"]["leaderWorkerTemplate"]["size"] == 2
    [ref] = lws["metadata"]["ownerReferences"]
    assert (ref["kind"], ref["uid"], ref["controller"]) == ("LLMEndpoint", "uid-big", True)
    service = world.kube.objects[("Service", NS, "big")]
    assert service["spec"]["selector"]["leaderworkerset.sigs.k8s.io/worker-index"] == "0"
    st = world.kube.status_of("big")
    assert st["selector"].endswith(",leaderworkerset.sigs.k8s.io/worker-index=0")
    assert st["groups"] == {"name": "big-group", "size": 2, "ready": 0, "desired": 1}
    assert next(m for _, reason, m in world.events if reason == "Created").startswith(
        "created LeaderWorkerSet big-group, "
    )


async def test_a_group_that_is_not_ready_names_its_failing_pod_and_keeps_the_last_failure() -> None:
    world = World()
    endpoint = world.add("big", GROUPS)
    await world.reconcile(endpoint, trigger="create")
    world.kube.objects[("LeaderWorkerSet", NS, "big-group")]["spec"]["replicas"] = 2
    world.observe_groups("big", replicas=2, readyReplicas=1, updatedReplicas=2)
    leader = {
        "metadata": {
            "name": "big-group-1",
            "labels": {
                "llmendpoints.dev/endpoint": "big",
                "leaderworkerset.sigs.k8s.io/group-index": "1",
                "leaderworkerset.sigs.k8s.io/worker-index": "0",
            },
        },
        "spec": {"nodeName": "gpu-3"},
        "status": {"conditions": [{"type": "Ready", "status": "False"}]},
    }
    worker = {
        "metadata": {
            "name": "big-group-1-1",
            "labels": {
                **leader["metadata"]["labels"],
                "leaderworkerset.sigs.k8s.io/worker-index": "1",
            },
        },
        "spec": {"nodeName": "gpu-7"},
        "status": {
            "containerStatuses": [
                {
                    "ready": False,
                    "restartCount": 1,
                    "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off"}},
                }
            ]
        },
    }
    world.kube.pods = [leader, worker]
    await world.reconciler.publish_status(endpoint)

    st = world.kube.status_of("big")
    assert st["groups"]["ready"] == 1 and st["groups"]["desired"] == 2
    assert [(p["pod"], p["reason"]) for p in st["groups"]["unready"]] == [
        ("big-group-1", "Starting"),
        ("big-group-1-1", "CrashLoopBackOff"),
    ]
    assert st["groups"]["lastFailure"]["node"] == "gpu-7"
    conditions = _conditions_of(st)
    assert conditions["Progressing"] == ("False", "GroupFailing")
    assert st["phase"] == "Degraded"  # one group serves, one does not
    progressing = next(c for c in st["conditions"] if c["type"] == "Progressing")
    assert "worker 1 (pod big-group-1-1 on node gpu-7) CrashLoopBackOff" in progressing["message"]

    # The group is recreated (new pods, starting): the failure stays on record, not unready.
    world.kube.pods = [{**leader}, {**worker, "status": {}}]
    await world.reconciler.publish_status(endpoint)
    st = world.kube.status_of("big")
    assert [p["reason"] for p in st["groups"]["unready"]] == ["Starting", "Starting"]
    assert st["groups"]["lastFailure"]["pod"] == "big-group-1-1"
    # Every group ready: no pods listed any more.
    world.observe_groups("big", replicas=2, readyReplicas=2, updatedReplicas=2)
    calls = len(world.kube.calls)
    await world.reconciler.publish_status(endpoint)
    assert not [c for c in world.kube.calls[calls:] if c[0] == "list"]
    assert world.kube.status_of("big")["groups"].get("unready") is None  # nulled


async def test_without_the_leader_worker_set_api_the_status_says_how_to_install_it() -> None:
    world = World()
    world.kube.fail[("create", "LeaderWorkerSet")] = kube.NotFound(
        404, "NotFound", "the server could not find the requested resource"
    )
    await world.reconcile(world.add("big", GROUPS), trigger="create")  # no exception

    # The rest of the endpoint is written all the same.
    assert ("apply", "Service", "big") in world.kube.writes()
    st = world.kube.status_of("big")
    ready = next(c for c in st["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "LeaderWorkerSetNotInstalled")
    assert "leaderworkerset.x-k8s.io/v1" in ready["message"]
    assert (
        "kubectl apply --server-side -f https://github.com/kubernetes-sigs/lws/releases/download/"
        "v0.9.0/manifests.yaml" in ready["message"]
    )
    assert st["phase"] == "Pending"
    assert ("Warning", "LeaderWorkerSetNotInstalled") in [(t, r) for t, r, _ in world.events]
    assert [e["metadata"]["name"] for e in world.reconciler.waiting_for_groups_api()] == ["big"]

    # Installed: the next reconcile creates the groups and the condition goes.
    del world.kube.fail[("create", "LeaderWorkerSet")]
    await world.reconcile(world.add("big", GROUPS))
    assert ("LeaderWorkerSet", NS, "big-group") in world.kube.objects
    ready = next(c for c in world.kube.status_of("big")["conditions"] if c["type"] == "Ready")
    assert ready["reason"] == "Starting"
    assert world.reconciler.waiting_for_groups_api() == []


async def test_a_forbidden_leader_worker_set_says_to_upgrade_the_chart() -> None:
    world = World()
    world.kube.fail[("create", "LeaderWorkerSet")] = kube.ApiError(
        403, "Forbidden", "cannot create leaderworkersets"
    )
    await world.reconcile(world.add("big", GROUPS), trigger="create")
    ready = next(c for c in world.kube.status_of("big")["conditions"] if c["type"] == "Ready")
    assert ready["reason"] == "LeaderWorkerSetForbidden" and "chart" in ready["message"]


def _workload_writes(world: World) -> list[tuple[str, str, str]]:
    return [c for c in world.kube.writes() if c[1] in ("Deployment", "LeaderWorkerSet")]


async def test_switching_nodes_replaces_the_workload_and_keeps_its_replica_count() -> None:
    world = World()
    single = {**GROUPS, "resources": {"gpus": 8}}
    await world.reconcile(world.add("big", single), trigger="create")
    world.kube.objects[("Deployment", NS, "big")]["spec"]["replicas"] = 2  # the autoscaler's
    world.observe_deployment("big", replicas=2, readyReplicas=2, availableReplicas=2)
    world.kube.calls.clear()

    await world.reconcile(world.add("big", GROUPS, generation=2))
    # The new workload first, then the old one goes.
    assert _workload_writes(world) == [
        ("create", "LeaderWorkerSet", "big-group"),
        ("delete", "Deployment", "big"),
    ]
    assert world.kube.objects[("LeaderWorkerSet", NS, "big-group")]["spec"]["replicas"] == 2
    world.deployments.clear()  # the watch brings the deletion
    world.observe_groups("big", replicas=2, readyReplicas=0)

    # And back to one node: a Deployment again, the LeaderWorkerSet deleted.
    world.kube.calls.clear()
    await world.reconcile(world.add("big", single, generation=3))
    assert _workload_writes(world) == [
        ("create", "Deployment", "big"),
        ("delete", "LeaderWorkerSet", "big-group"),
    ]
    assert world.kube.objects[("Deployment", NS, "big")]["spec"]["replicas"] == 2
    assert world.kube.status_of("big").get("groups") is None  # nulled by the merge patch


async def test_the_autoscaler_scales_the_groups() -> None:
    world = World()
    endpoint = world.add("big", GROUPS)
    await world.reconcile(endpoint, trigger="create")
    world.observe_groups("big", replicas=1, readyReplicas=1)
    [subject] = AutoscaledSubjects(world.indexes, OperatorSettings())()
    assert subject.workload == ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet")
    assert (subject.deployment, subject.service) == ("big-group", "big")
    assert (subject.replicas, subject.ready_replicas) == (1, 1)
    assert subject.policy.max_replicas == 3  # groups


def test_a_status_patch_nulls_what_nested_objects_no_longer_hold() -> None:
    from llmendpoints_operator.reconcile import _nulling

    previous = {
        "phase": "Failed",
        "groups": {"ready": 0, "unready": [1], "lastFailure": {"node": "a", "pod": "p"}},
    }
    new = {"phase": "Ready", "groups": {"ready": 1, "lastFailure": {"pod": "q"}}}
    assert _nulling(previous, new) == {
        "phase": "Ready",
        "groups": {"ready": 1, "unready": None, "lastFailure": {"node": None, "pod": "q"}},
    }


class FakeFitChecker:
    """The fit check's answer, set by the test."""

    def __init__(self, fit: Fit) -> None:
        self.fit = fit

    async def check(self, ep: Any) -> Fit:
        return self.fit


REFUSED = Fit("False", "WeightsDoNotFit", "the weights need 131.4 GiB per GPU, ...", {"gpus": 1})
FITS = Fit("True", "Fits", "fits: ...", {"gpus": 1, "weightsBytes": 16})


async def test_a_model_that_does_not_fit_gets_no_deployment_and_says_why() -> None:
    checker = FakeFitChecker(REFUSED)
    world = World(fit_checker=checker)
    await world.reconcile(world.add("chat", FULL), trigger="create")
    assert not [w for w in world.kube.writes() if w[1] == "Deployment"]
    assert ("apply", "Service", "chat") in world.kube.writes()  # the rest is there
    st = world.kube.status_of("chat")
    ready = next(c for c in st["conditions"] if c["type"] == "Ready")
    fits = next(c for c in st["conditions"] if c["type"] == "ModelFits")
    assert (ready["reason"], st["phase"], fits["status"]) == ("ModelDoesNotFit", "Failed", "False")
    assert st["fit"] == {"gpus": 1}
    assert [reason for _, reason, _ in world.events] == ["ModelDoesNotFit"]

    checker.fit = FITS  # fixed (more GPUs): rolled out at once
    await world.reconcile(world.add("chat", FULL, generation=2))
    assert ("create", "Deployment", "chat") in world.kube.writes()
    assert world.kube.status_of("chat")["fit"] == {"gpus": 1, "weightsBytes": 16}
    assert [reason for _, reason, _ in world.events][-1] == "ModelFits"


async def test_a_change_that_does_not_fit_leaves_the_serving_deployment_alone() -> None:
    checker = FakeFitChecker(FITS)
    world = World(fit_checker=checker)
    await world.reconcile(world.add("chat", FULL), trigger="create")
    world.observe_deployment("chat", **AVAILABLE)
    before = dict(world.kube.objects[("Deployment", NS, "chat")])
    checker.fit = REFUSED
    world.kube.calls.clear()
    longer = {**FULL, "engine": {"maxModelLen": 131072}}
    await world.reconcile(world.add("chat", longer, generation=2))
    assert not [w for w in world.kube.writes() if w[1] == "Deployment"]
    assert world.kube.objects[("Deployment", NS, "chat")] == before
    st = world.kube.status_of("chat")
    assert next(c for c in st["conditions"] if c["type"] == "Ready")["status"] == "True"
    assert next(c for c in st["conditions"] if c["type"] == "ModelFits")["status"] == "False"


async def test_an_unknown_fit_rolls_out() -> None:
    world = World(fit_checker=FakeFitChecker(Fit("Unknown", "HubTimeout", "no answer")))
    await world.reconcile(world.add("chat", FULL), trigger="create")
    assert ("create", "Deployment", "chat") in world.kube.writes()
    fits = next(c for c in world.kube.status_of("chat")["conditions"] if c["type"] == "ModelFits")
    assert (fits["status"], fits["reason"]) == ("Unknown", "HubTimeout")
