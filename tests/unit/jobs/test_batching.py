import itertools

import pytest
from llmendpoints_runtime.jobs.batching import (
    BatchSchedule,
    TextCollector,
    TokenBatcher,
    resolve_schedule,
)
from llmendpoints_runtime.jobs.port import ChoiceDelta, GenerationStep


def first(schedule: BatchSchedule, count: int) -> list[int]:
    return list(itertools.islice(schedule.sizes(), count))


def test_default_schedule_is_worker_vllms() -> None:
    assert first(BatchSchedule(), 7) == [1, 3, 9, 27, 50, 50, 50]


@pytest.mark.parametrize(
    ("schedule", "expected"),
    [
        (BatchSchedule(min_size=2, growth=2, max_size=10), [2, 4, 8, 10, 10]),
        (BatchSchedule(min_size=1, growth=1.5, max_size=5), [1, 2, 3, 4, 5]),
        (BatchSchedule(min_size=4, growth=1, max_size=50), [4, 4, 4, 4, 4]),
        (BatchSchedule(min_size=1, growth=3, max_size=1), [1, 1, 1, 1, 1]),
    ],
)
def test_custom_schedules(schedule: BatchSchedule, expected: list[int]) -> None:
    assert first(schedule, len(expected)) == expected


def test_invalid_schedules_are_refused() -> None:
    with pytest.raises(ValueError):
        BatchSchedule(min_size=0)
    with pytest.raises(ValueError):
        BatchSchedule(min_size=5, max_size=2)
    with pytest.raises(ValueError):
        BatchSchedule(growth=0.5)


def test_environment_defaults_are_used_and_request_values_override_each_one() -> None:
    defaults = {"default_max": 20, "default_min": 2, "default_growth": 2.0}
    none = {"max_batch_size": None, "min_batch_size": None, "growth": None}
    assert resolve_schedule(**none, **defaults) == BatchSchedule(2, 2.0, 20)
    assert resolve_schedule(**{**none, "growth": 5}, **defaults) == BatchSchedule(2, 5.0, 20)
    assert resolve_schedule(**{**none, "min_batch_size": 7}, **defaults) == BatchSchedule(
        7, 2.0, 20
    )
    # a per-request maximum under the default minimum lowers the minimum with it
    assert resolve_schedule(**{**none, "max_batch_size": 1}, **defaults) == BatchSchedule(1, 2.0, 1)


def steps(count: int, n: int = 1) -> list[GenerationStep]:
    return [
        GenerationStep(prompt_tokens=4, choices=tuple(ChoiceDelta(c, f"w{i}", 1) for c in range(n)))
        for i in range(count)
    ]


def run_batcher(batcher: TokenBatcher, items: list[GenerationStep]) -> list[dict]:
    out = [b for s in items if (b := batcher.add(s)) is not None]
    if (last := batcher.flush()) is not None:
        out.append(last)
    return out


def test_batches_grow_and_carry_cumulative_usage() -> None:
    batches = run_batcher(TokenBatcher(1, BatchSchedule()), steps(100))
    assert [len(b["choices"][0]["tokens"]) for b in batches] == [1, 3, 9, 27, 50, 10]
    assert [b["usage"]["output"] for b in batches] == [1, 4, 13, 40, 90, 100]
    assert all(b["usage"]["input"] == 4 for b in batches)
    assert "".join(t for b in batches for t in b["choices"][0]["tokens"]) == "".join(
        f"w{i}" for i in range(100)
    )


def test_batches_hold_every_choice() -> None:
    batches = run_batcher(TokenBatcher(2, BatchSchedule(1, 2, 4)), steps(7, n=2))
    assert [len(b["choices"]) for b in batches] == [2, 2, 2]
    assert [len(b["choices"][1]["tokens"]) for b in batches] == [1, 2, 4]
    assert batches[-1]["usage"]["output"] == 14


def test_merged_steps_count_their_tokens() -> None:
    # vLLM merges steps when the reader lags: one piece may carry several tokens
    merged = [
        GenerationStep(prompt_tokens=4, choices=(ChoiceDelta(0, f"p{i}", count),))
        for i, count in enumerate([1, 2, 2, 5, 1])
    ]
    batches = run_batcher(TokenBatcher(1, BatchSchedule(1, 3, 50)), merged)
    # sizes 1, 3, 9: a batch ends once it holds at least its size, never before
    assert [b["choices"][0]["tokens"] for b in batches] == [["p0"], ["p1", "p2"], ["p3", "p4"]]
    assert [b["usage"]["output"] for b in batches] == [1, 5, 11]


def test_nothing_left_means_no_empty_batch() -> None:
    batcher = TokenBatcher(1, BatchSchedule())
    assert batcher.add(steps(1)[0]) is not None
    assert batcher.flush() is None


def test_non_streamed_output_is_one_batch_of_full_texts() -> None:
    collector = TextCollector(2)
    for step in steps(3, n=2):
        collector.add(step)
    assert collector.result() == {
        "choices": [{"tokens": ["w0w1w2"]}, {"tokens": ["w0w1w2"]}],
        "usage": {"input": 4, "output": 6},
    }
