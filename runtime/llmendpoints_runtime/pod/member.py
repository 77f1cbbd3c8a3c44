"""An API process's part in its pod: its row on the board, kept fresh, and the pod's failure
turned into its own.

Every PUBLISH_SECONDS, on the process's event loop: its engine state and start-up phase, its
queued jobs and the work its metrics count (the pod's /metrics adds them up), and a heartbeat
(a row that stops changing says the process is stuck). When the pod has failed -- the engine
died, the group lost a node, another API process died -- the process declares its engine dead
(requests in flight end with an error; its watcher answers 503 and stops it, as for an engine
death of its own); when it fails on its own, it says so for the pod.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable

from llmendpoints_runtime.engine import Engine
from llmendpoints_runtime.health import EngineState, Health
from llmendpoints_runtime.metrics import RuntimeMetrics
from llmendpoints_runtime.pod.board import PodSeat

PUBLISH_SECONDS = 0.1
REFRESH_EVERY = 5  # publications between refreshes of the features' gauges


class PodMember:
    def __init__(
        self,
        seat: PodSeat,
        health: Health,
        engine: Engine,
        metrics: RuntimeMetrics,
        stop: Callable[[], None],
        jobs_queued: Callable[[], int] = lambda: 0,
    ) -> None:
        self.seat = seat
        self.stop = stop
        self.health = health
        self.engine = engine
        self.metrics = metrics
        self.jobs_queued = jobs_queued
        self.orphaned = False

    def publish(self) -> None:
        board, index = self.seat.board, self.seat.index
        board.publish_state(index, self.health.state, self.health.phase)
        board.set(index, "jobs_queued", self.jobs_queued())
        waiting, handed = self.metrics.raw_signals()
        board.set(index, "queue", waiting)
        board.set(index, "handed", handed)

    def watch(self) -> None:
        board = self.seat.board
        if os.getppid() != self.seat.supervisor and not self.orphaned:
            # The supervisor was killed (a SIGKILL, an OOM kill): nothing will stop this
            # process any more, nor the engine it serves. Drain and go. (Not PR_SET_PDEATHSIG:
            # vLLM spawns the API processes from the supervisor's start-up thread, whose end
            # would count as the parent's death.)
            self.orphaned = True
            self.stop()
        if (failure := board.failure) is not None:
            self.engine.declare_dead(failure)
        elif self.health.state is EngineState.FAILED:
            board.fail(f"API process {self.seat.index}: {self.health.reason}")

    async def run(self) -> None:
        """Until cancelled (the runtime's ``on_serving``)."""
        ticks = 0
        while True:
            self.watch()
            self.publish()
            ticks += 1
            if ticks % REFRESH_EVERY == 0:
                self.metrics.engine_ready.set(1 if self.health.ready else 0)
                self.metrics.refresh()
            await asyncio.sleep(PUBLISH_SECONDS)
