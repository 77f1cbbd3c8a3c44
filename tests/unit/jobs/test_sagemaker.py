import httpx
import pytest
from fastapi import FastAPI
from llmendpoints_common.errors import BadRequestError
from llmendpoints_runtime.errors import install_exception_handlers
from llmendpoints_runtime.jobs.port import ServedModels
from llmendpoints_runtime.metrics import RuntimeMetrics
from llmendpoints_runtime.middleware import BodyGuard
from llmendpoints_runtime.sagemaker import (
    build_sagemaker_router,
    check_modalities,
    check_task,
    invocation_route,
    map_model,
)

from .fakes import FakeEngine

# The client fixture lives on the module's event loop; its tests share that loop.
on_module_loop = pytest.mark.asyncio(loop_scope="module")

SERVED = ServedModels(base=("demo",), adapters=("my-lora",))
IMAGE_CHAT = {
    "model": "/opt/ml/model",
    "messages": [
        {"role": "system", "content": "You are a helpful medical assistant."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What does this medical image show?"},
                {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,AAAA"}},
            ],
        },
    ],
}


@pytest.mark.parametrize(
    ("payload", "route"),
    [
        (
            {"messages": [{"role": "user", "content": "hi"}], "prompt": "ignored"},
            "/v1/chat/completions",
        ),
        ({"prompt": "How can I maintain good kidney health?"}, "/v1/completions"),
        ({"prompt": ["one", "two"]}, "/v1/completions"),
        ({"input": "embed me"}, "/v1/embeddings"),
    ],
)
def test_payload_shape_picks_the_route(payload, route) -> None:
    assert invocation_route(payload) == route


@pytest.mark.parametrize(
    ("payload", "words"),
    [
        ({"max_tokens": 5}, "needs messages"),
        ({"messages": "hi"}, "messages: must be"),
        ({"messages": []}, "messages: must be"),
        ({"prompt": 5}, "prompt: must be"),
    ],
)
def test_unusable_payloads(payload, words) -> None:
    with pytest.raises(BadRequestError) as info:
        invocation_route(payload)
    assert words in info.value.message


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        ("/opt/ml/model", "demo"),
        (None, "demo"),
        ("gpt-4", "demo"),
        ("demo", "demo"),
        ("my-lora", "my-lora"),
    ],
)
def test_model_maps_to_the_served_model_unless_it_names_one(model, expected) -> None:
    payload = {"prompt": "x"} if model is None else {"prompt": "x", "model": model}
    assert map_model(payload, SERVED)["model"] == expected


def test_payload_for_a_task_the_model_lacks_is_refused() -> None:
    check_task("/v1/completions", SERVED)
    with pytest.raises(BadRequestError) as info:
        check_task("/v1/embeddings", SERVED)
    assert "embeddings" in info.value.message and "serves only generate" in info.value.message
    check_task("/v1/embeddings", ServedModels(base=("e5",), tasks=("embed",)))


def test_images_to_a_text_only_model_are_refused_naming_the_part() -> None:
    with pytest.raises(BadRequestError) as info:
        check_modalities(IMAGE_CHAT, SERVED)
    assert "text-only" in info.value.message and "messages[1].content[1]" in info.value.message
    check_modalities(IMAGE_CHAT, ServedModels(base=("vlm",), multimodal=True))  # passes


@pytest.fixture(scope="module")
async def client():
    engine = FakeEngine()
    app = FastAPI()
    install_exception_handlers(app)
    app.include_router(build_sagemaker_router(engine))
    # The runtime's edge reads the body, within MAX_REQUEST_BODY_BYTES.
    guarded = BodyGuard(app, 10_000, RuntimeMetrics())
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=guarded), base_url="http://t"
    ) as c:
        yield c, engine


@on_module_loop
async def test_invocations_forward_the_mapped_payload(client) -> None:
    c, _ = client
    answer = await c.post("/invocations", json={"model": "/opt/ml/model", "prompt": ["a", "b"]})
    assert answer.status_code == 200
    assert answer.json()["route"] == "/v1/completions"
    assert answer.json()["body"] == {"model": "demo", "prompt": ["a", "b"]}
    streamed = await c.post(
        "/invocations", json={"messages": [{"role": "user", "content": "hi"}], "stream": True}
    )
    assert streamed.headers["content-type"].startswith("text/event-stream")
    assert streamed.text.endswith("data: [DONE]\n\n")


@on_module_loop
@pytest.mark.parametrize(
    ("content", "status", "words"),
    [
        (b"{bad", 400, "not valid JSON"),
        (b"[1]", 400, "JSON object"),
        (b'{"temperature": 1}', 400, "needs messages"),
        (b"\xff", 400, "UTF-8"),
        (b'{"input": "embed me"}', 400, "serves only generate"),
        (b'{"prompt": "' + b"x" * 20_000 + b'"}', 413, "limit"),
    ],
)
async def test_bad_invocations_are_json_4xx(client, content, status, words) -> None:
    c, _ = client
    answer = await c.post("/invocations", content=content)
    assert answer.status_code == status
    error = answer.json()["error"]
    assert set(answer.json()) == {"error"}
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    assert words in error["message"]
    assert (await c.post("/invocations", json={"prompt": "ok"})).status_code == 200


@on_module_loop
async def test_image_to_text_only_model_is_400(client) -> None:
    c, _ = client
    answer = await c.post("/invocations", json=IMAGE_CHAT)
    assert answer.status_code == 400
    assert "text-only" in answer.json()["error"]["message"]
