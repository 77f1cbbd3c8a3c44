"""Every route of vLLM 0.32's OpenAI app is classified: engine control (admin keys only) or
serving (any key). A route that is in neither list -- a vLLM upgrade, a new flag -- fails here
until someone decides which it is (runtime/llmendpoints_runtime/control_routes.py)."""

from __future__ import annotations

import types

import pytest
from llmendpoints_runtime.control_routes import CONTROL_ROUTES, SERVING_ROUTES

# Every switch that adds routes to vLLM's app: the development and RL routes, run-time LoRA
# loading, profiling, fault tolerance, the tokenizer-info route.
_ENV = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}
_ARGS = [
    "--model",
    "org/m",
    "--profiler-config",
    '{"profiler": "torch", "torch_profiler_dir": "/tmp/llmep-profile"}',
    "--enable-fault-tolerance",
    "--enable-tokenizer-info-endpoint",
]


def _routes(pooling_task: str | None) -> set[str]:
    from llmendpoints_runtime.engine import build_arg_parser
    from vllm.entrypoints.launchers.app import build_app
    from vllm.tasks import FRONTEND_TASKS, GENERATION_TASKS, POOLING_TASKS

    args = build_arg_parser().parse_args(_ARGS)
    # What the pooling routes ask of the model: its pooling task and, for classify, its labels.
    model_config = types.SimpleNamespace(
        get_pooling_task=lambda tasks: pooling_task,
        hf_config=types.SimpleNamespace(num_labels=1),
    )
    tasks = (*GENERATION_TASKS, *POOLING_TASKS, *FRONTEND_TASKS)
    app = build_app(args, tasks, model_config)
    return {route.path for route in app.routes}


@pytest.fixture(scope="module")
def vllm_routes() -> set[str]:
    with pytest.MonkeyPatch.context() as patch:
        for name, value in _ENV.items():
            patch.setenv(name, value)
        return _routes("embed") | _routes("classify") | _routes(None)


def test_every_vllm_route_is_either_control_or_serving(vllm_routes):
    unclassified = vllm_routes - CONTROL_ROUTES - SERVING_ROUTES
    assert not unclassified, (
        f"vLLM's app has routes control_routes.py does not classify: {sorted(unclassified)}; "
        "add each to CONTROL_ROUTES (admin keys only) or SERVING_ROUTES"
    )


def test_the_control_routes_named_in_the_issue_exist_in_vllm(vllm_routes):
    # The list is not stale: these are vLLM 0.32's, as its app builds them.
    for path in (
        "/scale_elastic_ep",
        "/v1/load_lora_adapter",
        "/start_profile",
        "/sleep",
        "/wake_up",
        "/reset_prefix_cache",
        "/collective_rpc",
        "/pause",
    ):
        assert path in vllm_routes and path in CONTROL_ROUTES


def test_every_listed_route_is_one_of_vllms(vllm_routes):
    assert not CONTROL_ROUTES - vllm_routes
    assert not SERVING_ROUTES - vllm_routes
