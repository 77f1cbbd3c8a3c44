"""API keys: `Authorization: Bearer <key>` or `x-api-key: <key>`, compared in constant time.

Keys come from API_KEYS / API_KEY and from API_KEYS_FILE (a mounted Secret, one key per line,
`#` comments allowed); admin keys from ADMIN_API_KEYS and ADMIN_API_KEYS_FILE, the same way.
Files are re-read when they change (``llmendpoints_edge.keys.WatchedFile``), so rotating the
Secret needs no restart. Keys are never logged.

Who the caller is -- who owns the jobs it submits, whose they may see -- is left in the
request's scope (``caller``): keys here have no names, so a key is known by a short hash of it
(never the key); with no keys configured every caller is the same owner, "". An admin key is
"admin" and reaches every job.

The gateway never forwards its clients' keys (a pod runs the endpoint author's image). It
presents the endpoint's gateway token (GATEWAY_TOKEN_FILE, derived by the operator for this
endpoint alone) and names its caller in ``x-llmep-caller``; that header is believed only from a
request that carries the token, and is ignored (stripped) on every other.
"""

from __future__ import annotations

import hmac
import logging
from urllib.parse import unquote

from llmendpoints_common import gateway_token
from llmendpoints_common.errors import AuthenticationError
from llmendpoints_common.jobs.service import key_owner
from llmendpoints_edge.asgi import ASGIApp, Receive, Scope, Send, closing_if_body, send_error
from llmendpoints_edge.keys import WatchedFile, key_from_headers, parse_key_list

logger = logging.getLogger("llmendpoints.auth")

_CALLER = "llmep_caller"
_ADMIN = "llmep_admin"
CALLER_HEADER = gateway_token.CALLER_HEADER.encode()
ADMIN_OWNER = "admin"


def caller_is_admin(scope: Scope) -> bool:
    """The request came with an admin key (ADMIN_API_KEYS / ADMIN_API_KEYS_FILE); never true
    on a server without admin keys."""
    return scope.get("state", {}).get(_ADMIN) is True


def caller(scope: Scope) -> tuple[str, bool]:
    """(the caller's name, whether it is an admin), as APIKeyMiddleware found them."""
    state = scope.get("state", {})
    return state.get(_CALLER, ""), state.get(_ADMIN) is True


def key_matches(presented: str, keys: tuple[str, ...]) -> bool:
    """Compare against every key without stopping early, so timing says nothing about which."""
    presented_bytes = presented.encode()
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(presented_bytes, key.encode())
    return matched


def _key_file(
    path: str | None, setting: str, check_interval: float
) -> WatchedFile[tuple[str, ...]] | None:
    if not path:
        return None
    watched = WatchedFile(path, parse_key_list, setting, check_interval)
    if watched.load():
        logger.info("loaded %d key(s) from %s", len(watched.value or ()), setting)
    return watched


def _file_keys(watched: WatchedFile[tuple[str, ...]] | None) -> tuple[str, ...]:
    # A configured file that never could be read holds no keys: it fails closed, never open.
    return (watched.current() or ()) if watched is not None else ()


class KeyStore:
    """Every key the runtime accepts: API_KEYS (+ API_KEY, API_KEYS_FILE), the admin keys
    (ADMIN_API_KEYS, ADMIN_API_KEYS_FILE), which authenticate like the others and alone reach
    vLLM's engine-control routes (control_routes.py), and the gateway's token for this
    endpoint (GATEWAY_TOKEN_FILE)."""

    def __init__(
        self,
        static_keys: tuple[str, ...],
        keys_file: str | None,
        *,
        admin_keys: tuple[str, ...] = (),
        admin_keys_file: str | None = None,
        gateway_token_file: str | None = None,
        check_interval: float = 1.0,
    ):
        self.static_keys = static_keys
        self.static_admin_keys = admin_keys
        self.keys_file = keys_file
        self._file = _key_file(keys_file, "API_KEYS_FILE", check_interval)
        self._admin_file = _key_file(admin_keys_file, "ADMIN_API_KEYS_FILE", check_interval)
        self._gateway_file = _key_file(gateway_token_file, "GATEWAY_TOKEN_FILE", check_interval)

    @property
    def enabled(self) -> bool:
        """Requests need a key: some API key is configured. Admin keys alone do not turn this
        on: the operator gives every endpoint an admin key, and an endpoint without API keys
        stays open for serving (as its spec asked) while engine control stays closed."""
        return bool(self.keys_file or self.static_keys)

    @property
    def admin_keys(self) -> tuple[str, ...]:
        return self.static_admin_keys + _file_keys(self._admin_file)

    def gateway_tokens(self) -> tuple[str, ...]:
        return _file_keys(self._gateway_file)

    def keys(self) -> tuple[str, ...]:
        return self.static_keys + _file_keys(self._file) + self.admin_keys


def _caller_name(scope: Scope) -> str:
    """The key name the gateway sent (percent-encoded, so any name is header-safe text)."""
    for name, value in scope["headers"]:
        if name == CALLER_HEADER:
            text = unquote(value.decode("latin-1"))
            if text.isprintable() and len(text) <= 256:
                return text
    return ""


class APIKeyMiddleware:
    def __init__(self, app: ASGIApp, store: KeyStore, open_paths: frozenset[str]):
        self.app = app
        self.store = store
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        presented = key_from_headers(scope["headers"])
        gateway_tokens = self.store.gateway_tokens()
        if presented is not None and gateway_tokens and key_matches(presented, gateway_tokens):
            # The gateway, on behalf of the caller it names; never an admin.
            self._identify(scope, _caller_name(scope), admin=False)
            await self.app(scope, receive, send)
            return
        # Only the gateway may say who the caller is.
        scope["headers"] = [h for h in scope["headers"] if h[0] != CALLER_HEADER]
        if scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        admin_keys = self.store.admin_keys
        admin = presented is not None and bool(admin_keys) and key_matches(presented, admin_keys)
        if admin:
            self._identify(scope, ADMIN_OWNER, admin=True)
        elif not self.store.enabled:
            pass  # no API keys: everyone may serve, as one owner ""
        elif presented is None or not key_matches(presented, self.store.keys()):
            # Answered from the headers alone: not one byte of the body is read, and when one
            # is on its way the connection is closed rather than left to receive (and discard)
            # it -- whatever Content-Length says, a keyless caller costs only its headers.
            reason = "missing API key" if presented is None else "invalid API key"
            await send_error(
                closing_if_body(scope, send),
                AuthenticationError(
                    f"{reason}: send `Authorization: Bearer <key>` or `x-api-key: <key>`",
                    headers={"www-authenticate": "Bearer"},
                ),
            )
            return
        else:
            # Only the key's hash is kept: the key itself never leaves this frame.
            self._identify(scope, key_owner(presented), admin=False)
        await self.app(scope, receive, send)

    @staticmethod
    def _identify(scope: Scope, name: str, *, admin: bool) -> None:
        scope.setdefault("state", {}).update({_CALLER: name, _ADMIN: admin})
