"""Which endpoint a served model name belongs to: one rule for the gateway and the operator.

A client of the gateway names a model (``"model": "llama"``), not an endpoint, so two endpoints
declaring the same served model name cannot both have it: the oldest one keeps it. The gateway
routes the name by this rule (registry.py) and the operator reports it on the endpoints that
lose (condition ``ModelNameAvailable``, status.py), so the two must never disagree: both read
the name with ``served_model_name`` and order the claimants with ``claim_order``.

- The served name is ``spec.model.servedModelName``, else the LLMEndpoint's name.
- The oldest claimant is the one created first (``metadata.creationTimestamp``). A claimant whose
  creation time is unknown (absent or unreadable: an API server always sets it, only emulators
  and hand-made objects lack it) counts as the newest: it cannot take a name from one whose age
  is known. Ties (timestamps have one-second resolution) go to the smaller ``"<namespace>/<name>"``,
  never to the order a process happened to see them in, which differs between gateway replicas
  and the operator.

Pure: no I/O.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any


def served_model_name(name: str, spec: Mapping[str, Any] | None) -> str:
    """The OpenAI ``model`` value an LLMEndpoint named ``name`` with this (raw) spec serves.

    Read leniently (an invalid spec is still routed by the gateway, and still claims its name):
    anything but a non-empty string in ``spec.model.servedModelName`` means the name."""
    model = spec.get("model") if isinstance(spec, Mapping) else None
    served = model.get("servedModelName") if isinstance(model, Mapping) else None
    return served if isinstance(served, str) and served else name


def creation_time(text: object) -> float | None:
    """``metadata.creationTimestamp`` (RFC 3339) as epoch seconds; None when absent or unreadable."""
    if not isinstance(text, str):
        return None
    try:
        moment = datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    if moment.tzinfo is None:  # the API server writes UTC; never read it as local time
        moment = moment.replace(tzinfo=datetime.UTC)
    return moment.timestamp()


def claim_order(created: float | None, endpoint_id: str) -> tuple[bool, float, str]:
    """Sort key of a claim to a model name: the first in this order keeps the name.

    ``created``: the endpoint's creation time (epoch seconds), None when unknown (last);
    ``endpoint_id``: ``"<namespace>/<name>"``, the tie-breaker."""
    return (created is None, created if created is not None else 0.0, endpoint_id)


@dataclass(frozen=True)
class Claim:
    """One endpoint declaring a served model name."""

    namespace: str
    name: str
    created: float | None  # creation_time(metadata.creationTimestamp)

    @property
    def id(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def order(self) -> tuple[bool, float, str]:
        return claim_order(self.created, self.id)


def owner(claims: Iterable[Claim]) -> Claim | None:
    """The claim that keeps the name (None for no claims)."""
    return min(claims, key=lambda claim: claim.order, default=None)
