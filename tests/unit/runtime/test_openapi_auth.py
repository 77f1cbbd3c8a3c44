"""/openapi.json documents what the front door answers: 401 on every route that checks a key,
403 on every engine-control route. schemathesis over the schema found three operations
(/kv_event_sources, /scale_elastic_ep, /is_scaling_elastic_ep) answering an undocumented 403.

The schema here is vLLM 0.32's own app with every route switched on (as test_control_routes.py
builds it), merged with ours exactly as the runtime serves it."""

from __future__ import annotations

import types

import pytest
from llmendpoints_runtime.control_routes import CONTROL_ROUTES, is_control_path
from llmendpoints_runtime.openapi import (
    HTTP_METHODS,
    document_auth,
    merge_openapi,
    openapi_builder,
)
from test_control_routes import _ARGS, _ENV

OPEN = frozenset({"/health", "/ready", "/ping", "/metrics"})  # UNAUTHENTICATED_PATHS' default


@pytest.fixture(scope="module")
def schema() -> dict:
    from llmendpoints_runtime.engine import build_arg_parser
    from vllm.entrypoints.launchers.app import build_app
    from vllm.tasks import FRONTEND_TASKS, GENERATION_TASKS, POOLING_TASKS

    with pytest.MonkeyPatch.context() as patch:
        for name, value in _ENV.items():
            patch.setenv(name, value)
        model_config = types.SimpleNamespace(
            get_pooling_task=lambda tasks: "embed",
            hf_config=types.SimpleNamespace(num_labels=1),
        )
        app = build_app(
            build_arg_parser().parse_args(_ARGS),
            (*GENERATION_TASKS, *POOLING_TASKS, *FRONTEND_TASKS),
            model_config,
        )
        theirs = app.openapi()
    ours = {
        "openapi": "3.1.0",
        "info": {"title": "LLM Endpoints runtime", "version": "1"},
        "paths": {
            "/ready": {"get": {"responses": {"200": {}}}},
            "/run": {"post": {"responses": {"200": {}, "401": {"description": "ours"}}}},
        },
        "components": {"schemas": {"ErrorBody": {"type": "object"}}},
    }
    return document_auth(merge_openapi(ours, theirs, shadowed=["/health"]), OPEN, is_control_path)


def _operations(schema: dict):
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            if method in HTTP_METHODS:
                yield path, method, operation


def test_the_three_operations_schemathesis_found_document_their_403(schema):
    for path in ("/kv_event_sources", "/scale_elastic_ep", "/is_scaling_elastic_ep"):
        assert path in schema["paths"], path
        for method, operation in schema["paths"][path].items():
            assert "403" in operation["responses"], (path, method)
            assert "401" in operation["responses"], (path, method)


def test_every_control_route_documents_403_and_no_other_route_does(schema):
    documented = {p for p, _, op in _operations(schema) if "403" in op["responses"]}
    control = {p for p in schema["paths"] if is_control_path(p)}
    assert control and documented == control
    # Every control route vLLM's app has (every switch on) is in the schema.
    assert {p for p in CONTROL_ROUTES if "{" not in p} - {"/adapters"} <= set(schema["paths"])


def test_every_route_but_the_open_ones_documents_401_and_the_key_headers(schema):
    for path, method, operation in _operations(schema):
        if path in OPEN:
            assert "401" not in operation["responses"], path
            assert "security" not in operation
        else:
            assert "401" in operation["responses"], (path, method)
            assert operation["security"] == [{"bearer": []}, {"apiKey": []}, {}]
    schemes = schema["components"]["securitySchemes"]
    assert schemes["bearer"]["scheme"] == "bearer" and schemes["apiKey"]["name"] == "x-api-key"
    # An error body the schema defines; a route's own 401 description is kept.
    unauthorized = schema["paths"]["/v1/chat/completions"]["post"]["responses"]["401"]
    assert unauthorized["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorBody")
    assert "ErrorBody" in schema["components"]["schemas"]
    assert schema["paths"]["/run"]["post"]["responses"]["401"] == {"description": "ours"}


def test_an_operation_the_served_model_cannot_serve_is_left_out():
    """vLLM's /v1/systemone answers 501 for a model without structured decisions (schemathesis
    found it in the runtime's schema: tests/runtime/test_openapi_schemathesis.py)."""
    from fastapi import FastAPI

    def vllm_app(supported: bool) -> FastAPI:
        theirs = FastAPI()
        theirs.post("/v1/systemone")(lambda: None)
        theirs.post("/v1/completions")(lambda: None)
        theirs.state.serving_structured_decisions = object() if supported else None
        return theirs

    for supported in (False, True):
        built = vllm_app(supported)
        schema = openapi_builder(FastAPI(), lambda built=built: built)()
        assert ("/v1/systemone" in schema["paths"]) is supported
        assert "/v1/completions" in schema["paths"]
