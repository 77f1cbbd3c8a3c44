"""The contract between a runtime pod's /metrics and the gateway's engine-load reader.

The runtime's own exposition (`RuntimeMetrics().render(...)`, what a pod serves, with vLLM 0.32's
series after ours: vllm_series.py) fed to `engine_load.parse_engine_metrics`. The gateway and the
runtime never import each other; only this test sees both.
"""

from __future__ import annotations

import pytest
from llmendpoints_gateway import engine_load
from llmendpoints_runtime.metrics import RuntimeMetrics
from prometheus_client import CollectorRegistry, Gauge

from .vllm_series import vllm_registry


def _pod(*registries: CollectorRegistry) -> str:
    metrics = RuntimeMetrics()
    metrics.add_queue_source(lambda: 3)
    metrics.add_in_flight_source(lambda: 5)
    metrics.http_requests.labels(route="/v1/completions", method="POST", code="200").inc()
    return metrics.render(*registries).decode()


def test_the_gateway_reads_the_engine_load_a_pod_exports() -> None:
    text = _pod(
        vllm_registry(
            running=5, waiting=2, kv_usage=0.37, hits=1200, queries=2000,
            block_size=32, num_gpu_blocks=320,
        )
    )  # fmt: skip
    load = engine_load.parse_engine_metrics(text, taken_at=12.5)
    assert (load.running, load.waiting, load.kv_usage) == (5, 2, 0.37)
    assert (load.prefix_hits, load.prefix_queries) == (1200, 2000)
    assert (load.block_size, load.num_gpu_blocks, load.kv_tokens) == (32, 320, 10240)
    assert load.active_adapters == frozenset() and load.max_lora is None
    assert load.taken_at == 12.5 and load.age(13.0) == 0.5


def test_adapters_active_in_the_engine_and_loaded_by_the_pod() -> None:
    ours = CollectorRegistry()  # the runtime's per-adapter gauge (adapters/reconciler.py)
    ready = Gauge("llmendpoints_adapter_ready", "loaded", ["adapter"], registry=ours)
    ready.labels("sql").set(1)
    ready.labels("tone").set(1)
    ready.labels("broken").set(0)
    text = _pod(ours, vllm_registry(lora=(4, ["sql"], ["tone", "new"])))
    load = engine_load.parse_engine_metrics(text)
    assert load.active_adapters == {"sql", "tone", "new"}
    assert load.max_lora == 4
    assert load.ready_adapters == {"sql", "tone"}


def test_an_engine_without_prefix_counters_or_cache_config_still_reads() -> None:
    text = _pod(vllm_registry(running=1, block_size=None))
    load = engine_load.parse_engine_metrics(text)
    assert load.running == 1 and load.kv_tokens is None


@pytest.mark.parametrize(
    ("registry", "complaint"),
    [
        (CollectorRegistry(), "missing vllm:num_requests_running"),  # no engine series (loading)
        (vllm_registry(waiting=-1), "vllm:num_requests_waiting is -1.0"),
    ],
)
def test_a_pod_without_a_sane_engine_is_an_error(registry, complaint) -> None:
    with pytest.raises(engine_load.EngineMetricsError, match=complaint):
        engine_load.parse_engine_metrics(_pod(registry))


def test_data_parallel_engines_sum_their_queues_and_average_their_caches() -> None:
    registry = vllm_registry(running=2, waiting=1, kv_usage=0.2)
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
    ):
        gauge = registry._names_to_collectors[name]
        gauge.labels(model_name="demo", engine="1").set(0.6 if "kv" in name else 3)
    load = engine_load.parse_engine_metrics(_pod(registry))
    assert (load.running, load.waiting) == (5, 4)
    assert load.kv_usage == pytest.approx(0.4)


def test_hit_counts_between_samples_survive_an_engine_restart() -> None:
    first = engine_load.parse_engine_metrics(_pod(vllm_registry(hits=100, queries=400)))
    later = engine_load.parse_engine_metrics(_pod(vllm_registry(hits=250, queries=600)))
    restarted = engine_load.parse_engine_metrics(_pod(vllm_registry(hits=30, queries=50)))
    assert engine_load.hit_rate(first, later) == (150, 200)
    assert engine_load.hit_rate(later, restarted) == (30, 50)
    assert engine_load.hit_rate(None, first) == (100, 400)


def test_the_parser_reads_escaped_labels_and_refuses_a_broken_line_of_its_series() -> None:
    """The engine-load parser reads only its series, line by line (not prometheus_client's
    parser: ~7x slower): quoted label values with escapes, timestamps, other series skipped."""
    text = "\n".join(
        [
            "# HELP vllm:num_requests_running Running.",
            "# TYPE vllm:num_requests_running gauge",
            'vllm:num_requests_running{engine="0",model_name="a \\"b\\" c"} 2.0 1700000000000',
            'vllm:num_requests_waiting{engine="0"} 1',
            'vllm:kv_cache_usage_perc{engine="0"} 0.5',
            'vllm:e2e_request_latency_seconds_bucket{le="+Inf"} 9',  # not ours: skipped
            'llmendpoints_adapter_ready{adapter="we\\\\ird"} 1',
        ]
    )
    load = engine_load.parse_engine_metrics(text)
    assert (load.running, load.waiting, load.kv_usage) == (2, 1, 0.5)
    assert load.ready_adapters == {"we\\ird"}
    with pytest.raises(engine_load.EngineMetricsError, match="unparsable metrics value"):
        engine_load.parse_engine_metrics(text + '\nvllm:num_requests_waiting{engine="1"} many')
