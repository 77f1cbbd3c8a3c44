"""The runtime's /metrics against the Gateway API Inference Extension's model server protocol, as
`llmendpoints-runtime check-model-server` judges it (pure parts; the command against a real
engine is in tests/runtime/test_openai_api.py and tests/runtime/test_adapters.py).

The exposition is the runtime's own (`RuntimeMetrics().render(vllm registry)`, what a pod serves);
the vLLM series are real prometheus_client objects with vLLM 0.32's names (vllm_series.py).
"""

from __future__ import annotations

import socket

from llmendpoints_runtime import model_server_check as check
from llmendpoints_runtime.__main__ import main
from llmendpoints_runtime.metrics import RuntimeMetrics
from prometheus_client import CollectorRegistry, Counter, Gauge

from .vllm_series import vllm_registry


def _text(**series) -> str:
    return RuntimeMetrics().render(vllm_registry(**series)).decode()


def _by_name(checks: list[check.Check]) -> dict[str, check.Check]:
    return {c.name: c for c in checks}


def test_a_pod_serving_vllms_gauges_passes() -> None:
    checks = check.metric_checks(_text(running=3, waiting=1, kv_usage=0.42), adapters=False)
    assert check.passed(checks)
    found = _by_name(checks)
    assert found[check.RUNNING].detail == "gauge = 3"
    assert found[check.WAITING].detail == "gauge = 1"
    assert found[check.KV_USAGE].detail == "gauge = 0.42"
    assert found[check.CACHE_INFO].detail == "block_size=16, num_gpu_blocks=4096"
    assert check.LORA_INFO not in found  # not asked for without adapters


def test_a_missing_gauge_fails_and_names_it() -> None:
    registry = CollectorRegistry()  # a server without vLLM's series (another engine, a proxy)
    Gauge("vllm:num_requests_running", "r", ["model_name"], registry=registry).labels("m").set(0)
    checks = check.metric_checks(RuntimeMetrics().render(registry).decode(), adapters=False)
    assert not check.passed(checks)
    failed = {c.name: c.detail for c in checks if not c.ok}
    assert failed[check.WAITING] == "missing from /metrics"
    assert failed[check.KV_USAGE] == "missing from /metrics"
    # The cache config is optional: a warning, not a failure.
    assert not _by_name(checks)[check.CACHE_INFO].required
    assert check.RUNNING not in failed


def test_wrong_types_and_values_fail() -> None:
    registry = CollectorRegistry()
    Counter("vllm:num_requests_running", "r", registry=registry).inc(2)
    Gauge("vllm:num_requests_waiting", "w", registry=registry).set(-1)
    Gauge("vllm:kv_cache_usage_perc", "percent, not a fraction", registry=registry).set(42)
    failed = {
        c.name: c.detail
        for c in check.metric_checks(RuntimeMetrics().render(registry).decode(), adapters=False)
        if not c.ok
    }
    assert failed[check.RUNNING] == "is a counter, an endpoint picker reads a gauge"
    assert failed[check.WAITING] == "value -1.0 is not a count >= 0"
    assert failed[check.KV_USAGE] == "value 42.0 is not a fraction between 0 and 1"


def test_adapters_need_the_lora_metric_with_its_labels() -> None:
    without = check.metric_checks(_text(), adapters=True)
    assert _by_name(without)[check.LORA_INFO].detail.startswith("missing from /metrics")
    assert not check.passed(without)
    with_lora = check.metric_checks(_text(lora=(4, ["sql"], ["tone"])), adapters=True)
    assert check.passed(with_lora)
    assert _by_name(with_lora)[check.LORA_INFO].detail == (
        "max_lora=4, running=[sql], waiting=[tone]"
    )


def test_answers_are_judged_on_status_and_content() -> None:
    ok = {"choices": [{"text": "Hi"}], "usage": {"completion_tokens": 1}}
    assert check.answer_check("c", 200, ok, chat=False) == check.Check(
        "c", True, "HTTP 200, 1 token(s)"
    )
    chat = {"choices": [{"message": {"role": "assistant", "content": "Hi"}}]}
    assert check.answer_check("c", 200, chat, chat=True).ok
    refused = check.answer_check("c", 404, {"error": {"message": "no model x"}}, chat=False)
    assert not refused.ok and refused.detail.startswith("HTTP 404: {'message': 'no model x'}")
    assert check.answer_check("c", 200, {"choices": []}, chat=False).detail == (
        "HTTP 200 without choices"
    )
    assert not check.answer_check("c", 200, chat, chat=False).ok  # chat shape on /v1/completions


def test_the_table_shows_every_check_and_the_verdict() -> None:
    checks = [
        check.Check("/v1/completions", True, "HTTP 200, 1 token(s)"),
        check.Check(check.KV_USAGE, False, "missing from /metrics"),
        check.Check(check.CACHE_INFO, False, "missing", required=False),
    ]
    table = check.render("http://pod:8000", checks).splitlines()
    assert table[0] == "model server check of http://pod:8000"
    assert table[3].split() == ["/v1/completions", "pass", "HTTP", "200,", "1", "token(s)"]
    assert table[4].split()[:2] == [check.KV_USAGE, "FAIL"]
    assert table[5].split()[:2] == [check.CACHE_INFO, "warn"]
    assert not check.passed(checks)
    assert check.passed(checks[::2])


def test_the_command_fails_when_nothing_answers(capsys) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, never listening: connections are refused
        code = main(["check-model-server", f"http://127.0.0.1:{port}", "--timeout", "2"])
    out = capsys.readouterr().out
    assert code == 1
    assert "/v1/models" in out and "FAIL" in out and "no answer" in out
