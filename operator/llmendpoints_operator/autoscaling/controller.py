"""The autoscaler's I/O around the pure decision: one tick per endpoint every intervalSeconds.

A tick: list the endpoint's EndpointSlices (through the Kubernetes client, kube.py) -> read the
ready pods' /metrics (scrape.py) and the work no pod holds (held requests, queued jobs: outside.py)
-> `decide()` -> if the size changes, patch the Deployment's `spec.replicas` and post an Event ->
write `status.autoscaling` -> export the operator metrics. A nudge from the gateway (work for an
endpoint with no ready replica) makes that endpoint's tick due at once.

Cold start: from the decision that scales up from zero to the first ready replica (the
Deployment's readyReplicas, checked every pass of the scheduler, so to within a second), kept in
`status.autoscaling.coldStart` and the histogram llmendpoints_autoscaler_cold_start_seconds.

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
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from llmendpoints_common.identity import EndpointRef
from llmendpoints_common.waiting import wait_until_set

from .decision import Current, Decision, History, Observation, Outside, decide
from .metrics import AutoscalerMetrics
from .outside import OutsideReader
from .policy import ScalingPolicy
from .record import (
    SCALED_TO_ZERO_ANNOTATION,
    ColdStart,
    event_reason,
    history_from_status,
    status_block,
)
from .scrape import (
    MetricsScraper,
    ScrapeResult,
    controller_pod_endpoints,
    endpointslice_selector,
    targets_from_endpointslices,
)

logger = logging.getLogger(__name__)
# Endpoints come due at staggered times; waking for each alone listed every endpoint tens of
# times a second with 200 of them (bench/operator_scale.py). Ticks due within this much of one
# another run together: a tick is at most this late (a nudge still wakes the loop at once).
GRAIN_SECONDS = 0.25

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
    deployment: str  # the workload's name: a Deployment, or a LeaderWorkerSet (see workload)
    replicas: int  # the workload's spec.replicas now (a LeaderWorkerSet's: groups)
    # The Deployment's status.readyReplicas: 0 with replicas > 0 means nothing to measure (the
    # tick is skipped, without a request: an endpoint whose pods are still loading costs no API
    # calls; at minReplicas 0 it reads the outside work only, as at 0 replicas, so that it can
    # go back to zero when nothing waits any more).
    ready_replicas: int | None = None
    # (apiVersion, kind) of the workload. A LeaderWorkerSet's replicas are groups: its Service
    # lists their leaders only, so a group is one replica here (its leader's /metrics carry the
    # whole group's queue) and every decision is in whole groups.
    workload: tuple[str, str] = ("apps/v1", "Deployment")

    @property
    def key(self) -> Key:
        meta = self.owner["metadata"]
        return meta["namespace"], meta["name"]


# (obj, type, reason, message): events.EventPoster.post in the operator.
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
    cold_start: ColdStart | None = None  # the last scale-up from zero
    at_risk: frozenset[str] = frozenset()  # batches said to be at risk (one Event each)


class Autoscaler:
    def __init__(
        self,
        kube: Callable[[], KubeApi],
        post_event: PostEvent,
        metrics: AutoscalerMetrics,
        scraper: MetricsScraper | None = None,
        clock: Callable[[], float] = time.time,
        outside: OutsideReader | None = None,
    ) -> None:
        self._kube = kube
        self._post_event = post_event
        self._metrics = metrics
        self._scraper = scraper or MetricsScraper()
        self._clock = clock
        self._outside = outside
        self._memory: dict[Key, _Memory] = {}
        self._wake = asyncio.Event()

    def set_outside(self, outside: OutsideReader | None) -> None:
        self._outside = outside

    async def close(self) -> None:
        for memory in self._memory.values():
            if memory.task is not None:
                memory.task.cancel()
        await self._scraper.close()
        if self._outside is not None:
            await self._outside.close()

    def nudge(self, endpoint: EndpointRef) -> None:
        """Work arrived for `endpoint` (namespace and name): tick it now, not at its time."""
        memory = self._memory.get((endpoint.namespace, endpoint.name))
        if memory is not None:
            memory.next_due = 0.0
        self._wake.set()

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
                starting = memory.cold_start is not None and memory.cold_start.ready_at is None
                if starting and subject.ready_replicas:  # first replica ready: tick to record it
                    memory.cold_start = memory.cold_start.ready(now)
                    self._metrics.cold_started(*subject.key, memory.cold_start.seconds)
                    memory.next_due = 0.0
                busy = memory.task is not None and not memory.task.done()
                if memory.next_due <= now and not busy:
                    memory.next_due = now + subject.policy.interval_seconds
                    memory.task = asyncio.create_task(
                        self._tick_logged(subject), name=f"autoscale {subject.key}"
                    )
            for key in set(self._memory) - seen:
                self.forget(key)
            wake = min((m.next_due for m in self._memory.values()), default=now + 1)
            self._wake.clear()
            await wait_until_set(self._wake, min(max(wake - self._clock(), GRAIN_SECONDS), 1.0))

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
        starting = subject.ready_replicas == 0 and subject.replicas > 0
        if starting and (subject.policy.min_replicas > 0 or self._outside is None):
            return None  # nothing to scrape, and the scale-up is already under way
        namespace, name = subject.key
        memory = self._memory.setdefault(subject.key, _Memory())
        kube = self._kube()
        if subject.replicas == 0 or starting:
            # No ready pod (none asked for, or none ready yet): nothing to scrape. At minReplicas
            # 0 the work that woke the endpoint may be gone meanwhile; without a tick, replicas
            # that never get ready (no GPU free, an image that does not pull) would stay for
            # good (decision.py, rule 7).
            result = ScrapeResult(Observation(0, 0, 0))
        else:
            result = await self._scrape(kube, subject, memory)
        observation = replace(result.observation, outside=await self._read_outside(subject))

        if memory.history is None:  # first tick since start: resume from status
            _resume(memory, subject.owner.get("status") or {})
        now = self._clock()
        replicas = subject.replicas
        if memory.patched is not None:
            before, after = memory.patched
            if replicas == before:
                replicas = after  # the watch has not brought our own last patch yet
            else:
                memory.patched = None
        decision = decide(memory.history, Current(replicas, observation), subject.policy, now)
        memory.history = decision.history
        self._metrics.record(namespace, name, replicas, decision)
        self._batches_at_risk(subject, memory, decision, observation)
        if decision.replicas != replicas:
            await self._resize(kube, subject, memory, decision, now)
        await self._write_status(kube, subject, memory, status_block(
            memory.written, replicas, decision, now, memory.cold_start
        ))  # fmt: skip
        return decision

    def _batches_at_risk(
        self, subject: Subject, memory: _Memory, decision: Decision, observation: Observation
    ) -> None:
        """A Warning Event the first time a batch is seen to miss its window (before it does):
        while there is time to raise maxReplicas, or to cancel it and keep what it did."""
        at_risk = frozenset(decision.batches_at_risk)
        new = at_risk - memory.at_risk
        memory.at_risk = at_risk
        if not new:
            return
        batches = {b.batch: b for b in (observation.outside.batches if observation.outside else ())}
        now = self._clock()
        for batch_id in sorted(new):
            signal = batches.get(batch_id)
            if signal is None:
                continue
            message = (
                f"batch {batch_id} will not finish inside its completion window: "
                f"{signal.remaining} request(s) left, {max(0, signal.deadline - now):.0f} s to go"
            )
            if signal.rate:
                message += f", answered at {signal.rate:.3g}/s"
            message += (
                f"; maxReplicas {subject.policy.max_replicas} (raise it, or cancel the batch to "
                "keep what it did)"
            )
            logger.warning("%s/%s: %s", *subject.key, message)
            self._post_event(subject.owner, "Warning", "BatchAtRisk", message)

    async def _resize(
        self, kube: KubeApi, subject: Subject, memory: _Memory, decision: Decision, now: float
    ) -> None:
        """Patch the workload's replicas (with why it is at zero, or without), post the Event."""
        namespace, name = subject.key
        patch: dict[str, Any] = {"spec": {"replicas": decision.replicas}}
        if decision.to_zero or decision.from_zero:  # say why it is at zero; None removes it
            zero_reason = decision.reason if decision.to_zero else None
            patch["metadata"] = {"annotations": {SCALED_TO_ZERO_ANNOTATION: zero_reason}}
        await kube.patch(*subject.workload, namespace, subject.deployment, patch)
        memory.patched = (subject.replicas, decision.replicas)
        if decision.from_zero:
            memory.cold_start = ColdStart(decided_at=now)
        logger.info("%s/%s: %s", namespace, name, decision.reason)
        self._post_event(subject.owner, "Normal", event_reason(decision), decision.reason)

    async def _write_status(
        self, kube: KubeApi, subject: Subject, memory: _Memory, block: dict[str, Any]
    ) -> None:
        if _meaningful(block) == _meaningful(memory.written):
            return
        namespace, name = subject.key
        await kube.patch(
            subject.api_version,
            subject.kind,
            namespace,
            name,
            {"status": {STATUS_KEY: block}},
            subresource="status",
        )
        memory.written = block

    async def _scrape(self, kube: KubeApi, subject: Subject, memory: _Memory) -> ScrapeResult:
        namespace, name = subject.key
        slices = await kube.list(
            *ENDPOINTSLICE_API, namespace, label_selector=endpointslice_selector(subject.service)
        )
        view = targets_from_endpointslices(controller_pod_endpoints(slices))
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
        return result

    async def _read_outside(self, subject: Subject) -> Outside | None:
        """Held requests and queued jobs; None when there is no queue or it did not answer."""
        if self._outside is None:
            return None
        namespace, name = subject.key
        try:
            outside = await self._outside.read(EndpointRef(namespace, name))
        except Exception as error:
            self._metrics.outside_failed(namespace, name)
            logger.warning(
                "%s/%s: held requests / queued jobs not read: %r", namespace, name, error
            )
            return None
        self._metrics.record_outside(namespace, name, outside)
        return outside


def _resume(memory: _Memory, status: Mapping[str, Any]) -> None:
    """What an operator restart keeps: the history, the last block written, the cold start."""
    memory.history = history_from_status(status)
    memory.written = dict(status.get(STATUS_KEY) or {}) or None
    memory.cold_start = ColdStart.from_status(memory.written)


def _meaningful(block: Mapping[str, Any] | None) -> Any:
    """A status block minus the tick time: equal means there is nothing new to write."""
    if not block:
        return None
    return {k: v for k, v in block.items() if k != "lastTickTime"}
