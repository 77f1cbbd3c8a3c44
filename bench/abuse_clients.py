"""Memory and CPU a client (or a pod) cannot hold (issue 28): what one hostile party costs the
gateway or the control port, this code next to an older checkout's.

    .venv/bin/python bench/abuse_clients.py bodies --before /path/to/old/checkout   # ~6 min
    .venv/bin/python bench/abuse_clients.py sse --before /path/to/old/checkout      # ~2 min
    .venv/bin/python bench/abuse_clients.py control --before /path/to/old/checkout  # ~1 min

Sections:

bodies -- a gateway (static endpoints file, one stand-in backend, one key) gets ``--rounds``
rounds of ``--clients`` chat requests of ``--size`` bytes at once, each client closing after the
answer's status line with the rest unread (the kernel resets the connection). The gateway's RSS
(/proc VmRSS) before, 1 s after each round, and once it settles (up to 15 s after the last).

sse -- one streamed chat request whose pod sends a first event and then one event of ``--size``
bytes that never ends (the stand-in's ``standin_unterminated``); the client reads every byte.
The gateway's CPU time (user + system, /proc) for it, with ``stream_options.include_usage``
unset (the usual case: the gateway strips the usage chunk, so it holds events back) and set.

control -- the runtime's control port (``control_listener.start``, the child process the runtime
runs; no engine needed) under 16 connections that send a header byte every 4 s and under 512
that send nothing, each reopened as soon as it is closed: how many of 20 kubelet probes of
/health (each allowed 10 s) got 200.

``--before PATH``: the same against that checkout's gateway/runtime packages (its folders first
on PYTHONPATH), alternated with this one's for ``--rounds`` (bodies: once each).
Results: Markdown on stdout, JSON in bench/out/abuse_clients_<section>.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from abuse import (
    REPO,
    code_trees,
    loadavg,
    machine,
    pythonpath,
    running_gateway_of,
)
from gateway.harness import chat_body, hang_up_round, launch_standin
from proc_kit import cpu_seconds, rss_mib

KEY = "sk-bench-clients-0123456789"
MiB = 1024 * 1024
OUT = REPO / "bench" / "out"


def _header(title: str, command: str, setup: str) -> list[str]:
    return [
        f"## {title} ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})",
        "",
        f"Command: `{command}`  ",
        f"Machine: {machine()}; load average {loadavg()} at the end. {setup}",
        "",
    ]


def _with_standin(run):
    """``run(backend, log_dir)`` with one stand-in backend up."""
    log_dir = OUT / "abuse-logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    backend = launch_standin(log_dir, "clients")
    try:
        backend.wait_http("/ready")
        return run(backend, log_dir)
    finally:
        backend.stop()


def _gateway(code: Path, backend, log_dir: Path):
    endpoint = {"name": "one", "models": ["one"], "backends": [backend.url]}
    return running_gateway_of(code, log_dir, [endpoint], API_KEYS=KEY)


def _wait_ready(gateway) -> None:
    deadline = time.monotonic() + 30
    auth = {"authorization": f"Bearer {KEY}"}
    while (
        httpx.get(gateway.url + "/v1/models", headers=auth).json()["data"][0]["ready_replicas"] != 1
    ):
        if time.monotonic() > deadline:
            raise TimeoutError("the gateway never saw its backend ready")
        time.sleep(0.1)


# -- bodies -----------------------------------------------------------------------------------


def bodies(args: argparse.Namespace) -> dict:
    def run(backend, log_dir: Path) -> list[dict]:
        runs = []
        for label, code in code_trees(args.before):
            print(f"bodies: {label}", file=sys.stderr)
            with _gateway(code, backend, log_dir) as gateway:
                _wait_ready(gateway)
                pid = gateway.process.pid
                hang_up_round(gateway.port, KEY, chat_body(100_000), 2)
                began = rss_mib(pid)
                body, statuses, after = chat_body(args.size), Counter(), []
                for _ in range(args.rounds):
                    statuses.update(
                        s.decode() for s in hang_up_round(gateway.port, KEY, body, args.clients)
                    )
                    time.sleep(1.0)
                    after.append(round(rss_mib(pid)))
                deadline = time.monotonic() + 15
                while (settled := rss_mib(pid)) > began + 100 and time.monotonic() < deadline:
                    time.sleep(0.5)
            runs.append({"code": label, "began_mib": round(began), "after_rounds_mib": after,
                         "settled_mib": round(settled), "statuses": dict(statuses)})  # fmt: skip
        return runs

    return {"rounds": args.rounds, "clients": args.clients, "size": args.size,
            "runs": _with_standin(run)}  # fmt: skip


def bodies_markdown(result: dict, command: str) -> str:
    lines = _header(
        "Request bodies whose clients hang up: the gateway's memory",
        command,
        f"One gateway, one stand-in backend; {result['rounds']} rounds of {result['clients']} "
        f"chat requests of {result['size']:,} bytes at once, each client closing after the "
        "status line with the ~200 KB answer unread. RSS 1 s after each round; settled: the "
        "first reading within 100 MiB of the start, else the last of 15 s.",
    )
    lines += ["| code | RSS at start MiB | after each round MiB | settled MiB | answers | target |",
              "| --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for r in result["runs"]:
        lines.append(
            f"| {r['code']} | {r['began_mib']} | {', '.join(map(str, r['after_rounds_mib']))} | "
            f"**{r['settled_mib']}** (+{r['settled_mib'] - r['began_mib']}) | {r['statuses']} | "
            "within 100 MiB of the start |"
        )
    return "\n".join(lines) + "\n"


# -- sse --------------------------------------------------------------------------------------


def _unterminated_cpu(gateway, size: int, include_usage: bool) -> dict:
    request = {
        "model": "one",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "standin_unterminated": size,
    }
    if include_usage:
        request["stream_options"] = {"include_usage": True}
    pid = gateway.process.pid
    before, started, received = cpu_seconds(pid), time.monotonic(), 0
    headers = {"authorization": f"Bearer {KEY}"}
    with httpx.stream("POST", gateway.url + "/v1/chat/completions", json=request,
                      headers=headers, timeout=600) as answer:  # fmt: skip
        for chunk in answer.iter_raw():
            received += len(chunk)
    return {"cpu_s": round(cpu_seconds(pid) - before, 2),
            "wall_s": round(time.monotonic() - started, 2), "received": received}  # fmt: skip


def sse(args: argparse.Namespace) -> dict:
    def run(backend, log_dir: Path) -> list[dict]:
        runs = []
        for round_ in range(1, args.rounds + 1):
            for label, code in code_trees(args.before):
                print(f"sse: {label}, round {round_}", file=sys.stderr)
                with _gateway(code, backend, log_dir) as gateway:
                    _wait_ready(gateway)
                    for include_usage in (False, True):
                        runs.append({"code": label, "round": round_,
                                     "include_usage": include_usage,
                                     **_unterminated_cpu(gateway, args.size, include_usage)})  # fmt: skip
        return runs

    return {"size": args.size, "runs": _with_standin(run)}


def sse_markdown(result: dict, command: str) -> str:
    lines = _header(
        "An unterminated SSE event: the gateway's CPU",
        command,
        f"One gateway, one stand-in backend sending one event then {result['size']:,} bytes of "
        "one event that never ends; the client reads it all. CPU: user + system of the gateway "
        "process from /proc, before and after the request.",
    )
    lines += ["| code (round) | usage asked by the client | gateway CPU s | wall s | bytes relayed | target |",
              "| --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for r in result["runs"]:
        asked = "yes" if r["include_usage"] else "no (the usual case)"
        lines.append(f"| {r['code']} ({r['round']}) | {asked} | **{r['cpu_s']}** | {r['wall_s']} | "
                     f"{r['received']:,} | < 0.5 |")  # fmt: skip
    return "\n".join(lines) + "\n"


# -- control ----------------------------------------------------------------------------------

_CONTROL_RUN = """
import json, sys
sys.path[:0] = [{tests!r}, {runtime_tests!r}]
from llmendpoints_runtime import control_listener as c
from llmendpoints_runtime.health import Health
from prober import SlowClients, kubelet_probes
health = Health(); health.engine_ready()
surface = c.ControlSurface(health.liveness, lambda s: health.readiness(strict=s),
                           lambda: (b"", "text/plain"))
port = c.start(surface, "127.0.0.1", 0)
out = []
try:
    for count, every in ((16, 4.0), (512, None)):
        with SlowClients(port.port, count, every) as clients:
            probes = kubelet_probes(port.port)
        out.append({{"clients": count, "every": every,
                    "answered": sum(p.get("status") == 200 for p in probes),
                    "probes": len(probes), "closed_by_server": clients.closed_by_server}})
finally:
    port.close()
print(json.dumps(out))
"""


def control(args: argparse.Namespace) -> dict:
    runs = []
    script = _CONTROL_RUN.format(
        tests=str(REPO / "tests"), runtime_tests=str(REPO / "tests" / "runtime")
    )
    for round_ in range(1, args.rounds + 1):
        for label, code in code_trees(args.before):
            print(f"control: {label}, round {round_}", file=sys.stderr)
            env = {"PYTHONPATH": pythonpath(code), "PATH": "/usr/bin:/bin", "PYTHONUNBUFFERED": "1"}
            done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                                  text=True, timeout=600, check=True)  # fmt: skip
            for r in json.loads(done.stdout.strip().splitlines()[-1]):
                runs.append({"code": label, "round": round_, **r})
    return {"runs": runs}


def control_markdown(result: dict, command: str) -> str:
    lines = _header(
        "The control port under slow and silent clients: the kubelet's probes",
        command,
        "The runtime's control port process (control_listener.start; no engine), clients kept "
        "open and reopened as soon as they are closed; 20 probes of /health a kubelet would send, "
        "each on a fresh connection, each allowed 10 s.",
    )
    lines += ["| code (round) | clients | what they send | /health answered | connections the port closed | target |",
              "| --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for r in result["runs"]:
        sends = "a header byte every 4 s" if r["every"] else "nothing"
        lines.append(f"| {r['code']} ({r['round']}) | {r['clients']} | {sends} | "
                     f"**{r['answered']} of {r['probes']}** | {r['closed_by_server']} | all |")  # fmt: skip
    return "\n".join(lines) + "\n"


SECTIONS = {
    "bodies": (bodies, bodies_markdown),
    "sse": (sse, sse_markdown),
    "control": (control, control_markdown),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.set_defaults(section=None)
    sub = parser.add_subparsers(dest="section")
    for name, rounds in (("bodies", 9), ("sse", 1), ("control", 1)):
        section = sub.add_parser(name)
        section.add_argument("--before", type=Path, help="an older checkout, measured too")
        section.add_argument("--rounds", type=int, default=rounds)
        if name == "bodies":
            section.add_argument("--clients", type=int, default=40)
            section.add_argument("--size", type=int, default=10_000_000)
        if name == "sse":
            section.add_argument("--size", type=int, default=50 * MiB)
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    command = " ".join([".venv/bin/python", "bench/abuse_clients.py", *sys.argv[1:]])
    for name in [args.section] if args.section else ["control"]:
        if args.section is None:  # as `make bench` runs it: the quick section, defaults
            args = parser.parse_args([name])
        run, markdown = SECTIONS[name]
        result = run(args)
        (OUT / f"abuse_clients_{name}.json").write_text(json.dumps(result, indent=2) + "\n")
        print(markdown(result, command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
