"""What the autoscaler's decision takes and returns: the observation, the endpoint's state, the
history it remembers (JSON in status, so a restart resumes it), the decision, and how an outcome
is phrased and clamped to the user's bounds (`finish`). Pure data and arithmetic.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from llmendpoints_common.batch.signal import BatchSignal

from .policy import ScalingPolicy

# Demand that is a hair above an integer (2.0000000001) is that integer, not the next one.
EPS = 1e-9
STATE_VERSION = 1


@dataclass(frozen=True, slots=True)
class Outside:
    """Work for the endpoint that no pod holds (read from NATS, not from the pods)."""

    held: float = 0  # requests the gateway replicas hold (LLMEP_SIGNALS)
    jobs_queued: float = 0  # normal-priority jobs waiting in the shared queue
    jobs_queued_low_priority: float = 0  # lowPriority jobs waiting (no demand, no zero)
    jobs_running: float = 0  # jobs a pod runs now (already in its in-flight count)
    # A batch's requests waiting in the batch lane: no queue demand (the batch's own signal
    # sizes the endpoint for its window), but work that keeps the endpoint from zero.
    jobs_queued_batch: float = 0
    # The running batches' remaining work, deadlines and rates (their drivers' signals).
    batches: tuple[BatchSignal, ...] = ()

    @property
    def queue(self) -> float:
        """What adds to the endpoint's queue signal."""
        return self.held + self.jobs_queued

    @property
    def batch_requests(self) -> int:
        return sum(b.remaining for b in self.batches)

    @property
    def any(self) -> bool:
        """Anything at all that needs a replica, now or soon."""
        return (
            self.queue
            + self.jobs_queued_low_priority
            + self.jobs_running
            + self.jobs_queued_batch
            + self.batch_requests
        ) > 0

    def signals(self) -> dict[str, float]:
        return {
            "heldRequests": self.held,
            "queuedJobs": self.jobs_queued,
            "queuedLowPriorityJobs": self.jobs_queued_low_priority,
            "runningJobs": self.jobs_running,
            "queuedBatchJobs": self.jobs_queued_batch,
            "batches": len(self.batches),
            "batchRequests": self.batch_requests,
        }


@dataclass(frozen=True, slots=True)
class Observation:
    """One scrape of the endpoint's ready pods."""

    queue_depth: float  # llmendpoints_queue_depth summed over the pods that answered
    in_flight: float  # llmendpoints_requests_in_flight summed over the pods that answered
    answered: int  # ready pods whose /metrics was read
    failed: int = 0  # ready pods that did not answer in time, or answered without the gauges
    # Mean in-flight count of the pods that had a queue: a pod only queues when it runs all it
    # can, so this is what one replica carries at most. None when no pod had a queue.
    saturated_in_flight: float | None = None
    # Held requests and queued jobs; None when they could not be read (or no queue is set up).
    outside: Outside | None = None

    @property
    def ready(self) -> int:
        return self.answered + self.failed

    @property
    def total_queue(self) -> float:
        """The pods' queues plus the work waiting outside them."""
        return self.queue_depth + (self.outside.queue if self.outside else 0.0)

    @property
    def idle(self) -> bool:
        """Provably nothing to do: every ready pod answered with nothing in flight or queued,
        and the outside work was read and is none."""
        return (
            self.answered > 0
            and self.failed == 0
            and self.queue_depth == 0
            and self.in_flight == 0
            and self.outside is not None
            and not self.outside.any
        )


@dataclass(frozen=True, slots=True)
class Current:
    """The endpoint as it is now: the replica count last set, and this tick's measurement."""

    replicas: int
    observation: Observation

    @property
    def pending(self) -> int:
        """Replicas asked for but not ready (starting, or waiting for a GPU)."""
        return max(0, self.replicas - self.observation.ready)


@dataclass(frozen=True, slots=True)
class Sample:
    t: float
    queue_depth: float  # the pods' queues plus held requests and queued jobs
    in_flight: float
    partial: bool  # some ready pod did not answer: the totals are a lower bound


@dataclass(frozen=True, slots=True)
class History:
    """Everything the decision remembers; survives restarts through `to_json` / `from_json`."""

    samples: tuple[Sample, ...] = ()
    # The recommendations of the stabilisation windows as (time, replicas), oldest first, kept
    # as monotonic queues: `up` only holds entries that can still be the window's minimum
    # (increasing values), `down` those that can still be its maximum (decreasing values). The
    # window's answer is the first entry, and the state stays a handful of entries long.
    up: tuple[tuple[float, int], ...] = ()
    down: tuple[tuple[float, int], ...] = ()
    # Start of the uninterrupted run of measurements the windows cover (None: nothing yet).
    observing_since: float | None = None
    last_sample_at: float | None = None
    # While now < panic_until the endpoint is in burst mode (no scale-down).
    panic_until: float | None = None
    # Requests one replica runs at most, last seen on pods that had a queue (None: never seen).
    capacity: float | None = None
    # Since when every tick found the endpoint idle (None: not idle at the last tick).
    idle_since: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "v": STATE_VERSION,
            "since": self.observing_since,
            "last": self.last_sample_at,
            "panicUntil": self.panic_until,
            "capacity": None if self.capacity is None else _r(self.capacity),
            "idleSince": self.idle_since,
            "samples": [
                [_r(s.t), _r(s.queue_depth), _r(s.in_flight), int(s.partial)] for s in self.samples
            ],
            "up": [[_r(t), r] for t, r in self.up],
            "down": [[_r(t), r] for t, r in self.down],
        }

    @classmethod
    def from_json(cls, data: Any) -> History:
        """Rebuild a history; raises ValueError for anything that is not a state we wrote."""
        if not isinstance(data, dict) or data.get("v") != STATE_VERSION:
            raise ValueError("not an autoscaler state of version 1")
        try:
            return cls(
                samples=tuple(
                    Sample(float(t), float(q), float(f), bool(p)) for t, q, f, p in data["samples"]
                ),
                up=tuple((float(t), int(r)) for t, r in data["up"]),
                down=tuple((float(t), int(r)) for t, r in data["down"]),
                observing_since=_opt_float(data.get("since")),
                last_sample_at=_opt_float(data.get("last")),
                panic_until=_opt_float(data.get("panicUntil")),
                capacity=_opt_float(data.get("capacity")),
                idle_since=_opt_float(data.get("idleSince")),
            )
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"malformed autoscaler state: {error}") from error


def load_history(data: Any) -> History:
    """The stored history, or an empty one (which holds scale-down for a whole window)."""
    if data is None:
        return History()
    try:
        return History.from_json(data)
    except ValueError:
        return History()


@dataclass(frozen=True, slots=True)
class Decision:
    """The outcome of one tick: the replica count to set, why, and the history to keep."""

    replicas: int
    reason: str
    action: str  # "ScaleUp" | "ScaleDown" | "Hold"
    history: History
    burst: bool = False
    signals: dict[str, float] = field(default_factory=dict)  # what this tick measured
    before: int | None = None  # the replica count the decision started from
    # Batches that will not finish inside their window (autoscaling/batch.py): the controller
    # says so (an Event, a metric) when one joins.
    batches_at_risk: tuple[str, ...] = ()

    @property
    def from_zero(self) -> bool:
        return self.before == 0 and self.replicas > 0

    @property
    def to_zero(self) -> bool:
        return self.action == "ScaleDown" and self.replicas == 0


def finish(
    replicas: int,
    proposed: int,
    policy: ScalingPolicy,
    why: str,
    history: History,
    signals: dict[str, float],
    burst: bool,
    allow_zero: bool = False,
) -> Decision:
    """Clamp to the user's bounds and phrase the outcome. Only the zero rules (`allow_zero`)
    may go below 1: with minReplicas 0 the ordinary rules keep the last replica."""
    lower = policy.min_replicas if allow_zero else max(policy.min_replicas, 1)
    target = min(max(proposed, lower), policy.max_replicas)
    if proposed < lower and policy.min_replicas < lower:
        why += "; keeps 1 replica (only scaleToZeroAfterSeconds of idleness takes the last)"
    elif target != proposed:
        bound = "minReplicas" if proposed < lower else "maxReplicas"
        why += f"; clamped to {bound} {target}"
    if target > replicas:
        action, head = "ScaleUp", f"scale up {replicas}->{target}"
    elif target < replicas:
        action, head = "ScaleDown", f"scale down {replicas}->{target}"
    else:
        action, head = "Hold", f"hold at {replicas}"
    return Decision(
        replicas=target,
        reason=f"{head}: {why}",
        action=action,
        history=history,
        burst=burst,
        signals=signals,
        before=replicas,
    )


def outside_words(outside: Outside) -> str:
    parts = []
    if outside.held:
        parts.append(f"{fmt(outside.held)} request(s) held by the gateway")
    if outside.jobs_queued:
        parts.append(f"{fmt(outside.jobs_queued)} queued job(s)")
    if outside.jobs_queued_low_priority:
        parts.append(f"{fmt(outside.jobs_queued_low_priority)} queued low-priority job(s)")
    if outside.jobs_running:
        parts.append(f"{fmt(outside.jobs_running)} running job(s)")
    if outside.batch_requests:
        parts.append(f"{outside.batch_requests} batch request(s) of {len(outside.batches)} batch(es)")  # fmt: skip
    elif outside.jobs_queued_batch:
        parts.append(f"{fmt(outside.jobs_queued_batch)} queued batch request(s)")
    return " + ".join(parts) or "nothing held or queued"


def ceil(value: float) -> int:
    return max(0, math.ceil(value - EPS))


def fmt(value: float) -> str:
    return f"{value:.2f}".rstrip("0").rstrip(".")


def _r(value: float) -> float:
    return round(value, 3)


def _opt_float(value: Any) -> float | None:
    return None if value is None else float(value)
