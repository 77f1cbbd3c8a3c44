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

import logging
import os

from fastapi import APIRouter, Request
from llmendpoints_common.jobs.models import DEFAULT_EXECUTION_TIMEOUT_MS, DEFAULT_TTL_MS
from starlette.types import ASGIApp, Scope

from llmendpoints_runtime import adapters, app, control_listener, startup_report
from llmendpoints_runtime.adapters import AdapterReconciler
from llmendpoints_runtime.admission import Admission, AdmissionQueue, default_max_concurrency
from llmendpoints_runtime.app import Runtime
from llmendpoints_runtime.auth import KeyStore
from llmendpoints_runtime.batches import build_batch_feature
from llmendpoints_runtime.batches.routes import forwarded_batch_routers, unavailable_batch_routers
from llmendpoints_runtime.config import ConfigError, RuntimeConfig, RuntimeSettings, batch_dir
from llmendpoints_runtime.engine import Engine, EngineLink, install_media_fetcher
from llmendpoints_runtime.group import LeaderChannel
from llmendpoints_runtime.health import Health
from llmendpoints_runtime.job_engine import JobEngineAdapter
from llmendpoints_runtime.jobs.queue_worker import (
    BatchShare,
    QueueJobFeature,
    build_queue_feature,
    shared_queue_settings,
)
from llmendpoints_runtime.jobs.settings import JobSettings
from llmendpoints_runtime.jobs.wiring import JobFeature, JobSeat, build_job_feature, job_routers
from llmendpoints_runtime.media_fetch import MediaFetcher, media_policy
from llmendpoints_runtime.metrics import CONTENT_TYPE, RuntimeMetrics
from llmendpoints_runtime.pod.admission import PodAdmission
from llmendpoints_runtime.pod.board import PodSeat
from llmendpoints_runtime.pod.forward import ForwardTo, http_socket_path, is_peer
from llmendpoints_runtime.pod.jobs import PeerJobs, job_id_suffix
from llmendpoints_runtime.pod.member import PodMember
from llmendpoints_runtime.pod.metrics import PodView
from llmendpoints_runtime.sagemaker import build_sagemaker_router

logger = logging.getLogger("llmendpoints.startup")


def build_runtime(
    config: RuntimeConfig, *, seat: PodSeat | None = None, link: EngineLink | None = None
) -> Runtime:
    """The process's parts, before any feature is plugged in. ``seat`` and ``link``: one of
    the API processes of a pod with several (pod/api_process.py), on the pod's engine."""
    settings = config.settings
    health = Health()
    metrics = RuntimeMetrics(pod=seat is not None)
    engine = Engine(
        config.engine_args,
        health,
        metrics,
        progress_interval=settings.startup_log_interval_seconds,
        link=link,
    )
    limit = settings.max_concurrency or default_max_concurrency(None)
    admission: Admission = (
        PodAdmission(seat.board, seat.index, limit, settings.max_queue_length)
        if seat is not None
        else AdmissionQueue(limit, settings.max_queue_length)
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
        config=config,
        health=health,
        metrics=metrics,
        engine=engine,
        admission=admission,
        keys=keys,
        pod=PodView(seat.board) if seat is not None else None,
    )
    metrics.add_queue_source(lambda: admission.waiting)
    metrics.set_engine_waiting_source(engine.requests_waiting)
    metrics.add_in_flight_source(lambda: admission.running)
    report_startup(runtime)
    return runtime


def report_startup(runtime: Runtime) -> None:
    """The start-up phases the engine does not time itself: ``startup`` (process start to the
    engine's start) when the server starts, ``compile`` (what vLLM's processes reported,
    startup_report.py) once the engine is ready."""
    metrics = runtime.metrics

    async def startup_phase() -> None:
        age = startup_report.process_age()
        if age is not None:
            metrics.observe_phase("startup", age)

    def compile_phase() -> None:
        path = os.environ.get(startup_report.ENV)
        report = startup_report.read(path)
        startup_report.discard(path)
        if report.compile_seconds is not None:
            metrics.observe_phase("compile", report.compile_seconds)
        if report.compile_source is not None:
            metrics.compile_source.labels(report.compile_source).set(1)
        if report.compile_seconds is not None or report.compile_source is not None:
            logger.info(
                "compile: %s s, %s",
                "?" if report.compile_seconds is None else f"{report.compile_seconds:.1f}",
                _COMPILE_SOURCES.get(report.compile_source or "", "no compile reported"),
            )

    runtime.on_serving.append(startup_phase)
    runtime.on_ready.append(compile_phase)


_COMPILE_SOURCES = {
    "cache": "loaded from the compile cache",
    "compiled": "compiled (saved to the compile cache)",
    "reload_failed": "the cached compile would not load: compiled again",
}


def create_app(
    runtime: Runtime, *, start_engine: bool = True, seat: PodSeat | None = None
) -> ASGIApp:
    """The app with every feature plugged in: the job API (in the pod, or on the shared
    queue), the batch APIs, SageMaker. ``seat``: this process's place in a pod of several."""
    settings = runtime.config.settings
    features = Features(
        runtime,
        JobEngineAdapter(runtime.engine, adapter_reconciler(runtime)),
        job_settings_from(settings, settings.max_concurrency or default_max_concurrency(None)),
        seat,
    )
    if settings.jobs_queue_url is not None:
        routers = features.queued_jobs()
    else:
        routers = [*features.local_jobs(), *features.local_batches()]
    features.plug_jobs()
    sagemaker = build_sagemaker_router(features.engine, target=_same_app)
    if seat is not None:
        member = PodMember(
            seat,
            runtime.health,
            runtime.engine,
            runtime.metrics,
            stop=runtime.request_stop,
            jobs_queued=features.queued,
        )
        runtime.on_serving.append(member.run)
    return app.create_app(
        runtime,
        [*routers, sagemaker],
        start_engine=start_engine,
        passed_on=(lambda scope: is_peer(scope, seat.token)) if seat is not None else _nobody,
    )


class Features:
    """Each feature built on the engine's job port, its metrics, work and drain registered
    with the runtime; each method returns the feature's routers."""

    def __init__(
        self,
        runtime: Runtime,
        engine: JobEngineAdapter,
        job_settings: JobSettings,
        seat: PodSeat | None,
    ) -> None:
        self.runtime = runtime
        self.engine = engine
        self.job_settings = job_settings
        self.seat = seat
        self.settings = runtime.config.settings
        self.jobs: JobFeature | None = None
        self._job_feature: JobFeature | QueueJobFeature | None = None

    def queued(self) -> int:
        """Jobs this process holds queued (none of its own on the shared queue)."""
        return self.jobs.executor.queued if self.jobs is not None else 0

    def interactive(self) -> int:
        """OpenAI requests admitted, running or waiting for a slot: batch requests keep out of
        their way."""
        return self.runtime.admission.running + self.runtime.admission.waiting

    def batch_capacity(self) -> int:
        """What batch requests are a share of: the admission limit, never past what the
        engine runs at once (a batch filling every engine slot would hold a later interactive
        request until one of its requests ends)."""
        admission = self.runtime.admission
        return min(admission.limit, self.runtime.engine.max_num_seqs or admission.limit)

    def plug_jobs(self) -> None:
        """Last (its drain after the batches'): a draining pod waits for jobs and webhooks."""
        if (feature := self._job_feature) is not None:
            self.runtime.busy_sources.append(feature.busy)
            self.runtime.drainers.append(feature.drain)

    def queued_jobs(self) -> list[APIRouter]:
        """JOBS_QUEUE_URL: jobs live in the shared queue and this pod is one of its workers.
        Queued jobs belong to the endpoint (the autoscaler reads them from the queue), so
        only the ones running here count in this pod's metrics. In a pod of several API
        processes each takes its share of the pod's capacity."""
        runtime, count = self.runtime, self.seat.count if self.seat is not None else 1
        queued = build_queue_feature(
            self.engine,
            self.job_settings,
            shared_queue_settings(self.settings),
            registry=runtime.metrics.registry,
            capacity=lambda: max(1, runtime.admission.limit // count),
            webhook_policy=self.settings.webhook_policy,
            interactive=self.interactive,
            batch_capacity=self.batch_capacity,
        )
        runtime.metrics.add_in_flight_source(lambda: queued.jobs.running_sequences)
        self._job_feature = queued
        routers = queued.routers(openai_target=_same_app)
        if self.settings.batch_enabled:
            # The gateway serves the batch APIs on the queue's store; this pod runs their
            # requests (the queue's batch lane).
            routers += unavailable_batch_routers(
                "this pod takes its jobs from the shared queue (JOBS_QUEUE_URL): send batches "
                "and files to the gateway"
            )
        return routers

    def local_jobs(self) -> list[APIRouter]:
        """Jobs in this process. Queued jobs count in llmendpoints_queue_depth (except
        policy.lowPriority ones), running ones in llmendpoints_requests_in_flight, both in
        sequences as the engine runs them (a job with n: 4 counts 4), like the OpenAI
        requests' admission. Their pool of slots is the same number as the OpenAI requests'
        admission limit (a separate pool of that size), including the raise to the engine's
        batch size when MAX_CONCURRENCY is unset."""
        runtime, seat = self.runtime, self.seat
        local = self.jobs = build_job_feature(
            self.engine,
            self.job_settings,
            registry=runtime.metrics.registry,
            concurrency_limit=lambda: runtime.admission.limit,
            webhook_policy=self.settings.webhook_policy,
            seat=job_seat(seat, runtime.admission.limit) if seat is not None else None,
        )
        runtime.metrics.add_queue_source(lambda: local.executor.queued_for_scaling)
        runtime.metrics.add_in_flight_source(lambda: local.executor.running_sequences)
        runtime.metrics.add_refresher(local.refresh_metrics)
        self._job_feature = local
        if seat is None:
            return local.routers(openai_target=_same_app)
        peers = PeerJobs(local.verbs, seat.index, seat.count, seat.directory)
        runtime.on_serving.append(peers.serve)
        return job_routers(peers, _same_app)

    def local_batches(self) -> list[APIRouter]:
        """Batches kept on this pod's disk; in a pod of several API processes, by process 0
        (its store and driver), the others passing the requests to it."""
        runtime, settings, seat = self.runtime, self.settings, self.seat
        if not settings.batch_enabled:
            return []
        if seat is not None and seat.index != 0:
            return forwarded_batch_routers(
                ForwardTo(http_socket_path(seat.directory, 0), seat.token)
            )
        share = BatchShare(priority=settings.batch_priority, max_share=settings.batch_max_share)
        engine = self.engine

        def batch_slots() -> int:
            if engine.draining() or not engine.is_ready():
                return 0
            running_jobs = self.jobs.executor.running_sequences if self.jobs is not None else 0
            busy = self.interactive() + running_jobs
            return share.slots(self.batch_capacity(), busy, engine.load().waiting)

        batches = build_batch_feature(
            engine,
            self.job_settings,
            settings,
            root=batch_dir(settings, os.environ),
            endpoint=f"{settings.endpoint_namespace}/{settings.endpoint_id or 'local'}",
            slots=batch_slots,
            webhook_policy=settings.webhook_policy,
        )
        runtime.metrics.add_in_flight_source(lambda: batches.lines.running)
        runtime.busy_sources.append(batches.busy)
        runtime.drainers.append(batches.drain)
        return batches.routers()


def job_seat(seat: PodSeat, limit: int) -> JobSeat:
    """The job API's share of a pod: its slots on the pod's board, the other processes'
    queued jobs, ids that name this process."""
    board, index = seat.board, seat.index
    return JobSeat(
        gate=PodAdmission(board, index, max(1, limit), 1 << 62, prefix="job"),
        others_queued=lambda: int(board.total("jobs_queued") - board.get(index, "jobs_queued")),
        id_suffix=job_id_suffix(index),
    )


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
    host, setting = settings.control_address
    try:
        port = control_listener.start(surface, host, settings.control_port, thread=False)
    except OSError as exc:
        raise ConfigError(setting, str(exc)) from None
    # Published from the event loop, which stays responsive under load (a thread did not get
    # the GIL often enough); the first publication is already there.
    runtime.on_serving.append(port.publisher.run)
    runtime.control_port = port.port
    return port


def start_group_channel(runtime: Runtime) -> LeaderChannel | None:
    """A group's leader: the liveness channel its workers join (group.py), listening; None for
    one pod. A worker lost stops the engine (requests in flight fail, 503 everywhere, exit 1)
    so that LeaderWorkerSet recreates the group. ConfigError when its port cannot be had."""
    topology, settings = runtime.config.topology, runtime.config.settings
    if not topology.multinode:
        return None
    channel = LeaderChannel(
        settings.host,
        topology.group_port,
        topology.nodes,
        timeout=settings.group_timeout_seconds,
        on_lost=lambda reason: runtime.engine.declare_dead(f"the group lost a node: {reason}"),
        state=lambda: runtime.health.state.value,
    )
    try:
        channel.start()
    except OSError as exc:
        raise ConfigError(
            "LLMEP_MULTINODE_PORT",
            f"the group's liveness channel (this port + 2 = {topology.group_port}) cannot "
            f"listen on {settings.host}: {exc}",
        ) from None
    return channel


def adapter_reconciler(runtime: Runtime) -> AdapterReconciler:
    """LoRA adapters declared in the endpoint (LLMEP_ADAPTERS_FILE): reconciled into the engine
    once it is ready, until shutdown. Without the file the reconciler only answers "none
    declared" (the job port asks it which adapters are still loading)."""
    reconciler = adapters.build_reconciler(
        runtime.engine,
        runtime.config.settings,
        runtime.metrics.registry,
        tuple(runtime.config.served_model_names),
    )
    if reconciler.adapters_file is not None:

        async def stop_adapter_reconciler(_timeout: float) -> None:
            await reconciler.stop()  # cancels loads in flight; loaded adapters keep serving

        runtime.on_ready.append(lambda: adapters.start(runtime.engine, reconciler))
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


def _nobody(_scope: Scope) -> bool:
    return False


def _same_app(request: Request) -> ASGIApp:
    # Aliases re-enter our own app at the aliased path, so they get what /v1/... gets:
    # the admission queue, the 503 while loading, vLLM's handling.
    return request.app
