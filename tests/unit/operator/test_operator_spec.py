"""Spec parsing: defaults, and errors that name the field a user has to fix."""

from __future__ import annotations

from typing import Any

import pytest
from llmendpoints_operator.spec import InvalidSpecError, parse


def _problems(spec: dict[str, Any], name: str = "demo") -> list[str]:
    with pytest.raises(InvalidSpecError) as caught:
        parse(name, "ns", spec)
    return [str(p) for p in caught.value.problems]


def test_minimal_spec_gets_the_documented_defaults() -> None:
    ep = parse("demo", "ns", {"model": {"name": "org/model"}})
    spec = ep.spec
    assert ep.served_model_name == "demo"
    assert (spec.resources.gpus, spec.scaling.min_replicas, spec.scaling.upper) == (1, 1, 1)
    assert spec.cache is None
    assert spec.rollout.strategy == "RollingUpdate"
    assert (spec.engine.startup_timeout_seconds, spec.engine.drain_timeout_seconds) == (3600, 30)
    assert spec.api.service.port == 80 and not spec.api.ingress.enabled


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({}, "spec.model: is required"),
        ({"model": {"name": ""}}, "spec.model.name:"),
        (
            {"model": {"name": "m"}, "scaling": {"minReplicas": 3, "maxReplicas": 2}},
            "spec.scaling.minReplicas:",
        ),
        ({"model": {"name": "m"}, "scaling": {"maxReplicas": 0}}, "spec.scaling.maxReplicas:"),
        (
            {
                "model": {"name": "m"},
                "scaling": {"minReplicas": 1, "maxReplicas": 2, "replicas": 5},
            },
            "spec.scaling.replicas:",
        ),
        (
            {"model": {"name": "m", "hfTokenSecretRef": {"name": "hf"}}},
            "spec.model.hfTokenSecretRef.key: is required",
        ),
        (
            {"model": {"name": "m"}, "api": {"apiKeysSecretRef": {"name": "Bad_Name", "key": "k"}}},
            "spec.api.apiKeysSecretRef.name:",
        ),
        (
            {"model": {"name": "m"}, "resources": {"limits": {"memory": "12XB"}}},
            "spec.resources.limits.memory:",
        ),
        ({"model": {"name": "m"}, "cache": {"size": "lots"}}, "spec.cache.size:"),
        ({"model": {"name": "m"}, "cache": {}}, "spec.cache:"),
        ({"model": {"name": "m"}, "cache": {"size": "1Gi", "existingClaim": "c"}}, "spec.cache:"),
        (
            {"model": {"name": "m"}, "engine": {"args": {"max-num-seqs": [1, 2]}}},
            "spec.engine.args.max-num-seqs:",
        ),
        ({"model": {"name": "m"}, "engine": {"args": {"--max-num-seqs": 1}}}, "spec.engine.args:"),
        (
            {"model": {"name": "m"}, "engine": {"args": {"max-model-len": 4096}}},
            "spec.engine.args.max-model-len: set spec.engine.maxModelLen instead",
        ),
        (
            {"model": {"name": "m"}, "engine": {"env": [{"name": "MODEL_NAME", "value": "x"}]}},
            "spec.engine.env: MODEL_NAME is set by the operator",
        ),
        (
            {"model": {"name": "m"}, "engine": {"tensorParallelSize": 2}},
            "spec.engine.tensorParallelSize:",
        ),
        (
            {"model": {"name": "m", "bakedIntoImage": True}},
            "spec.model.bakedIntoImage: set engine.image",
        ),
        (
            {
                "model": {"name": "m", "bakedIntoImage": True},
                "engine": {"image": "r/i:1"},
                "cache": {"size": "10Gi"},
            },
            "spec.model.bakedIntoImage: remove cache",
        ),
        (
            {"model": {"name": "m"}, "engine": {"gpuMemoryUtilization": 1.5}},
            "spec.engine.gpuMemoryUtilization:",
        ),
        ({"model": {"name": "m"}, "rollout": {"maxSurge": "lots"}}, "spec.rollout.maxSurge:"),
        (
            {"model": {"name": "m"}, "rollout": {"maxSurge": 0, "maxUnavailable": 0}},
            "spec.rollout.maxUnavailable:",
        ),
        (
            {
                "model": {"name": "m"},
                "api": {"ingress": {"enabled": True, "tls": {"secretName": "t"}}},
            },
            "spec.api.ingress.tls: needs a host",
        ),
        ({"model": {"name": "m", "nmae": "typo"}}, "spec.model.nmae: is not a field"),
    ],
)
def test_invalid_spec_names_the_field(spec: dict[str, Any], field: str) -> None:
    problems = _problems(spec)
    assert any(p.startswith(field) for p in problems), problems


def test_every_problem_is_reported_at_once() -> None:
    problems = _problems({"model": {"name": ""}, "resources": {"gpus": -1}})
    assert [p.split(":")[0] for p in problems] == ["spec.model.name", "spec.resources.gpus"]


def test_values_are_quoted_in_messages() -> None:
    (problem,) = _problems({"model": {"name": "m"}, "scaling": {"minReplicas": -2}})
    assert "(got -2)" in problem


@pytest.mark.parametrize("name", ["Demo", "9lives", "a" * 50, "with_underscore"])
def test_endpoint_name_must_fit_child_names(name: str) -> None:
    (problem,) = _problems({"model": {"name": "m"}}, name=name)
    assert problem.startswith("metadata.name:")


def test_quantities_accept_kubernetes_forms() -> None:
    for value in ["8Gi", "500m", 2, "1.5", "1e3", "100M"]:
        parse("d", "ns", {"model": {"name": "m"}, "resources": {"requests": {"cpu": value}}})


def test_unset_max_replicas_means_a_fixed_size() -> None:
    ep = parse("d", "ns", {"model": {"name": "m"}, "scaling": {"minReplicas": 3}})
    assert ep.spec.scaling.upper == 3


def test_scale_to_zero_is_refused_until_the_gateway_exists() -> None:
    (problem,) = _problems(
        {"model": {"name": "m"}, "scaling": {"minReplicas": 0, "maxReplicas": 3}}
    )
    assert problem.startswith("spec.scaling.minReplicas: 0 needs the request-holding gateway")
    assert "LLMEP_OPERATOR_GATEWAY_URL" in problem


def test_scale_to_zero_is_allowed_with_the_gateway() -> None:
    spec = {
        "model": {"name": "m"},
        "scaling": {"minReplicas": 0, "maxReplicas": 3, "scaleToZeroAfterSeconds": 120},
    }
    scaling = parse("d", "ns", spec, scale_to_zero=True).spec.scaling
    assert (scaling.min_replicas, scaling.autoscaled) == (0, True)
    assert scaling.policy().scale_to_zero_after_seconds == 120
    with pytest.raises(
        InvalidSpecError,
        match=r"spec\.scaling\.minReplicas: Input should be greater than or equal to 0",
    ):
        parse(
            "d", "ns", {"model": {"name": "m"}, "scaling": {"minReplicas": -1}}, scale_to_zero=True
        )


def test_routing_is_prefix_aware_unless_set() -> None:
    assert parse("d", "ns", {"model": {"name": "m"}}).spec.routing == "prefix-aware"
    spec = {"model": {"name": "m"}, "routing": "round-robin"}
    assert parse("d", "ns", spec).spec.routing == "round-robin"
    (problem,) = _problems({"model": {"name": "m"}, "routing": "random"})
    assert problem.startswith("spec.routing")
