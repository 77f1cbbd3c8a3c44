"""HTTP routes of the batch APIs on one pod: a thin FastAPI layer over the framework-free verbs
(``llmendpoints_common.batch.api.BatchAPI``, which the gateway serves too).

- OpenAI: ``/v1/files`` (the upload is read here, streamed: ``llmendpoints_edge.multipart``,
  within LLMEP_BATCH_MAX_FILE_BYTES and LLMEP_BATCH_UPLOAD_TIMEOUT_SECONDS; the edge's body
  reader leaves this one path to it) and ``/v1/batches``;
- RunPod: ``/v2/{endpoint_id}/batch...`` (the endpoint id in the URL is accepted and ignored,
  as by the job routes: one pod serves one endpoint).

A pod on the shared queue (JOBS_QUEUE_URL) serves none of it: batches live in the queue's
store, which the gateway reaches and a pod's credential does not; every route then says so.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import IO

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from llmendpoints_common.batch.api import BatchAPI, BatchCall, BatchReply
from llmendpoints_common.batch.limits import BatchEnv
from llmendpoints_common.errors import NotFoundError
from llmendpoints_edge.body import ClientGone, read_before
from llmendpoints_edge.multipart import read_multipart

from llmendpoints_runtime.auth import caller
from llmendpoints_runtime.errors import error_responses
from llmendpoints_runtime.jobs.asgi import ASGIApp, ForwardedRequest

BATCH_TAG = "Batch API (OpenAI files and batches, RunPod batch jobs)"
CHUNK = 256 * 1024
UPLOAD_PATH = "/v1/files"


def is_upload(method: str, path: str) -> bool:
    """The one request whose body the batch route reads itself (pure)."""
    return method == "POST" and path == UPLOAD_PATH


def is_runpod_create(method: str, path: str) -> bool:
    """``POST /v2/{endpoint}/batch``: RunPod's body is a JSON array (pure)."""
    parts = path.split("/")
    return method == "POST" and len(parts) == 4 and parts[1] == "v2" and parts[3] == "batch"


async def _chunks(handle: IO[bytes]) -> AsyncIterator[bytes]:
    try:
        while chunk := handle.read(CHUNK):
            yield chunk
    finally:
        handle.close()


def answer(reply: BatchReply) -> Response:
    if reply.content is not None:
        return StreamingResponse(
            _chunks(reply.content), media_type="application/octet-stream", headers=reply.headers
        )
    return JSONResponse(reply.body, status_code=reply.status, headers=reply.headers)


async def _body(request: Request) -> bytes:
    body = read_before(request.scope)
    return body if body is not None else await request.body()


def build_batch_routers(
    api: BatchAPI, settings: BatchEnv, *, endpoint: str, endpoint_name: str
) -> list[APIRouter]:
    """The OpenAI routes at the root and RunPod's under ``/v2/{endpoint_id}``."""
    router = APIRouter(tags=[BATCH_TAG])
    errors = error_responses(400, 401, 404, 409, 413, 429)

    async def openai(request: Request, path: str, upload=None) -> Response:
        name, _ = caller(request.scope)
        body = await _body(request) if request.method == "POST" and upload is None else b""
        call = BatchCall(
            method=request.method,
            path=path,
            caller=name,
            query=dict(request.query_params),
            body=body,
            upload=upload,
        )
        return answer(await api.openai(call))

    @router.post("/v1/files", responses=errors)
    async def create_file(request: Request) -> Response:
        try:
            upload = await read_multipart(
                request.scope,
                request.receive,
                limit=settings.batch_max_file_bytes,
                setting="LLMEP_BATCH_MAX_FILE_BYTES",
                timeout=settings.batch_upload_timeout_seconds,
                timeout_setting="LLMEP_BATCH_UPLOAD_TIMEOUT_SECONDS",
            )
        except ClientGone:
            return Response(status_code=499)
        try:
            return await openai(request, "files", upload)
        finally:
            upload.close()

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

    @runpod.api_route("/batch", methods=["GET", "POST"], responses=errors)
    @runpod.api_route("/batch/{path:path}", methods=["GET", "POST", "PUT", "DELETE"], responses=errors)  # fmt: skip
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

    return [router, runpod]


def unavailable_batch_routers(reason: str) -> list[APIRouter]:
    """Every batch route answering that this pod does not serve batches, and why."""
    router = APIRouter(include_in_schema=False)

    async def refuse(request: Request) -> Response:
        if is_upload(request.method, request.url.path):
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
