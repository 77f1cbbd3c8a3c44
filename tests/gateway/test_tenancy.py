"""One tenant cannot read, bill, route around or starve another through the gateway: each
attack of the tenancy audit run against the real gateway process and stand-in replicas that
record what reached them. The queue's isolation (NATS credentials per endpoint) is tested in
tests/queue; the runtime's side of the gateway token in tests/unit/runtime."""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml
from llmendpoints_common.gateway_token import derive

from .harness import Process, free_port, launch_standin, running_gateway, write_endpoints

CHAT = "/v1/chat/completions"
ALICE, BOB, ADMIN = "sk-alice-0123456789", "sk-bob-0123456789", "sk-admin-0123456789"
SECRET = b"a-gateway-token-secret-of-32-bytes!"


def chat(model: str, text: str = "one two three", **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": text}], **extra}


def _auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def logs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tenancy")


@pytest.fixture(scope="module")
def standins(logs):
    started = {name: launch_standin(logs, name) for name in ("s1", "s2")}
    for standin in started.values():
        standin.wait_http("/ready")
    yield started
    for standin in started.values():
        standin.stop()


@pytest.fixture(scope="module")
def gateway(logs, standins):
    keys = logs / "keys.yaml"
    keys.write_text(
        yaml.safe_dump(
            {
                "keys": [
                    {"name": "alice", "key": ALICE, "endpoints": ["one", "cold"]},
                    {"name": "bob", "key": BOB, "endpoints": ["two", "cold"]},
                    {"name": "ops", "key": ADMIN, "admin": True},
                ]
            }
        )
    )
    secret = logs / "token-secret"
    secret.write_bytes(SECRET + b"\n")
    endpoints = write_endpoints(
        logs / "endpoints.yaml",
        [
            {"name": "one", "models": ["one-model"], "backends": [standins["s1"].url]},
            {"name": "two", "models": ["two-model"], "backends": [standins["s2"].url]},
            {
                "name": "cold",
                "models": ["cold-model"],
                "backends": [f"http://127.0.0.1:{free_port()}"],
            },
        ],
    )
    with running_gateway(
        logs,
        GATEWAY_ENDPOINTS_FILE=str(endpoints),
        API_KEYS_FILE=str(keys),
        GATEWAY_TOKEN_SECRET_FILE=str(secret),
        GATEWAY_HOLD_QUEUE_LENGTH="4",
        GATEWAY_HOLD_KEY_SHARE="0.5",
        GATEWAY_HOLD_MAX_BYTES="300000",
        GATEWAY_HOLD_TIMEOUT_SECONDS="20",
        REQUEST_READ_TIMEOUT_SECONDS="2",
        LOG_FORMAT="text",
    ) as gw:
        deadline = time.monotonic() + 20
        while True:
            models = httpx.get(gw.url + "/v1/models", headers=_auth(ADMIN)).json()["data"]
            if {m["endpoint"]: m["ready_replicas"] for m in models} == {
                "one": 1,
                "two": 1,
                "cold": 0,
            }:
                break
            assert time.monotonic() < deadline, models
            time.sleep(0.1)
        yield gw


def _stats(standin: Process) -> dict:
    return httpx.get(standin.url + "/stats").json()


def _still_serving(gw: Process) -> None:
    answer = httpx.post(gw.url + CHAT, json=chat("one-model"), headers=_auth(ALICE), timeout=30)
    assert answer.status_code == 200, answer.text


# ------------------------------------------------------------------ credentials


def test_the_pod_sees_the_gateways_token_and_the_callers_name_never_the_callers_key(
    gateway, standins
):
    for headers in (_auth(ALICE), {"x-api-key": ALICE}):
        headers = {**headers, "x-llmep-caller": "forged-name"}
        answer = httpx.post(gateway.url + CHAT, json=chat("one-model"), headers=headers)
        assert answer.status_code == 200, answer.text
        seen = _stats(standins["s1"])
        assert seen["last_authorization"] == f"Bearer {derive(SECRET, 'one')}"
        assert seen["last_api_key"] is None
        assert seen["last_caller"] == "alice"  # the gateway's word, not the client's
    # an admin key is never forwarded either
    answer = httpx.post(gateway.url + CHAT, json=chat("two-model"), headers=_auth(ADMIN))
    assert answer.status_code == 200
    seen = _stats(standins["s2"])
    assert seen["last_authorization"] == f"Bearer {derive(SECRET, 'two')}"
    assert seen["last_caller"] == "ops"
    # each endpoint's pods get their own token: one endpoint's is no use at another's
    assert derive(SECRET, "one") != derive(SECRET, "two")


# ------------------------------------------------------------------ paths


@pytest.mark.parametrize(
    "path",
    [
        "/v1/../run",
        "/v1/%2e%2e/collective_rpc",
        "/v1/../invocations",
        "/v1/%2E%2E/v1/load_lora_adapter",
        "/v1/sleep",
        "/v1/collective_rpc",
        "/v1/load_lora_adapter",
        "/v1/tokenize/../../pause",
    ],
)
def test_only_the_openai_inference_routes_reach_a_pod(gateway, standins, path):
    before = _stats(standins["s1"])["paths"]
    answer = httpx.post(
        gateway.url + path, content=json.dumps(chat("one-model")), headers=_auth(ALICE)
    )
    assert answer.status_code == 404, answer.text
    assert answer.json()["error"]["type"] == "NotFoundError"
    assert _stats(standins["s1"])["paths"] == before  # nothing reached the replica


@pytest.mark.parametrize("path", ["/v1/./chat/completions", "/v1//chat/completions"])
def test_a_path_with_dot_or_empty_segments_is_routed_and_billed_as_it_is_forwarded(
    gateway, standins, path
):
    answer = httpx.post(
        gateway.url + path,
        content=json.dumps(chat("one-model", stream=True)),
        headers=_auth(ALICE),
    )
    assert answer.status_code == 200
    # forwarded normalised, and the gateway asked for the usage it bills
    assert _stats(standins["s1"])["paths"][-1] == "POST /v1/chat/completions"
    assert "data: [DONE]" in answer.text and '"usage"' not in answer.text


# ------------------------------------------------------------------ metering


@pytest.mark.parametrize("stream", ["true", 1, "yes", "1", [True]])
def test_a_stream_flag_that_is_not_a_boolean_is_refused_naming_it(gateway, standins, stream):
    before = _stats(standins["s1"])["requests"]
    answer = httpx.post(
        gateway.url + CHAT, json=chat("one-model", stream=stream), headers=_auth(ALICE)
    )
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == "stream"
    assert _stats(standins["s1"])["requests"] == before
    _still_serving(gateway)


# ------------------------------------------------------------------ the front door


def _raw(gw: Process, request: bytes, read_timeout: float = 10) -> bytes:
    with socket.create_connection(("127.0.0.1", gw.port), timeout=read_timeout) as sock:
        sock.sendall(request)
        chunks = []
        while True:
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                break
            if not chunk:
                break  # the gateway closed the connection
            chunks.append(chunk)
        return b"".join(chunks)


def test_a_request_without_a_key_is_401_from_its_headers_and_closed(gateway):
    # 10 MiB declared, none sent: the answer comes at once and the connection is closed.
    answer = _raw(
        gateway,
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: 10485760\r\n\r\n{",
    )
    assert answer.startswith(b"HTTP/1.1 401"), answer[:200]
    assert b"connection: close" in answer.lower()
    wrong = _raw(
        gateway,
        b"POST /v2/one/runsync HTTP/1.1\r\nhost: x\r\nauthorization: Bearer nope\r\n"
        b"content-length: 5000000\r\n\r\n",
    )
    assert wrong.startswith(b"HTTP/1.1 401"), wrong[:200]
    _still_serving(gateway)


def test_headers_that_never_end_get_431_and_slow_bodies_408(gateway):
    huge = _raw(gateway, b"GET /v1/models HTTP/1.1\r\nx-filler: " + b"a" * 70_000 + b"\r\n")
    assert huge.startswith(b"HTTP/1.1 431"), huge[:200]
    slow = _raw(
        gateway,
        b"POST "
        + CHAT.encode()
        + b" HTTP/1.1\r\nhost: x\r\nauthorization: Bearer "
        + ALICE.encode()
        + b"\r\ncontent-length: 100\r\n\r\n{",
    )
    assert slow.startswith(b"HTTP/1.1 408"), slow[:200]
    _still_serving(gateway)


def test_json_nested_too_deep_is_a_400_not_a_500(gateway):
    deep = b'{"model": "one-model", "x": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"
    answer = httpx.post(gateway.url + CHAT, content=deep, headers=_auth(ALICE))
    assert answer.status_code == 400
    assert "nested too deeply" in answer.json()["error"]["message"]
    _still_serving(gateway)


def test_client_text_cannot_forge_a_log_line(gateway):
    answer = _raw(
        gateway,
        b"GET /v1/forged%0AINFO%20llmendpoints.gateway.access%20forged HTTP/1.1\r\nhost: x\r\n"
        b"authorization: Bearer " + ALICE.encode() + b"\r\nconnection: close\r\n\r\n",
    )
    assert answer.startswith(b"HTTP/1.1 404"), answer[:200]
    time.sleep(0.5)  # the access line is written as the answer ends
    log = gateway.log()
    assert "\nINFO llmendpoints.gateway.access forged" not in log
    assert "forged\\nINFO" in log


# ------------------------------------------------------------------ holding


def _hold(gw: Process, key: str, results: list, body: dict | None = None) -> threading.Thread:
    def call() -> None:
        try:
            answer = httpx.post(
                gw.url + CHAT, json=body or chat("cold-model"), headers=_auth(key), timeout=30
            )
            results.append(answer)
        except httpx.TransportError as exc:
            results.append(exc)

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    return thread


def _held(gw: Process) -> float:
    for line in httpx.get(gw.metrics_url).text.splitlines():
        if line.startswith("llmendpoints_gateway_held_requests{") and '"cold"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _wait_held(gw: Process, n: int) -> None:
    deadline = time.monotonic() + 10
    while _held(gw) != n:
        assert time.monotonic() < deadline, f"held {_held(gw)}, not {n}"
        time.sleep(0.05)


def test_one_key_cannot_take_every_hold_slot(gateway):
    """The hold queue is 4, a key's share 2: alice's third request is refused, bob's still
    waits; then a body that would pass the byte budget is refused too."""
    alice: list = []
    threads = [_hold(gateway, ALICE, alice) for _ in range(2)]
    _wait_held(gateway, 2)
    third = httpx.post(gateway.url + CHAT, json=chat("cold-model"), headers=_auth(ALICE))
    assert third.status_code == 503
    assert "its share of the hold queue" in third.json()["error"]["message"]
    assert third.headers["retry-after"].isdigit()
    bob: list = []
    threads.append(_hold(gateway, BOB, bob))
    _wait_held(gateway, 3)  # bob waits: alice's requests did not take his place
    big = chat("cold-model", text="word " * 70_000)  # ~350 KB: over the 300 KB budget
    over = httpx.post(gateway.url + CHAT, json=big, headers=_auth(BOB))
    assert over.status_code == 503 and "request bytes" in over.json()["error"]["message"]
    assert _held(gateway) == 3
    _still_serving(gateway)
    for thread in threads:
        thread.join(40)  # the holds time out (20 s): 503 each
    assert all(getattr(a, "status_code", None) == 503 for a in alice + bob)


# ------------------------------------------------------------------ metrics


def test_metrics_are_not_on_the_client_port(gateway):
    answer = httpx.get(gateway.url + "/metrics")
    assert answer.status_code == 404
    assert "llmendpoints_gateway_requests_total" in httpx.get(gateway.metrics_url).text


# ------------------------------------------------------------------ fail closed


def test_no_key_configured_is_no_access_and_deleting_the_last_key_opens_nothing(logs, standins):
    endpoints = write_endpoints(
        logs / "closed.yaml",
        [{"name": "one", "models": ["one-model"], "backends": [standins["s1"].url]}],
    )
    # Keys required (the default) and none anywhere: nobody gets in.
    with running_gateway(logs, GATEWAY_ENDPOINTS_FILE=str(endpoints)) as gw:
        answer = httpx.post(gw.url + CHAT, json=chat("one-model"))
        assert answer.status_code == 401
        assert httpx.get(gw.url + "/v1/models").status_code == 401
    keys = logs / "rotating-keys"
    keys.write_text(ALICE + "\n")
    with running_gateway(
        logs, GATEWAY_ENDPOINTS_FILE=str(endpoints), API_KEYS_FILE=str(keys)
    ) as gw:
        assert (
            httpx.post(gw.url + CHAT, json=chat("one-model"), headers=_auth(ALICE)).status_code
            == 200
        )
        keys.write_text("# every key revoked\n")
        deadline = time.monotonic() + 10
        while (
            httpx.post(gw.url + CHAT, json=chat("one-model"), headers=_auth(ALICE)).status_code
            != 401
        ):
            assert time.monotonic() < deadline, "the revoked key still works"
            time.sleep(0.2)
        assert httpx.post(gw.url + CHAT, json=chat("one-model")).status_code == 401
        keys.unlink()  # the file gone: the last keys known stay, nothing opens
        time.sleep(1.5)
        assert httpx.post(gw.url + CHAT, json=chat("one-model")).status_code == 401


# ------------------------------------------------------------------ what is billed


def _tokens(gw: Process, key: str, kind: str) -> float:
    want = f'llmendpoints_gateway_tokens_total{{endpoint="one",key="{key}",kind="{kind}"}}'
    for line in httpx.get(gw.metrics_url).text.splitlines():
        if line.startswith("llmendpoints_gateway_tokens_total{"):
            labels = dict(
                part.split("=", 1)
                for part in line[line.index("{") + 1 : line.index("}")].split(",")
            )
            if labels == {"endpoint": '"one"', "key": f'"{key}"', "kind": f'"{kind}"'}:
                return float(line.rsplit(" ", 1)[1])
    assert want  # (the series appears once something was counted)
    return 0.0


def _wait(condition, what: str, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def test_a_stream_the_client_cuts_is_billed_what_it_received(gateway):
    before = _tokens(gateway, "alice", "completion")
    body = chat("one-model", stream=True, standin_chunks=200, standin_interval=0.02)
    with httpx.stream("POST", gateway.url + CHAT, json=body, headers=_auth(ALICE)) as answer:
        events = 0
        for line in answer.iter_lines():
            if line.startswith("data: "):
                events += 1
            if events == 10:
                break  # leave before the usage chunk ever comes
    _wait(
        lambda: _tokens(gateway, "alice", "completion") >= before + 10,
        "a cut stream billed nothing",
    )
    # an estimate from what was relayed: at least what the client read, never all 200
    assert _tokens(gateway, "alice", "completion") - before < 200


def test_a_large_answer_is_billed(gateway, standins):
    prompt_before = _tokens(gateway, "alice", "prompt")
    completion_before = _tokens(gateway, "alice", "completion")
    body = chat("one-model", text="a b c d e", standin_pad=9 * 1024 * 1024)
    answer = httpx.post(gateway.url + CHAT, json=body, headers=_auth(ALICE), timeout=60)
    assert answer.status_code == 200 and len(answer.content) > 9 * 1024 * 1024
    _wait(
        lambda: _tokens(gateway, "alice", "completion") == completion_before + 8,
        "a 9 MiB answer was not billed",
    )
    assert _tokens(gateway, "alice", "prompt") == prompt_before + 5
