"""What one key keeps stored, and the room it reserves before storing more (pure).

Per key, files (uploads and a batch's outputs) and their bytes, with the stored inputs of its
batches not ended, are bounded (LLMEP_BATCH_MAX_FILES_PER_KEY, LLMEP_BATCH_MAX_BYTES_PER_KEY).
A bound checked by listing and then storing lets concurrent uploads all pass the same check (20
uploads stored 20 files against a bound of 5), so room is reserved first: each key has a
``Room`` record in the store, changed by compare-and-set only, holding what is being stored
now -- an upload under way (a file, at most its declared size), a RunPod append being written
(bytes). A reservation reads the record, then lists what is stored, checks the bounds with the
holds counted, and writes the record back at the revision it read: of two that race, one write
wins and the other reads again, counting the winner's hold. The hold comes off when the bytes
are stored (or refused); a hold whose writer died runs out at its ``until`` (the upload's
deadline).

Reading the record before listing keeps the count whole: a finished upload stores its file's
record before it lets go of its hold, so any listing made after the hold was gone shows the file.
A finished file keeps its hold for a minute more (``SETTLED_SECONDS``, counted once: a hold
whose file is listed is not counted again), for stores whose listings may lag their writes.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from llmendpoints_common.batch.files import FileRecord
from llmendpoints_common.batch.limits import BatchLimits
from llmendpoints_common.batch.record import BatchRecord
from llmendpoints_common.errors import RateLimitError

SETTLED_SECONDS = 60.0


class Hold(BaseModel):
    model_config = ConfigDict(extra="ignore")

    bytes: int
    until: float  # epoch seconds: a hold not let go of by then no longer counts
    file: bool = True  # counts as a file too (an upload), not only as bytes (a RunPod append)


class Room(BaseModel):
    model_config = ConfigDict(extra="ignore")

    holds: dict[str, Hold] = {}  # file id (or part id) -> its hold

    def encode(self) -> bytes:
        return self.model_dump_json().encode()

    @classmethod
    def decode(cls, data: bytes) -> Room:
        return cls.model_validate_json(data)

    def live(self, now: float) -> Room:
        """Without the holds that ran out."""
        return Room(holds={k: h for k, h in self.holds.items() if h.until > now})

    def holding(self, hold_id: str, hold: Hold, now: float) -> Room:
        return Room(holds={**self.live(now).holds, hold_id: hold})

    def without(self, hold_id: str, now: float) -> Room:
        return Room(holds={k: h for k, h in self.live(now).holds.items() if k != hold_id})

    def until(self) -> float:
        """When its last hold runs out (0: it holds nothing)."""
        return max((h.until for h in self.holds.values()), default=0.0)


def usage(
    files: list[FileRecord], batches: list[BatchRecord], room: Room, now: float
) -> tuple[int, int]:
    """(files, bytes) a key keeps: its files, the inputs of its batches not ended, and what it
    holds for stores under way (a hold whose file is listed already is counted once)."""
    listed = {f.id: f.bytes for f in files}
    held = [h for k, h in room.live(now).holds.items() if k not in listed]
    count = len(listed) + sum(1 for h in held if h.file)
    size = (
        sum(listed.values())
        + sum(b.parts_bytes for b in batches if b.active)
        + sum(h.bytes for h in held)
    )
    return count, size


def check(
    limits: BatchLimits,
    files: list[FileRecord],
    batches: list[BatchRecord],
    room: Room,
    now: float,
    *,
    adding_files: int,
    adding_bytes: int,
) -> None:
    """429 naming the bound and its setting when ``adding_files`` files of ``adding_bytes``
    more would pass either."""
    count, size = usage(files, batches, room, now)
    if adding_files and count + adding_files > limits.max_files_per_key:
        raise RateLimitError(
            f"this key keeps {count} files (uploads under way included); at most "
            f"{limits.max_files_per_key} (LLMEP_BATCH_MAX_FILES_PER_KEY): delete some, or wait "
            "for them to expire",
            code="file_limit_exceeded",
        )
    if size + adding_bytes > limits.max_bytes_per_key:
        raise RateLimitError(
            f"this key keeps {size} bytes of files and batch inputs (uploads under way "
            f"included); {adding_bytes} more would pass its {limits.max_bytes_per_key} "
            "(LLMEP_BATCH_MAX_BYTES_PER_KEY)",
            code="storage_limit_exceeded",
        )
