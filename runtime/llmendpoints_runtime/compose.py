"""The composition root: the one place that knows every part of the runtime and plugs them
together (as KubeAI's ``internal/manager/run.go``; each feature offers a builder, as vLLM's
``attach_router``). Nothing below imports this module or anything else above it: the
import-linter ``layers`` contract in pyproject.toml keeps it so.

``build_runtime(config)`` makes the process's parts; ``create_app(runtime)`` builds each
feature -- the job API (``jobs/wiring.py``), SageMaker's ``/invocations``, the LoRA adapter
reconciler (``adapters/``) -- on the engine's job port (``job_engine.py``), registers its metrics,
its work in flight and its shutdown, and hands its routers to ``app.create_app``.
"""

from __future__ import annotations

import os

from fastapi import APIRouter, Request
from llmendpoints_common.jobs.models import DEFAULT_EXECUTION_TIMEOUT_MS, DEFAULT_TTL_MS
from starlette.types import ASGIApp

from llmendpoints_runtime import adapters, app, control_listener
from llmendpoints_runtime.adapters import AdapterReconciler
from llmendpoints_runtime.admission import AdmissionQueue, default_max_concurrency
from llmendpoints_runtime.app import Runtime
from llmendpoints_runtime.auth import KeyStore
from llmendpoints_runtime.batches import build_batch_feature
from llmendpoints_runtime.batches.routes import unavailable_batch_routers
from llmendpoints_runtime.config import ConfigError, RuntimeConfig, RuntimeSettings, batch_dir
from llmendpoints_runtime.engine import Engine, install_media_fetcher
from llmendpoints_runtime.health import Health
from llmendpoints_runtime.job_engine import JobEngineAdapter
from llmendpoints_runtime.jobs.queue_worker import (
    BatchShare,
    QueueJobFeature,
    build_queue_feature,
    shared_queue_settings,
)
from llmendpoints_runtime.jobs.settings import JobSettings
from llmendpoints_runtime.jobs.wiring import JobFeature, build_job_feature
from llmendpoints_runtime.media_fetch import MediaFetcher, media_policy
from llmendpoints_runtime.metrics import CONTENT_TYPE, RuntimeMetrics
from llmendpoints_runtime.sagemaker import build_sagemaker_router


def build_runtime(config: RuntimeConfig) -> Runtime:
    """The process's parts, before any feature is plugged in."""
    settings = config.settings
    health = Health()
    metrics = RuntimeMetrics()
    engine = Engine(
        config.engine_args, health, metrics, progress_interval=settings.startup_log_interval_seconds
    )
    admission = AdmissionQueue(
        settings.max_concurrency or default_max_concurrency(None), settings.max_queue_length
    )
    keys = KeyStore(
        settings.static_api_keys(),
        settings.api_keys_file,
        admin_keys=settings.admin_keys(),
        admin_keys_file=settings.admin_api_keys_file,
        gateway_token_file=settings.gateway_token_file,
    )
    # Image URLs in requests are fetched only through the destination guard (media_fetch.py).
    try:
        policy = media_policy(config.engine_args.allowed_media_domains)
    except ValueError as exc:
        raise ConfigError("ALLOWED_MEDIA_DOMAINS", str(exc)) from None
    install_media_fetcher(MediaFetcher(policy))
    runtime = Runtime(
        config=config, health=health, metrics=metrics, engine=engine, admission=admission, keys=keys
    )
    metrics.add_queue_source(lambda: admission.waiting)
    metrics.set_engine_waiting_source(engine.requests_waiting)
    metrics.add_in_flight_source(lambda: admission.running)
    return runtime


def create_app(runtime: Runtime, *, start_engine: bool = True) -> ASGIApp:
    settings = runtime.config.settings
    engine = JobEngineAdapter(runtime.engine, adapter_reconciler(runtime))
    job_settings = job_settings_from(
        settings, settings.max_concurrency or default_max_concurrency(None)
    )
    jobs: JobFeature | QueueJobFeature
    admission = runtime.admission

    def interactive() -> int:
        """OpenAI requests admitted, running or waiting for a slot: batch requests keep out of
        their way."""
        return admission.running + admission.waiting

    def batch_capacity() -> int:
        """What batch requests are a share of: the admission limit, never past what the
        engine runs at once (a batch filling every engine slot would hold a later interactive
        request until one of its requests ends)."""
        return min(admission.limit, runtime.engine.max_num_seqs or admission.limit)

    batch_routers: list[APIRouter] = []
    if settings.jobs_queue_url is not None:
        # JOBS_QUEUE_URL: jobs live in the shared queue and this pod is one of its workers.
        # Queued jobs belong to the endpoint (the autoscaler reads them from the queue), so
        # only the ones running here count in this pod's metrics.
        jobs = queued = build_queue_feature(
            engine,
            job_settings,
            shared_queue_settings(settings),
            registry=runtime.metrics.registry,
            capacity=lambda: runtime.admission.limit,
            webhook_policy=settings.webhook_policy,
            interactive=interactive,
            batch_capacity=batch_capacity,
        )
        runtime.metrics.add_in_flight_source(lambda: queued.jobs.running_sequences)
        if settings.batch_enabled:
            # The gateway serves the batch APIs on the queue's store; this pod runs their
            # requests (the queue's batch lane).
            batch_routers = unavailable_batch_routers(
                "this pod takes its jobs from the shared queue (JOBS_QUEUE_URL): send batches "
                "and files to the gateway"
            )
    else:
        jobs = local = build_job_feature(
            engine,
            job_settings,
            registry=runtime.metrics.registry,
            # The same number as the OpenAI requests' admission limit (a separate pool of that
            # size), including the raise to the engine's batch size when MAX_CONCURRENCY is unset.
            concurrency_limit=lambda: runtime.admission.limit,
            webhook_policy=settings.webhook_policy,
        )
        # Queued jobs count in llmendpoints_queue_depth (except policy.lowPriority ones),
        # running ones in llmendpoints_requests_in_flight, both in sequences as the engine
        # runs them (a job with n: 4 counts 4), like the OpenAI requests' admission.
        runtime.metrics.add_queue_source(lambda: local.executor.queued_for_scaling)
        runtime.metrics.add_in_flight_source(lambda: local.executor.running_sequences)
        if settings.batch_enabled:
            share = BatchShare(priority=settings.batch_priority, max_share=settings.batch_max_share)

            def batch_slots() -> int:
                if engine.draining() or not engine.is_ready():
                    return 0
                busy = interactive() + local.executor.running_sequences
                return share.slots(batch_capacity(), busy, engine.load().waiting)

            batches = build_batch_feature(
                engine,
                job_settings,
                settings,
                root=batch_dir(settings, os.environ),
                endpoint=f"{settings.endpoint_namespace}/{settings.endpoint_id or 'local'}",
                slots=batch_slots,
                webhook_policy=settings.webhook_policy,
            )
            runtime.metrics.add_in_flight_source(lambda: batches.lines.running)
            runtime.busy_sources.append(batches.busy)
            runtime.drainers.append(batches.drain)
            batch_routers = batches.routers()
    # A draining pod waits for jobs and webhooks.
    runtime.busy_sources.append(jobs.busy)
    runtime.drainers.append(jobs.drain)

    sagemaker = build_sagemaker_router(engine, target=_same_app)
    routers: list[APIRouter] = [*jobs.routers(openai_target=_same_app), *batch_routers, sagemaker]
    return app.create_app(runtime, routers, start_engine=start_engine)


def start_control_listener(runtime: Runtime) -> control_listener.ControlPort | None:
    """Probes and /metrics on LLMEP_CONTROL_PORT, answered by a process of their own
    (control_listener); None when the port is not set. ConfigError when it cannot listen."""
    settings = runtime.config.settings
    if settings.control_port is None:
        return None
    if settings.control_port == settings.port:
        raise ConfigError("LLMEP_CONTROL_PORT", f"must differ from PORT ({settings.port})")
    surface = control_listener.ControlSurface(
        liveness=lambda: app.liveness_now(runtime),
        readiness=lambda strict: runtime.health.readiness(strict=strict),
        metrics=lambda: (app.metrics_now(runtime), CONTENT_TYPE),
    )
    try:
        port = control_listener.start(
            surface, settings.control_host or settings.host, settings.control_port, thread=False
        )
    except OSError as exc:
        setting = "LLMEP_CONTROL_HOST" if settings.control_host else "LLMEP_CONTROL_PORT"
        raise ConfigError(setting, str(exc)) from None
    # Published from the event loop, which stays responsive under load (a thread did not get
    # the GIL often enough); the first publication is already there.
    runtime.on_serving.append(port.publisher.run)
    runtime.control_port = port.port
    return port


def adapter_reconciler(runtime: Runtime) -> AdapterReconciler:
    """LoRA adapters declared in the endpoint (LLMEP_ADAPTERS_FILE): reconciled into the engine
    once it is ready, until shutdown. Without the file the reconciler only answers "none
    declared" (the job port asks it which adapters are still loading)."""
    reconciler = adapters.build_reconciler(runtime)
    if reconciler.adapters_file is not None:

        async def stop_adapter_reconciler(_timeout: float) -> None:
            await reconciler.stop()  # cancels loads in flight; loaded adapters keep serving

        runtime.on_ready.append(lambda: adapters.start(runtime, reconciler))
        runtime.drainers.append(stop_adapter_reconciler)
    return reconciler


def job_settings_from(settings: RuntimeSettings, max_concurrency: int) -> JobSettings:
    """The job API's settings from the runtime's (environment variables)."""
    return JobSettings(
        max_concurrency=max_concurrency,
        max_queue_length=settings.max_queue_length,
        default_max_tokens=settings.default_max_tokens,
        default_batch_size=settings.default_batch_size,
        default_min_batch_size=settings.default_min_batch_size,
        default_batch_size_growth_factor=settings.default_batch_size_growth_factor,
        raw_openai_output=settings.raw_openai_output,
        max_stored_jobs=settings.max_stored_jobs,
        max_stored_job_bytes=settings.max_stored_job_bytes,
        max_n=settings.max_n,
        max_execution_timeout_ms=settings.max_execution_timeout_ms,
        max_ttl_ms=settings.max_job_ttl_ms,
        default_execution_timeout_ms=min(
            DEFAULT_EXECUTION_TIMEOUT_MS, settings.max_execution_timeout_ms
        ),
        default_ttl_ms=min(DEFAULT_TTL_MS, settings.max_job_ttl_ms),
        run_retention_seconds=settings.jobs_run_retention_seconds,
        runsync_retention_seconds=settings.jobs_runsync_retention_seconds,
        webhook_timeout_seconds=settings.webhook_timeout_seconds,
        webhook_max_concurrency=settings.webhook_max_concurrency,
    )


def _same_app(request: Request) -> ASGIApp:
    # Aliases re-enter our own app at the aliased path, so they get what /v1/... gets:
    # the admission queue, the 503 while loading, vLLM's handling.
    return request.app
