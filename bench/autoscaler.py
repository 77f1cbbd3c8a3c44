"""Autoscaler benchmark: reaction to a queue step, decision CPU per endpoint per tick, and
replica changes under steady load over simulated hours. Prints a Markdown section for
bench/RESULTS.md.

    .venv/bin/python bench/autoscaler.py

Targets (issue 5): a queue step is acted on within one tick; decision CPU <= 2 ms per endpoint
per tick; zero replica changes under steady load over a simulated hour.

Timelines (issue 9): burst from zero, KV-bound steady load and a diurnal ramp, each with the
corrected pod signals and the whole queue (held requests while no replica is ready, scale to
zero) against the same load seen through the old, double-counting signal (a request waiting in
vLLM's scheduler counted in both gauges; minReplicas 0 refused).

Everything but the scrape timing is the real decide()/record code on a simulated clock and a
simulated Deployment (llmendpoints_operator.autoscaling.simulation); the scrape timing reads
real HTTP metrics servers on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import platform
import random
import socket
import statistics
import time
from dataclasses import dataclass

from aiohttp import web
from llmendpoints_operator.autoscaling.decision import (
    Current,
    History,
    Observation,
    Outside,
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


# --- timelines: corrected signals and the whole queue vs the double-counting signal ----------

COLD_START = 60.0  # seconds from a scale-up to the new replica's readiness
NOISE = 0.1  # the loads' noise band (+-10 %)


@dataclass(frozen=True)
class Regime:
    """What one replica runs at once: vLLM's max_num_seqs, or fewer when the KV cache is full
    (`kv_seqs`: how many sequences of the load's length the cache holds)."""

    max_num_seqs: int
    kv_seqs: int
    admission_limit: int = 256  # the runtime's MAX_CONCURRENCY (requests handed to vLLM)

    @property
    def capacity(self) -> int:
        return min(self.max_num_seqs, self.kv_seqs)


def observe_pods(work: float, ready: int, regime: Regime, double_count: bool) -> Observation:
    """The scrape of `ready` replicas sharing `work` concurrent requests evenly."""
    if ready == 0:
        return Observation(0, 0, 0)
    share = work / ready
    running = min(share, regime.capacity)
    handed = min(share, regime.admission_limit)  # holding an admission slot
    engine_waiting = handed - running
    admission_waiting = share - handed
    if double_count:  # the old gauges: in flight = handed (incl. engine-waiting), queue = both
        queue, in_flight = admission_waiting + engine_waiting, handed
    else:
        queue, in_flight = admission_waiting + engine_waiting, running
    saturated = in_flight if queue > 0 else None
    return Observation(queue * ready, in_flight * ready, ready, 0, saturated)


def needed(work: float, regime: Regime, target: float) -> int:
    """Replicas that leave at most `target` waiting each: the target's meaning."""
    return math.ceil(work / (regime.capacity + target) - 1e-9) if work > 0 else 0


def timeline(
    load,
    regime: Regime,
    duration: float,
    *,
    whole_queue: bool,
    min_replicas: int,
    start: int,
    tolerance: float = 0.1,
) -> dict[str, float]:
    """`load(t)` -> (noisy work the pods see, the noise-free work the need is judged on)."""
    policy = ScalingPolicy(
        minReplicas=min_replicas, maxReplicas=50, scaleToZeroAfterSeconds=300, tolerance=tolerance
    )
    deployment = SimulatedDeployment(start, ready_after=COLD_START)
    history = History()
    changes_, under, over, replica_s, held_s = 0, 0.0, 0.0, 0.0, 0.0
    step = policy.interval_seconds
    for i in range(round(duration / step)):
        now = i * step
        work, mean = load(now)
        ready = deployment.ready(now)
        obs = observe_pods(work, ready, regime, double_count=not whole_queue)
        if whole_queue:  # the gateway holds what no ready replica can take
            outside = Outside(held=work if ready == 0 else 0)
            obs = Observation(obs.queue_depth, obs.in_flight, obs.answered, 0,
                              obs.saturated_in_flight, outside)  # fmt: skip
        decision = decide(history, Current(deployment.replicas, obs), policy, now)
        history = decision.history
        if decision.replicas != deployment.replicas:
            changes_ += 1
        deployment.scale(decision.replicas, now)
        # Judged on the noise-free load: enough for it, and no more than its +10 % band needs.
        need = needed(mean, regime, policy.target_queue_depth)
        enough = needed(mean * (1 + NOISE), regime, policy.target_queue_depth)
        under += step if ready < need else 0
        over += step if deployment.replicas > enough else 0
        replica_s += step * deployment.replicas
        held_s += step if work > 0 and ready == 0 else 0
    return {
        "changes": changes_,
        "under_min": under / 60,
        "over_min": over / 60,
        "replica_h": replica_s / HOUR,
        "no_replica_min": held_s / 60,
    }


def timelines() -> list[tuple[str, str, dict[str, float]]]:
    kv_bound = Regime(max_num_seqs=256, kv_seqs=6)  # a GPU whose KV cache holds 6 sequences
    seq_bound = Regime(max_num_seqs=8, kv_seqs=64)
    rng = random.Random(3)
    noise = [rng.uniform(1 - NOISE, 1 + NOISE) for _ in range(100_000)]

    def burst(t):  # 10 min idle, 10 min of 60 concurrent, 20 min idle
        work = 60.0 if 600 <= t < 1200 else 0.0
        return work, work

    def steady(t):  # 40 +-10 % concurrent for 2 h
        return 40 * noise[int(t // 5)], 40.0

    def diurnal(t):  # 24 h: 2 at night, 60 at the afternoon peak, +-10 % per minute
        mean = 2 + 58 * (1 - math.cos(2 * math.pi * t / (24 * HOUR))) / 2
        return mean * noise[int(t // 60)], mean

    cases = [
        ("burst from zero (60 concurrent for 10 min)", burst, 2400, seq_bound),
        ("KV-bound steady (40 +-10 %, cache holds 6 seqs)", steady, 2 * HOUR, kv_bound),
        ("diurnal ramp, 24 h (2 -> 60 -> 2), KV-bound", diurnal, 24 * HOUR, kv_bound),
    ]
    out = []
    for label, work_at, duration, regime in cases:
        new = timeline(work_at, regime, duration, whole_queue=True, min_replicas=0, start=0)
        old = timeline(work_at, regime, duration, whole_queue=False, min_replicas=1, start=1)
        out.append((label, "corrected + whole queue, minReplicas 0", new))
        out.append((label, "double-counting signal, minReplicas 1", old))
        if work_at is diurnal:  # how much of the lag is the 10 % dead band
            exact = timeline(
                work_at, regime, duration, whole_queue=True, min_replicas=0, start=0, tolerance=0
            )
            out.append((label, "corrected + whole queue, minReplicas 0, tolerance 0", exact))
    return out


# --- nudge: from the gateway's nudge to the Deployment patch ---------------------------------


class _RecordingKube:
    """The Kubernetes API as the autoscaler uses it, in memory: records the Deployment patches."""

    def __init__(self) -> None:
        self.patched: dict[str, asyncio.Event] = {}
        self.ticked: dict[str, asyncio.Event] = {}

    async def list(self, *args, **kwargs):
        return []

    async def patch(self, api_version, kind, namespace, name, patch, *, subresource=None):
        events = self.patched if kind == "Deployment" else self.ticked
        events.setdefault(name, asyncio.Event()).set()
        return {}


async def nudge_latency(rounds: int = 30) -> list[float]:
    """Milliseconds from `nudge()` to the autoscaler's Deployment patch (0 -> 1), with a real
    nats-server, the real Autoscaler and NatsOutside; the endpoints tick every 60 s, so only
    the nudge can explain a patch within the round."""
    import shutil
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    import nats
    from llmendpoints_common.queue import signals
    from llmendpoints_operator.autoscaling.controller import Autoscaler, Subject
    from llmendpoints_operator.autoscaling.metrics import AutoscalerMetrics
    from llmendpoints_operator.autoscaling.outside import NatsOutside

    binary = Path(sys.executable).with_name("nats-server")
    server = str(binary) if binary.exists() else shutil.which("nats-server")
    with tempfile.TemporaryDirectory() as store:
        port = _free_port()
        proc = subprocess.Popen(
            [server, "-js", "-sd", store, "-a", "127.0.0.1", "-p", str(port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            url = f"nats://127.0.0.1:{port}"
            for _ in range(200):  # wait until it listens (it starts in well under a second)
                with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port)):
                    break
                await asyncio.sleep(0.05)
            client = await nats.connect(url)
            kube = _RecordingKube()
            scaler = Autoscaler(lambda: kube, lambda *a: None, AutoscalerMetrics())
            scaler.set_outside(NatsOutside(url, on_nudge=scaler.nudge))
            policy = ScalingPolicy(
                minReplicas=0, maxReplicas=2, intervalSeconds=60, stableWindowSeconds=60
            )
            subjects: list[Subject] = []
            runner = asyncio.create_task(scaler.run(lambda: subjects))
            latencies = []
            for i in range(rounds):
                name = f"ep-{i}"
                kube.ticked[name], kube.patched[name] = asyncio.Event(), asyncio.Event()
                owner = {"metadata": {"namespace": "bench", "name": name}}
                subjects.append(Subject(owner, "v1", "LLMEndpoint", policy, name, name, 0, 0))
                await asyncio.wait_for(kube.ticked[name].wait(), 10)  # its first tick, at 0
                await signals.publish_held(client.jetstream(), name, "gw", 1)
                started = time.perf_counter()
                await signals.nudge(client, name)
                await asyncio.wait_for(kube.patched[name].wait(), 10)
                latencies.append((time.perf_counter() - started) * 1e3)
            runner.cancel()
            await scaler.close()
            await client.drain()
            return sorted(latencies)
        finally:
            proc.terminate()
            proc.wait()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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
    print("\n### Timelines: corrected signals and the whole queue vs the double-counting signal\n")
    print(
        "Real decide() on a simulated clock; replicas ready 60 s after they are asked for; "
        "work shared evenly by the ready replicas; a replica runs min(max_num_seqs, what its "
        "KV cache holds) and queues the rest (admission limit 256). Needed = work / (capacity + "
        "targetQueueDepth 2), rounded up, for the noise-free load. Under-provisioned: ready < "
        "needed. Over-provisioned: replicas (incl. pending) > what the top of the +-10 % noise "
        "band needs (holding that is what keeps noise from moving replicas). 'No replica': minutes "
        "with work and no ready replica (requests held by the gateway; with minReplicas 1 the "
        "old setup never has none).\n"
    )
    print(
        "| load | setup | replica changes | under-provisioned, min | over-provisioned, min "
        "| replica-hours | no replica while work, min |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for label, setup, r in timelines():
        print(
            f"| {label} | {setup} | {r['changes']:.0f} | {r['under_min']:.1f} "
            f"| {r['over_min']:.1f} | {r['replica_h']:.2f} | {r['no_replica_min']:.1f} |"
        )

    nudges = asyncio.run(nudge_latency())
    print("\n### From a nudge to the scale-up from zero\n")
    print(
        f"Real nats-server, the real Autoscaler and NatsOutside, the Kubernetes API in memory; "
        f"{len(nudges)} endpoints at 0 replicas ticking every 60 s, each gets a held request "
        "and a nudge: milliseconds from `nudge()` to the Deployment patch 0 -> 1: median "
        f"{statistics.median(nudges):.1f}, p90 {nudges[int(len(nudges) * 0.9)]:.1f}, max "
        f"{nudges[-1]:.1f}. Without the nudge the held request waits for the next tick: "
        "intervalSeconds / 2 on average (2.5 s with the default 5 s)."
    )

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
