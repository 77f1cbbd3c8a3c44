"""Batches end to end: the ``openai`` SDK (files and batches) and RunPod's batch routes over raw
HTTP, against a real gateway, two real runtimes (vLLM CPU, demo model) and a real nats-server.
The engines start once for the module.

Order matters only at the end: the SIGKILL test kills one runtime, the NATS restart test runs
last (on the runtime left).
"""

from __future__ import annotations

import io
import json
import signal
import threading
import time
from pathlib import Path

import httpx
import openai
import proc_kit
import pytest
import yaml
from integration.nats_kit import NatsServer

from .harness import launch_gateway, launch_runtime, webhook_receiver

pytestmark = pytest.mark.engine

ENDPOINT = "chat"
MODEL = "demo"
ALICE, BOB = "sk-alice", "sk-bob"
HEARTBEAT_TIMEOUT = 3
MAX_NUM_SEQS = 8


@pytest.fixture(scope="module")
def demo_model(tmp_path_factory) -> Path:
    from llmendpoints_runtime.demo import write_demo_model

    return write_demo_model(tmp_path_factory.mktemp("demo-model"))


@pytest.fixture(scope="module")
def logs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("batch-logs")


@pytest.fixture(scope="module")
def nats(logs):
    server = NatsServer(store_dir=logs / "nats", log_path=logs / "nats.log")
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def pods(demo_model, logs, nats):
    started = [
        launch_runtime(
            demo_model,
            logs,
            SERVED_MODEL_NAME=MODEL,
            JOBS_QUEUE_URL=nats.url,
            ENDPOINT_ID=ENDPOINT,
            MAX_NUM_SEQS=str(MAX_NUM_SEQS),
            LLMEP_JOBS_HEARTBEAT_TIMEOUT_SECONDS=str(HEARTBEAT_TIMEOUT),
            DRAIN_TIMEOUT_SECONDS="5",
        )
        for _ in range(2)
    ]
    try:
        for pod in started:
            # Engine start-up: 25-90 s on a quiet 2-core machine, minutes on a busy one.
            pod.wait_http("/ready?strict=1", timeout=900)
        yield started
    finally:
        for pod in started:
            pod.stop()


@pytest.fixture(scope="module")
def gateway(logs, pods, nats):
    endpoints = logs / "endpoints.yaml"
    endpoints.write_text(
        yaml.safe_dump(
            {
                "endpoints": [
                    {"name": ENDPOINT, "models": [MODEL], "backends": [p.url for p in pods]}
                ],
                "apiKeys": [{"name": "alice", "key": ALICE}, {"name": "bob", "key": BOB}],
            }
        )
    )
    proc = launch_gateway(
        logs,
        GATEWAY_ENDPOINTS_FILE=str(endpoints),
        JOBS_QUEUE_URL=nats.url,
        LLMEP_WEBHOOK_DESTINATIONS="127.0.0.1/32",
        # Short windows for the expiry test (OpenAI's is 24h).
        LLMEP_BATCH_MIN_WINDOW_SECONDS="1",
        LLMEP_BATCH_WINDOW_LINES="32",
    )
    try:
        proc.wait_http("/health")
        _until(
            lambda: httpx.get(proc.url + "/v1/batches", headers=_auth(ALICE)).status_code == 200,
            "the gateway's batch API on the queue",
            60,
        )
        yield proc
    finally:
        proc.stop()


def _auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def _until(condition, what: str, timeout: float = 120.0, interval: float = 0.2):
    return proc_kit.wait_until(condition, timeout, what, interval)


def _sdk(gateway, key: str = ALICE) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=0, timeout=60)


def _line(custom_id: str, content: str, **body) -> dict:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": MODEL,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": 4,
            **body,
        },
    }


def _upload(client: openai.OpenAI, lines: list[dict]):
    data = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
    return client.files.create(file=("batch.jsonl", io.BytesIO(data)), purpose="batch")


def _wait(client: openai.OpenAI, batch_id: str, statuses, timeout: float = 600):
    return _until(
        lambda: (b := client.batches.retrieve(batch_id)).status in statuses and b,
        f"batch {batch_id} {statuses}",
        timeout,
        0.5,
    )


def _lines(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def _answered_once(client, batch, custom_ids: list[str]) -> tuple[list[dict], list[dict]]:
    """The output and error lines, with every custom_id in exactly one of them, once."""
    out, err = _lines(client, batch.output_file_id), _lines(client, batch.error_file_id)
    seen = [line["custom_id"] for line in out + err]
    assert sorted(seen) == sorted(custom_ids), "every request answered exactly once"
    return out, err


def _engine_running(pod) -> int:
    return httpx.get(pod.url + f"/v2/{ENDPOINT}/health").json()["engine"]["running"]


def test_a_200_line_batch_completes_with_every_request_answered_once(gateway):
    client = _sdk(gateway)
    lines = [_line(f"req-{i}", f"say {i}") for i in range(199)]
    # The engine refuses this one (more tokens than the context): it lands in the error file.
    lines.append(_line("too-long", "x", max_tokens=100_000))
    uploaded = _upload(client, lines)
    assert uploaded.purpose == "batch" and uploaded.bytes > 0
    started = time.time()
    batch = client.batches.create(
        input_file_id=uploaded.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"suite": "batches"},
    )
    assert batch.status == "validating" and batch.metadata == {"suite": "batches"}
    done = _wait(client, batch.id, {"completed", "failed"})
    assert done.status == "completed", done
    assert done.request_counts.total == 200
    assert (done.request_counts.completed, done.request_counts.failed) == (199, 1)
    assert done.in_progress_at and done.finalizing_at and done.completed_at
    assert started - 1 <= done.created_at <= done.in_progress_at <= done.completed_at
    out, err = _answered_once(client, done, [line["custom_id"] for line in lines])
    assert all(line["response"]["status_code"] == 200 for line in out)
    assert all(line["response"]["body"]["object"] == "chat.completion" for line in out)
    (refused,) = err
    assert refused["custom_id"] == "too-long"
    assert refused["response"]["status_code"] == 400
    assert "max_tokens" in refused["response"]["body"]["error"]["message"]
    assert done.usage.output_tokens == sum(
        line["response"]["body"]["usage"]["completion_tokens"] for line in out
    )
    # Listed for its key, and the files are its key's.
    assert batch.id in [b.id for b in client.batches.list(limit=100).data]
    assert done.output_file_id in [f.id for f in client.files.list().data]


def test_another_key_cannot_see_a_batch_or_its_files(gateway):
    alice, bob = _sdk(gateway, ALICE), _sdk(gateway, BOB)
    uploaded = _upload(alice, [_line("only", "hi")])
    batch = alice.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    done = _wait(alice, batch.id, {"completed"})
    for call in (
        lambda: bob.batches.retrieve(batch.id),
        lambda: bob.batches.cancel(batch.id),
        lambda: bob.files.retrieve(uploaded.id),
        lambda: bob.files.content(done.output_file_id),
        lambda: bob.files.delete(uploaded.id),
        lambda: bob.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        ),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    assert batch.id not in [b.id for b in bob.batches.list().data]
    assert uploaded.id not in [f.id for f in bob.files.list().data]
    # Alice still has everything.
    assert alice.files.retrieve(uploaded.id).id == uploaded.id
    assert alice.files.delete(uploaded.id).deleted is True
    with pytest.raises(openai.NotFoundError):
        alice.files.retrieve(uploaded.id)


def test_a_bad_file_fails_the_batch_with_errors_naming_its_lines(gateway):
    client = _sdk(gateway)
    data = (
        json.dumps(_line("a", "hi"))
        + "\n{not json\n"
        + json.dumps(_line("a", "again"))
        + "\n"
        + json.dumps({**_line("b", "hi"), "url": "/v1/completions"})
        + "\n"
    ).encode()
    uploaded = client.files.create(file=("bad.jsonl", io.BytesIO(data)), purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    failed = _wait(client, batch.id, {"failed", "completed"})
    assert failed.status == "failed" and failed.failed_at
    assert [(e.code, e.line) for e in failed.errors.data] == [
        ("invalid_json_line", 2),
        ("duplicate_custom_id", 3),
        ("mismatched_endpoint", 4),
    ]
    # A model no endpoint serves fails validation too, naming the line.
    unknown = _upload(client, [_line("x", "hi", model="nobody")])
    batch = client.batches.create(
        input_file_id=unknown.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    failed = _wait(client, batch.id, {"failed"})
    assert [(e.code, e.line) for e in failed.errors.data] == [("model_not_found", 1)]


def test_vllm_runs_a_later_interactive_request_before_waiting_batch_ones(pods):
    """The runtime runs vLLM with --scheduling-policy priority and gives batch requests a
    lower priority: with the engine's slots full, an interactive request sent after a
    batch-priority one is scheduled first. (The engine is stopped while the requests arrive,
    so all are waiting together when it resumes.) The fillers' lengths differ by 32 tokens, so
    their slots come free one at a time: the first goes to the interactive request, the next,
    32 steps later, to the batch one -- fillers ending together would free two slots at once
    and start both, and which of two equal requests the client hears from first is chance. The
    pod's session is niced while it runs, so its spinning engine does not hold this process's
    client threads off the CPU until both answers wait unread."""
    pod = pods[1]
    finished: list[str] = []
    threads = []

    def send(name: str, tokens: int, priority: int | None) -> None:
        body = {
            "model": MODEL,
            "prompt": "hello",
            "max_tokens": tokens,
            "ignore_eos": True,
        }
        if priority is not None:
            body["priority"] = priority
        response = httpx.post(pod.url + "/v1/completions", json=body, timeout=300)
        assert response.status_code == 200, response.text
        finished.append(name)

    with proc_kit.session_niced(pod.process.pid):
        with proc_kit.engines_frozen(pod.process.pid):
            for i in range(MAX_NUM_SEQS):  # fill every engine slot with batch-priority work
                fill = threading.Thread(target=send, args=(f"fill-{i}", 48 + 32 * i, 10))
                threads.append(fill)
            threads.append(threading.Thread(target=send, args=("batch", 24, 10)))
            threads.append(threading.Thread(target=send, args=("interactive", 24, None)))
            for thread in threads:
                thread.start()
                time.sleep(0.2)  # arrival order: fillers, then the batch one, then interactive
            _until(
                lambda: _in_flight(pod) >= len(threads), "every request in the (stopped) engine", 60
            )
        for thread in threads:
            thread.join(300)
    assert finished.index("interactive") < finished.index("batch"), finished


def _in_flight(pod) -> float:
    """Requests the pod has handed to its engine (our gauge: the engine core is stopped)."""
    for line in httpx.get(pod.url + "/metrics").text.splitlines():
        if line.startswith("llmendpoints_requests_in_flight "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_cancel_finishes_running_requests_and_answers_the_rest_cancelled(gateway, pods):
    client = _sdk(gateway)
    lines = [_line(f"c-{i}", f"count {i}", max_tokens=64, ignore_eos=True) for i in range(60)]
    uploaded = _upload(client, lines)
    # What runs in the engines below must be this batch's: an earlier test's requests first end.
    _until(lambda: sum(_engine_running(p) for p in pods) == 0, "idle engines", 600)
    with proc_kit.engines_frozen(*(p.process.pid for p in pods)):
        batch = client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        _until(
            lambda: sum(_engine_running(p) for p in pods) > 0,
            "batch requests running in the (stopped) engines",
        )
        cancelling = client.batches.cancel(batch.id)
        assert cancelling.status == "cancelling" and cancelling.cancelling_at
    done = _wait(client, batch.id, {"cancelled"})
    assert done.cancelled_at and done.cancelled_at >= done.cancelling_at
    out, err = _answered_once(client, done, [line["custom_id"] for line in lines])
    # What was running when the cancel came finished; the rest never ran.
    assert out and err
    assert {e["error"]["code"] for e in err} == {"batch_cancelled"}
    assert (done.request_counts.completed, done.request_counts.failed) == (len(out), len(err))
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(batch.id)


def test_a_batch_that_runs_out_of_its_window_expires_with_what_it_did(gateway, pods):
    client = _sdk(gateway)
    lines = [_line(f"e-{i}", f"count {i}", max_tokens=32, ignore_eos=True) for i in range(40)]
    uploaded = _upload(client, lines)
    with proc_kit.engines_frozen(*(p.process.pid for p in pods)):
        batch = client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="4s"
        )
        assert batch.expires_at - batch.created_at == 4
        time.sleep(5)  # the window ends while nothing can run
    done = _wait(client, batch.id, {"expired"})
    assert done.expired_at >= batch.expires_at
    out, err = _answered_once(client, done, [line["custom_id"] for line in lines])
    # Nothing could run (the engines were stopped): every request is answered expired.
    assert out == [] and done.output_file_id is None
    assert {e["error"]["code"] for e in err} == {"batch_expired"}
    assert done.request_counts.total == 40


def test_runpod_batch_jobs_over_raw_http(gateway):
    with (
        webhook_receiver() as (hook, received),
        httpx.Client(
            base_url=gateway.url + f"/v2/{ENDPOINT}", headers=_auth(ALICE), timeout=60
        ) as http,
    ):
        created = http.post("/batch", json=[{"input": {"prompt": "one", "sampling_params": {"max_tokens": 3}}}])  # fmt: skip
        assert created.status_code == 200, created.text
        batch = created.json()
        assert batch["status"] == "DRAFT" and batch["id"].startswith("batch_")
        appended = http.post(
            f"/batch/{batch['id']}/requests",
            json={
                "requests": [
                    {"input": {"prompt": f"p{i}", "sampling_params": {"max_tokens": 3}}}
                    for i in range(4)
                ]
                + [
                    {
                        "input": {
                            "openai_route": "/v1/chat/completions",
                            "openai_input": {
                                "model": MODEL,
                                "messages": [{"role": "user", "content": "hi"}],
                                "max_tokens": 3,
                            },
                        }
                    },
                    {"input": {"prompt": "bad", "sampling_params": {"top_p": 5}}},
                ]
            },
        )
        assert appended.status_code == 200, appended.text
        assert appended.json()["requestTotal"] == 7
        # A request refused at once names its place.
        refused = http.post(f"/batch/{batch['id']}/requests", json={"requests": [{"inpt": {}}]})
        assert refused.status_code == 400
        assert refused.json()["error"]["param"] == "requests[0].inpt"
        # Remove one from the draft; name it and set its webhook.
        listing = http.get(f"/batch/{batch['id']}/requests").json()
        assert [r["status"] for r in listing["requests"]] == ["IN_QUEUE"] * 7
        removed = listing["requests"][1]["id"]
        assert http.delete(f"/batch/{batch['id']}/requests/{removed}").json()["requestTotal"] == 6
        assert http.put(f"/batch/{batch['id']}", json={"name": "nightly", "webhook": hook}).json()["name"] == "nightly"  # fmt: skip
        finalized = http.post(f"/batch/{batch['id']}/finalize")
        assert finalized.status_code == 200 and finalized.json()["status"] == "FINALIZED"
        assert http.post(f"/batch/{batch['id']}/requests", json={"requests": [{"input": {"prompt": "late"}}]}).status_code == 409  # fmt: skip

        def finished():
            summary = http.get(f"/batch/{batch['id']}").json()
            done = summary["requestCompleted"] + summary["requestFailed"]
            return done == summary["requestTotal"] and summary

        summary = _until(finished, "every request of the RunPod batch finished", 300, 0.5)
        assert summary["status"] == "FINALIZED"
        assert (summary["requestTotal"], summary["requestCompleted"], summary["requestFailed"]) == (6, 5, 1)  # fmt: skip
        assert summary["endpointId"] == ENDPOINT and summary["name"] == "nightly"
        first = http.get(f"/batch/{batch['id']}/requests", params={"offset": 0, "limit": 4}).json()
        rest = http.get(f"/batch/{batch['id']}/requests", params={"offset": 4, "limit": 4}).json()
        assert (first["total"], first["hasMore"], rest["hasMore"]) == (6, True, False)
        results = first["requests"] + rest["requests"]
        assert removed not in [r["id"] for r in results]
        assert [r["status"] for r in results].count("COMPLETED") == 5
        failed = next(r for r in results if r["status"] == "FAILED")
        assert "top_p" in failed["error"] and failed["startedAt"] and failed["completedAt"]
        chat = results[-2]
        assert chat["output"]["object"] == "chat.completion"
        assert results[0]["output"][0]["usage"]["output"] > 0
        # Each request is a job of the endpoint, with the job API's /status too.
        assert http.get(f"/status/{results[0]['id']}").json()["status"] == "COMPLETED"
        _until(lambda: received, "the batch's webhook", 30)
        assert received[0]["id"] == batch["id"] and received[0]["requestCompleted"] == 5
        assert batch["id"] in [b["id"] for b in http.get("/batch").json()["batches"]]
        # Another key: not found; a draft cancelled ends at once.
        with httpx.Client(base_url=gateway.url + f"/v2/{ENDPOINT}", headers=_auth(BOB)) as bob:
            assert bob.get(f"/batch/{batch['id']}").status_code == 404
        draft = http.post("/batch", json=[]).json()
        assert http.post(f"/batch/{draft['id']}/cancel").json()["status"] == "CANCELLED"
        assert http.post(f"/batch/{draft['id']}/finalize").status_code == 409


def test_a_worker_killed_mid_batch_loses_no_request(gateway, pods):
    client = _sdk(gateway)
    victim, survivor = pods
    lines = [_line(f"k-{i}", f"count {i}", max_tokens=24, ignore_eos=True) for i in range(80)]
    uploaded = _upload(client, lines)
    # Both engines stopped: each pod takes its share of the batch and holds it running (an
    # idle pod looks at the batch lane every poll interval, a busy one finds it at once).
    with proc_kit.engines_frozen(victim.process.pid, survivor.process.pid):
        batch = client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        _until(lambda: _engine_running(victim) > 0, "batch requests running on the victim")
        victim.stop(signal.SIGKILL)
    done = _wait(client, batch.id, {"completed", "failed"})
    assert done.status == "completed"
    out, err = _answered_once(client, done, [line["custom_id"] for line in lines])
    assert (len(out), err) == (80, [])
    assert survivor.process.poll() is None


def test_a_nats_restart_mid_batch_loses_no_request(gateway, pods, nats):
    client = _sdk(gateway)
    survivor = pods[1]
    lines = [_line(f"n-{i}", f"count {i}", max_tokens=16, ignore_eos=True) for i in range(60)]
    uploaded = _upload(client, lines)
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    _until(
        lambda: client.batches.retrieve(batch.id).request_counts.completed > 0,
        "the batch under way",
    )
    nats.stop()
    time.sleep(3)
    nats.start()
    done = _wait(client, batch.id, {"completed", "failed"})
    assert done.status == "completed"
    out, err = _answered_once(client, done, [line["custom_id"] for line in lines])
    assert (len(out), err) == (60, [])
    assert survivor.process.poll() is None
