"""BodyGuard at the ASGI level: /runsync has RunPod's 20 MiB limit, every other path 10 MiB."""

from __future__ import annotations

import json

import pytest
from llmendpoints_runtime.metrics import RuntimeMetrics
from llmendpoints_runtime.middleware import BodyGuard, is_runsync_path

MiB = 1024 * 1024


async def _post(path: str, size: int, *, declared: bool = True) -> dict:
    """POST a JSON object of ``size`` bytes through the guard, in 1 MiB chunks; returns what
    the client saw (status, error body) or what the app received."""
    reached: dict = {}

    async def app(scope, receive, send):
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        reached.update(status=200, size=len(b"".join(chunks)))

    payload = b'{"input": {"prompt": "' + b"x" * (size - 25) + b'"}}'
    assert len(payload) == size
    pieces = [payload[i : i + MiB] for i in range(0, size, MiB)]
    messages = [
        {"type": "http.request", "body": p, "more_body": i < len(pieces) - 1}
        for i, p in enumerate(pieces)
    ]

    async def receive():
        return messages.pop(0)

    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    headers = [(b"content-type", b"application/json")]
    if declared:
        headers.append((b"content-length", str(size).encode()))
    scope = {"type": "http", "method": "POST", "path": path, "headers": headers}
    guard = BodyGuard(app, 10 * MiB, RuntimeMetrics(), runsync_limit=20 * MiB)
    await guard(scope, receive, send)
    if reached:
        return reached
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return {"status": sent[0]["status"], "error": json.loads(body)}


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
@pytest.mark.parametrize("path", ["/runsync", "/v2/my-endpoint/runsync"])
async def test_a_15_mib_runsync_passes_the_guard(path, declared):
    assert await _post(path, 15 * MiB, declared=declared) == {"status": 200, "size": 15 * MiB}


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
@pytest.mark.parametrize("path", ["/run", "/v2/my-endpoint/run", "/v1/chat/completions"])
async def test_a_15_mib_body_elsewhere_is_413_naming_max_request_body_bytes(path, declared):
    seen = await _post(path, 15 * MiB, declared=declared)
    assert seen["status"] == 413
    message = seen["error"]["error"]["message"]
    assert f"{10 * MiB} bytes" in message and "MAX_REQUEST_BODY_BYTES" in message


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
@pytest.mark.parametrize("path", ["/runsync", "/v2/my-endpoint/runsync"])
async def test_a_21_mib_runsync_is_413_naming_its_limit(path, declared):
    seen = await _post(path, 21 * MiB, declared=declared)
    assert seen["status"] == 413
    message = seen["error"]["error"]["message"]
    assert f"{20 * MiB} bytes" in message and "MAX_RUNSYNC_BODY_BYTES" in message


def test_runsync_paths():
    assert is_runsync_path("/runsync")
    assert is_runsync_path("/v2/abc/runsync")
    assert not is_runsync_path("/run")
    assert not is_runsync_path("/v2//runsync")
    assert not is_runsync_path("/v2/abc/runsync/x")
    assert not is_runsync_path("/v1/runsync")
    assert not is_runsync_path("/x/abc/runsync")
