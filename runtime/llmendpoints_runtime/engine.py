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
import functools
import logging
import os
import threading
import time
import types
import uuid
from argparse import Namespace
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from llmendpoints_runtime.download import download_model, is_local_model, missing_local_model
from llmendpoints_runtime.health import EngineState, Health
from llmendpoints_runtime.media_fetch import MediaFetchError, MediaFetchLimits
from llmendpoints_runtime.metrics import PHASES, RuntimeMetrics
from llmendpoints_runtime.proctree import become_subreaper, terminate_descendants

logger = logging.getLogger("llmendpoints.engine")

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


# ---------------------------------------------------------------------------------------------
# event-loop fairness
# ---------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------
# media fetching: vLLM's media connector, with every URL fetch through media_fetch.MediaFetcher
# ---------------------------------------------------------------------------------------------


def install_media_fetcher(fetcher) -> None:
    """Make vLLM fetch media URLs (images in chat messages) only through `fetcher`.

    vLLM resolves its media connector by name from a registry on every request
    (``VLLM_MEDIA_CONNECTOR``, default ``http``); the class registered here under that default
    name keeps vLLM's own handling of data: and file: URLs, ALLOWED_MEDIA_DOMAINS and the
    media cache, and replaces the HTTP client with the guarded fetcher. Refusals become vLLM's
    validation error (a 400 naming ``image_url``); so do the cases vLLM itself answers with
    422 (a 4xx from the image host), 500 (file: without ALLOWED_LOCAL_MEDIA_PATH) or 501
    (a data: URL that is not base64).
    """
    from vllm import envs
    from vllm.connections import HTTPConnection
    from vllm.exceptions import VLLMValidationError
    from vllm.multimodal.media import MEDIA_CONNECTOR_REGISTRY, MediaConnector

    def refused(message: str) -> VLLMValidationError:
        return VLLMValidationError(message, parameter="image_url")

    def limits(timeout, allow_redirects: bool, max_bytes: int | None) -> MediaFetchLimits:
        download_cap = envs.VLLM_MAX_MEDIA_DOWNLOAD_SIZE_MB * 1024 * 1024
        caps = [c for c in (max_bytes, download_cap if download_cap > 0 else None) if c]
        return MediaFetchLimits(
            timeout=timeout,
            attempts=max(1, envs.VLLM_MEDIA_FETCH_MAX_RETRIES),
            max_bytes=min(caps) if caps else None,
            follow_redirects=bool(allow_redirects),
        )

    class GuardedConnection(HTTPConnection):
        async def async_get_bytes(self, url, *, timeout=None, allow_redirects=True, max_bytes=None):
            try:
                return await fetcher.fetch(url, limits(timeout, allow_redirects, max_bytes))
            except MediaFetchError as exc:
                raise refused(str(exc)) from None

        def get_bytes(self, url, *, timeout=None, allow_redirects=True, max_bytes=None):
            try:
                return fetcher.fetch_blocking(url, limits(timeout, allow_redirects, max_bytes))
            except MediaFetchError as exc:
                raise refused(str(exc)) from None

        # Every other way of using this connection would bypass the guard.
        def get_response(self, url, **_):
            raise refused(f"media connector: unguarded fetch of {url!r} refused")

        async def get_async_response(self, url, **_):
            raise refused(f"media connector: unguarded fetch of {url!r} refused")

    class GuardedMediaConnector(MediaConnector):
        def __init__(self, *args, **kwargs):
            kwargs["connection"] = GuardedConnection()
            super().__init__(*args, **kwargs)

        def _load_data_url(self, url, media_io):
            spec, comma, _ = url[5:].partition(",")
            if not comma or spec.rpartition(";")[2] != "base64":
                raise refused("data: URLs must be base64 (data:<type>;base64,<data>)")
            return super()._load_data_url(url, media_io)

        def _load_file_url(self, url_spec, media_io):
            if self.allowed_local_media_path is None:
                raise refused(
                    "file: URLs are refused: this server reads no local files "
                    "(ALLOWED_LOCAL_MEDIA_PATH is not set)"
                )
            return super()._load_file_url(url_spec, media_io)

    MEDIA_CONNECTOR_REGISTRY.register("http")(GuardedMediaConnector)
    chosen = os.environ.get("VLLM_MEDIA_CONNECTOR", "http")
    if chosen != "http":
        logger.warning(
            "VLLM_MEDIA_CONNECTOR=%s: media URLs are fetched by that connector, outside the "
            "runtime's destination guard",
            chosen,
        )


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
        if problem := missing_local_model(model):
            raise FileNotFoundError(problem)
        if is_local_model(model):
            logger.info("model %s is a local directory; nothing to download", model)
            return
        await _in_daemon_thread(
            functools.partial(
                download_model,
                model,
                revision=revision,
                tokenizer=self.args.tokenizer,
                tokenizer_revision=self.args.tokenizer_revision,
                trust_remote_code=bool(self.args.trust_remote_code),
                log_interval=self.progress_interval,
            )
        )

    async def _load(self) -> None:
        ticker = asyncio.create_task(self._log_while("load"))
        self._spawning = True
        # Workers orphaned by a dying engine core stay ours, so shutdown still finds them.
        become_subreaper()
        try:
            self.client = await _in_daemon_thread(self._build_client)
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
        client = AsyncLLM.from_vllm_config(
            vllm_config=vllm_config,
            usage_context=UsageContext.OPENAI_API_SERVER,
            enable_log_requests=engine_args.enable_log_requests,
            aggregate_engine_logging=engine_args.aggregate_engine_logging,
            disable_log_stats=engine_args.disable_log_stats,
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
        """True once vLLM reports its engine core gone (it cannot come back in this process).

        vLLM's own monitor thread sees an engine-core process exit at once (it waits on the
        processes' sentinels) and marks the client errored; so does a crash of its output
        handler. Cheap: an attribute read, polled by the engine watcher."""
        client = self.client
        return client is not None and bool(getattr(client, "errored", False))

    def death_reason(self) -> str:
        """What vLLM knows about the engine core's end, for logs and 503 bodies."""
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
        except _client_errors() as exc:  # pydantic's ValidationError is a ValueError too
            field = "messages" if messages is not None else "prompt"
            raise EngineInputError(_clean(exc), field) from None
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
        except _client_errors() as exc:
            raise EngineInputError(_clean(exc)) from None
        except Exception as exc:
            from vllm.v1.engine.exceptions import EngineDeadError

            if isinstance(exc, EngineDeadError):
                raise EngineDead(_clean(exc)) from None
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


# ---------------------------------------------------------------------------------------------
# requests in vLLM's terms (job_engine.JobEngineAdapter puts the job API's words on them)
# ---------------------------------------------------------------------------------------------


class EngineInputError(ValueError):
    """vLLM refused a request's input: the client's mistake (a 400), not a server fault.

    ``parameter`` is the request parameter vLLM blames, when it names one.
    """

    def __init__(self, message: str, parameter: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.parameter = parameter


class EngineDead(RuntimeError):
    """vLLM's engine core is gone; nothing more runs in this process."""


# SamplingParams fields that are engine plumbing, not sampling choices a client may set.
_INTERNAL_SAMPLING_FIELDS = frozenset(
    {
        "output_kind",
        "skip_clone",
        "output_text_buffer_length",
        "routed_experts_prompt_start",
        "trace_decode_token_ids",
        "detokenize",
        "stream_interval",
    }
)


@functools.cache
def sampling_param_names() -> frozenset[str]:
    """The SamplingParams fields a client may set."""
    from vllm.sampling_params import SamplingParams

    return frozenset(
        f
        for f in SamplingParams.__struct_fields__
        if not f.startswith("_") and f not in _INTERNAL_SAMPLING_FIELDS
    )


def build_sampling_params(params: Mapping[str, Any], *, final_only: bool | None = None) -> Any:
    """vLLM's SamplingParams from a dict of public fields; EngineInputError naming the one vLLM
    refuses. ``final_only``: one output at the end (True) or one per step (False)."""
    import msgspec
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    try:
        sampling = msgspec.convert(dict(params), SamplingParams)
    except msgspec.ValidationError as exc:
        text = str(exc)
        name = text.rsplit("`$.", 1)[-1].split("`")[0].split(".")[0] if "`$." in text else None
        raise EngineInputError(text.split(" - at ")[0], name or None) from None
    except _client_errors() as exc:
        raise EngineInputError(_clean(exc), getattr(exc, "parameter", None)) from None
    if final_only is not None:
        sampling.output_kind = (
            RequestOutputKind.FINAL_ONLY if final_only else RequestOutputKind.DELTA
        )
    return sampling


def validate_openai_request(route: str, body: Mapping[str, Any]) -> None:
    """Check ``body`` against vLLM's request model for ``route`` (routes without one pass).

    pydantic's ValidationError for a wrong shape; EngineInputError for values pydantic lets
    through but SamplingParams refuses (``max_tokens: -1``, ``top_p: 5``), which the route
    itself would only refuse when called.
    """
    import pydantic

    model = _openai_request_models().get(route)
    if model is None:
        return
    parsed = pydantic.TypeAdapter(model).validate_python(body)
    to_sampling_params = getattr(parsed, "to_sampling_params", None)
    if to_sampling_params is None or getattr(parsed, "use_beam_search", False):
        return
    max_tokens = getattr(parsed, "max_completion_tokens", None)
    if max_tokens is None:
        max_tokens = getattr(parsed, "max_tokens", None)
    try:
        to_sampling_params(16 if max_tokens is None else max_tokens, {})
    except _client_errors() as exc:
        raise EngineInputError(_clean(exc), getattr(exc, "parameter", None)) from None
    except Exception:  # anything else is left to the route itself
        return


# ---------------------------------------------------------------------------------------------
# LoRA adapters at run time (llmendpoints_runtime.adapters.AdapterEngine) -- owned by adapters/
# ---------------------------------------------------------------------------------------------


class AdapterLoadError(Exception):
    """vLLM refused to load an adapter (bad files, rank above MAX_LORA_RANK, LoRA disabled...)."""


class EngineAdapters:
    """vLLM's own in-process LoRA loading: the methods behind /v1/load_lora_adapter and
    /v1/unload_lora_adapter (``OpenAIServingModels``), without the HTTP routes or
    VLLM_ALLOW_RUNTIME_LORA_UPDATING. Loaded adapters appear in vLLM's /v1/models with their
    base model as ``parent``, and ``model: <adapter>`` selects them on every OpenAI route."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def _models(self):
        app = self.engine.asgi_app
        return getattr(app.state, "openai_serving_models", None) if app is not None else None

    def lora_enabled(self) -> bool:
        return bool(getattr(self.engine.args, "enable_lora", False))

    def loaded(self) -> frozenset[str]:
        models = self._models()
        return frozenset(getattr(models, "lora_requests", None) or ())

    async def load(self, name: str, path: str, *, replace: bool) -> None:
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse
        from vllm.entrypoints.serve.lora.protocol import LoadLoRAAdapterRequest

        if not self.lora_enabled():
            raise AdapterLoadError("the engine was started without ENABLE_LORA")
        models = self._models()
        if models is None:
            raise AdapterLoadError("the engine is not ready")
        request = LoadLoRAAdapterRequest(lora_name=name, lora_path=path, load_inplace=replace)
        try:
            result = await models.load_lora_adapter(request)
        except Exception as exc:  # vLLM raises for some checks instead of answering
            raise AdapterLoadError(_clean(exc)) from None
        if isinstance(result, ErrorResponse):
            raise AdapterLoadError(result.error.message)

    async def unload(self, name: str) -> None:
        from vllm.entrypoints.serve.lora.protocol import UnloadLoRAAdapterRequest

        models = self._models()
        if models is None or name not in models.lora_requests:
            return
        lora_id = models.lora_requests[name].lora_int_id
        await models.unload_lora_adapter(UnloadLoRAAdapterRequest(lora_name=name))
        # vLLM's unload only forgets the name; free the engine's copy of the weights as well.
        with contextlib.suppress(Exception):
            await self.engine.client.remove_lora(lora_id)

    def lora_request(self, name: str):
        """The loaded adapter's LoRARequest (for generation straight on the engine), or None."""
        models = self._models()
        return (getattr(models, "lora_requests", None) or {}).get(name)


def _openai_request_models() -> dict[str, Any]:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.pooling.embed.protocol import EmbeddingRequest

    return {
        "/v1/chat/completions": ChatCompletionRequest,
        "/v1/completions": CompletionRequest,
        "/v1/embeddings": EmbeddingRequest,
    }


def _client_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean "the request is wrong" (a 400), not "the server broke"."""
    from vllm.exceptions import VLLMClientError

    return (ValueError, TypeError, VLLMClientError)


def _clean(exc: BaseException) -> str:
    return str(exc).strip() or type(exc).__name__


def _describe_failure(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    # vLLM wraps engine-core start-up failures; the useful line is the cause.
    cause = exc.__cause__ or exc.__context__
    if cause is not None and str(cause).strip() and str(cause).strip() not in text:
        text = f"{text} (cause: {str(cause).strip()})"
    return f"{type(exc).__name__}: {text}" if not text.startswith(type(exc).__name__) else text


__all__ = [
    "AdapterLoadError",
    "Engine",
    "EngineAdapters",
    "EngineArgsError",
    "EngineDead",
    "EngineInputError",
    "EngineState",
    "build_arg_parser",
    "install_media_fetcher",
    "parse_engine_args",
]
