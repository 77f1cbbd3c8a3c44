"""/openapi.json: one schema for the whole server -- vLLM's OpenAI operations and ours.

vLLM's app is built in-process once the model has loaded, so until then the schema holds our
operations only. Our routes document the error statuses they answer (``errors.error_responses``);
FastAPI's generated 422 is dropped, because validation errors are answered with 400 here.

What the front door adds to every route is documented on every route it applies to
(``document_auth``): 401 wherever a key is checked (every path but UNAUTHENTICATED_PATHS), 403 on
vLLM's engine-control routes (admin keys only), and the two ways to send a key as security
schemes. Without that, a client generated from the schema (or schemathesis) meets statuses the
schema says cannot happen.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

HTTP_METHODS = frozenset({"get", "put", "post", "delete", "options", "head", "patch", "trace"})
ERROR_SCHEMA = {"$ref": "#/components/schemas/ErrorBody"}
UNAUTHORIZED = {
    "description": "Missing or wrong API key (when the server has keys: API_KEYS, "
    "API_KEYS_FILE, ADMIN_API_KEYS...)",
    "content": {"application/json": {"schema": ERROR_SCHEMA}},
}
FORBIDDEN = {
    "description": "One of vLLM's engine-control routes: admin keys only (ADMIN_API_KEYS, "
    "ADMIN_API_KEYS_FILE); closed to everyone when the server has none",
    "content": {"application/json": {"schema": ERROR_SCHEMA}},
}
SECURITY_SCHEMES = {
    "bearer": {"type": "http", "scheme": "bearer", "description": "Authorization: Bearer <key>"},
    "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"},
}


def openapi_builder(
    app: FastAPI,
    vllm_app: Callable[[], FastAPI | None],
    unauthenticated: frozenset[str] = frozenset(),
    is_control: Callable[[str], bool] = lambda path: False,
) -> Callable[[], dict[str, Any]]:
    """``app.openapi``: our operations and, once ``vllm_app()`` exists (it is built in-process
    after the model loads), vLLM's own; cached from then on. ``unauthenticated``: the paths
    that never need a key (UNAUTHENTICATED_PATHS); ``is_control``: whether a path is one of
    vLLM's engine-control routes (control_routes.is_control_path)."""
    merged: dict[str, Any] | None = None

    def openapi() -> dict[str, Any]:
        nonlocal merged
        if merged is not None:
            return merged
        ours = get_openapi(title=app.title, version=_version(), routes=app.routes)
        theirs = vllm_app()
        if theirs is None:
            return document_auth(merge_openapi(ours, None), unauthenticated, is_control)
        hidden = [r.path for r in app.routes if not getattr(r, "include_in_schema", True)]
        left_out = [*hidden, *unserved_paths(theirs)]
        merged = document_auth(
            merge_openapi(ours, theirs.openapi(), shadowed=left_out), unauthenticated, is_control
        )
        return merged

    return openapi


# vLLM routes every model gets but a model without the feature answers 501 ("The model does
# not support the structured decision API"): path -> the attribute of vLLM's app state that is
# None for such a model. Documented, such an operation could only ever fail; so it is left out
# of this model's schema (it still answers its 501).
UNSERVED_WITHOUT = {"/v1/systemone": "serving_structured_decisions"}


def unserved_paths(vllm_app: FastAPI) -> list[str]:
    """vLLM's paths the served model cannot serve (``UNSERVED_WITHOUT``)."""
    state = vllm_app.state
    return [path for path, name in UNSERVED_WITHOUT.items() if getattr(state, name, None) is None]


def document_auth(
    doc: dict[str, Any],
    unauthenticated: Iterable[str],
    is_control: Callable[[str], bool],
) -> dict[str, Any]:
    """The schema with the front door's answers on every operation they apply to (pure).

    401 and the key's security schemes on every path that needs a key when keys are configured
    (all but ``unauthenticated``); 403 on every engine-control route, whoever calls it. An
    operation that documents its own 401/403 keeps its description."""
    open_paths = set(unauthenticated)
    paths: dict[str, Any] = {}
    for path, operations in (doc.get("paths") or {}).items():
        guarded = path not in open_paths
        control = is_control(path)
        documented = {}
        for method, operation in operations.items():
            if method not in HTTP_METHODS or not isinstance(operation, dict):
                documented[method] = operation
                continue
            operation = dict(operation)
            responses = dict(operation.get("responses") or {})
            if guarded:
                responses.setdefault("401", UNAUTHORIZED)
                # Any one of the two headers; none at all on a server without keys.
                operation["security"] = [{"bearer": []}, {"apiKey": []}, {}]
            if control:
                responses.setdefault("403", FORBIDDEN)
            operation["responses"] = responses
            documented[method] = operation
        paths[path] = documented
    components = dict(doc.get("components") or {})
    components["securitySchemes"] = {**components.get("securitySchemes", {}), **SECURITY_SCHEMES}
    return {**doc, "paths": paths, "components": components}


def merge_openapi(
    ours: dict[str, Any], theirs: dict[str, Any] | None, *, shadowed: Iterable[str] = ()
) -> dict[str, Any]:
    """Our schema with vLLM's operations added (pure).

    Where both have a path (``/invocations``) ours answers, so ours is kept; ``shadowed`` are
    paths ours answers without documenting them (probes: ``/health``, ``/ping``...), where
    vLLM's description would be of a route nobody reaches.
    Request bodies our routes document themselves carry pydantic's ``$defs``: they move to
    ``components``. FastAPI's generated 422 is dropped: validation errors here are 400s.
    """
    result = dict(theirs or {})
    result["openapi"] = ours.get("openapi", result.get("openapi"))
    result["info"] = {**(result.get("info") or {}), **ours["info"]}
    components = dict(result.get("components") or {})
    schemas = {**components.get("schemas", {}), **ours.get("components", {}).get("schemas", {})}
    paths = {p: ops for p, ops in (result.get("paths") or {}).items() if p not in set(shadowed)}
    for path, operations in ours.get("paths", {}).items():
        cleaned = {}
        for method, operation in operations.items():
            operation = dict(operation)
            operation["responses"] = {
                k: v for k, v in operation.get("responses", {}).items() if k != "422"
            }
            body_schema = (
                operation.get("requestBody", {}).get("content", {}).get("application/json", {})
            ).get("schema")
            if isinstance(body_schema, dict) and "$defs" in body_schema:
                body_schema = dict(body_schema)
                schemas.update(body_schema.pop("$defs"))
                operation["requestBody"] = {
                    **operation["requestBody"],
                    "content": {"application/json": {"schema": body_schema}},
                }
            cleaned[method] = operation
        paths[path] = cleaned
    result["paths"] = paths
    result["components"] = {**components, "schemas": schemas}
    return result


def _version() -> str:
    try:
        return version("llmendpoints")
    except PackageNotFoundError:
        return "0"
