"""Probes and /metrics of a loaded pod, asked from another process (issue 25).

The load: MAX_NUM_SEQS=2 and 24 concurrent 400-token /v1/completions on the demo model, so the
engine runs 2 and its scheduler holds 22 for the whole run. Meanwhile a separate prober process
asks /health, /ready and /metrics in turn every 50 ms, each on a fresh connection as the
kubelet and Prometheus do, and records how long the connect and the whole answer took. The
servers:

- ``ours``: `llmendpoints-runtime serve`, probes on its main port (answered by the event loop);
- ``ours-control``: the same server, probes on its control port (LLMEP_CONTROL_PORT: a listener
  in a thread of its own, runtime/llmendpoints_runtime/control_listener.py);
- ``vllm``: plain `python -m vllm.entrypoints.openai.api_server` (/health and /metrics; it has
  no /ready, /ping stands in for it).

    .venv/bin/python bench/probes_under_load.py                        # all three, 3 rounds
    .venv/bin/python bench/probes_under_load.py --servers ours,vllm --rounds 5
    .venv/bin/python bench/probes_under_load.py --renice-engine 19     # the engine's threads at nice 19
    .venv/bin/python bench/probes_under_load.py --server-env OMP_WAIT_POLICY=PASSIVE

Besides the latencies, each round records what the kernel says about who waited for a CPU
(/proc/<pid>/task/<tid>/schedstat: time spent runnable but not running) for the server's API
thread, the engine's threads and the prober itself, the machine's steal time, and the mid-load
autoscaling gauges the probes read. Results: bench/out/probes_under_load.json and a Markdown
table on stdout (for bench/RESULTS.md).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
# The tests' kits (tests/conftest.py puts the same two folders on the path).
sys.path[:0] = [str(REPO / "tests"), str(REPO / "tests" / "runtime")]
from runtime_process import free_port, launch_runtime  # noqa: E402

PROBER = REPO / "tests" / "runtime" / "prober.py"  # the engine tests' prober, shared

OUT = REPO / "bench" / "out"
SERVED = "demo"
CONCURRENT = 24
MAX_NUM_SEQS = 2
MAX_TOKENS = 400
PROBE_TIMEOUT = 10.0
NEW_SESSION_PROBER = False  # --prober-new-session: the prober in a session (autogroup) of its own
PROBER_NICE: int | None = (
    None  # --prober-nice: that autogroup's nice (a kubelet outside the pod)  # the kubelet's default is 1 s; a stall longer than this is one failure
)

# -- what the kernel says ------------------------------------------------------------------------


def _run_delay_ns(pid: int, tid: int) -> int:
    """Nanoseconds thread tid has spent runnable but waiting for a CPU (schedstat field 2)."""
    try:
        return int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def _children(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            with contextlib.suppress(OSError):
                for child in (task / "children").read_text().split():
                    found.append(int(child))
                    todo.append(int(child))
    return found


def _threads(pid: int) -> list[int]:
    with contextlib.suppress(OSError):
        return [int(t.name) for t in Path(f"/proc/{pid}/task").iterdir()]
    return []


def _comm(pid: int, tid: int) -> str:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
    return "?"


def _steal_jiffies() -> int:
    fields = Path("/proc/stat").read_text().splitlines()[0].split()
    return int(fields[8])


@dataclass
class KernelView:
    api_wait_ms: float  # the server's main (event loop) thread, runnable but not running
    api_threads_wait_ms: float  # every thread of the API process
    engine_wait_ms: float  # the engine's processes' threads
    engine_cpu_s: float
    steal_ms: float


def kernel_snapshot(server_pid: int) -> dict:
    engine = _children(server_pid)
    return {
        "api_main": _run_delay_ns(server_pid, server_pid),
        "api_all": sum(_run_delay_ns(server_pid, t) for t in _threads(server_pid)),
        "engine": sum(_run_delay_ns(p, t) for p in engine for t in _threads(p)),
        "engine_cpu": sum(_cpu_ticks(p) for p in engine),
        "steal": _steal_jiffies(),
    }


def _cpu_ticks(pid: int) -> int:
    with contextlib.suppress(OSError, IndexError, ValueError):
        stat = Path(f"/proc/{pid}/stat").read_text()
        fields = stat[stat.rfind(")") + 2 :].split()
        return int(fields[11]) + int(fields[12])
    return 0


def kernel_delta(before: dict, after: dict) -> KernelView:
    hz = os.sysconf("SC_CLK_TCK")
    return KernelView(
        api_wait_ms=(after["api_main"] - before["api_main"]) / 1e6,
        api_threads_wait_ms=(after["api_all"] - before["api_all"]) / 1e6,
        engine_wait_ms=(after["engine"] - before["engine"]) / 1e6,
        engine_cpu_s=(after["engine_cpu"] - before["engine_cpu"]) / hz,
        steal_ms=(after["steal"] - before["steal"]) * 1000 / hz,
    )


def renice_engine(server_pid: int, nice: int) -> list[str]:
    """Every thread of every engine process (nice is per thread: renicing the process's main
    thread leaves the OpenMP threads where they were)."""
    done = []
    for pid in _children(server_pid):
        for tid in _threads(pid):
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, tid, nice)
                done.append(f"{pid}/{tid}:{_comm(pid, tid)}")
    return done


# -- servers --------------------------------------------------------------------------------------


@dataclass
class Server:
    name: str
    url: str
    pid: int
    probe_port: int
    paths: list[str]


@contextlib.contextmanager
def running(name: str, model: Path, logs: Path, extra_env: dict[str, str]) -> Iterator[Server]:
    if name in ("ours", "ours-control"):
        control_port = free_port()
        if name == "ours-control":
            extra_env = {"LLMEP_CONTROL_PORT": str(control_port), **extra_env}
        server = launch_runtime(
            model, logs, MAX_NUM_SEQS=str(MAX_NUM_SEQS), MAX_CONCURRENCY="64", **extra_env
        )
        try:
            server.wait_listening()
            server.wait_ready()
            port = control_port if name == "ours-control" else server.port
            yield Server(
                name, server.url, server.process.pid, port, ["/health", "/ready", "/metrics"]
            )
        finally:
            server.stop()
        return
    port = free_port()
    keep = {"PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "USER"}
    env = {k: v for k, v in os.environ.items() if k in keep or k.startswith("VLLM_")}
    env.update(
        VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1"
    )
    env.update(extra_env)
    argv = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model), "--served-model-name", SERVED, "--max-model-len", "512",
        "--max-num-seqs", str(MAX_NUM_SEQS), "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip
    log = (logs / f"vllm-{port}.log").open("wb")
    process = subprocess.Popen(
        argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 480
        while True:
            assert process.poll() is None, f"plain vLLM exited; see {log.name}"
            assert time.monotonic() < deadline, "plain vLLM did not start"
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            time.sleep(0.5)
        yield Server(name, url, process.pid, port, ["/health", "/ping", "/metrics"])
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)


# -- one round --------------------------------------------------------------------------------------


async def load(url: str) -> tuple[float, float, int]:
    body = {"model": SERVED, "prompt": "count", "max_tokens": MAX_TOKENS, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        began = time.time()
        answers = await asyncio.gather(
            *(client.post("/v1/completions", json=body) for _ in range(CONCURRENT))
        )
        ended = time.time()
    return began, ended, sum(1 for a in answers if a.status_code == 200)


def one_round(server: Server, interval: float, workdir: Path, index: int) -> dict:
    out = workdir / f"probes-{server.name}-{index}.json"
    prober = subprocess.Popen(
        [
            *(["chrt", "--fifo", "1"] if PROBER_FIFO else []),
            sys.executable, str(PROBER), "--port", str(server.probe_port),
            "--paths", ",".join(server.paths), "--interval", str(interval), "--out", str(out),
            "--timeout", str(PROBE_TIMEOUT),
            *(["--nice", str(PROBER_NICE)] if PROBER_NICE is not None else []),
        ],
        stdin=subprocess.PIPE,
        start_new_session=NEW_SESSION_PROBER,
    )  # fmt: skip
    time.sleep(1.0)  # a few idle probes first
    before = kernel_snapshot(server.pid)
    began, ended, ok = asyncio.run(load(server.url))
    after = kernel_snapshot(server.pid)
    time.sleep(0.5)
    prober.stdin.close()
    prober.wait(60)
    data = json.loads(out.read_text())
    during = [r for r in data["records"] if began <= r["t"] <= ended]
    return {
        "server": server.name,
        "round": index,
        "load_seconds": ended - began,
        "completed": ok,
        "probes": summarise(during, server.paths),
        "gauges_mid_load": [r["gauges"] for r in during if "gauges" in r],
        "kernel": kernel_delta(before, after).__dict__,
        "prober_run_delay_ms": data["prober_run_delay_ms"],
    }


def summarise(records: list[dict], paths: list[str]) -> dict:
    result = {}
    for path in [*paths, "all"]:
        rows = [r for r in records if path in ("all", r["path"])]
        times = sorted(r["total_ms"] for r in rows)
        connects = sorted(r.get("connect_ms", PROBE_TIMEOUT * 1000) for r in rows)
        result[path] = {
            "n": len(rows),
            "failed": sum(1 for r in rows if "error" in r or r.get("status", 0) >= 500),
            "p50_ms": _pct(times, 50),
            "p99_ms": _pct(times, 99),
            "max_ms": times[-1] if times else None,
            "connect_p99_ms": _pct(connects, 99),
            "connect_max_ms": connects[-1] if connects else None,
            # The control port's answers are published ones: how old they were when served.
            "age_max_ms": max((r["age_ms"] for r in rows if "age_ms" in r), default=None),
        }
    return result


def _pct(values: list[float], p: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[min(int(p), 99) - 1]


def markdown(results: list[dict], note: str) -> str:
    lines = [
        f"Probes and /metrics under load ({note}): p50 / p99 / max of each probe's whole answer "
        "(ms, fresh connection each, another process), over the probes sent while the 24 "
        "requests ran.",
        "",
        "| server | round | load s | probes | failed | p50 ms | p99 ms | max ms | connect max ms |"
        " answer age max ms | API thread waited for CPU ms | prober waited ms | steal ms |"
        " mid-load gauges (running/waiting, min-max) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        a = r["probes"]["all"]
        g = r["gauges_mid_load"]
        if r["server"].startswith("ours"):
            run = [x["llmendpoints_requests_in_flight"] for x in g]
            wait = [x["llmendpoints_queue_depth"] for x in g]
        else:
            run = [x["vllm:num_requests_running"] for x in g]
            wait = [x["vllm:num_requests_waiting"] for x in g]
        gauge_words = (
            f"{min(run):g}-{max(run):g} / {min(wait):g}-{max(wait):g} ({len(g)} scrapes)"
            if g
            else "none answered"
        )
        k = r["kernel"]
        lines.append(
            f"| {r['server']} | {r['round']} | {r['load_seconds']:.1f} | {a['n']} | {a['failed']} | "
            f"{_f(a['p50_ms'])} | {_f(a['p99_ms'])} | {_f(a['max_ms'])} | {_f(a['connect_max_ms'])} | "
            f"{_f(a['age_max_ms'])} | "
            f"{k['api_wait_ms']:.0f} | {r['prober_run_delay_ms']:.0f} | {k['steal_ms']:.0f} | {gauge_words} |"
        )
    return "\n".join(lines)


def _f(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--servers", default="ours,ours-control,vllm")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--interval", type=float, default=0.05)
    parser.add_argument("--renice-engine", type=int, default=None)
    parser.add_argument("--server-env", action="append", default=[], help="KEY=VALUE")
    parser.add_argument("--prober-new-session", action="store_true")
    parser.add_argument("--prober-nice", type=int, default=None, help="with --prober-new-session")
    parser.add_argument(
        "--prober-fifo",
        action="store_true",
        help="run the prober under SCHED_FIFO (chrt, root): what it measures is then the server",
    )
    parser.add_argument("--note", default="")
    parser.add_argument("--out", type=Path, default=OUT / "probes_under_load.json")
    args = parser.parse_args()

    global NEW_SESSION_PROBER, PROBER_NICE, PROBER_FIFO
    PROBER_FIFO = args.prober_fifo
    NEW_SESSION_PROBER = args.prober_new_session or args.prober_nice is not None
    PROBER_NICE = args.prober_nice
    from llmendpoints_runtime.demo import write_demo_model

    work = OUT / "probes_under_load"
    work.mkdir(parents=True, exist_ok=True)
    model = write_demo_model(work / "demo-model")
    extra_env = dict(item.split("=", 1) for item in args.server_env)
    results: list[dict] = []
    names = args.servers.split(",")
    # ours and ours-control are the same server, probed on two ports: start it once.
    groups = [[n for n in names if n.startswith("ours")], [n for n in names if n == "vllm"]]
    for group in filter(None, groups):
        with running(group[-1], model, work, extra_env) as server:
            if args.renice_engine is not None:
                reniced = renice_engine(server.pid, args.renice_engine)
                print(f"  reniced {len(reniced)} engine thread(s) to {args.renice_engine}")
            for index in range(args.rounds):
                for name in group:
                    port = server.probe_port
                    if name == "ours":
                        port = int(server.url.rsplit(":", 1)[1])
                    view = Server(name, server.url, server.pid, port, server.paths)
                    result = one_round(view, args.interval, work, index)
                    results.append(result)
                    a = result["probes"]["all"]
                    print(
                        f"  {name} round {index}: {a['n']} probes, p99 {_f(a['p99_ms'])} ms, "
                        f"max {_f(a['max_ms'])} ms, failed {a['failed']}",
                        flush=True,
                    )
    note = args.note or ", ".join(
        filter(None, [f"renice {args.renice_engine}" if args.renice_engine is not None else "",
                      " ".join(args.server_env)])
    ) or "defaults"  # fmt: skip
    args.out.write_text(json.dumps({"note": note, "results": results}, indent=1))
    print(markdown(results, note))


if __name__ == "__main__":
    main()
