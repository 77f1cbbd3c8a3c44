"""PURE: the children's observed state -> the LLMEndpoint's status (conditions, phase, url).

Conditions, in the order a user reads them:

- SpecValid   the spec can be reconciled (reason InvalidSpec names the field otherwise);
- CacheReady  the model-cache volume is bound (or no shared cache is configured);
- Available   at least one replica serves requests;
- Progressing a rollout is under way (False with ProgressDeadlineExceeded when it is stuck);
- Ready       the endpoint answers requests: the spec is valid and a replica is available;
- Authenticated  requests need an API key (False, a warning, when anyone who can reach the
              endpoint may use it: in the cluster without keys, or published with
              spec.api.allowUnauthenticated);
- ModelNameAvailable  the gateway routes the endpoint's served model name to it (False,
              ModelNameTaken, when an older endpoint declares the same name: the message names
              it; the endpoint still serves its Service and its /v2 job API);
- InferencePool  only when the endpoint asks for one: created (status.inferencePool names it),
              or why not (CRDNotInstalled, Rejected, Forbidden);
- ModelFits   the model fits the GPUs the endpoint asks for (the fit check, fit/): True with
              status.fit's numbers, False with what to change (no pods are asked for: Ready is
              False, ModelDoesNotFit), Unknown with why (the rollout goes on).

`phase` summarises them in one word for `kubectl get`: Pending, Starting, Ready, Updating,
Scaling, Degraded, ScaledToZero, Failed. Transition events come from `transition_events`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from llmendpoints_operator import groups, manifests
from llmendpoints_operator.autoscaling.record import SCALED_TO_ZERO_ANNOTATION
from llmendpoints_operator.fit.verdict import Fit
from llmendpoints_operator.spec import Endpoint


@dataclass(frozen=True)
class DeploymentState:
    """What the status needs from the runtime workload: a Deployment, or a LeaderWorkerSet
    (from_leader_worker_set), whose replicas are groups of `group_size` pods."""

    desired: int
    replicas: int = 0
    ready: int = 0
    available: int = 0
    updated: int = 0
    generation: int | None = None
    observed_generation: int | None = None
    deadline_exceeded_message: str | None = None
    replica_failure_message: str | None = None  # pods cannot be created (quota, admission)
    # Why the autoscaler scaled it to zero (its annotation, written with replicas: 0).
    scaled_to_zero_reason: str | None = None
    group_size: int = 1  # pods per replica: more than 1 for a LeaderWorkerSet's groups
    # A group's pods that fail (crash, cannot be scheduled, ...): read from the pods, not the
    # LeaderWorkerSet, which says only how many groups are ready (groups.unready_pods).
    group_failure_message: str | None = None

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
            scaled_to_zero_reason=(
                ((obj.get("metadata") or {}).get("annotations") or {}).get(
                    SCALED_TO_ZERO_ANNOTATION
                )
            ),
        )

    @classmethod
    def from_leader_worker_set(cls, obj: Mapping[str, Any]) -> DeploymentState:
        """LWS v0.9.0's status counts groups: replicas (created), readyReplicas (every pod
        ready), updatedReplicas (on the current template). It has no availableReplicas."""
        spec = obj.get("spec") or {}
        status = obj.get("status") or {}
        meta = obj.get("metadata") or {}
        ready = int(status.get("readyReplicas") or 0)
        return cls(
            desired=int(spec.get("replicas", 1)),
            replicas=int(status.get("replicas") or 0),
            ready=ready,
            available=ready,
            updated=int(status.get("updatedReplicas") or 0),
            generation=meta.get("generation"),
            observed_generation=status.get("observedGeneration"),
            scaled_to_zero_reason=(meta.get("annotations") or {}).get(SCALED_TO_ZERO_ANNOTATION),
            group_size=int((spec.get("leaderWorkerTemplate") or {}).get("size") or 1),
        )

    @property
    def unit(self) -> str:
        return "replicas" if self.group_size == 1 else "groups"

    @property
    def trouble(self) -> str | None:
        """Why the workload cannot reach its replica count, when its controller (or, for
        groups, their pods) says so."""
        return (
            self.replica_failure_message
            or self.deadline_exceeded_message
            or self.group_failure_message
        )

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


def workload_state(obj: Mapping[str, Any]) -> DeploymentState:
    """A Deployment's or a LeaderWorkerSet's state, by its kind."""
    if obj.get("kind") == groups.LWS_KIND:
        return DeploymentState.from_leader_worker_set(obj)
    return DeploymentState.from_object(obj)


@dataclass(frozen=True)
class CacheState:
    """The model-cache volume: kind none (per-pod scratch) or claim, and the claim's phase."""

    claim_name: str | None = None
    phase: str | None = None  # PersistentVolumeClaim status.phase; None = not observed (yet)
    existing: bool = False  # a claim the user created (spec.cache.existingClaim)


@dataclass(frozen=True)
class WorkloadProblem:
    """Why the workload could not be written (a multi-node endpoint's LeaderWorkerSet API
    missing or forbidden): the Ready condition's reason and message."""

    reason: str
    message: str


def groups_api_missing(nodes: int) -> WorkloadProblem:
    return WorkloadProblem(
        "LeaderWorkerSetNotInstalled",
        f"spec.resources.nodes is {nodes}: a multi-node endpoint runs each replica as a "
        f"LeaderWorkerSet group, and the LeaderWorkerSet API ({groups.LWS_API_VERSION}) is not "
        f"installed in this cluster. Install LeaderWorkerSet {groups.LWS_VERSION}: "
        f'{groups.LWS_INSTALL} (docs/operator.md, "Multi-node endpoints"); the operator '
        "creates the groups once it is there",
    )


def groups_forbidden(api_message: str) -> WorkloadProblem:
    return WorkloadProblem(
        "LeaderWorkerSetForbidden",
        "the operator may not write LeaderWorkerSets (its RBAC: upgrade the chart, whose role "
        f"grants them): {api_message}",
    )


@dataclass(frozen=True)
class Observed:
    deployment: DeploymentState | None
    cache: CacheState
    # A multi-node endpoint's pods that keep its groups from being ready (groups.unready_pods).
    unready: tuple[groups.UnreadyPod, ...] = ()
    workload_problem: WorkloadProblem | None = None


# --- the InferencePool (optional child; its API may not be installed) ---------------------------

POOL_CONDITION = "InferencePool"


@dataclass(frozen=True)
class InferencePoolState:
    """What the last reconcile did about the endpoint's InferencePool. `wanted` False: the
    endpoint does not ask for one (nothing is reported). Build with the functions below."""

    wanted: bool
    ok: bool = False
    reason: str = ""
    message: str = ""
    name: str | None = None  # the pool's name, once the API server accepted it


NO_POOL = InferencePoolState(wanted=False)


def pool_created(pool: Mapping[str, Any]) -> InferencePoolState:
    name = pool["metadata"]["name"]
    spec = pool["spec"]
    ports = ", ".join(str(p["number"]) for p in spec["targetPorts"])
    picker = spec.get("endpointPickerRef")
    if picker is None:
        via = "no endpointPickerRef (the gateway picks among the pods itself)"
    else:
        port = f":{picker['port']['number']}" if picker.get("port") else ""
        via = f"endpoint picker {picker['kind']} {picker['name']}{port}"
    return InferencePoolState(
        wanted=True,
        ok=True,
        reason="Created",
        message=f"InferencePool {name} selects the endpoint's pods on port {ports}; {via}",
        name=name,
    )


def pool_api_missing() -> InferencePoolState:
    return InferencePoolState(
        wanted=True,
        reason="CRDNotInstalled",
        message=f"the InferencePool API ({manifests.INFERENCE_POOL_API_VERSION}) is not installed "
        "in this cluster: install the Gateway API Inference Extension's CRDs "
        "(docs/gateway-api.md); the operator creates the pool once they are there",
    )


def pool_rejected(api_message: str, *, has_picker: bool) -> InferencePoolState:
    hint = (
        ""
        if has_picker
        else "; InferencePool CRDs before v1.6.0 require an endpoint picker: set "
        "spec.api.inferencePool.endpointPickerRef, or upgrade the CRDs"
    )
    return InferencePoolState(
        wanted=True,
        reason="Rejected",
        message=f"the API server refused the InferencePool: {api_message}{hint}",
    )


def pool_forbidden(api_message: str) -> InferencePoolState:
    return InferencePoolState(
        wanted=True,
        reason="Forbidden",
        message="the operator may not write InferencePools (its RBAC: upgrade the chart, whose "
        f"role grants them): {api_message}",
    )


def _pool_report(
    state: InferencePoolState | None, previous: Mapping[str, Any]
) -> tuple[dict[str, Any] | None, str | None]:
    """The InferencePool condition and status.inferencePool. Unknown state (an operator that has
    not reconciled the endpoint since it started): what the status said."""
    if state is None:
        kept = _find(previous.get("conditions") or [], POOL_CONDITION)
        if kept is None:
            return None, None
        condition = _condition(
            POOL_CONDITION, kept["status"] == "True", kept["reason"], kept["message"]
        )
        return condition, previous.get("inferencePool")
    if not state.wanted:
        return None, None
    return _condition(POOL_CONDITION, state.ok, state.reason, state.message), state.name


# --- will the model fit (fit/; None: not checked since the operator started) ------------------

FIT_CONDITION = "ModelFits"


def _fit_report(
    fit: Fit | None, previous: Mapping[str, Any]
) -> tuple[dict[str, Any] | None, Mapping[str, Any] | None]:
    """The ModelFits condition and status.fit; what the status said while the operator has not
    checked the endpoint since it started."""
    if fit is None:
        kept = _find(previous.get("conditions") or [], FIT_CONDITION)
        if kept is None:
            return None, None
        condition = {k: kept[k] for k in ("type", "status", "reason", "message") if k in kept}
        return condition, previous.get("fit")
    condition = {
        "type": FIT_CONDITION,
        "status": fit.status,
        "reason": fit.reason,
        "message": fit.message,
    }
    return condition, fit.numbers


# --- the served model name (a name belongs to the oldest endpoint declaring it) ------------------

MODEL_NAME_CONDITION = "ModelNameAvailable"


@dataclass(frozen=True)
class ModelNameState:
    """The endpoint's served model name and who keeps it (llmendpoints_common.model_names)."""

    name: str
    owner: str | None = None  # "<namespace>/<name>" of the older endpoint keeping it; None: us


def _model_name_condition(state: ModelNameState, name: str, namespace: str) -> dict[str, Any]:
    model = f'"model": "{state.name}"'
    if state.owner is None:
        return _condition(
            MODEL_NAME_CONDITION,
            True,
            "ModelNameClaimed",
            f"no older endpoint declares the model name {state.name!r}: the gateway routes "
            f"{model} here",
        )
    return _condition(
        MODEL_NAME_CONDITION,
        False,
        "ModelNameTaken",
        f"the model name {state.name!r} is served by {state.owner}, created earlier: the gateway "
        f"routes {model} there, not here. This endpoint still serves its Service and, through "
        f"the gateway, /v2/{name}.{namespace}/...; give it a name of its own in "
        f"spec.model.servedModelName, or it gets {state.name!r} when {state.owner} no longer "
        "declares it",
    )


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


def _authenticated_condition(ep: Endpoint) -> dict[str, Any]:
    api = ep.spec.api
    if api.api_keys_secret_ref is not None:
        ref = api.api_keys_secret_ref
        return _condition(
            "Authenticated",
            True,
            "APIKeys",
            f"requests need an API key from Secret {ref.name} (key {ref.key})",
        )
    ways = api.published_outside_cluster()
    if ways:
        return _condition(
            "Authenticated",
            False,
            "UnauthenticatedAllowed",
            f"published outside the cluster ({' and '.join(ways)}) without API keys, as "
            "spec.api.allowUnauthenticated allows: anyone who can reach it can use it",
        )
    return _condition(
        "Authenticated",
        False,
        "NoAPIKeys",
        f"spec.api.apiKeysSecretRef is not set: any client that can reach Service "
        f"{manifests.service_name(ep.name)} inside the cluster can use the endpoint without a key",
    )


def _authenticated_condition_or_last(
    ep: Endpoint | None, previous: Mapping[str, Any]
) -> dict[str, Any] | None:
    if ep is not None:
        return _authenticated_condition(ep)
    # An invalid spec: the last good workload keeps running, and so does its authentication.
    kept = _find(previous.get("conditions") or [], "Authenticated")
    if kept is None:
        return None
    return _condition("Authenticated", kept["status"] == "True", kept["reason"], kept["message"])


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
    gateway_url: str | None = None,
    inference_pool: InferencePoolState | None = None,
    model_name: ModelNameState | None = None,
    fit: Fit | None = None,
) -> dict[str, Any]:
    """The full `.status` (a merge-patch replaces it wholesale, conditions included).

    `endpoint` is None when the spec is invalid (`invalid_message` says why); children that a
    previous valid spec created keep running and are still reported.
    `previous` is the current status: transition times and fields this call cannot know
    (observedGeneration when not given, url of the last valid spec) carry over from it.
    `gateway_url` (the operator's LLMEP_OPERATOR_GATEWAY_URL): clients reach every endpoint
    through the gateway, so the status URL is the gateway's.
    `inference_pool`: what the last reconcile did about the InferencePool (None: not known since
    the operator started; the previous report stays).
    `model_name`: the served model name and whether an older endpoint keeps it (None: no
    ModelNameAvailable condition). It does not change Ready or the phase: the endpoint serves.
    `fit`: the last fit check (None: not checked since the operator started; the previous report
    stays). A model that does not fit and has no Deployment is Ready False, ModelDoesNotFit.
    """
    previous = previous or {}
    dep = observed.deployment
    spec_valid = (
        _condition("SpecValid", True, "Valid", "the spec is valid")
        if endpoint is not None
        else _condition("SpecValid", False, "InvalidSpec", invalid_message or "")
    )
    cache = _cache_condition(observed.cache)
    available = _available_condition(dep, observed.workload_problem)
    progressing = _progressing_condition(dep)
    fit_condition, fit_numbers = _fit_report(fit, previous)
    ready, phase = _ready_and_phase(endpoint, invalid_message, dep, cache, available, progressing)
    if endpoint is not None and observed.workload_problem is not None:
        problem = observed.workload_problem
        ready, phase = _condition("Ready", False, problem.reason, problem.message), "Pending"
    if endpoint is not None and dep is None and (fit_condition or {}).get("status") == "False":
        ready, phase = (
            _condition("Ready", False, "ModelDoesNotFit", fit_condition["message"]),
            "Failed",
        )
    conditions = [spec_valid, cache, available, progressing, ready]
    authenticated = _authenticated_condition_or_last(endpoint, previous)
    if authenticated is not None:
        conditions.append(authenticated)
    if model_name is not None:
        conditions.append(_model_name_condition(model_name, name, namespace))
    pool_condition, pool_name = _pool_report(inference_pool, previous)
    if pool_condition is not None:
        conditions.append(pool_condition)
    if fit_condition is not None:
        conditions.append(fit_condition)
    generation = (
        observed_generation
        if observed_generation is not None
        else previous.get("observedGeneration")
    )
    _stamp(conditions, previous, now, generation)

    status: dict[str, Any] = {
        "phase": phase,
        "replicas": dep.replicas if dep else 0,
        "readyReplicas": dep.ready if dep else 0,
        "availableReplicas": dep.available if dep else 0,
        "updatedReplicas": dep.updated if dep else 0,
        "desiredReplicas": dep.desired if dep else 0,
        "selector": _selector(name, endpoint, previous),
        "conditions": conditions,
    }
    group_block = _groups_block(endpoint, dep, observed.unready, previous, now)
    if group_block is not None:
        status["groups"] = group_block
    if generation is not None:
        status["observedGeneration"] = generation
    status.update(_addresses(endpoint, previous, cluster_domain, gateway_url))
    if pool_name is not None:
        status["inferencePool"] = pool_name
    if fit_numbers is not None:
        status["fit"] = dict(fit_numbers)
    return status


def _selector(name: str, endpoint: Endpoint | None, previous: Mapping[str, Any]) -> str:
    """The serving pods (a group's leaders), as the scale subresource publishes them."""
    if endpoint is not None:
        return manifests.selector_string(manifests.serving_selector(endpoint))
    return previous.get("selector") or manifests.selector_string(manifests.selector_labels(name))


def _groups_block(
    endpoint: Endpoint | None,
    dep: DeploymentState | None,
    unready: Sequence[groups.UnreadyPod],
    previous: Mapping[str, Any],
    now: str,
) -> dict[str, Any] | None:
    """status.groups of a multi-node endpoint: its size, groups ready and wanted, the pods that
    keep groups from being ready, and the last pod seen failing (kept: a failed pod's group is
    recreated with new pods, which no longer show what happened)."""
    if endpoint is None:
        return previous.get("groups")
    if not groups.multinode(endpoint):
        return None
    block: dict[str, Any] = {
        "name": groups.group_set_name(endpoint.name),
        "size": endpoint.spec.resources.nodes,
        "ready": dep.ready if dep else 0,
        "desired": dep.desired if dep else 0,
    }
    if unready:
        block["unready"] = [pod.as_status() for pod in unready]
    failed = next((p for p in unready if p.reason not in groups.NOT_FAILURES), None)
    last = (previous.get("groups") or {}).get("lastFailure")
    if failed is not None:
        seen = failed.as_status()
        unchanged = last and {k: v for k, v in last.items() if k != "time"} == seen
        last = last if unchanged else {"time": now, **seen}
    if last:
        block["lastFailure"] = last
    return block


def _available_condition(
    dep: DeploymentState | None, problem: WorkloadProblem | None = None
) -> dict[str, Any]:
    if problem is not None:
        return _condition("Available", False, problem.reason, problem.message)
    if dep is None:
        return _condition(
            "Available", False, "DeploymentNotFound", "the runtime Deployment does not exist yet"
        )
    if dep.desired == 0:
        message = "the endpoint has 0 replicas"
        if dep.scaled_to_zero_reason:
            # The gateway holds requests meanwhile and the next one scales it up again.
            message += (
                f" (autoscaler: {dep.scaled_to_zero_reason}); the next request or job starts one"
            )
        return _condition("Available", False, "ScaledToZero", message)
    if dep.available >= 1:
        return _condition(
            "Available",
            True,
            "ReplicasAvailable",
            f"{dep.available}/{dep.desired} {dep.unit} available",
        )
    return _condition(
        "Available",
        False,
        "NoReplicasAvailable",
        f"0/{dep.desired} {dep.unit} available (pods download and load the model before "
        "they report ready)",
    )


def _progressing_condition(dep: DeploymentState | None) -> dict[str, Any]:
    if dep is None:
        return _condition("Progressing", False, "DeploymentNotFound", "no rollout yet")
    if dep.deadline_exceeded_message is not None:
        return _condition(
            "Progressing", False, "ProgressDeadlineExceeded", dep.deadline_exceeded_message
        )
    if dep.replica_failure_message is not None:
        return _condition("Progressing", False, "ReplicaFailure", dep.replica_failure_message)
    if dep.group_failure_message is not None:
        return _condition("Progressing", False, "GroupFailing", dep.group_failure_message)
    if dep.rolling_out:
        return _condition(
            "Progressing",
            True,
            "RollingOut",
            f"{dep.updated}/{dep.desired} {dep.unit} updated, {dep.available} available",
        )
    if dep.available < dep.desired:
        # New replicas (a scale-up, or replacements) download and load the model first.
        return _condition(
            "Progressing",
            True,
            "ScalingUp",
            f"{dep.available}/{dep.desired} {dep.unit} available, the others are starting",
        )
    return _condition(
        "Progressing", False, "RolloutComplete", f"all {dep.desired} {dep.unit} are up to date"
    )


def _ready_and_phase(
    endpoint: Endpoint | None,
    invalid_message: str | None,
    dep: DeploymentState | None,
    cache: Mapping[str, Any],
    available: Mapping[str, Any],
    progressing: Mapping[str, Any],
) -> tuple[dict[str, Any], str]:
    """The Ready condition and the phase: the most important problem wins."""
    if endpoint is None:
        return _condition("Ready", False, "InvalidSpec", invalid_message or ""), "Failed"
    if available["status"] == "True":
        assert dep is not None
        ready = _condition("Ready", True, "Serving", available["message"])
        if dep.trouble is not None:
            return ready, "Degraded"
        if progressing["reason"] == "RollingOut":
            return ready, "Updating"
        if progressing["reason"] == "ScalingUp":
            return ready, "Scaling"
        return ready, "Ready"
    if dep is not None and dep.desired == 0:
        return _condition("Ready", False, "ScaledToZero", available["message"]), "ScaledToZero"
    if cache["status"] != "True":
        return _condition("Ready", False, "WaitingForCache", cache["message"]), "Pending"
    if dep is None:
        return _condition("Ready", False, "Creating", available["message"]), "Pending"
    if dep.trouble is not None:
        return _condition("Ready", False, progressing["reason"], progressing["message"]), "Failed"
    return _condition("Ready", False, "Starting", available["message"]), "Starting"


def _stamp(
    conditions: list[dict[str, Any]], previous: Mapping[str, Any], now: str, generation: int | None
) -> None:
    """Keep lastTransitionTime when a condition's status did not change (Kubernetes convention)."""
    before = {c.get("type"): c for c in previous.get("conditions") or []}
    for cond in conditions:
        old = before.get(cond["type"])
        same = old is not None and old.get("status") == cond["status"]
        cond["lastTransitionTime"] = old.get("lastTransitionTime", now) if same else now
        if generation is not None:
            cond["observedGeneration"] = generation


def _addresses(
    endpoint: Endpoint | None,
    previous: Mapping[str, Any],
    cluster_domain: str,
    gateway_url: str | None,
) -> dict[str, Any]:
    """url, servedModelName, ingressUrl; of the last valid spec while the spec is invalid (the
    still-running last good workload answers there). With a gateway the url is the gateway's."""
    if endpoint is None:
        return {k: previous[k] for k in ("url", "servedModelName", "ingressUrl") if k in previous}
    out = {
        "url": gateway_url.rstrip("/") if gateway_url else endpoint_url(endpoint, cluster_domain),
        "servedModelName": endpoint.served_model_name,
    }
    ing = ingress_url(endpoint)
    if ing is not None:
        out["ingressUrl"] = ing
    return out


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
    """Kubernetes Events for the notable transitions between two statuses.

    Invalid specs are reported by the reconcile itself (it knows when a spec changed)."""
    return (
        _authentication_events(previous, current)
        + _model_name_events(previous, current)
        + _pool_events(previous, current)
        + _workload_events(previous, current)
        + _fit_events(previous, current)
        + _phase_events(previous, current)
    )


WORKLOAD_PROBLEMS = ("LeaderWorkerSetNotInstalled", "LeaderWorkerSetForbidden")


def _workload_events(previous: Mapping[str, Any] | None, current: Mapping[str, Any]) -> list[Event]:
    """A Warning when the workload cannot be written (its API missing, or forbidden)."""
    was = _find((previous or {}).get("conditions") or [], "Ready") or {}
    now = _find(current.get("conditions") or [], "Ready") or {}
    if now.get("reason") in WORKLOAD_PROBLEMS and was.get("reason") != now.get("reason"):
        return [Event("Warning", str(now["reason"]), str(now.get("message", "")))]
    return []


def _fit_events(previous: Mapping[str, Any] | None, current: Mapping[str, Any]) -> list[Event]:
    """A Warning when the model does not fit (again, or for a new reason); a Normal Event when
    it fits after it did not."""
    return _lost_and_regained(previous, current, FIT_CONDITION, "ModelDoesNotFit", "ModelFits")


def _pool_events(previous: Mapping[str, Any] | None, current: Mapping[str, Any]) -> list[Event]:
    """A Warning when the InferencePool cannot be written; a Normal Event when it is."""
    was = _find((previous or {}).get("conditions") or [], POOL_CONDITION) or {}
    now = _find(current.get("conditions") or [], POOL_CONDITION)
    if now is None or (was.get("status"), was.get("reason")) == (now["status"], now["reason"]):
        return []
    if now["status"] == "True":
        return [Event("Normal", "InferencePoolCreated", str(now["message"]))]
    return [Event("Warning", f"InferencePool{now['reason']}", str(now["message"]))]


def _model_name_events(
    previous: Mapping[str, Any] | None, current: Mapping[str, Any]
) -> list[Event]:
    """A Warning naming the owner when the served model name is (or goes to) another endpoint,
    once per owner: the status compared is the stored one, so resyncs and operator restarts
    post nothing new. A Normal Event when the name comes back."""
    return _lost_and_regained(
        previous, current, MODEL_NAME_CONDITION, "ModelNameTaken", "ModelNameAvailable"
    )


def _lost_and_regained(
    previous: Mapping[str, Any] | None,
    current: Mapping[str, Any],
    condition: str,
    warning: str,
    recovered: str,
) -> list[Event]:
    """A Warning when `condition` turns False or says something new while False; a Normal Event
    when it turns True again."""
    was = _find((previous or {}).get("conditions") or [], condition) or {}
    now = _find(current.get("conditions") or [], condition)
    if now is None:
        return []
    if now["status"] == "False" and (was.get("status"), was.get("message")) != (
        "False",
        now["message"],
    ):
        return [Event("Warning", warning, str(now["message"]))]
    if now["status"] == "True" and was.get("status") == "False":
        return [Event("Normal", recovered, str(now["message"]))]
    return []


def _authentication_events(
    previous: Mapping[str, Any] | None, current: Mapping[str, Any]
) -> list[Event]:
    """A Warning when the endpoint starts accepting requests without a key."""
    was = _find((previous or {}).get("conditions") or [], "Authenticated") or {}
    now = _find(current.get("conditions") or [], "Authenticated") or {}
    if now.get("status") == "False" and was.get("status") != "False":
        return [Event("Warning", "Unauthenticated", str(now.get("message", "")))]
    return []


def _phase_events(previous: Mapping[str, Any] | None, current: Mapping[str, Any]) -> list[Event]:
    """Events for the notable phase transitions."""
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
    if after == "Failed" and (ready or {}).get("reason") not in ("InvalidSpec", "ModelDoesNotFit"):
        return [Event("Warning", "RolloutFailed", (progressing or {}).get("message", message))]
    if after == "ScaledToZero":
        return [Event("Normal", "ScaledToZero", message or "the endpoint has no replicas")]
    if after == "Updating" and before == "Ready":
        return [Event("Normal", "RollingOut", (progressing or {}).get("message", ""))]
    return []


def _trouble(current: Mapping[str, Any]) -> str:
    progressing = _find(current.get("conditions") or [], "Progressing") or {}
    return str(progressing.get("message", ""))


def _find(conditions: Sequence[Mapping[str, Any]], type_: str) -> Mapping[str, Any] | None:
    return next((c for c in conditions if c.get("type") == type_), None)
