"""Minimal reproduction, plain vLLM only: while the CPU engine generates, its engine core and its
worker spin on their shared-memory queues and starve every other process of a 2-core machine.

Plain `python -m vllm.entrypoints.openai.api_server` (no code of ours in the server) on the demo
model (`llmendpoints-runtime demo-model PATH`, or any small model), `--max-num-seqs 2`, and 24
concurrent 400-token completions. Beside it a "neighbour" process -- what a probe, curl, the
kubelet or a sidecar would be -- wakes every 50 ms and records how late it woke and how long it
was runnable without a CPU (/proc/thread-self/schedstat). Also recorded: the CPU the engine's
processes used, per second of load, and how long the load took.

    .venv/bin/python bench/vllm_spin_repro.py                # vLLM as it is
    .venv/bin/python bench/vllm_spin_repro.py --no-spin      # its queues without the busy loop

`--no-spin` puts bench/_vllm_no_spin on PYTHONPATH: a sitecustomize that makes vLLM's
`shm_broadcast.SpinCondition` wait on its ZeroMQ notification at once (`busy_loop_s=0`) instead
of calling sched_yield() in a loop for a second after every message (vLLM 0.32's default, not
configurable). The upstream report draft is in bench/RESULTS.md, "Probes under load".
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        for task in Path(f"/proc/{todo.pop()}/task").glob("*"):
            with contextlib.suppress(OSError):
                for child in (task / "children").read_text().split():
                    found.append(int(child))
                    todo.append(int(child))
    return found


def cpu_seconds(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            stat = Path(f"/proc/{pid}/stat").read_text()
            fields = stat[stat.rfind(")") + 2 :].split()
            total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


NEIGHBOUR = """
import sys, time, json
from pathlib import Path
def waited():
    return int(Path("/proc/thread-self/schedstat").read_text().split()[1]) / 1e6
late, start_wait = [], waited()
sys.stdout.write("ready\\n"); sys.stdout.flush()
import select
while not select.select([sys.stdin], [], [], 0)[0]:
    t = time.monotonic(); time.sleep(0.05); late.append((time.monotonic() - t - 0.05) * 1000)
print(json.dumps({"late_ms": late, "waited_ms": waited() - start_wait}))
"""


async def load(url: str, n: int, tokens: int) -> float:
    body = {"model": "demo", "prompt": "count", "max_tokens": tokens, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        began = time.monotonic()
        answers = await asyncio.gather(
            *(client.post("/v1/completions", json=body) for _ in range(n))
        )
        assert all(a.status_code == 200 for a in answers), answers[0].text
        return time.monotonic() - began


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, default=None, help="default: write the demo model")
    parser.add_argument("--no-spin", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    model = args.model
    if model is None:
        from llmendpoints_runtime.demo import write_demo_model

        model = write_demo_model(HERE / "out" / "vllm_spin_repro" / "demo-model")
    port = free_port()
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
    }
    if args.no_spin:
        env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(HERE / "_vllm_no_spin"), env.get("PYTHONPATH")])
        )
    log = (HERE / "out" / f"vllm_spin_repro-{port}.log").open("wb")
    server = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
         "--served-model-name", "demo", "--max-model-len", "512", "--max-num-seqs", "2",
         "--port", str(port), "--host", "127.0.0.1"],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            assert server.poll() is None, "the server exited"
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            time.sleep(1)
        engine = descendants(server.pid)
        rows = []
        for _ in range(args.rounds):
            near = subprocess.Popen(
                [sys.executable, "-c", NEIGHBOUR], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                text=True, start_new_session=True,
            )  # fmt: skip
            near.stdout.readline()
            cpu_before = cpu_seconds(engine)
            seconds = asyncio.run(load(url, 24, 400))
            cpu = cpu_seconds(engine) - cpu_before
            near.stdin.write("stop\n")
            near.stdin.flush()
            result = json.loads(near.stdout.readline())
            near.wait(30)
            late = sorted(result["late_ms"])
            rows.append(
                {
                    "load_s": round(seconds, 2),
                    "engine_cores": round(cpu / seconds, 2),
                    "neighbour_waited_ms": round(result["waited_ms"]),
                    "neighbour_late_p50_ms": round(statistics.median(late), 1),
                    "neighbour_late_max_ms": round(late[-1], 1),
                }
            )
            print(
                ("no-spin " if args.no_spin else "vLLM as is ") + json.dumps(rows[-1]), flush=True
            )
    finally:
        server.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.wait(60)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(server.pid, signal.SIGKILL)


if __name__ == "__main__":
    main()
