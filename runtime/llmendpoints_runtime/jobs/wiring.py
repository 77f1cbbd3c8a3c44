"""The job API as one feature: its executor, webhook sender, metric and routers, built from
explicit parts (the composition root, ``compose.py``, supplies them and plugs the result in).

Routes: ``/run`` ... at the root and under ``/v2/{endpoint_id}`` (RunPod's layout). The root
``/health`` stays the process's liveness probe; RunPod's job-count ``/health`` answers under
``/v2/{endpoint_id}/health``, where ``runpod.Endpoint.health()`` asks for it.
``llmendpoints_jobs_finished_total{status}`` counts the jobs that ended;
``llmendpoints_job_store_bytes`` is what the in-pod store holds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from fastapi import APIRouter, Depends, Request
from llmendpoints_common.destinations import DestinationPolicy
from llmendpoints_common.jobs.api import JobVerbs
from llmendpoints_common.webhooks import WebhookSender
from prometheus_client import CollectorRegistry, Gauge

from llmendpoints_runtime.admission import Admission
from llmendpoints_runtime.jobs.executor import JobExecutor
from llmendpoints_runtime.jobs.port import ASGIApp, JobEngine
from llmendpoints_runtime.jobs.routes import JobHandler, build_job_router, job_verbs
from llmendpoints_runtime.jobs.settings import JobSettings, finished_jobs_counter


@dataclass
class JobFeature:
    executor: JobExecutor
    webhooks: WebhookSender
    verbs: JobVerbs
    stored: Gauge

    def refresh_metrics(self) -> None:
        """Set the store's gauge (a pod of several API processes reads what was set)."""
        self.stored.set(getattr(self.executor.store, "bytes", 0))

    def busy(self) -> int:
        """Work a draining pod waits for: queued and running jobs, webhooks being delivered."""
        return self.executor.queued + self.executor.running + self.webhooks.pending

    async def drain(self, timeout: float) -> None:
        """Start no new job, give running ones ``timeout`` s, then deliver their webhooks."""
        await self.executor.drain(timeout)

    def routers(self, openai_target: Callable[[Request], ASGIApp]) -> list[APIRouter]:
        return job_routers(self.verbs, openai_target)


def endpoint_in_path(endpoint_id: str) -> str:
    """The endpoint RunPod's URL names: accepted and ignored (one pod serves one endpoint);
    a dependency of the ``/v2/{endpoint_id}`` routes so /openapi.json declares the parameter."""
    return endpoint_id


def job_routers(verbs: JobHandler, openai_target: Callable[[Request], ASGIApp]) -> list[APIRouter]:
    """At the root, and under ``/v2/{endpoint_id}`` with the ``/openai/v1/...`` alias
    (``openai_target``: the app that serves ``/v1/...``)."""
    v2 = APIRouter(prefix="/v2/{endpoint_id}", dependencies=[Depends(endpoint_in_path)])
    v2.include_router(build_job_router(verbs, openai_target=openai_target))
    return [build_job_router(verbs, include_health=False), v2]


def build_job_feature(
    engine: JobEngine,
    settings: JobSettings,
    *,
    registry: CollectorRegistry,
    concurrency_limit: Callable[[], int],
    webhook_policy: DestinationPolicy,
    seat: JobSeat | None = None,
) -> JobFeature:
    """``seat``: this process's place in a pod of several API processes (jobs' slots and
    queue length counted for the pod, job ids naming the process)."""
    finished = finished_jobs_counter(registry)
    webhooks = WebhookSender(
        retries=settings.webhook_retries,
        delay_seconds=settings.webhook_retry_delay_seconds,
        timeout_seconds=settings.webhook_timeout_seconds,
        max_concurrency=settings.webhook_max_concurrency,
        policy=webhook_policy,
    )
    executor = JobExecutor(
        engine,
        settings,
        webhooks=webhooks,
        concurrency_limit=concurrency_limit,
        on_finish=lambda job: finished.labels(status=job.status.value).inc(),
        gate=seat.gate if seat else None,
        others_queued=seat.others_queued if seat else lambda: 0,
        id_suffix=seat.id_suffix if seat else "",
    )
    stored = Gauge(
        "llmendpoints_job_store_bytes",
        "Bytes of requests and results the pod's job store holds (JSON size; bounded by "
        "MAX_STORED_JOB_BYTES).",
        registry=registry,
        multiprocess_mode="livesum",
    )
    stored.set_function(lambda: getattr(executor.store, "bytes", 0))
    verbs = job_verbs(executor, engine, settings, webhook_policy)
    return JobFeature(executor=executor, webhooks=webhooks, verbs=verbs, stored=stored)


@dataclass(frozen=True)
class JobSeat:
    """A process's share of a pod's job API (API_SERVER_COUNT > 1): where running jobs take
    their slots, how many jobs the other processes hold queued, the end of its job ids."""

    gate: Admission
    others_queued: Callable[[], int]
    id_suffix: str
