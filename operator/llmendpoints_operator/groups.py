"""PURE: the workload of an endpoint - a Deployment, or a LeaderWorkerSet of multi-node groups.

An endpoint with `spec.resources.nodes > 1` runs each replica as one group of `nodes` pods:
one LeaderWorkerSet (leaderworkerset.x-k8s.io/v1, LWS v0.9.0) named `<endpoint>-group`, group
size = nodes, `spec.replicas` = groups. Leader and workers run the same runtime container
(manifests.build_pod_template; only the ports differ) and learn who is who from what LWS injects
(LWS_LEADER_ADDRESS, LWS_GROUP_SIZE, LWS_WORKER_INDEX: docs/contracts.md). A group that loses a
pod restarts whole (RecreateGroupOnPodRestart): vLLM cannot replace one rank of a running group.

Why not name it `<endpoint>`: LWS makes a headless Service named like the LeaderWorkerSet for
its pods' DNS names (LWS_LEADER_ADDRESS is <leader pod>.<that Service>), and the endpoint's own
Service already has that name; LWS would take ours for its own and the leader address would not
resolve.

Also here: which pods keep a group from being ready, from the pods themselves (for the status).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from llmendpoints_operator import manifests
from llmendpoints_operator.config import OperatorSettings
from llmendpoints_operator.manifests import ChildRef
from llmendpoints_operator.spec import Endpoint

LWS_GROUP = "leaderworkerset.x-k8s.io"
LWS_API_VERSION = f"{LWS_GROUP}/v1"
LWS_KIND = "LeaderWorkerSet"
LWS_PLURAL = "leaderworkersets"
LWS_CRD = f"{LWS_PLURAL}.{LWS_GROUP}"
LWS_VERSION = "v0.9.0"  # the release the operator's LeaderWorkerSets are built and tested for
LWS_INSTALL = (
    "kubectl apply --server-side -f https://github.com/kubernetes-sigs/lws/releases/download/"
    f"{LWS_VERSION}/manifests.yaml"
)
DEPLOYMENT_API_VERSION = "apps/v1"
DEPLOYMENT_KIND = "Deployment"


def group_set_name(endpoint_name: str) -> str:
    return f"{endpoint_name}-group"


def multinode(ep: Endpoint) -> bool:
    return ep.spec.resources.nodes > 1


def workload_ref(ep: Endpoint) -> ChildRef:
    """The workload the spec asks for."""
    if multinode(ep):
        return ChildRef(LWS_API_VERSION, LWS_KIND, group_set_name(ep.name))
    return ChildRef(DEPLOYMENT_API_VERSION, DEPLOYMENT_KIND, manifests.deployment_name(ep.name))


def other_workload_ref(ep: Endpoint) -> ChildRef:
    """The workload of the other kind, which a change of spec.resources.nodes leaves behind."""
    if multinode(ep):
        return ChildRef(DEPLOYMENT_API_VERSION, DEPLOYMENT_KIND, manifests.deployment_name(ep.name))
    return ChildRef(LWS_API_VERSION, LWS_KIND, group_set_name(ep.name))


def build_workload(
    ep: Endpoint, settings: OperatorSettings, *, replicas: int | None
) -> dict[str, Any]:
    if multinode(ep):
        return build_leader_worker_set(ep, settings, replicas=replicas)
    return manifests.build_deployment(ep, settings, replicas=replicas)


def _rollout(ep: Endpoint) -> dict[str, Any]:
    """spec.rollout in LWS's terms, counted in groups. LWS rolls groups only: Recreate is every
    group at once (maxUnavailable 100%)."""
    rollout = ep.spec.rollout
    if rollout.strategy == "Recreate":
        config: dict[str, Any] = {"maxUnavailable": "100%", "maxSurge": 0}
    else:
        config = {"maxUnavailable": rollout.max_unavailable, "maxSurge": rollout.max_surge}
    return {"type": "RollingUpdate", "rollingUpdateConfiguration": config}


def build_leader_worker_set(
    ep: Endpoint, settings: OperatorSettings, *, replicas: int | None
) -> dict[str, Any]:
    """The endpoint's LeaderWorkerSet. `replicas=None` leaves the field out, as for a Deployment
    (manifests.replicas_to_write: the autoscaler owns it)."""
    spec: dict[str, Any] = {
        "leaderWorkerTemplate": {
            "size": ep.spec.resources.nodes,
            "restartPolicy": "RecreateGroupOnPodRestart",
            "leaderTemplate": manifests.build_pod_template(ep, settings, role="leader"),
            "workerTemplate": manifests.build_pod_template(ep, settings, role="worker"),
        },
        # Workers start with their leader, not once it is ready: the leader's engine is ready
        # only when every worker has joined it (LeaderReady would wait forever).
        "startupPolicy": "LeaderCreated",
        "rolloutStrategy": _rollout(ep),
        # One headless Service (named like the LeaderWorkerSet) for every group's pod names.
        "networkConfig": {"subdomainPolicy": "Shared"},
    }
    if replicas is not None:
        spec = {"replicas": replicas, **spec}
    return {
        "apiVersion": LWS_API_VERSION,
        "kind": LWS_KIND,
        "metadata": {
            "name": group_set_name(ep.name),
            "namespace": ep.namespace,
            "labels": manifests.labels(ep.name),
        },
        "spec": spec,
    }


# --- which pods keep a group from being ready -------------------------------------------------

MAX_UNREADY_REPORTED = 10
# Reasons of pods that are not ready but have not failed (a group starting or being recreated).
NOT_FAILURES = frozenset({"Starting", "Terminating"})
# Container states that are failures, not a start in progress.
_FAILING_WAITING = {
    "CrashLoopBackOff",
    "ImagePullBackOff",
    "ErrImagePull",
    "InvalidImageName",
    "CreateContainerConfigError",
    "CreateContainerError",
    "RunContainerError",
}


@dataclass(frozen=True)
class UnreadyPod:
    group: int
    worker_index: int
    pod: str
    node: str | None
    reason: str
    message: str

    def as_status(self) -> dict[str, Any]:
        out: dict[str, Any] = {"group": self.group, "workerIndex": self.worker_index}
        out["pod"] = self.pod
        if self.node:
            out["node"] = self.node
        out |= {"reason": self.reason, "message": self.message}
        return out

    def describe(self) -> str:
        role = "leader" if self.worker_index == 0 else f"worker {self.worker_index}"
        where = f" on node {self.node}" if self.node else ""
        return f"group {self.group}: {role} (pod {self.pod}{where}) {self.reason}: {self.message}"


def _condition(pod: Mapping[str, Any], type_: str) -> Mapping[str, Any]:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c.get("type") == type_), {})


def _why(pod: Mapping[str, Any]) -> tuple[str, str] | None:
    """(reason, message) of a pod that is not ready; None when it is ready."""
    status = pod.get("status") or {}
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return "Terminating", "the pod is being deleted (its group is recreated)"
    scheduled = _condition(pod, "PodScheduled")
    if scheduled.get("status") == "False":
        return scheduled.get("reason") or "Unschedulable", scheduled.get("message") or ""
    for container in status.get("containerStatuses") or []:
        waiting = (container.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in _FAILING_WAITING:
            return waiting["reason"], waiting.get("message") or ""
        last = (container.get("lastState") or {}).get("terminated") or {}
        if last and not container.get("ready"):
            restarts = container.get("restartCount") or 0
            return last.get("reason") or "Error", (
                f"exit code {last.get('exitCode')}, restarted {restarts} time(s)"
            )
    if status.get("phase") == "Failed":
        return status.get("reason") or "Failed", status.get("message") or ""
    if _condition(pod, "Ready").get("status") == "True":
        return None
    return "Starting", "not ready yet (downloading or loading the model, or waiting for its group)"


def unready_pods(pods: Iterable[Mapping[str, Any]]) -> list[UnreadyPod]:
    """The not-ready pods of LeaderWorkerSet groups, by group and place, at most
    MAX_UNREADY_REPORTED. Pods without LWS's labels are not a group's and are left out."""
    found = []
    for pod in pods:
        labels = (pod.get("metadata") or {}).get("labels") or {}
        group = labels.get(manifests.LWS_GROUP_INDEX_LABEL)
        worker = labels.get(manifests.LWS_WORKER_INDEX_LABEL)
        why = _why(pod)
        if why is None or group is None or worker is None:
            continue
        if not (group.isdigit() and worker.isdigit()):
            continue
        found.append(
            UnreadyPod(
                group=int(group),
                worker_index=int(worker),
                pod=str((pod.get("metadata") or {}).get("name", "")),
                node=(pod.get("spec") or {}).get("nodeName"),
                reason=str(why[0]),
                message=str(why[1]),
            )
        )
    found.sort(key=lambda p: (p.group, p.worker_index))
    return found[:MAX_UNREADY_REPORTED]


def failure_message(unready: Iterable[UnreadyPod], limit: int = 3) -> str | None:
    """The failing pods in one sentence (None when the unready pods are only starting)."""
    failing = [pod.describe() for pod in unready if pod.reason not in NOT_FAILURES]
    if not failing:
        return None
    more = (
        f"; and {len(failing) - limit} more (status.groups.unready)" if len(failing) > limit else ""
    )
    return "; ".join(failing[:limit]) + more
