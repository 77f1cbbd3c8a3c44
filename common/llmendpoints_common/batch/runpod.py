"""RunPod's batch jobs, field for field, as its documentation has them (pure).

Followed: https://docs.runpod.io/serverless/batch-jobs (the runpod/docs repository,
``serverless/advanced-workflows/batch-jobs.mdx`` at a900806e). Routes, under
``/v2/{endpoint_id}``::

    POST   /batch                          create a DRAFT, optionally with requests
    POST   /batch/{id}/requests            append requests to a DRAFT ({"requests": [...]})
    POST   /batch/{id}/finalize            lock it; its requests start running
    PUT    /batch/{id}                     update attributes (the display name)
    DELETE /batch/{id}/requests/{req id}   remove one request from a DRAFT
    GET    /batch                          the endpoint's batches, newest first
    GET    /batch/{id}                     summary with request counts
    POST   /batch/{id}/cancel              queued requests are cancelled, running ones finish
    GET    /batch/{id}/requests            results, paged by ``offset`` and ``limit``

Each request has the shape of a ``/run`` body, ``{"input": {...}}``, and runs as a job of the
endpoint (same input checks, same outputs). Where the documentation leaves a choice, this
server's is written in docs/batch.md: the create body may also be an object
``{"requests": [...], "name"?, "webhook"?}`` (a name and a webhook at creation), ``PUT`` takes
``name`` and ``webhook``, and the webhook is posted once when the batch ends -- RunPod's terminal
states ``FAILED`` and ``CANCELLED``, and when every request has finished (``FINALIZED`` with
``requestCompleted + requestFailed == requestTotal``, RunPod's "all requests have finished").
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from llmendpoints_common.batch.limits import BatchLimits
from llmendpoints_common.errors import BadRequestError, describe_validation_errors
from llmendpoints_common.jobs.models import (
    JobLimits,
    JobRequest,
    check_limits,
    worker_vllm_route_input,
)

MAX_NAME_CHARS = 255
DEFAULT_PAGE = 50
MAX_PAGE = 1000
# A batch request's own policy: how long it may run. Its life is the batch's window, and it is
# below every interactive job already (policy.ttl and policy.lowPriority belong to the batch).
_REQUEST_KEYS = frozenset({"input", "policy"})


@dataclass(frozen=True)
class BatchCreate:
    requests: list[dict[str, Any]]
    name: str | None = None
    webhook: str | None = None


def _json_type(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean"}.get(
        type(value), "a number" if isinstance(value, int | float) else "null"
    )


def check_name(name: Any, field: str = "name") -> str | None:
    if name is None:
        return None
    if not isinstance(name, str) or len(name) > MAX_NAME_CHARS:
        raise BadRequestError(
            f"{field}: a string of at most {MAX_NAME_CHARS} characters", param=field
        )
    return name


def check_webhook_type(webhook: Any, field: str = "webhook") -> str | None:
    """The webhook's type; its destination is checked by the caller (DestinationPolicy)."""
    if webhook is None:
        return None
    if not isinstance(webhook, str) or not webhook.startswith(("http://", "https://")):
        raise BadRequestError(f"{field}: an http(s) URL", param=field)
    return webhook


def parse_requests(
    items: Any, limits: BatchLimits, job_limits: JobLimits | None, *, field: str
) -> list[dict[str, Any]]:
    """Each element checked as a ``/run`` body (``field[i].input...`` names the spot); the
    validated requests as JSON, ready to be stored."""
    if not isinstance(items, list):
        raise BadRequestError(f"{field}: must be an array of requests", param=field)
    requests = []
    for index, item in enumerate(items):
        where = f"{field}[{index}]"
        if not isinstance(item, dict):
            raise BadRequestError(
                f'{where}: must be an object like {{"input": {{...}}}}, got {_json_type(item)}',
                param=where,
            )
        for key in item:
            if key not in _REQUEST_KEYS:
                hint = " (a batch has one webhook: set it on the batch)" if key == "webhook" else ""
                raise BadRequestError(f"{where}.{key}: unknown field{hint}", param=f"{where}.{key}")
        if len(json.dumps(item)) > limits.max_line_bytes:
            raise BadRequestError(
                f"{where}: the request is larger than {limits.max_line_bytes} bytes "
                "(LLMEP_BATCH_MAX_LINE_BYTES)",
                param=where,
            )
        policy = item.get("policy")
        if isinstance(policy, dict):
            for key in policy:
                if key != "executionTimeout":
                    raise BadRequestError(
                        f"{where}.policy.{key}: a batch request takes policy.executionTimeout "
                        "only (its life is the batch's window; batches run below every job)",
                        param=f"{where}.policy.{key}",
                    )
        raw_input = item.get("input")
        if not isinstance(raw_input, dict):
            raise BadRequestError(f"{where}.input: required, a JSON object", param=f"{where}.input")
        try:
            value = {**item, "input": worker_vllm_route_input(raw_input)}
        except BadRequestError as exc:
            raise BadRequestError(f"{where}.{exc.message}", param=f"{where}.{exc.param}") from None
        try:
            request = JobRequest.model_validate(value)
        except ValidationError as exc:
            message, param = describe_validation_errors(exc.errors(include_url=False), prefix=where)
            raise BadRequestError(message, param=param) from None
        try:
            check_limits(request, job_limits or JobLimits())
        except BadRequestError as exc:
            raise BadRequestError(f"{where}.{exc.message}", param=f"{where}.{exc.param}") from None
        requests.append(request.model_dump(mode="json", exclude_none=True))
    return requests


def parse_create(body: Any, limits: BatchLimits, job_limits: JobLimits | None) -> BatchCreate:
    """``POST /v2/{endpoint}/batch``: an array of requests (RunPod), or an object with
    ``requests``, ``name`` and ``webhook``."""
    if isinstance(body, list):
        return BatchCreate(parse_requests(body, limits, job_limits, field="requests"))
    if not isinstance(body, dict):
        raise BadRequestError(
            'the body must be an array of requests ([{"input": {...}}, ...]) or an object '
            '{"requests": [...], "name"?, "webhook"?}'
        )
    for key in body:
        if key not in ("requests", "name", "webhook"):
            raise BadRequestError(f"{key}: unknown field", param=key)
    return BatchCreate(
        parse_requests(body.get("requests", []), limits, job_limits, field="requests"),
        name=check_name(body.get("name")),
        webhook=check_webhook_type(body.get("webhook")),
    )


def parse_append(body: Any, limits: BatchLimits, job_limits: JobLimits | None) -> list[dict]:
    """``POST /v2/{endpoint}/batch/{id}/requests``: ``{"requests": [...]}``."""
    if not isinstance(body, dict) or "requests" not in body:
        raise BadRequestError(
            'requests: required ({"requests": [{"input": {...}}, ...]})', param="requests"
        )
    for key in body:
        if key != "requests":
            raise BadRequestError(f"{key}: unknown field", param=key)
    return parse_requests(body["requests"], limits, job_limits, field="requests")


def parse_update(body: Any) -> dict[str, Any]:
    """``PUT /v2/{endpoint}/batch/{id}``: the attributes to change."""
    if not isinstance(body, dict):
        raise BadRequestError('the body must be an object such as {"name": "nightly"}')
    update: dict[str, Any] = {}
    for key, value in body.items():
        if key == "name":
            update["name"] = check_name(value)
        elif key == "webhook":
            update["webhook"] = check_webhook_type(value)
        else:
            raise BadRequestError(f"{key}: unknown field (name and webhook can be set)", param=key)
    return update


def page(query: dict[str, str]) -> tuple[int, int]:
    """``offset`` and ``limit`` of a results page."""

    def number(name: str, default: int, high: int | None) -> int:
        raw = query.get(name)
        if raw is None:
            return default
        if not (raw.isascii() and raw.isdigit()) or (
            high is not None and not 1 <= int(raw) <= high
        ):
            bound = f" from 1 to {high}" if high is not None else ""
            raise BadRequestError(f"{name}: a whole number{bound}, got {raw!r}", param=name)
        return int(raw)

    return number("offset", 0, None), number("limit", DEFAULT_PAGE, MAX_PAGE)
