"""The pure parts of holding at a cold start: the keep-alive's commit point and what crosses it
(held_stream.py), the Retry-After of a refused request (holding.retry_after, HoldQueue), and
the cold start the gateway reads from an LLMEndpoint's status (discovery.kube)."""

from __future__ import annotations

import asyncio
import json

import pytest
from llmendpoints_common.errors import ServiceUnavailableError
from llmendpoints_gateway import held_stream
from llmendpoints_gateway.discovery.kube import endpoint_view, last_cold_start
from llmendpoints_gateway.held_stream import COMMENT, HeldStream, upstream_error
from llmendpoints_gateway.holding import (
    MAX_RETRY_AFTER_SECONDS,
    RETRY_AFTER_SECONDS,
    HoldQueue,
    retry_after,
)


class Recorder:
    def __init__(self) -> None:
        self.messages: list[dict] = []

    async def __call__(self, message: dict) -> None:
        self.messages.append(message)

    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.messages if "body" in m)


@pytest.fixture(autouse=True)
def quick_commit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(held_stream, "FIRST_COMMENT_SECONDS", 0.01)


async def test_released_before_the_commit_point_the_replica_answers_with_its_own_head():
    sent = Recorder()
    held = HeldStream(sent, interval=0.05)
    held.arm()
    start = {"type": "http.response.start", "status": 400, "headers": []}
    await held.send(start)
    await held.send({"type": "http.response.body", "body": b"{}", "more_body": False})
    await asyncio.sleep(0.05)  # the keep-alive was stopped: nothing more goes out
    assert sent.messages[0] is start and len(sent.messages) == 2
    assert not held.committed


async def test_committed_a_stream_gets_comments_then_the_replicas_events_without_its_head():
    sent = Recorder()
    held = HeldStream(sent, interval=0.02)
    held.arm()
    await asyncio.sleep(0.1)
    assert held.committed
    head = sent.messages[0]
    assert (
        head["status"] == 200
        and (b"content-type", b"text/event-stream; charset=utf-8") in (head["headers"])
    )
    comments = sent.body().count(COMMENT)
    assert comments >= 3
    await held.send({"type": "http.response.start", "status": 200, "headers": [(b"x", b"y")]})
    await held.send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
    await asyncio.sleep(0.05)
    assert [m["type"] for m in sent.messages].count("http.response.start") == 1
    assert sent.body().count(COMMENT) == comments  # none after the answer started
    assert sent.body().endswith(b"data: [DONE]\n\n")


async def test_committed_a_replicas_error_answer_becomes_the_streams_error_event():
    sent = Recorder()
    held = HeldStream(sent, interval=1)
    held.arm()
    await asyncio.sleep(0.05)
    error = {"error": {"message": "max_tokens is too large", "type": "BadRequestError"}}
    await held.send({"type": "http.response.start", "status": 400, "headers": []})
    await held.send({"type": "http.response.body", "body": json.dumps(error).encode()[:10]})
    await held.send(
        {"type": "http.response.body", "body": json.dumps(error).encode()[10:], "more_body": False}
    )
    last = sent.messages[-1]
    assert last["more_body"] is False
    event = json.loads(last["body"].removeprefix(b"data: "))
    assert event["error"] == {
        "message": "max_tokens is too large",
        "type": "BadRequestError",
        "param": None,
        "code": 400,
    }


async def test_a_hold_that_fails_after_the_commit_point_ends_the_stream_with_its_error():
    sent = Recorder()
    held = HeldStream(sent, interval=1)
    assert not await held.fail(ServiceUnavailableError("nothing yet"))  # not committed: raise it
    held.arm()
    await asyncio.sleep(0.05)
    assert await held.fail(ServiceUnavailableError("no replica", code="endpoint_unavailable"))
    event = json.loads(sent.messages[-1]["body"].removeprefix(b"data: "))
    assert event["error"]["message"] == "no replica"
    assert event["error"]["code"] == "endpoint_unavailable"
    assert sent.messages[-1]["more_body"] is False


async def test_interval_zero_never_commits():
    sent = Recorder()
    held = HeldStream(sent, interval=0)
    held.arm()
    await asyncio.sleep(0.05)
    assert sent.messages == [] and not held.committed


def test_a_replica_error_that_is_not_json_is_still_an_openai_error():
    error = upstream_error(502, b"<html>bad gateway</html>")
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == 502 and "bad gateway" in error["message"]


def test_retry_after_is_what_is_left_of_the_measured_cold_start():
    assert retry_after(None, 0) == RETRY_AFTER_SECONDS
    assert retry_after(90.0, 30.0) == 60
    assert retry_after(90.0, 88.0) == RETRY_AFTER_SECONDS  # nearly there
    assert retry_after(90.0, 300.0) == RETRY_AFTER_SECONDS  # overdue
    assert retry_after(5000.0, 0.0) == MAX_RETRY_AFTER_SECONDS


async def test_a_full_hold_queue_answers_retry_after_from_the_endpoints_cold_start():
    queue = HoldQueue("default/e", max_length=1)
    queue.cold_start = 120.0
    never = asyncio.get_running_loop().create_future()
    held = asyncio.ensure_future(queue.wait(30, never))
    await asyncio.sleep(0)
    with pytest.raises(ServiceUnavailableError) as refused:
        await queue.wait(30, never)
    assert 115 <= int(refused.value.headers["retry-after"]) <= 120
    queue.release_all()
    await held
    assert queue.observed_cold_start is not None and queue.waking_since is None


async def test_without_an_operator_figure_the_gateways_own_wait_is_the_cold_start():
    queue = HoldQueue("default/e", max_length=1)
    never = asyncio.get_running_loop().create_future()
    held = asyncio.ensure_future(queue.wait(30, never))
    await asyncio.sleep(0.05)
    queue.release_all()
    await held
    assert 0.05 <= queue.observed_cold_start < 5
    assert queue.retry_after() == RETRY_AFTER_SECONDS


def test_the_cold_start_comes_from_the_endpoints_status():
    status = {
        "coldStart": {"last": {"seconds": 93.5}},
        "autoscaling": {"coldStart": {"seconds": 120.0}},
    }
    assert last_cold_start(status) == 93.5
    assert last_cold_start({"autoscaling": {"coldStart": {"seconds": 120}}}) == 120.0
    assert last_cold_start({"coldStart": {"last": {"seconds": "soon"}}}) is None
    assert last_cold_start({}) is None
    obj = {
        "metadata": {"name": "e", "namespace": "ns"},
        "spec": {"model": {"name": "m"}},
        "status": status,
    }
    assert endpoint_view(obj).cold_start == 93.5
