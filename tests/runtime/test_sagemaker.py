"""SageMaker's hosting contract end to end: the payloads of the SageMaker input-format guide
(shared/seeds/sagemaker-input-format.md) sent to /invocations of the real runtime."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

pytestmark = pytest.mark.engine

MODEL_PATH = "/opt/ml/model"
CHAT = {
    "model": MODEL_PATH,
    "messages": [
        {"role": "system", "content": "You are a helpful medical assistant."},
        {"role": "user", "content": "What should I do if I have a fever and body aches?"},
    ],
    "max_tokens": 16,
    "temperature": 0.7,
}
ONE_PROMPT = {
    "model": MODEL_PATH,
    "prompt": "How can I maintain good kidney health?",
    "max_tokens": 12,
    "temperature": 0.6,
}
TWO_PROMPTS = {
    "model": MODEL_PATH,
    "prompt": [
        "How can I maintain good kidney health?",
        "What are the best practices for kidney care?",
    ],
    "max_tokens": 12,
    "temperature": 0.6,
}
IMAGE_CHAT = {
    "model": MODEL_PATH,
    "messages": [
        {"role": "system", "content": "You are a helpful medical assistant."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What does this medical image show?"},
                {"type": "image_url", "image_url": {"url": "https://example.com/image.jpg"}},
            ],
        },
    ],
    "max_tokens": 2048,
    "temperature": 0.15,
}


@pytest.fixture(scope="module")
def sm(runtime) -> Iterator[httpx.Client]:
    with runtime.client() as client:
        yield client


def test_ping_answers_200_when_ready(sm) -> None:
    assert sm.get("/ping").status_code == 200
    assert sm.post("/ping").status_code == 200


def test_chat_completion(sm) -> None:
    answer = sm.post("/invocations", json=CHAT)
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["object"] == "chat.completion" and body["model"] == "demo"
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["usage"]["completion_tokens"] <= 16


def test_one_prompt(sm) -> None:
    body = sm.post("/invocations", json=ONE_PROMPT).json()
    assert body["object"] == "text_completion" and len(body["choices"]) == 1


def test_two_prompts(sm) -> None:
    body = sm.post("/invocations", json=TWO_PROMPTS).json()
    assert body["object"] == "text_completion"
    assert sorted(c["index"] for c in body["choices"]) == [0, 1]


@pytest.mark.parametrize("payload", [CHAT, ONE_PROMPT], ids=["chat", "prompt"])
def test_streaming_is_openai_sse(sm, payload) -> None:
    with sm.stream("POST", "/invocations", json={**payload, "stream": True}) as answer:
        assert answer.status_code == 200
        assert answer.headers["content-type"].startswith("text/event-stream")
        text = answer.read().decode()
    events = [e for e in text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    expected = "chat.completion.chunk" if "messages" in payload else "text_completion"
    assert {c["object"] for c in chunks} == {expected}


@pytest.mark.parametrize("model", [MODEL_PATH, "demo", "anything-else", None])
def test_any_model_value_names_the_served_model(sm, model) -> None:
    payload = {k: v for k, v in ONE_PROMPT.items() if k != "model"}
    if model is not None:
        payload["model"] = model
    answer = sm.post("/invocations", json=payload)
    assert answer.status_code == 200 and answer.json()["model"] == "demo"


def test_payload_without_content_type_is_still_json(sm) -> None:
    answer = sm.post(
        "/invocations", content=json.dumps(ONE_PROMPT).encode(), headers={"content-type": ""}
    )
    assert answer.status_code == 200, answer.text


def test_image_to_a_text_only_model_is_400_saying_so(sm) -> None:
    answer = sm.post("/invocations", json=IMAGE_CHAT)
    assert answer.status_code == 400
    message = answer.json()["error"]["message"]
    assert "text-only" in message and "messages[1].content[1]" in message


@pytest.mark.parametrize(
    ("content", "status", "words"),
    [
        (b"{oops", 400, "not valid JSON"),
        (b"[1, 2]", 400, "JSON object"),
        (b'{"max_tokens": 5}', 400, "needs messages"),
        (b'{"messages": "hello"}', 400, "messages"),
        (b'{"prompt": 5}', 400, "prompt"),
        (b'{"input": "embed me"}', 400, "embeddings"),
        (b'{"prompt": "x", "max_tokens": -1}', 400, "max_tokens"),
        (b'{"prompt": "x", "temperature": "hot"}', 400, "temperature"),
        (b"\xff\xfe", 400, "UTF-8"),
    ],
)
def test_bad_invocations_are_json_4xx_and_the_server_keeps_serving(
    sm, content, status, words
) -> None:
    answer = sm.post("/invocations", content=content, headers={"content-type": "application/json"})
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    assert words in error["message"]
    assert sm.post("/invocations", json=ONE_PROMPT).status_code == 200


# -- the TGI / LMI containers' text-generation payload -------------------------------------------

TGI = {
    "inputs": "The capital of France is",
    "parameters": {"max_new_tokens": 8, "do_sample": False},
}


def _greedy_completion(sm, prompt: str) -> str:
    body = {"model": "demo", "prompt": prompt, "max_tokens": 8, "temperature": 0}
    return sm.post("/v1/completions", json=body).json()["choices"][0]["text"]


def test_tgi_payload_answers_generated_text_as_v1_completions_would(sm) -> None:
    answer = sm.post("/invocations", json=TGI)
    assert answer.status_code == 200, answer.text
    assert answer.json() == [{"generated_text": _greedy_completion(sm, TGI["inputs"])}]
    full = sm.post(
        "/invocations", json={**TGI, "parameters": {**TGI["parameters"], "return_full_text": True}}
    ).json()
    assert full[0]["generated_text"].startswith(TGI["inputs"])
    two = sm.post("/invocations", json={**TGI, "inputs": ["Hello", "Goodbye"]}).json()
    assert [len(two), *map(set, two)] == [2, {"generated_text"}, {"generated_text"}]


def test_tgi_payload_streams_tgi_events(sm) -> None:
    with sm.stream("POST", "/invocations", json={**TGI, "stream": True}) as answer:
        assert answer.status_code == 200
        assert answer.headers["content-type"].startswith("text/event-stream")
        text = answer.read().decode()
    events = [json.loads(e.removeprefix("data: ")) for e in text.split("\n\n") if e]
    assert all(set(e) == {"index", "token", "generated_text", "details"} for e in events)
    assert [e["generated_text"] is None for e in events] == [True] * (len(events) - 1) + [False]
    streamed = "".join(e["token"]["text"] for e in events)
    assert streamed == events[-1]["generated_text"] == _greedy_completion(sm, TGI["inputs"])


def test_tgi_parameters_we_do_not_support_are_400_naming_them(sm) -> None:
    answer = sm.post("/invocations", json={"inputs": "x", "parameters": {"typical_p": 0.5}})
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == "parameters.typical_p"
