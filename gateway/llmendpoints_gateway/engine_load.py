"""Each ready replica's engine load: what scoring.py weighs.

`parse_engine_metrics` (pure) reads, from one pod's /metrics (the runtime's own series followed by
vLLM's), what the engine reports about itself:

- ``vllm:num_requests_running``, ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``;
- ``vllm:prefix_cache_queries`` / ``vllm:prefix_cache_hits`` (counters, in tokens): the hit rate
  the engine itself sees, for the gateway's metrics;
- ``vllm:lora_requests_info`` (the adapters active in its batches, and max_lora) and our
  ``llmendpoints_adapter_ready`` (the adapters the pod has loaded);
- ``vllm:cache_config_info`` (num_gpu_blocks x block_size: how many tokens its KV cache holds,
  which sizes the prefix index's memory of that replica).

Who reads, where and how often: pod_reader.py (each pod's control port, one reader per gateway
pod, only while its endpoints have traffic). A replica that fails keeps its last sample, which
ages (the scorer ignores old ones). No per-request round trip: the request path only reads the
latest samples.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from llmendpoints_gateway.scoring import EngineState

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
PREFIX_QUERIES = "vllm:prefix_cache_queries"
PREFIX_HITS = "vllm:prefix_cache_hits"
LORA_INFO = "vllm:lora_requests_info"
CACHE_INFO = "vllm:cache_config_info"
ADAPTER_READY = "llmendpoints_adapter_ready"
# Summed over their label sets (one per engine, with data parallelism; KV usage then averaged).
_SUMMED = (RUNNING, WAITING, KV_USAGE, f"{PREFIX_QUERIES}_total", f"{PREFIX_HITS}_total")
# The sample names read; every other line is passed over by its first characters.
_WANTED = frozenset((*_SUMMED, LORA_INFO, CACHE_INFO, ADAPTER_READY))
_PREFIXES = ("vllm:", ADAPTER_READY)
# name{labels} value [timestamp]; label values are quoted (\\ \" \n escaped).
_SAMPLE = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?[ \t]+(\S+)(?:[ \t]+\S+)?[ \t]*$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"')
# vLLM's histograms make a pod's /metrics a few hundred kB at most; refuse anything absurd.
MAX_BODY_BYTES = 8 * 1024 * 1024


class EngineMetricsError(ValueError):
    """A pod answered, but not with the engine gauges the scorer needs."""


@dataclass(frozen=True)
class EngineLoad:
    """One replica's engine, as its /metrics said at `taken_at` (time.monotonic())."""

    running: float
    waiting: float
    kv_usage: float  # 0..1
    prefix_queries: float = 0.0  # tokens, since the engine started
    prefix_hits: float = 0.0
    active_adapters: frozenset[str] = frozenset()  # running or waiting in the engine's batches
    max_lora: int | None = None  # LoRA slots per batch; None when LoRA is off
    ready_adapters: frozenset[str] = frozenset()  # loaded by the pod (llmendpoints_adapter_ready)
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    taken_at: float = 0.0

    @property
    def kv_tokens(self) -> int | None:
        """Tokens the engine's KV cache holds, when it reports its cache config."""
        if self.block_size and self.num_gpu_blocks:
            return self.block_size * self.num_gpu_blocks
        return None

    def age(self, now: float) -> float:
        return max(0.0, now - self.taken_at)

    def state(self, now: float) -> EngineState:
        """What the scorer weighs, aged to `now` (time.monotonic())."""
        return EngineState(
            running=self.running,
            waiting=self.waiting,
            kv_usage=self.kv_usage,
            active_adapters=self.active_adapters,
            max_lora=self.max_lora,
            age_s=self.age(now),
        )


def parse_engine_metrics(text: str, taken_at: float = 0.0) -> EngineLoad:
    """PURE: one pod's Prometheus text -> its engine load. Raises EngineMetricsError when the
    three gauges are missing or out of range (not a vLLM engine, or not serving yet)."""
    sums: dict[str, float] = {}
    lora: tuple[float, Mapping[str, str]] | None = None
    cache: Mapping[str, str] = {}
    ready: set[str] = set()
    kv_engines = 0
    for name, labels, value in _samples(text):
        if name in _SUMMED:
            sums[name] = sums.get(name, 0.0) + value
            kv_engines += name == KV_USAGE
        elif name == LORA_INFO and (lora is None or value > lora[0]):
            lora = (value, _labels(labels))  # the latest update wins
        elif name == CACHE_INFO and not cache:
            cache = _labels(labels)
        elif name == ADAPTER_READY and value >= 1:
            ready.add(_labels(labels).get("adapter", ""))
    _check_gauges(sums)
    active, max_lora = _lora_batches(lora[1] if lora is not None else None)
    return EngineLoad(
        running=sums[RUNNING],
        waiting=sums[WAITING],
        kv_usage=min(sums[KV_USAGE] / max(kv_engines, 1), 1.0),  # the engines' mean (data parallel)
        prefix_queries=sums.get(f"{PREFIX_QUERIES}_total", 0.0),
        prefix_hits=sums.get(f"{PREFIX_HITS}_total", 0.0),
        active_adapters=active,
        max_lora=max_lora,
        ready_adapters=frozenset(ready - {""}),
        block_size=_int(cache.get("block_size")),
        num_gpu_blocks=_int(cache.get("num_gpu_blocks")),
        taken_at=taken_at,
    )


def _check_gauges(sums: Mapping[str, float]) -> None:
    missing = [n for n in (RUNNING, WAITING, KV_USAGE) if n not in sums]
    if missing:
        raise EngineMetricsError(f"missing {', '.join(missing)}")
    for name in (RUNNING, WAITING, KV_USAGE):
        if not math.isfinite(sums[name]) or sums[name] < 0:
            raise EngineMetricsError(f"{name} is {sums[name]}")


def _lora_batches(labels: Mapping[str, str] | None) -> tuple[frozenset[str], int | None]:
    """The adapters running or waiting in the engine's batches, and its LoRA slots per batch,
    from ``vllm:lora_requests_info``'s labels (none: LoRA off)."""
    if labels is None:
        return frozenset(), None
    names = f"{labels.get('running_lora_adapters', '')},{labels.get('waiting_lora_adapters', '')}"
    return frozenset(a.strip() for a in names.split(",") if a.strip()), _int(labels.get("max_lora"))


def _samples(text: str) -> Iterator[tuple[str, str, float]]:
    """(name, label text, value) of the wanted series' lines of a Prometheus text exposition.
    Every other line (vLLM's histograms are most of a pod's /metrics) is passed over by its
    first characters; prometheus_client's own parser, character by character, took ~0.5 ms
    for a few kB and several for a pod's /metrics (issue 33)."""
    for line in text.splitlines():
        if not line.startswith(_PREFIXES):
            continue
        end = len(line)
        for stop in ("{", " "):
            at = line.find(stop)
            if 0 <= at < end:
                end = at
        if line[:end] not in _WANTED:
            continue
        match = _SAMPLE.match(line)
        if match is None:
            raise EngineMetricsError(f"unparsable metrics line: {line[:120]!r}")
        try:
            value = float(match.group(3))
        except ValueError:
            raise EngineMetricsError(f"unparsable metrics value: {line[:120]!r}") from None
        yield match.group(1), match.group(2) or "", value


def _labels(text: str) -> dict[str, str]:
    return {k: _unescape(v) for k, v in _LABEL.findall(text)}


def _unescape(value: str) -> str:
    if "\\" not in value:
        return value
    return value.replace("\\\\", "\0").replace('\\"', '"').replace("\\n", "\n").replace("\0", "\\")


def _int(value: str | None) -> int | None:
    try:
        return int(value) if value not in (None, "", "None") else None
    except ValueError:
        return None


def hit_rate(before: EngineLoad | None, after: EngineLoad) -> tuple[float, float]:
    """(hits, queries) between two samples of one engine, in tokens (a restarted engine's
    counters start again from zero: its whole count is the delta)."""
    if before is None or after.prefix_queries < before.prefix_queries:
        return after.prefix_hits, after.prefix_queries
    return after.prefix_hits - before.prefix_hits, after.prefix_queries - before.prefix_queries


def load_to_json(load: EngineLoad) -> dict:
    """One sample as JSON (what the pod's reader publishes to the other workers: pod_board.py)."""
    return {
        "running": load.running,
        "waiting": load.waiting,
        "kv_usage": load.kv_usage,
        "prefix_queries": load.prefix_queries,
        "prefix_hits": load.prefix_hits,
        "active_adapters": sorted(load.active_adapters),
        "max_lora": load.max_lora,
        "ready_adapters": sorted(load.ready_adapters),
        "block_size": load.block_size,
        "num_gpu_blocks": load.num_gpu_blocks,
        "taken_at": load.taken_at,  # time.monotonic(): one clock for every process of a host
    }


def load_from_json(data: Mapping[str, Any]) -> EngineLoad:
    return EngineLoad(
        running=float(data["running"]),
        waiting=float(data["waiting"]),
        kv_usage=float(data["kv_usage"]),
        prefix_queries=float(data.get("prefix_queries", 0.0)),
        prefix_hits=float(data.get("prefix_hits", 0.0)),
        active_adapters=frozenset(data.get("active_adapters") or ()),
        max_lora=data.get("max_lora"),
        ready_adapters=frozenset(data.get("ready_adapters") or ()),
        block_size=data.get("block_size"),
        num_gpu_blocks=data.get("num_gpu_blocks"),
        taken_at=float(data.get("taken_at", 0.0)),
    )
