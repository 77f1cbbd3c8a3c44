"""Streaming batch sizes and the batches of a prompt/messages job (pure).

A streamed job publishes its tokens in batches whose size grows geometrically,
``min_batch_size * growth^k`` capped at ``max_batch_size`` (defaults 1, 3, 50: 1, 3, 9, 27, 50,
50, ...): the first token reaches the client at once, later ones in fewer, larger chunks.
A batch of size k holds k tokens of every choice. vLLM hands over one text piece per engine step,
usually one token; when the reader falls behind it merges steps, and a batch may then end a few
tokens past its size (never before it).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from llmendpoints_runtime.jobs.port import GenerationStep


@dataclass(frozen=True)
class BatchSchedule:
    min_size: int = 1
    growth: float = 3.0
    max_size: int = 50

    def __post_init__(self) -> None:
        if self.min_size < 1 or self.max_size < 1 or self.growth < 1:
            raise ValueError(f"invalid batch schedule {self}")
        if self.min_size > self.max_size:
            raise ValueError(f"min_size {self.min_size} exceeds max_size {self.max_size}")

    def sizes(self) -> Iterator[int]:
        """1, 3, 9, 27, 50, 50, ... for the defaults; never ends."""
        size = float(self.min_size)
        while True:
            yield min(math.ceil(size - 1e-9), self.max_size)
            if size < self.max_size:
                size *= self.growth


def resolve_schedule(
    *,
    max_batch_size: int | None,
    min_batch_size: int | None,
    growth: float | None,
    default_max: int,
    default_min: int,
    default_growth: float,
) -> BatchSchedule:
    """Per-request values override the environment defaults, each on its own.

    A per-request maximum below the default minimum lowers the minimum with it, so
    ``{"max_batch_size": 1}`` alone means "one token per batch" rather than an error.
    """
    max_size = max_batch_size if max_batch_size is not None else default_max
    min_size = min_batch_size if min_batch_size is not None else min(default_min, max_size)
    return BatchSchedule(
        min_size=min_size,
        growth=float(growth if growth is not None else default_growth),
        max_size=max_size,
    )


class TokenBatcher:
    """Groups engine steps into worker-vllm token batches.

    A batch is ``{"choices": [{"tokens": [text, ...]}, ...], "usage": {"input": n, "output": m}}``
    with one ``tokens`` list per choice (``n`` choices) and ``usage.output`` the number of tokens
    generated so far over all choices.
    """

    def __init__(self, n_choices: int, schedule: BatchSchedule) -> None:
        self._n = n_choices
        self._sizes = schedule.sizes()
        self._target = next(self._sizes)
        self._batch_tokens = 0  # tokens per choice in the open batch
        self._tokens: list[list[str]] = [[] for _ in range(n_choices)]
        self._input_tokens = 0
        self._output_tokens = 0

    def add(self, step: GenerationStep) -> dict[str, Any] | None:
        """Take one engine step; return a full batch when the current size is reached."""
        self._input_tokens = step.prompt_tokens
        for delta in step.choices:
            self._grow(delta.index)
            self._tokens[delta.index].append(delta.text)
            self._output_tokens += delta.token_count
        self._batch_tokens += max((d.token_count for d in step.choices), default=0)
        if self._batch_tokens < self._target:
            return None
        batch = self._take()
        self._target = next(self._sizes)
        return batch

    def flush(self) -> dict[str, Any] | None:
        """What is left at the end of the generation, if anything."""
        return self._take() if any(self._tokens) else None

    def _grow(self, index: int) -> None:
        while index >= len(self._tokens):  # n is known up front; this only guards bad input
            self._tokens.append([])

    def _take(self) -> dict[str, Any]:
        batch = {
            "choices": [{"tokens": tokens} for tokens in self._tokens],
            "usage": {"input": self._input_tokens, "output": self._output_tokens},
        }
        self._batch_tokens = 0
        self._tokens = [[] for _ in range(max(self._n, len(self._tokens)))]
        return batch


class TextCollector:
    """The output of a non-streamed job: one batch holding each choice's full text."""

    def __init__(self, n_choices: int) -> None:
        self._texts = [""] * n_choices
        self._input_tokens = 0
        self._output_tokens = 0

    def add(self, step: GenerationStep) -> None:
        self._input_tokens = step.prompt_tokens
        for delta in step.choices:
            while delta.index >= len(self._texts):
                self._texts.append("")
            self._texts[delta.index] += delta.text
            self._output_tokens += delta.token_count

    def result(self) -> dict[str, Any]:
        return {
            "choices": [{"tokens": [text]} for text in self._texts],
            "usage": {"input": self._input_tokens, "output": self._output_tokens},
        }
