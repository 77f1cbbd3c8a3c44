"""`llmendpoints-runtime check-model-server URL`: does a pod serve what an endpoint picker reads?

A Gateway API inference gateway (an InferencePool with an endpoint picker such as llm-d-router's)
talks to the model server pods directly, under the Gateway API Inference Extension's model server
protocol: OpenAI's Completions and Chat Completions APIs, and Prometheus gauges on /metrics that
its scorers read -- vLLM's names:

- ``vllm:num_requests_waiting`` (queue scorer), ``vllm:num_requests_running``;
- ``vllm:kv_cache_usage_perc`` (KV-cache utilisation scorer; a fraction, 0 to 1);
- ``vllm:lora_requests_info`` with labels max_lora, running_lora_adapters, waiting_lora_adapters
  (LoRA affinity), when the pod serves adapters;
- ``vllm:cache_config_info`` (block_size, num_gpu_blocks: the prefix-cache scorer's defaults
  otherwise), optional.

The check sends one small completion and one small chat completion first (they also make vLLM
publish its per-step gauges), then reads /metrics. Pure parts (`metric_checks`, `answer_check`,
`render`) are separate from the few HTTP calls (`run`). No vLLM import: it runs anywhere the
package is installed, against any pod URL.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
LORA_INFO = "vllm:lora_requests_info"
CACHE_INFO = "vllm:cache_config_info"
LORA_LABELS = ("max_lora", "running_lora_adapters", "waiting_lora_adapters")


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    required: bool = True  # an optional check's failure does not fail the run


def _families(text: str) -> dict[str, Any]:
    """Metric families by name; only vLLM's lines are parsed (the rest may be large)."""
    wanted = "\n".join(
        line
        for line in text.splitlines()
        if line.startswith(("vllm:", "# TYPE vllm:", "# HELP vllm:"))
    )
    return {family.name: family for family in text_string_to_metric_families(wanted + "\n")}


def _gauge(families: Mapping[str, Any], name: str, *, fraction: bool = False) -> Check:
    family = families.get(name)
    if family is None:
        return Check(name, False, "missing from /metrics")
    if family.type != "gauge":
        return Check(name, False, f"is a {family.type}, an endpoint picker reads a gauge")
    values = [sample.value for sample in family.samples if sample.name == name]
    if not values:
        return Check(name, False, "declared but has no sample")
    bad = [v for v in values if not math.isfinite(v) or v < 0 or (fraction and v > 1)]
    if bad:
        expected = "a fraction between 0 and 1" if fraction else "a count >= 0"
        return Check(name, False, f"value {bad[0]} is not {expected}")
    return Check(name, True, "gauge = " + ", ".join(f"{v:g}" for v in values))


def _lora(families: Mapping[str, Any]) -> Check:
    family = families.get(LORA_INFO)
    if family is None:
        return Check(LORA_INFO, False, "missing from /metrics (is ENABLE_LORA on?)")
    samples = [s for s in family.samples if s.name == LORA_INFO]
    if not samples:
        return Check(LORA_INFO, False, "declared but has no sample yet")
    latest = max(samples, key=lambda s: s.value)  # the value is the update time
    missing = [label for label in LORA_LABELS if label not in latest.labels]
    if missing:
        return Check(LORA_INFO, False, f"labels {', '.join(missing)} missing")
    labels = latest.labels
    return Check(
        LORA_INFO,
        True,
        f"max_lora={labels['max_lora']}, running=[{labels['running_lora_adapters']}], "
        f"waiting=[{labels['waiting_lora_adapters']}]",
    )


def _cache_info(families: Mapping[str, Any]) -> Check:
    family = families.get(CACHE_INFO)
    samples = [s for s in family.samples if s.name == CACHE_INFO] if family else []
    if not samples:
        return Check(CACHE_INFO, False, "missing: the prefix-cache scorer uses its defaults", False)
    labels = samples[0].labels
    return Check(
        CACHE_INFO,
        True,
        f"block_size={labels.get('block_size', '?')}, "
        f"num_gpu_blocks={labels.get('num_gpu_blocks', '?')}",
        False,
    )


def metric_checks(text: str, *, adapters: bool) -> list[Check]:
    """PURE: the picker's metrics in one /metrics body. `adapters`: the pod serves LoRA adapters,
    so vllm:lora_requests_info is required."""
    try:
        families = _families(text)
    except ValueError as exc:
        return [Check("/metrics", False, f"not Prometheus text: {exc}")]
    checks = [
        _gauge(families, RUNNING),
        _gauge(families, WAITING),
        _gauge(families, KV_USAGE, fraction=True),
    ]
    if adapters:
        checks.append(_lora(families))
    checks.append(_cache_info(families))
    return checks


def answer_check(name: str, status: int, body: Any, *, chat: bool) -> Check:
    """PURE: one OpenAI answer (status code and parsed JSON body, None if not JSON)."""
    if status != 200:
        message = body.get("error", body) if isinstance(body, Mapping) else body
        return Check(name, False, f"HTTP {status}: {str(message)[:200]}")
    choices = body.get("choices") if isinstance(body, Mapping) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], Mapping):
        return Check(name, False, "HTTP 200 without choices")
    choice = choices[0]
    text = (choice.get("message") or {}).get("content") if chat else choice.get("text")
    if not isinstance(text, str):
        return Check(name, False, "HTTP 200, but the first choice has no text")
    usage = body.get("usage") or {}
    return Check(name, True, f"HTTP 200, {usage.get('completion_tokens', '?')} token(s)")


def render(url: str, checks: Iterable[Check]) -> str:
    """PURE: the pass/fail table."""
    rows = [
        (c.name, "pass" if c.ok else ("FAIL" if c.required else "warn"), c.detail) for c in checks
    ]
    width = max([len("check")] + [len(name) for name, _, _ in rows])
    lines = [f"model server check of {url}", "", f"{'check':<{width}}  result  detail"]
    lines += [f"{name:<{width}}  {result:<6}  {detail}" for name, result, detail in rows]
    return "\n".join(lines)


def passed(checks: Iterable[Check]) -> bool:
    return all(c.ok or not c.required for c in checks)


def _json(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        return response.text


def run(
    url: str,
    *,
    model: str | None = None,
    api_key: str | None = None,
    adapters: bool | None = None,
    timeout: float = 60.0,
) -> list[Check]:
    """The checks against one pod (or anything serving the same routes) at `url`.
    `model`: the served name to send (default: the first base model /v1/models lists).
    `adapters`: require the LoRA metric (default: when /v1/models lists an adapter)."""
    base = url.rstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    checks: list[Check] = []
    with httpx.Client(base_url=base, headers=headers, timeout=timeout) as client:
        try:
            listed = client.get("/v1/models")
        except httpx.HTTPError as exc:
            return [Check("/v1/models", False, f"no answer: {exc}")]
        data = _json(listed).get("data") if isinstance(_json(listed), Mapping) else None
        if listed.status_code != 200 or not isinstance(data, list) or not data:
            return [
                Check("/v1/models", False, f"HTTP {listed.status_code}: {str(_json(listed))[:200]}")
            ]
        bases = [m["id"] for m in data if not m.get("parent")]
        loras = [m["id"] for m in data if m.get("parent")]
        checks.append(
            Check(
                "/v1/models",
                True,
                f"{', '.join(bases)}" + (f"; adapters {', '.join(loras)}" if loras else ""),
            )
        )
        model = model or (bases or [data[0]["id"]])[0]
        adapters = bool(loras) if adapters is None else adapters
        for name, path, body, chat in (
            ("/v1/completions", "/v1/completions", {"prompt": "Hello"}, False),
            (
                "/v1/chat/completions",
                "/v1/chat/completions",
                {"messages": [{"role": "user", "content": "Hello"}]},
                True,
            ),
        ):
            try:
                answer = client.post(path, json={"model": model, "max_tokens": 1, **body})
            except httpx.HTTPError as exc:
                checks.append(Check(name, False, f"no answer: {exc}"))
                continue
            checks.append(answer_check(name, answer.status_code, _json(answer), chat=chat))
        try:
            metrics = client.get("/metrics")
        except httpx.HTTPError as exc:
            return [*checks, Check("/metrics", False, f"no answer: {exc}")]
        if metrics.status_code != 200:
            return [*checks, Check("/metrics", False, f"HTTP {metrics.status_code}")]
        checks.extend(metric_checks(metrics.text, adapters=adapters))
    return checks
