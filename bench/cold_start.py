"""Cold start phase by phase: the first replica of a model vs a second one on the same model
cache, each on a fresh HOME (a new pod), before and after compile caches moved to the volume.

    .venv/bin/python bench/cold_start.py                  # ~10 minutes on 2 cores
    .venv/bin/python bench/cold_start.py --pairs 2 --modes after

Target (issue 32, DESIGN.md "Performance targets"): the second replica's load phase <= 0.6x
the first's on this machine.

Modes, each a pair of `llmendpoints-runtime serve` runs one after the other, one BASE_PATH per
pair, a HOME per run:

- ``before``: LLMEP_COMPILE_CACHE_DIR=none -- vLLM's caches in HOME, as before issue 32: every
  new pod compiles the model and runs vLLM's model inspection again;
- ``after``: the defaults -- the caches on the model-cache volume, the plugin making the CPU
  build's compiled model loadable;
- ``restart`` (``--modes restart``): the same HOME twice without the plugin (VLLM_PLUGINS
  leaving it out) -- a container restarted on the same pod before issue 32, where vLLM 0.32 on
  CPU fails to load its own artifact and compiles again.

Per run: the runtime's phases (/metrics), where the compiled model came from, the CPU seconds of
the runtime's process tree at ready (user + system: what the load cost whatever else the machine
ran), and the load average when it started. Output: a Markdown table on stdout, JSON in
bench/out/cold_start.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests"), str(REPO / "tests" / "runtime")]

from plugin_registration import plugin_path  # noqa: E402
from runtime_process import launch_runtime  # noqa: E402

TARGET = 0.6
PROMPT = {"model": "demo", "prompt": "The cache", "max_tokens": 8, "temperature": 0}


def tree_cpu_seconds(pid: int) -> float:
    """user + system CPU seconds of ``pid`` and its live descendants, with what their exited
    children used (vLLM's model inspection subprocess, the C++ compiler's runs), from /proc."""
    parents: dict[int, int] = {}
    times: dict[int, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(entry.name)] = int(fields[1])
        times[int(entry.name)] = sum(int(f) for f in fields[11:15]) / tick
    tree, frontier = {pid}, [pid]
    while frontier:
        parent = frontier.pop()
        for child, ppid in parents.items():
            if ppid == parent and child not in tree:
                tree.add(child)
                frontier.append(child)
    return sum(times.get(p, 0.0) for p in tree)


def run_once(model: Path, logs: Path, base: Path, home: Path, env: dict[str, str]) -> dict:
    load_average = os.getloadavg()[0]
    server = launch_runtime(model, logs, BASE_PATH=str(base), HOME=str(home), **env)
    try:
        # A busy shared machine stretches an engine's start to many minutes.
        server.wait_listening(timeout=900)
        server.wait_ready(timeout=1800)
        cpu = tree_cpu_seconds(server.process.pid)
        reply = httpx.post(server.url + "/v1/completions", json=PROMPT, timeout=120)
        metrics = httpx.get(server.url + "/metrics", timeout=30).text
    finally:
        server.stop()
    phases = {
        name: round(float(value), 2)
        for name, value in re.findall(
            r'llmendpoints_startup_phase_seconds\{phase="(\w+)"\} ([\d.e+-]+)', metrics
        )
    }
    source = re.findall(r'llmendpoints_startup_compile_source\{source="(\w+)"\} 1', metrics)
    return {
        "phases": phases,
        "compile_source": source[0] if source else None,
        "cpu_seconds_to_ready": round(cpu, 1),
        "load_average": round(load_average, 1),
        "answer": reply.json()["choices"][0]["text"],
        "log": str(server.log_path),
    }


def run_pair(model: Path, root: Path, mode: str, extra_path: Path | None) -> list[dict]:
    logs = root / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    base = root / "model-cache"
    pythonpath = os.pathsep.join(
        p for p in (str(extra_path) if extra_path else "", os.environ.get("PYTHONPATH", "")) if p
    )
    env = {"PYTHONPATH": pythonpath}
    if mode == "before":
        env["LLMEP_COMPILE_CACHE_DIR"] = "none"
    if mode == "restart":
        env |= {"LLMEP_COMPILE_CACHE_DIR": "none", "VLLM_PLUGINS": "none"}
    homes = (
        [root / "home", root / "home"] if mode == "restart" else [root / "home-1", root / "home-2"]
    )
    return [run_once(model, logs, base, home, env) for home in homes]


def table(results: dict[str, list[list[dict]]]) -> str:
    phases = ("startup", "download", "load", "compile", "warmup", "ready")
    lines = [
        "| mode | replica | "
        + " | ".join(phases)
        + " | compiled model | CPU s to ready | load avg |",
        "| --- | --- | " + " | ".join("---:" for _ in phases) + " | --- | ---: | ---: |",
    ]
    for mode, pairs in results.items():
        for pair in pairs:
            for i, run in enumerate(pair, 1):
                cells = " | ".join(f"{run['phases'].get(p, 0):.1f}" for p in phases)
                lines.append(
                    f"| {mode} | {i} | {cells} | {run['compile_source'] or '-'} | "
                    f"{run['cpu_seconds_to_ready']:.0f} | {run['load_average']:.1f} |"
                )
            first, second = (r["phases"]["load"] for r in pair)
            cpu = pair[1]["cpu_seconds_to_ready"] / pair[0]["cpu_seconds_to_ready"]
            lines.append(
                f"| {mode} | 2nd/1st | load {second / first:.2f} (target <= {TARGET}) | "
                f"CPU {cpu:.2f} | | | | | | |"
            )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=1)
    parser.add_argument("--modes", default="before,after", help="before, after, restart")
    parser.add_argument("--keep", type=Path, help="keep logs and caches here")
    args = parser.parse_args()
    from llmendpoints_runtime.demo import write_demo_model

    root = args.keep or Path(tempfile.mkdtemp(prefix="cold-start-"))
    model = write_demo_model(root / "demo-model")
    extra = plugin_path(root / "plugin-registration")
    results: dict[str, list[list[dict]]] = {}
    began = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    for _ in range(args.pairs):
        for mode in args.modes.split(","):
            n = len(results.get(mode, []))
            results.setdefault(mode, []).append(run_pair(model, root / f"{mode}-{n}", mode, extra))
    print(f"cold start, {began}, {os.cpu_count()} CPUs\n")
    print(table(results))
    out = REPO / "bench" / "out" / "cold_start.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
