"""Records each cold start of each endpoint: when a runtime pod first turns Ready, its Events
(the kubelet's image pull) and its start-up phases (its /metrics on the control port) become
``status.coldStart.last`` (record.cold_start) and the operator's histograms.

The status block is this recorder's alone (reconcile.py leaves it to it, as the autoscaler's).
A pod is recorded once: by uid in this process, and across operator restarts by the status
itself (the last record names the pod).
"""

from __future__ import annotations

import datetime
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Histogram

from llmendpoints_operator import kube, manifests
from llmendpoints_operator.coldstart import record

logger = logging.getLogger("llmendpoints_operator.coldstart")

STATUS_KEY = "coldStart"
RECENT_SECONDS = 600  # a pod Ready for longer is not a start to record now (operator restarts)
_REMEMBERED = 4096  # pod uids recorded, most recent kept

# From a second (a warm node, a small model) to an hour (a large image on a slow registry).
_BUCKETS = (1, 2.5, 5, 10, 20, 30, 45, 60, 90, 120, 180, 300, 600, 900, 1800, 3600)


class ColdStartMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.seconds = Histogram(
            "llmendpoints_operator_cold_start_seconds",
            "Runtime pods' start, from the pod's creation to Ready (status.coldStart.last.seconds).",
            ["endpoint", "from_zero"],
            buckets=_BUCKETS,
            registry=registry,
        )
        self.phases = Histogram(
            "llmendpoints_operator_cold_start_phase_seconds",
            "Each phase of a runtime pod's start (status.coldStart.last.phases; compile is part "
            "of load).",
            ["endpoint", "phase"],
            buckets=_BUCKETS,
            registry=registry,
        )

    def observe(self, endpoint: str, last: Mapping[str, Any]) -> None:
        self.seconds.labels(endpoint, str(bool(last.get("fromZero"))).lower()).observe(
            last["seconds"]
        )
        for phase, seconds in (last.get("phases") or {}).items():
            self.phases.labels(endpoint, phase).observe(seconds)


def control_url(pod: Mapping[str, Any]) -> str | None:
    """The runtime's /metrics on the pod's control port, from the pod's own spec."""
    ip = (pod.get("status") or {}).get("podIP")
    for container in (pod.get("spec") or {}).get("containers") or ():
        for port in container.get("ports") or ():
            if port.get("name") == manifests.CONTROL_PORT_NAME and ip:
                return f"http://{ip}:{port['containerPort']}/metrics"
    return None


class ColdStartRecorder:
    def __init__(
        self,
        *,
        kube: Callable[[], kube.KubeClient],
        fetch: Callable[[str], Awaitable[str]],
        metrics: ColdStartMetrics,
        clock: Callable[[], datetime.datetime] = lambda: datetime.datetime.now(datetime.UTC),
    ) -> None:
        self._kube = kube
        self._clock = clock
        self._fetch = fetch  # a URL's body (raises on failure): the runtime's /metrics
        self._metrics = metrics
        self._recorded: OrderedDict[str, None] = OrderedDict()

    def wants(self, pod: Mapping[str, Any], endpoint: Mapping[str, Any] | None) -> bool:
        """A replica's pod (not a group's worker) that just turned Ready and is not recorded yet
        (cheap: called on every pod event). Not a pod that was Ready before the last record, nor
        one Ready for longer than RECENT_SECONDS: an operator that restarts sees every running
        pod again, and their starts are history (recorded then, or lost while it was down)."""
        meta = pod.get("metadata") or {}
        ready = record.condition_time(pod, "Ready")
        if endpoint is None or ready is None or meta.get("uid") in self._recorded:
            return False
        if not record.serves(pod):  # a group's worker: its leader's start is the group's
            return False
        if (self._clock() - ready).total_seconds() > RECENT_SECONDS:
            return False
        last = ((endpoint.get("status") or {}).get(STATUS_KEY) or {}).get("last") or {}
        recorded = record.parse_time(last.get("readyAt"))
        return (
            recorded is None
            or ready > recorded
            or (ready == recorded and last.get("pod") != meta.get("name"))
        )

    async def record(
        self, pod: Mapping[str, Any], endpoint: Mapping[str, Any], *, from_zero: bool
    ) -> dict[str, Any] | None:
        meta = pod["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        self._remember(meta.get("uid") or name)
        client = self._kube()
        try:
            events = await client.list(
                "v1", "Event", namespace, field_selector=f"involvedObject.name={name}"
            )
        except kube.ApiError as exc:
            logger.info("Events of pod %s/%s not read: %s", namespace, name, exc)
            events = []
        events = [e for e in events if (e.get("involvedObject") or {}).get("name") == name]
        startup = record.RuntimeStartup()
        url = control_url(pod)
        if url is not None:
            try:
                startup = record.parse_runtime_startup(await self._fetch(url))
            except Exception as exc:  # no phases: the record keeps what Kubernetes says
                logger.info("Start-up phases of pod %s/%s not read: %s", namespace, name, exc)
        last = record.cold_start(
            pod, events, startup, container=manifests.CONTAINER_NAME, from_zero=from_zero
        )
        if last is None:
            return None
        endpoint_name = endpoint["metadata"]["name"]
        try:
            await client.patch(
                manifests.API_VERSION,
                manifests.KIND,
                namespace,
                endpoint_name,
                {"status": {STATUS_KEY: {"last": last}}},
                subresource="status",
            )
        except kube.NotFound:
            return None  # the endpoint is gone
        self._metrics.observe(f"{namespace}/{endpoint_name}", last)
        logger.info(
            "Cold start of %s/%s (pod %s): %.1f s, %s",
            namespace,
            endpoint_name,
            name,
            last["seconds"],
            ", ".join(f"{k} {v:g} s" for k, v in last["phases"].items()),
        )
        return last

    def _remember(self, uid: str) -> None:
        self._recorded[uid] = None
        while len(self._recorded) > _REMEMBERED:
            self._recorded.popitem(last=False)
