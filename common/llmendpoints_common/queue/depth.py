"""How much work an endpoint has in the shared queue, readable with no runtime pod running.

The autoscaler scales an endpoint from zero on this, so it must not need a worker to have
connected: the stream's per-subject message counts are always there (a queued job is one
message on ``llmep.jobs.<endpoint>.<priority>`` until a worker acknowledges it). When the
workers' durable consumer exists, its count of delivered-but-unacknowledged messages says how
many of those are running.
"""

from __future__ import annotations

from dataclasses import dataclass

from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from llmendpoints_common.queue import names


@dataclass(frozen=True)
class QueueDepth:
    # Waiting for a worker, all priorities (what makes the autoscaler add replicas is
    # ``queued - queued_low_priority``: RunPod's lowPriority jobs do not trigger scaling).
    queued: int
    queued_low_priority: int
    # Taken by a worker and not finished (a job whose worker vanished counts here until it is
    # delivered again).
    running: int

    @property
    def for_scaling(self) -> int:
        return self.queued - self.queued_low_priority


async def endpoint_depth(js: JetStreamContext, endpoint: str) -> QueueDepth:
    """The endpoint's queued and running jobs. Raises NotFoundError-free: a queue that was never
    used (no stream yet) is empty."""
    try:
        info = await js.stream_info(names.JOBS_STREAM, subjects_filter=names.jobs_filter(endpoint))
    except NotFoundError:
        return QueueDepth(queued=0, queued_low_priority=0, running=0)
    counts = info.state.subjects or {}
    queued: dict[str, int] = {}
    running: dict[str, int] = {}
    for priority in names.PRIORITIES:
        in_stream = counts.get(names.jobs_subject(endpoint, priority), 0)
        taken = 0
        if in_stream:
            try:
                consumer = await js.consumer_info(
                    names.JOBS_STREAM, names.jobs_consumer(endpoint, priority)
                )
                taken = min(in_stream, consumer.num_ack_pending or 0)
            except NotFoundError:
                taken = 0  # no worker ever connected: everything is still queued
        queued[priority] = in_stream - taken
        running[priority] = taken
    return QueueDepth(
        queued=queued["normal"] + queued["low"],
        queued_low_priority=queued["low"],
        running=running["normal"] + running["low"],
    )
