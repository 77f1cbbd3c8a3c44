"""RunPod-compatible serverless job API: /run, /runsync, /status, /stream, /cancel, /retry,
/purge-queue, /health -- at the root and under /v2/{endpoint_id}.

Layers: ``models`` (what clients send) -> ``routes`` (HTTP, over the shared verbs of
``llmendpoints_common.jobs.api``) -> ``executor`` (lifecycle) ->
``work`` (one job's engine calls) -> ``port.JobEngine`` (implemented by ``job_engine.py`` on ``engine/``).
"""

from llmendpoints_runtime.jobs.executor import JobExecutor, status_body
from llmendpoints_runtime.jobs.port import JobEngine
from llmendpoints_runtime.jobs.routes import build_job_router, job_verbs
from llmendpoints_runtime.jobs.settings import JobSettings
from llmendpoints_runtime.jobs.store import InMemoryJobStore, JobStore

__all__ = [
    "InMemoryJobStore",
    "JobEngine",
    "JobExecutor",
    "JobSettings",
    "JobStore",
    "build_job_router",
    "job_verbs",
    "status_body",
]
