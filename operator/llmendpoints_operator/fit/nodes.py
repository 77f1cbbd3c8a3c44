"""Which nodes a pod may be scheduled on, and the memory of their GPUs. PURE.

NVIDIA's GPU feature discovery labels every GPU node with `nvidia.com/gpu.product`,
`nvidia.com/gpu.memory` (MiB per GPU) and `nvidia.com/gpu.count`. A pod may run on a node when the
node offers the GPU resource, carries every label of its nodeSelector, matches one of its required
node affinity's terms, and has no NoSchedule/NoExecute taint the pod does not tolerate (the
scheduler's own rules, for the fields an endpoint can set). Cordoned nodes are left out. The
pods may land on any of them, so the smallest GPU memory among them is the one that must do.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

MiB = 1 << 20
PRODUCT = "nvidia.com/gpu.product"
MEMORY = "nvidia.com/gpu.memory"
COUNT = "nvidia.com/gpu.count"


@dataclass(frozen=True)
class Placement:
    """Where the endpoint's pods may go (spec.resources)."""

    gpu_resource: str
    gpus: int
    node_selector: Mapping[str, str]
    affinity: Mapping[str, Any] | None
    tolerations: Sequence[Mapping[str, Any]]


@dataclass(frozen=True)
class Gpus:
    """The GPU the check sizes for: the smallest memory among the nodes the pods may use."""

    memory: int | None  # bytes per GPU; None: no node says
    product: str | None
    per_node: int | None  # the most GPUs one eligible node has
    nodes: int  # eligible nodes
    unlabelled: int  # eligible nodes without nvidia.com/gpu.memory
    products: tuple[str, ...] = ()  # every product among them


def _expression(labels: Mapping[str, str], expr: Mapping[str, Any]) -> bool:
    key, op, values = expr.get("key"), expr.get("operator"), expr.get("values") or []
    value = labels.get(key) if isinstance(key, str) else None
    if op == "In":
        return value in values
    if op == "NotIn":
        return value not in values
    if op == "Exists":
        return value is not None
    if op == "DoesNotExist":
        return value is None
    if op in ("Gt", "Lt") and value is not None and values:
        try:
            left, right = int(value), int(values[0])
        except ValueError:
            return False
        return left > right if op == "Gt" else left < right
    return False


def _term(node: Mapping[str, Any], term: Mapping[str, Any]) -> bool:
    labels = (node.get("metadata") or {}).get("labels") or {}
    fields = {"metadata.name": (node.get("metadata") or {}).get("name")}
    exprs = term.get("matchExpressions") or []
    field_exprs = term.get("matchFields") or []
    if not exprs and not field_exprs:
        return False  # an empty term matches nothing (the scheduler's rule)
    return all(_expression(labels, e) for e in exprs) and all(
        _expression(fields, e) for e in field_exprs
    )


def _affinity_allows(node: Mapping[str, Any], affinity: Mapping[str, Any] | None) -> bool:
    required = ((affinity or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    )
    if not required:
        return True
    return any(_term(node, t) for t in required.get("nodeSelectorTerms") or [])


def _tolerated(taint: Mapping[str, Any], tolerations: Sequence[Mapping[str, Any]]) -> bool:
    for t in tolerations:
        if t.get("effect") and t.get("effect") != taint.get("effect"):
            continue
        if not t.get("key"):
            if t.get("operator") == "Exists":
                return True
            continue
        if t.get("key") != taint.get("key"):
            continue
        if t.get("operator") == "Exists" or t.get("value", "") == taint.get("value", ""):
            return True
    return False


def eligible(node: Mapping[str, Any], placement: Placement) -> bool:
    meta, spec = node.get("metadata") or {}, node.get("spec") or {}
    labels = meta.get("labels") or {}
    if spec.get("unschedulable"):
        return False
    if any(labels.get(k) != v for k, v in placement.node_selector.items()):
        return False
    if not _affinity_allows(node, placement.affinity):
        return False
    for taint in spec.get("taints") or []:
        blocking = taint.get("effect") in ("NoSchedule", "NoExecute")
        if blocking and not _tolerated(taint, placement.tolerations):
            return False
    return _gpu_count(node, placement.gpu_resource) >= placement.gpus


def _gpu_count(node: Mapping[str, Any], resource: str) -> int:
    allocatable = (node.get("status") or {}).get("allocatable") or {}
    labels = (node.get("metadata") or {}).get("labels") or {}
    for raw in (allocatable.get(resource), labels.get(COUNT)):
        try:
            return int(str(raw))
        except ValueError:
            continue
    return 0


def gpus(nodes: Iterable[Mapping[str, Any]], placement: Placement) -> Gpus:
    """The GPUs of the nodes the pods may run on."""
    fits = [n for n in nodes if eligible(n, placement)]
    memories: list[tuple[int, str | None]] = []
    for node in fits:
        labels = (node.get("metadata") or {}).get("labels") or {}
        try:
            memories.append((int(labels[MEMORY]) * MiB, labels.get(PRODUCT)))
        except (KeyError, ValueError):
            continue
    smallest = min(memories, key=lambda m: m[0], default=(None, None))
    return Gpus(
        memory=smallest[0],
        product=smallest[1],
        per_node=max((_gpu_count(n, placement.gpu_resource) for n in fits), default=None),
        nodes=len(fits),
        unlabelled=len(fits) - len(memories),
        products=tuple(sorted({p for _, p in memories if p})),
    )
