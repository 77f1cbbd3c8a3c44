"""Creating the queue's streams, buckets and consumers (idempotent).

Who creates them: with per-role credentials (the chart's NATS), the llmendpoints operator, at
start-up (streams) and for each endpoint it reconciles (the endpoint's worker consumers); a
runtime pod's credential may not create anything, so its worker waits until they exist. With a
password in the URL (a NATS you bring, local runs), every process that uses the queue creates
what is missing on connect, as before. Existing streams and consumers are left as they are
(their configuration is whatever the first creator chose, or what an operator set by hand), so
a rolling upgrade never fights over configuration.

- ``LLMEP_JOBS``: work-queue retention (a message is removed when a worker acknowledges it,
  once the job ended), file storage; at most ``per_subject_limit`` messages per endpoint,
  priority and owner (``max_queued_per_owner``), further submissions are refused at once
  (discard-new per subject -> 429), never dropped later. Its per-subject limit is the one
  setting reconciled on an existing stream (``ensure_streams(reconcile=True)``, the
  operator's), so changing the cap takes effect without recreating the queue.
- ``KV_LLMEP_JOB_STATE``: one value per key, per-message TTL (a finished job's record expires
  after its retention), direct gets (reads served by any replica).
- ``KV_LLMEP_JOB_IDEMPOTENCY``: the same shape, entries live for the idempotency window.
- ``LLMEP_JOB_CHUNKS``: stream output, per-message TTL, bounded by ``chunk_max_age``.
- ``KV_LLMEP_QUOTAS``: the gateway's per-key limiter state (one value per key name, per-message
  TTL: an idle key's state goes away on its own).
- ``LLMEP_USAGE``: usage records for chargeback, kept ``usage_max_age``, de-duplicated by
  request id over ``usage_duplicate_window``.
- ``KV_LLMEP_SIGNALS``: held-request counts, in memory, each expiring ``HELD_TTL_SECONDS``
  after its last write (queue/signals.py).
- ``KV_LLMEP_BATCHES``: file and batch records (per-message TTL: each goes with what it
  describes).
- ``OBJ_LLMEP_FILES``: the object store of files' contents and batches' inputs (queue/objects.py),
  per-message TTL, at most ``files_max_bytes`` (new uploads get 507 beyond), nothing older than
  ``files_max_age`` (a backstop: every object expires by its own TTL first).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from nats.js import JetStreamContext
from nats.js import api as js_api
from nats.js.errors import BadRequestError, NotFoundError

from llmendpoints_common.identity import EndpointRef
from llmendpoints_common.queue import names, objects

# JetStream's error code for "stream name already in use" (two processes created it at once).
_STREAM_NAME_IN_USE = 10058
_CONSUMER_EXISTS = 10148


@dataclass(frozen=True)
class QueueLayout:
    """What the first creator of the streams decides."""

    # Replicas of each stream: 1 on one server, 3 on the chart's cluster.
    replicas: int = 1
    # Queued jobs per endpoint, priority and owner beyond which /run answers 429 when no
    # per-owner cap is set (0 below).
    max_queue_length: int = 10_000
    # Queued (or running) jobs one owner (API key) may have per endpoint and priority: one key
    # must not fill an endpoint's queue. 0: no cap below ``max_queue_length``.
    max_queued_per_owner: int = 1_000
    # A worker that has not reported progress this long is presumed dead: its job is
    # delivered to another worker.
    heartbeat_timeout_seconds: float = 30.0
    # Upper bound on how long stream chunks are kept (each also expires with its job).
    chunk_max_age_seconds: float = 24 * 3600.0
    # How long usage records are kept for export (about 13 months: a year of chargeback).
    usage_max_age_seconds: float = 400 * 24 * 3600.0
    # A usage record published again with the same request id within this window is dropped.
    usage_duplicate_window_seconds: float = 600.0
    # The object store of batch files: its bound in bytes (-1: none but the server's), and the
    # age past which nothing is kept (files live 30 days at most, plus a day of slack).
    files_max_bytes: int = -1
    files_max_age_seconds: float = 31 * 24 * 3600.0


def _kv_stream(bucket: str, replicas: int) -> js_api.StreamConfig:
    # The layout nats-py and the nats CLI expect of a key-value bucket, plus per-message TTL.
    return js_api.StreamConfig(
        name=names.kv_stream(bucket),
        subjects=[f"$KV.{bucket}.>"],
        max_msgs_per_subject=1,
        discard=js_api.DiscardPolicy.NEW,
        allow_rollup_hdrs=True,
        deny_delete=True,
        allow_direct=True,
        allow_msg_ttl=True,
        storage=js_api.StorageType.FILE,
        num_replicas=replicas,
    )


def per_subject_limit(layout: QueueLayout) -> int:
    """The jobs stream's per-subject limit: the per-owner cap, never above the queue length."""
    cap = layout.max_queued_per_owner
    return min(cap, layout.max_queue_length) if cap > 0 else layout.max_queue_length


def stream_configs(layout: QueueLayout) -> list[js_api.StreamConfig]:
    return [
        js_api.StreamConfig(
            name=names.JOBS_STREAM,
            subjects=["llmep.jobs.>"],
            retention=js_api.RetentionPolicy.WORK_QUEUE,
            storage=js_api.StorageType.FILE,
            max_msgs_per_subject=per_subject_limit(layout),
            discard=js_api.DiscardPolicy.NEW,
            discard_new_per_subject=True,
            duplicate_window=120.0,
            num_replicas=layout.replicas,
        ),
        _kv_stream(names.JOB_STATE_BUCKET, layout.replicas),
        _kv_stream(names.IDEMPOTENCY_BUCKET, layout.replicas),
        js_api.StreamConfig(
            name=names.CHUNKS_STREAM,
            subjects=["llmep.chunks.>"],
            storage=js_api.StorageType.FILE,
            max_age=layout.chunk_max_age_seconds,
            allow_direct=True,
            allow_msg_ttl=True,
            num_replicas=layout.replicas,
        ),
        _kv_stream(names.QUOTAS_BUCKET, layout.replicas),
        js_api.StreamConfig(
            name=names.USAGE_STREAM,
            subjects=["llmep.usage.>"],
            storage=js_api.StorageType.FILE,
            max_age=layout.usage_max_age_seconds,
            duplicate_window=layout.usage_duplicate_window_seconds,
            num_replicas=layout.replicas,
        ),
        signals_config(),
        _kv_stream(names.BATCHES_BUCKET, layout.replicas),
        js_api.StreamConfig(
            name=objects.FILES_STREAM,
            description="LLM Endpoints batch files (object store)",
            subjects=[f"$O.{objects.FILES_BUCKET}.C.>", f"$O.{objects.FILES_BUCKET}.M.>"],
            storage=js_api.StorageType.FILE,
            max_age=layout.files_max_age_seconds,
            max_bytes=layout.files_max_bytes,
            discard=js_api.DiscardPolicy.NEW,
            allow_rollup_hdrs=True,
            allow_direct=True,
            allow_msg_ttl=True,
            num_replicas=layout.replicas,
        ),
    ]


# A held count older than this is from a gateway replica that is gone (queue/signals.py).
HELD_TTL_SECONDS = 30.0


def signals_config() -> js_api.StreamConfig:
    """The ``LLMEP_SIGNALS`` bucket as nats-py's create_key_value makes it (history 1, TTL),
    in memory: a count is worth nothing after a restart, and expires within seconds anyway."""
    return js_api.StreamConfig(
        name=names.kv_stream(names.SIGNALS_BUCKET),
        description="LLM Endpoints scaling signals (held requests per gateway)",
        subjects=[f"$KV.{names.SIGNALS_BUCKET}.>"],
        max_msgs_per_subject=1,
        max_age=HELD_TTL_SECONDS,
        discard=js_api.DiscardPolicy.NEW,
        allow_rollup_hdrs=True,
        deny_delete=True,
        allow_direct=True,
        storage=js_api.StorageType.MEMORY,
        num_replicas=1,
    )


class NotCreatedYet(Exception):
    """A stream or consumer this credential may not create does not exist yet."""


async def ensure_streams(
    js: JetStreamContext, layout: QueueLayout, *, reconcile: bool = False
) -> None:
    """Create the streams that do not exist (the operator's credential, or a password user).
    ``reconcile`` (the operator): also set the jobs stream's per-subject limit (the per-owner
    cap) on an existing stream when it differs; nothing else of an existing stream changes."""
    for config in stream_configs(layout):
        try:
            info = await js.stream_info(config.name)
        except NotFoundError:
            info = None
        if info is not None:
            if (
                reconcile
                and config.name == names.JOBS_STREAM
                and info.config.max_msgs_per_subject != config.max_msgs_per_subject
            ):
                await js.update_stream(
                    replace(info.config, max_msgs_per_subject=config.max_msgs_per_subject)
                )
            continue
        try:
            await js.add_stream(config)
        except BadRequestError as exc:
            if exc.err_code != _STREAM_NAME_IN_USE:
                raise


def consumer_config(
    endpoint: EndpointRef | str, priority: str, layout: QueueLayout
) -> js_api.ConsumerConfig:
    durable = names.jobs_consumer(endpoint, priority)
    return js_api.ConsumerConfig(
        # Two filters (every owner's subject, and the form without an owner token), so it is
        # created through $JS.API.CONSUMER.CREATE.<stream>.<name>: the operator's to make.
        name=durable,
        durable_name=durable,
        filter_subjects=names.jobs_consumer_filters(endpoint, priority),
        deliver_policy=js_api.DeliverPolicy.ALL,
        ack_policy=js_api.AckPolicy.EXPLICIT,
        ack_wait=layout.heartbeat_timeout_seconds,
        # Unbounded here: attempts are counted in the job's record, so the last one ends the
        # job FAILED with a message instead of a message silently parked by the server.
        max_deliver=-1,
        num_replicas=layout.replicas,
    )


async def ensure_consumers(
    js: JetStreamContext,
    endpoint: EndpointRef | str,
    layout: QueueLayout,
    *,
    create: bool = True,
    priorities: tuple[str, ...] = names.PRIORITIES,
) -> float:
    """Make sure the endpoint's worker consumers (of ``priorities``) exist; returns their ack
    wait (the heartbeat timeout whoever created them chose). ``create=False`` (a runtime pod's
    credential): raise NotCreatedYet instead of creating a missing one."""
    ack_wait = layout.heartbeat_timeout_seconds
    for priority in priorities:
        durable = names.jobs_consumer(endpoint, priority)
        try:
            info = await js.consumer_info(names.JOBS_STREAM, durable)
            ack_wait = min(ack_wait, info.config.ack_wait or ack_wait)
            wanted = names.jobs_consumer_filters(endpoint, priority)
            if create and sorted(info.config.filter_subjects or []) != sorted(wanted):
                # A consumer made before jobs carried their owner (filtered on the subject
                # without it): it takes both forms from now on; its queued jobs stay queued.
                await js.add_consumer(
                    names.JOBS_STREAM,
                    replace(info.config, filter_subject=None, filter_subjects=wanted),
                )
            continue
        except NotFoundError:
            if not create:
                raise NotCreatedYet(
                    f"the worker consumer {durable} of stream {names.JOBS_STREAM} does not "
                    "exist yet (the llmendpoints operator creates it)"
                ) from None
        try:
            await js.add_consumer(names.JOBS_STREAM, consumer_config(endpoint, priority, layout))
        except BadRequestError as exc:
            if exc.err_code != _CONSUMER_EXISTS:
                raise
    return ack_wait
