"""The only module that imports vLLM.

It owns three things: vLLM's argument parser (so configuration is validated by vLLM itself), the
engine's lifecycle (download -> load -> warm-up -> ready, in the background while HTTP already
answers), and vLLM's own OpenAI FastAPI application, built in-process once the engine is ready.
Everything else in the runtime talks to the narrow `Engine` interface below.

vLLM internals used here (kept in one place so a vLLM upgrade touches one file):
``vllm.entrypoints.launchers.cli_args.make_arg_parser``, ``validate_parsed_serve_args``,
``vllm.entrypoints.launchers.app.build_app``, ``...api_server.app_state.init_app_state``,
``...utils.server_utils.lifespan``, ``vllm.v1.engine.async_llm.AsyncLLM``,
``vllm.v1.metrics.prometheus.get_prometheus_registry``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from argparse import Namespace
from collections.abc import Callable
from typing import Any

from llmendpoints_runtime.download import download_model, is_local_model
from llmendpoints_runtime.health import EngineState, Health
from llmendpoints_runtime.metrics import PHASES, RuntimeMetrics

logger = logging.getLogger("llmendpoints.engine")

VLLM_VERSION = "0.32.0"


# ---------------------------------------------------------------------------------------------
# argument parsing
# ---------------------------------------------------------------------------------------------


class EngineArgsError(Exception):
    """vLLM's parser or its serve-argument checks rejected the arguments."""


def build_arg_parser():
    """vLLM's own `vllm serve` parser, raising EngineArgsError instead of exiting."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    class _RaisingParser(FlexibleArgumentParser):
        def error(self, message: str):  # argparse would print usage and exit(2)
            raise EngineArgsError(message)

    return make_arg_parser(_RaisingParser(prog="llmendpoints-runtime", add_help=True))


def parse_engine_args(parser, argv: list[str]) -> Namespace:
    from vllm.entrypoints.launchers.cli_args import validate_parsed_serve_args

    namespace = parser.parse_args(argv)
    try:
        validate_parsed_serve_args(namespace)
    except (TypeError, ValueError) as exc:
        raise EngineArgsError(str(exc).removeprefix("Error: ")) from None
    return namespace


def installed_vllm_version() -> str:
    import vllm

    return vllm.__version__


# ---------------------------------------------------------------------------------------------
# the engine
# ---------------------------------------------------------------------------------------------


class Engine:
    """vLLM's engine and OpenAI app, started in the background.

    `asgi_app` is None until the engine is ready; callers check `health` first.
    """

    def __init__(
        self,
        args: Namespace,
        health: Health,
        metrics: RuntimeMetrics,
        *,
        progress_interval: float = 10.0,
    ):
        self.args = args
        self.health = health
        self.metrics = metrics
        self.progress_interval = progress_interval
        self.asgi_app: Any = None
        self.client: Any = None  # vllm.engine.protocol.EngineClient
        self.max_num_seqs: int | None = None
        self._lifespan: contextlib.AbstractAsyncContextManager | None = None
        self._client_cm: contextlib.AbstractAsyncContextManager | None = None
        self._waiting_gauge: Any = None

    # -- start-up --------------------------------------------------------------------------------

    async def start(self) -> None:
        """Download, load, warm up; never raises: failures land in `health`."""
        started = time.monotonic()
        try:
            await self._phase("download", self._download)
            await self._phase("load", self._load)
            await self._phase("warmup", self._warmup)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            reason = _describe_failure(exc)
            logger.error("engine failed to start: %s", reason, exc_info=exc)
            self.health.engine_failed(reason)
            return
        total = time.monotonic() - started
        self.metrics.observe_phase("ready", total)
        self.health.engine_ready()
        logger.info("engine ready after %.1f s; serving %s", total, self.served_model_names())

    async def _phase(self, name: str, step: Callable[[], Any]) -> None:
        assert name in PHASES
        self.health.set_phase(name)
        begin = time.monotonic()
        logger.info("start-up phase %s: begin", name)
        await step()
        elapsed = time.monotonic() - begin
        self.metrics.observe_phase(name, elapsed)
        logger.info("start-up phase %s: done in %.1f s", name, elapsed)

    async def _download(self) -> None:
        model, revision = self.args.model, self.args.revision
        if is_local_model(model):
            logger.info("model %s is a local directory; nothing to download", model)
            return
        await asyncio.to_thread(
            download_model,
            model,
            revision=revision,
            tokenizer=self.args.tokenizer,
            tokenizer_revision=self.args.tokenizer_revision,
            trust_remote_code=bool(self.args.trust_remote_code),
            log_interval=self.progress_interval,
        )

    async def _load(self) -> None:
        ticker = asyncio.create_task(self._log_while("load"))
        try:
            self.client = await asyncio.to_thread(self._build_client)
            await self._build_app()
        finally:
            ticker.cancel()

    async def _log_while(self, phase: str) -> None:
        begin = time.monotonic()
        while True:
            await asyncio.sleep(self.progress_interval)
            logger.info(
                "start-up phase %s: still running after %.0f s", phase, time.monotonic() - begin
            )

    def _build_client(self):
        """Create vLLM's AsyncLLM (blocks while the engine core loads weights and profiles)."""
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM

        engine_args = AsyncEngineArgs.from_cli_args(self.args)
        vllm_config = engine_args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
        self.max_num_seqs = vllm_config.scheduler_config.max_num_seqs
        return AsyncLLM.from_vllm_config(
            vllm_config=vllm_config,
            usage_context=UsageContext.OPENAI_API_SERVER,
            enable_log_requests=engine_args.enable_log_requests,
            aggregate_engine_logging=engine_args.aggregate_engine_logging,
            disable_log_stats=engine_args.disable_log_stats,
        )

    async def _build_app(self) -> None:
        from vllm.entrypoints.launchers.api_server.app_state import init_app_state
        from vllm.entrypoints.launchers.app import build_app
        from vllm.entrypoints.launchers.utils.server_utils import lifespan

        await self.client.reset_mm_cache()
        supported_tasks = await self.client.get_supported_tasks()
        logger.info("supported tasks: %s", ", ".join(supported_tasks))
        app = build_app(self.args, supported_tasks, self.client.model_config)
        await init_app_state(self.client, app.state, self.args, supported_tasks)
        # A mounted app's lifespan is not run by the outer server; enter it here (it starts
        # vLLM's periodic stats logging).
        self._lifespan = lifespan(app)
        await self._lifespan.__aenter__()
        self.asgi_app = app
        self.supported_tasks = tuple(supported_tasks)

    async def _warmup(self) -> None:
        """One token through the whole engine, so the first user request is not the first ever."""
        if "generate" not in self.supported_tasks:
            return
        from vllm import SamplingParams

        request_id = f"warmup-{uuid.uuid4().hex}"
        params = SamplingParams(max_tokens=1, temperature=0.0)
        async for _ in self.client.generate("Hello", params, request_id):
            pass

    # -- serving --------------------------------------------------------------------------------

    def served_model_names(self) -> list[str]:
        names = self.args.served_model_name
        return list(names) if names else [self.args.model]

    def requests_waiting(self) -> int:
        """Requests vLLM's scheduler holds but does not run yet (from vLLM's own gauge)."""
        gauge = self._waiting_gauge
        if gauge is None:
            from vllm.v1.metrics.prometheus import get_prometheus_registry

            registry = get_prometheus_registry()
            gauge = registry._names_to_collectors.get("vllm:num_requests_waiting")
            if gauge is None:
                return 0
            self._waiting_gauge = gauge
        total = 0.0
        for metric in gauge.collect():
            for sample in metric.samples:
                total += sample.value
        return int(total)

    @staticmethod
    def prometheus_registry():
        from vllm.v1.metrics.prometheus import get_prometheus_registry

        return get_prometheus_registry()

    def dead(self) -> bool:
        """True once vLLM reports its engine core gone (it cannot come back in this process)."""
        client = self.client
        return client is not None and bool(getattr(client, "errored", False))

    async def abort(self, request_id: str) -> None:
        if self.client is not None:
            await self.client.abort(request_id)

    async def shutdown(self) -> None:
        if self._lifespan is not None:
            with contextlib.suppress(Exception):
                await self._lifespan.__aexit__(None, None, None)
            self._lifespan = None
        if self.client is not None:
            client, self.client = self.client, None
            await asyncio.to_thread(client.shutdown)
        self.health.engine_stopped()


def _describe_failure(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    # vLLM wraps engine-core start-up failures; the useful line is the cause.
    cause = exc.__cause__ or exc.__context__
    if cause is not None and str(cause).strip() and str(cause).strip() not in text:
        text = f"{text} (cause: {str(cause).strip()})"
    return f"{type(exc).__name__}: {text}" if not text.startswith(type(exc).__name__) else text


__all__ = [
    "VLLM_VERSION",
    "Engine",
    "EngineArgsError",
    "EngineState",
    "build_arg_parser",
    "installed_vllm_version",
    "parse_engine_args",
]
