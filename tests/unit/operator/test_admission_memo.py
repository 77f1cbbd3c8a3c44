"""The autoscaler's admission memo: an unchanged spec is not admitted again, any change is."""

from __future__ import annotations

import pytest
from llmendpoints_operator import admission
from llmendpoints_operator.admission import AdmissionMemo
from llmendpoints_operator.config import OperatorSettings
from llmendpoints_operator.spec import InvalidSpecError


def spec(max_replicas: int = 3) -> dict:
    return {
        "model": {"name": "Qwen/Qwen2.5-7B-Instruct"},
        "scaling": {"minReplicas": 1, "maxReplicas": max_replicas},
    }


@pytest.fixture
def calls(monkeypatch) -> list[str]:
    """The names admission.admit was called with (it still runs)."""
    seen: list[str] = []
    real = admission.admit

    def counting(name, namespace, raw, settings):
        seen.append(name)
        return real(name, namespace, raw, settings)

    monkeypatch.setattr(admission, "admit", counting)
    return seen


def test_an_equal_spec_is_answered_from_memory(calls):
    memo = AdmissionMemo(OperatorSettings())
    first = memo.admit("a", "ns", spec())
    again = memo.admit("a", "ns", spec())  # a new body with the same spec, as after a status write
    assert again is first
    assert first.spec.scaling.max_replicas == 3
    assert calls == ["a"]


def test_a_changed_spec_is_admitted_again_even_when_changed_in_place(calls):
    memo = AdmissionMemo(OperatorSettings())
    body = spec()
    memo.admit("a", "ns", body)
    body["scaling"]["maxReplicas"] = 5
    assert memo.admit("a", "ns", body).spec.scaling.max_replicas == 5
    assert memo.admit("a", "ns", spec(7)).spec.scaling.max_replicas == 7
    assert calls == ["a", "a", "a"]


def test_endpoints_are_remembered_apart_and_forgotten_when_gone(calls):
    memo = AdmissionMemo(OperatorSettings())
    memo.admit("a", "ns", spec())
    memo.admit("a", "other", spec())
    memo.keep_only([("other", "a")])
    memo.admit("a", "ns", spec())
    memo.admit("a", "other", spec())
    assert calls == ["a", "a", "a"]


def test_an_invalid_spec_is_refused_every_time_with_its_fields(calls):
    memo = AdmissionMemo(OperatorSettings())
    bad = {"model": {"name": "m"}, "scaling": {"minReplicas": 4, "maxReplicas": 2}}
    errors = []
    for _ in range(2):
        with pytest.raises(InvalidSpecError) as raised:
            memo.admit("a", "ns", bad)
        errors.append(raised.value)
    assert errors[0] is not errors[1]
    assert "spec.scaling" in str(errors[1])
    assert calls == ["a"]
