"""What moves a batch along: validate its input, hand its requests to the batch lane a window at
a time, follow them, write the output and error files, end it.

A ``BatchDrivers`` host runs once per gateway pod, in a process of its own that serves nothing
(the gateway's batch_host.py), and in a runtime pod without the queue. Each tick it lists the
batches not ended and drives those it holds the lease of (a compare-and-set on the batch's
record; a host that dies lets its leases run out and another takes over). So a batch is driven
by one host at a time, and by some host as long as one runs.

An input file is validated as it streams from the store, a chunk at a time, the parsing in a
worker thread (``_read_input``): a 200 MB file costs the host one chunk and one line of memory,
and its event loop -- on one pod, the loop that serves vLLM's routes -- is never held by it.

What makes it safe to stop a driver anywhere (a SIGKILLed gateway, a NATS restart):

- a request's job id is fixed by its batch and index (``line_job_id``): handing it to the
  queue again stores nothing new, and its job record is the one truth of how it ended;
- the record keeps how many requests were handed over (``cursor``), written after they were;
  a driver that takes over reads the jobs of those requests again (``_rescan``) before
  going on;
- the output and error files are written from the job records, in input order, one line per
  request: every ``custom_id`` is answered once, whatever ran how often. Their ids are fixed
  before they are written, so a driver that takes over writes the same files.

Only ``window`` requests of a batch are queued or running at a time: the queue holds a bounded
slice of each batch, a cancel has a bounded slice to take back, and batches of several keys
share the lane.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from llmendpoints_common.batch import estimate as estimating
from llmendpoints_common.batch import jsonl
from llmendpoints_common.batch.files import FileContent, FileRecord, new_file_id
from llmendpoints_common.batch.limits import BatchLimits
from llmendpoints_common.batch.output import (
    NOT_QUEUED,
    LineOutcome,
    encode_line,
    openai_line,
    usage_of,
)
from llmendpoints_common.batch.record import (
    BatchRecord,
    BatchStatus,
    Conflict,
    begin_finalizing,
    expire,
    finished,
    line_job_id,
    progress,
    storage_failed,
    take_lease,
    validated,
    validation_failed,
)
from llmendpoints_common.batch.store import (
    PART_BYTES,
    PART_LINES,
    BatchStore,
    ContentWriter,
    StaleRevision,
    StoreFull,
)
from llmendpoints_common.errors import RateLimitError
from llmendpoints_common.jobs.models import JobStatus
from llmendpoints_common.waiting import wait_until_set

log = logging.getLogger("llmendpoints.batch")

LEASE_SECONDS = 20.0
TICK_SECONDS = 0.5
SWEEP_SECONDS = 300.0


class LineRunner(Protocol):
    """Where a batch's requests run (the shared queue's batch lane, or one pod's)."""

    async def submit(self, batch: BatchRecord, index: int, request: dict[str, Any]) -> None:
        """Queue request ``index`` (a job request as JSON) in the batch lane; doing it twice
        queues it once."""
        ...

    async def outcome(self, batch: BatchRecord, index: int) -> LineOutcome:
        """How request ``index`` stands (``NOT_QUEUED`` when it has no job)."""
        ...

    async def cancel(self, batch: BatchRecord, index: int, *, running: bool) -> None:
        """Take request ``index`` back if it is still queued; with ``running``, stop it too."""
        ...


Resolve = Callable[[str, str], Awaitable[str]]  # (owner, model) -> endpoint id, or LookupError
Signal = Callable[[BatchRecord], Awaitable[None]]


@dataclass
class _Progress:
    """What a host knows of a batch it drives (rebuilt from the job records on takeover)."""

    pending: set[int] = field(default_factory=set)  # handed over, not ended
    cursor: int = 0  # requests handed over by this host (its record may lag after a conflict)
    stopped: set[int] = field(default_factory=set)  # cancelled or aborted by the driver
    completed: int = 0
    failed: int = 0
    running: int = 0
    samples: list[tuple[float, int]] = field(default_factory=list)
    part: tuple[int, list[dict[str, Any]]] | None = None  # the part in memory
    signalled_at: float = 0.0


def part_bytes(lines: list[dict[str, Any]]) -> bytes:
    """Requests in a part's form: one compact JSON object per line."""
    return b"".join(json.dumps(line, separators=(",", ":")).encode() + b"\n" for line in lines)


def openai_job(endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI batch request as the job it runs as."""
    return {"input": {"openai_route": endpoint, "openai_input": body}}


def _part_lines(check: jsonl.Validator, chunk: bytes | None, endpoint: str) -> list[bytes]:
    """``chunk`` of an input file validated (None: the file's end); the stored form of its
    valid requests while the file is valid so far (once it is not, nothing is stored)."""
    requests = check.feed(chunk) if chunk is not None else check.finish()
    if not check.ok:
        return []
    return [
        json.dumps(
            {"custom_id": r.custom_id, "request": openai_job(endpoint, r.body)},
            separators=(",", ":"),
        ).encode()
        + b"\n"
        for r in requests
    ]


class _Parts:
    """A batch's requests stored as parts while its input is read: a part is written when it
    holds PART_LINES requests or PART_BYTES (one part in memory at a time)."""

    def __init__(self, store: BatchStore, record: BatchRecord) -> None:
        self.store = store
        self.batch = record
        self.counts: list[int] = []
        self.ids: list[str] = []
        self.size = 0
        self._lines: list[bytes] = []
        self._bytes = 0

    async def add(self, line: bytes) -> None:
        self._lines.append(line)
        self._bytes += len(line)
        if len(self._lines) >= PART_LINES or self._bytes >= PART_BYTES:
            await self.flush()

    async def flush(self) -> None:
        if not self._lines:
            return
        part_id = str(len(self.ids))
        self.ids.append(part_id)  # before the write: a part half-written is dropped too
        await self.store.put_part(self.batch, part_id, b"".join(self._lines))
        self.counts.append(len(self._lines))
        self.size += self._bytes
        self._lines, self._bytes = [], 0

    def record(self) -> BatchRecord:
        """The batch as far as its parts go (what ``drop_parts`` removes)."""
        return self.batch.model_copy(update={"part_ids": list(self.ids)})


class _Outputs:
    """A batch's output and error files being written (each kept only if it has a line)."""

    def __init__(self, output: ContentWriter, errors: ContentWriter) -> None:
        self.files = {True: output, False: errors}
        self.lines = {True: 0, False: 0}

    async def write(self, good: bool, line: bytes) -> None:
        await self.files[good].write(line)
        self.lines[good] += 1

    async def commit(self, record: BatchRecord, file_id: str, *, now: float) -> str | None:
        """The file's id once stored; None (and nothing stored) when it has no line."""
        good = file_id == record.output_file_id
        writer = self.files[good]
        if not self.lines[good]:
            await writer.abort()
            return None
        kind = "output" if good else "errors"
        await writer.commit(
            FileRecord(
                id=file_id,
                owner=record.owner,
                filename=f"{record.id}_{kind}.jsonl",
                purpose="batch_output",
                bytes=writer.size,
                created_at=now,
                expires_at=now + record.output_ttl_seconds,
            )
        )
        return file_id

    async def abort(self) -> None:
        for writer in self.files.values():
            with contextlib.suppress(Exception):
                await writer.abort()


class BatchDrivers:
    def __init__(
        self,
        store: BatchStore,
        runner: LineRunner,
        *,
        holder: str,
        limits: BatchLimits,
        resolve: Resolve,
        signal: Signal | None = None,
        on_end: Callable[[BatchRecord], None] | None = None,
        clock: Callable[[], float] = time.time,
        tick_seconds: float = TICK_SECONDS,
        lease_seconds: float = LEASE_SECONDS,
    ) -> None:
        self.store = store
        self.runner = runner
        self.holder = holder
        self.limits = limits
        self.resolve = resolve
        self.signal = signal
        self.on_end = on_end  # a batch ended (webhooks)
        self.clock = clock
        self.tick_seconds = tick_seconds
        self.lease_seconds = lease_seconds
        self._progress: dict[str, _Progress] = {}
        self._steps: dict[str, asyncio.Task[None]] = {}
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._stopping = False
        self._swept_at = 0.0

    # ---- the host's loop -------------------------------------------------------------------

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="batch-drivers")

    async def stop(self) -> None:
        # The flag as well as the cancel: nats-py's requests wait with Python 3.11's wait_for,
        # which returns instead of raising when a cancel lands as their answer does -- the
        # cancel is lost, and the loop must see that it is to stop all the same.
        self._stopping = True
        self._wake.set()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for task in list(self._steps.values()):
            task.cancel()
        if self._steps:
            await asyncio.gather(*self._steps.values(), return_exceptions=True)

    def wake(self) -> None:
        """Something changed (a batch created, cancelled): tick now."""
        self._wake.set()

    async def _run(self) -> None:
        while not self._stopping:
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the store is unreachable: try again next tick
                log.warning("batch drivers: %s: %s", type(exc).__name__, exc)
            if self._stopping:
                break
            self._wake.clear()
            await wait_until_set(self._wake, self.tick_seconds)

    async def tick(self) -> None:
        """One pass: a step for every batch not ended (each in a task of its own, one at a
        time per batch), and now and then a sweep of what expired."""
        now = self.clock()
        active = await self.store.active()
        seen = set()
        for owner, batch_id in active:
            seen.add(batch_id)
            task = self._steps.get(batch_id)
            if task is None or task.done():
                self._steps[batch_id] = asyncio.create_task(self._step_logged(owner, batch_id))
        for batch_id in set(self._progress) - seen:
            self._progress.pop(batch_id, None)
        for batch_id, task in list(self._steps.items()):
            if task.done() and batch_id not in seen:
                del self._steps[batch_id]
        if now - self._swept_at >= SWEEP_SECONDS:
            self._swept_at = now
            removed = await self.store.sweep(now)
            if removed:
                log.info("batch store: %d expired item(s) removed", removed)

    async def _step_logged(self, owner: str, batch_id: str) -> None:
        try:
            await self.step(owner, batch_id)
        except asyncio.CancelledError:
            raise
        except StaleRevision:
            pass  # written meanwhile (a cancel): the next tick decides on the new record
        except RateLimitError as exc:
            # The key's queued requests reached the per-owner cap (the jobs stream's
            # per-subject limit): the window fills again as they run.
            log.info("batch %s: waiting for room in the queue: %s", batch_id, exc.message)
        except Exception:
            log.exception("batch %s: step failed; trying again", batch_id)

    # ---- one batch ---------------------------------------------------------------------------

    async def step(self, owner: str, batch_id: str) -> BatchRecord | None:
        """Move one batch along as far as it goes now; the record as left (None: not ours)."""
        current = await self.store.batch(owner, batch_id)
        if current is None:
            self._progress.pop(batch_id, None)
            return None
        record, revision = current
        if not record.active:
            self._progress.pop(batch_id, None)
            return record
        now = self.clock()
        try:
            leased = take_lease(record, holder=self.holder, now=now, seconds=self.lease_seconds)
        except Conflict:
            self._progress.pop(batch_id, None)  # another host drives it
            return None
        if record.driver != self.holder:
            self._progress.pop(batch_id, None)  # new to this host: read its jobs again
        if (
            record.status in (BatchStatus.DRAFT, BatchStatus.VALIDATING)
            and now >= record.expires_at
        ):
            return await self._end(expire(leased, now=now), revision)
        # The lease is renewed well before it runs out (progress writes carry it too).
        if record.driver != self.holder or (record.lease_until or 0) - now < self.lease_seconds / 2:
            revision = await self.store.write_batch(leased, revision)
            record = leased
        if record.status is BatchStatus.DRAFT:
            return record
        if record.status is BatchStatus.VALIDATING:
            return await self._validate(record, revision)
        if record.status is BatchStatus.IN_PROGRESS and now >= record.expires_at:
            record = expire(record, now=now)
            revision = await self.store.write_batch(record, revision)
        return await self._run_lines(record, revision)

    async def _validate(self, record: BatchRecord, revision: int) -> BatchRecord:
        """The input file, checked line by line as it streams from the store, its requests
        stored as parts as they pass (dropped again if the file turns out invalid)."""
        assert record.input_file_id is not None and record.openai_endpoint is not None
        content = await self.store.open_file(record.owner, record.input_file_id)
        if content is None:
            error = {
                "code": "invalid_input_file",
                "message": f"input file {record.input_file_id} no longer exists",
                "param": "input_file_id",
                "line": None,
            }
            return await self._end(validation_failed(record, [error], now=self.clock()), revision)
        parts = _Parts(self.store, record)
        try:
            check, record, revision = await self._read_input(record, revision, content, parts)
            return await self._validated(record, revision, check, parts)
        except StoreFull as exc:
            await self.store.drop_parts(parts.record())
            return await self._end(storage_failed(record, str(exc), now=self.clock()), revision)
        except BaseException:
            with contextlib.suppress(Exception):
                await self.store.drop_parts(parts.record())
            raise

    async def _read_input(
        self, record: BatchRecord, revision: int, content: FileContent, parts: _Parts
    ) -> tuple[jsonl.Validator, BatchRecord, int]:
        """Feed the file to a validator a chunk at a time -- the parsing in a worker thread,
        so the loop that runs this driver (and, on one pod, serves) is never held by it --
        keeping this host's lease meanwhile. The validator, the record and its revision."""
        assert record.openai_endpoint is not None
        check = jsonl.Validator(record.openai_endpoint, self.limits)
        endpoint = record.openai_endpoint
        renewed = self.clock()
        async for chunk in content.chunks():
            for line in await asyncio.to_thread(_part_lines, check, chunk, endpoint):
                await parts.add(line)
            if self.clock() - renewed > self.lease_seconds / 4:
                renewed = self.clock()
                leased = take_lease(
                    record, holder=self.holder, now=renewed, seconds=self.lease_seconds
                )
                revision = await self.store.write_batch(leased, revision)
                record = leased
        for line in _part_lines(check, None, endpoint):
            await parts.add(line)
        await parts.flush()
        return check, record, revision

    async def _validated(
        self, record: BatchRecord, revision: int, check: jsonl.Validator, parts: _Parts
    ) -> BatchRecord:
        found, now = check.result, self.clock()
        if not found.ok:
            await self.store.drop_parts(parts.record())
            failed = validation_failed(record, found.error_list(), now=now, model=found.model)
            return await self._end(failed, revision)
        assert found.model is not None
        try:
            endpoint = await self.resolve(record.owner, found.model)
        except LookupError as exc:
            await self.store.drop_parts(parts.record())
            error = {
                "code": "model_not_found",
                "message": str(exc.args[0] if exc.args else exc),
                "param": "body.model",
                "line": found.model_line,
            }
            failed = validation_failed(record, [error], now=now, model=found.model)
            return await self._end(failed, revision)
        ready = validated(
            record,
            now=now,
            total=found.count,
            parts=parts.counts,
            part_ids=parts.ids,
            parts_bytes=parts.size,
            model=found.model,
            endpoint=endpoint,
            tokens=found.tokens,
        )
        await self.store.write_batch(ready, revision)
        log.info(
            "batch %s: %d requests for %s (%s) in progress", record.id, found.count, endpoint,
            found.model,
        )  # fmt: skip
        return ready

    async def _line(self, record: BatchRecord, index: int, state: _Progress) -> dict[str, Any]:
        """Stored request ``index``: ``{"custom_id"?, "request"}``."""
        part_index, offset = 0, index
        while part_index < len(record.parts) and offset >= record.parts[part_index]:
            offset -= record.parts[part_index]
            part_index += 1
        if state.part is None or state.part[0] != part_index:
            data = await self.store.part(record, record.part_ids[part_index])
            if data is None:
                raise StoreFull(f"part {part_index} of batch {record.id} is missing")
            state.part = (part_index, [json.loads(line) for line in data.splitlines() if line])
        return state.part[1][offset]

    async def _rescan(self, record: BatchRecord) -> _Progress:
        """A batch new to this host: how its handed-over requests stand, from their jobs."""
        state = _Progress(cursor=record.cursor)
        removed = set(record.removed)
        for index in range(record.cursor):
            if index in removed:
                continue
            outcome = await self.runner.outcome(record, index)
            if outcome.final:
                if outcome.succeeded:
                    state.completed += 1
                else:
                    state.failed += 1
            else:
                state.pending.add(index)
        return state

    async def _run_lines(self, record: BatchRecord, revision: int) -> BatchRecord:
        state = self._progress.get(record.id)
        if state is None:
            state = self._progress[record.id] = await self._rescan(record)
        now = self.clock()
        running = 0
        for index in sorted(state.pending):
            outcome = await self.runner.outcome(record, index)
            if outcome.final or (outcome.status is None and index in state.stopped):
                state.pending.discard(index)
                if outcome.succeeded:
                    state.completed += 1
                else:
                    state.failed += 1
            elif outcome.status is JobStatus.IN_PROGRESS:
                running += 1
            elif outcome.status is None and index not in state.stopped and record.ending is None:
                # Its job is gone (it was never stored: a driver stopped between the two):
                # hand it over again.
                await self.runner.submit(
                    record, index, (await self._line(record, index, state))["request"]
                )
        state.running = running
        # A write that lost to a client's cancel leaves the record's cursor behind this host's.
        cursor = max(record.cursor, state.cursor)
        stored = sum(record.parts)
        removed = set(record.removed)
        if record.ending is None:
            while len(state.pending) < self.limits.window_lines and cursor < stored:
                if cursor not in removed:
                    line = await self._line(record, cursor, state)
                    await self.runner.submit(record, cursor, line["request"])
                    state.pending.add(cursor)
                cursor += 1
                state.cursor = cursor
        else:
            # Cancelled: queued requests are taken back, running ones finish (OpenAI, RunPod).
            # Expired: nothing more runs.
            for index in sorted(state.pending - state.stopped):
                await self.runner.cancel(record, index, running=record.ending == "expired")
                state.stopped.add(index)
        state.samples = estimating.trim(
            [*state.samples, (now, state.completed + state.failed)], now
        )
        done = record.ending is not None or cursor >= stored
        if done and not state.pending:
            record = progress(
                record, cursor=cursor, completed=state.completed, failed=state.failed,
                running=0, estimate=record.estimate,
            )  # fmt: skip
            return await self._finalize(record, revision, state)
        forecast = estimating.estimate(
            state.samples,
            remaining=record.total - state.completed - state.failed,
            deadline=record.expires_at,
            now=now,
        )
        moved = progress(
            record,
            cursor=cursor,
            completed=state.completed,
            failed=state.failed,
            running=running,
            estimate=forecast,
        )
        if moved != record:
            await self.store.write_batch(moved, revision)
        if self.signal is not None and now - state.signalled_at >= 2.0:
            state.signalled_at = now
            with contextlib.suppress(Exception):
                await self.signal(moved)
        return moved

    async def _finalize(self, record: BatchRecord, revision: int, state: _Progress) -> BatchRecord:
        """Write the output and error files from the job records, in input order, then end."""
        now = self.clock()
        if record.output_file_id is None or record.error_file_id is None:
            record = begin_finalizing(
                record, now=now, output_file_id=new_file_id(), error_file_id=new_file_id()
            )
            revision = await self.store.write_batch(record, revision)
        assert record.output_file_id is not None and record.error_file_id is not None
        ttl = record.output_ttl_seconds
        outputs = _Outputs(
            await self.store.write_file(record.owner, record.output_file_id, ttl),
            await self.store.write_file(record.owner, record.error_file_id, ttl),
        )
        try:
            counts = await self._write_outputs(record, state, outputs)
            output_id = await outputs.commit(record, record.output_file_id, now=self.clock())
            error_id = await outputs.commit(record, record.error_file_id, now=self.clock())
        except StoreFull as exc:
            await outputs.abort()
            return await self._end(storage_failed(record, str(exc), now=self.clock()), revision)
        except BaseException:
            await outputs.abort()
            raise
        ended = finished(
            record,
            now=self.clock(),
            completed=counts[0],
            failed=counts[1],
            input_tokens=counts[2],
            output_tokens=counts[3],
            output_file_id=output_id,
            error_file_id=error_id,
        )
        return await self._end(ended, revision)

    async def _write_outputs(
        self, record: BatchRecord, state: _Progress, outputs: _Outputs
    ) -> tuple[int, int, int, int]:
        """Each request's line into the output or the error file, in input order; (completed,
        failed, input tokens, output tokens)."""
        completed = failed = input_tokens = output_tokens = 0
        removed = set(record.removed)
        for index in range(sum(record.parts)):
            if index in removed:
                continue
            line = await self._line(record, index, state)
            outcome = (
                await self.runner.outcome(record, index) if index < record.cursor else NOT_QUEUED
            )
            if outcome.succeeded:
                completed += 1
                used = usage_of(outcome.output)
                input_tokens += used[0]
                output_tokens += used[1]
            else:
                failed += 1
            if record.api == "openai":  # RunPod's results are read from the jobs (/requests)
                good, entry = openai_line(
                    line_job_id(record.id, index), line["custom_id"], outcome, record.ending
                )
                await outputs.write(good, encode_line(entry))
        return completed, failed, input_tokens, output_tokens

    async def _end(self, record: BatchRecord, revision: int) -> BatchRecord:
        """Store a batch's end (a CAS: a cancel that came meanwhile is decided on next tick)."""
        await self.store.write_batch(record, revision)
        if record.status.ended:
            self._progress.pop(record.id, None)
            await self.store.drop_parts(record)
            log.info(
                "batch %s %s: %d completed, %d failed of %d",
                record.id, record.status.value, record.completed, record.failed, record.total,
            )  # fmt: skip
            if self.signal is not None:
                with contextlib.suppress(Exception):
                    await self.signal(record)
            if self.on_end is not None:
                self.on_end(record)
        return record
