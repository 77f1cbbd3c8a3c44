"""A stand-in OpenAI backend for gateway benchmarks and fault-injection tests: no model, so
thousands of streams cost the backend next to nothing and failures can be made on purpose.

    python bench/gateway_standin.py --port 9001 [--ready-after 3]

- ``GET /ready?strict=1``: 503 for ``--ready-after`` seconds, then 200.
- ``POST /v1/chat/completions`` and ``/v1/completions``: with ``"stream": true`` an SSE stream
  of ``standin_chunks`` events (default 8) ``standin_interval`` seconds apart (default 0.01),
  then ``[DONE]`` (``standin_end_after``: the body's end that many seconds after it; a client
  that closes meanwhile is counted in ``closed_after_done``); without, one JSON completion.
  ``standin_fail``: ``"before"`` exits the process without answering (a crash),
  ``"midstream"`` closes it after two events (``standin_fail_on``: only on the replica of that
  ``--name``).
- Usage as vLLM reports it: ``prompt_tokens`` = the prompt's (or messages') words,
  ``completion_tokens`` = the chunks sent; in the JSON answer's ``usage``, and for streams with
  ``stream_options.include_usage`` a last usage-only chunk (``choices: []``) before ``[DONE]``.
- ``GET /stats``: requests seen, streams ended by the client's disconnect, the last
  ``x-request-id``, which replica this is (``--name``), and the tokens it reported in total
  (``prompt_tokens``, ``completion_tokens``: what metering must add up to); every path asked
  for (``paths``, the last 100) and the credentials the last request carried
  (``last_authorization``, ``last_api_key``, ``last_caller``): what a pod learns of a caller.
- ``standin_pad``: that many bytes of padding in a JSON answer, before its ``usage`` (a large
  answer, as embeddings of a big batch are).
- ``standin_delta``: what each streamed event's delta carries, one token an event as vLLM
  streams them: ``content`` (default), ``reasoning`` / ``reasoning_content`` (a reasoning model's
  thinking, vLLM 0.32's name and others'), or ``tool_calls``: one tool call whose first event
  carries its id and name (the ``TOOL_HEAD_TOKENS`` tokens a tool parser holds back until the
  name is whole) and every later one a token of its arguments (``TOOL_ARGUMENTS`` cut into
  pieces by ``tokens``). ``standin_fail_at``: the event ``"midstream"`` fails before (default 2).
  ``sent_tokens`` in ``/stats``: the completion tokens of every event sent, cut streams included
  (what a cut stream generated).
- ``standin_unterminated``: after the first event, that many bytes of one event that never ends
  (``data: {"choices": [{"delta": {"content": "yyy...``), in 64 KiB writes, then the body's end.
- ``GET /metrics``: the engine series the gateway's scorer reads, as vLLM names them:
  ``vllm:num_requests_running`` (the streams open now, plus what ``/standin/engine`` adds),
  ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``, ``vllm:cache_config_info``
  (``--kv-tokens`` as blocks of 16), ``vllm:lora_requests_info`` (with ``max_lora``), and
  ``vllm:prefix_cache_queries`` / ``vllm:prefix_cache_hits``: a pretend prefix cache counting, per
  request, the words of its leading messages (or prompt) that an earlier request here began with.
  ``POST /standin/engine`` (JSON: ``running``, ``waiting``, ``kv_usage``, ``adapters``,
  ``max_lora``) sets what it reports: a busy or full engine on cue.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import time


class Standin:
    def __init__(
        self, name: str, ready_after: float, kv_tokens: int = 16384, control_port: int = 0
    ):
        self.name = name
        self.control_port = control_port  # named in the main port's probe answers, as ours do
        self.ready_at = time.monotonic() + ready_after
        self.stats = {
            "name": name,
            "requests": 0,
            "disconnects": 0,
            "closed_after_done": 0,
            "open": 0,
            "last_request_id": None,
            "prompt_tokens": 0,
            "completion_tokens": 0,
            "usage_requested": 0,
            "sent_tokens": 0,
            "paths": [],
            "last_authorization": None,
            "last_api_key": None,
            "last_caller": None,
            # every request by port ("main", "control") and "METHOD /path", and who sent them
            "seen": {"main": {}, "control": {}},
            "user_agents": {"main": [], "control": []},
        }
        self.engine = {"running": 0, "waiting": 0, "kv_usage": 0.0, "adapters": [], "max_lora": 0}
        self.kv_tokens = kv_tokens
        self.prefix_queries = 0
        self.prefix_hits = 0
        self._seen: set[tuple] = set()  # leading-message tuples seen: the pretend prefix cache

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                await send({"type": message["type"] + ".complete"})
                if message["type"] == "lifespan.shutdown":
                    return
        path = scope["path"]
        self.count("main", scope)
        if path in ("/ready", "/health"):  # /health: what vllm-router probes
            named = [(b"x-llmep-control-port", str(self.control_port).encode())]
            return await self.probe(send, named if self.control_port else [])
        if path == "/stats":
            return await _json(send, 200, self.stats)
        if path == "/metrics":
            return await _text(send, 200, self.metrics())
        if path == "/standin/engine" and scope["method"] == "POST":
            self.engine.update(json.loads(await _read(receive)))
            return await _json(send, 200, self.engine)
        self.stats["paths"] = [*self.stats["paths"][-99:], f"{scope['method']} {path}"]
        headers = dict(scope["headers"])
        for field, header in (
            ("last_authorization", b"authorization"),
            ("last_api_key", b"x-api-key"),
            ("last_caller", b"x-llmep-caller"),
        ):
            value = headers.get(header)
            self.stats[field] = value.decode("latin-1") if value is not None else None
        if path not in ("/v1/chat/completions", "/v1/completions"):
            return await _json(send, 404, {"error": {"message": "not found"}})
        request = json.loads(await _read(receive))
        self.stats["requests"] += 1
        self._cache(request)
        for name, value in scope["headers"]:
            if name == b"x-request-id":
                self.stats["last_request_id"] = value.decode()
        fail = request.get("standin_fail")
        if request.get("standin_fail_on") not in (None, self.name):
            fail = None
        if fail == "before":
            os._exit(3)  # a replica that crashes: the connection resets before any byte
        chunks = int(request.get("standin_chunks", 8))
        interval = float(request.get("standin_interval", 0.01))
        usage = {
            "prompt_tokens": _prompt_words(request),
            "completion_tokens": chunks,
            "total_tokens": _prompt_words(request) + chunks,
        }
        if not request.get("stream"):
            gone = asyncio.ensure_future(receive())  # http.disconnect if the client leaves
            done, _ = await asyncio.wait({gone}, timeout=interval * chunks)
            if done:
                self.stats["disconnects"] += 1  # before a byte of the answer
                return
            gone.cancel()
            self.stats["prompt_tokens"] += usage["prompt_tokens"]
            self.stats["completion_tokens"] += usage["completion_tokens"]
            return await _json(
                send,
                200,
                {
                    "id": "cmpl-standin",
                    "object": "chat.completion",
                    "model": request.get("model"),
                    "replica": self.name,
                    "padding": "p" * int(request.get("standin_pad", 0)),
                    "choices": [
                        {
                            "index": 0,
                            "finish_reason": "stop",
                            "message": {"role": "assistant", "content": "x" * chunks},
                        }
                    ],
                    "usage": usage,
                },
            )
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )
        sent_before = self.stats["sent_tokens"]
        self.stats["open"] += 1
        gone = asyncio.ensure_future(receive())  # http.disconnect when the client leaves
        fail_at = int(request.get("standin_fail_at", 2))
        try:
            for i, (delta, spent) in enumerate(stream_deltas(request, chunks)):
                if fail == "midstream" and i == fail_at:
                    raise ConnectionAbortedError("standin: failing mid-stream")
                event = {
                    "id": "cmpl-standin",
                    "object": "chat.completion.chunk",
                    "model": request.get("model"),
                    "choices": [{"index": 0, "delta": delta, "finish_reason": None}],
                }
                await send(
                    {
                        "type": "http.response.body",
                        "body": b"data: " + json.dumps(event).encode() + b"\n\n",
                        "more_body": True,
                    }
                )
                self.stats["sent_tokens"] += spent
                usage["completion_tokens"] = self.stats["sent_tokens"] - sent_before
                if i == 0 and request.get("standin_unterminated"):
                    await _unterminated(send, int(request["standin_unterminated"]))
                    return
                done, _ = await asyncio.wait({gone}, timeout=interval)
                if done:
                    self.stats["disconnects"] += 1
                    return
            usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
            if (request.get("stream_options") or {}).get("include_usage"):
                self.stats["usage_requested"] += 1
                self.stats["prompt_tokens"] += usage["prompt_tokens"]
                self.stats["completion_tokens"] += usage["completion_tokens"]
                event = {
                    "id": "cmpl-standin",
                    "object": "chat.completion.chunk",
                    "model": request.get("model"),
                    "choices": [],
                    "usage": usage,
                }
                await send(
                    {
                        "type": "http.response.body",
                        "body": b"data: " + json.dumps(event).encode() + b"\n\n",
                        "more_body": True,
                    }
                )
            end_after = float(request.get("standin_end_after", 0))
            await send(
                {
                    "type": "http.response.body",
                    "body": b"data: [DONE]\n\n",
                    "more_body": bool(end_after),
                }
            )
            if end_after:  # the body's end comes later: [DONE] and the end are two writes
                done, _ = await asyncio.wait({gone}, timeout=end_after)
                if done:
                    self.stats["closed_after_done"] += 1
                    return
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            gone.cancel()
            self.stats["open"] -= 1

    def count(self, port: str, scope) -> None:
        if scope["path"] == "/stats":
            return
        seen = self.stats["seen"][port]
        what = f"{scope['method']} {scope['path']}"
        seen[what] = seen.get(what, 0) + 1
        agent = dict(scope["headers"]).get(b"user-agent", b"").decode("latin-1")
        if agent not in self.stats["user_agents"][port]:
            self.stats["user_agents"][port].append(agent)

    async def probe(self, send, headers: list) -> None:
        ok = time.monotonic() >= self.ready_at
        status = {"status": "ready" if ok else "initializing"}
        await _json(send, 200 if ok else 503, status, headers)

    def _cache(self, request: dict) -> None:
        """The pretend prefix cache: a request's leading messages (each prefix of the list)
        that an earlier request began with are hits, counted in words."""
        messages = request.get("messages")
        if not isinstance(messages, list):
            messages = [{"content": request.get("prompt")}]
        words = [_words(m) for m in messages]
        for i in range(1, len(messages) + 1):
            prefix = tuple(json.dumps(m, sort_keys=True) for m in messages[:i])
            self.prefix_queries += words[i - 1]
            if prefix in self._seen:
                self.prefix_hits += words[i - 1]
            else:
                self._seen.add(prefix)

    def metrics(self) -> str:
        e = self.engine
        labels = 'engine="0",model_name="standin"'
        adapters = ",".join(e["adapters"])
        lines = [
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{{{labels}}} {self.stats['open'] + e['running']}",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{{{labels}}} {e['waiting']}",
            "# TYPE vllm:kv_cache_usage_perc gauge",
            f"vllm:kv_cache_usage_perc{{{labels}}} {e['kv_usage']}",
            "# TYPE vllm:prefix_cache_queries counter",
            f"vllm:prefix_cache_queries_total{{{labels}}} {float(self.prefix_queries)}",
            "# TYPE vllm:prefix_cache_hits counter",
            f"vllm:prefix_cache_hits_total{{{labels}}} {float(self.prefix_hits)}",
            "# TYPE vllm:cache_config_info gauge",
            f'vllm:cache_config_info{{block_size="16",num_gpu_blocks="{self.kv_tokens // 16}",'
            f"{labels}}} 1.0",
        ]
        if e["max_lora"]:
            lines += [
                "# TYPE vllm:lora_requests_info gauge",
                f'vllm:lora_requests_info{{max_lora="{e["max_lora"]}",'
                f'running_lora_adapters="{adapters}",waiting_lora_adapters=""}} '
                f"{time.time()}",
            ]
        return "\n".join(lines) + "\n"


# A tool call's arguments as a model writes them, and the tokens a tool parser holds back before
# the call's first event (``<tool_call>{"name": "get_weather", "arguments": `` and the like).
TOOL_ARGUMENTS = json.dumps(
    {
        "location": "San Francisco, California, United States",
        "unit": "celsius",
        "days": 7,
        "include": ["hourly forecast", "precipitation probability", "wind speed"],
        "notes": "Plan a hike on the coast; prefer mornings without fog.",
    }
)
TOOL_HEAD_TOKENS = 10
# Token-like pieces: a word with its leading space, a number, a run of punctuation (a
# byte-level BPE's pre-tokenizer), words over 8 characters split in two.
_PIECES = re.compile(r" ?[A-Za-z]{1,8}| ?[0-9]{1,3}| ?[^\sA-Za-z0-9]+|\s+")


def tokens(text: str) -> list[str]:
    return _PIECES.findall(text)


def stream_deltas(request: dict, chunks: int):
    """(delta, completion tokens it stands for) of each streamed event."""
    kind = request.get("standin_delta", "content")
    if kind != "tool_calls":
        for _ in range(chunks):
            yield {kind: "x"}, 1
        return
    head = {"index": 0, "id": "chatcmpl-tool-standin", "type": "function"}
    yield (
        {"tool_calls": [{**head, "function": {"name": "get_weather", "arguments": ""}}]},
        (TOOL_HEAD_TOKENS),
    )
    pieces = tokens(TOOL_ARGUMENTS)
    for i in range(chunks - 1):
        piece = pieces[i % len(pieces)]
        yield {"tool_calls": [{"index": 0, "function": {"arguments": piece}}]}, 1


async def _unterminated(send, size: int) -> None:
    """One event that never ends (``size`` bytes), then the body's end."""
    await send(
        {
            "type": "http.response.body",
            "body": b'data: {"choices": [{"index": 0, "delta": {"content": "',
            "more_body": True,
        }
    )
    block = b"y" * 65_536
    for start in range(0, size, len(block)):
        part = block[: size - start]
        await send({"type": "http.response.body", "body": part, "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


def _words(message) -> int:
    content = message.get("content") if isinstance(message, dict) else None
    return len(content.split()) if isinstance(content, str) else 0


async def _read(receive) -> bytes:
    parts = []  # joined once: a 10 MB body is not copied 160 times over
    while True:
        message = await receive()
        parts.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(parts)


async def _text(send, status, text: str, headers=()):
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"text/plain; version=0.0.4"), *headers],
        }
    )
    await send({"type": "http.response.body", "body": text.encode()})


def _prompt_words(request: dict) -> int:
    prompt = request.get("prompt")
    if isinstance(prompt, str):
        return len(prompt.split())
    words = 0
    for message in request.get("messages") or []:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            words += len(content.split())
    return words


class ControlPort:
    """``--control-port``: the stand-in's probes and /metrics on a port of their own, as the
    runtime's control port answers them (its answers say how old they are)."""

    def __init__(self, standin: Standin) -> None:
        self.standin = standin

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.standin(scope, receive, send)  # the lifespan
        self.standin.count("control", scope)
        age = [(b"x-llmep-answer-age-ms", b"0")]
        if scope["path"] in ("/ready", "/health"):
            return await self.standin.probe(send, age)
        if scope["path"] == "/metrics":
            return await _text(send, 200, self.standin.metrics(), age)
        return await _json(send, 404, {"error": {"message": "not on the control port"}})


async def _json(send, status, body, headers=()):
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), *headers],
        }
    )
    await send({"type": "http.response.body", "body": json.dumps(body).encode()})


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--name", default=None)
    parser.add_argument("--ready-after", type=float, default=0.0)
    parser.add_argument("--kv-tokens", type=int, default=16384, help="KV cache it reports")
    parser.add_argument("--control-port", type=int, default=0, help="also a control port")
    parser.add_argument(
        "--name-control-port", type=int, default=0, help="name this port, listen on none there"
    )
    args = parser.parse_args()
    named = args.name_control_port or args.control_port
    app = Standin(args.name or f"standin-{args.port}", args.ready_after, args.kv_tokens, named)
    apps = [(app, args.port)] + (
        [(ControlPort(app), args.control_port)] if args.control_port else []
    )
    servers = [
        uvicorn.Server(
            uvicorn.Config(
                served, host="127.0.0.1", port=port, http="httptools", loop="uvloop",
                log_level="warning", backlog=4096, timeout_keep_alive=30,
                lifespan="on" if served is app else "off",
            )
        )
        for served, port in apps
    ]  # fmt: skip
    import uvloop

    async def serve_all() -> None:
        await asyncio.gather(*(server.serve() for server in servers))

    uvloop.run(serve_all())


if __name__ == "__main__":
    main()
