"""SageMaker hosting contract: ``POST /invocations`` (``/ping`` is app.py's probe router,
answered from health.py's readiness).

SageMaker sends every request to ``/invocations``; the payload's shape says what it is:
``messages`` -> chat completions, ``prompt`` (string or list) -> completions, ``input`` ->
embeddings, ``inputs`` -> text generation as the TGI/LMI containers answer it
(``text_generation.py``). The request then runs through vLLM's own OpenAI route in-process, so parameters,
errors and ``"stream": true`` (SSE) behave exactly as on ``/v1/...``.

Why not vLLM's own ``/invocations``: it tries the request types in turn and takes the first that
validates, so a payload error surfaces as "Cannot find suitable handler", and it rejects
``"model": "/opt/ml/model"`` (SageMaker's fixed model path) as an unknown model. Here the shape
decides, the model name is mapped, and images sent to a text-only model are refused up front
instead of being downloaded first.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from llmendpoints_common.errors import BadRequestError
from llmendpoints_edge.body import read_before

from llmendpoints_runtime import text_generation
from llmendpoints_runtime.errors import error_responses
from llmendpoints_runtime.jobs.asgi import ForwardedRequest
from llmendpoints_runtime.jobs.models import parse_json_object, refuse_images_for_text_only
from llmendpoints_runtime.jobs.port import ASGIApp, JobEngine, ServedModels


def invocation_route(payload: dict[str, Any]) -> str:
    """Which OpenAI route a SageMaker payload is meant for."""
    if "messages" in payload:
        if not isinstance(payload["messages"], list) or not payload["messages"]:
            raise BadRequestError(
                "messages: must be a non-empty list of chat messages", param="messages"
            )
        return "/v1/chat/completions"
    if "prompt" in payload:
        prompt = payload["prompt"]
        if not isinstance(prompt, str | list) or (isinstance(prompt, list) and not prompt):
            raise BadRequestError(
                "prompt: must be a string or a non-empty list of strings", param="prompt"
            )
        return "/v1/completions"
    if "input" in payload:
        return "/v1/embeddings"
    raise BadRequestError(
        "the payload needs messages (chat completion), prompt (completion), input "
        "(embeddings) or inputs (text generation, as the TGI and LMI containers take it)"
    )


def map_model(payload: dict[str, Any], served: ServedModels) -> dict[str, Any]:
    """Point ``model`` at the served model unless it names one (a base name or an adapter).

    SageMaker clients send ``"/opt/ml/model"`` or whatever their code carried over; on a
    single-model container every such value means "the model", so it is rewritten instead of
    answered with 404. Served names and LoRA adapter names pass through unchanged (a declared
    adapter that is still loading then gets 503 with Retry-After).
    """
    model = payload.get("model")
    if isinstance(model, str) and (
        model in served.base or model in served.adapters or model in served.unavailable
    ):
        return payload
    return {**payload, "model": served.base[0]}


_ROUTE_TASKS = {
    "/v1/chat/completions": ("generate", "chat completion (messages)"),
    "/v1/completions": ("generate", "completion (prompt)"),
    "/v1/embeddings": ("embed", "embeddings (input)"),
}


def check_task(route: str, served: ServedModels) -> None:
    """A payload for a task the model does not serve is a 400 that says so, not a bare 404."""
    task, what = _ROUTE_TASKS[route]
    if task not in served.tasks:
        raise BadRequestError(
            f"this payload asks for {what}, but model {served.base[0]!r} serves only "
            f"{', '.join(served.tasks) or 'nothing'}"
        )


def check_modalities(payload: dict[str, Any], served: ServedModels) -> None:
    if isinstance(payload.get("messages"), list):
        refuse_images_for_text_only(payload["messages"], served, field="messages")


def build_sagemaker_router(
    engine: JobEngine, *, target: Callable[[Request], ASGIApp] | None = None
) -> APIRouter:
    """``target`` is the app that serves ``/v1/...`` (default: vLLM's app itself). The body was
    read at the edge, within MAX_REQUEST_BODY_BYTES."""
    router = APIRouter(tags=["sagemaker"])

    @router.post("/invocations", responses=error_responses(400, 401, 413, 429, 503))
    async def invocations(request: Request) -> Response:
        body = read_before(request.scope)
        payload = parse_json_object(await request.body() if body is None else body)
        app = target(request) if target is not None else engine.openai_app()
        if text_generation.is_text_generation(payload):  # TGI / LMI containers' payload
            await engine.wait_ready()
            served = engine.served_models()
            check_task(text_generation.COMPLETIONS, served)
            return await text_generation.answer(app, payload, served.base[0])
        route = invocation_route(payload)
        await engine.wait_ready()
        served = engine.served_models()
        check_task(route, served)
        check_modalities(payload, served)
        payload = map_model(payload, served)
        return ForwardedRequest(app, route, json.dumps(payload).encode())

    return router
