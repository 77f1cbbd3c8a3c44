"""Scaling for a batch's window, not its backlog: the pure plan and decide() with batches."""

from __future__ import annotations

import pytest
from llmendpoints_common.batch.signal import BatchSignal
from llmendpoints_operator.autoscaling.batch import SAFETY, plan
from llmendpoints_operator.autoscaling.decision import (
    Current,
    History,
    Observation,
    Outside,
    decide,
)
from llmendpoints_operator.autoscaling.policy import ScalingPolicy

NOW = 1_000.0
HOUR = 3600.0


def batch(remaining, hours_left, rate=None, on_schedule=None, name="b1") -> BatchSignal:
    return BatchSignal(name, remaining, NOW + hours_left * HOUR, rate, on_schedule)


def policy(**fields) -> ScalingPolicy:
    return ScalingPolicy(**{"minReplicas": 0, "maxReplicas": 10, "scaleToZeroAfterSeconds": 60, **fields})  # fmt: skip


def serving(replicas, *batches, queue=0.0, in_flight=0.0, jobs_queued_batch=0.0) -> Current:
    outside = Outside(batches=tuple(batches), jobs_queued_batch=jobs_queued_batch)
    return Current(replicas, Observation(queue, in_flight, replicas, outside=outside))


def test_no_batch_plans_nothing():
    assert plan([], ready=2, max_replicas=5, now=NOW).replicas == 0
    assert not plan([batch(0, 1)], ready=2, max_replicas=5, now=NOW).any


def test_a_batch_without_a_rate_asks_for_one_replica_whatever_its_backlog():
    found = plan([batch(50_000, 24)], ready=0, max_replicas=10, now=NOW)
    assert (found.replicas, found.per_replica) == (1, None)
    assert "one replica until their rate is known" in found.words


def test_replicas_are_what_finish_the_window_at_the_measured_rate():
    # 2 ready replicas answer 4/s together: 2/s each. 72,000 requests in 10 h, planned into
    # 8 h (SAFETY 0.2): 2.5/s -> 2 replicas (1.25 -> 2).
    found = plan([batch(72_000, 10, rate=4.0)], ready=2, max_replicas=10, now=NOW)
    assert found.rate_needed == pytest.approx(72_000 / (10 * HOUR * (1 - SAFETY)))
    assert (found.per_replica, found.replicas) == (2.0, 2)
    # The same backlog due in 2 h needs 72,000 / 5,760 s = 12.5/s: 7 replicas.
    assert plan([batch(72_000, 2, rate=4.0)], ready=2, max_replicas=10, now=NOW).replicas == 7
    # A small batch never asks for more than one.
    assert plan([batch(10, 24, rate=4.0)], ready=2, max_replicas=10, now=NOW).replicas == 1


def test_earlier_deadlines_count_the_work_due_before_them():
    early = batch(3600, 1, rate=1.0, name="early")
    late = batch(3600, 10, rate=1.0, name="late")
    found = plan([late, early], ready=1, max_replicas=20, now=NOW)
    # Early alone: 3600 in 2880 s = 1.25/s; both by the late deadline: 7200 / 28,800 s.
    # Per replica 2/s (two batches at 1/s on one replica) -> 1 replica.
    assert found.rate_needed == pytest.approx(1.25) and found.replicas == 1


def test_a_batch_that_cannot_make_it_even_at_max_replicas_is_at_risk():
    found = plan([batch(100_000, 1, rate=1.0, name="huge")], ready=1, max_replicas=3, now=NOW)
    assert found.replicas > 3 and found.at_risk == ("huge",)
    # Its driver's forecast alone says so too.
    found = plan([batch(10, 1, rate=1.0, on_schedule=False, name="slow")], ready=1, max_replicas=3, now=NOW)  # fmt: skip
    assert found.at_risk == ("slow",)


def test_a_batch_wakes_an_endpoint_at_zero():
    decision = decide(History(), Current(0, Observation(0, 0, 0, outside=Outside(batches=(batch(500, 24),)))), policy(), NOW)  # fmt: skip
    assert (decision.replicas, decision.action) == (1, "ScaleUp") and decision.from_zero
    assert "batch request(s)" in decision.reason
    queued = decide(History(), Current(0, Observation(0, 0, 0, outside=Outside(jobs_queued_batch=3))), policy(), NOW)  # fmt: skip
    assert queued.replicas == 1


def test_batches_scale_up_to_their_window_and_no_further():
    def at(replicas: int) -> BatchSignal:  # each replica answers 2/s
        return batch(72_000, 2, rate=2.0 * replicas)  # 7 replicas by the plan above

    decision = decide(History(), serving(2, at(2), in_flight=2), policy(), NOW)
    assert decision.replicas == 4 and decision.action == "ScaleUp"  # x2 growth per decision
    assert decision.reason.startswith("scale up 2->4: batches:")
    assert decision.signals["batchReplicas"] == 7
    decision = decide(decision.history, serving(4, at(4), in_flight=4), policy(), NOW + 5)
    assert decision.replicas == 7
    # And not beyond it, however long the backlog stays.
    for t in (10, 15, 20):
        decision = decide(decision.history, serving(7, at(7), in_flight=7), policy(), NOW + t)
        assert decision.replicas == 7
    assert decision.batches_at_risk == ()


def test_a_batch_keeps_its_floor_and_the_endpoint_from_zero():
    b = batch(1000, 24, rate=1.0)
    history, replicas = History(), 1
    for t in range(0, 400, 5):
        decision = decide(
            history, serving(replicas, b), policy(scaleToZeroAfterSeconds=30), NOW + t
        )
        history, replicas = decision.history, decision.replicas
        assert replicas == 1, decision.reason
    done = decide(history, serving(1), policy(scaleToZeroAfterSeconds=30), NOW + 400)
    assert done.replicas == 1  # idle from now on: zero after scaleToZeroAfterSeconds


def test_interactive_load_still_scales_past_the_batch_floor():
    b = batch(10, 24, rate=1.0)
    history, replicas = History(), 1
    for t in range(0, 120, 5):
        decision = decide(history, serving(replicas, b, queue=40, in_flight=replicas * 4), policy(), NOW + t)  # fmt: skip
        history, replicas = decision.history, decision.replicas
    assert replicas > 1


def test_at_risk_batches_reach_the_decision():
    late = batch(100_000, 1, rate=1.0, name="late")
    decision = decide(History(), serving(1, late), policy(maxReplicas=2), NOW)
    assert decision.batches_at_risk == ("late",)
    assert decision.signals["batchesAtRisk"] == 1 and decision.replicas == 2
