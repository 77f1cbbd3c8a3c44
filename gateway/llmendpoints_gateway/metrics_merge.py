"""PURE: several worker processes' Prometheus expositions as one, the pod's.

With GATEWAY_WORKERS > 1 each worker keeps its own registry (metrics.GatewayMetrics) and the
supervisor serves their sum on GATEWAY_METRICS_PORT, so a dashboard reads one gateway pod as
before: the same families, the same labels, no ``worker`` label. Chosen over prometheus_client's
multiprocess mode (one mmap file per process and metric, read at scrape time) because that mode
cannot remove a series (a replica's ``in_flight_requests`` must go when the replica does), keeps
files of dead workers, and needs a writable directory on a read-only root filesystem; here a
worker's series are its own, removed as in a single process, and merging costs only the scrape.

How series of the same name and labels combine: counters, histograms and most gauges add up
(requests, tokens, in-flight and held requests are each worker's share of the pod's); the gauges
every worker reports whole -- ``ready_replicas``, which each worker's own discovery sees alike --
take the largest (``MAXIMUM``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from prometheus_client.utils import floatToGoString

MAXIMUM = frozenset({"llmendpoints_gateway_ready_replicas"})


@dataclass
class _Family:
    help: str | None = None
    type: str | None = None
    samples: dict[str, float] = field(default_factory=dict)  # "name{labels}" -> value


def merge(expositions: Sequence[str], maximum: Iterable[str] = MAXIMUM) -> str:
    """The expositions (Prometheus text format 0.0.4, as prometheus_client writes it) as one:
    families in order of first appearance, each family's samples together."""
    take_max = frozenset(maximum)
    families: dict[str, _Family] = {}
    for text in expositions:
        current = families.setdefault("", _Family())  # samples before any # line (none here)
        name = ""
        for line in text.splitlines():
            if not line:
                continue
            if line.startswith("#"):
                parts = line.split(" ", 3)
                if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                    name = parts[2]
                    current = families.setdefault(name, _Family())
                    if parts[1] == "HELP" and current.help is None:
                        current.help = line
                    elif parts[1] == "TYPE" and current.type is None:
                        current.type = line
                continue
            series, _, value = line.rpartition(" ")
            number = float(value)
            before = current.samples.get(series)
            if before is None:
                current.samples[series] = number
            elif name in take_max:
                current.samples[series] = max(before, number)
            else:
                current.samples[series] = before + number
    lines: list[str] = []
    for family in families.values():
        lines += [line for line in (family.help, family.type) if line is not None]
        lines += [f"{series} {floatToGoString(value)}" for series, value in family.samples.items()]
    return "\n".join(lines) + "\n" if lines else ""
