"""How much work an endpoint has in the shared queue, readable with no runtime pod running.

The autoscaler scales an endpoint from zero on this, so it must not need a worker to have
connected. The endpoint's worker consumers (``workers-<ns>_<name>-<priority>`` on its queue
stream ``LLMEP_QUEUE_<ns>_<name>``, which the operator creates with the endpoint) count it: ``num_pending`` is what matches their filter and
was never delivered (queued), ``num_ack_pending`` what was delivered and not acknowledged
(running; a job whose worker vanished counts here until it is delivered again). On a
work-queue stream the two add up to the endpoint's messages. Every read names the endpoint's
own stream in the request's subject, so a runtime pod's credential reads its own endpoint's
depth and no other's.

When a consumer does not exist yet, the stream's per-subject message counts say the same
(everything is still queued).
"""

from __future__ import annotations

from dataclasses import dataclass

from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from llmendpoints_common.identity import EndpointRef
from llmendpoints_common.queue import names


@dataclass(frozen=True)
class QueueDepth:
    # Waiting for a worker, all priorities (what makes the autoscaler add replicas is
    # ``queued - queued_low_priority - queued_batch``: RunPod's lowPriority jobs do not trigger
    # scaling, and a batch scales for its window, from its own signal).
    queued: int
    queued_low_priority: int
    # Taken by a worker and not finished (a job whose worker vanished counts here until it is
    # delivered again).
    running: int
    queued_batch: int = 0
    running_batch: int = 0

    @property
    def for_scaling(self) -> int:
        return self.queued - self.queued_low_priority - self.queued_batch


async def endpoint_depth(js: JetStreamContext, endpoint: EndpointRef | str) -> QueueDepth:
    """The endpoint's queued and running jobs. A queue that was never used (no stream yet) is
    empty."""
    stream = names.queue_stream(endpoint)
    queued: dict[str, int] = {}
    running: dict[str, int] = {}
    missing: list[str] = []
    for priority in names.PRIORITIES:
        try:
            info = await js.consumer_info(stream, names.jobs_consumer(endpoint, priority))
        except NotFoundError:
            missing.append(priority)
            continue
        queued[priority] = info.num_pending or 0
        running[priority] = info.num_ack_pending or 0
    if missing:
        counts: dict[str, int] = {}
        try:
            info = await js.stream_info(stream, subjects_filter=names.jobs_filter(endpoint))
            counts = info.state.subjects or {}
        except NotFoundError:
            counts = {}
        by_priority = dict.fromkeys(names.PRIORITIES, 0)
        for subject, count in counts.items():  # every owner's subject
            by_priority[names.priority_of_jobs_subject(subject)] += count
        for priority in missing:
            # No worker consumer yet: everything is still queued.
            queued[priority] = by_priority[priority]
            running[priority] = 0
    return QueueDepth(
        queued=sum(queued.values()),
        queued_low_priority=queued["low"],
        running=sum(running.values()),
        queued_batch=queued.get(names.BATCH_PRIORITY, 0),
        running_batch=running.get(names.BATCH_PRIORITY, 0),
    )
