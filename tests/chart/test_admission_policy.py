"""The cluster-admin policy in the chart: values -> the operator's settings, and the same rules as
a ValidatingAdmissionPolicy whose CEL (evaluated here with cel-python; no API server) agrees with
the operator's policy.py on the shared cases in tests/unit/operator/policy_cases.yaml."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from .helm_kit import ROOT, only, render

pytestmark = pytest.mark.helm

VAP_API = "admissionregistration.k8s.io/v1/ValidatingAdmissionPolicy"
TABLE = yaml.safe_load((ROOT / "tests/unit/operator/policy_cases.yaml").read_text())
POLICY_KINDS = {"ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"}


def _render(helm: Path, tmp_path: Path, policy: dict[str, Any], **values: Any) -> list[dict]:
    return render(helm, tmp_path, {"policy": policy, **values}, "--api-versions", VAP_API)


@pytest.fixture(scope="module")
def rendered(helm: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    """policy name -> the chart rendered with it, on a cluster that serves the admission API."""
    return {
        name: _render(helm, tmp_path_factory.mktemp(name), values)
        for name, values in TABLE["policies"].items()
    }


def _cel_failures(policy_doc: dict[str, Any], obj: dict[str, Any]) -> list[str]:
    """Messages of the validations `obj` fails, as the API server would evaluate them."""
    import celpy

    env = celpy.Environment()
    failures = []
    for validation in policy_doc["spec"]["validations"]:
        program = env.program(env.compile(validation["expression"]))
        if not program.evaluate({"object": celpy.json_to_cel(obj)}):
            failures.append(validation["message"])
    return failures


def _operator_verdict(deployment: dict[str, Any], spec: dict[str, Any], monkeypatch) -> list[str]:
    """The operator's refusals for `spec`, with the settings the chart's Deployment gives it."""
    from llmendpoints_operator import policy
    from llmendpoints_operator.config import OperatorSettings
    from llmendpoints_operator.spec import parse

    for name in [n for n in __import__("os").environ if n.startswith("LLMEP_OPERATOR_")]:
        monkeypatch.delenv(name)
    for var in deployment["spec"]["template"]["spec"]["containers"][0]["env"]:
        if "value" in var:
            monkeypatch.setenv(var["name"], var["value"])
    cluster_policy = policy.ClusterPolicy.from_settings(OperatorSettings())
    return [p.field for p in policy.check(parse("demo", "ns", spec), cluster_policy)]


def _as_message_field(field: str) -> str:
    """spec.engine.env[1].valueFrom.secretKeyRef -> spec.engine.env[].valueFrom.secretKeyRef"""
    return re.sub(r"\[[^\]]*\]", "[]", field)


@pytest.mark.parametrize("case", TABLE["cases"], ids=[c["id"] for c in TABLE["cases"]])
def test_admission_policy_and_operator_agree(
    case: dict[str, Any], rendered: dict[str, list[dict]], monkeypatch: pytest.MonkeyPatch
) -> None:
    docs = rendered[case["policy"]]
    obj = {
        "apiVersion": "llmendpoints.dev/v1alpha1",
        "kind": "LLMEndpoint",
        "metadata": {"name": "demo", "namespace": "team"},
        "spec": case["spec"],
    }
    operator = _operator_verdict(only(docs, "Deployment"), case["spec"], monkeypatch)
    expected = [] if case["refused"] is None else [case["refused"]]
    assert operator == expected

    policies = [d for d in docs if d["kind"] == "ValidatingAdmissionPolicy"]
    if not policies:
        assert (
            case["policy"] == "unset" and expected == []
        )  # nothing restricted, nothing to install
        return
    failures = _cel_failures(policies[0], obj)
    if case["refused"] is None:
        assert failures == []
    else:
        (message,) = failures
        assert _as_message_field(case["refused"]).startswith(message.split(" ")[0].rstrip(":"))
        assert "LLMEP_OPERATOR_" in message and "policy." in message


def test_runtime_image_of_the_cases_is_the_charts(rendered: dict[str, list[dict]]) -> None:
    env = only(rendered["strict"], "Deployment")["spec"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "LLMEP_OPERATOR_RUNTIME_IMAGE", "value": TABLE["runtimeImage"]} in env


def test_policy_documents_validate_against_the_kubernetes_schemas(
    rendered: dict[str, list[dict]],
) -> None:
    docs = [d for d in rendered["strict"] if d["kind"] in POLICY_KINDS]
    assert sorted(d["kind"] for d in docs) == sorted(POLICY_KINDS)
    for doc in docs:
        # admissionregistration.k8s.io/v1 ValidatingAdmissionPolicy is GA since Kubernetes 1.30.
        kubernetes_validate.validate(doc, kubernetes_validate.utils.latest_version(), strict=True)
    vap = only(docs, "ValidatingAdmissionPolicy")
    binding = only(docs, "ValidatingAdmissionPolicyBinding")
    assert binding["spec"]["policyName"] == vap["metadata"]["name"]
    assert binding["spec"]["validationActions"] == ["Deny"]
    assert vap["spec"]["failurePolicy"] == "Fail"


def test_every_admission_expression_compiles(rendered: dict[str, list[dict]]) -> None:
    import celpy

    env = celpy.Environment()
    vap = only(rendered["strict"], "ValidatingAdmissionPolicy")
    assert len(vap["spec"]["validations"]) == 7  # one per rule of the policy
    for item in [*vap["spec"]["validations"], *vap["spec"]["matchConditions"]]:
        env.compile(item["expression"])


def test_the_operator_itself_is_exempt(rendered: dict[str, list[dict]]) -> None:
    import celpy

    docs = rendered["strict"]
    vap = only(docs, "ValidatingAdmissionPolicy")
    (condition,) = vap["spec"]["matchConditions"]
    account = only(docs, "ServiceAccount")["metadata"]
    env = celpy.Environment()
    program = env.program(env.compile(condition["expression"]))

    def applies(user: str) -> bool:
        request = {"userInfo": {"username": user}}
        return bool(program.evaluate({"request": celpy.json_to_cel(request)}))

    assert not applies(f"system:serviceaccount:{account['namespace']}:{account['name']}")
    assert applies("alice@example.com")


def test_not_installed_without_the_api_when_disabled_or_with_nothing_to_enforce(
    helm: Path, tmp_path: Path, rendered: dict[str, list[dict]]
) -> None:
    strict = TABLE["policies"]["strict"]
    without_api = render(helm, tmp_path, {"policy": strict})  # e.g. Kubernetes 1.29
    disabled = _render(helm, tmp_path, {**strict, "admissionPolicy": {"enabled": False}})
    for docs in (without_api, disabled, rendered["unset"]):
        assert not [d for d in docs if d["kind"] in POLICY_KINDS]
    # The operator enforces the policy either way.
    env = only(without_api, "Deployment")["spec"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "LLMEP_OPERATOR_ALLOW_TRUST_REMOTE_CODE", "value": "false"} in env


def test_binding_follows_watch_namespaces(helm: Path, tmp_path: Path) -> None:
    docs = _render(
        helm, tmp_path, TABLE["policies"]["strict"], watchNamespaces=["team-a", "team-b"]
    )
    binding = only(docs, "ValidatingAdmissionPolicyBinding")
    (expression,) = binding["spec"]["matchResources"]["namespaceSelector"]["matchExpressions"]
    assert expression == {
        "key": "kubernetes.io/metadata.name",
        "operator": "In",
        "values": ["team-a", "team-b"],
    }
