"""Image requests: runtime vs plain vLLM on the vision demo model.

The same method as bench/runtime_vs_vllm.py (whose pieces this reuses): vLLM's own serving
benchmark client against `llmendpoints-runtime serve` (A) and
`python -m vllm.entrypoints.openai.api_server` (B), same model, same engine settings, both up
for all rounds, alternating A B A B. The load is vLLM's `random-mm` dataset: streamed
`/v1/chat/completions`, each request one random image as a base64 data URL plus random text
(fixed seed: both sides get the same requests), `--ignore-eos`.

    .venv/bin/python bench/images_vs_vllm.py                 # 6 rounds, ~5 minutes on 2 cores
    .venv/bin/python bench/images_vs_vllm.py --rounds 2 --num-prompts 100

Target (issue 17): the API-server process's CPU time per request, ours/plain <= 1.05 (user +
system of that one process; the engine's processes apart). Throughput and TTFT ratios are
reported too. Results: bench/out/images_vs_vllm.{json,md} and vLLM's per-run JSON in
bench/out/images_vs_vllm/.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import runtime_vs_vllm as base

REPO = base.REPO
SERVED_NAME = "demo-vision"
MAX_MODEL_LEN = "1024"
LIMIT_MM = json.dumps({"image": 1})
TARGET_API_CPU_RATIO = 1.05


def server_command(server: str, model: Path, port: int) -> tuple[list[str], dict[str, str]]:
    env = base.server_env(port)
    if server == base.OURS:
        env.update(
            MODEL_NAME=str(model),
            OPENAI_SERVED_MODEL_NAME_OVERRIDE=SERVED_NAME,
            MAX_MODEL_LEN=MAX_MODEL_LEN,
            LIMIT_MM_PER_PROMPT=LIMIT_MM,
            HOST="127.0.0.1",
            PORT=str(port),
        )
        return [str(base.BIN / "llmendpoints-runtime"), "serve"], env
    argv = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model),
        "--served-model-name", SERVED_NAME,
        "--max-model-len", MAX_MODEL_LEN,
        "--limit-mm-per-prompt", LIMIT_MM,
        "--host", "127.0.0.1",
        "--port", str(port),
    ]  # fmt: skip
    return argv, env


@contextlib.contextmanager
def running_server(server: str, model: Path, log_path: Path) -> Iterator[base.Server]:
    port = base.free_port()
    argv, env = server_command(server, model, port)
    url = f"http://127.0.0.1:{port}"
    probe = url + ("/ready?strict=1" if server == base.OURS else "/health")
    with log_path.open("wb") as log:
        process = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        try:
            started = time.monotonic()
            while True:
                if process.poll() is not None:
                    raise RuntimeError(f"{server} exited with {process.returncode}; see {log_path}")
                if time.monotonic() - started > base.START_TIMEOUT:
                    raise TimeoutError(f"{server} not ready; see {log_path}")
                with contextlib.suppress(httpx.TransportError):
                    if httpx.get(probe, timeout=2.0).status_code == 200:
                        break
                time.sleep(0.5)
            print(f"  {server} ready in {time.monotonic() - started:.0f} s", flush=True)
            yield base.Server(url, process.pid)
        finally:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(60)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait(10)


def client_argv(
    url: str, model: Path, load: base.Load, image_px: int, result_dir: Path, name: str
) -> list[str]:
    return [
        "--backend", "openai-chat",
        "--endpoint", "/v1/chat/completions",
        "--base-url", url,
        "--model", str(model),
        "--served-model-name", SERVED_NAME,
        "--tokenizer", str(model),
        "--dataset-name", "random-mm",
        "--random-input-len", str(load.input_len),
        "--random-output-len", str(load.output_len),
        "--random-mm-base-items-per-request", "1",
        "--random-mm-num-mm-items-range-ratio", "0",
        "--random-mm-limit-mm-per-prompt", LIMIT_MM,
        "--random-mm-bucket-config", f"{{({image_px}, {image_px}, 1): 1.0}}",
        "--num-prompts", str(load.num_prompts),
        "--max-concurrency", str(load.concurrency),
        "--ignore-eos",
        "--seed", str(load.seed),
        "--num-warmups", str(load.warmups),
        "--percentile-metrics", "ttft,tpot,e2el",
        "--metric-percentiles", "50,99",
        "--disable-tqdm",
        "--save-result",
        "--result-dir", str(result_dir),
        "--result-filename", name,
    ]  # fmt: skip


def run_client(argv: list[str], log_path: Path) -> dict:
    import asyncio

    from vllm.benchmarks.serve import add_cli_args, main_async
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(argv)
    with (
        log_path.open("w") as log,
        contextlib.redirect_stdout(log),
        contextlib.redirect_stderr(log),
    ):
        return asyncio.run(main_async(args))


def markdown(runs, comparison, load, image_px, facts, command) -> str:
    c = comparison
    api = c["api_cpu_per_request_ratio"]
    lines = [
        "## Image requests: runtime vs plain vLLM (bench/images_vs_vllm.py)",
        "",
        f"Command: `{command}`  ",
        f"Machine: {facts['cpus']} CPU cores ({facts['cpu_model']}), shared with other work "
        f"(load average {facts['load_before']} before, {facts.get('load_after', '?')} after); "
        f"vLLM {facts['vllm']} CPU build; the vision demo model (`demo-model --vision`: Idefics3, "
        f"random weights, images resized to 32x32), `MAX_MODEL_LEN={MAX_MODEL_LEN}`, "
        f"`LIMIT_MM_PER_PROMPT={LIMIT_MM}` on both sides.  ",
        f"Load: vLLM's client, `random-mm` dataset: {load.num_prompts} streamed chat requests, "
        f"each one {image_px}x{image_px} random image (base64 data URL) + {load.input_len} random "
        f"text tokens, {load.output_len} out (`--ignore-eos`), max concurrency "
        f"{load.concurrency}, seed {load.seed}, {load.warmups} warm-ups. Order "
        + " ".join("A" if r.server == base.OURS else "B" for r in runs)
        + " (A = runtime, B = plain vLLM).",
        "",
        "| run | server | req/s | median TTFT ms | p99 TTFT ms | median E2E ms | API CPU ms/req | engine CPU ms/req | failed |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for i, r in enumerate(runs, 1):
        lines.append(
            f"| {i} (round {r.round}) | {'A runtime' if r.server == base.OURS else 'B plain'} "
            f"| {r.request_throughput:.2f} | {r.median_ttft_ms:.1f} | {r.p99_ttft_ms:.1f} "
            f"| {r.median_e2el_ms:.1f} | {r.api_cpu_ms_per_request:.2f} "
            f"| {r.engine_cpu_ms_per_request:.2f} | {r.failed} |"
        )
    lines += ["", "Ratios ours/plain, median over rounds (range over rounds):", ""]
    for ratio, label in (
        (
            "api_cpu_per_request_ratio",
            f"API-process CPU per request (target <= {TARGET_API_CPU_RATIO})",
        ),
        ("request_throughput_ratio", "request throughput"),
        ("median_ttft_ratio", "median TTFT"),
        ("engine_cpu_per_request_ratio", "engine CPU per request"),
    ):
        low, high = c["range_over_rounds"][ratio]
        lines.append(f"- {label}: **{c[ratio]:.3f}** ({low:.3f}-{high:.3f})")
    met = "yes" if api <= TARGET_API_CPU_RATIO else "**no**"
    lines += ["", f"API CPU target met: {met}.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--warmups", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--image-px", type=int, default=64, help="square image side (pixels)")
    parser.add_argument("--model", type=Path, default=REPO / ".cache" / "demo-model-vision")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "out")
    args = parser.parse_args(argv)

    load = base.Load(
        args.num_prompts,
        args.input_len,
        args.output_len,
        args.concurrency,
        args.warmups,
        args.seed,
    )
    model = args.model.resolve()
    if not (model / "config.json").exists():
        from llmendpoints_runtime.demo_vision import write_vision_demo_model

        write_vision_demo_model(model)
    run_dir = args.out / "images_vs_vllm"
    run_dir.mkdir(parents=True, exist_ok=True)
    facts = base.machine_facts()
    command = ".venv/bin/python bench/images_vs_vllm.py " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    runs: list[base.RunResult] = []
    with contextlib.ExitStack() as stack:
        servers = {}
        for server in (base.OURS, base.PLAIN):
            print(f"starting {server}", flush=True)
            servers[server] = stack.enter_context(
                running_server(server, model, run_dir / f"{server}.server.log")
            )
        for round_ in range(1, args.rounds + 1):
            for server in (base.OURS, base.PLAIN):
                name = f"round{round_}-{server}"
                running = servers[server]
                before = running.cpu()
                data = run_client(
                    client_argv(running.url, model, load, args.image_px, run_dir, f"{name}.json"),
                    run_dir / f"{name}.client.log",
                )
                cpu = running.cpu() - before
                result = base.RunResult.from_vllm_json(
                    server, round_, data, cpu, load.num_prompts + load.warmups
                )
                runs.append(result)
                print(
                    f"round {round_} {server}: {result.request_throughput:.2f} req/s, "
                    f"API CPU {result.api_cpu_ms_per_request:.2f} ms/req, {result.failed} failed",
                    flush=True,
                )
    facts["load_after"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    comparison = base.compare(runs)
    summary = markdown(runs, comparison, load, args.image_px, facts, command.strip())
    (args.out / "images_vs_vllm.json").write_text(
        json.dumps(
            {
                "load": asdict(load),
                "image_px": args.image_px,
                "machine": facts,
                "runs": [asdict(r) for r in runs],
                "comparison": comparison,
            },
            indent=2,
        )
        + "\n"
    )
    (args.out / "images_vs_vllm.md").write_text(summary)
    print()
    print(summary)
    return 1 if comparison["failed_requests"] else 0


if __name__ == "__main__":
    sys.exit(main())
