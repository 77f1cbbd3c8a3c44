"""The engine seen through the job API's port: ``JobEngineAdapter`` implements
``jobs.port.JobEngine`` on ``engine.Engine``.

Prompt/messages jobs are rendered by vLLM's own completion/chat preprocessing (chat template,
CUSTOM_CHAT_TEMPLATE, tokenisation, length checks) and generated straight on the engine client
-- the same engine work as /v1/completions without the OpenAI response formatting. This module
speaks the job API's language (field paths such as ``input.sampling_params.top_p``, the shared
error types); ``engine/`` speaks vLLM's and stays the only package that imports it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from typing import Any

import pydantic
from llmendpoints_common.errors import (
    BadRequestError,
    InternalServerError,
    ServiceUnavailableError,
    describe_validation_errors,
)

from llmendpoints_runtime.adapters.gate import unavailable_adapters
from llmendpoints_runtime.adapters.reconciler import AdapterReconciler
from llmendpoints_runtime.engine import (
    Engine,
    EngineAdapters,
    EngineDead,
    EngineInputError,
    build_sampling_params,
    sampling_param_names,
    validate_openai_request,
)
from llmendpoints_runtime.health import EngineState
from llmendpoints_runtime.jobs.port import (
    ASGIApp,
    ChoiceDelta,
    EngineLoad,
    GenerationRequest,
    GenerationStep,
    ServedModels,
)

# Names from older worker-vllm/vLLM docs that vLLM 0.32 no longer has, with what to do instead.
RETIRED_SAMPLING_FIELDS = {
    "best_of": "vLLM 0.32 removed best_of; use n",
    "use_beam_search": "beam search is not a sampling parameter in vLLM 0.32; send the request "
    "through openai_route /v1/completions with use_beam_search",
    "length_penalty": "beam search only; send the request through openai_route",
    "early_stopping": "beam search only; send the request through openai_route",
}


class JobEngineAdapter:
    """``Engine`` as a ``jobs.port.JobEngine`` (tests/unit/runtime checks the two agree)."""

    def __init__(self, engine: Engine, adapters: AdapterReconciler | None = None) -> None:
        self.engine = engine
        self.adapters = adapters  # the declared LoRA adapters (None: none can be declared)

    def is_ready(self) -> bool:
        return self.engine.health.state is EngineState.READY and self.engine.asgi_app is not None

    def draining(self) -> bool:
        """No new jobs: the pod is shutting down, or its engine failed (then it is about to)."""
        return self.engine.health.draining or self.engine.health.state is EngineState.FAILED

    async def wait_ready(self) -> None:
        while not self.is_ready():
            if self.engine.health.state in (EngineState.FAILED, EngineState.STOPPED):
                raise ServiceUnavailableError(
                    f"the engine is not available: {self.engine.health.reason or 'stopped'}"
                )
            await asyncio.sleep(0.05)

    # -- input checks ------------------------------------------------------------------------

    def check_sampling_params(self, params: Mapping[str, Any]) -> None:
        self._sampling_params(params)

    def check_openai_input(self, route: str, body: Mapping[str, Any] | None) -> None:
        if body is None:
            return
        try:
            validate_openai_request(route, body)
        except pydantic.ValidationError as exc:
            message, field = describe_validation_errors(
                exc.errors(include_url=False), prefix="input.openai_input"
            )
            raise BadRequestError(message, param=field) from None
        except EngineInputError as exc:
            field = "input.openai_input" + (f".{exc.parameter}" if exc.parameter else "")
            raise BadRequestError(f"{field}: {exc.message}", param=field) from None

    def n_choices(self, params: Mapping[str, Any]) -> int:
        n = params.get("n", 1)
        return n if isinstance(n, int) and n > 0 else 1

    def _sampling_params(self, params: Mapping[str, Any], *, final_only: bool | None = None):
        """vLLM's SamplingParams from a job's dict; BadRequestError naming the bad field."""

        def bad(name: str | None, message: str) -> BadRequestError:
            field = f"input.sampling_params.{name}" if name else "input.sampling_params"
            return BadRequestError(f"{field}: {message}", param=field)

        allowed = sampling_param_names()
        for name in params:
            if name in RETIRED_SAMPLING_FIELDS:
                raise bad(name, RETIRED_SAMPLING_FIELDS[name])
            if name not in allowed:
                raise bad(name, "not a vLLM sampling parameter (see vllm.SamplingParams)")
        try:
            return build_sampling_params(params, final_only=final_only)
        except EngineInputError as exc:
            raise bad(exc.parameter, exc.message) from None

    # -- generation --------------------------------------------------------------------------

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationStep]:
        engine_input = await self._render(request)
        prompt_len = _prompt_len(engine_input)
        params = self.engine.model_defaults()
        params.update(request.sampling_params)
        if "max_tokens" not in request.sampling_params:
            room = self.engine.max_model_len - prompt_len
            params["max_tokens"] = max(1, min(request.default_max_tokens, room))
        # Non-streamed jobs take only the final output, as /v1/completions does: no per-token
        # outputs to detokenise-and-hand-over for text nobody reads before the end.
        sampling = self._sampling_params(params, final_only=not request.stream)
        lora = EngineAdapters(self.engine).lora_request(request.model) if request.model else None
        if not request.stream and prompt_len:
            # A non-streamed job hears from the engine only at its end: say what the prompt
            # costs now, so a job stopped before the end still bills it (jobs/tally.py).
            yield GenerationStep(prompt_tokens=prompt_len, choices=())
        try:
            async for output in self.engine.generate(
                engine_input,
                sampling,
                request.request_id,
                lora_request=lora,
                priority=request.priority,
            ):
                yield GenerationStep(
                    prompt_tokens=len(output.prompt_token_ids or ()) or prompt_len,
                    choices=tuple(
                        ChoiceDelta(o.index, o.text, len(o.token_ids)) for o in output.outputs
                    ),
                )
        except EngineInputError as exc:  # prompt too long, max_tokens beyond the context...
            raise BadRequestError(exc.message) from None
        except EngineDead:
            # vLLM's own text points at a stack trace in the server's log; say what happened.
            raise ServiceUnavailableError(
                f"the job could not finish: {self.engine.death_reason()}"
            ) from None
        except Exception as exc:
            cause = exc.__cause__ or exc
            text = str(cause).strip() or type(cause).__name__
            raise InternalServerError(f"generation failed: {type(cause).__name__}: {text}") from exc

    async def _render(self, request: GenerationRequest) -> Any:
        messages = request.messages
        if messages is None and request.apply_chat_template:
            messages = [{"role": "user", "content": request.prompt}]
        try:
            if messages is not None:
                return await self.engine.render(messages=messages)
            return await self.engine.render(prompt=request.prompt)
        except EngineInputError as exc:
            if exc.parameter is None:
                raise BadRequestError(exc.message) from None
            field = f"input.{exc.parameter}"
            raise BadRequestError(f"{field}: {exc.message}", param=field) from None

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)

    def load(self) -> EngineLoad:
        if self.engine.client is None or self.engine.asgi_app is None:
            return EngineLoad(running=0, waiting=0)
        waiting = self.engine.requests_waiting()
        running = max(0, self.engine.unfinished_requests() - waiting)
        return EngineLoad(running=running, waiting=waiting)

    def openai_app(self) -> ASGIApp:
        return self.engine.asgi_app

    def served_models(self) -> ServedModels:
        unavailable = unavailable_adapters(self.adapters)
        return ServedModels(
            base=tuple(self.engine.served_model_names()),
            adapters=tuple(a for a in self.engine.adapter_names() if a not in unavailable),
            multimodal=self.engine.is_multimodal(),
            tasks=self.engine.supported_tasks,
            unavailable=unavailable,
        )


def _prompt_len(engine_input: Any) -> int:
    ids = engine_input.get("prompt_token_ids") if isinstance(engine_input, dict) else None
    return len(ids) if ids is not None else 0
