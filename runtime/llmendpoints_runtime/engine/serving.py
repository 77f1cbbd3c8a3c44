"""vLLM's engine and its OpenAI application, in this process.

The engine's lifecycle (download -> load -> warm-up -> ready, in the background while HTTP
already answers), vLLM's own OpenAI FastAPI application built in-process once the engine is
ready, and the requests the job API runs straight on the engine client. Everything else in the
runtime talks to the narrow ``Engine`` interface below.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
import time
import types
import uuid
from argparse import Namespace
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from llmendpoints_runtime.download import download_model, is_local_model, missing_local_model
from llmendpoints_runtime.engine.requests import (
    EngineDead,
    EngineInputError,
    clean_message,
    client_errors,
)
from llmendpoints_runtime.health import Health
from llmendpoints_runtime.metrics import PHASES, RuntimeMetrics
from llmendpoints_runtime.proctree import become_subreaper, terminate_descendants

logger = logging.getLogger("llmendpoints.engine")


def yield_between_engine_steps(engine_core) -> None:
    """Let the event loop run other tasks after each engine step's outputs are taken.

    AsyncLLM's output handler awaits ``engine_core.get_output_async()``, an asyncio.Queue that
    another task fills from the engine core's socket, draining every message waiting there
    without suspending. Awaiting a non-empty queue does not suspend either, so whenever the
    engine core is ahead of this process (a small model, many sequences: this process
    detokenises every step of every sequence) the handler works through the whole backlog in
    one turn of the loop, and the next drain brings the next backlog: probes, /metrics, /status,
    new requests and client disconnects wait for the generation to end. Measured on the demo
    model with a 16 x 2,000-token job: /status went unanswered for the 4 s the job ran. One
    ``sleep(0)`` per engine step bounds a turn to one step's outputs.
    """
    take_outputs = engine_core.get_output_async

    async def get_output_async_then_yield():
        outputs = await take_outputs()
        await asyncio.sleep(0)
        return outputs

    # The handler looks the method up on the instance on every step, so this takes effect
    # whether or not it has started.
    engine_core.get_output_async = get_output_async_then_yield


@dataclass(frozen=True)
class EngineLink:
    """How an API process of a pod with several (API_SERVER_COUNT) reaches the pod's engine,
    which its supervisor launched: vLLM's ``client_config`` for this process (the ZMQ
    listeners it adopts, the engines' addresses), its index and the count."""

    client_config: dict[str, Any]
    index: int
    count: int


class Engine:
    """vLLM's engine and OpenAI app, started in the background.

    `asgi_app` is None until the engine is ready; callers check `health` first. Without a
    ``link`` this process starts the engine (its core and workers are its children); with one
    it is one of the pod's API processes, a client of the engine its supervisor started (the
    model is downloaded by then).
    """

    def __init__(
        self,
        args: Namespace,
        health: Health,
        metrics: RuntimeMetrics,
        *,
        progress_interval: float = 10.0,
        link: EngineLink | None = None,
    ):
        self.args = args
        self.health = health
        self.metrics = metrics
        self.progress_interval = progress_interval
        self.link = link
        # Why the engine cannot serve any more, when something outside vLLM's view says so
        # (the group lost a node; the pod's supervisor saw the engine die): declare_dead.
        self._death: str | None = None
        self._died = threading.Event()
        self.asgi_app: Any = None
        self.client: Any = None  # vllm.engine.protocol.EngineClient
        self.max_num_seqs: int | None = None
        self.supported_tasks: tuple[str, ...] = ()  # "generate", "embed"... once loaded
        self._lifespan: contextlib.AbstractAsyncContextManager | None = None
        self._client_cm: contextlib.AbstractAsyncContextManager | None = None
        self._waiting_gauge: Any = None
        # Set when the load begins: from then on this process has engine children to stop.
        self._spawning = False

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
            reason = describe_failure(exc)
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
        if self.link is not None:
            return  # the pod's supervisor downloaded it before it started the engine
        await _in_daemon_thread(
            functools.partial(download_weights, self.args, self.progress_interval)
        )

    async def _load(self) -> None:
        ticker = asyncio.create_task(self._log_while("load"))
        self._spawning = True
        # Workers orphaned by a dying engine core stay ours, so shutdown still finds them.
        become_subreaper()
        try:
            self.client = await self._unless_dead(_in_daemon_thread(self._build_client))
            await self._build_app()
        finally:
            ticker.cancel()

    async def _unless_dead(self, work: Awaitable[Any]) -> Any:
        """``work``'s result, or EngineDead as soon as declare_dead is called (the load may
        wait for ever on a group member that is gone; shutdown stops what it left)."""
        task = asyncio.ensure_future(work)
        while not task.done():
            if self._died.is_set():
                task.cancel()
                raise EngineDead(self._death or "the engine died")
            await asyncio.wait({task}, timeout=_DEATH_POLL_SECONDS)
        return task.result()

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
        link = self.link
        if link is not None:  # as vLLM's own API server processes do
            engine_args._api_process_count = link.count
            engine_args._api_process_rank = link.index
        vllm_config = engine_args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
        # Every data-parallel engine batches max_num_seqs: the default admission limit is theirs.
        parallel = vllm_config.parallel_config
        self.max_num_seqs = vllm_config.scheduler_config.max_num_seqs * max(
            1, parallel.data_parallel_size
        )
        client = AsyncLLM.from_vllm_config(
            vllm_config=vllm_config,
            usage_context=UsageContext.OPENAI_API_SERVER,
            enable_log_requests=engine_args.enable_log_requests,
            aggregate_engine_logging=engine_args.aggregate_engine_logging,
            disable_log_stats=engine_args.disable_log_stats,
            client_addresses=dict(link.client_config) if link is not None else None,
            client_count=link.count if link is not None else 1,
            client_index=link.index if link is not None else 0,
        )
        yield_between_engine_steps(client.engine_core)
        return client

    async def _build_app(self) -> None:
        from vllm.entrypoints.launchers.api_server.app_state import init_app_state
        from vllm.entrypoints.launchers.app import build_app
        from vllm.entrypoints.launchers.utils.server_utils import lifespan

        await self.client.reset_mm_cache()
        supported_tasks = await self.client.get_supported_tasks()
        logger.info("supported tasks: %s", ", ".join(supported_tasks))
        with _root_log_level_kept():
            app = build_app(self.args, supported_tasks, self.client.model_config)
        # vLLM's handler for EngineDeadError sets ``app.state.server.should_exit``; its own
        # launcher puts the uvicorn server there. Ours stops the process its own way (the
        # engine watcher in app.py), so vLLM gets a harmless stand-in instead of an
        # AttributeError that would reach the client as a 500.
        app.state.server = types.SimpleNamespace(should_exit=False)
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
        """Requests vLLM's scheduler holds but does not run yet (from vLLM's own gauge, every
        engine). In a pod of several API processes the gauge is the pod's, read from the
        processes' metric files (vLLM's registry is a fresh MultiProcessCollector then)."""
        gauge = self._waiting_gauge
        if gauge is None:
            from vllm.v1.metrics.prometheus import get_prometheus_registry

            registry = get_prometheus_registry()
            if self.link is not None:
                gauge = registry
            else:
                gauge = registry._names_to_collectors.get(_WAITING)
                if gauge is None:
                    return 0
                self._waiting_gauge = gauge
        total = 0.0
        for metric in gauge.collect():
            total += sum(s.value for s in metric.samples if s.name == _WAITING)
        return int(total)

    @staticmethod
    def prometheus_registry():
        from vllm.v1.metrics.prometheus import get_prometheus_registry

        return get_prometheus_registry()

    def dead(self) -> bool:
        """True once the engine is gone (it cannot come back in this process).

        vLLM's own monitor thread sees an engine-core process exit at once (it waits on the
        processes' sentinels) and marks the client errored; so does a crash of its output
        handler; ``declare_dead`` covers what vLLM cannot see. Cheap: attribute reads, polled
        by the engine watcher."""
        if self._death is not None:
            return True
        client = self.client
        return client is not None and bool(getattr(client, "errored", False))

    def declare_dead(self, reason: str) -> None:
        """The engine cannot serve any more, for a reason vLLM does not see (its group lost a
        node; the pod's supervisor saw the engine die). From any thread.

        Requests in flight end with vLLM's EngineDeadError -- the path vLLM takes when its
        engine core process exits: the client is marked dead and shut down, which ends its
        output handler with the error every waiting request then raises. A load in progress
        ends with EngineDead."""
        if self._death is not None:
            return
        self._death = reason
        self._died.set()
        core = getattr(self.client, "engine_core", None)
        if core is None:
            return
        core.resources.engine_dead = True
        # vLLM's own monitor shuts the client down from its thread too; it may wait for the
        # engine core's processes, so not on the caller's.
        threading.Thread(target=core.shutdown, name="llmep-engine-dead", daemon=True).start()

    def death_reason(self) -> str:
        """What is known about the engine's end, for logs and 503 bodies."""
        if self._death is not None:
            return self._death
        manager = getattr(getattr(self.client, "engine_core", None), "resources", None)
        manager = getattr(manager, "engine_manager", None)
        try:
            finished = manager.finished_procs() if manager is not None else {}
        except Exception:
            finished = {}
        if finished:
            procs = ", ".join(f"{name} exit code {code}" for name, code in finished.items())
            return f"the engine core process died ({procs})"
        return "the engine core died"

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
            # On the loop's own thread: AsyncLLM.shutdown() cancels its output-handler task,
            # which is only safe from the thread running that task's loop.
            with contextlib.suppress(Exception):
                client.shutdown()
        # Whatever is still running below us stops now: the engine core and its workers when
        # the model was still loading (no client knows them yet), compile workers, anything
        # vLLM's own shutdown left behind. No orphan outlives the runtime.
        if self._spawning:
            signalled = await asyncio.to_thread(terminate_descendants, _CHILD_STOP_GRACE_SECONDS)
            if signalled:
                logger.info("shutdown: stopped %d engine process(es)", signalled)
        self.health.engine_stopped()

    # -- requests straight on the engine (prompt/messages jobs) --------------------------------

    async def render(self, *, prompt: str | None = None, messages: list[Any] | None = None) -> Any:
        """vLLM's own preprocessing (chat template, tokenisation, length checks) -> the engine
        input of one request; EngineInputError when vLLM refuses it."""
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse

        state = self.asgi_app.state
        try:
            if messages is not None:
                rendered = await state.openai_serving_chat.render_chat_request(
                    ChatCompletionRequest(messages=messages)
                )
                engine_inputs = rendered if isinstance(rendered, ErrorResponse) else rendered[1]
            else:
                engine_inputs = await state.openai_serving_completion.render_completion_request(
                    CompletionRequest(prompt=prompt)
                )
        except client_errors() as exc:  # pydantic's ValidationError is a ValueError too
            field = "messages" if messages is not None else "prompt"
            raise EngineInputError(clean_message(exc), field) from None
        if isinstance(engine_inputs, ErrorResponse):
            raise EngineInputError(engine_inputs.error.message, engine_inputs.error.param)
        return engine_inputs[0]

    async def generate(
        self,
        engine_input: Any,
        sampling: Any,
        request_id: str,
        *,
        lora_request: Any = None,
        priority: int = 0,
    ) -> AsyncIterator[Any]:
        """vLLM's RequestOutputs for one request (on a loaded LoRA adapter's weights when
        ``lora_request`` is one, see ``EngineAdapters.lora_request``; ``priority``: lower runs
        first, with the priority scheduling policy). EngineInputError for input the engine
        refuses (prompt too long, max_tokens beyond the context), EngineDead when its core
        died."""
        try:
            async for output in self.client.generate(
                engine_input, sampling, request_id, lora_request=lora_request, priority=priority
            ):
                yield output
        except client_errors() as exc:
            raise EngineInputError(clean_message(exc)) from None
        except Exception as exc:
            from vllm.v1.engine.exceptions import EngineDeadError

            if isinstance(exc, EngineDeadError):
                raise EngineDead(clean_message(exc)) from None
            raise

    def model_defaults(self) -> dict[str, Any]:
        """The model's generation_config sampling defaults, as /v1/completions applies them."""
        serving = self.asgi_app.state.openai_serving_completion
        return dict(getattr(serving, "default_sampling_params", None) or {})

    @property
    def max_model_len(self) -> int:
        return int(self.client.model_config.max_model_len)

    def is_multimodal(self) -> bool:
        return bool(self.client.model_config.is_multimodal_model)

    def adapter_names(self) -> tuple[str, ...]:
        """The LoRA adapters loaded now (they come and go at run time)."""
        models = getattr(self.asgi_app.state, "openai_serving_models", None)
        return tuple(getattr(models, "lora_requests", {}) or {})

    def unfinished_requests(self) -> int:
        """Requests the engine holds, running or waiting."""
        return self.client.get_num_unfinished_requests() if self.client is not None else 0


def download_weights(args: Namespace, log_interval: float) -> None:
    """The model (and tokenizer) of vLLM's ``args`` into the cache, unless it is a local
    directory (FileNotFoundError when that is missing). Blocks."""
    model = args.model
    if problem := missing_local_model(model):
        raise FileNotFoundError(problem)
    if is_local_model(model):
        logger.info("model %s is a local directory; nothing to download", model)
        return
    download_model(
        model,
        revision=args.revision,
        tokenizer=args.tokenizer,
        tokenizer_revision=args.tokenizer_revision,
        trust_remote_code=bool(args.trust_remote_code),
        log_interval=log_interval,
    )


@contextlib.contextmanager
def _root_log_level_kept():
    """Undo what importing vLLM's SageMaker router does to the root logger's level.

    ``build_app`` imports ``model_hosting_container_standards``, which sets the root logger to
    ERROR (its SAGEMAKER_CONTAINER_LOG_LEVEL / LOG_LEVEL, default ERROR) at import; vLLM puts
    the handlers' levels back (``_restore_handler_levels``) but not the logger's. Every logger
    that inherits the root's level -- other libraries' warnings, asyncio's -- went silent below
    ERROR for the rest of the process (seen: the job API's failed webhook attempts, until our
    own loggers got their level explicitly, logs.OWN_LOGGERS).
    """
    root = logging.getLogger()
    level = root.level
    try:
        yield
    finally:
        if root.level != level:
            root.setLevel(level)


# Between SIGTERM and SIGKILL for the engine's processes at shutdown.
_CHILD_STOP_GRACE_SECONDS = 3.0
_WAITING = "vllm:num_requests_waiting"
# How often a load in progress looks whether the engine was declared dead.
_DEATH_POLL_SECONDS = 0.2


async def _in_daemon_thread(function: Callable[[], Any]) -> Any:
    """``function()`` in a daemon thread of its own, awaited.

    Not asyncio.to_thread: the default executor's threads are joined at interpreter exit, so a
    SIGTERM during a download or a model load would wait for it to finish (minutes) before the
    process could exit. Cancelling the await abandons the thread; shutdown stops the engine
    processes it was waiting for, which ends it.
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def run() -> None:
        try:
            result, error = function(), None
        except BaseException as exc:  # handed to the awaiting task
            result, error = None, exc
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            loop.call_soon_threadsafe(settle, result, error)

    name = getattr(function, "__name__", None) or getattr(function, "func", function).__name__
    threading.Thread(target=run, name=f"llmep-{name}", daemon=True).start()
    return await future


def describe_failure(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    # vLLM wraps engine-core start-up failures; the useful line is the cause.
    cause = exc.__cause__ or exc.__context__
    if cause is not None and str(cause).strip() and str(cause).strip() not in text:
        text = f"{text} (cause: {str(cause).strip()})"
    return f"{type(exc).__name__}: {text}" if not text.startswith(type(exc).__name__) else text
