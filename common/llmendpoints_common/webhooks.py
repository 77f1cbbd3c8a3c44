"""Delivering a job's final status to its webhook.

Whoever moves a job into a final state sends it: a runtime pod for the jobs it runs, the
gateway for jobs it cancels or purges (``QueueJobService(on_final=...)`` calls once per job).

The POST runs in its own task: a slow or dead receiver never holds up other jobs. Delivery
is tried once and retried ``retries`` times ``delay`` seconds apart (RunPod: twice, 10 s);
any 2xx answer counts as delivered. ``pending`` counts deliveries not yet over (their retries
and those waiting for a slot included), so a draining pod can wait for them.

A receiver is someone else's server, so what one can cost us is bounded:

- **One deadline per attempt** (``timeout_seconds``, WEBHOOK_TIMEOUT_SECONDS): from resolving
  the name to the end of the answer's headers. httpx's own timeouts are per phase (per read),
  so a receiver that trickles a byte every few seconds would never trip them; the deadline is
  an asyncio timeout around the whole attempt instead, and httpx's are off.
- **The answer's body is never read**: its status line is all a delivery needs. The response
  is streamed and closed after the headers (which closes the connection); what the HTTP
  client buffered with them is at most one socket read (64 KiB), and h11 refuses headers over
  16 KiB. An endless answer costs nothing.
- **At most ``max_concurrency`` attempts at once** (WEBHOOK_MAX_CONCURRENCY): the rest wait
  for a slot -- never dropped -- and the deadline starts once an attempt has its slot. Retry
  delays hold no slot.
- **Every failed attempt is logged** (a warning) with the job id, the destination as
  ``scheme://host:port`` and the reason. Never the path, userinfo or query: tokens live there
  (Slack and Discord put theirs in the path). The reason is escaped (it may quote the
  receiver's bytes) and never repeats the URL.

Each attempt resolves the host and checks every address against the destination policy
(``llmendpoints_common.destinations``), then connects to the address it checked -- never to the
name again -- so DNS cannot swap a refused address in between. Redirects are not followed (a
3xx is an answer, not a delivery). A refused destination is not retried. Connections are never
reused: the client's pool is keyed by the address, and a connection opened (and its TLS
certificate checked) for one host name must not carry another name's request.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit

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
DEFAULT_MAX_CONCURRENCY = 64
# The longest reason a log line carries (an exception's text can quote a receiver's bytes).
_MAX_REASON_CHARS = 300


class WebhookSender:
    def __init__(
        self,
        *,
        retries: int,
        delay_seconds: float,
        timeout_seconds: float,
        max_concurrency: int = DEFAULT_MAX_CONCURRENCY,
        policy: DestinationPolicy | None = None,
        resolver: Resolver | None = None,
        post: PostFn | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be at least 1, not {max_concurrency}")
        self._retries = retries
        self._delay = delay_seconds
        self._timeout = timeout_seconds
        self._slots = asyncio.Semaphore(max_concurrency)
        self._policy = policy or DestinationPolicy()
        self._resolver = resolver  # None: DNS
        self._post = post or self._http_post
        self._sleep = sleep
        self._tasks: set[asyncio.Task[bool]] = set()
        self._client: httpx.AsyncClient | None = None

    @property
    def pending(self) -> int:
        """Deliveries not over yet: being tried, waiting for a slot, or waiting to retry."""
        return len(self._tasks)

    def send(self, url: str, payload: dict[str, Any]) -> asyncio.Task[bool]:
        """Start delivering; returns the task (True when delivered) for those who care."""
        task = asyncio.create_task(self._deliver(url, payload))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _deliver(self, url: str, payload: dict[str, Any]) -> bool:
        job_id = payload.get("id")
        where = redact(url, path=False)
        attempts = 1 + self._retries
        for attempt in range(1, attempts + 1):
            try:
                status = await self._attempt(url, payload)
                if 200 <= status < 300:
                    return True
                problem = f"HTTP {status}"
                if 300 <= status < 400:
                    problem += " (redirects are not followed)"
            except DestinationRefused as exc:
                log.warning(
                    "webhook for job %s refused, not retried: %s", job_id, _printable(str(exc))
                )
                return False
            except TimeoutError:
                problem = (
                    f"no answer (status line and headers) within {self._timeout:g} s "
                    "(WEBHOOK_TIMEOUT_SECONDS)"
                )
            except Exception as exc:
                problem = _describe(exc, url)
            log.warning(
                "webhook for job %s to %s: attempt %d/%d failed: %s",
                job_id,
                where,
                attempt,
                attempts,
                problem,
            )
            if attempt < attempts:
                await self._sleep(self._delay)
        return False

    async def _attempt(self, url: str, payload: dict[str, Any]) -> int:
        """One attempt: a slot, then everything up to the status code within the deadline."""
        async with self._slots:
            async with asyncio.timeout(self._timeout):
                return await self._post(url, payload)

    async def _http_post(self, url: str, payload: dict[str, Any]) -> int:
        target = httpx.URL(url)
        port = target.port or _DEFAULT_PORTS.get(target.scheme, 80)
        addresses = await resolve_checked(target.host, port, self._policy, resolver=self._resolver)
        if self._client is None:
            self._client = httpx.AsyncClient(
                timeout=None,  # the attempt's deadline (above) bounds it all
                follow_redirects=False,
                # No pool: one connection per attempt, closed after it (see the module's notes).
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=0),
            )
        # The request names the host (Host header, TLS SNI and certificate check) but connects
        # to the address checked above.
        headers = {"host": target.netloc.decode("ascii"), "connection": "close"}
        extensions = {"sni_hostname": target.host} if target.scheme == "https" else {}
        last: Exception | None = None
        for address in addresses:
            try:
                # Streamed, and closed unread: the status line and headers are all we take.
                async with self._client.stream(
                    "POST",
                    target.copy_with(host=address),
                    json=payload,
                    headers=headers,
                    extensions=extensions,
                ) as response:
                    return response.status_code
            except httpx.ConnectError as exc:
                last = exc  # try the name's next address
                continue
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


def _describe(exc: BaseException, url: str) -> str:
    """Why an attempt failed, fit for a log line: the exception's type and text, without the
    URL's secrets (should the text quote the URL) and escaped (it may quote the receiver)."""
    text = str(exc)
    try:
        parts = urlsplit(url)
        secrets = [url, parts.query, parts.fragment, parts.netloc.rpartition("@")[0]]
    except ValueError:
        secrets = [url]
    for secret in sorted(filter(None, secrets), key=len, reverse=True):
        text = text.replace(secret, "***")
    reason = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return _printable(reason)


def _printable(text: str) -> str:
    """``text`` with control characters escaped (no forged log lines), cut to a sane length."""
    if not text.isprintable():
        text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    if len(text) > _MAX_REASON_CHARS:
        text = text[:_MAX_REASON_CHARS] + "..."
    return text
