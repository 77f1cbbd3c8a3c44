"""Autoscaler benchmark: reaction to a queue step, decision CPU per endpoint per tick, and
replica changes under steady load over simulated hours. Prints a Markdown section for
bench/RESULTS.md.

    .venv/bin/python bench/autoscaler.py

Targets (issue 5): a queue step is acted on within one tick; decision CPU <= 2 ms per endpoint
per tick; zero replica changes under steady load over a simulated hour.

Everything but the scrape timing is the real decide()/record code on a simulated clock and a
simulated Deployment (llmendpoints_operator.autoscaling.simulation); the scrape timing reads
real HTTP metrics servers on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import math
import platform
import random
import statistics
import time

from aiohttp import web
from llmendpoints_operator.autoscaling.decision import (
    Current,
    History,
    Observation,
    decide,
)
from llmendpoints_operator.autoscaling.policy import ScalingPolicy
from llmendpoints_operator.autoscaling.record import status_block
from llmendpoints_operator.autoscaling.scrape import (
    MetricsScraper,
    ScrapeTarget,
    parse_pod_metrics,
)
from llmendpoints_operator.autoscaling.simulation import (
    SimulatedDeployment,
    changes,
    replay,
)
from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest

HOUR = 3600.0
CAPACITY = 8  # requests one simulated replica runs at once (the runtime's MAX_CONCURRENCY)
POLICY = ScalingPolicy(minReplicas=1, maxReplicas=50)


def served(work_at, capacity: int = CAPACITY):
    """Closed loop: work_at(t) concurrent requests over the ready replicas; each runs
    `capacity` at most and queues the rest (the runtime's admission limit)."""

    def load(t, ready):
        work = work_at(t)
        return max(0.0, work - ready * capacity), min(work, ready * capacity)

    return load


def reaction(multiple: float, closed_loop: bool) -> tuple[float, int]:
    """Worst case over step phases: seconds from the step to the replica change, and ticks
    after the first tick that saw it (0 = that very tick)."""
    interval = POLICY.interval_seconds
    worst_seconds, worst_ticks = 0.0, 0
    for phase in (0.0, 0.25, 0.5, 0.75):
        step_at = 600 + phase * interval
        if closed_loop:
            # One replica fully busy (8 running, nothing queued), then work x multiple.
            load = served(lambda t, s=step_at: CAPACITY * (multiple if t >= s else 1.0))
        else:
            # Queue-only view: one replica carrying its target, then target x multiple.
            target = POLICY.target_queue_depth

            def load(t, ready, s=step_at, q=target):
                return q * (multiple if t >= s else 1.0), 0.0

        ticks, _ = replay(
            POLICY, load, duration=900, deployment=SimulatedDeployment(1, ready_after=60)
        )
        moved = next(c for c in changes(ticks) if c.t >= step_at)
        first_seen = math.ceil(step_at / interval) * interval
        worst_seconds = max(worst_seconds, moved.t - step_at)
        worst_ticks = max(worst_ticks, round((moved.t - first_seen) / interval))
    return worst_seconds, worst_ticks


def steady_changes(work: float, seeds: int, report_capacity: bool = True) -> list[int]:
    """Replica changes in the second hour (the first one settles) of a steady, noisy load."""
    counts = []
    for seed in range(seeds):
        rng = random.Random(seed)
        ticks, _ = replay(
            POLICY,
            served(lambda t, rng=rng: rng.uniform(work * 0.9, work * 1.1)),
            duration=2 * HOUR,
            deployment=SimulatedDeployment(1, ready_after=30),
            report_capacity=report_capacity,
        )
        counts.append(sum(1 for c in changes(ticks) if c.t >= HOUR))
    return counts


def open_loop_steady(seeds: int) -> list[int]:
    """Scripted queue signal at 83 % of 3 replicas' target (+-50 % noise per tick), one hour."""
    counts = []
    for seed in range(seeds):
        rng = random.Random(seed)
        ticks, _ = replay(
            POLICY,
            lambda t, ready, rng=rng: (rng.uniform(2.5, 7.5), 0.0),
            duration=HOUR,
            deployment=SimulatedDeployment(3),
        )
        counts.append(len(changes(ticks)))
    return counts


def decision_cpu(calls: int = 20000) -> tuple[float, float]:
    """CPU per decide() + status_block() call with full windows (mean and p99, in ms)."""
    rng = random.Random(7)
    history = History()
    replicas, now = 6, 0.0
    samples = []
    for i in range(calls + 200):
        work = rng.uniform(40, 60)
        obs = Observation(max(0.0, work - 48), min(work, 48), 6, 0, 8.0 if work > 48 else None)
        started = time.process_time_ns()
        decision = decide(history, Current(replicas, obs), POLICY, now)
        status_block(None, replicas, decision, now)
        elapsed = time.process_time_ns() - started
        if i >= 200:  # windows full (300 s of recommendations, 60 s of samples)
            samples.append(elapsed / 1e6)
        history, now = decision.history, now + POLICY.interval_seconds
    samples.sort()
    return statistics.fmean(samples), samples[int(len(samples) * 0.99)]


def runtime_like_metrics() -> str:
    """A /metrics body the size of a runtime pod's: our gauges among vLLM-like histograms."""
    registry = CollectorRegistry()
    Gauge("llmendpoints_queue_depth", "queued", registry=registry).set(3)
    Gauge("llmendpoints_requests_in_flight", "running", registry=registry).set(8)
    for name in ("e2e_request_latency", "time_to_first_token", "inter_token_latency", "queue"):
        histogram = Histogram(
            f"vllm:{name}_seconds", name, ["model_name", "engine"], registry=registry
        )
        for engine in range(4):
            histogram.labels("demo", str(engine)).observe(0.1)
    return generate_latest(registry).decode()


def parse_cpu(text: str, calls: int = 2000) -> float:
    started = time.process_time_ns()
    for _ in range(calls):
        parse_pod_metrics(text)
    return (time.process_time_ns() - started) / calls / 1e6


async def scrape_wall(pods: int = 8, rounds: int = 20) -> float:
    """Median wall time of one concurrent scrape of `pods` real local metrics servers."""
    body = runtime_like_metrics()

    async def handler(request):
        return web.Response(text=body, content_type="text/plain")

    runners, targets = [], []
    for i in range(pods):
        app = web.Application()
        app.router.add_get("/metrics", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        runners.append(runner)
        targets.append(ScrapeTarget(f"pod-{i}", f"http://127.0.0.1:{port}/metrics"))
    scraper = MetricsScraper(timeout=1.0)
    walls = []
    try:
        for _ in range(rounds):
            started = time.perf_counter()
            result = await scraper.scrape(targets)
            walls.append((time.perf_counter() - started) * 1e3)
            assert result.observation.answered == pods, result.errors
    finally:
        await scraper.close()
        for runner in runners:
            await runner.cleanup()
    return statistics.median(walls)


def main() -> int:
    body = runtime_like_metrics()
    rows = []
    for closed_loop in (False, True):
        for multiple in (1.5, 2, 4, 10):
            seconds, ticks = reaction(multiple, closed_loop)
            rows.append((closed_loop, multiple, seconds, ticks))
    cpu_mean, cpu_p99 = decision_cpu()
    parse_ms = parse_cpu(body)
    scrape_ms = asyncio.run(scrape_wall())
    open_loop = open_loop_steady(seeds=20)
    closed = {work: steady_changes(work, seeds=5) for work in (12, 20, 45)}
    naive = {work: steady_changes(work, seeds=5, report_capacity=False) for work in (12, 20, 45)}

    print("## Autoscaler (bench/autoscaler.py)\n")
    print("Command: `.venv/bin/python bench/autoscaler.py`  ")
    print(f"Machine: {platform.machine()}, Python {platform.python_version()}; policy defaults ")
    print("(interval 5 s, stable window 60 s, panic window 10 s x2, scale-down window 300 s),")
    print("maxReplicas 50, simulated replicas of 8 concurrent requests, new replicas ready ")
    print("after 60 s (30 s in the steady-load runs).\n")
    print("### Reaction to a step (target: within one tick)\n")
    print(
        "| load | step | queued per replica after it (target 2) | worst delay, s "
        "| ticks after the first tick that saw it |"
    )
    print("| --- | --- | --- | --- | --- |")
    for closed_loop, multiple, seconds, ticks in rows:
        if closed_loop:
            kind, what = "closed loop", f"work {CAPACITY} -> {CAPACITY * multiple:g} requests"
            queued = CAPACITY * (multiple - 1)
        else:
            target = POLICY.target_queue_depth
            kind, what = "scripted queue", f"queue {target:g} -> {target * multiple:g}"
            queued = target * multiple
        print(f"| {kind} | {what} | {queued:g} | {seconds:.2f} | {ticks} |")
    print(
        "\nOne replica before the step. Delay is from the step to the tick that patches the "
        "replicas, worst over four step phases within a tick (up to one interval of it is "
        "waiting for the next tick). Closed loop: the replica runs 8 requests and queues the "
        "rest, as the runtime's admission limit does."
    )
    print("\n### CPU per endpoint per tick (target <= 2 ms)\n")
    print(f"- decide() + status record, windows full: mean {cpu_mean:.3f} ms, p99 {cpu_p99:.3f} ms")
    print(f"- parsing one pod's /metrics ({len(body)} bytes, runtime-like): {parse_ms:.3f} ms")
    print(
        f"- one concurrent scrape of 8 real local metrics servers: {scrape_ms:.1f} ms wall (median)"
    )
    print("\n### Replica changes under steady load (target: 0 per simulated hour)\n")
    print(f"- scripted queue, 83 % of 3 replicas +-50 % noise, 1 h x 20 seeds: changes {open_loop}")
    for work, counts in closed.items():
        print(
            f"- closed loop, {work} +-10 % concurrent requests, second hour x 5 seeds: "
            f"changes {counts}"
        )
    print("\nFor comparison, the same closed loop scaling on queue / target alone (capacity ")
    print("not learned, the formula queue-depth autoscalers use):")
    for work, counts in naive.items():
        print(f"- {work} concurrent requests: changes in the second hour {counts}")

    target = POLICY.target_queue_depth
    burst_ok = all(
        ticks <= 1
        for closed_loop, multiple, _, ticks in rows
        if (CAPACITY * (multiple - 1) if closed_loop else target * multiple) >= 2 * target
    )
    steady_ok = not any(open_loop) and not any(sum(c) for c in closed.values())
    print("\n### Against the targets\n")
    print(
        f"- step acted on within one tick whenever the queue reaches 2x its target per replica "
        f"(the burst threshold): {'yes' if burst_ok else 'NO'}; smaller steps go through the "
        "60 s stable window by design (see the table)"
    )
    print(f"- decision CPU p99 {cpu_p99:.3f} ms <= 2 ms: {'yes' if cpu_p99 <= 2 else 'NO'}")
    print(f"- zero changes under steady load: {'yes' if steady_ok else 'NO'}")
    return 0 if burst_ok and cpu_p99 <= 2 and steady_ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
