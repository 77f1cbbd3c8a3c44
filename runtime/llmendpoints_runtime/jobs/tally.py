"""What a job's attempt has used so far, counted as the engine produces it (pure).

A job stopped before its end (``policy.executionTimeout``, ``policy.ttl``, ``/cancel``) has no
output to read its usage from, yet the engine read its prompt and generated tokens up to the
stop: that is what it is billed. Counted as vLLM counts them:

- prompt/messages jobs: every engine step carries the prompt's token count and each choice's
  new tokens (``GenerationStep``), streamed or not (a non-streamed job's adapter reports the
  prompt before generating, so a job stopped mid-way bills at least its prompt);
- ``openai_route`` streams: the latest ``usage`` a chunk carries (vLLM's cumulative counts,
  with ``stream_options.include_usage`` / ``continuous_usage_stats``), otherwise one token per
  choice delta that carries text -- vLLM sends one chunk per engine step and choice. Their prompt
  is counted only when a chunk carries usage; a non-streamed route answer is counted only when
  it is complete (it is then the job's output).
"""

from __future__ import annotations

from typing import Any

from llmendpoints_common.jobs.record import JobUsage

from llmendpoints_runtime.jobs.port import GenerationStep

# Fields of a streamed choice that carry generated tokens (chat deltas, completions' text).
_DELTA_FIELDS = ("content", "reasoning_content", "reasoning", "tool_calls")


class UsageTally:
    def __init__(self) -> None:
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self._reported = False  # a chunk carried vLLM's own usage: it is the count

    def step(self, step: GenerationStep) -> None:
        self.prompt_tokens = max(self.prompt_tokens, step.prompt_tokens)
        self.completion_tokens += sum(delta.token_count for delta in step.choices)

    def openai_chunk(self, chunk: Any) -> None:
        """One streamed OpenAI event, parsed (a dict; anything else counts nothing)."""
        if not isinstance(chunk, dict):
            return
        usage = chunk.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            prompt = usage.get("prompt_tokens")
            self.prompt_tokens = prompt if isinstance(prompt, int) else self.prompt_tokens
            self.completion_tokens = max(0, usage["completion_tokens"])
            self._reported = True
            return
        if self._reported:
            return
        choices = chunk.get("choices")
        for choice in choices if isinstance(choices, list) else ():
            if isinstance(choice, dict) and _carries_tokens(choice):
                self.completion_tokens += 1

    def usage(self) -> JobUsage:
        return JobUsage(
            prompt_tokens=max(0, self.prompt_tokens),
            completion_tokens=max(0, self.completion_tokens),
        )


def _carries_tokens(choice: dict[str, Any]) -> bool:
    if choice.get("text"):
        return True
    delta = choice.get("delta")
    return isinstance(delta, dict) and any(delta.get(name) for name in _DELTA_FIELDS)
