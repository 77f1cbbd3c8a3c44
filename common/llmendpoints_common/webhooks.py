"""Delivering a job's final status to its webhook.

Whoever moves a job into a final state sends it: a runtime pod for the jobs it runs, the
gateway for jobs it cancels or purges (``QueueJobService(on_final=...)`` calls once per job).

The POST runs in its own task: a slow or dead receiver never holds up other jobs. Delivery
is tried once and retried ``retries`` times ``delay`` seconds apart (RunPod: twice, 10 s);
any 2xx answer counts as delivered. ``pending`` counts deliveries not yet over (their retries
included), so a draining pod can wait for them.

Each attempt resolves the host and checks every address against the destination policy
(``llmendpoints_common.destinations``), then connects to the address it checked -- never to the
name again -- so DNS cannot swap a refused address in between. Redirects are not followed (a
3xx is an answer, not a delivery). A refused destination is not retried.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

from llmendpoints_common.destinations import (
    DestinationPolicy,
    DestinationRefused,
    Resolver,
    redact,
    resolve_checked,
)

log = logging.getLogger(__name__)

PostFn = Callable[[str, dict[str, Any]], Awaitable[int]]
_DEFAULT_PORTS = {"http": 80, "https": 443}

# RunPod's: one attempt and two retries, 10 s apart.
DEFAULT_RETRIES = 2
DEFAULT_RETRY_DELAY_SECONDS = 10.0
DEFAULT_TIMEOUT_SECONDS = 10.0


class WebhookSender:
    def __init__(
        self,
        *,
        retries: int,
        delay_seconds: float,
        timeout_seconds: float,
        policy: DestinationPolicy | None = None,
        resolver: Resolver | None = None,
        post: PostFn | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self._retries = retries
        self._delay = delay_seconds
        self._timeout = timeout_seconds
        self._policy = policy or DestinationPolicy()
        self._resolver = resolver  # None: DNS
        self._post = post or self._http_post
        self._sleep = sleep
        self._tasks: set[asyncio.Task[bool]] = set()
        self._client: httpx.AsyncClient | None = None

    @property
    def pending(self) -> int:
        """Deliveries still being tried (or waiting to retry)."""
        return len(self._tasks)

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
                if 300 <= status < 400:
                    problem += " (redirects are not followed)"
            except DestinationRefused as exc:
                log.warning("webhook for job %s refused: %s", payload.get("id"), exc)
                return False
            except Exception as exc:
                problem = f"{type(exc).__name__}: {exc}"
            log.warning(
                "webhook for job %s to %s: attempt %d/%d failed (%s)",
                payload.get("id"),
                redact(url),
                attempt,
                attempts,
                problem,
            )
            if attempt < attempts:
                await self._sleep(self._delay)
        return False

    async def _http_post(self, url: str, payload: dict[str, Any]) -> int:
        target = httpx.URL(url)
        port = target.port or _DEFAULT_PORTS.get(target.scheme, 80)
        addresses = await resolve_checked(target.host, port, self._policy, resolver=self._resolver)
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self._timeout, follow_redirects=False)
        # The request names the host (Host header, TLS SNI and certificate check) but connects
        # to the address checked above.
        headers = {"host": target.netloc.decode("ascii")}
        extensions = {"sni_hostname": target.host} if target.scheme == "https" else {}
        last: Exception | None = None
        for address in addresses:
            try:
                response = await self._client.post(
                    target.copy_with(host=address),
                    json=payload,
                    headers=headers,
                    extensions=extensions,
                )
            except httpx.ConnectError as exc:
                last = exc  # try the name's next address
                continue
            return response.status_code
        assert last is not None
        raise last

    async def aclose(self, timeout: float | None = None) -> None:
        """Let deliveries in flight finish (bounded by their retries, and by ``timeout`` seconds
        when given: those still being tried then are abandoned, with a warning), then close."""
        if self._tasks:
            _, unfinished = await asyncio.wait(set(self._tasks), timeout=timeout)
            if unfinished:
                log.warning("%d webhook delivery(ies) abandoned at shutdown", len(unfinished))
                for task in unfinished:
                    task.cancel()
                await asyncio.gather(*unfinished, return_exceptions=True)
        if self._client is not None:
            await self._client.aclose()
            self._client = None
