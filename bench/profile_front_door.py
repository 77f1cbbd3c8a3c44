"""Where our gateway's CPU goes per proxied streamed request: a py-spy profile of the gateway
while vLLM's bench client streams chats through it to one real runtime (issue 33's remaining gap).

    nice -n 10 .venv/bin/python bench/profile_front_door.py --num-prompts 300

The set-up is bench/vs_vllm_router.py's ``cpu`` part, ours only: the demo model's runtime with
its control port on, this checkout's gateway (keyless, one worker) in front, a warm-up pass,
then ``--num-prompts`` streamed chats (``--output-len`` tokens, ``--concurrency`` in flight)
while ``py-spy record`` samples every process of the gateway (``--rate`` Hz, non-blocking: the
gateway is never paused). Idle threads are not sampled, so the samples are where the gateway
spends CPU.

The samples are summed three ways: by the frame that ran (self time), by the layer a stack passes
through (the innermost of ours, the HTTP server, the upstream client, asyncio's loop, ...), and
inclusive per function of ours. Also the gateway's CPU per request and per SSE event over the
run (schedstat), and the events per request the client received. Results:
bench/out/profile_front_door/{samples.txt,summary.json} and a Markdown section on stdout.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import runtime_vs_vllm as rv
import vs_vllm_router as vr

OUT = vr.OUT / "profile_front_door"

# A stack's layer: the first of these (outermost first, in this order) whose marker is in a
# frame's file path names it; else "other". Ours are told apart by package.
LAYERS = (
    ("SSE meter (usage)", ("llmendpoints_gateway/stream_meter", "llmendpoints_gateway/metering")),
    ("routing / scoring", ("llmendpoints_gateway/routing", "llmendpoints_gateway/scoring")),
    ("prefix index", ("llmendpoints_gateway/prefix_index",)),
    ("keys / limits", ("llmendpoints_gateway/keys", "llmendpoints_gateway/limiter",
                       "llmendpoints_gateway/quotas", "llmendpoints_edge/keys")),
    ("proxy / upstream (ours)", ("llmendpoints_gateway/proxy", "llmendpoints_gateway/upstream")),
    ("edge server (ours)", ("llmendpoints_edge/",)),
    ("gateway, other (ours)", ("llmendpoints_gateway/",)),
    ("common (ours)", ("llmendpoints_common/",)),
    ("aiohttp", ("aiohttp/",)),
    ("httpx / httpcore", ("httpx/", "httpcore/")),
    ("uvicorn / h11 / httptools", ("uvicorn/", "h11/", "httptools/")),
    ("json", ("json/", "orjson", "msgspec")),
    ("asyncio loop", ("asyncio/", "uvloop/", "loop.pyx", "handles/", "transports/")),
)  # fmt: skip


def parse_raw(path: Path) -> list[tuple[list[str], int]]:
    """py-spy's raw (collapsed) output: ``frame;frame;...;frame count``, outermost first."""
    stacks = []
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            stacks.append((stack.split(";"), int(count)))
    return stacks


def frame_file(frame: str) -> str:
    """``function (path/to/file.py:123)`` -> ``path/to/file.py``."""
    inside = frame.rpartition("(")[2].rstrip(")")
    return inside.rpartition(":")[0] or inside


# Leaf frames (with --native) that say what the sample was doing whoever called it.
IDLE_LEAVES = ("epoll_wait", "epoll_pwait")  # the loop waiting: not CPU
SYSCALL_LEAVES = ("write", "writev", "send", "sendto", "sendmsg", "read", "recv", "recvfrom",
                  "recvmsg", "connect", "accept4", "close", "getpid", "getrandom", "shutdown")  # fmt: skip


def leaf_name(stack: list[str]) -> str:
    return stack[-1].partition(" (")[0]


def layer_of(stack: list[str], layers=LAYERS) -> str:
    """The innermost of ``layers`` a stack is in: what the sample's CPU was spent for."""
    leaf = leaf_name(stack)
    if leaf in SYSCALL_LEAVES:
        return f"system calls ({'read' if leaf.startswith(('read', 'recv')) else leaf})"
    if leaf.startswith("gc_"):
        return "garbage collector"
    for frame in reversed(stack):
        path = frame_file(frame)
        for name, markers in layers:
            if any(marker in path for marker in markers):
                return name
    return "other"


def summarize(stacks: list[tuple[list[str], int]], top: int = 25, layers=LAYERS) -> dict:
    """Shares of the samples taken while the process ran (the loop's waits left out)."""
    idle = sum(count for stack, count in stacks if leaf_name(stack) in IDLE_LEAVES)
    stacks = [(stack, count) for stack, count in stacks if leaf_name(stack) not in IDLE_LEAVES]
    total = sum(count for _, count in stacks) or 1
    self_time: collections.Counter[str] = collections.Counter()
    by_layer: collections.Counter[str] = collections.Counter()
    ours_inclusive: collections.Counter[str] = collections.Counter()
    for stack, count in stacks:
        self_time[_short(stack[-1])] += count
        by_layer[layer_of(stack, layers)] += count
        for frame in set(stack):
            if "llmendpoints_" in frame_file(frame):
                ours_inclusive[_short(frame)] += count

    def share(counter: collections.Counter[str], n: int) -> list[tuple[str, float]]:
        return [(name, round(100 * c / total, 1)) for name, c in counter.most_common(n)]

    return {
        "samples": total,
        "idle_samples_left_out": idle,
        "self": share(self_time, top),
        "layers": share(by_layer, 32),
        "ours_inclusive": share(ours_inclusive, top),
    }


def _short(frame: str) -> str:
    """``function (…/site-packages/pkg/mod.py:12)`` -> ``function (pkg/mod.py:12)``."""
    name, _, where = frame.partition(" (")
    for cut in ("site-packages/", "/work/", "lib/python3.11/"):
        if cut in where:
            where = where.split(cut, 1)[1]
    parts = where.rstrip(")").split("/")
    return f"{name} ({'/'.join(parts[-2:])})"


@contextlib.contextmanager
def recording(
    pid: int,
    samples: Path,
    log: Path,
    *,
    rate: int,
    native: bool = False,
    subprocesses: bool = False,
) -> Iterator[None]:
    """``py-spy record`` of ``pid`` (raw samples to ``samples``) while the block runs."""
    spy = subprocess.Popen(
        [
            str(vr.BIN / "py-spy"), "record", "--pid", str(pid), "--rate", str(rate),
            "--format", "raw", "--output", str(samples),
            *(["--subprocesses"] if subprocesses else []),
            # Native frames (uvloop, httptools; the kernel's side of a syscall is not seen)
            # need the process paused per sample; without them a sample in C code shows as
            # the Python frame that called it.
            *(["--native"] if native else ["--nonblocking"]),
        ],
        stdout=subprocess.DEVNULL,
        stderr=log.open("wb"),
    )  # fmt: skip
    try:
        time.sleep(2.0)  # py-spy attached
        yield
    finally:
        spy.send_signal(signal.SIGINT)
        spy.wait(60)


def run(args) -> dict:
    OUT.mkdir(parents=True, exist_ok=True)
    model = rv.ensure_demo_model(vr.OUT / "demo-model")
    load = vr.chat_load(args)
    with contextlib.ExitStack() as stack:
        runtime = stack.enter_context(vr.running_runtime(model, OUT))
        router = vr.start_gateway(
            "ours", vr.REPO, [runtime.url], rv.SERVED_NAME, OUT, keyed=False, workers=1
        )
        stack.callback(vr._stop, router)
        vr.wait_routable(router, rv.SERVED_NAME)
        warm = dataclasses.replace(
            load, num_prompts=16, warmups=0, seed=1, request_rate=float("inf")
        )
        vr.chat_client(router.url, model, warm, OUT, "warm", None)
        samples = OUT / "samples.txt"
        with recording(router.pid, samples, OUT / "py-spy.log", rate=args.rate, native=args.native,
                       subprocesses=True):  # fmt: skip
            cpu0, load_avg = router.cpu(), os.getloadavg()[0]
            started = time.perf_counter()
            data = vr.chat_client(router.url, model, load, OUT, "profiled", None)
            wall = time.perf_counter() - started
            cpu = router.cpu() - cpu0
    requests = load.num_prompts + load.warmups
    events = requests * (load.output_len + 2)  # role chunk + one per token + the final chunk
    return {
        "load": {
            "num_prompts": load.num_prompts,
            "output_len": load.output_len,
            "concurrency": load.concurrency,
            "rate_hz": args.rate,
        },
        "load_avg": round(load_avg, 2),
        "wall_s": round(wall, 1),
        "failed": int(data.get("failed", 0)),
        "gateway_cpu_ms_per_request": round(cpu * 1000 / requests, 3),
        "gateway_cpu_us_per_event": round(cpu * 1e6 / events, 1),
        "profile": summarize(parse_raw(samples)),
    }


def markdown(result: dict, argv: list[str]) -> str:
    p = result["profile"]
    lines = [
        f"Command: `nice -n 10 .venv/bin/python bench/profile_front_door.py {' '.join(argv)}`; "
        f"load average {result['load_avg']}, {result['wall_s']} s, {result['failed']} failed, "
        f"{p['samples']} samples while the gateway ran (and {p['idle_samples_left_out']} in the "
        "loop's wait, left out).",
        "",
        f"Gateway CPU: {result['gateway_cpu_ms_per_request']} ms per request, "
        f"{result['gateway_cpu_us_per_event']} µs per SSE event.",
        "",
        "| layer (innermost a sample was in) | % of CPU samples |",
        "| --- | --- |",
        *(f"| {name} | {pct} |" for name, pct in p["layers"]),
        "",
        "| frame that ran (self) | % |",
        "| --- | --- |",
        *(f"| `{name}` | {pct} |" for name, pct in p["self"]),
        "",
        "| function of ours (inclusive) | % |",
        "| --- | --- |",
        *(f"| `{name}` | {pct} |" for name, pct in p["ours_inclusive"]),
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=300)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rate", type=int, default=200, help="py-spy samples a second")
    parser.add_argument("--native", action="store_true", help="C frames too (pauses per sample)")
    parser.add_argument("--summarize", action="store_true", help="only summarise the last run")
    args = parser.parse_args()
    if args.summarize:
        result = json.loads((OUT / "summary.json").read_text())
        result["profile"] = summarize(parse_raw(OUT / "samples.txt"))
    else:
        result = run(args)
    (OUT / "summary.json").write_text(json.dumps(result, indent=2))
    text = markdown(result, sys.argv[1:])
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
