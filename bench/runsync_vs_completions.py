"""/runsync (the RunPod-style job API) vs /v1/completions on the same runtime, same work.

    .venv/bin/python bench/runsync_vs_completions.py              # ~2 minutes on 2 cores
    .venv/bin/python bench/runsync_vs_completions.py --rounds 3 --num-prompts 400 --concurrency 32

Target (bench/README.md): request throughput of /runsync / /v1/completions >= 0.95.

One `llmendpoints-runtime serve` on the demo model (written to a temporary folder) serves both
sides, so the engine, the model and the machine are the same. The client sends the same prompts
(fixed seed), the same max_tokens with ignore_eos (every request generates exactly that many
tokens) and greedy sampling, at the same concurrency, non-streamed, alternating the two APIs
A B A B ... so that whatever else runs on the machine hits both alike. Each run is preceded by
warm-up requests that are not measured. Results: a Markdown section on stdout (for
bench/RESULTS.md) and JSON in bench/out/runsync_vs_completions.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
# The same launcher as the runtime tests: a clean environment, whatever the caller's shell holds.
# The tests' kits (tests/conftest.py puts the same two folders on the path).
sys.path[:0] = [str(REPO / "tests"), str(REPO / "tests" / "runtime")]

from runtime_process import launch_runtime  # noqa: E402

TARGET = 0.95
WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "was",
    "for",
    "on",
    "that",
    "with",
    "as",
    "by",
    "at",
    "from",
    "his",
    "her",
    "an",
    "were",
    "are",
    "which",
    "this",
    "be",
    "or",
    "has",
    "had",
    "not",
    "but",
    "what",
    "all",
    "when",
    "there",
    "can",
    "more",
    "one",
    "their",
    "about",
    "if",
    "would",
    "been",
    "so",
    "who",
    "will",
    "sky",
    "blue",
    "light",
    "water",
    "city",
    "river",
    "France",
    "Paris",
    "capital",
    "health",
    "kidney",
    "care",
    "fever",
    "practice",
]


@dataclass(frozen=True)
class Load:
    num_prompts: int
    prompt_words: int
    max_tokens: int
    concurrency: int
    warmups: int
    seed: int


@dataclass(frozen=True)
class Run:
    api: str
    round: int
    completed: int
    failed: int
    duration_s: float
    request_throughput: float
    output_token_throughput: float
    median_latency_ms: float
    p99_latency_ms: float


def prompts(load: Load) -> list[str]:
    rng = random.Random(load.seed)
    return [" ".join(rng.choices(WORDS, k=load.prompt_words)) for _ in range(load.num_prompts)]


def completions_request(prompt: str, load: Load) -> tuple[str, dict]:
    return "/v1/completions", {
        "model": "demo",
        "prompt": prompt,
        "max_tokens": load.max_tokens,
        "ignore_eos": True,
        "temperature": 0,
    }


def runsync_request(prompt: str, load: Load) -> tuple[str, dict]:
    return "/runsync", {
        "input": {
            "prompt": prompt,
            "sampling_params": {
                "max_tokens": load.max_tokens,
                "ignore_eos": True,
                "temperature": 0,
            },
        }
    }


def output_tokens(api: str, body: dict) -> int:
    """Tokens generated, read from the answer; a failed request raises."""
    if api == "completions":
        return body["usage"]["completion_tokens"]
    if body.get("status") != "COMPLETED":
        raise RuntimeError(f"job not completed: {body}")
    return body["output"][0]["usage"]["output"]


async def one_run(url: str, api: str, round_: int, load: Load, texts: list[str]) -> Run:
    build = completions_request if api == "completions" else runsync_request
    limits = httpx.Limits(
        max_connections=load.concurrency, max_keepalive_connections=load.concurrency
    )
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        for text in texts[: load.warmups]:
            path, body = build(text, load)
            (await client.post(path, json=body)).raise_for_status()

        semaphore = asyncio.Semaphore(load.concurrency)
        latencies: list[float] = []
        tokens = 0
        failed = 0

        async def send(text: str) -> None:
            nonlocal tokens, failed
            path, body = build(text, load)
            async with semaphore:
                began = time.perf_counter()
                try:
                    answer = await client.post(path, json=body)
                    answer.raise_for_status()
                    tokens += output_tokens(api, answer.json())
                except Exception as exc:  # counted, shown, never silently dropped
                    failed += 1
                    print(f"{api}: request failed: {exc}", file=sys.stderr)
                    return
                latencies.append(time.perf_counter() - began)

        began = time.perf_counter()
        await asyncio.gather(*(send(text) for text in texts))
        duration = time.perf_counter() - began
    latencies.sort()
    return Run(
        api=api,
        round=round_,
        completed=len(latencies),
        failed=failed,
        duration_s=round(duration, 3),
        request_throughput=round(len(latencies) / duration, 3),
        output_token_throughput=round(tokens / duration, 1),
        median_latency_ms=round(statistics.median(latencies) * 1000, 1),
        p99_latency_ms=round(latencies[max(0, int(len(latencies) * 0.99) - 1)] * 1000, 1),
    )


def summarize(runs: list[Run], load: Load, command: str) -> tuple[dict, str]:
    def median(api: str, field: str) -> float:
        return statistics.median(getattr(r, field) for r in runs if r.api == api)

    ratio = median("runsync", "request_throughput") / median("completions", "request_throughput")
    # The same ratio within each round (the two runs of a round are back to back): shows how
    # much of the spread is the machine rather than the API.
    by_round: dict[int, dict[str, float]] = {}
    for r in runs:
        by_round.setdefault(r.round, {})[r.api] = r.request_throughput
    round_ratios = [round(v["runsync"] / v["completions"], 3) for _, v in sorted(by_round.items())]
    latency_ratio = median("runsync", "median_latency_ms") / median(
        "completions", "median_latency_ms"
    )
    summary = {
        "load": asdict(load),
        "runs": [asdict(r) for r in runs],
        "throughput_ratio_runsync_over_completions": round(ratio, 3),
        "per_round_throughput_ratios": round_ratios,
        "median_latency_ratio_runsync_over_completions": round(latency_ratio, 3),
        "target": TARGET,
        "meets_target": ratio >= TARGET,
        "failed_requests": sum(r.failed for r in runs),
    }
    lines = [
        "## /runsync vs /v1/completions (bench/runsync_vs_completions.py)",
        "",
        f"Command: `{command}`  ",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}; "
        "one runtime on the demo model (MAX_MODEL_LEN=512), the client on the same machine.  ",
        f"Load: {load.num_prompts} prompts of {load.prompt_words} words (seed {load.seed}), "
        f"max_tokens {load.max_tokens} with ignore_eos, temperature 0, non-streamed, concurrency "
        f"{load.concurrency}, {load.warmups} warm-up requests per run, APIs alternated.",
        "",
        "| round | API | completed | failed | duration s | req/s | output tok/s | median latency ms | p99 latency ms |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in runs:
        lines.append(
            f"| {r.round} | {'/runsync' if r.api == 'runsync' else '/v1/completions'} | {r.completed} "
            f"| {r.failed} | {r.duration_s} | {r.request_throughput} | {r.output_token_throughput} "
            f"| {r.median_latency_ms} | {r.p99_latency_ms} |"
        )
    lines += [
        "",
        f"Request throughput /runsync / /v1/completions (medians over rounds): **{ratio:.3f}** "
        f"(target >= {TARGET}: {'met' if ratio >= TARGET else 'NOT met'}); "
        f"median latency ratio {latency_ratio:.3f}. Per round: {round_ratios} (the machine is "
        "shared, so single rounds vary; compare the medians).",
        "",
    ]
    return summary, "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--prompt-words", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--warmups", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    load = Load(
        args.num_prompts,
        args.prompt_words,
        args.max_tokens,
        args.concurrency,
        args.warmups,
        args.seed,
    )
    command = " ".join([".venv/bin/python", "bench/runsync_vs_completions.py", *sys.argv[1:]])
    texts = prompts(load)
    out = REPO / "bench" / "out"
    out.mkdir(parents=True, exist_ok=True)

    with tempfile.TemporaryDirectory(prefix="bench-runsync-") as tmp:
        model = Path(tmp) / "demo-model"
        subprocess.run(
            [str(BIN / "llmendpoints-runtime"), "demo-model", str(model)],
            check=True,
            capture_output=True,
        )
        log_dir = out / "runsync_vs_completions-logs"
        log_dir.mkdir(exist_ok=True)
        server = launch_runtime(model, log_dir, DISABLE_UVICORN_ACCESS_LOG="true")
        url = server.url
        try:
            server.wait_listening()
            server.wait_ready(timeout=300)
            runs = []
            for round_ in range(1, args.rounds + 1):
                order = ("completions", "runsync") if round_ % 2 else ("runsync", "completions")
                for api in order:
                    run = asyncio.run(one_run(url, api, round_, load, texts))
                    print(f"round {round_} {api}: {run.request_throughput} req/s", file=sys.stderr)
                    runs.append(run)
        finally:
            server.stop()

    summary, markdown = summarize(runs, load, command)
    (out / "runsync_vs_completions.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "runsync_vs_completions.md").write_text(markdown)
    print(markdown)
    return 0 if summary["meets_target"] and not summary["failed_requests"] else 1


if __name__ == "__main__":
    sys.exit(main())
