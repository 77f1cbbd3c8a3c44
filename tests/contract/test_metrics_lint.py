"""What the three components serve on /metrics passes Prometheus's own linter, and they name
the same things alike.

Each component's real collectors are rendered with samples in every family (a family without
samples shows only its HELP and TYPE), then handed to `promtool check metrics` (Debian's
prometheus package; scripts/tools.sh puts it in .venv/bin). The end-to-end test of
`make serve-stack` runs promtool over the live /metrics of a runtime (vLLM's series included) and
of the gateway as well.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from llmendpoints_gateway.metrics import GatewayMetrics
from llmendpoints_gateway.metrics_merge import merge
from llmendpoints_gateway.workers import SupervisorMetrics
from llmendpoints_operator.autoscaling.decision import Outside
from llmendpoints_operator.autoscaling.metrics import AutoscalerMetrics
from llmendpoints_operator.reconcile import ReconcileMetrics
from llmendpoints_runtime.adapters.reconciler import AdapterReconciler
from llmendpoints_runtime.metrics import RuntimeMetrics
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

PROMTOOL = Path(sys.executable).parent / "promtool"


def promtool() -> str:
    found = str(PROMTOOL) if PROMTOOL.is_file() else shutil.which("promtool")
    assert found, "promtool is missing: run `make setup` (scripts/tools.sh installs it)"
    return found


def gateway_text() -> str:
    """A gateway pod with two workers: their series summed, then the supervisor's."""
    workers = [_gateway_worker(), _gateway_worker()]
    return merge([w.render().decode() for w in workers]) + SupervisorMetrics().render()


def _gateway_worker() -> GatewayMetrics:
    metrics = GatewayMetrics(key_labels=True)
    metrics.answered("team-a/chat", 200, "team-a-key")
    metrics.answered("", 401)
    metrics.tokens_used("team-a/chat", "prompt", 12, "team-a-key")
    metrics.held_for("team-a/chat", 42.0, "released")
    metrics.held.labels("team-a/chat").set(1)
    metrics.hold_rejected.labels("team-a/chat", "timeout").inc()
    metrics.jobs_unbilled.labels("team-a/chat").inc()
    metrics.set_in_flight("team-a/chat", "chat-7d9f-abcde", 3)
    metrics.ready_replicas.labels("team-a/chat").set(2)
    metrics.routing.labels("team-a/chat", "affinity").inc()
    metrics.ttft.labels("team-a/chat").observe(0.2)
    metrics.duration.labels("team-a/chat").observe(12.0)
    metrics.prefix_index("team-a/chat", 3, 8)
    metrics.engine_prefix_cache("team-a/chat", 300.0, 800.0)
    metrics.shared_records.labels("sent").inc(4)
    return metrics


def runtime_text() -> str:
    metrics = RuntimeMetrics()
    metrics.http_requests.labels(route="/v1/chat/completions", method="POST", code="200").inc()
    metrics.http_latency.labels(route="/v1/chat/completions", method="POST").observe(0.5)
    metrics.rejected.labels(reason="queue_full").inc()
    metrics.observe_phase("load", 12.5)
    adapters = AdapterReconciler(None, metrics.registry, adapters_file=None)  # type: ignore[arg-type]
    adapters.ready_gauge.labels("a1").set(1)
    adapters.failures.labels("a1").inc()
    adapters.error_info.labels("a1", "not found").set(1)
    return metrics.render().decode()


def operator_text() -> str:
    registry = CollectorRegistry()
    autoscaler = AutoscalerMetrics(registry)
    reconciles = ReconcileMetrics(registry)
    autoscaler.scrape_failed("team-a", "chat")
    autoscaler.record_outside("team-a", "chat", Outside(held=1, jobs_queued=2))
    autoscaler.cold_started("team-a", "chat", 95.0)
    autoscaler.outside_failed("team-a", "chat")
    reconciles.reconciles.labels("create", "ok").inc()
    reconciles.seconds.observe(0.1)
    return generate_latest(registry).decode()


COMPONENTS = {"gateway": gateway_text, "runtime": runtime_text, "operator": operator_text}


def check_metrics(text: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [promtool(), "check", "metrics"],
        input=text, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


@pytest.mark.parametrize("component", sorted(COMPONENTS))
def test_promtool_finds_nothing_to_fix(component: str) -> None:
    result = check_metrics(COMPONENTS[component]())
    assert result.returncode == 0 and not (result.stdout + result.stderr).strip(), (
        result.stdout + result.stderr
    )


def test_promtool_is_a_real_check() -> None:
    """The linter answers on what it is given: a counter without `_total` is reported."""
    result = check_metrics("# HELP bad_requests x\n# TYPE bad_requests counter\nbad_requests 1\n")
    assert result.returncode != 0 and "_total" in result.stdout + result.stderr


def _labels() -> dict[str, set[str]]:
    """Every label name each component's families use."""
    names: dict[str, set[str]] = {}
    for component, render in COMPONENTS.items():
        for family in text_string_to_metric_families(render()):
            for sample in family.samples:
                names.setdefault(component, set()).update(set(sample.labels) - {"le"})
    return names


def test_one_label_name_per_concept_across_components() -> None:
    labels = _labels()
    everywhere = set().union(*labels.values())
    # The endpoint is `endpoint`, an HTTP status `code`, a key's name `key` (opt-in).
    assert "endpoint" in labels["gateway"] and "endpoint" in labels["operator"]
    assert "code" in labels["gateway"] and "code" in labels["runtime"]
    assert not everywhere & {"llmendpoint", "status", "status_code", "namespace", "api_key"}


def test_endpoint_label_values_are_namespace_slash_name() -> None:
    for component in ("gateway", "operator"):
        for family in text_string_to_metric_families(COMPONENTS[component]()):
            for sample in family.samples:
                value = sample.labels.get("endpoint")
                assert value in (None, "", "team-a/chat"), (component, sample)


def test_no_created_series_anywhere() -> None:
    for component, render in COMPONENTS.items():
        assert "_created" not in render(), component
