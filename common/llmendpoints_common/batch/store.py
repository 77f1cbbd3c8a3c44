"""Where files and batch records live: the protocol the API and the driver use.

Two implementations, the same behaviour:

- ``llmendpoints_common.queue.batch_store.NatsBatchStore``: records in the key-value bucket
  ``LLMEP_BATCHES``, contents in the JetStream object store ``LLMEP_FILES`` -- replicated, shared
  by every gateway replica;
- the runtime's ``LocalBatchStore``: one directory (under the model cache by default), for
  ``make serve``.

Everything is per owner (the API key's name): a lookup names the owner, and another owner's id
is not found. Records change by compare-and-set (``write_batch(record, revision)``), as job
records do; so does each key's ``Room`` (room.py). Contents stream both ways: a file is written
as its bytes arrive (``write_file``) and read a piece at a time (``open_file``), never held
whole. A batch's input is kept as ``parts`` (up to ``PART_LINES`` requests or ``PART_BYTES``
each) so its driver holds one part at a time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from llmendpoints_common.batch.files import FileContent, FileRecord
from llmendpoints_common.batch.record import BatchRecord
from llmendpoints_common.batch.room import Room

PART_LINES = 1000
PART_BYTES = 4 * 1024 * 1024


class StaleRevision(Exception):
    """The record changed since it was read (or exists already, for a create)."""


class StoreFull(Exception):
    """The store has no room for what was to be written (its byte bound)."""


class ContentWriter(Protocol):
    """A file being stored: its bytes ``write``-n as they come (at most a piece held), then
    ``commit`` of its record -- the file exists from then on -- or ``abort``: nothing kept.
    StoreFull when the store has no room."""

    size: int  # bytes written so far

    async def write(self, data: bytes) -> None: ...

    async def commit(self, record: FileRecord) -> None: ...

    async def abort(self) -> None: ...


class BatchStore(Protocol):
    # -- files ------------------------------------------------------------------------------
    async def write_file(self, owner: str, file_id: str, ttl_seconds: float) -> ContentWriter:
        """A new file's content, kept ``ttl_seconds`` once committed."""
        ...

    async def file(self, owner: str, file_id: str) -> FileRecord | None: ...

    async def open_file(self, owner: str, file_id: str) -> FileContent | None:
        """The content, read as it is asked for."""
        ...

    async def delete_file(self, owner: str, file_id: str) -> bool: ...

    async def files(self, owner: str) -> list[FileRecord]: ...

    # -- what a key holds for stores under way (room.py) ---------------------------------------
    async def room(self, owner: str) -> tuple[Room, int]:
        """The key's room record and its revision (an empty room at revision 0 when none)."""
        ...

    async def write_room(self, owner: str, room: Room, revision: int) -> int:
        """As ``write_batch``: stored if still at ``revision``, else StaleRevision."""
        ...

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
