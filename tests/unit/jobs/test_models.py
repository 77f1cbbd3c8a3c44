import json

import pytest
from llmendpoints_common.errors import BadRequestError
from llmendpoints_runtime.jobs.models import JobStatus, parse_job_request


def rejected(body: bytes) -> BadRequestError:
    with pytest.raises(BadRequestError) as info:
        parse_job_request(body)
    assert info.value.status_code == 400
    return info.value


@pytest.mark.parametrize(
    ("body", "field", "words"),
    [
        (b'{"input": {"prompt": 5}}', "input.prompt", "valid string"),
        (b'{"input": {"messages": "x"}}', "input.messages", "valid list"),
        (b'{"input": {"messages": [{"content": "hi"}]}}', "input.messages[0].role", "missing"),
        (b'{"input": {"prompt": "hi", "sampling_param": {}}}', "input.sampling_param", "unknown"),
        (b'{"input": {"prompt": "hi", "sampling_params": []}}', "input.sampling_params", "dict"),
        (b'{"input": {"prompt": "hi", "stream": "yes"}}', "input.stream", "boolean"),
        (b'{"input": {"prompt": "hi", "max_batch_size": 0}}', "input.max_batch_size", ">= 1"),
        (b'{"input": {"prompt": "hi"}, "policy": {"ttl": -5}}', "policy.ttl", ">= 1"),
        (
            b'{"input": {"prompt": "hi"}, "policy": {"executionTimeout": "1s"}}',
            "policy.executionTimeout",
            "integer",
        ),
        (b'{"input": {"prompt": "hi"}, "webhook": "ftp://x"}', "webhook", "http"),
        (b'{"input": {"prompt": "hi"}, "extra": 1}', "extra", "unknown"),
    ],
)
def test_bad_fields_are_named(body: bytes, field: str, words: str) -> None:
    error = rejected(body)
    assert error.param == field
    assert error.message.startswith(f"{field}:")
    assert words in error.message.replace("greater than or equal to", ">=")


@pytest.mark.parametrize(
    ("body", "words"),
    [
        (b"", "empty"),
        (b"{not json", "not valid JSON"),
        (b"[1, 2]", "JSON object, got an array"),
        (b'"text"', "JSON object, got a string"),
        (b"\xff\xfe{}", "not valid UTF-8"),
        (b"{}", "input: required field is missing"),
        (b'{"input": "hello"}', "input: must be a JSON object, got a string"),
        (b'{"input": {}}', "needs prompt"),
        (b'{"input": {"sampling_params": {"max_tokens": 5}}}', "needs prompt"),
        (b'{"input": {"messages": []}}', "must not be empty"),
        (
            b'{"input": {"prompt": "x", "min_batch_size": 9, "max_batch_size": 3}}',
            "must not exceed",
        ),
        (b'{"input": {"openai_route": "/v1/chat/completions"}}', "openai_input is required"),
        (b'{"input": {"openai_route": "/v2/other", "openai_input": {}}}', "not one of"),
        (b'{"input": {"prompt": "x", "openai_route": "/v1/completions"}}', "cannot be combined"),
        (b'{"input": {"openai_input": {"prompt": "x"}}}', "needs openai_route"),
    ],
)
def test_bad_bodies_say_what_is_wrong(body: bytes, words: str) -> None:
    assert words in rejected(body).message


def test_messages_win_over_prompt_and_defaults_apply() -> None:
    request = parse_job_request(
        b'{"input": {"prompt": "p", "messages": [{"role": "user", "content": "m"}]}}'
    )
    assert request.input.messages is not None and request.input.prompt == "p"
    assert request.input.stream is False
    assert request.input.sampling_params == {}
    assert request.policy.ttl is None and request.webhook is None


def test_openai_models_route_needs_no_input() -> None:
    request = parse_job_request(b'{"input": {"openai_route": "/v1/models"}}')
    assert request.input.is_openai


def test_content_parts_and_extra_message_keys_pass_to_the_engine() -> None:
    request = parse_job_request(
        b'{"input": {"messages": [{"role": "user", "name": "ann", "content": '
        b'[{"type": "text", "text": "hi"}]}]}}'
    )
    dumped = request.input.messages[0].model_dump(exclude_none=True)
    assert dumped == {"role": "user", "name": "ann", "content": [{"type": "text", "text": "hi"}]}


def test_final_states() -> None:
    assert {s for s in JobStatus if s.is_final} == {
        JobStatus.COMPLETED,
        JobStatus.FAILED,
        JobStatus.CANCELLED,
        JobStatus.TIMED_OUT,
    }


def test_worker_vllm_route_body_method_is_the_openai_route() -> None:
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    request = parse_job_request(
        json.dumps(
            {"input": {"route": "/v1/chat/completions", "body": chat, "method": "post"}}
        ).encode()
    )
    assert request.input.openai_route == "/v1/chat/completions"
    assert request.input.openai_input == chat and request.input.is_openai
    # method defaults as worker-vllm's does: POST with a body, GET without.
    models = parse_job_request(b'{"input": {"route": "/v1/models"}}')
    assert models.input.openai_route == "/v1/models" and models.input.openai_input is None


@pytest.mark.parametrize(
    ("body", "field", "words"),
    [
        ({"route": "/v1/models", "method": "POST"}, "input.method", "/v1/models takes GET"),
        ({"route": "/v1/chat/completions", "body": {}, "method": 3}, "input.method", "string"),
        ({"route": "/v1/other", "body": {"x": 1}}, "input.route", "not one of"),
        ({"route": 5}, "input.route", "string"),
        ({"body": {"prompt": "x"}}, "input.body", "needs route"),
        (
            {"route": "/v1/completions", "openai_route": "/v1/completions", "body": {}},
            "input.route",
            "either route/body/method or openai_route/openai_input",
        ),
    ],
)
def test_worker_vllm_route_shape_errors_name_its_fields(body, field, words) -> None:
    error = rejected(json.dumps({"input": body}).encode())
    assert error.param == field and words in error.message
