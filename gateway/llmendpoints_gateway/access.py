"""Who is asking, and may they use this endpoint: the caller's key from the request's headers
(before any of its body is read), and the 401 / 403 answers.

A key (``keys.Key``) has a name -- the tenant, what logs, metrics, usage records and jobs carry,
never the secret -- the endpoints it may use, ``admin`` and its limits. An endpoint needs a key
when the gateway has keys of its own or the endpoint has some (``KeyRing.requires_key``).
"""

from __future__ import annotations

from llmendpoints_common.errors import APIError, AuthenticationError, PermissionDeniedError
from llmendpoints_edge.asgi import Scope
from llmendpoints_edge.keys import key_from_headers

from llmendpoints_gateway.keys import Key, KeyRing
from llmendpoints_gateway.registry import Endpoint
from llmendpoints_gateway.request import RequestLog

# The key name of requests without a key (an endpoint open to all).
ANONYMOUS = ""


class Access:
    def __init__(self, keys: KeyRing):
        self.keys = keys

    def identify(self, scope: Scope, state: RequestLog) -> Key | None:
        """The caller's key, or None. An unknown key is as good as none: it is refused (401)
        only where a key is needed, so open endpoints stay open to clients that always send
        one (the openai SDK insists on an api_key)."""
        secret = key_from_headers(scope["headers"])
        if secret is None:
            return None
        key = self.keys.identify(secret)
        if key is None:
            state.invalid_key = True
            return None
        state.key_name = key.name
        return key

    def check(self, key: Key | None, ep: Endpoint, state: RequestLog) -> None:
        """401 without a (valid) key where one is needed; 403 for a key off this endpoint."""
        if self.keys.allows(key, ep.name):
            return
        if key is None:
            raise self.missing_key(state)
        raise PermissionDeniedError(
            f"API key {key.name!r} may not use endpoint {ep.name!r}", code="endpoint_not_allowed"
        )

    def missing_key(self, state: RequestLog) -> APIError:
        reason = "invalid API key" if state.invalid_key else "missing API key"
        return AuthenticationError(
            f"{reason}: send `Authorization: Bearer <key>` or `x-api-key: <key>`",
            headers={"www-authenticate": "Bearer"},
        )

    def visible(self, key: Key | None, endpoints: list[Endpoint]) -> list[Endpoint]:
        return [ep for ep in endpoints if self.keys.allows(key, ep.name)]

    @staticmethod
    def caller(key: Key | None) -> tuple[str, bool]:
        """(the caller's name, admin): who owns what it submits, and whether it sees all."""
        if key is None:
            return ANONYMOUS, False
        return key.name, key.admin
