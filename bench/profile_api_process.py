"""Where the runtime's API process spends more CPU than plain vLLM's: both profiled with py-spy
under the same load, side by side (issue 33: "the runtime's own API-process CPU per request vs
plain vLLM").

    .venv/bin/python bench/profile_api_process.py --rounds 3 --num-prompts 600 --request-rate 30 --rate 200

The set-up is bench/runtime_vs_vllm.py's: the demo model behind ``llmendpoints-runtime serve``
(A) and ``python -m vllm.entrypoints.openai.api_server`` (B), both up for the whole run, vLLM's
bench client streaming ``/v1/completions``. First each API process's idle CPU (``--idle-seconds``
with nothing sent to either); then, in alternated rounds, ``py-spy record`` samples the API
process of the server under load (``--rate`` Hz, non-blocking, every thread of that process, the
engine's processes left out) while its CPU time is read before and after.

Each sample is put in the innermost layer its stack passes through (ours by package, vLLM's
serving, its output processing, the tokenizer, Starlette, uvicorn, asyncio, ...). A layer's
share of the samples times the process's CPU per request is that layer's CPU per request; the
table sets the two servers' figures side by side, so the difference per request is read per
layer. Results: bench/out/profile_api_process/{A,B}-round*.txt, summary.json, and a Markdown
section on stdout.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import profile_front_door as pf
import runtime_vs_vllm as rv

OUT = rv.REPO / "bench" / "out" / "profile_api_process"

# Innermost first wins (profile_front_door.layer_of): a sample in vLLM's code called from a
# wrapper of ours is vLLM's CPU.
LAYERS = (
    ("ours: runtime", ("llmendpoints_runtime/",)),
    ("ours: edge server", ("llmendpoints_edge/",)),
    ("ours: common", ("llmendpoints_common/",)),
    ("vLLM output processing (v1/engine)", ("vllm/v1/engine/",)),
    ("tokenizer / detokenizer", ("vllm/tokenizers", "vllm/transformers_utils", "tokenizers/",
                                 "transformers/", "vllm/v1/engine/detokenizer")),
    ("vLLM serving (entrypoints)", ("vllm/entrypoints/",)),
    ("vLLM metrics / other vLLM", ("vllm/",)),
    ("pydantic", ("pydantic",)),
    ("FastAPI / Starlette", ("fastapi/", "starlette/")),
    ("uvicorn / httptools", ("uvicorn/", "h11/", "httptools/")),
    ("prometheus_client", ("prometheus_client/",)),
    ("zmq / msgspec", ("zmq/", "msgspec")),
    ("logging", ("logging/",)),
    ("json", ("json/",)),
    ("threads / executors", ("threading.py", "concurrent/")),
    ("asyncio loop", ("asyncio/", "uvloop/")),
)  # fmt: skip

SIDES = {rv.OURS: "A runtime", rv.PLAIN: "B plain vLLM"}


def idle_cpu_ms_per_s(servers: dict[str, rv.Server], seconds: float) -> dict[str, float]:
    """Each API process's CPU a second with nothing sent to either server."""
    before = {name: server.cpu().api_seconds for name, server in servers.items()}
    time.sleep(seconds)
    return {
        name: round((server.cpu().api_seconds - before[name]) * 1000 / seconds, 2)
        for name, server in servers.items()
    }


def profiled_run(server: rv.Server, name: str, model: Path, load: rv.Load, rate: int) -> dict:
    samples = OUT / f"{name}.txt"
    with pf.recording(server.pid, samples, OUT / f"{name}.py-spy.log", rate=rate):
        cpu0 = server.cpu()
        data = rv.run_client(
            server.url, model, load, OUT, f"{name}.json", OUT / f"{name}.client.log"
        )
        cpu = server.cpu() - cpu0
    requests = load.num_prompts + load.warmups
    profile = pf.summarize(pf.parse_raw(samples), layers=LAYERS)
    return {
        "api_cpu_ms_per_request": round(cpu.api_seconds * 1000 / requests, 3),
        "request_throughput": round(data["request_throughput"], 2),
        "median_ttft_ms": round(data["median_ttft_ms"], 1),
        "failed": int(data.get("failed", 0)),
        "profile": profile,
    }


def per_layer(runs: list[dict]) -> dict[str, float]:
    """A layer's CPU per request over runs: its share of each run's samples times that run's CPU
    per request, the median over runs."""
    figures: dict[str, list[float]] = collections.defaultdict(list)
    for run in runs:
        shares = dict(run["profile"]["layers"])
        for name, _ in (*LAYERS, ("other", ())):
            figures[name].append(shares.get(name, 0.0) / 100 * run["api_cpu_ms_per_request"])
    return {name: round(statistics.median(values), 3) for name, values in figures.items()}


def run(args) -> dict:
    OUT.mkdir(parents=True, exist_ok=True)
    model = rv.ensure_demo_model(args.model.resolve())
    load = rv.Load(
        num_prompts=args.num_prompts,
        input_len=args.input_len,
        output_len=args.output_len,
        concurrency=args.concurrency,
        warmups=16,
        seed=0,
        request_rate=args.request_rate,
    )
    runs: dict[str, list[dict]] = {rv.OURS: [], rv.PLAIN: []}
    with contextlib.ExitStack() as stack:
        servers = {
            name: stack.enter_context(rv.running_server(name, model, OUT / f"{name}.server.log"))
            for name in (rv.OURS, rv.PLAIN)
        }
        warm = dataclasses.replace(
            load, num_prompts=32, warmups=0, seed=1, request_rate=float("inf")
        )
        for name, server in servers.items():
            rv.run_client(
                server.url, model, warm, OUT, f"warm-{name}.json", OUT / f"warm-{name}.log"
            )
        time.sleep(3.0)
        idle = idle_cpu_ms_per_s(servers, args.idle_seconds)
        load_before = os.getloadavg()
        for round_ in range(1, args.rounds + 1):
            for name in (rv.OURS, rv.PLAIN):
                result = profiled_run(
                    servers[name], f"{name}-round{round_}", model, load, args.rate
                )
                runs[name].append(result)
                print(
                    f"round {round_} {SIDES[name]}: {result['api_cpu_ms_per_request']} ms/req, "
                    f"{result['request_throughput']} req/s",
                    flush=True,
                )
    return {
        "load": {"num_prompts": load.num_prompts, "input_len": load.input_len,
                 "output_len": load.output_len, "concurrency": load.concurrency,
                 "request_rate": load.request_rate, "rate_hz": args.rate},
        "load_avg_before": [round(x, 2) for x in load_before],
        "load_avg_after": [round(x, 2) for x in os.getloadavg()],
        "idle_api_cpu_ms_per_s": idle,
        "runs": runs,
        "per_layer_ms_per_request": {name: per_layer(r) for name, r in runs.items()},
    }  # fmt: skip


def markdown(result: dict, argv: list[str]) -> str:
    ours, plain = rv.OURS, rv.PLAIN
    runs = result["runs"]
    cpu = {
        name: statistics.median(r["api_cpu_ms_per_request"] for r in runs[name]) for name in runs
    }
    layers = result["per_layer_ms_per_request"]
    rows = sorted(layers[ours], key=lambda n: abs(layers[ours][n] - layers[plain][n]), reverse=True)
    lines = [
        f"Command: `.venv/bin/python bench/profile_api_process.py {' '.join(argv)}`; "
        f"load average {result['load_avg_before']} before, {result['load_avg_after']} after.",
        "",
        "| run | API CPU ms/req | req/s | median TTFT ms | samples |",
        "| --- | --- | --- | --- | --- |",
        *(
            f"| {SIDES[name]} round {i} | {r['api_cpu_ms_per_request']} | "
            f"{r['request_throughput']} | {r['median_ttft_ms']} | {r['profile']['samples']} |"
            for name in runs
            for i, r in enumerate(runs[name], 1)
        ),
        "",
        f"API CPU per request, median of rounds: A {cpu[ours]:.3f} ms, B {cpu[plain]:.3f} ms "
        f"(A/B {cpu[ours] / cpu[plain]:.3f}). Idle, nothing sent: A "
        f"{result['idle_api_cpu_ms_per_s'][ours]} ms/s, B {result['idle_api_cpu_ms_per_s'][plain]} ms/s.",
        "",
        "| layer (innermost a sample was in) | A ms/req | B ms/req | A - B |",
        "| --- | --- | --- | --- |",
        *(
            f"| {name} | {layers[ours][name]:.3f} | {layers[plain][name]:.3f} | "
            f"{layers[ours][name] - layers[plain][name]:+.3f} |"
            for name in rows
        ),
        "",
        "Frames that ran (self), last round of each:",
        "",
        "| A runtime | % | B plain vLLM | % |",
        "| --- | --- | --- | --- |",
    ]
    a_self, b_self = runs[ours][-1]["profile"]["self"], runs[plain][-1]["profile"]["self"]
    for (a_name, a_pct), (b_name, b_pct) in zip(a_self[:15], b_self[:15], strict=False):
        lines.append(f"| `{a_name}` | {a_pct} | `{b_name}` | {b_pct} |")
    lines += ["", "Functions of ours (inclusive, A's last round):", ""]
    lines += [f"- `{name}`: {pct} %" for name, pct in runs[ours][-1]["profile"]["ours_inclusive"]]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-prompts", type=int, default=300)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="requests/s with Poisson arrivals (default: as fast as --concurrency allows); a "
        "fixed rate below both servers' capacity compares them at the same token rate",
    )
    parser.add_argument("--rate", type=int, default=100, help="py-spy samples a second")
    parser.add_argument("--idle-seconds", type=float, default=20.0)
    parser.add_argument("--model", type=Path, default=rv.REPO / ".cache" / "demo-model")
    parser.add_argument("--summarize", action="store_true", help="only summarise the last run")
    args = parser.parse_args()
    if args.summarize:
        result = json.loads((OUT / "summary.json").read_text())
    else:
        result = run(args)
        (OUT / "summary.json").write_text(json.dumps(result, indent=2))
    print(markdown(result, sys.argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
