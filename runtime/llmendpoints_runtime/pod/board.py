"""What the API processes of one pod share (API_SERVER_COUNT > 1): a few numbers per process in
shared memory, and the pod's failure.

Each API process writes its own row (its engine state and start-up phase, a heartbeat, its
admission and job counts, the work its metrics would report) about ten times a second; anyone
reads the sums. The supervisor creates the board and hands it to every process it spawns.
``PodAdmission`` (admission.py) takes and gives back its slots under the board's lock, so
MAX_CONCURRENCY and MAX_QUEUE_LENGTH hold for the pod.

The answers built from it (pure, below): the pod is live while no process failed and every one
refreshed its row within STALE_AFTER_SECONDS; ready when every one is ready and the pod is not
draining.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from multiprocessing.context import BaseContext
from pathlib import Path
from typing import Any

from llmendpoints_runtime.health import EngineState, Probe

FIELDS = (
    "state",  # STATES index
    "phase",  # PHASES index
    "beat",  # time.time() of the last refresh (0: not yet)
    "adm_running",  # OpenAI requests' admission: sequences holding a slot
    "adm_waiting",  # ... waiting for one
    "job_running",  # jobs' admission: sequences holding a slot
    "job_waiting",  # ... waiting for one
    "jobs_queued",  # jobs accepted, not started (MAX_QUEUE_LENGTH of the job API)
    "queue",  # work not handed to the engine (the metrics' queue sources)
    "handed",  # work handed to the engine (the metrics' in-flight sources)
)
STATES = tuple(EngineState)
PHASES = (None, "download", "load", "warmup")
_FAILED, _DRAINING = 0, 1  # pod-wide flags
_REASON_BYTES = 2048
STALE_AFTER_SECONDS = 30.0


class PodBoard:
    """Shared memory for ``count`` API processes (spawn-safe: pass it to a spawned process)."""

    def __init__(self, count: int, values: Any, flags: Any, reason: Any, lock: Any) -> None:
        self.count = count
        self._values = values  # count x len(FIELDS) doubles
        self._flags = flags
        self._reason = reason
        self.lock = lock

    @classmethod
    def create(cls, count: int, context: BaseContext) -> PodBoard:
        return cls(
            count,
            context.RawArray("d", count * len(FIELDS)),
            context.RawArray("b", 2),
            context.RawArray("c", _REASON_BYTES),
            context.Lock(),
        )

    # -- one process's row --

    def get(self, index: int, name: str) -> float:
        return self._values[index * len(FIELDS) + FIELDS.index(name)]

    def set(self, index: int, name: str, value: float) -> None:
        self._values[index * len(FIELDS) + FIELDS.index(name)] = value

    def add(self, index: int, name: str, delta: float) -> None:
        """Under the board's lock, by the caller."""
        self.set(index, name, self.get(index, name) + delta)

    def total(self, name: str) -> float:
        offset = FIELDS.index(name)
        return sum(self._values[i * len(FIELDS) + offset] for i in range(self.count))

    def publish_state(self, index: int, state: EngineState, phase: str | None) -> None:
        self.set(index, "state", STATES.index(state))
        self.set(index, "phase", PHASES.index(phase) if phase in PHASES else 0)
        self.set(index, "beat", time.time())

    def set_phase_all(self, phase: str) -> None:
        """The supervisor's start-up phase, shown until the API processes publish theirs."""
        for index in range(self.count):
            if not self.get(index, "beat"):
                self.set(index, "phase", PHASES.index(phase))

    def rows(self) -> list[Row]:
        return [
            Row(
                index=i,
                state=STATES[int(self.get(i, "state"))],
                phase=PHASES[int(self.get(i, "phase"))],
                beat=self.get(i, "beat"),
            )
            for i in range(self.count)
        ]

    # -- the pod --

    def fail(self, reason: str) -> None:
        """The pod cannot serve (first reason wins)."""
        with self.lock:
            if self._flags[_FAILED]:
                return
            self._reason.value = reason.encode("utf-8", "replace")[: _REASON_BYTES - 1]
            self._flags[_FAILED] = 1

    @property
    def failure(self) -> str | None:
        if not self._flags[_FAILED]:
            return None
        return bytes(self._reason.value).decode("utf-8", "replace")

    def start_draining(self) -> None:
        self._flags[_DRAINING] = 1

    @property
    def draining(self) -> bool:
        return bool(self._flags[_DRAINING])

    def liveness(self) -> Probe:
        return pod_liveness(self.failure, self.rows(), time.time())

    def readiness(self, strict: bool) -> Probe:
        return pod_readiness(self.failure, self.draining, self.rows(), time.time(), strict=strict)


@dataclass(frozen=True)
class Row:
    index: int
    state: EngineState
    phase: str | None
    beat: float


def _stale(rows: list[Row], now: float) -> Row | None:
    return next((r for r in rows if r.beat and now - r.beat > STALE_AFTER_SECONDS), None)


def pod_liveness(failure: str | None, rows: list[Row], now: float) -> Probe:
    """/health of the pod (pure)."""
    if failure is not None:
        return Probe(503, {"status": "unhealthy", "reason": failure})
    if (stale := _stale(rows, now)) is not None:
        reason = (
            f"API process {stale.index} has not refreshed its state for "
            f"{now - stale.beat:.0f} s: it is stuck"
        )
        return Probe(503, {"status": "unhealthy", "reason": reason})
    return Probe(200, {"status": "ok"})


def pod_readiness(
    failure: str | None, draining: bool, rows: list[Row], now: float, *, strict: bool
) -> Probe:
    """/ready of the pod (pure): as health.readiness, over every API process."""
    live = pod_liveness(failure, rows, now)
    if live.status != 200:
        return Probe(503, {"status": "failed", "reason": live.body["reason"]})
    if draining:
        return Probe(503, {"status": "draining", "reason": "the server is shutting down"})
    if all(r.state is EngineState.READY for r in rows):
        return Probe(200, {"status": "ready"})
    if any(r.state is EngineState.STOPPED for r in rows):
        return Probe(503, {"status": "stopped", "reason": "an API process stopped"})
    waiting = [r for r in rows if r.state is not EngineState.READY]
    phase = next((r.phase for r in waiting if r.phase), None) or "starting"
    return Probe(503 if strict else 204, {"status": "initializing", "phase": phase})


@dataclass(frozen=True)
class PodSeat:
    """One API process's place in its pod: the board, its row, the pod's private directory
    (its processes' Unix sockets), the pod's secret (requests passed between them) and the
    supervisor's pid."""

    board: PodBoard
    index: int
    directory: Path
    token: str
    supervisor: int

    @property
    def count(self) -> int:
        return self.board.count
