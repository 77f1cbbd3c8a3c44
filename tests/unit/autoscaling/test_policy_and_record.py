"""spec.scaling validation, and what a decision leaves in status and Events."""

from __future__ import annotations

import pytest
from llmendpoints_operator.autoscaling.decision import Current, History, Observation, decide
from llmendpoints_operator.autoscaling.metrics import AutoscalerMetrics
from llmendpoints_operator.autoscaling.policy import ScalingPolicy
from llmendpoints_operator.autoscaling.record import (
    MAX_DECISIONS,
    history_from_status,
    status_block,
)
from prometheus_client import generate_latest
from pydantic import ValidationError


def test_defaults_are_the_documented_ones():
    p = ScalingPolicy()
    assert (p.min_replicas, p.max_replicas, p.target_queue_depth, p.target_in_flight) == (
        1,
        1,
        2,
        None,
    )
    assert (p.interval_seconds, p.scale_up_stabilization_seconds) == (5, 0)
    assert p.scale_down_stabilization_seconds == 300
    assert (p.stable_window_seconds, p.panic_window_seconds, p.panic_threshold) == (60, 10, 2)
    assert (p.max_scale_up_rate, p.tolerance) == (2, 0.1)


def test_the_policy_takes_zero_the_spec_decides_whether_it_is_allowed():
    p = ScalingPolicy(minReplicas=0, maxReplicas=3)
    assert (p.min_replicas, p.scale_to_zero_after_seconds) == (0, 300)
    with pytest.raises(ValidationError, match="scaleToZeroAfterSeconds"):
        ScalingPolicy(minReplicas=0, maxReplicas=3, scaleToZeroAfterSeconds=-1)


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"minReplicas": 3, "maxReplicas": 2}, "maxReplicas: must be at least minReplicas (2 < 3)"),
        ({"targetQueueDepth": 0}, "targetQueueDepth"),
        ({"targetInFlight": -1}, "targetInFlight"),
        ({"panicWindowSeconds": 120}, "panicWindowSeconds: must not exceed stableWindowSeconds"),
        ({"panicThreshold": 1}, "panicThreshold"),
        ({"maxScaleUpRate": 1}, "maxScaleUpRate"),
        ({"intervalSeconds": 0}, "intervalSeconds"),
        (
            {"intervalSeconds": 1, "stableWindowSeconds": 300},
            "stableWindowSeconds: must not exceed 120 x intervalSeconds (300 > 120 x 1)",
        ),
        ({"targetQueDepth": 2}, "targetQueDepth"),  # a typo is an error, not a silent default
    ],
)
def test_bad_values_name_the_field(fields, words):
    with pytest.raises(ValidationError) as error:
        ScalingPolicy(**fields)
    assert words in str(error.value)


def _decision(replicas: int, queue_depth: float, now: float, history: History | None = None):
    obs = Observation(queue_depth=queue_depth, in_flight=1, answered=replicas)
    p = ScalingPolicy(minReplicas=1, maxReplicas=100_000)
    return decide(history or History(), Current(replicas, obs), p, now)


def test_status_keeps_the_last_changes_newest_first_and_bounded():
    status: dict = {}
    replicas, now = 1, 1_700_000_000.0
    for _ in range(MAX_DECISIONS + 3):
        decision = _decision(replicas, queue_depth=replicas * 8, now=now, history=None)
        assert decision.replicas > replicas
        status = status_block(status, replicas, decision, now)
        replicas, now = decision.replicas, now + 5
    decisions = status["lastDecisions"]
    assert len(decisions) == MAX_DECISIONS
    assert decisions[0]["to"] == replicas and decisions[0]["from"] < replicas
    assert decisions[0]["signals"]["queueDepth"] == decisions[0]["from"] * 8
    assert decisions[0]["time"].endswith("Z") and "scale up" in decisions[0]["reason"]


def test_a_hold_updates_the_latest_tick_but_not_the_decision_list():
    previous = {"lastDecisions": [{"from": 1, "to": 2}]}
    decision = _decision(2, queue_depth=3, now=100.0)
    assert decision.replicas == 2
    status = status_block(previous, 2, decision, 100.0)
    assert status["lastDecisions"] == previous["lastDecisions"]
    assert status["reason"].startswith("hold at 2")
    assert status["signals"]["readyReplicas"] == 2 and status["signals"]["inFlight"] == 1


def test_the_state_in_status_is_the_history_the_next_tick_starts_from():
    decision = _decision(1, queue_depth=40, now=100.0)
    status = {"autoscaling": status_block(None, 1, decision, 100.0)}
    assert history_from_status(status) == decision.history
    assert history_from_status({}) == History()
    assert history_from_status({"autoscaling": {"state": "garbage"}}) == History()


def test_operator_metrics_per_endpoint_and_forgetting_a_deleted_endpoint():
    metrics = AutoscalerMetrics()
    decision = _decision(1, queue_depth=40, now=100.0)
    metrics.record("ns", "chat", current=1, decision=decision)
    metrics.scrape_failed("ns", "chat", 2)
    text = generate_latest(metrics.registry).decode()
    assert 'llmendpoints_autoscaler_desired_replicas{endpoint="ns/chat"} 2.0' in text
    assert 'llmendpoints_autoscaler_current_replicas{endpoint="ns/chat"} 1.0' in text
    assert 'llmendpoints_autoscaler_decisions_total{direction="up",endpoint="ns/chat"} 1.0' in text
    assert 'llmendpoints_autoscaler_scrape_errors_total{endpoint="ns/chat"} 2.0' in text
    assert 'signal="queue_depth"} 40.0' in text
    metrics.forget("ns", "chat")
    assert 'endpoint="ns/chat"' not in generate_latest(metrics.registry).decode()


def test_spec_scaling_carries_the_tuning_into_the_policy():
    from llmendpoints_operator.spec import parse

    ep = parse(
        "chat",
        "ns",
        {
            "model": {"name": "m"},
            "scaling": {
                "minReplicas": 2,
                "maxReplicas": 8,
                "targetInFlight": 48,
                "scaleDownStabilizationSeconds": 600,
                "panicThreshold": 3,
            },
        },
    )
    scaling = ep.spec.scaling
    assert scaling.autoscaled
    policy = scaling.policy()
    assert (policy.min_replicas, policy.max_replicas, policy.target_in_flight) == (2, 8, 48)
    assert (policy.scale_down_stabilization_seconds, policy.panic_threshold) == (600, 3)
    assert policy.target_queue_depth == 2 and policy.interval_seconds == 5  # defaults


@pytest.mark.parametrize(
    "scaling",
    [
        {},
        {"minReplicas": 3},
        {"minReplicas": 2, "maxReplicas": 2},
        {"maxReplicas": 4, "replicas": 3},
    ],
    ids=["defaults", "min-only", "min-equals-max", "pinned"],
)
def test_fixed_or_pinned_endpoints_are_not_autoscaled(scaling):
    from llmendpoints_operator.spec import parse

    ep = parse("chat", "ns", {"model": {"name": "m"}, "scaling": scaling})
    assert not ep.spec.scaling.autoscaled
