import asyncio

from llmendpoints_runtime.jobs.webhook import WebhookSender


class Recorder:
    def __init__(self, outcomes: list) -> None:
        self.outcomes = outcomes
        self.calls = 0

    async def __call__(self, url: str, payload: dict) -> int:
        self.calls += 1
        outcome = self.outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome


def sender(post: Recorder, sleeps: list[float]) -> WebhookSender:
    async def sleep(seconds: float) -> None:
        sleeps.append(seconds)

    return WebhookSender(retries=2, delay_seconds=10, timeout_seconds=1, post=post, sleep=sleep)


async def test_tried_once_and_retried_twice_ten_seconds_apart() -> None:
    sleeps: list[float] = []
    post = Recorder([ConnectionError("refused"), 502, 500])
    assert await sender(post, sleeps).send("http://x", {"id": "j"}) is False
    assert post.calls == 3 and sleeps == [10, 10]


async def test_first_2xx_ends_delivery() -> None:
    sleeps: list[float] = []
    post = Recorder([500, 204])
    assert await sender(post, sleeps).send("http://x", {"id": "j"}) is True
    assert post.calls == 2 and sleeps == [10]


async def test_a_slow_receiver_does_not_block_the_caller() -> None:
    release = asyncio.Event()

    async def slow_post(url: str, payload: dict) -> int:
        await release.wait()
        return 200

    webhooks = WebhookSender(retries=0, delay_seconds=0, timeout_seconds=1, post=slow_post)
    task = webhooks.send("http://x", {"id": "j"})  # returns at once
    assert not task.done()
    release.set()
    assert await task is True
    await webhooks.aclose()
