"""The cluster administrator's policy (policy.py), from the operator's settings to refusals that
name the field and the policy."""

from __future__ import annotations

import pathlib
from typing import Any

import pytest
import yaml
from llmendpoints_operator import policy
from llmendpoints_operator.admission import admit
from llmendpoints_operator.config import OperatorSettings
from llmendpoints_operator.spec import InvalidSpecError, parse
from pydantic import ValidationError

CASES_FILE = pathlib.Path(__file__).with_name("policy_cases.yaml")
TABLE = yaml.safe_load(CASES_FILE.read_text())
RUNTIME_IMAGE = TABLE["runtimeImage"]
STRICT = TABLE["policies"]["strict"]
CASES = [
    (case["id"], TABLE["policies"][case["policy"]], case["spec"], case["refused"])
    for case in TABLE["cases"]
]

# The chart's `policy:` keys -> the operator's settings (the chart renders exactly this mapping;
# tests/chart/test_admission_policy.py checks it against the rendered Deployment).
SETTING = {
    "allowedImages": "allowed_images",
    "allowedServiceTypes": "allowed_service_types",
    "allowEnvValueFrom": "allow_env_value_from",
    "allowTrustRemoteCode": "allow_trust_remote_code",
    "allowedPriorityClasses": "allowed_priority_classes",
    "allowedIngressAnnotations": "allowed_ingress_annotations",
    "allowedExistingClaims": "allowed_existing_claims",
}


def settings_for(values: dict[str, Any]) -> OperatorSettings:
    fields: dict[str, Any] = {"runtime_image": RUNTIME_IMAGE}
    for key, value in values.items():
        fields[SETTING[key]] = ",".join(value) if isinstance(value, list) else value
    return OperatorSettings(**fields)


def refused_fields(values: dict[str, Any], spec: dict[str, Any]) -> list[str]:
    ep = parse("demo", "ns", spec)
    return [
        p.field for p in policy.check(ep, policy.ClusterPolicy.from_settings(settings_for(values)))
    ]


@pytest.mark.parametrize(
    ("values", "spec", "field"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_policy_case(values: dict[str, Any], spec: dict[str, Any], field: str | None) -> None:
    assert refused_fields(values, spec) == ([] if field is None else [field])


def test_defaults_restrict_nothing() -> None:
    defaults = policy.ClusterPolicy.from_settings(OperatorSettings())
    assert defaults.allowed_images is None and defaults.allowed_service_types is None
    assert defaults.allow_env_value_from and defaults.allow_trust_remote_code


def test_refusal_names_the_field_and_the_policy() -> None:
    spec = {"model": {"name": "m"}, "engine": {"image": "docker.io/evil/miner:1"}}
    with pytest.raises(InvalidSpecError) as caught:
        admit("demo", "ns", spec, settings_for(STRICT))
    (problem,) = caught.value.problems
    assert str(problem).startswith("spec.engine.image: 'docker.io/evil/miner:1' is not allowed by ")
    assert "policy.allowedImages (LLMEP_OPERATOR_ALLOWED_IMAGES)" in problem.message
    assert "registry.example.com/llm/*" in problem.message and RUNTIME_IMAGE in problem.message


def test_every_violation_is_reported_at_once() -> None:
    spec = {
        "model": {"name": "m", "trustRemoteCode": True},
        "engine": {"image": "x:1", "env": [{"name": "MODEL_NAME", "value": "m"}]},
    }
    with pytest.raises(InvalidSpecError) as caught:
        admit("demo", "ns", spec, settings_for(STRICT))
    # spec.parse stops at the managed variable first: the spec is invalid on its own.
    assert [p.field for p in caught.value.problems] == ["spec.engine.env"]
    spec["engine"].pop("env")
    with pytest.raises(InvalidSpecError) as caught:
        admit("demo", "ns", spec, settings_for(STRICT))
    assert [p.field for p in caught.value.problems] == [
        "spec.engine.image",
        "spec.model.trustRemoteCode",
    ]


def test_empty_list_allows_nothing_and_unset_allows_anything() -> None:
    assert (
        policy.ClusterPolicy.from_settings(OperatorSettings(allowed_images="")).allowed_images == ()
    )
    assert policy.ClusterPolicy.from_settings(OperatorSettings()).allowed_images is None


def test_unknown_service_type_in_the_setting_is_a_startup_error() -> None:
    with pytest.raises(ValidationError, match="unknown Service types"):
        OperatorSettings(allowed_service_types="ClusterIP,ExternalName")


@pytest.mark.parametrize(
    ("glob", "value", "matches"),
    [
        ("a/*", "a/b/c:1", True),
        ("a.b", "aXb", False),
        ("a?", "ab", True),
        ("a?", "abc", False),
        ("[ab]", "a", False),  # brackets are literal: only * and ? are special
        ("[ab]", "[ab]", True),
        ("x", "prefix-x", False),  # whole value, not a substring
    ],
)
def test_globs(glob: str, value: str, matches: bool) -> None:
    assert policy.matches_any(value, (glob,)) is matches


@pytest.mark.parametrize(
    ("gateway_url", "jobs_queue_url", "allowed"),
    [
        ("http://gw:8080", "nats://nats:4222", True),
        ("http://gw:8080", None, False),  # held requests are read from the queue: none to read
        (None, "nats://nats:4222", False),  # nothing holds requests while no replica runs
        (None, None, False),
    ],
)
def test_scale_to_zero_needs_the_gateway_and_the_shared_queue(
    gateway_url: str | None, jobs_queue_url: str | None, allowed: bool
) -> None:
    settings = OperatorSettings(gateway_url=gateway_url, jobs_queue_url=jobs_queue_url)
    spec = {"model": {"name": "m"}, "scaling": {"minReplicas": 0, "maxReplicas": 2}}
    if allowed:
        assert admit("d", "ns", spec, settings).spec.scaling.min_replicas == 0
        return
    with pytest.raises(InvalidSpecError) as refused:
        admit("d", "ns", spec, settings)
    message = str(refused.value)
    assert "spec.scaling.minReplicas" in message
    assert "LLMEP_OPERATOR_GATEWAY_URL" in message and "LLMEP_OPERATOR_JOBS_QUEUE_URL" in message
