"""What relaying one SSE event costs: the gateway's CPU per event and per request, against the
floor of any relay on this machine (a bare uvloop protocol that writes what it reads).

    .venv/bin/python bench/relay_floor.py                       # ~1 minute
    .venv/bin/python bench/relay_floor.py --gateway-ref main    # main's gateway instead

1. Floor: a sender writes one ~260-byte SSE event a millisecond over one TCP connection to a
   relay process (uvloop; ``data_received`` writes the bytes to a second connection, nothing
   else), for ``--events`` events; the relay's CPU divided by the events. That is the kernel's
   and the event loop's part of each event: a receive, a send, a wake-up.
2. The gateway in front of two stand-ins that stream 8 and 64 events, 5 ms apart, 16 requests
   at a time (events arrive one by one, as vLLM sends tokens; bench/gateway_streams.py's load
   sends them 1 ms apart to 100 streams, where reads coalesce): CPU per request at each length,
   so the cost per event is the slope and the cost per request the intercept.

Results: a Markdown section on stdout (bench/RESULTS.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gateway_streams as gs
import gateway_vs_direct as gvd

EVENT = b"data: " + json.dumps({"choices": [{"delta": {"content": "x" * 200}}]}).encode() + b"\n\n"


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def _relay(listen_port: int, sink_port: int, seconds: float) -> None:
    import uvloop  # noqa: F401  (the relay runs on it, as the gateway does)

    class Down(asyncio.Protocol):
        def connection_made(self, transport):
            self.transport = transport

    class Up(asyncio.Protocol):
        def __init__(self, down: Down) -> None:
            self.down = down

        def data_received(self, data: bytes) -> None:
            self.down.transport.write(data)

    loop = asyncio.get_running_loop()
    _, down = await loop.create_connection(Down, "127.0.0.1", sink_port)
    server = await loop.create_server(lambda: Up(down), "127.0.0.1", listen_port)
    await asyncio.sleep(1.0)
    before = _cpu()
    await asyncio.sleep(seconds)
    print(json.dumps({"cpu_s": _cpu() - before}), flush=True)
    server.close()


async def floor(events: int) -> float:
    """The bare relay's CPU per event, µs."""
    loop = asyncio.get_running_loop()

    class Sink(asyncio.Protocol):
        def data_received(self, data: bytes) -> None:
            pass

    sink = await loop.create_server(Sink, "127.0.0.1", 0)
    sink_port = sink.sockets[0].getsockname()[1]
    relay_port = gs.free_port()
    seconds = events / 1000
    relay = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--relay", str(relay_port), str(sink_port), str(seconds),
        stdout=subprocess.PIPE,
    )  # fmt: skip
    await asyncio.sleep(0.5)
    _, writer = await asyncio.open_connection("127.0.0.1", relay_port)
    await asyncio.sleep(0.6)  # the relay measures from 1 s after it started listening
    sent, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds + 0.5:
        writer.write(EVENT)
        sent += 1
        await asyncio.sleep(0.001)
    rate = sent / (time.perf_counter() - started)
    out, _ = await relay.communicate()
    writer.close()
    sink.close()
    cpu = json.loads(out.decode().strip().splitlines()[-1])["cpu_s"]
    # The events inside the relay's measuring window: the send rate times the window.
    return cpu / (rate * seconds) * 1e6


async def gateway_cost(url: str, pid: int, chunks: int, requests: int) -> float:
    """The gateway's CPU per request (ms), events arriving 5 ms apart, 16 requests at a time."""
    body = json.dumps(
        {
            "model": "standin",
            "stream": True,
            "standin_chunks": chunks,
            "standin_interval": 0.005,
            "messages": [{"role": "user", "content": "hello"}],
        }
    ).encode()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=16)) as session:
        for _ in range(20):
            await gs.one_stream(session, url, body, None, [])
        queue, outcomes = iter(range(requests)), []

        async def worker() -> None:
            for _ in queue:
                outcomes.append(await gs.one_stream(session, url, body, None, []))

        before = gvd.cpu_tree(pid)
        await asyncio.gather(*(worker() for _ in range(16)))
        cpu = gvd.cpu_tree(pid) - before
    assert all(o == "ok" for o in outcomes), outcomes[:3]
    return cpu / requests * 1000


async def main_async(args) -> None:
    floor_us = await floor(args.events)
    tmp = gs.OUT / "relay_floor"
    tmp.mkdir(parents=True, exist_ok=True)
    ports = [gs.free_port() for _ in range(2)]
    standins = [
        gs.spawn([gs.PY, str(gs.REPO / "bench" / "gateway_standin.py"), "--port", str(p)],
                 tmp / f"standin-{p}.log")
        for p in ports
    ]  # fmt: skip
    backends = [f"http://127.0.0.1:{p}" for p in ports]
    try:
        for backend in backends:
            gs.wait_http(backend + "/ready")
        endpoints = [{"name": "standin", "models": ["standin"], "backends": backends}]
        with gvd.gateway(endpoints, tmp / "gateway.log", ref=args.gateway_ref) as (url, pid):
            costs: dict[int, list[float]] = {8: [], 64: []}
            for _ in range(args.rounds):
                for chunks in costs:
                    costs[chunks].append(
                        await gateway_cost(url + "/v1/chat/completions", pid, chunks, args.requests)
                    )
    finally:
        for process in standins:
            process.terminate()
    short, long = (sorted(v)[len(v) // 2] for v in costs.values())
    per_event_us = (long - short) / (64 - 8) * 1000
    per_request_ms = short - 9 * per_event_us / 1000  # 8 events and [DONE]
    print(
        f"### Relaying an SSE event ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})\n\n"
        f"`.venv/bin/python bench/relay_floor.py {' '.join(sys.argv[1:])}` on {os.cpu_count()} "
        f"shared cores (load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}); gateway: "
        f"{args.gateway_ref or 'this checkout'}.\n\n"
        "| measure | value |\n| --- | --- |\n"
        f"| bare uvloop relay, CPU per event (the floor) | {floor_us:.1f} µs |\n"
        f"| gateway, CPU per request of 8 events (median of {args.rounds}) | {short:.3f} ms |\n"
        f"| gateway, CPU per request of 64 events | {long:.3f} ms |\n"
        f"| gateway, CPU per relayed event (slope) | {per_event_us:.1f} µs |\n"
        f"| gateway, CPU per request apart from its events (intercept) | {per_request_ms:.3f} ms |\n"
    )


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--events", type=int, default=3000, help="floor: events relayed")
    parser.add_argument("--requests", type=int, default=400, help="gateway: requests per run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--gateway-ref", help="run the gateway at this git ref (e.g. main)")
    parser.add_argument("--relay", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.relay:
        import uvloop

        listen, sink, seconds = args.relay
        uvloop.run(_relay(int(listen), int(sink), float(seconds)))
        return 0
    asyncio.run(main_async(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
