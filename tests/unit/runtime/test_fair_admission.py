"""Sequence-counted admission (issue 16) and the message fields jobs accept, checked against
vLLM 0.32's own chat message types."""

from __future__ import annotations

import asyncio
import typing

import pytest
from llmendpoints_common.errors import RateLimitError
from llmendpoints_common.jobs.models import MESSAGE_FIELDS
from llmendpoints_runtime.admission import AdmissionQueue


async def test_a_request_holds_as_many_slots_as_it_runs_sequences():
    queue = AdmissionQueue(limit=4, max_waiting=8)
    await queue.acquire(4)
    small = asyncio.create_task(queue.acquire(1))
    await asyncio.sleep(0)
    assert (queue.running, queue.waiting, queue.waiting_requests) == (4, 1, 1)
    assert not small.done()
    queue.release(4)
    await asyncio.wait_for(small, 1)
    assert (queue.running, queue.waiting) == (1, 0)


async def test_the_queue_is_fifo_a_heavy_head_is_not_overtaken():
    queue = AdmissionQueue(limit=4, max_waiting=16)
    await queue.acquire(2)
    order: list[str] = []

    async def take(name: str, weight: int) -> None:
        await queue.acquire(weight)
        order.append(name)

    heavy = asyncio.create_task(take("heavy", 4))
    await asyncio.sleep(0)
    light = asyncio.create_task(take("light", 1))
    await asyncio.sleep(0)
    # Two slots are free, enough for "light", but "heavy" is ahead of it.
    assert order == [] and queue.waiting == 5
    queue.release(2)
    await asyncio.wait_for(heavy, 1)
    assert order == ["heavy"] and not light.done()
    queue.release(4)
    await asyncio.wait_for(light, 1)
    assert order == ["heavy", "light"]


async def test_the_waiting_bound_counts_sequences():
    queue = AdmissionQueue(limit=2, max_waiting=3)
    await queue.acquire(2)
    waiter = asyncio.create_task(queue.acquire(2))
    await asyncio.sleep(0)
    with pytest.raises(RateLimitError) as info:
        await queue.acquire(2)  # 2 waiting + 2 > 3
    assert "sequences" in info.value.message
    queue.release(2)
    await asyncio.wait_for(waiter, 1)


async def test_a_request_heavier_than_the_whole_limit_runs_alone():
    queue = AdmissionQueue(limit=3, max_waiting=100)
    await queue.acquire(1)
    heavy = asyncio.create_task(queue.acquire(10))
    await asyncio.sleep(0)
    assert not heavy.done() and queue.waiting == 3
    queue.release(1)
    assert await asyncio.wait_for(heavy, 1) == 3  # it holds every slot, no more
    assert (queue.running, queue.waiting) == (3, 0)
    light = asyncio.create_task(queue.acquire(1))
    await asyncio.sleep(0)
    assert not light.done()
    queue.release(3)
    await asyncio.wait_for(light, 1)


async def test_a_cancelled_heavy_head_lets_the_next_in():
    queue = AdmissionQueue(limit=4, max_waiting=16)
    await queue.acquire(3)
    heavy = asyncio.create_task(queue.acquire(4))
    await asyncio.sleep(0)
    light = asyncio.create_task(queue.acquire(1))
    await asyncio.sleep(0)
    heavy.cancel()
    with pytest.raises(asyncio.CancelledError):
        await heavy
    await asyncio.wait_for(light, 1)
    assert (queue.running, queue.waiting) == (4, 0)


def test_job_message_fields_are_exactly_those_vllm_knows():
    chat_utils = pytest.importorskip("vllm.renderers.chat_utils")
    from openai.types import chat

    known: set[str] = set()
    for kind in (
        chat_utils.CustomChatCompletionMessageParam,
        chat_utils.ConversationMessage,
        *typing.get_args(chat.ChatCompletionMessageParam),
    ):
        known |= set(typing.get_type_hints(kind))
    assert known == MESSAGE_FIELDS
