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
            # On the loop's own thread: AsyncLLM.shutdown() cancels its output-handler task,
            # which is only safe from the thread running that task's loop.
            client.shutdown()
        self.health.engine_stopped()


# ---------------------------------------------------------------------------------------------
# the job API's engine port (llmendpoints_runtime.jobs.port.JobEngine) -- owned by the job API
# ---------------------------------------------------------------------------------------------

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
# Names from older worker-vllm/vLLM docs that vLLM 0.32 no longer has, with what to do instead.
_RETIRED_SAMPLING_FIELDS = {
    "best_of": "vLLM 0.32 removed best_of; use n",
    "use_beam_search": "beam search is not a sampling parameter in vLLM 0.32; send the request "
    "through openai_route /v1/completions with use_beam_search",
    "length_penalty": "beam search only; send the request through openai_route",
    "early_stopping": "beam search only; send the request through openai_route",
}


class JobEngineAdapter:
    """`Engine` seen through the job API's narrow port.

    Prompt/messages jobs are rendered by vLLM's own completion/chat preprocessing (chat
    template, CUSTOM_CHAT_TEMPLATE, tokenisation, length checks) and then generated straight on
    the engine client with DELTA outputs -- the same engine work as /v1/completions without the
    OpenAI response formatting.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def is_ready(self) -> bool:
        return self.engine.health.state is EngineState.READY and self.engine.asgi_app is not None

    def draining(self) -> bool:
        return self.engine.health.draining

    async def wait_ready(self) -> None:
        from llmendpoints_runtime.jobs.errors import EngineUnavailable

        while not self.is_ready():
            if self.engine.health.state in (EngineState.FAILED, EngineState.STOPPED):
                raise EngineUnavailable(
                    f"the engine is not available: {self.engine.health.reason or 'stopped'}"
                )
            await asyncio.sleep(0.05)

    # -- input checks ------------------------------------------------------------------------

    def sampling_params(self, params: Any, **overrides: Any):
        """vLLM's SamplingParams from a job's dict; InvalidRequest naming the bad field."""
        import msgspec
        from vllm.sampling_params import SamplingParams

        from llmendpoints_runtime.jobs.errors import InvalidRequest

        def bad(name: str, message: str) -> InvalidRequest:
            field = f"input.sampling_params.{name}" if name else "input.sampling_params"
            return InvalidRequest(f"{field}: {message}", param=field)

        allowed = _public_sampling_fields()
        for name in params:
            if name in _RETIRED_SAMPLING_FIELDS:
                raise bad(name, _RETIRED_SAMPLING_FIELDS[name])
            if name not in allowed:
                raise bad(name, "not a vLLM sampling parameter (see vllm.SamplingParams)")
        try:
            sampling = msgspec.convert(dict(params), SamplingParams)
        except msgspec.ValidationError as exc:
            text = str(exc)
            name = text.rsplit("`$.", 1)[-1].split("`")[0].split(".")[0] if "`$." in text else ""
            raise bad(name, text.split(" - at ")[0]) from None
        except _client_errors() as exc:
            raise bad(getattr(exc, "parameter", None) or "", _clean(exc)) from None
        for name, value in overrides.items():  # engine plumbing, set after validation
            setattr(sampling, name, value)
        return sampling

    def check_sampling_params(self, params: Any) -> None:
        self.sampling_params(params)

    def check_openai_input(self, route: str, body: Any) -> None:
        import pydantic

        from llmendpoints_runtime.jobs.errors import InvalidRequest
        from llmendpoints_runtime.jobs.models import describe_validation_error

        model = _openai_request_models().get(route)
        if model is None or body is None:
            return
        try:
            parsed = pydantic.TypeAdapter(model).validate_python(body)
        except pydantic.ValidationError as exc:
            message, field = describe_validation_error(exc, prefix="input.openai_input")
            raise InvalidRequest(message, param=field) from None
        # Values pydantic lets through but SamplingParams refuses (max_tokens: -1, top_p: 5):
        # the route would refuse them when the job runs; refuse them now, with a 400.
        to_sampling_params = getattr(parsed, "to_sampling_params", None)
        if to_sampling_params is None or getattr(parsed, "use_beam_search", False):
            return
        max_tokens = getattr(parsed, "max_completion_tokens", None)
        if max_tokens is None:
            max_tokens = getattr(parsed, "max_tokens", None)
        try:
            to_sampling_params(16 if max_tokens is None else max_tokens, {})
        except _client_errors() as exc:
            name = getattr(exc, "parameter", None)
            field = f"input.openai_input.{name}" if name else "input.openai_input"
            raise InvalidRequest(f"{field}: {_clean(exc)}", param=field) from None
        except Exception:  # anything else is left to the route itself
            return

    def n_choices(self, params: Any) -> int:
        n = params.get("n", 1)
        return n if isinstance(n, int) and n > 0 else 1

    # -- generation --------------------------------------------------------------------------

    async def generate(self, request):  # -> AsyncIterator[GenerationStep]
        from vllm.sampling_params import RequestOutputKind

        from llmendpoints_runtime.jobs.errors import EngineUnavailable, InvalidRequest, JobFailed
        from llmendpoints_runtime.jobs.port import ChoiceDelta, GenerationStep

        engine_input = await self._render(request)
        prompt_len = _prompt_len(engine_input)
        params = dict(self._model_defaults())
        params.update(request.sampling_params)
        if "max_tokens" not in request.sampling_params:
            room = self.engine.client.model_config.max_model_len - prompt_len
            params["max_tokens"] = max(1, min(request.default_max_tokens, room))
        # Non-streamed jobs take only the final output, as /v1/completions does: no per-token
        # outputs to detokenise-and-hand-over for text nobody reads before the end.
        kind = RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY
        sampling = self.sampling_params(params, output_kind=kind)
        try:
            async for output in self.engine.client.generate(
                engine_input, sampling, request.request_id
            ):
                yield GenerationStep(
                    prompt_tokens=len(output.prompt_token_ids or ()) or prompt_len,
                    choices=tuple(
                        ChoiceDelta(o.index, o.text, len(o.token_ids)) for o in output.outputs
                    ),
                )
        except _client_errors() as exc:  # prompt too long, max_tokens beyond the context...
            raise InvalidRequest(_clean(exc)) from None
        except Exception as exc:
            from vllm.v1.engine.exceptions import EngineDeadError

            if isinstance(exc, EngineDeadError):
                raise EngineUnavailable(f"the engine died: {_clean(exc)}") from None
            cause = exc.__cause__ or exc
            raise JobFailed(
                f"generation failed: {type(cause).__name__}: {_clean(cause)}",
                error_type="InternalServerError",
            ) from exc

    async def _render(self, request):
        """vLLM's own preprocessing: chat template or plain prompt -> engine input."""
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse

        from llmendpoints_runtime.jobs.errors import InvalidRequest

        state = self.engine.asgi_app.state
        messages = request.messages
        if messages is None and request.apply_chat_template:
            messages = [{"role": "user", "content": request.prompt}]
        try:
            if messages is not None:
                rendered = await state.openai_serving_chat.render_chat_request(
                    ChatCompletionRequest(messages=messages)
                )
                engine_inputs = rendered if isinstance(rendered, ErrorResponse) else rendered[1]
            else:
                engine_inputs = await state.openai_serving_completion.render_completion_request(
                    CompletionRequest(prompt=request.prompt)
                )
        except _client_errors() as exc:  # pydantic's ValidationError is a ValueError too
            raise InvalidRequest(f"input.messages: {_clean(exc)}", param="input.messages") from None
        if isinstance(engine_inputs, ErrorResponse):
            raise InvalidRequest(engine_inputs.error.message, param=engine_inputs.error.param)
        return engine_inputs[0]

    def _model_defaults(self) -> dict[str, Any]:
        """The model's generation_config defaults, as /v1/completions applies them."""
        serving = self.engine.asgi_app.state.openai_serving_completion
        return dict(getattr(serving, "default_sampling_params", None) or {})

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)

    def load(self):
        from llmendpoints_runtime.jobs.port import EngineLoad

        client = self.engine.client
        if client is None or self.engine.asgi_app is None:
            return EngineLoad(running=0, waiting=0)
        waiting = self.engine.requests_waiting()
        return EngineLoad(
            running=max(0, client.get_num_unfinished_requests() - waiting), waiting=waiting
        )

    def openai_app(self):
        return self.engine.asgi_app

    def served_models(self):
        from llmendpoints_runtime.jobs.port import ServedModels

        models = getattr(self.engine.asgi_app.state, "openai_serving_models", None)
        adapters = tuple(getattr(models, "lora_requests", {}) or {})
        return ServedModels(
            base=tuple(self.engine.served_model_names()),
            adapters=adapters,
            multimodal=bool(self.engine.client.model_config.is_multimodal_model),
            tasks=tuple(getattr(self.engine, "supported_tasks", ()) or ()),
        )


def _openai_request_models() -> dict[str, Any]:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.pooling.embed.protocol import EmbeddingRequest

    return {
        "/v1/chat/completions": ChatCompletionRequest,
        "/v1/completions": CompletionRequest,
        "/v1/embeddings": EmbeddingRequest,
    }


@functools.cache
def _public_sampling_fields() -> frozenset[str]:
    from vllm.sampling_params import SamplingParams

    return frozenset(
        f
        for f in SamplingParams.__struct_fields__
        if not f.startswith("_") and f not in _INTERNAL_SAMPLING_FIELDS
    )


def _client_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean "the request is wrong" (a 400), not "the server broke"."""
    from vllm.exceptions import VLLMClientError

    return (ValueError, TypeError, VLLMClientError)


def _prompt_len(engine_input: Any) -> int:
    ids = engine_input.get("prompt_token_ids") if isinstance(engine_input, dict) else None
    return len(ids) if ids is not None else 0


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
    "VLLM_VERSION",
    "Engine",
    "EngineArgsError",
    "EngineState",
    "JobEngineAdapter",
    "build_arg_parser",
    "installed_vllm_version",
    "parse_engine_args",
]
