"""The batch store on the shared queue: records in ``LLMEP_BATCHES``, contents in ``LLMEP_FILES``.

Every gateway replica reads and writes the same store, so a batch made through one is seen,
cancelled and driven through any other, and a replica that dies loses nothing.

- records are written by compare-and-set (``Nats-Expected-Last-Subject-Sequence``) with a
  message TTL: a file's record goes when the file expires, a batch's when its results do (a
  batch not ended keeps its window plus its results' lifetime, as a bound);
- ``active.<batch id>`` names the owner of every batch not ended (what the drivers list); it
  goes when the batch ends;
- contents are objects (queue/objects.py) with the same expiry as their records, written as
  their bytes arrive and read a chunk at a time; a batch's stored input (its parts) goes when
  it ends, or with its window at the latest;
- ``room.<owner token>``: what the owner holds for stores under way (batch/room.py), by
  compare-and-set, expiring with its last hold;
- listings (a key's files, its batches, the batches not ended) are batched direct gets
  (queue/scan.py): no consumer is left behind.

Keys and object names carry the owner's token (a digest of the key's name), so an id looked up
under another owner is not there.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable

import nats.errors
from nats.js.errors import APIError, NotFoundError

from llmendpoints_common.batch.files import FileContent, FileRecord
from llmendpoints_common.batch.record import BatchRecord
from llmendpoints_common.batch.room import Room
from llmendpoints_common.batch.store import StaleRevision, StoreFull
from llmendpoints_common.identity import tenant_token
from llmendpoints_common.queue import names, objects, scan
from llmendpoints_common.queue.client import QueueConnection
from llmendpoints_common.queue.state import purge_marker

_WRONG_LAST_SEQUENCE = 10071
# JetStream's "maximum bytes exceeded" / "insufficient resources" (the store is full).
_FULL_CODES = {10047, 10054, 10023}
_EXPECTED_LAST = "Nats-Expected-Last-Subject-Sequence"
# A batch record outlives its window by its results' lifetime; this bounds one that never ends.
_SLACK_SECONDS = 86_400.0
_ROOM_SLACK_SECONDS = 60.0


def _full(exc: APIError) -> bool:
    return exc.err_code in _FULL_CODES or "maximum bytes" in (exc.description or "")


class _ObjectFile:
    """A file's content on its way into the object store (the store's ``ContentWriter``)."""

    def __init__(self, store: NatsBatchStore, writer: objects.ObjectWriter, ttl: float) -> None:
        self.store = store
        self.writer = writer
        self.ttl = ttl

    @property
    def size(self) -> int:
        return self.writer.size

    async def write(self, data: bytes) -> None:
        try:
            await self.writer.write(data)
        except APIError as exc:
            raise _store_full(exc) if _full(exc) else exc from None

    async def commit(self, record: FileRecord) -> None:
        try:
            await self.writer.close()
            await self.store._write(
                names.file_key(record.owner, record.id), record.encode(), revision=None,
                ttl=self.ttl,
            )  # fmt: skip
        except APIError as exc:
            await self.abort()
            raise _store_full(exc) if _full(exc) else exc from None

    async def abort(self) -> None:
        with contextlib.suppress(nats.errors.Error, APIError):
            await self.writer.abort()


def _store_full(exc: APIError) -> StoreFull:
    return StoreFull(
        f"the file store is full ({exc.description}); delete files or wait for them to expire"
    )


class NatsBatchStore:
    def __init__(
        self, connection: QueueConnection, *, clock: Callable[[], float] = time.time
    ) -> None:
        self.nc = connection.nc
        self.js = connection.js
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
        """The latest value of every key matching ``pattern`` (no consumer: queue/scan.py)."""
        return list((await self._scan(pattern)).values())

    async def _scan(self, pattern: str) -> dict[str, bytes]:
        try:
            return await scan.latest(self.nc, self._stream, self._subject(pattern))
        except scan.ScanError as exc:
            if exc.no_stream:
                return {}  # the bucket does not exist yet: nothing stored
            raise

    # -- files ------------------------------------------------------------------------------

    async def write_file(self, owner: str, file_id: str, ttl_seconds: float) -> _ObjectFile:
        writer = objects.ObjectWriter(
            self.js, names.object_name(owner, file_id), nuid=uuid.uuid4().hex,
            ttl_seconds=ttl_seconds,
        )  # fmt: skip
        return _ObjectFile(self, writer, ttl_seconds)

    async def _put_object(self, name: str, data: bytes, ttl: float) -> int:
        try:
            return await objects.put_object(
                self.js, name, data, nuid=uuid.uuid4().hex, ttl_seconds=ttl
            )
        except APIError as exc:
            raise _store_full(exc) if _full(exc) else exc from None

    async def file(self, owner: str, file_id: str) -> FileRecord | None:
        try:
            key = names.file_key(owner, file_id)
        except ValueError:
            return None
        found = await self._read(key)
        if found is None:
            return None
        return FileRecord.decode(found[0]).visible(owner, self._clock())

    async def open_file(self, owner: str, file_id: str) -> FileContent | None:
        if await self.file(owner, file_id) is None:
            return None
        info = await objects.object_info(self.js, names.object_name(owner, file_id))
        if info is None:
            return None

        def chunks() -> AsyncIterator[bytes]:
            return objects.read_chunks(self.js, info)

        return FileContent(int(info.get("size") or 0), chunks)

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
            for value in await self._latest(f"file.{tenant_token(owner)}.*")
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
            for value in await self._latest(f"batch.{tenant_token(owner)}.*")
        ]
        return sorted((r for r in records if r.owner == owner), key=lambda r: (r.created_at, r.id))

    async def active(self) -> list[tuple[str, str]]:
        found = await self._scan("active.*")
        return [(json.loads(value), subject.rsplit(".", 1)[1]) for subject, value in found.items()]

    # -- what a key holds for stores under way -------------------------------------------------

    async def room(self, owner: str) -> tuple[Room, int]:
        found = await self._read(f"room.{tenant_token(owner)}")
        if found is None:
            return Room(), 0
        return Room.decode(found[0]), found[1]

    async def write_room(self, owner: str, room: Room, revision: int) -> int:
        # A removed key's revision is its marker's: 0 asks for a key with no message at all.
        ttl = max(room.until() - self._clock(), 0.0) + _ROOM_SLACK_SECONDS
        return await self._write(
            f"room.{tenant_token(owner)}", room.encode(), revision=revision, ttl=ttl
        )

    # -- parts ------------------------------------------------------------------------------

    async def put_part(self, record: BatchRecord, part_id: str, data: bytes) -> None:
        ttl = record.expires_at + _SLACK_SECONDS - self._clock()
        await self._put_object(names.object_name(record.owner, record.id, part_id), data, ttl)

    async def part(self, record: BatchRecord, part_id: str) -> bytes | None:
        return await objects.read_object(
            self.js, names.object_name(record.owner, record.id, part_id)
        )

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
