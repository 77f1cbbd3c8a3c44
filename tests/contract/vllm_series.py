"""vLLM 0.32's own Prometheus series, as a pod's /metrics carries them after ours.

Names, types and label names as vllm/v1/metrics/loggers.py registers them (gauges and counters
labelled model_name and engine; vllm:cache_config_info an info-style gauge carrying the cache
config as labels; vllm:lora_requests_info a gauge set to the update time, with max_lora and the
running and waiting adapters as labels). Real prometheus_client objects, rendered by the
runtime's own RuntimeMetrics.render, so the exposition format is the one a pod serves.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge

LABELS = ("model_name", "engine")


def vllm_registry(
    *,
    running: float = 0,
    waiting: float = 0,
    kv_usage: float = 0.0,
    hits: float = 0,
    queries: float = 0,
    block_size: int | None = 16,
    num_gpu_blocks: int | None = 4096,
    lora: tuple[int, list[str], list[str]] | None = None,
    model: str = "demo",
) -> CollectorRegistry:
    """`lora`: (max_lora, running adapters, waiting adapters), or None when LoRA is off."""
    registry = CollectorRegistry()
    labels = {"model_name": model, "engine": "0"}
    for name, doc, value in (
        ("vllm:num_requests_running", "Number of requests in model execution batches.", running),
        ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", waiting),
        ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", kv_usage),
    ):
        Gauge(name, doc, LABELS, registry=registry).labels(**labels).set(value)
    for name, doc, value in (
        ("vllm:prefix_cache_queries", "Prefix cache queries, in tokens.", queries),
        ("vllm:prefix_cache_hits", "Prefix cache hits, in tokens.", hits),
        ("vllm:prompt_tokens", "Number of prefill tokens processed.", queries),
    ):
        Counter(name, doc, LABELS, registry=registry).labels(**labels).inc(value)
    if block_size is not None:
        info = {
            "block_size": str(block_size),
            "num_gpu_blocks": str(num_gpu_blocks),
            "enable_prefix_caching": "True",
            "cache_dtype": "auto",
            "engine": "0",
        }
        Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            list(info),
            registry=registry,
        ).labels(**info).set(1)
    if lora is not None:
        max_lora, running_adapters, waiting_adapters = lora
        Gauge(
            "vllm:lora_requests_info",
            "Running stats on lora requests.",
            ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
            registry=registry,
        ).labels(
            max_lora=str(max_lora),
            waiting_lora_adapters=",".join(waiting_adapters),
            running_lora_adapters=",".join(running_adapters),
        ).set(time.time())
    return registry
