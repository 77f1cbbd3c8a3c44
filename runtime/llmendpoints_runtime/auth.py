"""API keys: `Authorization: Bearer <key>` or `x-api-key: <key>`, compared in constant time.

Keys come from API_KEYS / API_KEY and from API_KEYS_FILE (a mounted Secret, one key per line,
`#` comments allowed); admin keys from ADMIN_API_KEYS and ADMIN_API_KEYS_FILE, the same way.
Files are re-read when their modification time changes, checked at most once a second, so
rotating the Secret needs no restart. Keys are never logged.

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
_ADMIN = "llmep_admin"


def caller_is_admin(scope: Scope) -> bool:
    """The request came with an admin key (ADMIN_API_KEYS / ADMIN_API_KEYS_FILE); never true
    on a server without admin keys."""
    return scope.get("state", {}).get(_ADMIN) is True


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


class KeyFile:
    """Keys from a mounted file, re-read when its modification time changes (checked at most
    every ``check_interval`` seconds). A configured file that cannot be read keeps the keys it
    had -- none if it never could be read: it fails closed, never open."""

    def __init__(self, path: str | None, setting: str, *, check_interval: float = 1.0):
        self.path = path
        self.setting = setting
        self.check_interval = check_interval
        self._keys: tuple[str, ...] = ()
        self._mtime: float | None = None
        self._checked_at = float("-inf")
        self.refresh(force=True)

    def keys(self) -> tuple[str, ...]:
        self.refresh()
        return self._keys

    def refresh(self, *, force: bool = False) -> None:
        if not self.path:
            return
        now = time.monotonic()
        if not force and now - self._checked_at < self.check_interval:
            return
        self._checked_at = now
        try:
            mtime = os.stat(self.path).st_mtime
            if mtime == self._mtime:
                return
            with open(self.path, encoding="utf-8") as handle:
                self._keys = parse_keys_file(handle.read())
            self._mtime = mtime
            logger.info("loaded %d key(s) from %s", len(self._keys), self.setting)
        except OSError as exc:
            # Fail closed: a configured but unreadable file never opens the server.
            if self._mtime is not None or force:
                logger.error(
                    "cannot read %s (%s); keeping the previous keys", self.setting, exc.strerror
                )
            self._mtime = None


class KeyStore:
    """Every key the runtime accepts: API_KEYS (+ API_KEY, API_KEYS_FILE) and the admin keys
    (ADMIN_API_KEYS, ADMIN_API_KEYS_FILE), which authenticate like the others and alone reach
    vLLM's engine-control routes (control_routes.py)."""

    def __init__(
        self,
        static_keys: tuple[str, ...],
        keys_file: str | None,
        *,
        check_interval: float = 1.0,
        admin_keys: tuple[str, ...] = (),
        admin_keys_file: str | None = None,
    ):
        self.static_keys = static_keys
        self.static_admin_keys = admin_keys
        self.keys_file = keys_file
        self.admin_keys_file = admin_keys_file
        self._file = KeyFile(keys_file, "API_KEYS_FILE", check_interval=check_interval)
        self._admin_file = KeyFile(
            admin_keys_file, "ADMIN_API_KEYS_FILE", check_interval=check_interval
        )

    @property
    def enabled(self) -> bool:
        """Requests need a key: some API key is configured. Admin keys alone do not turn this
        on: the operator gives every endpoint an admin key, and an endpoint without API keys
        stays open for serving (as its spec asked) while engine control stays closed."""
        return bool(self.keys_file or self.static_keys)

    @property
    def admin_keys(self) -> tuple[str, ...]:
        return self.static_admin_keys + self._admin_file.keys()

    def keys(self) -> tuple[str, ...]:
        return self.static_keys + self._file.keys() + self.admin_keys


class APIKeyMiddleware:
    def __init__(self, app: ASGIApp, store: KeyStore, open_paths: frozenset[str]):
        self.app = app
        self.store = store
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        presented = key_from_headers(scope["headers"])
        if not self.store.enabled:
            # No API keys: everyone may serve, as one owner; an admin key still counts as one.
            admin_keys = self.store.admin_keys
            if presented is not None and admin_keys and key_matches(presented, admin_keys):
                scope.setdefault("state", {}).update({_OWNER: None, _ADMIN: True})
            await self.app(scope, receive, send)
            return
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
        admin_keys = self.store.admin_keys
        admin = bool(admin_keys) and key_matches(presented, admin_keys)
        state = scope.setdefault("state", {})
        state[_OWNER] = None if admin else key_owner(presented)
        state[_ADMIN] = admin
        await self.app(scope, receive, send)
