"""What the worker processes of one gateway pod share about the pods they route to: which
endpoints each worker has work for now, and what the pod's one reader last read of each pod.

Reading every pod once per gateway pod, not once per worker (issue 33: N workers x M pods
reads a second otherwise), needs three things shared between the workers of a pod, all here:

- **who reads** -- an exclusive ``flock`` on the board (each worker opens the board on its own
  open file description, so the lock is per process): the worker holding it is the reader; when
  its process ends, for any reason, the kernel drops the lock and another worker takes it;
- **what the reader read** -- a blob (JSON: each pod's readiness and engine load) behind a
  sequence number, written seqlock-style: the number is odd while the blob is being written, so a
  follower that read an odd number, or a different one after the blob, skips that read;
- **when to read** -- each worker's activity slots (``Activity``): one float per endpoint (hashed
  into ``SLOTS``), +inf while that worker has requests of the endpoint in flight or held, else
  when it went idle. A worker whose endpoint turns busy also writes the pod's wake-up
  ``eventfd``, which the reader watches: the first request after a quiet spell gets its engine
  loads read at once, not at the next slow tick.

A single-process gateway uses the same ``Activity`` on a private buffer and eventfd, with no
board: it is its own reader.

The board is a memfd the supervisor creates (as workers.DrainBoard), sized for the most workers
and pods a pod runs; pages nobody writes take no memory.
"""

from __future__ import annotations

import contextlib
import fcntl
import math
import mmap
import os
import struct
import time
import zlib
from collections.abc import Callable

SLOTS = 256  # activity slots per worker (endpoints hash into them; a collision only reads more)
MAX_WORKERS = 64  # GATEWAY_WORKERS' bound (config.py)
_HEADER = 64  # seq (u64), blob length (u32)
_ACTIVITY = _HEADER
_BLOB = _ACTIVITY + MAX_WORKERS * SLOTS * 8
MAX_BLOB_BYTES = 8 * 1024 * 1024
SIZE = _BLOB + MAX_BLOB_BYTES


def slot_of(endpoint_id: str) -> int:
    return zlib.crc32(endpoint_id.encode()) % SLOTS


class Activity:
    """Which endpoints have work (requests in flight or held) in this worker, and -- reading
    every worker's slots -- in the pod. ``grace``: an endpoint idle for less than this still
    counts as active (the next turn of a conversation is seconds away)."""

    def __init__(
        self,
        slots: memoryview,
        worker: int,
        workers: int,
        wake_fd: int,
        grace: float,
    ) -> None:
        self._slots = slots  # float64, workers x SLOTS
        self._mine = slots[worker * SLOTS : (worker + 1) * SLOTS]
        self.workers = workers
        self.wake_fd = wake_fd
        self.grace = grace
        self.on_busy: list[Callable[[], None]] = []  # this process's loops to wake

    @classmethod
    def private(cls, grace: float) -> Activity:
        """One process's own slots and wake-up (no board)."""
        buffer = memoryview(bytearray(SLOTS * 8)).cast("d")
        wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        return cls(buffer, 0, 1, wake, grace)

    def busy(self, slot: int) -> None:
        """An endpoint (its slot) has work in this worker now. The reader is woken only when
        the endpoint had been idle past the grace (it may be asleep for a slow tick): a request
        that follows another within seconds costs a float compare, not a wake-up."""
        was = self._mine[slot]
        if was == math.inf:
            return
        self._mine[slot] = math.inf
        if was > time.monotonic() - self.grace:
            return
        with contextlib.suppress(OSError):
            os.eventfd_write(self.wake_fd, 1)
        for wake in self.on_busy:
            wake()

    def idle(self, slot: int, now: float) -> None:
        """This worker's last request of the endpoint ended (or left the hold)."""
        self._mine[slot] = now

    def active(self, slot: int, now: float) -> bool:
        """Work in any worker now, or within ``grace``."""
        since = now - self.grace
        slots = self._slots
        return any(slots[w * SLOTS + slot] > since for w in range(self.workers))

    def locally_active(self, now: float) -> bool:
        since = now - self.grace
        return any(value > since for value in self._mine)

    def drain_wake(self) -> None:
        """Consume the wake-ups written so far (the reader, when it wakes)."""
        with contextlib.suppress(BlockingIOError, OSError):
            os.eventfd_read(self.wake_fd)


class PodBoard:
    """The shared page (see the module's docstring). ``fd``: the memfd (inherited)."""

    def __init__(self, fd: int, workers: int, wake_fd: int) -> None:
        self.fd = fd
        self.workers = workers
        self.wake_fd = wake_fd
        self._map = mmap.mmap(fd, SIZE)
        # A lock per process needs an open file description per process: open it again.
        self._lock_fd = os.open(f"/proc/self/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
        self.leading = False

    @classmethod
    def create(cls, workers: int) -> PodBoard:
        fd = os.memfd_create("llmep-gateway-pods")
        os.ftruncate(fd, SIZE)
        wake = os.eventfd(0, os.EFD_NONBLOCK)
        return cls(fd, workers, wake)

    def activity(self, worker: int, grace: float) -> Activity:
        slots = memoryview(self._map)[_ACTIVITY:_BLOB].cast("d")
        return Activity(slots, worker, self.workers, self.wake_fd, grace)

    def try_lead(self) -> bool:
        """True when this process is (now) the pod's reader."""
        if not self.leading:
            try:
                fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            self.leading = True
        return True

    def publish(self, blob: bytes) -> None:
        """The reader's latest (blobs above MAX_BLOB_BYTES are not published)."""
        if len(blob) > MAX_BLOB_BYTES:
            return
        seq = struct.unpack_from("Q", self._map, 0)[0]
        struct.pack_into("Q", self._map, 0, seq + 1)  # odd: being written
        struct.pack_into("I", self._map, 8, len(blob))
        self._map[_BLOB : _BLOB + len(blob)] = blob
        struct.pack_into("Q", self._map, 0, seq + 2)

    def close(self) -> None:
        """This process's hold on the board (its lock goes with it, as with its process)."""
        os.close(self._lock_fd)
        self.leading = False

    def seq(self) -> int:
        return struct.unpack_from("Q", self._map, 0)[0]

    def read(self, last: int) -> tuple[int, bytes | None]:
        """(sequence, blob) when the blob changed since ``last`` and was read whole, else
        (``last``, None)."""
        seq = self.seq()
        if seq == last or seq % 2:
            return last, None
        length = struct.unpack_from("I", self._map, 8)[0]
        blob = self._map[_BLOB : _BLOB + min(length, MAX_BLOB_BYTES)]
        if self.seq() != seq:
            return last, None  # written meanwhile: the next read gets it
        return seq, blob
