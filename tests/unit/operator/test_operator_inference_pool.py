"""The InferencePool (Gateway API Inference Extension): spec, pure builder, status report.

Every pool the operator builds is validated against the real InferencePool v1 schema, vendored in
schemas/ from kubernetes-sigs/gateway-api-inference-extension (each file names its tag and
commit): the newest release (v1.6.0) and the first v1 release (v1.0.0, which clusters still run),
including the CRDs' CEL rules. The reconcile's side (applied, refused, removed) is in
test_operator_reconcile.py; against kmock in tests/integration/test_inference_pool.py.
"""

from __future__ import annotations

import copy
import pathlib
from typing import Any

import jsonschema
import pytest
import yaml
from llmendpoints_operator import manifests, status
from llmendpoints_operator.config import OperatorSettings
from llmendpoints_operator.spec import InvalidSpecError, parse

SCHEMAS = pathlib.Path(__file__).parent / "schemas"
RELEASES = ("v1.0.0", "v1.6.0")
SETTINGS = OperatorSettings()
PICKER = {"name": "chat-epp", "port": {"number": 9002}}


def _schema(release: str) -> dict[str, Any]:
    return yaml.safe_load((SCHEMAS / f"inferencepool-{release}.yaml").read_text())


def _endpoint(pool: dict[str, Any] | None, name: str = "chat") -> Any:
    api = {} if pool is None else {"inferencePool": pool}
    return parse(name, "team", {"model": {"name": "org/m"}, "api": api})


def _walk(node: dict[str, Any], path: tuple[str, ...] = ()):
    yield path, node
    for key, child in (node.get("properties") or {}).items():
        yield from _walk(child, (*path, key))


def _cel_violations(schema: dict[str, Any], obj: dict[str, Any]) -> list[str]:
    """The schema's x-kubernetes-validations rules that `obj` breaks (where its field is set)."""
    import celpy  # cel-python: the test group's CEL runtime

    env = celpy.Environment()
    failed = []
    for path, node in _walk(schema):
        value: Any = obj
        for part in path:
            value = value.get(part) if isinstance(value, dict) else None
        if value is None:
            continue
        for rule in node.get("x-kubernetes-validations", []):
            program = env.program(env.compile(rule["rule"]))
            if not program.evaluate({"self": celpy.json_to_cel(value)}):
                failed.append(f"{'.'.join(path)}: {rule['message']}")
    return failed


def _schema_errors(release: str, obj: dict[str, Any]) -> list[str]:
    schema = _schema(release)
    # CRD schemas are OpenAPI 3.0 (JSON Schema draft 4 plus Kubernetes extensions).
    errors = [e.message for e in jsonschema.Draft4Validator(schema).iter_errors(obj)]
    return errors + _cel_violations(schema, obj)


# --- the spec ---------------------------------------------------------------------------------


def test_no_pool_unless_asked_or_defaulted() -> None:
    assert manifests.build_inference_pool(_endpoint(None), SETTINGS) is None
    assert manifests.build_inference_pool(_endpoint({"enabled": False}), SETTINGS) is None
    defaulted = OperatorSettings(inference_pool_default=True)
    assert manifests.build_inference_pool(_endpoint(None), defaulted) is not None
    assert manifests.build_inference_pool(_endpoint({}), defaulted) is not None
    # The endpoint's own word beats the operator's default, both ways.
    assert manifests.build_inference_pool(_endpoint({"enabled": False}), defaulted) is None
    assert manifests.build_inference_pool(_endpoint({"enabled": True}), SETTINGS) is not None


@pytest.mark.parametrize(
    ("pool", "problem"),
    [
        (
            {"enabled": True, "endpointPickerRef": {"name": "epp"}},
            "spec.api.inferencePool.endpointPickerRef.port: is required when kind is Service",
        ),
        (
            {"endpointPickerRef": {"name": "epp", "port": {"number": 0}}},
            "spec.api.inferencePool.endpointPickerRef.port.number:",
        ),
        (
            {"endpointPickerRef": {**PICKER, "failureMode": "Fail"}},
            "spec.api.inferencePool.endpointPickerRef.failureMode:",
        ),
        ({"enabled": "yes please"}, "spec.api.inferencePool.enabled:"),
        ({"enabled": True, "picker": "epp"}, "spec.api.inferencePool.picker: is not a field"),
    ],
)
def test_a_bad_pool_spec_names_the_field(pool: dict[str, Any], problem: str) -> None:
    with pytest.raises(InvalidSpecError) as caught:
        _endpoint(pool)
    assert any(str(p).startswith(problem) for p in caught.value.problems), caught.value


def test_a_picker_of_another_kind_needs_no_port() -> None:
    ref = {"name": "epp", "kind": "Backend", "group": "gateway.envoyproxy.io"}
    pool = manifests.build_inference_pool(
        _endpoint({"enabled": True, "endpointPickerRef": ref}), SETTINGS
    )
    assert pool is not None
    assert pool["spec"]["endpointPickerRef"] == {**ref, "failureMode": "FailClose"}


# --- the builder ------------------------------------------------------------------------------


def test_the_pool_selects_the_endpoints_pods_on_the_runtime_port() -> None:
    ep = _endpoint({"enabled": True, "endpointPickerRef": {**PICKER, "failureMode": "FailOpen"}})
    pool = manifests.build_inference_pool(ep, SETTINGS)
    assert pool is not None
    deployment = manifests.build_deployment(ep, SETTINGS, replicas=1)
    template = deployment["spec"]["template"]
    [container] = template["spec"]["containers"]
    assert (pool["apiVersion"], pool["kind"]) == ("inference.networking.k8s.io/v1", "InferencePool")
    assert pool["metadata"]["name"] == "chat" and pool["metadata"]["namespace"] == "team"
    # The pods the Deployment runs (and the Service selects), on the port the runtime listens on.
    selector = pool["spec"]["selector"]["matchLabels"]
    assert selector == deployment["spec"]["selector"]["matchLabels"]
    assert selector.items() <= template["metadata"]["labels"].items()
    assert pool["spec"]["targetPorts"] == [{"number": container["ports"][0]["containerPort"]}]
    assert pool["spec"]["endpointPickerRef"] == {
        "name": "chat-epp",
        "kind": "Service",
        "port": {"number": 9002},
        "failureMode": "FailOpen",
    }
    assert pool["metadata"]["labels"] == manifests.labels("chat")


@pytest.mark.parametrize("release", RELEASES)
def test_a_pool_with_a_picker_is_valid_in_every_v1_release(release: str) -> None:
    pool = manifests.build_inference_pool(
        _endpoint({"enabled": True, "endpointPickerRef": PICKER}), SETTINGS
    )
    assert _schema_errors(release, pool) == []


def test_a_pool_without_a_picker_needs_the_v1_6_crd() -> None:
    """Which is what the Rejected condition's hint tells the user."""
    pool = manifests.build_inference_pool(_endpoint({"enabled": True}), SETTINGS)
    assert "endpointPickerRef" not in pool["spec"]
    assert _schema_errors("v1.6.0", pool) == []
    assert _schema_errors("v1.0.0", pool) == ["'endpointPickerRef' is a required property"]


def test_the_schemas_catch_what_they_should() -> None:
    """The validation above can fail: broken pools are refused by the vendored schemas."""
    pool = manifests.build_inference_pool(
        _endpoint({"enabled": True, "endpointPickerRef": PICKER}), SETTINGS
    )
    no_port = copy.deepcopy(pool)
    del no_port["spec"]["endpointPickerRef"]["port"]
    assert _schema_errors("v1.6.0", no_port) == [
        "spec.endpointPickerRef: port is required when kind is 'Service' or unspecified "
        "(defaults to 'Service')"
    ]
    twice = copy.deepcopy(pool)
    twice["spec"]["targetPorts"] = [{"number": 8000}, {"number": 8000}]
    assert _schema_errors("v1.6.0", twice) == ["spec.targetPorts: port number must be unique"]
    bad_label = copy.deepcopy(pool)
    bad_label["spec"]["selector"]["matchLabels"]["x"] = "-bad-"
    assert len(_schema_errors("v1.6.0", bad_label)) == 1


def test_the_example_builds_a_valid_pool() -> None:
    doc = yaml.safe_load(
        (pathlib.Path(__file__).parents[3] / "examples/inference-pool.yaml").read_text()
    )
    ep = parse(doc["metadata"]["name"], "team", doc["spec"])
    pool = manifests.build_inference_pool(ep, SETTINGS)
    for release in RELEASES:
        assert _schema_errors(release, pool) == []


# --- the status report ------------------------------------------------------------------------


def _status(pool: status.InferencePoolState | None, previous: dict[str, Any] | None = None):
    ep = _endpoint({"enabled": True, "endpointPickerRef": PICKER})
    return status.compute(
        name="chat",
        namespace="team",
        endpoint=ep,
        invalid_message=None,
        observed=status.Observed(deployment=None, cache=status.CacheState()),
        previous=previous,
        now="2026-01-01T00:00:00Z",
        inference_pool=pool,
    )


def _condition(report: dict[str, Any]) -> dict[str, Any] | None:
    return next((c for c in report["conditions"] if c["type"] == "InferencePool"), None)


def test_a_created_pool_is_reported_by_name() -> None:
    pool = manifests.build_inference_pool(
        _endpoint({"enabled": True, "endpointPickerRef": PICKER}), SETTINGS
    )
    report = _status(status.pool_created(pool))
    assert report["inferencePool"] == "chat"
    condition = _condition(report)
    assert (condition["status"], condition["reason"]) == ("True", "Created")
    assert "port 8000" in condition["message"] and "Service chat-epp:9002" in condition["message"]
    assert report["phase"] == "Pending"  # the pool does not make the endpoint ready


@pytest.mark.parametrize(
    ("state", "reason", "words"),
    [
        (status.pool_api_missing(), "CRDNotInstalled", "not installed"),
        (
            status.pool_rejected("spec.endpointPickerRef: Required value", has_picker=False),
            "Rejected",
            "set spec.api.inferencePool.endpointPickerRef",
        ),
        (status.pool_forbidden("inferencepools is forbidden"), "Forbidden", "RBAC"),
    ],
)
def test_a_pool_that_could_not_be_written_says_why(
    state: status.InferencePoolState, reason: str, words: str
) -> None:
    report = _status(state)
    condition = _condition(report)
    assert (condition["status"], condition["reason"]) == ("False", reason)
    assert words in condition["message"]
    assert "inferencePool" not in report
    [event] = [e for e in status.transition_events({}, report) if "InferencePool" in e.reason]
    assert (event.type, event.reason) == ("Warning", f"InferencePool{reason}")


def test_no_pool_no_report_and_an_unknown_state_keeps_the_last_one() -> None:
    assert _condition(_status(status.NO_POOL)) is None
    created = _status(
        status.pool_created(
            manifests.build_inference_pool(
                _endpoint({"enabled": True, "endpointPickerRef": PICKER}), SETTINGS
            )
        )
    )
    # An operator that restarted has not reconciled the endpoint yet: the report stays.
    kept = _status(None, previous=created)
    assert _condition(kept) == _condition(created)
    assert kept["inferencePool"] == "chat"
    assert status.transition_events(created, kept) == []
    # Once the endpoint stops asking, the report goes.
    gone = _status(status.NO_POOL, previous=created)
    assert _condition(gone) is None and "inferencePool" not in gone
