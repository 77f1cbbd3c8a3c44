"""The job API's own knobs, as one immutable value.

The runtime's settings class reads them from the environment (worker-vllm names where
worker-vllm has them, ``LLMEP_`` otherwise) and builds this object; the job package itself
never reads the environment, so tests construct it directly.
"""

from __future__ import annotations

from llmendpoints_common.fair_use import DEFAULT_MAX_N
from llmendpoints_common.jobs.models import (
    DEFAULT_EXECUTION_TIMEOUT_MS,
    DEFAULT_TTL_MS,
    MAX_POLICY_MS,
    JobLimits,
)
from prometheus_client import CollectorRegistry, Counter
from pydantic import BaseModel, ConfigDict, Field, model_validator


class JobSettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    # At most this many jobs run at once (MAX_CONCURRENCY); the rest wait in the queue.
    max_concurrency: int = Field(default=300, ge=1)
    # Queued jobs beyond this are refused with 429 (MAX_QUEUE_LENGTH).
    max_queue_length: int = Field(default=1000, ge=0)
    # max_tokens for prompt/messages jobs that do not set it (DEFAULT_MAX_TOKENS);
    # vLLM's own default is 16, which silently truncates answers.
    default_max_tokens: int = Field(default=512, ge=1)
    # Streaming batch schedule: min * growth^k tokens, capped at max (worker-vllm names).
    default_batch_size: int = Field(default=50, ge=1)
    default_min_batch_size: int = Field(default=1, ge=1)
    default_batch_size_growth_factor: float = Field(default=3.0, ge=1.0)
    # Streamed openai_route jobs yield raw SSE text (RAW_OPENAI_OUTPUT=1) or parsed events.
    raw_openai_output: bool = True
    # Results kept in this pod at most (oldest finished results are dropped first), by count
    # and by bytes (the JSON size of the requests and results kept).
    max_stored_jobs: int = Field(default=10_000, ge=1)
    max_stored_job_bytes: int = Field(default=512 * 1024 * 1024, ge=1)
    # n and best_of of one job at most (MAX_N); the policy's maxima (MAX_EXECUTION_TIMEOUT_MS,
    # MAX_JOB_TTL_MS). The minima are RunPod's (llmendpoints_common.jobs.models).
    max_n: int = Field(default=DEFAULT_MAX_N, ge=1)
    max_execution_timeout_ms: int = Field(default=MAX_POLICY_MS, ge=1)
    max_ttl_ms: int = Field(default=MAX_POLICY_MS, ge=1)
    # policy defaults (milliseconds)
    default_execution_timeout_ms: int = Field(default=DEFAULT_EXECUTION_TIMEOUT_MS, ge=1)
    default_ttl_ms: int = Field(default=DEFAULT_TTL_MS, ge=1)
    # A finished job's result is kept this long (RunPod's: 30 min after /run, 1 min after
    # /runsync), never past its ttl.
    run_retention_seconds: float = Field(default=30 * 60.0, gt=0)
    runsync_retention_seconds: float = Field(default=60.0, gt=0)
    default_runsync_wait_ms: int = Field(default=90_000, ge=0)
    max_runsync_wait_ms: int = Field(default=300_000, ge=0)
    # A /run repeated with the same Idempotency-Key within this window gets the first job.
    idempotency_window_seconds: float = Field(default=600.0, gt=0)
    # Webhook: 1 attempt + this many retries, this far apart.
    webhook_retries: int = Field(default=2, ge=0)
    webhook_retry_delay_seconds: float = Field(default=10.0, ge=0)
    # One attempt's deadline, connect to status line (WEBHOOK_TIMEOUT_SECONDS).
    webhook_timeout_seconds: float = Field(default=10.0, gt=0)
    # Attempts under way at once; the rest wait for a slot (WEBHOOK_MAX_CONCURRENCY).
    webhook_max_concurrency: int = Field(default=64, ge=1)

    @property
    def limits(self) -> JobLimits:
        return JobLimits(
            max_n=self.max_n,
            max_execution_timeout_ms=self.max_execution_timeout_ms,
            max_ttl_ms=self.max_ttl_ms,
        )

    @model_validator(mode="after")
    def _batch_sizes_consistent(self) -> JobSettings:
        if self.default_min_batch_size > self.default_batch_size:
            raise ValueError(
                f"DEFAULT_MIN_BATCH_SIZE ({self.default_min_batch_size}) must not exceed "
                f"DEFAULT_BATCH_SIZE ({self.default_batch_size})"
            )
        return self


def finished_jobs_counter(registry: CollectorRegistry) -> Counter:
    """``llmendpoints_jobs_finished_total{status}``: the jobs this pod moved into a final state,
    whichever store keeps them (in-pod or the shared queue)."""
    return Counter(
        "llmendpoints_jobs_finished",
        "Jobs that reached a final state, by that state (COMPLETED, FAILED, CANCELLED, TIMED_OUT).",
        ["status"],
        registry=registry,
    )
