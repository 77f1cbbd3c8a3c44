"""RunPod-compatible serverless job API: /run, /runsync, /status, /stream, /cancel, /retry,
/purge-queue, /health -- at the root and under /v2/{endpoint_id}.

Layers: ``models`` (what clients send) -> ``routes`` (HTTP) -> ``executor`` (lifecycle) ->
``work`` (one job's engine calls) -> ``port.JobEngine`` (implemented by ``engine.py``).
"""

from llmendpoints_runtime.jobs.executor import JobExecutor, status_body
from llmendpoints_runtime.jobs.port import JobEngine
from llmendpoints_runtime.jobs.routes import JobAPI, build_job_router
from llmendpoints_runtime.jobs.settings import JobSettings
from llmendpoints_runtime.jobs.store import InMemoryJobStore, JobStore

__all__ = [
    "InMemoryJobStore",
    "JobAPI",
    "JobEngine",
    "JobExecutor",
    "JobSettings",
    "JobStore",
    "build_job_router",
    "status_body",
]
