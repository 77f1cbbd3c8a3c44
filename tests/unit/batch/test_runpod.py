"""RunPod's batch request shapes, field for field (docs.runpod.io/serverless/batch-jobs)."""

from __future__ import annotations

import pytest
from llmendpoints_common.batch import runpod
from llmendpoints_common.batch.limits import BatchLimits
from llmendpoints_common.errors import BadRequestError
from llmendpoints_common.jobs.models import JobLimits

LIMITS = BatchLimits()


def test_create_takes_runpods_array_or_an_object_with_name_and_webhook():
    created = runpod.parse_create([{"input": {"prompt": "a"}}], LIMITS, None)
    assert created.requests == [{"input": {"prompt": "a", "apply_chat_template": False,
                                            "sampling_params": {}, "stream": False},
                                 "policy": {"lowPriority": False}}]  # fmt: skip
    assert runpod.parse_create([], LIMITS, None).requests == []
    named = runpod.parse_create(
        {"requests": [], "name": "nightly", "webhook": "https://hook.example/x"}, LIMITS, None
    )
    assert (named.name, named.webhook) == ("nightly", "https://hook.example/x")


def test_worker_vllm_route_spelling_is_an_openai_request():
    created = runpod.parse_create(
        [{"input": {"route": "/v1/completions", "body": {"model": "m", "prompt": "x"}}}],
        LIMITS,
        None,
    )
    assert created.requests[0]["input"]["openai_route"] == "/v1/completions"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ("nope", None),
        ({"requests": [], "colour": 1}, "colour"),
        ([1], "requests[0]"),
        ([{"input": {"prompt": "a"}, "webhook": "https://x"}], "requests[0].webhook"),
        ([{"inpt": {}}], "requests[0].inpt"),
        ([{}], "requests[0].input"),
        ([{"input": {}}], "requests[0].input"),
        ([{"input": {"prompt": 3}}], "requests[0].input.prompt"),
        ([{"input": {"prompt": "a"}, "policy": {"ttl": 20000}}], "requests[0].policy.ttl"),
        (
            [{"input": {"prompt": "a"}, "policy": {"executionTimeout": 1}}],
            "requests[0].policy.executionTimeout",
        ),
        (
            [{"input": {"prompt": "a", "sampling_params": {"n": 99}}}],
            "requests[0].input.sampling_params.n",
        ),
        ([{"input": {"route": 5}}], "requests[0].input.route"),
        ({"requests": [], "name": 5}, "name"),
        ({"requests": [], "webhook": "ftp://x"}, "webhook"),
    ],
)
def test_a_bad_request_is_a_400_naming_its_place(body, param):
    with pytest.raises(BadRequestError) as caught:
        runpod.parse_create(body, LIMITS, JobLimits())
    assert caught.value.param == param
    if param:
        assert param.split(".")[0].split("[")[0] in caught.value.message


def test_a_request_larger_than_a_line_is_refused():
    small = BatchLimits(max_line_bytes=50)
    with pytest.raises(BadRequestError, match="LLMEP_BATCH_MAX_LINE_BYTES"):
        runpod.parse_create([{"input": {"prompt": "x" * 100}}], small, None)


def test_append_and_update_bodies():
    assert len(runpod.parse_append({"requests": [{"input": {"prompt": "a"}}]}, LIMITS, None)) == 1
    for bad in ([], {"requests": [], "more": 1}, {"other": 1}):
        with pytest.raises(BadRequestError):
            runpod.parse_append(bad, LIMITS, None)
    assert runpod.parse_update({"name": "n", "webhook": None}) == {"name": "n", "webhook": None}
    with pytest.raises(BadRequestError, match="name and webhook"):
        runpod.parse_update({"status": "DRAFT"})


def test_pages_default_and_bounds():
    assert runpod.page({}) == (0, 50)
    assert runpod.page({"offset": "100", "limit": "10"}) == (100, 10)
    for bad in ({"limit": "0"}, {"limit": "1001"}, {"offset": "-1"}, {"limit": "x"}):
        with pytest.raises(BadRequestError):
            runpod.page(bad)
