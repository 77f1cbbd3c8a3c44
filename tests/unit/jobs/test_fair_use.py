"""Fair use of the engine and the job policy (issue 16): the pure rules, the in-pod store's
byte bound, the executor's sequence-counted admission and ttl, shared by runtime and gateway."""

import asyncio

import pytest
from llmendpoints_common.errors import BadRequestError, RateLimitError
from llmendpoints_common.fair_use import (
    check_max_n,
    lax_int,
    may_ask_for_more_than_one,
    request_sequences,
)
from llmendpoints_common.jobs.models import (
    JobLimits,
    JobRequest,
    JobStatus,
    job_sequences,
    parse_job_request,
)
from llmendpoints_common.jobs.record import (
    JobRecord,
    cancel,
    expires_at,
    finish,
    record_ttl,
    requeue_for_retry,
)
from llmendpoints_common.webhooks import WebhookSender
from llmendpoints_runtime.jobs.executor import JobExecutor
from llmendpoints_runtime.jobs.settings import JobSettings
from llmendpoints_runtime.jobs.store import InMemoryJobStore, Job, job_size

from .fakes import FakeEngine


def refused(body: str, limits: JobLimits | None = None) -> BadRequestError:
    with pytest.raises(BadRequestError) as info:
        parse_job_request(body.encode(), limits)
    assert info.value.status_code == 400
    return info.value


# ---- MAX_N ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [(16, 16), ("17", 17), (" 3 ", 3), (4.0, 4), ("5.0", 5), (True, 1), (2.5, None), ("x", None)],
)
def test_lax_int_reads_numbers_as_vllms_models_do(value, expected) -> None:
    assert lax_int(value) == expected


@pytest.mark.parametrize("name", ["n", "best_of"])
def test_n_and_best_of_above_max_n_are_a_400_naming_the_field(name) -> None:
    assert check_max_n({name: 16}, 16) == 16
    with pytest.raises(BadRequestError) as info:
        check_max_n({name: "17"}, 16, prefix="input.openai_input.")
    assert info.value.param == f"input.openai_input.{name}"
    assert "MAX_N" in info.value.message and "got 17" in info.value.message


def test_sequences_are_n_times_prompts() -> None:
    assert request_sequences("/v1/completions", {"prompt": ["a", "b", "c"], "n": 2}, 16) == 6
    # A flat list of token ids is one prompt.
    assert request_sequences("/v1/completions", {"prompt": [1, 2, 3], "n": 4}, 16) == 4
    assert request_sequences("/v1/chat/completions", {"messages": [], "best_of": 3}, 16) == 3
    batch = {"messages": [[{"role": "user"}], [{"role": "user"}]], "n": 2}
    assert request_sequences("/v1/chat/completions/batch", batch, 16) == 4
    assert request_sequences("/v1/embeddings", {"input": "x", "n": 99}, 16) == 1


def test_the_hot_path_parses_only_bodies_that_may_ask_for_more() -> None:
    chat, completions = "/v1/chat/completions", "/v1/completions"
    assert not may_ask_for_more_than_one(chat, b'{"messages": [{"role": "user"}]}')
    assert may_ask_for_more_than_one(chat, b'{"messages": [], "n": 4}')
    # An escaped key spells "n" without the bytes "n": parsed, then.
    assert may_ask_for_more_than_one(chat, b'{"\\u006e": 4}')
    assert not may_ask_for_more_than_one(completions, b'{"prompt": [1, 2, 3]}')
    assert may_ask_for_more_than_one(completions, b'{"prompt": ["a", "b"]}')
    assert may_ask_for_more_than_one(completions, b'{"prompt" : [[1], [2]]}')
    assert not may_ask_for_more_than_one("/v1/embeddings", b'{"n": 4}')


def test_jobs_bound_n_and_best_of_on_both_kinds_of_input() -> None:
    error = refused('{"input": {"prompt": "x", "sampling_params": {"n": 17}}}')
    assert error.param == "input.sampling_params.n"
    error = refused(
        '{"input": {"openai_route": "/v1/completions", "openai_input": {"prompt": "x", "best_of": 40}}}'
    )
    assert error.param == "input.openai_input.best_of"
    error = refused('{"input": {"prompt": "x", "sampling_params": {"n": 5}}}', JobLimits(max_n=4))
    assert "at most 4" in error.message
    request = parse_job_request(b'{"input": {"prompt": "x", "sampling_params": {"n": 16}}}')
    assert job_sequences(request) == 16


# ---- policy ranges ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("policy", "field"),
    [
        ('{"executionTimeout": 4999}', "policy.executionTimeout"),
        ('{"executionTimeout": 604800001}', "policy.executionTimeout"),
        ('{"ttl": 9999}', "policy.ttl"),
        ('{"ttl": 1000000000000}', "policy.ttl"),
    ],
)
def test_policy_outside_runpods_ranges_is_a_400_naming_the_field(policy, field) -> None:
    error = refused(f'{{"input": {{"prompt": "x"}}, "policy": {policy}}}')
    assert error.param == field and error.message.startswith(f"{field}: must be between")


def test_policy_at_the_range_ends_is_accepted() -> None:
    for policy in ('{"executionTimeout": 5000, "ttl": 10000}', '{"ttl": 604800000}'):
        parse_job_request(f'{{"input": {{"prompt": "x"}}, "policy": {policy}}}'.encode())


def test_settings_lower_the_maxima_and_the_defaults() -> None:
    limits = JobLimits(max_execution_timeout_ms=60_000, max_ttl_ms=120_000)
    error = refused('{"input": {"prompt": "x"}, "policy": {"ttl": 120001}}', limits)
    assert "MAX_JOB_TTL_MS" in error.message and error.param == "policy.ttl"
    error = refused('{"input": {"prompt": "x"}, "policy": {"executionTimeout": 60001}}', limits)
    assert "MAX_EXECUTION_TIMEOUT_MS" in error.message
    assert limits.default_execution_timeout_ms == 60_000 and limits.default_ttl_ms == 120_000
    assert JobLimits().default_execution_timeout_ms == 600_000
    assert JobLimits().default_ttl_ms == 24 * 3_600_000


# ---- message fields -------------------------------------------------------------------------


def test_message_fields_vllm_does_not_know_are_refused_naming_the_field() -> None:
    error = refused(
        '{"input": {"messages": [{"role": "user", "content": "hi", "name": "a"},'
        ' {"role": "user", "content": "x", "padding": "yyyy"}]}}'
    )
    assert error.param == "input.messages[1].padding"
    error = refused(
        '{"input": {"openai_route": "/v1/chat/completions", "openai_input": '
        '{"messages": [{"role": "user", "content": "x", "blob": 1}]}}}'
    )
    assert error.param == "input.openai_input.messages[0].blob"
    # The fields vLLM knows pass.
    parse_job_request(
        b'{"input": {"messages": [{"role": "assistant", "content": null, "tool_calls": [],'
        b' "reasoning": "r"}, {"role": "tool", "content": "1", "tool_call_id": "c"}]}}'
    )


# ---- the shared queue's record ----------------------------------------------------------------


def record(**changes) -> JobRecord:
    fields = {
        "id": "j",
        "endpoint": "e",
        "owner": "",
        "request": {"input": {"prompt": "x"}, "webhook": "http://h/", "policy": {"ttl": 100000}},
        "sync": False,
        "submitted_at": 1000.0,
        "retention_seconds": 1800.0,
        "ttl_seconds": 100.0,
    }
    return JobRecord(**{**fields, **changes})


def test_a_record_lives_until_its_ttl_whatever_its_state() -> None:
    queued = record()
    assert expires_at(queued) == 1100.0 and record_ttl(queued, 1050.0) == 50.0
    done = finish(queued, JobStatus.COMPLETED, now=1010.0, output=[1])
    assert expires_at(done) == 1100.0  # 30 min of retention, cut at the ttl
    done = finish(record(ttl_seconds=None), JobStatus.COMPLETED, now=1010.0)
    assert expires_at(done) == 1010.0 + 1800.0
    assert expires_at(record(ttl_seconds=None)) is None and record_ttl(record(), 5000.0) == 1.0


def test_a_finished_job_keeps_its_output_not_its_input_unless_it_may_be_retried() -> None:
    done = finish(record(), JobStatus.COMPLETED, now=1010.0, output=["text"])
    assert "input" not in done.request and done.output == ["text"]
    assert done.webhook == "http://h/" and done.request["policy"] == {"ttl": 100000}
    assert "input" not in cancel(record(), now=1010.0).request
    failed = finish(record(), JobStatus.FAILED, now=1010.0, error={"message": "x"})
    assert failed.request["input"] == {"prompt": "x"}
    assert requeue_for_retry(failed).request["input"] == {"prompt": "x"}


# ---- the in-pod store: bytes -------------------------------------------------------------------


def stored(job_id: str, text: str) -> Job:
    request = parse_job_request(f'{{"input": {{"prompt": "{text}"}}}}'.encode())
    return Job(id=job_id, request=request, sync=False, ttl_seconds=3600, submitted_at=0.0)


async def test_the_store_is_bounded_by_bytes_dropping_oldest_finished_first() -> None:
    big = "x" * 4000
    store = InMemoryJobStore(100, lambda: 10.0, max_bytes=3 * job_size(stored("s", big)) + 10)
    a, b, c = stored("a", big), stored("b", big), stored("c", big)
    for item in (a, b, c):
        await store.add(item)
    with pytest.raises(RateLimitError) as info:
        await store.add(stored("d", big))
    assert "MAX_STORED_JOB_BYTES" in info.value.message
    a.status, a.finished_at = JobStatus.COMPLETED, 10.0
    await store.save(a)
    await store.add(stored("d", big))  # room made by dropping "a", the oldest finished
    assert await store.get("a") is None and await store.get("b") is b


async def test_a_finished_job_counts_its_result_not_its_input() -> None:
    store = InMemoryJobStore(100, lambda: 10.0, max_bytes=1 << 20)
    item = stored("a", "x" * 10_000)
    await store.add(item)
    before = store.bytes
    item.request = item.request.model_copy(update={"input": None})
    item.status, item.finished_at, item.output = JobStatus.COMPLETED, 10.0, ["short"]
    await store.save(item)
    assert store.bytes < before - 9_000


# ---- the executor ----------------------------------------------------------------------------


def executor_for(engine: FakeEngine, **settings) -> JobExecutor:
    executor = JobExecutor(
        engine,
        JobSettings(**settings),
        webhooks=WebhookSender(retries=0, delay_seconds=0, timeout_seconds=1),
    )
    executor.start()
    return executor


async def until(predicate, timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.005)


@pytest.mark.parametrize(
    ("limit", "n"),
    [(4, 4), (2, 3)],
    ids=["a-heavy-job-holds-every-slot", "a-job-heavier-than-the-whole-limit-runs-alone"],
)
async def test_jobs_are_admitted_by_sequences(limit: int, n: int) -> None:
    """A job takes one slot per sequence: one with ``n`` as large as MAX_CONCURRENCY holds them
    all, one larger still runs (alone, rather than never), and a light job waits behind either,
    counted as queued, until the heavy one ends."""
    engine = FakeEngine(step_delay=0.01)
    executor = executor_for(engine, max_concurrency=limit)
    heavy = await executor.submit(
        parse_job_request(
            b'{"input": {"prompt": "x", "sampling_params": {"n": %d, "max_tokens": 10000}}}' % n
        ),
        sync=False,
    )
    await until(lambda: heavy.status is JobStatus.IN_PROGRESS)
    light = await executor.submit(
        parse_job_request(b'{"input": {"prompt": "x", "sampling_params": {"max_tokens": 1}}}'),
        sync=False,
    )
    await asyncio.sleep(0.2)
    assert light.status is JobStatus.IN_QUEUE
    assert (executor.running_sequences, executor.queued_for_scaling) == (n, 1)
    await executor.cancel(heavy.id)
    assert (await executor.wait(light.id, 10)).status is JobStatus.COMPLETED
    await executor.drain(1)


async def test_a_finished_job_has_no_input_and_a_failed_one_keeps_it_for_retry() -> None:
    executor = executor_for(FakeEngine())
    done = await executor.submit(
        parse_job_request(b'{"input": {"prompt": "x", "sampling_params": {"max_tokens": 1}}}'),
        sync=True,
    )
    done = await executor.wait(done.id, 10)
    assert done.status is JobStatus.COMPLETED and done.output
    assert done.request.input is None
    await executor.drain(1)
    failing = executor_for(FakeEngine(fail_at_step=0))
    job = await failing.submit(parse_job_request(b'{"input": {"prompt": "x"}}'), sync=False)
    job = await failing.wait(job.id, 10)
    assert job.status is JobStatus.FAILED and job.request.input is not None
    await failing.drain(1)


async def test_a_job_still_queued_at_the_end_of_its_ttl_is_not_started() -> None:
    clock = [1000.0]
    engine = FakeEngine(ready=False)
    executor = JobExecutor(
        engine,
        JobSettings(),
        webhooks=WebhookSender(retries=0, delay_seconds=0, timeout_seconds=1),
        clock=lambda: clock[0],
    )
    executor.start()
    job = await executor.submit(
        JobRequest.model_validate({"input": {"prompt": "x"}, "policy": {"ttl": 10_000}}),
        sync=False,
    )
    clock[0] += 11  # the engine starts after the job's life ended
    engine.become_ready()
    job = await executor.wait(job.id, 10)
    assert job.status is JobStatus.TIMED_OUT and job.error["param"] == "policy.ttl"
    assert engine.started == []
    await executor.drain(1)
