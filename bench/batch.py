"""Batches below interactive traffic: what a running batch costs interactive requests, and what
a batch gets from an otherwise idle endpoint.

    .venv/bin/python bench/batch.py                      # ~8 minutes on 2 cores
    .venv/bin/python bench/batch.py --rounds 3 --seconds 30 --max-share 0.5

Targets (DESIGN.md, third round): with a 2,000-request batch running on the same replicas,
interactive p50 TTFT within 1.2x of the same load without it; a batch's requests per second on
an otherwise idle endpoint >= 0.9x the same requests sent interactively.

The stack is the production one, on the demo model: a real `nats-server -js`, `--replicas`
runtime pods on the shared queue (vLLM with `--scheduling-policy priority`, which the runtime
sets with batches on) and a gateway in front. Everything goes through the gateway: interactive
requests (streamed chat completions, the client measuring the time to the first token) and
the batch (the OpenAI Batch API: a file upload, a batch, polling).

1. Interactive load alone, then the same load while a 2,000-request batch runs (created, then
   waited for until its requests run), alternating (A B A B ...) for `--rounds`, so whatever
   else the machine does hits both alike. `--concurrency` clients send streamed requests back to
   back for `--seconds`; TTFT p50 / p99 and requests per second, per side. The batch is
   cancelled after each "with" phase and the endpoint left to drain before the next phase.
2. `--throughput-requests` requests as a batch on the idle endpoint (created -> completed, as
   the client sees it), vs the same requests sent interactively (non-streamed, as many at once
   as the engines run: `--max-num-seqs` per replica), alternating for `--rounds`.

Results: Markdown on stdout (for bench/RESULTS.md), JSON in bench/out/batch.json.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

REPO = Path(__file__).resolve().parents[1]
# The test kits: the one nats-server launcher, the runtime's and the gateway's.
sys.path[:0] = [str(REPO / "tests"), str(REPO / "tests" / "runtime")]

from gateway.harness import launch_gateway  # noqa: E402
from integration.nats_kit import NatsServer  # noqa: E402
from runtime_process import launch_runtime  # noqa: E402

ENDPOINT = "bench"
MODEL = "demo"
KEY = "sk-bench"


def chat_body(i: int, tokens: int) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"Tell me about the number {i}."}],
        "max_tokens": tokens,
        "ignore_eos": True,
    }


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


# ---- interactive load ---------------------------------------------------------------------


async def interactive(url: str, concurrency: int, seconds: float, tokens: int) -> dict:
    """Streamed chat completions back to back: TTFT per request, requests per second."""
    ttfts: list[float] = []
    totals: list[float] = []
    done = 0
    headers = {"authorization": f"Bearer {KEY}"}
    limits = httpx.Limits(max_connections=concurrency + 2)
    async with httpx.AsyncClient(
        base_url=url, timeout=300, headers=headers, limits=limits
    ) as client:
        stop = time.perf_counter() + seconds

        async def one(i: int) -> None:
            nonlocal done
            body = {**chat_body(i, tokens), "stream": True}
            begun = time.perf_counter()
            first = None
            async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                if response.status_code != 200:
                    raise RuntimeError(f"{response.status_code}: {await response.aread()!r}")
                async for line in response.aiter_lines():
                    if first is None and line.startswith("data: {") and '"content"' in line:
                        first = time.perf_counter() - begun
            total = time.perf_counter() - begun
            ttfts.append(first if first is not None else total)
            totals.append(total)
            done += 1

        async def loop(worker: int) -> None:
            i = worker
            while time.perf_counter() < stop:
                await one(i)
                i += concurrency

        begun = time.perf_counter()
        await asyncio.gather(*(loop(w) for w in range(concurrency)))
        elapsed = time.perf_counter() - begun
    return {
        "requests": done,
        "rps": done / elapsed,
        "ttft_p50_ms": percentile(ttfts, 0.5) * 1000,
        "ttft_p99_ms": percentile(ttfts, 0.99) * 1000,
        "latency_p50_ms": percentile(totals, 0.5) * 1000,
    }


# ---- batches ------------------------------------------------------------------------------


class Batches:
    def __init__(self, url: str) -> None:
        self.http = httpx.Client(
            base_url=url + "/v1", headers={"authorization": f"Bearer {KEY}"}, timeout=120
        )

    def create(self, requests: int, tokens: int) -> str:
        data = b"".join(
            json.dumps(
                {
                    "custom_id": f"r{i}",
                    "method": "POST",
                    "url": "/v1/chat/completions",
                    "body": chat_body(i, tokens),
                }
            ).encode()
            + b"\n"
            for i in range(requests)
        )
        uploaded = self.http.post(
            "/files", files={"file": ("batch.jsonl", io.BytesIO(data))}, data={"purpose": "batch"}
        )
        uploaded.raise_for_status()
        created = self.http.post(
            "/batches",
            json={
                "input_file_id": uploaded.json()["id"],
                "endpoint": "/v1/chat/completions",
                "completion_window": "24h",
            },
        )
        created.raise_for_status()
        return created.json()["id"]

    def get(self, batch_id: str) -> dict:
        return self.http.get(f"/batches/{batch_id}").json()

    def wait(self, batch_id: str, statuses: set[str], timeout: float = 1800) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            batch = self.get(batch_id)
            if batch["status"] in statuses:
                return batch
            time.sleep(0.1)
        raise TimeoutError(f"batch {batch_id} not {statuses} in {timeout} s: {batch}")

    def cancel(self, batch_id: str) -> None:
        self.http.post(f"/batches/{batch_id}/cancel")


def engine_running(pods: list[str]) -> int:
    total = 0
    for url in pods:
        for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
            if line.startswith("llmendpoints_requests_in_flight "):
                total += float(line.rsplit(" ", 1)[1])
    return int(total)


def wait_idle(pods: list[str], timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while engine_running(pods) and time.monotonic() < deadline:
        time.sleep(0.2)


async def interactive_burst(url: str, requests: int, tokens: int, concurrency: int) -> float:
    """The batch's requests sent as interactive ones, ``concurrency`` at a time: seconds."""
    headers = {"authorization": f"Bearer {KEY}"}
    semaphore = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 2)
    async with httpx.AsyncClient(
        base_url=url, timeout=600, headers=headers, limits=limits
    ) as client:

        async def one(i: int) -> None:
            async with semaphore:
                response = await client.post("/v1/chat/completions", json=chat_body(i, tokens))
                response.raise_for_status()

        begun = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(requests)))
        return time.perf_counter() - begun


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=20.0, help="interactive load per phase")
    parser.add_argument("--concurrency", type=int, default=4, help="interactive clients")
    parser.add_argument("--interactive-tokens", type=int, default=16)
    parser.add_argument("--batch-requests", type=int, default=2000)
    parser.add_argument(
        "--batch-tokens", type=int, default=128, help="tokens each batch request generates"
    )
    parser.add_argument("--throughput-requests", type=int, default=300)
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--max-share", type=float, default=None, help="LLMEP_BATCH_MAX_SHARE")
    args = parser.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="batch-bench-"))
    from llmendpoints_runtime.demo import write_demo_model

    model = write_demo_model(tmp / "model")
    nats = NatsServer(store_dir=tmp / "nats", log_path=tmp / "nats.log")
    servers: list = []
    try:
        nats.start()
        extra = {"LLMEP_BATCH_MAX_SHARE": str(args.max_share)} if args.max_share else {}
        replicas = [
            launch_runtime(
                model,
                tmp,
                JOBS_QUEUE_URL=nats.url,
                ENDPOINT_ID=ENDPOINT,
                MAX_NUM_SEQS=str(args.max_num_seqs),
                LLMEP_LOG_LEVEL="warning",
                **extra,
            )
            for _ in range(args.replicas)
        ]
        servers += replicas
        for replica in replicas:
            replica.wait_http("/ready?strict=1", timeout=900)
        pods = [replica.url for replica in replicas]
        endpoints = tmp / "endpoints.yaml"
        endpoints.write_text(
            yaml.safe_dump(
                {
                    "endpoints": [{"name": ENDPOINT, "models": [MODEL], "backends": pods}],
                    "apiKeys": [{"name": "bench", "key": KEY}],
                }
            )
        )
        gateway = launch_gateway(
            tmp,
            GATEWAY_ENDPOINTS_FILE=str(endpoints),
            JOBS_QUEUE_URL=nats.url,
            LLMEP_LOG_LEVEL="warning",
        )
        servers.append(gateway)
        gateway.wait_http("/health")
        url = gateway.url
        batches = Batches(url)
        deadline = time.monotonic() + 60
        while (
            httpx.get(url + "/v1/batches", headers={"authorization": f"Bearer {KEY}"}).status_code
            != 200
        ):
            assert time.monotonic() < deadline, "the gateway's batch API never came up"
            time.sleep(0.2)
        asyncio.run(interactive(url, args.concurrency, 3, args.interactive_tokens))  # warm-up

        # 1. interactive alone / with a batch running
        phases: dict[str, list[dict]] = {"alone": [], "with batch": []}
        batch_rates = []
        for number in range(args.rounds):
            order = ["alone", "with batch"] if number % 2 == 0 else ["with batch", "alone"]
            for side in order:
                wait_idle(pods)
                if side == "alone":
                    phases[side].append(
                        asyncio.run(
                            interactive(
                                url, args.concurrency, args.seconds, args.interactive_tokens
                            )
                        )
                    )
                    continue
                batch_id = batches.create(args.batch_requests, args.batch_tokens)
                batches.wait(batch_id, {"in_progress"})
                # Under way: requests answered, and the engine running some.
                deadline = time.monotonic() + 120
                while time.monotonic() < deadline and not (
                    batches.get(batch_id)["request_counts"]["completed"] > 0
                    and engine_running(pods) > 0
                ):
                    time.sleep(0.1)
                before = batches.get(batch_id)["request_counts"]["completed"]
                started = time.perf_counter()
                result = asyncio.run(
                    interactive(url, args.concurrency, args.seconds, args.interactive_tokens)
                )
                after = batches.get(batch_id)
                if after["status"] != "in_progress":
                    raise RuntimeError(
                        f"the batch ended before the interactive phase did ({after['status']}): "
                        "raise --batch-requests"
                    )
                during = after["request_counts"]["completed"] - before
                result["batch_rps_meanwhile"] = during / (time.perf_counter() - started)
                batch_rates.append(result["batch_rps_meanwhile"])
                phases[side].append(result)
                batches.cancel(batch_id)
                batches.wait(batch_id, {"cancelled", "completed"})

        # 2. a batch on an idle endpoint vs the same requests sent interactively
        throughput: dict[str, list[float]] = {"batch": [], "interactive": []}
        for number in range(args.rounds):
            order = ["batch", "interactive"] if number % 2 == 0 else ["interactive", "batch"]
            for side in order:
                wait_idle(pods)
                if side == "batch":
                    begun = time.perf_counter()
                    batch_id = batches.create(args.throughput_requests, args.batch_tokens)
                    done = batches.wait(batch_id, {"completed", "failed"})
                    assert done["request_counts"]["completed"] == args.throughput_requests, done
                    seconds = time.perf_counter() - begun
                else:
                    seconds = asyncio.run(
                        interactive_burst(
                            url,
                            args.throughput_requests,
                            args.batch_tokens,
                            args.max_num_seqs * args.replicas,
                        )
                    )
                throughput[side].append(args.throughput_requests / seconds)
    finally:
        for server in reversed(servers):
            server.stop()
        nats.stop()

    def median(side: str, key: str) -> float:
        return statistics.median(r[key] for r in phases[side])

    ratio_p50 = median("with batch", "ttft_p50_ms") / median("alone", "ttft_p50_ms")
    ratio_p99 = median("with batch", "ttft_p99_ms") / median("alone", "ttft_p99_ms")
    ratio_tput = statistics.median(throughput["batch"]) / statistics.median(
        throughput["interactive"]
    )
    report = {
        "args": vars(args),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "interactive": phases,
        "throughput_rps": throughput,
        "ratios": {
            "ttft_p50": ratio_p50,
            "ttft_p99": ratio_p99,
            "batch_vs_interactive": ratio_tput,
        },
    }
    out = REPO / "bench" / "out"
    out.mkdir(exist_ok=True)
    (out / "batch.json").write_text(json.dumps(report, indent=2))
    print(
        f"\n{len(phases['alone'])} rounds, {args.concurrency} interactive clients, "
        f"{args.replicas} replica(s), MAX_NUM_SEQS {args.max_num_seqs}, "
        f"LLMEP_BATCH_MAX_SHARE {args.max_share or 'default'}\n"
    )
    print(
        "| interactive | TTFT p50 ms | TTFT p99 ms | latency p50 ms | requests/s "
        "| batch requests/s meanwhile |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for side in ("alone", "with batch"):
        meanwhile = f"{statistics.median(batch_rates):.1f}" if side == "with batch" else "-"
        print(
            f"| {side} | {median(side, 'ttft_p50_ms'):.1f} | {median(side, 'ttft_p99_ms'):.1f} | "
            f"{median(side, 'latency_p50_ms'):.1f} | "
            f"{median(side, 'rps'):.2f} | {meanwhile} |"
        )
    print(
        f"\nTTFT with / without the batch: p50 {ratio_p50:.2f}x (target <= 1.2x), p99 {ratio_p99:.2f}x\n"
    )
    print("| the same requests | requests/s (per round) | median |")
    print("| --- | --- | --- |")
    for side in ("batch", "interactive"):
        rounds = ", ".join(f"{v:.1f}" for v in throughput[side])
        print(f"| as {side} | {rounds} | {statistics.median(throughput[side]):.1f} |")
    print(f"\nbatch / interactive: {ratio_tput:.2f}x (target >= 0.9x)")


if __name__ == "__main__":
    main()
