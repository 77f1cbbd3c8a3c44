"""The contract between the runtime's /metrics and the operator's autoscaler.

The runtime's own exposition (`RuntimeMetrics().render()`, what a pod serves on /metrics) is fed
to the autoscaler's own parser (`scrape.parse_pod_metrics`). Both are pure, so a renamed or
retyped series, or a change in how the runtime renders them, fails here. The two packages never
import each other; only this test sees both.
"""

from __future__ import annotations

from llmendpoints_common import signals
from llmendpoints_operator.autoscaling import scrape
from llmendpoints_runtime.metrics import RuntimeMetrics
from prometheus_client import CollectorRegistry, Counter, Histogram


def _pod(queued: list[int], running: list[int]) -> RuntimeMetrics:
    """A pod's metrics with its sources (admission queue, engine queue, jobs...) registered."""
    metrics = RuntimeMetrics()
    for value in queued:
        metrics.add_queue_source(lambda value=value: value)
    for value in running:
        metrics.add_in_flight_source(lambda value=value: value)
    return metrics


def test_the_autoscaler_reads_what_the_runtime_exports() -> None:
    metrics = _pod(queued=[3, 2], running=[4])
    # Everything else a pod serves: our other series, and vLLM's (a separate registry).
    metrics.http_requests.labels(route="/v1/completions", method="POST", code="200").inc()
    metrics.observe_phase("load", 12.5)
    vllm = CollectorRegistry()
    Histogram("vllm:time_to_first_token_seconds", "ttft", registry=vllm).observe(0.2)
    Counter("vllm:prompt_tokens", "tokens", ["model_name"], registry=vllm).labels("m").inc(7)

    text = metrics.render(vllm).decode()

    assert scrape.parse_pod_metrics(text) == (5.0, 4.0)


def test_an_idle_pod_reads_as_zero_not_as_missing() -> None:
    assert scrape.parse_pod_metrics(RuntimeMetrics().render().decode()) == (0.0, 0.0)


def test_the_wire_names_stay_what_running_pods_export() -> None:
    """A rolling upgrade runs old pods under a new operator: the names are a wire format."""
    assert (signals.QUEUE_DEPTH, signals.IN_FLIGHT) == (
        "llmendpoints_queue_depth",
        "llmendpoints_requests_in_flight",
    )
    text = RuntimeMetrics().render().decode()
    assert "# TYPE llmendpoints_queue_depth gauge" in text
    assert "# TYPE llmendpoints_requests_in_flight gauge" in text
