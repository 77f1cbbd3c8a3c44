"""One pod's batch lane, without the shared queue: the driver's ``LineRunner`` running a batch's
requests in this process, below everything else.

- A request starts only while ``slots()`` allows (the same rule a queue worker follows: never
  past the batch share of the pod's capacity, never into room interactive requests and jobs use,
  none while the engine has requests it cannot schedule), and runs with the batch priority
  inside the engine (``produce(..., priority=)``), exactly as a queue worker runs it.
- Batches take turns: one request of each in turn, so a large batch does not hold a small one
  back.
- How each request ended is appended to ``results/<batch id>.jsonl``, so a restart keeps every
  answer given; requests queued or running when the pod stopped have none, and the driver hands
  them over again. The file is read and appended to in worker threads: this lane runs on the
  loop that serves vLLM's routes, which no file operation may hold.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from llmendpoints_common.batch.output import NOT_QUEUED, LineOutcome
from llmendpoints_common.batch.record import BatchRecord, line_job_id
from llmendpoints_common.errors import RequestTimeoutError, error_from_exception
from llmendpoints_common.jobs.models import JobRequest, JobStatus
from llmendpoints_common.waiting import wait_until_set

from llmendpoints_runtime.jobs.executor import produce
from llmendpoints_runtime.jobs.port import JobEngine
from llmendpoints_runtime.jobs.queue_worker import check_with_engine
from llmendpoints_runtime.jobs.settings import JobSettings

log = logging.getLogger("llmendpoints.batch.local")


class LocalLines:
    def __init__(
        self,
        engine: JobEngine,
        job_settings: JobSettings,
        root: Path,
        *,
        slots: Callable[[], int],
        priority: int,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._engine = engine
        self._settings = job_settings
        self._results = root / "results"  # made with its first file
        self._slots = slots
        self._priority = priority
        self._clock = clock
        # batch id -> queued (index, request); batches take turns in this order.
        self._queued: OrderedDict[str, deque[tuple[int, dict[str, Any]]]] = OrderedDict()
        self._queued_ids: set[str] = set()
        self._running: dict[str, tuple[asyncio.Task[None], float]] = {}
        self._done: dict[str, dict[str, LineOutcome]] = {}  # batch id -> job id -> outcome
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self._writes: set[asyncio.Task[None]] = set()  # answers on their way to disk

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        self._task = asyncio.create_task(self._schedule(), name="batch-lines")

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def queued(self) -> int:
        return len(self._queued_ids)

    async def drain(self, timeout: float) -> None:
        """Start nothing more; give running requests ``timeout`` s; the rest have no answer
        and are handed over again after a restart."""
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        tasks = [task for task, _ in self._running.values()]
        if tasks:
            await asyncio.wait(tasks, timeout=timeout)
        for task, _ in list(self._running.values()):
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        if self._writes:
            await asyncio.gather(*self._writes, return_exceptions=True)

    # ---- the driver's side -----------------------------------------------------------------

    async def submit(self, batch: BatchRecord, index: int, request: dict[str, Any]) -> None:
        job_id = line_job_id(batch.id, index)
        if (
            job_id in self._queued_ids
            or job_id in self._running
            or job_id in await self._outcomes(batch.id)
        ):
            return
        self._queued.setdefault(batch.id, deque()).append((index, request))
        self._queued_ids.add(job_id)
        self._wake.set()

    async def outcome(self, batch: BatchRecord, index: int) -> LineOutcome:
        job_id = line_job_id(batch.id, index)
        done = (await self._outcomes(batch.id)).get(job_id)
        if done is not None:
            return done
        if job_id in self._running:
            return LineOutcome(JobStatus.IN_PROGRESS, started_at=self._running[job_id][1])
        if job_id in self._queued_ids:
            return LineOutcome(JobStatus.IN_QUEUE)
        return NOT_QUEUED

    async def cancel(self, batch: BatchRecord, index: int, *, running: bool) -> None:
        job_id = line_job_id(batch.id, index)
        if job_id in self._queued_ids:
            queue = self._queued.get(batch.id, deque())
            self._queued[batch.id] = deque(item for item in queue if item[0] != index)
            self._queued_ids.discard(job_id)
            self._record(
                batch.id, job_id, LineOutcome(JobStatus.CANCELLED, finished_at=self._clock())
            )
        elif running and job_id in self._running:
            task = self._running[job_id][0]
            task.cancel()  # the task records CANCELLED and aborts the engine request

    # ---- running ---------------------------------------------------------------------------

    async def _schedule(self) -> None:
        while not self._stopping:
            room = self._slots() - len(self._running)
            started = False
            while room > 0 and self._queued:
                batch_id, queue = next(iter(self._queued.items()))
                self._queued.move_to_end(batch_id)  # the next batch's turn after this one
                if not queue:
                    del self._queued[batch_id]
                    continue
                index, request = queue.popleft()
                job_id = line_job_id(batch_id, index)
                self._queued_ids.discard(job_id)
                task = asyncio.create_task(self._run(batch_id, job_id, request))
                self._running[job_id] = (task, self._clock())
                room -= 1
                started = True
            if started:
                continue
            self._wake.clear()
            # Room also opens when interactive work ends, which nobody signals: look again.
            await wait_until_set(self._wake, 0.2)

    async def _run(self, batch_id: str, job_id: str, raw: dict[str, Any]) -> None:
        started = self._clock()
        request_id = f"batch-{job_id}"
        try:
            request = JobRequest.model_validate(raw)
            check_with_engine(self._engine, request, self._settings.limits)
            timeout_ms = (
                request.policy.executionTimeout or self._settings.default_execution_timeout_ms
            )
            try:
                output = await asyncio.wait_for(
                    produce(
                        self._engine,
                        self._settings,
                        request,
                        request_id,
                        lambda _chunk: None,
                        priority=self._priority,
                    ),
                    timeout_ms / 1000,
                )
            except TimeoutError:
                with contextlib.suppress(Exception):
                    await self._engine.abort(request_id)
                error = RequestTimeoutError(
                    f"the request ran longer than {timeout_ms} ms and was aborted",
                    param="policy.executionTimeout",
                ).to_error()
                outcome = LineOutcome(JobStatus.TIMED_OUT, error=error)
            else:
                outcome = LineOutcome(JobStatus.COMPLETED, output=output)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await self._engine.abort(request_id)
            if not self._stopping:  # cancelled by the driver (an expired batch)
                self._record(batch_id, job_id, LineOutcome(JobStatus.CANCELLED, started_at=started, finished_at=self._clock()))  # fmt: skip
            raise
        except Exception as exc:
            outcome = LineOutcome(JobStatus.FAILED, error=error_from_exception(exc))
        finally:
            self._running.pop(job_id, None)
            self._wake.set()
        self._record(
            batch_id,
            job_id,
            LineOutcome(
                outcome.status,
                output=outcome.output,
                error=outcome.error,
                started_at=started,
                finished_at=self._clock(),
            ),
        )

    # ---- results on disk -------------------------------------------------------------------

    def _path(self, batch_id: str) -> Path:
        return self._results / f"{batch_id}.jsonl"

    async def _outcomes(self, batch_id: str) -> dict[str, LineOutcome]:
        known = self._done.get(batch_id)
        if known is None:
            known = self._done[batch_id] = await asyncio.to_thread(self._read, batch_id)
        return known

    def _read(self, batch_id: str) -> dict[str, LineOutcome]:
        known: dict[str, LineOutcome] = {}
        with contextlib.suppress(FileNotFoundError):
            for raw in self._path(batch_id).read_bytes().splitlines():
                try:
                    item = json.loads(raw)
                except ValueError:
                    continue  # a line cut short by a crash: that request runs again
                known[item["id"]] = LineOutcome(
                    JobStatus(item["status"]),
                    output=item.get("output"),
                    error=item.get("error"),
                    started_at=item.get("started_at"),
                    finished_at=item.get("finished_at"),
                )
        return known

    def _record(self, batch_id: str, job_id: str, outcome: LineOutcome) -> None:
        """Known at once (the driver may ask next); on disk in a moment (a worker thread)."""
        assert outcome.status is not None
        line = {
            "id": job_id,
            "status": outcome.status.value,
            "output": outcome.output,
            "error": outcome.error,
            "started_at": outcome.started_at,
            "finished_at": outcome.finished_at,
        }
        known = self._done.get(batch_id)  # read when the request was submitted
        if known is not None:
            known[job_id] = outcome
        write = asyncio.create_task(
            asyncio.to_thread(self._append, batch_id, json.dumps(line).encode() + b"\n")
        )
        self._writes.add(write)
        write.add_done_callback(self._writes.discard)

    def _append(self, batch_id: str, line: bytes) -> None:
        self._results.mkdir(parents=True, exist_ok=True)
        with self._path(batch_id).open("ab") as out:
            out.write(line)

    def forget(self, batch_id: str) -> None:
        """A batch ended and its results were written: its answers need not stay in memory
        (they stay on disk while the batch's record does, for RunPod's ``/requests``)."""
        self._done.pop(batch_id, None)
        self._queued.pop(batch_id, None)
