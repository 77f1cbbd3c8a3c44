"""What a key costs the gateway per request, piece by piece, in one process (issue 33).

    .venv/bin/python bench/key_path.py                       # this checkout, ~30 s
    PYTHONPATH=/old/checkout/gateway:/old/checkout/common:/old/checkout/edge \
        .venv/bin/python bench/key_path.py                   # an older checkout's code

Each piece of the request path that runs because the request carries a key (and that key has
per-minute limits) is called as the gateway calls it, ``--calls`` times, and timed per call
(CPU time, ``time.process_time_ns``: what the piece costs, not what the machine's other work
does to the wall clock); the median of ``--repeats`` runs is reported, in microseconds:

- ``identify``: the request's key from its headers (``Authorization: Bearer``) and the key
  ring's lookup of it (the ring from GATEWAY_ENDPOINTS_FILE's ``apiKeys``, as a static gateway
  has it); ``key from headers`` alone, which identify did first before it cached keys by header;
- ``access``: may that key use the endpoint (``Access.require`` + ``Access.allows``, what the
  OpenAI routes call for an allowed request);
- ``limiter admit + finish``: a key with requestsPerMinute and tokensPerMinute on this replica's
  own state (no NATS: bench/quotas.py measures the shared path), admitted reserving a chat
  request's tokens and finished with the tokens it used -- the background write included;
- ``rate-limit headers``: the answer's ``send`` that adds x-ratelimit-* (its head and end);
- ``keyless baseline``: the same calls for a request without a key on an open gateway.

No target of its own: the issue's goal is the whole request, keyed <= 1.15x keyless
(bench/vs_vllm_router.py); this says which piece to look at. Results: a Markdown table on stdout
and bench/out/key_path.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "bench" / "out"
SECRET = "sk-bench-0123456789abcdef0123456789"
HEADERS = [
    (b"host", b"127.0.0.1:8080"),
    (b"user-agent", b"OpenAI/Python 1.99.0"),
    (b"accept", b"application/json"),
    (b"content-type", b"application/json"),
    (b"x-stainless-lang", b"python"),
    (b"content-length", b"213"),
    (b"authorization", b"Bearer " + SECRET.encode()),
]


def timed(fn: Callable[[], object], calls: int) -> float:
    """CPU microseconds per call of ``fn``."""
    started = time.process_time_ns()
    for _ in range(calls):
        fn()
    return (time.process_time_ns() - started) / calls / 1000


async def timed_async(fn: Callable[[], object], calls: int) -> float:
    started = time.process_time_ns()
    for _ in range(calls):
        await fn()
    return (time.process_time_ns() - started) / calls / 1000


def build(folder: Path):
    from llmendpoints_gateway.access import Access
    from llmendpoints_gateway.keys import KeyRing
    from llmendpoints_gateway.metrics import GatewayMetrics
    from llmendpoints_gateway.registry import Registry
    from llmendpoints_gateway.routing import Strategy

    endpoints = folder / "endpoints.yaml"
    endpoints.write_text(
        yaml.safe_dump(
            {
                "endpoints": [{"name": "demo", "models": ["demo"], "backends": ["http://x:1"]}],
                "apiKeys": [
                    {
                        "name": "bench",
                        "key": SECRET,
                        "limits": {"requestsPerMinute": 10**9, "tokensPerMinute": 10**12},
                    }
                ],
            }
        )
    )
    registry = Registry(GatewayMetrics(), 100, 1.25)
    ep = registry.upsert("demo", ["demo"], Strategy.PREFIX_AWARE)
    keys = KeyRing.from_settings(None, None, str(endpoints), require_keys=True)
    return Access(keys, registry), ep


async def measure(calls: int) -> dict[str, float]:
    from llmendpoints_edge.keys import key_from_headers
    from llmendpoints_gateway.limiter import Limiter
    from llmendpoints_gateway.request import RequestLog

    with tempfile.TemporaryDirectory() as tmp:
        access, ep = build(Path(tmp))
        scope = {"headers": HEADERS}
        state = RequestLog("r")
        key = access.identify(scope, state)
        assert key is not None and key.limits.any
        limiter = Limiter("bench", None)
        await limiter.start()
        results = {}
        results["identify (headers to key)"] = timed(lambda: access.identify(scope, state), calls)
        results["(part of identify before: key from headers)"] = timed(
            lambda: key_from_headers(HEADERS), calls
        )

        def check() -> None:
            access.require(key, state)
            if not access.allows(key, ep):
                raise AssertionError("the bench key may use the endpoint")

        results["access"] = timed(check, calls)

        async def admit_finish() -> None:
            ticket = await limiter.admit(key, hold=True, tokens=1032)
            limiter.finish(ticket, 40)
            if limiter._background:
                await asyncio.wait(limiter._background)

        results["limiter admit + finish"] = await timed_async(admit_finish, calls)

        async def sink(message) -> None:
            pass

        head = {"type": "http.response.start", "status": 200, "headers": [(b"a", b"b")]}
        end = {"type": "http.response.body", "body": b"", "more_body": False}

        async def headers() -> None:
            send = limiter.reporting(key, sink, state)
            await send(head)
            await send(end)

        state.ticket = await limiter.admit(key, hold=True, tokens=1032)
        results["rate-limit headers"] = await timed_async(headers, calls)
        await limiter.stop()

        open_scope = {"headers": HEADERS[:-1]}

        def keyless() -> None:
            found = access.identify(open_scope, state)
            access.allows(found, ep)

        results["keyless baseline (identify + allows)"] = timed(keyless, calls)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    import llmendpoints_gateway

    runs = [asyncio.run(measure(args.calls)) for _ in range(args.repeats)]
    pieces = {name: statistics.median(r[name] for r in runs) for name in runs[0]}
    keyed = sum(v for k, v in pieces.items() if not k.startswith(("keyless", "(")))
    code = Path(llmendpoints_gateway.__file__).resolve().parents[2]
    print(f"key path, code from {code} ({args.calls} calls x {args.repeats} runs, median):\n")
    print("| piece | CPU µs per request |\n| --- | --- |")
    for name, value in pieces.items():
        print(f"| {name} | {value:.2f} |")
    print(f"| **all keyed pieces** | **{keyed:.2f}** |")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "key_path.json").write_text(
        json.dumps({"code": str(code), "pieces_us": pieces, "keyed_total_us": keyed}, indent=2)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
