"""Environment -> runtime settings + vLLM engine arguments.

Three kinds of variables are read:

* our own settings (`RuntimeSettings`: port, API keys, limits, drain, logging, job defaults);
* the worker-vllm names whose spelling differs from vLLM's flags (`WORKER_VLLM_ALIASES`, e.g.
  MODEL_NAME -> --model) and the ones vLLM has since dropped (`RETIRED_VARIABLES`);
* any vLLM engine or server flag by its UPPER_SNAKE name (`MAX_NUM_SEQS` -> `--max-num-seqs`),
  or as `SM_VLLM_<FLAG>` (the SageMaker convention).

Everything that ends up as a vLLM flag is checked by vLLM's own argument parser, so a typo or a bad
value stops the process at start-up with a message that names the variable (`ConfigError`).
This module is pure: it reads the mapping it is given, never `os.environ` directly.
"""

from __future__ import annotations

import json
import re
from argparse import Namespace
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from llmendpoints_common import vllm_env
from llmendpoints_common.batch.limits import BatchEnv
from llmendpoints_common.fair_use import DEFAULT_MAX_N
from llmendpoints_common.identity import EndpointRef
from llmendpoints_common.jobs.models import MAX_POLICY_MS, MIN_EXECUTION_TIMEOUT_MS, MIN_TTL_MS
from llmendpoints_common.queue.connect import read_creds
from llmendpoints_common.queue.natsjwt import CredentialsError
from llmendpoints_common.queue.trust import check_runtime_creds
from llmendpoints_edge.settings import EdgeSettings
from llmendpoints_edge.settings import settings_variables as edge_settings_variables
from pydantic import Field, SecretStr, ValidationError, field_validator

from llmendpoints_runtime import engine as engine_module

SAGEMAKER_PREFIX = vllm_env.SAGEMAKER_PREFIX


class ConfigError(Exception):
    """A configuration problem a user can fix; `variable` names the environment variable."""

    def __init__(self, variable: str, message: str):
        super().__init__(f"{variable}: {message}")
        self.variable = variable
        self.message = message


class RuntimeSettings(EdgeSettings, BatchEnv):
    """Our own settings (not vLLM flags). Field aliases are the environment variable names;
    the ones the gateway shares (HOST, PORT, keys, body limits, logs, drain, webhooks,
    JOBS_QUEUE_URL) are the edge's (``llmendpoints_edge.settings.EdgeSettings``)."""

    base_path: str | None = Field(
        None,
        validation_alias="BASE_PATH",
        description="Root of the Hugging Face cache (HF_HOME): the model-cache volume in Kubernetes.",
    )
    hf_token: SecretStr | None = Field(
        None,
        validation_alias="HF_TOKEN",
        description="Hugging Face token for gated or private models.",
    )
    api_key: SecretStr | None = Field(
        None,
        validation_alias="API_KEY",
        description="One API key (vLLM's --api-key spelling); merged with API_KEYS.",
    )
    admin_api_keys: SecretStr | None = Field(
        None,
        validation_alias="ADMIN_API_KEYS",
        description="Comma-separated admin keys: they authenticate like API_KEYS, reach every "
        "job of the endpoint (/status, /cancel... of any owner; /purge-queue purges all) and "
        "alone may call vLLM's engine-control routes (/sleep, /v1/load_lora_adapter...). "
        "Without API keys, serving stays open to all.",
    )
    admin_api_keys_file: str | None = Field(
        None,
        validation_alias="ADMIN_API_KEYS_FILE",
        description="File with admin keys, one per line (the operator mounts the endpoint's "
        "generated admin key here); re-read when it changes.",
    )
    gateway_token_file: str | None = Field(
        None,
        validation_alias="GATEWAY_TOKEN_FILE",
        description="File with this endpoint's gateway token (the operator mounts it): a "
        "request bearing it comes from the gateway, which names its caller in "
        "`x-llmep-caller` (believed from no one else); re-read when it changes.",
    )
    unauthenticated_paths: str = Field(
        "/health,/ready,/ping,/metrics",
        validation_alias="UNAUTHENTICATED_PATHS",
        description="Comma-separated paths that never need a key.",
    )
    max_concurrency: int | None = Field(
        None,
        ge=1,
        validation_alias="MAX_CONCURRENCY",
        description="Sequences running in the engine at once (a request with n: 4 takes 4; a "
        "request for more than this is a 400); default: max(300, the engine's max_num_seqs).",
    )
    max_queue_length: int = Field(
        1000,
        ge=0,
        validation_alias="MAX_QUEUE_LENGTH",
        description="Sequences waiting for a slot beyond MAX_CONCURRENCY (and queued jobs); "
        "more get 429 with Retry-After.",
    )
    max_n: int = Field(
        DEFAULT_MAX_N,
        ge=1,
        le=4096,
        validation_alias="MAX_N",
        description="Largest n (and best_of) of one request, on every contract (OpenAI routes, "
        "jobs, /invocations); more is a 400 naming the field.",
    )
    engine_death_exit_delay_seconds: float = Field(
        5.0,
        ge=0,
        le=600,
        validation_alias="ENGINE_DEATH_EXIT_DELAY_SECONDS",
        description="After the engine core dies: how long the process answers 503 everywhere (load "
        "balancers polling /ping see it; jobs fail naming the cause) before it drains and exits "
        "with status 1 so that it is restarted.",
    )
    control_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        validation_alias="LLMEP_CONTROL_PORT",
        description="A second port (on LLMEP_CONTROL_HOST) answering /health, /ready, /ping and "
        "/metrics from a process of its own, whatever the event loop is doing: for the kubelet's "
        "probes and the autoscaler's scrape under load (the operator sets it). Unset: no such "
        "port.",
    )
    control_host: str | None = Field(
        None,
        validation_alias="LLMEP_CONTROL_HOST",
        description="The address the control port listens on: the operator sets the pod's IP "
        "(the address the kubelet probes), so the port is not on every interface of the pod. "
        "Unset: HOST's (a local run with HOST=127.0.0.1 keeps it on loopback).",
    )
    startup_log_interval_seconds: float = Field(
        10.0,
        gt=0,
        validation_alias="STARTUP_LOG_INTERVAL_SECONDS",
        description="How often download and load progress is logged.",
    )

    # -- job API (RunPod-compatible; see docs/jobs.md) ------------------------------------------
    default_max_tokens: int = Field(
        512,
        ge=1,
        validation_alias="DEFAULT_MAX_TOKENS",
        description="max_tokens of prompt/messages jobs that set none (not vLLM's silent 16); "
        "lowered to what the context window leaves after the prompt.",
    )
    default_batch_size: int = Field(
        50,
        ge=1,
        validation_alias="DEFAULT_BATCH_SIZE",
        description="Largest streaming batch of a job, in tokens (per-request: max_batch_size).",
    )
    default_min_batch_size: int = Field(
        1,
        ge=1,
        validation_alias="DEFAULT_MIN_BATCH_SIZE",
        description="First streaming batch of a job, in tokens (per-request: min_batch_size).",
    )
    default_batch_size_growth_factor: float = Field(
        3.0,
        ge=1,
        validation_alias="DEFAULT_BATCH_SIZE_GROWTH_FACTOR",
        description="Each streaming batch is this many times the last, up to DEFAULT_BATCH_SIZE.",
    )
    raw_openai_output: bool = Field(
        True,
        validation_alias="RAW_OPENAI_OUTPUT",
        description="Streamed openai_route jobs yield raw SSE text (1) or parsed events (0).",
    )
    max_stored_jobs: int = Field(
        10_000,
        ge=1,
        validation_alias="MAX_STORED_JOBS",
        description="Jobs this pod keeps; finished ones are dropped when their retention ends "
        "(30 min after /run, 1 min after /runsync, never past policy.ttl), oldest first when full.",
    )
    max_stored_job_bytes: int = Field(
        512 * 1024 * 1024,
        ge=1024 * 1024,
        validation_alias="MAX_STORED_JOB_BYTES",
        description="Bytes of requests and results this pod's job store keeps (JSON size); "
        "oldest finished jobs are dropped first, then new jobs get 429.",
    )
    max_execution_timeout_ms: int = Field(
        MAX_POLICY_MS,
        ge=MIN_EXECUTION_TIMEOUT_MS,
        le=MAX_POLICY_MS,
        validation_alias="MAX_EXECUTION_TIMEOUT_MS",
        description="Largest policy.executionTimeout a job may set (RunPod's range: 5 s to 7 "
        "days); the default 600 s is lowered to it.",
    )
    max_job_ttl_ms: int = Field(
        MAX_POLICY_MS,
        ge=MIN_TTL_MS,
        le=MAX_POLICY_MS,
        validation_alias="MAX_JOB_TTL_MS",
        description="Largest policy.ttl a job may set (RunPod's range: 10 s to 7 days); the "
        "default 24 h is lowered to it.",
    )
    # The shared job queue (NATS JetStream): with it, every replica and the gateway serve every
    # job of the endpoint, and this pod is one of the endpoint's workers.
    endpoint_id: str | None = Field(
        None,
        pattern=r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$",
        validation_alias="ENDPOINT_ID",
        description="The endpoint this pod serves (the LLMEndpoint's name): whose queued jobs "
        "it takes, the `{id}` of `/v2/{id}/...`.",
    )
    endpoint_namespace: str = Field(
        "default",
        pattern=r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$",
        validation_alias="ENDPOINT_NAMESPACE",
        description="The namespace of the endpoint this pod serves (the LLMEndpoint's): with "
        "ENDPOINT_ID, the endpoint's identity in the shared queue.",
    )
    jobs_max_attempts: int = Field(
        3,
        ge=1,
        le=100,
        validation_alias="LLMEP_JOBS_MAX_ATTEMPTS",
        description="Shared queue: attempts per job (a worker that vanished mid-job costs one); "
        "after the last the job is FAILED, saying so.",
    )
    jobs_heartbeat_timeout_seconds: float = Field(
        30.0,
        ge=1,
        le=3600,
        validation_alias="LLMEP_JOBS_HEARTBEAT_TIMEOUT_SECONDS",
        description="Shared queue: a worker silent this long is presumed dead and its job runs "
        "elsewhere (it reports every third of this). Set by the first pod that creates the "
        "endpoint's consumers.",
    )
    jobs_run_retention_seconds: float = Field(
        1800.0,
        ge=1,
        validation_alias="LLMEP_JOBS_RUN_RETENTION_SECONDS",
        description="A /run job's result is kept this long after it ends (never past "
        "policy.ttl), in the pod or in the shared queue; then /status answers 404.",
    )
    jobs_runsync_retention_seconds: float = Field(
        60.0,
        ge=1,
        validation_alias="LLMEP_JOBS_RUNSYNC_RETENTION_SECONDS",
        description="The same for /runsync jobs.",
    )
    jobs_idempotency_window_seconds: float = Field(
        600.0,
        ge=1,
        validation_alias="LLMEP_JOBS_IDEMPOTENCY_WINDOW_SECONDS",
        description="A /run repeated with the same `Idempotency-Key` header within this window "
        "returns the first job's id.",
    )
    jobs_queue_replicas: int = Field(
        1,
        ge=1,
        le=5,
        validation_alias="LLMEP_JOBS_QUEUE_REPLICAS",
        description="Shared queue: replicas of each JetStream stream when this pod creates them "
        "(3 on the chart's NATS cluster).",
    )

    # -- LoRA adapters declared in the endpoint (see docs/operator.md, "LoRA adapters") -------
    adapters_file: str | None = Field(
        None,
        validation_alias="LLMEP_ADAPTERS_FILE",
        description="JSON list of LoRA adapters to serve (the operator's mounted ConfigMap); "
        "re-read while running: adapters are loaded and unloaded without a restart.",
    )
    adapters_poll_seconds: float = Field(
        2.0,
        gt=0,
        validation_alias="LLMEP_ADAPTERS_POLL_SECONDS",
        description="How often LLMEP_ADAPTERS_FILE is checked for changes.",
    )

    # -- batches below interactive traffic (see docs/batch.md) -------------------------------
    batch_priority: int = Field(
        10,
        ge=1,
        validation_alias="LLMEP_BATCH_PRIORITY",
        description="vLLM priority of batch requests (interactive requests run at 0; lower runs "
        "first): with `--scheduling-policy priority` an interactive request arriving later is "
        "scheduled before waiting batch requests.",
    )
    batch_max_share: float = Field(
        0.75,
        gt=0,
        le=1,
        validation_alias="LLMEP_BATCH_MAX_SHARE",
        description="Share of the pod's concurrency (MAX_CONCURRENCY) batch requests may take "
        "at most; the rest stays free for interactive requests and jobs, which also stop new "
        "batch requests from starting while they need the room.",
    )
    batch_dir: str | None = Field(
        None,
        validation_alias="LLMEP_BATCH_DIR",
        description="One pod without JOBS_QUEUE_URL: where batch files and results are kept "
        "(default: `llmendpoints-batches` under BASE_PATH, else HF_HOME, else "
        "~/.cache/huggingface).",
    )
    batch_local_max_bytes: int = Field(
        10 * 1000 * 1000 * 1000,
        ge=1024,
        validation_alias="LLMEP_BATCH_LOCAL_MAX_BYTES",
        description="One pod without JOBS_QUEUE_URL: bytes of files and batch inputs kept in "
        "LLMEP_BATCH_DIR at most (507 beyond).",
    )

    @field_validator("default_min_batch_size")
    @classmethod
    def _min_batch_within_max(cls, value: int, info) -> int:
        largest = info.data.get("default_batch_size")
        if largest is not None and value > largest:
            raise ValueError(f"must not exceed DEFAULT_BATCH_SIZE ({largest})")
        return value

    @property
    def unauthenticated_path_set(self) -> frozenset[str]:
        return frozenset(p.strip() for p in self.unauthenticated_paths.split(",") if p.strip())

    def admin_keys(self) -> tuple[str, ...]:
        raw = self.admin_api_keys.get_secret_value() if self.admin_api_keys else ""
        return tuple(dict.fromkeys(k.strip() for k in raw.split(",") if k.strip()))

    def static_api_keys(self) -> tuple[str, ...]:
        """API_KEYS, and vLLM's one-key spelling API_KEY."""
        keys = list(super().static_api_keys())
        if self.api_key is not None and self.api_key.get_secret_value().strip():
            keys.append(self.api_key.get_secret_value().strip())
        return tuple(dict.fromkeys(keys))


def settings_variables() -> dict[str, str]:
    """Environment variable name -> description, for every RuntimeSettings field."""
    return edge_settings_variables(RuntimeSettings)


# ---------------------------------------------------------------------------------------------
# worker-vllm names that are not spelled like a vLLM 0.32 flag
# ---------------------------------------------------------------------------------------------

Translator = Callable[[str, str], list[str]]


def _flag(flag: str) -> Translator:
    return lambda _name, value: _flag_argv(flag, value)


def _inverse_bool(flag: str) -> Translator:
    """DISABLE_X=1 means 'do not pass --flag'; DISABLE_X=0 means pass it."""

    def translate(name: str, value: str) -> list[str]:
        return [] if parse_bool(name, value) else [flag]

    return translate


def _lora_modules(name: str, value: str) -> list[str]:
    # worker-vllm: a JSON list of {"name", "path", "base_model_name"}; vLLM accepts one JSON
    # object (or name=path) per --lora-modules argument.
    try:
        modules = json.loads(value)
    except json.JSONDecodeError as exc:
        raise ConfigError(name, f"must be a JSON list of objects: {exc}") from None
    if isinstance(modules, dict):
        modules = [modules]
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise ConfigError(name, 'must be a JSON list like [{"name": "...", "path": "..."}]')
    for module in modules:
        missing = {"name", "path"} - module.keys()
        if missing:
            raise ConfigError(name, f"each module needs {sorted(missing)}: got {module}")
    if not modules:
        return []
    return ["--lora-modules", *(json.dumps(m) for m in modules)]


def check_start_adapters(engine_args: Any) -> None:
    """LORA_MODULES that cannot load, refused before the engine starts (ConfigError).

    vLLM finds a rank above max_lora_rank only once the engine is up, and fails the whole start
    with "LoRA rank 16 is greater than max_lora_rank 8". A local adapter's rank is in its
    adapter_config.json: checked here, naming the variable to change. (Adapters from the hub
    are checked by vLLM when they load; the start then fails with its message.)
    """
    modules = getattr(engine_args, "lora_modules", None) or []
    if not modules:
        return
    if not getattr(engine_args, "enable_lora", False):
        raise ConfigError("LORA_MODULES", "serving LoRA adapters needs ENABLE_LORA=1")
    limit = int(engine_args.max_lora_rank)
    for module in modules:
        rank = _local_adapter_rank(module.path)
        if rank is not None and rank > limit:
            raise ConfigError(
                "MAX_LORA_RANK",
                f"adapter {module.name!r} in LORA_MODULES ({module.path}) has rank {rank}, above "
                f"MAX_LORA_RANK={limit}: set MAX_LORA_RANK to at least {rank}",
            )


def _local_adapter_rank(path: str) -> int | None:
    """``r`` from a local adapter's adapter_config.json; None when there is none to read."""
    config = Path(path).expanduser() / "adapter_config.json"
    try:
        rank = json.loads(config.read_text()).get("r")
    except (OSError, ValueError, AttributeError):
        return None
    return rank if isinstance(rank, int) else None


def _worker_use_ray(name: str, value: str) -> list[str]:
    return ["--distributed-executor-backend", "ray"] if parse_bool(name, value) else []


def _guided_decoding_backend(_name: str, value: str) -> list[str]:
    return ["--structured-outputs-config", json.dumps({"backend": value})]


WORKER_VLLM_ALIASES: dict[str, tuple[Translator, str]] = {
    "MODEL_NAME": (_flag("--model"), "Model: a Hugging Face repo id or a local path. Required."),
    "MODEL_REVISION": (_flag("--revision"), "Model revision (branch, tag or commit)."),
    "TOKENIZER_NAME": (_flag("--tokenizer"), "Tokenizer repo or path, if not the model's own."),
    "MAX_MODEL_LENGTH": (_flag("--max-model-len"), "worker-vllm 0.3 spelling of MAX_MODEL_LEN."),
    "CUSTOM_CHAT_TEMPLATE": (
        _flag("--chat-template"),
        "Jinja chat template: the template text or a path to a file.",
    ),
    "OPENAI_SERVED_MODEL_NAME_OVERRIDE": (
        _flag("--served-model-name"),
        "The name clients pass as `model` (default: MODEL_NAME).",
    ),
    "OPENAI_RESPONSE_ROLE": (
        _flag("--response-role"),
        "Role of chat responses (default assistant).",
    ),
    "DISABLE_LOG_REQUESTS": (
        _inverse_bool("--enable-log-requests"),
        "0 logs every request (vLLM --enable-log-requests); default 1.",
    ),
    "DISABLE_LOGGING_REQUEST": (
        _inverse_bool("--enable-log-requests"),
        "Older spelling of DISABLE_LOG_REQUESTS.",
    ),
    "LORA_MODULES": (
        _lora_modules,
        'LoRA adapters, JSON: [{"name": "x", "path": "repo/x", "base_model_name": "..."}].',
    ),
    "WORKER_USE_RAY": (_worker_use_ray, "1 = --distributed-executor-backend ray."),
    "GUIDED_DECODING_BACKEND": (
        _guided_decoding_backend,
        "Structured-output backend (vLLM --structured-outputs-config backend).",
    ),
}

# Variables the worker-vllm READMEs list whose vLLM feature no longer exists in vLLM 0.32.
# "ignore": only tuned something vLLM now manages itself; logged as a warning at start-up.
# "refuse": asked for a behaviour we cannot give; start-up stops and says what to use instead.
RETIRED_VARIABLES: dict[str, tuple[Literal["ignore", "refuse"], str]] = {
    "USE_V2_BLOCK_MANAGER": ("ignore", "vLLM 0.32 has a single block manager."),
    "NUM_LOOKAHEAD_SLOTS": ("ignore", "speculative decoding schedules its own slots."),
    "SCHEDULER_DELAY_FACTOR": ("ignore", "the v1 scheduler has no delay factor."),
    "PREEMPTION_MODE": ("ignore", "the v1 scheduler always preempts by recomputation."),
    "PREEMPTION_CHECK_PERIOD": ("ignore", "the v1 scheduler has no preemption check period."),
    "PREEMPTION_CPU_CAPACITY": ("ignore", "the v1 scheduler has no preemption CPU capacity."),
    "TOKENIZER_POOL_SIZE": ("ignore", "tokenization is asynchronous in vLLM 0.32."),
    "TOKENIZER_POOL_TYPE": ("ignore", "tokenization is asynchronous in vLLM 0.32."),
    "TOKENIZER_POOL_EXTRA_CONFIG": ("ignore", "tokenization is asynchronous in vLLM 0.32."),
    "SWAP_SPACE": ("ignore", "vLLM 0.32 no longer swaps KV blocks to CPU memory."),
    "MAX_SEQ_LEN_TO_CAPTURE": ("ignore", "CUDA graph capture sizes are chosen by vLLM 0.32."),
    "LORA_EXTRA_VOCAB_SIZE": ("ignore", "LoRA extra vocabulary was removed from vLLM."),
    "QUANTIZATION_PARAM_PATH": (
        "refuse",
        "KV-cache scales now come from the checkpoint; remove it (see KV_CACHE_DTYPE).",
    ),
    "LONG_LORA_SCALING_FACTORS": ("refuse", "long-context LoRA was removed from vLLM."),
    "ROPE_SCALING": (
        "refuse",
        "use HF_OVERRIDES='{\"rope_parameters\": {...}}' (vLLM --hf-overrides).",
    ),
    "ROPE_THETA": ("refuse", 'use HF_OVERRIDES=\'{"rope_parameters": {"rope_theta": ...}}\'.'),
    "SPECULATIVE_MODEL": (
        "refuse",
        'use SPECULATIVE_CONFIG=\'{"model": "...", "num_speculative_tokens": N}\'.',
    ),
    "NUM_SPECULATIVE_TOKENS": ("refuse", "use SPECULATIVE_CONFIG (num_speculative_tokens)."),
    "SPECULATIVE_DRAFT_TENSOR_PARALLEL_SIZE": (
        "refuse",
        "use SPECULATIVE_CONFIG (draft_tensor_parallel_size).",
    ),
    "SPECULATIVE_MAX_MODEL_LEN": ("refuse", "use SPECULATIVE_CONFIG (max_model_len)."),
    "SPECULATIVE_DISABLE_BY_BATCH_SIZE": (
        "refuse",
        "use SPECULATIVE_CONFIG (disable_by_batch_size).",
    ),
    "NGRAM_PROMPT_LOOKUP_MAX": (
        "refuse",
        'use SPECULATIVE_CONFIG=\'{"method": "ngram", "prompt_lookup_max": N}\'.',
    ),
    "NGRAM_PROMPT_LOOKUP_MIN": ("refuse", "use SPECULATIVE_CONFIG (prompt_lookup_min)."),
    "SPEC_DECODING_ACCEPTANCE_METHOD": ("refuse", "vLLM 0.32 always uses rejection sampling."),
    "TYPICAL_ACCEPTANCE_SAMPLER_POSTERIOR_THRESHOLD": (
        "refuse",
        "the typical acceptance sampler was removed.",
    ),
    "TYPICAL_ACCEPTANCE_SAMPLER_POSTERIOR_ALPHA": (
        "refuse",
        "the typical acceptance sampler was removed.",
    ),
}

# worker-vllm variables whose name already is the vLLM flag's UPPER_SNAKE name: passed straight
# through (listed for the README; every vLLM flag works this way, these are the common ones).
COMMON_ENGINE_VARIABLES: dict[str, str] = {
    "TOKENIZER": "Tokenizer repo or path (same as TOKENIZER_NAME).",
    "TOKENIZER_REVISION": "Tokenizer revision.",
    "TOKENIZER_MODE": "auto, slow, mistral, ...",
    "SKIP_TOKENIZER_INIT": "Skip tokenizer initialisation (token-id input only).",
    "TRUST_REMOTE_CODE": "Run model code from the Hub repository.",
    "DOWNLOAD_DIR": "Where weights are stored, if not the Hugging Face cache under BASE_PATH.",
    "LOAD_FORMAT": "Weight format: auto, safetensors, pt, ...",
    "DTYPE": "auto, half, float16, bfloat16, float, float32.",
    "KV_CACHE_DTYPE": "auto, fp8, ...",
    "MAX_MODEL_LEN": "Context length (accepts 4k, 32k, ...).",
    "QUANTIZATION": "awq, gptq, fp8, bitsandbytes, ...",
    "TENSOR_PARALLEL_SIZE": "GPUs the model is sharded over.",
    "PIPELINE_PARALLEL_SIZE": "Pipeline stages.",
    "DISTRIBUTED_EXECUTOR_BACKEND": "mp or ray.",
    "MAX_PARALLEL_LOADING_WORKERS": "Load weights in batches (avoids host RAM OOM).",
    "GPU_MEMORY_UTILIZATION": "Fraction of GPU memory vLLM may use.",
    "BLOCK_SIZE": "KV-cache block size in tokens.",
    "ENFORCE_EAGER": "Disable CUDA graphs.",
    "DISABLE_CUSTOM_ALL_REDUCE": "Use NCCL all-reduce only.",
    "ENABLE_PREFIX_CACHING": "Automatic prefix caching (1/0).",
    "ENABLE_CHUNKED_PREFILL": "Chunked prefill (1/0).",
    "DISABLE_SLIDING_WINDOW": "Cap the context to the sliding window.",
    "SEED": "Random seed.",
    "NUM_GPU_BLOCKS_OVERRIDE": "Override the profiled number of KV blocks.",
    "MAX_NUM_BATCHED_TOKENS": "Tokens per scheduler step.",
    "MAX_NUM_SEQS": "Sequences per scheduler step (the engine's batch size).",
    "MAX_LOGPROBS": "Most logprobs a request may ask for.",
    "DISABLE_LOG_STATS": "Turn off vLLM's periodic stats log.",
    "ENABLE_LORA": "Serve LoRA adapters (1/0).",
    "MAX_LORAS": "LoRAs in one batch.",
    "MAX_LORA_RANK": "Largest LoRA rank.",
    "LORA_DTYPE": "auto, float16, bfloat16, float32.",
    "MAX_CPU_LORAS": "LoRAs kept in CPU memory.",
    "FULLY_SHARDED_LORAS": "Fully sharded LoRA layers.",
    "RAY_WORKERS_USE_NSIGHT": "Profile Ray workers with nsight.",
    "MODEL_LOADER_EXTRA_CONFIG": "JSON passed to the model loader.",
    "MAX_LOG_LEN": "Prompt characters shown in request logs.",
    "SPECULATIVE_CONFIG": "JSON speculative-decoding configuration.",
    "HF_OVERRIDES": "JSON overrides of the model's Hugging Face config.",
    "LIMIT_MM_PER_PROMPT": 'Most images (etc.) in one prompt, JSON: {"image": 4}; more is a 400.',
    "ALLOWED_MEDIA_DOMAINS": "Only fetch image URLs on these hosts (every redirect hop too).",
    "ALLOWED_LOCAL_MEDIA_PATH": "Directory file: image URLs may read; unset, file: URLs are a 400.",
}

# vLLM flags that are NOT settable through their UPPER_SNAKE name, and why. Either we own the
# variable (it means something to the runtime itself), or the name is too generic to be read
# from a container's environment without surprises.
NOT_FROM_ENVIRONMENT: dict[str, str] = {
    "--model": "set MODEL_NAME",
    "--help": "not a setting",
    "--host": "HOST is the runtime's own setting",
    "--port": "PORT is the runtime's own setting",
    "--api-key": "API_KEY/API_KEYS are enforced by the runtime for every route",
    "--hf-token": "HF_TOKEN is exported to the Hugging Face client by the runtime",
    "--headless": "the runtime always serves HTTP",
    "--api-server-count": "the runtime is one API server process",
    "--uds": "the runtime listens on HOST:PORT",
    "--grpc": "the runtime serves HTTP",
    "--grpc-port": "the runtime serves HTTP",
    "--root-path": "use the Ingress for path prefixes",
}


# ---------------------------------------------------------------------------------------------
# value parsing
# ---------------------------------------------------------------------------------------------


def parse_bool(name: str, value: str) -> bool:
    try:
        return vllm_env.parse_bool(value)
    except ValueError as exc:
        raise ConfigError(name, str(exc)) from None


def _flag_argv(flag: str, value: str) -> list[str]:
    return [flag, value]


def _list_values(name: str, value: str) -> list[str]:
    """A multi-valued flag: a JSON array, or values separated by whitespace or commas."""
    try:
        return vllm_env.list_values(value)
    except ValueError as exc:
        raise ConfigError(name, str(exc)) from None


@dataclass(frozen=True)
class FlagSpec:
    flag: str  # --max-num-seqs
    kind: Literal["value", "list", "store_true", "bool_optional", "append"]


env_name_for = vllm_env.env_name_for


def flag_table(parser) -> dict[str, FlagSpec]:
    """UPPER_SNAKE env name -> flag, for every long option of vLLM's parser."""
    table: dict[str, FlagSpec] = {}
    for action in parser._actions:
        longs = [o for o in action.option_strings if o.startswith("--")]
        if not longs:
            continue
        kind_name = type(action).__name__
        if kind_name == "_StoreTrueAction":
            kind = "store_true"
        elif kind_name == "BooleanOptionalAction":
            kind = "bool_optional"
        elif kind_name == "_AppendAction":
            kind = "append"
        elif action.nargs in ("+", "*"):
            kind = "list"
        else:
            kind = "value"
        # Only the positive spelling is read (ENABLE_X=0, never NO_ENABLE_X=1).
        for flag in longs:
            if flag.startswith("--no-") and kind == "bool_optional":
                continue
            if flag in NOT_FROM_ENVIRONMENT:
                continue
            table.setdefault(env_name_for(flag), FlagSpec(longs[0], kind))
    return table


def _argv_for(spec: FlagSpec, name: str, value: str) -> list[str]:
    if spec.kind == "store_true":
        return [spec.flag] if parse_bool(name, value) else []
    if spec.kind == "bool_optional":
        positive = parse_bool(name, value)
        return [spec.flag if positive else "--no-" + spec.flag[2:]]
    if spec.kind == "list":
        return [spec.flag, *_list_values(name, value)]
    if spec.kind == "append":
        return [arg for item in _list_values(name, value) for arg in (spec.flag, item)]
    return [spec.flag, value]


# ---------------------------------------------------------------------------------------------
# the entry point
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RuntimeConfig:
    settings: RuntimeSettings
    vllm_argv: list[str]
    engine_args: Namespace
    # vLLM flag -> the environment variable it came from (to name it in later errors)
    warnings: list[str] = field(default_factory=list)
    # Variables the runtime exports to its own process (and so to vLLM's workers).
    process_env: dict[str, str] = field(default_factory=dict)

    @property
    def served_model_names(self) -> list[str]:
        names = self.engine_args.served_model_name
        return list(names) if names else [self.engine_args.model]


def load_settings(env: Mapping[str, str]) -> RuntimeSettings:
    """The runtime's own settings alone (no vLLM flags): what `download` needs. ConfigError
    names the first variable that is wrong."""
    return _load_settings(env)


def _load_settings(env: Mapping[str, str]) -> RuntimeSettings:
    try:
        settings = RuntimeSettings.model_validate({k: v for k, v in env.items() if v.strip()})
    except ValidationError as exc:
        first = exc.errors()[0]
        variable = str(first["loc"][0]) if first["loc"] else "environment"
        raise ConfigError(variable, f"{first['msg']} (got {first.get('input')!r})") from None
    if settings.jobs_queue_url is not None and not settings.endpoint_id:
        raise ConfigError(
            "ENDPOINT_ID",
            "required with JOBS_QUEUE_URL: it names the endpoint whose jobs this pod takes",
        )
    if settings.jobs_queue_creds_file is not None:
        if settings.jobs_queue_url is None:
            raise ConfigError(
                "JOBS_QUEUE_CREDS_FILE", "set without JOBS_QUEUE_URL: which queue is it for?"
            )
        try:
            check_runtime_creds(
                read_creds(settings.jobs_queue_creds_file),
                EndpointRef(settings.endpoint_namespace, settings.endpoint_id),
            )
        except CredentialsError as exc:
            raise ConfigError("JOBS_QUEUE_CREDS_FILE", str(exc)) from None
    return settings


def _collect_flag_args(
    env: Mapping[str, str], table: Mapping[str, FlagSpec]
) -> tuple[list[str], dict[str, str], list[str]]:
    """Environment -> vLLM argv, which variable set which flag, and warnings."""
    own = set(settings_variables())
    argv: list[str] = []
    sources: dict[str, str] = {}
    warnings: list[str] = []
    seen_values: dict[str, tuple[str, list[str]]] = {}

    def add(flag_key: str, name: str, args: list[str]) -> None:
        previous = seen_values.get(flag_key)
        if previous is not None and previous[1] != args:
            raise ConfigError(
                name, f"conflicts with {previous[0]}: both set {flag_key} to different values"
            )
        if previous is None:
            seen_values[flag_key] = (name, args)
            argv.extend(args)
        sources.setdefault(flag_key, name)

    for name in sorted(env):
        value = env[name]
        if not value.strip():
            # Empty means "not set", as in worker-vllm: images declare ENV MODEL_REVISION= etc.
            continue
        if name in WORKER_VLLM_ALIASES:
            translate, _ = WORKER_VLLM_ALIASES[name]
            args = translate(name, value)
            if args:
                add(args[0], name, args)
            continue
        if name in RETIRED_VARIABLES:
            disposition, why = RETIRED_VARIABLES[name]
            if disposition == "refuse":
                raise ConfigError(name, f"is not supported by vLLM 0.32: {why}")
            warnings.append(f"{name} is ignored: {why}")
            continue
        if name.startswith(SAGEMAKER_PREFIX):
            flag_name = name[len(SAGEMAKER_PREFIX) :]
            spec = table.get(flag_name)
            if spec is None:
                raise ConfigError(
                    name, f"--{flag_name.lower().replace('_', '-')} is not a vLLM flag"
                )
            add(spec.flag, name, _argv_for(spec, name, value))
            continue
        if name in own:
            continue
        spec = table.get(name)
        if spec is not None:
            add(spec.flag, name, _argv_for(spec, name, value))
    return argv, sources, warnings


_ARG_ERROR = re.compile(r"argument (?P<flags>[-\w/]+)")


def _variable_for_parse_error(message: str, sources: Mapping[str, str]) -> str:
    match = _ARG_ERROR.search(message)
    if match:
        for flag in match.group("flags").split("/"):
            if flag in sources:
                return sources[flag]
        flag = match.group("flags").split("/")[0]
        return env_name_for(flag)
    for flag, variable in sources.items():
        if flag in message:
            return variable
    return "environment"


def _one_line(message: str) -> str:
    """vLLM's messages may span lines (pydantic) or name a Python function; make them readable."""
    message = re.sub(r"<function (\w+) at 0x[0-9a-f]+>", r"\1()", message)
    message = message.replace("json.loads()", "JSON").replace("loads()", "JSON")
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    lines = [line for line in lines if not line.startswith("For further information visit")]
    return "; ".join(lines)


def apply_batch_scheduling(
    settings: RuntimeSettings, engine_args: Namespace, sources: Mapping[str, str]
) -> None:
    """With batches on, vLLM schedules by priority, so batch requests (LLMEP_BATCH_PRIORITY)
    yield to interactive ones (priority 0; equal priorities keep arrival order, as FCFS).
    An explicit SCHEDULING_POLICY=fcfs cannot run them below: refused, naming both."""
    if not settings.batch_enabled:
        return
    policy = getattr(engine_args, "scheduling_policy", None)
    if "--scheduling-policy" in sources:
        if policy != "priority":
            raise ConfigError(
                sources["--scheduling-policy"],
                f"is {policy!r}, but batches (LLMEP_BATCH_ENABLED) need 'priority' to run "
                "below interactive requests: drop the variable (the runtime sets priority), "
                "or set LLMEP_BATCH_ENABLED=false",
            )
        return
    engine_args.scheduling_policy = "priority"


def batch_dir(settings: RuntimeSettings, env: Mapping[str, str]) -> str:
    """Where a pod without the shared queue keeps batch files (under the model cache)."""
    if settings.batch_dir:
        return settings.batch_dir
    root = (
        settings.base_path
        or env.get("HF_HOME")
        or str(Path(env.get("HOME") or Path.home()) / ".cache" / "huggingface")
    )
    return str(Path(root) / "llmendpoints-batches")


def load_config(env: Mapping[str, str]) -> RuntimeConfig:
    """Validate the environment and turn it into settings and vLLM's parsed arguments.

    Raises ConfigError naming the first variable that is missing, unknown or invalid.
    """
    settings = _load_settings(env)
    model = env.get("MODEL_NAME", "").strip()
    if not model:
        raise ConfigError(
            "MODEL_NAME",
            "is not set: set it to a Hugging Face repo id (e.g. Qwen/Qwen2.5-0.5B-Instruct) "
            "or a local model directory. There is no default model.",
        )

    parser = engine_module.build_arg_parser()
    table = flag_table(parser)
    argv, sources, warnings = _collect_flag_args(env, table)
    try:
        engine_args = engine_module.parse_engine_args(parser, argv)
    except engine_module.EngineArgsError as exc:
        message = _one_line(str(exc))
        raise ConfigError(_variable_for_parse_error(message, sources), message) from None

    if engine_args.api_key:
        # vLLM would enforce its own key on its routes only; keys are ours to enforce everywhere.
        raise ConfigError("API_KEY", "set API_KEY or API_KEYS, not vLLM's --api-key")
    check_start_adapters(engine_args)
    apply_batch_scheduling(settings, engine_args, sources)

    process_env: dict[str, str] = {}
    if settings.base_path:
        process_env["HF_HOME"] = settings.base_path
    if settings.hf_token is not None:
        process_env["HF_TOKEN"] = settings.hf_token.get_secret_value()
    return RuntimeConfig(
        settings=settings,
        vllm_argv=argv,
        engine_args=engine_args,
        warnings=warnings,
        process_env=process_env,
    )
