"""Scaling from zero and to zero (rules 6 and 7 of decision.py). Pure."""

from __future__ import annotations

from dataclasses import replace

from .model import Current, Decision, History, ceil, finish, fmt, outside_words
from .policy import ScalingPolicy


def from_zero(
    history: History, current: Current, policy: ScalingPolicy, now: float, signals: dict
) -> Decision:
    """6. No replica: any held request or queued job (of either priority) brings one up, or
    as many as the held and queued work needs once a replica's capacity is known."""
    outside = current.observation.outside
    # Nothing to average at zero: the windows restart with the first ready replica.
    kept = History(capacity=history.capacity)
    lower = max(policy.min_replicas, 0)
    if outside is None:
        why = "scaled to zero; held requests and queued jobs could not be read"
        return finish(0, lower, policy, why, kept, signals, burst=False, allow_zero=True)
    if not outside.any:
        why = "scaled to zero: nothing held, queued or running"
        return finish(0, lower, policy, why, kept, signals, burst=False, allow_zero=True)
    target = policy.target_queue_depth
    if history.capacity:
        demand = outside.queue / (history.capacity + target)
        words = (
            f"demand {fmt(outside.queue)} waiting / ({fmt(history.capacity)} running + "
            f"{target:g} queued per replica) = {fmt(demand)}"
        )
    else:
        # What one replica runs is unknown until one has queued: queue / target would start
        # a replica per 2 waiting requests (20 for 40, when 5 may do). Start one; it learns
        # the capacity on its first busy tick and the burst rule adds the rest from there.
        demand = 1.0
        words = "one replica first (its capacity is not known yet)"
    wanted = max(1, ceil(demand))
    signals["demandReplicas"] = round(demand, 3)
    why = f"from zero: {outside_words(outside)}; {words}"
    return finish(0, wanted, policy, why, kept, signals, burst=False)


def to_zero_if_idle(
    decision: Decision,
    current: Current,
    policy: ScalingPolicy,
    now: float,
    idle_words: str = "nothing in flight, held, queued or running",
) -> Decision:
    """7. The last replica goes after scaleToZeroAfterSeconds of provable idleness
    (``idle_words`` say what was proven, for the status)."""
    idle_since = decision.history.idle_since
    if policy.min_replicas > 0 or idle_since is None:
        return decision
    idle_for = now - idle_since
    if idle_for < policy.scale_to_zero_after_seconds:
        if decision.replicas == current.replicas:
            return replace(
                decision,
                reason=decision.reason + f"; idle {idle_for:.0f} s of "
                f"{policy.scale_to_zero_after_seconds:g} s before scaling to zero",
            )
        return decision
    why = (
        f"idle for {idle_for:.0f} s (scaleToZeroAfterSeconds {policy.scale_to_zero_after_seconds:g}):"
        f" {idle_words}"
    )
    history = History(capacity=decision.history.capacity)
    return finish(
        current.replicas, 0, policy, why, history, decision.signals, burst=False, allow_zero=True
    )
