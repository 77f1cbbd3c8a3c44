"""Each request's line in the output or the error file, whatever happened to it; RunPod's
view of the same request."""

from __future__ import annotations

from llmendpoints_common.batch.output import (
    NOT_QUEUED,
    LineOutcome,
    encode_line,
    error_status,
    openai_line,
    runpod_request,
    usage_of,
)
from llmendpoints_common.errors import BadRequestError, RateLimitError
from llmendpoints_common.jobs.models import JobStatus

JOB = "0123abcd-7"
ANSWER = {"object": "chat.completion", "usage": {"prompt_tokens": 5, "completion_tokens": 3}}


def test_an_answer_goes_to_the_output_file_as_openai_writes_it():
    good, line = openai_line(JOB, "c7", LineOutcome(JobStatus.COMPLETED, output=ANSWER), None)
    assert good
    assert line == {
        "id": "batch_req_0123abcd_7",
        "custom_id": "c7",
        "response": {"status_code": 200, "request_id": "req_0123abcd_7", "body": ANSWER},
        "error": None,
    }
    assert encode_line(line).endswith(b"\n") and b"\n" not in encode_line(line)[:-1]


def test_an_error_answer_goes_to_the_error_file_with_its_status_and_body():
    error = BadRequestError("max_tokens: too many", param="max_tokens").to_error()
    good, line = openai_line(JOB, "c", LineOutcome(JobStatus.FAILED, error=error), None)
    assert not good
    assert line["response"]["status_code"] == 400
    assert line["response"]["body"] == {"error": error}
    assert line["error"] is None


def test_requests_never_answered_say_why():
    for outcome, ending, code in [
        (NOT_QUEUED, "expired", "batch_expired"),
        (LineOutcome(JobStatus.CANCELLED), "expired", "batch_expired"),
        (NOT_QUEUED, "cancelled", "batch_cancelled"),
        (LineOutcome(JobStatus.CANCELLED), "cancelled", "batch_cancelled"),
        (LineOutcome(JobStatus.TIMED_OUT, error={"message": "ran out"}), None, "request_timeout"),
    ]:
        good, line = openai_line(JOB, "c", outcome, ending)
        assert not good and line["response"] is None
        assert line["error"]["code"] == code and line["error"]["message"]


def test_error_status_reads_the_code_or_the_type():
    assert error_status(RateLimitError("slow down").to_error()) == 429
    assert error_status({"type": "NotFoundError", "code": "model_not_found"}) == 404
    assert error_status({"message": "?"}) == 500
    assert error_status(None) == 500


def test_usage_of_openai_answers_and_of_prompt_jobs():
    assert usage_of(ANSWER) == (5, 3)
    batches = [{"usage": {"input": 4, "output": 2}}, {"usage": {"input": 4, "output": 7}}]
    assert usage_of(batches) == (4, 7)  # the last usage is cumulative
    assert usage_of("text") == (0, 0) and usage_of({"usage": "?"}) == (0, 0)


def test_runpod_requests_show_status_output_or_error_and_times():
    done = LineOutcome(JobStatus.COMPLETED, output=[1], started_at=0.0, finished_at=1.5)
    assert runpod_request(JOB, done, None) == {
        "id": JOB,
        "status": "COMPLETED",
        "output": [1],
        "startedAt": "1970-01-01T00:00:00Z",
        "completedAt": "1970-01-01T00:00:01Z",
    }
    failed = LineOutcome(JobStatus.FAILED, error={"message": "Handler raised"})
    assert runpod_request(JOB, failed, None)["error"] == "Handler raised"
    assert runpod_request(JOB, NOT_QUEUED, None) == {"id": JOB, "status": "IN_QUEUE"}
    cancelled = runpod_request(JOB, NOT_QUEUED, "cancelled")
    assert cancelled["status"] == "CANCELLED" and "cancelled" in cancelled["error"]
