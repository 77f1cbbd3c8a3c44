"""The Grafana dashboard: valid JSON, and every series its queries name is one the software exports,
checked against the real sources (vLLM's installed code, the runtime's and the operator's collectors)."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

from .helm_kit import CHART, ROOT

DASHBOARD = json.loads((CHART / "dashboards" / "llmendpoints.json").read_text())
METRIC = re.compile(r"\b(vllm:[a-z_:]+|llmendpoints_[a-z_]+)")
SUFFIXES = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"], "gauge": [""]}


def exposed(name: str, kind: str) -> set[str]:
    """The series names Prometheus scrapes for one metric."""
    if kind == "counter":
        name = name.removesuffix("_total")  # prometheus_client adds it back
    return {name + suffix for suffix in SUFFIXES[kind]}


def defined_in(package: Path) -> set[str]:
    """Series of every Counter/Gauge/Histogram a package's source defines with a literal name."""
    definition = re.compile(r'\b(Counter|Gauge|Histogram)\(\s*"(llmendpoints_[a-z_]+)"')
    series: set[str] = set()
    for path in package.rglob("*.py"):
        for kind, name in definition.findall(path.read_text()):
            series |= exposed(name, kind.lower())
    return series


def vllm_series() -> set[str]:
    """Every metric vLLM's Prometheus logger defines, read from the installed vLLM's source."""
    defined = re.compile(r'_(counter|gauge|histogram)_cls\(\s*name="(vllm:[a-z_]+)"')
    series: set[str] = set()
    spec = importlib.util.find_spec("vllm")  # located, not imported: importing vLLM is slow
    assert spec is not None and spec.origin is not None
    for path in Path(spec.origin).parent.rglob("*.py"):
        for kind, name in defined.findall(path.read_text(errors="replace")):
            series |= exposed(name, kind)
    return series


def runtime_series() -> set[str]:
    """The runtime's collectors: those RuntimeMetrics registers, plus any other metric the runtime
    package defines (the job API registers its own when it is wired in)."""
    from llmendpoints_runtime.metrics import RuntimeMetrics

    series: set[str] = set()
    for family in RuntimeMetrics().registry.collect():
        series |= exposed(family.name, family.type)
    return series | defined_in(ROOT / "runtime" / "llmendpoints_runtime")


def operator_series() -> set[str]:
    from llmendpoints_operator.autoscaling.metrics import AutoscalerMetrics

    series: set[str] = set()
    for family in AutoscalerMetrics().registry.collect():
        series |= exposed(family.name, family.type)
    return series | defined_in(ROOT / "operator" / "llmendpoints_operator")


OPERATOR_PREFIXES = ("llmendpoints_autoscaler_", "llmendpoints_operator_")
GATEWAY_PREFIX = "llmendpoints_gateway_"


def queries() -> list[tuple[str, str]]:
    return [
        (panel["title"], target["expr"])
        for panel in DASHBOARD["panels"]
        for target in panel["targets"]
    ]


def test_dashboard_is_a_grafana_dashboard() -> None:
    assert DASHBOARD["uid"] == "llmendpoints"
    assert DASHBOARD["title"]
    ids = [panel["id"] for panel in DASHBOARD["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"] for v in DASHBOARD["templating"]["list"]}
    for panel in DASHBOARD["panels"]:
        assert panel["targets"], panel["title"]
        assert panel["datasource"]["uid"] == "${datasource}"
        for target in panel["targets"]:
            # Every $variable a query uses is defined (Grafana's own ones start with __).
            used = set(re.findall(r"\$(\w+)", target["expr"])) - {"__rate_interval", "__interval"}
            assert used <= variables, (panel["title"], used - variables)
            assert target["expr"].count("(") == target["expr"].count(")"), target["expr"]


def test_dashboard_shows_what_an_operator_of_endpoints_needs() -> None:
    names = {m for _, expr in queries() for m in METRIC.findall(expr)}
    assert {
        "llmendpoints_queue_depth",  # queue depth
        "llmendpoints_autoscaler_desired_replicas",  # replicas desired ...
        "llmendpoints_autoscaler_ready_replicas",  # ... and ready
        "vllm:request_success_total",  # requests/s
        "vllm:time_to_first_token_seconds_bucket",  # TTFT
        "vllm:generation_tokens_total",  # tokens/s
        "llmendpoints_startup_phase_seconds",  # start-up phase durations
    } <= names


def test_runtime_and_vllm_series_in_queries_exist() -> None:
    known = vllm_series() | runtime_series()
    for title, expr in queries():
        for name in METRIC.findall(expr):
            if not name.startswith((*OPERATOR_PREFIXES, GATEWAY_PREFIX)):
                assert name in known, f"{title}: {name} is not exported by vLLM or the runtime"


def test_operator_series_in_queries_exist() -> None:
    known = operator_series()
    for title, expr in queries():
        for name in METRIC.findall(expr):
            if name.startswith(OPERATOR_PREFIXES):
                assert name in known, f"{title}: the operator exports no {name}"


def gateway_series() -> set[str]:
    from llmendpoints_gateway.metrics import GatewayMetrics

    series: set[str] = set()
    for family in GatewayMetrics(key_labels=True).registry.collect():
        series |= exposed(family.name, family.type)
    return series


def test_gateway_series_in_queries_exist() -> None:
    known = gateway_series()
    used = [(t, n) for t, e in queries() for n in METRIC.findall(e) if n.startswith(GATEWAY_PREFIX)]
    assert used
    for title, name in used:
        assert name in known, f"{title}: the gateway exports no {name}"


def test_dashboard_shows_the_gateway_the_kv_cache_and_token_latencies() -> None:
    names = {m for _, expr in queries() for m in METRIC.findall(expr)}
    assert {
        "llmendpoints_gateway_requests_total",  # requests, and 429s by code
        "llmendpoints_gateway_held_requests",  # held
        "llmendpoints_gateway_hold_duration_seconds_bucket",  # hold time
        "llmendpoints_gateway_routing_decisions_total",  # routing outcomes
        "vllm:kv_cache_usage_perc",  # KV-cache usage
        "vllm:time_to_first_token_seconds_bucket",  # TTFT ...
        "vllm:inter_token_latency_seconds_bucket",  # ... and ITL, vLLM's own
    } <= names
    assert any('code="429"' in e for _, e in queries())


def test_queries_select_by_the_label_every_component_sets() -> None:
    """One `endpoint` label: the PodMonitor gives it to runtime series, the gateway and the
    operator export it; every per-endpoint query filters on it."""
    template = (CHART / "templates" / "podmonitor.yaml").read_text()
    (target_label,) = re.findall(r"targetLabel: (\w+)", template)
    assert target_label == "endpoint"
    for title, expr in queries():
        if "llmendpoints_operator_" in expr:
            continue  # the operator's own reconciles are not per endpoint
        assert 'endpoint=~"$endpoint"' in expr, (title, expr)
        grouped = {n.strip() for by in re.findall(r"by \(([^)]*)\)", expr) for n in by.split(",")}
        selected = set(re.findall(r"[{,]\s*(\w+)\s*[=!]~?", expr))
        # No old spellings: `llmendpoint`, an HTTP status as `status` (a job's final state
        # keeps RunPod's word `status`), a `namespace` of our own.
        stale = (grouped | selected) & {"llmendpoint", "namespace", "status"}
        assert stale <= ({"status"} if "llmendpoints_jobs_finished" in expr else set()), expr


def test_the_endpoint_picker_keeps_endpoints_scaled_to_zero() -> None:
    """An endpoint at zero has no pod, so no runtime series: the picker also reads series that
    exist while the endpoint does (the operator's autoscaler, the gateway's ready replicas)."""
    variables = {v["name"]: v for v in DASHBOARD["templating"]["list"]}
    query = variables["endpoint"]["query"]["query"]
    for series in (
        "llmendpoints_autoscaler_desired_replicas",
        "llmendpoints_gateway_ready_replicas",
        "llmendpoints_queue_depth",
    ):
        assert series in query
    assert series_outlive_pods()


def series_outlive_pods() -> bool:
    """The gateway keeps ready_replicas at 0 for an endpoint with no replica (checked, not
    assumed): the registry sets it when the endpoint appears."""
    from llmendpoints_gateway.metrics import GatewayMetrics
    from llmendpoints_gateway.registry import Registry
    from llmendpoints_gateway.routing import Strategy

    metrics = GatewayMetrics()
    Registry(metrics, 1, 1.25).upsert("idle", ["m"], Strategy.PREFIX_AWARE, namespace="ns")
    return (
        'llmendpoints_gateway_ready_replicas{endpoint="ns/idle"} 0.0' in metrics.render().decode()
    )
