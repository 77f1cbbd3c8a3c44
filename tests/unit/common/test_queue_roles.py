"""Who may do what on the queue's NATS (queue/roles.py), read as nats-server reads an allow-list
(``Permissions.may_publish``: NATS wildcard matching, a deny wins). The chart's NATS proves the
same on the real server (tests/chart/test_nats_permissions.py); this checks every verb against
every stream, which the server test cannot afford."""

from __future__ import annotations

import itertools

import pytest
from llmendpoints_common.identity import EndpointRef
from llmendpoints_common.queue import names, natsjwt, objects, roles, trust

A, B = EndpointRef("team-a", "chat"), EndpointRef("team-b", "chat")
OTHERS = [
    names.records_stream(B),
    names.queue_stream(B),
    *roles.STREAMS,
    *names.LEGACY_STREAMS,
]
_API = "$JS.API"


def _requests(stream: str, consumer: str = "x") -> list[str]:
    """Every JetStream API request that names ``stream`` (and ``consumer``) in its subject."""
    return [
        f"{_API}.DIRECT.GET.{stream}",
        f"{_API}.DIRECT.GET.{stream}.llmep.ep.team-b.chat.rec.j",
        f"{_API}.STREAM.INFO.{stream}",
        f"{_API}.STREAM.MSG.GET.{stream}",
        f"{_API}.STREAM.MSG.DELETE.{stream}",
        f"{_API}.STREAM.PURGE.{stream}",
        f"{_API}.STREAM.DELETE.{stream}",
        f"{_API}.STREAM.UPDATE.{stream}",
        f"{_API}.CONSUMER.INFO.{stream}.{consumer}",
        f"{_API}.CONSUMER.MSG.NEXT.{stream}.{consumer}",
        f"{_API}.CONSUMER.DELETE.{stream}.{consumer}",
        f"$JS.ACK.{stream}.{consumer}.1.2.3.4.5",
    ]


def test_a_pods_credential_names_its_own_streams_and_consumers_only():
    pod = roles.runtime(A)
    records, queue = names.records_stream(A), names.queue_stream(A)
    workers = [names.jobs_consumer(A, p) for p in names.PRIORITIES]
    # What the code a pod runs needs (queue/client.py, worker.py, depth.py, admissions.py).
    needs = [
        names.record_subject(A, "j-1"),
        names.idempotency_subject(A, "ab" * 16),
        names.chunk_subject(A, "j-1", 1, 1),
        names.jobs_subject(A, "normal", "alice"),
        names.cancel_subject(A, "j-1"),
        names.admission_subject(A, "j-1", names.ADMITTED_BY_ENDPOINT),
        f"{_API}.DIRECT.GET.{records}.{names.record_subject(A, 'j-1')}",
        f"{_API}.DIRECT.GET.{records}",
        f"{_API}.STREAM.INFO.{queue}",
        f"{_API}.STREAM.INFO.{records}",
        f"{_API}.STREAM.MSG.GET.{queue}",
        f"{_API}.STREAM.MSG.DELETE.{queue}",
        *(f"{_API}.CONSUMER.{v}.{queue}.{w}" for v in ("INFO", "MSG.NEXT") for w in workers),
        *(f"$JS.ACK.{queue}.{w}.1.2.3.4.5" for w in workers),
    ]
    assert [s for s in needs if not pod.may_publish(s)] == []
    # Another endpoint's streams, the shared ones, the first layout's: no verb at all.
    reached = [s for stream in OTHERS for s in _requests(stream) if pod.may_publish(s)]
    assert reached == []
    # The gateway's usage consumer, on its own records too: by its real name, every verb.
    gateway_consumer = [
        subject
        for stream in (records, queue)
        for subject in _requests(stream, names.USAGE_CONSUMER)
        if ".CONSUMER." in subject or subject.startswith("$JS.ACK.")
    ]
    gateway_consumer.append(f"{_API}.CONSUMER.MSG.NEXT.KV_LLMEP_JOB_STATE.gateway-job-usage")
    assert [s for s in gateway_consumer if pod.may_publish(s)] == []
    # Its own streams are never purged, deleted or changed; its records not taken out.
    for stream, verb in itertools.product((records, queue), ("PURGE", "DELETE", "UPDATE")):
        assert not pod.may_publish(f"{_API}.STREAM.{verb}.{stream}")
    assert not pod.may_publish(f"{_API}.STREAM.MSG.DELETE.{records}")
    # A gateway admission is never a pod's word; another endpoint's subjects neither.
    assert not pod.may_publish(names.admission_subject(A, "j-1", names.ADMITTED_BY_GATEWAY))
    for subject in (names.record_subject(B, "j"), names.jobs_subject(B, "normal", "k"),
                    names.cancel_subject(B, "j"), names.usage_subject(A, "k"),
                    names.kv_subject(names.QUOTAS_BUCKET, "k"), names.nudge_subject(B)):  # fmt: skip
        assert not pod.may_publish(subject), subject
    # Subscriptions: its inbox, its cancels, its records; nobody else's.
    for subject in (f"{roles.endpoint_inbox(A)}.x", names.cancel_subject(A, "j"),
                    names.record_subject(A, "j")):  # fmt: skip
        assert pod.may_subscribe(subject)
    for subject in ("_INBOX.>", "_INBOX.gw.x", names.record_subject(B, "j"), "llmep.>"):
        assert not pod.may_subscribe(subject), subject


@pytest.mark.parametrize("stream", [names.records_stream(A), names.queue_stream(A), *OTHERS])
def test_no_pod_creates_or_changes_a_consumer(stream):
    """A push consumer's deliver subject is in the request's body, which no permission can
    scope: so a pod creates no consumer, even on its own streams, and changes none."""
    pod = roles.runtime(A)
    for name in ("thief", names.USAGE_CONSUMER, names.jobs_consumer(A)):
        for subject in (
            f"{_API}.CONSUMER.CREATE.{stream}",
            f"{_API}.CONSUMER.CREATE.{stream}.{name}",
            f"{_API}.CONSUMER.CREATE.{stream}.{name}.{names.records_filter(A)}",
            f"{_API}.CONSUMER.DURABLE.CREATE.{stream}.{name}",
            f"{_API}.CONSUMER.DELETE.{stream}.{name}",
        ):
            assert not pod.may_publish(subject), subject


def test_the_gateway_reaches_its_usage_consumers_and_deletes_no_stream():
    gateway = roles.gateway()
    records = names.records_stream(A)
    for verb in ("INFO", "MSG.NEXT", "DELETE"):
        assert gateway.may_publish(f"{_API}.CONSUMER.{verb}.{records}.{names.USAGE_CONSUMER}")
    assert gateway.may_publish(
        f"{_API}.CONSUMER.CREATE.{records}.{names.USAGE_CONSUMER}.{names.records_filter(A)}"
    )
    assert gateway.may_publish(f"$JS.ACK.{records}.{names.USAGE_CONSUMER}.1.2.3.4.5")
    assert gateway.may_publish(names.admission_subject(A, "j", names.ADMITTED_BY_GATEWAY))
    # The workers' consumers: read (depth), never made, changed or deleted.
    worker = names.jobs_consumer(A)
    queue = names.queue_stream(A)
    assert gateway.may_publish(f"{_API}.CONSUMER.INFO.{queue}.{worker}")
    for verb in ("CREATE", "DELETE"):
        assert not gateway.may_publish(f"{_API}.CONSUMER.{verb}.{queue}.{worker}")
    for stream in (records, queue, *roles.STREAMS):
        for verb in ("PURGE", "DELETE", "UPDATE", "CREATE"):
            assert not gateway.may_publish(f"{_API}.STREAM.{verb}.{stream}")
    # Queued messages are taken out of an endpoint's queue, never a shared stream's.
    assert gateway.may_publish(f"{_API}.STREAM.MSG.DELETE.{queue}")
    for stream in roles.STREAMS:
        assert not gateway.may_publish(f"{_API}.STREAM.MSG.DELETE.{stream}")


def test_the_operator_deletes_an_endpoints_streams_and_no_shared_one():
    operator = roles.operator()
    for stream in (names.records_stream(A), names.queue_stream(A)):
        for verb in ("CREATE", "UPDATE", "DELETE", "INFO"):
            assert operator.may_publish(f"{_API}.STREAM.{verb}.{stream}")
    for stream in (*roles.STREAMS, *names.LEGACY_STREAMS):
        assert not operator.may_publish(f"{_API}.STREAM.DELETE.{stream}"), stream
        assert not operator.may_publish(f"{_API}.STREAM.PURGE.{stream}")
    for stream in names.LEGACY_STREAMS:
        assert not operator.may_publish(f"{_API}.STREAM.UPDATE.{stream}")
    # It reads no job record, chunk, quota or usage.
    for subject in (f"{_API}.DIRECT.GET.{names.records_stream(A)}", names.record_subject(A, "j"),
                    names.kv_subject(names.QUOTAS_BUCKET, "k"), names.usage_subject(A, "k")):  # fmt: skip
        assert not operator.may_publish(subject), subject


def test_every_role_but_admin_is_bounded_in_its_jwt():
    installation = trust.Installation.generate()
    for role, endpoint in (("runtime", A), ("gateway", None), ("operator", None)):
        token, _ = natsjwt.parse_creds(trust.mint(installation.signer, role, endpoint, issued_at=2_000_000_000))  # fmt: skip
        limits = natsjwt.UserLimits.from_claims(natsjwt.decode(token))
        assert limits == roles.limits(role) and limits.subs > 0, role
    assert roles.limits("runtime").payload == roles.RUNTIME_MAX_PAYLOAD


def test_the_account_bounds_jetstream_and_refuses_the_first_layouts_credentials():
    installation = trust.Installation.generate()
    config = trust.server_config(installation, natsjwt.AccountLimits(disk_storage=3 * 10**10))
    account_jwt = next(
        line.split(": ", 1)[1]
        for line in config.splitlines()
        if line.strip().startswith(installation.account.public)
    )
    claims = natsjwt.verify(account_jwt)["nats"]
    assert claims["limits"]["max_bytes_required"] is True
    assert claims["limits"]["disk_storage"] == 3 * 10**10
    assert claims["revocations"] == {"*": trust.REVOKED_BEFORE}
    # Deterministic: every NATS replica renders the same.
    assert config == trust.server_config(
        installation, natsjwt.AccountLimits(disk_storage=3 * 10**10)
    )


def test_the_object_store_and_batches_are_the_gateways_alone():
    pod = roles.runtime(A)
    assert not pod.may_publish(f"$O.{objects.FILES_BUCKET}.C.x")
    assert not pod.may_publish(names.kv_subject(names.BATCHES_BUCKET, "batch.x.y"))
