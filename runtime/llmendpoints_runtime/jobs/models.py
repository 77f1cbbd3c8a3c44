"""What a client sends to the job API: the models are shared with the gateway
(``llmendpoints_common.jobs.models``); the checks that need the served model live here."""

from __future__ import annotations

from typing import Any

from llmendpoints_common.errors import BadRequestError, NotFoundError, ServiceUnavailableError
from llmendpoints_common.jobs.models import (
    FINAL_STATUSES,
    OPENAI_ROUTES,
    RETRYABLE_STATUSES,
    JobInput,
    JobRequest,
    JobStatus,
    Message,
    Policy,
    image_parts,
    parse_job_request,
    parse_json_object,
    worker_vllm_route_input,
)

from llmendpoints_runtime.jobs.port import ServedModels

__all__ = [
    "FINAL_STATUSES",
    "OPENAI_ROUTES",
    "RETRYABLE_STATUSES",
    "JobInput",
    "JobRequest",
    "JobStatus",
    "Message",
    "Policy",
    "check_model",
    "image_parts",
    "parse_job_request",
    "parse_json_object",
    "refuse_images_for_text_only",
    "requested_model",
    "worker_vllm_route_input",
]


def refuse_images_for_text_only(
    messages: list[Any], served: ServedModels, *, field: str = "messages"
) -> None:
    """A text-only model answers images with a 400 saying so -- before anything downloads
    the image (vLLM would fetch an https:// image first and fail later, or hang offline)."""
    if served.multimodal:
        return
    if images := image_parts(messages, field):
        raise BadRequestError(
            f"model {served.base[0]!r} is text-only and cannot take images "
            f"(image content at {', '.join(images)}); send text, or serve a multimodal model",
            param=images[0],
        )


def requested_model(job_input: JobInput) -> tuple[str | None, str]:
    """The model a job asks for, and the field it came from."""
    if job_input.is_openai:
        model = (job_input.openai_input or {}).get("model")
        return (model if isinstance(model, str) else None), "input.openai_input.model"
    return job_input.model, "input.model"


def check_model(job_input: JobInput, served: ServedModels) -> None:
    """404 for a model the endpoint does not serve; 503 (Retry-After) for a LoRA adapter that
    is declared but not loaded yet."""
    model, field = requested_model(job_input)
    if model is None or model in served.base or model in served.adapters:
        return
    if model in served.unavailable:
        why, retry_after = served.unavailable[model]
        raise ServiceUnavailableError(
            f"{field}: {why}", param=field, headers={"retry-after": str(retry_after)}
        )
    raise NotFoundError(
        f"{field}: the model {model!r} does not exist; served: "
        f"{', '.join((*served.base, *served.adapters))}",
        param=field,
    )
