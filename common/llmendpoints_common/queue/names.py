"""Names in NATS that the runtime, the gateway and the operator share. Keep them stable: a
rolling upgrade runs old and new pods against the same streams.

Layout (one set for all endpoints; the endpoint is a subject token):

- stream ``LLMEP_JOBS`` (work-queue retention): subjects ``llmep.jobs.<endpoint>.<priority>``,
  ``priority`` is ``normal`` or ``low`` (RunPod's ``policy.lowPriority``). One message per
  queued attempt. Workers pull through the durable consumers ``workers-<endpoint>-<priority>``.
- key-value bucket ``LLMEP_JOB_STATE``: key ``<endpoint>.<job id>`` -> the job's record (status,
  owner, times, output or error).
- stream ``LLMEP_JOB_CHUNKS``: subjects ``llmep.chunks.<endpoint>.<job id>``, the job's stream
  output in order.
- subject ``llmep.cancel.<endpoint>.<job id>`` (core NATS): a cancel reaches the worker running it.
- key-value bucket ``LLMEP_JOB_IDEMPOTENCY`` (entries expire after the idempotency window): key
  ``<endpoint>.<hash of owner and Idempotency-Key>`` -> the job id the first ``/run`` got.
- key-value bucket ``LLMEP_SIGNALS`` (entries expire): key ``held.<endpoint>.<gateway id>`` ->
  requests that gateway holds for the endpoint; subject ``llmep.nudge.<endpoint>`` (core NATS):
  "work arrived for an endpoint with no ready replica", so the autoscaler need not wait a tick.
- key-value bucket ``LLMEP_QUOTAS`` (entries expire when idle): key ``<tenant token>`` -> one
  API key name's (tenant's) limiter state: the current minute window's request and token counts
  and its concurrency leases, changed only by compare-and-set (the gateway's limiter).
- stream ``LLMEP_USAGE`` (limits retention, kept ``usage_max_age``): subjects
  ``llmep.usage.<endpoint>.<tenant token>``, one usage record per request or job served
  (key name, endpoint, model, prompt and completion tokens), de-duplicated by request id.

Endpoint ids are Kubernetes object names (lowercase alphanumerics, ``-`` and ``.``); ``.``
separates subject tokens, so it is written ``_`` (which Kubernetes names never contain: the
mapping is one to one).
"""

from __future__ import annotations

import hashlib
import re

JOBS_STREAM = "LLMEP_JOBS"
JOB_STATE_BUCKET = "LLMEP_JOB_STATE"
CHUNKS_STREAM = "LLMEP_JOB_CHUNKS"
SIGNALS_BUCKET = "LLMEP_SIGNALS"
IDEMPOTENCY_BUCKET = "LLMEP_JOB_IDEMPOTENCY"
QUOTAS_BUCKET = "LLMEP_QUOTAS"
USAGE_STREAM = "LLMEP_USAGE"

PRIORITIES = ("normal", "low")

_ENDPOINT = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")
_JOB_ID = re.compile(r"[A-Za-z0-9-]{1,128}")


def token(endpoint: str) -> str:
    """The endpoint id as one subject token / key segment."""
    if not _ENDPOINT.fullmatch(endpoint):
        raise ValueError(
            f"endpoint id {endpoint!r} is not a Kubernetes object name "
            "(lowercase letters, digits, '-' and '.')"
        )
    return endpoint.replace(".", "_")


def check_job_id(job_id: str) -> str:
    if not _JOB_ID.fullmatch(job_id):
        raise ValueError(f"job id {job_id!r}: letters, digits and '-' only, at most 128")
    return job_id


def jobs_subject(endpoint: str, priority: str = "normal") -> str:
    if priority not in PRIORITIES:
        raise ValueError(f"priority must be one of {PRIORITIES}, got {priority!r}")
    return f"llmep.jobs.{token(endpoint)}.{priority}"


def jobs_consumer(endpoint: str, priority: str = "normal") -> str:
    if priority not in PRIORITIES:
        raise ValueError(f"priority must be one of {PRIORITIES}, got {priority!r}")
    return f"workers-{token(endpoint)}-{priority}"


def job_key(endpoint: str, job_id: str) -> str:
    return f"{token(endpoint)}.{check_job_id(job_id)}"


def chunks_subject(endpoint: str, job_id: str) -> str:
    return f"llmep.chunks.{token(endpoint)}.{check_job_id(job_id)}"


def cancel_subject(endpoint: str, job_id: str = "*") -> str:
    return f"llmep.cancel.{token(endpoint)}.{job_id if job_id == '*' else check_job_id(job_id)}"


def held_key(endpoint: str, gateway_id: str) -> str:
    return f"held.{token(endpoint)}.{gateway_id}"


def nudge_subject(endpoint: str = "*") -> str:
    return f"llmep.nudge.{endpoint if endpoint == '*' else token(endpoint)}"


def jobs_filter(endpoint: str) -> str:
    """Every priority of one endpoint's queue (``llmep.jobs.<endpoint>.*``)."""
    return f"llmep.jobs.{token(endpoint)}.*"


def kv_stream(bucket: str) -> str:
    """The stream behind a key-value bucket (NATS's own convention)."""
    return f"KV_{bucket}"


def kv_subject(bucket: str, key: str) -> str:
    """The subject a key's values are published on (NATS's own convention): a core
    subscription to it sees every update of the key, which is how waiters learn a job ended."""
    return f"$KV.{bucket}.{key}"


def idempotency_key(endpoint: str, digest: str) -> str:
    if not re.fullmatch(r"[0-9a-f]{16,64}", digest):
        raise ValueError("idempotency digest must be 16-64 lowercase hex digits")
    return f"{token(endpoint)}.{digest}"


def tenant_token(name: str) -> str:
    """An API key's name (any text) as one key segment / subject token: a digest of it, so
    names with dots, spaces or wildcards map one to one onto safe tokens."""
    return hashlib.sha256(name.encode("utf-8", "surrogateescape")).hexdigest()[:24]


def quota_key(name: str) -> str:
    return tenant_token(name)


def usage_subject(endpoint: str, key_name: str) -> str:
    return f"llmep.usage.{token(endpoint)}.{tenant_token(key_name)}"
