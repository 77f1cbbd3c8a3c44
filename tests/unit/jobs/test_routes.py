"""The job routes over HTTP (in-process), at the root and under /v2/{endpoint_id}."""

import asyncio

import httpx
import pytest
from fastapi import FastAPI
from llmendpoints_common.webhooks import WebhookSender
from llmendpoints_runtime.errors import install_exception_handlers
from llmendpoints_runtime.jobs import JobExecutor, JobSettings, build_job_router, job_verbs
from llmendpoints_runtime.metrics import RuntimeMetrics
from llmendpoints_runtime.middleware import BodyGuard

from .fakes import FakeEngine, fake_openai_app

# The fixture's executor runs its workers on the module's event loop; the tests must share it.
pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest.fixture
async def setup():
    engine = FakeEngine(step_delay=0.001)
    settings = JobSettings(max_runsync_wait_ms=5000, default_runsync_wait_ms=5000)
    executor = JobExecutor(
        engine, settings, webhooks=WebhookSender(retries=0, delay_seconds=0, timeout_seconds=1)
    )
    executor.start()
    verbs = job_verbs(executor, engine, settings)
    app = FastAPI()
    install_exception_handlers(app)
    app.include_router(build_job_router(verbs))
    app.include_router(
        build_job_router(verbs, openai_target=lambda request: engine.openai_app()),
        prefix="/v2/{endpoint_id}",
    )
    # The runtime's edge reads the body (MAX_REQUEST_BODY_BYTES, MAX_RUNSYNC_BODY_BYTES).
    guarded = BodyGuard(app, 2000, RuntimeMetrics(), runsync_limit=2900)
    transport = httpx.ASGITransport(app=guarded)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        yield client, engine
    await executor.drain(1)


GOOD = {"input": {"prompt": "hello", "sampling_params": {"max_tokens": 2}}}


@pytest.mark.parametrize("prefix", ["", "/v2/ep123"])
async def test_runsync_status_and_stream_under_both_prefixes(setup, prefix) -> None:
    client, _ = setup
    answer = await client.post(f"{prefix}/runsync", json=GOOD)
    assert answer.status_code == 200
    body = answer.json()
    assert body["status"] == "COMPLETED"
    assert body["output"] == [
        {"choices": [{"tokens": ["t0 t1 "]}], "usage": {"input": 1, "output": 2}}
    ]
    # the job is visible under the other prefix too
    other = "/v2/any-id" if prefix == "" else ""
    status = (await client.get(f"{other}/status/{body['id']}")).json()
    assert status["status"] == "COMPLETED" and status["output"] == body["output"]
    stream = (await client.get(f"{prefix}/stream/{body['id']}")).json()
    assert stream["status"] == "COMPLETED"
    assert stream["stream"] == [{"output": body["output"][0]}]
    # POST works as GET does (RunPod's local test server takes both).
    assert (await client.post(f"{prefix}/status/{body['id']}")).json() == status
    assert (await client.post(f"{prefix}/stream/{body['id']}")).json()["stream"] == []


async def test_run_returns_id_and_queue_status(setup) -> None:
    client, _ = setup
    answer = await client.post("/run", json=GOOD)
    assert answer.status_code == 200
    assert set(answer.json()) == {"id", "status"}
    assert answer.json()["status"] in {"IN_QUEUE", "IN_PROGRESS"}


async def test_runsync_returns_the_id_when_the_wait_runs_out(setup) -> None:
    client, _ = setup
    slow = {"input": {"prompt": "x", "sampling_params": {"max_tokens": 100000}}}
    body = (await client.post("/runsync?wait=20", json=slow)).json()
    assert body["status"] in {"IN_QUEUE", "IN_PROGRESS"} and "output" not in body
    cancel = await client.post(f"/cancel/{body['id']}")
    assert cancel.json() == {"id": body["id"], "status": "CANCELLED"}


@pytest.mark.parametrize(
    ("content", "status", "words"),
    [
        (b"{oops", 400, "not valid JSON"),
        (b"[]", 400, "JSON object"),
        (b'{"input": 3}', 400, "input: must be a JSON object"),
        (b'{"input": {"prompt": 5}}', 400, "input.prompt"),
        (b'{"input": {"messages": "x"}}', 400, "input.messages"),
        (b'{"input": {"temperature": 1}}', 400, "input.temperature: unknown field"),
        (b'{"input": {"prompt": "x", "sampling_params": {"max_tokens": 0}}}', 400, "max_tokens"),
        (b'{"input": {"prompt": "x", "sampling_params": {"max_tokens": -3}}}', 400, "max_tokens"),
        (
            b'{"input": {"prompt": "x", "sampling_params": {"bogus": 1}}}',
            400,
            "input.sampling_params.bogus",
        ),
        (
            b'{"input": {"openai_route": "/v1/chat/completions", "openai_input": {"x": 1}}}',
            400,
            "input.openai_input.messages",
        ),
        (b"\xc3\x28", 400, "UTF-8"),
        (
            b'{"input": {"messages": [{"role": "user", "content": [{"type": "image_url", '
            b'"image_url": {"url": "https://example.com/x.jpg"}}]}]}}',
            400,
            "text-only and cannot take images (image content at input.messages[0].content[0])",
        ),
        (b'{"input": {"prompt": "' + b"x" * 3000 + b'"}}', 413, "limit"),
    ],
)
async def test_bad_input_is_a_json_4xx_and_the_next_request_works(
    setup, content, status, words
) -> None:
    client, _ = setup
    for path in ("/run", "/runsync", "/v2/e/run"):
        answer = await client.post(path, content=content)
        assert answer.status_code == status, answer.text
        body = answer.json()
        assert set(body) == {"error"}  # no job was made: no id, no status
        error = body["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert words in error["message"] and error["code"] == status
        assert error["type"] == {400: "BadRequestError", 413: "ContentTooLargeError"}[status]
    assert (await client.post("/runsync", json=GOOD)).json()["status"] == "COMPLETED"


async def test_runsync_has_a_larger_body_limit_than_run(setup) -> None:
    """RunPod's limits: /runsync takes bodies /run refuses (10 vs 20 MB by default)."""
    client, _ = setup
    content = b'{"input": {"prompt": "' + b"x" * 2500 + b'"}}'
    for path in ("/run", "/v2/e/run"):
        answer = await client.post(path, content=content)
        assert answer.status_code == 413, answer.text
        assert "the limit is 2000 bytes" in answer.json()["error"]["message"]
    for path in ("/runsync", "/v2/e/runsync"):
        answer = await client.post(path, content=content)
        assert answer.status_code == 200, answer.text
        assert answer.json()["status"] == "COMPLETED"


async def test_a_draining_replica_refuses_new_jobs_with_503(setup) -> None:
    client, engine = setup
    engine.shutting_down = True
    try:
        for path in ("/run", "/runsync", "/v2/e/run"):
            answer = await client.post(path, json=GOOD)
            assert (
                answer.status_code == 503 and "shutting down" in answer.json()["error"]["message"]
            )
    finally:
        engine.shutting_down = False
    assert (await client.post("/runsync", json=GOOD)).json()["status"] == "COMPLETED"


@pytest.mark.parametrize("wait", ["abc", "-1", "1.5", "999999"])
async def test_bad_wait_is_400(setup, wait) -> None:
    client, _ = setup
    answer = await client.post(f"/runsync?wait={wait}", json=GOOD)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "wait"


async def test_unknown_ids_and_wrong_states(setup) -> None:
    client, _ = setup
    for method, path in [
        ("GET", "/status/x"),
        ("GET", "/stream/x"),
        ("POST", "/cancel/x"),
        ("POST", "/retry/x"),
    ]:
        answer = await client.request(method, f"/v2/e{path}")
        assert answer.status_code == 404, answer.text
        # The job envelope: the id the request named, and the error object.
        assert answer.json() == {
            "id": "x",
            "error": {
                "message": "no job with id 'x': it never existed, or its result expired "
                "(policy.ttl) and was removed",
                "type": "NotFoundError",
                "param": "id",
                "code": 404,
            },
        }
    done = (await client.post("/runsync", json=GOOD)).json()
    cancel = await client.post(f"/cancel/{done['id']}")
    assert cancel.status_code == 409 and "COMPLETED" in cancel.json()["error"]["message"]
    assert cancel.json()["id"] == done["id"] and cancel.json()["error"]["type"] == "ConflictError"
    retry = await client.post(f"/retry/{done['id']}")
    assert (
        retry.status_code == 409 and "only FAILED or TIMED_OUT" in retry.json()["error"]["message"]
    )


async def test_purge_queue_and_health(setup) -> None:
    client, engine = setup
    engine._ready.clear()  # hold jobs in the queue, as during a cold start
    ids = [(await client.post("/run", json=GOOD)).json()["id"] for _ in range(3)]
    health = (await client.get("/v2/e/health")).json()
    assert health["jobs"]["inQueue"] == 3 and health["workers"]["initializing"] == 1
    assert (await client.post("/v2/e/purge-queue")).json() == {"removed": 3, "status": "completed"}
    statuses = [(await client.get(f"/status/{i}")).json()["status"] for i in ids]
    assert statuses == ["CANCELLED"] * 3
    engine._ready.set()
    health = (await client.get("/health")).json()
    assert health["jobs"]["cancelled"] == 3 and health["engine"]["state"] == "idle"


async def test_openai_alias_reaches_the_openai_app(setup) -> None:
    client, _ = setup
    models = await client.get("/v2/e/openai/v1/models")
    assert models.json()["data"][0]["id"] == "demo"
    answer = await client.post("/v2/e/openai/v1/chat/completions", json={"messages": [], "x": "é"})
    assert answer.json()["route"] == "/v1/chat/completions"
    assert answer.json()["body"] == {"messages": [], "x": "é"}
    streamed = await client.post("/v2/e/openai/v1/completions", json={"stream": True, "events": 2})
    assert streamed.headers["content-type"].startswith("text/event-stream")
    assert streamed.text.count("data: ") == 3


async def test_streamed_openai_job_is_cut_at_event_boundaries() -> None:
    # the fake app sends its SSE bytes 5 at a time: events and UTF-8 characters arrive split
    engine = FakeEngine(openai_app=fake_openai_app(chunk_split=5))
    for raw in (True, False):
        settings = JobSettings(raw_openai_output=raw)
        executor = JobExecutor(engine, settings)
        executor.start()
        from llmendpoints_runtime.jobs.models import parse_job_request

        job = await executor.submit(
            parse_job_request(
                b'{"input": {"openai_route": "/v1/completions", "openai_input": '
                b'{"stream": true, "events": 5, "keep_alive": true}}}'
            ),
            sync=True,
        )
        job = await executor.wait(job.id, 5)
        assert job.status.value == "COMPLETED"
        if raw:
            # batches of 1, 3, then the rest (2 events + [DONE]), each a run of whole events;
            # the keep-alive comment rides along without counting
            assert [c.count("data: ") for c in job.output] == [1, 3, 2]
            assert job.output[0].startswith(": keep-alive\n\n")
            assert all(c.endswith("\n\n") for c in job.output)
            assert "".join(job.output).endswith("data: [DONE]\n\n")
            assert "é✓4" in "".join(job.output)
        else:
            assert [len(c) for c in job.output] == [1, 3, 1]
            assert job.output[0] == [{"i": 0, "text": "é✓0"}]
        await executor.drain(1)
        await asyncio.sleep(0)


async def test_error_event_mid_stream_fails_the_openai_job() -> None:
    engine = FakeEngine(openai_app=fake_openai_app(chunk_split=7))
    executor = JobExecutor(engine, JobSettings())
    executor.start()
    from llmendpoints_runtime.jobs.models import parse_job_request

    job = await executor.submit(
        parse_job_request(
            b'{"input": {"openai_route": "/v1/chat/completions", "openai_input": '
            b'{"messages": [], "stream": true, "events": 2, "error_midway": true}}}'
        ),
        sync=True,
    )
    job = await executor.wait(job.id, 5)
    assert job.status.value == "FAILED"
    assert job.error == {
        "message": "/v1/chat/completions: engine died",
        "type": "InternalServerError",
        "param": None,
        "code": 500,
    }
    assert job.chunks  # what streamed before the error stays readable
    await executor.drain(1)


@pytest.mark.parametrize(
    ("webhook", "words"),
    [
        ("http://169.254.169.254/latest/meta-data/", "169.254.169.254 is a cloud metadata address"),
        ("http://[::ffff:169.254.169.254]/", "cloud metadata address"),
        ("http://169.254.1.1:8080/hook", "link-local"),
        ("http://[fe80::1]/hook", "link-local"),
        ("http://224.0.0.1/hook", "multicast"),
    ],
)
async def test_webhooks_to_refused_destinations_are_400_naming_webhook(
    setup, webhook, words
) -> None:
    client, _ = setup
    for path in ("/run", "/v2/e/runsync"):
        answer = await client.post(path, json={**GOOD, "webhook": webhook})
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert error["param"] == "webhook" and words in error["message"]
    # In-cluster receivers (private and loopback addresses, cluster names) are accepted.
    for webhook in ("http://10.0.0.7:8080/hook", "http://receiver.ns.svc.cluster.local/hook"):
        assert (await client.post("/run", json={**GOOD, "webhook": webhook})).status_code == 200
