"""Fair use of the engine and the job policy (issue 16), on one real runtime (demo model):
MAX_N on every contract, sequence-counted admission, the policy's ranges, a finished job that
keeps its output and not its input.

The server runs with MAX_N=32, MAX_CONCURRENCY=32 (sequences: one MAX_N request fills it),
MAX_QUEUE_LENGTH=2 (sequences waiting), MAX_JOB_TTL_MS=1 h and MAX_MODEL_LEN 2048. MAX_N is large so that a MAX_N
request runs for seconds on the tiny demo model.
"""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from held_stream import HeldStream
from runtime_process import RuntimeServer, running_runtime

pytestmark = pytest.mark.engine

MAX_N = 32
CHAT = [{"role": "user", "content": "hi"}]
# Streams long enough (seconds on two cores) to be caught running.
HEAVY = {
    "model": "demo",
    "prompt": "Once upon a time",
    "max_tokens": 480,
    "ignore_eos": True,
    "n": MAX_N,
    "stream": True,
    "stream_options": {"include_usage": True},
}


@pytest.fixture(scope="module")
def server(demo_model, runtime_logs) -> Iterator[RuntimeServer]:
    with running_runtime(
        demo_model,
        runtime_logs,
        MAX_N=str(MAX_N),
        MAX_CONCURRENCY=str(MAX_N),
        MAX_QUEUE_LENGTH="2",
        MAX_JOB_TTL_MS="3600000",
        MAX_MODEL_LEN="2048",
    ) as running:
        yield running


@pytest.fixture(scope="module")
def http(server) -> Iterator[httpx.Client]:
    with server.client(timeout=120) as client:
        yield client


def metric(http: httpx.Client, name: str) -> float:
    for line in http.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not exported")


def refused(response: httpx.Response, param: str) -> dict:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["param"], error["code"]) == ("BadRequestError", param, 400)
    return error


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"model": "demo", "prompt": "x", "n": 33}, "n"),
        ("/v1/completions", {"model": "demo", "prompt": "x", "best_of": "33"}, "best_of"),
        ("/v1/chat/completions", {"model": "demo", "messages": CHAT, "n": 33.0}, "n"),
        ("/v1/chat/completions", {"model": "demo", "messages": CHAT, "n": 16384}, "n"),
        (
            "/v2/any-id/openai/v1/chat/completions",
            {"model": "demo", "messages": CHAT, "n": 40},
            "n",
        ),
        ("/invocations", {"messages": CHAT, "n": 33}, "n"),
        ("/invocations", {"prompt": "x", "best_of": 33}, "best_of"),
    ],
)
def test_n_above_max_n_is_a_400_naming_the_field(http, path, body, param) -> None:
    error = refused(http.post(path, json=body), param)
    assert "MAX_N" in error["message"] and f"at most {MAX_N}" in error["message"]


def test_tgi_parameters_cannot_ask_for_more_sequences(http) -> None:
    answer = http.post("/invocations", json={"inputs": "x", "parameters": {"best_of": 33}})
    refused(answer, "parameters.best_of")


@pytest.mark.parametrize(
    ("path", "job", "param"),
    [
        ("/run", {"prompt": "x", "sampling_params": {"n": 33}}, "input.sampling_params.n"),
        (
            "/runsync",
            {"openai_route": "/v1/completions", "openai_input": {"prompt": "x", "n": 33}},
            "input.openai_input.n",
        ),
        (
            "/v2/any-id/run",
            {
                "openai_route": "/v1/chat/completions",
                "openai_input": {"messages": CHAT, "best_of": 64},
            },
            "input.openai_input.best_of",
        ),
    ],
)
def test_jobs_above_max_n_are_a_400_naming_the_field(http, path, job, param) -> None:
    answer = http.post(path, json={"input": job})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and "MAX_N" in error["message"]


def test_n_of_max_n_is_served(http) -> None:
    answer = http.post(
        "/v1/completions", json={"model": "demo", "prompt": "x", "n": MAX_N, "max_tokens": 2}
    )
    assert answer.status_code == 200 and len(answer.json()["choices"]) == MAX_N
    job = http.post(
        "/runsync",
        json={"input": {"prompt": "x", "sampling_params": {"n": MAX_N, "max_tokens": 2}}},
    ).json()
    assert job["status"] == "COMPLETED" and len(job["output"][0]["choices"]) == MAX_N


def _stream(url: str, body: dict, first: concurrent.futures.Future, done: threading.Event):
    """Stream a completion; ``first`` gets the status once the first token (or an error)
    arrives; returns (status, completion tokens in the final usage)."""
    tokens = 0
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=180) as response:
            if response.status_code != 200:
                first.set_result(response.status_code)
                return response.status_code, 0
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    if not first.done():
                        first.set_result(200)
                    usage = json.loads(line[6:]).get("usage")
                    if usage:
                        tokens = usage["completion_tokens"]
            return 200, tokens
    finally:
        done.set()
        if not first.done():
            first.set_result(None)


def test_a_max_n_request_holds_max_n_sequences(server, http) -> None:
    rejected_before = _rejected(http)
    # A MAX_N stream whose client does not read holds its 32 slots until it is read (HeldStream):
    # what follows cannot race the engine finishing it.
    heavy = HeldStream(server.url, n=MAX_N, max_tokens=500)
    assert heavy.status == 200
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        # 3 more sequences exceed the 2 that may wait, so this is refused at once (counted as
        # 1 request, it would have been admitted beside it).
        busy = http.post(
            "/v1/completions", json={"model": "demo", "prompt": "x", "n": 3, "max_tokens": 1}
        )
        assert busy.status_code == 429, busy.text
        assert busy.json()["error"]["type"] == "RateLimitError"
        assert f"{MAX_N} sequences running" in busy.json()["error"]["message"]
        # A small request waits for a slot, then runs.
        small_first, small_done = concurrent.futures.Future(), threading.Event()
        small = pool.submit(
            _stream, server.url, {**HEAVY, "n": 1, "max_tokens": 2}, small_first, small_done
        )
        assert heavy.finish() == MAX_N * 500
        assert small.result(180) == (200, 2)
    assert _rejected(http) >= rejected_before + 1
    assert metric(http, "llmendpoints_requests_in_flight") == 0


def _rejected(http: httpx.Client) -> float:
    for line in http.get("/metrics").text.splitlines():
        if line.startswith('llmendpoints_requests_rejected_total{reason="queue_full"}'):
            return float(line.split()[1])
    return 0.0


def _status(http: httpx.Client, job_id: str) -> str:
    return http.get(f"/status/{job_id}").json()["status"]


FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMED_OUT"}


def _wait_status(http: httpx.Client, job_id: str, wanted: set[str], timeout: float = 120) -> str:
    """The job's status once it is one of ``wanted`` or final."""
    deadline = time.monotonic() + timeout
    while (status := _status(http, job_id)) not in wanted | FINAL:
        assert time.monotonic() < deadline, f"job {job_id} stayed {status}"
        time.sleep(0.05)
    return status


def test_jobs_count_their_sequences(http) -> None:
    """Each heavy job holds all 32 slots: the second starts when the first ends, the small one
    when both have (FIFO); counted as 1 each, all three would run at once. Decided from the
    jobs' own times (delayTime: submitted -> started; executionTime: started -> finished), so
    no reading can race the engine."""
    long_job = {
        "prompt": "hi",
        "sampling_params": {"n": MAX_N, "max_tokens": 2000, "ignore_eos": True},
    }
    small_job = {"prompt": "x", "sampling_params": {"max_tokens": 1}}
    began = time.monotonic()
    ids = [http.post("/run", json={"input": job}).json()["id"] for job in (long_job, long_job)]
    ids.append(http.post("/run", json={"input": small_job}).json()["id"])
    # The submissions' spread bounds how much later one was submitted than another.
    spread_ms = (time.monotonic() - began) * 1000
    for job_id in ids:
        assert _wait_status(http, job_id, set(), timeout=300) == "COMPLETED"
    first, second, small = (http.get(f"/status/{job_id}").json() for job_id in ids)

    def ended(job: dict) -> float:  # ms after its submission
        return job["delayTime"] + job["executionTime"]

    assert first["executionTime"] > 10 * spread_ms, "the heavy job was too short: inconclusive"
    # started after the other ended (submitted at most spread_ms later than it)
    assert second["delayTime"] + spread_ms >= ended(first), (first, second)
    assert small["delayTime"] + spread_ms >= ended(second), (second, small)


@pytest.mark.parametrize(
    ("policy", "param", "words"),
    [
        ({"ttl": 9999}, "policy.ttl", "between 10000 and 3600000"),
        ({"ttl": 3600001}, "policy.ttl", "MAX_JOB_TTL_MS"),
        ({"ttl": 10**12}, "policy.ttl", "between"),
        ({"executionTimeout": 4999}, "policy.executionTimeout", "between 5000"),
        ({"executionTimeout": 10**12}, "policy.executionTimeout", "7 days"),
    ],
)
def test_policy_outside_its_range_is_a_400_naming_the_field(http, policy, param, words) -> None:
    for path in ("/run", "/runsync"):
        answer = http.post(path, json={"input": {"prompt": "x"}, "policy": policy})
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert error["param"] == param and words in error["message"]


def test_unknown_message_fields_are_refused(http) -> None:
    messages = [{"role": "user", "content": "hi", "padding": "x" * 1000}]
    answer = http.post("/run", json={"input": {"messages": messages}})
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == "input.messages[0].padding"


def test_a_finished_job_keeps_its_output_not_its_input(http) -> None:
    prompt = "hello " * 60  # 360 bytes: within the 512-token context whatever the tokens
    before = metric(http, "llmendpoints_job_store_bytes")
    done = http.post(
        "/runsync", json={"input": {"prompt": prompt, "sampling_params": {"max_tokens": 1}}}
    ).json()
    assert done["status"] == "COMPLETED"
    kept = metric(http, "llmendpoints_job_store_bytes") - before
    assert 0 < kept < len(prompt)  # the result and the request's policy, not the prompt
    # A FAILED job (its prompt is longer than the context) keeps its input for /retry.
    too_long = "hello " * 3000  # at least 3,000 tokens: beyond MAX_MODEL_LEN 2048
    before = metric(http, "llmendpoints_job_store_bytes")
    failed = http.post(
        "/runsync", json={"input": {"prompt": too_long, "sampling_params": {"max_tokens": 1}}}
    ).json()
    assert failed["status"] == "FAILED"
    assert metric(http, "llmendpoints_job_store_bytes") - before > len(too_long)
