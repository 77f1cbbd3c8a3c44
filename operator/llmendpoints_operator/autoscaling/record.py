"""What a decision leaves behind: the `status.autoscaling` block and the Event. Pure.

`status.autoscaling` (documented in docs/autoscaling.md):
- `desiredReplicas`, `lastTickTime`, `reason`: the latest tick (every tick, also when holding);
- `signals`: what that tick measured (totals over the ready pods, window averages, counts);
- `lastDecisions`: the last scale changes, newest first, at most MAX_DECISIONS, each with time,
  from, to, reason and the signals it saw;
- `state`: the decision history (windows), so that an operator restart resumes it.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from .decision import Decision, History, load_history

MAX_DECISIONS = 10


def rfc3339(now: float) -> str:
    return datetime.fromtimestamp(now, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def history_from_status(status: Mapping[str, Any] | None) -> History:
    """The decision history kept in `status.autoscaling.state` (empty if absent or unreadable:
    the decision then holds scale-down until it has observed a whole window again)."""
    autoscaling = (status or {}).get("autoscaling") or {}
    return load_history(autoscaling.get("state"))


def status_block(
    previous: Mapping[str, Any] | None, before: int, decision: Decision, now: float
) -> dict[str, Any]:
    """The new `status.autoscaling`, from the previous one and this tick's decision."""
    signals = {name: _num(value) for name, value in decision.signals.items()}
    decisions = list((previous or {}).get("lastDecisions") or [])
    if decision.replicas != before:
        entry = {
            "time": rfc3339(now),
            "from": before,
            "to": decision.replicas,
            "reason": decision.reason,
            "signals": signals,
        }
        decisions = [entry, *decisions]
    return {
        "desiredReplicas": decision.replicas,
        "lastTickTime": rfc3339(now),
        "reason": decision.reason,
        "burst": decision.burst,
        "signals": signals,
        "lastDecisions": decisions[:MAX_DECISIONS],
        "state": decision.history.to_json(),
    }


def event_for(before: int, decision: Decision) -> tuple[str, str] | None:
    """(reason, message) of the Kubernetes Event for a scale change; None when holding."""
    if decision.replicas == before:
        return None
    return decision.action, decision.reason


def _num(value: float) -> float | int:
    """Integers stay integers in status; other values keep 3 decimals."""
    return int(value) if float(value).is_integer() else round(value, 3)
