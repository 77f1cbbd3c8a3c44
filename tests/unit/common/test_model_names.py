"""The one rule the gateway and the operator share for who keeps a served model name."""

from __future__ import annotations

import itertools

import pytest
from llmendpoints_common.model_names import (
    Claim,
    claim_order,
    creation_time,
    owner,
    served_model_name,
)


@pytest.mark.parametrize(
    ("spec", "served"),
    [
        ({"model": {"name": "org/m", "servedModelName": "llama"}}, "llama"),
        ({"model": {"name": "org/m"}}, "chat"),
        ({}, "chat"),
        (None, "chat"),
        # Read leniently (an invalid spec is still routed): anything but a name is no name.
        ({"model": {"servedModelName": ""}}, "chat"),
        ({"model": {"servedModelName": 7}}, "chat"),
        ({"model": "org/m"}, "chat"),
    ],
)
def test_the_served_model_name_is_the_declared_one_else_the_endpoints_name(
    spec: object, served: str
) -> None:
    assert served_model_name("chat", spec) == served  # type: ignore[arg-type]


def test_creation_times_are_read_as_the_api_server_writes_them() -> None:
    assert creation_time("2026-01-01T00:00:00Z") == 1767225600.0
    assert creation_time("2026-01-01T01:00:00+01:00") == 1767225600.0
    assert creation_time("2026-01-01T00:00:00") == 1767225600.0  # UTC, never local time
    for unknown in (None, "", "yesterday", 1767225600):
        assert creation_time(unknown) is None


def test_the_oldest_claim_keeps_the_name_ties_by_namespace_and_name_unknown_ages_last() -> None:
    oldest = Claim("team-z", "chat", 100.0)
    same_second = [Claim("team-b", "chat", 200.0), Claim("team-a", "zeta", 200.0)]
    unknown = [Claim("team-b", "x", None), Claim("team-a", "y", None)]
    claims = [oldest, *same_second, *unknown]
    # Whatever order a process sees them in (gateway replicas and the operator differ).
    for seen in itertools.permutations(claims):
        assert owner(seen) == oldest
        assert sorted(seen, key=lambda c: c.order) == [
            oldest,
            Claim("team-a", "zeta", 200.0),  # "team-a/zeta" < "team-b/chat"
            Claim("team-b", "chat", 200.0),
            Claim("team-a", "y", None),  # unknown ages: after every known one, then by id
            Claim("team-b", "x", None),
        ]
    # A claim of unknown age never takes a name from one of known age, even a "zero" one.
    assert owner([Claim("a", "a", None), Claim("z", "z", 0.0)]) == Claim("z", "z", 0.0)
    assert claim_order(None, "a/a") > claim_order(1e12, "z/z")
    assert owner([]) is None
