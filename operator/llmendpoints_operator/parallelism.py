"""How one replica's GPUs are split: tensor x pipeline x data parallel over gpus x nodes. PURE.

A replica is `resources.nodes` pods (one LeaderWorkerSet group when more than one) of
`resources.gpus` GPUs each, and every GPU holds one shard: tensor x pipeline x data must equal
gpus x nodes. Sizes left out are derived, in this order:

- dataParallelSize: 1;
- pipelineParallelSize: resources.nodes when neither tensorParallelSize nor dataParallelSize is
  given (vLLM's advice for several nodes: tensor parallel inside a node, one pipeline stage per
  node), else 1;
- tensorParallelSize: the GPUs left, gpus x nodes / (pipeline x data).

A CPU replica (gpus 0) has no GPU count to match: every node must then run the same number of
ranks. Data parallel across nodes places whole ranks on each node (vLLM's
--data-parallel-size-local), so dataParallelSize is then a multiple of nodes.

The CRD holds the same rules in CEL (crds/, tests/unit/operator/test_operator_crd.py evaluates
them against this module's answers).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Parallelism:
    """The sizes one replica runs with, all derived."""

    tensor: int
    pipeline: int
    data: int
    nodes: int
    gpus: int  # per node
    expert: bool = False

    @property
    def multinode(self) -> bool:
        return self.nodes > 1


class ParallelismError(ValueError):
    """The sizes cannot fit; `field` is the engine field to look at first (one the user set)."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(message)


def _sizes(tensor: int, pipeline: int, data: int) -> str:
    return (
        f"tensorParallelSize {tensor} x pipelineParallelSize {pipeline} x dataParallelSize {data}"
    )


def derive(
    *,
    gpus: int,
    nodes: int,
    tensor: int | None,
    pipeline: int | None,
    data: int | None,
    expert: bool = False,
) -> Parallelism:
    """The sizes of one replica; ParallelismError naming every size when they cannot fit."""
    given = [
        name
        for name, value in (
            ("tensorParallelSize", tensor),
            ("pipelineParallelSize", pipeline),
            ("dataParallelSize", data),
        )
        if value is not None
    ]
    field = given[0] if given else "tensorParallelSize"
    d = data or 1
    p = pipeline if pipeline is not None else (nodes if tensor is None and data is None else 1)
    if gpus == 0:
        t = tensor or 1
        if (t * p * d) % nodes:
            raise ParallelismError(
                field,
                f"{_sizes(t, p, d)} = {t * p * d} ranks cannot be spread evenly over "
                f"resources.nodes {nodes} (a CPU replica, resources.gpus 0, runs the same number "
                "of ranks on every node)",
            )
    else:
        total = f"resources.gpus {gpus} x resources.nodes {nodes} = {gpus * nodes}"
        if tensor is None and (gpus * nodes) % (p * d):
            raise ParallelismError(
                field,
                f"pipelineParallelSize {p} x dataParallelSize {d} = {p * d} does not divide "
                f"{total} (tensorParallelSize, unset, takes the GPUs left)",
            )
        t = tensor if tensor is not None else gpus * nodes // (p * d)
        if t * p * d != gpus * nodes:
            raise ParallelismError(
                field,
                f"{_sizes(t, p, d)} = {t * p * d}, but {total}: every GPU of a replica holds "
                'one shard (sizes left out are derived: docs/operator.md, "Parallelism")',
            )
    if nodes > 1 and d > 1 and d % nodes:
        raise ParallelismError(
            "dataParallelSize",
            f"dataParallelSize {d} is not a multiple of resources.nodes {nodes}: every node runs "
            "the same number of whole data-parallel ranks",
        )
    return Parallelism(tensor=t, pipeline=p, data=d, nodes=nodes, gpus=gpus, expert=expert)
