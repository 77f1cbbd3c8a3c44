"""Plugging the job API and the SageMaker route into the runtime (called by app.py).

Routes: ``/run`` ... at the root and under ``/v2/{endpoint_id}`` (RunPod's layout). The root
``/health`` stays the process's liveness probe; RunPod's job-count ``/health`` answers under
``/v2/{endpoint_id}/health``, where ``runpod.Endpoint.health()`` asks for it.
Queued jobs count in ``llmendpoints_queue_depth`` (except ``policy.lowPriority`` ones), running ones in
``llmendpoints_requests_in_flight``, and a draining pod waits for both to reach zero;
``llmendpoints_jobs_finished_total{status}`` counts the jobs that ended.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from prometheus_client import Counter

from llmendpoints_runtime.engine import JobEngineAdapter
from llmendpoints_runtime.jobs.executor import JobExecutor
from llmendpoints_runtime.jobs.routes import JobAPI, build_job_router
from llmendpoints_runtime.jobs.settings import JobSettings
from llmendpoints_runtime.sagemaker import build_sagemaker_router


def job_settings(settings: Any, max_concurrency: int) -> JobSettings:
    """JobSettings from the runtime's settings (environment variables)."""
    return JobSettings(
        max_concurrency=max_concurrency,
        max_queue_length=settings.max_queue_length,
        default_max_tokens=settings.default_max_tokens,
        default_batch_size=settings.default_batch_size,
        default_min_batch_size=settings.default_min_batch_size,
        default_batch_size_growth_factor=settings.default_batch_size_growth_factor,
        raw_openai_output=settings.raw_openai_output,
        max_stored_jobs=settings.max_stored_jobs,
        max_body_bytes=settings.max_request_body_bytes,
    )


def _same_app(request: Request) -> Any:
    # Aliases re-enter our own app at the aliased path, so they get what /v1/... gets:
    # the admission queue, the 503 while loading, vLLM's handling.
    return request.app


def install_job_api(runtime: Any, *, default_max_concurrency: int) -> list[APIRouter]:
    """Build the executor, register its metrics and drain hooks, return the routers."""
    settings = runtime.config.settings
    engine = JobEngineAdapter(runtime.engine)
    config = job_settings(settings, settings.max_concurrency or default_max_concurrency)
    # The same number as the OpenAI requests' admission limit (a separate pool of that size),
    # including the raise to the engine's batch size when MAX_CONCURRENCY is unset.
    finished = Counter(
        "llmendpoints_jobs_finished",
        "Jobs that reached a final state, by that state (COMPLETED, FAILED, CANCELLED, TIMED_OUT).",
        ["status"],
        registry=runtime.metrics.registry,
    )
    executor = JobExecutor(
        engine,
        config,
        concurrency_limit=lambda: runtime.admission.limit,
        on_finish=lambda job: finished.labels(status=job.status.value).inc(),
    )
    runtime.jobs = executor
    runtime.metrics.add_queue_source(lambda: executor.queued_for_scaling)
    runtime.metrics.add_in_flight_source(lambda: executor.running)
    runtime.busy_sources.append(lambda: executor.running + executor.queued)

    api = JobAPI(executor=executor, engine=engine, settings=config)
    root = build_job_router(api, include_health=False)
    v2 = APIRouter(prefix="/v2/{endpoint_id}")
    v2.include_router(build_job_router(api, openai_target=_same_app))
    sagemaker = build_sagemaker_router(
        engine, max_body_bytes=config.max_body_bytes, target=_same_app
    )
    return [root, v2, sagemaker]
