"""Status computation: children's state -> conditions, phase, url; and transition events."""

from __future__ import annotations

from typing import Any

import pytest
from llmendpoints_operator import status
from llmendpoints_operator.spec import parse
from llmendpoints_operator.status import CacheState, DeploymentState, Observed

T0, T1 = "2026-01-01T00:00:00Z", "2026-01-01T00:05:00Z"


def _ep(spec: dict[str, Any] | None = None):
    return parse("demo", "team", spec or {"model": {"name": "org/m"}})


def _compute(
    deployment: DeploymentState | None,
    cache: CacheState | None = None,
    previous: dict[str, Any] | None = None,
    now: str = T0,
    **kwargs: Any,
) -> dict[str, Any]:
    kwargs.setdefault("endpoint", _ep())
    kwargs.setdefault("invalid_message", None)
    return status.compute(
        name="demo",
        namespace="team",
        observed=Observed(deployment=deployment, cache=cache or CacheState()),
        previous=previous,
        now=now,
        **kwargs,
    )


def _conditions(st: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in st["conditions"]}


def _deployment(desired: int = 1, **status_fields: Any) -> DeploymentState:
    return DeploymentState.from_object({"spec": {"replicas": desired}, "status": status_fields})


QUOTA_FAILURE = {
    "type": "ReplicaFailure",
    "status": "True",
    "reason": "FailedCreate",
    "message": 'pods "demo-7d9" is forbidden: exceeded quota: gpu, requested: nvidia.com/gpu=1',
}
AVAILABLE = {"replicas": 1, "readyReplicas": 1, "availableReplicas": 1, "updatedReplicas": 1}


def test_golden_ready_status() -> None:
    st = _compute(_deployment(1, **AVAILABLE), observed_generation=4)
    stamp = {"lastTransitionTime": T0, "observedGeneration": 4}
    assert st == {
        "phase": "Ready",
        "replicas": 1,
        "readyReplicas": 1,
        "availableReplicas": 1,
        "updatedReplicas": 1,
        "desiredReplicas": 1,
        "selector": "llmendpoints.dev/endpoint=demo",
        "conditions": [
            {
                "type": "SpecValid",
                "status": "True",
                "reason": "Valid",
                "message": "the spec is valid",
                **stamp,
            },
            {
                "type": "CacheReady",
                "status": "True",
                "reason": "NoSharedCache",
                "message": "spec.cache is not set: every pod downloads the model into its own scratch volume",
                **stamp,
            },
            {
                "type": "Available",
                "status": "True",
                "reason": "ReplicasAvailable",
                "message": "1/1 replicas available",
                **stamp,
            },
            {
                "type": "Progressing",
                "status": "False",
                "reason": "RolloutComplete",
                "message": "all 1 replicas are up to date",
                **stamp,
            },
            {
                "type": "Ready",
                "status": "True",
                "reason": "Serving",
                "message": "1/1 replicas available",
                **stamp,
            },
            {
                "type": "Authenticated",
                "status": "False",
                "reason": "NoAPIKeys",
                "message": "spec.api.apiKeysSecretRef is not set: any client that can reach "
                "Service demo inside the cluster can use the endpoint without a key",
                **stamp,
            },
        ],
        "observedGeneration": 4,
        "url": "http://demo.team.svc.cluster.local",
        "servedModelName": "demo",
    }


@pytest.mark.parametrize(
    ("deployment", "cache", "phase", "ready_reason"),
    [
        (None, CacheState(), "Pending", "Creating"),
        (_deployment(1), CacheState(), "Starting", "Starting"),
        (_deployment(1), CacheState("c", "Pending"), "Pending", "WaitingForCache"),
        (_deployment(1), CacheState("c", None, existing=True), "Pending", "WaitingForCache"),
        (_deployment(1, **AVAILABLE), CacheState("c", "Bound"), "Ready", "Serving"),
        (_deployment(0), CacheState(), "ScaledToZero", "ScaledToZero"),
        # 2 wanted, 1 serving, nothing rolling out: the other one is starting (a scale-up).
        (
            _deployment(2, replicas=2, readyReplicas=1, availableReplicas=1, updatedReplicas=2),
            CacheState(),
            "Scaling",
            "Serving",
        ),
        # ...and when the Deployment controller says pods cannot be created, it is degraded.
        (
            _deployment(
                2, replicas=1, availableReplicas=1, updatedReplicas=1, conditions=[QUOTA_FAILURE]
            ),
            CacheState(),
            "Degraded",
            "Serving",
        ),
        (_deployment(1, conditions=[QUOTA_FAILURE]), CacheState(), "Failed", "ReplicaFailure"),
        # A rollout while the old replica still serves.
        (
            _deployment(1, replicas=2, readyReplicas=1, availableReplicas=1, updatedReplicas=1),
            CacheState(),
            "Updating",
            "Serving",
        ),
        (
            DeploymentState.from_object(
                {
                    "spec": {"replicas": 1},
                    "status": {
                        "conditions": [
                            {
                                "type": "Progressing",
                                "status": "False",
                                "reason": "ProgressDeadlineExceeded",
                                "message": "stuck",
                            }
                        ]
                    },
                }
            ),
            CacheState(),
            "Failed",
            "ProgressDeadlineExceeded",
        ),
    ],
)
def test_phase_and_ready_reason(
    deployment: DeploymentState | None, cache: CacheState, phase: str, ready_reason: str
) -> None:
    st = _compute(deployment, cache)
    assert (st["phase"], _conditions(st)["Ready"][1]) == (phase, ready_reason)
    assert _conditions(st)["Ready"][0] == (
        "True" if phase in {"Ready", "Updating", "Scaling", "Degraded"} else "False"
    )


def test_deployment_without_replicas_field_defaults_to_one() -> None:
    assert DeploymentState.from_object({"spec": {}}).desired == 1


def test_a_newer_deployment_generation_is_a_rollout() -> None:
    state = DeploymentState.from_object(
        {
            "metadata": {"generation": 3},
            "spec": {"replicas": 1},
            "status": {**AVAILABLE, "observedGeneration": 2},
        }
    )
    assert state.rolling_out
    assert _compute(state)["phase"] == "Updating"


def test_invalid_spec_keeps_reporting_the_running_workload() -> None:
    previous = _compute(_deployment(1, **AVAILABLE), observed_generation=1)
    st = _compute(
        _deployment(1, **AVAILABLE),
        previous=previous,
        endpoint=None,
        invalid_message="spec.scaling.minReplicas: must not exceed maxReplicas (3 > 2)",
        observed_generation=2,
    )
    conditions = _conditions(st)
    assert st["phase"] == "Failed"
    assert conditions["Ready"] == ("False", "InvalidSpec")
    assert conditions["Available"] == ("True", "ReplicasAvailable")
    ready = next(c for c in st["conditions"] if c["type"] == "Ready")
    assert ready["message"].startswith("spec.scaling.minReplicas")
    assert st["url"] == previous["url"]  # where the last good workload still answers
    assert st["observedGeneration"] == 2


def test_transition_times_only_move_when_a_condition_flips() -> None:
    first = _compute(_deployment(1), observed_generation=1)
    second = _compute(_deployment(1, **AVAILABLE), previous=first, now=T1)
    times = {c["type"]: c["lastTransitionTime"] for c in second["conditions"]}
    assert times["SpecValid"] == T0 and times["CacheReady"] == T0
    assert times["Available"] == T1 and times["Ready"] == T1
    assert second["observedGeneration"] == 1  # carried over when not given
    assert status.without_times(
        _compute(_deployment(1), previous=first, now=T1)
    ) == status.without_times(first)


def test_ingress_url() -> None:
    ep = _ep(
        {
            "model": {"name": "m"},
            "api": {
                "ingress": {
                    "enabled": True,
                    "host": "a.example.com",
                    "path": "/llm/",
                    "tls": {"secretName": "t"},
                },
                "apiKeysSecretRef": {"name": "keys", "key": "k"},
            },
        }
    )
    assert _compute(None, endpoint=ep)["ingressUrl"] == "https://a.example.com/llm"
    ep = _ep({"model": {"name": "m"}, "api": {"service": {"port": 8000}}})
    assert _compute(None, endpoint=ep)["url"] == "http://demo.team.svc.cluster.local:8000"


def test_with_the_gateway_installed_the_status_url_is_the_gateways() -> None:
    url = _compute(None, gateway_url="http://llmendpoints-gateway.llmendpoints.svc:8080/")["url"]
    assert url == "http://llmendpoints-gateway.llmendpoints.svc:8080"


def test_cache_state_for_created_and_existing_claims() -> None:
    created = _ep({"model": {"name": "m"}, "cache": {"size": "1Gi"}})
    assert status.cache_state_for(created, {"demo-model-cache": "Bound"}) == CacheState(
        "demo-model-cache", "Bound"
    )
    existing = _ep({"model": {"name": "m"}, "cache": {"existingClaim": "shared"}})
    assert status.cache_state_for(existing, {}) == CacheState("shared", None, existing=True)
    st = _compute(_deployment(1), status.cache_state_for(existing, {}))
    cache = next(c for c in st["conditions"] if c["type"] == "CacheReady")
    assert cache["reason"] == "ClaimNotFound" and "spec.cache.existingClaim" in cache["message"]


def _events(before: dict[str, Any] | None, after: dict[str, Any]) -> list[tuple[str, str]]:
    return [(e.type, e.reason) for e in status.transition_events(before, after)]


def test_transition_events() -> None:
    starting = _compute(_deployment(1))
    ready = _compute(_deployment(1, **AVAILABLE), previous=starting)
    updating = _compute(
        _deployment(1, replicas=2, readyReplicas=1, availableReplicas=1, updatedReplicas=1),
        previous=ready,
    )
    scaling = _compute(
        _deployment(2, replicas=2, readyReplicas=1, availableReplicas=1, updatedReplicas=2),
        previous=ready,
    )
    degraded = _compute(
        _deployment(
            2, replicas=1, availableReplicas=1, updatedReplicas=1, conditions=[QUOTA_FAILURE]
        ),
        previous=scaling,
    )
    # The endpoint has no keys: one warning when it first reports so, not at every transition.
    assert _events(None, starting) == [("Warning", "Unauthenticated")]
    assert _events(starting, ready) == [("Normal", "Ready")]
    assert _events(ready, ready) == []
    assert _events(ready, updating) == [("Normal", "RollingOut")]
    assert _events(updating, ready) == [("Normal", "RolledOut")]
    # A scale-up is the autoscaler's business (it posts its own events), not a degradation.
    assert _events(ready, scaling) == []
    assert _events(scaling, ready) == []
    assert _events(scaling, degraded) == [("Warning", "Degraded")]
    assert "exceeded quota" in status.transition_events(scaling, degraded)[0].message
    invalid = _compute(_deployment(1), endpoint=None, invalid_message="spec.x: bad")
    assert _events(ready, invalid) == []  # the reconcile reports invalid specs itself
    assert (
        "serving at http://demo.team.svc.cluster.local"
        in status.transition_events(starting, ready)[0].message
    )


KEYS = {"apiKeysSecretRef": {"name": "keys", "key": "api-keys"}}


@pytest.mark.parametrize(
    ("api", "condition"),
    [
        (KEYS, ("True", "APIKeys")),
        ({**KEYS, "service": {"type": "LoadBalancer"}}, ("True", "APIKeys")),
        ({}, ("False", "NoAPIKeys")),
        (
            {"service": {"type": "LoadBalancer"}, "allowUnauthenticated": True},
            ("False", "UnauthenticatedAllowed"),
        ),
    ],
)
def test_authenticated_condition_says_who_can_use_the_endpoint(
    api: dict[str, Any], condition: tuple[str, str]
) -> None:
    st = _compute(_deployment(1, **AVAILABLE), endpoint=_ep({"model": {"name": "m"}, "api": api}))
    assert _conditions(st)["Authenticated"] == condition
    assert _conditions(st)["Ready"] == ("True", "Serving")  # a warning, not an outage


def test_authentication_messages_name_the_exposure() -> None:
    in_cluster = _compute(None, endpoint=_ep())
    (cond,) = [c for c in in_cluster["conditions"] if c["type"] == "Authenticated"]
    assert "apiKeysSecretRef" in cond["message"] and "Service demo" in cond["message"]
    published = _compute(
        None,
        endpoint=_ep(
            {
                "model": {"name": "m"},
                "api": {"service": {"type": "NodePort"}, "allowUnauthenticated": True},
            }
        ),
    )
    (cond,) = [c for c in published["conditions"] if c["type"] == "Authenticated"]
    assert "service.type NodePort" in cond["message"]
    assert "allowUnauthenticated" in cond["message"]


def test_unauthenticated_warning_is_posted_when_keys_go_away_only() -> None:
    keyed = _compute(
        _deployment(1, **AVAILABLE), endpoint=_ep({"model": {"name": "m"}, "api": KEYS})
    )
    assert _events(None, keyed) == [("Normal", "Ready")]
    keyless = _compute(_deployment(1, **AVAILABLE), previous=keyed)
    assert _events(keyed, keyless) == [("Warning", "Unauthenticated")]
    assert _events(keyless, _compute(_deployment(1, **AVAILABLE), previous=keyless)) == []
    assert _events(keyless, keyed) == []


def test_an_invalid_spec_keeps_reporting_the_running_workloads_authentication() -> None:
    keyless = _compute(_deployment(1, **AVAILABLE))
    invalid = _compute(
        _deployment(1, **AVAILABLE), endpoint=None, invalid_message="spec.x: bad", previous=keyless
    )
    assert _conditions(invalid)["Authenticated"] == ("False", "NoAPIKeys")
    fresh_invalid = _compute(None, endpoint=None, invalid_message="spec.x: bad")
    assert "Authenticated" not in _conditions(fresh_invalid)


def test_scaled_to_zero_says_why_from_the_autoscalers_annotation() -> None:
    why = "scale down 1->0: idle for 300 s (scaleToZeroAfterSeconds 300)"
    zero = DeploymentState.from_object(
        {
            "metadata": {"annotations": {"llmendpoints.dev/scaled-to-zero": why}},
            "spec": {"replicas": 0},
            "status": {},
        }
    )
    st = _compute(zero)
    ready = next(c for c in st["conditions"] if c["type"] == "Ready")
    assert (st["phase"], ready["reason"]) == ("ScaledToZero", "ScaledToZero")
    assert f"(autoscaler: {why}); the next request or job starts one" in ready["message"]
    authenticated = [c for c in st["conditions"] if c["type"] == "Authenticated"]
    (event,) = status.transition_events({"phase": "Ready", "conditions": authenticated}, st)
    assert (event.reason, event.message) == ("ScaledToZero", ready["message"])


def test_a_taken_model_name_is_warned_once_per_owner_and_changes_nothing_else() -> None:
    def with_owner(owner: str | None, previous: dict[str, Any] | None = None) -> dict[str, Any]:
        return _compute(
            _deployment(1, **AVAILABLE),
            previous=previous,
            model_name=status.ModelNameState("llama", owner),
        )

    ours = with_owner(None)
    taken = with_owner("team-a/chat", ours)
    assert _conditions(taken)["ModelNameAvailable"] == ("False", "ModelNameTaken")
    assert (taken["phase"], _conditions(taken)["Ready"]) == (ours["phase"], ("True", "Serving"))
    assert _events(ours, taken) == [("Warning", "ModelNameTaken")]
    assert _events(taken, with_owner("team-a/chat", taken)) == []  # a resync: nothing new
    assert _events(taken, with_owner("team-b/older", taken)) == [("Warning", "ModelNameTaken")]
    assert _events(taken, with_owner(None, taken)) == [("Normal", "ModelNameAvailable")]
    assert _events(ours, with_owner(None, ours)) == []


# --- multi-node endpoints: replicas are LeaderWorkerSet groups -----------------------------------

GROUPS_SPEC = {"model": {"name": "org/m"}, "resources": {"gpus": 8, "nodes": 2}}


def _groups(desired: int = 2, **status_fields: Any) -> DeploymentState:
    return DeploymentState.from_leader_worker_set(
        {
            "kind": "LeaderWorkerSet",
            "metadata": {"generation": 3},
            "spec": {"replicas": desired, "leaderWorkerTemplate": {"size": 2}},
            "status": {"observedGeneration": 3, **status_fields},
        }
    )


def test_a_leader_worker_set_counts_groups() -> None:
    state = _groups(2, replicas=2, readyReplicas=1, updatedReplicas=2)
    assert (state.desired, state.replicas, state.ready, state.available, state.updated) == (
        2,
        2,
        1,
        1,
        2,
    )
    assert (state.group_size, state.unit) == (2, "groups")
    assert status.workload_state({"kind": "LeaderWorkerSet", "spec": {}}).group_size == 1
    st = _compute(state, endpoint=_ep(GROUPS_SPEC))
    available = next(c for c in st["conditions"] if c["type"] == "Available")
    assert available["message"] == "1/2 groups available"
    assert st["phase"] == "Scaling"  # one group still starting
    assert st["groups"] == {"name": "demo-group", "size": 2, "ready": 1, "desired": 2}
    assert st["selector"] == (
        "llmendpoints.dev/endpoint=demo,leaderworkerset.sigs.k8s.io/worker-index=0"
    )
    # A single-node endpoint has no groups block and selects every pod.
    single = _compute(_deployment(1, **AVAILABLE))
    assert "groups" not in single and single["selector"] == "llmendpoints.dev/endpoint=demo"


def test_a_missing_leader_worker_set_api_is_the_ready_reason_and_a_warning() -> None:
    problem = status.groups_api_missing(2)
    st = status.compute(
        name="demo",
        namespace="team",
        endpoint=_ep(GROUPS_SPEC),
        invalid_message=None,
        observed=Observed(deployment=None, cache=CacheState(), workload_problem=problem),
        previous=None,
        now=T0,
    )
    conditions = _conditions(st)
    assert conditions["Ready"] == ("False", "LeaderWorkerSetNotInstalled")
    assert conditions["Available"] == ("False", "LeaderWorkerSetNotInstalled")
    assert st["phase"] == "Pending"
    events = status.transition_events(None, st)
    assert [(e.type, e.reason) for e in events] == [
        ("Warning", "Unauthenticated"),
        ("Warning", "LeaderWorkerSetNotInstalled"),
    ]
    assert status.transition_events(st, st) == []  # once
