"""Where files and batch records live: the protocol the API and the driver use, and the store of
a single pod without a queue (``LocalBatchStore``: files under a directory, bounded).

Two implementations, the same behaviour:

- ``llmendpoints_common.queue.batch_store.NatsBatchStore``: records in the key-value bucket
  ``LLMEP_BATCHES``, contents in the JetStream object store ``LLMEP_FILES`` -- replicated, shared
  by every gateway replica;
- ``LocalBatchStore``: one directory (under the model cache by default), for ``make serve``.

Everything is per owner (the API key's name): a lookup names the owner, and another owner's id
is not found. Records change by compare-and-set (``write_batch(record, revision)``), as job
records do. Contents are written once and read whole; a batch's input is kept as ``parts``
(JSONL of up to ``PART_LINES`` requests each) so its driver holds one part at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Protocol

from llmendpoints_common.batch.files import FileRecord
from llmendpoints_common.batch.record import BatchRecord

PART_LINES = 1000
READ_CHUNK = 256 * 1024


class StaleRevision(Exception):
    """The record changed since it was read (or exists already, for a create)."""


class StoreFull(Exception):
    """The store has no room for what was to be written (its byte bound)."""


class BatchStore(Protocol):
    # -- files ------------------------------------------------------------------------------
    async def put_file(self, record: FileRecord, content: IO[bytes]) -> None:
        """Store a file's content (read from ``content`` to its end) and then its record."""
        ...

    async def file(self, owner: str, file_id: str) -> FileRecord | None: ...

    async def open_file(self, owner: str, file_id: str) -> IO[bytes] | None:
        """The content, as a readable file (the caller closes it)."""
        ...

    async def delete_file(self, owner: str, file_id: str) -> bool: ...

    async def files(self, owner: str) -> list[FileRecord]: ...

    # -- batches ----------------------------------------------------------------------------
    async def batch(self, owner: str, batch_id: str) -> tuple[BatchRecord, int] | None: ...

    async def write_batch(self, record: BatchRecord, revision: int) -> int:
        """Store ``record`` if its key is at ``revision`` (0: it must not exist yet); the new
        revision, or StaleRevision."""
        ...

    async def batches(self, owner: str) -> list[BatchRecord]: ...

    async def active(self) -> list[tuple[str, str]]:
        """(owner, batch id) of every batch not ended (what drivers move along)."""
        ...

    # -- a batch's stored input ---------------------------------------------------------------
    async def put_part(self, record: BatchRecord, part_id: str, data: bytes) -> None: ...

    async def part(self, record: BatchRecord, part_id: str) -> bytes | None: ...

    async def drop_parts(self, record: BatchRecord) -> None: ...

    async def sweep(self, now: float) -> int:
        """Remove what has expired (files, ended batches, orphaned parts); how many."""
        ...


async def update_batch(
    store: BatchStore, owner: str, batch_id: str, change: Callable[[BatchRecord], BatchRecord]
) -> tuple[BatchRecord, BatchRecord] | None:
    """Apply ``change`` to the latest record until the write wins: (before, after), or None
    when there is no such batch. ``change`` raises to refuse."""
    while True:
        current = await store.batch(owner, batch_id)
        if current is None:
            return None
        record, revision = current
        changed = change(record)
        if changed == record:
            return record, record
        try:
            await store.write_batch(changed, revision)
        except StaleRevision:
            continue
        return record, changed


def stored_bytes(files: list[FileRecord], batches: list[BatchRecord]) -> int:
    """What a key keeps stored: its files, and the inputs of its batches not ended."""
    return sum(f.bytes for f in files) + sum(b.parts_bytes for b in batches if b.active)


def _token(owner: str) -> str:
    # Owner names are any text: a digest makes them one safe path segment (and key token).
    from llmendpoints_common.queue.names import tenant_token

    return tenant_token(owner)


class LocalBatchStore:
    """Files and records under ``root`` (one pod: an asyncio lock stands in for the queue's
    compare-and-set), at most ``max_bytes`` of contents in all.

    Layout: ``files/<owner token>/<file id>`` + ``.json``, ``batches/<owner token>/<id>.json``
    (``{"revision", "record"}``), ``parts/<batch id>/<n>.jsonl``.
    """

    def __init__(self, root: str | Path, *, max_bytes: int, clock: Callable[[], float] = time.time):
        self.root = Path(root)
        self.max_bytes = max_bytes
        self._clock = clock
        self._lock = asyncio.Lock()
        # Folders are made when first written to: a pod that never sees a batch leaves no trace.

    # -- bytes on disk --------------------------------------------------------------------------

    def used_bytes(self) -> int:
        total = 0
        for sub in ("files", "parts"):
            for path in (self.root / sub).rglob("*"):
                if path.is_file() and path.suffix != ".json":
                    total += path.stat().st_size
        return total

    def _room(self, size: int) -> None:
        used = self.used_bytes()
        if used + size > self.max_bytes:
            raise StoreFull(
                f"the batch store holds {used} bytes; {size} more would pass its bound of "
                f"{self.max_bytes} (LLMEP_BATCH_LOCAL_MAX_BYTES)"
            )

    # -- files ----------------------------------------------------------------------------------

    def _file_dir(self, owner: str) -> Path:
        return self.root / "files" / _token(owner)

    async def put_file(self, record: FileRecord, content: IO[bytes]) -> None:
        self._room(record.bytes)
        folder = self._file_dir(record.owner)
        folder.mkdir(parents=True, exist_ok=True)
        data_path = folder / record.id
        with tempfile.NamedTemporaryFile(dir=folder, delete=False) as out:
            shutil.copyfileobj(content, out, READ_CHUNK)
        os.replace(out.name, data_path)
        _write_json(folder / f"{record.id}.json", json.loads(record.encode()))

    async def file(self, owner: str, file_id: str) -> FileRecord | None:
        path = self._file_dir(owner) / f"{_safe(file_id)}.json"
        try:
            record = FileRecord.model_validate(json.loads(path.read_bytes()))
        except (FileNotFoundError, ValueError):
            return None
        return record.visible(owner, self._clock())

    async def open_file(self, owner: str, file_id: str) -> IO[bytes] | None:
        if await self.file(owner, file_id) is None:
            return None
        try:
            return (self._file_dir(owner) / _safe(file_id)).open("rb")
        except FileNotFoundError:
            return None

    async def delete_file(self, owner: str, file_id: str) -> bool:
        if await self.file(owner, file_id) is None:
            return False
        folder = self._file_dir(owner)
        for path in (folder / f"{_safe(file_id)}.json", folder / _safe(file_id)):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        return True

    async def files(self, owner: str) -> list[FileRecord]:
        found = []
        folder = self._file_dir(owner)
        if not folder.exists():
            return []
        for path in folder.glob("*.json"):
            record = await self.file(owner, path.stem)
            if record is not None:
                found.append(record)
        return sorted(found, key=lambda r: (r.created_at, r.id))

    # -- batches ----------------------------------------------------------------------------

    def _batch_path(self, owner: str, batch_id: str) -> Path:
        return self.root / "batches" / _token(owner) / f"{_safe(batch_id)}.json"

    async def batch(self, owner: str, batch_id: str) -> tuple[BatchRecord, int] | None:
        try:
            stored = json.loads(self._batch_path(owner, batch_id).read_bytes())
            record = BatchRecord.model_validate(stored["record"])
        except (FileNotFoundError, ValueError, KeyError):
            return None
        if record.owner != owner:
            return None
        kept = record.kept_until
        if kept is not None and kept <= self._clock():
            return None
        return record, int(stored["revision"])

    async def write_batch(self, record: BatchRecord, revision: int) -> int:
        async with self._lock:
            current = await self.batch(record.owner, record.id)
            if (current[1] if current is not None else 0) != revision:
                raise StaleRevision(record.id)
            path = self._batch_path(record.owner, record.id)
            path.parent.mkdir(parents=True, exist_ok=True)
            _write_json(path, {"revision": revision + 1, "record": json.loads(record.encode())})
            return revision + 1

    async def batches(self, owner: str) -> list[BatchRecord]:
        folder = self.root / "batches" / _token(owner)
        found = []
        for path in folder.glob("*.json") if folder.exists() else ():
            current = await self.batch(owner, path.stem)
            if current is not None:
                found.append(current[0])
        return sorted(found, key=lambda r: (r.created_at, r.id))

    async def active(self) -> list[tuple[str, str]]:
        found = []
        for path in (self.root / "batches").glob("*/*.json"):
            with contextlib.suppress(FileNotFoundError, ValueError, KeyError):
                record = BatchRecord.model_validate(json.loads(path.read_bytes())["record"])
                if record.active:
                    found.append((record.owner, record.id))
        return found

    # -- parts ------------------------------------------------------------------------------

    def _part_path(self, record: BatchRecord, part_id: str) -> Path:
        return self.root / "parts" / _safe(record.id) / f"{_safe(part_id)}.jsonl"

    async def put_part(self, record: BatchRecord, part_id: str, data: bytes) -> None:
        self._room(len(data))
        path = self._part_path(record, part_id)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)

    async def part(self, record: BatchRecord, part_id: str) -> bytes | None:
        try:
            return self._part_path(record, part_id).read_bytes()
        except FileNotFoundError:
            return None

    async def drop_parts(self, record: BatchRecord) -> None:
        shutil.rmtree(self.root / "parts" / _safe(record.id), ignore_errors=True)

    async def sweep(self, now: float) -> int:
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
        for path in (self.root / "batches").glob("*/*.json"):
            with contextlib.suppress(FileNotFoundError, ValueError, KeyError):
                record = BatchRecord.model_validate(json.loads(path.read_bytes())["record"])
                until = record.kept_until
                if until is not None and until <= now:
                    path.unlink()
                    removed += 1
                    continue
                kept.add(record.id)
                if record.active:
                    live.add(record.id)
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


def _safe(name: str) -> str:
    """An id as one path segment (ids are ours, but a client sends them)."""
    return "".join(c for c in name if c.isalnum() or c in "-_")[:200] or "_"


def _write_json(path: Path, value: object) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)
