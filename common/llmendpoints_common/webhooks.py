"""Delivering a job's final status to its webhook.

Whoever moves a job into a final state sends it: a runtime pod for the jobs it runs, the
gateway for jobs it cancels or purges (``QueueJobService(on_final=...)`` calls once per job).

The POST runs in its own task: a slow or dead receiver never holds up other jobs. Delivery
is tried once and retried ``retries`` times ``delay`` seconds apart (RunPod: twice, 10 s);
any 2xx answer counts as delivered. ``pending`` counts deliveries not yet over (their retries
and those waiting for a slot included), so a draining pod can wait for them.

A receiver is someone else's server, so what one can cost us is bounded:

- **One deadline per attempt** (``timeout_seconds``, WEBHOOK_TIMEOUT_SECONDS): from resolving
  the name to the answer's status line, one asyncio timeout around the whole attempt. (An HTTP
  client's timeouts are per phase -- per read --, so a receiver that trickles a byte every few
  seconds would never trip them.)
- **Nothing past the status line is read**: the status code is all a delivery needs. The
  answer is read ``_READ_BYTES`` (4 KiB) at a time into one buffer, up to its final status line
  (``_MAX_HEAD_BYTES``, 8 KiB, for it and any 1xx interim answers), then the connection is
  aborted. An endless answer costs a few KiB. This is why the POST is written here on asyncio's
  transports rather than sent with httpx: httpx (through anyio) keeps reading the socket, 64
  to 256 KiB at a time with no flow control, for as long as the response is open, and reads
  the headers whole (measured in bench/abuse_webhooks.py).
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
3xx is an answer, not a delivery). A refused destination is not retried. Each attempt opens
its own connection and aborts it when done: nothing is pooled, so a connection opened (and its
TLS certificate checked) for one host name can never carry another name's request.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import re
import ssl
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
# The answer is read this much at a time, and no further than its final status line, which
# (with any 1xx interim answers before it) must come within _MAX_HEAD_BYTES.
_READ_BYTES = 4096
_MAX_HEAD_BYTES = 8192
_STATUS_LINE = re.compile(rb"HTTP/1\.[0-9] ([0-9]{3})(?:[ \t][^\r\n]*)?")


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
        self._ssl: ssl.SSLContext | None = None

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
                problem = f"no status line within {self._timeout:g} s (WEBHOOK_TIMEOUT_SECONDS)"
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
        target = httpx.URL(url)  # parsed as before (IDNA, percent-encoding, default ports)
        if target.scheme not in _DEFAULT_PORTS:  # checked at submission too
            raise DestinationRefused(f"scheme {target.scheme!r} is not allowed; use http or https")
        port = target.port or _DEFAULT_PORTS[target.scheme]
        addresses = await resolve_checked(target.host, port, self._policy, resolver=self._resolver)
        request = _request(target, payload)
        tls = target.scheme == "https"
        if tls and self._ssl is None:
            self._ssl = httpx.create_ssl_context()  # httpx's trust store, as before
        loop = asyncio.get_running_loop()
        last: OSError | None = None
        for address in addresses:
            try:
                # Connects to the address checked above; the request and the TLS name (SNI and
                # certificate check) are the URL's host.
                transport, answer = await loop.create_connection(
                    _StatusLine,
                    host=address,
                    port=port,
                    ssl=self._ssl if tls else None,
                    server_hostname=target.raw_host.decode("ascii") if tls else None,
                )
            except OSError as exc:
                last = exc  # try the name's next address
                continue
            try:
                transport.write(request)
                return await answer.status
            finally:
                transport.abort()  # at once: no flushing to, or reading from, the receiver
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


def _request(target: httpx.URL, payload: dict[str, Any]) -> bytes:
    """The POST, whole: JSON as httpx wrote it; credentials in the URL sent as Basic auth, as
    httpx did."""
    body = json.dumps(payload, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()
    head = [
        f"POST {target.raw_path.decode('ascii')} HTTP/1.1",
        f"Host: {target.netloc.decode('ascii')}",
        "User-Agent: llmendpoints-webhooks",
        "Content-Type: application/json",
        f"Content-Length: {len(body)}",
        "Connection: close",
    ]
    if target.userinfo:
        credentials = f"{target.username}:{target.password}".encode()
        head.append(f"Authorization: Basic {base64.b64encode(credentials).decode('ascii')}")
    # httpx.URL refuses control characters and percent-encodes spaces: no header injection.
    return ("\r\n".join(head) + "\r\n\r\n").encode("ascii") + body


def final_status(head: bytes | bytearray) -> int | None:
    """The status code of the final answer that ``head`` (the first bytes of an HTTP/1.x
    answer) starts with; None while more bytes are needed. 1xx interim answers (100 Continue,
    103 Early Hints) are skipped; ValueError for anything that is not an HTTP/1.x answer."""
    start = 0
    while True:
        if not head.startswith(b"HTTP/"[: len(head) - start], start):
            raise ValueError(f"not an HTTP/1.x answer: {bytes(head[start : start + 40])!r}")
        end = head.find(b"\r\n", start)
        if end < 0:
            return None
        match = _STATUS_LINE.fullmatch(head, start, end)
        if match is None:
            raise ValueError(f"not an HTTP/1.x status line: {bytes(head[start:end][:80])!r}")
        status = int(match[1])
        if not 100 <= status < 200 or status == 101:
            return status
        head_end = head.find(b"\r\n\r\n", end)
        if head_end < 0:
            return None
        start = head_end + 4


class _StatusLine(asyncio.BufferedProtocol):
    """Reads an answer into one small buffer up to its final status line, then stops reading.

    ``status`` resolves with the code, or fails (not HTTP, too long, connection closed).
    """

    def __init__(self) -> None:
        self.status: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._buffer = bytearray(_READ_BYTES)
        self._head = bytearray()
        self._transport: asyncio.BaseTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport

    def get_buffer(self, sizehint: int) -> bytearray:
        return self._buffer  # every read is at most _READ_BYTES, whatever the sender has

    def buffer_updated(self, nbytes: int) -> None:
        if self.status.done():
            return
        self._head += self._buffer[:nbytes]
        try:
            status = final_status(self._head)
        except ValueError as exc:
            self._fail(exc)
            return
        if status is not None:
            self.status.set_result(status)
        elif len(self._head) >= _MAX_HEAD_BYTES:
            self._fail(ValueError(f"no status line in the answer's first {_MAX_HEAD_BYTES} bytes"))
        else:
            return
        assert self._transport is not None
        self._transport.pause_reading()  # type: ignore[attr-defined]

    def eof_received(self) -> bool:
        self._fail(ConnectionError("the receiver closed the connection without a status line"))
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(exc or ConnectionError("connection closed without a status line"))

    def _fail(self, exc: BaseException) -> None:
        if not self.status.done():
            self.status.set_exception(exc)
            # Marked as seen: when an attempt ends at its deadline while connecting, nobody
            # awaits this future, and asyncio would log "exception was never retrieved".
            self.status.exception()


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
