"""Autoscaling: scrape the runtime pods' queue signals, decide (pure), record the decision.

- policy.py     `spec.scaling` knobs and their defaults
- decision.py   the pure `decide(history, current, policy, now)` and its JSON-able history
- scrape.py     EndpointSlices -> pod URLs (pure), /metrics parsing (pure), the HTTP scraper
- record.py     `status.autoscaling` and Events from a decision (pure)
- metrics.py    the operator's own Prometheus metrics about autoscaling
- simulation.py replays scripted load through decide() (tests and bench)
"""

from .decision import Current, Decision, History, Observation, decide, load_history
from .policy import SCALE_TO_ZERO_REFUSED, ScalingPolicy

__all__ = [
    "SCALE_TO_ZERO_REFUSED",
    "Current",
    "Decision",
    "History",
    "Observation",
    "ScalingPolicy",
    "decide",
    "load_history",
]
