"""Liveness, readiness and start-up phases.

Two audiences read readiness. SageMaker and RunPod load balancers expect `/ping` (and our
`/ready`) to answer 204 while the model loads, 200 when it serves and 503 when it cannot. The
kubelet counts every 2xx as ready, so Kubernetes probes use `/ready?strict=1`: 200 only when ready.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class EngineState(enum.StrEnum):
    INITIALIZING = "initializing"
    READY = "ready"
    FAILED = "failed"
    STOPPED = "stopped"


@dataclass(frozen=True)
class Probe:
    status: int
    body: dict


def readiness(
    state: EngineState, *, phase: str | None, reason: str | None, draining: bool, strict: bool
) -> Probe:
    """The answer of /ready (strict=False: 204 while initialising; strict=True: 503).

    A failed engine keeps saying why while the process drains towards its exit: "draining" would
    hide the cause from whoever looks last (a load balancer's log, `kubectl describe`)."""
    if state is EngineState.FAILED:
        return Probe(503, {"status": str(state), "reason": reason or "the engine is not running"})
    if draining:
        return Probe(503, {"status": "draining", "reason": "the server is shutting down"})
    if state is EngineState.READY:
        return Probe(200, {"status": "ready"})
    if state is EngineState.INITIALIZING:
        body = {"status": "initializing", "phase": phase}
        return Probe(503 if strict else 204, body)
    return Probe(503, {"status": str(state), "reason": reason or "the engine is not running"})


def liveness(state: EngineState, *, reason: str | None) -> Probe:
    """/health: 200 while the process can still become or stay useful.

    An engine that died after it was ready cannot recover inside this process: 503, so the
    kubelet restarts the container. A start-up failure also answers 503 (the reason is in the body
    and in /ready) — restarting is the only remedy for it as well.
    """
    if state is EngineState.FAILED:
        return Probe(503, {"status": "unhealthy", "reason": reason})
    return Probe(200, {"status": "ok"})


class Health:
    """The process's mutable health record; the functions above turn it into answers."""

    def __init__(self) -> None:
        self.state = EngineState.INITIALIZING
        self.phase: str | None = None
        self.reason: str | None = None
        self.draining = False

    def set_phase(self, phase: str) -> None:
        self.phase = phase

    def engine_ready(self) -> None:
        self.state, self.phase, self.reason = EngineState.READY, None, None

    def engine_failed(self, reason: str) -> None:
        self.state, self.reason = EngineState.FAILED, reason

    def engine_stopped(self) -> None:
        if self.state is not EngineState.FAILED:
            self.state = EngineState.STOPPED

    def start_draining(self) -> None:
        self.draining = True

    @property
    def ready(self) -> bool:
        return self.state is EngineState.READY and not self.draining

    def readiness(self, *, strict: bool) -> Probe:
        return readiness(
            self.state, phase=self.phase, reason=self.reason, draining=self.draining, strict=strict
        )

    def liveness(self) -> Probe:
        return liveness(self.state, reason=self.reason)
