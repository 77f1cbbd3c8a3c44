"""The job API at the gateway, on a real nats-server, with no runtime pod running: jobs are
accepted, reported, streamed, cancelled and purged by owner; the runpod SDK works against it."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import httpx
import nats
import pytest
import yaml
from integration.nats_kit import nats_server
from llmendpoints_common.identity import EndpointRef
from llmendpoints_common.queue.signals import subscribe_nudges

from .harness import free_port, running_gateway, webhook_receiver, write_endpoints

ALICE, BOB, ADMIN = "sk-alice", "sk-bob", "sk-admin"
JOB = {"input": {"prompt": "Hello", "sampling_params": {"max_tokens": 4}}}


@pytest.fixture(scope="module")
def queue_url():
    with nats_server(max_payload=32 * 1024 * 1024) as url:  # as the chart's: 20 MiB /runsync jobs
        yield url


@pytest.fixture(scope="module")
def gateway(tmp_path_factory, queue_url):
    tmp: Path = tmp_path_factory.mktemp("gateway-jobs")
    endpoints = write_endpoints(
        tmp / "endpoints.yaml",
        [
            {"name": "work", "models": ["work"], "backends": [f"http://127.0.0.1:{free_port()}"]},
        ],
    )
    keys = tmp / "keys.yaml"
    keys.write_text(
        yaml.safe_dump(
            {
                "keys": [
                    {"name": "alice", "key": ALICE},
                    {"name": "bob", "key": BOB},
                    {"name": "ops", "key": ADMIN, "admin": True},
                ]
            }
        )
    )
    with running_gateway(
        tmp,
        GATEWAY_ENDPOINTS_FILE=str(endpoints),
        API_KEYS_FILE=str(keys),
        JOBS_QUEUE_URL=queue_url,
        LLMEP_WEBHOOK_DESTINATIONS="127.0.0.1/32",
    ) as gw:
        gw.wait_http("/v2/work/health", want=401)
        for _ in range(100):  # the queue connection comes up in the background
            if httpx.get(gw.url + "/v2/work/health", headers=_auth(ADMIN)).status_code == 200:
                break
            time.sleep(0.1)
        yield gw


def _auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def _client(gw, key: str) -> httpx.Client:
    return httpx.Client(base_url=gw.url + "/v2/work", headers=_auth(key), timeout=30)


def test_jobs_are_accepted_with_no_runtime_running_and_owned_by_their_key(gateway):
    with _client(gateway, ALICE) as alice, _client(gateway, BOB) as bob:
        accepted = alice.post("/run", json=JOB)
        assert accepted.status_code == 200, accepted.text
        job = accepted.json()
        assert job["status"] == "IN_QUEUE" and job["id"]
        assert alice.get(f"/status/{job['id']}").json() == {"id": job["id"], "status": "IN_QUEUE"}
        assert alice.get(f"/stream/{job['id']}").json()["stream"] == []
        # Another key's job is answered exactly like a job that does not exist.
        for response in (bob.get(f"/status/{job['id']}"), bob.post(f"/cancel/{job['id']}")):
            assert response.status_code == 404
            assert response.json()["error"]["type"] == "NotFoundError"
        assert alice.post(f"/cancel/{job['id']}").json()["status"] == "CANCELLED"
        assert alice.get(f"/status/{job['id']}").json()["status"] == "CANCELLED"


def test_jobs_cancelled_or_purged_through_the_gateway_notify_their_webhook_once(gateway):
    with webhook_receiver() as (url, received), _client(gateway, BOB) as bob:
        bob.post("/purge-queue")
        cancelled = bob.post("/run", json={**JOB, "webhook": url + "?job=cancelled"}).json()
        purged = bob.post("/run", json={**JOB, "webhook": url + "?job=purged"}).json()
        assert bob.post(f"/cancel/{cancelled['id']}").json()["status"] == "CANCELLED"
        assert bob.post("/purge-queue").json()["removed"] == 1
        assert bob.post(f"/cancel/{cancelled['id']}").status_code == 409  # already final
        # LLMEP_WEBHOOK_DESTINATIONS allows only 127.0.0.1 here.
        refused = bob.post("/run", json={**JOB, "webhook": "http://10.0.0.1/hook"})
        assert refused.status_code == 400
        assert refused.json()["error"]["param"] == "webhook"
        deadline = time.monotonic() + 10
        while len(received) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # a second notification would have arrived by now
    assert sorted((n["id"], n["status"]) for n in received) == sorted(
        [(cancelled["id"], "CANCELLED"), (purged["id"], "CANCELLED")]
    )


def test_a_draining_gateway_waits_for_its_webhook_deliveries(tmp_path, queue_url):
    endpoints = write_endpoints(
        tmp_path / "endpoints.yaml",
        [{"name": "drain", "models": ["drain"], "backends": [f"http://127.0.0.1:{free_port()}"]}],
    )
    with (
        webhook_receiver(answer_after=2.0) as (url, received),
        running_gateway(
            tmp_path,
            GATEWAY_ENDPOINTS_FILE=str(endpoints),
            JOBS_QUEUE_URL=queue_url,
            GATEWAY_REQUIRE_KEYS="false",
        ) as gw,
        httpx.Client(base_url=gw.url + "/v2/drain", timeout=30) as client,
    ):
        for _ in range(100):  # the queue connection comes up in the background
            if client.get("/health").status_code == 200:
                break
            time.sleep(0.1)
        job = client.post("/run", json={**JOB, "webhook": url}).json()
        assert client.post(f"/cancel/{job['id']}").json()["status"] == "CANCELLED"
        time.sleep(0.2)  # the delivery is under way; the receiver answers in 2 s
        gw.process.send_signal(signal.SIGTERM)
        assert gw.process.wait(30) == 0
        exited_at = time.monotonic()
        assert [(n["id"], n["status"]) for n in received] == [(job["id"], "CANCELLED")]
        assert received[0]["answered_at"] < exited_at
        assert "abandoned" not in gw.log()


def test_runsync_returns_the_id_when_the_wait_runs_out(gateway):
    with _client(gateway, ALICE) as alice:
        reply = alice.post("/runsync?wait=300", json=JOB).json()
        assert reply["status"] == "IN_QUEUE" and set(reply) == {"id", "status"}
        error = alice.post("/runsync?wait=soon", json=JOB).json()["error"]
        assert error["param"] == "wait"


def test_purge_queue_takes_the_callers_jobs_unless_admin(gateway):
    with (
        _client(gateway, ALICE) as alice,
        _client(gateway, BOB) as bob,
        _client(gateway, ADMIN) as admin,
    ):
        admin.post("/purge-queue")
        ids = [alice.post("/run", json=JOB).json()["id"] for _ in range(2)]
        bob_id = bob.post("/run", json=JOB).json()["id"]
        assert alice.post("/purge-queue").json() == {"removed": 2, "status": "completed"}
        assert {alice.get(f"/status/{i}").json()["status"] for i in ids} == {"CANCELLED"}
        assert bob.get(f"/status/{bob_id}").json()["status"] == "IN_QUEUE"
        assert admin.post("/purge-queue").json()["removed"] == 1


def test_runsync_takes_bodies_up_to_20_mib_and_run_up_to_the_request_limit(gateway):
    # RunPod's limits: 10 MB /run, 20 MB /runsync; the gateway's MAX_REQUEST_BODY_BYTES is 16 MiB.
    big = {"input": {"prompt": "x" * (18 * 1024 * 1024)}}
    with _client(gateway, ALICE) as alice:
        too_large = alice.post("/run", json=big)
        assert too_large.status_code == 413, too_large.text
        accepted = alice.post("/runsync?wait=100", json=big)
        assert accepted.status_code == 200, accepted.text
        assert alice.post(f"/cancel/{accepted.json()['id']}").json()["status"] == "CANCELLED"
        huge = alice.post("/runsync", json={"input": {"prompt": "x" * (21 * 1024 * 1024)}})
        assert huge.status_code == 413
        assert f"the limit is {20 * 1024 * 1024}" in huge.json()["error"]["message"]


def test_bad_job_input_is_a_400_naming_the_field(gateway):
    with _client(gateway, ALICE) as alice:
        error = alice.post("/run", json={"prompt": "no input wrapper"}).json()["error"]
        assert error["param"] == "input" and error["type"] == "BadRequestError"
        assert alice.post("/run", content=b"{").status_code == 400
        assert alice.get("/nothing").status_code == 404
        assert alice.get("/run").status_code == 405


def test_the_runpod_sdk_works_against_the_gateway(gateway):
    import runpod

    runpod.endpoint_url_base = gateway.url + "/v2"
    runpod.api_key = ALICE
    job = runpod.Endpoint("work").run(JOB["input"])
    assert job.status() == "IN_QUEUE"
    job.cancel()
    assert job.status() == "CANCELLED"


async def test_a_job_for_an_endpoint_with_no_ready_replica_nudges_the_autoscaler(
    gateway, queue_url
):
    nc = await nats.connect(queue_url)
    nudged: list[EndpointRef] = []
    await subscribe_nudges(nc, nudged.append)
    # Nudges are at most one a second per endpoint, and earlier tests sent some.
    await asyncio.sleep(1.1)
    async with httpx.AsyncClient(base_url=gateway.url + "/v2/work", headers=_auth(BOB)) as bob:
        assert (await bob.post("/run", json=JOB)).status_code == 200
    for _ in range(50):
        if nudged:
            break
        await asyncio.sleep(0.1)
    assert nudged == [EndpointRef("default", "work")]
    await nc.close()
