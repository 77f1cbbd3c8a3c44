"""The narrow engine interface the job API and the SageMaker routes depend on.

``job_engine.py`` implements it on ``engine/`` (the only package that imports vLLM); unit tests use a fake.
Prompt/messages jobs go straight to the engine -- rendered by vLLM's own chat/completion
preprocessing, sampled with vLLM's ``SamplingParams`` -- so a job costs what a
``/v1/completions`` request costs minus the OpenAI response formatting. ``openai_route`` jobs
and ``/invocations`` call vLLM's OpenAI app in-process (an ASGI call, no network hop).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any, Protocol

ASGIApp = Callable[
    [
        MutableMapping[str, Any],
        Callable[[], Awaitable[MutableMapping[str, Any]]],
        Callable[[MutableMapping[str, Any]], Awaitable[None]],
    ],
    Awaitable[None],
]


@dataclass(frozen=True)
class GenerationRequest:
    """A prompt/messages job as the engine sees it."""

    request_id: str
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    # Treat ``prompt`` as one user message and apply the chat template.
    apply_chat_template: bool = False
    sampling_params: Mapping[str, Any] = field(default_factory=dict)
    # True: one step per engine iteration (deltas). False: a single step at the end holding
    # everything -- what non-streamed jobs need, and far less work per token.
    stream: bool = True
    # Used when sampling_params has no max_tokens; the engine lowers it to what the
    # context window leaves after the prompt.
    default_max_tokens: int = 512
    # A served name: the base model (None: the same) or a loaded LoRA adapter.
    model: str | None = None
    # vLLM's request priority (lower runs first; a batch's requests run above 0).
    priority: int = 0


@dataclass(frozen=True)
class ChoiceDelta:
    """What one choice gained in one engine step."""

    index: int
    text: str
    token_count: int


@dataclass(frozen=True)
class GenerationStep:
    prompt_tokens: int
    choices: tuple[ChoiceDelta, ...]


@dataclass(frozen=True)
class EngineLoad:
    """Requests the engine is running and holding in its own waiting queue."""

    running: int
    waiting: int


@dataclass(frozen=True)
class ServedModels:
    base: tuple[str, ...]
    adapters: tuple[str, ...] = ()
    multimodal: bool = False
    # What the model serves: "generate" (chat, completions), "embed" (embeddings), ...
    tasks: tuple[str, ...] = ("generate",)
    # Declared LoRA adapters that do not serve yet: name -> (why, seconds until worth retrying).
    unavailable: Mapping[str, tuple[str, int]] = field(default_factory=dict)


class JobEngine(Protocol):
    def is_ready(self) -> bool: ...

    def draining(self) -> bool:
        """The process is shutting down: new jobs belong on another replica."""
        ...

    async def wait_ready(self) -> None:
        """Return once the engine serves; raise EngineUnavailable if it failed to start."""
        ...

    def check_sampling_params(self, params: Mapping[str, Any]) -> None:
        """Raise InvalidRequest (param ``input.sampling_params.<name>``) unless vLLM's
        SamplingParams accepts every name and value."""
        ...

    def check_openai_input(self, route: str, body: Mapping[str, Any] | None) -> None:
        """Raise InvalidRequest (param ``input.openai_input...``) unless vLLM's request model
        for ``route`` accepts ``body``."""
        ...

    def n_choices(self, params: Mapping[str, Any]) -> int:
        """How many choices (``n``) these sampling parameters ask for."""
        ...

    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationStep]:
        """The request's engine steps as deltas (one final step when not ``stream``). Raises InvalidRequest for input the
        engine refuses (prompt too long, no chat template, ...); closing the iterator aborts
        the engine request."""
        ...

    async def abort(self, request_id: str) -> None: ...

    def load(self) -> EngineLoad: ...

    def openai_app(self) -> ASGIApp:
        """vLLM's OpenAI app (valid once ready)."""
        ...

    def served_models(self) -> ServedModels: ...
