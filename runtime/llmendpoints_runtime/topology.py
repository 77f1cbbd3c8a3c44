"""Where this process stands in its replica, and the vLLM flags that follow (pure).

A replica is one pod, or -- for a model bigger than a node -- one LeaderWorkerSet group of
``LLMEP_NODES`` pods. LeaderWorkerSet injects ``LWS_GROUP_SIZE``, ``LWS_WORKER_INDEX`` (0 is
the leader) and ``LWS_LEADER_ADDRESS`` into every container of the group; the operator writes
``LLMEP_NODES`` and ``LLMEP_MULTINODE_PORT`` beside the parallel sizes
(docs/multinode-runtime.md, the operator <-> runtime contract). From these the runtime decides its role
and launches vLLM's own multi-node mode (the mp executor; no Ray cluster to form):

- tensor/pipeline parallel across the nodes (``DATA_PARALLEL_SIZE`` 1): every node runs
  ``tensor x pipeline / nodes`` workers of one engine; the leader ``--nnodes N --node-rank 0
  --master-addr <leader> --master-port <port>`` serves HTTP, the others add ``--headless``.
- data parallel across the nodes (``DATA_PARALLEL_SIZE`` a multiple of the nodes): each node
  runs ``data / nodes`` whole engines (``--data-parallel-size-local``), the leader's API server
  balances over all of them (``--data-parallel-address <leader> --data-parallel-rpc-port``),
  the others run theirs ``--headless`` from ``--data-parallel-start-rank``.

Ports, all on the leader and derived from ``LLMEP_MULTINODE_PORT`` (P, default 29500): P is
torch.distributed's master port, P+1 vLLM's data-parallel RPC port, P+2 the group's liveness
channel (``group.py``). P+3 ... P+9 are reserved.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DEFAULT_MULTINODE_PORT = 29500
DATA_PARALLEL_RPC_OFFSET = 1
GROUP_CHANNEL_OFFSET = 2
RESERVED_PORTS = 10  # P ... P+9

# The vLLM flags the runtime sets itself from the group's variables (never from the
# environment): the names are torch's and LWS's too generic to be read as vLLM flags.
TOPOLOGY_FLAGS = {
    "--nnodes": "the runtime sets it from LLMEP_NODES (a LeaderWorkerSet group)",
    "--node-rank": "the runtime sets it from LWS_WORKER_INDEX",
    "--master-addr": "the runtime sets it from LWS_LEADER_ADDRESS",
    "--master-port": "the runtime sets it from LLMEP_MULTINODE_PORT",
    "--data-parallel-size-local": "the runtime sets it from DATA_PARALLEL_SIZE / LLMEP_NODES",
    "--data-parallel-start-rank": "the runtime sets it from LWS_WORKER_INDEX",
    "--data-parallel-address": "the runtime sets it from LWS_LEADER_ADDRESS",
    "--data-parallel-rpc-port": "the runtime sets it from LLMEP_MULTINODE_PORT + 1",
    "--data-parallel-rank": "the runtime runs one data-parallel replica set per group",
    "--headless": "the runtime runs headless on a group's workers (LWS_WORKER_INDEX > 0)",
}


class TopologyError(ValueError):
    """A combination of the group's variables that cannot run; ``variable`` names one."""

    def __init__(self, variable: str, message: str) -> None:
        super().__init__(f"{variable}: {message}")
        self.variable = variable
        self.message = message


@dataclass(frozen=True)
class Sizes:
    """The engine's parallel sizes, as vLLM parsed them."""

    tensor: int = 1
    pipeline: int = 1
    data: int = 1


@dataclass(frozen=True)
class Topology:
    nodes: int = 1
    rank: int = 0  # LWS_WORKER_INDEX; 0 is the leader (and a single pod)
    leader_address: str | None = None
    port: int = DEFAULT_MULTINODE_PORT
    sizes: Sizes = Sizes()

    @property
    def multinode(self) -> bool:
        return self.nodes > 1

    @property
    def leader(self) -> bool:
        return self.rank == 0

    @property
    def headless(self) -> bool:
        """A group's worker: no HTTP server, only the control port."""
        return self.multinode and not self.leader

    @property
    def data_parallel_across_nodes(self) -> bool:
        return self.multinode and self.sizes.data > 1

    @property
    def data_parallel_local(self) -> int:
        """Data-parallel engines on this node."""
        return self.sizes.data // self.nodes if self.data_parallel_across_nodes else self.sizes.data

    @property
    def group_port(self) -> int:
        return self.port + GROUP_CHANNEL_OFFSET

    @property
    def data_parallel_rpc_port(self) -> int:
        return self.port + DATA_PARALLEL_RPC_OFFSET

    def describe(self) -> str:
        if not self.multinode:
            return "one pod"
        role = "leader" if self.leader else f"worker {self.rank}"
        split = (
            f"{self.data_parallel_local} data-parallel engine(s) per node"
            if self.data_parallel_across_nodes
            else f"tensor {self.sizes.tensor} x pipeline {self.sizes.pipeline} across the nodes"
        )
        return f"{role} of a {self.nodes}-node group led by {self.leader_address} ({split})"


def read_topology(
    *,
    nodes: int | None,
    group_size: int | None,
    worker_index: int | None,
    leader_address: str | None,
    port: int,
    sizes: Sizes,
) -> Topology:
    """The topology from LLMEP_NODES and LeaderWorkerSet's variables; TopologyError naming
    the variable when they disagree or the sizes cannot be split over the nodes."""
    group = group_size or 1
    if nodes is not None and nodes != group:
        if group_size is None:
            raise TopologyError(
                "LLMEP_NODES",
                f"is {nodes}, but LWS_GROUP_SIZE is not set: a multi-node replica runs as a "
                "LeaderWorkerSet group, which sets it (run it through the operator)",
            )
        raise TopologyError(
            "LLMEP_NODES", f"is {nodes}, but LWS_GROUP_SIZE is {group_size}: they must agree"
        )
    rank = worker_index or 0
    if rank >= group:
        raise TopologyError(
            "LWS_WORKER_INDEX", f"is {rank}, outside a group of LWS_GROUP_SIZE={group}"
        )
    if group > 1 and not leader_address:
        raise TopologyError("LWS_LEADER_ADDRESS", f"is not set, in a group of {group} nodes")
    if group > 1 and port + RESERVED_PORTS - 1 > 65535:
        raise TopologyError(
            "LLMEP_MULTINODE_PORT", f"is {port}: the group uses it and the 9 ports above it"
        )
    topology = Topology(group, rank, leader_address if group > 1 else None, port, sizes)
    check_sizes(topology)
    return topology


def check_sizes(topology: Topology) -> None:
    """Whether the parallel sizes split over the group's nodes."""
    if not topology.multinode:
        return
    sizes, nodes = topology.sizes, topology.nodes
    if sizes.data > 1:
        if sizes.data % nodes:
            raise TopologyError(
                "DATA_PARALLEL_SIZE",
                f"is {sizes.data}, across LLMEP_NODES={nodes}: each node runs whole "
                "data-parallel engines, so make it a multiple of the nodes (or 1, with "
                "TENSOR_PARALLEL_SIZE x PIPELINE_PARALLEL_SIZE across the nodes); an engine "
                "that spans nodes inside data parallel is not supported",
            )
        return
    world = sizes.tensor * sizes.pipeline
    if world < nodes:
        raise TopologyError(
            "TENSOR_PARALLEL_SIZE",
            f"{world} workers for LLMEP_NODES={nodes}: a node would have none",
        )
    if world % nodes:
        raise TopologyError(
            "PIPELINE_PARALLEL_SIZE" if sizes.pipeline > 1 else "TENSOR_PARALLEL_SIZE",
            f"TENSOR_PARALLEL_SIZE x PIPELINE_PARALLEL_SIZE = {sizes.tensor} x "
            f"{sizes.pipeline} = {world} workers cannot be split evenly over LLMEP_NODES="
            f"{nodes}: every node of the group runs the same number of workers",
        )


def vllm_flags(topology: Topology) -> list[str]:
    """The flags that launch vLLM's multi-node mode for this node (none for one pod)."""
    if not topology.multinode:
        return []
    leader = topology.leader_address or ""
    if topology.data_parallel_across_nodes:
        local = topology.data_parallel_local
        flags = [
            "--data-parallel-size-local", str(local),
            "--data-parallel-address", leader,
            "--data-parallel-rpc-port", str(topology.data_parallel_rpc_port),
        ]  # fmt: skip
        if topology.headless:
            flags += ["--data-parallel-start-rank", str(topology.rank * local)]
    else:
        flags = [
            "--nnodes", str(topology.nodes),
            "--node-rank", str(topology.rank),
            "--master-addr", leader,
            "--master-port", str(topology.port),
            "--distributed-executor-backend", "mp",
        ]  # fmt: skip
    return [*flags, "--headless"] if topology.headless else flags


def default_api_server_count(cpus: int, engine_processes: int) -> int:
    """API_SERVER_COUNT when it is not set: one API process per 4 CPUs the engine's own
    processes leave (its core and its workers take one each), at most 8 -- so 1 on pods of up
    to 8 CPUs (pure)."""
    spare = cpus - max(1, engine_processes)
    return max(1, min(8, math.floor(spare / 4)))
