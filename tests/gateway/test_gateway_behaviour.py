"""The real gateway process in front of stand-in backends (bench/gateway_standin.py): keys, bad
input, holding, disconnects, retries and failures mid-stream, request ids, metrics, drain.

Stand-ins, not engines, because these behaviours need backends that crash or cut a stream on
cue; tests/gateway/test_gateway_runtime.py runs the same gateway in front of real runtimes.

Every test that runs on the module's gateway runs twice: with one process and with
GATEWAY_WORKERS=2 (a supervisor and two workers sharing the port; /metrics their sum), which
must behave alike to a client and on /metrics.
"""

from __future__ import annotations

import json
import re
import signal
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import yaml
from llmendpoints_gateway.routing import HashRing, hash64, prefix_key

from .harness import Process, free_port, launch_standin, running_gateway, write_endpoints

ALICE, BOB = "sk-alice-secret", "sk-bob-secret"
CHAT = "/v1/chat/completions"


def chat(model: str, text: str = "hello", **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": text}], **extra}


@pytest.fixture(scope="module")
def logs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gateway-logs")


@pytest.fixture(scope="module", params=[1, 2], ids=["1-process", "2-workers"])
def workers(request) -> int:
    return request.param


@pytest.fixture(scope="module")
def standins(logs, workers):
    procs = {name: launch_standin(logs, name) for name in ("p1", "p2", "o1", "f1", "f2")}
    for proc in procs.values():
        proc.wait_http("/ready")
    yield procs
    for proc in procs.values():
        proc.stop()


@pytest.fixture(scope="module")
def solo_port() -> int:
    return free_port()  # nothing listens here until test_holding starts a replica


@pytest.fixture(scope="module")
def gateway(logs, standins, solo_port, workers):
    endpoints = [
        {
            "name": "pair",
            "models": ["pair-model"],
            "backends": [standins["p1"].url, standins["p2"].url],
        },
        {"name": "other", "models": ["other-model"], "backends": [standins["o1"].url]},
        {
            "name": "fragile",
            "models": ["fragile-model"],
            "backends": [standins["f1"].url, standins["f2"].url],
        },
        {"name": "solo", "models": ["solo-model"], "backends": [f"http://127.0.0.1:{solo_port}"]},
        {
            "name": "never",
            "models": ["never-model"],
            "backends": [f"http://127.0.0.1:{free_port()}"],
        },
    ]
    keys = logs / "keys.yaml"
    keys.write_text(
        yaml.safe_dump(
            {
                "keys": [
                    {
                        "name": "alice",
                        "key": ALICE,
                        "endpoints": ["pair", "fragile", "solo", "never"],
                    },
                    {"name": "bob", "key": BOB, "endpoints": ["other"]},
                ]
            }
        )
    )
    with running_gateway(
        logs,
        GATEWAY_ENDPOINTS_FILE=str(write_endpoints(logs / "endpoints.yaml", endpoints)),
        API_KEYS_FILE=str(keys),
        MAX_REQUEST_BODY_BYTES="65536",
        MAX_HEADER_BYTES="32768",
        GATEWAY_METRICS_KEY_LABELS="1",
        GATEWAY_WORKERS=str(workers),
    ) as gw:
        _wait_ready_replicas(gw, {"pair": 2, "other": 1, "fragile": 2})
        yield gw


def _wait_ready_replicas(gw: Process, want: dict[str, int], timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        models = httpx.get(gw.url + "/v1/models", headers=_auth(ALICE)).json()["data"]
        models += httpx.get(gw.url + "/v1/models", headers=_auth(BOB)).json()["data"]
        ready = {m["endpoint"]: m["ready_replicas"] for m in models}
        if all(ready.get(k) == v for k, v in want.items()):
            return
        time.sleep(0.1)
    raise TimeoutError(f"replicas not ready: {ready}")


def _auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def _client(gw: Process, key: str = ALICE, timeout: float = 30) -> httpx.Client:
    return httpx.Client(base_url=gw.url, headers=_auth(key), timeout=timeout)


def _metric(gw: Process, name: str, **labels: str) -> float:
    text = httpx.get(gw.metrics_url).text
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith(name + "{"):
            got = ",".join(sorted(line[len(name) + 1 : line.index("}")].split(",")))
            if got == want:
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


# ------------------------------------------------------------------ models and keys


def test_models_lists_what_the_key_may_use(gateway):
    with _client(gateway, ALICE) as c:
        alice = {m["id"] for m in c.get("/v1/models").json()["data"]}
    with _client(gateway, BOB) as c:
        bob = {m["id"] for m in c.get("/v1/models").json()["data"]}
    assert alice == {"pair-model", "fragile-model", "solo-model", "never-model"}
    assert bob == {"other-model"}


def test_openai_sdk_through_the_gateway(gateway):
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=BOB, max_retries=0)
    reply = client.chat.completions.create(**chat("other-model"))
    assert reply.choices[0].message.content == "x" * 8
    chunks = list(client.chat.completions.create(**chat("other-model"), stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "x" * 8


def test_a_key_of_one_endpoint_is_refused_on_another(gateway):
    # Told nothing about the other endpoint: its model answers exactly as a model that does
    # not exist, its /v2 address as an endpoint that does not exist (never a 403 that would
    # confirm it is there); /v1/models does not list it.
    with _client(gateway, BOB) as c:
        refused = c.post(CHAT, json=chat("pair-model"))
        unknown = c.post(CHAT, json=chat("no-such-model"))
        error = _error(refused, 404)
        assert error == {**_error(unknown, 404), "message": error["message"]}
        assert error["message"] == "The model `pair-model` does not exist."
        assert BOB not in refused.text
        refused = c.post("/v2/pair/openai/v1/chat/completions", json=chat("pair-model"))
        unknown = c.post("/v2/nowhere/openai/v1/chat/completions", json=chat("pair-model"))
        assert _error(refused, 404)["message"] == "endpoint 'pair' does not exist"
        assert _error(unknown, 404)["message"] == "endpoint 'nowhere' does not exist"
        assert (
            c.post("/v2/other/openai/v1/chat/completions", json=chat("other-model")).status_code
            == 200
        )


def test_missing_and_wrong_keys_are_401(gateway):
    assert (
        _error(httpx.post(gateway.url + CHAT, json=chat("pair-model")), 401)["type"]
        == "AuthenticationError"
    )
    error = _error(
        httpx.post(gateway.url + CHAT, json=chat("pair-model"), headers=_auth("nope")), 401
    )
    assert "invalid API key" in error["message"]
    _error(httpx.get(gateway.url + "/v1/models"), 401)


# ------------------------------------------------------------------ bad input


def test_bad_inputs_are_openai_shaped_4xx_and_the_gateway_keeps_serving(gateway):
    with _client(gateway) as c:
        error = _error(c.post(CHAT, content=b'{"model": "pair-model", "messages": ['), 400)
        assert "not valid JSON" in error["message"]
        error = _error(c.post(CHAT, json={"messages": []}), 400)
        assert error["param"] == "model" and "`model` is required" in error["message"]
        _error(c.post(CHAT, json={"model": 7}), 400)
        _error(c.post(CHAT, content=b"[1, 2]"), 400)
        error = _error(c.post(CHAT, content=b'{"model": "pair-\xff\xfe"}'), 400)
        assert "not UTF-8" in error["message"]
        error = _error(c.post(CHAT, json=chat("pair-model", "x" * 70_000)), 413)
        assert error["type"] == "ContentTooLargeError"
        # Chunked (no Content-Length): the limit still holds while reading.
        chunks = iter([b'{"model": "pair-model", "x": "', b"y" * 70_000, b'"}'])
        _error(c.post(CHAT, content=chunks), 413)
        _error(c.post(CHAT, json=chat("pair-model"), headers={"x-filler": "z" * 40_000}), 431)
        error = _error(c.post(CHAT, json=chat("no-such-model")), 404)
        assert error["message"] == "The model `no-such-model` does not exist."
        _error(c.get(CHAT), 405)
        _error(c.get("/nothing"), 404)
        assert c.post(CHAT, json=chat("pair-model")).status_code == 200


# ------------------------------------------------------------------ routing and streaming


def test_request_id_is_passed_through(gateway, standins):
    with _client(gateway, BOB) as c:
        response = c.post(CHAT, json=chat("other-model"), headers={"x-request-id": "req-abc-123"})
        assert response.status_code == 200
        assert response.headers["x-request-id"] == "req-abc-123"
        assert httpx.get(standins["o1"].url + "/stats").json()["last_request_id"] == "req-abc-123"
        assert "req-abc-123" in gateway.log()


def test_an_unsafe_request_id_is_replaced_not_echoed_or_logged(gateway, standins):
    forged = 'ab] 127.0.0.1:1 - "GET /admin HTTP/1.1" 200 #'
    with _client(gateway, BOB) as c:
        response = c.post(CHAT, json=chat("other-model"), headers={"x-request-id": forged})
        assert response.status_code == 200
        fresh = response.headers["x-request-id"]
        assert fresh != forged and re.fullmatch(r"[0-9a-f]{32}", fresh)
        assert httpx.get(standins["o1"].url + "/stats").json()["last_request_id"] == fresh


def test_a_shared_prefix_sticks_to_one_replica(gateway, standins):
    before = {n: httpx.get(standins[n].url + "/stats").json()["requests"] for n in ("p1", "p2")}
    with _client(gateway) as c:
        for turn in range(6):
            messages = [
                {"role": "system", "content": "You are a pirate."},
                {"role": "user", "content": "tell me about ships"},
            ]
            messages += [
                {"role": "assistant", "content": "arr"},
                {"role": "user", "content": f"more {turn}"},
            ] * turn
            assert (
                c.post(CHAT, json={"model": "pair-model", "messages": messages}).status_code == 200
            )
    after = {n: httpx.get(standins[n].url + "/stats").json()["requests"] for n in ("p1", "p2")}
    assert sorted(after[n] - before[n] for n in after) == [0, 6]
    assert (
        _metric(
            gateway,
            "llmendpoints_gateway_routing_decisions_total",
            endpoint="default/pair",
            outcome="affinity",
        )
        >= 6
    )


def test_client_disconnect_cancels_the_upstream_stream(gateway, standins):
    body = chat(
        "pair-model", "a long story", stream=True, standin_chunks=3000, standin_interval=0.01
    )
    before = sum(httpx.get(standins[n].url + "/stats").json()["disconnects"] for n in ("p1", "p2"))
    with _client(gateway) as c, c.stream("POST", CHAT, json=body) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        stats = [httpx.get(standins[n].url + "/stats").json() for n in ("p1", "p2")]
        if sum(s["disconnects"] for s in stats) == before + 1 and all(
            s["open"] == 0 for s in stats
        ):
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"the replica kept streaming after the client left: {stats}")
    assert (
        _metric(
            gateway,
            "llmendpoints_gateway_in_flight_requests",
            endpoint="default/pair",
            replica=standins["p1"].url,
        )
        == 0
    )


def test_a_stream_read_to_done_and_closed_is_answered_not_abandoned(gateway, standins):
    """The openai SDK's synchronous stream closes the connection at [DONE], before the body's
    end (here 3 s later): the client had the whole answer, so it is counted a 200 (metrics,
    usage record), not a 499 as a client that left mid-answer is."""

    def counted() -> tuple[float, float]:  # alice's requests on "pair" answered 200, and 499
        return tuple(
            _metric(
                gateway,
                "llmendpoints_gateway_key_requests_total",
                key="alice",
                endpoint="default/pair",
                code=code,
            )
            for code in ("200", "499")
        )

    before = counted()
    closed_before = [httpx.get(standins[n].url + "/stats").json() for n in ("p1", "p2")]
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=ALICE, max_retries=0)
    chunks = list(
        client.chat.completions.create(
            model="pair-model",
            messages=[{"role": "user", "content": "hello"}],
            stream=True,
            extra_body={"standin_chunks": 3, "standin_end_after": 3},
        )
    )
    assert len(chunks) == 3
    deadline = time.monotonic() + 10
    while True:  # the gateway saw the client close before the body's end, and closed upstream
        stats = [httpx.get(standins[n].url + "/stats").json() for n in ("p1", "p2")]
        if sum(s["closed_after_done"] for s in stats) == 1 + sum(
            s["closed_after_done"] for s in closed_before
        ):
            break
        assert time.monotonic() < deadline, stats
        time.sleep(0.05)
    after = counted()
    assert (after[0] - before[0], after[1] - before[1]) == (1, 0)


def test_a_client_leaving_before_the_answer_starts_closes_the_upstream_request(gateway, standins):
    # Non-streamed: the stand-in answers after 1,000 x 10 ms; the client gives up after 0.5 s.
    body = chat("other-model", standin_chunks=1000, standin_interval=0.01)
    before = httpx.get(standins["o1"].url + "/stats").json()["disconnects"]
    with _client(gateway, BOB, timeout=0.5) as c, pytest.raises(httpx.ReadTimeout):
        c.post(CHAT, json=body)
    deadline = time.monotonic() + 5
    while httpx.get(standins["o1"].url + "/stats").json()["disconnects"] != before + 1:
        assert time.monotonic() < deadline, "the replica still works for a client that left"
        time.sleep(0.05)


def test_a_replica_failing_before_the_first_byte_is_retried_on_another(gateway, standins):
    f1, f2 = standins["f1"], standins["f2"]
    # A prompt whose own replica (the first on the ring) is f1: it crashes on it, f2 answers.
    text = next(
        t
        for t in (f"story {i}" for i in range(1000))
        if HashRing([f1.url, f2.url]).owner(hash64(prefix_key(CHAT, chat("fragile-model", t))))
        == f1.url
    )
    with _client(gateway) as c:
        response = c.post(
            CHAT, json=chat("fragile-model", text, standin_fail="before", standin_fail_on="f1")
        )
    assert response.status_code == 200, response.text
    assert response.json()["replica"] == "f2"
    assert f1.process.wait(5) == 3  # it really crashed
    assert (
        _metric(
            gateway,
            "llmendpoints_gateway_routing_decisions_total",
            endpoint="default/fragile",
            outcome="retry",
        )
        == 1
    )


def test_a_failure_mid_stream_reaches_the_client_as_an_error_event(gateway):
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=BOB, max_retries=0)
    stream = client.chat.completions.create(
        **chat("other-model"), stream=True, extra_body={"standin_fail": "midstream"}
    )
    received = []
    with pytest.raises(openai.APIError, match="mid-stream"):
        for chunk in stream:
            received.append(chunk)
    assert len(received) == 2


# ------------------------------------------------------------------ holding


def test_requests_are_held_until_the_only_replica_is_ready(gateway, logs, solo_port):
    result: dict = {}

    def call():
        with _client(gateway) as c:
            result["response"] = c.post(CHAT, json=chat("solo-model"))

    caller = threading.Thread(target=call)
    caller.start()
    deadline = time.monotonic() + 10
    while _metric(gateway, "llmendpoints_gateway_held_requests", endpoint="default/solo") != 1:
        assert time.monotonic() < deadline, "the request was not held"
        time.sleep(0.05)
    replica = launch_standin(logs, "solo", port=solo_port, ready_after=1.0)
    try:
        caller.join(30)
        assert result["response"].status_code == 200
        assert result["response"].json()["replica"] == "solo"
        assert _metric(gateway, "llmendpoints_gateway_held_requests", endpoint="default/solo") == 0
    finally:
        replica.stop()


def test_a_client_that_leaves_while_held_is_dropped(gateway):
    with _client(gateway, timeout=0.5) as c, pytest.raises(httpx.ReadTimeout):
        c.post(CHAT, json=chat("never-model"))
    deadline = time.monotonic() + 5
    while (
        _metric(
            gateway,
            "llmendpoints_gateway_key_requests_total",
            key="alice",
            endpoint="default/never",
            code="499",
        )
        != 1
    ):
        assert time.monotonic() < deadline, "the held request was not dropped"
        time.sleep(0.05)
    assert _metric(gateway, "llmendpoints_gateway_held_requests", endpoint="default/never") == 0
    assert (
        _metric(
            gateway, "llmendpoints_gateway_requests_total", endpoint="default/never", code="499"
        )
        == 1
    )
    gone = _metric(
        gateway,
        "llmendpoints_gateway_hold_duration_seconds_count",
        endpoint="default/never",
        outcome="client_gone",
    )
    assert gone == 1


def test_beyond_the_hold_bounds_503_with_retry_after(logs):
    endpoints = write_endpoints(
        logs / "cold.yaml",
        [
            {
                "name": "cold",
                "models": ["cold-model"],
                "backends": [f"http://127.0.0.1:{free_port()}"],
            }
        ],
    )
    with running_gateway(
        logs,
        GATEWAY_ENDPOINTS_FILE=str(endpoints),
        GATEWAY_REQUIRE_KEYS="false",
        GATEWAY_HOLD_QUEUE_LENGTH="1",
        GATEWAY_HOLD_TIMEOUT_SECONDS="1.5",
    ) as gw:
        first: dict = {}
        caller = threading.Thread(
            target=lambda: first.update(
                r=httpx.post(gw.url + CHAT, json=chat("cold-model"), timeout=10)
            )
        )
        caller.start()
        deadline = time.monotonic() + 5
        while _metric(gw, "llmendpoints_gateway_held_requests", endpoint="default/cold") != 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        full = httpx.post(gw.url + CHAT, json=chat("cold-model"), timeout=10)
        assert "hold queue is full" in _error(full, 503)["message"]
        assert full.headers["retry-after"].isdigit()
        caller.join(10)
        timed_out = first["r"]
        assert "no ready replica" in _error(timed_out, 503)["message"]
        assert timed_out.headers["retry-after"].isdigit()


# ------------------------------------------------------------------ drain


def test_sigterm_finishes_streams_and_answers_held_requests_503(logs, standins, workers):
    endpoints = write_endpoints(
        logs / "drain.yaml",
        [
            {"name": "live", "models": ["live-model"], "backends": [standins["o1"].url]},
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
        GATEWAY_REQUIRE_KEYS="false",
        GATEWAY_WORKERS=str(workers),
    ) as gw:
        gw.wait_http("/v1/models")
        while httpx.get(gw.url + "/v1/models").json()["data"][1]["ready_replicas"] != 1:
            time.sleep(0.05)
        held: dict = {}
        holder = threading.Thread(
            target=lambda: held.update(
                r=httpx.post(gw.url + CHAT, json=chat("cold-model"), timeout=30)
            )
        )
        holder.start()
        body = chat("live-model", stream=True, standin_chunks=100, standin_interval=0.02)
        with httpx.stream("POST", gw.url + CHAT, json=body, timeout=30) as stream:
            lines = stream.iter_lines()
            assert next(lines).startswith("data: ")
            gw.process.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]" and len(rest) == 100  # 99 chunks + [DONE]
        assert json.loads(rest[-2][len("data: ") :])["object"] == "chat.completion.chunk"
        holder.join(10)
        assert "shutting down" in _error(held["r"], 503)["message"]
        assert held["r"].headers["retry-after"].isdigit()
        assert gw.process.wait(30) == 0
