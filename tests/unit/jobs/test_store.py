import pytest
from llmendpoints_common.errors import RateLimitError
from llmendpoints_runtime.jobs.models import JobStatus, parse_job_request
from llmendpoints_runtime.jobs.store import InMemoryJobStore, Job

REQUEST = parse_job_request(b'{"input": {"prompt": "hi"}}')


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def job(job_id: str, ttl: float = 60.0) -> Job:
    return Job(id=job_id, request=REQUEST, sync=False, ttl_seconds=ttl)


async def finish(store: InMemoryJobStore, item: Job, at: float) -> None:
    item.status, item.finished_at = JobStatus.COMPLETED, at
    await store.save(item)


async def test_finished_jobs_expire_ttl_after_they_finish() -> None:
    clock = Clock()
    store = InMemoryJobStore(10, clock)
    a, b = job("a", ttl=60), job("b", ttl=5)
    await store.add(a)
    await store.add(b)
    await finish(store, a, clock.now)
    await finish(store, b, clock.now)
    clock.now += 4.9
    assert await store.get("b") is b
    clock.now += 0.2
    assert await store.get("b") is None
    assert await store.get("a") is a
    clock.now += 60
    assert await store.get("a") is None
    assert len(store) == 0


async def test_unfinished_jobs_never_expire() -> None:
    clock = Clock()
    store = InMemoryJobStore(10, clock)
    await store.add(job("q", ttl=1))
    clock.now += 10_000
    assert (await store.get("q")).status is JobStatus.IN_QUEUE


async def test_full_store_drops_oldest_finished_then_refuses() -> None:
    clock = Clock()
    store = InMemoryJobStore(2, clock)
    first, second = job("first"), job("second")
    await store.add(first)
    await store.add(second)
    await finish(store, first, clock.now)
    await store.add(job("third"))  # evicts "first", the only finished one
    assert await store.get("first") is None
    with pytest.raises(RateLimitError):
        await store.add(job("fourth"))
    assert (await store.counts())[JobStatus.IN_QUEUE] == 2


async def test_retried_job_does_not_expire_on_its_old_deadline() -> None:
    clock = Clock()
    store = InMemoryJobStore(10, clock)
    item = job("r", ttl=5)
    await store.add(item)
    await finish(store, item, clock.now)
    item.reset_for_retry()
    await store.save(item)
    clock.now += 100
    assert await store.get("r") is item
