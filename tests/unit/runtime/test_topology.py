"""A pod's place in its replica (LeaderWorkerSet's variables + the contract's) -> vLLM's
multi-node flags, through vLLM's real parser; bad combinations refused naming a variable."""

from __future__ import annotations

import pytest
from llmendpoints_runtime.config import ConfigError, api_server_count, load_config
from llmendpoints_runtime.topology import default_api_server_count

BASE = {"MODEL_NAME": "org/model"}
GROUP = {"LLMEP_NODES": "2", "LWS_GROUP_SIZE": "2", "LWS_LEADER_ADDRESS": "ep-0.ep.ns"}


def config(**env: str):
    return load_config({**BASE, **env})


def error_for(**env: str) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        config(**env)
    return info.value


def flags_after(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_one_pod_gets_no_group_flags():
    cfg = config()
    assert not cfg.topology.multinode and not cfg.topology.headless
    assert "--nnodes" not in cfg.vllm_argv and "--headless" not in cfg.vllm_argv


def test_pipeline_across_two_nodes_leader_and_worker():
    leader = config(**GROUP, LWS_WORKER_INDEX="0", PIPELINE_PARALLEL_SIZE="2")
    worker = config(**GROUP, LWS_WORKER_INDEX="1", PIPELINE_PARALLEL_SIZE="2")
    for cfg, rank in ((leader, "0"), (worker, "1")):
        argv, args = cfg.vllm_argv, cfg.engine_args
        assert flags_after(argv, "--nnodes") == "2"
        assert flags_after(argv, "--node-rank") == rank
        assert args.master_addr == "ep-0.ep.ns" and args.master_port == 29500
        assert args.distributed_executor_backend == "mp"
    assert not leader.engine_args.headless and not leader.topology.headless
    assert worker.engine_args.headless and worker.topology.headless
    assert leader.topology.group_port == 29502


def test_data_parallel_across_nodes_splits_engines_per_node():
    worker = config(**GROUP, LWS_WORKER_INDEX="1", DATA_PARALLEL_SIZE="4")
    args = worker.engine_args
    assert args.data_parallel_size == 4 and args.data_parallel_size_local == 2
    assert args.data_parallel_start_rank == 2 and args.headless
    assert args.data_parallel_address == "ep-0.ep.ns" and args.data_parallel_rpc_port == 29501
    leader = config(**GROUP, LWS_WORKER_INDEX="0", DATA_PARALLEL_SIZE="4")
    assert leader.engine_args.data_parallel_size_local == 2
    assert leader.engine_args.data_parallel_start_rank is None
    assert "--nnodes" not in leader.vllm_argv


def test_the_port_is_the_contracts_and_moves_every_derived_port():
    cfg = config(**GROUP, LLMEP_MULTINODE_PORT="31000", DATA_PARALLEL_SIZE="2")
    assert cfg.engine_args.data_parallel_rpc_port == 31001
    assert cfg.topology.group_port == 31002


@pytest.mark.parametrize(
    ("env", "variable", "words"),
    [
        ({"LLMEP_NODES": "2"}, "LLMEP_NODES", "LWS_GROUP_SIZE is not set"),
        ({**GROUP, "LWS_GROUP_SIZE": "3"}, "LLMEP_NODES", "LWS_GROUP_SIZE is 3"),
        ({**GROUP, "LWS_WORKER_INDEX": "2"}, "LWS_WORKER_INDEX", "outside a group"),
        ({**GROUP, "LWS_LEADER_ADDRESS": ""}, "LWS_LEADER_ADDRESS", "not set"),
        ({**GROUP, "PIPELINE_PARALLEL_SIZE": "3"}, "PIPELINE_PARALLEL_SIZE", "1 x 3 = 3"),
        ({**GROUP}, "TENSOR_PARALLEL_SIZE", "a node would have none"),
        ({**GROUP, "DATA_PARALLEL_SIZE": "3"}, "DATA_PARALLEL_SIZE", "multiple of the nodes"),
        (
            {**GROUP, "PIPELINE_PARALLEL_SIZE": "2", "DISTRIBUTED_EXECUTOR_BACKEND": "ray"},
            "DISTRIBUTED_EXECUTOR_BACKEND",
            "mp",
        ),
        ({**GROUP, "LLMEP_MULTINODE_PORT": "65530"}, "LLMEP_MULTINODE_PORT", "9 ports above"),
        ({"API_SERVER_COUNT": "2", "LLMEP_ADAPTERS_FILE": "/a"}, "API_SERVER_COUNT", "one API"),
        (
            {**GROUP, "PIPELINE_PARALLEL_SIZE": "2", "API_SERVER_COUNT": "2"},
            "API_SERVER_COUNT",
            "leader runs one API process",
        ),
        ({"API_SERVER_COUNT": "0"}, "API_SERVER_COUNT", "greater than or equal to 1"),
    ],
)
def test_bad_combinations_are_refused_naming_the_variable(env, variable, words):
    error = error_for(**env)
    assert error.variable == variable, error
    assert words in error.message, error


def test_group_flags_are_not_read_from_the_environment():
    # torch's own MASTER_ADDR / MASTER_PORT in a container must not become vLLM flags.
    cfg = config(MASTER_ADDR="10.0.0.9", MASTER_PORT="1234", NODE_RANK="3", HEADLESS="1")
    assert cfg.engine_args.master_addr == "127.0.0.1"
    assert cfg.engine_args.node_rank == 0 and not cfg.engine_args.headless


@pytest.mark.parametrize(
    ("cpus", "engine", "count"), [(1, 1, 1), (2, 1, 1), (8, 1, 1), (16, 2, 3), (64, 9, 8)]
)
def test_default_api_server_count_from_the_pods_cpus(cpus, engine, count):
    assert default_api_server_count(cpus, engine) == count


def test_api_server_count_resolved():
    assert api_server_count(config(API_SERVER_COUNT="3"), 2) == 3
    assert api_server_count(config(), 2) == 1
    assert api_server_count(config(), 32) == 7
    # Eight GPUs' workers take their CPUs first.
    assert api_server_count(config(TENSOR_PARALLEL_SIZE="8"), 32) == 5
    assert api_server_count(config(LLMEP_ADAPTERS_FILE="/a"), 32) == 1
    assert (
        api_server_count(config(**GROUP, LWS_WORKER_INDEX="1", PIPELINE_PARALLEL_SIZE="2"), 32) == 1
    )
