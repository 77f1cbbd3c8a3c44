"""HTTP routes of the RunPod-compatible job API.

The same router serves at the root and under ``/v2/{endpoint_id}`` (RunPod's URL layout), so
``runpod.Endpoint`` works with only ``RUNPOD_ENDPOINT_BASE_URL`` changed; the endpoint id in
the URL is accepted and ignored (one pod serves one endpoint). ``/v2/{endpoint_id}/openai/v1/...``
is an alias of the OpenAI routes, so the OpenAI SDK works with only ``base_url`` changed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from llmendpoints_runtime.jobs.asgi import ForwardedRequest
from llmendpoints_runtime.jobs.errors import (
    EngineUnavailable,
    InvalidRequest,
    JobAPIError,
    PayloadTooLarge,
)
from llmendpoints_runtime.jobs.executor import JobExecutor, status_body
from llmendpoints_runtime.jobs.models import JobRequest, parse_job_request
from llmendpoints_runtime.jobs.port import ASGIApp, JobEngine
from llmendpoints_runtime.jobs.settings import JobSettings
from llmendpoints_runtime.jobs.work import check_images


@dataclass
class JobAPI:
    """What the routes need: the executor, the engine (for input checks), the settings."""

    executor: JobExecutor
    engine: JobEngine
    settings: JobSettings


def error_response(exc: JobAPIError) -> JSONResponse:
    return JSONResponse(exc.to_body(), status_code=exc.status_code)


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 as soon as it is known to exceed ``limit`` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"request body is {declared} bytes; the limit is {limit} bytes")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
    return bytes(body)


def build_job_router(
    api: JobAPI,
    *,
    include_health: bool = True,
    openai_target: Callable[[Request], ASGIApp] | None = None,
) -> APIRouter:
    """The job routes. ``openai_target`` (the app serving ``/v1/...``) enables the
    ``/openai/v1/...`` alias; mount the router with ``prefix="/v2/{endpoint_id}"`` for it."""
    router = APIRouter(tags=["jobs"])
    executor, settings = api.executor, api.settings

    async def accept(request: Request, *, sync: bool) -> Any:
        if api.engine.draining():
            raise EngineUnavailable(
                "this replica is shutting down and takes no new jobs; send the job again "
                "(the load balancer routes it to another replica)"
            )
        job_request = parse_job_request(await read_body(request, settings.max_body_bytes))
        _check_input(api.engine, job_request)
        return await executor.submit(job_request, sync=sync)

    @router.post("/run")
    async def run(request: Request) -> Response:
        try:
            job = await accept(request, sync=False)
        except JobAPIError as exc:
            return error_response(exc)
        return JSONResponse({"id": job.id, "status": job.status.value})

    @router.post("/runsync")
    async def runsync(request: Request) -> Response:
        try:
            wait_ms = _wait_ms(request, settings)
            job = await accept(request, sync=True)
            job = await executor.wait(job, wait_ms / 1000)
        except JobAPIError as exc:
            return error_response(exc)
        if not job.status.is_final:
            return JSONResponse({"id": job.id, "status": job.status.value})
        return JSONResponse(status_body(job))

    @router.get("/status/{job_id}")
    async def status(job_id: str) -> Response:
        try:
            job = await executor.get(job_id)
        except JobAPIError as exc:
            return error_response(exc)
        return JSONResponse(status_body(job))

    @router.get("/stream/{job_id}")
    async def stream(job_id: str) -> Response:
        try:
            job, chunks = await executor.take_stream(job_id)
        except JobAPIError as exc:
            return error_response(exc)
        body: dict[str, Any] = {
            "id": job.id,
            "status": job.status.value,
            "stream": [{"output": chunk} for chunk in chunks],
        }
        if job.error is not None:
            body["error"] = job.error
        return JSONResponse(body)

    @router.post("/cancel/{job_id}")
    async def cancel(job_id: str) -> Response:
        try:
            job = await executor.cancel(job_id)
        except JobAPIError as exc:
            return error_response(exc)
        return JSONResponse({"id": job.id, "status": job.status.value})

    @router.post("/retry/{job_id}")
    async def retry(job_id: str) -> Response:
        try:
            job = await executor.retry(job_id)
        except JobAPIError as exc:
            return error_response(exc)
        return JSONResponse({"id": job.id, "status": job.status.value})

    @router.post("/purge-queue")
    async def purge_queue() -> Response:
        removed = await executor.purge_queue()
        return JSONResponse({"removed": removed, "status": "completed"})

    if include_health:

        @router.get("/health")
        async def health() -> Response:
            return JSONResponse(await executor.health())

    if openai_target is not None:

        @router.api_route(
            "/openai/v1/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"]
        )
        async def openai_alias(request: Request, path: str) -> Response:
            return ForwardedRequest(openai_target(request), f"/v1/{path}")

    return router


def _wait_ms(request: Request, settings: JobSettings) -> int:
    raw = request.query_params.get("wait")
    if raw is None:
        return settings.default_runsync_wait_ms
    if not raw.isdigit():
        raise InvalidRequest(
            f"wait: must be a whole number of milliseconds, got {raw!r}", param="wait"
        )
    if int(raw) > settings.max_runsync_wait_ms:
        raise InvalidRequest(
            f"wait: at most {settings.max_runsync_wait_ms} ms, got {raw}; use /run and "
            "/status for longer jobs",
            param="wait",
        )
    return int(raw)


def _check_input(engine: JobEngine, job_request: JobRequest) -> None:
    """Checks that need the engine's view, done before the job is accepted."""
    job_input = job_request.input
    if job_input.is_openai:
        assert job_input.openai_route is not None
        engine.check_openai_input(job_input.openai_route, job_input.openai_input)
    else:
        engine.check_sampling_params(job_input.sampling_params)
    if engine.is_ready():  # the model's modalities are known (else: checked when it runs)
        check_images(engine, job_input)
