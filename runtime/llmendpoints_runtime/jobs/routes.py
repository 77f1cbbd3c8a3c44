"""HTTP routes of the RunPod-compatible job API: a thin FastAPI layer over the job verbs
(``llmendpoints_common.jobs.api``, which the gateway serves too).

One route per operation, so ``/openapi.json`` documents each with the statuses it answers. The
same router serves at the root and under ``/v2/{endpoint_id}`` (RunPod's URL layout), so
``runpod.Endpoint`` works with only ``RUNPOD_ENDPOINT_BASE_URL`` changed; the endpoint id in
the URL is accepted and ignored (one pod serves one endpoint). ``/v2/{endpoint_id}/openai/v1/...``
is an alias of the OpenAI routes, so the OpenAI SDK works with only ``base_url`` changed.

The body was read at the edge (``llmendpoints_edge.body``: deadline, size limit, /runsync's
larger one) and is taken from there, not read again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from llmendpoints_common.destinations import DestinationPolicy
from llmendpoints_common.errors import ServiceUnavailableError
from llmendpoints_common.jobs.api import JobCall, JobReply, JobVerbs
from llmendpoints_common.jobs.service import JobService
from llmendpoints_edge.body import read_before
from pydantic import BaseModel

from llmendpoints_runtime.auth import caller
from llmendpoints_runtime.errors import JOBS_TAG, error_responses
from llmendpoints_runtime.jobs.asgi import ForwardedRequest
from llmendpoints_runtime.jobs.models import JobRequest, check_model
from llmendpoints_runtime.jobs.port import ASGIApp, JobEngine
from llmendpoints_runtime.jobs.settings import JobSettings
from llmendpoints_runtime.jobs.work import check_images


class JobHandler(Protocol):
    """What the routes hand each call to: the verbs (``JobVerbs``), or, in a pod of several
    API processes, the verbs of the process that holds the job (``pod.jobs.PeerJobs``)."""

    async def handle(self, call: JobCall) -> JobReply: ...


def job_verbs(
    service: JobService,
    engine: JobEngine,
    settings: JobSettings,
    webhook_policy: DestinationPolicy | None = None,
) -> JobVerbs:
    """The job verbs on ``service`` with the runtime's own checks: a draining pod takes no new
    job, and the engine refuses what it could not run before the job is accepted."""

    def accepting() -> None:
        if engine.draining():
            raise ServiceUnavailableError(
                "this replica is shutting down and takes no new jobs; send the job again "
                "(the load balancer routes it to another replica)"
            )

    return JobVerbs(
        service,
        limits=settings.limits,
        webhook_policy=webhook_policy,
        default_wait_ms=settings.default_runsync_wait_ms,
        max_wait_ms=settings.max_runsync_wait_ms,
        accepting=accepting,
        check=lambda request: check_input(engine, request),
    )


def check_input(engine: JobEngine, job_request: JobRequest) -> None:
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


# What /run's and /runsync's statuses mean where they differ from the other job routes'.
_SUBMIT_WHEN = {404: "`input.model` names no model this endpoint serves"}


def build_job_router(
    verbs: JobHandler,
    *,
    include_health: bool = True,
    openai_target: Callable[[Request], ASGIApp] | None = None,
) -> APIRouter:
    """The job routes. ``openai_target`` (the app serving ``/v1/...``) enables the
    ``/openai/v1/...`` alias; mount the router with ``prefix="/v2/{endpoint_id}"`` for it."""
    router = APIRouter(tags=[JOBS_TAG])

    async def answer(request: Request, verb: str, job_id: str | None = None) -> Response:
        name, admin = caller(request.scope)
        body = b""
        if request.method == "POST":
            body = read_before(request.scope)
            if body is None:
                body = await request.body()
        reply = await verbs.handle(
            JobCall(
                method=request.method,
                verb=verb,
                caller=name,
                admin=admin,
                job_id=job_id,
                query=dict(request.query_params),
                body=body,
                idempotency_key=request.headers.get("idempotency-key") or None,
            )
        )
        return JSONResponse(reply.body, status_code=reply.status, headers=dict(reply.headers))

    submit_errors = error_responses(400, 401, 404, 413, 429, 503, job=True, when=_SUBMIT_WHEN)
    request_body = {"requestBody": _request_body(JobRequest)}

    @router.post("/run", responses=submit_errors, openapi_extra=request_body)
    async def run(request: Request) -> Response:
        return await answer(request, "run")

    @router.post("/runsync", responses=submit_errors, openapi_extra=request_body)
    async def runsync(request: Request) -> Response:
        return await answer(request, "runsync")

    async def status(request: Request, job_id: str) -> Response:
        return await answer(request, "status", job_id)

    async def stream(request: Request, job_id: str) -> Response:
        return await answer(request, "stream", job_id)

    # GET, and POST as RunPod's own local test server also accepts; one route per method, so
    # each has its own OpenAPI operation.
    for method in ("GET", "POST"):
        for path, endpoint in (("/status/{job_id}", status), ("/stream/{job_id}", stream)):
            router.add_api_route(
                path, endpoint, methods=[method], responses=error_responses(401, 404, job=True)
            )

    @router.post("/cancel/{job_id}", responses=error_responses(401, 404, 409, job=True))
    async def cancel(request: Request, job_id: str) -> Response:
        return await answer(request, "cancel", job_id)

    @router.post("/retry/{job_id}", responses=error_responses(401, 404, 409, 429, job=True))
    async def retry(request: Request, job_id: str) -> Response:
        return await answer(request, "retry", job_id)

    @router.post("/purge-queue", responses=error_responses(401, job=True))
    async def purge_queue(request: Request) -> Response:
        return await answer(request, "purge-queue")

    if include_health:

        @router.get("/health")
        async def health(request: Request) -> Response:
            return await answer(request, "health")

    if openai_target is not None:

        @router.api_route(  # vLLM's operations, documented under /v1
            "/openai/v1/{path:path}",
            methods=["GET", "POST", "PUT", "DELETE", "PATCH"],
            include_in_schema=False,
        )
        async def openai_alias(request: Request, path: str) -> Response:
            return ForwardedRequest(openai_target(request), f"/v1/{path}")

    return router


def _request_body(model: type[BaseModel]) -> dict[str, Any]:
    """An OpenAPI requestBody for a route that reads its body itself (to name the field in
    400s): documented, not parsed by FastAPI."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    return {"required": True, "content": {"application/json": {"schema": schema}}}
