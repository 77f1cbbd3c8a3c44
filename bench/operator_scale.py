"""Operator at scale: N LLMEndpoints applied at once against the in-memory Kubernetes API.

    .venv/bin/python bench/operator_scale.py [--count 200] [--json out.json]

The real operator runs as its own process (`python -m llmendpoints_operator run`), exactly as in
production, against kmock's KubernetesEmulator served from this process. After a warm-up
endpoint (so that imports and the initial listing are not counted), N endpoints are created
concurrently. An endpoint counts as reconciled when its Deployment and Service exist and its
status carries the reconcile's observedGeneration.

Reported:
- operator CPU time per endpoint (user + system of the operator process only; the emulator's
  own cost - tens of milliseconds a request - is in this process and excluded). Two numbers:
  until every endpoint is reconciled, and once the operator has gone quiet (under 5 % of a core
  for 3 s: children's watch events and Kubernetes Events included);
- the operator's steady CPU use afterwards, with N endpoints and nothing changing (the
  autoscaler's ticks; the resync is pushed out of the window);
- apply-to-status latency p50/p99 (wall time; dominated by the emulator's queueing);
- peak RSS of the operator process (VmHWM);
- the machine's load average: other work on the same cores slows the wall-clock numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time
from typing import Any

import psutil

REPO = pathlib.Path(__file__).resolve().parents[1]
# The tests' kits (tests/conftest.py puts the same two folders on the path).
sys.path[:0] = [str(REPO / "tests"), str(REPO / "tests" / "runtime")]

from integration.kube_emulator import (  # noqa: E402
    CHILD_RESOURCES,
    LLMEP,
    Cluster,
    Operator,
    endpoint,
    wait_for,
)

NS = "bench"
SPEC = {
    "model": {"name": "Qwen/Qwen2.5-7B-Instruct"},
    "cache": {"size": "50Gi"},
    "scaling": {"minReplicas": 1, "maxReplicas": 3},
    "api": {"apiKeysSecretRef": {"name": "keys", "key": "api-keys"}},
}


def _cpu_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def _peak_rss_mib(pid: int) -> float:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _reconciled(cluster: Cluster, name: str) -> bool:
    obj = cluster.get(LLMEP, NS, name)
    if obj is None or (obj.get("status") or {}).get("observedGeneration") != 1:
        return False
    return (
        cluster.get(CHILD_RESOURCES["Deployment"], NS, name) is not None
        and cluster.get(CHILD_RESOURCES["Service"], NS, name) is not None
    )


async def _quiet(process: psutil.Process, idle_seconds: float = 3.0, timeout: float = 120) -> float:
    """Wait until the operator uses under 5 % of a core for idle_seconds (its periodic work,
    the autoscaler's ticks, never stops entirely); return its CPU time then."""
    deadline = time.monotonic() + timeout
    last, since = _cpu_seconds(process), time.monotonic()
    while time.monotonic() < deadline:
        await asyncio.sleep(0.5)
        now = _cpu_seconds(process)
        if now - last > 0.025:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= idle_seconds:
            break
    return last


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


async def run(count: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = pathlib.Path(tmp_dir)
        async with Cluster() as cluster:
            operator = Operator(
                cluster.write_kubeconfig(tmp / "kubeconfig"),
                tmp / "operator.log",
                # No resync during the measurement, and no per-request info logging.
                {"LLMEP_OPERATOR_RESYNC_SECONDS": "3600"},
            )
            proc = await operator.start()
            process = psutil.Process(proc.pid)
            try:
                await cluster.create(LLMEP, NS, endpoint("warmup", NS, SPEC))
                await wait_for(lambda: _reconciled(cluster, "warmup"), 120, "the warm-up endpoint")
                cpu_start = await _quiet(process)

                names = [f"ep-{i:04d}" for i in range(count)]
                applied: dict[str, float] = {}
                done: dict[str, float] = {}

                async def apply(name: str) -> None:
                    await cluster.create(LLMEP, NS, endpoint(name, NS, SPEC))
                    applied[name] = time.monotonic()

                started = time.monotonic()
                await asyncio.gather(*(apply(name) for name in names))
                applied_all = time.monotonic()
                while len(done) < count:
                    for name in names:
                        if name not in done and _reconciled(cluster, name):
                            done[name] = time.monotonic()
                    if time.monotonic() - started > 600:
                        raise TimeoutError(f"only {len(done)}/{count} reconciled after 600 s")
                    await asyncio.sleep(0.02)
                finished = time.monotonic()
                cpu_reconciled = _cpu_seconds(process)
                cpu_quiet = await _quiet(process)
                steady_from, steady_cpu = time.monotonic(), _cpu_seconds(process)
                await asyncio.sleep(10)
                steady_ms_per_s = (
                    (_cpu_seconds(process) - steady_cpu) * 1000 / (time.monotonic() - steady_from)
                )
                assert operator.alive, operator.log()[-3000:]
                peak_rss = _peak_rss_mib(proc.pid)
            finally:
                await operator.stop()

    latencies = [done[name] - applied[name] for name in names]
    return {
        "endpoints": count,
        "all_reconciled_s": round(finished - started, 2),
        "apply_s": round(applied_all - started, 2),
        "cpu_ms_per_endpoint_until_reconciled": round(
            (cpu_reconciled - cpu_start) * 1000 / count, 2
        ),
        "cpu_ms_per_endpoint_until_quiet": round((cpu_quiet - cpu_start) * 1000 / count, 2),
        "latency_p50_s": round(statistics.median(latencies), 2),
        "latency_p99_s": round(_percentile(latencies, 99), 2),
        "latency_max_s": round(max(latencies), 2),
        "steady_cpu_ms_per_s": round(steady_ms_per_s, 1),
        "operator_peak_rss_mib": round(peak_rss, 1),
        "load_average_1m": round(os.getloadavg()[0], 2),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=200, help="endpoints applied at once")
    parser.add_argument("--json", type=pathlib.Path, help="also write the results here")
    args = parser.parse_args()
    results = asyncio.run(run(args.count))
    width = max(len(key) for key in results)
    for key, value in results.items():
        print(f"{key:<{width}}  {value}")
    target_ok = results["cpu_ms_per_endpoint_until_quiet"] <= 30
    print(f"target <= 30 ms CPU per endpoint: {'met' if target_ok else 'MISSED'}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0 if target_ok else 1


if __name__ == "__main__":
    sys.exit(main())
