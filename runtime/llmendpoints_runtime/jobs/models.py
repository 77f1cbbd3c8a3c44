"""What a client sends to the job API, validated, with messages that name the field.

A job request is ``{"input": {...}, "webhook"?: url, "policy"?: {"executionTimeout", "ttl"}}``.
``input`` is either a generation (``prompt`` or ``messages``, plus ``sampling_params`` and the
streaming batch knobs) or an OpenAI request (``openai_route`` + ``openai_input``). Unknown keys
are refused rather than ignored: a typo such as ``sampling_param`` must not silently fall back to
defaults. Sampling parameters themselves are checked against vLLM's ``SamplingParams`` by the
engine (see ``port.JobEngine.check_sampling_params``).
"""

from __future__ import annotations

import enum
import json
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

from llmendpoints_runtime.jobs.errors import InvalidRequest
from llmendpoints_runtime.jobs.port import ServedModels


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


class Message(BaseModel):
    """One chat message; content is text or OpenAI content parts (validated by vLLM)."""

    model_config = ConfigDict(extra="allow", frozen=True)

    role: StrictStr
    content: StrictStr | list[dict[str, Any]] | None = None


class JobInput(BaseModel):
    model_config = _STRICT

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


class Policy(BaseModel):
    model_config = _STRICT

    executionTimeout: StrictInt | None = Field(default=None, ge=1)
    ttl: StrictInt | None = Field(default=None, ge=1)
    # RunPod: a low-priority job does not trigger scaling. Here: it is not counted in
    # llmendpoints_queue_depth, so the autoscaler does not add replicas for it.
    lowPriority: StrictBool = False  # RunPod's spelling


class JobRequest(BaseModel):
    model_config = _STRICT

    input: JobInput
    webhook: AnyHttpUrl | None = None
    policy: Policy = Field(default_factory=Policy)


def describe_validation_error(exc: ValidationError, prefix: str = "") -> tuple[str, str | None]:
    """One readable sentence per problem, each naming the field (``input.prompt: ...``)."""
    parts: list[str] = []
    first_field: str | None = None
    for error in exc.errors(include_url=False):
        field = _field_path(prefix, error["loc"])
        first_field = first_field or field
        message = error["msg"].removeprefix("Value error, ")
        if error["type"] == "extra_forbidden":
            message = "unknown field (not part of the job API)"
        elif error["type"] == "missing":
            message = "required field is missing"
        parts.append(f"{field}: {message}")
    return "; ".join(dict.fromkeys(parts)), first_field


def _field_path(prefix: str, loc: tuple[int | str, ...]) -> str:
    """``("input", "messages", 1, "role")`` -> ``input.messages[1].role``."""
    path = prefix
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif "[" in part or part in _UNION_MEMBER_NAMES or part.startswith("function-"):
            continue  # pydantic names union members in loc; they are noise to a client
        else:
            path = f"{path}.{part}" if path else part
    return path or "body"


_UNION_MEMBER_NAMES = {"str", "int", "float", "bool", "dict", "list", "none"}


def parse_json_object(body: bytes, *, what: str = "request body") -> dict[str, Any]:
    """Decode a request body into a JSON object, or raise InvalidRequest saying what is wrong."""
    if not body.strip():
        raise InvalidRequest(f"{what} is empty; expected a JSON object")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequest(
            f"{what} is not valid UTF-8 (byte 0x{body[exc.start]:02x} at offset {exc.start})"
        ) from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidRequest(
            f"{what} is not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})"
        ) from None
    if not isinstance(value, dict):
        raise InvalidRequest(f"{what} must be a JSON object, got {_json_type(value)}")
    return value


def parse_job_request(body: bytes) -> JobRequest:
    """Validate a ``/run`` or ``/runsync`` body."""
    value = parse_json_object(body)
    if "input" not in value:
        raise InvalidRequest(
            'input: required field is missing (expected {"input": {"prompt": ...}})',
            param="input",
        )
    if not isinstance(value["input"], dict):
        raise InvalidRequest(
            f"input: must be a JSON object, got {_json_type(value['input'])}", param="input"
        )
    try:
        return JobRequest.model_validate(value)
    except ValidationError as exc:
        message, field = describe_validation_error(exc)
        raise InvalidRequest(message, param=field) from None


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


def refuse_images_for_text_only(
    messages: list[Any], served: ServedModels, *, field: str = "messages"
) -> None:
    """A text-only model answers images with a 400 saying so -- before anything downloads
    the image (vLLM would fetch an https:// image first and fail later, or hang offline)."""
    if served.multimodal:
        return
    if images := image_parts(messages, field):
        raise InvalidRequest(
            f"model {served.base[0]!r} is text-only and cannot take images "
            f"(image content at {', '.join(images)}); send text, or serve a multimodal model",
            param=images[0],
        )
