"""Requests in vLLM's terms: its sampling parameters, its OpenAI request models, and the two
ways a request fails here -- the client's input (``EngineInputError``, a 400) or the engine's
death (``EngineDead``). ``job_engine.JobEngineAdapter`` puts the job API's words on them."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import msgspec
import pydantic


class EngineInputError(ValueError):
    """vLLM refused a request's input: the client's mistake (a 400), not a server fault.

    ``parameter`` is the request parameter vLLM blames, when it names one.
    """

    def __init__(self, message: str, parameter: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.parameter = parameter


class EngineDead(RuntimeError):
    """vLLM's engine core is gone; nothing more runs in this process."""


# SamplingParams fields that are engine plumbing, not sampling choices a client may set.
_INTERNAL_SAMPLING_FIELDS = frozenset(
    {
        "output_kind",
        "skip_clone",
        "output_text_buffer_length",
        "routed_experts_prompt_start",
        "trace_decode_token_ids",
        "detokenize",
        "stream_interval",
    }
)


@functools.cache
def sampling_param_names() -> frozenset[str]:
    """The SamplingParams fields a client may set."""
    from vllm.sampling_params import SamplingParams

    return frozenset(
        f
        for f in SamplingParams.__struct_fields__
        if not f.startswith("_") and f not in _INTERNAL_SAMPLING_FIELDS
    )


def build_sampling_params(params: Mapping[str, Any], *, final_only: bool | None = None) -> Any:
    """vLLM's SamplingParams from a dict of public fields; EngineInputError naming the one vLLM
    refuses. ``final_only``: one output at the end (True) or one per step (False)."""
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    try:
        sampling = msgspec.convert(dict(params), SamplingParams)
    except msgspec.ValidationError as exc:
        text = str(exc)
        name = text.rsplit("`$.", 1)[-1].split("`")[0].split(".")[0] if "`$." in text else None
        raise EngineInputError(text.split(" - at ")[0], name or None) from None
    except client_errors() as exc:
        raise EngineInputError(clean_message(exc), getattr(exc, "parameter", None)) from None
    if final_only is not None:
        sampling.output_kind = (
            RequestOutputKind.FINAL_ONLY if final_only else RequestOutputKind.DELTA
        )
    return sampling


def validate_openai_request(route: str, body: Mapping[str, Any]) -> None:
    """Check ``body`` against vLLM's request model for ``route`` (routes without one pass).

    pydantic's ValidationError for a wrong shape; EngineInputError for values pydantic lets
    through but SamplingParams refuses (``max_tokens: -1``, ``top_p: 5``), which the route
    itself would only refuse when called.
    """
    model = _openai_request_models().get(route)
    if model is None:
        return
    parsed = pydantic.TypeAdapter(model).validate_python(body)
    to_sampling_params = getattr(parsed, "to_sampling_params", None)
    if to_sampling_params is None or getattr(parsed, "use_beam_search", False):
        return
    max_tokens = getattr(parsed, "max_completion_tokens", None)
    if max_tokens is None:
        max_tokens = getattr(parsed, "max_tokens", None)
    try:
        to_sampling_params(16 if max_tokens is None else max_tokens, {})
    except client_errors() as exc:
        raise EngineInputError(clean_message(exc), getattr(exc, "parameter", None)) from None
    except Exception:  # anything else is left to the route itself
        return


def _openai_request_models() -> dict[str, Any]:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.pooling.embed.protocol import EmbeddingRequest

    return {
        "/v1/chat/completions": ChatCompletionRequest,
        "/v1/completions": CompletionRequest,
        "/v1/embeddings": EmbeddingRequest,
    }


def client_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean "the request is wrong" (a 400), not "the server broke"."""
    from vllm.exceptions import VLLMClientError

    return (ValueError, TypeError, VLLMClientError)


def clean_message(exc: BaseException) -> str:
    return str(exc).strip() or type(exc).__name__
