"""Scaling for a batch's window, not for its backlog (pure).

A batch of 50,000 requests with 24 hours to go does not need 50,000 / target replicas: it needs
as many as finish it inside its window at the rate the endpoint has shown. Each running batch's
driver publishes its remaining requests, its deadline and the rate its requests have been
answered at lately (``BatchSignal``); from those:

- the work rate needed: batches are served earliest deadline first, so for each deadline the
  requests of that batch and of every batch due before it must be done by then; the needed rate
  is the largest of (their remaining requests) / (time left to that deadline) over the
  deadlines, with ``SAFETY`` of the time kept in reserve;
- the rate one replica gives: the batches' summed rate over the replicas that were ready;
- the replicas: needed rate / rate per replica, rounded up. Until a rate is known (no replica
  yet, or none answered long enough to measure) a batch asks for one replica: it wakes an
  endpoint at zero and keeps it from zero, and the measured rate decides the rest.

A batch is at risk when its driver's own forecast says it ends after its window, or when even
``maxReplicas`` replicas at the measured rate would not finish it: the autoscaler says so (a
signal in status, an Event, a metric) while there is still time to act (raise maxReplicas,
cancel, accept the partial results).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from llmendpoints_common.batch.signal import BatchSignal

# Share of each batch's remaining time the plan keeps in reserve (a replica's start-up, a
# slower stretch): the work is planned to be done by 80 % of the time left.
SAFETY = 0.2
# Time left below which a batch is not planned for any more (its window ends now).
MIN_TIME_LEFT_SECONDS = 1.0


@dataclass(frozen=True, slots=True)
class BatchPlan:
    replicas: int  # what the batches need (0: no batch)
    remaining: int  # their requests not answered yet
    rate_needed: float | None  # requests per second (None: no batch with time left)
    per_replica: float | None  # requests per second one replica answers (None: unknown)
    at_risk: tuple[str, ...] = ()  # batch ids that will not finish in their window
    words: str = ""

    @property
    def any(self) -> bool:
        return self.remaining > 0


def plan(batches: Sequence[BatchSignal], *, ready: int, max_replicas: int, now: float) -> BatchPlan:
    live = sorted(
        (b for b in batches if b.remaining > 0 and b.deadline - now >= MIN_TIME_LEFT_SECONDS),
        key=lambda b: b.deadline,
    )
    remaining = sum(b.remaining for b in batches if b.remaining > 0)
    if not live:
        if remaining:  # their windows have ended: the drivers are writing their results
            return BatchPlan(1, remaining, None, None, words=f"{remaining} batch request(s) expiring")  # fmt: skip
        return BatchPlan(0, 0, None, None)
    needed = 0.0
    due = 0
    for batch in live:
        due += batch.remaining
        needed = max(needed, due / ((batch.deadline - now) * (1 - SAFETY)))
    rates = [b.rate for b in live if b.rate is not None]
    per_replica = sum(rates) / ready if rates and ready > 0 and sum(rates) > 0 else None
    at_risk = [b.batch for b in live if b.on_schedule is False]
    if per_replica is None:
        words = (
            f"{len(live)} batch(es), {due} request(s) left; one replica until their rate is known"
        )
        return BatchPlan(1, remaining, needed, None, tuple(at_risk), words)
    replicas = max(1, math.ceil(needed / per_replica - 1e-9))
    if replicas > max_replicas:
        # Even at maxReplicas some batch will not make it: the earliest whose cumulative work
        # cannot be done by its deadline at that size.
        capacity = per_replica * max_replicas
        due = 0
        for batch in live:
            due += batch.remaining
            if due > capacity * (batch.deadline - now) and batch.batch not in at_risk:
                at_risk.append(batch.batch)
    words = (
        f"{len(live)} batch(es), {due} request(s) left, {needed:.3g}/s needed by their deadlines "
        f"at {per_replica:.3g}/s per replica = {replicas} replica(s)"
    )
    return BatchPlan(replicas, remaining, needed, per_replica, tuple(at_risk), words)
