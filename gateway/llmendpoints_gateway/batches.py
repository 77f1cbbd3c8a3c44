"""The batch APIs at the gateway, on the shared queue: OpenAI's ``/v1/files`` + ``/v1/batches``
and RunPod's ``/v2/{endpoint}/batch...``, for every endpoint, with no runtime pod running.

The verbs are ``llmendpoints_common.batch.api.BatchAPI``'s (a pod without the queue serves the
same), over the queue's store (``NatsBatchStore``: records in ``LLMEP_BATCHES``, contents in the
object store ``LLMEP_FILES``) and its batch lane (``QueueLines``: each request a job of the
endpoint, in ``llmep.ep.<ns>.<name>.jobs.batch.*``). Every gateway replica also runs the batch drivers
(``BatchDrivers``): each batch is driven by the replica holding its lease, and by another when
that one goes.

What this module adds around them, as a front door across endpoints does:

- an OpenAI batch's model is the endpoint's that serves it, and only if the batch's key may use
  that endpoint (else the batch fails validation: the model does not exist for that key);
- a driver publishes each batch's remaining work and deadline for the autoscaler, and nudges it
  when the endpoint has no ready replica (a batch wakes an endpoint at zero);
- a RunPod batch's webhook, when it ends;
- the upload to ``/v1/files`` is read here, streamed, within LLMEP_BATCH_MAX_FILE_BYTES
  (``llmendpoints_edge.multipart``), not by the edge's body reader.

Usage: each request's tokens are metered when its job completes (usage.py's ``JobUsageMeter``,
``kind: "batch"``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import IO
from urllib.parse import parse_qsl

from llmendpoints_common.batch.api import BatchAPI, BatchCall, BatchReply
from llmendpoints_common.batch.driver import BatchDrivers
from llmendpoints_common.batch.record import BatchRecord, runpod_summary
from llmendpoints_common.batch.signal import BatchSignal
from llmendpoints_common.errors import NotFoundError, ServiceUnavailableError
from llmendpoints_common.queue.batch_lines import QueueLines
from llmendpoints_common.queue.batch_store import NatsBatchStore
from llmendpoints_common.queue.signals import drop_batch, publish_batch
from llmendpoints_common.webhooks import (
    DEFAULT_RETRIES,
    DEFAULT_RETRY_DELAY_SECONDS,
    WebhookSender,
)
from llmendpoints_edge.asgi import Receive, Scope, Send, send_json
from llmendpoints_edge.body import read_body
from llmendpoints_edge.multipart import read_multipart

from llmendpoints_gateway.access import Access
from llmendpoints_gateway.config import GatewaySettings
from llmendpoints_gateway.keys import Key
from llmendpoints_gateway.queue import SharedQueue
from llmendpoints_gateway.registry import Endpoint, Registry
from llmendpoints_gateway.request import RequestLog

logger = logging.getLogger("llmendpoints.gateway.batches")

OPENAI_PREFIXES = ("/v1/files", "/v1/batches")
CHUNK = 256 * 1024


def is_openai_batch_path(path: str) -> bool:
    """``/v1/files...`` or ``/v1/batches...`` (pure)."""
    return any(path == p or path.startswith(p + "/") for p in OPENAI_PREFIXES)


def is_runpod_batch_path(rest: str) -> bool:
    """What follows ``/v2/{endpoint}/``: ``batch`` or ``batch/...`` (pure)."""
    return rest == "batch" or rest.startswith("batch/")


async def send_reply(send: Send, reply: BatchReply) -> None:
    if reply.content is None:
        await send_json(send, reply.status, reply.body, reply.headers)
        return
    content: IO[bytes] = reply.content
    try:
        size = content.seek(0, 2)
        content.seek(0)
        await send(
            {
                "type": "http.response.start",
                "status": reply.status,
                "headers": [
                    (b"content-type", b"application/octet-stream"),
                    (b"content-length", str(size).encode()),
                ],
            }
        )
        while chunk := content.read(CHUNK):
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
    finally:
        content.close()


class BatchGateway:
    def __init__(
        self,
        queue: SharedQueue,
        access: Access,
        registry: Registry,
        settings: GatewaySettings,
        *,
        holder: str | None = None,
        nudge: Callable[[str], None] | None = None,
    ) -> None:
        self.queue = queue
        # Who holds a batch's lease: one per process (GATEWAY_WORKERS processes share the
        # gateway's id, and each runs drivers of its own).
        self.holder = holder or settings.gateway_id
        self.access = access
        self.registry = registry
        self.settings = settings
        self.limits = settings.batch_limits()
        self.nudge = nudge
        self.webhooks = WebhookSender(
            retries=DEFAULT_RETRIES,
            delay_seconds=DEFAULT_RETRY_DELAY_SECONDS,
            timeout_seconds=settings.webhook_timeout_seconds,
            max_concurrency=settings.webhook_max_concurrency,
            policy=settings.webhook_policy,
        )
        self.api: BatchAPI | None = None
        self.drivers: BatchDrivers | None = None
        self._task: asyncio.Task | None = None

    @property
    def pending_webhooks(self) -> int:
        return self.webhooks.pending

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        self._task = asyncio.create_task(self._connect(), name="batch-gateway")

    async def _connect(self) -> None:
        connection = await self.queue.wait()
        store = NatsBatchStore(connection.js)
        lines = QueueLines(connection)
        self.drivers = BatchDrivers(
            store,
            lines,
            holder=self.holder,
            limits=self.limits,
            resolve=self._resolve,
            signal=self._signal,
            on_end=self._ended,
        )
        self.api = BatchAPI(
            store,
            lines,
            self.limits,
            wake=self.drivers.wake,
            webhook_policy=self.settings.webhook_policy,
        )
        await self.drivers.start()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.drivers is not None:
            await self.drivers.stop()
        await self.webhooks.aclose(timeout=1.0)

    def _api(self) -> BatchAPI:
        if self.api is None:
            raise ServiceUnavailableError(
                "the shared queue is not reachable yet; retry", headers={"retry-after": "2"}
            )
        return self.api

    # ---- the drivers' callbacks ------------------------------------------------------------

    async def _resolve(self, owner: str, model: str) -> str:
        """The endpoint an OpenAI batch's model runs on, if the batch's key may use it."""
        ep = self.registry.by_model(model)
        key = self.access.keys.by_name(owner) if owner else None
        if ep is None or not self.access.allows(key, ep):
            raise LookupError(f"the model {model!r} does not exist")
        return ep.id

    async def _signal(self, record: BatchRecord) -> None:
        if record.endpoint is None:
            return
        js = (await self.queue.wait()).js
        if not record.active:
            await drop_batch(js, record.endpoint, record.id)
            return
        await publish_batch(js, record.endpoint, BatchSignal.of(record))
        ep = self.registry.by_id(record.endpoint)
        if ep is not None and not ep.ready and record.remaining and self.nudge is not None:
            self.nudge(ep.id)  # a batch wakes an endpoint at zero

    def _ended(self, record: BatchRecord) -> None:
        if record.api == "runpod" and record.webhook and record.endpoint is not None:
            ep = self.registry.by_id(record.endpoint)
            name = self.registry.address(ep) if ep is not None else record.endpoint
            self.webhooks.send(record.webhook, runpod_summary(record, name))

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
        api = self._api()
        method = scope["method"]
        caller, _ = Access.caller(key)
        upload = None
        body = b""
        if method == "POST" and path == "/v1/files":
            upload = await read_multipart(
                scope,
                receive,
                limit=self.settings.batch_max_file_bytes,
                setting="LLMEP_BATCH_MAX_FILE_BYTES",
                timeout=self.settings.batch_upload_timeout_seconds,
                timeout_setting="LLMEP_BATCH_UPLOAD_TIMEOUT_SECONDS",
            )
        elif method == "POST":
            body = await self._body(scope, receive)
        try:
            reply = await api.openai(
                BatchCall(
                    method=method,
                    path=path[len("/v1/") :],
                    caller=caller,
                    query=_query(scope),
                    body=body,
                    upload=upload,
                )
            )
        finally:
            if upload is not None:
                upload.close()
        await send_reply(state.send or send, reply)

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
        api = self._api()
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
