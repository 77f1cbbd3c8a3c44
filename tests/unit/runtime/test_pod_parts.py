"""What the API processes of one pod share (API_SERVER_COUNT > 1): the board's answers, the
pod-wide admission, and the routing of job verbs to the process that holds the job. Two
seats on one real shared-memory board stand for two processes."""

from __future__ import annotations

import asyncio
import multiprocessing

import pytest
from llmendpoints_common.errors import RateLimitError
from llmendpoints_common.jobs.api import JobCall, JobReply
from llmendpoints_runtime.health import EngineState
from llmendpoints_runtime.metrics import split_signals
from llmendpoints_runtime.pod.admission import PodAdmission
from llmendpoints_runtime.pod.board import (
    STALE_AFTER_SECONDS,
    PodBoard,
    Row,
    pod_liveness,
    pod_readiness,
)
from llmendpoints_runtime.pod.forward import is_peer
from llmendpoints_runtime.pod.jobs import (
    EVERY,
    decode_call,
    decode_reply,
    encode_call,
    encode_reply,
    job_id_suffix,
    merge,
    route,
)


def board(count: int = 2) -> PodBoard:
    return PodBoard.create(count, multiprocessing.get_context("spawn"))


READY, INIT = EngineState.READY, EngineState.INITIALIZING


def rows(*states: EngineState, beat: float = 100.0, phase: str | None = None) -> list[Row]:
    return [Row(i, s, phase if s is INIT else None, beat) for i, s in enumerate(states)]


def test_the_pod_is_ready_when_every_process_is():
    assert pod_readiness(None, False, rows(READY, READY), 100.0, strict=True).status == 200
    loading = pod_readiness(None, False, rows(READY, INIT, phase="load"), 100.0, strict=False)
    assert (loading.status, loading.body["phase"]) == (204, "load")
    assert pod_readiness(None, False, rows(READY, INIT), 100.0, strict=True).status == 503
    draining = pod_readiness(None, True, rows(READY, READY), 100.0, strict=False)
    assert draining.body["status"] == "draining" and draining.status == 503


def test_a_failed_or_stuck_pod_is_not_live():
    failed = pod_liveness("the engine core process died", rows(READY, READY), 100.0)
    assert failed.status == 503 and failed.body["reason"] == "the engine core process died"
    stuck = pod_liveness(None, rows(READY, READY, beat=10.0), 10.0 + STALE_AFTER_SECONDS + 1)
    assert stuck.status == 503 and "API process 0 has not refreshed" in stuck.body["reason"]
    ready = pod_readiness("gone", False, rows(READY, READY), 100.0, strict=False)
    assert ready.status == 503 and ready.body["reason"] == "gone"
    # A process not started yet (no heartbeat) is not "stuck".
    assert pod_liveness(None, rows(INIT, INIT, beat=0.0), 1e9).status == 200


def test_the_board_keeps_the_first_failure_and_sums_rows():
    shared = board()
    shared.set(0, "queue", 3)
    shared.set(1, "queue", 4)
    assert shared.total("queue") == 7
    shared.fail("first")
    shared.fail("second")
    assert shared.failure == "first"
    shared.publish_state(1, READY, None)
    assert [r.state for r in shared.rows()] == [INIT, READY]


def test_the_signals_never_count_twice():
    assert split_signals(waiting=2, handed=5, engine_waiting=3) == (5, 2)
    assert split_signals(waiting=0, handed=1, engine_waiting=4) == (1, 0)


async def test_admission_holds_for_the_pod_not_per_process():
    shared = board()
    first = PodAdmission(shared, 0, limit=2, max_waiting=1)
    second = PodAdmission(shared, 1, limit=2, max_waiting=1)
    assert await first.acquire() == 1
    assert await second.acquire() == 1
    # The pod is full: the next waits (in either process), one more is refused.
    waiter = asyncio.ensure_future(first.acquire())
    await asyncio.sleep(0.05)
    assert not waiter.done() and first.waiting == 1 and second.pod_waiting == 1
    with pytest.raises(RateLimitError) as refused:
        await second.acquire()
    assert "MAX_QUEUE_LENGTH" in refused.value.message
    # A slot freed in the other process is taken by the waiter.
    second.release()
    assert await asyncio.wait_for(waiter, 2) == 1
    assert (shared.total("adm_running"), shared.total("adm_waiting")) == (2, 0)


async def test_a_cancelled_waiter_gives_its_place_back():
    shared = board()
    first = PodAdmission(shared, 0, limit=1, max_waiting=5)
    await first.acquire()
    waiter = asyncio.ensure_future(PodAdmission(shared, 1, limit=1, max_waiting=5).acquire())
    await asyncio.sleep(0.02)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert shared.total("adm_waiting") == 0
    first.release()
    assert shared.total("adm_running") == 0


def call(verb: str, job_id: str | None = None, **kw) -> JobCall:
    method = "GET" if verb in ("status", "stream", "health") else "POST"
    return JobCall(method=method, verb=verb, caller="alice", job_id=job_id, **kw)


def test_job_verbs_go_to_the_process_that_holds_the_job():
    assert route(call("status", "abc" + job_id_suffix(1)), index=0, count=2) == 1
    assert route(call("cancel", "abc-p0"), index=1, count=2) == 0
    assert route(call("status", "not-ours"), index=1, count=2) == 1  # the local 404
    assert route(call("status", "abc-p7"), index=1, count=2) == 1
    assert route(call("run"), index=1, count=2) == 1
    assert route(call("runsync"), index=0, count=2) == 0
    assert route(call("purge-queue"), index=0, count=2) == EVERY
    assert route(call("health"), index=0, count=2) == EVERY
    keyed = {route(call("run", idempotency_key="k1"), index=i, count=2) for i in (0, 1)}
    assert len(keyed) == 1  # one owner for a key, wherever the repeat lands


def test_calls_and_replies_cross_the_socket_unchanged():
    original = call("run", body=b'{"input": {"prompt": "\xc3\xa9"}}', idempotency_key="k")
    assert decode_call(encode_call(original)) == original
    reply = JobReply(429, {"error": {"message": "full"}}, {"retry-after": "1"})
    assert decode_reply(encode_reply(reply)) == reply


def test_every_process_answers_purge_and_health_summed():
    purged = merge("purge-queue", [JobReply(200, {"removed": 2}), JobReply(200, {"removed": 3})])
    assert purged.body["removed"] == 5
    health = merge(
        "health",
        [
            JobReply(200, {"jobs": {"completed": 1, "inQueue": 2}, "workers": {"ready": 1}}),
            JobReply(200, {"jobs": {"completed": 4, "inQueue": 0}, "workers": {"ready": 1}}),
        ],
    )
    assert health.body["jobs"] == {"completed": 5, "inQueue": 2}
    assert health.body["workers"] == {"ready": 1}  # one pod, one worker
    failed = merge("health", [JobReply(200, {"jobs": {}}), JobReply(503, {"error": {}})])
    assert failed.status == 503


def test_only_the_pods_own_processes_pass_requests_unrecounted():
    token = "s3cret"
    assert is_peer({"headers": [(b"x-llmep-peer", b"s3cret")]}, token)
    assert not is_peer({"headers": [(b"x-llmep-peer", b"guess")]}, token)
    assert not is_peer({"headers": []}, token)
