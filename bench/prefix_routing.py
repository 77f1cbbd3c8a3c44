"""Routing strategies compared on what the engines report: prefix-cache hit rate and TTFT.

    .venv/bin/python bench/prefix_routing.py            # ~10 min on 2 shared cores
    .venv/bin/python bench/prefix_routing.py --rounds 2 --strategies round-robin,scored
    .venv/bin/python bench/prefix_routing.py --strategies scored,scored-2w   # 1 vs 2 workers
    # side by side with vllm-router's policies (and an older checkout's gateway):
    .venv/bin/python bench/prefix_routing.py --strategies \
        scored,vr-cache_aware,vr-round_robin,vr-consistent_hash,scored-before --before PATH
    # Drive a gateway you run yourself (the replicas' /metrics give the engines' counters):
    .venv/bin/python bench/prefix_routing.py --gateway http://127.0.0.1:8080 \
        --replica http://127.0.0.1:8001 --replica http://127.0.0.1:8002 \
        --model round-robin=demo-round-robin --model prefix-aware=demo-prefix-aware

The load (issue 23's "Done when"): 40 conversations x 5 turns; every conversation opens with one
of 8 long system prompts (a RAG or support app: one long instruction, many users) and its own
first question, and each turn resends the whole history (chat, streamed, 8 tokens out). All 40
conversations run at once behind a client-side limit of --concurrency requests in flight, so
the turns of different conversations interleave: by the time a conversation's next turn comes,
dozens of other prompts have passed through the engines.

The engines (started here unless --gateway is given): two replicas of the demo model with prefix
caching and a deliberately small KV cache (NUM_GPU_BLOCKS_OVERRIDE blocks of BLOCK_SIZE tokens
each, default 320 x 32 = 10,240 tokens per replica): the 8 system prompts (~1,340 tokens each,
10.7k tokens) do not fit in one replica's cache, half of them do, with room for the histories
(up to ~400 tokens of their own each). A router that sends every prompt everywhere makes the
engines evict what the next request needs; one that partitions the system prompts and keeps
conversations where their history is gets hits. (--system-words and --gpu-blocks move the load
between those regimes; bench/RESULTS.md has several.)

Strategies, each an endpoint over the same two replicas (the replicas serve one model name per
strategy; a gateway routes each name with its endpoint's `routing:`), all through real gateways:
`round-robin` and `scored` (`prefix-aware`: the scorer over the prefix index and the engines'
load) on this checkout's gateway; `chwbl`: `prefix-aware` as it was before the scorer --
consistent hashing with bounded load on the system messages and first user turn -- on the
gateway of git ref --chwbl-ref (default: where this branch left main), run from that tree;
`scored-2w` (`-4w`): `scored` on a gateway with GATEWAY_WORKERS=2 (4), whose processes each
have their own prefix index (connections, so requests, spread over them by the kernel);
`scored-before`: `scored` on the gateway of the checkout --before; `vr-cache_aware`,
`vr-round_robin`, `vr-consistent_hash`: vllm-router (the vLLM project's Rust router, PyPI) with
that policy, its other settings its defaults (issue 33's side by side). The replicas run with
their control port on (LLMEP_CONTROL_PORT), as the operator's pods do. Every run
gets fresh system prompts, so no run is warmed by an earlier one, and the strategies alternate
within a round, their order rotated every round (A B C, B C A, ...), because the machine is
shared. Measured per run, from the engines themselves: vLLM's prefix-cache hit rate
(vllm:prefix_cache_hits / vllm:prefix_cache_queries, both in tokens, summed over the replicas);
the client's time to first token (median, p90); how the requests split over the replicas.

Results: bench/out/prefix_routing.json and a Markdown section on stdout (for bench/RESULTS.md).
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
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import httpx

# This folder's modules, and the tests' kits (tests/conftest.py puts tests/ on the path too).
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "tests"))
import gateway_vs_direct as gvd
import runtime_vs_vllm as rv
from integration.nats_kit import running_nats

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "bench" / "out"
DEFAULT_STRATEGIES = ("round-robin", "prefix-aware", "scored-core")

# Words for the generated prompts. The demo model's byte-level tokenizer was trained on a few
# sentences, so ordinary words cost about 1.4 characters per token.
_WORDS = tuple(
    " ".join(
        [
            "account billing refund policy order shipping return warranty support ticket customer",
            "answer question product service invoice payment delivery address contract renewal",
            "plan upgrade downgrade cancel escalate agent manager priority urgent normal detail",
            "summary context document source quote cite verify confirm apologise thank greet close",
        ]
    ).split(" ")
)


# --- the load (pure) --------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """Where one strategy's requests go: a router's base URL and the model name it routes."""

    url: str
    model: str
    stats: str | None = None  # the gateway's /metrics (its routing decisions)


@dataclass(frozen=True)
class Load:
    conversations: int = 40
    turns: int = 5
    system_prompts: int = 8
    system_words: int = 240  # ~1,340 demo-tokenizer tokens
    question_words: int = 6
    max_tokens: int = 8
    concurrency: int = 8


def system_prompts(load: Load, seed: int) -> list[str]:
    """`load.system_prompts` long instructions that share no prefix with each other (or with
    those of another seed: the tag comes first)."""
    rng = random.Random(seed)
    return [
        f"[{seed}-{i}] You are support assistant {i}. Follow these rules: "
        + " ".join(rng.choice(_WORDS) for _ in range(load.system_words))
        + "."
        for i in range(load.system_prompts)
    ]


def question(rng: random.Random, load: Load, label: str) -> str:
    return f"{label}: " + " ".join(rng.choice(_WORDS) for _ in range(load.question_words)) + "?"


# --- one run ----------------------------------------------------------------------------------


@dataclass
class RunResult:
    strategy: str
    round: int
    ttfts_ms: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    hits: float = 0.0
    queries: float = 0.0
    requests_per_replica: list[float] = field(default_factory=list)
    seconds: float = 0.0
    router_stats: dict | None = None  # the gateway's routing decisions after the run (cumulative)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    def summary(self) -> dict:
        return {
            "strategy": self.strategy,
            "round": self.round,
            "prefix_cache_hit_rate": round(self.hit_rate, 4),
            "median_ttft_ms": round(statistics.median(self.ttfts_ms), 2) if self.ttfts_ms else None,
            "p90_ttft_ms": round(_percentile(self.ttfts_ms, 0.9), 2) if self.ttfts_ms else None,
            "requests": len(self.ttfts_ms),
            "errors": len(self.errors),
            "requests_per_replica": self.requests_per_replica,
            "seconds": round(self.seconds, 1),
            **({"router_stats": self.router_stats} if self.router_stats else {}),
        }


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def engine_counters(replica: str) -> dict[str, float]:
    """The engine's counters this bench reads, from one replica's /metrics (sums over labels)."""
    wanted = {
        "vllm:prefix_cache_hits_total": "hits",
        "vllm:prefix_cache_queries_total": "queries",
        "vllm:request_success_total": "requests",
    }
    totals = dict.fromkeys(wanted.values(), 0.0)
    for line in httpx.get(replica + "/metrics", timeout=10).text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in wanted:
            totals[wanted[name]] += float(line.rsplit(" ", 1)[1])
    return totals


def cache_config(replica: str) -> dict[str, str]:
    """vllm:cache_config_info's labels (block_size, num_gpu_blocks, ...) of one replica."""
    for line in httpx.get(replica + "/metrics", timeout=10).text.splitlines():
        if line.startswith("vllm:cache_config_info{"):
            labels = line[line.index("{") + 1 : line.rindex("}")]
            pairs = (item.split("=", 1) for item in labels.split('",') if "=" in item)
            return {k.strip(): v.strip().strip('"') for k, v in pairs}
    return {}


async def conversations(url: str, model: str, load: Load, seed: int, result: RunResult) -> None:
    prompts = system_prompts(load, seed)
    rng = random.Random(seed + 1)
    limit = asyncio.Semaphore(load.concurrency)

    async def chat(session: aiohttp.ClientSession, c: int) -> None:
        messages = [
            {"role": "system", "content": prompts[c % len(prompts)]},
            {"role": "user", "content": question(rng, load, f"Customer {c} asks")},
        ]
        for turn in range(load.turns):
            body = {
                "model": model,
                "messages": messages,
                "max_tokens": load.max_tokens,
                "stream": True,
                "ignore_eos": True,
            }
            async with limit:
                started = time.perf_counter()
                first: float | None = None
                text: list[str] = []
                try:
                    async with session.post(url + "/v1/chat/completions", json=body) as response:
                        if response.status != 200:
                            result.errors.append(f"{response.status}: {await response.text()}")
                            return
                        async for line in response.content:
                            if not line.startswith(b"data: {"):
                                continue
                            if first is None:
                                first = time.perf_counter() - started
                            choices = json.loads(line[6:]).get("choices") or [{}]
                            text.append(choices[0].get("delta", {}).get("content") or "")
                except aiohttp.ClientError as exc:
                    result.errors.append(repr(exc))
                    return
            if first is not None:
                result.ttfts_ms.append(first * 1000)
            messages += [
                {"role": "assistant", "content": "".join(text)},
                {"role": "user", "content": question(rng, load, f"Follow-up {turn}")},
            ]

    timeout = aiohttp.ClientTimeout(total=900)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(chat(session, c) for c in range(load.conversations)))


def run_once(
    target: Target, replicas: list[str], load: Load, strategy: str, round_: int
) -> RunResult:
    result = RunResult(strategy, round_)
    before = [engine_counters(r) for r in replicas]
    started = time.perf_counter()
    # A fresh seed per (round, strategy): fresh system prompts, so no run warms another.
    seed = 1000 * (round_ + 1) + sum(map(ord, strategy))
    asyncio.run(conversations(target.url, target.model, load, seed, result))
    result.seconds = time.perf_counter() - started
    after = [engine_counters(r) for r in replicas]
    result.hits = sum(a["hits"] - b["hits"] for a, b in zip(after, before, strict=True))
    result.queries = sum(a["queries"] - b["queries"] for a, b in zip(after, before, strict=True))
    result.requests_per_replica = [
        a["requests"] - b["requests"] for a, b in zip(after, before, strict=True)
    ]
    if target.stats:
        result.router_stats = {"reasons": gateway_reasons(target.stats, target.model)}
    return result


def run_rounds(
    targets: dict[str, Target], replicas: list[str], load: Load, rounds: int
) -> list[RunResult]:
    strategies = list(targets)
    runs: list[RunResult] = []
    for round_ in range(rounds):
        order = strategies[round_ % len(strategies) :] + strategies[: round_ % len(strategies)]
        for strategy in order:
            result = run_once(targets[strategy], replicas, load, strategy, round_)
            runs.append(result)
            print(f"  {json.dumps(result.summary())}", flush=True)
    return runs


def aggregate(runs: list[RunResult]) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for strategy in dict.fromkeys(r.strategy for r in runs):
        mine = [r for r in runs if r.strategy == strategy]
        ttfts = [t for r in mine for t in r.ttfts_ms]
        out[strategy] = {
            "prefix_cache_hit_rate_median": round(statistics.median(r.hit_rate for r in mine), 4),
            "prefix_cache_hit_rates": [round(r.hit_rate, 4) for r in mine],
            "median_ttft_ms": round(statistics.median(ttfts), 2) if ttfts else None,
            "median_ttft_ms_per_round": [r.summary()["median_ttft_ms"] for r in mine],
            "p90_ttft_ms": round(_percentile(ttfts, 0.9), 2) if ttfts else None,
            "requests": len(ttfts),
            "errors": sum(len(r.errors) for r in mine),
            "requests_per_replica": [r.requests_per_replica for r in mine],
        }
        if mine[-1].router_stats:  # cumulative: the last run's covers them all
            out[strategy]["router_reasons"] = mine[-1].router_stats["reasons"]
    return out


# --- servers (unless --gateway is given) -------------------------------------------------------


@dataclass(frozen=True)
class Strategy:
    """A strategy as a gateway endpoint: its routing, and which gateway serves it."""

    routing: str
    ref: str | None = None  # git ref of the gateway's tree (None: this checkout)
    workers: int = 1
    shared: bool = True  # GATEWAY_SHARE_PREFIX_INDEX (through a nats-server, with workers)
    peer: bool = False  # ``routing`` is a vllm-router policy, routed by vllm-router
    before: bool = False  # the gateway of the checkout --before


STRATEGIES = {
    "round-robin": Strategy("round-robin"),
    # vllm-router (PyPI; the vLLM project's Rust router), side by side (issue 33)
    "vr-cache_aware": Strategy("cache_aware", peer=True),
    "vr-round_robin": Strategy("round_robin", peer=True),
    "vr-consistent_hash": Strategy("consistent_hash", peer=True),
    "scored-before": Strategy("prefix-aware", before=True),
    "chwbl": Strategy("prefix-aware", ref="CHWBL"),  # the ref: --chwbl-ref
    "scored": Strategy("prefix-aware"),
    "scored-2w": Strategy("prefix-aware", workers=2),
    "scored-4w": Strategy("prefix-aware", workers=4),
    "scored-4w-own": Strategy("prefix-aware", workers=4, shared=False),
}
DEFAULT_STRATEGIES = ("round-robin", "chwbl", "scored")


def model_name(strategy: str) -> str:
    return f"{rv.SERVED_NAME}-{strategy}"


def chwbl_ref(ref: str | None) -> str:
    """The commit whose gateway routes `chwbl`: ``ref``, or where this branch left main."""
    if ref:
        return ref
    return subprocess.run(
        ["git", "merge-base", "HEAD", "main"], cwd=REPO, check=True, capture_output=True, text=True
    ).stdout.strip()


@contextlib.contextmanager
def own_stack(args, strategies: list[str], out: Path):
    """Two replicas (started together) and one gateway per (tree, workers) the strategies need,
    each with one endpoint per strategy it serves."""
    model = rv.ensure_demo_model(OUT / "demo-model")
    with contextlib.ExitStack() as stack:
        starting = []
        for i in range(2):
            port = rv.free_port()
            argv, env = rv.server_command(rv.OURS, model, port)
            env.pop("OPENAI_SERVED_MODEL_NAME_OVERRIDE")
            env.update(
                SERVED_MODEL_NAME=" ".join(model_name(s) for s in strategies),
                LLMEP_CONTROL_PORT=str(rv.free_port()),  # as the operator's pods have it
                ENABLE_PREFIX_CACHING="true",
                MAX_MODEL_LEN=str(args.max_model_len),
                NUM_GPU_BLOCKS_OVERRIDE=str(args.gpu_blocks),
                BLOCK_SIZE=str(args.block_size),
            )
            starting.append(
                stack.enter_context(gvd._process(argv, env, port, out / f"replica-{i}.log"))
            )
        replicas = [next(waiter) for waiter in starting]
        gateways: dict[tuple[str | None, int, bool], list[str]] = {}
        targets: dict[str, Target] = {}
        for name in strategies:
            strategy = STRATEGIES[name]
            if strategy.peer:
                targets[name] = stack.enter_context(peer_router(name, replicas, out))
                continue
            ref = chwbl_ref(args.chwbl_ref) if strategy.ref == "CHWBL" else None
            if strategy.before:
                if args.before is None:
                    raise SystemExit(f"{name} needs --before PATH (an older checkout)")
                ref = str(args.before.resolve())
            gateways.setdefault((ref, strategy.workers, strategy.shared), []).append(name)
        # Workers share limits and their prefix indexes through the queue: a nats-server.
        queue = (
            stack.enter_context(running_nats(out / "nats")).url
            if any(workers > 1 for _, workers, _ in gateways)
            else None
        )
        for (ref, workers, shared), names in gateways.items():
            endpoints = [
                {
                    "name": f"pr-{n}",
                    "models": [model_name(n)],
                    "backends": replicas,
                    "routing": STRATEGIES[n].routing,
                }
                for n in names
            ]
            metrics_port = rv.free_port()
            label = f"gateway-{ref or 'here'}-{workers}w{'' if shared else '-own'}"
            checkout = Path(ref) if ref and Path(ref).is_dir() else None
            url, _ = stack.enter_context(
                gvd.gateway(
                    endpoints,
                    out / f"{label.replace('/', '_')}.log",
                    workers=workers,
                    ref=None if checkout else ref,
                    code=checkout,
                    extra_env={
                        "GATEWAY_METRICS_PORT": str(metrics_port),
                        "GATEWAY_LOAD_FACTOR": str(args.load_factor),
                        "GATEWAY_SHARE_PREFIX_INDEX": str(shared).lower(),
                        **({"JOBS_QUEUE_URL": queue} if queue and workers > 1 else {}),
                    },
                )
            )
            for n in names:
                targets[n] = Target(url, model_name(n), f"http://127.0.0.1:{metrics_port}/metrics")
        yield {s: targets[s] for s in strategies}, replicas


@contextlib.contextmanager
def peer_router(name: str, replicas: list[str], out: Path):
    """vllm-router with the strategy's policy over the replicas (its default settings)."""
    port = rv.free_port()
    argv = [
        str(Path(sys.executable).parent / "vllm-router"),
        "--host", "127.0.0.1", "--port", str(port),
        "--policy", STRATEGIES[name].routing, "--log-level", "warning",
        # Its metrics exporter listens on 29000 unless told: one port each, as they run at once.
        "--prometheus-port", str(rv.free_port()),
        "--worker-urls", *replicas,
    ]  # fmt: skip
    with (out / f"{name}.log").open("wb") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 300
            body = {"model": model_name(name), "prompt": "hi", "max_tokens": 1}
            while True:
                assert process.poll() is None, f"{name} exited; see its log"
                assert time.monotonic() < deadline, f"{name} not routable; see its log"
                with contextlib.suppress(httpx.TransportError):
                    if (
                        httpx.post(url + "/v1/completions", json=body, timeout=30).status_code
                        == 200
                    ):
                        break
                time.sleep(0.5)
            yield Target(url, model_name(name))
        finally:
            process.terminate()
            process.wait(30)


def gateway_reasons(metrics_url: str, model: str) -> dict[str, float]:
    """The gateway's routing decisions for the strategy's endpoint, by outcome (cumulative)."""
    endpoint = f'endpoint="default/pr-{model.removeprefix(rv.SERVED_NAME + "-")}"'
    reasons: dict[str, float] = {}
    for line in httpx.get(metrics_url, timeout=10).text.splitlines():
        if line.startswith("llmendpoints_gateway_routing_decisions_total{") and endpoint in line:
            outcome = line.split('outcome="', 1)[1].split('"', 1)[0]
            reasons[outcome] = reasons.get(outcome, 0.0) + float(line.rsplit(" ", 1)[1])
    return reasons


# --- report -----------------------------------------------------------------------------------


def markdown(result: dict, argv: list[str]) -> str:
    load, cache = result["load"], result["cache_config"]
    lines = [
        f"### Routing strategies on an evicting KV cache ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})",
        "",
        f"`.venv/bin/python bench/prefix_routing.py {' '.join(argv)}` on {os.cpu_count()} shared "
        f"cores (load average before: {result['load_before']}).",
        "",
        f"{load['conversations']} conversations x {load['turns']} turns over "
        f"{load['system_prompts']} system prompts, {load['concurrency']} requests in flight, "
        f"{result['rounds']} alternated rounds; 2 replicas, KV cache "
        f"{cache.get('num_gpu_blocks', '?')} blocks x {cache.get('block_size', '?')} tokens each. "
        "Hit rate: vLLM's prefix-cache hits / queries (tokens), both replicas, per run.",
        "",
        "| strategy | hit rate (median of rounds) | per round | median TTFT ms | per round | p90 TTFT ms | requests | errors |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for strategy, r in result["strategies"].items():
        lines.append(
            f"| {strategy} | {r['prefix_cache_hit_rate_median']:.3f} | "
            f"{', '.join(f'{x:.3f}' for x in r['prefix_cache_hit_rates'])} | "
            f"{r['median_ttft_ms']} | {', '.join(str(x) for x in r['median_ttft_ms_per_round'])} | "
            f"{r['p90_ttft_ms']} | {r['requests']} | {r['errors']} |"
        )
    for strategy, r in result["strategies"].items():
        if "router_reasons" in r:
            reasons = ", ".join(f"{k} {v}" for k, v in sorted(r["router_reasons"].items()))
            lines += ["", f"{strategy}: routing reasons over all its runs: {reasons}."]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--strategies",
        default=",".join(DEFAULT_STRATEGIES),
        help=f"routing strategies to compare, comma-separated, of: {', '.join(STRATEGIES)}",
    )
    parser.add_argument(
        "--chwbl-ref", help="git ref of the gateway for `chwbl` (default: merge-base with main)"
    )
    parser.add_argument(
        "--before", type=Path, help="`scored-before`: the gateway of this older checkout"
    )
    parser.add_argument(
        "--load-factor", type=float, default=1.25, help="the bound (GATEWAY_LOAD_FACTOR)"
    )
    parser.add_argument("--conversations", type=int, default=Load.conversations)
    parser.add_argument("--turns", type=int, default=Load.turns)
    parser.add_argument("--system-prompts", type=int, default=Load.system_prompts)
    parser.add_argument(
        "--system-words", type=int, default=Load.system_words, help="words per system prompt"
    )
    parser.add_argument("--concurrency", type=int, default=Load.concurrency)
    parser.add_argument("--gpu-blocks", type=int, default=320, help="KV-cache blocks per replica")
    parser.add_argument("--block-size", type=int, default=32, help="tokens per KV-cache block")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--gateway", help="drive this gateway instead of starting one")
    parser.add_argument(
        "--replica", action="append", default=[], help="a replica's base URL (with --gateway)"
    )
    parser.add_argument(
        "--model",
        action="append",
        default=[],
        help="STRATEGY=MODEL: the model name the gateway routes with that strategy (with --gateway)",
    )
    args = parser.parse_args()
    load = Load(
        conversations=args.conversations,
        turns=args.turns,
        system_prompts=args.system_prompts,
        system_words=args.system_words,
        concurrency=args.concurrency,
    )
    out = OUT / "prefix_routing"
    out.mkdir(parents=True, exist_ok=True)
    load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
    with contextlib.ExitStack() as stack:
        if args.gateway:
            if not args.replica or not args.model:
                parser.error("--gateway needs --replica (each replica) and --model STRATEGY=MODEL")
            gateway_url = args.gateway.rstrip("/")
            targets = {
                strategy: Target(gateway_url, model)
                for strategy, model in (item.split("=", 1) for item in args.model)
            }
            replicas = [r.rstrip("/") for r in args.replica]
        else:
            strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
            targets, replicas = stack.enter_context(own_stack(args, strategies, out))
        cache = cache_config(replicas[0])
        print(f"  replicas {replicas}, cache {cache}", flush=True)
        runs = run_rounds(targets, replicas, load, args.rounds)
    result = {
        "load": load.__dict__,
        "rounds": args.rounds,
        "cache_config": cache,
        "load_before": load_before,
        "strategies": aggregate(runs),
        "runs": [r.summary() for r in runs],
    }
    (OUT / "prefix_routing.json").write_text(json.dumps(result, indent=2))
    print(markdown(result, sys.argv[1:]))
    return 0 if not any(r.errors for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
