"""Names in NATS that the runtime, the gateway and the operator share. Keep them stable: a
rolling upgrade runs old and new pods against the same streams (this layout is the second: see
``LEGACY_STREAMS`` and docs/install.md's upgrade table).

An endpoint is its namespace and its name (``identity.EndpointRef``); both are subject tokens,
the namespace before the name, so every name below reaches one endpoint only and a NATS
permission for one endpoint is ``llmep.ep.<namespace>.<name>.>`` (queue/roles.py).

Each endpoint has a queue of its own -- two streams, created by the operator with the endpoint
and bounded in bytes (queue/topology.py) -- so what one endpoint's pods write can fill that
endpoint's storage and nobody else's, and every JetStream request a pod makes names its own
endpoint in the request's subject (the stream's name), which its credential is scoped to:

- stream ``LLMEP_QUEUE_<ns>_<name>`` (work-queue retention): subjects
  ``llmep.ep.<ns>.<name>.jobs.<priority>.<owner token>``, ``priority`` is ``normal``, ``low``
  (RunPod's ``policy.lowPriority``) or ``batch`` (a batch's requests: the lowest lane), the
  owner token the submitting key's name as ``tenant_token``. One message per queued attempt.
  The stream's per-subject limit is the per-owner cap on queued jobs, enforced by JetStream
  itself (discard-new per subject), across every gateway replica and pod; a key's batch
  requests (their own subject) are capped apart from its jobs. Workers pull through the
  durable consumers ``workers-<ns>_<name>-<priority>`` (a namespace never holds ``_``, so the
  first ``_`` ends it).
- stream ``LLMEP_RECORDS_<ns>_<name>`` (one message per subject, compare-and-set writes,
  per-message TTL, direct gets), subjects under ``llmep.ep.<ns>.<name>``:
  - ``rec.<job id>``: the job's record (status, owner, times, output or error);
  - ``idem.<hash of owner and Idempotency-Key>``: the job id the first ``/run`` got (expires
    after the idempotency window);
  - ``chunk.<job id>.<attempt>.<n>``: the n-th stream chunk (from 1) of the job's attempt, one
    subject per chunk, read by name (a direct get);
  - ``adm.gw.<job id>``: the job's admission as the gateway accepted it (owner, bounds on what
    it may be billed); the endpoint's pods may read it and never write it;
  - ``adm.ep.<job id>``: the admission of a job accepted at one of the endpoint's own pods.
  The gateway reads the records through its durable consumer ``llmep-gateway-usage`` on each
  endpoint's records stream (its usage meter): a name no pod permission matches.
- subject ``llmep.ep.<ns>.<name>.cancel.<job id>`` (core NATS): a cancel reaches the worker
  running it.
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

import hashlib
import re

from llmendpoints_common.identity import EndpointRef, as_ref

SIGNALS_BUCKET = "LLMEP_SIGNALS"
QUOTAS_BUCKET = "LLMEP_QUOTAS"
USAGE_STREAM = "LLMEP_USAGE"
BATCHES_BUCKET = "LLMEP_BATCHES"

# The first layout's shared streams, every endpoint's jobs in one set: no longer written.
# An installation upgraded from it keeps them until an admin deletes them (docs/install.md).
LEGACY_STREAMS = (
    "LLMEP_JOBS",
    "KV_LLMEP_JOB_STATE",
    "KV_LLMEP_JOB_IDEMPOTENCY",
    "LLMEP_JOB_CHUNKS",
)

# Lanes of an endpoint's queue, highest first: a worker takes from a lane only when the ones
# above are empty (and a batch request only with capacity to spare).
PRIORITIES = ("normal", "low", "batch")
BATCH_PRIORITY = "batch"

QUEUE_STREAM_PREFIX = "LLMEP_QUEUE_"
RECORDS_STREAM_PREFIX = "LLMEP_RECORDS_"
# The gateway's usage meter's durable consumer on each endpoint's records stream.
USAGE_CONSUMER = "llmep-gateway-usage"
# Who accepted a job: its admission's subject (``adm.<by>.<job id>``).
ADMITTED_BY_GATEWAY = "gw"
ADMITTED_BY_ENDPOINT = "ep"

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


def _stream_token(endpoint: EndpointRef | str) -> str:
    """``<ns>_<name>``: the endpoint in a stream or consumer name (a namespace holds no ``_``,
    so the first one ends it: one to one)."""
    ref = as_ref(endpoint)
    return f"{ref.namespace}_{name_token(ref)}"


def _checked_name(endpoint: EndpointRef | str, name: str) -> str:
    if len(name) > _MAX_NAME:
        raise ValueError(
            f"endpoint {as_ref(endpoint).id!r}: namespace and name together are too long for a "
            f"JetStream stream or consumer name ({len(name)} > {_MAX_NAME} characters)"
        )
    return name


def check_job_id(job_id: str) -> str:
    if not _JOB_ID.fullmatch(job_id):
        raise ValueError(f"job id {job_id!r}: letters, digits and '-' only, at most 128")
    return job_id


def _check_priority(priority: str) -> str:
    if priority not in PRIORITIES:
        raise ValueError(f"priority must be one of {PRIORITIES}, got {priority!r}")
    return priority


# ---- an endpoint's own queue: two streams, every subject under llmep.ep.<ns>.<name> --------


def endpoint_prefix(endpoint: EndpointRef | str) -> str:
    """``llmep.ep.<ns>.<name>``: every subject of the endpoint's queue is under it."""
    return f"llmep.ep.{tokens(endpoint)}"


def queue_stream(endpoint: EndpointRef | str) -> str:
    """The endpoint's jobs (work-queue retention): ``LLMEP_QUEUE_<ns>_<name>``."""
    return _checked_name(endpoint, f"{QUEUE_STREAM_PREFIX}{_stream_token(endpoint)}")


def records_stream(endpoint: EndpointRef | str) -> str:
    """The endpoint's records, idempotency keys, chunks and admissions."""
    return _checked_name(endpoint, f"{RECORDS_STREAM_PREFIX}{_stream_token(endpoint)}")


def endpoint_of_stream(stream: str) -> EndpointRef:
    """The endpoint a queue or records stream is (inverse of ``queue_stream``/``records_stream``)."""
    for prefix in (QUEUE_STREAM_PREFIX, RECORDS_STREAM_PREFIX):
        if stream.startswith(prefix):
            namespace, sep, name = stream[len(prefix) :].partition("_")
            if sep and namespace and name:
                return EndpointRef(namespace, name.replace("_", "."))
    raise ValueError(f"{stream!r} is not an endpoint's queue or records stream")


def queue_subjects(endpoint: EndpointRef | str) -> list[str]:
    return [f"{endpoint_prefix(endpoint)}.jobs.*.*"]


def records_subjects(endpoint: EndpointRef | str) -> list[str]:
    prefix = endpoint_prefix(endpoint)
    return [f"{prefix}.rec.*", f"{prefix}.idem.*", f"{prefix}.chunk.*.*.*", f"{prefix}.adm.*.*"]


def jobs_subject(endpoint: EndpointRef | str, priority: str, owner: str) -> str:
    """Where a job is queued: per owner (the API key's name; "" without keys), so the
    stream's per-subject limit caps each owner's queued jobs."""
    return f"{endpoint_prefix(endpoint)}.jobs.{_check_priority(priority)}.{tenant_token(owner)}"


def jobs_consumer_filter(endpoint: EndpointRef | str, priority: str) -> str:
    """What an endpoint's worker consumer for ``priority`` takes: every owner's jobs."""
    return f"{endpoint_prefix(endpoint)}.jobs.{_check_priority(priority)}.*"


def priority_of_jobs_subject(subject: str) -> str:
    """``llmep.ep.<ns>.<name>.jobs.<priority>.<owner>`` -> the priority."""
    parts = subject.split(".")
    if len(parts) != 7 or parts[:2] != ["llmep", "ep"] or parts[4] != "jobs":
        raise ValueError(f"{subject!r} is not a jobs subject")
    return _check_priority(parts[5])


def jobs_consumer(endpoint: EndpointRef | str, priority: str = "normal") -> str:
    return _checked_name(endpoint, f"workers-{_stream_token(endpoint)}-{_check_priority(priority)}")


def jobs_filter(endpoint: EndpointRef | str) -> str:
    """Every priority and owner of one endpoint's queue."""
    return f"{endpoint_prefix(endpoint)}.jobs.>"


def record_subject(endpoint: EndpointRef | str, job_id: str) -> str:
    """Where the job's record is written (each write replaces the last: one per subject)."""
    return f"{endpoint_prefix(endpoint)}.rec.{check_job_id(job_id)}"


def records_filter(endpoint: EndpointRef | str) -> str:
    """Every job record of the endpoint (what the usage meter and waiters follow)."""
    return f"{endpoint_prefix(endpoint)}.rec.*"


def job_of_record_subject(endpoint: EndpointRef | str, subject: str) -> str | None:
    """The job id a record subject of ``endpoint`` names (None: not one of its records)."""
    prefix = f"{endpoint_prefix(endpoint)}.rec."
    if not subject.startswith(prefix):
        return None
    job_id = subject[len(prefix) :]
    return job_id if _JOB_ID.fullmatch(job_id) else None


def admission_subject(endpoint: EndpointRef | str, job_id: str, by: str) -> str:
    """Where a job's admission is: ``by`` is ``ADMITTED_BY_GATEWAY`` (pods may not write it)
    or ``ADMITTED_BY_ENDPOINT`` (a job accepted at one of the endpoint's pods)."""
    if by not in (ADMITTED_BY_GATEWAY, ADMITTED_BY_ENDPOINT):
        raise ValueError(f"admitted by must be {ADMITTED_BY_GATEWAY!r} or {ADMITTED_BY_ENDPOINT!r}")
    return f"{endpoint_prefix(endpoint)}.adm.{by}.{check_job_id(job_id)}"


def chunk_subject(endpoint: EndpointRef | str, job_id: str, attempt: int, index: int) -> str:
    """The ``index``-th chunk (from 1) of attempt ``attempt`` of the job's stream output."""
    if attempt < 0 or index < 1:
        raise ValueError(f"chunk {index} of attempt {attempt}: attempt >= 0 and index >= 1")
    return f"{endpoint_prefix(endpoint)}.chunk.{check_job_id(job_id)}.{attempt}.{index}"


def cancel_subject(endpoint: EndpointRef | str, job_id: str = "*") -> str:
    job = job_id if job_id == "*" else check_job_id(job_id)
    return f"{endpoint_prefix(endpoint)}.cancel.{job}"


def idempotency_subject(endpoint: EndpointRef | str, digest: str) -> str:
    if not re.fullmatch(r"[0-9a-f]{16,64}", digest):
        raise ValueError("idempotency digest must be 16-64 lowercase hex digits")
    return f"{endpoint_prefix(endpoint)}.idem.{digest}"


# ---- shared: signals, quotas, usage, batches ------------------------------------------------


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


def tenant_token(name: str) -> str:
    """An API key's name (any text) as one key segment / subject token: a digest of it, so
    names with dots, spaces or wildcards map one to one onto safe tokens."""
    return hashlib.sha256(name.encode("utf-8", "surrogateescape")).hexdigest()[:24]


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
