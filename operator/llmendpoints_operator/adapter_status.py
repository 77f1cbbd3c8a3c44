"""PURE: per-adapter status (status.adapters) from what the ready pods' /metrics say.

Each runtime pod exports, per declared LoRA adapter, ``llmendpoints_adapter_ready{adapter}``
(1 serving, 0 not yet) and, while its last attempt failed,
``llmendpoints_adapter_error_info{adapter,message}``. The status says, for every adapter the spec
declares, on how many of the ready replicas it serves and the last error a replica reported::

    adapters:
      - {name: sql, readyReplicas: 2, replicas: 2}
      - {name: legal, readyReplicas: 0, replicas: 2, lastError: "2 of 2 replicas: ..."}

Written only by the adapter watcher (autoscaling/adapter_watch.py), like status.autoscaling is by
the autoscaler, so the reconcile's status writes leave it alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

STATUS_KEY = "adapters"
READY = "llmendpoints_adapter_ready"
ERROR = "llmendpoints_adapter_error_info"
_PREFIXES = (READY, ERROR, f"# TYPE {READY}", f"# TYPE {ERROR}")


@dataclass(frozen=True)
class PodAdapter:
    ready: bool
    error: str | None = None


def parse_pod_adapters(text: str) -> dict[str, PodAdapter]:
    """adapter -> its state on one pod, from the pod's Prometheus text (absent: not declared
    there yet, e.g. the kubelet has not refreshed the pod's list). Unparsable lines are ignored:
    adapter status must never fail a scrape the autoscaler depends on."""
    wanted = "\n".join(line for line in text.splitlines() if line.startswith(_PREFIXES))
    ready: dict[str, bool] = {}
    errors: dict[str, str] = {}
    try:
        for family in text_string_to_metric_families(wanted + "\n"):
            for sample in family.samples:
                name = sample.labels.get("adapter")
                if not name:
                    continue
                if sample.name == READY:
                    ready[name] = sample.value >= 1
                elif sample.name == ERROR and sample.value >= 1:
                    errors[name] = sample.labels.get("message", "")
    except ValueError:
        return {}
    return {name: PodAdapter(ready[name], errors.get(name)) for name in ready}


def adapter_status(
    declared: Sequence[str], pods: Sequence[Mapping[str, PodAdapter]]
) -> list[dict[str, object]]:
    """status.adapters: one entry per declared adapter, in spec order (``pods``: one mapping
    per ready replica whose /metrics was read)."""
    entries: list[dict[str, object]] = []
    for name in declared:
        states = [pod[name] for pod in pods if name in pod]
        entry: dict[str, object] = {
            "name": name,
            "readyReplicas": sum(1 for s in states if s.ready),
            "replicas": len(pods),
        }
        failed = sorted({s.error for s in states if s.error})
        if failed:
            count = sum(1 for s in states if s.error)
            entry["lastError"] = f"{count} of {len(pods)} replicas: {failed[0]}"
        entries.append(entry)
    return entries
