"""Keys, limits and metering with the real engine: two gateway processes sharing one real
nats-server in front of one real runtime (vLLM CPU, demo model), which also takes the
endpoint's jobs from the queue. One runtime for the whole module.

What only the engine can show: the tokens the gateways count are the engine's own
(``vllm:prompt_tokens_total`` / ``vllm:generation_tokens_total`` on the runtime), for streams
too (the usage chunk asked for upstream and taken out of the client's stream), and for jobs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import yaml
from held_stream import HeldStream
from integration.nats_kit import nats_server
from runtime_process import RuntimeServer

from .harness import key_counting_gateways, launch_runtime

pytestmark = pytest.mark.engine

KEYS = [
    {"name": "meter", "key": "sk-meter"},
    {"name": "rpm", "key": "sk-rpm", "limits": {"requestsPerMinute": 3}},
    {"name": "conc", "key": "sk-conc", "limits": {"maxConcurrent": 1}},
    {"name": "gone", "key": "sk-gone"},
]


@pytest.fixture(scope="module")
def demo_model(tmp_path_factory) -> Path:
    from llmendpoints_runtime.demo import write_demo_model

    return write_demo_model(tmp_path_factory.mktemp("demo-model"))


@pytest.fixture(scope="module")
def logs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("quota-runtime-logs")


@pytest.fixture(scope="module")
def queue_url():
    with nats_server() as url:
        yield url


@pytest.fixture(scope="module")
def runtime(demo_model, logs, queue_url):
    proc = launch_runtime(
        demo_model,
        logs,
        SERVED_MODEL_NAME="demo",
        JOBS_QUEUE_URL=queue_url,
        ENDPOINT_ID="demo",
        MAX_MODEL_LEN="2048",  # room for HeldStream
    )
    try:
        # Engine start-up: 25-90 s on a quiet 2-core machine, minutes on a busy one.
        proc.wait_http("/ready?strict=1", timeout=900)
        yield proc
    finally:
        proc.stop()


def _write(path: Path, runtime: RuntimeServer, keys: list[dict]) -> None:
    document = {
        "endpoints": [{"name": "demo", "models": ["demo"], "backends": [runtime.url]}],
        "apiKeys": keys,
    }
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(document))
    tmp.replace(path)


@pytest.fixture(scope="module")
def endpoints_file(logs, runtime) -> Path:
    path = logs / "endpoints.yaml"
    _write(path, runtime, KEYS)
    return path


@pytest.fixture(scope="module")
def gateways(logs, endpoints_file, queue_url):
    def ready(gw) -> bool:
        models = httpx.get(gw.url + "/v1/models", headers=_auth("meter")).json()["data"]
        return [m["ready_replicas"] for m in models] == [1]

    with key_counting_gateways(
        logs, endpoints_file, queue_url, ready, "the runtime ready behind both gateways", 60
    ) as procs:
        yield procs


def _auth(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer sk-{name}"}


def _until(condition, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for: {what}"
        time.sleep(0.05)


def _until_read(read, want, timeout: float) -> None:
    """Until ``read()`` returns ``want``; on timeout the assertion shows the last value read."""
    deadline = time.monotonic() + timeout
    while (got := read()) != want:
        assert time.monotonic() < deadline, f"timed out: read {got}, want {want}"
        time.sleep(0.05)


def _metric(metrics_url: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in httpx.get(metrics_url, timeout=10).text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _engine_tokens(runtime: RuntimeServer) -> tuple[float, float]:
    return (
        _metric(runtime.url + "/metrics", "vllm:prompt_tokens_total"),
        _metric(runtime.url + "/metrics", "vllm:generation_tokens_total"),
    )


def _gateway_tokens(gateways, key: str) -> tuple[float, float]:
    return tuple(
        sum(
            _metric(gw.metrics_url, "llmendpoints_gateway_key_tokens_total", key=key, kind=kind)
            for gw in gateways
        )
        for kind in ("prompt", "completion")
    )


def _fresh_window(margin: float = 25.0) -> None:
    left = 60 - time.time() % 60
    if left < margin:
        time.sleep(left + 0.2)


def test_the_tokens_counted_are_the_engines_own_for_answers_streams_and_jobs(gateways, runtime):
    engine_before = _engine_tokens(runtime)
    clients = [
        openai.OpenAI(base_url=gw.url + "/v1", api_key="sk-meter", max_retries=0, timeout=300)
        for gw in gateways
    ]
    messages = [{"role": "user", "content": "Count the tokens of this request, please."}]
    reply = clients[0].chat.completions.create(model="demo", messages=messages, max_tokens=7)
    seen = [reply.usage.prompt_tokens, reply.usage.completion_tokens]
    completion = clients[1].completions.create(model="demo", prompt="Once upon", max_tokens=5)
    seen[0] += completion.usage.prompt_tokens
    seen[1] += completion.usage.completion_tokens
    # A stream whose client did not ask for usage: none reaches the client, yet it is counted.
    chunks = list(
        clients[1].chat.completions.create(
            model="demo",
            messages=messages,
            max_tokens=6,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    assert chunks and all(c.usage is None for c in chunks) and all(c.choices for c in chunks)
    # One that asked gets the usage chunk, as from vLLM.
    asked = list(
        clients[0].completions.create(
            model="demo",
            prompt="A story",
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert asked[-1].choices == [] and asked[-1].usage.completion_tokens == 4
    # A job through the shared queue, run by the runtime, returned by /runsync.
    job = httpx.post(
        gateways[0].url + "/v2/demo/runsync",
        json={"input": {"prompt": "Hello", "sampling_params": {"max_tokens": 3}}},
        headers=_auth("meter"),
        timeout=300,
    ).json()
    assert job["status"] == "COMPLETED", job
    job_usage = job["output"][-1]["usage"]

    engine_after = _engine_tokens(runtime)
    engine = (engine_after[0] - engine_before[0], engine_after[1] - engine_before[1])
    # The job's tokens are counted when its record is seen completed.
    _until_read(lambda: _gateway_tokens(gateways, "meter"), engine, timeout=180)
    assert engine[1] == seen[1] + 6 + 4 + job_usage["output"]
    assert engine[0] > seen[0] + job_usage["input"]  # plus the two streams' prompts
    # Five answers, all 200 -- the two streams too, which the SDK closed at [DONE], before the
    # body's end (a loaded run counted only 4 of 5 as 200: such a stream was then counted 499,
    # test_gateway_behaviour.py reproduces it). A request is counted as its handler ends, just
    # after the client has its answer: read as a scrape would, not in the same instant; a
    # failure shows every code counted.
    _until_read(lambda: _key_requests(gateways, "meter"), {"200": 5}, timeout=30)


def _key_requests(gateways, key: str) -> dict[str, float]:
    """The gateways' llmendpoints_gateway_key_requests_total for ``key``, by status code."""
    codes: dict[str, float] = {}
    for gw in gateways:
        for line in httpx.get(gw.metrics_url, timeout=10).text.splitlines():
            if (
                line.startswith("llmendpoints_gateway_key_requests_total{")
                and f'key="{key}"' in line
            ):
                code = line.split('code="', 1)[1].split('"', 1)[0]
                codes[code] = codes.get(code, 0) + float(line.rsplit(" ", 1)[1])
    return {code: n for code, n in codes.items() if n}


def test_limits_hold_across_both_gateways_in_front_of_the_engine(gateways):
    _fresh_window()
    body = {"model": "demo", "prompt": "Hi", "max_tokens": 2, "ignore_eos": True}
    answers = [
        httpx.post(
            gateways[i % 2].url + "/v1/completions", json=body, headers=_auth("rpm"), timeout=300
        )
        for i in range(4)
    ]
    assert [a.status_code for a in answers] == [200, 200, 200, 429]
    refused = answers[-1]
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert "'rpm'" in refused.json()["error"]["message"] and "sk-rpm" not in refused.text
    assert int(refused.headers["retry-after"]) >= 1
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    assert [a.headers["x-ratelimit-remaining-requests"] for a in answers[:3]] == ["2", "1", "0"]

    # maxConcurrent 1: while one stream holds the key's only slot (its client has not read it
    # yet), a stream to either gateway is refused; once it is read, the next one runs.
    held = HeldStream(gateways[0].url, _auth("conc"))
    assert held.status == 200
    short = {"model": "demo", "prompt": "Go", "max_tokens": 2, "ignore_eos": True}
    for gateway in gateways:
        refused = httpx.post(
            gateway.url + "/v1/completions", json=short, headers=_auth("conc"), timeout=300
        )
        assert refused.status_code == 429, refused.text
        assert "maxConcurrent" in refused.json()["error"]["message"]
    assert held.finish() == HeldStream.TOKENS
    # The slot is given back by a NATS write just after the stream's last byte (docs/gateway.md):
    # the next request runs once that write is seen, as a client honouring Retry-After finds.
    deadline = time.monotonic() + 10
    while True:
        after = httpx.post(
            gateways[1].url + "/v1/completions", json=short, headers=_auth("conc"), timeout=300
        )
        if after.status_code != 429 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert after.status_code == 200, after.text


def test_the_export_lists_what_was_served(gateways, queue_url):
    env = {**os.environ, "JOBS_QUEUE_URL": queue_url}

    def rows() -> list[dict]:
        done = subprocess.run(
            [
                sys.executable, "-m", "llmendpoints_gateway", "usage",
                "--since", "2020-01-01T00:00:00Z", "--format", "json",
            ],
            env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    prompt, completion = _gateway_tokens(gateways, "meter")
    _until(
        lambda: any(r["key"] == "meter" and r["completion_tokens"] == completion for r in rows()),
        "the usage records",
    )
    (meter,) = [r for r in rows() if r["key"] == "meter"]
    assert meter == {
        "key": "meter",
        "endpoint": "default/demo",  # usage is the endpoint's: namespace and name
        "model": "demo",
        "requests": 5,  # 4 OpenAI requests and 1 job
        "prompt_tokens": prompt,
        "completion_tokens": completion,
    }
    (rpm,) = [r for r in rows() if r["key"] == "rpm"]
    assert rpm["requests"] == 3 and rpm["completion_tokens"] == 6


def test_a_revoked_key_stops_on_both_gateways_within_5_s(gateways, endpoints_file, runtime):
    body = {"model": "demo", "prompt": "Hi", "max_tokens": 1}
    for gw in gateways:
        assert (
            httpx.post(
                gw.url + "/v1/completions", json=body, headers=_auth("gone"), timeout=300
            ).status_code
            == 200
        )
    _write(endpoints_file, runtime, [k for k in KEYS if k["name"] != "gone"])
    revoked_at = time.monotonic()
    for gw in gateways:
        _until(
            lambda gw=gw: (
                httpx.post(
                    gw.url + "/v1/completions", json=body, headers=_auth("gone"), timeout=300
                ).status_code
                == 401
            ),
            "the revoked key refused",
            timeout=max(0.1, revoked_at + 5.0 - time.monotonic()),
        )
