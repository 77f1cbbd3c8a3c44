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


def job(job_id: str, ttl: float = 3600.0, retention: float = 60.0, at: float = 1000.0) -> Job:
    return Job(
        id=job_id,
        request=REQUEST,
        sync=False,
        ttl_seconds=ttl,
        retention_seconds=retention,
        submitted_at=at,
    )


async def finish(store: InMemoryJobStore, item: Job, at: float) -> None:
    item.status, item.finished_at = JobStatus.COMPLETED, at
    await store.save(item)


async def test_finished_jobs_expire_when_their_retention_ends() -> None:
    clock = Clock()
    store = InMemoryJobStore(10, clock)
    a, b = job("a", retention=60), job("b", retention=5)
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


async def test_a_result_is_never_kept_past_the_jobs_ttl() -> None:
    clock = Clock()
    store = InMemoryJobStore(10, clock)
    # Submitted at 1000 with a 100 s life, finished at 1090: kept 10 s, not its 30 min.
    item = job("t", ttl=100, retention=1800)
    await store.add(item)
    clock.now = 1090.0
    await finish(store, item, clock.now)
    clock.now = 1099.9
    assert await store.get("t") is item
    clock.now = 1100.1
    assert await store.get("t") is None


async def test_unfinished_jobs_never_expire() -> None:
    clock = Clock()
    store = InMemoryJobStore(10, clock)
    await store.add(job("q", ttl=10))
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
    item = job("r", retention=5)
    await store.add(item)
    await finish(store, item, clock.now)
    item.reset_for_retry()
    await store.save(item)
    clock.now += 100
    assert await store.get("r") is item
