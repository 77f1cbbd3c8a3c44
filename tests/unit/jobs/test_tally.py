"""What a stopped job's attempt used, counted as vLLM counts it (jobs/tally.py)."""

from llmendpoints_common.jobs.record import JobUsage
from llmendpoints_runtime.jobs.port import ChoiceDelta, GenerationStep
from llmendpoints_runtime.jobs.tally import UsageTally


def test_engine_steps_count_the_prompt_and_every_choices_tokens() -> None:
    tally = UsageTally()
    tally.step(GenerationStep(prompt_tokens=9, choices=()))  # a non-streamed job's first word
    assert tally.usage() == JobUsage(prompt_tokens=9, completion_tokens=0)
    tally.step(GenerationStep(9, (ChoiceDelta(0, "a", 1), ChoiceDelta(1, "bc", 2))))
    tally.step(GenerationStep(9, (ChoiceDelta(0, "d", 1),)))
    assert tally.usage() == JobUsage(prompt_tokens=9, completion_tokens=4)


def test_openai_chunks_count_one_token_per_delta_until_vllm_reports_usage() -> None:
    tally = UsageTally()
    tally.openai_chunk({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
    tally.openai_chunk({"choices": [{"index": 0, "delta": {"content": "Hi"}}]})
    tally.openai_chunk({"choices": [{"index": 0, "delta": {"reasoning_content": "hm"}}]})
    tally.openai_chunk({"choices": [{"index": 0, "text": " there"}, {"index": 1, "text": ""}]})
    tally.openai_chunk("[DONE]")
    tally.openai_chunk({"choices": "not a list"})
    assert tally.usage() == JobUsage(prompt_tokens=0, completion_tokens=3)
    # vLLM's own counts (continuous_usage_stats / the final usage chunk) replace the estimate.
    tally.openai_chunk({"choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 5}})
    tally.openai_chunk({"choices": [{"index": 0, "delta": {"content": "x"}}]})
    assert tally.usage() == JobUsage(prompt_tokens=12, completion_tokens=5)
