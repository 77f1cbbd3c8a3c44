"""The text-generation payload of SageMaker's TGI and LMI containers on ``/invocations``.

Users moving from those containers send ``{"inputs": "...", "parameters": {...}, "stream"?}``
and read ``[{"generated_text": "..."}]``. Here that payload becomes a ``/v1/completions``
request run by vLLM's own route in-process (so sampling, limits and errors are vLLM's), and the
answer is put back in the TGI shape:

- not streamed: ``[{"generated_text": ...}]``, one object per input (``inputs`` may be a list);
- ``"stream": true`` (one input): server-sent events ``{"index", "token": {"id", "text",
  "logprob", "special"}, "generated_text", "details"}``, ``generated_text`` set on the last.
  vLLM streams text, not token ids: ``token.id`` and ``token.logprob`` are null and a token may
  carry more than one model token.

Parameters map to vLLM's: ``max_new_tokens`` -> ``max_tokens``; ``temperature``, ``top_p``,
``top_k``, ``repetition_penalty``, ``seed``, ``stop`` as they are; ``do_sample: false`` ->
greedy (temperature 0); ``truncate`` -> ``truncate_prompt_tokens``; ``return_full_text``
prepends the input. Anything else is a 400 naming ``parameters.<name>`` -- never ignored.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from llmendpoints_common.errors import BadRequestError
from starlette.responses import JSONResponse, Response, StreamingResponse

from llmendpoints_runtime.jobs.asgi import InProcessResponse, call_app
from llmendpoints_runtime.jobs.port import ASGIApp
from llmendpoints_runtime.jobs.sse import SSECutter

COMPLETIONS = "/v1/completions"

# TGI/LMI parameter -> vLLM's /v1/completions field.
_RENAMED = {"max_new_tokens": "max_tokens", "truncate": "truncate_prompt_tokens"}
_SAME = frozenset({"temperature", "top_p", "top_k", "repetition_penalty", "seed", "stop"})
# Understood here, not passed on.
_LOCAL = frozenset({"do_sample", "return_full_text", "details"})


def is_text_generation(payload: dict[str, Any]) -> bool:
    return "inputs" in payload


def completion_request(payload: dict[str, Any], model: str) -> tuple[dict[str, Any], bool]:
    """The ``/v1/completions`` body for a TGI payload, and whether to return the full text."""
    unknown = sorted(set(payload) - {"inputs", "parameters", "stream"})
    if unknown:
        raise BadRequestError(
            f"{unknown[0]}: unknown field for a text-generation payload (inputs, parameters, "
            "stream)",
            param=unknown[0],
        )
    inputs = payload["inputs"]
    if not (
        isinstance(inputs, str)
        or (isinstance(inputs, list) and inputs and all(isinstance(i, str) for i in inputs))
    ):
        raise BadRequestError(
            "inputs: must be a string or a non-empty list of strings", param="inputs"
        )
    parameters = payload.get("parameters")
    parameters = {} if parameters is None else parameters
    if not isinstance(parameters, dict):
        raise BadRequestError("parameters: must be a JSON object", param="parameters")
    stream = payload.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequestError("stream: must be true or false", param="stream")
    if stream and not isinstance(inputs, str):
        raise BadRequestError("stream: streams one input; send inputs as a string", param="stream")
    body: dict[str, Any] = {"model": model, "prompt": inputs, "stream": stream}
    for name, value in parameters.items():
        if name in _RENAMED:
            body[_RENAMED[name]] = value
        elif name in _SAME:
            body[name] = value
        elif name not in _LOCAL:
            raise BadRequestError(
                f"parameters.{name}: not a supported text-generation parameter (supported: "
                f"{', '.join(sorted([*_RENAMED, *_SAME, *_LOCAL]))})",
                param=f"parameters.{name}",
            )
    if parameters.get("details"):
        raise BadRequestError(
            "parameters.details: token details are not available; send details: false, or "
            "use the OpenAI payload (prompt) with logprobs",
            param="parameters.details",
        )
    if parameters.get("do_sample") is False:
        body["temperature"] = 0.0
    return body, bool(parameters.get("return_full_text", False))


def generated_texts(completion: dict[str, Any], prompts: list[str], full: bool) -> list[dict]:
    """``[{"generated_text"}]``, one per prompt, from a /v1/completions answer (pure)."""
    choices = sorted(completion.get("choices", []), key=lambda c: c.get("index", 0))
    return [
        {"generated_text": (prompts[i] if full else "") + choice.get("text", "")}
        for i, choice in enumerate(choices)
    ]


def stream_event(text: str, *, final: str | None) -> bytes:
    """One TGI server-sent event (pure)."""
    event = {
        "index": 0,
        "token": {"id": None, "text": text, "logprob": None, "special": False},
        "generated_text": final,
        "details": None,
    }
    return f"data: {json.dumps(event)}\n\n".encode()


async def answer(app: ASGIApp, payload: dict[str, Any], model: str) -> Response:
    """Run a TGI payload through vLLM's /v1/completions; answer in TGI's shape."""
    body, full = completion_request(payload, model)
    response = await call_app(app, "POST", COMPLETIONS, body)
    if response.status >= 400:  # vLLM's (or our admission's) own error, as it is
        return Response(
            await response.read(),
            status_code=response.status,
            media_type="application/json",
            headers={k: v for k, v in response.headers.items() if k == "retry-after"},
        )
    inputs = payload["inputs"]
    prompts = [inputs] if isinstance(inputs, str) else list(inputs)
    if not body["stream"]:
        return JSONResponse(generated_texts(json.loads(await response.read()), prompts, full))
    prefix = prompts[0] if full else ""
    return StreamingResponse(_events(response, prefix), media_type="text/event-stream")


async def _events(response: InProcessResponse, prefix: str) -> AsyncIterator[bytes]:
    cutter = SSECutter()
    text = prefix
    pending: str | None = None  # held back one event, so the last can carry generated_text

    async for chunk in response.body:
        for event in cutter.feed(chunk):
            if (error := event.error) is not None:
                yield f"data: {json.dumps({'error': error})}\n\n".encode()
                return
            value = event.json()
            if not isinstance(value, dict) or not value.get("choices"):
                continue
            delta = value["choices"][0].get("text", "")
            if pending is not None:
                yield stream_event(pending, final=None)
            text += delta
            pending = delta
    yield stream_event(pending or "", final=text)
