"""A small request's latency while a MAX_N request runs: admission counting requests (before)
vs counting sequences (after), and the abuse of issue 16 (one request with a huge ``n``).

    .venv/bin/python bench/fair_use.py --before /path/to/a/checkout/without/it [--rounds 3]
    .venv/bin/python bench/fair_use.py            # this checkout only

Each code tree (``--before``: a checkout from before sequence-counted admission and MAX_N; the
"after" side is this checkout) runs one `llmendpoints-runtime serve` on the demo model per
MAX_CONCURRENCY value in ``--concurrency``, launched as the runtime tests launch it, with the
code put first on PYTHONPATH. Per server:

- idle: a small request alone (non-streamed /v1/completions, 8 tokens);
- MAX_N: a streamed request with n=MAX_N (16) and ``--heavy-tokens`` tokens each (ignore_eos)
  is started; once its first token is in, the same small request is sent and timed; then the
  heavy one is read to its end;
- abuse (issue 16's ``n: 16384``, scaled to two cores): a request with ``n=--abuse-n`` and the
  small one behind it. After the change it is refused (400) and the small request runs alone.

Results: a Markdown section on stdout (for bench/RESULTS.md), JSON in bench/out/fair_use.json.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
# The tests' kits (tests/conftest.py puts the same two folders on the path).
sys.path[:0] = [str(REPO / "tests"), str(REPO / "tests" / "runtime")]

from runtime_process import launch_runtime  # noqa: E402

SMALL = {"model": "demo", "prompt": "Hello", "max_tokens": 8, "ignore_eos": True}
MAX_N = 16


def small_latency(url: str) -> tuple[float, int]:
    started = time.perf_counter()
    answer = httpx.post(url + "/v1/completions", json=SMALL, timeout=600)
    return time.perf_counter() - started, answer.status_code


def heavy_stream(url: str, body: dict, first: concurrent.futures.Future) -> tuple[int, float]:
    """Stream ``body``; ``first`` is set once the first token arrives; (status, seconds)."""
    started = time.perf_counter()
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=900) as response:
        if response.status_code != 200:
            response.read()
            first.set_result(response.status_code)
            return response.status_code, time.perf_counter() - started
        for line in response.iter_lines():
            if line.startswith("data: {") and not first.done():
                first.set_result(200)
    if not first.done():
        first.set_result(200)
    return 200, time.perf_counter() - started


def under_load(url: str, heavy: dict) -> dict:
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        first: concurrent.futures.Future = concurrent.futures.Future()
        running = pool.submit(heavy_stream, url, heavy, first)
        heavy_status = first.result(900)
        seconds, status = small_latency(url)
        heavy_status, heavy_seconds = running.result(900)
    return {
        "small_seconds": seconds,
        "small_status": status,
        "heavy_status": heavy_status,
        "heavy_seconds": heavy_seconds,
    }


def measure(code: Path, concurrency: int, args, model: Path, logs: Path) -> dict:
    paths = f"{code / 'runtime'}:{code / 'common'}"
    server = launch_runtime(
        model,
        logs,
        PYTHONPATH=paths,
        MAX_CONCURRENCY=str(concurrency),
        MAX_N=str(MAX_N),
    )
    try:
        server.wait_listening()
        server.wait_ready()
        url = server.url
        for _ in range(3):  # warm-up, not measured
            small_latency(url)
        heavy = {
            "model": "demo",
            "prompt": "Once upon a time",
            "max_tokens": args.heavy_tokens,
            "ignore_eos": True,
            "n": MAX_N,
            "stream": True,
        }
        idle = [small_latency(url)[0] for _ in range(args.rounds)]
        loaded = [under_load(url, heavy) for _ in range(args.rounds)]
        abuse = under_load(url, {**heavy, "n": args.abuse_n, "max_tokens": 64})
    finally:
        server.stop()
    return {
        "idle_small_median_s": statistics.median(idle),
        "max_n_small_median_s": statistics.median(r["small_seconds"] for r in loaded),
        "max_n_heavy_median_s": statistics.median(r["heavy_seconds"] for r in loaded),
        "max_n_rounds": loaded,
        "abuse": abuse,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--before", type=Path, help="a checkout without the change (unset: measure this one only)"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", default="16,300", help="MAX_CONCURRENCY values")
    parser.add_argument("--heavy-tokens", type=int, default=400)
    parser.add_argument("--abuse-n", type=int, default=512)
    args = parser.parse_args()
    from llmendpoints_runtime.demo import write_demo_model

    results: dict = {"machine": f"{platform.machine()}, Python {platform.python_version()}"}
    with tempfile.TemporaryDirectory() as tmp:
        model = write_demo_model(Path(tmp) / "model")
        logs = Path(tmp)
        for concurrency in [int(c) for c in args.concurrency.split(",")]:
            trees = [("after", REPO)]
            if args.before is not None:
                trees.insert(0, ("before", args.before.resolve()))
            for label, code in trees:
                print(f"measuring {label}, MAX_CONCURRENCY={concurrency} ...", file=sys.stderr)
                results[f"{label}/{concurrency}"] = measure(code, concurrency, args, model, logs)
    out = REPO / "bench" / "out"
    out.mkdir(exist_ok=True)
    (out / "fair_use.json").write_text(json.dumps(results, indent=2))
    print(
        "| MAX_CONCURRENCY | code | small alone (s) | small while n=16 runs (s) | n=16 request (s) "
        f"| n={args.abuse_n} request | small behind it (s) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for key, r in results.items():
        if key == "machine":
            continue
        label, concurrency = key.split("/")
        abuse = r["abuse"]
        print(
            f"| {concurrency} | {label} | {r['idle_small_median_s']:.2f} | "
            f"{r['max_n_small_median_s']:.2f} | {r['max_n_heavy_median_s']:.2f} | "
            f"{abuse['heavy_status']} in {abuse['heavy_seconds']:.2f} s | "
            f"{abuse['small_seconds']:.2f} |"
        )
    print(f"\n{results['machine']}; medians of {args.rounds} rounds")


if __name__ == "__main__":
    main()
