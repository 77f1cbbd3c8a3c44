"""/openapi.json: one schema for the whole server -- vLLM's OpenAI operations and ours.

vLLM's app is built in-process once the model has loaded, so until then the schema holds our
operations only. Our routes document the error statuses they answer (``errors.error_responses``);
FastAPI's generated 422 is dropped, because validation errors are answered with 400 here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi


def openapi_builder(
    app: FastAPI, vllm_app: Callable[[], FastAPI | None]
) -> Callable[[], dict[str, Any]]:
    """``app.openapi``: our operations and, once ``vllm_app()`` exists (it is built in-process
    after the model loads), vLLM's own; cached from then on."""
    merged: dict[str, Any] | None = None

    def openapi() -> dict[str, Any]:
        nonlocal merged
        if merged is not None:
            return merged
        ours = get_openapi(title=app.title, version=_version(), routes=app.routes)
        theirs = vllm_app()
        if theirs is None:
            return merge_openapi(ours, None)
        hidden = [r.path for r in app.routes if not getattr(r, "include_in_schema", True)]
        merged = merge_openapi(ours, theirs.openapi(), shadowed=hidden)
        return merged

    return openapi


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
