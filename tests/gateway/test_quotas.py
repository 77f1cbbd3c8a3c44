"""Keys, limits and metering across two real gateway processes sharing one real nats-server,
in front of stand-in backends (bench/gateway_standin.py reports usage as vLLM does, and counts
what it reported, so metering is checked against the backend's own totals).
tests/gateway/test_quotas_runtime.py does the same in front of a real runtime (demo model).

The keys are the local form: ``apiKeys`` in GATEWAY_ENDPOINTS_FILE.
"""

from __future__ import annotations

import concurrent.futures
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
from integration.nats_kit import nats_server

from .harness import Process, key_counting_gateways, launch_standin

CHAT = "/v1/chat/completions"
RATE_HEADERS = (
    "x-ratelimit-limit-requests",
    "x-ratelimit-remaining-requests",
    "x-ratelimit-reset-requests",
    "x-ratelimit-limit-tokens",
    "x-ratelimit-remaining-tokens",
    "x-ratelimit-reset-tokens",
)

KEYS = {
    "rpm": {"key": "sk-rpm-1", "limits": {"requestsPerMinute": 5, "tokensPerMinute": 100000}},
    "tpm": {"key": "sk-tpm-1", "limits": {"tokensPerMinute": 40}},
    "tpm-local": {
        "key": "sk-tpm-local-1",
        "limits": {"requestsPerMinute": 10_000, "tokensPerMinute": 1_000_000},
    },
    "conc": {"key": "sk-conc-1", "limits": {"maxConcurrent": 2}},
    "jobs": {"key": "sk-jobs-1", "limits": {"requestsPerMinute": 3}},
    "retry": {"key": "sk-retry-1", "limits": {"requestsPerMinute": 3}},
    "meter": {"key": "sk-meter-1", "endpoints": ["metered", "fragile"]},
    "revoked": {"key": "sk-revoked-1", "endpoints": ["demo"]},
    "demo-only": {"key": "sk-demo-only-1", "endpoints": ["demo"]},
}


def chat(model: str = "demo", text: str = "one two three", **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": text}], **extra}


def _auth(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[name]['key']}"}


def _api_keys(names) -> list[dict]:
    return [{"name": name, **KEYS[name]} for name in names]


@pytest.fixture(scope="module")
def logs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("quota-logs")


@pytest.fixture(scope="module")
def queue_url():
    with nats_server() as url:
        yield url


@pytest.fixture(scope="module")
def standins(logs):
    procs = {name: launch_standin(logs, name) for name in ("d1", "m1", "f1", "f2")}
    for proc in procs.values():
        proc.wait_http("/ready")
    yield procs
    for proc in procs.values():
        proc.stop()


@pytest.fixture(scope="module")
def endpoints_file(logs, standins) -> Path:
    path = logs / "endpoints.yaml"
    _write(path, standins, list(KEYS))
    return path


def _write(path: Path, standins, key_names) -> None:
    document = {
        "endpoints": [
            {"name": "demo", "models": ["demo"], "backends": [standins["d1"].url]},
            {"name": "metered", "models": ["metered"], "backends": [standins["m1"].url]},
            {
                "name": "fragile",
                "models": ["fragile"],
                "backends": [standins["f1"].url, standins["f2"].url],
            },
        ],
        "apiKeys": _api_keys(key_names),
    }
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(document))
    tmp.replace(path)  # atomic, as a ConfigMap or an editor's save would be


@pytest.fixture(scope="module")
def gateways(logs, endpoints_file, queue_url):
    with key_counting_gateways(
        logs, endpoints_file, queue_url, _ready, "every endpoint ready on both gateways", 30
    ) as procs:
        yield procs


def _ready(gw: Process) -> bool:
    seen = {}
    for name in ("rpm", "meter"):
        for model in httpx.get(gw.url + "/v1/models", headers=_auth(name)).json()["data"]:
            seen[model["endpoint"]] = model["ready_replicas"]
    return seen == {"demo": 1, "metered": 1, "fragile": 2}


def _until(condition, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for: {what}"
        time.sleep(0.05)


def _fresh_window(margin: float = 20.0) -> None:
    """Start a check with at least ``margin`` seconds left in the current minute window, so
    its requests are counted in one window (windows are the clock's minutes)."""
    left = 60 - time.time() % 60
    if left < margin:
        time.sleep(left + 0.2)


def _metric(gw: Process, name: str, **labels: str) -> float:
    text = httpx.get(gw.metrics_url).text
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith(name + "{"):
            got = ",".join(sorted(line[len(name) + 1 : line.index("}")].split(",")))
            if got == want:
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def _both(gateways, name: str, **labels: str) -> float:
    return sum(_metric(gw, name, **labels) for gw in gateways)


# ------------------------------------------------------------------ keys


def test_a_request_without_a_listed_key_is_401_and_a_key_off_its_endpoints_404(gateways):
    gw = gateways[0]
    for headers in ({}, {"Authorization": "Bearer sk-not-listed"}):
        response = httpx.post(gw.url + CHAT, json=chat(), headers=headers)
        assert response.status_code == 401 and response.json()["error"]["type"] == (
            "AuthenticationError"
        )
    # A key off an endpoint learns nothing of it: 404, as for a model that does not exist.
    response = httpx.post(gw.url + CHAT, json=chat("metered"), headers=_auth("demo-only"))
    assert response.status_code == 404, response.text
    error = response.json()["error"]
    assert error["message"] == "The model `metered` does not exist."
    assert KEYS["demo-only"]["key"] not in response.text
    response = httpx.post(
        gw.url + "/v2/metered/openai/v1/chat/completions",
        json=chat("metered"),
        headers=_auth("demo-only"),
    )
    assert response.status_code == 404
    models = httpx.get(gw.url + "/v1/models", headers=_auth("demo-only")).json()["data"]
    assert [m["id"] for m in models] == ["demo"]


# ------------------------------------------------------------------ limits across replicas


def test_requests_per_minute_hold_across_both_gateways_and_429s_carry_the_headers(gateways):
    _fresh_window()
    answers = [
        httpx.post(gateways[i % 2].url + CHAT, json=chat(), headers=_auth("rpm"), timeout=30)
        for i in range(8)
    ]
    assert [a.status_code for a in answers] == [200] * 5 + [429] * 3
    assert [a.headers["x-ratelimit-remaining-requests"] for a in answers[:5]] == [
        "4", "3", "2", "1", "0"
    ]  # fmt: skip
    for answer in answers:  # every answer of a key with limits, on either gateway
        assert all(h in answer.headers for h in RATE_HEADERS), answer.headers
        assert answer.headers["x-ratelimit-limit-requests"] == "5"
        assert answer.headers["x-ratelimit-limit-tokens"] == "100000"
    refused = answers[-1]
    error = refused.json()["error"]
    assert error["code"] == "rate_limit_exceeded" and error["type"] == "RateLimitError"
    assert "requestsPerMinute" in error["message"] and "'rpm'" in error["message"]
    assert KEYS["rpm"]["key"] not in refused.text
    retry_after = int(refused.headers["retry-after"])
    assert 1 <= retry_after <= 60
    assert refused.headers["x-ratelimit-reset-requests"].endswith("s")
    # Answers that count nothing carry them too (a model list, a 404), as of now.
    for answer in (
        httpx.get(gateways[1].url + "/v1/models", headers=_auth("rpm")),
        httpx.post(gateways[0].url + CHAT, json=chat("no-such-model"), headers=_auth("rpm")),
    ):
        assert answer.headers["x-ratelimit-remaining-requests"] == "0", answer.headers
        assert all(h in answer.headers for h in RATE_HEADERS)
    # The openai SDK sees a RateLimitError with the same body.
    client = openai.OpenAI(
        base_url=gateways[1].url + "/v1", api_key=KEYS["rpm"]["key"], max_retries=0
    )
    with pytest.raises(openai.RateLimitError) as raised:
        client.chat.completions.create(**chat())
    assert raised.value.code == "rate_limit_exceeded"
    assert (
        _both(
            gateways,
            "llmendpoints_gateway_key_requests_total",
            key="rpm",
            endpoint="default/demo",
            code="429",
        )
        == 4
    )


def _stored_tokens(queue_url: str, key_name: str) -> int:
    """The tokens the shared limiter state holds for a key name (read from NATS directly)."""
    import asyncio

    import nats
    from llmendpoints_common.queue import names
    from llmendpoints_gateway.quotas import QuotaState

    async def read() -> int:
        nc = await nats.connect(queue_url)
        try:
            raw = await nc.jetstream().get_msg(
                names.kv_stream(names.QUOTAS_BUCKET),
                subject=names.kv_subject(names.QUOTAS_BUCKET, names.quota_key(key_name)),
                direct=True,
            )
            return QuotaState.decode(raw.data).tokens
        finally:
            await nc.close()

    return asyncio.run(read())


def test_tokens_per_minute_hold_across_both_gateways(gateways, queue_url):
    _fresh_window()
    # Each request: 3 prompt words + 8 chunks = 11 tokens reported by the stand-in. It reserves
    # 16 at admission: max_tokens 8, and its prompt estimated at 4 (13 characters / 4) + 4 (a
    # message's template); the reservation is settled to the 11 the engine reported.
    statuses, remaining = [], []
    for i in range(8):
        answer = httpx.post(
            gateways[i % 2].url + CHAT, json=chat(max_tokens=8), headers=_auth("tpm"), timeout=30
        )
        statuses.append(answer.status_code)
        remaining.append(int(answer.headers["x-ratelimit-remaining-tokens"]))
        if answer.status_code == 429:
            error = answer.json()["error"]
            assert "tokensPerMinute" in error["message"] and "'tpm'" in error["message"]
            assert answer.headers["x-ratelimit-limit-tokens"] == "40"
            assert answer.headers["x-ratelimit-reset-tokens"].endswith("s")
            assert 1 <= int(answer.headers["retry-after"]) <= 60
            break
        # Tokens are charged once the answer has ended, in the background: wait for the
        # charge to be stored before the next request (sequential use, no overshoot).
        _until(lambda n=i: _stored_tokens(queue_url, "tpm") == 11 * (n + 1), "the charge")
    # 40 tokens: 0, 11, 22 used before admission, +16 reserved each fits; 33 + 16 does not.
    # No request is admitted that the window cannot take (it used to end at 44 of 40).
    assert statuses == [200, 200, 200, 429]
    assert remaining == [40 - 16, 40 - 11 - 16, 40 - 22 - 16, 40 - 33]
    assert _stored_tokens(queue_url, "tpm") == 33


def test_a_tokens_per_minute_key_far_from_its_limit_is_admitted_and_settled_locally(
    gateways, queue_url
):
    """Far from the limit, a replica takes a block of the minute's tokens (and requests) with
    the admission it writes and admits and settles the next requests from it: 10 requests, 2
    writes to the key's shared state (that admission and its settlement). What the client sees
    stays exact: its remaining tokens are the limit less what its requests used."""
    import asyncio

    import nats
    from llmendpoints_common.queue import names
    from llmendpoints_common.queue.connect import settle

    limit = 1_000_000
    subject = names.kv_subject(names.QUOTAS_BUCKET, names.quota_key("tpm-local"))
    gw = gateways[0]

    async def scenario() -> tuple[int, list[int]]:
        nc = await nats.connect(queue_url)
        writes = 0

        async def seen(_msg) -> None:
            nonlocal writes
            writes += 1

        await nc.subscribe(subject, cb=seen)  # every write to the key's value, by anyone
        await settle(nc)  # on the server before the first request (flush() is not enough)
        statuses = []
        try:
            async with httpx.AsyncClient(base_url=gw.url, timeout=30) as client:
                for i in range(10):
                    answer = await client.post(
                        CHAT, json=chat(max_tokens=8), headers=_auth("tpm-local")
                    )
                    statuses.append(answer.status_code)
                    if i == 0:  # the first admission's settlement is written: let it land
                        deadline = time.monotonic() + 30
                        while writes < 2:
                            assert time.monotonic() < deadline, "the settlement was not written"
                            await asyncio.sleep(0.05)
                # Every request has ended and settled: this replica reports exactly the
                # tokens used (11 each, their reservations of 16 given back).
                deadline = time.monotonic() + 30
                while True:
                    models = await client.get("/v1/models", headers=_auth("tpm-local"))
                    left = int(models.headers["x-ratelimit-remaining-tokens"])
                    if left == limit - 10 * 11:
                        break
                    assert time.monotonic() < deadline, f"remaining tokens stuck at {left}"
                    await asyncio.sleep(0.05)
            await nc.flush()
        finally:
            await nc.close()
        return writes, statuses

    _fresh_window()
    writes, statuses = asyncio.run(scenario())
    assert statuses == [200] * 10
    assert writes == 2
    # The shared state counts the first request's 11 tokens and the block this replica holds
    # (1/8 of what was left, at most 32 requests' reservations: 32 x 16): no other replica
    # can take it.
    assert _stored_tokens(queue_url, "tpm-local") == 11 + 32 * 16


def test_max_concurrent_holds_across_both_gateways_and_frees_when_requests_end(gateways):
    slow = chat(stream=True, standin_chunks=100, standin_interval=0.05)  # ~5 s each

    def call(i: int) -> tuple[int, str]:
        with httpx.stream(
            "POST", gateways[i % 2].url + CHAT, json=slow, headers=_auth("conc"), timeout=60
        ) as response:
            return response.status_code, response.read().decode()

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        results = list(pool.map(call, range(6)))
    codes = sorted(code for code, _ in results)
    assert codes == [200, 200, 429, 429, 429, 429], results
    refused = next(body for code, body in results if code == 429)
    assert "maxConcurrent" in json.loads(refused)["error"]["message"]
    # Both slots are free again once the streams ended (released in the background).
    _until(
        lambda: (
            httpx.post(gateways[1].url + CHAT, json=chat(), headers=_auth("conc")).status_code
            == 200
        ),
        "a slot after the streams ended",
    )


def test_jobs_count_against_the_same_limits(gateways):
    _fresh_window()
    base = [gw.url + "/v2/demo" for gw in gateways]
    job = {"input": {"prompt": "hi"}}
    assert httpx.post(gateways[0].url + CHAT, json=chat(), headers=_auth("jobs")).status_code == 200
    assert httpx.post(base[1] + "/run", json=job, headers=_auth("jobs")).status_code == 200
    assert httpx.post(base[0] + "/run", json=job, headers=_auth("jobs")).status_code == 200
    refused = httpx.post(base[1] + "/run", json=job, headers=_auth("jobs"))
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    assert httpx.post(gateways[0].url + CHAT, json=chat(), headers=_auth("jobs")).status_code == 429


def _fail(queue_url: str, job_id: str) -> None:
    """A worker takes the job and it fails (the queue's own record functions, as a pod's)."""
    import asyncio

    from llmendpoints_common.jobs.models import JobStatus
    from llmendpoints_common.jobs.record import claim, finish
    from llmendpoints_common.queue.client import QueueConnection
    from llmendpoints_common.queue.state import JobStates

    async def work() -> None:
        connection = await QueueConnection.connect(queue_url, name="test-worker")
        try:
            states = JobStates(connection.js, "default/demo")
            now = time.time()
            await states.update(job_id, lambda r: claim(r, now=now, worker="w"))
            await states.update(
                job_id, lambda r: finish(r, JobStatus.FAILED, now=now, error={"message": "x"})
            )
        finally:
            await connection.close()

    asyncio.run(work())


def test_each_retry_is_one_of_the_keys_requests(gateways, queue_url):
    """A /retry runs the job again: it counts against the key's requests, so retrying a failed
    job cannot get around requestsPerMinute."""
    _fresh_window()
    base = [gw.url + "/v2/demo" for gw in gateways]
    run = httpx.post(base[0] + "/run", json={"input": {"prompt": "hi"}}, headers=_auth("retry"))
    assert run.status_code == 200, run.text
    job_id = run.json()["id"]
    for gateway in base[1], base[0]:  # requests 2 and 3, one on each gateway
        _fail(queue_url, job_id)
        retried = httpx.post(f"{gateway}/retry/{job_id}", headers=_auth("retry"))
        assert retried.status_code == 200, retried.text
    _fail(queue_url, job_id)
    refused = httpx.post(f"{base[1]}/retry/{job_id}", headers=_auth("retry"))
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "rate_limit_exceeded"
    # The refused retry left the job as it was.
    status = httpx.get(f"{base[0]}/status/{job_id}", headers=_auth("retry"))
    assert status.json()["status"] == "FAILED"


# ------------------------------------------------------------------ metering


def test_counters_match_the_usage_the_backend_reported(gateways, standins):
    client = [
        openai.OpenAI(base_url=gw.url + "/v1", api_key=KEYS["meter"]["key"], max_retries=0)
        for gw in gateways
    ]
    for i in range(3):
        client[i % 2].chat.completions.create(**chat("metered", "a b c d e"))
    # A stream whose client did not ask for usage: the gateway asks, and takes the usage
    # chunk out of what the client sees.
    chunks = list(client[0].chat.completions.create(**chat("metered", "a b"), stream=True))
    assert chunks and all(c.choices for c in chunks) and all(c.usage is None for c in chunks)
    # One that asked gets it, as it would from vLLM.
    asked = list(
        client[1].chat.completions.create(
            **chat("metered", "a b"), stream=True, stream_options={"include_usage": True}
        )
    )
    assert asked[-1].choices == [] and asked[-1].usage.completion_tokens == 8
    stats = httpx.get(standins["m1"].url + "/stats").json()
    assert stats["usage_requested"] == 2  # both streams carried the option upstream
    assert stats["prompt_tokens"] == 3 * 5 + 2 + 2 and stats["completion_tokens"] == 5 * 8

    def counted(kind: str) -> float:
        return _both(
            gateways,
            "llmendpoints_gateway_key_tokens_total",
            key="meter",
            endpoint="default/metered",
            kind=kind,
        )

    _until(lambda: counted("completion") == stats["completion_tokens"], "completion tokens")
    assert counted("prompt") == stats["prompt_tokens"]
    assert (
        _both(
            gateways,
            "llmendpoints_gateway_key_requests_total",
            key="meter",
            endpoint="default/metered",
            code="200",
        )
        == 5
    )


def test_a_request_retried_on_another_replica_is_counted_once(gateways, standins):
    before = _both(
        gateways,
        "llmendpoints_gateway_key_requests_total",
        key="meter",
        endpoint="default/fragile",
        code="200",
    )
    # f1 crashes before answering; the gateway retries on f2.
    for _ in range(2):
        answer = httpx.post(
            gateways[0].url + CHAT,
            json=chat("fragile", standin_fail="before", standin_fail_on="f1"),
            headers=_auth("meter"),
            timeout=30,
        )
        assert answer.status_code == 200, answer.text
    stats = httpx.get(standins["f2"].url + "/stats").json()
    after = _both(
        gateways,
        "llmendpoints_gateway_key_requests_total",
        key="meter",
        endpoint="default/fragile",
        code="200",
    )
    assert after - before == 2
    assert (
        _both(
            gateways,
            "llmendpoints_gateway_key_tokens_total",
            key="meter",
            endpoint="default/fragile",
            kind="completion",
        )
        == stats["completion_tokens"]
    )


def test_the_usage_export_lists_what_was_served(gateways, queue_url, standins):
    stats = httpx.get(standins["m1"].url + "/stats").json()
    since = "2020-01-01T00:00:00Z"

    def export(fmt: str) -> str:
        env = {**os.environ, "JOBS_QUEUE_URL": queue_url}
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "llmendpoints_gateway",
                "usage",
                "--since",
                since,
                "--format",
                fmt,
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    def metered_row():
        rows = json.loads(export("json"))
        return next(
            (r for r in rows if r["key"] == "meter" and r["endpoint"] == "default/metered"), None
        )

    _until(lambda: (metered_row() or {}).get("requests") == 5, "the usage records of 'meter'")
    row = metered_row()
    assert row == {
        "key": "meter",
        "endpoint": "default/metered",  # usage is the endpoint's: namespace and name
        "model": "metered",
        "requests": 5,
        "prompt_tokens": stats["prompt_tokens"],
        "completion_tokens": stats["completion_tokens"],
    }
    rows = json.loads(export("json"))
    rpm = next(r for r in rows if r["key"] == "rpm")
    assert rpm["requests"] == 5  # the 429s were not served
    text = export("csv").splitlines()
    assert text[0] == "key,endpoint,model,requests,prompt_tokens,completion_tokens"
    assert (
        f"meter,default/metered,metered,5,{stats['prompt_tokens']},{stats['completion_tokens']}"
        in text
    )
    # A window that ended before anything was served is empty.
    env = {**os.environ, "JOBS_QUEUE_URL": queue_url}
    done = subprocess.run(
        [
            sys.executable, "-m", "llmendpoints_gateway", "usage",
            "--since", "2020-01-01T00:00:00Z", "--until", "2020-01-02T00:00:00Z",
        ],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.stdout.strip() == "key,endpoint,model,requests,prompt_tokens,completion_tokens"
    bad = subprocess.run(
        [sys.executable, "-m", "llmendpoints_gateway", "usage", "--since", "yesterday"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert bad.returncode == 2 and "--since" in bad.stderr and "ISO 8601" in bad.stderr
    from .harness import free_port

    unreachable = subprocess.run(
        [sys.executable, "-m", "llmendpoints_gateway", "usage", "--since", since],
        env={**env, "JOBS_QUEUE_URL": f"nats://127.0.0.1:{free_port()}"},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert unreachable.returncode == 1
    assert "cannot read usage records from JOBS_QUEUE_URL" in unreachable.stderr
    assert "Traceback" not in unreachable.stderr


# ------------------------------------------------------------------ revocation (last: it rewrites the file)


def test_a_revoked_key_stops_on_both_gateways_within_5_s(gateways, endpoints_file, standins):
    for gw in gateways:
        assert httpx.post(gw.url + CHAT, json=chat(), headers=_auth("revoked")).status_code == 200
    _write(endpoints_file, standins, [n for n in KEYS if n != "revoked"])
    revoked_at = time.monotonic()
    for gw in gateways:
        _until(
            lambda gw=gw: (
                httpx.post(gw.url + CHAT, json=chat(), headers=_auth("revoked")).status_code == 401
            ),
            "the revoked key refused",
            timeout=max(0.1, revoked_at + 5.0 - time.monotonic()),
        )
    # The other keys keep working.
    assert (
        httpx.post(gateways[1].url + CHAT, json=chat(), headers=_auth("demo-only")).status_code
        == 200
    )


def test_a_completed_jobs_tokens_are_counted_once_whoever_ran_it(gateways, queue_url):
    """A job accepted by one gateway and completed by a worker (played here with the queue's own
    record functions, as a runtime pod does) is metered once across both gateways, also when
    its finished record is written again (a /stream read moving its cursor)."""
    import asyncio

    from llmendpoints_common.jobs.models import JobStatus
    from llmendpoints_common.jobs.record import claim, finish
    from llmendpoints_common.queue.client import QueueConnection
    from llmendpoints_common.queue.state import JobStates

    job = httpx.post(
        gateways[1].url + "/v2/demo/run",
        json={"input": {"prompt": "hi"}},
        headers=_auth("demo-only"),
    )
    assert job.status_code == 200, job.text
    job_id = job.json()["id"]
    output = [{"choices": [{"tokens": ["a b"]}], "usage": {"input": 4, "output": 2}}]

    async def work() -> None:
        connection = await QueueConnection.connect(queue_url, name="test-worker")
        try:
            states = JobStates(connection.js, "default/demo")
            now = time.time()
            await states.update(job_id, lambda r: claim(r, now=now, worker="w"))
            await states.update(
                job_id, lambda r: finish(r, JobStatus.COMPLETED, now=now, output=output)
            )
            await states.update(job_id, lambda r: r.model_copy(update={"stream_cursor": 7}))
        finally:
            await connection.close()

    def tokens(kind: str) -> float:
        return _both(
            gateways,
            "llmendpoints_gateway_key_tokens_total",
            key="demo-only",
            endpoint="default/demo",
            kind=kind,
        )

    before = tokens("prompt"), tokens("completion")
    asyncio.run(work())
    _until(lambda: tokens("completion") == before[1] + 2, "the job's tokens counted")
    assert tokens("prompt") == before[0] + 4
    _until(lambda: _consumer_drained(queue_url), "every change of the record handled")
    # The second write of the finished record counted nothing.
    assert tokens("completion") == before[1] + 2


def _consumer_drained(queue_url: str) -> bool:
    import asyncio

    import nats
    from llmendpoints_common.queue import names

    async def read() -> bool:
        nc = await nats.connect(queue_url)
        try:
            info = await nc.jetstream().consumer_info(
                names.records_stream("default/demo"), names.USAGE_CONSUMER
            )
            return info.num_pending == 0 and info.num_ack_pending == 0
        finally:
            await nc.close()

    return asyncio.run(read())
