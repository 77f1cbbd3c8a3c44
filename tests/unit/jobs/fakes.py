"""A fake JobEngine for unit tests of the job API's own logic (the real engine is exercised in
tests/runtime/)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from llmendpoints_common.errors import BadRequestError, ServiceUnavailableError
from llmendpoints_runtime.jobs.port import (
    ChoiceDelta,
    EngineLoad,
    GenerationRequest,
    GenerationStep,
    ServedModels,
)

KNOWN_PARAMS = {"max_tokens", "temperature", "n", "seed", "ignore_eos", "top_p"}


class FakeEngine:
    """Generates ``t0 t1 t2 ...`` one token per step, ``step_delay`` seconds apart."""

    def __init__(
        self,
        *,
        step_delay: float = 0.0,
        fail_at_step: int | None = None,
        ready: bool = True,
        openai_app: Any = None,
        multimodal: bool = False,
    ) -> None:
        self.step_delay = step_delay
        self.fail_at_step = fail_at_step
        self._ready = asyncio.Event()
        if ready:
            self._ready.set()
        self.start_error: str | None = None
        self.shutting_down = False
        self.aborted: list[str] = []
        self.active: set[str] = set()
        self.started: list[GenerationRequest] = []
        self._openai_app = openai_app or fake_openai_app()
        self.multimodal = multimodal

    def draining(self) -> bool:
        return self.shutting_down

    def become_ready(self) -> None:
        self._ready.set()

    def fail_start(self, reason: str) -> None:
        self.start_error = reason
        self._ready.set()

    def is_ready(self) -> bool:
        return self._ready.is_set() and self.start_error is None

    async def wait_ready(self) -> None:
        await self._ready.wait()
        if self.start_error is not None:
            raise ServiceUnavailableError(f"the engine failed to start: {self.start_error}")

    def check_sampling_params(self, params: Mapping[str, Any]) -> None:
        for name, value in params.items():
            if name not in KNOWN_PARAMS:
                raise BadRequestError(
                    f"input.sampling_params.{name}: unknown sampling parameter",
                    param=f"input.sampling_params.{name}",
                )
            if name == "max_tokens" and (not isinstance(value, int) or value < 1):
                raise BadRequestError(
                    f"input.sampling_params.max_tokens: must be at least 1, got {value}",
                    param="input.sampling_params.max_tokens",
                )

    def check_openai_input(self, route: str, body: Mapping[str, Any] | None) -> None:
        if route == "/v1/chat/completions" and body is not None and "messages" not in body:
            raise BadRequestError(
                "input.openai_input.messages: required field is missing",
                param="input.openai_input.messages",
            )

    def n_choices(self, params: Mapping[str, Any]) -> int:
        return int(params.get("n", 1))

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationStep]:
        self.started.append(request)
        self.active.add(request.request_id)
        max_tokens = request.sampling_params.get("max_tokens", request.default_max_tokens)
        n = self.n_choices(request.sampling_params)
        prompt_tokens = len((request.prompt or json.dumps(request.messages)).split())
        try:
            for i in range(max_tokens):
                if self.step_delay:
                    await asyncio.sleep(self.step_delay)
                else:
                    await asyncio.sleep(0)
                if self.fail_at_step == i:
                    raise RuntimeError("the engine broke mid-generation")
                yield GenerationStep(
                    prompt_tokens=prompt_tokens,
                    choices=tuple(ChoiceDelta(c, f"t{i} ", 1) for c in range(n)),
                )
        finally:
            self.active.discard(request.request_id)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        self.active.discard(request_id)

    def load(self) -> EngineLoad:
        return EngineLoad(running=len(self.active), waiting=0)

    def openai_app(self) -> Any:
        return self._openai_app

    def served_models(self) -> ServedModels:
        return ServedModels(base=("demo",), adapters=("my-lora",), multimodal=self.multimodal)


def fake_openai_app(chunk_split: int | None = None) -> FastAPI:
    """A stand-in for vLLM's OpenAI app: echoes what it got; streams ``n`` SSE events.

    ``chunk_split`` cuts the streamed bytes into pieces of that size, so events (and UTF-8
    characters) arrive split across ASGI messages.
    """
    app = FastAPI()
    app.state.seen = []

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": "demo", "object": "model"}]})

    @app.post("/v1/{route:path}")
    async def echo(route: str, request: Request):
        body = await request.json()
        app.state.seen.append((f"/v1/{route}", body))
        if body.get("fail"):
            return JSONResponse(
                {"error": {"message": "bad things", "type": "BadRequestError", "code": 400}},
                status_code=400,
            )
        if not body.get("stream"):
            return JSONResponse({"object": "echo", "route": f"/v1/{route}", "body": body})

        async def events() -> AsyncIterator[bytes]:
            text = b": keep-alive\n\n" if body.get("keep_alive") else b""
            for i in range(body.get("events", 3)):
                text += f'data: {{"i": {i}, "text": "é✓{i}"}}\n\n'.encode()
            if body.get("error_midway"):
                text += b'data: {"error": {"message": "engine died", "type": "InternalServerError", "code": 500}}\n\n'
            text += b"data: [DONE]\n\n"
            step = chunk_split or len(text)
            for start in range(0, len(text), step):
                yield text[start : start + step]
                await asyncio.sleep(0)

        return StreamingResponse(events(), media_type="text/event-stream")

    return app
