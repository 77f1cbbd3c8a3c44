"""Writes status.adapters: per declared LoRA adapter, on how many ready replicas it serves.

Every ``interval`` seconds, for each endpoint that declares adapters: list its EndpointSlices
(kube.py), read the ready pods' /metrics with the autoscaler's scraper (scrape.py parses the
adapter gauges next to its own), compute the block (adapter_status.py, pure), and patch
``status.adapters`` when it changed. Independent of autoscaling, so fixed-size endpoints get it
too; the reconcile's status writes leave the key alone (handlers.publish_status).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ..adapter_status import STATUS_KEY, adapter_status
from .controller import ENDPOINTSLICE_API, Key, KubeApi
from .scrape import MetricsScraper, endpointslice_selector, targets_from_endpointslices

logger = logging.getLogger(__name__)

DEFAULT_INTERVAL_SECONDS = 10.0


@dataclass(frozen=True)
class AdapterSubject:
    owner: Mapping[str, Any]  # the LLMEndpoint as last seen
    api_version: str
    kind: str
    service: str
    adapters: tuple[str, ...]  # declared names, in spec order
    ready_replicas: int  # the Deployment's readyReplicas (0: nothing to read)

    @property
    def key(self) -> Key:
        meta = self.owner["metadata"]
        return meta["namespace"], meta["name"]


class AdapterStatusWatcher:
    def __init__(
        self,
        kube: Callable[[], KubeApi],
        scraper: MetricsScraper | None = None,
        interval: float = DEFAULT_INTERVAL_SECONDS,
    ) -> None:
        self._kube = kube
        self._scraper = scraper or MetricsScraper()
        self._interval = interval
        self._written: dict[Key, list[dict[str, Any]]] = {}

    async def close(self) -> None:
        await self._scraper.close()

    async def run(self, subjects: Callable[[], Iterable[AdapterSubject]]) -> None:
        while True:
            try:
                current = list(subjects())
                await asyncio.gather(*(self._tick_logged(s) for s in current))
                for key in set(self._written) - {s.key for s in current}:
                    del self._written[key]
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug in listing must not end the watch for good
                logger.exception("adapter status round failed")
            await asyncio.sleep(self._interval)

    async def _tick_logged(self, subject: AdapterSubject) -> None:
        try:
            await self.tick(subject)
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("adapter status of %s/%s failed", *subject.key)

    async def tick(self, subject: AdapterSubject) -> list[dict[str, Any]]:
        namespace, name = subject.key
        kube = self._kube()
        pods: tuple = ()
        if subject.ready_replicas > 0:
            slices = await kube.list(
                *ENDPOINTSLICE_API,
                namespace,
                label_selector=endpointslice_selector(subject.service),
            )
            result = await self._scraper.scrape(targets_from_endpointslices(slices).ready)
            pods = result.adapters
        block = adapter_status(subject.adapters, pods)
        previous = self._written.get(subject.key)
        if previous is None:
            previous = (subject.owner.get("status") or {}).get(STATUS_KEY)
        if block != previous:
            await kube.patch(
                subject.api_version,
                subject.kind,
                namespace,
                name,
                {"status": {STATUS_KEY: block}},
                subresource="status",
            )
            for entry in block:
                if "lastError" in entry:
                    logger.warning("%s/%s: adapter %s: %s", namespace, name, entry["name"],
                                   entry["lastError"])  # fmt: skip
        self._written[subject.key] = block
        return block


def adapter_subjects(
    endpoints: Iterable[tuple[Mapping[str, Any] | None, int]],
) -> list[AdapterSubject]:
    """(LLMEndpoint snapshot, its Deployment's readyReplicas) -> what to watch: endpoints that
    declare adapters, and those whose status still lists adapters the spec dropped (one last
    write clears it)."""
    subjects = []
    for snapshot, ready in endpoints:
        if snapshot is None or snapshot["metadata"].get("deletionTimestamp"):
            continue
        declared = (snapshot.get("spec") or {}).get("adapters") or []
        names = tuple(a["name"] for a in declared if isinstance(a, Mapping) and "name" in a)
        if not names and not (snapshot.get("status") or {}).get(STATUS_KEY):
            continue
        subjects.append(
            AdapterSubject(
                owner=snapshot,
                api_version=snapshot.get("apiVersion", ""),
                kind=snapshot.get("kind", ""),
                service=snapshot["metadata"]["name"],  # manifests.service_name: the same
                adapters=names,
                ready_replicas=ready,
            )
        )
    return subjects
