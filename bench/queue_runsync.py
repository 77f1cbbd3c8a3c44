"""/runsync through the shared queue (NATS JetStream) vs the in-pod job store, same work.

    .venv/bin/python bench/queue_runsync.py                 # ~5 minutes on 2 cores
    .venv/bin/python bench/queue_runsync.py --rounds 3 --seconds 20 --concurrency 8

Targets (bench/README.md, the table's target column): throughput ratio (queue / in-pod) >= 0.90; added median latency per job
<= 5 ms. Also reported: jobs/s one worker drains from a full queue, and the nats-server
process's own CPU per job.

Two `llmendpoints-runtime serve` processes on the demo model, identical but for
JOBS_QUEUE_URL (+ ENDPOINT_ID): "in-pod" keeps jobs in memory, "queue" puts every job through a
real `nats-server -js` (file storage) and works on it as the endpoint's only worker. Both run
during the whole benchmark and the sides alternate (A B A B ...), so whatever else runs on the
machine hits both alike. Per round and side:

- latency: jobs one at a time (no queueing anywhere), median and p90 of the client-side time;
- throughput: `--concurrency` clients sending /runsync back to back for `--seconds`.

Jobs are small by default (max_tokens 4, ignore_eos): the engine's share is small, so the
queue's cost shows; `--max-tokens 64` is closer to real work. Results: Markdown on stdout (for bench/RESULTS.md), JSON in bench/out/queue_runsync.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
ENDPOINT = "bench"
JOB: dict = {"input": {"prompt": "the queue", "sampling_params": {"ignore_eos": True}}}
TICKS = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime + stime


def start_nats(tmp: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    (tmp / "nats.conf").write_text("max_payload: 33554432\n")
    proc = subprocess.Popen(
        [
            str(BIN / "nats-server"),
            "-c",
            str(tmp / "nats.conf"),
            "-js",
            "-sd",
            str(tmp / "js"),
            "-a",
            "127.0.0.1",
            "-p",
            str(port),
        ],
        stdout=(tmp / "nats.log").open("wb"),
        stderr=subprocess.STDOUT,
    )
    time.sleep(0.5)
    return proc, f"nats://127.0.0.1:{port}"


def start_runtime(model: Path, tmp: Path, name: str, concurrency: int, **extra: str):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("API_KEY", "MAX_", "LLMEP_"))}
    env.update(
        MODEL_NAME=str(model),
        OPENAI_SERVED_MODEL_NAME_OVERRIDE="demo",
        MAX_MODEL_LEN="512",
        HOST="127.0.0.1",
        PORT=str(port),
        VLLM_CPU_KVCACHE_SPACE="1",
        HF_HUB_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        MAX_CONCURRENCY=str(concurrency),
        LLMEP_LOG_LEVEL="warning",
        **extra,
    )
    proc = subprocess.Popen(
        [str(BIN / "llmendpoints-runtime"), "serve"],
        env=env,
        stdout=(tmp / f"{name}.log").open("wb"),
        stderr=subprocess.STDOUT,
        cwd=REPO,
    )
    return proc, f"http://127.0.0.1:{port}"


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"runtime {url} exited with {proc.returncode}")
        try:
            if httpx.get(url + "/ready", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not ready in {timeout} s")


async def runsync(client: httpx.AsyncClient) -> float:
    start = time.perf_counter()
    answer = await client.post("/runsync", json=JOB)
    elapsed = time.perf_counter() - start
    body = answer.json()
    if answer.status_code != 200 or body.get("status") != "COMPLETED":
        raise RuntimeError(f"/runsync failed: {answer.status_code} {body}")
    return elapsed


async def latency(url: str, jobs: int) -> list[float]:
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        for _ in range(5):  # warm-up
            await runsync(client)
        return [await runsync(client) for _ in range(jobs)]


async def throughput(url: str, concurrency: int, seconds: float) -> float:
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
        done = 0
        stop = time.perf_counter() + seconds

        async def loop() -> None:
            nonlocal done
            while time.perf_counter() < stop:
                await runsync(client)
                done += 1

        start = time.perf_counter()
        await asyncio.gather(*(loop() for _ in range(concurrency)))
        return done / (time.perf_counter() - start)


async def drain_rate(url: str, jobs: int) -> float:
    """Jobs/s one worker drains: `jobs` /run submitted at once, until the queue's depth (read
    from NATS by /v2/{endpoint}/health) says none is queued or running."""
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        start = time.perf_counter()
        await asyncio.gather(*(client.post("/run", json=JOB) for _ in range(jobs)))
        while True:
            counts = (await client.get(f"/v2/{ENDPOINT}/health")).json()["jobs"]
            if counts["inQueue"] + counts["inProgress"] == 0:
                return jobs / (time.perf_counter() - start)
            await asyncio.sleep(0.02)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--latency-jobs", type=int, default=100)
    parser.add_argument("--drain-jobs", type=int, default=300)
    parser.add_argument("--max-tokens", type=int, default=4, help="tokens each job generates")
    args = parser.parse_args()
    JOB["input"]["sampling_params"]["max_tokens"] = args.max_tokens

    tmp = Path(tempfile.mkdtemp(prefix="queue-bench-"))
    from llmendpoints_runtime.demo import write_demo_model

    model = write_demo_model(tmp / "model")
    nats, nats_url = start_nats(tmp)
    procs = []
    try:
        inpod, inpod_url = start_runtime(model, tmp, "in-pod", args.concurrency)
        queued, queue_url = start_runtime(
            model, tmp, "queue", args.concurrency, JOBS_QUEUE_URL=nats_url, ENDPOINT_ID=ENDPOINT
        )
        procs = [inpod, queued]
        wait_ready(inpod_url, inpod)
        wait_ready(queue_url, queued)
        sides = {"in-pod": inpod_url, "queue": queue_url}
        rounds = []
        nats_cpu = 0.0
        queue_jobs = 0
        for number in range(args.rounds):
            order = ["in-pod", "queue"] if number % 2 == 0 else ["queue", "in-pod"]
            result: dict = {"round": number + 1, "order": order}
            for side in order:
                before = cpu_seconds(nats.pid)
                lat = asyncio.run(latency(sides[side], args.latency_jobs))
                rate = asyncio.run(throughput(sides[side], args.concurrency, args.seconds))
                if side == "queue":
                    nats_cpu += cpu_seconds(nats.pid) - before
                    queue_jobs += args.latency_jobs + 5 + round(rate * args.seconds)
                result[side] = {
                    "median_ms": statistics.median(lat) * 1000,
                    "p90_ms": statistics.quantiles(lat, n=10)[-1] * 1000,
                    "jobs_per_s": rate,
                }
            result["throughput_ratio"] = (
                result["queue"]["jobs_per_s"] / result["in-pod"]["jobs_per_s"]
            )
            result["added_median_ms"] = result["queue"]["median_ms"] - result["in-pod"]["median_ms"]
            rounds.append(result)
            print(json.dumps(result), file=sys.stderr)
        drain = asyncio.run(drain_rate(queue_url, args.drain_jobs))
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
        nats.terminate()
        nats.wait(10)

    ratios = [r["throughput_ratio"] for r in rounds]
    added = [r["added_median_ms"] for r in rounds]
    summary = {
        "rounds": rounds,
        "throughput_ratio_median": statistics.median(ratios),
        "added_median_ms_median": statistics.median(added),
        "drain_jobs_per_s": drain,
        "nats_cpu_ms_per_job": nats_cpu * 1000 / max(1, queue_jobs),
        "args": vars(args),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}",
    }
    out = REPO / "bench" / "out"
    out.mkdir(exist_ok=True)
    (out / "queue_runsync.json").write_text(json.dumps(summary, indent=2))
    print(
        f"## Shared queue: /runsync through NATS vs the in-pod store ({time.strftime('%Y-%m-%d %H:%M')} UTC)\n"
    )
    print(f"`{' '.join([Path(sys.executable).name, *sys.argv])}`; {summary['machine']}.\n")
    print(
        "| round | order | in-pod jobs/s | queue jobs/s | ratio | in-pod median ms | queue median ms | added ms | queue p90 ms |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rounds:
        print(
            f"| {r['round']} | {' '.join(r['order'])} | {r['in-pod']['jobs_per_s']:.1f} | "
            f"{r['queue']['jobs_per_s']:.1f} | {r['throughput_ratio']:.3f} | "
            f"{r['in-pod']['median_ms']:.1f} | {r['queue']['median_ms']:.1f} | "
            f"{r['added_median_ms']:+.1f} | {r['queue']['p90_ms']:.1f} |"
        )
    print(
        f"\nMedian of rounds: throughput ratio **{summary['throughput_ratio_median']:.3f}** "
        f"(target >= 0.90), added median latency **{summary['added_median_ms_median']:+.1f} ms** "
        f"(target <= 5 ms). One worker (MAX_CONCURRENCY={args.concurrency}) drains "
        f"**{drain:.0f} jobs/s** ({args.drain_jobs} jobs queued at once). nats-server CPU: "
        f"**{summary['nats_cpu_ms_per_job']:.2f} ms per job**."
    )


if __name__ == "__main__":
    main()
