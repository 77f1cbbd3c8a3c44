"""The batch APIs' verbs over HTTP-shaped input, written once for both front doors (as the job
API's ``JobVerbs``): ``BatchCall -> BatchReply``, no web framework.

- OpenAI (``/v1/...``): ``POST /files`` (the multipart upload, read by the front door),
  ``GET /files``, ``GET /files/{id}``, ``GET /files/{id}/content``, ``DELETE /files/{id}``;
  ``POST /batches``, ``GET /batches``, ``GET /batches/{id}``, ``POST /batches/{id}/cancel``.
- RunPod (``/v2/{endpoint}/batch...``): see ``runpod.py``.

Files and batches belong to the caller's key: another key's id is answered like an id that
does not exist (404), and a listing shows the caller's own only. What a key may hold is
bounded (files, bytes, batches not ended, tokens those batches queue): beyond, 429 saying which
bound and its setting.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import IO, Any

from llmendpoints_common.batch import jsonl, runpod
from llmendpoints_common.batch.driver import LineRunner, part_bytes
from llmendpoints_common.batch.files import (
    FileRecord,
    check_filename,
    check_purpose,
    check_ttl,
    expires_after,
    new_file_id,
)
from llmendpoints_common.batch.limits import BatchLimits
from llmendpoints_common.batch.output import runpod_request
from llmendpoints_common.batch.record import (
    ESTIMATE_KEY,
    MAX_METADATA_PAIRS,
    ON_SCHEDULE_KEY,
    BatchRecord,
    BatchStatus,
    Conflict,
    add_part,
    finalize_draft,
    line_job_id,
    new_batch_id,
    openai_object,
    remove_request,
    request_cancel,
    runpod_summary,
)
from llmendpoints_common.batch.store import BatchStore, StoreFull, stored_bytes, update_batch
from llmendpoints_common.destinations import DestinationPolicy, DestinationRefused, check_url
from llmendpoints_common.errors import (
    APIError,
    BadRequestError,
    ConflictError,
    NotFoundError,
    RateLimitError,
    job_error_body,
)
from llmendpoints_common.jobs.models import JobLimits, parse_json_object

_BATCH_FIELDS = frozenset(
    {"input_file_id", "endpoint", "completion_window", "metadata", "output_expires_after"}
)


@dataclass(frozen=True)
class BatchCall:
    method: str
    # What follows the API's prefix: "files/<id>/content", "batches/<id>/cancel" (OpenAI);
    # "", "<id>", "<id>/requests" (RunPod, after /v2/{endpoint}/batch).
    path: str
    caller: str  # the API key's name: the owner of what it makes
    query: Mapping[str, str] = field(default_factory=dict)
    body: bytes = b""
    # POST /v1/files: the form as the front door read it (``llmendpoints_edge.multipart``).
    upload: Any = None


@dataclass
class BatchReply:
    status: int
    body: Any = None
    # A file's content (GET /v1/files/{id}/content), to be streamed and closed.
    content: IO[bytes] | None = None
    headers: dict[str, str] = field(default_factory=dict)


def _parts(path: str) -> list[str]:
    return [p for p in path.strip("/").split("/") if p]


def _route_shape(parts: list[str]) -> bool:
    """Whether ``parts`` is the shape of an OpenAI batch route (another method: 405)."""
    if not parts or parts[0] not in ("files", "batches"):
        return False
    tail = {"files": "content", "batches": "cancel"}[parts[0]]
    return len(parts) <= 2 or (len(parts) == 3 and parts[2] == tail)


def _list_page(
    items: list[dict[str, Any]], query: Mapping[str, str], *, default: int, most: int
) -> dict[str, Any]:
    """OpenAI's list object over ``items`` (already in order): ``after`` an id, ``limit``."""
    raw = query.get("limit")
    if raw is not None and (not raw.isdigit() or not 1 <= int(raw) <= most):
        raise BadRequestError(f"limit: a whole number from 1 to {most}, got {raw!r}", param="limit")
    limit = int(raw) if raw is not None else default
    after = query.get("after")
    if after:
        ids = [item["id"] for item in items]
        items = items[ids.index(after) + 1 :] if after in ids else []
    page = items[:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(items) > limit,
    }


class BatchAPI:
    def __init__(
        self,
        store: BatchStore,
        runner: LineRunner,
        limits: BatchLimits,
        *,
        clock: Callable[[], float] = time.time,
        wake: Callable[[], None] = lambda: None,
        webhook_policy: DestinationPolicy | None = None,
        job_limits: JobLimits | None = None,
    ) -> None:
        self.store = store
        self.runner = runner
        self.limits = limits
        self.clock = clock
        self.wake = wake
        self.webhook_policy = webhook_policy or DestinationPolicy()
        self.job_limits = job_limits

    # ---- OpenAI ----------------------------------------------------------------------------

    async def openai(self, call: BatchCall) -> BatchReply:
        try:
            return await self._openai(call)
        except APIError as exc:
            return BatchReply(exc.status_code, exc.body(), headers=dict(exc.headers))

    async def _openai(self, call: BatchCall) -> BatchReply:
        parts, method, owner = _parts(call.path), call.method, call.caller
        match parts, method:
            case ["files"], "POST":
                return BatchReply(200, await self.create_file(call.upload, owner))
            case ["files"], "GET":
                return BatchReply(200, await self._list_files(owner, call.query))
            case ["files", file_id], "GET":
                return BatchReply(200, (await self._file(owner, file_id)).to_openai())
            case ["files", file_id], "DELETE":
                if not await self.store.delete_file(owner, file_id):
                    raise _no_file(file_id)
                return BatchReply(200, {"id": file_id, "object": "file", "deleted": True})
            case ["files", file_id, "content"], "GET":
                handle = await self.store.open_file(owner, file_id)
                if handle is None:
                    raise _no_file(file_id)
                return BatchReply(200, content=handle)
            case ["batches"], "POST":
                return BatchReply(200, openai_object(await self.create_batch(call.body, owner)))
            case ["batches"], "GET":
                batches = sorted(
                    await self.store.batches(owner),
                    key=lambda r: (r.created_at, r.id),
                    reverse=True,
                )
                items = [openai_object(b) for b in batches if b.api == "openai"]
                return BatchReply(200, _list_page(items, call.query, default=20, most=100))
            case ["batches", batch_id], "GET":
                return BatchReply(200, openai_object(await self._batch(owner, batch_id)))
            case ["batches", batch_id, "cancel"], "POST":
                record = await self._cancel(owner, batch_id)
                return BatchReply(200, openai_object(record))
        if _route_shape(parts):
            raise APIError(405, f"{method} /v1/{'/'.join(parts)}: not a method of this route")
        raise NotFoundError(f"/v1/{call.path} is not a route of the Batch API")

    async def _file(self, owner: str, file_id: str) -> FileRecord:
        record = await self.store.file(owner, file_id)
        if record is None:
            raise _no_file(file_id)
        return record

    async def _batch(self, owner: str, batch_id: str, api: str = "openai") -> BatchRecord:
        current = await self.store.batch(owner, batch_id)
        if current is None or current[0].api != api:
            raise _no_batch(batch_id)
        return current[0]

    async def _list_files(self, owner: str, query: Mapping[str, str]) -> dict[str, Any]:
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise BadRequestError(f"order: 'asc' or 'desc', got {order!r}", param="order")
        files = sorted(await self.store.files(owner), key=lambda f: (f.created_at, f.id))
        if order == "desc":
            files.reverse()
        purpose = query.get("purpose")
        items = [f.to_openai() for f in files if purpose is None or f.purpose == purpose]
        return _list_page(items, query, default=10_000, most=10_000)

    async def create_file(self, upload: Any, owner: str) -> dict[str, Any]:
        """``POST /v1/files``: an input file stored for its key, within the key's bounds."""
        if upload is None or upload.file is None:
            raise BadRequestError("file: required (a multipart upload)", param="file")
        fields = upload.fields
        check_purpose(fields.get("purpose"))
        filename = check_filename(upload.filename)
        ttl = expires_after(
            fields.get("expires_after[anchor]"), fields.get("expires_after[seconds]"), self.limits
        )
        files = await self.store.files(owner)
        batches = await self.store.batches(owner)
        self._check_room(files, batches, upload.size, owner)
        lines, tokens = await asyncio.to_thread(_count, upload.file, self.limits)
        upload.file.seek(0)
        now = self.clock()
        record = FileRecord(
            id=new_file_id(),
            owner=owner,
            filename=filename,
            purpose="batch",
            bytes=upload.size,
            created_at=now,
            expires_at=now + ttl,
            lines=lines,
            tokens=tokens,
        )
        try:
            await self.store.put_file(record, upload.file)
        except StoreFull as exc:
            raise APIError(507, str(exc), code="storage_full") from None
        return record.to_openai()

    def _check_room(
        self, files: list[FileRecord], batches: list[BatchRecord], size: int, owner: str
    ) -> None:
        limits = self.limits
        if len(files) + 1 > limits.max_files_per_key:
            raise RateLimitError(
                f"this key keeps {len(files)} files; at most {limits.max_files_per_key} "
                "(LLMEP_BATCH_MAX_FILES_PER_KEY): delete some, or wait for them to expire",
                code="file_limit_exceeded",
            )
        used = stored_bytes(files, batches)
        if used + size > limits.max_bytes_per_key:
            raise RateLimitError(
                f"this key keeps {used} bytes of files and batch inputs; {size} more would "
                f"pass its {limits.max_bytes_per_key} (LLMEP_BATCH_MAX_BYTES_PER_KEY)",
                code="storage_limit_exceeded",
            )

    async def create_batch(self, body: bytes, owner: str) -> BatchRecord:
        """``POST /v1/batches``: a batch of the caller's input file, ``validating`` until its
        driver has read the file."""
        value = parse_json_object(body)
        for key in value:
            if key not in _BATCH_FIELDS:
                raise BadRequestError(f"{key}: unknown field", param=key)
        for key in ("input_file_id", "endpoint", "completion_window"):
            if key not in value:
                raise BadRequestError(f"{key}: required", param=key)
        try:
            endpoint = jsonl.check_endpoint(value["endpoint"])
        except ValueError as exc:
            raise BadRequestError(str(exc), param="endpoint") from None
        window = value["completion_window"]
        seconds = self.limits.window_seconds(window)
        metadata = check_metadata(value.get("metadata"))
        output_ttl = self.limits.file_ttl_seconds
        if (expiry := value.get("output_expires_after")) is not None:
            if not isinstance(expiry, dict) or expiry.get("anchor") != "created_at":
                raise BadRequestError(
                    'output_expires_after: {"anchor": "created_at", "seconds": n}',
                    param="output_expires_after",
                )
            output_ttl = check_ttl(expiry.get("seconds"), self.limits, field="output_expires_after")
        file_id = value["input_file_id"]
        if not isinstance(file_id, str):
            raise BadRequestError("input_file_id: a file id", param="input_file_id")
        input_file = await self.store.file(owner, file_id)
        if input_file is None:
            raise _no_file(file_id, param="input_file_id")
        if input_file.purpose != "batch":
            raise BadRequestError(
                f"input_file_id: {file_id} is a {input_file.purpose} file; upload the input "
                "with purpose=batch",
                param="input_file_id",
            )
        await self._check_queue(owner, input_file.tokens)
        now = self.clock()
        record = BatchRecord(
            id=new_batch_id(),
            api="openai",
            owner=owner,
            created_at=now,
            expires_at=now + seconds,
            completion_window=window,
            status=BatchStatus.VALIDATING,
            openai_endpoint=endpoint,
            input_file_id=file_id,
            metadata=metadata,
            tokens=input_file.tokens,
            total=0,
            output_ttl_seconds=output_ttl,
        )
        await self.store.write_batch(record, 0)
        self.wake()
        return record

    async def _check_queue(self, owner: str, tokens: int, *, endpoint: str | None = None) -> None:
        """The key's batches not ended, and the tokens they queue: 429 beyond either bound."""
        active = [b for b in await self.store.batches(owner) if b.active]
        limits = self.limits
        if len(active) + 1 > limits.max_active_batches_per_key:
            raise RateLimitError(
                f"this key has {len(active)} batches not ended; at most "
                f"{limits.max_active_batches_per_key} (LLMEP_BATCH_MAX_ACTIVE_PER_KEY)",
                code="batch_limit_exceeded",
            )
        queued = sum(b.tokens for b in active if b.status is not BatchStatus.DRAFT)
        if queued + tokens > limits.max_enqueued_tokens_per_key:
            raise RateLimitError(
                f"this key's batches queue about {queued} tokens; this one adds about {tokens}, "
                f"past its limit of {limits.max_enqueued_tokens_per_key} enqueued tokens "
                "(LLMEP_BATCH_MAX_ENQUEUED_TOKENS); retry when a batch has ended",
                code="enqueued_token_limit_exceeded",
            )

    async def _cancel(self, owner: str, batch_id: str, api: str = "openai") -> BatchRecord:
        await self._batch(owner, batch_id, api)
        try:
            result = await update_batch(
                self.store, owner, batch_id, lambda r: request_cancel(r, now=self.clock())
            )
        except Conflict as exc:
            raise ConflictError(str(exc), param="batch_id") from None
        if result is None:
            raise _no_batch(batch_id)
        self.wake()
        return result[1]

    # ---- RunPod ----------------------------------------------------------------------------

    async def runpod(self, call: BatchCall, endpoint: str, endpoint_name: str) -> BatchReply:
        """``/v2/{endpoint}/batch/<call.path>`` for ``endpoint`` ("<namespace>/<name>")."""
        parts = _parts(call.path)
        try:
            return await self._runpod(call, parts, endpoint, endpoint_name)
        except APIError as exc:
            batch_id = parts[0] if parts else None
            body = job_error_body(exc, job_id=batch_id)
            return BatchReply(exc.status_code, body, headers=dict(exc.headers))

    async def _runpod(
        self, call: BatchCall, parts: list[str], endpoint: str, name: str
    ) -> BatchReply:
        owner, method = call.caller, call.method

        async def mine(batch_id: str) -> BatchRecord:
            record = await self._batch(owner, batch_id, "runpod")
            if record.endpoint != endpoint:
                raise _no_batch(batch_id)
            return record

        match parts, method:
            case [], "POST":
                created = runpod.parse_create(_json(call.body), self.limits, self.job_limits)
                record = await self._create_runpod(created, owner, endpoint)
                return BatchReply(200, {"id": record.id, "status": "DRAFT"})
            case [], "GET":
                batches = [
                    b
                    for b in await self.store.batches(owner)
                    if b.api == "runpod" and b.endpoint == endpoint
                ]
                batches.sort(key=lambda r: (r.created_at, r.id), reverse=True)
                return BatchReply(200, {"batches": [runpod_summary(b, name) for b in batches]})
            case [batch_id], "GET":
                return BatchReply(200, runpod_summary(await mine(batch_id), name))
            case [batch_id], "PUT":
                await mine(batch_id)
                update = runpod.parse_update(_json(call.body))
                if update.get("webhook"):
                    self._check_webhook(update["webhook"])
                result = await update_batch(
                    self.store, owner, batch_id, lambda r: r.model_copy(update=update)
                )
                if result is None:
                    raise _no_batch(batch_id)
                return BatchReply(200, runpod_summary(result[1], name))
            case [batch_id, "requests"], "POST":
                record = await mine(batch_id)
                requests = runpod.parse_append(_json(call.body), self.limits, self.job_limits)
                record = await self._append(record, requests)
                return BatchReply(200, runpod_summary(record, name))
            case [batch_id, "requests"], "GET":
                record = await mine(batch_id)
                return BatchReply(200, await self._results(record, call.query))
            case [batch_id, "requests", request_id], "DELETE":
                record = await mine(batch_id)
                index = _request_index(record, request_id)
                try:
                    result = await update_batch(
                        self.store, owner, batch_id, lambda r: remove_request(r, index)
                    )
                except KeyError:
                    raise NotFoundError(
                        f"batch {batch_id} has no request {request_id!r}", param="requestId"
                    ) from None
                except Conflict as exc:
                    raise ConflictError(str(exc), param="requestId") from None
                assert result is not None
                return BatchReply(200, runpod_summary(result[1], name))
            case [batch_id, "finalize"], "POST":
                record = await mine(batch_id)
                if record.status is BatchStatus.DRAFT:
                    await self._check_queue(owner, record.tokens, endpoint=endpoint)
                try:
                    result = await update_batch(
                        self.store, owner, batch_id, lambda r: finalize_draft(r, now=self.clock())
                    )
                except Conflict as exc:
                    raise ConflictError(str(exc), param="id") from None
                assert result is not None
                self.wake()
                return BatchReply(200, runpod_summary(result[1], name))
            case [batch_id, "cancel"], "POST":
                await mine(batch_id)
                return BatchReply(200, runpod_summary(await self._cancel(owner, batch_id, "runpod"), name))  # fmt: skip
        raise NotFoundError(f"{method} /batch/{call.path.strip('/')} is not a batch route")

    def _check_webhook(self, url: str) -> None:
        try:
            check_url(url, self.webhook_policy)
        except DestinationRefused as exc:
            raise BadRequestError(f"webhook: {exc}", param="webhook") from None

    async def _create_runpod(
        self, created: runpod.BatchCreate, owner: str, endpoint: str
    ) -> BatchRecord:
        if created.webhook is not None:
            self._check_webhook(created.webhook)
        mine = [
            b
            for b in await self.store.batches(owner)
            if b.active and b.api == "runpod" and b.endpoint == endpoint
        ]
        if len(mine) + 1 > self.limits.runpod_max_active_batches:
            raise RateLimitError(
                f"this key has {len(mine)} batches of this endpoint not ended; at most "
                f"{self.limits.runpod_max_active_batches} active batches per endpoint",
                code="batch_limit_exceeded",
            )
        now = self.clock()
        window = self.limits.default_window
        record = BatchRecord(
            id=new_batch_id(),
            api="runpod",
            owner=owner,
            created_at=now,
            expires_at=now + self.limits.window_seconds(window),
            completion_window=window,
            status=BatchStatus.DRAFT,
            endpoint=endpoint,
            name=created.name,
            webhook=created.webhook,
            output_ttl_seconds=self.limits.file_ttl_seconds,
        )
        await self.store.write_batch(record, 0)
        if created.requests:
            record = await self._append(record, created.requests)
        return record

    async def _append(self, record: BatchRecord, requests: list[dict[str, Any]]) -> BatchRecord:
        if record.status is not BatchStatus.DRAFT:
            raise ConflictError(
                f"batch {record.id} is not DRAFT: requests can be added only while it is",
                param="id",
            )
        if record.total + len(requests) > self.limits.runpod_max_requests:
            raise BadRequestError(
                f"requests: batch {record.id} holds {record.total}; {len(requests)} more would "
                f"pass {self.limits.runpod_max_requests} requests per batch",
                param="requests",
            )
        if not requests:
            return record
        data = part_bytes([{"request": r} for r in requests])
        files = await self.store.files(record.owner)
        batches = await self.store.batches(record.owner)
        self._check_room(files, batches, len(data), record.owner)
        tokens = sum(_job_tokens(r, self.limits.default_max_tokens) for r in requests)
        part_id = uuid.uuid4().hex
        try:
            await self.store.put_part(record, part_id, data)
        except StoreFull as exc:
            raise APIError(507, str(exc), code="storage_full") from None
        try:
            result = await update_batch(
                self.store,
                record.owner,
                record.id,
                lambda r: add_part(r, part_id, len(requests), tokens, len(data)),
            )
        except Conflict as exc:
            raise ConflictError(str(exc), param="id") from None
        if result is None:
            raise _no_batch(record.id)
        return result[1]

    async def _results(self, record: BatchRecord, query: Mapping[str, str]) -> dict[str, Any]:
        offset, limit = runpod.page(dict(query))
        removed = set(record.removed)
        indexes = [i for i in range(sum(record.parts)) if i not in removed]
        page = indexes[offset : offset + limit]
        requests = []
        for index in page:
            outcome = await self.runner.outcome(record, index)
            ending = record.ending or (
                "cancelled" if record.status is BatchStatus.CANCELLED else None
            )
            if record.status is BatchStatus.EXPIRED:
                ending = "expired"
            requests.append(runpod_request(line_job_id(record.id, index), outcome, ending))
        return {
            "requests": requests,
            "total": len(indexes),
            "offset": offset,
            "limit": limit,
            "hasMore": offset + len(page) < len(indexes),
        }


def check_metadata(metadata: Any) -> dict[str, str] | None:
    """OpenAI's metadata: at most 16 pairs, keys up to 64 characters, string values up to 512.
    Keys starting ``llmep_`` are this server's (the estimate it adds)."""
    if metadata is None:
        return None
    if not isinstance(metadata, dict):
        raise BadRequestError("metadata: an object of string values", param="metadata")
    if len(metadata) > MAX_METADATA_PAIRS:
        raise BadRequestError(
            f"metadata: at most {MAX_METADATA_PAIRS} pairs, got {len(metadata)}", param="metadata"
        )
    for key, value in metadata.items():
        if len(key) > 64:
            raise BadRequestError(f"metadata.{key[:64]}...: keys are at most 64 characters", param="metadata")  # fmt: skip
        if key.startswith("llmep_") or key in (ESTIMATE_KEY, ON_SCHEDULE_KEY):
            raise BadRequestError(
                f"metadata.{key}: keys starting with llmep_ are the server's", param=f"metadata.{key}"
            )  # fmt: skip
        if not isinstance(value, str) or len(value) > 512:
            raise BadRequestError(
                f"metadata.{key}: a string of at most 512 characters", param=f"metadata.{key}"
            )
    return dict(metadata)


def _count(handle: IO[bytes], limits: BatchLimits) -> tuple[int, int]:
    """An input file's lines and a token estimate, read as uploaded (not validated: that is
    the batch's validation; a line that is not JSON counts its bytes / 4)."""
    lines = tokens = 0
    for raw in handle:
        if not raw.strip():
            continue
        lines += 1
        try:
            value = json.loads(raw)
            body = value.get("body") if isinstance(value, dict) else None
        except (ValueError, RecursionError):
            body = None
        if isinstance(body, dict):
            tokens += jsonl.estimate_tokens(body, limits.default_max_tokens)
        else:
            tokens += len(raw) // 4
    return lines, tokens


def _job_tokens(request: dict[str, Any], default_max_tokens: int) -> int:
    job_input = request.get("input") or {}
    if isinstance(job_input.get("openai_input"), dict):
        return jsonl.estimate_tokens(job_input["openai_input"], default_max_tokens)
    params = job_input.get("sampling_params") or {}
    body = {
        "prompt": job_input.get("prompt") or job_input.get("messages") or "",
        "max_tokens": params.get("max_tokens"),
        "n": params.get("n"),
    }
    return jsonl.estimate_tokens(body, default_max_tokens)


def _request_index(record: BatchRecord, request_id: str) -> int:
    prefix = record.id.removeprefix("batch_") + "-"
    tail = request_id.removeprefix(prefix)
    if tail == request_id or not tail.isdigit():
        raise NotFoundError(f"batch {record.id} has no request {request_id!r}", param="requestId")
    return int(tail)


def _json(body: bytes) -> Any:
    if not body.strip():
        raise BadRequestError("the request body is empty; expected JSON")
    try:
        return json.loads(body)
    except (ValueError, RecursionError):
        raise BadRequestError("the request body is not valid JSON") from None


def _no_file(file_id: str, param: str = "file_id") -> NotFoundError:
    return NotFoundError(f"no file with id {file_id!r}", param=param)


def _no_batch(batch_id: str) -> NotFoundError:
    return NotFoundError(f"no batch with id {batch_id!r}", param="batch_id")
