"""engine.env and engine.args cannot set what the operator or the runtime manages."""

from __future__ import annotations

import pathlib
from typing import Any

import pytest
import yaml
from llmendpoints_operator import managed_env, manifests
from llmendpoints_operator.admission import admit
from llmendpoints_operator.config import OperatorSettings
from llmendpoints_operator.spec import MANAGED_VARIABLES, InvalidSpecError, parse

SETTINGS = OperatorSettings()
EXAMPLES = sorted((pathlib.Path(__file__).resolve().parents[3] / "examples").glob("*.yaml"))


def _refused(env: list[dict[str, Any]] | None = None, args: dict[str, Any] | None = None):
    spec = {"model": {"name": "org/m"}, "engine": {"env": env or [], "args": args or {}}}
    with pytest.raises(InvalidSpecError) as caught:
        admit("demo", "ns", spec, SETTINGS)
    return caught.value.problems


@pytest.mark.parametrize(
    "variable",
    [
        "API_KEYS",
        "API_KEYS_FILE",
        "API_KEY",
        "ADMIN_API_KEYS",
        "ADMIN_API_KEYS_FILE",
        "UNAUTHENTICATED_PATHS",
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING",
        "JOBS_QUEUE_URL",
        "ENDPOINT_ID",
        "ENDPOINT_NAMESPACE",
        "JOBS_QUEUE_CREDS_FILE",
        "GATEWAY_TOKEN_FILE",
        "LLMEP_CONTROL_PORT",
        "LLMEP_CONTROL_HOST",  # an author cannot put the probed port back on every interface
        # worker-vllm and vLLM spellings of variables the operator writes
        "SERVED_MODEL_NAME",
        "MODEL",
        "MAX_MODEL_LENGTH",
        "CHAT_TEMPLATE",
        # SageMaker spellings
        "SM_VLLM_SERVED_MODEL_NAME",
        "SM_VLLM_MAX_MODEL_LEN",
        "SM_VLLM_TRUST_REMOTE_CODE",
        "SM_VLLM_UNAUTHENTICATED_PATHS",
        "LOG_FORMAT",
    ],
)
def test_managed_variable_in_env_is_refused_naming_it(variable: str) -> None:
    problems = _refused(env=[{"name": "SEED", "value": "1"}, {"name": variable, "value": "x"}])
    (problem,) = problems
    # spec.parse refuses the operator's own names with the field to use instead; the rest are
    # refused by managed_env with their index. Either way the variable is named.
    assert problem.field in ("spec.engine.env", "spec.engine.env[1].name")
    assert problem.message.startswith(variable + " is ")


def test_a_flag_that_becomes_a_managed_variable_is_refused() -> None:
    (problem,) = _refused(args={"unauthenticated-paths": "/v1"})
    assert problem.field == "spec.engine.args.unauthenticated-paths"
    assert "UNAUTHENTICATED_PATHS" in problem.message


def test_managed_message_says_what_to_use_instead() -> None:
    (problem,) = _refused(env=[{"name": "SM_VLLM_MAX_MODEL_LEN", "value": "4"}])
    assert "spec.engine.maxModelLen" in problem.message
    (problem,) = _refused(env=[{"name": "API_KEYS", "value": "k"}])
    assert "spec.api.apiKeysSecretRef" in problem.message


@pytest.mark.parametrize(
    ("variable", "value"),
    [("MAX_NUM_SEQS", "1"), ("SEED", "1"), ("VLLM_LOGGING_LEVEL", "1"), ("KV_CACHE_DTYPE", "fp8")],
)
def test_ordinary_engine_variables_stay_allowed(variable: str, value: str) -> None:
    spec = {"model": {"name": "m"}, "engine": {"env": [{"name": variable, "value": value}]}}
    admit("demo", "ns", spec, SETTINGS)


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_every_variable_the_operator_writes_is_managed(example: pathlib.Path) -> None:
    """Derived from build_env, so a variable the operator starts writing is managed at once."""
    doc = yaml.safe_load(example.read_text())
    ep = parse(doc["metadata"]["name"], "ns", doc["spec"])
    written = {v["name"] for v in manifests.build_env(ep)}
    from_env = {v.name for v in ep.spec.engine.env}  # the user's own engine.env, passed through
    from_args = {name for name in written - from_env if name not in managed_env.operator_written()}
    # Besides engine.args: the LoRA defaults spec.adapters derives, which args/env may override.
    defaults = set(manifests.lora_settings(ep))
    assert from_args - defaults == {n.replace("-", "_").upper() for n in ep.spec.engine.args}
    assert all(managed_env.owner_of(n) for n in written - from_args - from_env)


def test_the_specs_own_table_is_a_subset_of_the_derived_one() -> None:
    """spec.MANAGED_VARIABLES gives the friendlier message; it must not miss what the pod gets."""
    derived = managed_env.operator_written()
    assert {"MODEL_NAME", "API_KEYS_FILE", "HF_TOKEN", "HOST", "PORT"} <= derived
    assert all(managed_env.owner_of(name) for name in MANAGED_VARIABLES)
