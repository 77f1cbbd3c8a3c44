"""HTTP routes of the batch APIs on one pod: a thin FastAPI layer over the framework-free verbs
(``llmendpoints_common.batch.api.BatchAPI``, which the gateway serves too).

- OpenAI: ``/v1/files`` (the upload is read here as it arrives, ``llmendpoints_edge.multipart``,
  within LLMEP_BATCH_MAX_FILE_BYTES and LLMEP_BATCH_UPLOAD_TIMEOUT_SECONDS, and stored a piece at
  a time; the edge's body reader leaves this one path to it; a file's content streams back the
  same way) and ``/v1/batches``;
- RunPod: ``/v2/{endpoint_id}/batch...`` (the endpoint id in the URL is accepted and ignored,
  as by the job routes: one pod serves one endpoint).

A pod on the shared queue (JOBS_QUEUE_URL) serves none of it: batches live in the queue's
store, which the gateway reaches and a pod's credential does not; every route then says so.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from llmendpoints_common.batch.api import BatchAPI, BatchCall, BatchReply
from llmendpoints_common.batch.limits import BatchEnv
from llmendpoints_common.errors import NotFoundError
from llmendpoints_edge.body import ClientGone, read_before
from llmendpoints_edge.multipart import MultipartReader

from llmendpoints_runtime.auth import caller
from llmendpoints_runtime.errors import error_responses
from llmendpoints_runtime.jobs.asgi import ASGIApp, ForwardedRequest
from llmendpoints_runtime.middleware import is_upload_path

BATCH_TAG = "Batch API (OpenAI files and batches, RunPod batch jobs)"

# What each error status of the batch routes means (their /openapi.json entries).
_WHEN = {
    400: "A field or the body is invalid (`param` names it)",
    404: "No such file or batch for this key (another key's ids are not found either)",
    408: "The upload did not arrive within LLMEP_BATCH_UPLOAD_TIMEOUT_SECONDS",
    409: "The batch's state does not allow this",
    413: "The file is over LLMEP_BATCH_MAX_FILE_BYTES, or the body over MAX_REQUEST_BODY_BYTES",
    415: "The upload is not multipart/form-data",
    429: "A bound of the key (files, bytes, batches not ended, enqueued tokens): the message "
    "names it and its setting",
    507: "The batch store is full (LLMEP_BATCH_LOCAL_MAX_BYTES)",
}


def batch_errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """``responses=`` for a batch route: the error statuses it answers, with their body."""
    return error_responses(*statuses, when=_WHEN)


def answer(reply: BatchReply) -> Response:
    if reply.content is not None:
        return StreamingResponse(
            reply.content.chunks(),
            media_type="application/octet-stream",
            headers={**reply.headers, "content-length": str(reply.content.size)},
        )
    return JSONResponse(reply.body, status_code=reply.status, headers=reply.headers)


async def _body(request: Request) -> bytes:
    body = read_before(request.scope)
    return body if body is not None else await request.body()


def upload_route(api: BatchAPI, settings: BatchEnv) -> Callable[[Request], Awaitable[Response]]:
    """``POST /v1/files``: the upload read as it arrives and stored a piece at a time."""

    async def create_file(request: Request) -> Response:
        reader = MultipartReader(
            request.scope,
            request.receive,
            limit=settings.batch_max_file_bytes,
            setting="LLMEP_BATCH_MAX_FILE_BYTES",
            timeout=settings.batch_upload_timeout_seconds,
            timeout_setting="LLMEP_BATCH_UPLOAD_TIMEOUT_SECONDS",
        )
        name, _ = caller(request.scope)
        try:
            reply = await api.openai(BatchCall("POST", "files", name, upload=reader.upload()))
        except ClientGone:
            return Response(status_code=499)
        if not reader.complete:  # answered before the whole body was read (a 429 first)
            reply.headers["connection"] = "close"
        return answer(reply)

    return create_file


def build_batch_routers(
    api: BatchAPI, settings: BatchEnv, *, endpoint: str, endpoint_name: str
) -> list[APIRouter]:
    """The OpenAI routes at the root and RunPod's under ``/v2/{endpoint_id}``."""
    router = APIRouter(tags=[BATCH_TAG])
    errors = batch_errors(400, 401, 404, 409, 413, 429)

    async def openai(request: Request, path: str) -> Response:
        name, _ = caller(request.scope)
        body = await _body(request) if request.method == "POST" else b""
        call = BatchCall(
            method=request.method, path=path, caller=name, query=dict(request.query_params),
            body=body,
        )  # fmt: skip
        return answer(await api.openai(call))

    router.add_api_route(
        "/v1/files",
        upload_route(api, settings),
        methods=["POST"],
        responses=batch_errors(400, 401, 408, 413, 415, 429, 507),
        name="create_file",
    )

    @router.get("/v1/files", responses=errors)
    async def list_files(request: Request) -> Response:
        return await openai(request, "files")

    @router.get("/v1/files/{file_id}", responses=errors)
    async def get_file(request: Request, file_id: str) -> Response:
        return await openai(request, f"files/{file_id}")

    @router.delete("/v1/files/{file_id}", responses=errors)
    async def delete_file(request: Request, file_id: str) -> Response:
        return await openai(request, f"files/{file_id}")

    @router.get("/v1/files/{file_id}/content", responses=errors)
    async def file_content(request: Request, file_id: str) -> Response:
        return await openai(request, f"files/{file_id}/content")

    @router.post("/v1/batches", responses=errors)
    async def create_batch(request: Request) -> Response:
        return await openai(request, "batches")

    @router.get("/v1/batches", responses=errors)
    async def list_batches(request: Request) -> Response:
        return await openai(request, "batches")

    @router.get("/v1/batches/{batch_id}", responses=errors)
    async def get_batch(request: Request, batch_id: str) -> Response:
        return await openai(request, f"batches/{batch_id}")

    @router.post("/v1/batches/{batch_id}/cancel", responses=errors)
    async def cancel_batch(request: Request, batch_id: str) -> Response:
        return await openai(request, f"batches/{batch_id}/cancel")

    runpod = APIRouter(prefix="/v2/{endpoint_id}", tags=[BATCH_TAG])

    async def runpod_batch(request: Request, endpoint_id: str, path: str = "") -> Response:
        name, _ = caller(request.scope)
        body = await _body(request) if request.method in ("POST", "PUT") else b""
        call = BatchCall(
            method=request.method,
            path=path,
            caller=name,
            query=dict(request.query_params),
            body=body,
        )
        return answer(await api.runpod(call, endpoint, endpoint_id or endpoint_name))

    # One route per method: each its own OpenAPI operation (and operation id).
    for path, methods in (("/batch", "GET POST"), ("/batch/{path:path}", "GET POST PUT DELETE")):
        for method in methods.split():
            runpod.add_api_route(
                path, runpod_batch, methods=[method], responses=errors,
                name=f"runpod_batch{'_path' if '{' in path else ''}_{method.lower()}",
            )  # fmt: skip
    return [router, runpod]


def unavailable_batch_routers(reason: str) -> list[APIRouter]:
    """Every batch route answering that this pod does not serve batches, and why."""
    router = APIRouter(include_in_schema=False)

    async def refuse(request: Request) -> Response:
        if is_upload_path(request.method, request.url.path):
            # The body was not read at the edge (an upload may be large): close instead.
            error = NotFoundError(reason, code="batches_unavailable")
            return JSONResponse(error.body(), status_code=404, headers={"connection": "close"})
        error = NotFoundError(reason, code="batches_unavailable")
        return JSONResponse(error.body(), status_code=404)

    for path in BATCH_PATHS:
        router.add_api_route(path, refuse, methods=["GET", "POST", "PUT", "DELETE"])
    return [router]


def forwarded_batch_routers(forward: ASGIApp) -> list[APIRouter]:
    """Every batch route answered by ``forward`` (the API process of the pod that keeps the
    batches: pod/forward.py); that process's own routes document them."""
    router = APIRouter(include_in_schema=False)

    async def passed(request: Request) -> Response:
        return ForwardedRequest(forward, request.scope["path"])

    for path in BATCH_PATHS:
        router.add_api_route(path, passed, methods=["GET", "POST", "PUT", "DELETE"])
    return [router]


# Every batch route, OpenAI's and RunPod's.
BATCH_PATHS = (
    "/v1/files",
    "/v1/files/{rest:path}",
    "/v1/batches",
    "/v1/batches/{rest:path}",
    "/v2/{endpoint_id}/batch",
    "/v2/{endpoint_id}/batch/{rest:path}",
)
