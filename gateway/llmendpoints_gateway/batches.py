"""The batch APIs at the gateway, on the shared queue: OpenAI's ``/v1/files`` + ``/v1/batches``
and RunPod's ``/v2/{endpoint}/batch...``, for every endpoint, with no runtime pod running.

The verbs are ``llmendpoints_common.batch.api.BatchAPI``'s (a pod without the queue serves the
same), over the queue's store (``NatsBatchStore``: records in ``LLMEP_BATCHES``, contents in the
object store ``LLMEP_FILES``) and its batch lane (``QueueLines``: each request a job of the
endpoint, in ``llmep.ep.<ns>.<name>.jobs.batch.*``). This is the serving side only: what moves a
batch along -- reading and validating its input, handing its requests to the lane, writing its
results -- runs in the pod's batch driver host, a process of its own (batch_host.py), never in
a process that relays interactive streams.

What this module adds around the verbs, as a front door across endpoints does:

- the upload to ``/v1/files`` is read here as it arrives (``llmendpoints_edge.multipart``,
  within LLMEP_BATCH_MAX_FILE_BYTES), not by the edge's body reader, and each piece goes to the
  object store before the next is read: the key's room is reserved before the body is read, and
  a refused upload is answered at once, its connection closed;
- a file's content is sent as it is read from the object store, a chunk at a time, each after
  the client took the last (``send`` waits while the connection's buffer is full);
- a RunPod batch finalized for an endpoint with no ready replica nudges the autoscaler.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from urllib.parse import parse_qsl

from llmendpoints_common.batch.api import BatchAPI, BatchCall, BatchReply
from llmendpoints_common.errors import NotFoundError, ServiceUnavailableError
from llmendpoints_common.queue.batch_lines import QueueLines
from llmendpoints_common.queue.batch_store import NatsBatchStore
from llmendpoints_edge.asgi import Receive, Scope, Send, closing_if_body, send_json
from llmendpoints_edge.body import read_body
from llmendpoints_edge.multipart import MultipartReader

from llmendpoints_gateway.access import Access
from llmendpoints_gateway.config import GatewaySettings
from llmendpoints_gateway.keys import Key
from llmendpoints_gateway.queue import SharedQueue
from llmendpoints_gateway.registry import Endpoint, Registry
from llmendpoints_gateway.request import RequestLog

logger = logging.getLogger("llmendpoints.gateway.batches")


async def send_reply(send: Send, reply: BatchReply) -> None:
    if reply.content is None:
        await send_json(send, reply.status, reply.body, reply.headers)
        return
    await send(
        {
            "type": "http.response.start",
            "status": reply.status,
            "headers": [
                (b"content-type", b"application/octet-stream"),
                (b"content-length", str(reply.content.size).encode()),
            ],
        }
    )
    # A chunk is read from the store when the last one was taken: memory stays one chunk per
    # download, whatever the file's size and however slowly the client reads.
    async for chunk in reply.content.chunks():
        await send({"type": "http.response.body", "body": chunk, "more_body": True})
    await send({"type": "http.response.body", "body": b""})


class BatchGateway:
    def __init__(
        self,
        queue: SharedQueue,
        registry: Registry,
        settings: GatewaySettings,
        *,
        nudge: Callable[[str], None] | None = None,
    ) -> None:
        self.queue = queue
        self.registry = registry
        self.settings = settings
        self.limits = settings.batch_limits()
        self.nudge = nudge  # an endpoint at zero with a batch to run
        self.api: BatchAPI | None = None  # made with the queue's first connection

    async def _api(self) -> BatchAPI:
        if self.api is None:
            if not self.queue.connected:
                raise ServiceUnavailableError(
                    "the shared queue is not reachable yet; retry", headers={"retry-after": "2"}
                )
            connection = await self.queue.wait()
            self.api = BatchAPI(
                NatsBatchStore(connection),
                QueueLines(connection),
                self.limits,
                webhook_policy=self.settings.webhook_policy,
            )
        return self.api

    # ---- HTTP ------------------------------------------------------------------------------

    async def openai(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        state: RequestLog,
        key: Key | None,
        path: str,
    ) -> None:
        """``/v1/files...`` and ``/v1/batches...`` (files and batches of the caller's key)."""
        api = await self._api()
        method = scope["method"]
        caller, _ = Access.caller(key)
        call = BatchCall(
            method=method, path=path[len("/v1/") :], caller=caller, query=_query(scope)
        )
        reply_to = state.send or send
        if method == "POST" and path == "/v1/files":
            reader = MultipartReader(
                scope,
                receive,
                limit=self.settings.batch_max_file_bytes,
                setting="LLMEP_BATCH_MAX_FILE_BYTES",
                timeout=self.settings.batch_upload_timeout_seconds,
                timeout_setting="LLMEP_BATCH_UPLOAD_TIMEOUT_SECONDS",
            )
            reply = await api.openai(replace(call, upload=reader.upload()))
            if not reader.complete:  # answered before the body was read (no room for it)
                reply_to = closing_if_body(scope, reply_to)
        else:
            if method == "POST":
                call = replace(call, body=await self._body(scope, receive))
            reply = await api.openai(call)
        await send_reply(reply_to, reply)

    async def runpod(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        state: RequestLog,
        key: Key | None,
        ep: Endpoint,
        rest: str,
    ) -> None:
        """``/v2/{endpoint}/batch...``; ``rest`` is what follows ``/v2/{endpoint}/``."""
        api = await self._api()
        method = scope["method"]
        state.endpoint = ep.id
        caller, _ = Access.caller(key)
        body = b""
        if method in ("POST", "PUT"):
            body = await self._body(scope, receive, arrays=rest == "batch")
        reply = await api.runpod(
            BatchCall(
                method=method,
                path=rest[len("batch") :],
                caller=caller,
                query=_query(scope),
                body=body,
            ),
            ep.id,
            self.registry.address(ep),
        )
        if rest.endswith("/finalize") and reply.status == 200 and not ep.ready and self.nudge:
            self.nudge(ep.id)
        await send_reply(state.send or send, reply)

    async def _body(self, scope: Scope, receive: Receive, *, arrays: bool = False) -> bytes:
        return await read_body(
            scope,
            receive,
            limit=self.settings.max_request_body_bytes,
            setting="MAX_REQUEST_BODY_BYTES",
            timeout=self.settings.request_read_timeout_seconds,
            arrays=arrays,
        )


def unavailable(path: str) -> NotFoundError:
    return NotFoundError(
        f"{path}: batches need the shared job queue (JOBS_QUEUE_URL) and LLMEP_BATCH_ENABLED, "
        "which this gateway does not have",
        code="batches_unavailable",
    )


def _query(scope: Scope) -> dict[str, str]:
    return dict(parse_qsl((scope.get("query_string") or b"").decode("latin-1")))
