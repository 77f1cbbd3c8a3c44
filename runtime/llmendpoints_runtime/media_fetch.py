"""Fetching media that requests name by URL, under the outbound-destination guard.

A chat message may carry ``{"type": "image_url", "image_url": {"url": "http://..."}}``; vLLM
then downloads that URL from inside the pod. Unguarded, that is a server-side request forgery
hole: the URL (or a redirect from an innocent-looking one) can name the cloud metadata service
(169.254.169.254), a link-local address, or anything else the pod can reach. This module is the
fetch vLLM's media connector delegates to (engine/media.py hooks it in), with the same destination
rules as webhooks (llmendpoints_common.destinations):

* the scheme must be http or https (data: URLs are decoded by vLLM without any fetch; file: URLs
  only with ALLOWED_LOCAL_MEDIA_PATH, handled by vLLM);
* every address a host name resolves to is checked *after* DNS, at connection time (the
  resolver below), so a name that resolves to a refused address is refused, and the connection
  goes to exactly the addresses that were checked (no second lookup to rebind);
* literal IP addresses never reach a resolver, so each URL is also checked as written;
* redirects are followed by this code, not by aiohttp, one hop at a time, each hop checked as
  above (at most MAX_REDIRECTS; none when VLLM_MEDIA_URL_ALLOW_REDIRECTS=0);
* ALLOWED_MEDIA_DOMAINS, when set, is the policy's allow-list: every hop must be in it (vLLM's
  own check sees only the first URL);
* proxies from the environment (HTTP_PROXY, ...) are not used: through a proxy the pod would
  never see the address it is really talking to.

Bounds (vLLM's settings, kept): VLLM_IMAGE_FETCH_TIMEOUT seconds per attempt for the whole
redirect chain, VLLM_MEDIA_FETCH_MAX_RETRIES attempts for transient failures (timeouts, refused
connections, 5xx; each attempt's timeout four times the last), VLLM_MAX_MEDIA_DOWNLOAD_SIZE_MB
per response (Content-Length checked first, then the bytes as they arrive).

Every refusal and failure is a `MediaFetchError` with a message naming the URL (redacted: no
credentials, no query) and the reason; engine/media.py turns it into vLLM's 400.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from urllib.parse import urljoin

import aiohttp
from aiohttp.abc import AbstractResolver
from llmendpoints_common.destinations import (
    DestinationPolicy,
    DestinationRefused,
    Resolver,
    check_url,
    redact,
    resolve_checked,
)

REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
MAX_REDIRECTS = 5
_CHUNK = 64 * 1024
_BACKOFF = 4  # vLLM's schedule: attempt N waits 4**N s and gets 4**N times the timeout


def media_policy(allowed_media_domains: list[str] | tuple[str, ...] | None) -> DestinationPolicy:
    """The destination policy for media URLs: the guard's defaults (link-local and metadata
    addresses refused; loopback and private allowed, as for webhooks), plus ALLOWED_MEDIA_DOMAINS
    (vLLM's --allowed-media-domains) as the allow-list every redirect hop must also meet.
    ValueError naming an entry that is neither a host name nor a CIDR."""
    return DestinationPolicy(allowed=tuple(allowed_media_domains or ()))


class MediaFetchError(ValueError):
    """A media URL was refused or could not be fetched; the message says which and why."""


class MediaFetchTransient(Exception):
    """A failure worth another attempt (timeout, connection refused, 5xx)."""


@dataclass(frozen=True)
class MediaFetchLimits:
    timeout: float | None = 5.0  # seconds per attempt, the whole redirect chain
    attempts: int = 3
    max_bytes: int | None = 256 * 1024 * 1024
    follow_redirects: bool = True
    max_redirects: int = MAX_REDIRECTS


class GuardedResolver(AbstractResolver):
    """aiohttp resolver that only ever hands out addresses the policy allows."""

    def __init__(self, policy: DestinationPolicy, resolver: Resolver | None = None):
        self.policy = policy
        self.resolver = resolver

    async def resolve(self, host: str, port: int = 0, family: int = socket.AF_INET):
        # DestinationRefused when any address is refused (aiohttp passes it through).
        addresses = await resolve_checked(host, port, self.policy, resolver=self.resolver)
        return [
            {
                "hostname": host,
                "host": address,
                "port": port,
                "family": socket.AF_INET6 if ":" in address else socket.AF_INET,
                "proto": 0,
                "flags": socket.AI_NUMERICHOST,
            }
            for address in addresses
        ]

    async def close(self) -> None:
        return None


class MediaFetcher:
    """Downloads media bytes under a destination policy. One aiohttp session per event loop.

    ``resolver`` replaces DNS (tests; see llmendpoints_common.destinations.Resolver)."""

    def __init__(self, policy: DestinationPolicy, *, resolver: Resolver | None = None):
        self.policy = policy
        self.resolver = resolver
        self._sessions: dict[asyncio.AbstractEventLoop, aiohttp.ClientSession] = {}
        self._lock = threading.Lock()

    # -- public ----------------------------------------------------------------------------------

    async def fetch(self, url: str, limits: MediaFetchLimits) -> bytes:
        """The body of `url` (following checked redirects); MediaFetchError on any refusal."""
        attempts = max(1, limits.attempts)
        last: BaseException | None = None
        for attempt in range(attempts):
            timeout = None if limits.timeout is None else limits.timeout * _BACKOFF**attempt
            try:
                return await self._attempt(url, limits, timeout)
            except MediaFetchTransient as exc:
                last = exc
                if attempt + 1 < attempts:
                    await asyncio.sleep(_BACKOFF**attempt)
        raise MediaFetchError(f"could not fetch {redact(url)}: {last} (after {attempts} attempts)")

    def fetch_blocking(self, url: str, limits: MediaFetchLimits) -> bytes:
        """`fetch` for vLLM's synchronous code paths (never called on a running event loop)."""
        return _run_blocking(lambda: self._fetch_once_with_own_session(url, limits))

    async def close(self) -> None:
        with self._lock:
            sessions, self._sessions = list(self._sessions.values()), {}
        for session in sessions:
            await session.close()

    # -- internals -------------------------------------------------------------------------------

    async def _fetch_once_with_own_session(self, url: str, limits: MediaFetchLimits) -> bytes:
        try:
            return await self.fetch(url, limits)
        finally:
            loop = asyncio.get_running_loop()
            with self._lock:
                session = self._sessions.pop(loop, None)
            if session is not None:
                await session.close()

    def _session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        with self._lock:
            session = self._sessions.get(loop)
            if session is None or session.closed:
                connector = aiohttp.TCPConnector(
                    resolver=GuardedResolver(self.policy, self.resolver), use_dns_cache=False
                )
                session = aiohttp.ClientSession(connector=connector, trust_env=False)
                self._sessions[loop] = session
        return session

    async def _attempt(self, url: str, limits: MediaFetchLimits, timeout: float | None) -> bytes:
        try:
            async with asyncio.timeout(timeout):
                return await self._follow(url, limits)
        except TimeoutError:
            raise MediaFetchTransient(f"no complete answer within {timeout:g} s") from None

    async def _follow(self, url: str, limits: MediaFetchLimits) -> bytes:
        current = url
        for hop in range(limits.max_redirects + 1):
            self._check(current, original=url, hop=hop)
            body, location = await self._get(current, limits.max_bytes)
            if location is None:
                return body
            if not limits.follow_redirects:
                raise MediaFetchError(
                    f"{redact(url)} redirects to {redact(urljoin(current, location))}; media "
                    "redirects are not followed (VLLM_MEDIA_URL_ALLOW_REDIRECTS=0): send the "
                    "final URL"
                )
            current = urljoin(current, location)
        raise MediaFetchError(f"{redact(url)}: more than {limits.max_redirects} redirects")

    def _check(self, url: str, *, original: str, hop: int) -> None:
        try:
            check_url(url, self.policy, schemes=("http", "https"))
        except DestinationRefused as exc:
            via = f" (redirected from {redact(original)})" if hop else ""
            raise MediaFetchError(f"media URL {redact(url)}{via} refused: {exc}") from None

    async def _get(self, url: str, max_bytes: int | None) -> tuple[bytes, str | None]:
        """One request: (body, None), or (b"", Location) for a redirect."""
        try:
            async with self._session().get(
                url, allow_redirects=False, headers={"User-Agent": "llmendpoints-media"}
            ) as response:
                if response.status in REDIRECT_STATUSES and "Location" in response.headers:
                    return b"", response.headers["Location"]
                if response.status >= 500 or response.status in (408, 429):
                    raise MediaFetchTransient(f"HTTP {response.status}")
                if response.status >= 400:
                    raise MediaFetchError(f"could not fetch {redact(url)}: HTTP {response.status}")
                return await _read_bounded(response, url, max_bytes), None
        except DestinationRefused as exc:  # from the resolver, after DNS
            raise MediaFetchError(f"media URL {redact(url)} refused: {exc}") from None
        except (aiohttp.ClientConnectorDNSError, aiohttp.InvalidURL) as exc:
            raise MediaFetchError(f"could not fetch {redact(url)}: {_describe(exc)}") from None
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, OSError) as exc:
            raise MediaFetchTransient(_describe(exc)) from None


async def _read_bounded(response: aiohttp.ClientResponse, url: str, max_bytes: int | None) -> bytes:
    def too_big(received: int) -> MediaFetchError:
        return MediaFetchError(
            f"{redact(url)} is larger than the media download limit of {max_bytes} bytes "
            f"(at least {received} bytes; VLLM_MAX_MEDIA_DOWNLOAD_SIZE_MB)"
        )

    if max_bytes is None:
        return await response.read()
    if response.content_length is not None and response.content_length > max_bytes:
        raise too_big(response.content_length)
    chunks: list[bytes] = []
    received = 0
    async for chunk in response.content.iter_chunked(_CHUNK):
        received += len(chunk)
        if received > max_bytes:
            raise too_big(received)
        chunks.append(chunk)
    return b"".join(chunks)


def _describe(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _run_blocking(make: Callable[[], Awaitable[bytes]]) -> bytes:
    """Run a coroutine to completion from synchronous code, on a thread of its own if this
    thread already runs an event loop (asyncio.run refuses to nest)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(make())
    result: list[bytes] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            result.append(asyncio.run(make()))
        except BaseException as exc:  # handed to the caller's thread
            error.append(exc)

    thread = threading.Thread(target=run, name="media-fetch", daemon=True)
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]
