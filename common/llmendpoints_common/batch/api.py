"""The batch APIs' verbs over HTTP-shaped input, written once for both front doors (as the job
API's ``JobVerbs``): ``BatchCall -> BatchReply``, no web framework.

- OpenAI (``/v1/...``): ``POST /files`` (the multipart upload as events from the front door's
  reader, stored as it arrives, after the key's room for it is reserved: room.py),
  ``GET /files``, ``GET /files/{id}``, ``GET /files/{id}/content``, ``DELETE /files/{id}``;
  ``POST /batches``, ``GET /batches``, ``GET /batches/{id}``, ``POST /batches/{id}/cancel``.
- RunPod (``/v2/{endpoint}/batch...``): see ``runpod.py``.

Files and batches belong to the caller's key: another key's id is answered like an id that
does not exist (404), and a listing shows the caller's own only. What a key may hold is
bounded (files, bytes, batches not ended, tokens those batches queue): beyond, 429 saying which
bound and its setting. A file's content is answered as a ``FileContent``: the front door sends
it a chunk at a time as it is read from the store.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from llmendpoints_common.batch import jsonl, runpod
from llmendpoints_common.batch.driver import LineRunner, part_bytes
from llmendpoints_common.batch.files import (
    FileContent,
    FileRecord,
    FileStart,
    FormField,
    Upload,
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
from llmendpoints_common.batch.room import SETTLED_SECONDS, Hold, Room
from llmendpoints_common.batch.room import check as check_room
from llmendpoints_common.batch.store import (
    BatchStore,
    ContentWriter,
    StaleRevision,
    StoreFull,
    update_batch,
)
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
    # POST /v1/files: the form as it arrives (``llmendpoints_edge.multipart``).
    upload: Upload | None = None


@dataclass
class BatchReply:
    status: int
    body: Any = None
    # A file's content (GET /v1/files/{id}/content), streamed from the store as it is sent.
    content: FileContent | None = None
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
    if raw is not None and (not _whole(raw) or not 1 <= int(raw) <= most):
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
                await self._let_go(owner, file_id)
                return BatchReply(200, {"id": file_id, "object": "file", "deleted": True})
            case ["files", file_id, "content"], "GET":
                content = await self.store.open_file(owner, file_id)
                if content is None:
                    raise _no_file(file_id)
                return BatchReply(200, content=content)
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

    async def create_file(self, upload: Upload, owner: str) -> dict[str, Any]:
        """``POST /v1/files``: an input file stored for its key as it arrives. Room for it is
        reserved first -- a file, and at most its declared size (else the largest a file may
        be) -- so concurrent uploads cannot pass the key's bounds together, and nothing is
        stored for an upload the key has no room for."""
        limits = self.limits
        size = limits.max_file_bytes
        if upload.declared is not None:
            size = min(upload.declared, size)
        file_id = new_file_id()
        until = self.clock() + limits.upload_timeout_seconds + SETTLED_SECONDS
        await self._hold(owner, file_id, Hold(bytes=size, until=until), adding_file=True)
        try:
            record = await self._receive(upload, owner, file_id)
        except BaseException:
            with contextlib.suppress(Exception):
                await self._let_go(owner, file_id)
            raise
        # Stored: the hold shrinks to the file, and stays a minute (counted once with it).
        settled = Hold(bytes=record.bytes, until=self.clock() + SETTLED_SECONDS)
        await self._change_room(owner, lambda room, now: room.holding(file_id, settled, now))
        return record.to_openai()

    async def _receive(self, upload: Upload, owner: str, file_id: str) -> FileRecord:
        """The form's events as they come: fields kept, the file's bytes counted and stored."""
        fields: dict[str, str] = {}
        writer: ContentWriter | None = None
        counted = jsonl.UploadCount(self.limits)
        filename, ttl = "", 0
        try:
            async for event in upload.events:
                if isinstance(event, FormField):
                    _after_file(event.name, writer is not None)
                    fields[event.name] = event.value
                elif isinstance(event, FileStart):
                    if "purpose" in fields:
                        check_purpose(fields["purpose"])
                    filename = check_filename(event.filename)
                    ttl = expires_after(
                        fields.get("expires_after[anchor]"),
                        fields.get("expires_after[seconds]"),
                        self.limits,
                    )
                    writer = await self.store.write_file(owner, file_id, ttl)
                elif isinstance(event, bytes) and writer is not None:
                    counted.feed(event)
                    await writer.write(event)
            if writer is None:
                raise BadRequestError("file: required (a multipart upload)", param="file")
            check_purpose(fields.get("purpose"))
            counted.finish()
            now = self.clock()
            record = FileRecord(
                id=file_id,
                owner=owner,
                filename=filename,
                purpose="batch",
                bytes=writer.size,
                created_at=now,
                expires_at=now + ttl,
                lines=counted.lines,
                tokens=counted.tokens,
            )
            await writer.commit(record)
        except StoreFull as exc:
            await _abort(writer)
            raise APIError(507, str(exc), code="storage_full") from None
        except BaseException:
            await _abort(writer)
            raise
        return record

    # ---- room reserved per key (room.py) -----------------------------------------------------

    async def _hold(
        self, owner: str, hold_id: str, hold: Hold, *, adding_file: bool = False
    ) -> None:
        """Reserve ``hold`` for ``owner`` if the key's bounds have room for it (429 if not):
        the key's room record read first, then what it stores, then the record written back
        at the revision read -- a write that lost to another reservation reads again."""
        while True:
            room, revision = await self.store.room(owner)
            files = await self.store.files(owner)
            batches = await self.store.batches(owner)
            now = self.clock()
            check_room(
                self.limits, files, batches, room, now,
                adding_files=int(adding_file), adding_bytes=hold.bytes,
            )  # fmt: skip
            try:
                await self.store.write_room(owner, room.holding(hold_id, hold, now), revision)
            except StaleRevision:
                continue
            return

    async def _let_go(self, owner: str, hold_id: str) -> None:
        await self._change_room(owner, lambda room, now: room.without(hold_id, now), hold_id)

    async def _change_room(
        self, owner: str, change: Callable[[Room, float], Room], only_if: str | None = None
    ) -> None:
        """``change`` the key's room record until the write wins (no bound checked); with
        ``only_if``, only when it holds that id."""
        while True:
            room, revision = await self.store.room(owner)
            if only_if is not None and only_if not in room.holds:
                return
            try:
                await self.store.write_room(owner, change(room, self.clock()), revision)
            except StaleRevision:
                continue
            return

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

    async def _check_queue(self, owner: str, tokens: int) -> None:
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
                    await self._check_queue(owner, record.tokens)
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
        tokens = sum(_job_tokens(r, self.limits.default_max_tokens) for r in requests)
        part_id = uuid.uuid4().hex
        hold = Hold(bytes=len(data), until=self.clock() + SETTLED_SECONDS, file=False)
        await self._hold(record.owner, part_id, hold)
        try:
            await self.store.put_part(record, part_id, data)
            result = await update_batch(
                self.store,
                record.owner,
                record.id,
                lambda r: add_part(r, part_id, len(requests), tokens, len(data)),
            )
        except StoreFull as exc:
            raise APIError(507, str(exc), code="storage_full") from None
        except Conflict as exc:
            raise ConflictError(str(exc), param="id") from None
        finally:
            with contextlib.suppress(Exception):
                await self._let_go(record.owner, part_id)
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


def _after_file(name: str, file_seen: bool) -> None:
    """``expires_after`` sets how long the file's bytes are kept, fixed as they are stored: it
    must come before the file part (the openai SDK sends it there, as curl -F does in order)."""
    if file_seen and name.startswith("expires_after"):
        raise BadRequestError(
            f"{name}: send it before the file part (it sets how long the file is kept, which "
            "is fixed as its bytes are stored)",
            param="expires_after",
        )


async def _abort(writer: ContentWriter | None) -> None:
    if writer is not None:
        with contextlib.suppress(Exception):
            await writer.abort()


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
    """Request ``<batch digits>-<n>``'s index ``n``: 404 for another batch's id, 400 for one
    whose ``n`` is not a number in ASCII digits (``"²".isdigit()`` is true, ``int("²")`` fails)."""
    prefix = record.id.removeprefix("batch_") + "-"
    tail = request_id.removeprefix(prefix)
    if tail == request_id:
        raise NotFoundError(f"batch {record.id} has no request {request_id!r}", param="requestId")
    if not _whole(tail):
        raise BadRequestError(
            f"requestId: {request_id!r} is not a request id of batch {record.id} "
            f"({prefix}<n>, n in the digits 0-9)",
            param="requestId",
        )
    return int(tail)


def _whole(text: str) -> bool:
    """A whole number in ASCII digits (``str.isdigit`` takes superscripts and other scripts'
    digits, some of which ``int`` refuses)."""
    return text.isascii() and text.isdigit()


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
