"""Delivering a job's final status to its webhook.

The POST runs in its own task: a slow or dead receiver never holds up other jobs. Delivery
is tried once and retried ``retries`` times ``delay`` seconds apart (RunPod: twice, 10 s);
any 2xx answer counts as delivered.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

log = logging.getLogger(__name__)

PostFn = Callable[[str, dict[str, Any]], Awaitable[int]]


class WebhookSender:
    def __init__(
        self,
        *,
        retries: int,
        delay_seconds: float,
        timeout_seconds: float,
        post: PostFn | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self._retries = retries
        self._delay = delay_seconds
        self._timeout = timeout_seconds
        self._post = post or self._http_post
        self._sleep = sleep
        self._tasks: set[asyncio.Task[bool]] = set()
        self._client: httpx.AsyncClient | None = None

    def send(self, url: str, payload: dict[str, Any]) -> asyncio.Task[bool]:
        """Start delivering; returns the task (True when delivered) for those who care."""
        task = asyncio.create_task(self._deliver(url, payload))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _deliver(self, url: str, payload: dict[str, Any]) -> bool:
        attempts = 1 + self._retries
        for attempt in range(1, attempts + 1):
            try:
                status = await self._post(url, payload)
                if 200 <= status < 300:
                    return True
                problem = f"HTTP {status}"
            except Exception as exc:
                problem = f"{type(exc).__name__}: {exc}"
            log.warning(
                "webhook for job %s: attempt %d/%d failed (%s)",
                payload.get("id"),
                attempt,
                attempts,
                problem,
            )
            if attempt < attempts:
                await self._sleep(self._delay)
        return False

    async def _http_post(self, url: str, payload: dict[str, Any]) -> int:
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self._timeout)
        response = await self._client.post(url, json=payload)
        return response.status_code

    async def aclose(self) -> None:
        """Let deliveries in flight finish (bounded by their retries), then close."""
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._client is not None:
            await self._client.aclose()
            self._client = None
