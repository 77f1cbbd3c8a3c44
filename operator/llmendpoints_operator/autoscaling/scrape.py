"""Signals: which pods to read (from EndpointSlices) and reading their /metrics.

`targets_from_endpointslices` and `parse_pod_metrics` are pure. `MetricsScraper` is the only
network code here: one aiohttp session, every ready pod read concurrently with a short timeout.
The EndpointSlices themselves are listed through kube.py (the only module that talks to the
Kubernetes API).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from llmendpoints_common.signals import IN_FLIGHT, QUEUE_DEPTH
from prometheus_client.parser import text_string_to_metric_families

from ..adapter_status import PodAdapter, parse_pod_adapters
from ..bodies import read_at_most
from .decision import Observation

SERVICE_NAME_LABEL = "kubernetes.io/service-name"
PORT_NAME = "http"
# The runtime's control port (probes and /metrics from a process of their own, answered under
# load): scraped where the Service lists it, else the http port (pods of older runtimes).
CONTROL_PORT_NAME = "control"
# vLLM's own series make a pod's /metrics a few hundred kB at most; refuse anything absurd.
MAX_BODY_BYTES = 8 * 1024 * 1024


class MetricsError(ValueError):
    """A pod answered, but not with the two gauges the autoscaler needs."""


@dataclass(frozen=True, slots=True)
class ScrapeTarget:
    pod: str  # pod name (or the address when the slice names no pod)
    url: str


@dataclass(frozen=True, slots=True)
class EndpointsView:
    """An endpoint's pods as its Service's EndpointSlices list them."""

    ready: tuple[ScrapeTarget, ...]


@dataclass(frozen=True, slots=True)
class ScrapeResult:
    observation: Observation
    errors: dict[str, str] = field(default_factory=dict)  # pod -> why it was not read
    # Per pod read: its LoRA adapters' state (adapter_status.py; empty without adapters).
    adapters: tuple[Mapping[str, PodAdapter], ...] = ()


def endpointslice_selector(service: str) -> str:
    """The label selector that lists a Service's EndpointSlices."""
    return f"{SERVICE_NAME_LABEL}={service}"


# The EndpointSlice controller's own mark. Only it writes slices for a Service with a selector,
# and its endpoints point at the Pods it selected.
MANAGED_BY_LABEL = "endpointslice.kubernetes.io/managed-by"
ENDPOINTSLICE_CONTROLLER = "endpointslice-controller.k8s.io"


def controller_pod_endpoints(slices: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Only what the operator may fetch from: slices the EndpointSlice controller manages, and in
    them only endpoints that point at a Pod (targetRef.kind: Pod).

    The service-name label alone selects any EndpointSlice anyone labels so; without this filter,
    whoever may write one could make the operator send GETs to any address (docs/security.md)."""
    trusted: list[Mapping[str, Any]] = []
    for eps in slices:
        labels = (eps.get("metadata") or {}).get("labels") or {}
        if labels.get(MANAGED_BY_LABEL) != ENDPOINTSLICE_CONTROLLER:
            continue
        pods = [
            endpoint
            for endpoint in eps.get("endpoints") or ()
            if (endpoint.get("targetRef") or {}).get("kind") == "Pod"
        ]
        trusted.append({**eps, "endpoints": pods})
    return trusted


def targets_from_endpointslices(
    slices: Iterable[Mapping[str, Any]], port_name: str = PORT_NAME
) -> EndpointsView:
    """Ready pods and their metrics URL. A pod listed in several slices (dual stack) counts
    once; an endpoint whose `ready` condition is absent counts as ready, as the EndpointSlice
    API asks consumers to do."""
    ready: dict[str, ScrapeTarget] = {}
    for eps in slices:
        ports = {p.get("name"): p.get("port") for p in eps.get("ports") or ()}
        port = ports.get(CONTROL_PORT_NAME) if port_name == PORT_NAME else None
        port = port or ports.get(port_name)
        for endpoint in eps.get("endpoints") or ():
            addresses = endpoint.get("addresses") or ()
            if not addresses:
                continue
            pod = (endpoint.get("targetRef") or {}).get("name") or addresses[0]
            if (endpoint.get("conditions") or {}).get("ready") is False or port is None:
                continue  # starting or terminating, or nothing to scrape
            if pod not in ready:
                host = f"[{addresses[0]}]" if ":" in addresses[0] else addresses[0]
                ready[pod] = ScrapeTarget(pod, f"http://{host}:{port}/metrics")
    return EndpointsView(tuple(ready.values()))


def parse_pod_metrics(text: str) -> tuple[float, float]:
    """(queue depth, requests in flight) from one pod's Prometheus text exposition."""
    # Only the two gauges' lines go through the parser: vLLM's histograms are most of the body.
    wanted = "\n".join(
        line
        for line in text.splitlines()
        if line.startswith((QUEUE_DEPTH, IN_FLIGHT, "# TYPE llmendpoints_", "# HELP llmendpoints_"))
    )
    values: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(wanted + "\n"):
            for sample in family.samples:
                if sample.name in (QUEUE_DEPTH, IN_FLIGHT):
                    values[sample.name] = values.get(sample.name, 0.0) + sample.value
    except ValueError as error:
        raise MetricsError(f"unparsable metrics: {error}") from error
    missing = [name for name in (QUEUE_DEPTH, IN_FLIGHT) if name not in values]
    if missing:
        raise MetricsError(f"missing {', '.join(missing)}")
    for name, value in values.items():
        if not math.isfinite(value) or value < 0:
            raise MetricsError(f"{name} is {value}")
    return values[QUEUE_DEPTH], values[IN_FLIGHT]


def observe(pods: list[tuple[float, float]], failed: int = 0) -> Observation:
    """One tick's observation from the (queue depth, in flight) of each pod that answered."""
    saturated = [in_flight for queue_depth, in_flight in pods if queue_depth > 0]
    return Observation(
        queue_depth=sum(q for q, _ in pods),
        in_flight=sum(f for _, f in pods),
        answered=len(pods),
        failed=failed,
        saturated_in_flight=sum(saturated) / len(saturated) if saturated else None,
    )


class MetricsScraper:
    """Reads the runtime pods' /metrics. One per operator; close it on shutdown."""

    def __init__(self, timeout: float = 1.0) -> None:
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._session: aiohttp.ClientSession | None = None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def scrape(self, targets: Iterable[ScrapeTarget]) -> ScrapeResult:
        """Read every target concurrently. A pod that does not answer in time, answers with an
        error, or lacks the gauges is counted as failed, with the reason in `errors`."""
        targets = list(targets)
        results = await asyncio.gather(*(self._read(t) for t in targets))
        errors: dict[str, str] = {}
        read: list[tuple[float, float]] = []
        adapters: list[Mapping[str, PodAdapter]] = []
        for target, result in zip(targets, results, strict=True):
            if isinstance(result, str):
                errors[target.pod] = result
            else:
                read.append(result[:2])
                adapters.append(result[2])
        return ScrapeResult(observe(read, failed=len(errors)), errors, tuple(adapters))

    async def fetch(self, url: str) -> str:
        """One page's text (a new pod's /metrics, for its start-up phases); raises on an error,
        a timeout or a body over MAX_BODY_BYTES."""
        session = self._open()
        async with session.get(url) as response:
            if response.status != 200:
                raise aiohttp.ClientResponseError(response.request_info, (), status=response.status)
            body = await read_at_most(response.content, MAX_BODY_BYTES + 1)
        if len(body) > MAX_BODY_BYTES:
            raise ValueError(f"body larger than {MAX_BODY_BYTES} bytes")
        return body.decode("utf-8", errors="replace")

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # A fresh connection per read: pod IPs are recycled, and a kept-alive connection to
            # a pod that is gone would turn into a failed scrape.
            self._session = aiohttp.ClientSession(
                timeout=self._timeout, connector=aiohttp.TCPConnector(limit=0, force_close=True)
            )
        return self._session

    async def _read(
        self, target: ScrapeTarget
    ) -> tuple[float, float, Mapping[str, PodAdapter]] | str:
        session = self._open()
        try:
            async with session.get(target.url) as response:
                if response.status != 200:
                    return f"HTTP {response.status}"
                body = await read_at_most(response.content, MAX_BODY_BYTES + 1)
                if len(body) > MAX_BODY_BYTES:
                    return f"body larger than {MAX_BODY_BYTES} bytes"
            text = body.decode("utf-8", errors="replace")
            return (*parse_pod_metrics(text), parse_pod_adapters(text))
        except TimeoutError:
            return f"no answer within {self._timeout.total:g} s"
        except aiohttp.ClientError as error:
            return f"{type(error).__name__}: {error}"
        except MetricsError as error:
            return str(error)
