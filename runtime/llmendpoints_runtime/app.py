"""create_app(): our routes and middleware in front of vLLM's own OpenAI application.

The HTTP application and the ``Runtime`` record it serves from; which features it carries (the
job API, SageMaker) is decided by the composition root, ``compose.py``, which passes their
routers in and registers their work (``busy_sources``) and their shutdown (``drainers``).

Request path, outermost first: RequestContext (request id, HTTP metrics, in-flight count) ->
API keys (from the headers, before any of the body is read) -> BodyGuard (408 past the read
deadline, 413, non-UTF-8 / non-object / too deep JSON -> 400) -> then `/v1/...` goes straight
to `EngineDelegate`, and everything else to our FastAPI router: probes and /metrics, the job and
SageMaker routers, and a catch-all that falls through to the same delegate. The delegate refuses
vLLM's engine-control routes to all but admin keys (403), waits for an admission slot and hands the
request to vLLM's app, in-process. Until the engine is ready it answers 503 with the start-up
phase; once it died (the engine watcher, below), 503 with the cause.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from fastapi import APIRouter, FastAPI
from fastapi.responses import JSONResponse, Response
from llmendpoints_common.errors import (
    APIError,
    InternalServerError,
    RateLimitError,
    ServiceUnavailableError,
)
from llmendpoints_common.fair_use import (
    SEQUENCE_ROUTES,
    may_ask_for_more_than_one,
    request_sequences,
)
from llmendpoints_edge.asgi import ASGIApp, Receive, Scope, Send, send_error
from llmendpoints_edge.body import read_before
from starlette.routing import Mount

from llmendpoints_runtime.admission import Admission, default_max_concurrency
from llmendpoints_runtime.auth import APIKeyMiddleware, KeyStore, caller_is_admin
from llmendpoints_runtime.config import RuntimeConfig
from llmendpoints_runtime.control_routes import control_denied, is_control_path
from llmendpoints_runtime.engine import Engine
from llmendpoints_runtime.errors import OpenAIShapedErrors, install_exception_handlers
from llmendpoints_runtime.health import EngineState, Health, Probe
from llmendpoints_runtime.metrics import CONTENT_TYPE, RuntimeMetrics
from llmendpoints_runtime.middleware import BodyGuard, RequestContext
from llmendpoints_runtime.openapi import openapi_builder

logger = logging.getLogger("llmendpoints.app")

# POSTs that reach vLLM without taking an admission slot: they never run the model.
_CHEAP_POSTS = frozenset(
    {"/tokenize", "/detokenize", "/v1/load_lora_adapter", "/v1/unload_lora_adapter"}
)


# Finish a feature's work at shutdown, within the seconds given, before the engine stops.
Drainer = Callable[[float], Awaitable[None]]


class PodAnswers(Protocol):
    """The answers of a pod of several API processes (pod.metrics.PodView), which every one
    of them gives in place of its own."""

    def liveness(self) -> Probe: ...

    def readiness(self, strict: bool) -> Probe: ...

    def metrics(self) -> bytes: ...


@dataclass
class Runtime:
    """Everything a request handler may need, kept on `app.state.runtime`."""

    config: RuntimeConfig
    health: Health
    metrics: RuntimeMetrics
    engine: Engine
    admission: Admission
    keys: KeyStore
    context: RequestContext | None = None
    # One of several API processes of a pod (API_SERVER_COUNT > 1): the pod's answers.
    pod: PodAnswers | None = None
    # How much work each feature still has (running jobs, webhooks being delivered...); the
    # SIGTERM drain waits for the sum, with HTTP requests in flight, to reach zero.
    busy_sources: list[Callable[[], int]] = field(default_factory=list)
    # Run by the lifespan's shutdown, in order, before the engine stops.
    drainers: list[Drainer] = field(default_factory=list)
    # Event-loop time by which shutdown should be over (set on SIGTERM by server.py).
    drain_deadline: float | None = None
    # Run once the engine is ready, in order (the LoRA adapter reconciler starts here).
    on_ready: list[Callable[[], None]] = field(default_factory=list)
    # Tasks run on the event loop from the server's start to its end (the control port's
    # publisher), cancelled at shutdown.
    on_serving: list[Callable[[], Awaitable[None]]] = field(default_factory=list)
    # Ends the process as SIGTERM would (the engine watcher calls it when the engine dies).
    request_stop: Callable[[], None] = field(default=lambda: os.kill(os.getpid(), signal.SIGTERM))
    # The port the control port's process listens on (LLMEP_CONTROL_PORT), once it does: named
    # in the main port's probe answers, so a gateway that found this pod by its main port
    # probes and reads it there instead (gateway pod_reader.py).
    control_port: int | None = None

    # -- what the edge's server asks on SIGTERM (llmendpoints_edge.server.Drainable) --

    def start_draining(self) -> None:
        self.health.start_draining()

    def set_drain_deadline(self, deadline: float) -> None:
        self.drain_deadline = deadline  # the lifespan's shutdown keeps to it too

    def busy(self) -> int:
        active = self.context.active if self.context is not None else 0
        return active + sum(source() for source in self.busy_sources)


class EngineDelegate:
    """The fallback ASGI app: vLLM's application once the engine is ready, 503 before.

    vLLM's engine-control routes (control_routes.py) answer 403 to every caller without an
    admin key -- with no admin key configured, to everyone.

    Generation requests take as many admission slots as they run sequences (``n`` x prompts,
    ``llmendpoints_common.fair_use``), after the ``MAX_N`` check, on the body the edge already
    read (``scope[BODY]``: read once, within the limits, replayed to vLLM).
    """

    def __init__(self, runtime: Runtime):
        self.runtime = runtime

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        runtime = self.runtime
        if is_control_path(scope["path"]) and not caller_is_admin(scope):
            admin_keys = bool(runtime.keys.admin_keys)
            await send_error(send, control_denied(scope["path"], admin_keys_configured=admin_keys))
            return
        inner = runtime.engine.asgi_app
        if inner is None or runtime.health.state is not EngineState.READY:
            await send_error(send, _not_ready_error(runtime.health))
            return
        if scope["method"] != "POST" or scope["path"] in _CHEAP_POSTS:
            await inner(scope, receive, send)
            return
        weight = 1
        body = read_before(scope)
        if scope["path"] in SEQUENCE_ROUTES and body is not None:
            try:
                weight = await _sequences(scope["path"], body, runtime.config.settings.max_n)
            except APIError as exc:  # n / best_of above MAX_N
                runtime.metrics.rejected.labels(reason="max_n").inc()
                await send_error(send, exc)
                return
        try:
            slots = await runtime.admission.acquire(weight)
        except RateLimitError as exc:
            runtime.metrics.rejected.labels(reason="queue_full").inc()
            await send_error(send, exc)
            return
        try:
            await inner(scope, receive, send)
        finally:
            runtime.admission.release(slots)


# Bodies larger than this are parsed off the event loop (a parse of megabytes stalls it).
_PARSE_IN_THREAD_BYTES = 256 * 1024


async def _sequences(route: str, body: bytes, max_n: int) -> int:
    """The sequences a generation request runs; BadRequestError above MAX_N. A body that is
    not a JSON object counts 1: vLLM answers it with its own 400."""
    if not may_ask_for_more_than_one(route, body):
        return 1
    try:
        if len(body) > _PARSE_IN_THREAD_BYTES:
            value = await asyncio.to_thread(json.loads, body)
        else:
            value = json.loads(body)
    except (ValueError, RecursionError):
        return 1
    if not isinstance(value, dict):
        return 1
    return request_sequences(route, value, max_n)


OPENAI_PREFIX = "/v1/"
# The /v1 routes that are ours, not vLLM's: OpenAI's Batch API (batches/routes.py).
OWN_V1_PREFIXES = ("/v1/files", "/v1/batches")


def is_own_v1(path: str) -> bool:
    return any(path == p or path.startswith(p + "/") for p in OWN_V1_PREFIXES)


class OpenAIFastPath:
    """Send /v1/... straight to the engine delegate, around our FastAPI app.

    Every OpenAI request would otherwise try each of our routes before the catch-all mount and
    pass every streamed chunk through two more Starlette middleware layers; /v1/ is vLLM's alone
    (create_app refuses a router of ours there) but for the Batch API's ``/v1/files`` and
    ``/v1/batches``, so the detour buys nothing.
    """

    def __init__(self, app: ASGIApp, delegate: ASGIApp):
        self.app = app
        self.delegate = delegate

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not path.startswith(OPENAI_PREFIX) or is_own_v1(path):
            await self.app(scope, receive, send)
            return
        try:
            await self.delegate(scope, receive, send)
        except Exception:
            # What our FastAPI app's exception handler would do: log it, answer in OpenAI's
            # shape (impossible once a response has started: then the server closes it).
            logger.exception("unhandled error on %s %s", scope["method"], scope["path"])
            with contextlib.suppress(Exception):
                await send_error(
                    send, InternalServerError("internal server error; see the server log")
                )


def _not_ready_error(health: Health) -> ServiceUnavailableError:
    if health.state is EngineState.INITIALIZING:
        return ServiceUnavailableError(
            f"the model is still loading (phase: {health.phase or 'starting'}); retry shortly",
            headers={"retry-after": "5"},
        )
    return ServiceUnavailableError(f"the engine is not available: {health.reason or health.state}")


CONTROL_PORT_HEADER = "x-llmep-control-port"


def _probe_response(probe: Probe, runtime: Runtime) -> Response:
    headers = {CONTROL_PORT_HEADER: str(runtime.control_port)} if runtime.control_port else None
    if probe.status == 204:
        return Response(status_code=204, headers=headers)
    return JSONResponse(probe.body, status_code=probe.status, headers=headers)


def liveness_now(runtime: Runtime) -> Probe:
    """/health's answer (on the main port and the control port alike)."""
    if runtime.engine.dead() and runtime.health.state is not EngineState.FAILED:
        # The engine watcher says so within moments; a probe in between need not wait.
        runtime.health.engine_failed(
            f"{runtime.engine.death_reason()}; restarting the container is the only remedy"
        )
    own = runtime.health.liveness()
    return runtime.pod.liveness() if runtime.pod is not None and own.status == 200 else own


def readiness_now(runtime: Runtime, strict: bool) -> Probe:
    """/ready's answer (and /ping's, not strict)."""
    own = runtime.health.readiness(strict=strict)
    if runtime.pod is None or own.status == 503:
        return own
    return runtime.pod.readiness(strict)


def metrics_now(runtime: Runtime) -> bytes:
    """/metrics' body: ours, then vLLM's series (safe from any thread: prometheus_client's
    collectors lock, and the gauges' sources read counters)."""
    runtime.metrics.engine_ready.set(1 if runtime.health.ready else 0)
    if runtime.pod is not None:
        runtime.metrics.refresh()
        return runtime.pod.metrics()
    vllm_registry = (
        runtime.engine.prometheus_registry() if runtime.engine.client is not None else None
    )
    return runtime.metrics.render(vllm_registry)


def probe_router(runtime: Runtime) -> APIRouter:
    router = APIRouter()

    @router.get("/health", include_in_schema=False)
    async def health() -> Response:
        return _probe_response(liveness_now(runtime), runtime)

    @router.get("/ready", include_in_schema=False)
    async def ready(strict: bool = False) -> Response:
        return _probe_response(readiness_now(runtime, strict), runtime)

    @router.api_route("/ping", methods=["GET", "POST"], include_in_schema=False)
    async def ping() -> Response:
        return _probe_response(readiness_now(runtime, False), runtime)

    @router.get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        return Response(metrics_now(runtime), media_type=CONTENT_TYPE)

    return router


def create_app(
    runtime: Runtime,
    routers: Sequence[APIRouter] = (),
    *,
    start_engine: bool = True,
    passed_on: Callable[[Scope], bool] = lambda _scope: False,
) -> ASGIApp:
    """The ASGI app: middleware, probes, ``routers`` (the features'), then vLLM's app.
    ``passed_on``: requests another API process of the pod passed here (counted there)."""
    settings = runtime.config.settings

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        task = asyncio.create_task(_start_engine(runtime)) if start_engine else None
        serving = [asyncio.create_task(run()) for run in runtime.on_serving]
        try:
            yield
        finally:
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await _drain_features(runtime)
            await runtime.engine.shutdown()
            for running in serving:  # last: the control port says "draining" to the end
                running.cancel()

    app = FastAPI(title="LLM Endpoints runtime", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.runtime = runtime
    app.openapi = openapi_builder(  # type: ignore[method-assign]
        app, lambda: runtime.engine.asgi_app, settings.unauthenticated_path_set, is_control_path
    )
    install_exception_handlers(app)
    app.include_router(probe_router(runtime))
    for router in routers:
        app.include_router(router)
    # Last: everything no router above claims goes to vLLM's own app.
    delegate = EngineDelegate(runtime)
    vllm = OpenAIShapedErrors(delegate)  # vLLM's own 404s etc. in our error shape
    app.router.routes.append(Mount("/", app=vllm))
    claimed = [
        r.path
        for r in app.router.routes
        if getattr(r, "path", "").startswith(OPENAI_PREFIX) and not is_own_v1(r.path)
    ]
    if claimed:
        raise RuntimeError(f"routes under {OPENAI_PREFIX} belong to vLLM's app: {claimed}")

    if not runtime.keys.enabled:
        logger.warning(
            "no API keys configured (API_KEYS / API_KEYS_FILE): the server is open to anyone who can reach it"
        )
    routed = OpenAIFastPath(app, vllm)
    # The key first, from the headers; only then is the body read (within its deadline).
    guarded = BodyGuard(
        routed,
        settings.max_request_body_bytes,
        runtime.metrics,
        runsync_limit=settings.max_runsync_body_bytes,
        read_timeout=settings.request_read_timeout_seconds,
    )
    guarded = APIKeyMiddleware(guarded, runtime.keys, settings.unauthenticated_path_set)
    context = RequestContext(guarded, runtime.metrics, passed_on)
    runtime.context = context
    return context


async def _drain_features(runtime: Runtime) -> None:
    """Let the features finish (jobs, webhook deliveries) while the engine still runs.

    By now the SIGTERM drain (server.py) has usually waited for them already; this is the
    bound for what is left, and the only drain when the server stops some other way.
    """
    loop = asyncio.get_running_loop()
    deadline = runtime.drain_deadline
    if deadline is None:
        deadline = loop.time() + runtime.config.settings.drain_timeout_seconds
    for drain in runtime.drainers:
        # What is still running when the time is up is stopped (a job ends FAILED); a
        # few seconds' grace let that be recorded and reported.
        left = max(0.0, deadline - loop.time())
        try:
            async with asyncio.timeout(left + _DRAIN_GRACE_SECONDS):
                await drain(left)
        except TimeoutError:
            logger.warning("shutdown: %s did not finish in time", _name(drain))
        except Exception:
            logger.exception("shutdown: %s failed", _name(drain))


_DRAIN_GRACE_SECONDS = 5.0


def _name(function: Callable[..., Any]) -> str:
    return getattr(function, "__qualname__", None) or repr(function)


async def _start_engine(runtime: Runtime) -> None:
    await runtime.engine.start()
    if runtime.health.state is EngineState.FAILED:
        # The engine never came up (a missing or corrupt model, a crash at load or warm-up):
        # it cannot in this process either. Exit as after a later death, so that `make serve`
        # ends with the cause and Kubernetes restarts the container (or shows CrashLoopBackOff
        # with the cause as the last log line) instead of a Running pod answering 503 for ever.
        await _stop_after_engine_failure(
            runtime, f"engine failed to start: {runtime.health.reason}"
        )
        return
    if (
        runtime.health.state is EngineState.READY
        and runtime.config.settings.max_concurrency is None
    ):
        limit = default_max_concurrency(runtime.engine.max_num_seqs)
        runtime.admission.set_limit(limit)
        logger.info(
            "MAX_CONCURRENCY defaults to %d (the engine batches up to %s)",
            limit,
            runtime.engine.max_num_seqs,
        )
    runtime.metrics.engine_ready.set(1 if runtime.health.ready else 0)
    if runtime.health.state is EngineState.READY:
        for hook in runtime.on_ready:
            hook()
        await _watch_engine(runtime)


# How often the engine watcher looks; vLLM marks its client errored as soon as the engine-core
# process exits, so a death is noticed within this interval.
ENGINE_WATCH_INTERVAL_SECONDS = 0.2


async def _watch_engine(runtime: Runtime) -> None:
    """Turn the endpoint away from traffic as soon as vLLM's engine core dies, then exit.

    A dead engine cannot come back in this process. From the moment it is noticed, readiness
    (/ready, /ping) and liveness (/health) answer 503, vLLM's routes and /invocations answer 503
    in OpenAI's shape, and the job API takes no new job; queued and running jobs fail naming the
    engine's death. ENGINE_DEATH_EXIT_DELAY_SECONDS later the process stops as on SIGTERM (the
    same drain: what is in flight fails fast, webhooks are sent) and exits non-zero
    (``__main__``), so Kubernetes restarts the container at once instead of after the liveness
    probe's failures. Cancelled by the lifespan's shutdown, before the engine is stopped on
    purpose.
    """
    engine = runtime.engine
    while not engine.dead():
        await asyncio.sleep(ENGINE_WATCH_INTERVAL_SECONDS)
    reason = f"{engine.death_reason()}; the process exits to be restarted"
    runtime.health.engine_failed(reason)
    await _stop_after_engine_failure(runtime, f"engine died: {reason}")


async def _stop_after_engine_failure(runtime: Runtime, what: str) -> None:
    """503 everywhere for ENGINE_DEATH_EXIT_DELAY_SECONDS, then stop as on SIGTERM; the
    process exits 1 (``__main__``: the engine's state is FAILED)."""
    runtime.metrics.engine_ready.set(0)
    delay = runtime.config.settings.engine_death_exit_delay_seconds
    logger.error("%s; answering 503 everywhere, exiting in %.0f s", what, delay)
    # Load balancers that only poll /ping (SageMaker, RunPod) see the 503 and take the pod out
    # before its connections start being refused; queued and running jobs fail meanwhile.
    await asyncio.sleep(delay)
    if runtime.health.draining:
        return  # a SIGTERM came meanwhile: its drain ends the process
    # By default a SIGTERM to ourselves: the server's own handling (server.py) drains and stops.
    runtime.request_stop()
