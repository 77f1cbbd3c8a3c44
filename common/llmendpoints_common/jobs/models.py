"""What a client sends to the job API, validated, with messages that name the field.

A job request is ``{"input": {...}, "webhook"?: url, "policy"?: {"executionTimeout", "ttl"}}``.
``input`` is either a generation (``prompt`` or ``messages``, plus ``sampling_params`` and the
streaming batch knobs) or an OpenAI request (``openai_route`` + ``openai_input``, or
worker-vllm's newer ``route`` + ``body`` + ``method``). Unknown keys
are refused rather than ignored: a typo such as ``sampling_param`` must not silently fall back to
defaults. Sampling parameters themselves are checked against vLLM's ``SamplingParams`` by the
engine (``JobEngine.check_sampling_params`` in the runtime): only a process with an engine can
do that, so the gateway accepts a job that passes the checks here, and the worker that runs it
refuses the rest (the job ends ``FAILED`` with the engine's message, naming the field).

Shared by the runtime and the gateway: no engine and no web framework here.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import (
    AnyHttpUrl,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    model_validator,
)

from llmendpoints_common.errors import BadRequestError, describe_validation_errors
from llmendpoints_common.fair_use import DEFAULT_MAX_N, check_max_n, request_sequences


class JobStatus(enum.StrEnum):
    IN_QUEUE = "IN_QUEUE"
    IN_PROGRESS = "IN_PROGRESS"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    TIMED_OUT = "TIMED_OUT"

    @property
    def is_final(self) -> bool:
        return self in FINAL_STATUSES


FINAL_STATUSES = frozenset(
    {JobStatus.COMPLETED, JobStatus.FAILED, JobStatus.CANCELLED, JobStatus.TIMED_OUT}
)
RETRYABLE_STATUSES = frozenset({JobStatus.FAILED, JobStatus.TIMED_OUT})

# The OpenAI routes a job may call, and the HTTP method each one takes.
OPENAI_ROUTES: dict[str, str] = {
    "/v1/chat/completions": "POST",
    "/v1/completions": "POST",
    "/v1/embeddings": "POST",
    "/v1/models": "GET",
}

_STRICT = ConfigDict(extra="forbid", frozen=True)

# The fields of a chat message that vLLM 0.32's chat API knows (OpenAI's message types and
# vLLM's own CustomChatCompletionMessageParam; tests/unit/runtime checks the list against
# vLLM). vLLM drops any other field silently; a job refuses it, so a job cannot carry
# megabytes of fields nobody reads (and nothing is silently ignored).
MESSAGE_FIELDS = frozenset(
    {
        "role",
        "content",
        "name",
        "tool_call_id",
        "tool_calls",
        "function_call",
        "refusal",
        "audio",
        "reasoning",
        "reasoning_content",
        "tools",
        "task",
    }
)


class Message(BaseModel):
    """One chat message; content is text or OpenAI content parts, the other fields (tool
    calls, name, ...) as vLLM takes them (validated by vLLM)."""

    model_config = ConfigDict(extra="allow", frozen=True)

    role: StrictStr
    content: StrictStr | list[dict[str, Any]] | None = None


def check_message_fields(messages: list[Any], field: str) -> None:
    """400 naming the first message field vLLM's chat API does not know
    (``input.messages[2].extra``)."""
    for i, message in enumerate(messages):
        names = message if isinstance(message, Mapping) else (message.model_extra or {})
        for name in names:
            if name not in MESSAGE_FIELDS:
                path = f"{field}[{i}].{name}"
                raise BadRequestError(
                    f"{path}: unknown message field (vLLM's chat messages take "
                    f"{', '.join(sorted(MESSAGE_FIELDS))})",
                    param=path,
                )


class JobInput(BaseModel):
    model_config = _STRICT

    # The base model's served name or a LoRA adapter's (default: the base model).
    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[Message] | None = None
    apply_chat_template: StrictBool = False
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    stream: StrictBool = False
    max_batch_size: StrictInt | None = Field(default=None, ge=1)
    min_batch_size: StrictInt | None = Field(default=None, ge=1)
    batch_size_growth_factor: StrictInt | StrictFloat | None = Field(default=None, ge=1)
    openai_route: StrictStr | None = None
    openai_input: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_kind_of_work(self) -> JobInput:
        generation = self.prompt is not None or self.messages is not None
        if self.openai_route is not None:
            if generation:
                raise ValueError(
                    "openai_route cannot be combined with prompt/messages: send the OpenAI "
                    "request body in openai_input, or drop openai_route"
                )
            if self.model is not None:
                raise ValueError("model: with openai_route, set model inside openai_input")
            if self.openai_route not in OPENAI_ROUTES:
                raise ValueError(
                    f"openai_route {self.openai_route!r} is not one of {', '.join(OPENAI_ROUTES)}"
                )
            if OPENAI_ROUTES[self.openai_route] == "POST" and not self.openai_input:
                raise ValueError(f"openai_input is required for openai_route {self.openai_route}")
            return self
        if self.openai_input is not None:
            raise ValueError("openai_input needs openai_route (for example /v1/chat/completions)")
        if not generation:
            raise ValueError(
                "input needs prompt (a string) or messages (a list of chat messages), "
                "or openai_route + openai_input"
            )
        if self.messages is not None and not self.messages:
            raise ValueError("messages must not be empty")
        if (
            self.min_batch_size is not None
            and self.max_batch_size is not None
            and self.min_batch_size > self.max_batch_size
        ):
            raise ValueError(
                f"min_batch_size ({self.min_batch_size}) must not exceed "
                f"max_batch_size ({self.max_batch_size})"
            )
        return self

    @property
    def is_openai(self) -> bool:
        return self.openai_route is not None


# RunPod's documented ranges for a job's policy, in milliseconds.
MIN_EXECUTION_TIMEOUT_MS = 5_000
DEFAULT_EXECUTION_TIMEOUT_MS = 600_000
MIN_TTL_MS = 10_000
DEFAULT_TTL_MS = 24 * 3_600_000
MAX_POLICY_MS = 7 * 24 * 3_600_000


class Policy(BaseModel):
    model_config = _STRICT

    # How long the job may run once started (default 600 s). Range: 5 s to 7 days, or less
    # where the server's MAX_EXECUTION_TIMEOUT_MS says so (``JobLimits``).
    executionTimeout: StrictInt | None = Field(default=None, ge=1)
    # The job's whole life from submission: queued, running and its kept result never outlive
    # it (default 24 h). Range: 10 s to 7 days, or less (MAX_JOB_TTL_MS).
    ttl: StrictInt | None = Field(default=None, ge=1)
    # RunPod: a low-priority job does not trigger scaling. Here: it is not counted in
    # llmendpoints_queue_depth, so the autoscaler does not add replicas for it.
    lowPriority: StrictBool = False  # RunPod's spelling


class JobRequest(BaseModel):
    model_config = _STRICT

    input: JobInput
    webhook: AnyHttpUrl | None = None
    policy: Policy = Field(default_factory=Policy)


@dataclass(frozen=True)
class JobLimits:
    """What a job may ask for on this server (the runtime's settings; RunPod's ranges and
    MAX_N's default elsewhere). One place checks them: ``check_limits``."""

    max_n: int = DEFAULT_MAX_N
    max_execution_timeout_ms: int = MAX_POLICY_MS
    max_ttl_ms: int = MAX_POLICY_MS

    @property
    def default_execution_timeout_ms(self) -> int:
        return min(DEFAULT_EXECUTION_TIMEOUT_MS, self.max_execution_timeout_ms)

    @property
    def default_ttl_ms(self) -> int:
        return min(DEFAULT_TTL_MS, self.max_ttl_ms)


def _check_range(field: str, value: int | None, low: int, high: int, setting: str) -> None:
    if value is None or low <= value <= high:
        return
    raise BadRequestError(
        f"{field}: must be between {low} and {high} ms ({_duration(low)} to "
        f"{_duration(high)}{'' if high == MAX_POLICY_MS else ', ' + setting}), got {value}",
        param=field,
    )


def _duration(ms: int) -> str:
    for unit, size in (("days", 86_400_000), ("h", 3_600_000), ("min", 60_000), ("s", 1_000)):
        if ms >= size and ms % size == 0:
            return f"{ms // size} {unit}"
    return f"{ms} ms"


def check_limits(request: JobRequest, limits: JobLimits) -> None:
    """The job's policy within its ranges, ``n`` / ``best_of`` within MAX_N, and only message
    fields vLLM knows: 400 naming the field otherwise. The in-pod API, the gateway and the
    queue's workers all call this (``parse_job_request`` does)."""
    policy = request.policy
    _check_range(
        "policy.executionTimeout",
        policy.executionTimeout,
        MIN_EXECUTION_TIMEOUT_MS,
        limits.max_execution_timeout_ms,
        "MAX_EXECUTION_TIMEOUT_MS",
    )
    _check_range("policy.ttl", policy.ttl, MIN_TTL_MS, limits.max_ttl_ms, "MAX_JOB_TTL_MS")
    job_input = request.input
    if job_input.openai_input is not None and job_input.openai_route is not None:
        request_sequences(
            job_input.openai_route,
            job_input.openai_input,
            limits.max_n,
            prefix="input.openai_input.",
        )
        messages = job_input.openai_input.get("messages")
        if job_input.openai_route == "/v1/chat/completions" and isinstance(messages, list):
            check_message_fields(messages, "input.openai_input.messages")
    else:
        check_max_n(job_input.sampling_params, limits.max_n, prefix="input.sampling_params.")
        if job_input.messages is not None:
            check_message_fields(job_input.messages, "input.messages")


def job_sequences(request: JobRequest) -> int:
    """The engine sequences a job runs (after ``check_limits``): what it weighs in admission."""
    job_input = request.input
    if job_input.openai_input is not None and job_input.openai_route is not None:
        return request_sequences(job_input.openai_route, job_input.openai_input, 1 << 30)
    return check_max_n(job_input.sampling_params, 1 << 30)


def parse_json_object(body: bytes, *, what: str = "request body") -> dict[str, Any]:
    """Decode a request body into a JSON object, or raise BadRequestError saying what is wrong."""
    if not body.strip():
        raise BadRequestError(f"{what} is empty; expected a JSON object")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadRequestError(
            f"{what} is not valid UTF-8 (byte 0x{body[exc.start]:02x} at offset {exc.start})"
        ) from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise BadRequestError(
            f"{what} is not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})"
        ) from None
    except RecursionError:  # a 200,000-deep array: the parser's recursion gives out
        raise BadRequestError(f"{what} is nested too deeply") from None
    if not isinstance(value, dict):
        raise BadRequestError(f"{what} must be a JSON object, got {_json_type(value)}")
    return value


def parse_job_request(body: bytes, limits: JobLimits | None = None) -> JobRequest:
    """Validate a ``/run`` or ``/runsync`` body, within ``limits`` (default: RunPod's ranges
    and MAX_N's default)."""
    value = parse_json_object(body)
    if "input" not in value:
        raise BadRequestError(
            'input: required field is missing (expected {"input": {"prompt": ...}})',
            param="input",
        )
    if not isinstance(value["input"], dict):
        raise BadRequestError(
            f"input: must be a JSON object, got {_json_type(value['input'])}", param="input"
        )
    value = {**value, "input": worker_vllm_route_input(value["input"])}
    try:
        request = JobRequest.model_validate(value)
    except ValidationError as exc:
        message, field = describe_validation_errors(exc.errors(include_url=False))
        raise BadRequestError(message, param=field) from None
    check_limits(request, limits or JobLimits())
    return request


_ROUTE_KEYS = ("route", "body", "method")


def worker_vllm_route_input(job_input: dict[str, Any]) -> dict[str, Any]:
    """worker-vllm's newer spelling of an OpenAI job, ``{"route", "body"?, "method"?}``, as
    ``openai_route`` + ``openai_input`` (its default method: POST with a body, else GET)."""
    if not any(key in job_input for key in _ROUTE_KEYS):
        return job_input
    if "openai_route" in job_input or "openai_input" in job_input:
        raise BadRequestError(
            "input: send either route/body/method or openai_route/openai_input, not both",
            param="input.route",
        )
    route, body, method = (job_input.get(key) for key in _ROUTE_KEYS)
    if route is None:
        raise BadRequestError(
            "input.body: needs route (for example /v1/chat/completions)", param="input.body"
        )
    if not isinstance(route, str):
        raise BadRequestError(
            f"input.route: must be a string, got {_json_type(route)}", param="input.route"
        )
    if route not in OPENAI_ROUTES:
        raise BadRequestError(
            f"input.route: {route!r} is not one of {', '.join(OPENAI_ROUTES)}",
            param="input.route",
        )
    if method is not None and not isinstance(method, str):
        raise BadRequestError(
            f"input.method: must be a string, got {_json_type(method)}", param="input.method"
        )
    wanted = (method or ("POST" if body is not None else "GET")).upper()
    if wanted != OPENAI_ROUTES[route]:
        raise BadRequestError(
            f"input.method: {route} takes {OPENAI_ROUTES[route]}, not {wanted}",
            param="input.method",
        )
    rest = {k: v for k, v in job_input.items() if k not in _ROUTE_KEYS}
    return {**rest, "openai_route": route, "openai_input": body}


def _json_type(value: Any) -> str:
    match value:
        case None:
            return "null"
        case bool():
            return "a boolean"
        case int() | float():
            return "a number"
        case str():
            return "a string"
        case list():
            return "an array"
        case _:
            return type(value).__name__


_IMAGE_PART_TYPES = {"image_url", "input_image", "image", "image_pil", "image_embeds"}


def image_parts(messages: list[Any], field: str = "messages") -> list[str]:
    """Where chat messages carry images, as field paths (``messages[1].content[1]``)."""
    found = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") in _IMAGE_PART_TYPES:
                found.append(f"{field}[{i}].content[{j}]")
    return found
