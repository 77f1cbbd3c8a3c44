"""The gateway routes a served model name to one endpoint; the operator tells every other endpoint
declaring it (condition ModelNameAvailable). Both read the same LLMEndpoint objects, in whatever
order their watches deliver them: they must name the same owner for every model, or an author
would be told "yours" while the gateway routes elsewhere. The gateway and the operator never
import each other; only this test sees both.
"""

from __future__ import annotations

from typing import Any

from llmendpoints_gateway.discovery.kube import endpoint_view
from llmendpoints_gateway.metrics import GatewayMetrics
from llmendpoints_gateway.registry import Registry
from llmendpoints_operator import handlers
from llmendpoints_operator.config import OperatorSettings
from llmendpoints_operator.reconcile import Indexes, Reconciler, snapshot


def _endpoint(namespace: str, name: str, created: str | None, served: str | None = None) -> Any:
    meta = {"namespace": namespace, "name": name}
    if created is not None:
        meta["creationTimestamp"] = created
    model = {"name": "org/m", **({"servedModelName": served} if served else {})}
    return {"apiVersion": "llmendpoints.dev/v1alpha1", "kind": "LLMEndpoint",
            "metadata": meta, "spec": {"model": model}}  # fmt: skip


OBJECTS = [
    _endpoint("team-a", "chat", "2026-01-01T10:00:00Z", "llama"),
    _endpoint("team-c", "aaa", "2026-01-01T09:59:59Z", "llama"),
    _endpoint("team-b", "chat", "2026-01-01T09:59:59Z", "llama"),  # same second: by id
    _endpoint("team-a", "alpha", None, "llama"),  # age unknown: never the owner
    _endpoint("team-d", "mistral", "2026-01-01T12:00:00Z"),  # serves its own name...
    _endpoint("team-e", "x", "2026-01-01T11:00:00Z", "mistral"),  # ...declared earlier here
    _endpoint("team-f", "solo", None),
]
OWNERS = {"llama": "team-b/chat", "mistral": "team-e/x", "solo": "team-f/solo"}


def _gateway(seen: list[Any]) -> dict[str, str]:
    registry = Registry(GatewayMetrics(), hold_queue_length=1, load_factor=1.25)
    for obj in seen:
        view = endpoint_view(obj)
        registry.upsert(
            view.name, view.models, view.routing, namespace=view.namespace, created=view.created
        )
    return {model: ep.id for model in OWNERS if (ep := registry.by_model(model)) is not None}


async def _operator(seen: list[Any]) -> dict[str, str]:
    """Each endpoint's ModelNameAvailable verdict, from kopf's index as handlers.py builds it."""
    claims: dict[str, list[Any]] = {}
    endpoints: dict[Any, list[Any]] = {}
    for obj in seen:
        meta = obj["metadata"]
        indexed = await handlers.model_claims(
            namespace=meta["namespace"], name=meta["name"], body=obj
        )
        for model, claim in indexed.items():
            claims.setdefault(model, []).append(claim)
        endpoints[(meta["namespace"], meta["name"])] = [snapshot(obj)]
    reconciler = Reconciler(
        kube=lambda: None,  # type: ignore[arg-type,return-value]
        indexes=Indexes(
            llmendpoints=endpoints,
            runtime_deployments={},
            claim_phases={},
            claim_users={},
            model_claims=claims,
        ),
        settings=OperatorSettings(),
        post_event=lambda *_: None,
    )
    owners: dict[str, str] = {}
    for obj in seen:
        state = reconciler.model_name(snapshot(obj))
        me = f"{obj['metadata']['namespace']}/{obj['metadata']['name']}"
        if state.owner is None:
            assert owners.setdefault(state.name, me) == me, f"two owners of {state.name}"
        else:
            assert owners.setdefault(state.name, state.owner) == state.owner
    return owners


async def test_the_gateway_and_the_operator_name_the_same_owner_in_any_order() -> None:
    orders = [OBJECTS[i:] + OBJECTS[:i] for i in range(len(OBJECTS))]
    orders += [list(reversed(order)) for order in orders]
    for seen in orders:
        assert _gateway(seen) == OWNERS
        assert await _operator(seen) == OWNERS
