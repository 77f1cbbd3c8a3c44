"""Scripted load traces through the pure decide() with a simulated clock and Deployment."""

from __future__ import annotations

import json
import math
import random

import pytest
from llmendpoints_operator.autoscaling.decision import (
    Current,
    History,
    Observation,
    decide,
    load_history,
)
from llmendpoints_operator.autoscaling.policy import ScalingPolicy
from llmendpoints_operator.autoscaling.simulation import SimulatedDeployment, changes, replay

HOUR = 3600.0


def policy(**fields) -> ScalingPolicy:
    return ScalingPolicy(**{"minReplicas": 1, "maxReplicas": 20, **fields})


def queue(level_at):
    """A load that puts `level_at(t)` requests in the queue, whatever the replica count."""
    return lambda t, ready: (level_at(t), 0.0)


def step(at: float, low: float, high: float, until: float = math.inf):
    return queue(lambda t: high if at <= t < until else low)


def noisy(rng: random.Random, mean: float, spread: float):
    return queue(lambda t: rng.uniform(mean - spread, mean + spread))


def test_burst_is_acted_on_at_the_tick_that_sees_it_and_grows_at_most_double_per_tick():
    ticks, _ = replay(
        policy(),
        step(at=300, low=0, high=40),
        duration=600,
        deployment=SimulatedDeployment(1, ready_after=60),
    )
    ups = changes(ticks)
    assert ups[0].t == 300 and (ups[0].before, ups[0].after) == (1, 2)
    assert ups[0].decision.burst and "burst" in ups[0].decision.reason
    # +1..x2 per decision, up to what the queue needs (40 / 2 per replica), never beyond.
    assert [(c.before, c.after) for c in ups] == [(1, 2), (2, 4), (4, 8), (8, 16), (16, 20)]
    assert [c.t for c in ups] == [300, 305, 310, 315, 320]


def test_a_step_of_twice_the_capacity_is_acted_on_within_one_tick():
    ticks, _ = replay(
        policy(),
        step(at=300, low=2, high=8),  # 1 replica carries 2; 8 queued is 4x
        duration=400,
        deployment=SimulatedDeployment(1),
    )
    first = changes(ticks)[0]
    assert first.t - 300 <= policy().interval_seconds
    assert first.after == 2


def test_a_sustained_ramp_is_followed_up_without_ever_scaling_down():
    ramp = queue(lambda t: min(40.0, t / 600 * 40))
    ticks, _ = replay(policy(), ramp, duration=900, deployment=SimulatedDeployment(1))
    sizes = [tick.after for tick in ticks]
    assert sizes == sorted(sizes)
    assert sizes[-1] == 20 == max(sizes)
    # Always within a stable window of what the queue asked for.
    for tick in ticks:
        assert tick.after <= math.ceil(min(40.0, tick.t / 600 * 40) / 2) + 1


@pytest.mark.parametrize("seed", range(5))
def test_steady_load_makes_no_change_in_an_hour(seed):
    # 3 replicas, queue 5 +- 2.5 on average 2.5 replicas' worth: noisy but steady.
    rng = random.Random(seed)
    ticks, _ = replay(
        policy(), noisy(rng, 5, 2.5), duration=HOUR, deployment=SimulatedDeployment(3)
    )
    assert changes(ticks) == []
    assert len(ticks) == HOUR / 5


@pytest.mark.parametrize("seed", range(3))
def test_steady_load_on_both_signals_makes_no_change_in_an_hour(seed):
    rng = random.Random(seed)

    def load(t, ready):
        return rng.uniform(0, 2), rng.uniform(20, 28)  # in-flight asks for 2.4 of 3 replicas

    ticks, _ = replay(
        policy(targetInFlight=10), load, duration=HOUR, deployment=SimulatedDeployment(3)
    )
    assert changes(ticks) == []


@pytest.mark.parametrize(
    "load",
    [
        queue(lambda t: 6 + 3 * math.sin(2 * math.pi * t / 120)),  # slow wave around 3 replicas
        queue(lambda t: 4 if int(t / 5) % 2 else 8),  # tick-to-tick zig-zag around 3 replicas
        queue(lambda t: 9 if int(t / 240) % 2 else 3),  # 4-minute plateaus, 1.5 vs 4.5 replicas
    ],
    ids=["wave", "zigzag", "plateaus"],
)
def test_load_oscillating_around_the_target_does_not_flap(load):
    ticks, _ = replay(policy(), load, duration=HOUR, deployment=SimulatedDeployment(3))
    moves = changes(ticks)
    # Up to the size the peaks need, within the first few minutes, then never a change back.
    assert all(m.after > m.before for m in moves), [(m.t, m.before, m.after) for m in moves]
    assert all(m.t < 600 for m in moves)


def test_load_gone_holds_for_the_scale_down_window_then_returns_to_min_replicas():
    ticks, _ = replay(
        policy(),
        step(at=0, low=0, high=20, until=600),
        duration=1800,
        deployment=SimulatedDeployment(10),
    )
    downs = [c for c in changes(ticks) if c.after < c.before]
    assert downs[0].t >= 600 + 300
    assert downs[-1].after == 1
    assert len(downs) <= 2  # one step, or two when the drop straddles the short window
    assert "fit in" in downs[0].decision.reason


def test_a_pod_that_does_not_answer_holds_scale_down_but_not_scale_up():
    # 10 replicas with no load at all; one pod never answers: nothing is scaled down.
    ticks, _ = replay(
        policy(),
        queue(lambda t: 0.0),
        duration=1800,
        deployment=SimulatedDeployment(10),
        failed=lambda t, ready: 1,
    )
    assert changes(ticks) == []
    assert "did not answer /metrics" in ticks[-1].decision.reason

    # The pods that answer show a burst: scaling up goes on regardless.
    ticks, _ = replay(
        policy(),
        queue(lambda t: 40.0),
        duration=60,
        deployment=SimulatedDeployment(2),
        failed=lambda t, ready: 1,
    )
    assert changes(ticks)[0].after == 4


def test_scale_down_resumes_once_every_pod_answers_again():
    ticks, _ = replay(
        policy(),
        queue(lambda t: 0.0),
        duration=1800,
        deployment=SimulatedDeployment(10),
        failed=lambda t, ready: 1 if t < 900 else 0,
    )
    (down,) = changes(ticks)
    # The last incomplete sample (t=895) must have left the 60 s stable window first.
    assert down.t == 895 + 60
    assert down.after == 1


def test_no_pod_answering_holds_everything():
    deployment = SimulatedDeployment(4)
    ticks, _ = replay(
        policy(),
        queue(lambda t: 0.0),
        duration=900,
        deployment=deployment,
        failed=lambda t, ready: ready,
    )
    assert changes(ticks) == []
    assert "no ready replica answered /metrics (4 failed)" in ticks[-1].decision.reason


def test_pending_replicas_are_not_capacity_and_do_not_cause_runaway_growth():
    # The added replicas never become ready (no GPU): the queue stays at 20 for an hour.
    deployment = SimulatedDeployment(1, ready_after=None)
    ticks, _ = replay(policy(maxReplicas=50), step(0, 0, 20), duration=HOUR, deployment=deployment)
    assert max(tick.after for tick in ticks) == 10  # what 20 queued / 2 per replica needs
    assert ticks[-1].after == 10
    assert deployment.ready(HOUR) == 1
    assert "pending replica(s) not counted as capacity" in changes(ticks)[-1].decision.reason


def served(work_at, capacity: int = 8):
    """Closed loop: `work_at(t)` concurrent requests spread over the ready replicas, each of
    which runs `capacity` at most and queues the rest."""

    def load(t, ready):
        work = work_at(t)
        return max(0.0, work - ready * capacity), min(work, ready * capacity)

    return load


def test_pending_replicas_with_a_known_capacity_stop_at_what_the_work_needs():
    # 40 concurrent requests, 8 per replica, 2 may wait per replica: 4 replicas. The first one
    # is ready and saturated (8 running, 32 queued); the added ones never start.
    deployment = SimulatedDeployment(1, ready_after=None)
    ticks, _ = replay(policy(), served(lambda t: 40.0), duration=HOUR, deployment=deployment)
    assert [(c.before, c.after) for c in changes(ticks)] == [(1, 2), (2, 4)]
    assert "40 requests / (8 running + 2 queued per replica) = 4" in ticks[-1].decision.reason


@pytest.mark.parametrize("work", [12, 20, 45])
def test_closed_loop_steady_load_settles_then_never_changes(work):
    # The queue the replicas see depends on how many there are: adding replicas drains it.
    # Queue / target alone would shrink to minReplicas once drained, and come back: no flapping
    # is allowed here, and the size must leave at most ~2 queued per replica.
    rng = random.Random(work)
    ticks, _ = replay(
        policy(),
        served(lambda t: rng.uniform(work * 0.9, work * 1.1)),
        duration=2 * HOUR,
        deployment=SimulatedDeployment(1, ready_after=30),
    )
    assert [c for c in changes(ticks) if c.t >= 600] == []
    settled = ticks[-1].after
    assert math.ceil(work / (8 + 2)) <= settled <= math.ceil(work * 1.1 * 1.1 / (8 + 2))


def test_burst_detection_measures_against_ready_replicas_only():
    # 4 replicas asked for, 1 ready: 6 queued is 3 replicas' worth = 3x the *ready* capacity.
    obs = Observation(queue_depth=6, in_flight=0, answered=1)
    decision = decide(History(), Current(4, obs), policy(), now=0)
    assert decision.burst
    assert decision.replicas == 4  # demand (3) is below the size already asked for: no growth


@pytest.mark.parametrize(
    ("fields", "replicas", "queue_depth", "expected", "words"),
    [
        ({"maxReplicas": 4}, 4, 100, 4, "clamped to maxReplicas 4"),
        ({"maxReplicas": 4}, 6, 0, 4, "clamped to maxReplicas 4"),  # max lowered by the user
        ({"minReplicas": 3, "maxReplicas": 5}, 1, 0, 3, "clamped to minReplicas 3"),
        ({"minReplicas": 2, "maxReplicas": 2}, 2, 50, 2, "clamped to maxReplicas 2"),
    ],
)
def test_clamping_to_the_users_bounds(fields, replicas, queue_depth, expected, words):
    obs = Observation(queue_depth=queue_depth, in_flight=0, answered=min(replicas, 2))
    decision = decide(History(), Current(replicas, obs), policy(**fields), now=0)
    assert decision.replicas == expected
    assert words in decision.reason


def test_the_largest_signal_wins():
    ticks, _ = replay(
        policy(targetInFlight=10),
        lambda t, ready: (0.0, 60.0),  # nothing queued, 60 running: 6 replicas' worth
        duration=300,
        deployment=SimulatedDeployment(2),
    )
    assert ticks[-1].after == 6
    assert "running 60 / 10 per replica = 6" in changes(ticks)[-1].decision.reason


def test_scale_up_stabilization_ignores_a_short_spike_and_acts_on_a_sustained_rise():
    # The spike stays in the 60 s average for a minute: shorter than the 120 s asked for.
    p = policy(scaleUpStabilizationSeconds=120)
    spike, _ = replay(
        p, step(200, 0, 40, until=215), duration=600, deployment=SimulatedDeployment(1)
    )
    assert changes(spike) == []
    sustained, _ = replay(p, step(200, 0, 40), duration=600, deployment=SimulatedDeployment(1))
    assert changes(sustained)[0].t == 320


def test_restart_in_the_middle_of_the_scale_down_window_changes_nothing():
    p = policy()
    load = step(at=0, low=0, high=20, until=600)
    whole, _ = replay(p, load, duration=1800, deployment=SimulatedDeployment(10))

    # The same run, with the operator "restarted" at t=750 (mid-window): the history goes
    # through JSON (as it does through status) and the run continues from it.
    deployment = SimulatedDeployment(10)
    first, history = replay(p, load, duration=750, deployment=deployment)
    stored = json.loads(json.dumps(history.to_json()))
    second, _ = replay(
        p, load, duration=1050, start=750, deployment=deployment, history=load_history(stored)
    )
    assert [(c.t, c.after) for c in changes(first + second)] == [
        (c.t, c.after) for c in changes(whole)
    ]


def test_restart_that_lost_the_state_waits_a_whole_window_before_scaling_down():
    p = policy()
    deployment = SimulatedDeployment(10)
    ticks, _ = replay(
        p, queue(lambda t: 0.0), duration=900, start=1000, deployment=deployment, history=None
    )
    (down,) = changes(ticks)
    assert down.t >= 1000 + p.scale_down_stabilization_seconds
    assert "uninterrupted measurements" in ticks[0].decision.reason


def test_a_gap_longer_than_the_stable_window_restarts_the_evidence():
    p = policy()
    deployment = SimulatedDeployment(10)
    _, history = replay(p, queue(lambda t: 0.0), duration=200, deployment=deployment)
    # The operator was away for 10 minutes; the old samples say nothing about now.
    ticks, _ = replay(
        p, queue(lambda t: 0.0), duration=600, start=800, deployment=deployment, history=history
    )
    assert changes(ticks)[0].t >= 800 + p.scale_down_stabilization_seconds


def test_history_round_trips_through_json_and_garbage_gives_an_empty_history():
    _, history = replay(
        policy(), step(0, 0, 40, until=100), duration=400, deployment=SimulatedDeployment(1)
    )
    assert history.samples and history.up and history.down
    assert History.from_json(json.loads(json.dumps(history.to_json()))) == history
    assert load_history({"v": 1, "samples": "nope"}) == History()
    assert load_history({"v": 99}) == History()
    assert load_history(None) == History()
    assert len(json.dumps(history.to_json())) < 4096  # small enough for status


def test_the_stabilisation_windows_answer_like_a_full_scan():
    # The windows keep only the entries that can still be their minimum / maximum; check the
    # answers against a scan of every recommendation on random traces.
    from llmendpoints_operator.autoscaling.decision import _larger, _push, _smaller, _trim

    rng = random.Random(3)
    for window in (0, 5, 60, 300):
        ups: tuple = ()
        downs: tuple = ()
        seen: list[tuple[float, int]] = []
        for i in range(500):
            now, value = i * 5.0, rng.randint(0, 12)
            seen.append((now, value))
            ups = _push(_trim(ups, now - window), now, value, keep_if=_smaller)
            downs = _push(_trim(downs, now - window), now, value, keep_if=_larger)
            in_window = [v for t, v in seen if t >= now - window]
            assert ups[0][1] == min(in_window) and downs[0][1] == max(in_window)
            assert len(ups) <= 13 and len(downs) <= 13  # at most one entry per distinct value
