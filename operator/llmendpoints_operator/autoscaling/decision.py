"""The autoscaler's decision: a pure function of what was measured, what was decided before,
the policy and the clock. No I/O, no wall clock: every caller passes `now` (seconds).

How a decision is made (docs/autoscaling.md tells the same story for users):

1. Each tick adds one sample (queue depth and in-flight totals over the ready pods that
   answered) to the history. Demand, in replicas, is computed per signal and the largest wins:
   in-flight / targetInFlight; for the queue, queue / targetQueueDepth until a replica's
   capacity is known, then work / (capacity + targetQueueDepth) (see `_demand`: this is what
   keeps a drained queue from shrinking the endpoint back into a queue, and pending replicas
   from causing runaway growth).
2. Stable window (default 60 s): its average demand is the normal scale-up recommendation, with
   a dead band (`tolerance`) above the current size so that noise never moves it, and only once
   the window is full of samples.
3. Panic window (default 10 s): when its average demand reaches `panicThreshold` x the *ready*
   replicas (pending ones are not capacity), the endpoint is bursting: it scales to that demand
   at once and does not scale down until no burst has been seen for a whole stable window.
4. Scale up once the recommendation has held for `scaleUpStabilizationSeconds` (0: at once), by
   at most x`maxScaleUpRate` (at least +1) per decision. Scale down to the largest short-window
   demand (with `tolerance` headroom) of the last `scaleDownStabilizationSeconds`: a size the
   busiest short window of that period would have fit. (The long average lags a drop in load;
   replaying that lag through the window would shed one replica per tick.) A size just scaled
   up to is kept for a whole scale-down window. The result is clamped to [minReplicas,
   maxReplicas]; a bound the user changes applies at once.
5. Scale-down is held while any sample in the stable window is incomplete (a ready pod did not
   answer: its load is unknown, so it is neither load nor idle capacity), and until the history
   covers a whole scale-down window of uninterrupted observation (after a restart that lost the
   state, or a gap longer than the stable window).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from .policy import ScalingPolicy

# Demand that is a hair above an integer (2.0000000001) is that integer, not the next one.
_EPS = 1e-9
STATE_VERSION = 1


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

    @property
    def ready(self) -> int:
        return self.answered + self.failed


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
    queue_depth: float
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

    def to_json(self) -> dict[str, Any]:
        return {
            "v": STATE_VERSION,
            "since": self.observing_since,
            "last": self.last_sample_at,
            "panicUntil": self.panic_until,
            "capacity": None if self.capacity is None else _r(self.capacity),
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


def decide(history: History, current: Current, policy: ScalingPolicy, now: float) -> Decision:
    """Replicas for the next interval, and the reason, from the history and this tick."""
    obs = current.observation
    replicas = current.replicas
    targets = policy.signal_targets
    signals: dict[str, float] = {
        "queueDepth": obs.queue_depth,
        "inFlight": obs.in_flight,
        "readyReplicas": obs.ready,
        "pendingReplicas": current.pending,
        "failedScrapes": obs.failed,
    }
    ups = _trim(history.up, now - policy.scale_up_stabilization_seconds)
    downs = _trim(history.down, now - policy.scale_down_stabilization_seconds)
    panic_until = history.panic_until if history.panic_until and now < history.panic_until else None

    if obs.answered == 0:
        # Nothing measured: keep the size (only the user's bounds can move it).
        why = (
            f"no ready replica answered /metrics ({obs.failed} failed)"
            if obs.failed
            else "no ready replica to measure yet"
        )
        kept = History(
            samples=tuple(s for s in history.samples if s.t > now - policy.stable_window_seconds),
            up=ups,
            down=downs,
            observing_since=history.observing_since,
            last_sample_at=history.last_sample_at,
            panic_until=panic_until,
            capacity=history.capacity,
        )
        return _finish(replicas, replicas, policy, why, kept, signals, burst=False)

    # 1. Remember this tick's sample; restart the evidence after a gap.
    since = history.observing_since
    if (
        since is None
        or history.last_sample_at is None
        or now - history.last_sample_at > policy.stable_window_seconds
    ):
        since = now
    sample = Sample(now, obs.queue_depth, obs.in_flight, obs.failed > 0)
    stable = (
        *(s for s in history.samples if s.t > now - policy.stable_window_seconds and s.t < now),
        sample,
    )
    burst_samples = [s for s in stable if s.t > now - policy.panic_window_seconds]
    capacity = history.capacity
    if obs.saturated_in_flight:
        capacity = obs.saturated_in_flight

    # 2./3. Demand over both windows, burst detection against ready capacity only.
    stable_demand, stable_avg, explained = _demand(stable, targets, capacity)
    burst_demand, burst_avg, _ = _demand(burst_samples, targets, capacity)
    signals.update(stable_avg)
    if capacity:
        signals["replicaCapacity"] = capacity
    # Burst: a signal per *ready* replica (pending ones carry nothing) at panicThreshold x its
    # target, e.g. 4 queued per replica for a target of 2.
    pressure = burst_avg["queueDepthAvg"] / targets["queueDepth"]
    if "inFlight" in targets:
        pressure = max(pressure, burst_avg["inFlightAvg"] / targets["inFlight"])
    bursting = pressure >= policy.panic_threshold * max(obs.ready, 1)
    if bursting:
        panic_until = now + policy.stable_window_seconds
    if panic_until is not None:
        # Burst mode: follow the short window up, never down.
        up_rec = down_rec = max(_ceil(burst_demand), _ceil(stable_demand), replicas)
    elif now - since < policy.stable_window_seconds - policy.interval_seconds / 2:
        # Too few samples to average (first ticks, or after a gap): only a burst moves it up.
        up_rec = replicas
        down_rec = _ceil(burst_demand * (1 + policy.tolerance))
    else:
        up_rec = _banded_up(stable_demand, replicas, policy.tolerance)
        # Down on the short window: the smoothed average lags a drop in load, and replaying
        # that lag through the scale-down window would step down one replica per tick.
        down_rec = _ceil(burst_demand * (1 + policy.tolerance))
    signals["demandReplicas"] = round(stable_demand, 3)

    # 4. Stabilise, cap growth, hold scale-down when the evidence is incomplete.
    ups = _push(ups, now, up_rec, keep_if=_smaller)
    up_to = ups[0][1]
    pushed_downs = _push(downs, now, down_rec, keep_if=_larger)
    down_to = pushed_downs[0][1]
    new_history = History(
        samples=stable,
        up=ups,
        down=pushed_downs,
        observing_since=since,
        last_sample_at=now,
        panic_until=panic_until,
        capacity=capacity,
    )
    why = f"{explained} over {policy.stable_window_seconds:g} s ({obs.ready} ready)"
    if panic_until is not None:
        why += (
            f"; burst: {_fmt(pressure / max(obs.ready, 1))} x target per ready replica over "
            f"{policy.panic_window_seconds:g} s, {_fmt(burst_demand)} replicas needed"
            if bursting
            else "; burst mode (no scale-down until a stable window without burst)"
        )
    if up_to > replicas:
        if current.pending:
            why += f"; {current.pending} pending replica(s) not counted as capacity"
        cap = max(math.ceil(replicas * policy.max_scale_up_rate - _EPS), replicas + 1)
        if up_to > cap:
            why += f"; growth capped at {cap} (x{policy.max_scale_up_rate:g} per decision)"
        up = _finish(replicas, min(up_to, cap), policy, why, new_history, signals, bursting)
        # The size just scaled up to is the floor of the scale-down window from now on.
        floor = _push(downs, now, max(down_rec, up.replicas), keep_if=_larger)
        return replace(up, history=replace(new_history, down=floor))
    if down_to < replicas:
        partial = sum(1 for s in stable if s.partial)
        if partial:
            why += (
                f"; scale-down held: a ready pod did not answer /metrics in {partial} of the "
                f"last {len(stable)} samples"
            )
            return _finish(replicas, replicas, policy, why, new_history, signals, False)
        observed_for = now - since
        if observed_for < policy.scale_down_stabilization_seconds:
            why += (
                f"; scale-down held: {observed_for:.0f} s of uninterrupted measurements, "
                f"{policy.scale_down_stabilization_seconds:g} s needed"
            )
            return _finish(replicas, replicas, policy, why, new_history, signals, False)
        why += (
            f"; the busiest {policy.panic_window_seconds:g} s of the last "
            f"{policy.scale_down_stabilization_seconds:g} s fit in {down_to}"
        )
        return _finish(replicas, down_to, policy, why, new_history, signals, False)
    if up_rec == replicas < _banded_up(stable_demand, replicas, policy.tolerance):
        why += f"; scale-up waits for a full {policy.stable_window_seconds:g} s window (bursts excepted)"
    elif up_rec > replicas:
        why += f"; waiting {policy.scale_up_stabilization_seconds:g} s scale-up stabilization"
    elif down_rec < replicas:
        why += (
            f"; waiting for {policy.scale_down_stabilization_seconds:g} s of lower load "
            "before scaling down"
        )
    return _finish(replicas, replicas, policy, why, new_history, signals, bursting)


def _finish(
    replicas: int,
    proposed: int,
    policy: ScalingPolicy,
    why: str,
    history: History,
    signals: dict[str, float],
    burst: bool,
) -> Decision:
    """Clamp to the user's bounds and phrase the outcome."""
    target = min(max(proposed, policy.min_replicas), policy.max_replicas)
    if target != proposed:
        bound = "minReplicas" if proposed < policy.min_replicas else "maxReplicas"
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
    )


def _demand(
    samples: list[Sample] | tuple[Sample, ...],
    targets: dict[str, float],
    capacity: float | None,
) -> tuple[float, dict[str, float], str]:
    """Replicas the samples' average load needs (the largest signal wins), the averages, and
    the arithmetic in words.

    Queue signal. A queue shows a shortage but not its size: once scaling up has drained it,
    queue / target says "no replica needed" however much work is running, and shrinking on
    that brings the queue straight back (the flapping of queue-only autoscalers); while added
    replicas are pending the queue stays, and queue / target keeps asking for more (runaway).
    So once a replica's capacity is known (a pod only queues when it runs all it can, so its
    in-flight count then is its capacity), the queue signal asks the question the target means:
    how many replicas leave at most targetQueueDepth waiting each, for the work now running plus
    queued? n replicas run n x capacity and queue the rest:
        (work - n x capacity) / n <= target   <=>   n >= work / (capacity + target).
    This needs more than the current n exactly when the queue per ready replica exceeds the
    target, so it never stalls a needed scale-up. Until a queue has been seen (capacity
    unknown) it is queue / target.

    In-flight signal (optional): in-flight / targetInFlight.
    """
    n = len(samples)
    queue_depth = sum(s.queue_depth for s in samples) / n
    in_flight = sum(s.in_flight for s in samples) / n
    target = targets["queueDepth"]
    if capacity:
        work = queue_depth + in_flight
        demand = work / (capacity + target)
        words = (
            f"queued {_fmt(queue_depth)} + running {_fmt(in_flight)} = {_fmt(work)} requests / "
            f"({_fmt(capacity)} running + {target:g} queued per replica) = {_fmt(demand)}"
        )
    else:
        demand = queue_depth / target
        words = f"queued {_fmt(queue_depth)} / {target:g} per replica = {_fmt(demand)}"
    if "inFlight" in targets:
        by_in_flight = in_flight / targets["inFlight"]
        words += (
            f"; running {_fmt(in_flight)} / {targets['inFlight']:g} per replica = "
            f"{_fmt(by_in_flight)}"
        )
        demand = max(demand, by_in_flight)
    return demand, {"queueDepthAvg": queue_depth, "inFlightAvg": in_flight}, f"demand {words}"


def _banded_up(demand: float, replicas: int, tolerance: float) -> int:
    """ceil(demand), but a demand at most `tolerance` above the current size keeps it."""
    wanted = _ceil(demand)
    if wanted > replicas and demand <= replicas * (1 + tolerance) + _EPS:
        return replicas
    return wanted


def _trim(queue: tuple[tuple[float, int], ...], since: float) -> tuple[tuple[float, int], ...]:
    """The entries of a window that began at `since`."""
    start = 0
    while start < len(queue) and queue[start][0] < since:
        start += 1
    return queue[start:]


def _push(
    queue: tuple[tuple[float, int], ...], t: float, value: int, keep_if
) -> tuple[tuple[float, int], ...]:
    """Append to a monotonic queue, dropping the entries the new one makes irrelevant."""
    end = len(queue)
    while end and not keep_if(queue[end - 1][1], value):
        end -= 1
    return (*queue[:end], (t, value))


def _smaller(old: int, new: int) -> bool:
    return old < new  # window minimum: an older entry matters only while it is smaller


def _larger(old: int, new: int) -> bool:
    return old > new  # window maximum: an older entry matters only while it is larger


def _ceil(value: float) -> int:
    return max(0, math.ceil(value - _EPS))


def _fmt(value: float) -> str:
    return f"{value:.2f}".rstrip("0").rstrip(".")


def _r(value: float) -> float:
    return round(value, 3)


def _opt_float(value: Any) -> float | None:
    return None if value is None else float(value)
