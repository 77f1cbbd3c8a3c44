"""Per-key limits and metering at the gateway: limiter cost, overshoot across replicas, metering
accuracy. No engine: a real nats-server, real gateway processes, stand-in upstreams
(bench/gateway_standin.py, which reports usage as vLLM does and counts what it reported).

    .venv/bin/python bench/quotas.py                 # all parts, ~2-3 min on 2 cores
    .venv/bin/python bench/quotas.py --part cost --requests 5000
    .venv/bin/python bench/quotas.py --part overshoot --rounds 3
    .venv/bin/python bench/quotas.py --part metering

Part ``cost``: the limiter (gateway/llmendpoints_gateway/limiter.py) in one process against the
real nats-server: the time of ``admit`` + ``finish`` per request, sequential, for a key without
limits (no NATS), a key with limits on one replica's own state (no NATS), a key with
requestsPerMinute + tokensPerMinute shared through NATS (mostly admitted from the replica's
reservation, no round trip), the same key admitted as the gateway admits a chat request
(reserving its prompt estimate + max_tokens of tokensPerMinute, where the code does: a write per
admission), and one that also has maxConcurrent (a lease: one compare-and-set round trip per
request); also bucket round trips per request (admission + the background release / token
charge). With PYTHONPATH pointing at an older checkout, the same part measures that code. Then the same through a real gateway process: median end-to-end
latency of each limited key minus the unlimited one, alternating (the limiter's share of a
proxied request).

Part ``overshoot``: 200 concurrent requests of one key with ``requestsPerMinute: 60`` spread
over 2 gateway processes sharing the nats-server, inside one minute window: how many were
admitted (target: 60, overshoot 0); the same with ``tokensPerMinute: 960`` (requests reserving
16 tokens, using 11): the tokens the upstream reported against the limit; and ``maxConcurrent: 4`` with 200 concurrent slow streams:
the most streams the upstream ever saw open at once for that key.

Part ``metering``: N requests (non-streamed, streamed without and with include_usage) over both
gateways: the tokens counted by ``llmendpoints_gateway_key_tokens_total``, and by the usage export,
against the tokens the upstream reported.

Results: a Markdown section on stdout and bench/out/quotas.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import inspect
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import yaml

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "bench" / "out"
# The tests' kits (tests/conftest.py puts the same two folders on the path).
sys.path[:0] = [str(REPO / "tests"), str(REPO / "tests" / "runtime")]

from gateway.harness import Process, launch_gateway, launch_standin  # noqa: E402
from integration.nats_kit import nats_server  # noqa: E402

CHAT = "/v1/chat/completions"
BODY = {"model": "demo", "messages": [{"role": "user", "content": "one two three"}]}
# What the gateway reserves of tokensPerMinute for BODY (metering.metered_request): the prompt
# estimate (13 characters / 4 + 4 tokens for the message) + GATEWAY_DEFAULT_MAX_TOKENS (1024).
CHAT_RESERVATION = 8 + 1024
# overshoot: the tokensPerMinute of the burst's key (60 requests' reservations of 16 tokens)
TPM_LIMIT = 60 * 16


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


# ------------------------------------------------------------------ part: cost (in process)


async def limiter_cost(url: str, requests: int) -> dict:
    from llmendpoints_gateway.keys import Key
    from llmendpoints_gateway.limiter import Limiter
    from llmendpoints_gateway.quotas import Limits

    # Older code (PYTHONPATH) has no shared queue object: its limiter opened its own NATS
    # connection from a URL. (Not an ImportError test: this venv's editable install would
    # supply this checkout's module to the older package.)
    shares_queue = "queue" in inspect.signature(Limiter.__init__).parameters
    # Newer code reserves a request's tokens of tokensPerMinute at admission (the gateway passes
    # prompt estimate + n x max_tokens); older code took no such argument.
    reserves = "tokens" in inspect.signature(Limiter.admit).parameters

    rates = Limits(requests_per_minute=10**9, tokens_per_minute=10**12)
    every = Limits(requests_per_minute=10**9, tokens_per_minute=10**12, max_concurrent=10**6)
    results = {}
    for label, key, shared, tokens in [
        ("no limits", Key("free"), False, 0),
        ("rpm+tpm+maxConcurrent, this replica's own state", Key("local", limits=every), False, 0),
        ("rpm+tpm, shared through NATS", Key("rates", limits=rates), True, 0),
        (
            "rpm+tpm, shared through NATS, admitted as the gateway admits BODY",
            Key("chat", limits=rates),
            True,
            CHAT_RESERVATION,
        ),
        ("rpm+tpm+maxConcurrent, shared through NATS", Key("every", limits=every), True, 0),
    ]:
        if not shares_queue:
            queue = None
            limiter = Limiter("bench", url if shared else None)
        else:
            from llmendpoints_gateway.queue import SharedQueue

            queue = SharedQueue(url, "bench") if shared else None
            if queue is not None:
                await queue.start()
            limiter = Limiter("bench", queue)
        reserve = {"tokens": tokens} if reserves and tokens else {}
        await limiter.start()
        if shared:
            deadline = time.monotonic() + 20
            while not limiter.shared:
                assert time.monotonic() < deadline, "the limiter did not connect"
                await asyncio.sleep(0.05)
        for _ in range(200):  # warm-up
            limiter.finish(await limiter.admit(key, **reserve), 11)
        await asyncio.sleep(0.2)
        trips_before = limiter.round_trips
        local_before = limiter.local_admissions
        settled_before = getattr(limiter, "local_settlements", 0)
        times = []
        for _ in range(requests):
            started = time.perf_counter()
            ticket = await limiter.admit(key, **reserve)
            limiter.finish(ticket, 11)
            times.append((time.perf_counter() - started) * 1e6)
            if limiter._background:
                await asyncio.wait(limiter._background)  # release lands before the next one
        await limiter.stop()
        if queue is not None:
            await queue.stop()
        results[label] = {
            "tokens_reserved_at_admission": reserve.get("tokens", 0),
            "admitted_without_round_trip": limiter.local_admissions - local_before,
            # settled in the replica's token allowance (older code: no such path)
            "settled_without_round_trip": getattr(limiter, "local_settlements", 0) - settled_before,
            "p50_us": round(statistics.median(times), 1),
            "p99_us": round(pct(times, 0.99), 1),
            # admit (on the request path) + the lease release and token charge (after it)
            "bucket_round_trips_per_request": round(
                (limiter.round_trips - trips_before) / requests, 2
            ),
        }
    return results


# ------------------------------------------------------------------ helpers: processes


@contextlib.contextmanager
def fleet(log_dir: Path, url: str, api_keys: list[dict], gateways: int = 2) -> Iterator[tuple]:
    standin = launch_standin(log_dir, "up")
    standin.wait_http("/ready")
    path = log_dir / "endpoints.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "endpoints": [{"name": "demo", "models": ["demo"], "backends": [standin.url]}],
                "apiKeys": api_keys,
            }
        )
    )
    procs: list[Process] = []
    try:
        for i in range(gateways):
            procs.append(
                launch_gateway(
                    log_dir,
                    GATEWAY_ENDPOINTS_FILE=str(path),
                    JOBS_QUEUE_URL=url,
                    GATEWAY_ID=f"bench{i}",
                    LLMEP_LOG_LEVEL="warning",
                    LOG_LEVEL="warning",  # the same, for an older gateway (PYTHONPATH)
                    GATEWAY_METRICS_KEY_LABELS="1",  # counted per key below
                )
            )
        for proc in procs:
            proc.wait_http("/health")
            auth = {"Authorization": f"Bearer {api_keys[0]['key']}"}
            deadline = time.monotonic() + 30
            while True:
                models = httpx.get(proc.url + "/v1/models", headers=auth).json()["data"]
                if models and models[0]["ready_replicas"] == 1:
                    break
                assert time.monotonic() < deadline, "the gateway did not see the stand-in"
                time.sleep(0.1)
        time.sleep(2.0)  # the limiters' NATS connections
        yield standin, procs
    finally:
        for proc in procs:
            proc.stop()
        standin.stop()


def fresh_window(margin: float = 25.0) -> None:
    left = 60 - time.time() % 60
    if left < margin:
        time.sleep(left + 0.3)


# ------------------------------------------------------------------ part: cost (through a gateway)


def gateway_cost(log_dir: Path, url: str, requests: int) -> dict:
    rates = {"requestsPerMinute": 10**9, "tokensPerMinute": 10**12}
    keys = [
        {"name": "free", "key": "sk-free"},
        {"name": "rates", "key": "sk-rates", "limits": rates},
        {"name": "every", "key": "sk-every", "limits": {**rates, "maxConcurrent": 10**6}},
    ]
    names = [k["name"] for k in keys]
    body = {**BODY, "standin_chunks": 1, "standin_interval": 0}
    with fleet(log_dir, url, keys, gateways=1) as (_, (gw,)):
        times: dict[str, list[float]] = {n: [] for n in names}
        with httpx.Client(base_url=gw.url, timeout=30) as client:
            for i in range(requests * 3 + 300):
                name = names[i % 3]
                started = time.perf_counter()
                answer = client.post(
                    CHAT, json=body, headers={"Authorization": f"Bearer sk-{name}"}
                )
                elapsed = (time.perf_counter() - started) * 1e6
                assert answer.status_code == 200, answer.text
                if i >= 300:
                    times[name].append(elapsed)
    free = statistics.median(times["free"])
    out: dict = {"requests_each": requests, "median_us_no_limits": round(free)}
    for name in names[1:]:
        out[f"added_median_us_{name}"] = round(statistics.median(times[name]) - free)
    return out


# ------------------------------------------------------------------ part: overshoot


async def _burst(urls: list[str], key: str, n: int, body: dict) -> list[int]:
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:

        async def one(i: int) -> int:
            answer = await client.post(
                urls[i % len(urls)] + CHAT, json=body, headers={"Authorization": f"Bearer {key}"}
            )
            return answer.status_code

        return await asyncio.gather(*(one(i) for i in range(n)))


def overshoot(log_dir: Path, url: str, rounds: int, concurrency: int) -> dict:
    keys = (
        [
            {"name": f"rpm{r}", "key": f"sk-rpm-{r}", "limits": {"requestsPerMinute": 60}}
            for r in range(rounds)
        ]
        + [
            {"name": f"tpm{r}", "key": f"sk-tpm-{r}", "limits": {"tokensPerMinute": TPM_LIMIT}}
            for r in range(rounds)
        ]
        + [{"name": "conc", "key": "sk-conc", "limits": {"maxConcurrent": 4}}]
    )
    out: dict = {"requestsPerMinute": [], "tokensPerMinute": [], "maxConcurrent": None}
    with fleet(log_dir, url, keys) as (standin, procs):
        urls = [p.url for p in procs]
        for r in range(rounds):
            fresh_window()
            started = time.perf_counter()
            codes = asyncio.run(_burst(urls, f"sk-rpm-{r}", concurrency, BODY))
            out["requestsPerMinute"].append(
                {
                    "sent": concurrency,
                    "admitted": codes.count(200),
                    "refused_429": codes.count(429),
                    "other": len(codes) - codes.count(200) - codes.count(429),
                    "overshoot": codes.count(200) - 60,
                    "seconds": round(time.perf_counter() - started, 2),
                }
            )
        # tokensPerMinute: each request reserves 16 (max_tokens 8 + its prompt's estimate 8)
        # and uses 11 (the stand-in's 3 prompt words + 8 chunks); reservations come back as
        # requests end, so more than TPM_LIMIT / 16 may be admitted. Overshoot: the tokens the
        # upstream reported for the burst beyond the limit.
        small = {**BODY, "max_tokens": 8}
        for r in range(rounds):
            fresh_window()
            before = httpx.get(standin.url + "/stats").json()
            started = time.perf_counter()
            codes = asyncio.run(_burst(urls, f"sk-tpm-{r}", concurrency, small))
            seconds = time.perf_counter() - started
            time.sleep(0.5)  # the settlements written in the background
            after = httpx.get(standin.url + "/stats").json()
            used = sum(after[k] - before[k] for k in ("prompt_tokens", "completion_tokens"))
            out["tokensPerMinute"].append(
                {
                    "limit": TPM_LIMIT,
                    "sent": concurrency,
                    "admitted": codes.count(200),
                    "refused_429": codes.count(429),
                    "other": len(codes) - codes.count(200) - codes.count(429),
                    "tokens_used": used,
                    "overshoot_tokens": max(0, used - TPM_LIMIT),
                    "left_unused": max(0, TPM_LIMIT - used),
                    "seconds": round(seconds, 2),
                }
            )
        # Concurrency: slow streams; the stand-in's "open" gauge, sampled while they run.
        slow = {**BODY, "stream": True, "standin_chunks": 40, "standin_interval": 0.05}
        peak = 0
        done = False

        def sample() -> None:
            nonlocal peak
            with httpx.Client(timeout=5) as client:
                while not done:
                    peak = max(peak, client.get(standin.url + "/stats").json()["open"])
                    time.sleep(0.005)

        import threading

        sampler = threading.Thread(target=sample)
        sampler.start()
        try:
            codes = asyncio.run(_burst(urls, "sk-conc", concurrency, slow))
        finally:
            done = True
            sampler.join()
        out["maxConcurrent"] = {
            "limit": 4,
            "sent": concurrency,
            "admitted": codes.count(200),
            "peak_open_upstream": peak,
        }
    return out


# ------------------------------------------------------------------ part: metering


def metering(log_dir: Path, url: str, requests: int) -> dict:
    keys = [{"name": "meter", "key": "sk-meter"}]
    with fleet(log_dir, url, keys) as (standin, procs):
        bodies = [
            {**BODY, "standin_chunks": 5},
            {**BODY, "stream": True, "standin_chunks": 7},
            {
                **BODY,
                "stream": True,
                "stream_options": {"include_usage": True},
                "standin_chunks": 3,
            },
        ]

        async def run() -> None:
            async with httpx.AsyncClient(timeout=60) as client:
                sem = asyncio.Semaphore(32)

                async def one(i: int) -> None:
                    async with sem:
                        answer = await client.post(
                            procs[i % 2].url + CHAT,
                            json=bodies[i % 3],
                            headers={"Authorization": "Bearer sk-meter"},
                        )
                        assert answer.status_code == 200, answer.text

                await asyncio.gather(*(one(i) for i in range(requests)))

        since = time.time() - 1
        asyncio.run(run())
        time.sleep(1.0)
        reported = httpx.get(standin.url + "/stats").json()

        def counted(kind: str) -> int:
            total = 0.0
            for proc in procs:
                for line in httpx.get(proc.metrics_url).text.splitlines():
                    if line.startswith("llmendpoints_gateway_key_tokens_total{") and (
                        f'kind="{kind}"' in line and 'key="meter"' in line
                    ):
                        total += float(line.rsplit(" ", 1)[1])
            return int(total)

        env = {**os.environ, "JOBS_QUEUE_URL": url}
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(since))
        export = subprocess.run(
            [sys.executable, "-m", "llmendpoints_gateway", "usage", "--since", stamp, "--format", "json"],
            env=env, capture_output=True, text=True, timeout=120, check=True,
        )  # fmt: skip
        rows = [r for r in json.loads(export.stdout) if r["key"] == "meter"]
        return {
            "requests": requests,
            "upstream_reported": {
                "prompt": reported["prompt_tokens"],
                "completion": reported["completion_tokens"],
            },
            "metrics": {"prompt": counted("prompt"), "completion": counted("completion")},
            "export": {
                "requests": sum(r["requests"] for r in rows),
                "prompt": sum(r["prompt_tokens"] for r in rows),
                "completion": sum(r["completion_tokens"] for r in rows),
            },
        }


# ------------------------------------------------------------------ main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("all", "cost", "overshoot", "metering"), default="all")
    parser.add_argument("--requests", type=int, default=2000, help="cost: requests per variant")
    parser.add_argument("--rounds", type=int, default=2, help="overshoot: bursts (one minute each)")
    parser.add_argument("--concurrency", type=int, default=200)
    parser.add_argument("--metered", type=int, default=600, help="metering: requests")
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    log_dir = OUT / "quotas"
    log_dir.mkdir(exist_ok=True)
    results: dict = {}
    with nats_server() as url:
        if args.part in ("all", "cost"):
            results["limiter_in_process"] = asyncio.run(limiter_cost(url, args.requests))
            results["through_gateway"] = gateway_cost(log_dir, url, args.requests // 2)
        if args.part in ("all", "overshoot"):
            results["overshoot"] = overshoot(log_dir, url, args.rounds, args.concurrency)
        if args.part in ("all", "metering"):
            results["metering"] = metering(log_dir, url, args.metered)
    (OUT / "quotas.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
