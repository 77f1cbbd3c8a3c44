"""Kubernetes Events on LLMEndpoints: what `kubectl describe llmep` lists under Events.

`event_object` is pure. `EventPoster` posts them through kube.py in one background task, in the
order they were raised, so that the reconcile, the resync and the autoscaler post the same way
from wherever they run (kopf's own `kopf.event` works only inside kopf's per-object handler
context, which the operator-wide resync and autoscaler tasks do not have). A failed post is
logged and dropped: an Event is never worth failing a reconcile for.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
from collections.abc import Callable, Mapping
from typing import Any, Protocol

logger = logging.getLogger(__name__)

COMPONENT = "llmendpoints-operator"
MAX_MESSAGE_LENGTH = 1024  # what the API server keeps of a message
QUEUE_LIMIT = 1000  # Events waiting to be posted; beyond it new ones are dropped (and logged)

# (object, type, reason, message): the signature every poster of Events has.
PostEvent = Callable[[Mapping[str, Any], str, str, str], None]


class EventsApi(Protocol):
    """The part of kube.KubeClient the poster uses."""

    async def create(self, obj: Mapping[str, Any]) -> dict[str, Any]: ...


def event_object(
    involved: Mapping[str, Any], type_: str, reason: str, message: str, now: datetime.datetime
) -> dict[str, Any]:
    """A core/v1 Event about `involved` (any object with apiVersion, kind and metadata)."""
    meta = involved.get("metadata") or {}
    if len(message) > MAX_MESSAGE_LENGTH:
        message = message[: MAX_MESSAGE_LENGTH - 3] + "..."
    timestamp = now.strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
        "involvedObject": {
            "apiVersion": involved.get("apiVersion"),
            "kind": involved.get("kind"),
            "name": meta["name"],
            "namespace": meta["namespace"],
            **({"uid": meta["uid"]} if meta.get("uid") else {}),
        },
        "type": type_,
        "reason": reason,
        "message": message,
        "source": {"component": COMPONENT},  # the "From" column of kubectl describe
        "reportingComponent": COMPONENT,
        "firstTimestamp": timestamp,
        "lastTimestamp": timestamp,
        "count": 1,
    }


class EventPoster:
    """Queues Events (`post`, never blocks, never raises) and posts them in the background."""

    def __init__(
        self,
        kube: Callable[[], EventsApi],
        clock: Callable[[], datetime.datetime] = lambda: datetime.datetime.now(datetime.UTC),
    ) -> None:
        self._kube = kube
        self._clock = clock
        self._queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue(QUEUE_LIMIT)

    def post(self, obj: Mapping[str, Any], type_: str, reason: str, message: str) -> None:
        try:
            self._queue.put_nowait(event_object(obj, type_, reason, message, self._clock()))
        except asyncio.QueueFull:
            logger.warning("Event %s dropped (%d waiting): %s", reason, QUEUE_LIMIT, message)

    async def run(self) -> None:
        """Post queued Events until cancelled."""
        while True:
            event = await self._queue.get()
            try:
                await self._post(event)
            finally:
                self._queue.task_done()

    async def flush(self, timeout: float) -> None:
        """Wait (at most `timeout` seconds) until every queued Event is posted: on shutdown."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._queue.join(), timeout)

    async def _post(self, event: dict[str, Any]) -> None:
        try:
            await self._kube().create(event)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the API refused it, or no connection: log, never fail
            logger.warning(
                "Event %s on %s not posted: %s",
                event["reason"],
                event["involvedObject"]["name"],
                exc,
            )
