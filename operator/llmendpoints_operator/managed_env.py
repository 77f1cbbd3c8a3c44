"""Variables an endpoint author cannot set through `engine.env` or `engine.args`.

An endpoint's spec reaches the runtime as environment variables. Some of them are the operator's
(every variable `manifests.build_env` writes) and some are the runtime's own security settings
(keys, the paths that need no key, run-time adapter loading, the shared job queue). A spec that
sets one of them through `engine.env` - or through `engine.args`, which become UPPER_SNAKE
variables too - would override what the operator enforces: `UNAUTHENTICATED_PATHS=/v1` would open
the endpoint, `SM_VLLM_SERVED_MODEL_NAME` would rename it behind the operator's back.

The operator's part of the list is derived from `manifests.build_env` (it cannot drift from what
the pod gets); the runtime's aliases of those names are listed here because the operator never
imports the runtime, and tests/contract/test_managed_env.py checks them against the runtime's own
alias tables.
"""

from __future__ import annotations

from functools import cache

from llmendpoints_operator import manifests
from llmendpoints_operator.config import OperatorSettings
from llmendpoints_operator.spec import MANAGED_VARIABLES, Endpoint, Problem, flag_env_name, parse

# The runtime's SageMaker spelling of any vLLM flag variable (SM_VLLM_MAX_MODEL_LEN).
SAGEMAKER_PREFIX = "SM_VLLM_"

# Settings the runtime enforces and the operator (or the cluster admin) owns, with what to use
# instead. Patterns end in `*`.
RUNTIME_MANAGED: dict[str, str] = {
    "API_KEYS*": "API keys come from spec.api.apiKeysSecretRef",
    "API_KEY": "API keys come from spec.api.apiKeysSecretRef",
    "ADMIN_API_KEYS*": "the operator generates the endpoint's admin key",
    "UNAUTHENTICATED_PATHS": "only the health and metrics paths are served without a key",
    "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "adapters are declared in spec.adapters and loaded by "
    "the operator",
    "JOBS_QUEUE_URL": "the cluster admin chooses the queue (LLMEP_OPERATOR_JOBS_QUEUE_URL)",
    "JOBS_QUEUE_CREDS_FILE": "the operator mints the endpoint's own queue credential",
    "ENDPOINT_ID": "it is the endpoint's name",
    "ENDPOINT_NAMESPACE": "it is the endpoint's namespace",
    # Written only when the operator has the gateway token secret (operator_written cannot
    # build that setting without the file): a token of the author's choosing would let anyone
    # who knows it name any caller to the pods.
    "GATEWAY_TOKEN_FILE": "the operator writes the endpoint's gateway token",
    # A multi-node group: LeaderWorkerSet says who is who (a variable already set is not
    # overwritten by it), and the runtime derives vLLM's launch flags from that and the sizes.
    "LWS_*": "LeaderWorkerSet sets it in a multi-node endpoint's pods",
    "NNODES": "the runtime derives it from spec.resources.nodes",
    "NODE_RANK": "the runtime derives it from the pod's place in its group",
    "MASTER_ADDR": "the runtime derives it from the group's leader",
    "MASTER_PORT": "the runtime derives it from LLMEP_MULTINODE_PORT",
    "HEADLESS": "the runtime runs a group's workers headless",
    "DATA_PARALLEL_SIZE_LOCAL": "the runtime derives it from spec.engine.dataParallelSize",
    "DATA_PARALLEL_RANK": "the runtime derives it from spec.engine.dataParallelSize",
    "DATA_PARALLEL_START_RANK": "the runtime derives it from the pod's place in its group",
    "DATA_PARALLEL_ADDRESS": "the runtime derives it from the group's leader",
    "DATA_PARALLEL_RPC_PORT": "the runtime derives it from LLMEP_MULTINODE_PORT",
    # The leader's API server balances over every data-parallel rank and reports their queue,
    # which the autoscaler and the gateway read: an external balancer would split both.
    "DATA_PARALLEL_HYBRID_LB": "the replica's API server balances its data-parallel ranks",
    "DATA_PARALLEL_EXTERNAL_LB": "the replica's API server balances its data-parallel ranks",
}

# Other names under which the runtime (worker-vllm's and vLLM's spellings) reads a variable the
# operator writes. Checked against the runtime by tests/contract/test_managed_env.py.
RUNTIME_ALIASES: dict[str, tuple[str, ...]] = {
    "MODEL_NAME": ("MODEL",),
    "MODEL_REVISION": ("REVISION",),
    "TOKENIZER_NAME": ("TOKENIZER",),
    "OPENAI_SERVED_MODEL_NAME_OVERRIDE": ("SERVED_MODEL_NAME",),
    "CUSTOM_CHAT_TEMPLATE": ("CHAT_TEMPLATE",),
    "MAX_MODEL_LEN": ("MAX_MODEL_LENGTH",),
    "GPU_MEMORY_UTILIZATION": ("DEVICE_MEMORY_UTILIZATION",),  # vLLM 0.32's second spelling
    "BASE_PATH": ("HF_HOME",),  # the runtime exports BASE_PATH as HF_HOME
}

# A spec that exercises every optional field build_env turns into a variable, and settings with
# every optional feature on: what build_env writes for it is what the operator manages.
_EVERYTHING = {
    "model": {
        "name": "m",
        "revision": "r",
        "servedModelName": "s",
        "tokenizer": {"name": "t", "revision": "r"},
        "chatTemplate": "c",
        "hfTokenSecretRef": {"name": "hf", "key": "k"},
        "trustRemoteCode": True,
    },
    "engine": {
        "dtype": "auto",
        "maxModelLen": 1,
        "tensorParallelSize": 1,
        "pipelineParallelSize": 2,
        "dataParallelSize": 2,
        "enableExpertParallel": True,
        "gpuMemoryUtilization": 0.5,
        "quantization": "q",
        "enablePrefixCaching": True,
    },
    "resources": {"gpus": 2, "nodes": 2},
    "cache": {"size": "1Gi"},
    "api": {
        "apiKeysSecretRef": {"name": "keys", "key": "k"},
        "maxConcurrency": 1,
        "maxQueueLength": 1,
        "defaultMaxTokens": 1,
        "streaming": {"batchSize": 1, "minBatchSize": 1, "batchSizeGrowthFactor": 1},
    },
    "adapters": [{"name": "a", "source": "org/a", "rank": 8}],
}


@cache
def operator_written() -> frozenset[str]:
    """Every variable the operator writes into a runtime container."""
    ep = parse("managed", "ns", _EVERYTHING)
    every_feature = OperatorSettings(
        jobs_queue_url="nats://queue:4222", jobs_queue_keys_dir="/keys", gateway_url="http://gw"
    )
    container = manifests.build_pod_template(ep, every_feature)["spec"]["containers"][0]
    # The LoRA engine settings spec.adapters derives are defaults an author may override.
    defaults = manifests.lora_settings(ep)
    return frozenset(var["name"] for var in container["env"] if var["name"] not in defaults)


@cache
def managed_names() -> dict[str, str]:
    """Managed variable name (or `PREFIX*`, a prefix) -> why, for messages."""
    managed: dict[str, str] = {}
    for name in sorted(operator_written()):
        field = MANAGED_VARIABLES.get(name, "")
        why = f"set it through {field}" if field.startswith("spec.") else "the operator sets it"
        for spelling in (name, *RUNTIME_ALIASES.get(name, ())):
            managed.setdefault(spelling, why if spelling == name else f"{why} ({name})")
    managed.update(RUNTIME_MANAGED)
    for name, why in list(managed.items()):
        managed.setdefault(SAGEMAKER_PREFIX + name, why)
    return managed


@cache
def _lookup() -> tuple[dict[str, str], tuple[tuple[str, str], ...]]:
    """Exact names, and `PREFIX*` patterns as (prefix, why): checked once per variable."""
    names = managed_names()
    exact = {name: why for name, why in names.items() if not name.endswith("*")}
    prefixes = tuple((name[:-1], why) for name, why in names.items() if name.endswith("*"))
    return exact, prefixes


def owner_of(variable: str) -> str | None:
    """Why `variable` is managed, or None when an endpoint author may set it."""
    exact, prefixes = _lookup()
    if variable in exact:
        return exact[variable]
    return next((why for prefix, why in prefixes if variable.startswith(prefix)), None)


def check(ep: Endpoint) -> list[Problem]:
    """Every engine.env entry and engine.args flag that would set a managed variable."""
    problems: list[Problem] = []
    for index, var in enumerate(ep.spec.engine.env):
        why = owner_of(var.name)
        if why is not None:
            problems.append(
                Problem(f"spec.engine.env[{index}].name", f"{var.name} is managed: {why}")
            )
    for flag in ep.spec.engine.args:
        variable = flag_env_name(flag)
        why = owner_of(variable)
        if why is not None:
            problems.append(
                Problem(f"spec.engine.args.{flag}", f"becomes {variable}, which is managed: {why}")
            )
    return problems
