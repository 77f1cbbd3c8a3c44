"""CPU cost per request of everything the runtime puts in front of vLLM's app, in-process.

The same streamed /v1/completions exchange (request body in, `chunks` SSE messages out) is sent
through (a) a stand-in for vLLM's app called directly and (b) the runtime's full ASGI stack from
`create_app` (request id, HTTP metrics, body guard, API keys, FastAPI routing, the catch-all
mount, admission) with that stand-in as the engine's app. The difference is what our layers cost
per request, without a network, an engine or other processes in the way. Used by
bench/runtime_vs_vllm.py (files starting with "_" are not benchmarks of their own); run as a
script (``python bench/_middleware_overhead.py MODEL``) it prints the measure as JSON, for the
code its PYTHONPATH names (``measure_code``: an older checkout's).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

BODY = json.dumps(
    {
        "model": "demo",
        "prompt": "word " * 64,
        "max_tokens": 32,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
).encode()
CHUNK = b'data: {"id":"cmpl-0","object":"text_completion","created":0,"model":"demo","choices":[{"index":0,"text":" word","logprobs":null,"finish_reason":null}]}\n\n'


async def stand_in_for_vllm(scope, receive, send, chunks: int) -> None:
    """What vLLM's app does at the ASGI level for one streamed completion, minus the work."""
    message = await receive()
    assert message["body"]
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"text/event-stream; charset=utf-8")],
        }
    )
    for _ in range(chunks):
        await send({"type": "http.response.body", "body": CHUNK, "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


def _scope() -> dict:
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "root_path": "",
        "query_string": b"",
        "headers": [
            (b"host", b"127.0.0.1"),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(BODY)).encode()),
            (b"authorization", b"Bearer unused"),
        ],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000),
        "state": {},
    }


async def _drive(app, requests: int) -> float:
    """Seconds per request, sequentially (the loop's CPU time, as nothing else runs)."""

    async def send(message) -> None:
        return None

    def receiver():
        messages = [{"type": "http.request", "body": BODY, "more_body": False}]

        async def receive():
            return messages.pop() if messages else {"type": "http.disconnect"}

        return receive

    started = time.perf_counter()
    for _ in range(requests):
        await app(_scope(), receiver(), send)
    return (time.perf_counter() - started) / requests


def runtime_stack(model: Path, inner):
    """The runtime's ASGI app as `serve` builds it, with `inner` as vLLM's app."""
    from llmendpoints_runtime.compose import build_runtime, create_app
    from llmendpoints_runtime.config import load_config

    config = load_config({"MODEL_NAME": str(model), "OPENAI_SERVED_MODEL_NAME_OVERRIDE": "demo"})
    runtime = build_runtime(config)
    app = create_app(runtime, start_engine=False)
    runtime.engine.asgi_app = inner
    runtime.health.engine_ready()
    return app


def measure(model: Path, chunks: int, requests: int = 2000, repeats: int = 5) -> dict:
    """Best-of-`repeats` microseconds per request, direct and through the runtime's stack."""

    async def inner(scope, receive, send):
        await stand_in_for_vllm(scope, receive, send, chunks)

    stack = runtime_stack(model, inner)

    async def best(app) -> float:
        await _drive(app, 200)  # warm caches and metric label children
        return min([await _drive(app, requests) for _ in range(repeats)])

    async def both() -> tuple[float, float]:
        return await best(inner), await best(stack)

    direct, through = asyncio.run(both())
    return {
        "chunks_per_request": chunks,
        "direct_us": direct * 1e6,
        "runtime_stack_us": through * 1e6,
        "overhead_us": (through - direct) * 1e6,
    }


def measure_code(pythonpath: str, model: Path, chunks: int) -> dict:
    """``measure`` in a child process whose PYTHONPATH is ``pythonpath`` (another checkout's
    runtime, imported instead of this one)."""
    result = subprocess.run(
        [sys.executable, __file__, str(model), "--chunks", str(chunks)],
        env={**os.environ, "PYTHONPATH": pythonpath},
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--chunks", type=int, default=34)
    args = parser.parse_args()
    print(json.dumps(measure(args.model, args.chunks)))
