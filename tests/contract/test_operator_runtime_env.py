"""The contract between operator and runtime: the pod the operator builds, as the runtime reads it.

The operator's pod spec (env, volumes, mounts) is turned into the environment and files a
container would see - this test plays the kubelet: it resolves secretKeyRef values and writes the
ConfigMap and Secret volumes under a temporary root, moving the mount paths there - and is then
parsed by the runtime's own `load_config`, which checks every value with vLLM's argument parser.
The two packages never import each other; only this test sees both.
"""

from __future__ import annotations

import asyncio
import pathlib
from typing import Any

import pytest
from llmendpoints_operator import groups, manifests
from llmendpoints_operator.admission import admit
from llmendpoints_operator.config import OperatorSettings
from llmendpoints_operator.managed_env import owner_of
from llmendpoints_operator.spec import InvalidSpecError, parse
from llmendpoints_runtime import config

SECRETS = {
    ("hf", "token"): "hf_contract_token",
    ("keys", "api-keys"): "key-one\nkey-two\n",
    ("demo-admin-key", "admin-api-key"): "generated-admin-key",  # the operator's own Secret
}
POD_FIELDS = {"status.podIP": "10.244.1.17"}  # what the kubelet puts in for the downward API


def _pod_environment(
    spec: dict[str, Any],
    root: pathlib.Path,
    settings: OperatorSettings | None = None,
    secrets: dict[tuple[str, str], str] | None = None,
    role: str | None = None,
) -> dict[str, str]:
    """The environment of the runtime container, with its config files materialised under root.
    `role`: "leader" or "worker" of a multi-node endpoint's group (its LeaderWorkerSet's
    template); None: the Deployment's pod."""
    SECRETS.update(secrets or {})
    ep = parse("demo", "team", spec)
    workload = groups.build_workload(ep, settings or OperatorSettings(), replicas=1)
    if role is None:
        pod = workload["spec"]["template"]["spec"]
    else:
        pod = workload["spec"]["leaderWorkerTemplate"][f"{role}Template"]["spec"]
    container = pod["containers"][0]
    configmaps = {
        obj["metadata"]["name"]: obj
        for obj in manifests.build_children(ep, OperatorSettings())
        if obj["kind"] == "ConfigMap"
    }
    volumes = {v["name"]: v for v in pod["volumes"]}

    moved: dict[str, str] = {}
    for mount in container["volumeMounts"]:
        volume = volumes[mount["name"]]
        target = root / mount["mountPath"].lstrip("/")
        if "configMap" in volume:
            files = dict(configmaps[volume["configMap"]["name"]]["data"])
        elif "secret" in volume:
            secret = volume["secret"]["secretName"]
            files = {
                item["path"]: SECRETS[(secret, item["key"])] for item in volume["secret"]["items"]
            }
        else:
            continue  # emptyDir / PVC: nothing to materialise
        target.mkdir(parents=True)
        for name, text in files.items():
            (target / name).write_text(text)
        moved[mount["mountPath"]] = str(target)

    env: dict[str, str] = {}
    for var in container["env"]:
        if "valueFrom" in var:
            source = var["valueFrom"]
            if "fieldRef" in source:  # the downward API, as the kubelet fills it in
                env[var["name"]] = POD_FIELDS[source["fieldRef"]["fieldPath"]]
                continue
            ref = source["secretKeyRef"]
            env[var["name"]] = SECRETS[(ref["name"], ref["key"])]
            continue
        value = var["value"]
        for mount_path, real in moved.items():
            if value.startswith(mount_path + "/"):
                value = real + value[len(mount_path) :]
        env[var["name"]] = value
    return env


def test_full_spec_reaches_vllm_as_intended(tmp_path: pathlib.Path) -> None:
    spec = {
        "model": {
            "name": "org/model",
            "revision": "abc123",
            "servedModelName": "chat",
            "tokenizer": {"name": "org/tokenizer", "revision": "def456"},
            "chatTemplate": "{% for m in messages %}{{ m['content'] }}{% endfor %}",
            "hfTokenSecretRef": {"name": "hf", "key": "token"},
            "trustRemoteCode": True,
        },
        "engine": {
            "dtype": "bfloat16",
            "maxModelLen": 8192,
            "tensorParallelSize": 2,
            "gpuMemoryUtilization": 0.85,
            "quantization": "fp8",
            "enablePrefixCaching": True,
            "args": {"max-num-seqs": 64, "enforce-eager": True, "max-num-batched-tokens": 4096},
            "drainTimeoutSeconds": 45,
        },
        "resources": {"gpus": 2},
        "api": {
            "apiKeysSecretRef": {"name": "keys", "key": "api-keys"},
            "maxConcurrency": 32,
            "maxQueueLength": 100,
        },
    }
    cfg = config.load_config(_pod_environment(spec, tmp_path))
    args = cfg.engine_args
    assert (args.model, args.revision) == ("org/model", "abc123")
    assert (args.tokenizer, args.tokenizer_revision) == ("org/tokenizer", "def456")
    assert cfg.served_model_names == ["chat"]
    assert pathlib.Path(args.chat_template).read_text() == spec["model"]["chatTemplate"]
    assert args.trust_remote_code is True
    assert (args.dtype, args.max_model_len, args.tensor_parallel_size) == ("bfloat16", 8192, 2)
    assert (args.gpu_memory_utilization, args.quantization) == (0.85, "fp8")
    assert args.enable_prefix_caching is True
    assert (args.max_num_seqs, args.enforce_eager, args.max_num_batched_tokens) == (64, True, 4096)

    settings = cfg.settings
    assert (settings.host, settings.port) == ("0.0.0.0", manifests.HTTP_PORT)
    assert settings.base_path == manifests.MODEL_CACHE_PATH
    assert settings.hf_token.get_secret_value() == "hf_contract_token"
    assert pathlib.Path(settings.api_keys_file).read_text() == "key-one\nkey-two\n"
    assert (settings.max_concurrency, settings.max_queue_length) == (32, 100)
    assert settings.drain_timeout_seconds == 45
    assert settings.log_format == "json"


def test_minimal_spec_serves_the_model_under_the_endpoint_name(tmp_path: pathlib.Path) -> None:
    cfg = config.load_config(_pod_environment({"model": {"name": "org/model"}}, tmp_path))
    assert cfg.engine_args.model == "org/model"
    assert cfg.served_model_names == ["demo"]
    assert cfg.settings.api_keys_file is None  # no keys configured: the endpoint is open
    assert cfg.warnings == []
    # ... for serving; engine control takes the endpoint's generated admin key.
    admin_file = pathlib.Path(cfg.settings.admin_api_keys_file)
    assert admin_file.read_text() == "generated-admin-key"


def test_the_control_port_listens_on_the_pods_ip_only(tmp_path: pathlib.Path) -> None:
    """The kubelet probes, and the autoscaler scrapes, the pod's IP: the control port listens
    there, not on every interface (before: HOST, 0.0.0.0), while the main port stays on all."""
    settings = config.load_config(_pod_environment({"model": {"name": "m"}}, tmp_path)).settings
    assert settings.control_host == POD_FIELDS["status.podIP"]
    assert settings.control_port == 8001 and settings.host == "0.0.0.0"


def test_disabling_a_boolean_engine_field_reaches_vllm(tmp_path: pathlib.Path) -> None:
    spec = {"model": {"name": "org/model"}, "engine": {"enablePrefixCaching": False}}
    cfg = config.load_config(_pod_environment(spec, tmp_path))
    assert cfg.engine_args.enable_prefix_caching is False


def test_an_engine_arg_vllm_rejects_is_caught_at_startup_naming_the_variable(
    tmp_path: pathlib.Path,
) -> None:
    # The operator passes free-form args through; the runtime's parser is the judge.
    spec = {"model": {"name": "org/model"}, "engine": {"args": {"max-num-seqs": "many"}}}
    with pytest.raises(config.ConfigError) as caught:
        config.load_config(_pod_environment(spec, tmp_path))
    assert caught.value.variable == "MAX_NUM_SEQS"


QUEUE_KEYS = OperatorSettings(
    jobs_queue_url="nats://llmendpoints-nats.llm-system.svc:4222", jobs_queue_keys_dir="/k"
)


def _minted(endpoint: str) -> str:
    from llmendpoints_common.queue.trust import Installation, mint

    return mint(Installation.generate().signer, "runtime", endpoint, issued_at=0)


def test_the_queue_identity_and_the_endpoints_own_credential_reach_the_runtime(
    tmp_path: pathlib.Path,
) -> None:
    creds = {("demo-queue-creds-v2", "queue.creds"): _minted("team/demo")}
    env = _pod_environment({"model": {"name": "org/model"}}, tmp_path, QUEUE_KEYS, creds)
    settings = config.load_config(env).settings
    assert (settings.endpoint_namespace, settings.endpoint_id) == ("team", "demo")
    assert settings.jobs_queue_url.get_secret_value() == QUEUE_KEYS.jobs_queue_url
    assert (
        pathlib.Path(settings.jobs_queue_creds_file).read_text()
        == creds[("demo-queue-creds-v2", "queue.creds")]
    )


def test_a_planted_credential_of_another_endpoint_stops_the_pod(tmp_path: pathlib.Path) -> None:
    """A Secret named <endpoint>-queue-creds-v2 that someone made before the operator could, with
    a credential minted for another endpoint (theirs): the pod refuses to start with it."""
    planted = {("demo-queue-creds-v2", "queue.creds"): _minted("other-team/demo")}
    env = _pod_environment({"model": {"name": "org/model"}}, tmp_path, QUEUE_KEYS, planted)
    with pytest.raises(config.ConfigError) as caught:
        config.load_config(env)
    assert caught.value.variable == "JOBS_QUEUE_CREDS_FILE"
    assert "runtime:other-team/demo" in str(caught.value)


def test_a_password_url_reaches_the_pod_from_the_endpoints_secret(tmp_path: pathlib.Path) -> None:
    url = "nats://llmep:secret@nats.infra:4222"
    queued = OperatorSettings(jobs_queue_url=url)
    env = _pod_environment(
        {"model": {"name": "org/model"}}, tmp_path, queued, {("demo-queue-creds-v2", "url"): url}
    )
    settings = config.load_config(env).settings
    assert settings.jobs_queue_url.get_secret_value() == url
    assert settings.jobs_queue_creds_file is None


def test_declared_adapters_reach_the_runtime_as_its_adapter_list(tmp_path: pathlib.Path) -> None:
    from llmendpoints_runtime.adapters.declared import DeclaredAdapter, parse_adapters

    spec = {
        "model": {"name": "org/model", "servedModelName": "chat"},
        "adapters": [
            {"name": "sql", "source": "org/sql-lora", "revision": "abc", "rank": 24},
            {"name": "legal", "source": "/models/adapters/legal"},
        ],
    }
    env = _pod_environment(spec, tmp_path)
    loaded = config.load_config(env)
    args = loaded.engine_args
    # Derived engine settings, accepted by vLLM's own parser: rank 24 needs vLLM's next size, 32.
    assert (args.enable_lora, args.max_loras, args.max_lora_rank) == (True, 4, 32)
    declared = parse_adapters(pathlib.Path(loaded.settings.adapters_file).read_text())
    assert declared == (
        DeclaredAdapter("sql", "org/sql-lora", "abc"),
        DeclaredAdapter("legal", "/models/adapters/legal"),
    )


def test_engine_args_win_over_the_derived_lora_settings(tmp_path: pathlib.Path) -> None:
    spec = {
        "model": {"name": "org/model"},
        "engine": {"args": {"max-loras": 2, "max-lora-rank": 64}},
        "adapters": [{"name": "sql", "source": "org/sql-lora", "rank": 8}],
    }
    args = config.load_config(_pod_environment(spec, tmp_path)).engine_args
    assert (args.enable_lora, args.max_loras, args.max_lora_rank) == (True, 2, 64)


async def test_the_operator_reads_the_adapter_gauges_the_runtime_exports(
    tmp_path: pathlib.Path,
) -> None:
    from llmendpoints_operator.adapter_status import PodAdapter, parse_pod_adapters
    from llmendpoints_runtime.adapters.declared import DeclaredAdapter
    from llmendpoints_runtime.adapters.reconciler import AdapterReconciler
    from prometheus_client import CollectorRegistry, generate_latest

    class Engine:  # the engine port: loads "good", refuses everything else
        async def load(self, name: str, path: str, *, replace: bool) -> None:
            if name != "good":
                raise ValueError(f'LoRA rank 64 is greater than max_lora_rank 8 ("{name}")')

        async def unload(self, name: str) -> None: ...

        def loaded(self) -> frozenset[str]:
            return frozenset()

    for name in ("good", "bad"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "adapter_config.json").write_text("{}")
    registry = CollectorRegistry()
    reconciler = AdapterReconciler(Engine(), registry, adapters_file=None)
    await reconciler.sync(tuple(DeclaredAdapter(n, str(tmp_path / n)) for n in ("good", "bad")))
    while reconciler._tasks:
        await asyncio.sleep(0.01)

    assert parse_pod_adapters(generate_latest(registry).decode()) == {
        "good": PodAdapter(ready=True),
        "bad": PodAdapter(
            ready=False,
            error='ValueError: LoRA rank 64 is greater than max_lora_rank 8 ("bad")',
        ),
    }


# --- multi-node groups (docs/contracts.md, "Multi-node groups") -----------------------------------

GROUP = {"model": {"name": "org/model"}, "resources": {"gpus": 8, "nodes": 2}}


def _as_lws_starts_it(env: dict[str, str], index: int, size: int = 2) -> dict[str, str]:
    """What LeaderWorkerSet v0.9.0's pod webhook adds to every container of a group's pod."""
    return {
        **env,
        "LWS_LEADER_ADDRESS": "demo-group-0.demo-group.team",
        "LWS_GROUP_SIZE": str(size),
        "LWS_WORKER_INDEX": str(index),
    }


def test_a_groups_leader_and_workers_get_the_same_contract_env(tmp_path: pathlib.Path) -> None:
    leader = _pod_environment(GROUP, tmp_path / "leader", role="leader")
    worker = _pod_environment(GROUP, tmp_path / "worker", role="worker")
    # The same variables, values aside from the materialised file paths.
    assert set(leader) == set(worker)
    assert {k: v for k, v in leader.items() if not v.startswith("/")} == {
        k: v for k, v in worker.items() if not v.startswith("/")
    }
    # 2 x 8 GPUs, nothing set: tensor 8 inside a node, a pipeline stage per node.
    assert (leader["TENSOR_PARALLEL_SIZE"], leader["PIPELINE_PARALLEL_SIZE"]) == ("8", "2")
    assert "DATA_PARALLEL_SIZE" not in leader and "ENABLE_EXPERT_PARALLEL" not in leader
    lws = groups.build_leader_worker_set(
        parse("demo", "team", GROUP), OperatorSettings(), replicas=1
    )
    lwt = lws["spec"]["leaderWorkerTemplate"]
    assert leader["LLMEP_NODES"] == str(lwt["size"]) == "2"
    [container] = lwt["leaderTemplate"]["spec"]["containers"]
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert leader["LLMEP_MULTINODE_PORT"] == str(ports["multinode"]) == "29500"
    # Who is who comes from LeaderWorkerSet; the API server count is the runtime's own.
    assert not [name for name in leader if name.startswith("LWS_")]
    assert "API_SERVER_COUNT" not in leader
    for index, env in ((0, leader), (1, worker)):
        args = config.load_config(_as_lws_starts_it(env, index)).engine_args
        assert (args.tensor_parallel_size, args.pipeline_parallel_size) == (8, 2)
        assert args.data_parallel_size == 1


def test_data_and_expert_parallel_across_nodes_reach_vllm(tmp_path: pathlib.Path) -> None:
    spec = {**GROUP, "engine": {"dataParallelSize": 16, "enableExpertParallel": True}}
    for index, role in enumerate(("leader", "worker")):
        env = _pod_environment(spec, tmp_path / role, role=role)
        assert (env["DATA_PARALLEL_SIZE"], env["ENABLE_EXPERT_PARALLEL"]) == ("16", "true")
        assert "TENSOR_PARALLEL_SIZE" not in env and "PIPELINE_PARALLEL_SIZE" not in env
        args = config.load_config(_as_lws_starts_it(env, index)).engine_args
        assert (args.data_parallel_size, args.enable_expert_parallel) == (16, True)
        assert (args.tensor_parallel_size, args.pipeline_parallel_size) == (1, 1)


def test_data_parallel_in_one_node_is_one_pod_without_group_variables(
    tmp_path: pathlib.Path,
) -> None:
    spec = {
        "model": {"name": "org/model"},
        "resources": {"gpus": 8},
        "engine": {"dataParallelSize": 4},
    }
    env = _pod_environment(spec, tmp_path)
    assert (env["DATA_PARALLEL_SIZE"], env["TENSOR_PARALLEL_SIZE"]) == ("4", "2")
    assert "LLMEP_NODES" not in env and "LLMEP_MULTINODE_PORT" not in env
    args = config.load_config(env).engine_args
    assert (args.data_parallel_size, args.tensor_parallel_size) == (4, 2)


@pytest.mark.parametrize(
    "variable",
    [
        "TENSOR_PARALLEL_SIZE",
        "PIPELINE_PARALLEL_SIZE",
        "DATA_PARALLEL_SIZE",
        "ENABLE_EXPERT_PARALLEL",
        "LLMEP_NODES",
        "LLMEP_MULTINODE_PORT",
        "LWS_GROUP_SIZE",
        "LWS_WORKER_INDEX",
        "LWS_LEADER_ADDRESS",
    ],
)
def test_the_group_variables_are_managed(variable: str) -> None:
    assert owner_of(variable) is not None
    spec = {**GROUP, "engine": {"env": [{"name": variable, "value": "1"}]}}
    with pytest.raises(InvalidSpecError, match=variable):
        admit("demo", "team", spec, OperatorSettings())


def test_the_api_server_count_is_the_runtimes_own_setting() -> None:
    assert owner_of("API_SERVER_COUNT") is None
    spec = {**GROUP, "engine": {"env": [{"name": "API_SERVER_COUNT", "value": "4"}]}}
    env = _pod_environment_of(spec)
    assert env["API_SERVER_COUNT"] == "4"  # written only because the spec asks


def _pod_environment_of(spec: dict[str, Any]) -> dict[str, Any]:
    ep = admit("demo", "team", spec, OperatorSettings())
    template = groups.build_workload(ep, OperatorSettings(), replicas=1)["spec"][
        "leaderWorkerTemplate"
    ]["workerTemplate"]
    return {v["name"]: v.get("value") for v in template["spec"]["containers"][0]["env"]}
