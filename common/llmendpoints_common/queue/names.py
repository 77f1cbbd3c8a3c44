"""Names in NATS that the runtime, the gateway and the operator share. Keep them stable: a
rolling upgrade runs old and new pods against the same streams.

An endpoint is its namespace and its name (``identity.EndpointRef``); both are subject tokens,
the namespace before the name, so every name below reaches one endpoint only and a NATS
permission for one endpoint is ``<prefix>.<namespace>.<name>.>`` (queue/roles.py).

Layout (one set for all endpoints):

- stream ``LLMEP_JOBS`` (work-queue retention): subjects
  ``llmep.jobs.<ns>.<name>.<priority>.<owner token>``, ``priority`` is ``normal``, ``low``
  (RunPod's ``policy.lowPriority``) or ``batch`` (a batch's requests: the lowest lane), the
  owner token the submitting key's name as ``tenant_token``. One message per queued attempt.
  The stream's per-subject limit is so the per-owner cap on queued jobs, enforced by JetStream
  itself (discard-new per subject), across every gateway replica and pod; a key's batch
  requests (their own subject) are capped apart from its jobs, and a batch's driver queues a
  window at a time (LLMEP_BATCH_WINDOW_LINES) and waits when the cap is reached. Subjects
  without the owner token (``llmep.jobs.<ns>.<name>.<priority>``) are what releases before the
  cap wrote, and what a pod whose credential predates it still writes: they are consumed
  alike. Workers pull through the durable consumers ``workers-<ns>_<name>-<priority>`` (a
  namespace never holds ``_``, so the first ``_`` ends it), filtered on both forms.
- key-value bucket ``LLMEP_JOB_STATE``: key ``<ns>.<name>.<job id>`` -> the job's record (status,
  owner, times, output or error).
- stream ``LLMEP_JOB_CHUNKS``: subjects ``llmep.chunks.<ns>.<name>.<job id>.<attempt>.<n>``, the
  n-th stream chunk (from 1) of the job's attempt: one subject per chunk, so a reader fetches it
  by name (a direct get whose subject is in the request's own subject, which a per-endpoint
  permission can scope) rather than by stream sequence (which no permission can).
- subject ``llmep.cancel.<ns>.<name>.<job id>`` (core NATS): a cancel reaches the worker running
  it.
- key-value bucket ``LLMEP_JOB_IDEMPOTENCY`` (entries expire after the idempotency window): key
  ``<ns>.<name>.<hash of owner and Idempotency-Key>`` -> the job id the first ``/run`` got.
- key-value bucket ``LLMEP_SIGNALS`` (entries expire): key ``held.<ns>.<name>.<gateway id>`` ->
  requests that gateway holds for the endpoint; subject ``llmep.nudge.<ns>.<name>`` (core NATS):
  "work arrived for an endpoint with no ready replica", so the autoscaler need not wait a tick.
- key-value bucket ``LLMEP_QUOTAS`` (entries expire when idle): key ``<tenant token>`` -> one
  API key name's (tenant's) limiter state: the current minute window's request and token counts
  and its concurrency leases, changed only by compare-and-set (the gateway's limiter).
- stream ``LLMEP_USAGE`` (limits retention, kept ``usage_max_age``): subjects
  ``llmep.usage.<ns>.<name>.<tenant token>``, one usage record per request or job served
  (key name, endpoint, model, prompt and completion tokens), de-duplicated by request id.
- key-value bucket ``LLMEP_BATCHES`` (entries expire with what they describe): keys
  ``file.<tenant token>.<file id>`` (a file's record), ``batch.<tenant token>.<batch id>``
  (a batch's record), ``active.<batch id>`` (the owner of a batch not ended: what the batch
  drivers list).
- object store ``LLMEP_FILES`` (stream ``OBJ_LLMEP_FILES``): files' contents, objects
  ``<tenant token>.<file id>``, and batches' stored inputs, ``<tenant token>.<batch id>.<part>``
  (queue/objects.py).
- ``LLMEP_SIGNALS`` also holds ``batch.<ns>.<name>.<batch id>``: a batch's remaining requests,
  deadline and rate, refreshed by its driver (the autoscaler sizes the endpoint for its window).

Names are Kubernetes object names (lowercase alphanumerics, ``-`` and ``.``); ``.`` separates
subject tokens, so it is written ``_`` (which Kubernetes names never contain: the mapping is one
to one). Namespaces have neither.
"""

from __future__ import annotations

import re

from llmendpoints_common.identity import EndpointRef, as_ref, tenant_token

JOBS_STREAM = "LLMEP_JOBS"
JOB_STATE_BUCKET = "LLMEP_JOB_STATE"
CHUNKS_STREAM = "LLMEP_JOB_CHUNKS"
SIGNALS_BUCKET = "LLMEP_SIGNALS"
IDEMPOTENCY_BUCKET = "LLMEP_JOB_IDEMPOTENCY"
QUOTAS_BUCKET = "LLMEP_QUOTAS"
USAGE_STREAM = "LLMEP_USAGE"
BATCHES_BUCKET = "LLMEP_BATCHES"

# Lanes of an endpoint's queue, highest first: a worker takes from a lane only when the ones
# above are empty (and a batch request only with capacity to spare).
PRIORITIES = ("normal", "low", "batch")
BATCH_PRIORITY = "batch"

# JetStream's limit on stream and consumer names.
_MAX_NAME = 255
_JOB_ID = re.compile(r"[A-Za-z0-9-]{1,128}")


def name_token(endpoint: EndpointRef | str) -> str:
    """The endpoint's name as one subject token."""
    return as_ref(endpoint).name.replace(".", "_")


def tokens(endpoint: EndpointRef | str) -> str:
    """``<ns>.<name>``: the endpoint as two subject tokens / key segments."""
    ref = as_ref(endpoint)
    return f"{ref.namespace}.{name_token(ref)}"


def check_job_id(job_id: str) -> str:
    if not _JOB_ID.fullmatch(job_id):
        raise ValueError(f"job id {job_id!r}: letters, digits and '-' only, at most 128")
    return job_id


def _check_priority(priority: str) -> str:
    if priority not in PRIORITIES:
        raise ValueError(f"priority must be one of {PRIORITIES}, got {priority!r}")
    return priority


def jobs_subject(
    endpoint: EndpointRef | str, priority: str = "normal", owner: str | None = None
) -> str:
    """Where a job is queued: per owner (the API key's name; "" without keys), so the
    stream's per-subject limit caps each owner's queued jobs. ``owner=None``: the form without
    the owner token (releases before the cap)."""
    subject = f"llmep.jobs.{tokens(endpoint)}.{_check_priority(priority)}"
    return subject if owner is None else f"{subject}.{tenant_token(owner)}"


def jobs_consumer_filters(endpoint: EndpointRef | str, priority: str) -> list[str]:
    """What an endpoint's worker consumer for ``priority`` takes: every owner's jobs, and jobs
    queued without an owner token (before the cap; pods with an older credential)."""
    subject = jobs_subject(endpoint, priority)
    return [subject, f"{subject}.*"]


def priority_of_jobs_subject(subject: str) -> str:
    """``llmep.jobs.<ns>.<name>.<priority>[.<owner>]`` -> the priority."""
    parts = subject.split(".")
    if len(parts) not in (5, 6) or parts[:2] != ["llmep", "jobs"]:
        raise ValueError(f"{subject!r} is not a jobs subject")
    return _check_priority(parts[4])


def jobs_consumer(endpoint: EndpointRef | str, priority: str = "normal") -> str:
    ref = as_ref(endpoint)
    durable = f"workers-{ref.namespace}_{name_token(ref)}-{_check_priority(priority)}"
    if len(durable) > _MAX_NAME:
        raise ValueError(
            f"endpoint {ref.id!r}: namespace and name together are too long for a JetStream "
            f"consumer name ({len(durable)} > {_MAX_NAME} characters)"
        )
    return durable


def jobs_filter(endpoint: EndpointRef | str) -> str:
    """Every priority and owner of one endpoint's queue (``llmep.jobs.<ns>.<name>.>``)."""
    return f"llmep.jobs.{tokens(endpoint)}.>"


def job_key(endpoint: EndpointRef | str, job_id: str) -> str:
    return f"{tokens(endpoint)}.{check_job_id(job_id)}"


def chunk_subject(endpoint: EndpointRef | str, job_id: str, attempt: int, index: int) -> str:
    """The ``index``-th chunk (from 1) of attempt ``attempt`` of the job's stream output."""
    if attempt < 0 or index < 1:
        raise ValueError(f"chunk {index} of attempt {attempt}: attempt >= 0 and index >= 1")
    return f"llmep.chunks.{tokens(endpoint)}.{check_job_id(job_id)}.{attempt}.{index}"


def chunks_filter(endpoint: EndpointRef | str, job_id: str) -> str:
    """Every chunk of every attempt of one job."""
    return f"llmep.chunks.{tokens(endpoint)}.{check_job_id(job_id)}.>"


def cancel_subject(endpoint: EndpointRef | str, job_id: str = "*") -> str:
    job = job_id if job_id == "*" else check_job_id(job_id)
    return f"llmep.cancel.{tokens(endpoint)}.{job}"


def held_key(endpoint: EndpointRef | str, gateway_id: str) -> str:
    return f"held.{tokens(endpoint)}.{gateway_id}"


def held_filter(endpoint: EndpointRef | str) -> str:
    """Every gateway's held count for one endpoint."""
    return f"held.{tokens(endpoint)}.*"


NUDGE_WILDCARD = "llmep.nudge.*.*"
# Gateway processes tell each other which prompt blocks they sent to which replica (prefix-aware
# routing), one subject per sending process: core NATS, nothing stored.
ROUTES_WILDCARD = "llmep.routes.*"


def routes_subject(process_token: str) -> str:
    """Where one gateway process publishes its routing records (a token: no dots)."""
    return f"llmep.routes.{process_token}"


def nudge_subject(endpoint: EndpointRef | str) -> str:
    return f"llmep.nudge.{tokens(endpoint)}"


def endpoint_of_nudge(subject: str) -> EndpointRef:
    """The endpoint a nudge subject names (inverse of ``nudge_subject``)."""
    parts = subject.split(".")
    if len(parts) != 4 or parts[:2] != ["llmep", "nudge"]:
        raise ValueError(f"{subject!r} is not a nudge subject")
    return EndpointRef(parts[2], parts[3].replace("_", "."))


def kv_stream(bucket: str) -> str:
    """The stream behind a key-value bucket (NATS's own convention)."""
    return f"KV_{bucket}"


def kv_subject(bucket: str, key: str) -> str:
    """The subject a key's values are published on (NATS's own convention): a core
    subscription to it sees every update of the key, which is how waiters learn a job ended."""
    return f"$KV.{bucket}.{key}"


def idempotency_key(endpoint: EndpointRef | str, digest: str) -> str:
    if not re.fullmatch(r"[0-9a-f]{16,64}", digest):
        raise ValueError("idempotency digest must be 16-64 lowercase hex digits")
    return f"{tokens(endpoint)}.{digest}"


def quota_key(name: str) -> str:
    return tenant_token(name)


def usage_subject(endpoint: EndpointRef | str, key_name: str) -> str:
    return f"llmep.usage.{tokens(endpoint)}.{tenant_token(key_name)}"


_BATCH_OR_FILE_ID = re.compile(r"(batch_|file-)[0-9a-f]{32}")


def check_batch_or_file_id(value: str) -> str:
    """Batch and file ids are ours (``batch_<hex>``, ``file-<hex>``); anything else a client
    sends names nothing (and never reaches a key or subject)."""
    if not _BATCH_OR_FILE_ID.fullmatch(value):
        raise ValueError(f"{value!r} is not a batch or file id")
    return value


def file_key(owner: str, file_id: str) -> str:
    return f"file.{tenant_token(owner)}.{check_batch_or_file_id(file_id)}"


def batch_key(owner: str, batch_id: str) -> str:
    return f"batch.{tenant_token(owner)}.{check_batch_or_file_id(batch_id)}"


def active_key(batch_id: str) -> str:
    return f"active.{check_batch_or_file_id(batch_id)}"


def batch_signal_key(endpoint: EndpointRef | str, batch_id: str) -> str:
    return f"batch.{tokens(endpoint)}.{check_batch_or_file_id(batch_id)}"


def batch_signal_filter(endpoint: EndpointRef | str) -> str:
    return f"batch.{tokens(endpoint)}.*"


def object_name(owner: str, *parts: str) -> str:
    """A content's name in the object store: the owner's token, then the ids."""
    return ".".join((tenant_token(owner), *parts))
