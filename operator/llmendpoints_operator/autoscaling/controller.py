"""The autoscaler's I/O around the pure decision: one tick per endpoint every intervalSeconds.

A tick: list the endpoint's EndpointSlices (through the Kubernetes client, kube.py) -> read the
ready pods' /metrics (scrape.py) -> `decide()` -> if the size changes, patch the Deployment's
`spec.replicas` and post an Event -> write `status.autoscaling` -> export the operator metrics.

One scheduler task serves every endpoint (not a kopf timer per object: kopf timers put a
finalizer on each object, and their interval could not follow each endpoint's intervalSeconds).
Ticks of different endpoints run concurrently; an endpoint never has two ticks at once.

The autoscaler is the single writer of the Deployment's replicas while an endpoint can choose
(minReplicas < maxReplicas, no `spec.scaling.replicas` pin). The reconcile writes them only when it
creates the Deployment, when the count is outside the bounds, or for a pin (see
manifests.replicas_to_write and docs/operator.md); the autoscaler clamps to the same bounds, so the
two never disagree.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from .decision import Current, Decision, History, decide
from .metrics import AutoscalerMetrics
from .policy import ScalingPolicy
from .record import history_from_status, status_block
from .scrape import MetricsScraper, endpointslice_selector, targets_from_endpointslices

logger = logging.getLogger(__name__)

ENDPOINTSLICE_API = ("discovery.k8s.io/v1", "EndpointSlice")
STATUS_KEY = "autoscaling"  # status.autoscaling: written by the autoscaler only

Key = tuple[str, str]  # (namespace, endpoint name)


class KubeApi(Protocol):
    """The part of kube.KubeClient the autoscaler uses."""

    async def list(
        self, api_version: str, kind: str, namespace: str, *, label_selector: str
    ) -> list[dict[str, Any]]: ...

    async def patch(
        self,
        api_version: str,
        kind: str,
        namespace: str,
        name: str,
        patch: Mapping[str, Any],
        *,
        subresource: str | None = None,
    ) -> dict[str, Any]: ...


@dataclass(frozen=True)
class Subject:
    """An endpoint the autoscaler acts on, as the operator currently knows it."""

    owner: Mapping[str, Any]  # the LLMEndpoint (Events are posted on it)
    api_version: str
    kind: str
    policy: ScalingPolicy
    service: str
    deployment: str
    replicas: int  # the Deployment's spec.replicas now
    # The Deployment's status.readyReplicas: 0 means nothing to measure (the tick is skipped,
    # without a request: an endpoint whose pods are still loading costs no API calls).
    ready_replicas: int | None = None

    @property
    def key(self) -> Key:
        meta = self.owner["metadata"]
        return meta["namespace"], meta["name"]


# (obj, type, reason, message): kopf.event in the operator.
PostEvent = Callable[[Mapping[str, Any], str, str, str], None]


@dataclass
class _Memory:
    """What the autoscaler keeps per endpoint between ticks (the history also lives in status)."""

    history: History | None = None
    written: dict[str, Any] | None = None  # the last status.autoscaling written
    failing: frozenset[str] = frozenset()  # pods whose /metrics failed at the last tick
    # (replicas before, replicas after) of our last patch, until the Deployment index shows it.
    patched: tuple[int, int] | None = None
    next_due: float = 0.0
    task: asyncio.Task[None] | None = field(default=None, repr=False)


class Autoscaler:
    def __init__(
        self,
        kube: Callable[[], KubeApi],
        post_event: PostEvent,
        metrics: AutoscalerMetrics,
        scraper: MetricsScraper | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._kube = kube
        self._post_event = post_event
        self._metrics = metrics
        self._scraper = scraper or MetricsScraper()
        self._clock = clock
        self._memory: dict[Key, _Memory] = {}

    async def close(self) -> None:
        for memory in self._memory.values():
            if memory.task is not None:
                memory.task.cancel()
        await self._scraper.close()

    async def run(self, subjects: Callable[[], Iterable[Subject]]) -> None:
        """Tick every endpoint `subjects()` names at its own interval, until cancelled."""
        while True:
            now = self._clock()
            seen: set[Key] = set()
            try:
                current = list(subjects())
            except Exception:  # a bug in listing must not stop autoscaling for good
                logger.exception("Listing the autoscaled endpoints failed")
                await asyncio.sleep(1.0)
                continue
            for subject in current:
                seen.add(subject.key)
                memory = self._memory.setdefault(subject.key, _Memory())
                busy = memory.task is not None and not memory.task.done()
                if memory.next_due <= now and not busy:
                    memory.next_due = now + subject.policy.interval_seconds
                    memory.task = asyncio.create_task(
                        self._tick_logged(subject), name=f"autoscale {subject.key}"
                    )
            for key in set(self._memory) - seen:
                self.forget(key)
            wake = min((m.next_due for m in self._memory.values()), default=now + 1)
            await asyncio.sleep(min(max(wake - self._clock(), 0.05), 1.0))

    def forget(self, key: Key) -> None:
        """An endpoint is gone or no longer autoscaled: drop its memory and metric series."""
        memory = self._memory.pop(key, None)
        if memory is not None and memory.task is not None:
            memory.task.cancel()
        self._metrics.forget(*key)

    async def _tick_logged(self, subject: Subject) -> None:
        try:
            await self.tick(subject)
        except asyncio.CancelledError:
            raise
        except Exception:  # one endpoint's failure must not stop the others
            logger.exception("Autoscaling tick of %s/%s failed", *subject.key)

    async def tick(self, subject: Subject) -> Decision | None:
        """One decision for one endpoint, with all its I/O (None: nothing to measure)."""
        if subject.ready_replicas == 0:
            return None
        namespace, name = subject.key
        memory = self._memory.setdefault(subject.key, _Memory())
        kube = self._kube()
        slices = await kube.list(
            *ENDPOINTSLICE_API, namespace, label_selector=endpointslice_selector(subject.service)
        )
        view = targets_from_endpointslices(slices)
        result = await self._scraper.scrape(view.ready)
        failing = frozenset(result.errors)
        if failing != memory.failing:
            for pod in sorted(failing - memory.failing):
                logger.warning(
                    "%s/%s: /metrics of pod %s not read: %s", namespace, name, pod,
                    result.errors[pod],
                )  # fmt: skip
            for pod in sorted(memory.failing - failing):
                logger.info("%s/%s: /metrics of pod %s read again", namespace, name, pod)
            memory.failing = failing
        if result.errors:
            self._metrics.scrape_failed(namespace, name, len(result.errors))

        status = subject.owner.get("status") or {}
        if memory.history is None:  # first tick since start: resume from status
            memory.history = history_from_status(status)
            memory.written = dict(status.get(STATUS_KEY) or {}) or None
        now = self._clock()
        replicas = subject.replicas
        if memory.patched is not None:
            before, after = memory.patched
            if replicas == before:
                replicas = after  # the watch has not brought our own last patch yet
            else:
                memory.patched = None
        current = Current(replicas, result.observation)
        decision = decide(memory.history, current, subject.policy, now)
        memory.history = decision.history
        self._metrics.record(namespace, name, replicas, decision)

        if decision.replicas != replicas:
            await kube.patch(
                "apps/v1",
                "Deployment",
                namespace,
                subject.deployment,
                {"spec": {"replicas": decision.replicas}},
            )
            memory.patched = (subject.replicas, decision.replicas)
            logger.info("%s/%s: %s", namespace, name, decision.reason)
            self._post_event(subject.owner, "Normal", decision.action, decision.reason)

        block = status_block(memory.written, replicas, decision, now)
        if _meaningful(block) != _meaningful(memory.written):
            await kube.patch(
                subject.api_version,
                subject.kind,
                namespace,
                name,
                {"status": {STATUS_KEY: block}},
                subresource="status",
            )
            memory.written = block
        return decision


def _meaningful(block: Mapping[str, Any] | None) -> Any:
    """A status block minus the tick time: equal means there is nothing new to write."""
    if not block:
        return None
    return {k: v for k, v in block.items() if k != "lastTickTime"}
