"""The TGI/LMI text-generation payload on /invocations: mapping in, shape out (pure parts)."""

from __future__ import annotations

import json

import pytest
from llmendpoints_common.errors import BadRequestError
from llmendpoints_runtime.text_generation import (
    completion_request,
    generated_texts,
    is_text_generation,
    stream_event,
)


def test_parameters_map_to_vllms_completion_fields() -> None:
    payload = {
        "inputs": "Once upon a time",
        "parameters": {
            "max_new_tokens": 20,
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": 40,
            "repetition_penalty": 1.1,
            "seed": 3,
            "stop": ["\n"],
            "truncate": 100,
            "details": False,
        },
    }
    assert is_text_generation(payload) and not is_text_generation({"prompt": "x"})
    body, full = completion_request(payload, "demo")
    assert body == {
        "model": "demo",
        "prompt": "Once upon a time",
        "stream": False,
        "max_tokens": 20,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 40,
        "repetition_penalty": 1.1,
        "seed": 3,
        "stop": ["\n"],
        "truncate_prompt_tokens": 100,
    }
    assert full is False


def test_greedy_full_text_and_streaming() -> None:
    body, full = completion_request(
        {
            "inputs": "x",
            "parameters": {"do_sample": False, "return_full_text": True},
            "stream": True,
        },
        "demo",
    )
    assert body["temperature"] == 0.0 and body["stream"] is True and full is True


@pytest.mark.parametrize(
    ("payload", "param", "words"),
    [
        ({"inputs": 5}, "inputs", "string or a non-empty list"),
        ({"inputs": []}, "inputs", "string or a non-empty list"),
        ({"inputs": "x", "parameters": []}, "parameters", "JSON object"),
        (
            {"inputs": "x", "parameters": {"typical_p": 0.5}},
            "parameters.typical_p",
            "not a supported",
        ),
        ({"inputs": "x", "parameters": {"details": True}}, "parameters.details", "not available"),
        ({"inputs": "x", "stream": "yes"}, "stream", "true or false"),
        ({"inputs": ["a", "b"], "stream": True}, "stream", "one input"),
        ({"inputs": "x", "max_tokens": 3}, "max_tokens", "unknown field"),
    ],
)
def test_refusals_name_the_field(payload, param, words) -> None:
    with pytest.raises(BadRequestError) as info:
        completion_request(payload, "demo")
    assert info.value.param == param and words in info.value.message


def test_answers_in_the_generated_text_shape() -> None:
    completion = {"choices": [{"index": 1, "text": " B"}, {"index": 0, "text": " A"}]}
    assert generated_texts(completion, ["a", "b"], full=False) == [
        {"generated_text": " A"},
        {"generated_text": " B"},
    ]
    assert generated_texts(completion, ["a", "b"], full=True)[1] == {"generated_text": "b B"}
    event = stream_event(" tok", final=None)
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    assert json.loads(event[6:]) == {
        "index": 0,
        "token": {"id": None, "text": " tok", "logprob": None, "special": False},
        "generated_text": None,
        "details": None,
    }
