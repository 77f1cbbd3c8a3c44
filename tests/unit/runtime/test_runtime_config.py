"""Environment -> settings and vLLM engine arguments, through vLLM's real parser."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from llmendpoints_runtime import engine
from llmendpoints_runtime.config import (
    COMMON_ENGINE_VARIABLES,
    RETIRED_VARIABLES,
    WORKER_VLLM_ALIASES,
    ConfigError,
    flag_table,
    load_config,
    settings_variables,
)

# The worker-vllm READMEs' variables (shared/seeds), copied into the repository.
SEED_VARIABLES = Path(__file__).resolve().parent / "fixtures" / "worker_vllm_variables.txt"
BASE = {"MODEL_NAME": "org/model"}


def config(**env: str):
    return load_config({**BASE, **env})


def error_for(**env: str) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config({**BASE, **env})
    return info.value


def test_model_name_is_required_and_named():
    with pytest.raises(ConfigError) as info:
        load_config({})
    assert info.value.variable == "MODEL_NAME"
    assert "no default model" in str(info.value)
    assert error_for(MODEL_NAME="  ").variable == "MODEL_NAME"


def test_worker_vllm_names_map_to_vllm_flags():
    args = config(
        MODEL_REVISION="v2",
        TOKENIZER_NAME="org/tok",
        TOKENIZER_REVISION="t1",
        MAX_MODEL_LENGTH="4k",
        CUSTOM_CHAT_TEMPLATE="{{ messages }}",
        OPENAI_SERVED_MODEL_NAME_OVERRIDE="my-model",
        OPENAI_RESPONSE_ROLE="bot",
        DISABLE_LOG_REQUESTS="0",
        WORKER_USE_RAY="1",
    ).engine_args
    assert args.model == "org/model"
    assert args.revision == "v2"
    assert args.tokenizer == "org/tok"
    assert args.tokenizer_revision == "t1"
    assert args.max_model_len == 4000
    assert args.chat_template == "{{ messages }}"
    assert args.served_model_name == ["my-model"]
    assert args.response_role == "bot"
    assert args.enable_log_requests is True
    assert args.distributed_executor_backend == "ray"


def test_defaults_do_not_invent_engine_settings():
    cfg = config()
    assert cfg.vllm_argv == ["--model", "org/model"]
    assert cfg.engine_args.enable_log_requests is False
    assert cfg.served_model_names == ["org/model"]


def test_any_vllm_flag_by_its_upper_snake_name():
    args = config(
        MAX_NUM_SEQS="64",
        ENFORCE_EAGER="true",
        TRUST_REMOTE_CODE="1",
        DTYPE="bfloat16",
        GPU_MEMORY_UTILIZATION="0.8",
        TENSOR_PARALLEL_SIZE="2",
        QUANTIZATION="awq",
        HF_OVERRIDES='{"rope_theta": 5}',
    ).engine_args
    assert args.max_num_seqs == 64
    assert args.enforce_eager is True
    assert args.trust_remote_code is True
    assert args.dtype == "bfloat16"
    assert args.gpu_memory_utilization == 0.8
    assert args.tensor_parallel_size == 2
    assert args.quantization == "awq"
    assert args.hf_overrides == {"rope_theta": 5}


@pytest.mark.parametrize(
    ("value", "expected"), [("1", True), ("0", False), ("true", True), ("False", False)]
)
def test_boolean_flags_take_both_directions(value, expected):
    assert config(ENABLE_PREFIX_CACHING=value).engine_args.enable_prefix_caching is expected


def test_sagemaker_prefix_sets_the_same_flags():
    args = config(SM_VLLM_MAX_NUM_SEQS="32", SM_VLLM_ENABLE_PREFIX_CACHING="false").engine_args
    assert args.max_num_seqs == 32
    assert args.enable_prefix_caching is False


def test_sagemaker_prefix_with_unknown_flag_is_named():
    err = error_for(SM_VLLM_NOT_A_FLAG="1")
    assert err.variable == "SM_VLLM_NOT_A_FLAG"
    assert "--not-a-flag" in err.message


def test_two_variables_for_one_flag_must_agree():
    assert config(TOKENIZER="a", TOKENIZER_NAME="a").engine_args.tokenizer == "a"
    err = error_for(TOKENIZER="a", TOKENIZER_NAME="b")
    assert {err.variable} <= {"TOKENIZER", "TOKENIZER_NAME"}
    assert "conflicts" in err.message


@pytest.mark.parametrize(
    ("env", "variable", "fragment"),
    [
        ({"MAX_MODEL_LEN": "lots"}, "MAX_MODEL_LEN", "lots"),
        ({"MAX_NUM_SEQS": "many"}, "MAX_NUM_SEQS", "many"),
        ({"DTYPE": "float7"}, "DTYPE", "float7"),
        ({"SM_VLLM_DTYPE": "float7"}, "SM_VLLM_DTYPE", "float7"),
        ({"ENABLE_PREFIX_CACHING": "maybe"}, "ENABLE_PREFIX_CACHING", "boolean"),
        ({"MAX_MODEL_LENGTH": "x"}, "MAX_MODEL_LENGTH", "'x'"),
        ({"PORT": "http"}, "PORT", "integer"),
        ({"PORT": "70000"}, "PORT", "65535"),
        ({"MAX_CONCURRENCY": "0"}, "MAX_CONCURRENCY", "greater than or equal to 1"),
        ({"LOG_FORMAT": "xml"}, "LOG_FORMAT", "text"),
        ({"DRAIN_TIMEOUT_SECONDS": "-1"}, "DRAIN_TIMEOUT_SECONDS", "0"),
        ({"LORA_MODULES": "not json"}, "LORA_MODULES", "JSON"),
        ({"LORA_MODULES": '[{"name": "a"}]'}, "LORA_MODULES", "path"),
        ({"ENABLE_AUTO_TOOL_CHOICE": "1"}, "environment", "tool-call-parser"),
        ({"HF_OVERRIDES": "{not: json}"}, "HF_OVERRIDES", "JSON"),
        ({"SPECULATIVE_CONFIG": "{bad"}, "SPECULATIVE_CONFIG", "cannot be converted to JSON"),
        ({"COMPILATION_CONFIG": "3"}, "COMPILATION_CONFIG", "Input should be an object"),
    ],
)
def test_invalid_values_stop_start_up_naming_the_variable(env, variable, fragment):
    err = error_for(**env)
    if variable != "environment":
        assert err.variable == variable, err
    assert fragment in str(err)
    # One line a person can read in a pod's log.
    assert "\n" not in str(err)


def test_lora_modules_in_worker_vllm_json_form():
    modules = [
        {"name": "sql", "path": "org/sql-lora", "base_model_name": "org/model"},
        {"name": "b", "path": "/p"},
    ]
    args = config(ENABLE_LORA="1", LORA_MODULES=json.dumps(modules)).engine_args
    assert [(m.name, m.path) for m in args.lora_modules] == [("sql", "org/sql-lora"), ("b", "/p")]
    assert args.lora_modules[0].base_model_name == "org/model"


def test_retired_tuning_variables_warn_and_behaviour_changing_ones_refuse():
    cfg = config(USE_V2_BLOCK_MANAGER="1", SWAP_SPACE="4")
    assert any("USE_V2_BLOCK_MANAGER is ignored" in w for w in cfg.warnings)
    assert any("SWAP_SPACE is ignored" in w for w in cfg.warnings)
    err = error_for(ROPE_SCALING='{"type": "linear"}')
    assert err.variable == "ROPE_SCALING"
    assert "HF_OVERRIDES" in err.message


def test_runtime_owned_names_never_reach_vllm():
    cfg = config(
        PORT="9001",
        HOST="127.0.0.1",
        API_KEY="k1",
        API_KEYS="k2,k3",
        HF_TOKEN="hf_x",
        BASE_PATH="/models",
    )
    assert cfg.settings.port == 9001 and cfg.settings.host == "127.0.0.1"
    assert cfg.engine_args.api_key is None  # enforced by the runtime on every route instead
    assert cfg.engine_args.hf_token is None
    assert set(cfg.settings.static_api_keys()) == {"k1", "k2", "k3"}
    assert cfg.process_env == {"HF_HOME": "/models", "HF_TOKEN": "hf_x"}
    assert "hf_x" not in repr(cfg.settings)  # secrets are not printed


def test_unrelated_environment_is_ignored():
    cfg = config(PATH="/usr/bin", HOME="/root", KUBERNETES_SERVICE_HOST="10.0.0.1", LANG="C.UTF-8")
    assert cfg.vllm_argv == ["--model", "org/model"]


def test_documented_common_variables_are_real_vllm_flags():
    table = flag_table(engine.build_arg_parser())
    missing = [name for name in COMMON_ENGINE_VARIABLES if name not in table]
    assert not missing, f"not vLLM 0.32 flags: {missing}"


def _seed_variables() -> set[str]:
    lines = SEED_VARIABLES.read_text().splitlines()
    return {line for line in lines if line and not line.startswith("#")}


def test_every_worker_vllm_variable_keeps_a_meaning():
    seeds = _seed_variables()
    assert len(seeds) > 60, "the seed tables were not found"
    build_only = {"WORKER_CUDA_VERSION"}  # a docker build argument of worker-vllm, not a setting
    handled = (
        set(flag_table(engine.build_arg_parser()))
        | set(WORKER_VLLM_ALIASES)
        | set(RETIRED_VARIABLES)
        | set(settings_variables())
        | build_only
    )
    unhandled = sorted(seeds - handled)
    assert not unhandled, f"worker-vllm variables the runtime would silently ignore: {unhandled}"


def test_own_settings_never_shadow_a_vllm_flag_by_accident():
    """A runtime setting named like a vLLM flag would silently take that flag away from users."""
    from llmendpoints_runtime.config import NOT_FROM_ENVIRONMENT, env_name_for

    parser = engine.build_arg_parser()
    vllm_names = {
        env_name_for(flag)
        for action in parser._actions
        for flag in action.option_strings
        if flag.startswith("--")
    }
    deliberately_owned = {env_name_for(flag) for flag in NOT_FROM_ENVIRONMENT}
    shadowed = sorted((set(settings_variables()) & vllm_names) - deliberately_owned)
    assert not shadowed, f"settings that hide vLLM flags: {shadowed} (prefix them with LLMEP_)"


def test_empty_values_mean_not_set():
    """Images declare `ENV MODEL_REVISION=` and friends; an empty value must not reach vLLM."""
    cfg = config(
        MODEL_REVISION="",
        TOKENIZER_NAME="",
        MAX_MODEL_LEN=" ",
        PORT="",
        API_KEYS="",
        SM_VLLM_DTYPE="",
    )
    assert cfg.vllm_argv == ["--model", "org/model"]
    assert cfg.settings.port == 8000
    assert cfg.settings.static_api_keys() == ()


def test_shared_queue_settings():
    plain = config()
    assert plain.settings.jobs_queue_url is None  # the in-pod job store
    queued = config(
        JOBS_QUEUE_URL="nats://u:p@nats:4222", ENDPOINT_ID="chat-a", LLMEP_JOBS_MAX_ATTEMPTS="5"
    )
    assert queued.settings.jobs_queue_url.get_secret_value() == "nats://u:p@nats:4222"
    assert "u:p" not in repr(queued.settings)  # the password never reaches a log line
    assert (queued.settings.endpoint_id, queued.settings.jobs_max_attempts) == ("chat-a", 5)
    assert error_for(JOBS_QUEUE_URL="nats://nats:4222").variable == "ENDPOINT_ID"
    assert error_for(ENDPOINT_ID="Not_A_Name").variable == "ENDPOINT_ID"
    assert error_for(LLMEP_JOBS_MAX_ATTEMPTS="0").variable == "LLMEP_JOBS_MAX_ATTEMPTS"


def test_webhook_destinations_are_parsed_and_a_bad_entry_is_named():
    policy = config(LLMEP_WEBHOOK_DESTINATIONS="hooks.example.com, 10.0.0.0/8").settings
    assert policy.webhook_policy.allowed == ("hooks.example.com", "10.0.0.0/8")
    assert config().settings.webhook_policy.allowed == ()
    error = error_for(LLMEP_WEBHOOK_DESTINATIONS="hooks.example.com, https://x/")
    assert error.variable == "LLMEP_WEBHOOK_DESTINATIONS" and "'https://x/'" in str(error)


def test_webhook_bounds_reach_the_job_settings_and_bad_values_are_named():
    from llmendpoints_runtime.compose import job_settings_from

    defaults = job_settings_from(config().settings, 300)
    assert (defaults.webhook_timeout_seconds, defaults.webhook_max_concurrency) == (10.0, 64)
    tuned = config(WEBHOOK_TIMEOUT_SECONDS="2.5", WEBHOOK_MAX_CONCURRENCY="8").settings
    jobs = job_settings_from(tuned, 300)
    assert (jobs.webhook_timeout_seconds, jobs.webhook_max_concurrency) == (2.5, 8)
    assert error_for(WEBHOOK_TIMEOUT_SECONDS="0").variable == "WEBHOOK_TIMEOUT_SECONDS"
    assert error_for(WEBHOOK_MAX_CONCURRENCY="0").variable == "WEBHOOK_MAX_CONCURRENCY"


def test_the_gateway_reads_the_webhook_settings_by_the_same_names():
    from llmendpoints_gateway.config import GatewaySettings
    from llmendpoints_runtime.config import RuntimeSettings

    names = ("webhook_destinations", "webhook_timeout_seconds", "webhook_max_concurrency")
    for name in names:
        runtime, gateway = RuntimeSettings.model_fields[name], GatewaySettings.model_fields[name]
        assert runtime.validation_alias == gateway.validation_alias, name
        assert runtime.default == gateway.default, name
    settings = GatewaySettings(WEBHOOK_TIMEOUT_SECONDS="3", WEBHOOK_MAX_CONCURRENCY="5")
    assert (settings.webhook_timeout_seconds, settings.webhook_max_concurrency) == (3.0, 5)


def _adapter(path, rank: int):
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps({"r": rank, "peft_type": "LORA"}))
    return str(path)


def test_a_start_adapter_above_max_lora_rank_is_refused_naming_the_variable(tmp_path):
    modules = [{"name": "big", "path": _adapter(tmp_path / "big", 16)}]
    with pytest.raises(ConfigError) as caught:
        config(ENABLE_LORA="1", MAX_LORA_RANK="8", LORA_MODULES=json.dumps(modules))
    assert caught.value.variable == "MAX_LORA_RANK"
    assert "'big'" in str(caught.value) and "rank 16" in str(caught.value)
    assert "MAX_LORA_RANK=8" in str(caught.value) and "at least 16" in str(caught.value)


def test_a_start_adapter_within_max_lora_rank_and_the_default_rank_pass(tmp_path):
    modules = [{"name": "ok", "path": _adapter(tmp_path / "ok", 8)}]
    assert config(ENABLE_LORA="1", MAX_LORA_RANK="8", LORA_MODULES=json.dumps(modules))
    assert config(ENABLE_LORA="1", LORA_MODULES=json.dumps(modules))  # vLLM's default: 16


def test_hub_adapters_are_left_to_vllm_at_start():
    modules = [{"name": "hub", "path": "org/adapter"}]
    assert config(ENABLE_LORA="1", MAX_LORA_RANK="8", LORA_MODULES=json.dumps(modules))


def test_start_adapters_need_enable_lora(tmp_path):
    modules = [{"name": "ok", "path": _adapter(tmp_path / "ok", 8)}]
    with pytest.raises(ConfigError) as caught:
        config(LORA_MODULES=json.dumps(modules))
    assert caught.value.variable == "LORA_MODULES" and "ENABLE_LORA" in str(caught.value)
