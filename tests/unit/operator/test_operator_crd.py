"""The CRD is structural, documented, and agrees with the operator's typed spec and defaults."""

from __future__ import annotations

import itertools
import pathlib
from typing import Any

import jsonschema
import pytest
import yaml
from llmendpoints_operator import manifests, spec
from pydantic import BaseModel

REPO = pathlib.Path(__file__).resolve().parents[3]
CRD_PATH = REPO / "crds" / "llmendpoints.dev_llmendpoints.yaml"
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))


@pytest.fixture(scope="module")
def crd() -> dict[str, Any]:
    return yaml.safe_load(CRD_PATH.read_text())


@pytest.fixture(scope="module")
def version(crd: dict[str, Any]) -> dict[str, Any]:
    (only,) = crd["spec"]["versions"]
    return only


@pytest.fixture(scope="module")
def schema(version: dict[str, Any]) -> dict[str, Any]:
    return version["schema"]["openAPIV3Schema"]


def _walk(node: dict[str, Any], path: str = ""):
    yield path, node
    for name, child in (node.get("properties") or {}).items():
        yield from _walk(child, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        yield from _walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _walk(node["additionalProperties"], f"{path}{{}}")


def test_names_match_the_operator(crd: dict[str, Any], version: dict[str, Any]) -> None:
    names = crd["spec"]["names"]
    assert crd["metadata"]["name"] == f"{manifests.PLURAL}.{manifests.GROUP}"
    assert (crd["spec"]["group"], version["name"]) == (manifests.GROUP, manifests.VERSION)
    assert (names["kind"], names["plural"], names["shortNames"]) == (
        manifests.KIND,
        manifests.PLURAL,
        ["llmep"],
    )


def test_subresources_and_printer_columns(version: dict[str, Any]) -> None:
    assert version["subresources"]["status"] == {}
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.scaling.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    assert columns == [
        "Model", "Phase", "Ready", "Replicas", "Reason", "Cold-Start", "Nodes", "URL", "Age"
    ]  # fmt: skip
    by_name = {c["name"]: c for c in version["additionalPrinterColumns"]}
    # `kubectl get llmep -o wide` says why an endpoint is not ready (ScaledToZero, ...).
    assert by_name["Reason"]["jsonPath"] == '.status.conditions[?(@.type=="Ready")].reason'
    assert by_name["Cold-Start"]["jsonPath"] == ".status.autoscaling.coldStart.seconds"
    # Nodes per replica (-o wide): more than 1, Ready and Replicas count LeaderWorkerSet groups.
    assert (by_name["Nodes"]["jsonPath"], by_name["Nodes"]["priority"]) == (
        ".spec.resources.nodes",
        1,
    )


def test_schema_is_structural_and_documented(schema: dict[str, Any]) -> None:
    undocumented, untyped = [], []
    for path, node in _walk(schema):
        free = node.get("x-kubernetes-preserve-unknown-fields") or node.get(
            "x-kubernetes-int-or-string"
        )
        if "type" not in node and not free:
            untyped.append(path)
        # metadata is the API server's; list items and map values are described by their list/map.
        exempt = path == ".metadata" or path.endswith(("{}", "[]"))
        if not exempt and "description" not in node:
            undocumented.append(path)
    assert untyped == []
    assert undocumented == []


def _model_for(schema_path: list[str]) -> type[BaseModel]:
    model: type[BaseModel] = spec.EndpointSpec
    for part in schema_path:
        field = next(f for f in model.model_fields.values() if f.alias == part)
        model = _submodel(field.annotation)
    return model


def _submodel(annotation: Any) -> type[BaseModel]:
    for arg in [annotation, *getattr(annotation, "__args__", ())]:
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
        inner = getattr(arg, "__args__", ())
        for candidate in inner:
            if isinstance(candidate, type) and issubclass(candidate, BaseModel):
                return candidate
    raise AssertionError(f"no model in {annotation}")


def _object_nodes(schema: dict[str, Any]):
    """(path below spec, schema node) for every object node of the spec that has properties."""
    for path, node in _walk(schema["properties"]["spec"]):
        if node.get("properties") and "{}" not in path:
            yield [p for p in path.replace("[]", "").split(".") if p], node


def test_every_crd_field_is_a_spec_field_and_back(schema: dict[str, Any]) -> None:
    for path, node in _object_nodes(schema):
        model = _model_for(path)
        crd_fields = set(node["properties"])
        model_fields = {f.alias for f in model.model_fields.values()}
        assert crd_fields == model_fields, f"spec.{'.'.join(path)}"


def test_crd_defaults_agree_with_the_operator(schema: dict[str, Any]) -> None:
    checked = 0
    for path, node in _object_nodes(schema):
        model = _model_for(path)
        required = {f.alias for f in model.model_fields.values() if f.is_required()}
        assert set(node.get("required", [])) == required, f"spec.{'.'.join(path)}"
        for field in model.model_fields.values():
            if field.is_required():
                continue
            prop = node["properties"][field.alias]
            default = field.get_default(call_default_factory=True)
            if isinstance(default, BaseModel) or default in (None, {}, ()):
                # Nothing to default, or a nested object whose own fields carry the defaults.
                assert "default" not in prop, f"spec.{'.'.join([*path, field.alias])}"
                continue
            expected = list(default) if isinstance(default, tuple) else default
            assert prop.get("default") == expected, f"spec.{'.'.join([*path, field.alias])}"
            checked += 1
    assert checked >= 10  # the walk really visited the defaulted fields


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_example_validates_against_the_crd_schema(
    example: pathlib.Path, schema: dict[str, Any]
) -> None:
    doc = yaml.safe_load(example.read_text())
    # CRD schemas are OpenAPI 3.0: boolean exclusiveMinimum, i.e. JSON Schema draft 4.
    jsonschema.Draft4Validator(schema).validate(doc)
    assert doc["apiVersion"] == manifests.API_VERSION and doc["kind"] == manifests.KIND


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_example_is_a_valid_endpoint_for_the_operator(example: pathlib.Path) -> None:
    doc = yaml.safe_load(example.read_text())
    spec.parse(doc["metadata"]["name"], "default", doc["spec"])


def test_minimal_example_is_just_a_model_name() -> None:
    doc = yaml.safe_load((REPO / "examples" / "minimal.yaml").read_text())
    assert doc["spec"] == {"model": {"name": doc["spec"]["model"]["name"]}}


@pytest.mark.parametrize(
    "bad",
    [
        {"model": {}},
        {"model": {"name": "m"}, "scaling": {"minReplicas": -1}},
        {"model": {"name": "m"}, "resources": {"requests": {"memory": "12XB"}}},
        {"model": {"name": "m", "hfTokenSecretRef": {"name": "s"}}},
        {"model": {"name": "m"}, "engine": {"dtype": "int3"}},
        # Adapter names are DNS labels (clients send them as model; they label metrics).
        {"model": {"name": "m"}, "adapters": [{"name": "My_Adapter", "source": "o/a"}]},
        {"model": {"name": "m"}, "adapters": [{"name": "v1.2", "source": "o/a"}]},
        {"model": {"name": "m"}, "adapters": [{"name": "a" * 64, "source": "o/a"}]},
        {"model": {"name": "m"}, "adapters": [{"name": "a"}]},
        {"model": {"name": "m"}, "adapters": [{"name": "a", "source": "o/a", "rank": 0}]},
    ],
)
def test_schema_rejects_what_it_can_see(bad: dict[str, Any], schema: dict[str, Any]) -> None:
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft4Validator(schema["properties"]["spec"]).validate(bad)


def test_cel_rules_have_messages(schema: dict[str, Any]) -> None:
    rules = [rule for _, node in _walk(schema) for rule in node.get("x-kubernetes-validations", [])]
    assert len(rules) >= 6
    assert all(rule.get("message") for rule in rules)


# --- the CEL rules, evaluated with a CEL implementation (the API server is not available here) ---


def _rules(schema: dict[str, Any]) -> list[tuple[str, str]]:
    """(schema path, rule) for every x-kubernetes-validations rule."""
    return [
        (path, rule["rule"])
        for path, node in _walk(schema)
        for rule in node.get("x-kubernetes-validations", [])
    ]


def _at(doc: Any, path: str) -> Any:
    """The value a rule at `path` sees as `self`, or None when the path is absent."""
    for part in [p for p in path.split(".") if p]:
        if not isinstance(doc, dict) or part not in doc:
            return None
        doc = doc[part]
    return doc


def _violations(schema: dict[str, Any], doc: dict[str, Any]) -> list[str]:
    import celpy  # cel-python: the test group's CEL runtime

    env = celpy.Environment()
    failed = []
    for path, rule in _rules(schema):
        value = _at(doc, path)
        if value is None:
            continue  # the API server runs a rule only where its field is present
        program = env.program(env.compile(rule))
        if not program.evaluate({"self": celpy.json_to_cel(value)}):
            failed.append(f"{path or '<root>'}: {rule}")
    return failed


def test_cel_rules_compile(schema: dict[str, Any]) -> None:
    import celpy

    env = celpy.Environment()
    for _, rule in _rules(schema):
        env.compile(rule)


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_examples_pass_every_cel_rule(example: pathlib.Path, schema: dict[str, Any]) -> None:
    assert _violations(schema, yaml.safe_load(example.read_text())) == []


def _doc(spec: dict[str, Any], name: str = "demo") -> dict[str, Any]:
    return {"metadata": {"name": name}, "spec": {"model": {"name": "m"}, **spec}}


@pytest.mark.parametrize(
    ("doc", "rule_path"),
    [
        (_doc({"scaling": {"minReplicas": 3, "maxReplicas": 2}}), ".spec.scaling"),
        (_doc({"scaling": {"minReplicas": 1, "maxReplicas": 2, "replicas": 3}}), ".spec.scaling"),
        (_doc({"scaling": {"minReplicas": 2, "replicas": 1}}), ".spec.scaling"),
        (_doc({"scaling": {"replicas": 2}}), ".spec.scaling"),  # no max: fixed size 1
        (_doc({"cache": {"size": "1Gi", "existingClaim": "c"}}), ".spec.cache"),
        (_doc({"cache": {"accessModes": ["ReadWriteOnce"]}}), ".spec.cache"),
        (
            _doc(
                {
                    "api": {
                        "ingress": {"enabled": True, "tls": {"secretName": "t"}},
                        "allowUnauthenticated": True,
                    }
                }
            ),
            ".spec.api.ingress",
        ),
        # Published outside the cluster without keys (docs/security.md).
        (_doc({"api": {"service": {"type": "LoadBalancer"}}}), ".spec.api"),
        (_doc({"api": {"service": {"type": "NodePort"}}}), ".spec.api"),
        (_doc({"api": {"ingress": {"enabled": True}}}), ".spec.api"),
        (
            _doc({"api": {"ingress": {"enabled": True}, "allowUnauthenticated": False}}),
            ".spec.api",
        ),
        (_doc({"engine": {"tensorParallelSize": 4}, "resources": {"gpus": 2}}), ".spec"),
        # Every GPU of a replica holds a shard: tensor x pipeline x data = gpus x nodes.
        (_doc({"engine": {"tensorParallelSize": 2}, "resources": {"gpus": 4}}), ".spec"),
        (
            _doc({"engine": {"tensorParallelSize": 8}, "resources": {"gpus": 8, "nodes": 2}}),
            ".spec",
        ),
        (_doc({"engine": {"pipelineParallelSize": 3}, "resources": {"gpus": 8}}), ".spec"),
        (_doc({"engine": {"dataParallelSize": 4}, "resources": {"gpus": 8, "nodes": 8}}), ".spec"),
        (
            _doc({"engine": {"tensorParallelSize": 3}, "resources": {"gpus": 0, "nodes": 2}}),
            ".spec",
        ),
        # A multi-node endpoint's name prefixes its StatefulSets' pods: at most 42 characters.
        (_doc({"resources": {"gpus": 8, "nodes": 2}}, name="a" * 43), "<root>"),
        (_doc({"model": {"name": "m", "bakedIntoImage": True}}), ".spec"),
        (
            _doc(
                {
                    "model": {"name": "m", "bakedIntoImage": True},
                    "engine": {"image": "r/i:1"},
                    "cache": {"size": "1Gi"},
                }
            ),
            ".spec",
        ),
        # An endpoint picker Service without its port (InferencePool v1's own rule).
        (
            _doc({"api": {"inferencePool": {"enabled": True, "endpointPickerRef": {"name": "e"}}}}),
            ".spec.api.inferencePool.endpointPickerRef",
        ),
        (
            _doc(
                {"api": {"inferencePool": {"endpointPickerRef": {"name": "e", "kind": "Service"}}}}
            ),
            ".spec.api.inferencePool.endpointPickerRef",
        ),
        (_doc({}, name="Upper"), "<root>"),
        (_doc({}, name="a" * 50), "<root>"),
        (
            _doc(
                {"adapters": [{"name": "sql", "source": "o/a"}, {"name": "sql", "source": "o/b"}]}
            ),
            ".spec.adapters",
        ),
        # The base model's served name: metadata.name, or model.servedModelName when set.
        (_doc({"adapters": [{"name": "demo", "source": "o/a"}]}), "<root>"),
        (
            _doc(
                {
                    "model": {"name": "m", "servedModelName": "chat"},
                    "adapters": [{"name": "chat", "source": "o/a"}],
                }
            ),
            "<root>",
        ),
    ],
)
def test_cel_rules_reject_what_the_operator_rejects(
    doc: dict[str, Any], rule_path: str, schema: dict[str, Any]
) -> None:
    violations = _violations(schema, doc)
    assert [v.split(":")[0] for v in violations] == [rule_path]
    # The operator refuses the same spec (the CRD may be older than the operator, or absent).
    with pytest.raises(spec.InvalidSpecError):
        spec.parse(doc["metadata"]["name"], "ns", doc["spec"])


@pytest.mark.parametrize(
    "doc",
    [
        _doc({"scaling": {"minReplicas": 1, "maxReplicas": 4, "replicas": 4}}),
        _doc({"scaling": {"minReplicas": 3, "replicas": 3}}),
        _doc({"scaling": {"maxReplicas": 2}}),
        _doc({"engine": {"tensorParallelSize": 2}, "resources": {"gpus": 2}}),
        _doc({"engine": {"tensorParallelSize": 2}, "resources": {"gpus": 0}}),
        _doc({"resources": {"gpus": 8, "nodes": 2}}),  # tensor 8, pipeline 2 (derived)
        _doc({"engine": {"tensorParallelSize": 16}, "resources": {"gpus": 8, "nodes": 2}}),
        _doc({"engine": {"pipelineParallelSize": 4}, "resources": {"gpus": 8, "nodes": 2}}),
        _doc(
            {
                "engine": {"dataParallelSize": 16, "enableExpertParallel": True},
                "resources": {"gpus": 8, "nodes": 2},
            }
        ),
        _doc({"engine": {"dataParallelSize": 2}, "resources": {"gpus": 8}}),  # tensor 4
        _doc({"resources": {"gpus": 0, "nodes": 2}}),  # a CPU group: pipeline 2
        _doc({"resources": {"gpus": 8, "nodes": 2}}, name="a" * 42),
        _doc({"cache": {"existingClaim": "c"}}),
        _doc({"model": {"name": "m", "bakedIntoImage": True}, "engine": {"image": "r/i:1"}}),
        _doc(
            {
                "model": {"name": "m", "servedModelName": "chat"},
                "adapters": [
                    {"name": "demo", "source": "org/demo-lora", "revision": "v1", "rank": 16},
                    {"name": "sql", "source": "/models/adapters/sql"},
                ],
            }
        ),
        _doc({"api": {"service": {"type": "ClusterIP"}, "ingress": {"enabled": False}}}),
        _doc(
            {
                "api": {
                    "service": {"type": "LoadBalancer"},
                    "apiKeysSecretRef": {"name": "k", "key": "keys"},
                }
            }
        ),
        _doc({"api": {"ingress": {"enabled": True}, "allowUnauthenticated": True}}),
        # A picker of another kind needs no port (only a Service's is required).
        _doc(
            {
                "api": {
                    "inferencePool": {
                        "enabled": True,
                        "endpointPickerRef": {"name": "e", "kind": "Backend", "group": "x.io"},
                    }
                }
            }
        ),
    ],
)
def test_cel_rules_accept_valid_specs(doc: dict[str, Any], schema: dict[str, Any]) -> None:
    assert _violations(schema, doc) == []
    spec.parse(doc["metadata"]["name"], "ns", doc["spec"])


@pytest.mark.parametrize(
    "adapter",
    [
        {"name": "My_Adapter", "source": "o/a"},
        {"name": "v1.2", "source": "o/a"},
        {"name": "a" * 64, "source": "o/a"},
        {"name": "a", "source": "o/a", "rank": 0},
    ],
)
def test_the_operator_refuses_adapters_the_schema_refuses(adapter: dict[str, Any]) -> None:
    with pytest.raises(spec.InvalidSpecError) as info:
        spec.parse("demo", "ns", {"model": {"name": "m"}, "adapters": [adapter]})
    assert str(info.value).startswith("spec.adapters[0].")


def test_scale_to_zero_is_left_to_the_operator(schema: dict[str, Any]) -> None:
    """Only the operator knows whether a gateway holds requests: the CRD accepts minReplicas 0,
    the operator refuses it without LLMEP_OPERATOR_GATEWAY_URL and takes it with."""
    doc = _doc({"scaling": {"minReplicas": 0, "maxReplicas": 2, "scaleToZeroAfterSeconds": 60}})
    assert _violations(schema, doc) == []
    with pytest.raises(spec.InvalidSpecError, match="LLMEP_OPERATOR_GATEWAY_URL"):
        spec.parse("demo", "ns", doc["spec"])
    assert spec.parse("demo", "ns", doc["spec"], scale_to_zero=True).spec.scaling.min_replicas == 0


def _sizes_spec(gpus: int, nodes: int, t: int | None, p: int | None, d: int | None) -> dict:
    engine = {
        key: value
        for key, value in (
            ("tensorParallelSize", t),
            ("pipelineParallelSize", p),
            ("dataParallelSize", d),
        )
        if value is not None
    }
    return {"model": {"name": "m"}, "resources": {"gpus": gpus, "nodes": nodes}, "engine": engine}


def test_the_parallelism_rules_agree_with_the_operator_on_every_combination(
    schema: dict[str, Any],
) -> None:
    """The CEL rules at .spec and parallelism.derive accept and refuse exactly the same sizes
    (the CRD in the cluster checks at `kubectl apply`, the operator again at every reconcile)."""
    import celpy

    env = celpy.Environment()
    programs = [
        env.program(env.compile(rule["rule"]))
        for rule in schema["properties"]["spec"]["x-kubernetes-validations"]
    ]
    checked = refused = 0
    for gpus, nodes, t, p, d in itertools.product(
        (0, 1, 8), (1, 2, 4), (None, 1, 2, 8, 16), (None, 1, 2), (None, 1, 2, 16)
    ):
        doc = _sizes_spec(gpus, nodes, t, p, d)
        cel_ok = all(program.evaluate({"self": celpy.json_to_cel(doc)}) for program in programs)
        try:
            spec.parse("demo", "ns", doc)
            operator_ok = True
        except spec.InvalidSpecError:
            operator_ok = False
        assert cel_ok == operator_ok, (gpus, nodes, t, p, d)
        checked += 1
        refused += not operator_ok
    assert 0 < refused < checked


def test_a_mismatch_at_kubectl_apply_names_the_sizes(schema: dict[str, Any]) -> None:
    """The messageExpression: the API server's answer says which sizes were seen."""
    import celpy

    [rule] = [
        rule
        for rule in schema["properties"]["spec"]["x-kubernetes-validations"]
        if "messageExpression" in rule
    ]
    env = celpy.Environment()
    doc = _sizes_spec(8, 2, 8, None, None)
    message = env.program(env.compile(rule["messageExpression"])).evaluate(
        {"self": celpy.json_to_cel(doc)}
    )
    assert str(message) == (
        "engine: tensorParallelSize 8 x pipelineParallelSize 1 x dataParallelSize 1 must multiply "
        "to resources.gpus 8 x resources.nodes 2 = 16 (every GPU of a replica holds one shard)"
    )


def _pruned(value: Any, node: dict[str, Any], path: str = "") -> list[str]:
    """The paths of `value` the API server would prune under the structural schema `node`."""
    if node.get("x-kubernetes-preserve-unknown-fields"):
        return []
    if isinstance(value, dict):
        props = node.get("properties")
        extra = node.get("additionalProperties")
        out = []
        for key, child in value.items():
            if props is not None and key in props:
                out += _pruned(child, props[key], f"{path}.{key}")
            elif isinstance(extra, dict):
                out += _pruned(child, extra, f"{path}.{key}")
            else:
                out.append(f"{path}.{key}")
        return out
    if isinstance(value, list) and isinstance(node.get("items"), dict):
        return [p for item in value for p in _pruned(item, node["items"], f"{path}[]")]
    return []


def test_a_multi_node_status_survives_the_schema(schema: dict[str, Any]) -> None:
    """Everything the operator writes in a multi-node endpoint's status is in the CRD's status
    schema (the API server silently prunes what is not)."""
    from llmendpoints_operator import groups, status

    ep = spec.parse("big", "ns", {"model": {"name": "m"}, "resources": {"gpus": 8, "nodes": 2}})
    pod = groups.UnreadyPod(1, 1, "big-group-1-1", "gpu-7", "OOMKilled", "exit code 137")
    state = status.DeploymentState.from_leader_worker_set(
        {
            "spec": {"replicas": 2, "leaderWorkerTemplate": {"size": 2}},
            "status": {"readyReplicas": 1},
        }
    )
    written = status.compute(
        name="big",
        namespace="ns",
        endpoint=ep,
        invalid_message=None,
        observed=status.Observed(
            deployment=state,
            cache=status.CacheState(),
            unready=(pod,),
            workload_problem=status.groups_api_missing(2),
        ),
        previous=None,
        now="2026-01-01T00:00:00Z",
        observed_generation=1,
    )
    assert written["groups"]["lastFailure"]["node"] == "gpu-7"
    assert _pruned(written, schema["properties"]["status"]) == []
