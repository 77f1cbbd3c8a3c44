"""Autoscaling: scrape the runtime pods' queue signals and read the work outside them (held
requests, queued jobs), decide (pure), record the decision.

- policy.py     `spec.scaling` knobs and their defaults
- model.py      what a decision takes and returns; the JSON-able history; outcome phrasing
- decision.py   the pure `decide(history, current, policy, now)`: the ordinary rules
- zero.py       scaling from zero and to zero (pure)
- scrape.py     EndpointSlices -> pod URLs (pure), /metrics parsing (pure), the HTTP scraper
- outside.py    held requests, queued jobs and nudges from NATS (the only NATS code here)
- controller.py the ticks: I/O around decide()
- record.py     `status.autoscaling` from a decision (pure)
- metrics.py    the operator's own Prometheus metrics about autoscaling
- simulation.py replays scripted load through decide() (tests and bench)
"""

from .decision import Current, Decision, History, Observation, Outside, decide, load_history
from .policy import SCALE_TO_ZERO_REFUSED, ScalingPolicy

__all__ = [
    "SCALE_TO_ZERO_REFUSED",
    "Current",
    "Decision",
    "History",
    "Observation",
    "Outside",
    "ScalingPolicy",
    "decide",
    "load_history",
]
