"""What vLLM itself allocates for a model: run as a script by test_fit_estimate.py.

    python fit_probe.py CASES.json OUT.json

CASES.json is a list of {"model": dir, "max_model_len": n, "kv_cache_memory_bytes": n}. For each,
one vLLM engine (the CPU build, in this process, eager) loads the model with that KV cache budget
(on CPU the budget is VLLM_CPU_KVCACHE_SPACE, or --kv-cache-memory-bytes: no profiling) and the
script records what vLLM measured: the bytes of the loaded model's parameters, the KV cache's
blocks and block size, vLLM's "KV cache size: N tokens" and the scheduler limits it used.
"""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process
# The CPU platform would replace each case's budget with this legacy setting's.
os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)


def _parameter_bytes(model) -> int:
    seen, total = set(), 0
    for tensor in model.parameters():
        if tensor.data_ptr() not in seen:  # a tied LM head is the embedding itself
            seen.add(tensor.data_ptr())
            total += tensor.numel() * tensor.element_size()
    return total


def measure(case: dict) -> dict:
    from vllm import LLM

    llm = LLM(
        model=case["model"],
        max_model_len=case["max_model_len"],
        kv_cache_memory_bytes=case["kv_cache_memory_bytes"],
        enforce_eager=True,
        seed=0,
    )
    config = llm.llm_engine.vllm_config
    result = {
        "weights": llm.apply_model(_parameter_bytes)[0],
        "blocks": config.cache_config.num_gpu_blocks,
        "block_size": config.cache_config.block_size,
        "tokens": config.cache_config.kv_cache_size_tokens,
        "dtype": str(config.model_config.dtype).removeprefix("torch."),
        "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
        "async_scheduling": bool(config.scheduler_config.async_scheduling),
        "hybrid": not config.scheduler_config.disable_hybrid_kv_cache_manager,
    }
    del llm
    gc.collect()
    return result


def main() -> None:
    cases = json.loads(Path(sys.argv[1]).read_text())
    Path(sys.argv[2]).write_text(json.dumps([measure(case) for case in cases]))


if __name__ == "__main__":
    main()
