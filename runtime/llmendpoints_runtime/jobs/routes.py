"""HTTP routes of the RunPod-compatible job API.

The same router serves at the root and under ``/v2/{endpoint_id}`` (RunPod's URL layout), so
``runpod.Endpoint`` works with only ``RUNPOD_ENDPOINT_BASE_URL`` changed; the endpoint id in
the URL is accepted and ignored (one pod serves one endpoint). ``/v2/{endpoint_id}/openai/v1/...``
is an alias of the OpenAI routes, so the OpenAI SDK works with only ``base_url`` changed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from llmendpoints_common.destinations import DestinationPolicy, DestinationRefused, check_url
from llmendpoints_common.errors import (
    BadRequestError,
    ContentTooLargeError,
    ServiceUnavailableError,
)
from llmendpoints_common.jobs.service import JobService, JobView, status_body
from pydantic import BaseModel

from llmendpoints_runtime.auth import caller_owner, job_owner
from llmendpoints_runtime.errors import JOBS_TAG, error_responses
from llmendpoints_runtime.jobs.asgi import ForwardedRequest
from llmendpoints_runtime.jobs.models import JobRequest, check_model, parse_job_request
from llmendpoints_runtime.jobs.port import ASGIApp, JobEngine
from llmendpoints_runtime.jobs.settings import JobSettings
from llmendpoints_runtime.jobs.work import check_images


@dataclass
class JobAPI:
    """What the routes need: the job service (the in-pod executor or the shared queue), the
    engine (for input checks), the settings, and where webhooks may point (checked at
    submission; the sender checks again at delivery). Every call carries the caller's owner
    (the API key's name), so one tenant never sees another's jobs."""

    executor: JobService
    engine: JobEngine
    settings: JobSettings
    webhook_policy: DestinationPolicy = field(default_factory=DestinationPolicy)


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 as soon as it is known to exceed ``limit`` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ContentTooLargeError(f"request body is {declared} bytes; the limit is {limit} bytes")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise ContentTooLargeError(f"request body exceeds the limit of {limit} bytes")
    return bytes(body)


def build_job_router(
    api: JobAPI,
    *,
    include_health: bool = True,
    openai_target: Callable[[Request], ASGIApp] | None = None,
) -> APIRouter:
    """The job routes. ``openai_target`` (the app serving ``/v1/...``) enables the
    ``/openai/v1/...`` alias; mount the router with ``prefix="/v2/{endpoint_id}"`` for it.
    Routes raise; the runtime's exception handler answers in the job envelope."""
    router = APIRouter(tags=[JOBS_TAG])
    _add_submission_routes(router, api)
    _add_job_routes(router, api.executor)

    if include_health:

        @router.get("/health")
        async def health() -> Response:
            return JSONResponse(await api.executor.health())

    if openai_target is not None:

        @router.api_route(  # vLLM's operations, documented under /v1
            "/openai/v1/{path:path}",
            methods=["GET", "POST", "PUT", "DELETE", "PATCH"],
            include_in_schema=False,
        )
        async def openai_alias(request: Request, path: str) -> Response:
            return ForwardedRequest(openai_target(request), f"/v1/{path}")

    return router


def _add_submission_routes(router: APIRouter, api: JobAPI) -> None:
    """``/run`` and ``/runsync``: checks that need no engine, then the engine's, then queue."""
    executor, settings = api.executor, api.settings

    async def accept(
        request: Request, *, sync: bool, idempotency_key: str | None = None
    ) -> JobView:
        if api.engine.draining():
            raise ServiceUnavailableError(
                "this replica is shutting down and takes no new jobs; send the job again "
                "(the load balancer routes it to another replica)"
            )
        limit = settings.max_runsync_body_bytes if sync else settings.max_body_bytes
        job_request = parse_job_request(await read_body(request, limit), settings.limits)
        _check_webhook(job_request, api.webhook_policy)
        _check_input(api.engine, job_request)
        return await executor.submit(
            job_request,
            sync=sync,
            owner=job_owner(request.scope),
            idempotency_key=idempotency_key,
        )

    errors = error_responses(400, 401, 413, 429, 503, job=True)
    body = {"requestBody": _request_body(JobRequest)}

    @router.post("/run", responses=errors, openapi_extra=body)
    async def run(request: Request) -> Response:
        job = await accept(
            request, sync=False, idempotency_key=request.headers.get("idempotency-key") or None
        )
        return JSONResponse({"id": job.id, "status": job.status.value})

    @router.post("/runsync", responses=errors, openapi_extra=body)
    async def runsync(request: Request) -> Response:
        wait_ms = _wait_ms(request, settings)
        accepted = await accept(request, sync=True)
        job = await executor.wait(accepted.id, wait_ms / 1000, owner=caller_owner(request.scope))
        if not job.status.is_final:
            return JSONResponse({"id": job.id, "status": job.status.value})
        return JSONResponse(status_body(job))


def _add_job_routes(router: APIRouter, executor: JobService) -> None:
    """The routes about one job, and ``/purge-queue``."""

    async def status(request: Request, job_id: str) -> Response:
        return JSONResponse(
            status_body(await executor.get(job_id, owner=caller_owner(request.scope)))
        )

    async def stream(request: Request, job_id: str) -> Response:
        job, chunks = await executor.take_stream(job_id, owner=caller_owner(request.scope))
        body: dict[str, Any] = {
            "id": job.id,
            "status": job.status.value,
            "stream": [{"output": chunk} for chunk in chunks],
        }
        if job.error is not None:
            body["error"] = job.error
        return JSONResponse(body)

    # GET, and POST as RunPod's own local test server also accepts; one route per method, so
    # each has its own OpenAPI operation.
    for method in ("GET", "POST"):
        for path, endpoint in (("/status/{job_id}", status), ("/stream/{job_id}", stream)):
            router.add_api_route(
                path, endpoint, methods=[method], responses=error_responses(401, 404, job=True)
            )

    @router.post("/cancel/{job_id}", responses=error_responses(401, 404, 409, job=True))
    async def cancel(request: Request, job_id: str) -> Response:
        job = await executor.cancel(job_id, owner=caller_owner(request.scope))
        return JSONResponse({"id": job.id, "status": job.status.value})

    @router.post("/retry/{job_id}", responses=error_responses(401, 404, 409, 429, job=True))
    async def retry(request: Request, job_id: str) -> Response:
        job = await executor.retry(job_id, owner=caller_owner(request.scope))
        return JSONResponse({"id": job.id, "status": job.status.value})

    @router.post("/purge-queue", responses=error_responses(401, job=True))
    async def purge_queue(request: Request) -> Response:
        removed = await executor.purge_queue(owner=caller_owner(request.scope))
        return JSONResponse({"removed": removed, "status": "completed"})


def _request_body(model: type[BaseModel]) -> dict[str, Any]:
    """An OpenAPI requestBody for a route that reads its body itself (to refuse it with 413
    while it streams in, and to name the field in 400s): documented, not parsed by FastAPI."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    return {"required": True, "content": {"application/json": {"schema": schema}}}


def _wait_ms(request: Request, settings: JobSettings) -> int:
    raw = request.query_params.get("wait")
    if raw is None:
        return settings.default_runsync_wait_ms
    if not raw.isdigit():
        raise BadRequestError(
            f"wait: must be a whole number of milliseconds, got {raw!r}", param="wait"
        )
    if int(raw) > settings.max_runsync_wait_ms:
        raise BadRequestError(
            f"wait: at most {settings.max_runsync_wait_ms} ms, got {raw}; use /run and "
            "/status for longer jobs",
            param="wait",
        )
    return int(raw)


def _check_webhook(job_request: JobRequest, policy: DestinationPolicy) -> None:
    if job_request.webhook is None:
        return
    try:
        check_url(str(job_request.webhook), policy)
    except DestinationRefused as exc:
        raise BadRequestError(f"webhook: {exc}", param="webhook") from None


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
        check_model(job_input, engine.served_models())
