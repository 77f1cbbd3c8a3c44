"""Who may do what on the queue's NATS: one allow-list per role, and its limits (pure data).

A NATS user may publish and subscribe only to the subjects its JWT allows (queue/natsjwt.py);
JetStream's API is subjects too (``$JS.API.<verb>.<stream>[.<consumer>[.<filter>]]``), so an
allow-list says which streams, consumers and records a role reaches. Each endpoint's jobs live
in two streams of its own (queue/names.py), so every request a pod makes names its own endpoint
in its subject -- even those whose body picks a message (a get or delete by sequence, a stream
info with a subject filter) -- and its credential is scoped by stream name. A consumer's deliver
subject is in the request's body, which no permission can scope: so no pod creates a consumer.

- ``runtime(ns/name)``: a runtime pod of one endpoint. Publish under its endpoint's subjects
  (``llmep.ep.<ns>.<name>.>``: submit, re-queue, records, idempotency keys, chunks, cancels,
  the admissions of jobs submitted at a pod) but never a gateway admission
  (``...adm.gw.*``); read its two streams (direct gets, info, queued messages by sequence) and
  take a cancelled job's message out of its queue; info, pull and acknowledge its three
  ``workers-<ns>_<name>-<priority>`` consumers, which it alone (and the trusted roles) may use;
  subscribe to its reply inbox, its cancels and its records. No other endpoint, no consumer it
  may create or change (the gateway's ``llmep-gateway-usage`` included), no quotas, usage,
  signals, batches or files; no stream created, changed, purged or deleted.
- ``gateway``: every endpoint's subjects (it accepts jobs for all of them and writes their
  admissions), queued messages (a cancel takes a queued job's message out, so the depth drops
  at once), the quotas bucket, the usage stream, held-request signals and nudges, the routing
  records gateway processes share (``llmep.routes.*``, publish and subscribe); the batch records
  (``LLMEP_BATCHES``) and files (the object store ``LLMEP_FILES``, written and removed by
  subject: no purge), and the batch signals; the consumers it reads with (``llmep-gateway-usage``
  on every endpoint's records, which it checks and repairs; the quotas follower, the usage
  export, the batch records' listings). No stream or bucket created, purged or deleted, no
  worker consumer created or deleted.
- ``operator``: creates the streams and each endpoint's consumers, sets the bounds of the
  streams it made (``max_bytes``, message size, the per-owner cap: queue/topology.py) and
  deletes a deleted endpoint's two streams (never a shared one); reads queue depth,
  held-request signals and nudges (the autoscaler).
- ``admin``: everything. Used by nobody at run time; for a person repairing the queue.

Each role subscribes to replies on its own inbox prefix only (nats-py's ``inbox_prefix``), so
one user never sees another's replies: a direct get's reply is a job record. Each role's user
JWT also carries ``limits``: the largest message it may publish and how many subscriptions it
may hold at once (NATS refuses the rest), so no credential can hold the server's memory.
"""

from __future__ import annotations

from llmendpoints_common.identity import EndpointRef, as_ref
from llmendpoints_common.queue import names, objects
from llmendpoints_common.queue.natsjwt import Permissions, UserLimits

ROLES = ("runtime", "gateway", "operator", "admin")

GATEWAY_INBOX = "_INBOX.gw"
OPERATOR_INBOX = "_INBOX.op"
ADMIN_INBOX = "_INBOX"

_JS = "$JS.API"
_QUOTAS = names.kv_stream(names.QUOTAS_BUCKET)
_SIGNALS = names.kv_stream(names.SIGNALS_BUCKET)
_BATCHES = names.kv_stream(names.BATCHES_BUCKET)
# The shared streams (each endpoint's two are its own: queue/names.py).
STREAMS = (_QUOTAS, names.USAGE_STREAM, _SIGNALS, _BATCHES, objects.FILES_STREAM)
_USAGE = names.USAGE_CONSUMER

# A runtime pod's largest message: a job's record with its input or output (the chart's NATS
# max_payload; a server configured lower wins) and its subscriptions: its reply inbox, worker
# lanes, cancels and one per /runsync or /status?wait waiting at the pod.
RUNTIME_MAX_PAYLOAD = 32 * 1024 * 1024
RUNTIME_MAX_SUBSCRIPTIONS = 10_000
GATEWAY_MAX_SUBSCRIPTIONS = 100_000
OPERATOR_MAX_SUBSCRIPTIONS = 10_000

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

# The operator updates the bounds of the streams it made and deletes a deleted endpoint's two;
# the shared streams (and the first layout's, which an admin removes) are never deleted.
_OPERATOR_NEVER = (
    *(rule for rule in _NEVER if rule not in (f"{_JS}.STREAM.DELETE.>", f"{_JS}.STREAM.UPDATE.>")),
    *(f"{_JS}.STREAM.DELETE.{s}" for s in (*STREAMS, *names.LEGACY_STREAMS)),
    *(f"{_JS}.STREAM.UPDATE.{s}" for s in names.LEGACY_STREAMS),
)


def endpoint_inbox(endpoint: EndpointRef | str) -> str:
    return f"_INBOX.ep.{names.tokens(endpoint)}"


def runtime(endpoint: EndpointRef | str) -> Permissions:
    """A runtime pod of ``endpoint``: that endpoint's subjects, streams and consumers only."""
    ref = as_ref(endpoint)
    prefix = names.endpoint_prefix(ref)
    queue, records = names.queue_stream(ref), names.records_stream(ref)
    consumers = [names.jobs_consumer(ref, p) for p in names.PRIORITIES]
    return Permissions(
        pub_allow=(
            # Its jobs (a publish of the job's id on its owner's subject), records,
            # idempotency keys, chunks, cancels and the admissions of jobs it accepts.
            f"{prefix}.>",
            # Reads of its own records stream, by subject or by sequence (the stream is its own).
            f"{_JS}.DIRECT.GET.{records}",
            f"{_JS}.DIRECT.GET.{records}.>",
            f"{_JS}.STREAM.INFO.{queue}",
            f"{_JS}.STREAM.INFO.{records}",
            # /purge-queue and /cancel: its queued messages, and taking them out.
            f"{_JS}.STREAM.MSG.GET.{queue}",
            f"{_JS}.STREAM.MSG.DELETE.{queue}",
            # The worker: its three durable consumers (pull, acknowledge, in-progress, info).
            *(f"{_JS}.CONSUMER.INFO.{queue}.{c}" for c in consumers),
            *(f"{_JS}.CONSUMER.MSG.NEXT.{queue}.{c}" for c in consumers),
            *(f"$JS.ACK.{queue}.{c}.>" for c in consumers),
        ),
        # A gateway admission is the gateway's word on who owns a job: never a pod's.
        pub_deny=(*_NEVER, f"{prefix}.adm.{names.ADMITTED_BY_GATEWAY}.>"),
        sub_allow=(
            f"{endpoint_inbox(ref)}.>",
            names.cancel_subject(ref),
            # /runsync and /status?wait follow a record's changes.
            names.records_filter(ref),
        ),
        sub_deny=("$SYS.>",),
    )


def gateway() -> Permissions:
    return Permissions(
        pub_allow=(
            "llmep.ep.>",
            "llmep.nudge.>",
            "llmep.usage.>",
            names.ROUTES_WILDCARD,
            *(
                names.kv_subject(b, ">")
                for b in (names.SIGNALS_BUCKET, names.QUOTAS_BUCKET, names.BATCHES_BUCKET)
            ),
            # Stream info and direct gets of every stream (the gateway reads every endpoint's
            # records, chunks, quotas, batches and files): one wildcard each keeps the
            # credential inside NATS's control-line bound (4 KiB by default).
            f"{_JS}.STREAM.INFO.*",
            # The usage meter finds the endpoints' records streams; nats-py finds the stream of
            # a subscription by subject (the limiter's follower).
            f"{_JS}.STREAM.NAMES",
            f"{_JS}.DIRECT.GET.>",
            # A cancel or /purge-queue takes queued jobs' messages out of an endpoint's queue.
            f"{_JS}.STREAM.MSG.GET.*",
            f"{_JS}.STREAM.MSG.DELETE.*",
            # /health: the queue depth from the endpoint's worker consumers.
            f"{_JS}.CONSUMER.INFO.*.*",
            # The usage meter: its consumer on every endpoint's records, checked and repaired.
            f"{_JS}.CONSUMER.CREATE.*.{_USAGE}.>",
            f"{_JS}.CONSUMER.DELETE.*.{_USAGE}",
            f"{_JS}.CONSUMER.MSG.NEXT.*.{_USAGE}",
            f"$JS.ACK.*.{_USAGE}.>",
            # Its other consumers: the limiter's follower (quotas), the usage export.
            *(
                f"{_JS}.CONSUMER.{verb}.{s}.>"
                for s in (_QUOTAS, names.USAGE_STREAM)
                for verb in ("CREATE", "MSG.NEXT", "DELETE")
            ),
            f"{_JS}.CONSUMER.CREATE.{_QUOTAS}",
            "$JS.FC.>",
            # Batches: records (compare-and-set by subject, direct gets, listings through
            # watchers on their own keys) and the files' object store (chunks and descriptions
            # by subject, removed by roll-up markers; direct gets).
            f"{_JS}.CONSUMER.CREATE.{_BATCHES}",
            f"{_JS}.CONSUMER.*.{_BATCHES}.>",  # create (named), info, delete
            f"$O.{objects.FILES_BUCKET}.>",
        ),
        # Queued messages are taken out of endpoints' queues only, by sequence.
        pub_deny=(*_NEVER, *(f"{_JS}.STREAM.MSG.DELETE.{s}" for s in STREAMS)),
        sub_allow=(f"{GATEWAY_INBOX}.>", "llmep.ep.*.*.rec.*", names.ROUTES_WILDCARD),
        sub_deny=("$SYS.>",),
    )


def operator() -> Permissions:
    return Permissions(
        pub_allow=(
            f"{_JS}.STREAM.INFO.*",
            f"{_JS}.STREAM.CREATE.*",
            f"{_JS}.STREAM.UPDATE.*",  # the bounds of what it made (queue/topology.py)
            f"{_JS}.STREAM.DELETE.*",  # a deleted endpoint's two streams (see the denials)
            # Each endpoint's worker consumers and the gateway's usage consumer (named, one
            # filter each: both in the request's subject).
            f"{_JS}.CONSUMER.CREATE.*.*.>",
            f"{_JS}.CONSUMER.INFO.*.*",
            f"{_JS}.CONSUMER.DELETE.*.{_USAGE}",
            # Held-request counts: a watcher (ordered consumer) on the signals bucket; nats-py
            # names neither consumer nor filter in that request's subject.
            f"{_JS}.CONSUMER.CREATE.{_SIGNALS}",
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


def limits(role: str) -> UserLimits:
    """What a role's user JWT bounds: its largest message and its subscriptions."""
    if role == "runtime":
        return UserLimits(payload=RUNTIME_MAX_PAYLOAD, subs=RUNTIME_MAX_SUBSCRIPTIONS)
    if role == "gateway":
        return UserLimits(subs=GATEWAY_MAX_SUBSCRIPTIONS)
    if role == "operator":
        return UserLimits(subs=OPERATOR_MAX_SUBSCRIPTIONS)
    return UserLimits()


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
