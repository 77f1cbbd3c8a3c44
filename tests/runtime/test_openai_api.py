"""vLLM's OpenAI routes served by the runtime, through the real `openai` SDK, on the real engine;
and OpenAI's Batch API on one pod without the shared queue (the gateway's is
tests/gateway/test_batches.py)."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from runtime_process import check_model_server, free_port, runtime_env

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def client(runtime) -> openai.OpenAI:
    return openai.OpenAI(base_url=runtime.url + "/v1", api_key="unused", max_retries=0)


def test_answered_204_while_loading_then_200(runtime):
    assert 204 in runtime.statuses_before_ready
    assert httpx.get(runtime.url + "/ready").status_code == 200
    assert httpx.get(runtime.url + "/ready?strict=1").status_code == 200
    assert httpx.get(runtime.url + "/ping").status_code == 200
    assert httpx.post(runtime.url + "/ping").status_code == 200


def test_models(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["demo"]


def test_chat(client):
    reply = client.chat.completions.create(
        model="demo",
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hello!"},
        ],
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    choice = reply.choices[0]
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str) and choice.message.content
    assert choice.finish_reason == "length"
    assert reply.usage.completion_tokens == 8
    assert reply.usage.prompt_tokens > 5
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 8


def test_chat_streaming_with_usage(client):
    stream = client.chat.completions.create(
        model="demo",
        messages=[{"role": "user", "content": "Tell me a story."}],
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finishes == ["length"]
    assert text
    assert chunks[-1].usage.completion_tokens == 12


def test_completion_one_prompt(client):
    reply = client.completions.create(
        model="demo", prompt="The sky is", max_tokens=5, extra_body={"ignore_eos": True}
    )
    assert len(reply.choices) == 1
    assert reply.usage.completion_tokens == 5


def test_completion_several_prompts(client):
    prompts = ["The sky is", "Kubernetes schedules", "Hello"]
    reply = client.completions.create(
        model="demo", prompt=prompts, max_tokens=4, extra_body={"ignore_eos": True}
    )
    assert sorted(c.index for c in reply.choices) == [0, 1, 2]
    assert reply.usage.completion_tokens == 12


def test_completion_streaming(client):
    stream = client.completions.create(
        model="demo", prompt="Hello", max_tokens=6, stream=True, extra_body={"ignore_eos": True}
    )
    chunks = list(stream)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_request_id_is_echoed_generated_and_used_by_vllm(runtime):
    with runtime.client() as http:
        given = http.post(
            "/v1/completions",
            json={"model": "demo", "prompt": "Hi", "max_tokens": 2},
            headers={"x-request-id": "req-12345"},
        )
        assert given.headers["x-request-id"] == "req-12345"
        assert given.json()["id"] == "cmpl-req-12345"
        generated = http.get("/v1/models")
        assert len(generated.headers["x-request-id"]) >= 16
    assert "req-12345" in runtime.log()


@pytest.mark.parametrize(
    ("path", "body", "status", "fragment"),
    [
        ("/v1/completions", b"{not json", 400, "not valid JSON"),
        ("/v1/completions", b"[1, 2]", 400, "JSON object"),
        ("/v1/completions", b'"prompt"', 400, "JSON object"),
        ("/v1/completions", b'{"model": "demo", "prompt": "\xff\xfe"}', 400, "UTF-8"),
        ("/v1/completions", {"model": "demo", "prompt": 5}, 400, "prompt"),
        ("/v1/chat/completions", {"model": "demo", "messages": "x"}, 400, "messages"),
        ("/v1/completions", {"model": "demo", "prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
        ("/v1/completions", {"model": "demo", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        (
            "/v1/completions",
            {"model": "demo", "prompt": "x", "temperature": "hot"},
            400,
            "temperature",
        ),
        ("/v1/completions", {"model": "demo", "prompt": "x", "top_p": 7}, 400, "top_p"),
        ("/v1/completions", {"model": "demo", "prompt": "x", "n": 0}, 400, "n must be"),
        ("/v1/completions", {"model": "no-such-model", "prompt": "x"}, 404, "does not exist"),
        (
            "/v1/chat/completions",
            {"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]},
            404,
            "does not exist",
        ),
    ],
)
def test_bad_inputs_get_openai_errors_and_the_server_keeps_serving(
    runtime, client, path, body, status, fragment
):
    with runtime.client() as http:
        if isinstance(body, bytes):
            response = http.post(path, content=body, headers={"content-type": "application/json"})
        else:
            response = http.post(path, json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    assert error["code"] == status
    assert fragment in error["message"] or fragment == error["param"], error
    assert "Traceback" not in response.text
    # ...and the next good request still works.
    assert client.completions.create(model="demo", prompt="ok", max_tokens=1).choices


def test_openapi_has_vllms_operations_and_ours_with_their_statuses(runtime):
    doc = httpx.get(runtime.url + "/openapi.json").json()
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/models", "/run", "/invocations"):
        assert path in doc["paths"], path
    run = doc["paths"]["/run"]["post"]
    assert {"200", "400", "413", "429", "503"} <= set(run["responses"]) and "422" not in run[
        "responses"
    ]
    assert set(doc["paths"]["/status/{job_id}"]) == {"get", "post"}
    assert "404" in doc["paths"]["/status/{job_id}"]["get"]["responses"]
    assert "JobInput" in doc["components"]["schemas"]
    assert "ChatCompletionRequest" in doc["components"]["schemas"]


def test_metrics_expose_ours_and_vllms(runtime, client):
    client.completions.create(model="demo", prompt="count me", max_tokens=1)
    text = httpx.get(runtime.url + "/metrics").text
    for series in (
        "llmendpoints_queue_depth ",
        "llmendpoints_requests_in_flight ",
        "llmendpoints_engine_ready 1.0",
        'llmendpoints_startup_phase_seconds{phase="load"}',
        'llmendpoints_startup_phase_seconds{phase="ready"}',
        'llmendpoints_http_requests_total{code="200",method="POST",route="/v1/completions"}',
        "llmendpoints_http_request_duration_seconds_bucket",
        "vllm:num_requests_waiting",
        "vllm:generation_tokens_total",
    ):
        assert series in text, series


@pytest.fixture(scope="module")
def plain_vllm(demo_model, runtime_logs):
    """vLLM's own server on the same model and settings: the reference for byte compatibility."""
    port = free_port()
    env = runtime_env(demo_model, port)
    log = (runtime_logs / "plain-vllm.log").open("wb")
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(demo_model),
            "--served-model-name",
            "demo",
            "--max-model-len",
            "512",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        import time

        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            assert process.poll() is None, (runtime_logs / "plain-vllm.log").read_text()[-3000:]
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        yield url
    finally:
        process.terminate()
        process.wait(60)


def _normalised(payload: dict) -> dict:
    payload = json.loads(json.dumps(payload))
    for key in ("id", "created", "system_fingerprint"):
        payload.pop(key, None)
    return payload


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (
            "/v1/completions",
            {
                "model": "demo",
                "prompt": ["a", "bc"],
                "max_tokens": 6,
                "temperature": 0,
                "logprobs": 2,
            },
        ),
        (
            "/v1/chat/completions",
            {
                "model": "demo",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 6,
                "temperature": 0,
            },
        ),
        ("/v1/completions", {"model": "demo", "prompt": "x", "max_tokens": 0}),
    ],
)
def test_responses_match_vllms_own_server(runtime, plain_vllm, path, body):
    ours = httpx.post(runtime.url + path, json=body, timeout=60)
    theirs = httpx.post(plain_vllm + path, json=body, timeout=60)
    assert ours.status_code == theirs.status_code
    assert _normalised(ours.json()) == _normalised(theirs.json())
    assert ours.headers["content-type"] == theirs.headers["content-type"]


def test_the_pod_serves_what_an_endpoint_picker_reads(runtime):
    """`llmendpoints-runtime check-model-server` (docs/gateway-api.md) passes on a real pod: the
    queue and KV-cache gauges a Gateway API endpoint picker scores on, /v1/completions and
    /v1/chat/completions."""
    rows = check_model_server(runtime.url)
    assert {check: row.split()[1] for check, row in rows.items()} == {
        "/v1/models": "pass",
        "/v1/completions": "pass",
        "/v1/chat/completions": "pass",
        "vllm:num_requests_running": "pass",
        "vllm:num_requests_waiting": "pass",
        "vllm:kv_cache_usage_perc": "pass",
        "vllm:cache_config_info": "pass",
    }


def test_a_batch_on_one_pod_with_the_openai_sdk(client, runtime):
    """The same SDK calls as at the gateway: files and batches kept under the pod's batch
    folder, the requests run by this pod below interactive ones; every custom_id answered
    once, the request the engine refuses in the error file."""
    lines = [
        {
            "custom_id": f"req-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "demo",
                "messages": [{"role": "user", "content": f"say {i}"}],
                "max_tokens": 100_000 if i == 199 else 4,
            },
        }
        for i in range(200)
    ]
    data = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
    uploaded = client.files.create(file=("batch.jsonl", io.BytesIO(data)), purpose="batch")
    assert client.files.retrieve(uploaded.id).bytes == len(data)
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    assert batch.status == "validating"
    deadline = time.monotonic() + 600
    while (batch := client.batches.retrieve(batch.id)).status not in ("completed", "failed"):
        assert time.monotonic() < deadline, batch
        time.sleep(0.5)
    assert batch.status == "completed", batch
    assert (batch.request_counts.completed, batch.request_counts.failed) == (199, 1)
    out = [
        json.loads(line) for line in client.files.content(batch.output_file_id).text.splitlines()
    ]
    err = [json.loads(line) for line in client.files.content(batch.error_file_id).text.splitlines()]
    assert sorted(line["custom_id"] for line in out + err) == sorted(x["custom_id"] for x in lines)
    assert [line["custom_id"] for line in err] == ["req-199"]
    assert err[0]["response"]["status_code"] == 400
    assert batch.id in [b.id for b in client.batches.list().data]
    # Kept under LLMEP_BATCH_DIR (the model cache's by default), not in memory.
    folder = Path(runtime.env["LLMEP_BATCH_DIR"])
    assert uploaded.id in [p.name for p in folder.rglob("file-*")]
