"""The pure rules for a job record's state changes (no NATS needed)."""

from __future__ import annotations

import pytest
from llmendpoints_common.identity import EndpointRef
from llmendpoints_common.jobs.models import JobStatus
from llmendpoints_common.jobs.record import (
    Conflict,
    JobRecord,
    cancel,
    claim,
    finish,
    gave_up_error,
    out_of_attempts,
    requeue_for_retry,
)
from llmendpoints_common.jobs.service import status_body
from llmendpoints_common.queue import names


def record(**fields) -> JobRecord:
    base = dict(
        id="j1",
        endpoint="ep",
        owner="alice",
        request={"input": {"prompt": "x"}, "policy": {"lowPriority": True, "executionTimeout": 5}},
        sync=False,
        submitted_at=100.0,
        retention_seconds=60,
    )
    return JobRecord(**{**base, **fields})


def test_claim_starts_an_attempt_and_a_takeover_keeps_the_start_time() -> None:
    first = claim(record(), now=101.0, worker="pod-a")
    assert (first.status, first.attempt, first.tries, first.started_at, first.worker) == (
        JobStatus.IN_PROGRESS,
        1,
        1,
        101.0,
        "pod-a",
    )
    takeover = claim(first, now=140.0, worker="pod-b")
    assert (takeover.attempt, takeover.tries, takeover.started_at) == (2, 2, 101.0)
    assert takeover.engine_request_id == "job-j1-2"
    with pytest.raises(Conflict):
        claim(finish(takeover, JobStatus.COMPLETED, now=150.0), now=151.0, worker="pod-c")


def test_a_superseded_attempt_cannot_end_the_job() -> None:
    first = claim(record(), now=101.0, worker="pod-a")
    second = claim(first, now=140.0, worker="pod-b")
    with pytest.raises(Conflict):
        finish(second, JobStatus.COMPLETED, now=150.0, attempt=1, output="late")
    done = finish(second, JobStatus.COMPLETED, now=150.0, attempt=2, output="ok")
    assert (done.status, done.output, done.finished_at) == (JobStatus.COMPLETED, "ok", 150.0)
    with pytest.raises(Conflict):
        finish(done, JobStatus.FAILED, now=151.0)


def test_only_completed_jobs_keep_output() -> None:
    running = claim(record(), now=101.0, worker="w")
    failed = finish(running, JobStatus.FAILED, now=102.0, output="x", error={"message": "m"})
    assert failed.output is None and failed.error == {"message": "m"}


def test_cancel_rules() -> None:
    queued = cancel(record(), now=101.0)
    assert queued.status is JobStatus.CANCELLED and queued.started_at is None
    with pytest.raises(Conflict, match="only IN_QUEUE or IN_PROGRESS"):
        cancel(queued, now=102.0)


def test_retry_starts_a_new_run_with_fresh_attempts() -> None:
    running = claim(claim(record(), now=101.0, worker="a"), now=110.0, worker="b")
    failed = finish(running, JobStatus.FAILED, now=120.0, error={"message": "m"})
    again = requeue_for_retry(failed)
    assert (again.status, again.tries, again.runs, again.attempt) == (JobStatus.IN_QUEUE, 0, 2, 2)
    assert again.started_at is None and again.error is None
    with pytest.raises(Conflict, match="only FAILED or TIMED_OUT"):
        requeue_for_retry(again)


def test_attempt_bound_and_its_message() -> None:
    third = claim(claim(claim(record(), now=1, worker="a"), now=2, worker="b"), now=3, worker="c")
    assert not out_of_attempts(claim(record(), now=1, worker="a"), 3)
    assert out_of_attempts(third, 3)
    error = gave_up_error(third, 3)
    assert error["code"] == "attempts_exhausted"
    assert "attempted 3 times" in error["message"] and "on c" in error["message"]


def test_policy_views_and_status_body() -> None:
    job = record()
    assert job.low_priority and job.execution_timeout_ms == 5 and job.webhook is None
    done = finish(claim(job, now=100.5, worker="pod-a"), JobStatus.COMPLETED, now=101.0, output=[1])
    assert status_body(done) == {
        "id": "j1",
        "status": "COMPLETED",
        "output": [1],
        "delayTime": 500,
        "executionTime": 500,
        "workerId": "pod-a",
    }
    assert JobRecord.decode(done.encode()) == done


def test_names_are_one_to_one_and_refuse_what_would_break_subjects() -> None:
    # Every subject of an endpoint's queue is under its own prefix; its two streams carry it.
    assert names.record_subject("ns/a.b", "j-1") == "llmep.ep.ns.a_b.rec.j-1"
    assert names.records_stream("ns/a.b") == "LLMEP_RECORDS_ns_a_b"
    assert names.queue_stream("ns/a.b") == "LLMEP_QUEUE_ns_a_b"
    for stream in (names.records_stream("ns/a.b"), names.queue_stream("ns/a.b")):
        assert names.endpoint_of_stream(stream) == EndpointRef("ns", "a.b")
    # "a-b" + "c" and "a" + "b-c" stay apart: a namespace holds no '_'.
    assert names.records_stream("a-b/c") != names.records_stream("a/b-c")
    assert names.jobs_filter("ns/ep") == "llmep.ep.ns.ep.jobs.>"
    assert names.chunk_subject("ns/ep", "j-1", 2, 5) == "llmep.ep.ns.ep.chunk.j-1.2.5"
    assert names.admission_subject("ns/ep", "j-1", "gw") == "llmep.ep.ns.ep.adm.gw.j-1"
    assert names.job_of_record_subject("ns/ep", "llmep.ep.ns.ep.rec.j-1") == "j-1"
    assert names.job_of_record_subject("ns/ep", "llmep.ep.ns.other.rec.j-1") is None
    # Jobs are queued per owner (the per-owner cap is the stream's per-subject limit).
    alice = names.jobs_subject("ns/ep", "low", "alice")
    assert alice == f"llmep.ep.ns.ep.jobs.low.{names.tenant_token('alice')}"
    assert alice != names.jobs_subject("ns/ep", "low", "bob")
    assert names.jobs_subject("ns/ep", "low", "a.b *>").count(".") == 6
    assert names.jobs_consumer_filter("ns/ep", "low") == "llmep.ep.ns.ep.jobs.low.*"
    assert names.priority_of_jobs_subject(alice) == "low"
    with pytest.raises(ValueError):
        names.priority_of_jobs_subject("llmep.ep.ns.ep.chunk.j.1.normal")
    with pytest.raises(ValueError):
        names.idempotency_subject("ns/ep", "not-hex")
    with pytest.raises(ValueError):
        names.record_subject("ns/ep", "a.b")  # a '.' would split the subject
    with pytest.raises(ValueError):
        names.admission_subject("ns/ep", "j-1", "anyone")
    with pytest.raises(ValueError, match="too long"):
        names.records_stream(f"ns/{'x' * 250}")


def test_a_stopped_job_keeps_what_it_used_for_one_run() -> None:
    from llmendpoints_common.jobs.record import JobUsage, with_usage

    used = JobUsage(prompt_tokens=4, completion_tokens=9)
    running = claim(record(), now=101.0, worker="w")
    timed_out = finish(running, JobStatus.TIMED_OUT, now=102.0, attempt=1, usage=used)
    assert timed_out.usage == used and status_body(timed_out)["usage"] == {"input": 4, "output": 9}
    # A completed job's usage is its output's; a retried job starts its new run with none.
    assert finish(running, JobStatus.COMPLETED, now=102.0, output=[], usage=used).usage is None
    assert requeue_for_retry(timed_out).usage is None
    # Whoever cancels writes the end; the attempt's worker adds its usage, once, its own only.
    cancelled = cancel(running, now=102.0)
    assert cancelled.usage is None and "usage" not in status_body(cancelled)
    billed = with_usage(cancelled, used, attempt=1)
    assert billed.usage == used
    for refused in (
        lambda: with_usage(billed, used, attempt=1),
        lambda: with_usage(cancelled, used, attempt=2),
        lambda: with_usage(running, used, attempt=1),
    ):
        with pytest.raises(Conflict):
            refused()
