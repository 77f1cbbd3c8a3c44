"""The pure builders: golden outputs, the runtime contract in the pod, and real Kubernetes schemas.

Golden files live in golden/ (one per example). After an intended change, regenerate them with
`UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/unit/operator/test_operator_manifests.py` and
review the diff like code.
"""

from __future__ import annotations

import base64
import json
import os
import pathlib
from typing import Any

import kubernetes_validate
import pytest
import yaml
from llmendpoints_operator import groups, manifests
from llmendpoints_operator.config import OperatorSettings
from llmendpoints_operator.spec import Endpoint, parse

REPO = pathlib.Path(__file__).resolve().parents[3]
GOLDEN = pathlib.Path(__file__).parent / "golden"
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
SETTINGS = OperatorSettings(runtime_image="registry.example/runtime:1.2.3")
# The oldest Kubernetes release the chart supports and the newest the validator knows.
K8S_VERSIONS = ["1.29.0", kubernetes_validate.utils.latest_version()]


def _endpoint(spec: dict[str, Any], name: str = "demo", namespace: str = "team") -> Endpoint:
    return parse(name, namespace, spec)


def _example(path: pathlib.Path) -> Endpoint:
    doc = yaml.safe_load(path.read_text())
    return parse(doc["metadata"]["name"], "team", doc["spec"])


def _all(ep: Endpoint) -> list[dict[str, Any]]:
    """What a first reconcile writes."""
    replicas = manifests.replicas_to_write(ep, None)
    workload = groups.build_workload(ep, SETTINGS, replicas=replicas)
    pool = manifests.build_inference_pool(ep, SETTINGS)
    return [workload, *manifests.build_children(ep, SETTINGS), *([pool] if pool else [])]


def _core(objs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The objects of Kubernetes' own kinds (an InferencePool is checked against its CRD's
    schema in test_operator_inference_pool.py), and a LeaderWorkerSet's pod templates as the
    Pods they make (the LeaderWorkerSet itself: against its CRD's schema in
    test_operator_groups.py)."""
    core = []
    for obj in objs:
        if obj["kind"] == groups.LWS_KIND:
            lwt = obj["spec"]["leaderWorkerTemplate"]
            for template in (lwt["leaderTemplate"], lwt["workerTemplate"]):
                meta = {"name": obj["metadata"]["name"], **template["metadata"]}
                core.append({"apiVersion": "v1", "kind": "Pod", "metadata": meta, **template})
        elif obj["kind"] != manifests.INFERENCE_POOL_KIND:
            core.append(obj)
    return core


def _container(deployment: dict[str, Any]) -> dict[str, Any]:
    return deployment["spec"]["template"]["spec"]["containers"][0]


def _env(ep: Endpoint) -> dict[str, Any]:
    return {v["name"]: v.get("value", v.get("valueFrom")) for v in manifests.build_env(ep)}


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_golden(example: pathlib.Path) -> None:
    built = _all(_example(example))
    golden = GOLDEN / f"{example.stem}.yaml"
    text = yaml.safe_dump_all(built, sort_keys=False, width=100)
    if os.environ.get("UPDATE_GOLDEN"):
        GOLDEN.mkdir(exist_ok=True)
        golden.write_text(text)
    assert list(yaml.safe_load_all(golden.read_text())) == built


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_every_built_manifest_passes_the_kubernetes_schemas(
    example: pathlib.Path, version: str
) -> None:
    ep = _example(example)
    for obj in _core([*_all(ep), groups.build_workload(ep, SETTINGS, replicas=None)]):
        kubernetes_validate.validate(obj, version, strict=True)


def test_pod_follows_the_runtime_contract() -> None:
    ep = _endpoint(
        {
            "model": {"name": "org/m", "chatTemplate": "{{ x }}"},
            "api": {"apiKeysSecretRef": {"name": "keys", "key": "k"}},
        }
    )
    deployment = manifests.build_deployment(ep, SETTINGS, replicas=1)
    container = _container(deployment)
    assert container["ports"] == [
        {"name": "http", "containerPort": 8000, "protocol": "TCP"},
        {"name": "control", "containerPort": 8001, "protocol": "TCP"},
    ]
    # Probes on the control port: answered by a thread of their own under load (issue 25).
    assert container["startupProbe"]["httpGet"] == {"path": "/ready?strict=1", "port": "control"}
    assert container["readinessProbe"]["httpGet"] == {
        "path": "/ready?strict=1",
        "port": "control",
    }
    assert container["livenessProbe"]["httpGet"] == {"path": "/health", "port": "control"}
    env = _env(ep)
    assert env["HOST"] == "0.0.0.0" and env["PORT"] == "8000"
    assert env["LLMEP_CONTROL_PORT"] == "8001"
    assert env["BASE_PATH"] == "/models"
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert mounts["/models"]["name"] == "model-cache"
    assert mounts["/dev/shm"]["name"] == "dshm"
    # Files, not inline text or keys in the environment:
    assert pathlib.PurePosixPath(env["API_KEYS_FILE"]).parent.as_posix() in mounts
    assert pathlib.PurePosixPath(env["CUSTOM_CHAT_TEMPLATE"]).parent.as_posix() in mounts
    assert "API_KEYS" not in env
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    assert volumes["api-keys"]["secret"]["items"] == [{"key": "k", "path": "api-keys"}]
    assert "subPath" not in mounts[manifests.API_KEYS_DIR]  # subPath mounts never refresh


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_pod_mounts_the_endpoints_admin_key_secret(version: str) -> None:
    ep = _endpoint({"model": {"name": "org/m"}})  # no API keys: still an admin key
    secret = manifests.build_admin_key_secret(ep, "k3y")
    kubernetes_validate.validate(secret, version, strict=True)
    assert secret["metadata"]["name"] == "demo-admin-key"
    deployment = manifests.build_deployment(ep, SETTINGS, replicas=1)
    container = _container(deployment)
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    mount = next(m for m in container["volumeMounts"] if m["name"] == "admin-key")
    source = volumes["admin-key"]["secret"]
    assert source["secretName"] == secret["metadata"]["name"]
    assert not source.get("optional")  # a pod waits for its key, never starts without one
    [item] = source["items"]
    assert item["key"] in secret["data"]
    assert _env(ep)["ADMIN_API_KEYS_FILE"] == f"{mount['mountPath']}/{item['path']}"
    assert "subPath" not in mount


def test_a_baked_image_gets_no_cache_volume_and_keeps_its_own_base_path() -> None:
    ep = _endpoint(
        {"model": {"name": "org/m", "bakedIntoImage": True}, "engine": {"image": "r/llm:1"}}
    )
    deployment = manifests.build_deployment(ep, SETTINGS, replicas=1)
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == "r/llm:1"
    env = _env(ep)
    assert "BASE_PATH" not in env and "HF_HUB_OFFLINE" not in env  # the image's own ENV wins
    assert env["MODEL_NAME"] == "org/m"
    assert "/models" not in {m["mountPath"] for m in container["volumeMounts"]}
    names = {v["name"] for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert "model-cache" not in names


def test_engine_fields_and_args_become_upper_snake_variables() -> None:
    ep = _endpoint(
        {
            "model": {"name": "org/m", "trustRemoteCode": True},
            "engine": {
                "dtype": "bfloat16",
                "enablePrefixCaching": False,
                "args": {"max-num-seqs": 64, "enforce-eager": True, "kv_cache_dtype": "fp8"},
                "env": [{"name": "VLLM_LOGGING_LEVEL", "value": "DEBUG"}],
            },
        }
    )
    env = _env(ep)
    assert env["MAX_NUM_SEQS"] == "64"
    assert env["ENFORCE_EAGER"] == "true"
    assert env["KV_CACHE_DTYPE"] == "fp8"
    assert env["DTYPE"] == "bfloat16"
    assert env["ENABLE_PREFIX_CACHING"] == "false"
    assert env["TRUST_REMOTE_CODE"] == "true"
    assert env["OPENAI_SERVED_MODEL_NAME_OVERRIDE"] == "demo"  # the resource's name
    assert env["VLLM_LOGGING_LEVEL"] == "DEBUG"
    # Unset optional fields are not written (the runtime's own defaults apply).
    assert "MAX_MODEL_LEN" not in env and "QUANTIZATION" not in env


def test_tensor_parallel_size_defaults_to_the_gpu_count() -> None:
    assert "TENSOR_PARALLEL_SIZE" not in _env(_endpoint({"model": {"name": "m"}}))
    env = _env(_endpoint({"model": {"name": "m"}, "resources": {"gpus": 4}}))
    assert env["TENSOR_PARALLEL_SIZE"] == "4"
    limits = _container(
        manifests.build_deployment(
            _endpoint({"model": {"name": "m"}, "resources": {"gpus": 4}}), SETTINGS, replicas=1
        )
    )["resources"]["limits"]
    assert limits == {"nvidia.com/gpu": "4"}


def test_gpu_resource_name_comes_from_spec_then_settings() -> None:
    ep = _endpoint({"model": {"name": "m"}, "resources": {"gpuResourceName": "amd.com/gpu"}})
    limits = _container(manifests.build_deployment(ep, SETTINGS, replicas=1))["resources"]["limits"]
    assert limits == {"amd.com/gpu": "1"}
    other = OperatorSettings(gpu_resource_name="gpu.intel.com/i915")
    ep = _endpoint({"model": {"name": "m"}})
    limits = _container(manifests.build_deployment(ep, other, replicas=1))["resources"]["limits"]
    assert limits == {"gpu.intel.com/i915": "1"}
    cpu_only = _endpoint({"model": {"name": "m"}, "resources": {"gpus": 0}})
    assert _container(manifests.build_deployment(cpu_only, SETTINGS, replicas=1))["resources"] == {}


def test_termination_grace_outlasts_the_drain() -> None:
    ep = _endpoint({"model": {"name": "m"}, "engine": {"drainTimeoutSeconds": 120}})
    pod = manifests.build_deployment(ep, SETTINGS, replicas=1)["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == 135
    assert _env(ep)["DRAIN_TIMEOUT_SECONDS"] == "120"


def test_startup_probe_budget_covers_the_startup_timeout() -> None:
    ep = _endpoint({"model": {"name": "m"}, "engine": {"startupTimeoutSeconds": 1805}})
    probe = _container(manifests.build_deployment(ep, SETTINGS, replicas=1))["startupProbe"]
    assert probe["periodSeconds"] * probe["failureThreshold"] >= 1805


def test_rollout_suits_scarce_gpus() -> None:
    default = manifests.build_deployment(_endpoint({"model": {"name": "m"}}), SETTINGS, replicas=1)
    assert default["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1},
    }
    recreate = _endpoint({"model": {"name": "m"}, "rollout": {"strategy": "Recreate"}})
    assert manifests.build_deployment(recreate, SETTINGS, replicas=1)["spec"]["strategy"] == {
        "type": "Recreate"
    }


def test_changing_the_chat_template_changes_the_pod_template() -> None:
    def template(text: str) -> dict[str, Any]:
        ep = _endpoint({"model": {"name": "m", "chatTemplate": text}})
        return manifests.build_deployment(ep, SETTINGS, replicas=1)["spec"]["template"]

    assert template("a") == template("a")
    assert template("a") != template("b")  # a new ReplicaSet: pods read the template at start


def test_optional_children_follow_the_spec() -> None:
    kinds = lambda ep: [o["kind"] for o in manifests.build_children(ep, SETTINGS)]  # noqa: E731
    assert kinds(_endpoint({"model": {"name": "m"}})) == ["Service"]
    # A PDB only when the endpoint may run more than one replica.
    assert "PodDisruptionBudget" in kinds(
        _endpoint({"model": {"name": "m"}, "scaling": {"maxReplicas": 2}})
    )
    assert "PodDisruptionBudget" in kinds(
        _endpoint({"model": {"name": "m"}, "scaling": {"minReplicas": 2}})
    )
    # An existing claim is used, not created.
    existing = _endpoint({"model": {"name": "m"}, "cache": {"existingClaim": "mine"}})
    assert "PersistentVolumeClaim" not in kinds(existing)
    volumes = manifests.build_deployment(existing, SETTINGS, replicas=1)["spec"]["template"][
        "spec"
    ]["volumes"]
    assert {"name": "model-cache", "persistentVolumeClaim": {"claimName": "mine"}} in volumes
    # Every optional child has a fixed name the reconcile can delete it by.
    optional = {(r.kind, r.name) for r in manifests.optional_children("demo")}
    full = _endpoint(
        {
            "model": {"name": "m", "chatTemplate": "t"},
            "cache": {"size": "1Gi"},
            "scaling": {"maxReplicas": 2},
            "api": {"ingress": {"enabled": True}, "allowUnauthenticated": True},
            "adapters": [{"name": "sql", "source": "org/sql-lora"}],
        }
    )
    built = {(o["kind"], o["metadata"]["name"]) for o in manifests.build_children(full, SETTINGS)}
    assert optional == built - {("Service", "demo")}


def test_children_carry_the_selector_labels() -> None:
    ep = _endpoint({"model": {"name": "m"}, "scaling": {"maxReplicas": 2}})
    objs = _all(ep)
    for obj in objs:
        assert obj["metadata"]["labels"][manifests.LABEL_ENDPOINT] == "demo"
        assert obj["metadata"]["namespace"] == "team"
    deployment = objs[0]
    assert deployment["spec"]["selector"]["matchLabels"] == {manifests.LABEL_ENDPOINT: "demo"}
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert labels.items() >= deployment["spec"]["selector"]["matchLabels"].items()


@pytest.mark.parametrize(
    ("scaling", "current", "expected"),
    [
        ({}, None, 1),  # create: minReplicas
        ({"minReplicas": 2, "maxReplicas": 5}, None, 2),
        ({"minReplicas": 1, "maxReplicas": 5}, 3, None),  # inside the bounds: the autoscaler's
        ({"minReplicas": 1, "maxReplicas": 5}, 1, None),
        ({"minReplicas": 1, "maxReplicas": 5}, 5, None),
        ({"minReplicas": 2, "maxReplicas": 5}, 1, 2),  # below: raise to min
        ({"minReplicas": 1, "maxReplicas": 2}, 4, 2),  # above: lower to max
        ({"minReplicas": 3}, 1, 3),  # no max: a fixed size
        ({"minReplicas": 1, "maxReplicas": 5, "replicas": 4}, 2, 4),  # pinned by kubectl scale
        ({"minReplicas": 1, "maxReplicas": 5, "replicas": 4}, 4, None),
    ],
)
def test_replicas_to_write(
    scaling: dict[str, Any], current: int | None, expected: int | None
) -> None:
    ep = _endpoint({"model": {"name": "m"}, "scaling": scaling})
    assert manifests.replicas_to_write(ep, current) == expected


def test_replicas_are_left_out_unless_given() -> None:
    ep = _endpoint({"model": {"name": "m"}})
    assert "replicas" not in manifests.build_deployment(ep, SETTINGS, replicas=None)["spec"]
    assert manifests.build_deployment(ep, SETTINGS, replicas=2)["spec"]["replicas"] == 2


def test_security_contexts_come_from_settings() -> None:
    settings = OperatorSettings(
        runtime_security_context={"readOnlyRootFilesystem": True},
        runtime_pod_security_context={"runAsUser": 2000},
    )
    deployment = manifests.build_deployment(
        _endpoint({"model": {"name": "m"}}), settings, replicas=1
    )
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"] == {"runAsUser": 2000}
    assert pod["containers"][0]["securityContext"] == {"readOnlyRootFilesystem": True}
    default = manifests.build_deployment(_endpoint({"model": {"name": "m"}}), SETTINGS, replicas=1)
    assert default["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
    container_sc = _container(default)["securityContext"]
    assert container_sc["allowPrivilegeEscalation"] is False


def _lora_env(spec_adapters: list[dict], **engine: Any) -> dict[str, str]:
    ep = _endpoint({"model": {"name": "m"}, "adapters": spec_adapters, "engine": engine})
    return {v["name"]: v.get("value") for v in manifests.build_env(ep)}


def test_adapters_become_a_mounted_list_and_the_engine_settings_they_need() -> None:
    ep = _endpoint(
        {
            "model": {"name": "m"},
            "adapters": [
                {"name": "sql", "source": "org/sql-lora", "revision": "abc", "rank": 8},
                {"name": "legal", "source": "/models/adapters/legal"},
            ],
        }
    )
    (configmap,) = [o for o in manifests.build_children(ep, SETTINGS) if o["kind"] == "ConfigMap"]
    assert configmap["metadata"]["name"] == "demo-adapters"
    assert json.loads(configmap["data"]["adapters.json"]) == {
        "adapters": [
            {"name": "sql", "source": "org/sql-lora", "revision": "abc", "rank": 8},
            {"name": "legal", "source": "/models/adapters/legal"},
        ]
    }
    pod = manifests.build_pod_template(ep, SETTINGS)
    assert {"name": "adapters", "configMap": {"name": "demo-adapters"}} in pod["spec"]["volumes"]
    (mount,) = [m for m in pod["spec"]["containers"][0]["volumeMounts"] if m["name"] == "adapters"]
    assert "subPath" not in mount  # the kubelet refreshes whole-directory mounts only
    env = {v["name"]: v.get("value") for v in pod["spec"]["containers"][0]["env"]}
    assert env["LLMEP_ADAPTERS_FILE"] == "/etc/llmendpoints/adapters/adapters.json"
    assert (env["ENABLE_LORA"], env["MAX_LORAS"], env["MAX_LORA_RANK"]) == ("true", "4", "8")


def test_changing_the_adapter_list_does_not_roll_the_pods() -> None:
    def template(adapters: list[dict]) -> dict[str, Any]:
        ep = _endpoint({"model": {"name": "m"}, "adapters": adapters})
        return manifests.build_pod_template(ep, SETTINGS)

    one = template([{"name": "a", "source": "org/a"}])
    assert one == template([{"name": "b", "source": "org/b", "revision": "v2"}])
    assert one == template([{"name": f"a{i}", "source": "org/a"} for i in range(4)])
    # Only a step in the engine's settings does: beyond four adapters MAX_LORAS becomes 8.
    assert one != template([{"name": f"a{i}", "source": "org/a"} for i in range(5)])


@pytest.mark.parametrize(
    ("ranks", "expected"), [((None,), None), ((8, None), "8"), ((12, 16), "16"), ((300,), "320")]
)
def test_max_lora_rank_is_the_smallest_vllm_size_that_fits(ranks, expected) -> None:
    env = _lora_env(
        [
            {"name": f"a{i}", "source": "org/a", **({"rank": r} if r else {})}
            for i, r in enumerate(ranks)
        ]
    )
    assert env.get("MAX_LORA_RANK") == expected


def test_engine_args_and_env_override_the_derived_lora_settings() -> None:
    adapters = [{"name": "a", "source": "org/a", "rank": 8}]
    ep = _endpoint(
        {
            "model": {"name": "m"},
            "adapters": adapters,
            "engine": {
                "args": {"max-loras": 16},
                "env": [{"name": "MAX_LORA_RANK", "value": "64"}],
            },
        }
    )
    names = [v["name"] for v in manifests.build_env(ep)]
    assert names.count("MAX_LORAS") == 1 and names.count("MAX_LORA_RANK") == 1
    env = {v["name"]: v.get("value") for v in manifests.build_env(ep)}
    assert (
        env["MAX_LORAS"] == "16" and env["MAX_LORA_RANK"] == "64" and env["ENABLE_LORA"] == "true"
    )
    assert "ENABLE_LORA" not in _lora_env([])
    assert "LLMEP_ADAPTERS_FILE" not in _lora_env([])


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_runtime_pods_get_no_service_account_token(example: pathlib.Path) -> None:
    """The runtime never talks to the Kubernetes API: code in it must not hold a token that can."""
    pod = manifests.build_pod_template(_example(example), SETTINGS)["spec"]
    assert pod["automountServiceAccountToken"] is False
    # No ServiceAccount of its own either: one with no RBAC would be the default one by another name.
    assert "serviceAccountName" not in pod and "serviceAccount" not in pod
    mounts = [m["mountPath"] for c in pod["containers"] for m in c.get("volumeMounts", [])]
    assert not [m for m in mounts if m.startswith("/var/run/secrets/kubernetes.io")]


def test_pods_get_their_endpoint_id_and_the_shared_queue() -> None:
    ep = _endpoint({"model": {"name": "org/m"}}, name="chat-a")
    alone = {v["name"]: v.get("value") for v in _container(_all(ep)[0])["env"]}
    assert alone["ENDPOINT_ID"] == "chat-a"
    assert "JOBS_QUEUE_URL" not in alone  # no queue configured: the in-pod job store
    queued = OperatorSettings(
        runtime_image="registry.example/runtime:1.2.3",
        jobs_queue_url="nats://llmep:secret@llmendpoints-nats:4222",
        jobs_queue_replicas=3,
    )
    deployment = manifests.build_deployment(ep, queued, replicas=1)
    env = {v["name"]: v.get("value", v.get("valueFrom")) for v in _container(deployment)["env"]}
    # The password URL reaches the pod from the endpoint's Secret, never as a plain value.
    assert env["JOBS_QUEUE_URL"] == {
        "secretKeyRef": {"name": "chat-a-queue-creds-v2", "key": "url"}
    }
    assert "llmep:secret" not in json.dumps(deployment)
    assert env["ENDPOINT_ID"] == "chat-a"
    assert env["ENDPOINT_NAMESPACE"] == ep.namespace
    assert env["LLMEP_JOBS_QUEUE_REPLICAS"] == "3"
    secret = manifests.build_queue_creds_secret(ep, url=queued.jobs_queue_url)
    assert secret["metadata"]["name"] == "chat-a-queue-creds-v2"
    assert base64.b64decode(secret["data"]["url"]).decode() == queued.jobs_queue_url
    assert secret["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "llmendpoints-operator"


def test_pods_mount_their_own_queue_creds_with_per_endpoint_credentials() -> None:
    ep = _endpoint({"model": {"name": "org/m"}}, name="chat-a")
    keyed = OperatorSettings(
        jobs_queue_url="nats://llmendpoints-nats:4222", jobs_queue_keys_dir="/k"
    )
    pod = manifests.build_deployment(ep, keyed, replicas=1)["spec"]["template"]["spec"]
    container = pod["containers"][0]
    env = {v["name"]: v.get("value") for v in container["env"]}
    assert env["JOBS_QUEUE_URL"] == "nats://llmendpoints-nats:4222"
    assert env["JOBS_QUEUE_CREDS_FILE"] == "/etc/llmendpoints/queue/queue.creds"
    (volume,) = [v for v in pod["volumes"] if v["name"] == "queue-creds"]
    assert volume["secret"] == {
        "secretName": "chat-a-queue-creds-v2",
        "items": [{"key": "queue.creds", "path": "queue.creds"}],
    }
    assert {"name": "queue-creds", "mountPath": "/etc/llmendpoints/queue", "readOnly": True} in (
        container["volumeMounts"]
    )
    secret = manifests.build_queue_creds_secret(ep, creds="CREDS")
    assert base64.b64decode(secret["data"]["queue.creds"]) == b"CREDS"


def test_a_password_url_with_per_endpoint_credentials_is_refused() -> None:
    with pytest.raises(ValueError, match="must not hold one"):
        OperatorSettings(jobs_queue_url="nats://u:p@nats:4222", jobs_queue_keys_dir="/k")
