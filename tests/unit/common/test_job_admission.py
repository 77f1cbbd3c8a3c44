"""What a job may be billed at most, and whether a finished record is billed (pure:
jobs/admission.py). A pod writes its endpoint's records at will; the meter believes a record only
as far as its admission, written by whoever accepted the job."""

from __future__ import annotations

import pytest
from llmendpoints_common.jobs import admission
from llmendpoints_common.jobs.admission import (
    MEDIA_TOKENS,
    TEMPLATE_TOKENS,
    UNSET_MAX_TOKENS,
    JobAdmission,
    bounds,
    endpoint_key_name,
    judge,
)
from llmendpoints_common.jobs.models import JobStatus
from llmendpoints_common.jobs.record import JobRecord

EP = "team-a/chat"


def record(**fields) -> JobRecord:
    base = dict(id="j-1", endpoint=EP, owner="alice", request={"input": {"prompt": "hi"}},
                sync=False, submitted_at=100.0, retention_seconds=60.0,
                status=JobStatus.COMPLETED)  # fmt: skip
    return JobRecord(**{**base, **fields})


def admitted(**fields) -> JobAdmission:
    base = dict(id="j-1", endpoint=EP, owner="alice", by="gateway", prompt_tokens=100,
                completion_tokens=50, admitted_at=100.0, expires_at=1000.0)  # fmt: skip
    return JobAdmission(**{**base, **fields})


def text_bytes(job_input) -> int:
    import json

    return len(json.dumps(job_input, ensure_ascii=False).encode())


def test_a_prompt_job_is_bounded_by_its_bytes_and_n_times_max_tokens():
    job_input = {"prompt": "héllo", "sampling_params": {"max_tokens": 16, "n": 3}}
    assert bounds({"input": job_input}) == (text_bytes(job_input) + TEMPLATE_TOKENS, 48)
    # Values read as vLLM reads them ("16" is 16); best_of counts like n.
    lax = {"prompt": "x", "sampling_params": {"max_tokens": "16", "best_of": 4}}
    assert bounds({"input": lax})[1] == 64
    # No max_tokens: the front door does not know the model's context.
    assert bounds({"input": {"prompt": "x"}})[1] == UNSET_MAX_TOKENS


def test_openai_routes_are_bounded_as_the_engine_runs_them():
    chat = {"openai_route": "/v1/chat/completions",
            "openai_input": {"messages": [{"role": "user", "content": "hi"}],
                             "max_completion_tokens": 10, "max_tokens": 99, "n": 2}}  # fmt: skip
    assert bounds({"input": chat})[1] == 20  # max_completion_tokens wins, as in vLLM
    prompts = {"openai_route": "/v1/completions",
               "openai_input": {"prompt": ["a", "b", "c"], "max_tokens": 5}}  # fmt: skip
    assert bounds({"input": prompts})[1] == 15
    embeddings = {"openai_route": "/v1/embeddings", "openai_input": {"input": "x"}}
    assert bounds({"input": embeddings})[1] == 0
    responses = {"openai_route": "/v1/responses",
                 "openai_input": {"input": "x", "max_output_tokens": 7}}  # fmt: skip
    assert bounds({"input": responses})[1] == 7


def test_images_audio_and_video_each_bring_their_allowance():
    content = [
        {"type": "text", "text": "what is in these?"},
        {"type": "image_url", "image_url": {"url": "https://x/a.png"}},
        {"type": "input_audio", "input_audio": {"data": "...", "format": "wav"}},
        {"type": "video_url", "video_url": {"url": "https://x/v.mp4"}},
    ]
    job_input = {"messages": [{"role": "user", "content": content}],
                 "sampling_params": {"max_tokens": 1}}  # fmt: skip
    prompt, _ = bounds({"input": job_input})
    assert prompt == text_bytes(job_input) + TEMPLATE_TOKENS + 3 * MEDIA_TOKENS


def test_what_the_front_door_admits_carries_the_bounds_owner_and_runs():
    job = record(request={"input": {"prompt": "hi", "sampling_params": {"max_tokens": 8}}},
                 status=JobStatus.IN_QUEUE, batch="batch_" + "0" * 32)  # fmt: skip
    made = admission.admit(job, by=admission.GATEWAY, now=100.0, life_seconds=50.0)
    assert (made.owner, made.endpoint, made.by, made.runs, made.billed_runs) == (
        "alice", EP, "gateway", 1, 0)  # fmt: skip
    assert made.completion_tokens == 8 and made.expires_at == 150.0 and made.batch
    assert JobAdmission.decode(made.encode()) == made
    with pytest.raises(ValueError):
        admission.admit(job, by="someone", now=1.0, life_seconds=1.0)


def test_a_record_that_agrees_with_a_gateway_admission_bills_its_key():
    verdict = judge(record(), stored_endpoint=EP, stored_id="j-1", admission=admitted(),
                    prompt_tokens=100, completion_tokens=50)  # fmt: skip
    assert (verdict.key, verdict.gateway_key, verdict.batch) == ("alice", True, False)


def test_a_job_accepted_at_a_pod_bills_the_endpoints_own_name_never_a_gateway_key():
    verdict = judge(record(owner="victim"), stored_endpoint=EP, stored_id="j-1",
                    admission=admitted(by="endpoint", owner="victim"),
                    prompt_tokens=1, completion_tokens=1)  # fmt: skip
    assert verdict.key == endpoint_key_name(EP, "victim") == "endpoint:team-a/chat:victim"
    assert not verdict.gateway_key


@pytest.mark.parametrize(
    ("job", "stored", "admission_", "tokens", "reason"),
    [
        (record(owner="victim"), EP, admitted(), (1, 1), "names owner 'victim'"),
        (record(), EP, None, (1, 1), "no admission"),
        (record(endpoint="team-b/chat"), EP, admitted(), (1, 1), "stored as"),
        (record(), EP, admitted(endpoint="team-b/chat"), (1, 1), "the admission is of"),
        (record(), EP, admitted(), (101, 1), "at most 100 and 50 admitted"),
        (record(), EP, admitted(), (1, 51), "at most 100 and 50 admitted"),
        (record(runs=2), EP, admitted(), (1, 1), "run 2 was not admitted"),
    ],
)
def test_a_record_that_disagrees_bills_nobody_and_says_why(job, stored, admission_, tokens, reason):
    verdict = judge(job, stored_endpoint=stored, stored_id="j-1", admission=admission_,
                    prompt_tokens=tokens[0], completion_tokens=tokens[1])  # fmt: skip
    assert not verdict.billable and reason in (verdict.reason or "")


def test_a_run_is_billed_once_whatever_is_written_after():
    once = admitted(runs=2, billed_runs=1)
    again = judge(record(runs=1), stored_endpoint=EP, stored_id="j-1", admission=once,
                  prompt_tokens=1, completion_tokens=1)  # fmt: skip
    assert not again.billable and again.reason is None  # routine: nothing logged
    second = judge(record(runs=2), stored_endpoint=EP, stored_id="j-1", admission=once,
                   prompt_tokens=1, completion_tokens=1)  # fmt: skip
    assert second.key == "alice"
