"""Streamed requests held while an endpoint wakes survive the proxies in front of the gateway
(held_stream.py): a byte at least every 15 s until the answer starts, the whole answer when a
replica comes up, an error event the openai SDK raises when none does.

The real gateway process; the replica is the stand-in (bench/gateway_standin.py) that answers
/ready 503 for 45 s after it starts -- a cold start, without an engine's two cores.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from .harness import free_port, launch_standin, running_gateway, write_endpoints

CHAT = "/v1/chat/completions"
COLD_START_SECONDS = 45.0
MAX_SILENCE_SECONDS = 15.0
COMMENT = ": waiting for a replica"


def chat(model: str, **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "hello"}], **extra}


@pytest.fixture(scope="module")
def logs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("held-stream-logs")


def _endpoints(logs: Path, name: str, port: int) -> str:
    path = write_endpoints(
        logs / f"{name}.yaml",
        [{"name": name, "models": [f"{name}-model"], "backends": [f"http://127.0.0.1:{port}"]}],
    )
    return str(path)


def _raw_stream(url: str, body: dict, path: str = CHAT) -> dict:
    """One streamed request, read as it arrives: the response's status and content type, and
    every chunk with the time it arrived (seconds after the request was sent)."""
    began = time.monotonic()
    chunks: list[tuple[float, bytes]] = []
    with httpx.stream("POST", url + path, json=body, timeout=300) as response:
        head = (time.monotonic() - began, response.status_code, response.headers["content-type"])
        for chunk in response.iter_raw():
            chunks.append((time.monotonic() - began, chunk))
    return {"head": head, "chunks": chunks}


def _events(chunks: list[tuple[float, bytes]]) -> list[str]:
    text = b"".join(c for _, c in chunks).decode()
    return [block for block in text.split("\n\n") if block]


def test_a_held_stream_is_kept_alive_and_answered_when_a_replica_comes_45_s_later(logs):
    port = free_port()
    with running_gateway(
        logs,
        GATEWAY_ENDPOINTS_FILE=_endpoints(logs, "cold", port),
        GATEWAY_REQUIRE_KEYS="false",
        GATEWAY_PROBE_INTERVAL_SECONDS="0.5",
    ) as gw:
        results: dict = {}

        def raw() -> None:
            results["raw"] = _raw_stream(gw.url, chat("cold-model", stream=True))

        def sdk() -> None:
            client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
            began = time.monotonic()
            stream = client.chat.completions.create(
                model="cold-model", messages=[{"role": "user", "content": "hi"}], stream=True
            )
            results["sdk"] = ([chunk for chunk in stream], time.monotonic() - began)

        def replica_error() -> None:
            # The stand-in has no /v1/embeddings: its 404 comes after the commit point.
            body = {"model": "cold-model", "input": "hello", "stream": True}
            results["error"] = _raw_stream(gw.url, body, "/v1/embeddings")

        callers = [threading.Thread(target=f) for f in (raw, sdk, replica_error)]
        for caller in callers:
            caller.start()
        replica = launch_standin(logs, "late", port=port, ready_after=COLD_START_SECONDS)
        try:
            for caller in callers:
                caller.join(COLD_START_SECONDS + 120)
        finally:
            replica.stop()

    raw_result = results["raw"]
    _, status, content_type = raw_result["head"]
    assert status == 200 and content_type.startswith("text/event-stream")
    events = _events(raw_result["chunks"])
    answer_at = next(t for t, c in raw_result["chunks"] if b"data: " in c)
    assert answer_at >= COLD_START_SECONDS - 5, "the request was not held for the cold start"
    # A byte at least every 15 s from the request to the first event of the answer.
    arrivals = [0.0] + [t for t, _ in raw_result["chunks"] if t <= answer_at]
    gaps = [later - earlier for earlier, later in itertools.pairwise(arrivals)]
    assert max(gaps) <= MAX_SILENCE_SECONDS, f"silences while held: {gaps}"
    comments = [e for e in events if e.startswith(":")]
    assert comments and all(e == COMMENT for e in comments)
    data = [e for e in events if e.startswith("data: ")]
    assert data[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: ") :]) for e in data[:-1]]
    assert len(chunks) == 8 and all(c["object"] == "chat.completion.chunk" for c in chunks)

    sdk_chunks, sdk_seconds = results["sdk"]
    assert sdk_seconds >= COLD_START_SECONDS - 5
    assert len(sdk_chunks) == 8
    assert "".join(c.choices[0].delta.content or "" for c in sdk_chunks) == "x" * 8

    error_result = results["error"]
    assert error_result["head"][1] == 200  # committed before the replica answered
    last = _events(error_result["chunks"])[-1]
    error = json.loads(last[len("data: ") :])["error"]
    assert error["code"] == 404 and set(error) >= {"message", "type", "param", "code"}


def test_a_hold_that_times_out_ends_the_stream_with_an_error_the_sdk_raises(logs):
    with running_gateway(
        logs,
        GATEWAY_ENDPOINTS_FILE=_endpoints(logs, "never", free_port()),
        GATEWAY_REQUIRE_KEYS="false",
        GATEWAY_HOLD_TIMEOUT_SECONDS="4",
    ) as gw:
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
        stream = client.chat.completions.create(
            model="never-model", messages=[{"role": "user", "content": "hi"}], stream=True
        )
        with pytest.raises(openai.APIError) as raised:
            list(stream)
        assert "no ready replica" in raised.value.message
        assert raised.value.body["code"] == "endpoint_unavailable"

        raw = _raw_stream(gw.url, chat("never-model", stream=True))
        events = _events(raw["chunks"])
        assert raw["head"][1] == 200 and events[0] == COMMENT
        error = json.loads(events[-1][len("data: ") :])["error"]
        assert error["code"] == "endpoint_unavailable" and "no ready replica" in error["message"]

        # Not streamed: the hold ends in a 503 with Retry-After, as before.
        plain = httpx.post(gw.url + CHAT, json=chat("never-model"), timeout=30)
        assert plain.status_code == 503 and plain.headers["retry-after"].isdigit()
