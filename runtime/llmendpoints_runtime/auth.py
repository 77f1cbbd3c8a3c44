"""API keys: `Authorization: Bearer <key>` or `x-api-key: <key>`, compared in constant time.

Keys come from API_KEYS / API_KEY and from API_KEYS_FILE (a mounted Secret, one key per line,
`#` comments allowed). The file is re-read when its modification time changes, checked at most
once a second, so rotating the Secret needs no restart. Keys are never logged.

The caller's identity -- who owns the jobs it submits -- is left in the request's scope
(``caller_owner``): keys here have no names, so a key is known by a short hash of it (never the
key); with no keys configured every caller is the same owner, "". An admin key (ADMIN_API_KEYS)
is nobody's in particular: None, which reaches every job.
"""

from __future__ import annotations

import hmac
import logging
import os
import time

from llmendpoints_common.errors import AuthenticationError
from llmendpoints_common.jobs.service import key_owner
from starlette.types import ASGIApp, Receive, Scope, Send

from llmendpoints_runtime.errors import send_error

logger = logging.getLogger("llmendpoints.auth")

_OWNER = "llmep_owner"


def caller_owner(scope: Scope) -> str | None:
    """The owner name of the request's caller (set by APIKeyMiddleware; "" without keys; None
    for an admin key)."""
    return scope.get("state", {}).get(_OWNER, "")


def job_owner(scope: Scope) -> str:
    """The owner recorded with a job the caller submits (an admin's jobs are "admin"'s)."""
    owner = caller_owner(scope)
    return "admin" if owner is None else owner


def parse_keys_file(text: str) -> tuple[str, ...]:
    keys = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keys.extend(k.strip() for k in line.split(",") if k.strip())
    return tuple(dict.fromkeys(keys))


def key_from_headers(headers: list[tuple[bytes, bytes]]) -> str | None:
    for name, value in headers:
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
        elif name == b"x-api-key" and value.strip():
            return value.decode("latin-1").strip()
    return None


def declares_body(headers: list[tuple[bytes, bytes]]) -> bool:
    """Whether a request says a body follows (a non-zero Content-Length, or chunked)."""
    for name, value in headers:
        if name == b"transfer-encoding":
            return True
        if name == b"content-length" and value.strip() not in (b"", b"0"):
            return True
    return False


def key_matches(presented: str, keys: tuple[str, ...]) -> bool:
    """Compare against every key without stopping early, so timing says nothing about which."""
    presented_bytes = presented.encode()
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(presented_bytes, key.encode())
    return matched


class KeyStore:
    def __init__(
        self,
        static_keys: tuple[str, ...],
        keys_file: str | None,
        *,
        check_interval: float = 1.0,
        admin_keys: tuple[str, ...] = (),
    ):
        self.static_keys = static_keys
        self.admin_keys = admin_keys
        self.keys_file = keys_file
        self.check_interval = check_interval
        self._file_keys: tuple[str, ...] = ()
        self._file_mtime: float | None = None
        self._checked_at = float("-inf")
        self._refresh(force=True)

    @property
    def enabled(self) -> bool:
        return bool(self.keys_file) or bool(self.static_keys) or bool(self.admin_keys)

    def keys(self) -> tuple[str, ...]:
        self._refresh()
        return self.static_keys + self._file_keys + self.admin_keys

    def _refresh(self, *, force: bool = False) -> None:
        if not self.keys_file:
            return
        now = time.monotonic()
        if not force and now - self._checked_at < self.check_interval:
            return
        self._checked_at = now
        try:
            mtime = os.stat(self.keys_file).st_mtime
            if mtime == self._file_mtime:
                return
            with open(self.keys_file, encoding="utf-8") as handle:
                self._file_keys = parse_keys_file(handle.read())
            self._file_mtime = mtime
            logger.info("loaded %d API key(s) from API_KEYS_FILE", len(self._file_keys))
        except OSError as exc:
            # Fail closed: a configured but unreadable file never opens the server.
            if self._file_mtime is not None or force:
                logger.error(
                    "cannot read API_KEYS_FILE (%s); keeping the previous keys", exc.strerror
                )
            self._file_mtime = None


class APIKeyMiddleware:
    def __init__(self, app: ASGIApp, store: KeyStore, open_paths: frozenset[str]):
        self.app = app
        self.store = store
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.store.enabled or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        presented = key_from_headers(scope["headers"])
        if presented is None or not key_matches(presented, self.store.keys()):
            # Answered from the headers alone: not one byte of the body is read, and when one
            # is on its way the connection is closed rather than left to receive (and discard)
            # it -- whatever Content-Length says, a keyless caller costs only its headers.
            reason = "missing API key" if presented is None else "invalid API key"
            headers = {"www-authenticate": "Bearer"}
            if declares_body(scope["headers"]):
                headers["connection"] = "close"
            await send_error(
                send,
                AuthenticationError(
                    f"{reason}: send `Authorization: Bearer <key>` or `x-api-key: <key>`",
                    headers=headers,
                ),
            )
            return
        # Only the key's hash is kept: the key itself never leaves this frame.
        admin = bool(self.store.admin_keys) and key_matches(presented, self.store.admin_keys)
        scope.setdefault("state", {})[_OWNER] = None if admin else key_owner(presented)
        await self.app(scope, receive, send)
