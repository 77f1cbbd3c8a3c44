"""The chart's gateway (gateway.enabled): rendered by the real helm, validated against the real
Kubernetes schemas, and checked for what the gateway needs and nothing more."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from .helm_kit import CHART, pod_specs, render, run_helm

GATEWAY_ALL: dict[str, Any] = {
    "gateway": {
        "enabled": True,
        "apiKeysSecret": "gateway-keys",
        "jobsQueue": {"existingSecret": "gateway-queue", "existingSecretKey": "url"},
        "autoscaling": {"enabled": True},
        "ingress": {
            "enabled": True,
            "className": "nginx",
            "host": "llm.example.com",
            "tlsSecretName": "llm-tls",
        },
        "httpRoute": {
            "enabled": True,
            "parentRefs": [{"name": "public", "namespace": "gateway-system"}],
            "hostnames": ["llm.example.com"],
        },
        "networkPolicy": {"enabled": True, "namespaces": ["team-a", "team-b"]},
    }
}


def _gateway_docs(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        d
        for d in docs
        if d["metadata"].get("labels", {}).get("app.kubernetes.io/component") == "gateway"
    ]


def _one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"{len(found)} {kind}"
    return found[0]


def test_off_by_default(helm: Path, tmp_path: Path) -> None:
    docs = render(helm, tmp_path)
    assert not _gateway_docs(docs)
    operator = _one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert "LLMEP_OPERATOR_GATEWAY_URL" not in {e["name"] for e in operator["env"]}


@pytest.mark.parametrize("kube_version", ["1.29", kubernetes_validate.utils.latest_version()])
def test_every_gateway_document_validates_strictly(
    helm: Path, tmp_path: Path, kube_version: str
) -> None:
    docs = _gateway_docs(render(helm, tmp_path, GATEWAY_ALL))
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == sorted(
        [
            "Deployment",
            "Service",
            "PodDisruptionBudget",
            "HorizontalPodAutoscaler",
            "Ingress",
            "HTTPRoute",
            "NetworkPolicy",
            "NetworkPolicy",
            "NetworkPolicy",  # and the groups' pods of multi-node endpoints, per namespace
            "NetworkPolicy",
            "ServiceAccount",
            "ClusterRole",
            "ClusterRoleBinding",
            "Namespace",  # the key Secrets' own (kept on uninstall)
            "Role",  # list/watch of the key Secrets' namespace
            "RoleBinding",
            "Secret",  # the gateway token secret (generated once, kept)
        ]
    )
    for doc in docs:
        if doc["kind"] != "HTTPRoute":  # a Gateway API CRD: not in kubernetes-validate
            kubernetes_validate.validate(doc, kube_version, strict=True)
    route = _one(docs, "HTTPRoute")
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    assert route["spec"]["rules"][0]["backendRefs"] == [
        {"name": "llmendpoints-gateway", "port": 80}
    ]


def test_gateway_deployment_is_highly_available_and_locked_down(helm: Path, tmp_path: Path) -> None:
    docs = _gateway_docs(render(helm, tmp_path, {"gateway": {"enabled": True}}))
    deployment = _one(docs, "Deployment")
    assert deployment["spec"]["replicas"] == 2
    assert _one(docs, "PodDisruptionBudget")["spec"]["minAvailable"] == 1
    ((_, pod),) = pod_specs(docs)
    anti = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]
    assert anti["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    container = pod["containers"][0]
    ctx, pod_ctx = container["securityContext"], pod["securityContext"]
    assert pod_ctx["runAsNonRoot"] is True and pod_ctx["runAsUser"] == 10001
    assert ctx["readOnlyRootFilesystem"] is True and ctx["allowPrivilegeEscalation"] is False
    assert ctx["capabilities"]["drop"] == ["ALL"]
    assert container["resources"]["requests"] and container["resources"]["limits"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["PORT"] == "8080" and "JOBS_QUEUE_URL" not in env and "API_KEYS_FILE" not in env
    # The drain gets its time before the kubelet kills the pod.
    assert pod["terminationGracePeriodSeconds"] > float(env["DRAIN_TIMEOUT_SECONDS"])


def test_gateway_settings_reach_the_container_as_the_variables_it_reads(
    helm: Path, tmp_path: Path
) -> None:
    from llmendpoints_gateway.config import GatewaySettings

    docs = render(helm, tmp_path, GATEWAY_ALL)
    container = _one(_gateway_docs(docs), "Deployment")["spec"]["template"]["spec"]["containers"][0]
    read = {info.validation_alias for info in GatewaySettings.model_fields.values()}
    names = {e["name"] for e in container["env"]}
    assert names <= read, names - read
    env = {e["name"]: e.get("value") for e in container["env"]}
    # Secrets by reference: the gateway's queue URL (with its credentials) comes from a Secret.
    (queue,) = [e for e in container["env"] if e["name"] == "JOBS_QUEUE_URL"]
    assert queue["valueFrom"] == {"secretKeyRef": {"name": "gateway-queue", "key": "url"}}
    mount = next(m for m in container["volumeMounts"] if m["name"] == "gateway-keys")
    assert env["API_KEYS_FILE"] == f"{mount['mountPath']}/api-keys"
    # The operator learns the gateway's URL: status URLs point there.
    operator = next(d for d in docs if d["kind"] == "Deployment" and d not in _gateway_docs(docs))
    operator_env = {
        e["name"]: e.get("value")
        for e in operator["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert (
        operator_env["LLMEP_OPERATOR_GATEWAY_URL"] == "http://llmendpoints-gateway.llm-system.svc"
    )


def test_gateway_rbac_reads_only_what_discovery_needs(helm: Path, tmp_path: Path) -> None:
    docs = _gateway_docs(render(helm, tmp_path, {"gateway": {"enabled": True}}))
    role = _one(docs, "ClusterRole")
    grants = {
        (g, r): set(rule["verbs"])
        for rule in role["rules"]
        for g in rule["apiGroups"]
        for r in rule["resources"]
    }
    # No Secret of any other namespace: the tenant keys are read in the key namespace alone.
    assert grants == {
        ("llmendpoints.dev", "llmendpoints"): {"list", "watch"},
        ("discovery.k8s.io", "endpointslices"): {"list", "watch"},
    }
    with_endpoint_keys = _gateway_docs(
        render(helm, tmp_path, {"gateway": {"enabled": True, "endpointKeys": True}})
    )
    rules = _one(with_endpoint_keys, "ClusterRole")["rules"]
    # only when asked for: endpoints' own keys, by name (no list, no watch)
    assert {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]} in rules
    binding = _one(docs, "ClusterRoleBinding")
    account = _one(docs, "ServiceAccount")["metadata"]["name"]
    assert binding["subjects"][0]["name"] == account
    assert _one(docs, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"] == account
    # Key Secrets (labelled llmendpoints.dev/api-key): list and watch, in a namespace of their
    # own -- never the release's, where the NATS keys and the gateway token secret are.
    keys_role = _one(docs, "Role")
    assert keys_role["metadata"]["namespace"] == "llm-system-keys"
    assert keys_role["rules"] == [
        {"apiGroups": [""], "resources": ["secrets"], "verbs": ["list", "watch"]}
    ]
    assert _one(docs, "RoleBinding")["roleRef"]["name"] == keys_role["metadata"]["name"]
    env = {
        e["name"]: e.get("value")
        for e in _one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert env["GATEWAY_KEYS_NAMESPACE"] == "llm-system-keys"
    namespaced = _gateway_docs(
        render(
            helm,
            tmp_path,
            {"gateway": {"enabled": True, "namespace": "team-a", "keySecretsNamespace": "keys"}},
        )
    )
    roles = {d["metadata"]["name"]: d for d in namespaced if d["kind"] == "Role"}
    assert sorted(r["metadata"]["namespace"] for r in roles.values()) == ["keys", "team-a"]
    assert not [d for d in namespaced if d["kind"] == "ClusterRole"]


def _secret_grants(docs: list[dict[str, Any]]) -> list[tuple[str, str, set[str]]]:
    """(role kind, namespace or "*", verbs) of every rule of the gateway's on Secrets."""
    return [
        (d["kind"], d["metadata"].get("namespace", "*"), set(rule["verbs"]))
        for d in _gateway_docs(docs)
        if d["kind"] in ("Role", "ClusterRole")
        for rule in d["rules"]
        if "secrets" in rule["resources"]
    ]


def test_the_gateway_lists_no_secret_of_the_release_namespace(helm: Path, tmp_path: Path) -> None:
    """The gateway faces the internet; the release namespace holds the NATS account signing keys
    and the gateway token secret. Before: its key Role listed and watched every Secret there
    (RBAC cannot narrow a list to a label). Now the key Secrets have a namespace of their own,
    made by the chart and kept on uninstall, and naming the release's is refused."""
    docs = render(helm, tmp_path, {"gateway": {"enabled": True}})
    assert _secret_grants(docs) == [("Role", "llm-system-keys", {"list", "watch"})]
    (namespace,) = [d for d in _gateway_docs(docs) if d["kind"] == "Namespace"]
    assert namespace["metadata"]["name"] == "llm-system-keys"
    assert namespace["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    # an existing namespace of the admin's: used, not created
    own = render(
        helm,
        tmp_path,
        {"gateway": {"enabled": True, "keySecretsNamespace": "tenant-keys", "createKeySecretsNamespace": False}},
    )  # fmt: skip
    assert _secret_grants(own) == [("Role", "tenant-keys", {"list", "watch"})]
    assert not [d for d in own if d["kind"] == "Namespace"]
    # with the queue on, the NATS keys Secret and the token secret stay in the release namespace
    queued = render(helm, tmp_path, {"gateway": {"enabled": True}, "queue": {"enabled": True}})
    held = {
        (d["metadata"].get("namespace"), d["metadata"]["name"])
        for d in queued
        if d["kind"] == "Secret"
    }
    assert ("llm-system", "llmendpoints-nats-keys") in held, held
    assert ("llm-system", "llmendpoints-gateway-token") in held, held
    assert all(ns != "llm-system" for _, ns, _ in _secret_grants(queued))
    refused = run_helm(
        helm,
        "template", "llmendpoints", str(CHART), "--namespace", "llm-system",
        values={"gateway": {"enabled": True, "keySecretsNamespace": "llm-system"}},
        tmp_path=tmp_path,
    )  # fmt: skip
    assert refused.returncode != 0
    assert "gateway.keySecretsNamespace" in refused.stderr and "signing keys" in refused.stderr


def test_the_gateway_metrics_listen_on_the_pod_ip(helm: Path, tmp_path: Path) -> None:
    """/metrics (per-endpoint, optionally per-key series) on the pod's IP, what Prometheus
    scrapes; before: HOST, every interface of the pod."""
    docs = render(helm, tmp_path, {"gateway": {"enabled": True}})
    container = _one(_gateway_docs(docs), "Deployment")["spec"]["template"]["spec"]["containers"][0]
    (host,) = [e for e in container["env"] if e["name"] == "GATEWAY_METRICS_HOST"]
    assert host["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}


def test_network_policy_admits_only_the_gateway_and_the_operator(
    helm: Path, tmp_path: Path
) -> None:
    from llmendpoints_operator import manifests

    every = [d for d in render(helm, tmp_path, GATEWAY_ALL) if d["kind"] == "NetworkPolicy"]
    policies = [p for p in every if not p["metadata"]["name"].endswith("-groups")]
    assert sorted(p["metadata"]["namespace"] for p in policies) == ["team-a", "team-b"]
    policy = policies[0]["spec"]
    runtime_labels = manifests.labels("chat")
    assert policy["podSelector"]["matchLabels"].items() <= runtime_labels.items()
    peers = policy["ingress"][0]["from"]
    components = sorted(
        p["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for p in peers
    )
    assert components == ["gateway", "operator"]
    assert all(
        p["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "llm-system"}
        for p in peers
    )


def test_install_notes_give_the_one_url(helm: Path, tmp_path: Path) -> None:
    result = run_helm(
        helm,
        "install",
        "llmendpoints",
        str(CHART),
        "-n",
        "llm-system",
        "--dry-run=client",
        values={"gateway": {"enabled": True}},
        tmp_path=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    notes = result.stdout.split("NOTES:", 1)[1]
    assert "http://llmendpoints-gateway.llm-system.svc/v1" in notes


def _env(docs: list[dict[str, Any]], name: str) -> dict[str, dict[str, Any]]:
    (deployment,) = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == name]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e for e in container.get("env", [])}


@pytest.mark.parametrize(
    ("queue", "expected"),
    [
        # The release's NATS: no password in the URL (each has its own creds file).
        ({"enabled": True}, "nats://llmendpoints-nats.llm-system.svc:4222"),
        (
            {"existingSecret": "nats-creds", "existingSecretKey": "uri"},
            {"secretKeyRef": {"name": "nats-creds", "key": "uri"}},
        ),
        ({"url": "nats://nats.shared:4222"}, "nats://nats.shared:4222"),
    ],
)
def test_the_gateway_and_the_operator_read_the_same_queue(
    helm: Path, tmp_path: Path, queue: dict[str, Any], expected: Any
) -> None:
    """Held requests reach the autoscaler only if both talk to one queue, and scale to zero
    needs both: the gateway gets the release's queue unless gateway.jobsQueue says otherwise."""
    docs = render(helm, tmp_path, {"gateway": {"enabled": True}, "queue": queue})
    gateway = _env(docs, "llmendpoints-gateway")["JOBS_QUEUE_URL"]
    operator = _env(docs, "llmendpoints")["LLMEP_OPERATOR_JOBS_QUEUE_URL"]
    for entry in (gateway, operator):
        value = entry.get("valueFrom", entry.get("value"))
        assert value == expected
    assert "LLMEP_OPERATOR_GATEWAY_URL" in _env(docs, "llmendpoints")
    # With the release's NATS, each has its own credential: the gateway a creds file its init
    # container mints, the operator the signing key it mints with.
    has_keys = bool(queue.get("enabled"))
    assert ("JOBS_QUEUE_CREDS_FILE" in _env(docs, "llmendpoints-gateway")) is has_keys
    assert ("LLMEP_OPERATOR_JOBS_QUEUE_KEYS_DIR" in _env(docs, "llmendpoints")) is has_keys


def test_without_a_queue_the_gateway_has_none(helm: Path, tmp_path: Path) -> None:
    docs = render(helm, tmp_path, {"gateway": {"enabled": True}})
    assert "JOBS_QUEUE_URL" not in _env(docs, "llmendpoints-gateway")
    assert "LLMEP_OPERATOR_JOBS_QUEUE_URL" not in _env(docs, "llmendpoints")


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        # A queue to share limits through: one worker per CPU of the container's limit.
        (
            {"queue": {"enabled": True}},
            {"resourceFieldRef": {"resource": "limits.cpu", "divisor": "1"}},
        ),
        (
            {
                "queue": {"enabled": True},
                "gateway": {"resources": {"requests": {"cpu": "3"}, "limits": {"cpu": None}}},
            },
            {"resourceFieldRef": {"resource": "requests.cpu", "divisor": "1"}},
        ),
        ({}, "1"),  # no queue: per-key limits could not be shared among processes
        ({"gateway": {"workers": 3}}, "3"),  # said explicitly
    ],
)
def test_gateway_workers_follow_the_pods_cpus(
    helm: Path, tmp_path: Path, values: dict[str, Any], expected: Any
) -> None:
    gateway = {"enabled": True, **values.get("gateway", {})}
    docs = render(helm, tmp_path, {**values, "gateway": gateway})
    entry = _env(docs, "llmendpoints-gateway")["GATEWAY_WORKERS"]
    assert entry.get("valueFrom", entry.get("value")) == expected


def _token_file(pod: dict[str, Any], variable: str) -> tuple[str, str]:
    """(Secret name, file path) of the gateway token secret the pod's container reads."""
    (container,) = pod["containers"]
    path = next(e["value"] for e in container["env"] if e["name"] == variable)
    mount = next(m for m in container["volumeMounts"] if path.startswith(m["mountPath"] + "/"))
    assert mount.get("readOnly") is True
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert [item["path"] for item in volume["secret"]["items"]] == [path.rsplit("/", 1)[1]]
    return volume["secret"]["secretName"], path


def test_the_gateway_and_the_operator_read_one_generated_token_secret(
    helm: Path, tmp_path: Path
) -> None:
    """The gateway presents, and the operator writes into each endpoint's pods, tokens derived
    from one secret: both mount the same Secret; nobody else (runtime pods get only their own
    endpoint's token, from the operator)."""
    import base64

    docs = render(helm, tmp_path, {"gateway": {"enabled": True}})
    pods = dict(pod_specs(docs))
    gateway = _token_file(pods["llmendpoints-gateway"], "GATEWAY_TOKEN_SECRET_FILE")
    operator = _token_file(pods["llmendpoints"], "LLMEP_OPERATOR_GATEWAY_TOKEN_SECRET_FILE")
    assert gateway[0] == operator[0]
    (secret,) = [d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"] == gateway[0]]
    assert len(base64.b64decode(secret["data"]["secret"])) == 48
    mounted_by = [
        name
        for name, pod in pods.items()
        if any((v.get("secret") or {}).get("secretName") == gateway[0] for v in pod["volumes"])
    ]
    assert sorted(mounted_by) == ["llmendpoints", "llmendpoints-gateway"]
    # Yours instead: nothing generated, both read it.
    docs = render(
        helm, tmp_path, {"gateway": {"enabled": True, "tokenSecret": {"existingSecret": "mine"}}}
    )
    pods = dict(pod_specs(docs))
    assert _token_file(pods["llmendpoints-gateway"], "GATEWAY_TOKEN_SECRET_FILE")[0] == "mine"
    assert (
        _token_file(pods["llmendpoints"], "LLMEP_OPERATOR_GATEWAY_TOKEN_SECRET_FILE")[0] == "mine"
    )
    assert not [d for d in docs if d["kind"] == "Secret" and "secret" in (d.get("data") or {})]


def test_the_pods_of_a_group_admit_each_other_and_nothing_else_is_opened(
    helm: Path, tmp_path: Path
) -> None:
    """A multi-node endpoint's leader and workers talk among themselves (torch.distributed,
    vLLM's data-parallel RPC): a second policy admits group pods to group pods only."""
    from llmendpoints_operator import groups, manifests, spec
    from llmendpoints_operator.config import OperatorSettings

    every = [d for d in render(helm, tmp_path, GATEWAY_ALL) if d["kind"] == "NetworkPolicy"]
    extra = [p for p in every if p["metadata"]["name"].endswith("-groups")]
    assert sorted(p["metadata"]["namespace"] for p in extra) == ["team-a", "team-b"]
    policy = extra[0]["spec"]
    [rule] = policy["ingress"]
    [peer] = rule["from"]
    assert "namespaceSelector" not in peer  # the policy's own namespace only
    assert peer["podSelector"] == policy["podSelector"]  # from group pods to group pods

    def selects(selector: dict, labels: dict[str, str]) -> bool:
        return selector["matchLabels"].items() <= labels.items() and all(
            e["operator"] == "Exists" and e["key"] in labels for e in selector["matchExpressions"]
        )

    ep = spec.parse("big", "team-a", {"model": {"name": "m"}, "resources": {"gpus": 8, "nodes": 2}})
    lws = groups.build_leader_worker_set(ep, OperatorSettings(), replicas=1)
    # What LWS adds to every pod of the group.
    lws_labels = {"leaderworkerset.sigs.k8s.io/name": lws["metadata"]["name"]}
    for template in ("leaderTemplate", "workerTemplate"):
        labels = lws["spec"]["leaderWorkerTemplate"][template]["metadata"]["labels"]
        assert selects(policy["podSelector"], {**labels, **lws_labels})
    single = manifests.build_pod_template(
        spec.parse("chat", "team-a", {"model": {"name": "m"}}), OperatorSettings()
    )
    assert not selects(policy["podSelector"], single["metadata"]["labels"])
