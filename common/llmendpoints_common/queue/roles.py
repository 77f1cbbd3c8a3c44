"""Who may do what on the queue's NATS: one allow-list per role (pure data).

A NATS user may publish and subscribe only to the subjects its JWT allows (queue/natsjwt.py);
JetStream's API is subjects too (``$JS.API.<verb>.<stream>[.<consumer>[.<filter>]]``), so an
allow-list says which streams, consumers and records a role reaches. Where a request names what
it touches only in its body (a stream-wide message get or delete by sequence, a purge), no
subject can scope it: those verbs go to the trusted roles alone, and the code a runtime pod runs
does without them (queue/client.py).

- ``runtime(ns/name)``: a runtime pod of one endpoint. Its own job subjects and records (by key,
  in the subject of a direct get), its own chunks, its own cancel subject, its own two worker
  consumers (pull, acknowledge, read their info: the queue depth), and its own reply inbox. No
  other endpoint, no quotas, no usage, no stream or consumer created, changed, purged or
  deleted. The operator creates the streams and the endpoint's consumers.
- ``gateway``: every endpoint's jobs (it accepts jobs for all of them), records, chunks and
  queue messages (a cancel takes a queued job's message out, so the depth drops at once), the
  quotas bucket, the usage stream, held-request signals and nudges, the routing records gateway
  processes share (``llmep.routes.*``, publish and subscribe); the batch records
  (``LLMEP_BATCHES``) and files (the object store ``LLMEP_FILES``, written and removed by
  subject: no purge), and the batch signals; the consumers it reads with (the job records'
  usage meter, the quotas follower, the usage export, the batch records' listings). No stream
  or bucket purged or deleted, no consumer of the job queue created or deleted.
- ``operator``: creates the streams and each endpoint's worker consumers (and updates their
  filters), sets the jobs stream's per-subject limit (the per-owner cap; no other stream update);
  reads queue depth, held-request signals and nudges (the autoscaler).
- ``admin``: everything. Used by nobody at run time; for a person repairing the queue.

Each role subscribes to replies on its own inbox prefix only (nats-py's ``inbox_prefix``), so
one user never sees another's replies: a direct get's reply is a job record.
"""

from __future__ import annotations

from llmendpoints_common.identity import EndpointRef, as_ref
from llmendpoints_common.queue import names, objects
from llmendpoints_common.queue.natsjwt import Permissions

ROLES = ("runtime", "gateway", "operator", "admin")

GATEWAY_INBOX = "_INBOX.gw"
OPERATOR_INBOX = "_INBOX.op"
ADMIN_INBOX = "_INBOX"

_JS = "$JS.API"
_STATE = names.kv_stream(names.JOB_STATE_BUCKET)
_IDEMPOTENCY = names.kv_stream(names.IDEMPOTENCY_BUCKET)
_QUOTAS = names.kv_stream(names.QUOTAS_BUCKET)
_SIGNALS = names.kv_stream(names.SIGNALS_BUCKET)
_BATCHES = names.kv_stream(names.BATCHES_BUCKET)
STREAMS = (
    names.JOBS_STREAM,
    _STATE,
    _IDEMPOTENCY,
    names.CHUNKS_STREAM,
    _QUOTAS,
    names.USAGE_STREAM,
    _SIGNALS,
    _BATCHES,
    objects.FILES_STREAM,
)

# What no role but admin may ever do, denied explicitly as well: an allow-list edited too
# broadly later still cannot reach them.
_NEVER = (
    f"{_JS}.STREAM.DELETE.>",
    f"{_JS}.STREAM.PURGE.>",
    f"{_JS}.STREAM.UPDATE.>",
    f"{_JS}.STREAM.SNAPSHOT.>",
    f"{_JS}.STREAM.RESTORE.>",
    f"{_JS}.STREAM.PEER.>",
    f"{_JS}.STREAM.LEADER.>",
    f"{_JS}.META.>",
    f"{_JS}.SERVER.>",
    f"{_JS}.ACCOUNT.>",
    "$SYS.>",
)


# The operator sets the per-owner cap on the jobs stream (its per-subject limit; the operator
# holds the account's signing key anyway): every other stream's update stays denied.
_OPERATOR_NEVER = tuple(
    deny
    for rule in _NEVER
    for deny in (
        [f"{_JS}.STREAM.UPDATE.{s}" for s in STREAMS if s != names.JOBS_STREAM]
        if rule == f"{_JS}.STREAM.UPDATE.>"
        else [rule]
    )
)


def endpoint_inbox(endpoint: EndpointRef | str) -> str:
    return f"_INBOX.ep.{names.tokens(endpoint)}"


def runtime(endpoint: EndpointRef | str) -> Permissions:
    """A runtime pod of ``endpoint``: that endpoint's subjects, records and consumers only."""
    ref = as_ref(endpoint)
    ep = names.tokens(ref)
    consumers = [names.jobs_consumer(ref, p) for p in names.PRIORITIES]
    state_keys = names.kv_subject(names.JOB_STATE_BUCKET, f"{ep}.>")
    idempotency_keys = names.kv_subject(names.IDEMPOTENCY_BUCKET, f"{ep}.>")
    chunks = f"llmep.chunks.{ep}.>"
    return Permissions(
        pub_allow=(
            # Submit (/run at the pod) and re-queue (/retry); a publish of the job's id, on
            # its owner's subject (llmep.jobs.<ns>.<name>.<priority>.<owner token>).
            f"llmep.jobs.{ep}.>",
            f"llmep.cancel.{ep}.*",
            chunks,
            # Records and idempotency keys: written by subject (compare-and-set headers), read
            # by direct get with the key in the request's subject.
            state_keys,
            idempotency_keys,
            f"{_JS}.DIRECT.GET.{_STATE}.{state_keys}",
            f"{_JS}.DIRECT.GET.{_IDEMPOTENCY}.{idempotency_keys}",
            f"{_JS}.DIRECT.GET.{names.CHUNKS_STREAM}.{chunks}",
            # /purge-queue lists the endpoint's records through a consumer filtered to them
            # (the filter is in the subject, and the server checks it against the request).
            f"{_JS}.CONSUMER.CREATE.{_STATE}.*.{state_keys}",
            f"{_JS}.CONSUMER.MSG.NEXT.{_STATE}.*",
            # The worker: its two durable consumers (pull, acknowledge, in-progress, info).
            *(f"{_JS}.CONSUMER.INFO.{names.JOBS_STREAM}.{c}" for c in consumers),
            *(f"{_JS}.CONSUMER.MSG.NEXT.{names.JOBS_STREAM}.{c}" for c in consumers),
            *(f"$JS.ACK.{names.JOBS_STREAM}.{c}.>" for c in consumers),
        ),
        pub_deny=_NEVER,
        sub_allow=(
            f"{endpoint_inbox(ref)}.>",
            f"llmep.cancel.{ep}.*",
            # /runsync and /status?wait follow a record's changes.
            names.kv_subject(names.JOB_STATE_BUCKET, f"{ep}.*"),
        ),
        sub_deny=("$SYS.>",),
    )


def gateway() -> Permissions:
    return Permissions(
        pub_allow=(
            "llmep.jobs.>",
            "llmep.cancel.>",
            "llmep.nudge.>",
            "llmep.usage.>",
            "llmep.chunks.>",
            names.ROUTES_WILDCARD,
            *(
                names.kv_subject(b, ">")
                for b in (
                    names.JOB_STATE_BUCKET,
                    names.IDEMPOTENCY_BUCKET,
                    names.SIGNALS_BUCKET,
                    names.QUOTAS_BUCKET,
                )
            ),
            # Stream info and direct gets of every stream (the gateway reads every endpoint's
            # records, chunks, quotas, batches and files): one wildcard each keeps the
            # credential inside NATS's control-line bound (4 KiB by default).
            f"{_JS}.STREAM.INFO.*",
            # nats-py finds the stream of a subscription by subject (the limiter's follower).
            f"{_JS}.STREAM.NAMES",
            f"{_JS}.DIRECT.GET.>",
            # A cancel or /purge-queue takes queued jobs' messages out (by sequence).
            f"{_JS}.STREAM.MSG.GET.{names.JOBS_STREAM}",
            f"{_JS}.STREAM.MSG.DELETE.{names.JOBS_STREAM}",
            # /health: the queue depth from the endpoint's worker consumers.
            f"{_JS}.CONSUMER.INFO.{names.JOBS_STREAM}.*",
            # Its own consumers: the job usage meter (job records), the limiter's follower
            # (quotas), the usage export; and what a record listing needs.
            *(
                f"{_JS}.CONSUMER.{verb}.{s}.>"
                for s in (_STATE, _QUOTAS, names.USAGE_STREAM)
                for verb in ("CREATE", "INFO", "MSG.NEXT", "DELETE")
            ),
            *(f"{_JS}.CONSUMER.{verb}.{s}" for s in (_QUOTAS,) for verb in ("CREATE",)),
            *(f"$JS.ACK.{s}.>" for s in (_STATE, names.USAGE_STREAM)),
            "$JS.FC.>",
            # Batches: records (compare-and-set by subject, direct gets, listings through
            # watchers on their own keys) and the files' object store (chunks and descriptions
            # by subject, removed by roll-up markers; direct gets).
            names.kv_subject(names.BATCHES_BUCKET, ">"),
            f"{_JS}.CONSUMER.CREATE.{_BATCHES}",
            f"{_JS}.CONSUMER.*.{_BATCHES}.>",  # create (named), info, delete
            f"$O.{objects.FILES_BUCKET}.>",
        ),
        pub_deny=_NEVER,
        sub_allow=(
            f"{GATEWAY_INBOX}.>",
            names.kv_subject(names.JOB_STATE_BUCKET, ">"),
            names.ROUTES_WILDCARD,
        ),
        sub_deny=("$SYS.>",),
    )


def operator() -> Permissions:
    return Permissions(
        pub_allow=(
            *(f"{_JS}.STREAM.INFO.{s}" for s in STREAMS),
            *(f"{_JS}.STREAM.CREATE.{s}" for s in STREAMS),
            f"{_JS}.STREAM.UPDATE.{names.JOBS_STREAM}",  # the per-owner cap
            # Each endpoint's worker consumers (two filters each -- per-owner subjects and the
            # form without an owner -- so the filter is not in the request's subject).
            f"{_JS}.CONSUMER.CREATE.{names.JOBS_STREAM}.*",
            f"{_JS}.CONSUMER.INFO.{names.JOBS_STREAM}.*",
            # Held-request counts: a watcher (ordered consumer) on the signals bucket; nats-py
            # names neither consumer nor filter in that request's subject.
            f"{_JS}.CONSUMER.CREATE.{_SIGNALS}",
            f"{_JS}.CONSUMER.CREATE.{_SIGNALS}.>",
            f"{_JS}.CONSUMER.INFO.{_SIGNALS}.>",
            f"{_JS}.CONSUMER.DELETE.{_SIGNALS}.>",
            "$JS.FC.>",
        ),
        pub_deny=_OPERATOR_NEVER,
        sub_allow=(f"{OPERATOR_INBOX}.>", names.NUDGE_WILDCARD),
        sub_deny=("$SYS.>",),
    )


def admin() -> Permissions:
    return Permissions(pub_allow=(">",), sub_allow=(">",))


def inbox_prefix(permissions: Permissions) -> str:
    """The reply inbox a credential may subscribe to (``_INBOX`` when any)."""
    for subject in permissions.sub_allow:
        if subject.startswith("_INBOX.") and subject.endswith(".>"):
            return subject[: -len(".>")]
    return ADMIN_INBOX


def for_role(role: str, endpoint: EndpointRef | str | None = None) -> Permissions:
    if role == "runtime":
        if endpoint is None:
            raise ValueError("role runtime: the endpoint ('<namespace>/<name>') is required")
        return runtime(endpoint)
    if endpoint is not None:
        raise ValueError(f"role {role}: no endpoint (only a runtime credential has one)")
    if role == "gateway":
        return gateway()
    if role == "operator":
        return operator()
    if role == "admin":
        return admin()
    raise ValueError(f"role must be one of {ROLES}, got {role!r}")
