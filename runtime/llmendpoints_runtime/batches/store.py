"""One pod's batch store without the queue: files and records under a directory, bounded.

The same behaviour as the queue's ``NatsBatchStore`` (``llmendpoints_common.batch.store``'s
protocol), on local disk. This store runs in the runtime's API process, on the event loop that
serves vLLM's routes, so it touches no file there: ``_Disk`` does the file work, synchronously,
and every call to it goes to a worker thread (``asyncio.to_thread``). An upload or a download
moves a piece at a time (``CHUNK``), each piece in its own thread call.

Layout: ``files/<owner token>/<file id>`` + ``.json``, ``batches/<owner token>/<id>.json``
(``{"revision", "record"}``), ``parts/<batch id>/<n>.jsonl``. Folders are made when first
written to: a pod that never sees a batch leaves no trace. Compare-and-set of records is an
asyncio lock around the read and the write (one process); a key's room is kept in memory, as
the uploads it holds room for live in this process too.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import IO

from llmendpoints_common.batch.files import FileContent, FileRecord
from llmendpoints_common.batch.record import BatchRecord
from llmendpoints_common.batch.room import Room
from llmendpoints_common.batch.store import StaleRevision, StoreFull
from llmendpoints_common.identity import tenant_token

CHUNK = 1024 * 1024


def _safe(name: str) -> str:
    """An id as one path segment (ids are ours, but a client sends them)."""
    return "".join(c for c in name if c.isalnum() or c in "-_")[:200] or "_"


def _write_json(path: Path, value: object) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_bytes())
    except (FileNotFoundError, ValueError):
        return None


class _Disk:
    """The store's file work, synchronous (called in worker threads only)."""

    def __init__(self, root: Path, max_bytes: int) -> None:
        self.root = root
        self.max_bytes = max_bytes

    def used_bytes(self) -> int:
        total = 0
        for sub in ("files", "parts"):
            for path in (self.root / sub).rglob("*"):
                if path.is_file() and path.suffix != ".json":
                    total += path.stat().st_size
        return total

    def room_for(self, size: int) -> None:
        used = self.used_bytes()
        if used + size > self.max_bytes:
            raise StoreFull(
                f"the batch store holds {used} bytes; {size} more would pass its bound of "
                f"{self.max_bytes} (LLMEP_BATCH_LOCAL_MAX_BYTES)"
            )

    # -- files --

    def file_dir(self, owner: str) -> Path:
        return self.root / "files" / tenant_token(owner)

    def new_file(self, owner: str) -> IO[bytes]:
        folder = self.file_dir(owner)
        folder.mkdir(parents=True, exist_ok=True)
        return tempfile.NamedTemporaryFile(dir=folder, delete=False)  # closed by the writer

    def commit_file(self, handle: IO[bytes], record: FileRecord) -> None:
        handle.close()
        folder = self.file_dir(record.owner)
        os.replace(handle.name, folder / record.id)
        _write_json(folder / f"{record.id}.json", json.loads(record.encode()))

    @staticmethod
    def drop(handle: IO[bytes]) -> None:
        handle.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(handle.name)

    def file(self, owner: str, file_id: str) -> FileRecord | None:
        stored = _read_json(self.file_dir(owner) / f"{_safe(file_id)}.json")
        try:
            return FileRecord.model_validate(stored) if stored is not None else None
        except ValueError:
            return None

    def content_path(self, owner: str, file_id: str) -> Path:
        return self.file_dir(owner) / _safe(file_id)

    def delete_file(self, owner: str, file_id: str) -> None:
        folder = self.file_dir(owner)
        for path in (folder / f"{_safe(file_id)}.json", folder / _safe(file_id)):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()

    def files(self, owner: str) -> list[FileRecord]:
        folder = self.file_dir(owner)
        found = [self.file(owner, path.stem) for path in folder.glob("*.json")]
        return [f for f in found if f is not None]

    # -- batches --

    def batch_path(self, owner: str, batch_id: str) -> Path:
        return self.root / "batches" / tenant_token(owner) / f"{_safe(batch_id)}.json"

    def batch(self, owner: str, batch_id: str) -> tuple[BatchRecord, int] | None:
        stored = _read_json(self.batch_path(owner, batch_id))
        try:
            if stored is None:
                return None
            return BatchRecord.model_validate(stored["record"]), int(stored["revision"])
        except (ValueError, KeyError):
            return None

    def write_batch(self, record: BatchRecord, revision: int) -> int:
        current = self.batch(record.owner, record.id)
        if (current[1] if current is not None else 0) != revision:
            raise StaleRevision(record.id)
        path = self.batch_path(record.owner, record.id)
        path.parent.mkdir(parents=True, exist_ok=True)
        _write_json(path, {"revision": revision + 1, "record": json.loads(record.encode())})
        return revision + 1

    def all_batches(self, pattern: str = "*/*.json") -> list[tuple[Path, BatchRecord]]:
        found = []
        for path in (self.root / "batches").glob(pattern):
            stored = _read_json(path)
            if stored is not None:
                with contextlib.suppress(ValueError, KeyError):
                    found.append((path, BatchRecord.model_validate(stored["record"])))
        return found

    # -- parts --

    def part_path(self, record: BatchRecord, part_id: str) -> Path:
        return self.root / "parts" / _safe(record.id) / f"{_safe(part_id)}.jsonl"

    def put_part(self, record: BatchRecord, part_id: str, data: bytes) -> None:
        self.room_for(len(data))
        path = self.part_path(record, part_id)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)

    def part(self, record: BatchRecord, part_id: str) -> bytes | None:
        try:
            return self.part_path(record, part_id).read_bytes()
        except FileNotFoundError:
            return None

    def drop_parts(self, record: BatchRecord) -> None:
        shutil.rmtree(self.root / "parts" / _safe(record.id), ignore_errors=True)

    # -- expiry --

    def sweep(self, now: float) -> int:
        removed = 0
        for meta in (self.root / "files").glob("*/*.json"):
            with contextlib.suppress(FileNotFoundError, ValueError):
                record = FileRecord.model_validate(json.loads(meta.read_bytes()))
                if record.expires_at <= now:
                    meta.unlink()
                    with contextlib.suppress(FileNotFoundError):
                        (meta.parent / record.id).unlink()
                    removed += 1
        live: set[str] = set()  # batches not ended: their parts stay
        kept: set[str] = set()  # batches still kept: their results stay
        for path, record in self.all_batches():
            until = record.kept_until
            if until is not None and until <= now:
                path.unlink(missing_ok=True)
                removed += 1
                continue
            kept.add(record.id)
            if record.active:
                live.add(record.id)
        return removed + self._sweep_leftovers(live, kept)

    def _sweep_leftovers(self, live: set[str], kept: set[str]) -> int:
        removed = 0
        parts = self.root / "parts"
        for folder in parts.iterdir() if parts.exists() else ():
            if folder.name not in live:
                shutil.rmtree(folder, ignore_errors=True)
                removed += 1
        results = self.root / "results"
        for path in results.glob("*.jsonl") if results.exists() else ():
            if path.stem not in kept:
                path.unlink(missing_ok=True)
                removed += 1
        return removed


class _LocalFile:
    """A file being written (the store's ``ContentWriter``): pieces of up to CHUNK written in
    worker threads, bounded by the store's bytes as they come."""

    def __init__(self, disk: _Disk, handle: IO[bytes], room: int) -> None:
        self.disk = disk
        self.handle = handle
        self.room = room  # what the store may still take
        self.size = 0
        self._pending = bytearray()

    async def write(self, data: bytes) -> None:
        self.size += len(data)
        if self.size > self.room:
            raise StoreFull(
                f"the batch store has room for {self.room} more bytes; this file is larger "
                "(LLMEP_BATCH_LOCAL_MAX_BYTES)"
            )
        self._pending += data
        if len(self._pending) >= CHUNK:
            await self._flush()

    async def _flush(self) -> None:
        piece, self._pending = bytes(self._pending), bytearray()
        await asyncio.to_thread(self.handle.write, piece)

    async def commit(self, record: FileRecord) -> None:
        await self._flush()
        await asyncio.to_thread(self.disk.commit_file, self.handle, record)

    async def abort(self) -> None:
        self._pending = bytearray()
        await asyncio.to_thread(self.disk.drop, self.handle)


class LocalBatchStore:
    """Files and records under ``root``, at most ``max_bytes`` of contents in all."""

    def __init__(
        self, root: str | Path, *, max_bytes: int, clock: Callable[[], float] = time.time
    ) -> None:
        self.root = Path(root)
        self._disk = _Disk(self.root, max_bytes)
        self._clock = clock
        self._lock = asyncio.Lock()
        self._rooms: dict[str, tuple[Room, int]] = {}

    # -- files ----------------------------------------------------------------------------------

    async def write_file(self, owner: str, file_id: str, ttl_seconds: float) -> _LocalFile:
        used = await asyncio.to_thread(self._disk.used_bytes)
        handle = await asyncio.to_thread(self._disk.new_file, owner)
        return _LocalFile(self._disk, handle, self._disk.max_bytes - used)

    async def file(self, owner: str, file_id: str) -> FileRecord | None:
        record = await asyncio.to_thread(self._disk.file, owner, file_id)
        return record.visible(owner, self._clock()) if record is not None else None

    async def open_file(self, owner: str, file_id: str) -> FileContent | None:
        if await self.file(owner, file_id) is None:
            return None
        path = self._disk.content_path(owner, file_id)
        try:
            size = (await asyncio.to_thread(path.stat)).st_size
        except FileNotFoundError:
            return None

        async def chunks() -> AsyncIterator[bytes]:
            handle = await asyncio.to_thread(path.open, "rb")
            try:
                while piece := await asyncio.to_thread(handle.read, CHUNK):
                    yield piece
            finally:
                await asyncio.to_thread(handle.close)

        return FileContent(size, chunks)

    async def delete_file(self, owner: str, file_id: str) -> bool:
        if await self.file(owner, file_id) is None:
            return False
        await asyncio.to_thread(self._disk.delete_file, owner, file_id)
        return True

    async def files(self, owner: str) -> list[FileRecord]:
        now = self._clock()
        found = await asyncio.to_thread(self._disk.files, owner)
        visible = [f for f in found if f.visible(owner, now) is not None]
        return sorted(visible, key=lambda r: (r.created_at, r.id))

    # -- what a key holds for stores under way ---------------------------------------------------

    async def room(self, owner: str) -> tuple[Room, int]:
        return self._rooms.get(owner, (Room(), 0))

    async def write_room(self, owner: str, room: Room, revision: int) -> int:
        async with self._lock:
            if self._rooms.get(owner, (Room(), 0))[1] != revision:
                raise StaleRevision(owner)
            self._rooms[owner] = (room, revision + 1)
            return revision + 1

    # -- batches --------------------------------------------------------------------------------

    async def batch(self, owner: str, batch_id: str) -> tuple[BatchRecord, int] | None:
        current = await asyncio.to_thread(self._disk.batch, owner, batch_id)
        if current is None or current[0].owner != owner:
            return None
        kept = current[0].kept_until
        if kept is not None and kept <= self._clock():
            return None
        return current

    async def write_batch(self, record: BatchRecord, revision: int) -> int:
        async with self._lock:
            return await asyncio.to_thread(self._disk.write_batch, record, revision)

    async def batches(self, owner: str) -> list[BatchRecord]:
        now = self._clock()
        found = await asyncio.to_thread(self._disk.all_batches, f"{tenant_token(owner)}/*.json")
        mine = [
            r for _, r in found if r.owner == owner and (r.kept_until is None or r.kept_until > now)
        ]
        return sorted(mine, key=lambda r: (r.created_at, r.id))

    async def active(self) -> list[tuple[str, str]]:
        found = await asyncio.to_thread(self._disk.all_batches)
        return [(r.owner, r.id) for _, r in found if r.active]

    # -- parts ----------------------------------------------------------------------------------

    async def put_part(self, record: BatchRecord, part_id: str, data: bytes) -> None:
        await asyncio.to_thread(self._disk.put_part, record, part_id, data)

    async def part(self, record: BatchRecord, part_id: str) -> bytes | None:
        return await asyncio.to_thread(self._disk.part, record, part_id)

    async def drop_parts(self, record: BatchRecord) -> None:
        await asyncio.to_thread(self._disk.drop_parts, record)

    async def sweep(self, now: float) -> int:
        return await asyncio.to_thread(self._disk.sweep, now)
