"""What misbehaving webhook receivers cost the process that sends job webhooks (issue 16).

No runtime, no engine: the real ``WebhookSender`` (the runtime's and the gateway's) in this
process, the receivers in a child process (so their buffers are not counted here), both on
127.0.0.1. Two receivers, one scenario each, ``--seconds`` long (12, as in the issue's audit,
where an endless answer grew the runtime by 1,987 MiB in 12 s):

- **endless**: answers ``200`` with headers, then body bytes for as long as the connection lasts;
- **trickle**: answers one byte every ``--trickle-interval`` seconds (2) and never finishes its
  status line.

The endless receiver is also measured against the same sender with the POST sent by httpx,
response streamed and closed after the headers (``--compare-httpx``, on by default): the design
the module's docstring explains it does not use.

For the whole scenario ``--in-flight`` deliveries (200, more than WEBHOOK_MAX_CONCURRENCY's 64,
so some wait for a slot) are kept pending: each one that ends is replaced at once. Measured:
this process's RSS before, at its highest and after (from /proc), tracemalloc's peak of Python
allocations during the scenario, sockets open at once (file descriptors beyond the ones before),
bytes the endless receiver got out (its send buffer set to 64 KiB: the rest sat in this host's
receive buffers or was read), deliveries and failed attempts (counted from the log warnings, one
of which is shown).

    .venv/bin/python bench/abuse_webhooks.py [--seconds 12] [--in-flight 200] [--timeout 10]
        [--no-compare-httpx] [--top 3]   # --top: tracemalloc's largest live allocations at the end
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import multiprocessing
import os
import platform
import socket
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

import httpx
from llmendpoints_common.destinations import resolve_checked
from llmendpoints_common.webhooks import DEFAULT_MAX_CONCURRENCY, WebhookSender

OUT = Path(__file__).resolve().parent / "out"
CHUNK = b"x" * 65536


# -- the receivers (child process) -----------------------------------------------------------


def _serve(ports, counters, trickle_interval: float) -> None:
    """Child process: the two receivers, until terminated. ``counters``: bytes written by the
    endless one."""
    (written,) = counters

    async def read_request(reader: asyncio.StreamReader) -> None:
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").lower()
        await reader.readexactly(int(head.split("content-length:")[1].split("\r\n")[0]))

    async def endless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 65536)
        try:
            await read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\n")
            while True:
                writer.write(CHUNK)
                await writer.drain()
                written.value += len(CHUNK)
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def trickle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await read_request(reader)
            for byte in itertools.chain(b"HTTP/1.1 200 ", itertools.repeat(ord("K"))):
                writer.write(bytes([byte]))
                await writer.drain()
                await asyncio.sleep(trickle_interval)
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def main() -> None:
        servers = [
            await asyncio.start_server(handler, "127.0.0.1", 0, backlog=1024)
            for handler in (endless, trickle)
        ]
        ports.put([s.sockets[0].getsockname()[1] for s in servers])
        await asyncio.Event().wait()

    asyncio.run(main())


# -- the sender (this process) ----------------------------------------------------------------


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


class HttpxStreamed(WebhookSender):
    """The alternative: httpx, response streamed and closed after the headers (no pool)."""

    async def _http_post(self, url: str, payload: dict[str, Any]) -> int:
        target = httpx.URL(url)
        addresses = await resolve_checked(target.host, target.port or 80, self._policy)
        if not hasattr(self, "_httpx"):
            self._httpx = httpx.AsyncClient(
                timeout=None, limits=httpx.Limits(max_connections=None, max_keepalive_connections=0)
            )
        async with self._httpx.stream(
            "POST", target.copy_with(host=addresses[0]), json=payload
        ) as response:
            return response.status_code


class Failures(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.count = 0
        self.example: str | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if "attempt" in record.getMessage():
            self.count += 1
            self.example = self.example or record.getMessage()


async def scenario(
    name: str, sender: type[WebhookSender], port: int, args: argparse.Namespace, counters
) -> dict:
    (written,) = counters
    failures = Failures()
    logging.getLogger("llmendpoints_common.webhooks").addHandler(failures)
    webhooks = sender(retries=0, delay_seconds=0, timeout_seconds=args.timeout)
    # The query and userinfo stand for a receiver's token: the log must not show them.
    url = f"http://bench:t0ken@127.0.0.1:{port}/hook?sig=s3cret"
    await webhooks.send(url, {"id": "warm-up"})  # imports, the client: not what is measured
    failures.count, failures.example = 0, None
    written_before = written.value
    before, fds_before = rss_mib(), open_fds()
    most_rss, most_fds = before, fds_before
    delivered = ids = 0
    tracemalloc.start(10 if args.top else 1)
    started = time.monotonic()
    tasks: set[asyncio.Task[bool]] = set()
    while (elapsed := time.monotonic() - started) < args.seconds:
        while len(tasks) < args.in_flight:
            ids += 1
            tasks.add(webhooks.send(url, {"id": f"{name}-{ids}", "status": "COMPLETED"}))
        done, tasks = await asyncio.wait(tasks, timeout=0.25)
        delivered += sum(1 for t in done if t.result())
        most_rss, most_fds = max(most_rss, rss_mib()), max(most_fds, open_fds())
    pending_at_end = webhooks.pending
    await webhooks.aclose(timeout=0)  # abandon the rest (they would end within --timeout)
    _, peak = tracemalloc.get_traced_memory()
    for stat in tracemalloc.take_snapshot().statistics("traceback")[: args.top]:
        print(stat, *stat.traceback.format()[-8:], sep="\n", file=sys.stderr)
    tracemalloc.stop()
    logging.getLogger("llmendpoints_common.webhooks").removeHandler(failures)
    await asyncio.sleep(1)  # let the receiver see the closes
    endless = name == "endless"
    return {
        "scenario": f"{name} ({'this sender' if sender is WebhookSender else 'httpx streamed'})",
        "seconds": round(elapsed, 1),
        "deliveries started": ids,
        "delivered": delivered,
        "failed attempts (logged)": failures.count,
        "pending at the end": pending_at_end,
        "rss before MiB": round(before, 1),
        "rss highest MiB": round(most_rss, 1),
        "rss after MiB": round(rss_mib(), 1),
        "tracemalloc peak MiB": round(peak / 2**20, 2),
        "sockets open at most": most_fds - fds_before,
        "receiver MiB written": round((written.value - written_before) / 2**20)
        if endless
        else None,
        "receiver KiB written per delivery": round((written.value - written_before) / 1024 / ids)
        if endless
        else None,
        "example log line": failures.example,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=12.0, help="length of each scenario")
    parser.add_argument("--in-flight", type=int, default=200, help="deliveries kept pending")
    parser.add_argument("--timeout", type=float, default=10.0, help="WEBHOOK_TIMEOUT_SECONDS")
    parser.add_argument("--trickle-interval", type=float, default=2.0, help="seconds per byte")
    parser.add_argument(
        "--compare-httpx",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also measure the endless receiver against httpx, streamed",
    )
    parser.add_argument("--top", type=int, default=0, help="largest live allocations to show")
    args = parser.parse_args()

    context = multiprocessing.get_context("spawn")
    ports = context.Queue()
    counters = (context.Value("q", 0),)
    child = context.Process(
        target=_serve, args=(ports, counters, args.trickle_interval), daemon=True
    )
    child.start()
    try:
        endless_port, trickle_port = ports.get(timeout=60)
        runs = [("endless", WebhookSender, endless_port), ("trickle", WebhookSender, trickle_port)]
        if args.compare_httpx:  # last: its imports and buffers would count in the others' RSS
            runs.append(("endless", HttpxStreamed, endless_port))
        results = [asyncio.run(scenario(*run, args, counters)) for run in runs]
    finally:
        child.terminate()
        child.join(10)

    print(
        f"Machine: {platform.machine()}, Python {platform.python_version()}, "
        f"{os.cpu_count()} cores; WEBHOOK_MAX_CONCURRENCY {DEFAULT_MAX_CONCURRENCY}, "
        f"WEBHOOK_TIMEOUT_SECONDS {args.timeout:g}, {args.in_flight} deliveries kept pending, "
        f"trickle: a byte every {args.trickle_interval:g} s\n"
    )
    keys = [k for k in results[0] if k not in ("scenario", "example log line")]
    print("| measure | " + " | ".join(r["scenario"] for r in results) + " |")
    print("| --- |" + " --- |" * len(results))
    for key in keys:
        cells = ["—" if r[key] is None else str(r[key]) for r in results]
        print(f"| {key} | " + " | ".join(cells) + " |")
    for r in results:
        if r["example log line"]:
            print(f"\n{r['scenario']}: `{r['example log line']}`")
    OUT.mkdir(exist_ok=True)
    (OUT / "abuse_webhooks.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
