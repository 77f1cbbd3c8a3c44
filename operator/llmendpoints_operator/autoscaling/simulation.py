"""Replay a scripted load through `decide()` with a simulated clock and a simulated Deployment.

Used by the unit tests and by bench/autoscaler.py. Pure: no I/O, no wall clock. The simulated
Deployment makes a new replica ready `ready_after` seconds after it was asked for (None: never,
like a pod waiting for a GPU that is not there) and removes not-ready replicas first on
scale-down, as the Deployment controller does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from .decision import Current, Decision, History, Observation, decide
from .policy import ScalingPolicy

# load(t, ready_replicas) -> (queue depth total, in-flight total) over the ready replicas.
Load = Callable[[float, int], tuple[float, float]]


@dataclass
class SimulatedDeployment:
    replicas: int
    ready_after: float | None = 0.0
    # When each replica became / becomes ready (inf: never), oldest first.
    ready_at: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.ready_at:
            self.ready_at = [float("-inf")] * self.replicas

    def ready(self, now: float) -> int:
        return sum(1 for t in self.ready_at if t <= now)

    def scale(self, replicas: int, now: float) -> None:
        if replicas > self.replicas:
            delay = float("inf") if self.ready_after is None else self.ready_after
            self.ready_at += [now + delay] * (replicas - self.replicas)
        elif replicas < self.replicas:
            # Not-ready replicas go first, then the youngest ready ones.
            self.ready_at = sorted(self.ready_at)[:replicas]
        self.replicas = replicas


@dataclass(frozen=True)
class Tick:
    t: float
    before: int
    decision: Decision

    @property
    def after(self) -> int:
        return self.decision.replicas


def replay(
    policy: ScalingPolicy,
    load: Load,
    *,
    duration: float,
    deployment: SimulatedDeployment,
    start: float = 0.0,
    history: History | None = None,
    failed: Callable[[float, int], int] | None = None,
    report_capacity: bool = True,
) -> tuple[list[Tick], History]:
    """Run one decision every `policy.interval_seconds` from `start` for `duration` seconds.

    `failed(t, ready)` says how many ready pods do not answer /metrics; their share of the load
    is missing from the observation, as it would be from a real scrape. `report_capacity=False`
    hides the pods' saturation (the decision then scales on queue / target alone).
    """
    ticks: list[Tick] = []
    history = history or History()
    steps = round(duration / policy.interval_seconds)
    for i in range(steps):
        now = start + i * policy.interval_seconds
        ready = deployment.ready(now)
        queue, in_flight = load(now, ready)
        down = min(ready, failed(now, ready)) if failed else 0
        seen = (ready - down) / ready if ready else 0.0
        answered = ready - down
        # The balanced-load model: every pod has the same share, so all or none have a queue.
        saturated = in_flight / ready if queue > 0 and ready and report_capacity else None
        observation = Observation(queue * seen, in_flight * seen, answered, down, saturated)
        decision = decide(history, Current(deployment.replicas, observation), policy, now)
        ticks.append(Tick(now, deployment.replicas, decision))
        history = decision.history
        deployment.scale(decision.replicas, now)
    return ticks, history


def changes(ticks: list[Tick]) -> list[Tick]:
    """The ticks that changed the replica count."""
    return [tick for tick in ticks if tick.after != tick.before]
