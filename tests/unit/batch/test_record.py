"""A batch's state machine, its timestamps and counts, and how each API shows it."""

from __future__ import annotations

import pytest
from llmendpoints_common.batch import record as r
from llmendpoints_common.batch.record import BatchRecord, BatchStatus, Conflict, Estimate

T0 = 1_000_000.0


def openai_batch(**update) -> BatchRecord:
    base = BatchRecord(
        id=r.new_batch_id(),
        api="openai",
        owner="alice",
        created_at=T0,
        expires_at=T0 + 86_400,
        completion_window="24h",
        status=BatchStatus.VALIDATING,
        openai_endpoint="/v1/chat/completions",
        input_file_id="file-" + "0" * 32,
        metadata={"k": "v"},
        tokens=500,
    )
    return base.model_copy(update=update)


def runpod_draft(**update) -> BatchRecord:
    base = BatchRecord(
        id=r.new_batch_id(),
        api="runpod",
        owner="alice",
        created_at=T0,
        expires_at=T0 + 86_400,
        completion_window="24h",
        status=BatchStatus.DRAFT,
        endpoint="ns/chat",
    )
    return base.model_copy(update=update)


def running(**update) -> BatchRecord:
    return r.validated(
        openai_batch(),
        now=T0 + 1,
        total=10,
        parts=[10],
        part_ids=["0"],
        parts_bytes=100,
        model="m",
        endpoint="ns/chat",
        tokens=400,
    ).model_copy(update=update)


def test_ids_are_opaque_and_line_job_ids_fixed_by_batch_and_index():
    batch_id = r.new_batch_id()
    assert batch_id.startswith("batch_") and len(batch_id) == 6 + 32
    assert r.line_job_id(batch_id, 7) == f"{batch_id[6:]}-7" == r.line_job_id(batch_id, 7)
    assert r.new_batch_id() != batch_id


def test_the_happy_path_sets_every_timestamp_in_order():
    batch = running()
    assert (batch.status, batch.in_progress_at, batch.total, batch.endpoint) == (
        BatchStatus.IN_PROGRESS, T0 + 1, 10, "ns/chat"
    )  # fmt: skip
    batch = r.progress(batch, cursor=10, completed=9, failed=1, running=0, estimate=None)
    batch = r.begin_finalizing(batch, now=T0 + 5, output_file_id="file-o", error_file_id="file-e")
    assert (batch.status, batch.finalizing_at) == (BatchStatus.FINALIZING, T0 + 5)
    done = r.finished(
        batch, now=T0 + 6, completed=9, failed=1, input_tokens=30, output_tokens=20,
        output_file_id="file-o", error_file_id="file-e",
    )  # fmt: skip
    assert (done.status, done.completed_at, done.tokens, done.parts_bytes) == (
        BatchStatus.COMPLETED, T0 + 6, 0, 0
    )  # fmt: skip
    assert done.kept_until == T0 + 6 + done.output_ttl_seconds
    assert not done.active and done.ended_at == T0 + 6
    shown = r.openai_object(done)
    assert shown["status"] == "completed"
    assert shown["request_counts"] == {"total": 10, "completed": 9, "failed": 1}
    assert [shown[k] for k in ("created_at", "in_progress_at", "finalizing_at", "completed_at")] == [
        int(T0), int(T0 + 1), int(T0 + 5), int(T0 + 6)
    ]  # fmt: skip
    assert shown["usage"]["total_tokens"] == 50
    assert (shown["output_file_id"], shown["error_file_id"]) == ("file-o", "file-e")


def test_validation_failure_ends_the_batch_with_its_errors():
    errors = [{"code": "invalid_json_line", "message": "x", "param": None, "line": 3}]
    failed = r.validation_failed(openai_batch(), errors, now=T0 + 2, model="m")
    assert (failed.status, failed.failed_at, failed.tokens) == (BatchStatus.FAILED, T0 + 2, 0)
    assert r.openai_object(failed)["errors"] == {"object": "list", "data": errors}
    with pytest.raises(Conflict):
        r.validated(failed, now=T0, total=1, parts=[1], part_ids=["0"], parts_bytes=1,
                    model="m", endpoint="ns/chat", tokens=1)  # fmt: skip


def test_cancel_goes_through_cancelling_and_keeps_what_finished():
    batch = r.request_cancel(running(), now=T0 + 3)
    assert (batch.status, batch.cancelling_at, batch.ending) == (
        BatchStatus.CANCELLING, T0 + 3, "cancelled"
    )  # fmt: skip
    assert r.request_cancel(batch, now=T0 + 9) == batch  # a second cancel changes nothing
    batch = r.begin_finalizing(batch, now=T0 + 4, output_file_id="o", error_file_id="e")
    assert batch.status is BatchStatus.CANCELLING and batch.finalizing_at == T0 + 4
    done = r.finished(batch, now=T0 + 5, completed=2, failed=8, input_tokens=0,
                      output_tokens=0, output_file_id="o", error_file_id="e")  # fmt: skip
    assert (done.status, done.cancelled_at) == (BatchStatus.CANCELLED, T0 + 5)
    with pytest.raises(Conflict, match="only a batch that is validating or in_progress"):
        r.request_cancel(done, now=T0 + 6)


def test_a_validating_batch_can_be_cancelled_a_finalizing_one_cannot():
    assert r.request_cancel(openai_batch(), now=T0).status is BatchStatus.CANCELLING
    finalizing = r.begin_finalizing(running(), now=T0, output_file_id="o", error_file_id="e")
    with pytest.raises(Conflict):
        r.request_cancel(finalizing, now=T0)


def test_expiry_marks_a_running_batch_then_ends_it_expired():
    batch = r.expire(running(), now=T0 + 86_400)
    assert batch.status is BatchStatus.IN_PROGRESS and batch.ending == "expired"
    assert r.expire(batch, now=T0 + 90_000) == batch
    with pytest.raises(Conflict, match="expiring"):
        r.request_cancel(batch, now=T0)
    batch = r.begin_finalizing(batch, now=T0 + 86_401, output_file_id="o", error_file_id="e")
    assert batch.status is BatchStatus.IN_PROGRESS  # no finalizing status for an expiry
    done = r.finished(batch, now=T0 + 86_402, completed=1, failed=9, input_tokens=0,
                      output_tokens=0, output_file_id=None, error_file_id="e")  # fmt: skip
    assert (done.status, done.expired_at) == (BatchStatus.EXPIRED, T0 + 86_402)
    assert r.openai_object(done)["output_file_id"] is None


def test_a_batch_that_never_started_expires_at_once():
    done = r.expire(openai_batch(), now=T0 + 86_400)
    assert (done.status, done.expired_at) == (BatchStatus.EXPIRED, T0 + 86_400)
    assert done.errors[0]["code"] == "batch_expired"


def test_files_are_shown_only_once_the_batch_ended():
    batch = r.begin_finalizing(running(), now=T0, output_file_id="o", error_file_id="e")
    assert r.openai_object(batch)["output_file_id"] is None


def test_the_estimate_is_shown_in_metadata_while_the_batch_runs():
    batch = running(estimate=Estimate(rate=2.0, finish_at=T0 + 100, on_schedule=False))
    shown = r.openai_object(batch)
    assert shown["metadata"] == {
        "k": "v",
        r.ESTIMATE_KEY: str(int(T0 + 100)),
        r.ON_SCHEDULE_KEY: "false",
    }
    assert r.openai_object(openai_batch())["metadata"] == {"k": "v"}


def test_runpod_drafts_take_parts_lose_requests_and_finalize():
    draft = r.add_part(runpod_draft(), "p1", 3, tokens=30, size=300)
    draft = r.add_part(draft, "p2", 2, tokens=20, size=200)
    assert (draft.parts, draft.part_ids, draft.total, draft.tokens, draft.parts_bytes) == (
        [3, 2], ["p1", "p2"], 5, 50, 500
    )  # fmt: skip
    draft = r.remove_request(draft, 4)
    assert (draft.total, draft.removed) == (4, [4])
    with pytest.raises(KeyError):
        r.remove_request(draft, 4)  # already gone
    with pytest.raises(KeyError):
        r.remove_request(draft, 5)  # never there
    with pytest.raises(Conflict, match="no request"):
        r.finalize_draft(runpod_draft(), now=T0)
    live = r.finalize_draft(draft, now=T0 + 1)
    assert (live.status, live.in_progress_at) == (BatchStatus.IN_PROGRESS, T0 + 1)
    with pytest.raises(Conflict, match="only while it is DRAFT"):
        r.add_part(live, "p3", 1, tokens=1, size=1)
    with pytest.raises(Conflict):
        r.finalize_draft(live, now=T0)


def test_a_draft_cancelled_ends_at_once():
    done = r.request_cancel(r.add_part(runpod_draft(), "p", 1, 1, 1), now=T0 + 1)
    assert (done.status, done.cancelled_at, done.parts_bytes) == (BatchStatus.CANCELLED, T0 + 1, 0)


@pytest.mark.parametrize(
    ("status", "shown"),
    [
        (BatchStatus.DRAFT, "DRAFT"),
        (BatchStatus.IN_PROGRESS, "FINALIZED"),
        (BatchStatus.FINALIZING, "FINALIZED"),
        (BatchStatus.COMPLETED, "FINALIZED"),
        (BatchStatus.CANCELLING, "FINALIZED"),
        (BatchStatus.CANCELLED, "CANCELLED"),
        (BatchStatus.FAILED, "FAILED"),
        (BatchStatus.EXPIRED, "FAILED"),
    ],
)
def test_runpod_shows_its_four_states(status, shown):
    summary = r.runpod_summary(runpod_draft(status=status, total=5, completed=2, failed=1, running=1), "chat")  # fmt: skip
    assert summary["status"] == shown
    assert (summary["requestTotal"], summary["requestCompleted"], summary["requestFailed"]) == (5, 2, 1)  # fmt: skip
    assert summary["requestInProgress"] == (1 if not status.ended else 0)
    assert summary["createdAt"] == int(T0 * 1000) and summary["endpointId"] == "chat"


def test_leases_keep_one_driver_at_a_time():
    batch = r.take_lease(running(), holder="g1", now=T0, seconds=20)
    assert (batch.driver, batch.lease_until) == ("g1", T0 + 20)
    assert r.take_lease(batch, holder="g1", now=T0 + 5, seconds=20).lease_until == T0 + 25
    with pytest.raises(Conflict, match="driven by g1"):
        r.take_lease(batch, holder="g2", now=T0 + 10, seconds=20)
    assert r.take_lease(batch, holder="g2", now=T0 + 21, seconds=20).driver == "g2"


def test_records_round_trip_and_ignore_fields_they_do_not_know():
    batch = running(estimate=Estimate(rate=1.0))
    assert BatchRecord.decode(batch.encode()) == batch
    newer = batch.encode()[:-1] + b', "from_the_future": 1}'
    assert BatchRecord.decode(newer) == batch


def test_storage_failure_fails_the_batch_saying_so():
    failed = r.storage_failed(running(), "the store is full", now=T0 + 9)
    assert failed.status is BatchStatus.FAILED and failed.errors[0]["code"] == "storage_full"
