"""Through the gateway vs straight to the runtime, and prefix-aware vs round-robin routing.

    .venv/bin/python bench/gateway_vs_direct.py                   # both parts, ~10 min on 2 cores
    .venv/bin/python bench/gateway_vs_direct.py --part overhead --rounds 3
    .venv/bin/python bench/gateway_vs_direct.py --part prefix
    # The gateway with 2 worker processes, and main's gateway (the tree at a git ref) to compare:
    .venv/bin/python bench/gateway_vs_direct.py --part overhead --workers 2
    .venv/bin/python bench/gateway_vs_direct.py --part overhead --gateway-ref main
    # ... and an older checkout's gateway next to it in every round:
    .venv/bin/python bench/gateway_vs_direct.py --part overhead --rounds 3 --before /old/checkout

Part ``overhead``: one runtime (demo model), one gateway in front of it (static endpoints file).
vLLM's own benchmark client (as in bench/runtime_vs_vllm.py: random dataset, streamed
/v1/completions, --ignore-eos) alternates direct, gateway, direct, gateway... Reported: request
throughput ratio gateway/direct (target >= 0.97), median TTFT added by the gateway (target
<= 2 ms), the gateway's CPU per proxied request (every process of it: with GATEWAY_WORKERS > 1
the supervisor and its workers), and the runtime's API process's CPU for the same requests (the
runtime's own process, not its engine core): the gateway/runtime-API ratio (issue 23's goal:
<= 0.10). ``--before PATH`` puts a second gateway, of an older checkout's code (its gateway/ and
common/ first on PYTHONPATH), in front of the same runtime and adds it to every round (the two
gateways' order swapped every other round): the same measures for both codes, in one run.

Part ``prefix``: two runtimes with prefix caching; a multi-turn chat load (conversations sharing
one long system prompt, each turn resending the whole history) through the gateway, once with the
endpoint on ``prefix-aware`` and once on ``round-robin`` (a fresh system prompt per run, so the
first run does not warm the second). Reported: vLLM's own prefix-cache hit rate
(vllm:prefix_cache_hits / vllm:prefix_cache_queries, summed over both replicas) and the median
TTFT for each.

Results: bench/out/gateway_vs_direct.json and a Markdown section on stdout (for bench/RESULTS.md).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import httpx
import psutil
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import runtime_vs_vllm as rv

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "bench" / "out"


def source_tree(ref: str | None) -> Path:
    """The repository's Python packages at git ``ref`` (None: this checkout), for PYTHONPATH: a
    bench can run main's gateway next to this branch's."""
    if ref is None:
        return REPO
    commit = subprocess.run(
        ["git", "rev-parse", "--short", ref], cwd=REPO, check=True, capture_output=True, text=True
    ).stdout.strip()
    tree = OUT / "trees" / commit
    if not (tree / "gateway").exists():
        tree.mkdir(parents=True, exist_ok=True)
        # Only the folders the ref has: an older one has no edge/.
        folders = subprocess.run(
            ["git", "ls-tree", "--name-only", commit, "gateway", "common", "edge"],
            cwd=REPO,
            check=True,
            capture_output=True,
            text=True,
        ).stdout.split()
        archive = subprocess.run(
            ["git", "archive", commit, *folders],
            cwd=REPO,
            check=True,
            capture_output=True,
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    return tree


def wait_port(port: int, timeout: float = 30.0) -> None:
    """Until something listens on 127.0.0.1:port."""
    import socket

    deadline = time.monotonic() + timeout
    while True:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        assert time.monotonic() < deadline, f"nothing listens on port {port}"
        time.sleep(0.1)


def cpu_tree(pid: int) -> float:
    """CPU seconds of a process and all its descendants (a gateway's supervisor and workers)."""
    total = 0.0
    main = psutil.Process(pid)
    for process in [main, *main.children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess):
            times = process.cpu_times()
            total += times.user + times.system
    return total


@contextlib.contextmanager
def gateway(
    endpoints: list[dict],
    log_path: Path,
    *,
    workers: int = 1,
    ref: str | None = None,
    code: Path | None = None,
    extra_env: dict[str, str] | None = None,
) -> Iterator[tuple[str, int]]:
    """A gateway over static ``endpoints``: this checkout's, the one at git ``ref``, or the
    one of the checkout ``code``."""
    port = rv.free_port()
    config = log_path.with_suffix(".yaml")
    config.write_text(yaml.safe_dump({"endpoints": endpoints}))
    tree = code if code is not None else source_tree(ref)
    env = {
        **os.environ,
        "GATEWAY_ENDPOINTS_FILE": str(config),
        "PORT": str(port),
        "HOST": "127.0.0.1",
        "LLMEP_LOG_LEVEL": "warning",
        "LOG_LEVEL": "warning",  # the same, for an older gateway
        "GATEWAY_REQUIRE_KEYS": "false",  # the replicas are open: a bench of routing
        "GATEWAY_METRICS_PORT": "0",
        "GATEWAY_WORKERS": str(workers),
        "PYTHONPATH": os.pathsep.join(
            str(tree / p) for p in ("gateway", "common", "edge") if (tree / p).is_dir()
        ),
        **(extra_env or {}),
    }
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "llmendpoints_gateway", "serve"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
        )
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 60
            while True:
                assert time.monotonic() < deadline, f"gateway not ready; see {log_path}"
                with contextlib.suppress(httpx.TransportError):
                    models = httpx.get(url + "/v1/models", timeout=2).json()["data"]
                    if all(m["ready_replicas"] > 0 for m in models):
                        break
                time.sleep(0.2)
            yield url, process.pid
        finally:
            process.terminate()
            process.wait(30)


def overhead(args, model: Path, out: Path) -> dict:
    load = rv.Load(
        num_prompts=args.num_prompts,
        input_len=128,
        output_len=32,
        concurrency=args.concurrency,
        warmups=8,
        seed=0,
    )
    gateways = ["gateway", "gateway-before"] if args.before is not None else ["gateway"]
    runs: dict[str, list[dict]] = {side: [] for side in ["direct", *gateways]}
    with contextlib.ExitStack() as stack:
        runtime = stack.enter_context(rv.running_server(rv.OURS, model, out / "runtime.log"))
        endpoints = [{"name": "demo", "models": [rv.SERVED_NAME], "backends": [runtime.url]}]
        urls, pids = {"direct": runtime.url}, {}
        for side in gateways:
            urls[side], pids[side] = stack.enter_context(
                gateway(
                    endpoints,
                    out / f"{side}.log",
                    workers=args.workers,
                    ref=args.gateway_ref,
                    code=args.before.resolve() if side == "gateway-before" else None,
                )
            )
        requests = load.num_prompts + load.warmups
        # What each costs with no request at all (the gateway's probes and engine-load reads,
        # the runtime's answers to them), per second: taken off each run's CPU, so that the
        # client's own start-up time in each run does not count as request work.
        time.sleep(2)
        idle_started, api_idle0 = time.perf_counter(), runtime.cpu()
        gw_idle0 = {side: cpu_tree(pid) for side, pid in pids.items()}
        time.sleep(args.idle_seconds)
        idle_wall = time.perf_counter() - idle_started
        gw_idle = {side: (cpu_tree(pid) - gw_idle0[side]) / idle_wall for side, pid in pids.items()}
        api_idle = (runtime.cpu() - api_idle0).api_seconds / idle_wall
        print(f"  idle: gateways {gw_idle} cores, runtime API {api_idle * 100:.2f}% of a core")
        for round_ in range(args.rounds):
            for side in ["direct", *(gateways if round_ % 2 == 0 else gateways[::-1])]:
                pid = pids.get(side)
                before, runtime_before = (cpu_tree(pid) if pid else 0.0), runtime.cpu()
                started = time.perf_counter()
                data = rv.run_client(
                    urls[side],
                    model,
                    load,
                    out,
                    f"{side}-{round_}.json",
                    out / f"{side}-{round_}.log",
                )
                wall = time.perf_counter() - started
                gw_cpu = cpu_tree(pid) - before - gw_idle[side] * wall if pid else 0.0
                api_cpu = (runtime.cpu() - runtime_before).api_seconds - api_idle * wall
                runs[side].append(
                    {
                        "request_throughput": data["request_throughput"],
                        "median_ttft_ms": data["median_ttft_ms"],
                        "completed": data["completed"],
                        "failed": data.get("failed", 0),
                        "gateway_cpu_ms_per_request": gw_cpu * 1000 / requests,
                        "runtime_api_cpu_ms_per_request": api_cpu * 1000 / requests,
                    }
                )
                print(f"  round {round_} {side}: {runs[side][-1]}", flush=True)
    result: dict = {"load": load.__dict__, "runs": runs}
    for side in gateways:
        result |= gateway_summary(
            runs["direct"], runs[side], "" if side == "gateway" else "_before"
        )
    return result | {
        "idle_cpu_per_s": {**gw_idle, "runtime_api": api_idle},
        "workers": args.workers,
        "gateway_ref": args.gateway_ref or "this checkout",
        "before": str(args.before) if args.before is not None else None,
        "failed": sum(r["failed"] for side in runs.values() for r in side),
    }


def gateway_summary(direct: list[dict], through: list[dict], suffix: str) -> dict:
    """One gateway's rounds against the direct ones (pure): medians of the per-round ratios,
    its CPU per request, and that over the runtime API process's; keys end with ``suffix``."""
    ratios = [
        g["request_throughput"] / d["request_throughput"]
        for d, g in zip(direct, through, strict=True)
    ]
    added = [
        g["median_ttft_ms"] - d["median_ttft_ms"] for d, g in zip(direct, through, strict=True)
    ]
    cpu = [r["gateway_cpu_ms_per_request"] for r in through]
    return {
        f"throughput_ratio_median{suffix}": statistics.median(ratios),
        f"throughput_ratios{suffix}": ratios,
        f"ttft_added_ms_median{suffix}": statistics.median(added),
        f"ttft_added_ms{suffix}": added,
        f"gateway_cpu_ms_per_request{suffix}": statistics.median(cpu),
        f"gateway_cpu_ms_per_request_rounds{suffix}": cpu,
        f"runtime_api_cpu_ms_per_request{suffix}": statistics.median(
            r["runtime_api_cpu_ms_per_request"] for r in through
        ),
        # The same requests: the gateway's CPU over the runtime API process's, per round.
        f"gateway_to_runtime_api_cpu{suffix}": [
            r["gateway_cpu_ms_per_request"] / r["runtime_api_cpu_ms_per_request"] for r in through
        ],
    }


def vllm_counter(url: str, name: str) -> float:
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def conversations(
    url: str, model: str, system: str, n: int, turns: int, concurrency: int
) -> list[float]:
    """Multi-turn chats sharing ``system``; returns the TTFT (s) of every request."""
    ttfts: list[float] = []
    limit = asyncio.Semaphore(concurrency)

    async def chat(session, c: int):
        messages = [
            {"role": "system", "content": system},
            {"role": "user", "content": f"Conversation {c}: hello."},
        ]
        for t in range(turns):
            async with limit:
                started = time.perf_counter()
                first = None
                text = []
                body = {
                    "model": model,
                    "messages": messages,
                    "max_tokens": 8,
                    "stream": True,
                    "ignore_eos": True,
                }
                async with session.post(url + "/v1/chat/completions", json=body) as r:
                    assert r.status == 200, await r.text()
                    async for line in r.content:
                        if line.startswith(b"data: {"):
                            if first is None:
                                first = time.perf_counter() - started
                            delta = json.loads(line[6:])["choices"][0]["delta"].get("content")
                            text.append(delta or "")
                ttfts.append(first)
            messages += [
                {"role": "assistant", "content": "".join(text)},
                {"role": "user", "content": f"And then {t}?"},
            ]

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        await asyncio.gather(*(chat(session, c) for c in range(n)))
    return ttfts


def prefix(args, model: Path, out: Path) -> dict:
    served = f"{rv.SERVED_NAME} {rv.SERVED_NAME}-rr"
    results = {}
    with contextlib.ExitStack() as stack:
        starting = []
        for i in range(2):  # started together, waited for together
            port = rv.free_port()
            argv, env = rv.server_command(rv.OURS, model, port)
            env.pop("OPENAI_SERVED_MODEL_NAME_OVERRIDE")
            # A long shared system prompt (~530 demo-tokenizer tokens) plus the turns.
            env.update(SERVED_MODEL_NAME=served, ENABLE_PREFIX_CACHING="true", MAX_MODEL_LEN="2048")
            starting.append(
                stack.enter_context(_process(argv, env, port, out / f"replica-{i}.log"))
            )
        replicas = [next(waiter) for waiter in starting]
        gw_url, _ = stack.enter_context(
            gateway(
                [
                    {
                        "name": "pa",
                        "models": [rv.SERVED_NAME],
                        "backends": replicas,
                        "routing": "prefix-aware",
                    },
                    {
                        "name": "rr",
                        "models": [f"{rv.SERVED_NAME}-rr"],
                        "backends": replicas,
                        "routing": "round-robin",
                    },
                ],
                out / "gateway-prefix.log",
            )
        )
        rng = random.Random(0)
        for strategy, model_name in (
            ("round-robin", f"{rv.SERVED_NAME}-rr"),
            ("prefix-aware", rv.SERVED_NAME),
        ):
            words = " ".join(
                rng.choice(["alpha", "beta", "gamma", "delta", "omega", "sigma"])
                for _ in range(120)
            )
            system = f"You are assistant {strategy}. Rules: {words}."
            hits0 = sum(vllm_counter(r, "vllm:prefix_cache_hits_total") for r in replicas)
            queries0 = sum(vllm_counter(r, "vllm:prefix_cache_queries_total") for r in replicas)
            ttfts = asyncio.run(
                conversations(gw_url, model_name, system, args.conversations, args.turns, 8)
            )
            hits = sum(vllm_counter(r, "vllm:prefix_cache_hits_total") for r in replicas) - hits0
            queries = (
                sum(vllm_counter(r, "vllm:prefix_cache_queries_total") for r in replicas) - queries0
            )
            results[strategy] = {
                "prefix_cache_hit_rate": hits / queries if queries else 0.0,
                "median_ttft_ms": statistics.median(ttfts) * 1000,
                "requests": len(ttfts),
            }
            print(f"  {strategy}: {results[strategy]}", flush=True)
    return results


@contextlib.contextmanager
def _process(argv, env, port, log_path) -> Iterator[Iterator[str]]:
    """Start a runtime; yields a one-item iterator that waits for it to be ready (so several
    can start at once)."""
    with log_path.open("wb") as log:
        process = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        url = f"http://127.0.0.1:{port}"

        def ready() -> Iterator[str]:
            deadline = time.monotonic() + 900
            while True:
                assert process.poll() is None, f"runtime exited; see {log_path}"
                assert time.monotonic() < deadline, f"runtime not ready; see {log_path}"
                with contextlib.suppress(httpx.TransportError):
                    if httpx.get(url + "/ready?strict=1", timeout=2).status_code == 200:
                        break
                time.sleep(0.5)
            yield url

        try:
            yield ready()
        finally:
            process.terminate()
            process.wait(60)


def markdown(result: dict, argv: list[str]) -> str:
    lines = [
        f"### Gateway vs direct, and prefix-aware vs round-robin ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})",
        "",
        f"`.venv/bin/python bench/gateway_vs_direct.py {' '.join(argv)}` on {os.cpu_count()} shared cores.",
        "",
    ]
    if "overhead" in result:
        o = result["overhead"]
        lines += [
            f"Overhead ({o['load']['num_prompts']} prompts, input 128, output 32, concurrency {o['load']['concurrency']}, "
            f"{len(o['throughput_ratios'])} A/B rounds, vLLM's client):",
            "",
            "| measure | value | target |",
            "| --- | --- | --- |",
            f"| request throughput gateway/direct (median of rounds) | {o['throughput_ratio_median']:.3f} ({', '.join(f'{r:.3f}' for r in o['throughput_ratios'])}) | >= 0.97 |",
            f"| median TTFT added by the gateway, ms (median of rounds) | {o['ttft_added_ms_median']:.2f} ({', '.join(f'{a:.2f}' for a in o['ttft_added_ms'])}) | <= 2 |",
            f"| gateway CPU per proxied request, ms ({o['workers']} worker(s), {o['gateway_ref']}; net of its idle {o['idle_cpu_per_s']['gateway'] * 1000:.1f} ms/s) | {o['gateway_cpu_ms_per_request']:.3f} ({', '.join(f'{c:.3f}' for c in o['gateway_cpu_ms_per_request_rounds'])}) | reported |",
            f"| runtime API process CPU per request, ms | {o['runtime_api_cpu_ms_per_request']:.3f} | reported |",
            f"| gateway / runtime API CPU (per round) | {statistics.median(o['gateway_to_runtime_api_cpu']):.3f} ({', '.join(f'{r:.3f}' for r in o['gateway_to_runtime_api_cpu'])}) | <= 0.10 |",
        ]
        if o.get("before") is not None:
            lines += [
                f"| older gateway ({o['before']}): request throughput gateway/direct | {o['throughput_ratio_median_before']:.3f} ({', '.join(f'{r:.3f}' for r in o['throughput_ratios_before'])}) | >= 0.97 |",
                f"| older gateway: median TTFT added, ms | {o['ttft_added_ms_median_before']:.2f} ({', '.join(f'{a:.2f}' for a in o['ttft_added_ms_before'])}) | <= 2 |",
                f"| older gateway: CPU per proxied request, ms (net of its idle {o['idle_cpu_per_s']['gateway-before'] * 1000:.1f} ms/s) | {o['gateway_cpu_ms_per_request_before']:.3f} ({', '.join(f'{c:.3f}' for c in o['gateway_cpu_ms_per_request_rounds_before'])}) | this one no higher |",
            ]
        lines += [f"| failed requests | {o['failed']} | 0 |", ""]
    if "prefix" in result:
        p = result["prefix"]
        lines += [
            "Prefix-aware vs round-robin (2 replicas, prefix caching, multi-turn chats sharing a system prompt):",
            "",
            "| routing | vLLM prefix-cache hit rate | median TTFT ms | requests |",
            "| --- | --- | --- | --- |",
        ]
        for strategy, r in p.items():
            lines.append(
                f"| {strategy} | {r['prefix_cache_hit_rate']:.3f} | {r['median_ttft_ms']:.1f} | {r['requests']} |"
            )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--part", choices=["overhead", "prefix", "both"], default="both")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--workers", type=int, default=1, help="GATEWAY_WORKERS")
    parser.add_argument(
        "--idle-seconds", type=float, default=5.0, help="how long the idle cost is measured"
    )
    parser.add_argument(
        "--gateway-ref", help="run the gateway at this git ref (e.g. main) instead of this checkout"
    )
    parser.add_argument(
        "--before", type=Path, help="overhead: also a gateway of this older checkout's code"
    )
    args = parser.parse_args()
    out = OUT / "gateway_vs_direct"
    out.mkdir(parents=True, exist_ok=True)
    model = rv.ensure_demo_model(OUT / "demo-model")
    result: dict = {}
    if args.part in ("overhead", "both"):
        result["overhead"] = overhead(args, model, out)
    if args.part in ("prefix", "both"):
        result["prefix"] = prefix(args, model, out)
    (OUT / "gateway_vs_direct.json").write_text(json.dumps(result, indent=2))
    print(markdown(result, sys.argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
