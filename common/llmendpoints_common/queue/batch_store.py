"""The batch store on the shared queue: records in ``LLMEP_BATCHES``, contents in ``LLMEP_FILES``.

Every gateway replica reads and writes the same store, so a batch made through one is seen,
cancelled and driven through any other, and a replica that dies loses nothing.

- records are written by compare-and-set (``Nats-Expected-Last-Subject-Sequence``) with a
  message TTL: a file's record goes when the file expires, a batch's when its results do (a
  batch not ended keeps its window plus its results' lifetime, as a bound);
- ``active.<batch id>`` names the owner of every batch not ended (what the drivers list); it
  goes when the batch ends;
- contents are objects (queue/objects.py) with the same expiry as their records; a batch's
  stored input (its parts) goes when it ends, or with its window at the latest.

Keys and object names carry the owner's token (a digest of the key's name), so an id looked up
under another owner is not there.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import tempfile
import time
import uuid
from collections.abc import Callable
from typing import IO

import nats.errors
from nats.js import JetStreamContext
from nats.js.errors import APIError, BucketNotFoundError, NotFoundError

from llmendpoints_common.batch.files import FileRecord
from llmendpoints_common.batch.record import BatchRecord
from llmendpoints_common.batch.store import StaleRevision, StoreFull
from llmendpoints_common.queue import names, objects
from llmendpoints_common.queue.state import purge_marker

_WRONG_LAST_SEQUENCE = 10071
# JetStream's "maximum bytes exceeded" / "insufficient resources" (the store is full).
_FULL_CODES = {10047, 10054, 10023}
_EXPECTED_LAST = "Nats-Expected-Last-Subject-Sequence"
# A batch record outlives its window by its results' lifetime; this bounds one that never ends.
_SLACK_SECONDS = 86_400.0


class NatsBatchStore:
    def __init__(self, js: JetStreamContext, *, clock: Callable[[], float] = time.time) -> None:
        self.js = js
        self._clock = clock
        self._stream = names.kv_stream(names.BATCHES_BUCKET)

    # -- records ----------------------------------------------------------------------------

    def _subject(self, key: str) -> str:
        return names.kv_subject(names.BATCHES_BUCKET, key)

    async def _read(self, key: str) -> tuple[bytes, int] | None:
        try:
            raw = await self.js.get_msg(self._stream, subject=self._subject(key), direct=True)
        except NotFoundError:
            return None
        if not raw.data:
            return None
        return raw.data, raw.seq

    async def _write(self, key: str, data: bytes, *, revision: int | None, ttl: float) -> int:
        headers = {_EXPECTED_LAST: str(revision)} if revision is not None else None
        try:
            ack = await self.js.publish(
                self._subject(key), data, headers=headers, msg_ttl=max(1, round(ttl))
            )
        except APIError as exc:
            if exc.err_code == _WRONG_LAST_SEQUENCE:
                raise StaleRevision(key) from None
            if exc.err_code in _FULL_CODES:
                raise StoreFull(f"the batch store is full: {exc.description}") from None
            raise
        return ack.seq

    async def _latest(self, pattern: str) -> list[bytes]:
        """The latest value of every key matching ``pattern`` (a watcher delivers each key's
        last value, then None)."""
        try:
            kv = await self.js.key_value(names.BATCHES_BUCKET)
        except (BucketNotFoundError, NotFoundError):
            return []
        watcher = await kv.watch(pattern, ignore_deletes=True)
        found = []
        try:
            async for entry in watcher:
                if entry is None:
                    break
                if entry.value:
                    found.append(entry.value)
        finally:
            with contextlib.suppress(Exception):
                await watcher.stop()
        return found

    # -- files ------------------------------------------------------------------------------

    async def put_file(self, record: FileRecord, content: IO[bytes]) -> None:
        ttl = record.expires_at - self._clock()
        name = names.object_name(record.owner, record.id)
        await self._put_object(name, content, ttl)
        await self._write(
            names.file_key(record.owner, record.id), record.encode(), revision=None, ttl=ttl
        )

    async def _put_object(self, name: str, content: IO[bytes], ttl: float) -> int:
        try:
            return await objects.put_object(
                self.js, name, content, nuid=uuid.uuid4().hex, ttl_seconds=ttl
            )
        except APIError as exc:
            if exc.err_code in _FULL_CODES or "maximum bytes" in (exc.description or ""):
                raise StoreFull(
                    f"the file store is full ({exc.description}); delete files or wait for "
                    "them to expire"
                ) from None
            raise

    async def file(self, owner: str, file_id: str) -> FileRecord | None:
        try:
            key = names.file_key(owner, file_id)
        except ValueError:
            return None
        found = await self._read(key)
        if found is None:
            return None
        return FileRecord.decode(found[0]).visible(owner, self._clock())

    async def open_file(self, owner: str, file_id: str) -> IO[bytes] | None:
        if await self.file(owner, file_id) is None:
            return None
        sink = tempfile.SpooledTemporaryFile(8 * 1024 * 1024)  # noqa: SIM115 (the caller's)
        try:
            if not await objects.read_object(self.js, names.object_name(owner, file_id), sink):
                sink.close()
                return None
        except BaseException:
            sink.close()
            raise
        sink.seek(0)
        return sink

    async def delete_file(self, owner: str, file_id: str) -> bool:
        if await self.file(owner, file_id) is None:
            return False
        await objects.delete_object(self.js, names.object_name(owner, file_id))
        await purge_marker(self.js, self._subject(names.file_key(owner, file_id)))
        return True

    async def files(self, owner: str) -> list[FileRecord]:
        now = self._clock()
        records = [
            FileRecord.decode(value)
            for value in await self._latest(f"file.{names.tenant_token(owner)}.*")
        ]
        return sorted(
            (r for r in records if r.owner == owner and r.expires_at > now),
            key=lambda r: (r.created_at, r.id),
        )

    # -- batches ----------------------------------------------------------------------------

    def _batch_ttl(self, record: BatchRecord) -> float:
        kept = record.kept_until
        if kept is None:
            kept = record.expires_at + record.output_ttl_seconds + _SLACK_SECONDS
        return kept - self._clock()

    async def batch(self, owner: str, batch_id: str) -> tuple[BatchRecord, int] | None:
        try:
            key = names.batch_key(owner, batch_id)
        except ValueError:
            return None
        found = await self._read(key)
        if found is None:
            return None
        record = BatchRecord.decode(found[0])
        if record.owner != owner:
            return None
        return record, found[1]

    async def write_batch(self, record: BatchRecord, revision: int) -> int:
        ttl = self._batch_ttl(record)
        seq = await self._write(
            names.batch_key(record.owner, record.id), record.encode(), revision=revision, ttl=ttl
        )
        active = self._subject(names.active_key(record.id))
        if record.active and revision == 0:
            await self.js.publish(
                active, json.dumps(record.owner).encode(), msg_ttl=max(1, round(ttl))
            )
        elif not record.active:
            await purge_marker(self.js, active)
        return seq

    async def batches(self, owner: str) -> list[BatchRecord]:
        records = [
            BatchRecord.decode(value)
            for value in await self._latest(f"batch.{names.tenant_token(owner)}.*")
        ]
        return sorted((r for r in records if r.owner == owner), key=lambda r: (r.created_at, r.id))

    async def active(self) -> list[tuple[str, str]]:
        found = []
        kv = None
        with contextlib.suppress(BucketNotFoundError, NotFoundError):
            kv = await self.js.key_value(names.BATCHES_BUCKET)
        if kv is None:
            return []
        watcher = await kv.watch("active.*", ignore_deletes=True)
        try:
            async for entry in watcher:
                if entry is None:
                    break
                if entry.value:
                    found.append((json.loads(entry.value), entry.key.split(".", 1)[1]))
        finally:
            with contextlib.suppress(Exception):
                await watcher.stop()
        return found

    # -- parts ------------------------------------------------------------------------------

    async def put_part(self, record: BatchRecord, part_id: str, data: bytes) -> None:
        ttl = record.expires_at + _SLACK_SECONDS - self._clock()
        await self._put_object(
            names.object_name(record.owner, record.id, part_id), io.BytesIO(data), ttl
        )

    async def part(self, record: BatchRecord, part_id: str) -> bytes | None:
        sink = io.BytesIO()
        if not await objects.read_object(
            self.js, names.object_name(record.owner, record.id, part_id), sink
        ):
            return None
        return sink.getvalue()

    async def drop_parts(self, record: BatchRecord) -> None:
        for part_id in record.part_ids:
            with contextlib.suppress(nats.errors.Error, NotFoundError):
                await objects.delete_object(
                    self.js, names.object_name(record.owner, record.id, part_id)
                )

    async def sweep(self, now: float) -> int:
        """Nothing to do: every record and object here expires by its own TTL."""
        await asyncio.sleep(0)
        return 0
