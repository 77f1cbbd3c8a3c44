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
6. The whole queue: requests the gateway holds and jobs queued in the shared queue for the
   endpoint (`Outside`) count as queue, as if a pod held them. With no replica (scaled to
   zero) any of them scales 0 -> N at once, N = waiting / (capacity + target) with the capacity
   learned before (kept at zero), 1 while it was never learned.
   Queued low-priority jobs do not add demand (RunPod's lowPriority), but one alone still
   brings the endpoint from zero to 1 (it would otherwise wait forever) and keeps it from zero.
7. Scale to zero (minReplicas 0): after `scaleToZeroAfterSeconds` of consecutive ticks in which
   every replica answered and nothing was in flight, queued, held, or queued / running as a
   job, the endpoint goes to 0 (whatever its size). Ticks with no ready replica at all count
   as idle too when nothing is held, queued or running for the endpoint: replicas woken by
   work that went away (a purged job) and never ready (no GPU free, an image that does not
   pull) do not pin their GPU request. Otherwise the floor is 1: the ordinary rules never
   take the last replica. Unknown outside work (the queue was not readable) and a ready pod
   that did not answer are never idle.
8. Batches (batch.py): a batch's requests wait in their own lane and add no queue demand;
   the running batches ask for the replicas that finish them inside their windows at the
   rate they have been answered at (one while that rate is unknown). That is a floor under
   the decision above (reached at the same growth rate), not a demand of its own: a batch
   never grows the endpoint past what its window needs, and interactive load still scales it
   beyond. A batch wakes an endpoint at zero (rule 6) and keeps it from zero (rule 7).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from .batch import BatchPlan, plan
from .model import (
    EPS,
    STATE_VERSION,
    Current,
    Decision,
    History,
    Observation,
    Outside,
    Sample,
    ceil,
    finish,
    fmt,
    load_history,
    outside_words,
)
from .policy import ScalingPolicy
from .zero import from_zero, to_zero_if_idle

__all__ = [
    "STATE_VERSION",
    "Current",
    "Decision",
    "History",
    "Observation",
    "Outside",
    "Sample",
    "decide",
    "load_history",
]


def decide(history: History, current: Current, policy: ScalingPolicy, now: float) -> Decision:
    """Replicas for the next interval, and the reason, from the history and this tick."""
    obs = current.observation
    signals = _signals(current)
    batches = plan(
        obs.outside.batches if obs.outside is not None else (),
        ready=obs.ready,
        max_replicas=policy.max_replicas,
        now=now,
    )
    if batches.any:
        signals["batchReplicas"] = batches.replicas
        signals["batchesAtRisk"] = len(batches.at_risk)
        if batches.per_replica is not None:
            signals["batchRatePerReplica"] = round(batches.per_replica, 4)
    if current.replicas == 0:
        return _at_risk(from_zero(history, current, policy, now, signals), batches)
    if obs.answered == 0:
        return _at_risk(_unmeasured(history, current, policy, now, signals), batches)
    state = _observe(history, obs, policy, now)
    rec = _recommend(history, state, current, policy, now)
    signals.update(rec.averages)
    if state.capacity:
        signals["replicaCapacity"] = state.capacity
    signals["demandReplicas"] = round(rec.stable_demand, 3)
    idle_since = None
    if obs.idle:
        idle_since = now if history.idle_since is None else history.idle_since
    if idle_since is not None:
        signals["idleSeconds"] = now - idle_since
    decision = _stabilise(history, state, rec, current, policy, now, signals)
    decision = _batch_floor(decision, batches, current, policy)
    decision = replace(decision, history=replace(decision.history, idle_since=idle_since))
    return _at_risk(to_zero_if_idle(decision, current, policy, now), batches)


def _at_risk(decision: Decision, batches: BatchPlan) -> Decision:
    return replace(decision, batches_at_risk=batches.at_risk) if batches.at_risk else decision


def _batch_floor(
    decision: Decision, batches: BatchPlan, current: Current, policy: ScalingPolicy
) -> Decision:
    """8. The replicas the running batches need for their windows, as a floor."""
    if not batches.any or batches.replicas <= decision.replicas:
        return decision
    replicas = current.replicas
    cap = max(math.ceil(replicas * policy.max_scale_up_rate - EPS), replicas + 1)
    wanted = (
        min(batches.replicas, max(cap, replicas))
        if batches.replicas > replicas
        else batches.replicas
    )
    why = f"batches: {batches.words}"
    if wanted < batches.replicas:
        why += f"; growth capped at {wanted} (x{policy.max_scale_up_rate:g} per decision)"
    if decision.replicas < replicas:
        why += f" (instead of {decision.reason})"
    floored = finish(
        replicas, wanted, policy, why, decision.history, decision.signals, decision.burst
    )
    if floored.action == "ScaleUp" and floored.replicas > replicas:
        # The size a batch asked for is the floor of the scale-down window, as for any scale-up.
        down = _push(decision.history.down, decision.history.last_sample_at or 0.0, floored.replicas, keep_if=_larger)  # fmt: skip
        floored = replace(floored, history=replace(decision.history, down=down))
    return floored


@dataclass(frozen=True, slots=True)
class _Window:
    """The windows with this tick's sample added."""

    stable: tuple[Sample, ...]  # the stable window's samples, this tick's last
    burst: tuple[Sample, ...]  # the panic window's
    since: float  # start of the uninterrupted run of measurements
    capacity: float | None


@dataclass(frozen=True, slots=True)
class _Recommendation:
    up: int  # what this tick adds to the scale-up window
    down: int  # what it adds to the scale-down window
    stable_demand: float
    burst_demand: float
    pressure: float  # the panic window's signal in targets (per endpoint, not per replica)
    bursting: bool
    panic_until: float | None
    averages: dict[str, float]
    explained: str


def _signals(current: Current) -> dict[str, float]:
    obs = current.observation
    signals: dict[str, float] = {
        "queueDepth": obs.queue_depth,
        "inFlight": obs.in_flight,
        "readyReplicas": obs.ready,
        "pendingReplicas": current.pending,
        "failedScrapes": obs.failed,
    }
    if obs.outside is not None:
        signals.update(obs.outside.signals())
    return signals


def _observe(history: History, obs: Observation, policy: ScalingPolicy, now: float) -> _Window:
    """1. Remember this tick's sample; restart the evidence after a gap."""
    since = history.observing_since
    if (
        since is None
        or history.last_sample_at is None
        or now - history.last_sample_at > policy.stable_window_seconds
    ):
        since = now
    sample = Sample(now, obs.total_queue, obs.in_flight, obs.failed > 0)
    stable = (
        *(s for s in history.samples if s.t > now - policy.stable_window_seconds and s.t < now),
        sample,
    )
    burst = tuple(s for s in stable if s.t > now - policy.panic_window_seconds)
    return _Window(stable, burst, since, obs.saturated_in_flight or history.capacity)


def _recommend(
    history: History, window: _Window, current: Current, policy: ScalingPolicy, now: float
) -> _Recommendation:
    """2./3. Demand over both windows; a burst is judged against ready capacity only."""
    targets = policy.signal_targets
    ready = current.observation.ready
    stable_demand, stable_avg, explained = _demand(window.stable, targets, window.capacity)
    burst_demand, burst_avg, _ = _demand(window.burst, targets, window.capacity)
    # Burst: a signal per *ready* replica (pending ones carry nothing) at panicThreshold x its
    # target, e.g. 4 queued per replica for a target of 2.
    pressure = burst_avg["queueDepthAvg"] / targets["queueDepth"]
    if "inFlight" in targets:
        pressure = max(pressure, burst_avg["inFlightAvg"] / targets["inFlight"])
    bursting = pressure >= policy.panic_threshold * max(ready, 1)
    panic_until = history.panic_until if history.panic_until and now < history.panic_until else None
    if bursting:
        panic_until = now + policy.stable_window_seconds
    replicas = current.replicas
    down = ceil(burst_demand * (1 + policy.tolerance))
    if panic_until is not None:
        # Burst mode: follow the short window up, never down.
        up = down = max(ceil(burst_demand), ceil(stable_demand), replicas)
    elif now - window.since < policy.stable_window_seconds - policy.interval_seconds / 2:
        # Too few samples to average (first ticks, or after a gap): only a burst moves it up.
        up = replicas
    else:
        # Down on the short window: the smoothed average lags a drop in load, and replaying
        # that lag through the scale-down window would step down one replica per tick.
        up = _banded_up(stable_demand, replicas, policy.tolerance)
    return _Recommendation(
        up, down, stable_demand, burst_demand, pressure, bursting, panic_until, stable_avg,
        explained,
    )  # fmt: skip


def _stabilise(
    history: History,
    window: _Window,
    rec: _Recommendation,
    current: Current,
    policy: ScalingPolicy,
    now: float,
    signals: dict[str, float],
) -> Decision:
    """4./5. Stabilise, cap growth, hold scale-down when the evidence is incomplete."""
    replicas = current.replicas
    downs = _trim(history.down, now - policy.scale_down_stabilization_seconds)
    ups = _push(
        _trim(history.up, now - policy.scale_up_stabilization_seconds), now, rec.up, _smaller
    )
    pushed_downs = _push(downs, now, rec.down, keep_if=_larger)
    up_to, down_to = ups[0][1], pushed_downs[0][1]
    new_history = History(
        samples=window.stable,
        up=ups,
        down=pushed_downs,
        observing_since=window.since,
        last_sample_at=now,
        panic_until=rec.panic_until,
        capacity=window.capacity,
    )
    why = _explain(rec, current, policy)

    def outcome(proposed: int, why: str, burst: bool = False) -> Decision:
        return finish(replicas, proposed, policy, why, new_history, signals, burst)

    if up_to > replicas:
        if current.pending:
            why += f"; {current.pending} pending replica(s) not counted as capacity"
        cap = max(math.ceil(replicas * policy.max_scale_up_rate - EPS), replicas + 1)
        if up_to > cap:
            why += f"; growth capped at {cap} (x{policy.max_scale_up_rate:g} per decision)"
        up = outcome(min(up_to, cap), why, rec.bursting)
        # The size just scaled up to is the floor of the scale-down window from now on.
        floor = _push(downs, now, max(rec.down, up.replicas), keep_if=_larger)
        return replace(up, history=replace(new_history, down=floor))
    if down_to < replicas:
        held = _scale_down_held(window, policy, now)
        if held:
            return outcome(replicas, f"{why}; scale-down held: {held}")
        why += (
            f"; the busiest {policy.panic_window_seconds:g} s of the last "
            f"{policy.scale_down_stabilization_seconds:g} s fit in {down_to}"
        )
        return outcome(down_to, why)
    if rec.up == replicas < _banded_up(rec.stable_demand, replicas, policy.tolerance):
        why += f"; scale-up waits for a full {policy.stable_window_seconds:g} s window (bursts excepted)"
    elif rec.up > replicas:
        why += f"; waiting {policy.scale_up_stabilization_seconds:g} s scale-up stabilization"
    elif rec.down < replicas:
        why += (
            f"; waiting for {policy.scale_down_stabilization_seconds:g} s of lower load "
            "before scaling down"
        )
    return outcome(replicas, why, rec.bursting)


def _scale_down_held(window: _Window, policy: ScalingPolicy, now: float) -> str | None:
    """5. Why the evidence does not allow a scale-down yet (None: it does)."""
    partial = sum(1 for s in window.stable if s.partial)
    if partial:
        return (
            f"a ready pod did not answer /metrics in {partial} of the last "
            f"{len(window.stable)} samples"
        )
    observed_for = now - window.since
    if observed_for < policy.scale_down_stabilization_seconds:
        return (
            f"{observed_for:.0f} s of uninterrupted measurements, "
            f"{policy.scale_down_stabilization_seconds:g} s needed"
        )
    return None


def _explain(rec: _Recommendation, current: Current, policy: ScalingPolicy) -> str:
    """The demand arithmetic, and the burst if there is one, in words."""
    ready = max(current.observation.ready, 1)
    why = f"{rec.explained} over {policy.stable_window_seconds:g} s ({current.observation.ready} ready)"
    outside = current.observation.outside
    if outside is not None and outside.queue:
        why += f" (queued includes {outside_words(outside)})"
    if rec.panic_until is None:
        return why
    if rec.bursting:
        return why + (
            f"; burst: {fmt(rec.pressure / ready)} x target per ready replica over "
            f"{policy.panic_window_seconds:g} s, {fmt(rec.burst_demand)} replicas needed"
        )
    return why + "; burst mode (no scale-down until a stable window without burst)"


def _unmeasured(
    history: History, current: Current, policy: ScalingPolicy, now: float, signals: dict
) -> Decision:
    """Replicas exist but none answered: keep the size (only the user's bounds can move it),
    except that with no ready replica at all and nothing waiting for one, the idle clock of
    rule 7 runs: replicas that never become ready (no GPU free, an image that does not pull)
    must not hold a GPU request for ever once the work that woke them is gone."""
    obs = current.observation
    nothing_waits = obs.ready == 0 and obs.outside is not None and not obs.outside.any
    if obs.failed:
        why = f"no ready replica answered /metrics ({obs.failed} failed)"
    else:
        why = "no ready replica to measure yet"
        if obs.outside is not None and obs.outside.any:
            why += f"; waiting for it: {outside_words(obs.outside)}"
        elif nothing_waits:
            why += "; nothing held, queued or running waits for it"
    kept = History(
        samples=tuple(s for s in history.samples if s.t > now - policy.stable_window_seconds),
        up=_trim(history.up, now - policy.scale_up_stabilization_seconds),
        down=_trim(history.down, now - policy.scale_down_stabilization_seconds),
        observing_since=history.observing_since,
        last_sample_at=history.last_sample_at,
        panic_until=history.panic_until
        if history.panic_until and now < history.panic_until
        else None,
        capacity=history.capacity,
        idle_since=(now if history.idle_since is None else history.idle_since)
        if nothing_waits
        else None,
    )
    if kept.idle_since is not None:
        signals["idleSeconds"] = now - kept.idle_since
    decision = finish(current.replicas, current.replicas, policy, why, kept, signals, burst=False)
    return to_zero_if_idle(
        decision, current, policy, now, idle_words="no replica became ready and nothing is "
        "held, queued or running for it",
    )  # fmt: skip


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
            f"queued {fmt(queue_depth)} + running {fmt(in_flight)} = {fmt(work)} requests / "
            f"({fmt(capacity)} running + {target:g} queued per replica) = {fmt(demand)}"
        )
    else:
        demand = queue_depth / target
        words = f"queued {fmt(queue_depth)} / {target:g} per replica = {fmt(demand)}"
    if "inFlight" in targets:
        by_in_flight = in_flight / targets["inFlight"]
        words += (
            f"; running {fmt(in_flight)} / {targets['inFlight']:g} per replica = "
            f"{fmt(by_in_flight)}"
        )
        demand = max(demand, by_in_flight)
    return demand, {"queueDepthAvg": queue_depth, "inFlightAvg": in_flight}, f"demand {words}"


def _banded_up(demand: float, replicas: int, tolerance: float) -> int:
    """ceil(demand), but a demand at most `tolerance` above the current size keeps it."""
    wanted = ceil(demand)
    if wanted > replicas and demand <= replicas * (1 + tolerance) + EPS:
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
