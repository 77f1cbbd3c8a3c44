"""Several API processes in one pod, and a multi-node group's start-up.

**API servers.** The same load from vLLM's own serving benchmark client
(bench/runtime_vs_vllm.py's client and settings) against the runtime with API_SERVER_COUNT=1
(A) and API_SERVER_COUNT=2 (B), alternating A B A B: requests/s, median TTFT, and the API
processes' CPU per request -- user + system of the process(es) serving HTTP (A: the one runtime
process; B: both ``VLLM::APIServer_<i>``), engine processes and B's supervisor apart (the
supervisor's own CPU is reported too). Both servers start once and stay up for all rounds.

**Start-up.** Time from launch to ready (``/ready?strict=1`` 200 on the control port) of a
single pod and of a two-node group (a leader and a worker on loopback as the operator writes
them, pipeline parallel 2 across them), alternating, ``--startups`` times each.

    .venv/bin/python bench/api_servers.py                       # 6 rounds, 2 start-ups each
    .venv/bin/python bench/api_servers.py --rounds 4 --num-prompts 200 --startups 0

Results: bench/out/api_servers.json and a Markdown section (for bench/RESULTS.md) on stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
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
from runtime_vs_vllm import (
    BIN,
    REPO,
    Load,
    ensure_demo_model,
    free_port,
    machine_facts,
    run_client,
    runtime_settings,
    server_env,
)

START_TIMEOUT = 900.0
OUT = REPO / "bench" / "out"


def runtime_env(model: Path, port: int, control: int, **extra: str) -> dict[str, str]:
    """bench/runtime_vs_vllm.py's clean environment, and this checkout's code (PYTHONPATH, as
    /work/wt-env.sh or a developer's shell sets it: the venv may be installed from another)."""
    env = server_env(port)
    if os.environ.get("PYTHONPATH"):
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    env.update(
        runtime_settings(model, port),
        LLMEP_CONTROL_PORT=str(control),
        LLMEP_BATCH_DIR=str(OUT / "api_servers" / f"batches-{port}"),
        **extra,
    )
    return env


@dataclass(frozen=True)
class Pod:
    url: str
    pid: int

    def cpu(self) -> dict[str, float]:
        """CPU seconds so far: the HTTP-serving processes, the supervisor (B), the engine."""
        main = psutil.Process(self.pid)
        api = supervisor = engine = 0.0
        children = main.children(recursive=True)
        servers = [c for c in children if "APIServer" in _title(c)]
        for process in [main, *children]:
            used = _used(process)
            if servers and process.pid == main.pid:
                supervisor += used
            elif process.pid == main.pid or process in servers:
                api += used
            else:
                engine += used
        return {"api": api, "supervisor": supervisor, "engine": engine}


def _title(process: psutil.Process) -> str:
    with contextlib.suppress(psutil.Error):
        return " ".join(process.cmdline()) + " " + process.name()
    return ""


def _used(process: psutil.Process) -> float:
    with contextlib.suppress(psutil.NoSuchProcess):
        times = process.cpu_times()
        return times.user + times.system
    return 0.0


def _wait_ready(control: int, processes: list[subprocess.Popen], logs: list[Path]) -> float:
    began = time.monotonic()
    while time.monotonic() - began < START_TIMEOUT:
        for process, log in zip(processes, logs, strict=True):
            if process.poll() is not None:
                raise RuntimeError(f"exited with {process.returncode}; see {log}")
        with contextlib.suppress(httpx.TransportError):
            if (
                httpx.get(f"http://127.0.0.1:{control}/ready?strict=1", timeout=2).status_code
                == 200
            ):
                return time.monotonic() - began
        time.sleep(0.2)
    raise TimeoutError(f"not ready in {START_TIMEOUT:.0f} s; see {logs}")


def _stop(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    for process in processes:
        try:
            process.wait(90)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


def _launch(envs: list[dict[str, str]], logs: list[Path]) -> list[subprocess.Popen]:
    return [
        subprocess.Popen(
            [str(BIN / "llmendpoints-runtime"), "serve"],
            env=env,
            stdout=log.open("wb"),
            stderr=subprocess.STDOUT,
            cwd=REPO,
        )
        for env, log in zip(envs, logs, strict=True)
    ]


@contextlib.contextmanager
def running_pod(model: Path, count: int, run_dir: Path) -> Iterator[Pod]:
    port, control = free_port(), free_port()
    log = run_dir / f"pod-{count}.log"
    processes = _launch([runtime_env(model, port, control, API_SERVER_COUNT=str(count))], [log])
    try:
        seconds = _wait_ready(control, processes, [log])
        print(f"  API_SERVER_COUNT={count} ready in {seconds:.0f} s", flush=True)
        yield Pod(f"http://127.0.0.1:{port}", processes[0].pid)
    finally:
        _stop(processes)


@dataclass
class Run:
    servers: int
    round: int
    requests_per_second: float
    median_ttft_ms: float
    api_cpu_ms_per_request: float
    supervisor_cpu_ms_per_request: float
    engine_cpu_ms_per_request: float
    failed: int


def api_server_rounds(args, model: Path, run_dir: Path) -> list[Run]:
    load = Load(args.num_prompts, 64, 64, args.concurrency, warmups=8, seed=0)
    runs: list[Run] = []
    with running_pod(model, 1, run_dir) as one, running_pod(model, 2, run_dir) as two:
        for round_ in range(args.rounds):
            order = [(1, one), (2, two)] if round_ % 2 == 0 else [(2, two), (1, one)]
            for count, pod in order:
                name = f"round{round_}-servers{count}.json"
                before = pod.cpu()
                data = run_client(pod.url, model, load, run_dir, name, run_dir / (name + ".log"))
                used = {k: v - before[k] for k, v in pod.cpu().items()}
                done = int(data["completed"])
                run = Run(
                    servers=count,
                    round=round_,
                    requests_per_second=float(data["request_throughput"]),
                    median_ttft_ms=float(data["median_ttft_ms"]),
                    api_cpu_ms_per_request=used["api"] * 1000 / done,
                    supervisor_cpu_ms_per_request=used["supervisor"] * 1000 / done,
                    engine_cpu_ms_per_request=used["engine"] * 1000 / done,
                    failed=int(data.get("failed", 0)),
                )
                runs.append(run)
                print(
                    f"  round {round_} servers={count}: {run.requests_per_second:.2f} req/s, "
                    f"API CPU {run.api_cpu_ms_per_request:.2f} ms/req",
                    flush=True,
                )
    return runs


def group_envs(model: Path, port: int, controls: list[int], multinode: int) -> list[dict]:
    """A leader and a worker as the operator writes them (tests/runtime/test_multinode_group)."""
    return [
        runtime_env(
            model,
            port,
            controls[rank],
            PIPELINE_PARALLEL_SIZE="2",
            LLMEP_NODES="2",
            LLMEP_MULTINODE_PORT=str(multinode),
            LWS_LEADER_ADDRESS="127.0.0.1",
            LWS_GROUP_SIZE="2",
            LWS_WORKER_INDEX=str(rank),
            VLLM_HOST_IP="127.0.0.1",
        )
        for rank in range(2)
    ]


def startup_seconds(model: Path, kind: str, run_dir: Path, attempt: int) -> float:
    port = free_port()
    if kind == "group":
        controls = [free_port(), free_port()]
        envs = group_envs(model, port, controls, free_port())
    else:
        controls = [free_port()]
        envs = [runtime_env(model, port, controls[0])]
    logs = [run_dir / f"startup-{kind}-{attempt}-{i}.log" for i in range(len(envs))]
    processes = _launch(envs, logs)
    try:
        return _wait_ready(controls[0], processes, logs)
    finally:
        _stop(processes)


def startups(args, model: Path, run_dir: Path) -> dict[str, list[float]]:
    seen: dict[str, list[float]] = {"single": [], "group": []}
    for attempt in range(args.startups):
        order = ("single", "group") if attempt % 2 == 0 else ("group", "single")
        for kind in order:
            seconds = startup_seconds(model, kind, run_dir, attempt)
            seen[kind].append(seconds)
            print(f"  start-up {kind} #{attempt}: {seconds:.1f} s", flush=True)
    return seen


def markdown(runs: list[Run], starts: dict[str, list[float]], facts: dict, args) -> str:
    lines = [
        "## API servers (`bench/api_servers.py`)",
        "",
        f"Machine: {facts['cpus']} CPU cores ({facts['cpu_model']}), vLLM {facts['vllm']}; "
        f"load average at the start {facts['load']}. Demo model, {args.num_prompts} streamed "
        f"/v1/completions per run (64 in, 64 out, {args.concurrency} at once), "
        f"{args.rounds} rounds alternating.",
        "",
        "| servers | round | req/s | median TTFT ms | API CPU ms/req | supervisor ms/req | "
        "engine CPU ms/req | failed |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in runs:
        lines.append(
            f"| {r.servers} | {r.round} | {r.requests_per_second:.2f} | {r.median_ttft_ms:.0f} "
            f"| {r.api_cpu_ms_per_request:.2f} | {r.supervisor_cpu_ms_per_request:.2f} "
            f"| {r.engine_cpu_ms_per_request:.2f} | {r.failed} |"
        )
    if runs:
        ratios = summary(runs)
        lines += [
            "",
            f"Medians, 2 / 1 API servers: requests/s {ratios['throughput_ratio']:.3f}, "
            f"API-process CPU per request {ratios['api_cpu_ratio']:.3f}, API + supervisor "
            f"{ratios['api_and_supervisor_cpu_ratio']:.3f}.",
        ]
    if starts["single"]:
        lines += [
            "",
            "| start-up to ready | runs (s) | median (s) |",
            "| --- | --- | ---: |",
        ]
        for kind, label in (("single", "single pod"), ("group", "2-node group, PP 2")):
            seen = starts[kind]
            lines.append(
                f"| {label} | {', '.join(f'{s:.0f}' for s in seen)} | {statistics.median(seen):.0f} |"
            )
        ratio = statistics.median(starts["group"]) / statistics.median(starts["single"])
        lines += ["", f"Group / single pod, median start-up: {ratio:.2f}."]
    return "\n".join(lines)


def summary(runs: list[Run]) -> dict[str, float]:
    def median(count: int, field: str) -> float:
        return statistics.median(getattr(r, field) for r in runs if r.servers == count)

    def both(count: int) -> float:
        return median(count, "api_cpu_ms_per_request") + median(
            count, "supervisor_cpu_ms_per_request"
        )

    return {
        "throughput_ratio": median(2, "requests_per_second") / median(1, "requests_per_second"),
        "api_cpu_ratio": median(2, "api_cpu_ms_per_request") / median(1, "api_cpu_ms_per_request"),
        "api_and_supervisor_cpu_ratio": both(2) / both(1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--startups", type=int, default=2)
    args = parser.parse_args(argv)
    run_dir = OUT / "api_servers"
    run_dir.mkdir(parents=True, exist_ok=True)
    model = ensure_demo_model(OUT / "demo-model")
    facts = {**machine_facts(), "load": " ".join(f"{x:.1f}" for x in psutil.getloadavg())}
    runs = api_server_rounds(args, model, run_dir) if args.rounds else []
    starts = startups(args, model, run_dir) if args.startups else {"single": [], "group": []}
    result = {
        "facts": facts,
        "runs": [asdict(r) for r in runs],
        "summary": summary(runs) if runs else {},
        "startups": starts,
    }
    (OUT / "api_servers.json").write_text(json.dumps(result, indent=2) + "\n")
    print(markdown(runs, starts, facts, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
