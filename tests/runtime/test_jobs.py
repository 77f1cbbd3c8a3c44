"""The job API end to end: the real runtime (subprocess, real vLLM on the demo model), the real
`runpod` SDK pointed at it through RUNPOD_ENDPOINT_BASE_URL, the real `openai` SDK through
/v2/{endpoint_id}/openai/v1. One server for the whole module.

The server runs with small, non-default limits so that the environment knobs are proven to
work: MAX_N=1024 (SLOW), MAX_CONCURRENCY=32 (two LONG jobs' sequences: admission counts
sequences), MAX_QUEUE_LENGTH=4, DEFAULT_MAX_TOKENS=24, batches 2, 4, 8, 8, ...
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from proc_kit import engines_frozen
from runtime_process import RuntimeServer, running_runtime

pytestmark = pytest.mark.engine

API_KEY = "jobs-e2e-key"
ENDPOINT_ID = "ep-e2e"
# Long enough (several seconds on two cores, with MAX_MODEL_LEN 2048) to be caught running,
# queued, cancelled.
LONG = {"prompt": "hi", "sampling_params": {"max_tokens": 2000, "ignore_eos": True, "n": 16}}
# Runs well past RunPod's shortest executionTimeout (5 s): 1,024 x 480 tokens, in several
# waves of the engine's batch (the demo model does 256 x 480 in under 5 s).
SLOW = {"prompt": "hi", "sampling_params": {"max_tokens": 480, "ignore_eos": True, "n": 1024}}


@pytest.fixture(scope="module")
def server(demo_model, runtime_logs) -> Iterator[RuntimeServer]:
    with running_runtime(
        demo_model,
        runtime_logs,
        API_KEYS=API_KEY,
        MAX_MODEL_LEN="2048",
        MAX_N="1024",
        MAX_CONCURRENCY="32",
        MAX_QUEUE_LENGTH="4",
        DEFAULT_MAX_TOKENS="24",
        DEFAULT_BATCH_SIZE="8",
        DEFAULT_MIN_BATCH_SIZE="2",
        DEFAULT_BATCH_SIZE_GROWTH_FACTOR="2",
        MAX_REQUEST_BODY_BYTES="65536",
        MAX_RUNSYNC_BODY_BYTES="65536",
        # Room for the shutdown test's webhook retry (10 s after a failed first delivery).
        DRAIN_TIMEOUT_SECONDS="90",
    ) as running:
        yield running


@pytest.fixture(scope="module")
def http(server) -> Iterator[httpx.Client]:
    with server.client(headers={"Authorization": f"Bearer {API_KEY}"}) as client:
        yield client


@pytest.fixture(scope="module")
def endpoint(server):
    """runpod.Endpoint, configured the way a user does: the base URL from the environment."""
    os.environ["RUNPOD_ENDPOINT_BASE_URL"] = f"{server.url}/v2"
    import runpod

    # runpod reads the variable when it is first imported; a module imported earlier in this
    # process is pointed at the same value.
    runpod.endpoint_url_base = os.environ["RUNPOD_ENDPOINT_BASE_URL"]
    runpod.api_key = API_KEY
    return runpod.Endpoint(ENDPOINT_ID)


def wait_final(http: httpx.Client, job_id: str, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        body = http.get(f"/status/{job_id}").json()
        if body["status"] in {"COMPLETED", "FAILED", "CANCELLED", "TIMED_OUT"}:
            return body
        time.sleep(0.1)
    raise TimeoutError(f"job {job_id} did not finish: {body}")


def wait_for(predicate, timeout: float = 60, describe=lambda: "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"condition not reached; {describe()}")
        time.sleep(0.05)


def assert_batches_follow(batches: list[dict], schedule: list[int], total: int) -> None:
    """Batch i holds schedule[i] tokens. vLLM merges engine steps when its reader lags, so a
    batch may run past its size (then there are fewer batches) but never ends short of it."""
    outputs = [b["usage"]["output"] for b in batches]
    sizes = [b - a for a, b in zip([0, *outputs], outputs, strict=False)]
    assert sum(sizes) == total and all(size > 0 for size in sizes)
    assert len(sizes) <= len(schedule)
    assert all(size >= target for size, target in zip(sizes[:-1], schedule, strict=False))
    for batch, size in zip(batches, sizes, strict=True):
        assert 1 <= len(batch["choices"][0]["tokens"]) <= size  # one text piece per step


def health(http: httpx.Client) -> dict:
    return http.get(f"/v2/{ENDPOINT_ID}/health").json()


def test_run_sync_with_the_runpod_sdk(endpoint) -> None:
    output = endpoint.run_sync(
        {
            "input": {
                "prompt": "The capital of France is",
                "sampling_params": {"max_tokens": 5, "ignore_eos": True},
            }
        },
        timeout=120,
    )
    assert isinstance(output, list) and len(output) == 1
    (batch,) = output
    assert set(batch) == {"choices", "usage"}
    assert len(batch["choices"]) == 1 and len(batch["choices"][0]["tokens"]) == 1
    assert isinstance(batch["choices"][0]["tokens"][0], str)
    assert batch["usage"]["output"] == 5 and batch["usage"]["input"] > 0


def test_messages_jobs_use_the_chat_template(endpoint) -> None:
    output = endpoint.run_sync(
        {
            "input": {
                "messages": [
                    {"role": "system", "content": "You are a helpful assistant."},
                    {"role": "user", "content": "What is the capital of France?"},
                ],
                "sampling_params": {"max_tokens": 3, "ignore_eos": True, "n": 2},
            }
        },
        timeout=120,
    )
    assert len(output[0]["choices"]) == 2
    # the chat template adds its role markers: more prompt tokens than the words alone
    assert output[0]["usage"]["input"] > 12 and output[0]["usage"]["output"] == 6


def test_apply_chat_template_wraps_the_prompt_as_a_user_message(http) -> None:
    def input_tokens(apply: bool) -> int:
        job = {
            "prompt": "What is the capital of France?",
            "apply_chat_template": apply,
            "sampling_params": {"max_tokens": 1},
        }
        return http.post("/runsync", json={"input": job}).json()["output"][0]["usage"]["input"]

    assert input_tokens(True) > input_tokens(False)


def test_bare_prompt_gets_default_max_tokens(http) -> None:
    body = http.post(
        "/runsync", json={"input": {"prompt": "hi", "sampling_params": {"ignore_eos": True}}}
    ).json()
    assert body["status"] == "COMPLETED"
    assert body["output"][0]["usage"]["output"] == 24  # DEFAULT_MAX_TOKENS, not vLLM's 16


def test_run_status_and_stream_with_the_runpod_sdk(endpoint, http) -> None:
    request = {
        "prompt": "Once upon a time",
        "stream": True,
        "sampling_params": {"max_tokens": 30, "ignore_eos": True, "temperature": 0},
    }
    job = endpoint.run({"input": request})
    assert job.status() in {"IN_QUEUE", "IN_PROGRESS", "COMPLETED"}
    chunks = list(job.stream())
    # DEFAULT_MIN_BATCH_SIZE=2, growth 2, DEFAULT_BATCH_SIZE=8: 2, 4, 8, 8, then the rest (8)
    assert_batches_follow(chunks, [2, 4, 8, 8, 8], total=30)
    assert job.status() == "COMPLETED"
    assert job.output() == chunks  # a streamed job's output is the list of its batches
    streamed_text = "".join(t for c in chunks for t in c["choices"][0]["tokens"])
    plain = http.post("/runsync", json={"input": {**request, "stream": False}}).json()
    assert plain["output"][0]["choices"][0]["tokens"] == [streamed_text]  # greedy: same text


def test_per_request_batch_sizes_override_the_environment(http) -> None:
    job = http.post(
        "/run",
        json={
            "input": {
                "prompt": "x",
                "stream": True,
                "max_batch_size": 3,
                "min_batch_size": 1,
                "batch_size_growth_factor": 3,
                "sampling_params": {"max_tokens": 10, "ignore_eos": True},
            }
        },
    ).json()
    final = wait_final(http, job["id"])
    assert_batches_follow(final["output"], [1, 3, 3, 3], total=10)
    stream = http.get(f"/stream/{job['id']}").json()
    assert stream["status"] == "COMPLETED" and stream["stream"] == [
        {"output": c} for c in final["output"]
    ]
    assert http.get(f"/stream/{job['id']}").json()["stream"] == []  # already drained


def test_cancel_aborts_the_engine_request(server, endpoint, http) -> None:
    with engines_frozen(server.process.pid):  # the job stays running until cancelled
        job = endpoint.run({"input": LONG})
        wait_for(
            lambda: job.status() == "IN_PROGRESS" and health(http)["engine"]["running"] >= 1,
            describe=lambda: f"job {job.status()}, {health(http)}",
        )
        assert job.cancel() == {"id": job.job_id, "status": "CANCELLED"}
        # the abort happened before /cancel answered: nothing runs in the engine any more
        assert health(http)["engine"]["running"] == 0
    assert job.status() == "CANCELLED"
    answer = http.post(f"/cancel/{job.job_id}")
    assert answer.status_code == 409 and "CANCELLED" in answer.json()["error"]["message"]


def test_queue_limit_purge_and_queue_depth(server, endpoint, http) -> None:
    with engines_frozen(server.process.pid):  # the two running jobs stay running
        running = [http.post("/run", json={"input": LONG}).json()["id"] for _ in range(2)]
        wait_for(lambda: health(http)["jobs"]["inProgress"] == 2)
        queued = [http.post("/run", json={"input": LONG}).json()["id"] for _ in range(4)]
        refused = http.post("/run", json={"input": LONG})
        assert refused.status_code == 429 and refused.json()["error"]["type"] == "RateLimitError"
        assert health(http)["jobs"]["inQueue"] == 4
        metrics = http.get("/metrics").text
        depth = next(
            line for line in metrics.splitlines() if line.startswith("llmendpoints_queue_depth ")
        )
        assert float(depth.split()[1]) >= 4
        assert endpoint.purge_queue() == {"removed": 4, "status": "completed"}
        assert [http.get(f"/status/{i}").json()["status"] for i in queued] == ["CANCELLED"] * 4
        cancelled = next(
            line
            for line in http.get("/metrics").text.splitlines()
            if line.startswith('llmendpoints_jobs_finished_total{status="CANCELLED"}')
        )
        assert float(cancelled.split()[1]) >= 4
        for job_id in running:
            http.post(f"/cancel/{job_id}")
        stats = endpoint.health()
        assert stats["jobs"]["inQueue"] == 0 and stats["jobs"]["inProgress"] == 0
        assert stats["workers"]["ready"] == 1


def test_execution_timeout_and_retry(http) -> None:
    # RunPod's shortest executionTimeout, 5 s: SLOW runs longer.
    job = http.post("/run", json={"input": SLOW, "policy": {"executionTimeout": 5000}}).json()
    final = wait_final(http, job["id"])
    assert final["status"] == "TIMED_OUT" and "output" not in final
    assert (
        final["error"]["type"] == "RequestTimeoutError" and "5000 ms" in final["error"]["message"]
    )
    assert health(http)["engine"]["running"] == 0
    retried_before = health(http)["jobs"]["retried"]
    again = http.post(f"/retry/{job['id']}").json()
    assert again == {"id": job["id"], "status": "IN_QUEUE"}
    assert wait_final(http, job["id"])["status"] == "TIMED_OUT"
    assert health(http)["jobs"]["retried"] == retried_before + 1
    done = http.post(
        "/runsync", json={"input": {"prompt": "x", "sampling_params": {"max_tokens": 1}}}
    ).json()
    answer = http.post(f"/retry/{done['id']}")
    assert (
        answer.status_code == 409
        and "only FAILED or TIMED_OUT" in answer.json()["error"]["message"]
    )


def test_engine_side_failure_is_failed_with_a_json_error(http) -> None:
    too_long = "hello " * 4000  # far beyond MAX_MODEL_LEN=2048
    body = http.post(
        "/runsync", json={"input": {"prompt": too_long, "sampling_params": {"max_tokens": 5}}}
    ).json()
    assert body["status"] == "FAILED" and "output" not in body
    assert set(body["error"]) >= {"message", "type"}
    assert "2048" in body["error"]["message"]  # says what the limit is


def test_results_expire_at_the_end_of_their_ttl(http) -> None:
    # RunPod's shortest ttl, 10 s from submission (a /runsync result is kept 1 min otherwise).
    body = http.post(
        "/runsync",
        json={
            "input": {"prompt": "x", "sampling_params": {"max_tokens": 1}},
            "policy": {"ttl": 10000},
        },
    ).json()
    assert http.get(f"/status/{body['id']}").status_code == 200
    deadline = time.monotonic() + 60
    while (gone := http.get(f"/status/{body['id']}")).status_code == 200:
        assert time.monotonic() < deadline, "the result outlived its ttl"
        time.sleep(0.5)
    assert gone.status_code == 404 and "expired" in gone.json()["error"]["message"]


class _Receiver(BaseHTTPRequestHandler):
    received: list[dict] = []

    def do_POST(self) -> None:
        length = int(self.headers["content-length"])
        self.received.append(json.loads(self.rfile.read(length)))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


def test_webhook_receives_the_final_status(http) -> None:
    receiver = ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    thread = threading.Thread(target=receiver.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{receiver.server_port}/hook"
        job = http.post(
            "/run",
            json={"input": {"prompt": "x", "sampling_params": {"max_tokens": 3}}, "webhook": url},
        ).json()
        final = wait_final(http, job["id"])
        wait_for(lambda: _Receiver.received, timeout=30)
        assert _Receiver.received[0] == final
    finally:
        receiver.shutdown()


def test_openai_route_jobs(http) -> None:
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    body = http.post(
        "/runsync", json={"input": {"openai_route": "/v1/chat/completions", "openai_input": chat}}
    ).json()
    assert body["status"] == "COMPLETED" and body["output"]["object"] == "chat.completion"
    models = http.post("/runsync", json={"input": {"openai_route": "/v1/models"}}).json()
    assert [m["id"] for m in models["output"]["data"]] == ["demo"]
    streamed = http.post(
        "/runsync",
        json={
            "input": {
                "openai_route": "/v1/completions",
                "openai_input": {"prompt": "hi", "max_tokens": 12, "stream": True},
            }
        },
    ).json()
    chunks = streamed["output"]
    assert all(isinstance(c, str) and c.startswith("data: ") and c.endswith("\n\n") for c in chunks)
    assert chunks[-1].endswith("data: [DONE]\n\n")
    events = [e for c in chunks for e in c.split("\n\n") if e]
    assert all(json.loads(e.removeprefix("data: ")) for e in events[:-1])  # every event whole
    assert [c.count("data: ") for c in chunks][:2] == [2, 4]  # batches of events grow too


def test_openai_sdk_through_the_v2_alias(server) -> None:
    from openai import OpenAI

    client = OpenAI(api_key=API_KEY, base_url=f"{server.url}/v2/{ENDPOINT_ID}/openai/v1")
    assert [m.id for m in client.models.list()] == ["demo"]
    chat = client.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert chat.choices[0].message.content is not None and chat.usage.completion_tokens <= 4
    stream = client.completions.create(
        model="demo", prompt="hi", max_tokens=6, stream=True, extra_body={"ignore_eos": True}
    )
    assert sum(1 for chunk in stream if chunk.choices and chunk.choices[0].text is not None) >= 1


BAD_INPUTS = [
    (b"{not json", 400, "not valid JSON"),
    (b'["input"]', 400, "JSON object"),
    (b'{"prompt": "hi"}', 400, "input"),
    (b'{"input": "hi"}', 400, "input: must be a JSON object"),
    (b'{"input": {"sampling_params": {"max_tokens": 5}}}', 400, "needs prompt"),
    (b'{"input": {"prompt": 5}}', 400, "input.prompt"),
    (b'{"input": {"messages": "x"}}', 400, "input.messages"),
    (
        b'{"input": {"prompt": "x", "sampling_params": {"max_tokens": 0}}}',
        400,
        "max_tokens must be at least 1",
    ),
    (
        b'{"input": {"prompt": "x", "sampling_params": {"max_tokens": -5}}}',
        400,
        "max_tokens must be at least 1",
    ),
    (
        b'{"input": {"prompt": "x", "sampling_params": {"temprature": 0.5}}}',
        400,
        "input.sampling_params.temprature",
    ),
    (b'{"input": {"prompt": "x", "sampling_params": {"top_p": 7}}}', 400, "top_p"),
    (
        b'{"input": {"openai_route": "/v1/completions", "openai_input": {"prompt": "x", "max_tokens": -1}}}',
        400,
        "input.openai_input.max_tokens",
    ),
    (b'{"input": {"prompt": "x"}, "policy": {"ttl": 0}}', 400, "policy.ttl"),
    (
        b'{"input": {"messages": [{"role": "user", "content": [{"type": "text", "text": "what is it?"}, '
        b'{"type": "image_url", "image_url": {"url": "https://example.com/x.jpg"}}]}]}}',
        400,
        "text-only and cannot take images (image content at input.messages[0].content[1])",
    ),
    (b'{"input": {"prompt": "caf\xe9"}}', 400, "UTF-8"),
    (b'{"input": {"prompt": "' + b"x" * 70_000 + b'"}}', 413, "limit"),
]


@pytest.mark.parametrize(("content", "status", "words"), BAD_INPUTS)
def test_bad_inputs_are_json_4xx_and_the_server_keeps_serving(http, content, status, words) -> None:
    for path in ("/run", f"/v2/{ENDPOINT_ID}/runsync"):
        answer = http.post(path, content=content, headers={"content-type": "application/json"})
        assert answer.status_code == status, answer.text
        error = answer.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
        assert words in error["message"]
        assert error["type"] == {400: "BadRequestError", 413: "ContentTooLargeError"}[status]
    good = http.post(
        "/runsync", json={"input": {"prompt": "x", "sampling_params": {"max_tokens": 1}}}
    )
    assert good.json()["status"] == "COMPLETED"


def test_unknown_job_ids_are_404(http) -> None:
    for method, path in [
        ("GET", "/status/nope"),
        ("GET", "/stream/nope"),
        ("POST", "/cancel/nope"),
        ("POST", "/retry/nope"),
    ]:
        answer = http.request(method, f"/v2/{ENDPOINT_ID}{path}")
        assert answer.status_code == 404 and answer.json()["error"]["type"] == "NotFoundError"


def test_the_job_api_needs_the_api_key(server) -> None:
    with server.client() as anonymous:
        answer = anonymous.post("/run", json={"input": {"prompt": "x"}})
        assert answer.status_code == 401 and "error" in answer.json()


class _FlakyReceiver(BaseHTTPRequestHandler):
    """Answers 500 to the first delivery of each job, 200 to the next; records every attempt."""

    attempts: list[tuple[int, dict]] = []

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        seen = any(b["id"] == body["id"] for _, b in self.attempts)
        status = 200 if seen else 500
        self.attempts.append((status, body))
        self.send_response(status)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


def test_sigterm_finishes_accepted_jobs_delivers_their_webhooks_and_refuses_new_ones(
    server, http
) -> None:
    """Last in the module: it stops the server.

    The job running at SIGTERM has a webhook whose first delivery gets a 500: the retry is due
    10 s after the job ends, when nothing else is left -- the pod must stay up to deliver it.
    """
    receiver = ThreadingHTTPServer(("127.0.0.1", 0), _FlakyReceiver)
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    result: dict = {}
    job = LONG
    webhook = f"http://127.0.0.1:{receiver.server_port}/hook"

    def runsync() -> None:
        with server.client(headers={"Authorization": f"Bearer {API_KEY}"}) as own:
            answer = own.post("/runsync", json={"input": job, "webhook": webhook})
            result.update(answer.json())

    try:
        with engines_frozen(server.process.pid):  # the job is surely running at SIGTERM
            thread = threading.Thread(target=runsync)
            thread.start()
            wait_for(
                lambda: health(http)["jobs"]["inProgress"] == 1,
                describe=lambda: f"{health(http)}",
            )
            server.process.send_signal(signal.SIGTERM)
            wait_for(lambda: http.get("/ready").status_code == 503)
            refused = http.post("/run", json={"input": {"prompt": "x"}})
            assert (
                refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
            )
        thread.join(120)
        assert result["status"] == "COMPLETED"  # the accepted job ran to the end
        sampling = LONG["sampling_params"]
        assert result["output"][0]["usage"]["output"] == sampling["max_tokens"] * sampling["n"]
        assert server.process.wait(60) == 0
    finally:
        receiver.shutdown()
    statuses = [(status, body["id"], body["status"]) for status, body in _FlakyReceiver.attempts]
    assert statuses == [(500, result["id"], "COMPLETED"), (200, result["id"], "COMPLETED")]
    assert "drained: nothing in flight" in server.log()
