"""PURE builders: a validated Endpoint (+ operator settings) -> the Kubernetes objects it needs.

No I/O, no clock, no randomness: the same input always gives the same dicts, which is what makes
the reconcile idempotent and these builders golden-testable. Owner references are added by the
reconcile (kopf.adopt), because they need the live object's uid.

The pod spec implements the runtime's environment contract (docs/contracts.md): MODEL_NAME and
friends, engine flags as UPPER_SNAKE variables, BASE_PATH on the model-cache volume,
API_KEYS_FILE and CUSTOM_CHAT_TEMPLATE as mounted files, probes on /ready?strict=1 and /health.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any

from llmendpoints_operator.config import OperatorSettings
from llmendpoints_operator.spec import LORA_RANKS, Endpoint, flag_env_name

GROUP = "llmendpoints.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "LLMEndpoint"
PLURAL = "llmendpoints"

# Labels on every child. The endpoint label is the pod selector (immutable in a Deployment, so it
# must never change) and how the autoscaler and the status find an endpoint's children.
LABEL_ENDPOINT = f"{GROUP}/endpoint"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGED_BY = "llmendpoints-operator"
ANNOTATION_CHAT_TEMPLATE_HASH = f"{GROUP}/chat-template-sha256"

CONTAINER_NAME = "runtime"
HTTP_PORT = 8000
HTTP_PORT_NAME = "http"
# A multi-node group's leader: torch.distributed's master port (LLMEP_MULTINODE_PORT; the runtime
# takes the ports after it for what else it needs, e.g. the data-parallel RPC port).
MULTINODE_PORT = 29500
MULTINODE_PORT_NAME = "multinode"
# The runtime's control port (LLMEP_CONTROL_PORT): /health, /ready, /ping and /metrics answered
# by a process of their own, whatever the event loop carries. The kubelet's probes and the
# autoscaler's scrape go there: a loaded pod stays visible to both (docs/operator.md).
CONTROL_PORT = 8001
CONTROL_PORT_NAME = "control"
MODEL_CACHE_PATH = "/models"
CHAT_TEMPLATE_DIR = "/etc/llmendpoints/chat-template"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
API_KEYS_DIR = "/etc/llmendpoints/api-keys"
API_KEYS_FILE = "api-keys"
ADAPTERS_DIR = "/etc/llmendpoints/adapters"
# The endpoint's own NATS credential for the shared job queue (Secret <endpoint>-queue-creds-v2):
# a creds file when the operator mints per-endpoint credentials, else the password URL.
QUEUE_CREDS_DIR = "/etc/llmendpoints/queue"
QUEUE_CREDS_FILE = "queue.creds"
QUEUE_URL_KEY = "url"
ADMIN_KEY_DIR = "/etc/llmendpoints/admin-key"
ADMIN_KEY_FILE = "admin-api-key"  # the file in ADMIN_KEY_DIR and the key in the Secret
ADAPTERS_FILE = "adapters.json"
# Extra grace after the runtime's drain timeout: SIGKILL must never cut a drain short.
TERMINATION_GRACE_MARGIN_SECONDS = 15
STARTUP_PROBE_PERIOD_SECONDS = 10
READY_PATH = "/ready?strict=1"  # 200 ready, 503 otherwise (plain /ready answers 204 while loading)
HEALTH_PATH = "/health"


# Fixed child names: a reconcile finds its children by name, never by listing.
def deployment_name(endpoint_name: str) -> str:
    return endpoint_name


def service_name(endpoint_name: str) -> str:
    return endpoint_name


def chat_template_configmap_name(endpoint_name: str) -> str:
    return f"{endpoint_name}-chat-template"


def adapters_configmap_name(endpoint_name: str) -> str:
    return f"{endpoint_name}-adapters"


def cache_claim_name(endpoint_name: str) -> str:
    return f"{endpoint_name}-model-cache"


def gateway_token_secret_name(endpoint_name: str) -> str:
    return f"{endpoint_name}-gateway-token"


def admin_key_secret_name(endpoint_name: str) -> str:
    return f"{endpoint_name}-admin-key"


# The credential's permissions' generation: a Secret is created once and never updated (the
# operator may not), so permissions that change get a new Secret name -- minted anew, and the
# pods rolled onto it -- while the NATS servers refuse credentials minted before
# (queue/trust.py REVOKED_BEFORE). 2: each endpoint's own streams (issue 28).
QUEUE_CREDS_GENERATION = 2


def queue_creds_secret_name(endpoint_name: str) -> str:
    return f"{endpoint_name}-queue-creds-v{QUEUE_CREDS_GENERATION}"


def selector_labels(endpoint_name: str) -> dict[str, str]:
    return {LABEL_ENDPOINT: endpoint_name}


# What LeaderWorkerSet's webhook labels each pod of a group with: its place in the group.
LWS_WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
LWS_GROUP_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/group-index"
LEADER_INDEX = "0"


def serving_selector(ep: Endpoint) -> dict[str, str]:
    """The pods that serve requests: every pod of a single-node endpoint, the leaders of a
    multi-node one's groups (a worker serves no HTTP; a group is one replica). The Service (so
    its EndpointSlices, which the gateway and the autoscaler read) and the InferencePool select
    these."""
    if ep.spec.resources.nodes == 1:
        return selector_labels(ep.name)
    return {**selector_labels(ep.name), LWS_WORKER_INDEX_LABEL: LEADER_INDEX}


def labels(endpoint_name: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "llmendpoint",
        "app.kubernetes.io/instance": endpoint_name,
        "app.kubernetes.io/component": "inference",
        LABEL_MANAGED_BY: MANAGED_BY,
        LABEL_ENDPOINT: endpoint_name,
    }


def selector_string(labels: dict[str, str]) -> str:
    """A pod selector in the string form the scale subresource publishes (status.selector)."""
    return ",".join(f"{key}={value}" for key, value in labels.items())


def _metadata(ep: Endpoint, name: str, annotations: dict[str, str] | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": ep.namespace, "labels": labels(ep.name)}
    if annotations:
        meta["annotations"] = dict(annotations)
    return meta


def _bool(value: bool) -> str:
    return "true" if value else "false"


def _arg_value(value: str | int | float | bool) -> str:
    return _bool(value) if isinstance(value, bool) else str(value)


def tensor_parallel_size(ep: Endpoint) -> int | None:
    """Explicit tensorParallelSize, else the derived one when it is more than 1 (parallelism.py)."""
    if ep.spec.engine.tensor_parallel_size is not None:
        return ep.spec.engine.tensor_parallel_size
    tensor = ep.spec.parallelism.tensor
    return tensor if tensor > 1 else None


def parallel_env(ep: Endpoint) -> list[tuple[str, str | None]]:
    """The sizes that are not 1 and, for a multi-node replica, how the group meets (the same on
    leader and workers; LeaderWorkerSet adds who is who: docs/contracts.md)."""
    sizes = ep.spec.parallelism
    multinode = sizes.multinode
    return [
        ("TENSOR_PARALLEL_SIZE", _opt(tensor_parallel_size(ep))),
        ("PIPELINE_PARALLEL_SIZE", _opt(sizes.pipeline if sizes.pipeline > 1 else None)),
        ("DATA_PARALLEL_SIZE", _opt(sizes.data if sizes.data > 1 else None)),
        ("ENABLE_EXPERT_PARALLEL", _bool(True) if sizes.expert else None),
        ("LLMEP_NODES", str(sizes.nodes) if multinode else None),
        ("LLMEP_MULTINODE_PORT", str(MULTINODE_PORT) if multinode else None),
    ]


def build_env(ep: Endpoint) -> list[dict[str, Any]]:
    """The runtime's environment for this endpoint, in a stable order."""
    model, engine, api = ep.spec.model, ep.spec.engine, ep.spec.api
    plain: list[tuple[str, str | None]] = [
        ("MODEL_NAME", model.name),
        ("MODEL_REVISION", model.revision),
        ("TOKENIZER_NAME", model.tokenizer.name if model.tokenizer else None),
        ("TOKENIZER_REVISION", model.tokenizer.revision if model.tokenizer else None),
        ("OPENAI_SERVED_MODEL_NAME_OVERRIDE", ep.served_model_name),
        (
            "CUSTOM_CHAT_TEMPLATE",
            f"{CHAT_TEMPLATE_DIR}/{CHAT_TEMPLATE_FILE}" if model.chat_template else None,
        ),
        ("TRUST_REMOTE_CODE", _bool(True) if model.trust_remote_code else None),
        ("DTYPE", engine.dtype),
        ("MAX_MODEL_LEN", _opt(engine.max_model_len)),
        *parallel_env(ep),
        ("GPU_MEMORY_UTILIZATION", _opt(engine.gpu_memory_utilization)),
        ("QUANTIZATION", engine.quantization),
        (
            "ENABLE_PREFIX_CACHING",
            None if engine.enable_prefix_caching is None else _bool(engine.enable_prefix_caching),
        ),
        # A baked image keeps its own BASE_PATH (where its weights are) and HF_HUB_OFFLINE=1.
        ("BASE_PATH", None if model.baked_into_image else MODEL_CACHE_PATH),
        ("API_KEYS_FILE", f"{API_KEYS_DIR}/{API_KEYS_FILE}" if api.api_keys_secret_ref else None),
        # The endpoint's generated admin key: engine control (adapter loads, sleep...) and every
        # job. Without API keys the endpoint still serves without a key; control stays closed.
        ("ADMIN_API_KEYS_FILE", f"{ADMIN_KEY_DIR}/{ADMIN_KEY_FILE}"),
        ("MAX_CONCURRENCY", _opt(api.max_concurrency)),
        ("MAX_QUEUE_LENGTH", _opt(api.max_queue_length)),
        ("DEFAULT_MAX_TOKENS", _opt(api.default_max_tokens)),
        ("DEFAULT_BATCH_SIZE", _opt(api.streaming.batch_size if api.streaming else None)),
        ("DEFAULT_MIN_BATCH_SIZE", _opt(api.streaming.min_batch_size if api.streaming else None)),
        (
            "DEFAULT_BATCH_SIZE_GROWTH_FACTOR",
            _opt(api.streaming.batch_size_growth_factor if api.streaming else None),
        ),
        ("DRAIN_TIMEOUT_SECONDS", str(engine.drain_timeout_seconds)),
        ("HOST", "0.0.0.0"),
        ("PORT", str(HTTP_PORT)),
        ("LLMEP_CONTROL_PORT", str(CONTROL_PORT)),
        ("LOG_FORMAT", "json"),
    ]
    env: list[dict[str, Any]] = [
        {"name": name, "value": value} for name, value in plain if value is not None
    ]
    # The control port listens on the pod's IP, which the kubelet probes and the autoscaler
    # scrapes: not on every interface of the pod.
    env.append(
        {"name": "LLMEP_CONTROL_HOST", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
    )
    if model.hf_token_secret_ref is not None:
        ref = model.hf_token_secret_ref
        env.append(
            {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}}
        )
    env.extend(lora_env(ep))
    for flag in sorted(engine.args):
        env.append({"name": flag_env_name(flag), "value": _arg_value(engine.args[flag])})
    for var in engine.env:
        env.append(var.model_dump(by_alias=True, exclude_none=True))
    return env


# --- LoRA adapters ------------------------------------------------------------------------------


def lora_settings(ep: Endpoint) -> dict[str, str]:
    """The engine settings that spec.adapters needs, minus those engine.args/env set themselves.

    They are fixed at engine start, so they change in steps (a new value rolls the pods): LoRA on
    at the first adapter; MAX_LORAS (adapters in one batch) 4, then 8 beyond four adapters (more
    adapters still serve, just not all in the same batch); MAX_LORA_RANK the smallest value vLLM
    accepts that covers the largest declared rank (unset: vLLM's default, 16).
    """
    adapters = ep.spec.adapters
    if not adapters:
        return {}
    settings = {"ENABLE_LORA": "true", "MAX_LORAS": "4" if len(adapters) <= 4 else "8"}
    ranks = [a.rank for a in adapters if a.rank is not None]
    if ranks:
        settings["MAX_LORA_RANK"] = str(next(r for r in LORA_RANKS if r >= max(ranks)))
    engine = ep.spec.engine
    taken = {flag_env_name(flag) for flag in engine.args} | {var.name for var in engine.env}
    return {name: value for name, value in settings.items() if name not in taken}


def lora_env(ep: Endpoint) -> list[dict[str, Any]]:
    if not ep.spec.adapters:
        return []
    env = [{"name": "LLMEP_ADAPTERS_FILE", "value": f"{ADAPTERS_DIR}/{ADAPTERS_FILE}"}]
    env.extend({"name": name, "value": value} for name, value in lora_settings(ep).items())
    return env


def adapters_document(ep: Endpoint) -> str:
    """The file the runtime reconciles its adapters to (runtime: adapters/declared.py)."""
    adapters = [a.model_dump(exclude_none=True) for a in ep.spec.adapters]
    return json.dumps({"adapters": adapters}, indent=2, sort_keys=True) + "\n"


def build_adapters_configmap(ep: Endpoint) -> dict[str, Any] | None:
    if not ep.spec.adapters:
        return None
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(ep, adapters_configmap_name(ep.name)),
        "data": {ADAPTERS_FILE: adapters_document(ep)},
    }


def queue_env(ep: Endpoint, settings: OperatorSettings) -> list[dict[str, Any]]:
    """Which endpoint's jobs the pod serves (``/v2/{ENDPOINT_ID}/...``; its identity in the
    queue is ENDPOINT_NAMESPACE/ENDPOINT_ID) and, when the operator knows the shared job queue,
    where it is and the endpoint's own credential: then the pod is one of the endpoint's
    workers. No secret is a plain env value: the credential is a mounted creds file, or (a
    password URL) read from the endpoint's Secret."""
    env: list[dict[str, Any]] = [
        {"name": "ENDPOINT_ID", "value": ep.name},
        {"name": "ENDPOINT_NAMESPACE", "value": ep.namespace},
    ]
    if settings.jobs_queue_url:
        secret = queue_creds_secret_name(ep.name)
        if settings.jobs_queue_keys_dir:
            env.append({"name": "JOBS_QUEUE_URL", "value": settings.jobs_queue_url})
            env.append(
                {"name": "JOBS_QUEUE_CREDS_FILE", "value": f"{QUEUE_CREDS_DIR}/{QUEUE_CREDS_FILE}"}
            )
        else:
            env.append(
                {
                    "name": "JOBS_QUEUE_URL",
                    "valueFrom": {"secretKeyRef": {"name": secret, "key": QUEUE_URL_KEY}},
                }
            )
        if settings.jobs_queue_replicas is not None:
            env.append(
                {"name": "LLMEP_JOBS_QUEUE_REPLICAS", "value": str(settings.jobs_queue_replicas)}
            )
    return env


def _opt(value: int | float | None) -> str | None:
    return None if value is None else str(value)


def _resources(ep: Endpoint, settings: OperatorSettings) -> dict[str, Any]:
    res = ep.spec.resources
    requests = res.requests.model_dump(exclude_none=True) if res.requests else {}
    limits = res.limits.model_dump(exclude_none=True) if res.limits else {}
    if res.gpus:
        # Extended resources are only set as limits; Kubernetes copies them into requests.
        limits[res.gpu_resource_name or settings.gpu_resource_name] = str(res.gpus)
    out: dict[str, Any] = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def _probe(path: str, period: int, failures: int, timeout: int = 5) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": CONTROL_PORT_NAME},
        "periodSeconds": period,
        "timeoutSeconds": timeout,
        "failureThreshold": failures,
    }


def _volumes(ep: Endpoint) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    spec = ep.spec
    shm: dict[str, Any] = {"medium": "Memory"}
    if spec.resources.shm_size is not None:
        shm["sizeLimit"] = spec.resources.shm_size
    volumes: list[dict[str, Any]] = [{"name": "dshm", "emptyDir": shm}]
    mounts: list[dict[str, Any]] = [{"name": "dshm", "mountPath": "/dev/shm"}]

    if spec.model.baked_into_image:
        pass  # the weights are in the image, under its own BASE_PATH: mount nothing over them
    elif spec.cache is None:
        # No shared cache: every pod downloads into its own scratch volume.
        volumes.append({"name": "model-cache", "emptyDir": {}})
        mounts.append({"name": "model-cache", "mountPath": MODEL_CACHE_PATH})
    else:
        claim = spec.cache.existing_claim or cache_claim_name(ep.name)
        volumes.append({"name": "model-cache", "persistentVolumeClaim": {"claimName": claim}})
        mounts.append({"name": "model-cache", "mountPath": MODEL_CACHE_PATH})

    if spec.model.chat_template is not None:
        volumes.append(
            {"name": "chat-template", "configMap": {"name": chat_template_configmap_name(ep.name)}}
        )
        mounts.append({"name": "chat-template", "mountPath": CHAT_TEMPLATE_DIR, "readOnly": True})

    if spec.adapters:
        # A whole-directory mount (no subPath), no hash annotation: the kubelet refreshes the
        # file in running pods and the runtime loads and unloads adapters to match, no rollout.
        volumes.append(
            {"name": "adapters", "configMap": {"name": adapters_configmap_name(ep.name)}}
        )
        mounts.append({"name": "adapters", "mountPath": ADAPTERS_DIR, "readOnly": True})

    # Mounted as a directory too (rotating it by hand reaches running pods); not optional: a pod
    # waits for its admin key rather than start without one.
    volumes.append(
        {
            "name": "admin-key",
            "secret": {
                "secretName": admin_key_secret_name(ep.name),
                "items": [{"key": ADMIN_KEY_FILE, "path": ADMIN_KEY_FILE}],
            },
        }
    )
    mounts.append({"name": "admin-key", "mountPath": ADMIN_KEY_DIR, "readOnly": True})

    if spec.api.api_keys_secret_ref is not None:
        ref = spec.api.api_keys_secret_ref
        # A whole-directory mount (no subPath): the kubelet refreshes the file when the Secret
        # changes, and the runtime re-reads it, so keys rotate without a restart.
        volumes.append(
            {
                "name": "api-keys",
                "secret": {
                    "secretName": ref.name,
                    "items": [{"key": ref.key, "path": API_KEYS_FILE}],
                },
            }
        )
        mounts.append({"name": "api-keys", "mountPath": API_KEYS_DIR, "readOnly": True})
    return volumes, mounts


def chat_template_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


GATEWAY_TOKEN_DIR = "/etc/llmendpoints/gateway-token"
GATEWAY_TOKEN_FILE = "token"


def gateway_token_env(settings: OperatorSettings) -> list[dict[str, Any]]:
    if not settings.gateway_token_secret_file:
        return []
    return [{"name": "GATEWAY_TOKEN_FILE", "value": f"{GATEWAY_TOKEN_DIR}/{GATEWAY_TOKEN_FILE}"}]


def _gateway_token_volumes(ep: Endpoint, settings: OperatorSettings) -> tuple[list, list]:
    """The endpoint's gateway token: what the gateway presents instead of a client's key (the
    runtime believes its x-llmep-caller only with it). A directory mount, like the keys."""
    if not settings.gateway_token_secret_file:
        return [], []
    volume = {
        "name": "gateway-token",
        "secret": {
            "secretName": gateway_token_secret_name(ep.name),
            "items": [{"key": GATEWAY_TOKEN_FILE, "path": GATEWAY_TOKEN_FILE}],
        },
    }
    return [volume], [{"name": "gateway-token", "mountPath": GATEWAY_TOKEN_DIR, "readOnly": True}]


def _queue_volumes(ep: Endpoint, settings: OperatorSettings) -> tuple[list, list]:
    """The endpoint's creds file (per-endpoint credentials only). A directory mount: a creds
    file replaced in the Secret reaches running pods, which read it at each reconnect."""
    if not (settings.jobs_queue_url and settings.jobs_queue_keys_dir):
        return [], []
    volume = {
        "name": "queue-creds",
        "secret": {
            "secretName": queue_creds_secret_name(ep.name),
            "items": [{"key": QUEUE_CREDS_FILE, "path": QUEUE_CREDS_FILE}],
        },
    }
    return [volume], [{"name": "queue-creds", "mountPath": QUEUE_CREDS_DIR, "readOnly": True}]


def _ports(role: str) -> list[dict[str, Any]]:
    """A worker of a group serves no HTTP: only its probes and /metrics on the control port."""
    http = {"name": HTTP_PORT_NAME, "containerPort": HTTP_PORT, "protocol": "TCP"}
    control = {"name": CONTROL_PORT_NAME, "containerPort": CONTROL_PORT, "protocol": "TCP"}
    multinode = {"name": MULTINODE_PORT_NAME, "containerPort": MULTINODE_PORT, "protocol": "TCP"}
    return {"leader": [http, control, multinode], "worker": [control]}.get(role, [http, control])


def build_pod_template(
    ep: Endpoint, settings: OperatorSettings, *, role: str = "server"
) -> dict[str, Any]:
    """The runtime pod. `role`: server (a Deployment's pod), or a group's leader or worker, which
    run the same container and differ only in the ports they declare."""
    spec = ep.spec
    engine = spec.engine
    volumes, mounts = _volumes(ep)
    queue_volumes, queue_mounts = _queue_volumes(ep, settings)
    token_volumes, token_mounts = _gateway_token_volumes(ep, settings)
    volumes = [*volumes, *queue_volumes, *token_volumes]
    mounts = [*mounts, *queue_mounts, *token_mounts]
    container: dict[str, Any] = {
        "name": CONTAINER_NAME,
        "image": engine.image or settings.runtime_image,
        "command": ["llmendpoints-runtime"],
        "args": ["serve"],
        "ports": _ports(role),
        "env": [*build_env(ep), *queue_env(ep, settings), *gateway_token_env(settings)],
        "resources": _resources(ep, settings),
        "volumeMounts": mounts,
        # The HTTP server answers from the first second; the startup probe's budget covers the
        # whole download + load of the weights, after which readiness and liveness take over.
        "startupProbe": _probe(
            READY_PATH,
            STARTUP_PROBE_PERIOD_SECONDS,
            math.ceil(engine.startup_timeout_seconds / STARTUP_PROBE_PERIOD_SECONDS),
        ),
        "readinessProbe": _probe(READY_PATH, period=5, failures=2),
        # Generous: a busy engine may answer slowly, and a restart reloads the whole model.
        "livenessProbe": _probe(HEALTH_PATH, period=10, failures=6),
        "securityContext": dict(settings.runtime_security_context),
    }
    if engine.image_pull_policy is not None:
        container["imagePullPolicy"] = engine.image_pull_policy

    pod_spec: dict[str, Any] = {
        "containers": [container],
        "volumes": volumes,
        "terminationGracePeriodSeconds": engine.drain_timeout_seconds
        + TERMINATION_GRACE_MARGIN_SECONDS,
        "securityContext": dict(settings.runtime_pod_security_context),
        "enableServiceLinks": False,  # hundreds of *_SERVICE_HOST variables help nobody here
        # The runtime never calls the Kubernetes API: no token in the pod, so code running in it
        # (a model's remote code, a compromised dependency) cannot act as the namespace's
        # default ServiceAccount. The pod needs no ServiceAccount of its own for the same reason.
        "automountServiceAccountToken": False,
    }
    if engine.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": ref.name} for ref in engine.image_pull_secrets]
    res = spec.resources
    if res.node_selector:
        pod_spec["nodeSelector"] = dict(res.node_selector)
    if res.tolerations:
        pod_spec["tolerations"] = [
            t.model_dump(by_alias=True, exclude_none=True) for t in res.tolerations
        ]
    if res.affinity is not None:
        pod_spec["affinity"] = res.affinity
    if res.priority_class_name is not None:
        pod_spec["priorityClassName"] = res.priority_class_name

    annotations = {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(CONTROL_PORT),
        "prometheus.io/path": "/metrics",
    }
    if spec.model.chat_template is not None:
        # The runtime reads the template at start-up: a changed template must roll the pods.
        annotations[ANNOTATION_CHAT_TEMPLATE_HASH] = chat_template_hash(spec.model.chat_template)
    return {"metadata": {"labels": labels(ep.name), "annotations": annotations}, "spec": pod_spec}


def build_deployment(
    ep: Endpoint, settings: OperatorSettings, *, replicas: int | None
) -> dict[str, Any]:
    """The runtime Deployment. `replicas=None` leaves the field out (see replicas_to_write)."""
    rollout = ep.spec.rollout
    strategy: dict[str, Any]
    if rollout.strategy == "Recreate":
        strategy = {"type": "Recreate"}
    else:
        # Default maxSurge 0: a surge pod would wait for a GPU that the old pod still holds.
        strategy = {
            "type": "RollingUpdate",
            "rollingUpdate": {
                "maxSurge": rollout.max_surge,
                "maxUnavailable": rollout.max_unavailable,
            },
        }
    spec: dict[str, Any] = {
        "selector": {"matchLabels": selector_labels(ep.name)},
        "strategy": strategy,
        # Model downloads are long: only call a rollout stuck after the startup budget is spent.
        "progressDeadlineSeconds": ep.spec.engine.startup_timeout_seconds + 600,
        "revisionHistoryLimit": 3,
        "template": build_pod_template(ep, settings),
    }
    if replicas is not None:
        spec = {"replicas": replicas, **spec}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(ep, deployment_name(ep.name)),
        "spec": spec,
    }


def build_service(ep: Endpoint) -> dict[str, Any]:
    svc = ep.spec.api.service
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(ep, service_name(ep.name), svc.annotations),
        "spec": {
            "type": svc.type,
            "selector": serving_selector(ep),
            "ports": [
                {
                    "name": HTTP_PORT_NAME,
                    "port": svc.port,
                    "targetPort": HTTP_PORT_NAME,
                    "protocol": "TCP",
                    "appProtocol": "http",
                },
                # Listed so that the EndpointSlices carry it: the autoscaler scrapes there.
                # It serves nothing the http port does not (probes and /metrics).
                {
                    "name": CONTROL_PORT_NAME,
                    "port": CONTROL_PORT,
                    "targetPort": CONTROL_PORT_NAME,
                    "protocol": "TCP",
                    "appProtocol": "http",
                },
            ],
        },
    }


def build_chat_template_configmap(ep: Endpoint) -> dict[str, Any] | None:
    template = ep.spec.model.chat_template
    if template is None:
        return None
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(ep, chat_template_configmap_name(ep.name)),
        "data": {CHAT_TEMPLATE_FILE: template},
    }


def build_cache_claim(ep: Endpoint) -> dict[str, Any] | None:
    cache = ep.spec.cache
    if cache is None or cache.size is None:
        return None
    spec: dict[str, Any] = {
        "accessModes": list(cache.access_modes),
        "volumeMode": "Filesystem",
        "resources": {"requests": {"storage": cache.size}},
    }
    if cache.storage_class_name is not None:
        spec["storageClassName"] = cache.storage_class_name
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": _metadata(ep, cache_claim_name(ep.name)),
        "spec": spec,
    }


def build_pdb(ep: Endpoint) -> dict[str, Any] | None:
    """One voluntary disruption at a time, once the endpoint may run more than one replica.

    It selects every pod, a group's workers too: evicting any pod of a group takes the whole
    group down (RecreateGroupOnPodRestart), so with one pod budget a drain disrupts one group,
    then waits until it is back."""
    if ep.spec.scaling.upper <= 1:
        return None
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(ep, ep.name),
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": selector_labels(ep.name)},
            # Pods still loading a model do not count against the budget; evicting them is cheap.
            # A group's pods are unready together while it restarts: with IfHealthyBudget, a
            # group that never comes up (no GPU free, say) would block every drain.
            "unhealthyPodEvictionPolicy": (
                "IfHealthyBudget" if ep.spec.resources.nodes == 1 else "AlwaysAllow"
            ),
        },
    }


def build_ingress(ep: Endpoint) -> dict[str, Any] | None:
    ing = ep.spec.api.ingress
    if not ing.enabled:
        return None
    rule: dict[str, Any] = {
        "http": {
            "paths": [
                {
                    "path": ing.path,
                    "pathType": "Prefix",
                    "backend": {
                        "service": {
                            "name": service_name(ep.name),
                            "port": {"name": HTTP_PORT_NAME},
                        }
                    },
                }
            ]
        }
    }
    if ing.host is not None:
        rule = {"host": ing.host, **rule}
    spec: dict[str, Any] = {"rules": [rule]}
    if ing.class_name is not None:
        spec = {"ingressClassName": ing.class_name, **spec}
    if ing.tls is not None and ing.host is not None:
        spec["tls"] = [{"hosts": [ing.host], "secretName": ing.tls.secret_name}]
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "Ingress",
        "metadata": _metadata(ep, ep.name, ing.annotations),
        "spec": spec,
    }


def build_admin_key_secret(ep: Endpoint, key: str) -> dict[str, Any]:
    """The endpoint's admin key (``key``: generated by the reconcile, the one impure input).

    Created once and never written again (the operator may only create Secrets, never read or
    update them): rotating it is deleting it -- the next reconcile creates a new one -- or
    replacing its value by hand; the runtime re-reads the mounted file either way."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _metadata(ep, admin_key_secret_name(ep.name)),
        "type": "Opaque",
        "data": {ADMIN_KEY_FILE: base64.b64encode(key.encode()).decode()},
    }


def build_gateway_token_secret(ep: Endpoint, token: str) -> dict[str, Any]:
    """The endpoint's gateway token (``llmendpoints_common.gateway_token.derive`` of the
    installation's secret and ``<namespace>/<name>``: the reconcile's one impure input is the
    secret). Created once, like the admin key."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _metadata(ep, gateway_token_secret_name(ep.name)),
        "type": "Opaque",
        "data": {GATEWAY_TOKEN_FILE: base64.b64encode(token.encode()).decode()},
    }


def build_queue_creds_secret(
    ep: Endpoint, *, creds: str | None = None, url: str | None = None
) -> dict[str, Any]:
    """The endpoint's credential for the shared job queue: a creds file minted for it alone
    (``creds``), or the queue's password URL (``url``). Created once like the admin key;
    labelled as the operator's (``app.kubernetes.io/managed-by``) and owned by the endpoint.
    A runtime pod checks that a creds file was minted for its own endpoint before using it
    (llmendpoints_common.queue.trust.check_runtime_creds), so a Secret planted under this name
    before the endpoint existed is refused by the pods that would mount it."""
    data = {QUEUE_CREDS_FILE: creds} if creds is not None else {QUEUE_URL_KEY: url or ""}
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _metadata(ep, queue_creds_secret_name(ep.name)),
        "type": "Opaque",
        "data": {k: base64.b64encode(v.encode()).decode() for k, v in data.items()},
    }


# --- the InferencePool (Gateway API Inference Extension) ----------------------------------------

INFERENCE_POOL_GROUP = "inference.networking.k8s.io"
INFERENCE_POOL_API_VERSION = f"{INFERENCE_POOL_GROUP}/v1"
INFERENCE_POOL_KIND = "InferencePool"
INFERENCE_POOL_PLURAL = "inferencepools"
INFERENCE_POOL_CRD = f"{INFERENCE_POOL_PLURAL}.{INFERENCE_POOL_GROUP}"


def inference_pool_name(endpoint_name: str) -> str:
    return endpoint_name


def wants_inference_pool(ep: Endpoint, settings: OperatorSettings) -> bool:
    """spec.api.inferencePool.enabled, or the operator's default when the spec leaves it unset."""
    enabled = ep.spec.api.inference_pool.enabled
    return settings.inference_pool_default if enabled is None else enabled


def build_inference_pool(ep: Endpoint, settings: OperatorSettings) -> dict[str, Any] | None:
    """One InferencePool selecting the endpoint's pods on the runtime's port, or None when the
    endpoint does not ask for one.

    The selector is the Service's own (a multi-node endpoint's group leaders): the pool follows
    the pods through rollouts and scaling, and a gateway's endpoint picker reads their /metrics and sends
    /v1/completions and /v1/chat/completions to them directly. appProtocol is left out: its
    default is HTTP/1.1, which the runtime speaks, and CRDs before v1.4 do not know the field."""
    if not wants_inference_pool(ep, settings):
        return None
    spec: dict[str, Any] = {
        "selector": {"matchLabels": serving_selector(ep)},
        "targetPorts": [{"number": HTTP_PORT}],
    }
    ref = ep.spec.api.inference_pool.endpoint_picker_ref
    if ref is not None:
        picker: dict[str, Any] = {"name": ref.name, "kind": ref.kind}
        if ref.group:
            picker["group"] = ref.group
        if ref.port is not None:
            picker["port"] = {"number": ref.port.number}
        picker["failureMode"] = ref.failure_mode
        spec["endpointPickerRef"] = picker
    return {
        "apiVersion": INFERENCE_POOL_API_VERSION,
        "kind": INFERENCE_POOL_KIND,
        "metadata": _metadata(ep, inference_pool_name(ep.name)),
        "spec": spec,
    }


@dataclass(frozen=True)
class ChildRef:
    """Enough to address a child in the API: apiVersion, kind, name (namespace is the endpoint's)."""

    api_version: str
    kind: str
    name: str


def optional_children(ep_name: str) -> list[ChildRef]:
    """Children that exist only for some specs; a reconcile deletes those the spec no longer asks for."""
    return [
        ChildRef("v1", "ConfigMap", chat_template_configmap_name(ep_name)),
        ChildRef("v1", "ConfigMap", adapters_configmap_name(ep_name)),
        ChildRef("v1", "PersistentVolumeClaim", cache_claim_name(ep_name)),
        ChildRef("policy/v1", "PodDisruptionBudget", ep_name),
        ChildRef("networking.k8s.io/v1", "Ingress", ep_name),
    ]


def build_children(ep: Endpoint, settings: OperatorSettings) -> list[dict[str, Any]]:
    """Every child except the Deployment (whose replicas need the cluster's state), in apply order:
    what the pods mount first, so that a new pod never waits for a missing volume source."""
    built = [
        build_chat_template_configmap(ep),
        build_adapters_configmap(ep),
        build_cache_claim(ep),
        build_service(ep),
        build_pdb(ep),
        build_ingress(ep),
    ]
    return [obj for obj in built if obj is not None]


def first_replicas(ep: Endpoint, carried: int | None) -> int:
    """The replica count a new workload starts with: minReplicas (or the pin), or `carried` -
    the count of the workload it replaces - within the bounds."""
    wanted = replicas_to_write(ep, carried)
    return wanted if wanted is not None else carried if carried is not None else 0


def replicas_to_write(ep: Endpoint, current: int | None) -> int | None:
    """The replica count the reconcile must write to the Deployment, or None to leave it alone.

    Ownership rule (docs/operator.md): the reconcile writes `replicas` only when it creates the
    Deployment, when the current count is outside [minReplicas, maxReplicas], or when the user
    pins a count through the scale subresource (spec.scaling.replicas). Otherwise the autoscaler
    is the single writer, and a reconcile never undoes its decisions.
    """
    scaling = ep.spec.scaling
    lower, upper = scaling.min_replicas, scaling.upper
    if scaling.replicas is not None:
        wanted = min(max(scaling.replicas, lower), upper)
        return None if current == wanted else wanted
    if current is None:
        return lower
    if current < lower:
        return lower
    if current > upper:
        return upper
    return None
