"""What a decision leaves behind in `status.autoscaling`. Pure. (The Event of a scale change is
the decision's own action and reason, posted by controller.Autoscaler.tick.)

`status.autoscaling` (documented in docs/autoscaling.md):
- `desiredReplicas`, `lastTickTime`, `reason`: the latest tick (every tick, also when holding);
- `signals`: what that tick measured (totals over the ready pods, window averages, counts);
- `lastDecisions`: the last scale changes, newest first, at most MAX_DECISIONS, each with time,
  from, to, reason and the signals it saw;
- `scaledToZero`: while the endpoint is at zero replicas by the autoscaler's choice, when and why;
- `coldStart`: the last scale-up from zero, and (once there) when its first replica was ready;
- `state`: the decision history (windows), so that an operator restart resumes it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

from .decision import Decision, History, load_history

MAX_DECISIONS = 10
# On the Deployment, written with `replicas: 0` (removed with the next scale-up): why it is at
# zero, so that the endpoint's status says it with the very event that reports 0 replicas.
SCALED_TO_ZERO_ANNOTATION = "llmendpoints.dev/scaled-to-zero"


def rfc3339(now: float) -> str:
    return datetime.fromtimestamp(now, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _parse_time(value: Any) -> float | None:
    try:
        return datetime.strptime(str(value), "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp()
    except ValueError:
        return None


@dataclass(frozen=True)
class ColdStart:
    """A scale-up from zero: decided at, first replica ready at (None: still starting)."""

    decided_at: float
    ready_at: float | None = None

    @property
    def seconds(self) -> float | None:
        return None if self.ready_at is None else max(0.0, self.ready_at - self.decided_at)

    def ready(self, now: float) -> ColdStart:
        return replace(self, ready_at=now)

    def to_status(self) -> dict[str, Any]:
        out: dict[str, Any] = {"decidedTime": rfc3339(self.decided_at)}
        if self.ready_at is not None:
            out["readyTime"] = rfc3339(self.ready_at)
            out["seconds"] = round(self.seconds or 0.0, 1)
        return out

    @classmethod
    def from_status(cls, block: Mapping[str, Any] | None) -> ColdStart | None:
        raw = (block or {}).get("coldStart") or {}
        decided = _parse_time(raw.get("decidedTime"))
        if decided is None:
            return None
        return cls(decided, _parse_time(raw.get("readyTime")) if "readyTime" in raw else None)


def event_reason(decision: Decision) -> str:
    """The Event's reason: ScaleUp / ScaleDown, or ScaleFromZero / ScaleToZero."""
    if decision.from_zero:
        return "ScaleFromZero"
    if decision.to_zero:
        return "ScaleToZero"
    return decision.action


def history_from_status(status: Mapping[str, Any] | None) -> History:
    """The decision history kept in `status.autoscaling.state` (empty if absent or unreadable:
    the decision then holds scale-down until it has observed a whole window again)."""
    autoscaling = (status or {}).get("autoscaling") or {}
    return load_history(autoscaling.get("state"))


def status_block(
    previous: Mapping[str, Any] | None,
    before: int,
    decision: Decision,
    now: float,
    cold_start: ColdStart | None = None,
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
    block: dict[str, Any] = {
        "desiredReplicas": decision.replicas,
        "lastTickTime": rfc3339(now),
        "reason": decision.reason,
        "burst": decision.burst,
        "signals": signals,
        "lastDecisions": decisions[:MAX_DECISIONS],
        "state": decision.history.to_json(),
    }
    if decision.to_zero:
        block["scaledToZero"] = {"time": rfc3339(now), "reason": decision.reason}
    elif decision.replicas == 0 and (previous or {}).get("scaledToZero"):
        block["scaledToZero"] = previous["scaledToZero"]  # type: ignore[index]
    if cold_start is not None:
        block["coldStart"] = cold_start.to_status()
    return block


def _num(value: float) -> float | int:
    """Integers stay integers in status; other values keep 3 decimals."""
    return int(value) if float(value).is_integer() else round(value, 3)
