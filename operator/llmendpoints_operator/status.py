"""PURE: the children's observed state -> the LLMEndpoint's status (conditions, phase, url).

Conditions, in the order a user reads them:

- SpecValid   the spec can be reconciled (reason InvalidSpec names the field otherwise);
- CacheReady  the model-cache volume is bound (or no shared cache is configured);
- Available   at least one replica serves requests;
- Progressing a rollout is under way (False with ProgressDeadlineExceeded when it is stuck);
- Ready       the endpoint answers requests: the spec is valid and a replica is available.

`phase` summarises them in one word for `kubectl get`: Pending, Starting, Ready, Updating,
Scaling, Degraded, ScaledToZero, Failed. Transition events come from `transition_events`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from llmendpoints_operator import manifests
from llmendpoints_operator.spec import Endpoint

CONDITION_TYPES = ("SpecValid", "CacheReady", "Available", "Progressing", "Ready")


@dataclass(frozen=True)
class DeploymentState:
    """What the status needs from the runtime Deployment."""

    desired: int
    replicas: int = 0
    ready: int = 0
    available: int = 0
    updated: int = 0
    generation: int | None = None
    observed_generation: int | None = None
    deadline_exceeded_message: str | None = None
    replica_failure_message: str | None = None  # pods cannot be created (quota, admission)

    @classmethod
    def from_object(cls, obj: Mapping[str, Any]) -> DeploymentState:
        spec = obj.get("spec") or {}
        status = obj.get("status") or {}
        stuck = failure = None
        for cond in status.get("conditions") or []:
            if (
                cond.get("type") == "Progressing"
                and cond.get("reason") == "ProgressDeadlineExceeded"
            ):
                stuck = cond.get("message") or "the rollout made no progress within its deadline"
            if cond.get("type") == "ReplicaFailure" and cond.get("status") == "True":
                failure = cond.get("message") or "pods cannot be created"
        return cls(
            desired=int(spec.get("replicas", 1)),
            replicas=int(status.get("replicas") or 0),
            ready=int(status.get("readyReplicas") or 0),
            available=int(status.get("availableReplicas") or 0),
            updated=int(status.get("updatedReplicas") or 0),
            generation=(obj.get("metadata") or {}).get("generation"),
            observed_generation=status.get("observedGeneration"),
            deadline_exceeded_message=stuck,
            replica_failure_message=failure,
        )

    @property
    def trouble(self) -> str | None:
        """Why the Deployment cannot reach its replica count, when its controller says so."""
        return self.replica_failure_message or self.deadline_exceeded_message

    @property
    def rolling_out(self) -> bool:
        if (
            self.generation is not None
            and self.observed_generation is not None
            and self.observed_generation < self.generation
        ):
            return True
        # New pods still to create, or old pods still to remove.
        return self.updated < self.desired or self.replicas > self.updated


@dataclass(frozen=True)
class CacheState:
    """The model-cache volume: kind none (per-pod scratch) or claim, and the claim's phase."""

    claim_name: str | None = None
    phase: str | None = None  # PersistentVolumeClaim status.phase; None = not observed (yet)
    existing: bool = False  # a claim the user created (spec.cache.existingClaim)


@dataclass(frozen=True)
class Observed:
    deployment: DeploymentState | None
    cache: CacheState


def _condition(type_: str, ok: bool, reason: str, message: str) -> dict[str, Any]:
    return {
        "type": type_,
        "status": "True" if ok else "False",
        "reason": reason,
        "message": message,
    }


def endpoint_url(ep: Endpoint, cluster_domain: str = "cluster.local") -> str:
    port = ep.spec.api.service.port
    suffix = "" if port == 80 else f":{port}"
    return f"http://{manifests.service_name(ep.name)}.{ep.namespace}.svc.{cluster_domain}{suffix}"


def ingress_url(ep: Endpoint) -> str | None:
    ing = ep.spec.api.ingress
    if not ing.enabled or ing.host is None:
        return None
    scheme = "https" if ing.tls is not None else "http"
    return f"{scheme}://{ing.host}{ing.path.rstrip('/')}"


def cache_state_for(ep: Endpoint, claim_phases: Mapping[str, str]) -> CacheState:
    """Pick the endpoint's claim out of the observed claim phases (by claim name)."""
    cache = ep.spec.cache
    if cache is None:
        return CacheState()
    claim = cache.existing_claim or manifests.cache_claim_name(ep.name)
    return CacheState(
        claim_name=claim, phase=claim_phases.get(claim), existing=cache.existing_claim is not None
    )


def _cache_condition(cache: CacheState) -> dict[str, Any]:
    if cache.claim_name is None:
        return _condition(
            "CacheReady",
            True,
            "NoSharedCache",
            "spec.cache is not set: every pod downloads the model into its own scratch volume",
        )
    claim = f"PersistentVolumeClaim {cache.claim_name}"
    if cache.phase == "Bound":
        return _condition("CacheReady", True, "Bound", f"{claim} is bound")
    if cache.phase is None and cache.existing:
        return _condition(
            "CacheReady",
            False,
            "ClaimNotFound",
            f"{claim} (spec.cache.existingClaim) does not exist",
        )
    if cache.phase is None:
        return _condition("CacheReady", False, "ClaimPending", f"waiting for {claim} to be created")
    if cache.phase == "Lost":
        return _condition("CacheReady", False, "ClaimLost", f"{claim} lost its volume")
    return _condition(
        "CacheReady",
        False,
        "ClaimPending",
        f"{claim} is {cache.phase}; check that its storage class can provision the requested "
        "access modes (ReadWriteMany by default)",
    )


def compute(
    *,
    name: str,
    namespace: str,
    endpoint: Endpoint | None,
    invalid_message: str | None,
    observed: Observed,
    previous: Mapping[str, Any] | None,
    now: str,
    observed_generation: int | None = None,
    cluster_domain: str = "cluster.local",
) -> dict[str, Any]:
    """The full `.status` (a merge-patch replaces it wholesale, conditions included).

    `endpoint` is None when the spec is invalid (`invalid_message` says why); children that a
    previous valid spec created keep running and are still reported.
    `previous` is the current status: transition times and fields this call cannot know
    (observedGeneration when not given, url of the last valid spec) carry over from it.
    """
    previous = previous or {}
    dep = observed.deployment
    conditions: list[dict[str, Any]] = []

    if endpoint is None:
        conditions.append(_condition("SpecValid", False, "InvalidSpec", invalid_message or ""))
    else:
        conditions.append(_condition("SpecValid", True, "Valid", "the spec is valid"))

    cache_cond = _cache_condition(observed.cache)
    conditions.append(cache_cond)
    cache_ready = cache_cond["status"] == "True"

    if dep is None:
        available = _condition(
            "Available", False, "DeploymentNotFound", "the runtime Deployment does not exist yet"
        )
    elif dep.desired == 0:
        available = _condition("Available", False, "ScaledToZero", "the endpoint has 0 replicas")
    elif dep.available >= 1:
        available = _condition(
            "Available",
            True,
            "ReplicasAvailable",
            f"{dep.available}/{dep.desired} replicas available",
        )
    else:
        available = _condition(
            "Available",
            False,
            "NoReplicasAvailable",
            f"0/{dep.desired} replicas available (pods download and load the model before "
            "they report ready)",
        )
    conditions.append(available)
    is_available = available["status"] == "True"

    if dep is None:
        progressing = _condition("Progressing", False, "DeploymentNotFound", "no rollout yet")
    elif dep.deadline_exceeded_message is not None:
        progressing = _condition(
            "Progressing", False, "ProgressDeadlineExceeded", dep.deadline_exceeded_message
        )
    elif dep.replica_failure_message is not None:
        progressing = _condition(
            "Progressing", False, "ReplicaFailure", dep.replica_failure_message
        )
    elif dep.rolling_out:
        progressing = _condition(
            "Progressing",
            True,
            "RollingOut",
            f"{dep.updated}/{dep.desired} replicas updated, {dep.available} available",
        )
    elif dep.available < dep.desired:
        # New replicas (a scale-up, or replacements) download and load the model first.
        progressing = _condition(
            "Progressing",
            True,
            "ScalingUp",
            f"{dep.available}/{dep.desired} replicas available, the others are starting",
        )
    else:
        progressing = _condition(
            "Progressing", False, "RolloutComplete", f"all {dep.desired} replicas are up to date"
        )
    conditions.append(progressing)

    # Ready and phase: the most important problem wins.
    if endpoint is None:
        ready = _condition("Ready", False, "InvalidSpec", invalid_message or "")
        phase = "Failed"
    elif is_available:
        ready = _condition("Ready", True, "Serving", available["message"])
        assert dep is not None
        if dep.trouble is not None:
            phase = "Degraded"
        elif progressing["reason"] == "RollingOut":
            phase = "Updating"
        elif progressing["reason"] == "ScalingUp":
            phase = "Scaling"
        else:
            phase = "Ready"
    elif dep is not None and dep.desired == 0:
        ready = _condition("Ready", False, "ScaledToZero", available["message"])
        phase = "ScaledToZero"
    elif not cache_ready:
        ready = _condition("Ready", False, "WaitingForCache", cache_cond["message"])
        phase = "Pending"
    elif dep is None:
        ready = _condition("Ready", False, "Creating", available["message"])
        phase = "Pending"
    elif dep.trouble is not None:
        ready = _condition("Ready", False, progressing["reason"], progressing["message"])
        phase = "Failed"
    else:
        ready = _condition("Ready", False, "Starting", available["message"])
        phase = "Starting"
    conditions.append(ready)

    # Keep lastTransitionTime when a condition's status did not change (Kubernetes convention).
    before = {c.get("type"): c for c in previous.get("conditions") or []}
    generation = (
        observed_generation
        if observed_generation is not None
        else previous.get("observedGeneration")
    )
    for cond in conditions:
        old = before.get(cond["type"])
        same = old is not None and old.get("status") == cond["status"]
        cond["lastTransitionTime"] = old.get("lastTransitionTime", now) if same else now
        if generation is not None:
            cond["observedGeneration"] = generation

    status: dict[str, Any] = {
        "phase": phase,
        "replicas": dep.replicas if dep else 0,
        "readyReplicas": dep.ready if dep else 0,
        "availableReplicas": dep.available if dep else 0,
        "updatedReplicas": dep.updated if dep else 0,
        "desiredReplicas": dep.desired if dep else 0,
        "selector": manifests.selector_string(name),
        "conditions": conditions,
    }
    if generation is not None:
        status["observedGeneration"] = generation
    if endpoint is not None:
        status["url"] = endpoint_url(endpoint, cluster_domain)
        status["servedModelName"] = endpoint.served_model_name
        ing = ingress_url(endpoint)
        if ing is not None:
            status["ingressUrl"] = ing
    else:
        # Keep telling where the still-running last good workload answers.
        for key in ("url", "servedModelName", "ingressUrl"):
            if key in previous:
                status[key] = previous[key]
    return status


def without_times(status: Mapping[str, Any]) -> dict[str, Any]:
    """The status minus transition times: equal results mean there is nothing to write."""
    out = dict(status)
    out["conditions"] = [
        {k: v for k, v in c.items() if k != "lastTransitionTime"}
        for c in status.get("conditions") or []
    ]
    return out


@dataclass(frozen=True)
class Event:
    type: str  # Normal or Warning
    reason: str
    message: str


def transition_events(
    previous: Mapping[str, Any] | None, current: Mapping[str, Any]
) -> list[Event]:
    """Kubernetes Events for the notable phase transitions between two statuses.

    Invalid specs are reported by the reconcile itself (it knows when a spec changed)."""
    before = (previous or {}).get("phase")
    after = current.get("phase")
    if before == after:
        return []
    ready = _find(current.get("conditions") or [], "Ready")
    progressing = _find(current.get("conditions") or [], "Progressing")
    message = (ready or {}).get("message", "")
    if after == "Ready":
        if before == "Updating":
            return [Event("Normal", "RolledOut", f"rollout complete: {message}")]
        if before == "Scaling":
            return []  # the autoscaler reports its own decisions
        url = current.get("url", "")
        return [Event("Normal", "Ready", f"{message}; serving at {url}")]
    if after == "Degraded":
        return [Event("Warning", "Degraded", f"{message}: {_trouble(current)}")]
    if after == "Failed" and (ready or {}).get("reason") != "InvalidSpec":
        return [Event("Warning", "RolloutFailed", (progressing or {}).get("message", message))]
    if after == "ScaledToZero":
        return [Event("Normal", "ScaledToZero", "the endpoint has no replicas")]
    if after == "Updating" and before == "Ready":
        return [Event("Normal", "RollingOut", (progressing or {}).get("message", ""))]
    return []


def _trouble(current: Mapping[str, Any]) -> str:
    progressing = _find(current.get("conditions") or [], "Progressing") or {}
    return str(progressing.get("message", ""))


def _find(conditions: Sequence[Mapping[str, Any]], type_: str) -> Mapping[str, Any] | None:
    return next((c for c in conditions if c.get("type") == type_), None)
