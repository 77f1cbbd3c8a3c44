"""The whole queue (held requests, queued jobs), scale from zero and to zero: the pure decide()."""

from __future__ import annotations

import pytest
from llmendpoints_operator.autoscaling.decision import (
    Current,
    History,
    Observation,
    Outside,
    decide,
)
from llmendpoints_operator.autoscaling.policy import ScalingPolicy
from llmendpoints_operator.autoscaling.record import event_reason, status_block

IDLE_AFTER = 120.0
NOTHING = Outside()


def policy(**fields) -> ScalingPolicy:
    return ScalingPolicy(
        **{"minReplicas": 0, "maxReplicas": 10, "scaleToZeroAfterSeconds": IDLE_AFTER, **fields}
    )


def at_zero(outside: Outside | None) -> Current:
    return Current(0, Observation(0, 0, 0, outside=outside))


def serving(replicas: int, queue=0.0, in_flight=0.0, outside=NOTHING, failed=0, sat=None):
    return Current(replicas, Observation(queue, in_flight, replicas - failed, failed, sat, outside))


def run(p: ScalingPolicy, current_at, start: float, end: float, history: History | None = None):
    """Tick every interval from start to end with current_at(t, replicas); follow decisions."""
    history = history or History()
    replicas = None
    decisions = []
    t = start
    while t < end:
        current = current_at(t, replicas)
        decision = decide(history, current, p, t)
        decisions.append((t, current.replicas, decision))
        history, replicas = decision.history, decision.replicas
        t += p.interval_seconds
    return decisions, history


@pytest.mark.parametrize(
    ("outside", "why"),
    [
        (Outside(held=1), "1 request(s) held by the gateway"),
        (Outside(jobs_queued=1), "1 queued job(s)"),
        # lowPriority adds no demand, but alone at zero it would never run: it brings up one.
        (Outside(jobs_queued_low_priority=3), "3 queued low-priority job(s)"),
    ],
)
def test_work_for_an_endpoint_with_no_pod_scales_it_to_one_at_the_first_tick(outside, why):
    decision = decide(History(), at_zero(outside), policy(), now=0)
    assert (decision.replicas, decision.action, decision.from_zero) == (1, "ScaleUp", True)
    assert why in decision.reason and decision.reason.startswith("scale up 0->1: from zero")
    assert event_reason(decision) == "ScaleFromZero"


def test_from_zero_uses_the_learned_capacity_for_a_big_backlog():
    # A replica was seen to run 6 while others waited: 40 waiting need 40 / (6 + 2) = 5 replicas.
    decision = decide(History(capacity=6), at_zero(Outside(held=25, jobs_queued=15)), policy(), 0)
    assert decision.replicas == 5
    assert "40 waiting / (6 running + 2 queued per replica) = 5" in decision.reason
    capped = decide(History(capacity=6), at_zero(Outside(held=400)), policy(maxReplicas=3), 0)
    assert capped.replicas == 3 and "clamped to maxReplicas 3" in capped.reason


@pytest.mark.parametrize(
    ("outside", "why"),
    [
        (Outside(), "scaled to zero: nothing held, queued or running"),
        (None, "held requests and queued jobs could not be read"),
    ],
)
def test_zero_stays_zero_without_work_or_without_knowledge(outside, why):
    decision = decide(History(), at_zero(outside), policy(), now=0)
    assert (decision.replicas, decision.action) == (0, "Hold") and why in decision.reason


def test_a_raised_min_replicas_brings_a_zero_endpoint_up():
    decision = decide(History(), at_zero(Outside()), policy(minReplicas=2), now=0)
    assert decision.replicas == 2


def test_idle_endpoint_goes_to_zero_after_scale_to_zero_after_seconds_not_before():
    p = policy()
    decisions, _ = run(p, lambda t, r: serving(r or 1), 0, IDLE_AFTER + 5 * p.interval_seconds)
    zero = [(t, d) for t, before, d in decisions if d.replicas == 0]
    t, first = zero[0]
    assert t == IDLE_AFTER  # idle since the first tick at 0 s
    assert first.to_zero and event_reason(first) == "ScaleToZero"
    assert f"idle for {IDLE_AFTER:.0f} s (scaleToZeroAfterSeconds {IDLE_AFTER:g})" in first.reason
    waiting = decisions[3][2]
    assert waiting.replicas == 1 and "idle 15 s of 120 s before scaling to zero" in waiting.reason
    block = status_block(None, 1, first, t)
    assert block["scaledToZero"]["reason"] == first.reason
    # Later ticks at zero keep saying why.
    later = decide(first.history, at_zero(Outside()), p, t + 5)
    assert status_block(block, 0, later, t + 5)["scaledToZero"] == block["scaledToZero"]


@pytest.mark.parametrize(
    "busy",
    [
        {"in_flight": 1},
        {"queue": 1},
        {"outside": Outside(held=1)},
        {"outside": Outside(jobs_queued=1)},
        {"outside": Outside(jobs_queued_low_priority=1)},  # never while a job is queued
        {"outside": Outside(jobs_running=1)},  # ... or running
        {"outside": None},  # the queue could not be read: not provably idle
        {"failed": 1},  # a replica did not answer: its load is unknown
    ],
)
def test_any_work_or_unknown_restarts_the_idle_clock(busy):
    p = policy()
    one_busy_tick = 60.0

    def current_at(t, replicas):
        if t == one_busy_tick:
            return serving(replicas or 2, **busy)
        return serving(replicas or 2)

    decisions, _ = run(p, current_at, 0, one_busy_tick + IDLE_AFTER + 10)
    zero_at = [t for t, _, d in decisions if d.to_zero]
    # Idle again from the tick after the busy one: zero only a full window after it.
    assert zero_at == [one_busy_tick + p.interval_seconds + IDLE_AFTER]


def test_the_ordinary_rules_never_take_the_last_replica():
    p = policy(scaleDownStabilizationSeconds=30, scaleToZeroAfterSeconds=3600)

    def current_at(t, replicas):
        # Busy (but not idle) at a trickle: 0.2 running per tick on average.
        return serving(replicas or 4, in_flight=1 if int(t) % 25 == 0 else 0)

    decisions, _ = run(p, current_at, 0, 600)
    assert decisions[-1][2].replicas == 1
    assert min(d.replicas for _, _, d in decisions) == 1


def test_low_priority_jobs_add_no_demand_while_replicas_run():
    p = policy(minReplicas=1)
    crowd = Outside(jobs_queued_low_priority=500)
    decisions, _ = run(p, lambda t, r: serving(r or 1, in_flight=1, outside=crowd), 0, 200)
    assert all(d.replicas == 1 for _, _, d in decisions)


def test_held_requests_and_queued_jobs_count_as_queue_for_a_running_endpoint():
    decision = decide(History(), serving(1, outside=Outside(held=4, jobs_queued=4)), policy(), 0)
    # 8 waiting for 1 replica at target 2 is a burst: acted on at this tick.
    assert decision.replicas == 2 and decision.burst
    assert "queued includes 4 request(s) held by the gateway + 4 queued job(s)" in decision.reason
    assert decision.signals["heldRequests"] == 4 and decision.signals["queuedJobs"] == 4


def test_capacity_is_what_a_replica_runs_while_others_wait():
    """The corrected pod signals (MAX_NUM_SEQS=2, 24 sent): in flight 2, queue 22. A replica
    runs 2, so 24 requests at <= 2 waiting per replica need 24 / (2 + 2) = 6 replicas. The old
    signal (in flight 24 = running + waiting, queue 22) learned a capacity of 24 and asked 2."""
    p = policy(minReplicas=1, stableWindowSeconds=10, panicWindowSeconds=10)
    right = decide(History(), serving(1, queue=22, in_flight=2, sat=2), p, 0)
    assert right.signals["replicaCapacity"] == 2
    assert "24 requests / (2 running + 2 queued per replica) = 6" in right.reason
    double_counted = decide(History(), serving(1, queue=22, in_flight=24, sat=24), p, 0)
    assert "46 requests / (24 running + 2 queued per replica) = 1.77" in double_counted.reason
    # KV-bound: vLLM runs 5 of max_num_seqs 256 because the cache is full; 5 is the capacity.
    kv = decide(History(), serving(2, queue=30, in_flight=10, sat=5), p, 0)
    assert kv.signals["replicaCapacity"] == 5
    assert "40 requests / (5 running + 2 queued per replica) = 5.71" in kv.reason


def test_the_idle_clock_survives_a_restart():
    p = policy()
    _, history = run(p, lambda t, r: serving(r or 1), 0, 60)
    restored = History.from_json(history.to_json())
    assert restored.idle_since == 0
    decision = decide(restored, serving(1), p, IDLE_AFTER)
    assert decision.replicas == 0


def never_ready(replicas: int, outside=NOTHING) -> Current:
    """Replicas asked for, none ready (no GPU free, an image that does not pull...)."""
    return Current(replicas, Observation(0, 0, 0, outside=outside))


def test_replicas_that_never_get_ready_go_back_to_zero_once_nothing_waits_for_them():
    """Woken from zero by a job that is purged before a pod is ready: the pod never gets
    ready, and nothing waits for it any more. It must not pin its GPU request for ever."""
    p = policy()
    purged_at = 30.0

    def current_at(t, replicas):
        if replicas is None:
            return at_zero(Outside(jobs_queued=1))
        return never_ready(replicas, Outside(jobs_queued=1) if t < purged_at else NOTHING)

    decisions, _ = run(p, current_at, 0, purged_at + IDLE_AFTER + 30)
    assert decisions[0][2].from_zero
    zero = [(t, d) for t, _, d in decisions if d.replicas == 0]
    t, first = zero[0]
    assert t == purged_at + IDLE_AFTER  # idle from the first tick after the purge
    assert first.to_zero and event_reason(first) == "ScaleToZero"
    assert "no replica became ready and nothing is held, queued or running" in first.reason
    waiting = next(d for at, _, d in decisions if at == purged_at + 15)
    assert waiting.replicas == 1
    assert "no ready replica to measure yet; nothing held, queued or running waits" in (
        waiting.reason
    )
    assert "idle 15 s of 120 s before scaling to zero" in waiting.reason
    assert waiting.signals["idleSeconds"] == 15
    # The status says why it is at zero, and keeps saying it.
    block = status_block(None, 1, first, t)
    assert block["scaledToZero"]["reason"] == first.reason


@pytest.mark.parametrize(
    "outside",
    [
        Outside(jobs_queued=1),  # the work that woke it still waits: keep waiting for the pod
        Outside(held=1),
        Outside(jobs_running=1),
        Outside(jobs_queued_low_priority=1),
        None,  # the queue could not be read: not provably idle
    ],
)
def test_a_replica_that_is_not_ready_yet_is_kept_while_anything_may_wait_for_it(outside):
    p = policy()
    decisions, _ = run(p, lambda t, r: never_ready(r or 1, outside), 0, 3 * IDLE_AFTER)
    assert all(d.replicas == 1 for _, _, d in decisions)
    assert all("before scaling to zero" not in d.reason for _, _, d in decisions)


def test_a_ready_replica_that_does_not_answer_is_not_idle():
    p = policy()
    unanswered = Current(1, Observation(0, 0, 0, failed=1, outside=NOTHING))
    decisions, _ = run(p, lambda t, r: unanswered, 0, 3 * IDLE_AFTER)
    assert all(d.replicas == 1 for _, _, d in decisions)


def test_never_ready_replicas_keep_min_replicas():
    p = policy(minReplicas=1)
    decisions, _ = run(p, lambda t, r: never_ready(r or 1), 0, 3 * IDLE_AFTER)
    assert all(d.replicas == 1 for _, _, d in decisions)


def test_idle_ticks_before_and_after_the_first_ready_replica_are_one_idle_period():
    p = policy()

    def current_at(t, replicas):
        return never_ready(replicas or 1) if t < 60 else serving(replicas or 1)

    decisions, _ = run(p, current_at, 0, IDLE_AFTER + 30)
    assert [t for t, _, d in decisions if d.to_zero] == [IDLE_AFTER]
