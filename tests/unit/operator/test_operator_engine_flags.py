"""engine.args and engine.env that the pinned vLLM would refuse are an InvalidSpec at apply time.

(tests/contract/test_engine_flags.py checks the table against vLLM's parser for every flag; these
tests pin what a user sees.)
"""

from __future__ import annotations

from typing import Any

import pytest
from llmendpoints_operator import engine_flags
from llmendpoints_operator.admission import admit
from llmendpoints_operator.config import OperatorSettings
from llmendpoints_operator.spec import InvalidSpecError, parse

SETTINGS = OperatorSettings()


def _spec(env: list[dict[str, Any]] | None = None, args: dict[str, Any] | None = None):
    return {"model": {"name": "org/m"}, "engine": {"env": env or [], "args": args or {}}}


def _problems(**kwargs: Any) -> dict[str, str]:
    with pytest.raises(InvalidSpecError) as caught:
        admit("demo", "ns", _spec(**kwargs), SETTINGS)
    return {p.field: p.message for p in caught.value.problems}


def test_an_unknown_flag_in_args_is_refused_with_the_closest_flag() -> None:
    problems = _problems(args={"max-num-seq": 64})
    assert problems == {
        "spec.engine.args.max-num-seq": "--max-num-seq is not a flag of vLLM 0.32.0 "
        "(did you mean max-num-seqs?)"
    }


@pytest.mark.parametrize(
    ("args", "says"),
    [
        ({"max-num-seqs": "lots"}, "--max-num-seqs takes an integer, got 'lots'"),
        ({"max-num-batched-tokens": "1.5K"}, "--max-num-batched-tokens takes an integer such as"),
        ({"gpu-memory-utilization": "high"}, None),  # managed: spec.engine.gpuMemoryUtilization
        ({"kv-cache-dtype": "fp4"}, "--kv-cache-dtype must be one of auto, bfloat16,"),
        ({"enforce-eager": "maybe"}, "--enforce-eager: expected a boolean (1/0, true/false)"),
        ({"speculative-config": "{not json"}, "--speculative-config takes JSON, got"),
        ({"max-lora-rank": 12}, "--max-lora-rank must be one of 1, 8, 16, 32, 64"),
        ({"compilation-config": "3"}, '--compilation-config takes a JSON object such as {"key"'),
    ],
)
def test_a_value_vllm_refuses_is_refused_naming_the_flag(args: dict, says: str | None) -> None:
    (flag,) = args
    problems = _problems(args=args)
    field = f"spec.engine.args.{flag}"
    assert field in problems
    if says is not None:
        assert problems[field].startswith(says), problems[field]


def test_values_vllm_takes_are_admitted() -> None:
    spec = _spec(
        args={
            "max-num-seqs": 64,
            "max-num-batched-tokens": "32k",
            "kv-cache-dtype": "fp8",
            "enforce-eager": True,
            "moe-backend": "TRITON",  # vLLM lower-cases it
            "speculative-config": '{"method": "ngram", "num_speculative_tokens": 3}',
            "hf-overrides": "plain-name",
            "cudagraph-capture-sizes": "1, 2, 4",
        },
        env=[
            {"name": "NCCL_DEBUG", "value": "INFO"},  # not vLLM's: passed through untouched
            {"name": "BLOCK_SIZE", "value": "32"},
            {"name": "SM_VLLM_SEED", "value": "7"},
            {"name": "SWAP_SPACE", "value": "4"},  # retired, ignored by the runtime (a warning)
            {"name": "MAX_LOG_LEN", "valueFrom": {"configMapKeyRef": {"name": "c", "key": "k"}}},
        ],
    )
    ep = admit("demo", "ns", spec, SETTINGS)
    assert engine_flags.engine_settings(ep)["--kv-cache-dtype"] == "fp8"
    assert engine_flags.engine_settings(ep)["--block-size"] == "32"
    assert engine_flags.engine_settings(ep)["--seed"] == "7"


def test_env_values_are_checked_and_sagemaker_names_must_name_a_flag() -> None:
    problems = _problems(
        env=[
            {"name": "MAX_NUM_SEQS", "value": "1.5"},
            {"name": "SM_VLLM_MAX_NUM_SEQ", "value": "3"},
            {"name": "ROPE_SCALING", "value": "{}"},
        ]
    )
    assert problems["spec.engine.env[0].value"] == "--max-num-seqs takes an integer, got '1.5'"
    assert problems["spec.engine.env[1].name"] == "--max-num-seq is not a flag of vLLM 0.32.0"
    assert problems["spec.engine.env[2]"].startswith(
        "ROPE_SCALING is not supported by vLLM 0.32.0: use HF_OVERRIDES"
    )


def test_two_spellings_of_one_flag_must_agree() -> None:
    problems = _problems(
        env=[
            {"name": "KV_CACHE_DTYPE", "value": "fp8"},
            {"name": "SM_VLLM_KV_CACHE_DTYPE", "value": "auto"},
        ]
    )
    assert problems == {
        "spec.engine.env[1]": "sets --kv-cache-dtype to 'auto', but spec.engine.env[0] sets it "
        "to 'fp8'"
    }


def test_a_managed_variable_is_reported_once() -> None:
    problems = _problems(env=[{"name": "SM_VLLM_MAX_MODEL_LEN", "value": "lots"}])
    assert list(problems) == ["spec.engine.env[0].name"]
    assert "managed" in problems["spec.engine.env[0].name"]


def test_every_value_is_read_as_the_runtime_reads_it() -> None:
    flag = engine_flags.table().flags["MAX_MODEL_LEN"]
    for good in ("4096", "32k", "1M", "25.6k", "auto", "-1"):
        assert engine_flags.value_problem(flag, good) is None, good
    for bad in ("1.5M", "lots", "4 k"):
        assert engine_flags.value_problem(flag, bad) is not None, bad
    assert engine_flags.value_problem(flag, "") is None  # empty: not set, as in the runtime


def test_the_spec_alone_still_parses_without_the_table() -> None:
    # parse() knows nothing of vLLM's flags: only admission does.
    assert parse("demo", "ns", _spec(args={"max-num-seq": 64})).name == "demo"
