"""The fit check's estimate against what vLLM itself allocates, on the CPU build.

Demo-size models written by the project's own writer (llmendpoints_runtime.demo) vary what the
check reads: layers, attention and KV heads, head size, the checkpoint's dtype (float32 served in
bfloat16, bfloat16, float16), a vocabulary vLLM pads, tied embeddings, sliding-window layers next
to full ones (the hybrid KV cache manager), and max_model_len. vLLM loads each one with a fixed KV
cache budget (on CPU the budget is given, VLLM_CPU_KVCACHE_SPACE or --kv-cache-memory-bytes: no
activation profiling), in one process (fit_probe.py), niced. The check, given the same budget and
reading only config.json and the safetensors headers, must give vLLM's loaded weight bytes
exactly, and its KV cache tokens and blocks within 3 %.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from llmendpoints_operator.fit import architecture
from llmendpoints_operator.fit.inputs import defaults
from llmendpoints_operator.fit.local import read_folder
from llmendpoints_operator.fit.sizing import GpuMemory, size
from llmendpoints_runtime.demo import write_demo_model

pytestmark = pytest.mark.engine
HERE = Path(__file__).resolve().parent
MiB = 1 << 20

CASES = {
    # The demo model itself: float32 on disk, bfloat16 in vLLM; 2 layers, 1 KV head of 64.
    "demo": ({}, 1000, 256 * MiB),
    # Grouped-query attention, 32-wide heads, a bfloat16 checkpoint, a vocabulary padded to 448.
    "gqa": (
        {
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "torch_dtype": "bfloat16",
            "vocab_size": 400,
        },
        3000,
        64 * MiB,
    ),
    # float16, tied embeddings, 4 sliding-window layers (256 tokens) and 2 full ones.
    "sliding": (
        {
            "num_hidden_layers": 6,
            "num_key_value_heads": 2,
            "torch_dtype": "float16",
            "tie_word_embeddings": True,
            "sliding_window": 256,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 2,
        },
        4096,
        32 * MiB,
    ),
}


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    tmp = tmp_path_factory.mktemp("fit")
    cases = []
    for name, (shape, max_len, budget) in CASES.items():
        folder = write_demo_model(tmp / name, max_positions=max(max_len, 2048), shape=shape)
        cases.append(
            {"model": str(folder), "max_model_len": max_len, "kv_cache_memory_bytes": budget}
        )
    (tmp / "cases.json").write_text(json.dumps(cases))
    subprocess.run(
        ["nice", "-n", "10", sys.executable, str(HERE / "fit_probe.py"),
         str(tmp / "cases.json"), str(tmp / "out.json")],
        check=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        timeout=900,
    )  # fmt: skip
    results = json.loads((tmp / "out.json").read_text())
    return {
        name: {**result, "folder": case["model"]}
        for name, result, case in zip(CASES, results, cases, strict=True)
    }


def _estimate(name: str, vllm: dict):
    _, max_len, budget = CASES[name]
    facts = read_folder(vllm["folder"])
    inputs = defaults(
        max_model_len=max_len,
        kv_cache_memory_bytes=budget,
        block_size=vllm["block_size"],
        max_num_batched_tokens=vllm["max_num_batched_tokens"],
        async_scheduling=vllm["async_scheduling"],
        hybrid_kv_cache=vllm["hybrid"],
        enforce_eager=True,
    )
    shape = architecture.read_config(facts.config)
    return shape, size(shape, facts.tensors, inputs, GpuMemory(budget, None, "the budget"))


@pytest.mark.parametrize("name", list(CASES))
def test_weights_are_exactly_what_vllm_loads(measured: dict, name: str) -> None:
    shape, estimate = _estimate(name, measured[name])
    assert architecture.model_dtype(shape, None)[0] == measured[name]["dtype"]
    assert estimate.weights_per_gpu == measured[name]["weights"]


@pytest.mark.parametrize("name", list(CASES))
def test_kv_cache_is_within_three_percent_of_vllm(measured: dict, name: str) -> None:
    _, estimate = _estimate(name, measured[name])
    vllm = measured[name]
    assert estimate.plan.fits
    assert abs(estimate.plan.blocks - vllm["blocks"]) <= 0.03 * vllm["blocks"], (
        estimate.plan,
        vllm,
    )
    assert abs(estimate.plan.tokens - vllm["tokens"]) <= 0.03 * vllm["tokens"], (
        estimate.plan,
        vllm,
    )
