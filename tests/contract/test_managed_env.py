"""The operator's list of managed variables covers every name under which the runtime reads them.

managed_env derives the operator's part from build_env, but the runtime's aliases (worker-vllm's
spellings, vLLM's flag names, SM_VLLM_*) live in the runtime, which the operator never imports.
This test sees both: for every variable the operator writes, it asks the runtime's own tables
which other environment variables reach the same vLLM flag or runtime setting, and checks that
the operator refuses each of them in engine.env.
"""

from __future__ import annotations

import pytest
from llmendpoints_operator import managed_env
from llmendpoints_runtime import config, engine


def _flag_of_alias(name: str) -> str | None:
    translate, _ = config.WORKER_VLLM_ALIASES[name]
    for sample in ("x", "1", '[{"name": "a", "path": "b"}]'):
        try:
            argv = translate(name, sample)
        except config.ConfigError:
            continue
        return argv[0] if argv else None
    return None


@pytest.fixture(scope="module")
def runtime_names() -> dict[str, str]:
    """Environment variable -> what it sets in the runtime (a vLLM flag or a setting's name)."""
    table = config.flag_table(engine.build_arg_parser())
    targets: dict[str, str] = {name: f"setting {name}" for name in config.settings_variables()}
    for name, spec in table.items():
        targets.setdefault(name, spec.flag)
        targets.setdefault(config.SAGEMAKER_PREFIX + name, spec.flag)
    for name in config.WORKER_VLLM_ALIASES:
        flag = _flag_of_alias(name)
        if flag is not None:
            targets[name] = flag
    return targets


def test_every_runtime_spelling_of_a_managed_variable_is_refused(
    runtime_names: dict[str, str],
) -> None:
    written = managed_env.operator_written()
    managed_targets = {runtime_names[name] for name in written if name in runtime_names}
    # The operator's variables reach vLLM flags and runtime settings (sanity: the lookup works).
    assert {"--model", "--served-model-name", "--max-model-len", "setting API_KEYS_FILE"} <= (
        managed_targets
    )
    spellings = sorted(name for name, target in runtime_names.items() if target in managed_targets)
    missed = [name for name in spellings if managed_env.owner_of(name) is None]
    assert missed == [], f"the runtime reads these as managed settings: {missed}"


def test_variables_the_runtime_exports_for_managed_settings_are_refused() -> None:
    """HF_HOME and HF_TOKEN are exported by the runtime from BASE_PATH and HF_TOKEN."""
    cfg = config.load_config({"MODEL_NAME": "m", "BASE_PATH": "/models", "HF_TOKEN": "t"})
    assert set(cfg.process_env) == {"HF_HOME", "HF_TOKEN"}
    assert all(managed_env.owner_of(name) for name in cfg.process_env)


@pytest.mark.parametrize(
    "setting", ["API_KEYS", "API_KEY", "API_KEYS_FILE", "UNAUTHENTICATED_PATHS"]
)
def test_the_runtimes_security_settings_are_managed(setting: str) -> None:
    assert setting in config.settings_variables()  # still the runtime's names
    assert managed_env.owner_of(setting) is not None
