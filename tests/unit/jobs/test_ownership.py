"""Who may see a job (the in-pod store; the shared queue is tested in tests/queue/): the key
that submitted it. Another key's /status, /stream, /cancel, /retry answer 404, /purge-queue
takes only the caller's jobs, and Idempotency-Key is per caller."""

import asyncio

import httpx
import pytest
from fastapi import FastAPI
from llmendpoints_runtime.auth import APIKeyMiddleware, KeyStore
from llmendpoints_runtime.errors import install_exception_handlers
from llmendpoints_runtime.jobs import JobExecutor, JobSettings, build_job_router, job_verbs

from .fakes import FakeEngine

pytestmark = pytest.mark.asyncio(loop_scope="module")

ALICE = {"Authorization": "Bearer alice-key"}
BOB = {"Authorization": "Bearer bob-key"}
SLOW = {"input": {"prompt": "x", "sampling_params": {"max_tokens": 500}}}


@pytest.fixture
async def client():
    engine = FakeEngine(step_delay=0.01)
    settings = JobSettings(max_concurrency=1)
    executor = JobExecutor(engine, settings)
    app = FastAPI()
    install_exception_handlers(app)
    app.include_router(build_job_router(job_verbs(executor, engine, settings)))
    guarded = APIKeyMiddleware(app, KeyStore(("alice-key", "bob-key"), None), frozenset())
    transport = httpx.ASGITransport(app=guarded)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        yield http
    await executor.drain(0.1)


async def test_another_keys_job_is_not_found(client) -> None:
    job_id = (await client.post("/run", json=SLOW, headers=ALICE)).json()["id"]
    assert (await client.get(f"/status/{job_id}", headers=ALICE)).status_code == 200
    for method, path in [
        ("GET", f"/status/{job_id}"),
        ("GET", f"/stream/{job_id}"),
        ("POST", f"/cancel/{job_id}"),
        ("POST", f"/retry/{job_id}"),
    ]:
        answer = await client.request(method, path, headers=BOB)
        assert answer.status_code == 404, path
        assert answer.json()["error"]["type"] == "NotFoundError"
    assert (await client.post(f"/cancel/{job_id}", headers=ALICE)).json()["status"] == "CANCELLED"


async def test_purge_takes_only_the_callers_queued_jobs(client) -> None:
    running = (await client.post("/run", json=SLOW, headers=ALICE)).json()["id"]  # one slot
    while (await client.get(f"/status/{running}", headers=ALICE)).json()["status"] != "IN_PROGRESS":
        await asyncio.sleep(0.005)
    queued_alice = (await client.post("/run", json=SLOW, headers=ALICE)).json()["id"]
    queued_bob = (await client.post("/run", json=SLOW, headers=BOB)).json()["id"]
    assert (await client.post("/purge-queue", headers=ALICE)).json()["removed"] == 1
    assert (await client.get(f"/status/{queued_alice}", headers=ALICE)).json()[
        "status"
    ] == "CANCELLED"
    assert (await client.get(f"/status/{queued_bob}", headers=BOB)).json()["status"] == "IN_QUEUE"


async def test_idempotency_key_returns_the_first_job_per_caller(client) -> None:
    key = {"Idempotency-Key": "order-17"}
    first = (await client.post("/run", json=SLOW, headers={**ALICE, **key})).json()
    again = (await client.post("/run", json=SLOW, headers={**ALICE, **key})).json()
    other = (await client.post("/run", json=SLOW, headers={**BOB, **key})).json()
    plain = (await client.post("/run", json=SLOW, headers=ALICE)).json()
    assert again["id"] == first["id"]
    assert len({first["id"], other["id"], plain["id"]}) == 3


async def test_admin_key_reaches_every_job_and_purges_all() -> None:
    engine = FakeEngine(step_delay=0.01)
    settings = JobSettings(max_concurrency=1)
    executor = JobExecutor(engine, settings)
    app = FastAPI()
    install_exception_handlers(app)
    app.include_router(build_job_router(job_verbs(executor, engine, settings)))
    keys = KeyStore(("alice-key", "bob-key"), None, admin_keys=("root-key",))
    guarded = APIKeyMiddleware(app, keys, frozenset())
    admin = {"Authorization": "Bearer root-key"}
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=guarded), base_url="http://test"
    ) as http:
        ids = [
            (await http.post("/run", json=SLOW, headers=who)).json()["id"] for who in (ALICE, BOB)
        ]
        assert (await http.get(f"/status/{ids[0]}", headers=admin)).status_code == 200
        mine = (await http.post("/run", json=SLOW, headers=admin)).json()["id"]
        assert (await http.get(f"/status/{mine}", headers=ALICE)).status_code == 404
        removed = (await http.post("/purge-queue", headers=admin)).json()["removed"]
        assert removed >= 2  # everyone's queued jobs (one may already run)
    await executor.drain(0.1)
