"""The only package that imports vLLM.

By concern: ``args`` (vLLM's argument parser: configuration is validated by vLLM itself),
``serving`` (the engine's lifecycle and vLLM's OpenAI app, in this process), ``requests``
(sampling parameters, OpenAI request models, the errors a request ends with), ``adapters``
(LoRA loading at run time), ``media`` (vLLM's media connector behind our destination guard).
Everything else in the runtime talks to the narrow interfaces exported here.

vLLM is imported inside the functions that use it, never at a module's top: the runtime's CLI
must set up the environment (HF_HOME, logging) before vLLM is first imported, and the settings'
unit tests and ``--help`` should not pay seconds for it.

vLLM internals used (kept in this package so a vLLM upgrade touches it alone):
``vllm.entrypoints.launchers.cli_args.make_arg_parser``, ``validate_parsed_serve_args``,
``vllm.entrypoints.launchers.app.build_app``, ``...api_server.app_state.init_app_state``,
``...utils.server_utils.lifespan``, ``vllm.v1.engine.async_llm.AsyncLLM``,
``vllm.v1.metrics.prometheus.get_prometheus_registry``, ``vllm.multimodal.media``'s connector
registry.
"""

from llmendpoints_runtime.engine.adapters import AdapterLoadError, EngineAdapters
from llmendpoints_runtime.engine.args import EngineArgsError, build_arg_parser, parse_engine_args
from llmendpoints_runtime.engine.media import install_media_fetcher
from llmendpoints_runtime.engine.requests import (
    EngineDead,
    EngineInputError,
    build_sampling_params,
    sampling_param_names,
    validate_openai_request,
)
from llmendpoints_runtime.engine.serving import Engine, EngineLink

__all__ = [
    "AdapterLoadError",
    "Engine",
    "EngineAdapters",
    "EngineArgsError",
    "EngineDead",
    "EngineInputError",
    "EngineLink",
    "build_arg_parser",
    "build_sampling_params",
    "install_media_fetcher",
    "parse_engine_args",
    "sampling_param_names",
    "validate_openai_request",
]
