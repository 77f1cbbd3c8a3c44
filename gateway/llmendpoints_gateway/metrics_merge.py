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

    def add(self, series: str, value: float, *, keep_max: bool) -> None:
        before = self.samples.get(series)
        if before is None:
            self.samples[series] = value
        else:
            self.samples[series] = max(before, value) if keep_max else before + value


def merge(expositions: Sequence[str], maximum: Iterable[str] = MAXIMUM) -> str:
    """The expositions (Prometheus text format 0.0.4, as prometheus_client writes it) as one:
    families in order of first appearance, each family's samples together."""
    take_max = frozenset(maximum)
    families: dict[str, _Family] = {}
    for text in expositions:
        name = ""
        current = families.setdefault(name, _Family())  # samples before any # line (none here)
        for line in text.splitlines():
            if line.startswith("#"):
                name, current = _heading(line, families, name, current)
            elif line:
                series, _, value = line.rpartition(" ")
                current.add(series, float(value), keep_max=name in take_max)
    lines: list[str] = []
    for family in families.values():
        lines += [line for line in (family.help, family.type) if line is not None]
        lines += [f"{series} {floatToGoString(value)}" for series, value in family.samples.items()]
    return "\n".join(lines) + "\n" if lines else ""


def _heading(
    line: str, families: dict[str, _Family], name: str, current: _Family
) -> tuple[str, _Family]:
    """A ``# HELP`` or ``# TYPE`` line opens its family (or returns to it: the first worker's
    text is kept); any other comment leaves the current one."""
    parts = line.split(" ", 3)
    if len(parts) < 3 or parts[1] not in ("HELP", "TYPE"):
        return name, current
    family = families.setdefault(parts[2], _Family())
    if parts[1] == "HELP" and family.help is None:
        family.help = line
    elif parts[1] == "TYPE" and family.type is None:
        family.type = line
    return parts[2], family
