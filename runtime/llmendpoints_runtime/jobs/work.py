"""Turning a job's input into its output: the part of a job that talks to the engine.

``publish`` receives each chunk as soon as it exists (what ``/stream`` hands out); the return
value is the job's final output. Anything raised ends the job ``FAILED``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from llmendpoints_common.errors import APIError

from llmendpoints_runtime.jobs.asgi import call_app
from llmendpoints_runtime.jobs.batching import BatchSchedule, TextCollector, TokenBatcher
from llmendpoints_runtime.jobs.models import (
    OPENAI_ROUTES,
    JobInput,
    check_model,
    refuse_images_for_text_only,
)
from llmendpoints_runtime.jobs.port import GenerationRequest, GenerationStep, JobEngine
from llmendpoints_runtime.jobs.sse import SSECutter, SSEEvent
from llmendpoints_runtime.jobs.tally import UsageTally

Publish = Callable[[Any], None]


async def run_generation(
    engine: JobEngine,
    job_input: JobInput,
    *,
    request_id: str,
    schedule: BatchSchedule,
    default_max_tokens: int,
    publish: Publish,
    tally: UsageTally | None = None,
    priority: int = 0,
) -> list[dict[str, Any]]:
    """A prompt/messages job: token batches when streamed, one batch of full texts if not."""
    check_images(engine, job_input)
    check_model(job_input, engine.served_models())
    request = GenerationRequest(
        request_id=request_id,
        model=job_input.model,
        prompt=job_input.prompt,
        messages=(
            [m.model_dump(exclude_none=True) for m in job_input.messages]
            if job_input.messages is not None
            else None
        ),
        apply_chat_template=job_input.apply_chat_template,
        sampling_params=job_input.sampling_params,
        stream=job_input.stream,
        default_max_tokens=default_max_tokens,
        priority=priority,
    )
    n_choices = engine.n_choices(job_input.sampling_params)
    steps = _counted(engine.generate(request), tally or UsageTally())
    if not job_input.stream:
        collector = TextCollector(n_choices)
        async for step in steps:
            collector.add(step)
        result = collector.result()
        publish(result)
        return [result]

    batches: list[dict[str, Any]] = []
    batcher = TokenBatcher(n_choices, schedule)
    async for step in steps:
        if (batch := batcher.add(step)) is not None:
            publish(batch)
            batches.append(batch)
    if (batch := batcher.flush()) is not None:
        publish(batch)
        batches.append(batch)
    return batches


async def run_openai_route(
    engine: JobEngine,
    job_input: JobInput,
    *,
    schedule: BatchSchedule,
    raw_output: bool,
    publish: Publish,
    tally: UsageTally | None = None,
    priority: int = 0,
) -> Any:
    """An ``openai_route`` job: the OpenAI JSON, or the streamed events in growing batches.
    ``priority`` (a batch's request) replaces whatever the body says: vLLM's request field."""
    route = job_input.openai_route
    assert route is not None  # validated by JobInput
    check_images(engine, job_input)
    method = OPENAI_ROUTES[route]
    body = job_input.openai_input if method == "POST" else None
    if priority and body is not None:
        body = {**body, "priority": priority}
    response = await call_app(engine.openai_app(), method, route, body)
    streamed = response.headers.get("content-type", "").startswith("text/event-stream")
    if response.status >= 400 or not streamed:
        raw = await response.read()
        value = _json_or_text(raw)
        if response.status >= 400:
            raise _route_error(route, response.status, value)
        publish(value)
        return value

    chunks: list[Any] = []
    sizes = schedule.sizes()
    target = next(sizes)
    pending: list[SSEEvent] = []
    cutter = SSECutter()

    def emit() -> None:
        chunk: Any = (
            "".join(e.raw for e in pending)
            if raw_output
            else [v for e in pending if (v := e.json()) is not None]
        )
        publish(chunk)
        chunks.append(chunk)
        pending.clear()

    def take(events: list[SSEEvent]) -> None:
        nonlocal target
        for event in events:
            if (error := event.error) is not None:
                raise _route_error(route, error.get("code") or 500, {"error": error})
            if tally is not None:
                tally.openai_chunk(event.json())
            if not raw_output and event.json() is None:
                continue  # [DONE] and comments carry nothing once parsed
            pending.append(event)
            # Only events with data count towards a batch: keep-alive comments ride along.
            if sum(e.data is not None for e in pending) >= target:
                emit()
                target = next(sizes)

    async for piece in response.body:
        take(cutter.feed(piece))
    take(cutter.finish())
    if pending:
        emit()
    return chunks


async def _counted(
    steps: AsyncIterator[GenerationStep], tally: UsageTally
) -> AsyncIterator[GenerationStep]:
    """The engine's steps, each counted as it arrives (a job stopped mid-way bills what the
    tally holds then)."""
    async for step in steps:
        tally.step(step)
        yield step


def check_images(engine: JobEngine, job_input: JobInput) -> None:
    """Images in a job's chat messages need a multimodal model (a 400 / FAILED otherwise)."""
    if job_input.messages is not None:
        messages = [m.model_dump(exclude_none=True) for m in job_input.messages]
        field = "input.messages"
    elif job_input.openai_input is not None and isinstance(
        job_input.openai_input.get("messages"), list
    ):
        messages, field = job_input.openai_input["messages"], "input.openai_input.messages"
    else:
        return
    refuse_images_for_text_only(messages, engine.served_models(), field=field)


def _json_or_text(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return raw.decode("utf-8", errors="replace")


def _route_error(route: str, status: Any, value: Any) -> APIError:
    """The route's error as ours: its status decides the type, as it did the route's."""
    error = value.get("error") if isinstance(value, dict) else None
    if isinstance(error, dict):
        message = str(error.get("message") or error)
        param = error.get("param") if isinstance(error.get("param"), str) else None
    else:
        detail = value.get("detail") if isinstance(value, dict) else value
        message, param = str(detail), None
    status_code = status if isinstance(status, int) and status >= 400 else 500
    return APIError(status_code, f"{route}: {message}", param=param)
