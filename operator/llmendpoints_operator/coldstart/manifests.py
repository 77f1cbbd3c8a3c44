"""PURE builders of the children that take work off a cold start's path (endpoints with
``spec.scaling.minReplicas: 0``):

- the download Job, ``<endpoint>-download-<key>``: ``llmendpoints-runtime download`` fills the
  model-cache volume when the endpoint is created or its model changes (the key is a hash of
  what is downloaded), so the first replica finds the weights there. Kubernetes retries a failed
  attempt with its exponential back-off (10 s, 20 s, 40 s... capped at 6 min) up to
  ``DOWNLOAD_BACKOFF_LIMIT`` times; each attempt writes its outcome (bytes and seconds, or the
  error) as the container's termination message, which the status shows (record.py).
- the pre-pull DaemonSet, ``<endpoint>-prepull``: on every node the endpoint's pods may use
  (their nodeSelector, node affinity and tolerations), an init container of the runtime image
  runs ``llmendpoints-runtime --version`` -- the image is pulled, nothing else happens -- and a
  pause container keeps the pod (so the kubelet keeps the image). Tiny requests, no GPU.

Both carry the endpoint's labels but for the pod selector label, so neither their pods nor the
Job's count as the endpoint's replicas (the Deployment, the Service, the PDB select on it).
"""

from __future__ import annotations

import copy
import hashlib
import json
from typing import Any

from llmendpoints_operator import manifests as base
from llmendpoints_operator.config import OperatorSettings
from llmendpoints_operator.spec import Endpoint

COMPONENT_DOWNLOAD = "model-download"
COMPONENT_PREPULL = "image-prepull"
# Labels of the download Job's pod (the operator's pods index finds them by these) and of the
# pre-pull pods (never indexed: one per node).
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_DOWNLOAD_KEY = f"{base.GROUP}/download-key"
LABEL_PREPULL = f"{base.GROUP}/prepull"

DOWNLOAD_BACKOFF_LIMIT = 8  # ~20 min of Kubernetes' exponential back-off between attempts
DOWNLOAD_REPORT_PATH = "/dev/termination-log"
_DOWNLOAD_RESOURCES = {
    "requests": {"cpu": "500m", "memory": "1Gi"},
    "limits": {"memory": "4Gi"},
}
_PREPULL_RESOURCES = {"requests": {"cpu": "1m", "memory": "8Mi"}, "limits": {"memory": "64Mi"}}
_PREPULL_CHECK_RESOURCES = {
    "requests": {"cpu": "10m", "memory": "64Mi"},
    "limits": {"memory": "256Mi"},
}


def prepull_name(endpoint_name: str) -> str:
    return f"{endpoint_name}-prepull"


def download_key(ep: Endpoint) -> str:
    """What is downloaded (and for whom: a Job name keeps 42 characters of the endpoint's),
    hashed: a new key, a new Job, when the model changes."""
    model = ep.spec.model
    tokenizer = model.tokenizer
    what = {
        "endpoint": ep.name,
        "model": model.name,
        "revision": model.revision,
        "tokenizer": tokenizer.name if tokenizer else None,
        "tokenizerRevision": tokenizer.revision if tokenizer else None,
        "trustRemoteCode": model.trust_remote_code,
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:10]


def download_job_name(ep: Endpoint) -> str:
    # A Job's name is a pod label value (job-name): at most 63 characters.
    return f"{ep.name[:42]}-download-{download_key(ep)}"


def _is_hub_model(name: str) -> bool:
    return not name.startswith(("/", "./", "../", "~"))


def wants_download(ep: Endpoint, settings: OperatorSettings) -> bool:
    """A Hub model, for an endpoint that scales to zero, onto a volume every replica mounts and
    the Job may write (not only ReadOnlyMany), unless the operator's setting turns it off."""
    spec = ep.spec
    cache = spec.cache
    return (
        settings.download_ahead
        and spec.scaling.min_replicas == 0
        and not spec.model.baked_into_image
        and cache is not None
        and set(cache.access_modes) != {"ReadOnlyMany"}
        and _is_hub_model(spec.model.name)
    )


def wants_prepull(ep: Endpoint, settings: OperatorSettings) -> bool:
    return settings.prepull_images and ep.spec.scaling.min_replicas == 0


def _labels(ep: Endpoint, component: str) -> dict[str, str]:
    labels = base.labels(ep.name)
    labels.pop(base.LABEL_ENDPOINT)  # not a replica: out of the Deployment's selector
    labels[LABEL_COMPONENT] = component
    return labels


def placement(ep: Endpoint, settings: OperatorSettings) -> dict[str, Any]:
    """Where the endpoint's pods may run, as pod spec fields: its nodeSelector, its node
    affinity (pod (anti-)affinity is about the replicas, not the nodes) and its tolerations.
    A GPU endpoint's pods tolerate the GPU resource's taint without saying so (Kubernetes'
    ExtendedResourceToleration adds it to pods that request the resource); pods that request
    none get it here."""
    res = ep.spec.resources
    out: dict[str, Any] = {}
    if res.node_selector:
        out["nodeSelector"] = dict(res.node_selector)
    node_affinity = (res.affinity or {}).get("nodeAffinity")
    if node_affinity:
        out["affinity"] = {"nodeAffinity": node_affinity}
    tolerations = [t.model_dump(by_alias=True, exclude_none=True) for t in res.tolerations]
    if res.gpus:
        gpu = res.gpu_resource_name or settings.gpu_resource_name
        tolerations.append({"key": gpu, "operator": "Exists", "effect": "NoSchedule"})
    if tolerations:
        out["tolerations"] = tolerations
    return out


def _pod_basics(ep: Endpoint, settings: OperatorSettings) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "securityContext": copy.deepcopy(settings.runtime_pod_security_context),
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,
        **placement(ep, settings),
    }
    if ep.spec.engine.image_pull_secrets:
        spec["imagePullSecrets"] = [{"name": r.name} for r in ep.spec.engine.image_pull_secrets]
    if ep.spec.resources.priority_class_name is not None:
        spec["priorityClassName"] = ep.spec.resources.priority_class_name
    return spec


def _image(ep: Endpoint, settings: OperatorSettings) -> str:
    return ep.spec.engine.image or settings.runtime_image


def _pull_policy(ep: Endpoint) -> dict[str, str]:
    policy = ep.spec.engine.image_pull_policy
    return {"imagePullPolicy": policy} if policy is not None else {}


def download_env(ep: Endpoint) -> list[dict[str, Any]]:
    """What ``llmendpoints-runtime download`` reads: the model's variables, BASE_PATH, the
    token, and the endpoint's own engine.env (a mirror's HF_ENDPOINT, a proxy)."""
    wanted = {
        "MODEL_NAME",
        "MODEL_REVISION",
        "TOKENIZER_NAME",
        "TOKENIZER_REVISION",
        "TRUST_REMOTE_CODE",
        "BASE_PATH",
        "HF_TOKEN",
    }
    env = [var for var in base.build_env(ep) if var["name"] in wanted]
    env += [var.model_dump(by_alias=True, exclude_none=True) for var in ep.spec.engine.env]
    return env


def build_download_job(ep: Endpoint, settings: OperatorSettings) -> dict[str, Any] | None:
    if not wants_download(ep, settings):
        return None
    cache = ep.spec.cache
    assert cache is not None  # wants_download
    claim = cache.existing_claim or base.cache_claim_name(ep.name)
    labels = {**_labels(ep, COMPONENT_DOWNLOAD), LABEL_DOWNLOAD_KEY: download_key(ep)}
    container = {
        "name": "download",
        "image": _image(ep, settings),
        **_pull_policy(ep),
        "command": ["llmendpoints-runtime"],
        "args": ["download", "--report", DOWNLOAD_REPORT_PATH],
        "env": download_env(ep),
        "resources": _DOWNLOAD_RESOURCES,
        "volumeMounts": [{"name": "model-cache", "mountPath": base.MODEL_CACHE_PATH}],
        "terminationMessagePath": DOWNLOAD_REPORT_PATH,
        # A crash before the report is written still says why: the log's tail.
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": copy.deepcopy(settings.runtime_security_context),
    }
    pod_spec = {
        **_pod_basics(ep, settings),
        "restartPolicy": "Never",  # each attempt a pod of its own: the Job's back-off applies
        "containers": [container],
        "volumes": [{"name": "model-cache", "persistentVolumeClaim": {"claimName": claim}}],
    }
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": download_job_name(ep),
            "namespace": ep.namespace,
            "labels": {**labels, base.LABEL_ENDPOINT: ep.name},
        },
        "spec": {
            "backoffLimit": DOWNLOAD_BACKOFF_LIMIT,
            "template": {"metadata": {"labels": labels}, "spec": pod_spec},
        },
    }


def build_prepull_daemonset(ep: Endpoint, settings: OperatorSettings) -> dict[str, Any] | None:
    if not wants_prepull(ep, settings):
        return None
    selector = {LABEL_PREPULL: ep.name}
    labels = {**_labels(ep, COMPONENT_PREPULL), **selector}
    check = {
        "name": "pull",
        "image": _image(ep, settings),
        **_pull_policy(ep),
        # Any command the image has: this one exists in every runtime image and exits at once.
        "command": ["llmendpoints-runtime", "--version"],
        "resources": _PREPULL_CHECK_RESOURCES,
        "securityContext": copy.deepcopy(settings.runtime_security_context),
    }
    hold = {
        "name": "hold",
        "image": settings.pause_image,
        "resources": _PREPULL_RESOURCES,
        "securityContext": copy.deepcopy(settings.runtime_security_context),
    }
    pod_spec = {
        **_pod_basics(ep, settings),
        "initContainers": [check],
        "containers": [hold],
        "terminationGracePeriodSeconds": 1,
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {
            "name": prepull_name(ep.name),
            "namespace": ep.namespace,
            "labels": {**labels, base.LABEL_ENDPOINT: ep.name},
        },
        "spec": {
            "selector": {"matchLabels": selector},
            # A new runtime image is pulled on every node at once: these pods serve nothing.
            "updateStrategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxUnavailable": "100%"},
            },
            "template": {"metadata": {"labels": labels}, "spec": pod_spec},
        },
    }
