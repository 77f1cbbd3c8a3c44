import asyncio

import pytest
from llmendpoints_common.errors import ConflictError, RateLimitError
from llmendpoints_common.webhooks import WebhookSender
from llmendpoints_runtime.jobs.errors import JobNotFound
from llmendpoints_runtime.jobs.executor import JobExecutor, status_body
from llmendpoints_runtime.jobs.models import JobRequest, JobStatus, parse_job_request
from llmendpoints_runtime.jobs.settings import JobSettings

from .fakes import FakeEngine


def request(body: str):
    return parse_job_request(body.encode())


async def until(predicate, timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.001)


class Posts:
    def __init__(self, statuses: list[int] | None = None) -> None:
        self.calls: list[tuple[str, dict]] = []
        self.statuses = statuses or []

    async def __call__(self, url: str, payload: dict) -> int:
        self.calls.append((url, payload))
        return self.statuses.pop(0) if self.statuses else 200


def make(engine: FakeEngine, posts: Posts | None = None, **settings) -> JobExecutor:
    job_settings = JobSettings(**settings)
    webhooks = WebhookSender(retries=2, delay_seconds=0, timeout_seconds=1, post=posts or Posts())
    executor = JobExecutor(engine, job_settings, webhooks=webhooks)
    executor.start()
    return executor


async def test_prompt_job_completes_with_worker_vllm_output() -> None:
    executor = make(FakeEngine())
    job = await executor.submit(
        request('{"input": {"prompt": "a b c", "sampling_params": {"max_tokens": 3}}}'), sync=True
    )
    job = await executor.wait(job.id, 5)
    body = status_body(job)
    assert body["status"] == "COMPLETED"
    assert body["output"] == [
        {"choices": [{"tokens": ["t0 t1 t2 "]}], "usage": {"input": 3, "output": 3}}
    ]
    assert body["delayTime"] >= 0 and body["executionTime"] >= 0
    assert "error" not in body
    await executor.drain(1)


async def test_bare_prompt_gets_default_max_tokens_not_16() -> None:
    engine = FakeEngine()
    executor = make(engine, default_max_tokens=40)
    job = await executor.wait(
        (await executor.submit(request('{"input": {"prompt": "x"}}'), sync=True)).id, 5
    )
    assert job.output[0]["usage"]["output"] == 40
    assert engine.started[0].default_max_tokens == 40
    await executor.drain(1)


async def test_streamed_job_publishes_growing_batches() -> None:
    executor = make(
        FakeEngine(),
        default_batch_size=8,
        default_min_batch_size=2,
        default_batch_size_growth_factor=2,
    )
    job = await executor.submit(
        request(
            '{"input": {"prompt": "x", "stream": true, "sampling_params": {"max_tokens": 20}}}'
        ),
        sync=False,
    )
    job = await executor.wait(job.id, 5)
    assert [len(b["choices"][0]["tokens"]) for b in job.output] == [2, 4, 8, 6]
    _, chunks = await executor.take_stream(job.id)
    assert chunks == job.output
    _, again = await executor.take_stream(job.id)
    assert again == []  # drained: only what was produced since the last poll
    await executor.drain(1)


async def test_per_request_batch_sizes_override_the_environment() -> None:
    executor = make(FakeEngine())
    job = await executor.submit(
        request(
            '{"input": {"prompt": "x", "stream": true, "max_batch_size": 2, "min_batch_size": 2, "sampling_params": {"max_tokens": 5}}}'
        ),
        sync=False,
    )
    job = await executor.wait(job.id, 5)
    assert [len(b["choices"][0]["tokens"]) for b in job.output] == [2, 2, 1]
    await executor.drain(1)


async def test_at_most_max_concurrency_jobs_run_and_the_rest_queue() -> None:
    engine = FakeEngine(step_delay=0.01)
    executor = make(engine, max_concurrency=2, max_queue_length=3)
    body = request('{"input": {"prompt": "x", "sampling_params": {"max_tokens": 50}}}')
    jobs = [await executor.submit(body, sync=False) for _ in range(2)]
    await until(lambda: executor.running == 2)
    jobs += [await executor.submit(body, sync=False) for _ in range(3)]
    await asyncio.sleep(0.02)
    assert executor.running == 2 and executor.queued == 3
    assert len(engine.active) == 2
    with pytest.raises(RateLimitError) as info:
        await executor.submit(request('{"input": {"prompt": "x"}}'), sync=False)
    assert info.value.status_code == 429
    for job in jobs:
        await executor.wait(job.id, 10)
    assert {j.status for j in jobs} == {JobStatus.COMPLETED}
    assert executor.queued == 0
    await executor.drain(1)


async def test_workers_follow_a_growing_concurrency_limit() -> None:
    engine = FakeEngine(step_delay=0.01)
    limit = [1]
    executor = JobExecutor(engine, JobSettings(), concurrency_limit=lambda: limit[0])
    body = request('{"input": {"prompt": "x", "sampling_params": {"max_tokens": 30}}}')
    jobs = [await executor.submit(body, sync=False) for _ in range(3)]
    await until(lambda: executor.running == 1)
    await asyncio.sleep(0.02)
    assert executor.running == 1 and executor.queued == 2
    limit[0] = 3  # e.g. raised to the engine's batch size once it is up
    jobs.append(await executor.submit(body, sync=False))
    await until(lambda: executor.running == 3)
    for job in jobs:
        await executor.wait(job.id, 10)
    await executor.drain(1)


async def test_execution_timeout_ends_timed_out_and_aborts_the_engine_request() -> None:
    engine = FakeEngine(step_delay=0.02)
    # The endpoint's default timeout (a job's policy.executionTimeout is 5 s at least).
    executor = make(engine, default_execution_timeout_ms=100)
    job = await executor.submit(
        request('{"input": {"prompt": "x", "sampling_params": {"max_tokens": 1000}}}'),
        sync=False,
    )
    job = await executor.wait(job.id, 5)
    assert job.status is JobStatus.TIMED_OUT
    assert job.error["type"] == "RequestTimeoutError" and "100 ms" in job.error["message"]
    assert job.error["param"] == "policy.executionTimeout" and job.error["code"] == 408
    assert engine.aborted == [job.engine_request_id]
    assert engine.active == set()
    await executor.drain(1)


async def test_cancel_running_job_aborts_at_once() -> None:
    engine = FakeEngine(step_delay=0.05)
    executor = make(engine)
    job = await executor.submit(
        request('{"input": {"prompt": "x", "sampling_params": {"max_tokens": 1000}}}'), sync=False
    )
    await until(lambda: job.status is JobStatus.IN_PROGRESS and engine.active)
    cancelled = await executor.cancel(job.id)
    assert cancelled.status is JobStatus.CANCELLED
    assert engine.aborted == [job.engine_request_id] and engine.load().running == 0
    with pytest.raises(ConflictError) as info:
        await executor.cancel(job.id)
    assert info.value.status_code == 409 and "CANCELLED" in info.value.message
    await executor.drain(1)


async def test_cancelled_queued_job_never_starts_and_purge_counts() -> None:
    engine = FakeEngine(ready=False)
    executor = make(engine)
    jobs = [
        await executor.submit(request('{"input": {"prompt": "x"}}'), sync=False) for _ in range(3)
    ]
    await executor.cancel(jobs[0].id)
    assert executor.queued == 2
    assert await executor.purge_queue() == 2
    assert executor.queued == 0
    engine.become_ready()
    await asyncio.sleep(0.05)
    assert engine.started == []
    assert {j.status for j in jobs} == {JobStatus.CANCELLED}
    await executor.drain(1)


async def test_low_priority_jobs_queue_without_asking_for_scale() -> None:
    engine = FakeEngine(ready=False)
    executor = make(engine)
    low = request('{"input": {"prompt": "x"}, "policy": {"lowPriority": true}}')
    normal = request('{"input": {"prompt": "x"}}')
    jobs = [await executor.submit(body, sync=False) for body in (low, low, normal)]
    assert executor.queued == 3 and executor.queued_for_scaling == 1
    await executor.cancel(jobs[0].id)
    assert executor.queued == 2 and executor.queued_for_scaling == 1
    engine.become_ready()
    for job in jobs[1:]:
        await executor.wait(job.id, 5)
    assert executor.queued == 0 and executor.queued_for_scaling == 0
    await executor.drain(1)


async def test_jobs_wait_for_the_engine_then_run() -> None:
    engine = FakeEngine(ready=False)
    executor = make(engine)
    job = await executor.submit(
        request('{"input": {"prompt": "x", "sampling_params": {"max_tokens": 2}}}'), sync=False
    )
    await asyncio.sleep(0.05)
    assert job.status is JobStatus.IN_QUEUE and executor.queued == 1
    engine.become_ready()
    assert (await executor.wait(job.id, 5)).status is JobStatus.COMPLETED
    await executor.drain(1)


async def test_engine_start_failure_fails_queued_jobs_with_a_json_error() -> None:
    engine = FakeEngine(ready=False)
    executor = make(engine)
    job = await executor.submit(request('{"input": {"prompt": "x"}}'), sync=False)
    engine.fail_start("out of memory")
    job = await executor.wait(job.id, 5)
    assert job.status is JobStatus.FAILED
    assert job.error == {
        "message": "the engine failed to start: out of memory",
        "type": "ServiceUnavailableError",
        "param": None,
        "code": 503,
    }
    assert executor.queued == 0
    await executor.drain(1)


async def test_error_mid_stream_fails_the_job_and_keeps_what_was_streamed() -> None:
    engine = FakeEngine(fail_at_step=5)
    executor = make(engine)
    job = await executor.submit(
        request(
            '{"input": {"prompt": "x", "stream": true, "sampling_params": {"max_tokens": 50}}}'
        ),
        sync=False,
    )
    job = await executor.wait(job.id, 5)
    body = status_body(job)
    assert body["status"] == "FAILED" and "output" not in body
    assert body["error"] == {
        "message": "RuntimeError: the engine broke mid-generation",
        "type": "InternalServerError",
        "param": None,
        "code": 500,
    }
    _, chunks = await executor.take_stream(job.id)
    assert [len(c["choices"][0]["tokens"]) for c in chunks] == [1, 3]
    await executor.drain(1)


async def test_retry_requeues_failed_job_under_the_same_id() -> None:
    engine = FakeEngine(fail_at_step=0)
    executor = make(engine)
    job = await executor.wait(
        (
            await executor.submit(
                request('{"input": {"prompt": "x", "sampling_params": {"max_tokens": 2}}}'),
                sync=False,
            )
        ).id,
        5,
    )
    assert job.status is JobStatus.FAILED
    engine.fail_at_step = None
    retried = await executor.retry(job.id)
    assert retried.id == job.id and retried.status is JobStatus.IN_QUEUE and retried.error is None
    job = await executor.wait(retried.id, 5)
    assert job.status is JobStatus.COMPLETED and job.attempts == 2
    assert [r.request_id for r in engine.started] == [f"job-{job.id}-1", f"job-{job.id}-2"]
    assert (await executor.health())["jobs"]["retried"] == 1
    with pytest.raises(ConflictError):
        await executor.retry(job.id)
    await executor.drain(1)


async def test_every_final_state_is_reported_once() -> None:
    finished: list[str] = []
    engine = FakeEngine(step_delay=0.01)
    executor = JobExecutor(
        engine, JobSettings(), on_finish=lambda job: finished.append(job.status.value)
    )
    ok = await executor.submit(
        request('{"input": {"prompt": "x", "sampling_params": {"max_tokens": 1}}}'), sync=True
    )
    await executor.wait(ok.id, 5)
    slow = await executor.submit(
        request('{"input": {"prompt": "x", "sampling_params": {"max_tokens": 500}}}'), sync=False
    )
    await until(lambda: slow.status is JobStatus.IN_PROGRESS)
    await executor.cancel(slow.id)
    # Built without the route's checks: a client's executionTimeout is 5 s at least.
    timed = await executor.submit(
        JobRequest.model_validate_json(
            '{"input": {"prompt": "x", "sampling_params": {"max_tokens": 500}}, "policy": {"executionTimeout": 30}}'
        ),
        sync=False,
    )
    await executor.wait(timed.id, 5)
    assert finished == ["COMPLETED", "CANCELLED", "TIMED_OUT"]
    await executor.drain(1)


async def test_unknown_job_is_404() -> None:
    executor = make(FakeEngine())
    for verb in (executor.get, executor.cancel, executor.retry):
        with pytest.raises(JobNotFound) as info:
            await verb("nope")
        assert info.value.status_code == 404
    await executor.drain(1)


async def test_webhook_gets_the_final_status_and_is_retried() -> None:
    posts = Posts(statuses=[500, 503, 200])
    executor = make(FakeEngine(), posts)
    job = await executor.submit(
        request(
            '{"input": {"prompt": "x", "sampling_params": {"max_tokens": 1}}, "webhook": "http://hooks.example/done"}'
        ),
        sync=False,
    )
    await executor.wait(job.id, 5)
    await until(lambda: len(posts.calls) == 3)
    url, payload = posts.calls[-1]
    assert url == "http://hooks.example/done"
    assert payload == status_body(job) and payload["status"] == "COMPLETED"
    await executor.drain(1)


async def test_health_reports_counts_and_engine_state() -> None:
    engine = FakeEngine(step_delay=0.05)
    executor = make(engine)
    job = await executor.submit(
        request('{"input": {"prompt": "x", "sampling_params": {"max_tokens": 100}}}'), sync=False
    )
    await until(lambda: job.status is JobStatus.IN_PROGRESS)
    health = await executor.health()
    assert health["jobs"]["inProgress"] == 1
    assert health["engine"] == {"state": "busy", "running": 1, "waiting": 0}
    await executor.cancel(job.id)
    health = await executor.health()
    assert health["jobs"]["cancelled"] == 1 and health["engine"]["state"] == "idle"
    await executor.drain(1)


async def test_openai_route_job_returns_the_routes_json() -> None:
    engine = FakeEngine()
    executor = make(engine)
    job = await executor.submit(
        request('{"input": {"openai_route": "/v1/completions", "openai_input": {"prompt": "hi"}}}'),
        sync=True,
    )
    job = await executor.wait(job.id, 5)
    assert job.output == {"object": "echo", "route": "/v1/completions", "body": {"prompt": "hi"}}
    models = await executor.wait(
        (await executor.submit(request('{"input": {"openai_route": "/v1/models"}}'), sync=True)).id,
        5,
    )
    assert models.output["data"][0]["id"] == "demo"
    await executor.drain(1)


async def test_openai_route_error_fails_the_job_with_the_routes_error() -> None:
    executor = make(FakeEngine())
    job = await executor.submit(
        request(
            '{"input": {"openai_route": "/v1/completions", "openai_input": {"prompt": "hi", "fail": true}}}'
        ),
        sync=True,
    )
    job = await executor.wait(job.id, 5)
    assert job.status is JobStatus.FAILED
    assert job.error == {
        "message": "/v1/completions: bad things",
        "type": "BadRequestError",
        "param": None,
        "code": 400,
    }
    await executor.drain(1)


async def test_stopped_jobs_report_what_they_used_on_their_status() -> None:
    """The one-pod runtime (no gateway) says what a timed-out or cancelled job used, as the
    shared queue's record does; a job cancelled while queued used nothing."""
    engine = FakeEngine(step_delay=0.02)
    executor = make(engine, default_execution_timeout_ms=150)
    body = '{"input": {"prompt": "a b", "sampling_params": {"max_tokens": 1000}}}'
    timed_out = await executor.wait((await executor.submit(request(body), sync=False)).id, 5)
    assert timed_out.status is JobStatus.TIMED_OUT
    usage = status_body(timed_out)["usage"]
    assert usage["input"] == 2 and usage["output"] >= 1
    streamed = (
        '{"input": {"prompt": "a b", "stream": true, "sampling_params": {"max_tokens": 1000}}}'
    )
    running = await executor.submit(request(streamed), sync=False)
    await until(lambda: len(running.chunks) >= 2)
    cancelled = await executor.cancel(running.id)
    assert status_body(cancelled)["usage"]["output"] >= 2
    await executor.drain(1)
    idle = make(FakeEngine(ready=False))
    queued = await idle.cancel((await idle.submit(request(body), sync=False)).id)
    assert "usage" not in status_body(queued)
    await idle.drain(1)
