"""Every stream the queue makes is bounded, and what an existing one lacks is named (pure:
queue/topology.py's configurations and drift checks)."""

from __future__ import annotations

from dataclasses import replace

from llmendpoints_common.identity import EndpointRef
from llmendpoints_common.queue import names, natsjwt
from llmendpoints_common.queue.topology import (
    JOB_MESSAGE_MAX_BYTES,
    QueueLayout,
    bounds_drift,
    consumer_drift,
    endpoint_stream_configs,
    stream_configs,
    usage_consumer_config,
)
from nats.js import api as js_api

A, B = EndpointRef("team-a", "chat"), EndpointRef("team-b", "chat")


def test_every_stream_is_bounded_and_an_endpoints_are_its_own():
    layout = QueueLayout()
    shared = stream_configs(layout)
    mine, theirs = endpoint_stream_configs(A, layout), endpoint_stream_configs(B, layout)
    for config in (*shared, *mine, *theirs):
        assert config.max_bytes and config.max_bytes > 0, config.name
    queue, records = mine
    assert queue.max_msg_size == JOB_MESSAGE_MAX_BYTES
    assert records.max_bytes == layout.endpoint_max_bytes
    assert queue.max_msgs_per_subject == layout.max_queued_per_owner
    # No subject of one endpoint's streams is another's or a shared stream's: JetStream would
    # refuse the stream, and a pod's writes would land in storage that is not its own.
    own = [s for c in mine for s in c.subjects]
    others = [s for c in (*theirs, *shared) for s in c.subjects]
    for pattern in own:
        for other in others:
            assert not natsjwt.subject_matches(pattern, other.replace(">", "x").replace("*", "x"))
            assert not natsjwt.subject_matches(other, pattern.replace(">", "x").replace("*", "x"))
    for pattern in own:
        assert pattern.startswith(names.endpoint_prefix(A) + ".")
    # The records stream holds what its subjects say: records, keys, chunks, admissions.
    for subject in (names.record_subject(A, "j"), names.chunk_subject(A, "j", 0, 1),
                    names.idempotency_subject(A, "ab" * 16),
                    names.admission_subject(A, "j", names.ADMITTED_BY_GATEWAY)):  # fmt: skip
        assert any(natsjwt.subject_matches(p, subject) for p in records.subjects), subject
    assert not any(natsjwt.subject_matches(p, names.cancel_subject(A, "j")) for p in own)


def test_bounds_drift_names_only_missing_bounds():
    layout = QueueLayout(max_queued_per_owner=7)
    wanted = endpoint_stream_configs(A, layout)[0]
    before = replace(wanted, max_bytes=-1, max_msgs_per_subject=10_000, max_age=5.0)
    assert bounds_drift(before, wanted) == {
        "max_bytes": layout.endpoint_queue_max_bytes,
        "max_msgs_per_subject": 7,
    }  # the age is not a bound it sets
    assert bounds_drift(wanted, wanted) == {}


def test_consumer_drift_names_what_cannot_be_updated_in_place():
    wanted = usage_consumer_config(A)
    assert consumer_drift(wanted, wanted) == ([], [])
    changed = replace(wanted, max_ack_pending=1, filter_subject=names.records_filter(B))
    assert consumer_drift(changed, wanted) == ([], ["filter_subject", "max_ack_pending"])
    push = replace(wanted, deliver_subject="llmep.elsewhere")
    assert consumer_drift(push, wanted) == (["deliver_subject"], [])
    new_only = replace(wanted, deliver_policy=js_api.DeliverPolicy.NEW)
    assert consumer_drift(new_only, wanted)[0] == ["deliver_policy"]
    # The server's "none" spelled either way is no drift.
    assert consumer_drift(replace(wanted, max_deliver=0), wanted) == ([], [])
