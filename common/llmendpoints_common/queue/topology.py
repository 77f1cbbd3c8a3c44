"""Creating the queue's streams, buckets and consumers (idempotent), every one bounded.

Who creates them: with per-role credentials (the chart's NATS), the llmendpoints operator, at
start-up (the shared streams) and for each endpoint it reconciles (the endpoint's own two
streams and its consumers); a runtime pod's credential may not create anything, so its worker
waits until they exist. With a password in the URL (a NATS you bring, local runs), every
process that uses the queue creates what is missing, as before.

Bounded by construction: every stream has ``max_bytes`` (the chart's account JWT requires it,
``natsjwt.AccountLimits.max_bytes_required``), and JetStream reserves a stream's ``max_bytes``
on its servers when the stream is created, refusing a stream that does not fit -- so the
streams' bounds add up to at most the servers' storage, and no stream can grow into another's
share. What a pod writes goes to its own endpoint's two streams only (queue/names.py):

- ``LLMEP_QUEUE_<ns>_<name>``: the endpoint's jobs, work-queue retention (a message is removed
  when a worker acknowledges it, once the job ended), file storage; at most
  ``per_subject_limit`` messages per priority and owner (``max_queued_per_owner``), further
  submissions refused at once (discard-new per subject -> 429), never dropped later; messages
  of at most ``JOB_MESSAGE_MAX_BYTES`` (a job id), ``endpoint_queue_max_bytes`` in all.
- ``LLMEP_RECORDS_<ns>_<name>``: the endpoint's job records, idempotency keys, stream chunks
  and admissions, one value per subject, per-message TTL (a record expires after its
  retention, or at its ``policy.ttl``), direct gets, ``endpoint_max_bytes`` in all. Full, it
  refuses new keys (a new job: 503 naming the bound) while existing ones may still be
  rewritten no larger (a running job still ends); ``records_max_age`` is the backstop for a
  write that carried no TTL.

A pod that fills its own endpoint's streams gets the errors; every other endpoint's streams,
and the shared ones below (which only the gateway writes), keep their room:

- ``KV_LLMEP_QUOTAS``: the gateway's per-key limiter state (one value per key name, per-message
  TTL: an idle key's state goes away on its own).
- ``LLMEP_USAGE``: usage records for chargeback, kept ``usage_max_age`` or until
  ``usage_max_bytes`` (the oldest go first, as with the age), de-duplicated by request id over
  ``usage_duplicate_window``.
- ``KV_LLMEP_SIGNALS``: held-request counts, in memory, each expiring ``HELD_TTL_SECONDS``
  after its last write (queue/signals.py).
- ``KV_LLMEP_BATCHES``: file and batch records (per-message TTL: each goes with what it
  describes).
- ``OBJ_LLMEP_FILES``: the object store of files' contents and batches' inputs (queue/objects.py),
  per-message TTL, at most ``files_max_bytes`` (new uploads get 507 beyond), nothing older than
  ``files_max_age`` (a backstop: every object expires by its own TTL first).

Existing streams keep their configuration but for their bounds: ``reconcile=True`` (the
operator) sets ``max_bytes`` and the message size limit of every stream, and the per-owner cap
of each endpoint's queue, to this layout's, so an installation made before a bound existed
gets it on upgrade.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

from nats.js import JetStreamContext
from nats.js import api as js_api
from nats.js.errors import BadRequestError, NotFoundError

from llmendpoints_common.identity import EndpointRef, as_ref
from llmendpoints_common.queue import names, objects

log = logging.getLogger(__name__)

# JetStream's error code for "stream name already in use" (two processes created it at once).
_STREAM_NAME_IN_USE = 10058
_CONSUMER_EXISTS = 10148
MiB = 1024 * 1024
# A job's message in its endpoint's queue is its id (at most 128 characters), the subject
# and a de-duplication header: 1 KiB holds it with room to spare.
JOB_MESSAGE_MAX_BYTES = 1024
# The gateway's usage consumer: a record write unacknowledged this long (its gateway replica
# died) goes to another replica; at most this many in flight.
USAGE_ACK_WAIT_SECONDS = 30.0
USAGE_MAX_ACK_PENDING = 1000


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
    # Each endpoint's records stream (job records, chunks, idempotency keys, admissions) and
    # its jobs stream: bytes reserved for it alone on every server.
    endpoint_max_bytes: int = 128 * MiB
    endpoint_queue_max_bytes: int = 8 * MiB
    # The backstop on a record's life (a record written without a TTL): a RunPod batch's
    # requests are kept 30 days past its window, nothing longer.
    records_max_age_seconds: float = 40 * 24 * 3600.0
    # How long usage records are kept for export (about 13 months: a year of chargeback), and
    # the bytes they may take (the oldest go first beyond).
    usage_max_age_seconds: float = 400 * 24 * 3600.0
    usage_max_bytes: int = 1024 * MiB
    # A usage record published again with the same request id within this window is dropped.
    usage_duplicate_window_seconds: float = 600.0
    # The gateway's limiter state, batch records and (in memory) scaling signals.
    quotas_max_bytes: int = 64 * MiB
    batches_max_bytes: int = 256 * MiB
    signals_max_bytes: int = 16 * MiB
    # The object store of batch files: its bound in bytes, and the age past which nothing is
    # kept (files live 30 days at most, plus a day of slack).
    files_max_bytes: int = 1024 * MiB
    files_max_age_seconds: float = 31 * 24 * 3600.0


def _kv_stream(bucket: str, replicas: int, max_bytes: int) -> js_api.StreamConfig:
    # The layout nats-py and the nats CLI expect of a key-value bucket, plus per-message TTL.
    return js_api.StreamConfig(
        name=names.kv_stream(bucket),
        subjects=[f"$KV.{bucket}.>"],
        max_msgs_per_subject=1,
        max_bytes=max_bytes,
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
    """The shared streams (no endpoint's jobs: those are ``endpoint_stream_configs``)."""
    return [
        _kv_stream(names.QUOTAS_BUCKET, layout.replicas, layout.quotas_max_bytes),
        js_api.StreamConfig(
            name=names.USAGE_STREAM,
            subjects=["llmep.usage.>"],
            storage=js_api.StorageType.FILE,
            max_age=layout.usage_max_age_seconds,
            max_bytes=layout.usage_max_bytes,
            discard=js_api.DiscardPolicy.OLD,
            duplicate_window=layout.usage_duplicate_window_seconds,
            num_replicas=layout.replicas,
        ),
        signals_config(layout.signals_max_bytes),
        _kv_stream(names.BATCHES_BUCKET, layout.replicas, layout.batches_max_bytes),
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


def endpoint_stream_configs(
    endpoint: EndpointRef | str, layout: QueueLayout
) -> list[js_api.StreamConfig]:
    """The endpoint's own two streams: its jobs, and its records (names.py)."""
    ref = as_ref(endpoint)
    return [
        js_api.StreamConfig(
            name=names.queue_stream(ref),
            description=f"LLM Endpoints jobs of {ref.id}",
            subjects=names.queue_subjects(ref),
            retention=js_api.RetentionPolicy.WORK_QUEUE,
            storage=js_api.StorageType.FILE,
            max_msgs_per_subject=per_subject_limit(layout),
            max_bytes=layout.endpoint_queue_max_bytes,
            max_msg_size=JOB_MESSAGE_MAX_BYTES,
            max_age=layout.records_max_age_seconds,
            discard=js_api.DiscardPolicy.NEW,
            discard_new_per_subject=True,
            duplicate_window=120.0,
            num_replicas=layout.replicas,
        ),
        js_api.StreamConfig(
            name=names.records_stream(ref),
            description=f"LLM Endpoints job records of {ref.id}",
            subjects=names.records_subjects(ref),
            storage=js_api.StorageType.FILE,
            max_msgs_per_subject=1,
            max_bytes=layout.endpoint_max_bytes,
            max_age=layout.records_max_age_seconds,
            discard=js_api.DiscardPolicy.NEW,
            allow_rollup_hdrs=True,
            deny_delete=True,
            allow_direct=True,
            allow_msg_ttl=True,
            # A chunk published twice (a retry after a lost acknowledgement) is stored once.
            duplicate_window=120.0,
            num_replicas=layout.replicas,
        ),
    ]


# A held count older than this is from a gateway replica that is gone (queue/signals.py).
HELD_TTL_SECONDS = 30.0


def signals_config(max_bytes: int = QueueLayout.signals_max_bytes) -> js_api.StreamConfig:
    """The ``LLMEP_SIGNALS`` bucket as nats-py's create_key_value makes it (history 1, TTL),
    in memory: a count is worth nothing after a restart, and expires within seconds anyway."""
    return js_api.StreamConfig(
        name=names.kv_stream(names.SIGNALS_BUCKET),
        description="LLM Endpoints scaling signals (held requests per gateway)",
        subjects=[f"$KV.{names.SIGNALS_BUCKET}.>"],
        max_msgs_per_subject=1,
        max_age=HELD_TTL_SECONDS,
        max_bytes=max_bytes,
        discard=js_api.DiscardPolicy.NEW,
        allow_rollup_hdrs=True,
        deny_delete=True,
        allow_direct=True,
        storage=js_api.StorageType.MEMORY,
        num_replicas=1,
    )


class NotCreatedYet(Exception):
    """A stream or consumer this credential may not create does not exist yet."""


# What ``reconcile`` sets on a stream that exists: its bounds, nothing else.
_BOUNDS = ("max_bytes", "max_msg_size", "max_msgs_per_subject")


def bounds_drift(current: js_api.StreamConfig, wanted: js_api.StreamConfig) -> dict[str, Any]:
    """PURE: the bounds of ``wanted`` that ``current`` does not have (field -> wanted value)."""
    drift = {}
    for field in _BOUNDS:
        want = getattr(wanted, field)
        if want is not None and getattr(current, field) != want:
            drift[field] = want
    return drift


async def _ensure_stream(
    js: JetStreamContext, config: js_api.StreamConfig, *, reconcile: bool
) -> None:
    try:
        info = await js.stream_info(config.name)
    except NotFoundError:
        info = None
    if info is None:
        try:
            await js.add_stream(config)
        except BadRequestError as exc:
            if exc.err_code != _STREAM_NAME_IN_USE:
                raise
        return
    drift = bounds_drift(info.config, config) if reconcile else {}
    if drift:
        log.info("queue stream %s: setting %s", config.name, drift)
        await js.update_stream(replace(info.config, **drift))


async def ensure_streams(
    js: JetStreamContext, layout: QueueLayout, *, reconcile: bool = False
) -> None:
    """Create the shared streams that do not exist (the operator's credential, or a password
    user). ``reconcile`` (the operator): also set their bounds on existing ones."""
    for config in stream_configs(layout):
        await _ensure_stream(js, config, reconcile=reconcile)


async def ensure_endpoint_streams(
    js: JetStreamContext, endpoint: EndpointRef | str, layout: QueueLayout, *, reconcile: bool
) -> None:
    for config in endpoint_stream_configs(endpoint, layout):
        await _ensure_stream(js, config, reconcile=reconcile)


async def delete_endpoint_streams(js: JetStreamContext, endpoint: EndpointRef | str) -> bool:
    """Remove an endpoint's two streams (the endpoint was deleted: its jobs go with it, and its
    storage reservation is freed). True when there was something to remove."""
    removed = False
    for stream in (names.queue_stream(endpoint), names.records_stream(endpoint)):
        try:
            await js.delete_stream(stream)
            removed = True
        except NotFoundError:
            pass
    return removed


def consumer_config(
    endpoint: EndpointRef | str, priority: str, layout: QueueLayout
) -> js_api.ConsumerConfig:
    durable = names.jobs_consumer(endpoint, priority)
    return js_api.ConsumerConfig(
        name=durable,
        durable_name=durable,
        filter_subject=names.jobs_consumer_filter(endpoint, priority),
        deliver_policy=js_api.DeliverPolicy.ALL,
        ack_policy=js_api.AckPolicy.EXPLICIT,
        ack_wait=layout.heartbeat_timeout_seconds,
        # Unbounded here: attempts are counted in the job's record, so the last one ends the
        # job FAILED with a message instead of a message silently parked by the server.
        max_deliver=-1,
        num_replicas=layout.replicas,
    )


def usage_consumer_config(endpoint: EndpointRef | str, replicas: int = 0) -> js_api.ConsumerConfig:
    """The gateway's usage meter on the endpoint's records: every record write from the first
    (created with the stream, so nothing is missed before a gateway starts), acknowledged one
    by one, shared by every gateway replica (each write is handled by one). ``replicas`` 0:
    as many as its stream."""
    return js_api.ConsumerConfig(
        name=names.USAGE_CONSUMER,
        durable_name=names.USAGE_CONSUMER,
        description="LLM Endpoints gateway usage meter",
        filter_subject=names.records_filter(endpoint),
        deliver_policy=js_api.DeliverPolicy.ALL,
        ack_policy=js_api.AckPolicy.EXPLICIT,
        ack_wait=USAGE_ACK_WAIT_SECONDS,
        max_ack_pending=USAGE_MAX_ACK_PENDING,
        max_deliver=-1,
        num_replicas=replicas,
    )


# Fields of the usage consumer that decide what the meter is given; the first group cannot be
# changed on an existing consumer (it is made again), the second can.
_FIXED = ("deliver_policy", "ack_policy", "deliver_subject", "deliver_group", "headers_only")
_UPDATABLE = (
    "filter_subject",
    "filter_subjects",
    "ack_wait",
    "max_ack_pending",
    "max_deliver",
    "inactive_threshold",
    "rate_limit_bps",
    "backoff",
)


def consumer_drift(
    current: js_api.ConsumerConfig, wanted: js_api.ConsumerConfig
) -> tuple[list[str], list[str]]:
    """PURE: (fields that differ and cannot be updated, fields that differ and can)."""

    def value(config: js_api.ConsumerConfig, field: str) -> Any:
        got = getattr(config, field)
        if field == "filter_subjects":
            return sorted(got or [])
        if field in ("max_deliver", "inactive_threshold", "rate_limit_bps") and got in (0, -1):
            return None  # the server's "none" either way
        return got or None

    fixed = [f for f in _FIXED if value(current, f) != value(wanted, f)]
    updatable = [f for f in _UPDATABLE if value(current, f) != value(wanted, f)]
    return fixed, updatable


async def ensure_usage_consumer(
    js: JetStreamContext, endpoint: EndpointRef | str, replicas: int = 0
) -> str | None:
    """The usage meter's consumer on the endpoint's records, as ``usage_consumer_config``
    says: created when missing, repaired when someone changed it. Returns what was repaired
    (None: nothing; the caller logs it)."""
    stream = names.records_stream(endpoint)
    wanted = usage_consumer_config(endpoint, replicas)
    try:
        info = await js.consumer_info(stream, names.USAGE_CONSUMER)
    except NotFoundError:
        await _add_consumer(js, stream, wanted)
        return None
    fixed, updatable = consumer_drift(info.config, wanted)
    wanted = replace(wanted, num_replicas=info.config.num_replicas)  # what it was made with
    if fixed:
        # Not updatable in place: made again. Records written up to now are delivered again;
        # the meter bills no write older than BILLED_WRITES_WITHIN_SECONDS, and the usage
        # stream drops a record it stored within its duplicate window.
        await js.delete_consumer(stream, names.USAGE_CONSUMER)
        await _add_consumer(js, stream, wanted)
        return f"made again ({', '.join(fixed + updatable)} differed)"
    if updatable:
        await js.add_consumer(stream, wanted)
        return f"updated ({', '.join(updatable)} differed)"
    return None


async def _add_consumer(js: JetStreamContext, stream: str, config: js_api.ConsumerConfig) -> None:
    try:
        await js.add_consumer(stream, config)
    except BadRequestError as exc:
        if exc.err_code != _CONSUMER_EXISTS:
            raise


async def ensure_endpoint_queue(
    js: JetStreamContext,
    endpoint: EndpointRef | str,
    layout: QueueLayout,
    *,
    create: bool = True,
    reconcile: bool = False,
    priorities: tuple[str, ...] = names.PRIORITIES,
) -> float:
    """Make sure the endpoint's streams and its worker consumers (of ``priorities``) exist,
    and (``create``) the gateway's usage consumer; returns the workers' ack wait (the heartbeat
    timeout whoever created them chose). ``create=False`` (a runtime pod's credential): raise
    NotCreatedYet instead of creating what is missing. ``reconcile`` (the operator): set the
    streams' bounds and the per-owner cap on existing ones."""
    ref = as_ref(endpoint)
    if create:
        await ensure_endpoint_streams(js, ref, layout, reconcile=reconcile)
        repaired = await ensure_usage_consumer(js, ref, layout.replicas)
        if repaired:
            log.warning("the usage meter's consumer of %s was %s", ref.id, repaired)
    ack_wait = layout.heartbeat_timeout_seconds
    stream = names.queue_stream(ref)
    for priority in priorities:
        durable = names.jobs_consumer(ref, priority)
        try:
            info = await js.consumer_info(stream, durable)
            ack_wait = min(ack_wait, info.config.ack_wait or ack_wait)
            continue
        except NotFoundError:
            if not create:
                raise NotCreatedYet(
                    f"the worker consumer {durable} of stream {stream} does not exist yet "
                    "(the llmendpoints operator creates it with the endpoint)"
                ) from None
        await _add_consumer(js, stream, consumer_config(ref, priority, layout))
    return ack_wait
