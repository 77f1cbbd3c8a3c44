"""API keys, body-size limit, admission queue and 429, on a runtime configured for them."""

from __future__ import annotations

import concurrent.futures
import json
import os
import time

import httpx
import openai
import pytest
from held_stream import HeldStream
from runtime_process import running_runtime

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("secret") / "api-keys"
    path.write_text("# mounted from a Secret\nfile-key-1\n")
    return path


@pytest.fixture(scope="module")
def limited(demo_model, runtime_logs, keys_file):
    with running_runtime(
        demo_model,
        runtime_logs,
        API_KEYS="env-key-1,env-key-2",
        API_KEYS_FILE=str(keys_file),
        MAX_CONCURRENCY="1",
        MAX_QUEUE_LENGTH="1",
        MAX_MODEL_LEN="2048",
        MAX_REQUEST_BODY_BYTES="4096",
    ) as server:
        yield server


def sdk(server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


def test_requests_without_a_valid_key_get_401(limited):
    with pytest.raises(openai.AuthenticationError) as info:
        sdk(limited, "wrong").models.list()
    assert info.value.status_code == 401
    assert "invalid API key" in info.value.body["message"]
    response = httpx.post(limited.url + "/v1/completions", json={"model": "demo", "prompt": "x"})
    assert response.status_code == 401
    assert response.json()["error"]["code"] == 401
    assert response.json()["error"]["type"] == "AuthenticationError"
    assert response.headers["www-authenticate"] == "Bearer"


def test_bearer_and_x_api_key_both_work(limited):
    assert sdk(limited, "env-key-2").models.list().data[0].id == "demo"
    response = httpx.get(limited.url + "/v1/models", headers={"x-api-key": "env-key-1"})
    assert response.status_code == 200


def test_keys_file_is_honoured_and_rotation_needs_no_restart(limited, keys_file):
    assert sdk(limited, "file-key-1").models.list().data
    keys_file.write_text("file-key-2\n")
    later = time.time() + 10
    os.utime(keys_file, (later, later))
    time.sleep(1.2)  # the file is checked at most once a second
    assert sdk(limited, "file-key-2").models.list().data
    with pytest.raises(openai.AuthenticationError):
        sdk(limited, "file-key-1").models.list()


def test_probes_and_metrics_are_open(limited):
    for path in ("/health", "/ready", "/ping", "/metrics"):
        assert httpx.get(limited.url + path).status_code == 200, path


def test_keys_never_reach_the_log(limited):
    log = limited.log()
    for key in ("env-key-1", "env-key-2", "file-key-1", "file-key-2"):
        assert key not in log


def test_oversized_body_gets_413(limited):
    big = {"model": "demo", "prompt": "x" * 5000}
    response = httpx.post(
        limited.url + "/v1/completions", json=big, headers={"x-api-key": "env-key-1"}
    )
    assert response.status_code == 413
    assert "MAX_REQUEST_BODY_BYTES" in response.json()["error"]["message"]
    assert response.json()["error"]["type"] == "ContentTooLargeError"
    # a chunked body (no content-length) is counted as it arrives
    response = httpx.post(
        limited.url + "/v1/completions",
        content=iter([b'{"prompt": "', b"y" * 5000, b'"}']),
        headers={"x-api-key": "env-key-1", "content-type": "application/json"},
    )
    assert response.status_code == 413


def _completion_tokens(url: str) -> int:
    with httpx.stream(
        "POST",
        url + "/v1/completions",
        json={**HeldStream.BODY, "n": 1, "logprobs": None},
        headers={"x-api-key": "env-key-1"},
        timeout=120,
    ) as r:
        assert r.status_code == 200, r.read()
        tokens = 0
        for line in r.iter_lines():
            if line.startswith("data: {") and '"usage":{' in line:
                tokens = json.loads(line[6:])["usage"]["completion_tokens"]
        return tokens


def _wait_metric(url: str, name: str, value: float, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while (seen := _metric(url, name)) != value:
        assert time.monotonic() < deadline, f"{name} stayed {seen}, expected {value}"
        time.sleep(0.1)


def _metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not exported")


def test_beyond_concurrency_requests_queue_and_beyond_the_queue_get_429(limited):
    held = HeldStream(limited.url, {"x-api-key": "env-key-1"})  # the only slot
    assert held.status == 200
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        second = pool.submit(_completion_tokens, limited.url)  # waits in the queue (length 1)
        _wait_metric(limited.url, "llmendpoints_queue_depth", 1)
        assert _metric(limited.url, "llmendpoints_requests_in_flight") == 1

        third = httpx.post(
            limited.url + "/v1/completions",
            json={"model": "demo", "prompt": "x", "max_tokens": 1},
            headers={"x-api-key": "env-key-1"},
        )
        assert third.status_code == 429
        assert third.headers["retry-after"]
        assert third.json()["error"]["type"] == "RateLimitError"
        assert not second.done()  # still queued behind the held slot

        assert held.finish() == HeldStream.TOKENS  # nothing was cut short
        assert second.result(120) == HeldStream.BODY["max_tokens"]  # ran once the slot was free
    # Everything drained, and the server keeps serving.
    assert _metric(limited.url, "llmendpoints_queue_depth") == 0
    assert (
        sdk(limited, "env-key-1")
        .completions.create(model="demo", prompt="ok", max_tokens=1)
        .choices
    )
